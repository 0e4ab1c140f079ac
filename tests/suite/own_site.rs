//! A user's first hour on their own site: a pass that fails on a bad selector says so (grouped
//! failures, exit 1, the top reason in `status` and on the status page), and a bot's request
//! headers reach the site while a secret one is printed by no command and no endpoint.

use crate::kit;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use kit::shop::Shop;
use kit::*;

async fn seedlock(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_seedlock"));
    cmd.arg("-c")
        .arg(config)
        .args(args)
        .env_remove("MONGODB_URI")
        .env_remove("SEEDLOCK_DATABASE")
        .env("SEEDLOCK_LOG", "trace");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().await.expect("run seedlock")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The shop's bot (seeds `BASE/seeds.txt`, the shop's rules with `natural_key`), with `extra`
/// lines in `[bots.crawl]`.
fn shop_bot(base: &str, natural_key: &str, extra: &str) -> String {
    let rules =
        seedlock::demo_site::crawl_rules_toml(&[base.trim_start_matches("http://")], natural_key)
            .replacen("[bots.crawl]\n", &format!("[bots.crawl]\n{extra}\n"), 1);
    format!(
        "[[bots]]\nid = \"shop\"\nseeds = {{ url = \"{base}/seeds.txt\", format = \"lines\" }}\nrefresh = \"1h\"\n{rules}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_fails_on_a_bad_selector_exits_1_naming_the_reason() {
    let db = test_db("own_fail").await;
    let shop = Shop::start(2, 5).await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ProcConfig::new(&db, shop_bot(&shop.base, ".skuu", ""));
    cfg.extra = "[crawl]\nbackoff_base = \"20ms\"\nbackoff_max = \"100ms\"";
    let config = cfg.write(dir.path());
    let mut run = Proc::spawn(dir.path(), &config, "i1", &["run", "--once"], &[]);
    let status = run.wait(Duration::from_secs(60)).await;
    run.assert_clean();
    assert_eq!(status.code(), Some(1), "{}\n{}", run.out(), run.log());
    let out = run.out();
    // 10 product pages failed, 2 listing pages done: 10 of 12 pages.
    let grouped = out
        .lines()
        .find(|l| l.starts_with("  failed: 10 × no natural key (.skuu) on the page — e.g. "))
        .unwrap_or_else(|| panic!("the failures grouped by reason:\n{out}"));
    let example = grouped.rsplit("e.g. ").next().unwrap();
    assert!(
        example.starts_with(&format!("{}/product/", shop.base)),
        "{grouped}"
    );
    let last = run.log().lines().last().unwrap_or_default().to_owned();
    assert_eq!(
        last,
        format!("seedlock: bot shop: pass 1 failed 10 of 12 pages (83.3%, over crawl.max_error_rate 5.0%); most common: no natural key (.skuu) on the page (10 pages, e.g. {example})")
    );
    // `status` shows the pass's top failure reason, in the table and as JSON.
    let out = seedlock(&config, &["status"], &[]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        // (the cell is cut at 80 characters)
        table.contains(&format!(
            "10× no natural key (.skuu) on the page (e.g. {}",
            shop.base
        )),
        "{table}"
    );
    let out = seedlock(&config, &["status", "--json"], &[]).await;
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rows[0]["crawl"]["top_failure"],
        serde_json::json!({"reason": "no natural key (.skuu) on the page", "count": 10, "example": example})
    );

    // The selector fixed: the next pass stores every record, and the run exits 0.
    let fixed = ProcConfig {
        bots: shop_bot(&shop.base, ".sku", ""),
        ..cfg
    }
    .write(dir.path());
    let out = seedlock(&fixed, &["refresh", "shop"], &[]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut run = Proc::spawn(dir.path(), &fixed, "i2", &["run", "--once"], &[]);
    run.expect_ok(Duration::from_secs(60)).await;
    assert!(!run.out().contains("failed:"), "{}", run.out());
}

/// Every string a person or a scraper could read from seedlock about the bot.
async fn everything_shown(config: &Path, db: &TestDb, url: &str, env: &[(&str, &str)]) -> String {
    let mut all = String::new();
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["inspect", "shop"],
        &["export", "shop"],
        &["bots", "list", "--json"],
        &["try", "shop", url],
        &["try", "shop", url, "--json"],
    ] {
        let out = seedlock(config, args, env).await;
        assert!(
            out.status.success(),
            "{args:?}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        all.push_str(&text(&out.stdout));
        all.push_str(&text(&out.stderr));
    }
    // What the database holds, every collection.
    for name in db.db.list_collection_names().await.unwrap() {
        let docs: Vec<bson::Document> = futures_util::TryStreamExt::try_collect(
            db.db
                .collection::<bson::Document>(&name)
                .find(bson::doc! {})
                .await
                .unwrap(),
        )
        .await
        .unwrap();
        for d in docs {
            all.push_str(&d.to_string());
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_headers_reach_the_site_and_a_secret_one_is_printed_nowhere() {
    let db = test_db("own_headers").await;
    let shop = Shop::start(1, 4).await;
    let dir = tempfile::tempdir().unwrap();
    let secret = format!("tok-{:016x}", rand::random::<u64>());
    // A cookie and a proxy's password from the environment are secrets too; the proxy (a relay
    // to the shop) carries every request.
    let cookie = format!("cookie-{:016x}", rand::random::<u64>());
    let password = format!("pw{:016x}", rand::random::<u64>());
    let relay =
        crate::kit::delay::Delay::start(shop.base.trim_start_matches("http://"), Duration::ZERO);
    let proxy = format!("http://user:{password}@{}", relay.addr);
    let env = [
        ("SHOP_TOKEN", secret.as_str()),
        ("SHOP_COOKIE", cookie.as_str()),
        ("SHOP_PROXY", proxy.as_str()),
    ];
    let headers = "headers = { \"Accept-Language\" = \"de-CH\", X-Shop-Token = { env = \"SHOP_TOKEN\" } }\ncookies = { session = { env = \"SHOP_COOKIE\" } }\nproxy = { env = \"SHOP_PROXY\" }";
    let bot = shop_bot(&shop.base, ".sku", headers);
    let config = ProcConfig::new(&db, bot.clone()).write(dir.path());
    // A crawl logging everything (trace), then a daemon serving its status page and metrics.
    let mut run = Proc::spawn(
        dir.path(),
        &config,
        "i1",
        &["run", "--once"],
        &[env[0], env[1], env[2], ("SEEDLOCK_LOG", "trace")],
    );
    run.expect_ok(Duration::from_secs(60)).await;
    let received: serde_json::Value = reqwest::get(format!("{}/__headers", shop.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(received["x-shop-token"], serde_json::json!([secret]));
    assert_eq!(received["accept-language"], serde_json::json!(["de-CH"]));
    assert_eq!(
        received["cookie"],
        serde_json::json!([format!("session={cookie}")])
    );
    let mut shown = run.out() + &run.log();
    let mut daemon = Proc::spawn(
        dir.path(),
        &config,
        "i2",
        &["run"],
        &[
            env[0],
            env[1],
            env[2],
            ("SEEDLOCK_LOG", "trace"),
            ("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0"),
        ],
    );
    let addr = daemon.http_addr().await;
    for path in ["/", "/status.json", "/metrics", "/healthz"] {
        let body = reqwest::get(format!("http://{addr}{path}"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        shown.push_str(&body);
    }
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    daemon.expect_ok(Duration::from_secs(30)).await;
    shown.push_str(&daemon.log());
    let page = format!("{}/list/1", shop.base);
    shown.push_str(&everything_shown(&config, &db, &page, &env).await);
    assert!(
        shown.contains("x-shop-token: <from $SHOP_TOKEN>")
            && shown.contains("cookie session: <from $SHOP_COOKIE>")
            && shown.contains("proxy: <from $SHOP_PROXY>"),
        "try names the header, the cookie and the proxy"
    );
    // The same bot kept in the database, tried from an instance whose config has no [[bots]].
    let file = dir.path().join("bots.toml");
    std::fs::write(&file, &bot).unwrap();
    let no_bots = ProcConfig::new(&db, String::new()).write(dir.path());
    for args in [
        &["bots", "apply", file.to_str().unwrap(), "--dry-run"][..],
        &["bots", "apply", file.to_str().unwrap()],
    ] {
        let out = seedlock(&no_bots, args, &env).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        shown.push_str(&text(&out.stdout));
        shown.push_str(&text(&out.stderr));
    }
    shown.push_str(&everything_shown(&no_bots, &db, &page, &env).await);
    for value in [&secret, &cookie, &password] {
        let at = shown.find(value.as_str());
        assert!(
            at.is_none(),
            "a secret was printed or stored: …{}…",
            at.map_or("", |i| &shown
                [i.saturating_sub(300)..(i + 60).min(shown.len())])
        );
    }
    // A missing variable stops start-up naming the key, and says nothing of any value.
    let out = seedlock(&config, &["run", "--once"], &[]).await;
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("key `bots[0].crawl.headers.X-Shop-Token`: the environment variable SHOP_TOKEN is not set"),
        "{err}"
    );
    let bad = format!("{secret}\nbroken");
    let out = seedlock(&config, &["run", "--once"], &[("SHOP_TOKEN", &bad)]).await;
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("the value of $SHOP_TOKEN is not a valid header value")
            && !err.contains(&secret),
        "{err}"
    );
}
