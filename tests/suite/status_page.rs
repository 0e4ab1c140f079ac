//! The operator's window over HTTP: the status page at `/` of a running instance (content, the
//! escaping of everything that comes from outside, the self-refresh) and `/status.json` (the
//! same rows as `seedlock status --json`), with the pass size estimated while a first pass still
//! discovers its pages and from the last completed pass afterwards.

use crate::kit;

use std::time::Duration;

use kit::crawl::*;
use kit::*;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// A seed source whose answer is hostile markup: its error text carries `<script>`.
async fn hostile_sitemap() -> String {
    let app = axum::Router::new().route(
        "/sitemap.xml",
        axum::routing::get(|| async { "<script>alert(\"pwned\")</script>" }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/sitemap.xml")
}

async fn get(url: &str) -> (u16, String, String) {
    let resp = reqwest::get(url).await.unwrap();
    let status = resp.status().as_u16();
    let kind = resp.headers()["content-type"].to_str().unwrap().to_owned();
    (status, kind, resp.text().await.unwrap())
}

async fn status_json(addr: &str) -> Value {
    let (code, kind, body) = get(&format!("http://{addr}/status.json")).await;
    assert_eq!((code, kind.as_str()), (200, "application/json"), "{body}");
    serde_json::from_str(&body).unwrap()
}

fn row<'a>(rows: &'a Value, bot: &str) -> &'a Value {
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["bot"] == bot)
        .unwrap_or_else(|| panic!("no row for {bot}: {rows:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_fleet_escapes_outside_text_and_matches_status_json() {
    let db = test_db("statuspage").await;
    let dir = tempfile::tempdir().unwrap();
    let base = shop(12, 25).await;
    // Slow product pages: the first pass is still running when the page is read.
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "latency_ms": 150}]),
    )
    .await;
    let evil = hostile_sitemap().await;
    let bots = format!(
        "{}\n[[bots]]\nid = \"evil\"\nseeds = {{ url = \"{evil}\", format = \"sitemap\" }}\n",
        crawl_bot_toml(&base)
    );
    let mut config = ProcConfig::new(&db, bots);
    config.backoff = ("30s", "60s");
    config.extra = "[crawl]\nworkers = 2\n";
    let config = config.write(dir.path());
    let mut a = Proc::spawn(
        dir.path(),
        &config,
        "page-1",
        &["run", "--ignore-robots"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    );
    let addr = a.http_addr().await;

    // While the first pass runs, its total is still being discovered: no expected size, and an
    // ETA that is only a lower bound.
    eventually(
        "the first pass is under way",
        Duration::from_secs(20),
        || async {
            let rows = status_json(&addr).await;
            let c = &row(&rows, "shop")["crawl"];
            c.is_object() && c["done"].as_u64().unwrap_or(0) > 0 && c["finished"] == false
        },
    )
    .await;
    let rows = status_json(&addr).await;
    let first = &row(&rows, "shop")["crawl"];
    assert_eq!(first["expected_pages"], Value::Null, "{first:#}");
    assert_eq!(first["eta_lower_bound"], true, "{first:#}");
    let (code, kind, page) = get(&format!("http://{addr}/")).await;
    assert_eq!((code, kind.as_str()), (200, "text/html; charset=utf-8"));
    assert!(page.contains("pages so far)"), "{page}");

    post(&format!("{base}/__faults"), json!([])).await;
    // Done and evaluated: the views below are compared with each other, read moments apart.
    eventually("the pass is done", Duration::from_secs(60), || async {
        let rows = status_json(&addr).await;
        let shop = row(&rows, "shop");
        shop["crawl"]["finished"] == true
            && shop["last_evaluation"]
                .as_str()
                .is_some_and(|e| !e.ends_with("evaluating"))
    })
    .await;
    eventually(
        "evil failed its refresh",
        Duration::from_secs(20),
        || async { row(&status_json(&addr).await, "evil")["last_error"].is_string() },
    )
    .await;

    let (code, kind, page) = get(&format!("http://{addr}/")).await;
    assert_eq!((code, kind.as_str()), (200, "text/html; charset=utf-8"));
    // It reloads itself without script, and carries no script at all: the source's markup is text.
    assert!(page.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
    assert!(!page.to_lowercase().contains("<script"), "{page}");
    assert!(
        page.contains(
            "root element &lt;script&gt; is neither &lt;urlset&gt; nor &lt;sitemapindex&gt;"
        ),
        "{page}"
    );
    // Every bot with its state, this instance and the shop's finished pass.
    assert!(page.contains("served by <b>page-1</b>"), "{page}");
    assert!(page.contains("<b>shop</b></td><td><span class=\"state state-ready\">ready</span>"));
    assert!(page.contains("<b>evil</b></td><td><span class=\"state state-error\">error</span>"));
    let truth = truth(&base).await.len() as u64;
    let rows = status_json(&addr).await;
    let shop_pass = &row(&rows, "shop")["crawl"];
    let pages = shop_pass["done"].as_u64().unwrap();
    assert!(pages > truth, "listing pages and products: {shop_pass:#}");
    assert!(page.contains(&format!(
        "{pages} done · 0 pending · 0 leased · 0 failed of ~{pages}"
    )));
    assert!(page.contains("ETA done"));
    // Two bots fit one page: any `?page=` shows it, a malformed one included.
    for query in ["?page=2", "?page=x"] {
        let (code, _, paged) = get(&format!("http://{addr}/{query}")).await;
        assert_eq!(code, 200, "{query}");
        assert!(paged.contains("<b>shop</b></td>") && paged.contains("<b>evil</b></td>"));
        assert!(!paged.contains("class=\"pages\""), "{paged}");
    }
    // After a completed pass the size comes from it (crawlLastPass.pages).
    assert_eq!(shop_pass["expected_pages"], pages, "{shop_pass:#}");

    // /status.json is what `seedlock status --json` prints.
    let mut cli = Proc::spawn(dir.path(), &config, "status", &["status", "--json"], &[]);
    cli.expect_ok(Duration::from_secs(20)).await;
    let printed: Value = serde_json::from_str(&cli.out()).unwrap();
    let served = status_json(&addr).await;
    assert_eq!(row(&printed, "shop"), row(&served, "shop"));
    assert_eq!(
        row(&printed, "evil")["last_error"],
        row(&served, "evil")["last_error"]
    );

    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_says_when_the_database_cannot_be_read() {
    let db = test_db("statusdown").await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = blackhole::Blackhole::start(&blackhole::server_of(&db.uri)).await;
    let mut config = ProcConfig::new(&db, url_bot("b", "http://127.0.0.1:9/seeds.txt"));
    let uri = proxy.uri(&db.uri);
    config.uri = &uri;
    let config = config.write(dir.path());
    let mut a = Proc::spawn(
        dir.path(),
        &config,
        "down-1",
        &["run"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    );
    let addr = a.http_addr().await;
    proxy.cut();
    let (code, kind, page) = get(&format!("http://{addr}/")).await;
    assert_eq!((code, kind.as_str()), (503, "text/html; charset=utf-8"));
    assert!(page.contains("The database could not be read"), "{page}");
    assert!(page.contains("served by <b>down-1</b>"));
    proxy.heal();
    a.signal(Signal::SIGTERM);
    let _ = a.wait(Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_creates_the_indexes_the_mongosh_recipes_use_and_host_rows_expire() {
    let db = test_db("recipeidx").await;
    let dir = tempfile::tempdir().unwrap();
    let base = shop(1, 5).await;
    let config = ProcConfig::new(&db, crawl_bot_toml(&base)).write(dir.path());
    let mut a = Proc::spawn(
        dir.path(),
        &config,
        "idx-1",
        &["run", "--once", "--ignore-robots"],
        &[],
    );
    a.expect_ok(Duration::from_secs(60)).await;

    // The indexes the README's mongosh recipes run on (scripts/check-recipes explains each one),
    // created by the daemon; host rows expire an hour after their last refresh.
    let indexes = |collection: &'static str| {
        let db = &db;
        async move {
            let mut cursor = db
                .db
                .collection::<bson::Document>(collection)
                .list_indexes()
                .await
                .unwrap();
            let mut all = Vec::new();
            while let Some(index) = futures_util::TryStreamExt::try_next(&mut cursor)
                .await
                .unwrap()
            {
                all.push(index);
            }
            all
        }
    };
    let names = |all: &[mongodb::IndexModel]| -> Vec<String> {
        all.iter()
            .filter_map(|i| i.options.as_ref().and_then(|o| o.name.clone()))
            .collect()
    };
    assert!(names(&indexes("bots").await).contains(&"editing_ready".to_owned()));
    let records = names(&indexes("records").await);
    for name in ["bot_natural_key", "bot_last_changed", "bot_removed_at"] {
        assert!(records.contains(&name.to_owned()), "{records:?}");
    }
    for retired in seedlock::store::records::RETIRED_RECORD_INDEXES {
        assert!(!records.contains(&retired.to_owned()), "{records:?}");
    }
    let hosts = indexes("hosts").await;
    let ttl = hosts
        .iter()
        .find(|i| i.keys == bson::doc! { "updatedAt": 1 })
        .unwrap_or_else(|| panic!("no updatedAt index on hosts: {hosts:?}"));
    assert_eq!(
        ttl.options.as_ref().and_then(|o| o.expire_after),
        Some(Duration::from_secs(3600))
    );
}
