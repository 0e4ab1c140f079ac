//! `seedlock try BOT URL`: one page fetched and read as the crawl would, on the demo shop's
//! listing and product pages (the report checked against the shop's own truth), on a page where
//! a selector matches nothing, on a saved file (exact output), and on hostile pages (bounded as
//! the crawl is).

use crate::kit;

use std::path::{Path, PathBuf};
use std::process::Output;

use kit::shop::Shop;
use serde_json::Value;

/// A config file with the shop's bot: seeds `BASE/list/1`, the shop's own rules with
/// `natural_key`, and `extra` lines in `[bots.crawl]` and `[crawl]`.
fn config(
    dir: &Path,
    base: &str,
    natural_key: &str,
    bot_extra: &str,
    crawl_extra: &str,
) -> PathBuf {
    let rules =
        seedlock::demo_site::crawl_rules_toml(&[base.trim_start_matches("http://")], natural_key)
            .replacen("[bots.crawl]\n", &format!("[bots.crawl]\n{bot_extra}\n"), 1);
    let text = format!(
        "[mongo]\nuri = \"mongodb://127.0.0.1:1\"\nconnect_timeout = \"1s\"\n[http]\nlisten = \"off\"\n[crawl]\n{crawl_extra}\n[[bots]]\nid = \"shop\"\nseeds = [\"{base}/list/1\"]\n{rules}"
    );
    let path = dir.join(format!("try-{}.toml", rand::random::<u32>()));
    std::fs::write(&path, text).unwrap();
    path
}

async fn seedlock(config: &Path, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_seedlock"))
        .arg("-c")
        .arg(config)
        .args(args)
        .env_remove("MONGODB_URI")
        .output()
        .await
        .expect("run seedlock")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The shop's products in listing order (newest first), as `/__truth` lists them.
async fn products(base: &str) -> Vec<Value> {
    let truth: Value = reqwest::get(format!("{base}/__truth"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    truth["products"].as_array().unwrap().clone()
}

fn fingerprint(p: &Value) -> String {
    let joined = [&p["price"], &p["status"], &p["title"]]
        .map(|v| v.as_str().unwrap().to_owned())
        .join("\u{1f}");
    format!(
        "{:016x}",
        seedlock::store::frontier::fingerprint_hash(&joined)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_page_shows_its_items_fingerprints_and_links_as_the_crawl_reads_them() {
    let shop = Shop::start(3, 4).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), base, ".sku", "", "");
    let out = seedlock(&cfg, &["try", "shop", &format!("{base}/list/2"), "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kind"], "listing", "not a seed, not a detail page");
    assert_eq!(report["fetch_error"], Value::Null);
    let page: Vec<Value> = products(base).await[4..8].to_vec();
    let items = report["items"].as_array().unwrap();
    assert_eq!(items.len(), 4);
    for (item, p) in items.iter().zip(&page) {
        let sku = p["sku"].as_str().unwrap();
        assert_eq!(item["id"], sku);
        assert_eq!(item["link"], format!("{base}/product/{sku}"));
        assert_eq!(
            item["fingerprint_fields"],
            serde_json::json!([
                {"spec": ".price", "value": p["price"]},
                {"spec": ".status", "value": p["status"]},
                {"spec": ".title", "value": p["title"]},
            ])
        );
        assert_eq!(item["fingerprint"], fingerprint(p));
        // The shop writes an HTTP date; the report shows it as read and as understood.
        let raw = item["updated_at"].as_str().unwrap();
        let parsed = seedlock::extract::parse_time(raw).unwrap();
        assert_eq!(item["updated_at_parsed"], parsed.to_rfc3339());
    }
    let mut follows: Vec<String> = page
        .iter()
        .map(|p| format!("{base}/product/{}", p["sku"].as_str().unwrap()))
        .collect();
    follows.extend([format!("{base}/list/1"), format!("{base}/list/3")]);
    assert_eq!(report["follows"], serde_json::json!(follows));
    assert_eq!(report["refused"], serde_json::json!([]));
    assert_eq!(report["unmatched"], serde_json::json!([]));
    assert_eq!(report["ok"], true);

    // The same page for a person: the items and the verdict, one line each.
    let out = seedlock(&cfg, &["try", "shop", &format!("{base}/list/2")]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    let first = &page[0];
    let sku = first["sku"].as_str().unwrap();
    for line in [
        "kind: listing".to_owned(),
        "items: 4".to_owned(),
        format!("  {sku} -> {base}/product/{sku}"),
        format!(
            "    fingerprint {}: .price={:?} .status={:?} .title={:?}",
            fingerprint(first),
            first["price"].as_str().unwrap(),
            first["status"].as_str().unwrap(),
            first["title"].as_str().unwrap()
        ),
        "follows: 6".to_owned(),
        "not followed: 0".to_owned(),
        "result: ok: 4 items (4 with a detail link), 6 links to follow".to_owned(),
    ] {
        assert!(
            shown.lines().any(|l| l == line),
            "no line {line:?} in:\n{shown}"
        );
    }
    // The bot's seed is a seed page.
    let out = seedlock(&cfg, &["try", "shop", &format!("{base}/list/1"), "--json"]).await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kind"], "seed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_product_page_shows_the_record_it_stores_exactly() {
    let shop = Shop::start(1, 3).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), base, ".sku", "", "");
    let p = products(base).await[1].clone();
    let sku = p["sku"].as_str().unwrap();
    let url = format!("{base}/product/{sku}");
    let body = reqwest::get(&url).await.unwrap().text().await.unwrap();
    let field = |k: &str| p[k].as_str().unwrap().to_owned();
    let data =
        bson::doc! { "price": field("price"), "status": field("status"), "title": field("title") };
    let out = seedlock(&cfg, &["try", "shop", &url]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "bot: shop\nurl: {url}\npage: fetched ({} bytes)\nkind: detail\nrecord: {sku} (id {}, content hash {})\n  price = {:?}\n  status = {:?}\n  title = {:?}\nfollows: 1\n  {base}/list/1\nnot followed: 0\nresult: ok: a record: {sku}\n",
            body.len(),
            seedlock::store::records::record_id("shop", sku),
            seedlock::store::records::content_hash(&data),
            field("price"),
            field("status"),
            field("title"),
        )
    );
    let out = seedlock(&cfg, &["try", "shop", &url, "--json"]).await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["record"]["natural_key"], sku);
    assert_eq!(
        report["record"]["fields"],
        serde_json::json!({"price": p["price"], "status": p["status"], "title": p["title"]})
    );
    assert_eq!(report["ok"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selector_that_matches_nothing_is_named_and_the_page_fails_with_exit_1() {
    let shop = Shop::start(2, 3).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let sku = products(base).await[0]["sku"].as_str().unwrap().to_owned();
    let url = format!("{base}/product/{sku}");
    // The natural key misspelt: no record, exit 1, the key named.
    let cfg = config(dir.path(), base, ".skuu", "", "");
    let out = seedlock(&cfg, &["try", "shop", &url]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let shown = text(&out.stdout);
    assert!(
        shown.contains("nothing matched: crawl.record.natural_key (.skuu): matched nothing on the page: no record\n"),
        "{shown}"
    );
    assert!(
        shown.ends_with("result: FAILED: no record: no natural key (.skuu) on the page\n"),
        "{shown}"
    );
    assert_eq!(
        text(&out.stderr),
        format!("seedlock: {url}: no record: no natural key (.skuu) on the page\n")
    );
    // A listing page whose item selector matches nothing: its kind lacks what it needs.
    let cfg = config(dir.path(), base, ".sku", "", "");
    let broken = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("item = \".item\"", "item = \".itme\"");
    std::fs::write(&cfg, broken).unwrap();
    let out = seedlock(&cfg, &["try", "shop", &format!("{base}/list/2")]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout)
            .contains("nothing matched: crawl.list.item (.itme): matched no element on the page\n"),
        "{}",
        text(&out.stdout)
    );
    // A field that matches nothing is named, but the record is still a record (stored null).
    let cfg = config(dir.path(), base, ".sku", "", "");
    let typo = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("price = \".price\"", "price = \".prize\"");
    std::fs::write(&cfg, typo).unwrap();
    let out = seedlock(&cfg, &["try", "shop", &url]).await;
    assert!(out.status.success());
    let shown = text(&out.stdout);
    assert!(shown.contains("  price = null\n"), "{shown}");
    assert!(
        shown.contains("nothing matched: crawl.record.fields.price (.prize): matched nothing on the page (stored as null)\n"),
        "{shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_page_is_read_without_a_request_and_every_refused_link_says_why() {
    let dir = tempfile::tempdir().unwrap();
    // No shop runs: port 1 answers nothing, so any request would fail the try.
    let base = "http://127.0.0.1:1";
    let cfg = config(dir.path(), base, ".sku", "deny = [\"/logout\"]", "");
    let page = dir.path().join("list.html");
    std::fs::write(
        &page,
        r#"<html><body>
<div class="item" data-id="A-1" data-updated="2026-12-01T10:00:00Z"><a href="/product/A-1"><span class="title">Lamp</span></a> <span class="price">$5</span></div>
<div class="item" data-id="A-2" data-updated="yesterday"><span class="title">Mug</span> <span class="price">$2</span> <span class="status">sold out</span></div>
<div class="item"><a href="/product/X">no id</a></div>
<a href="/product/A-1">again</a>
<a href="http://elsewhere.test/x">away</a>
<a href="/logout">log out</a>
<a href="http://[::1">broken</a>
</body></html>"#,
    )
    .unwrap();
    let url = format!("{base}/list/7");
    let out = seedlock(
        &cfg,
        &[
            "try",
            "shop",
            "--file",
            page.to_str().unwrap(),
            "--url",
            &url,
        ],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let fp1 = format!(
        "{:016x}",
        seedlock::store::frontier::fingerprint_hash("$5\u{1f}\u{1f}Lamp")
    );
    let fp2 = format!(
        "{:016x}",
        seedlock::store::frontier::fingerprint_hash("$2\u{1f}sold out\u{1f}Mug")
    );
    let why = seedlock::urls::NormalizedUrl::join_with(
        &url::Url::parse(&url).unwrap(),
        "http://[::1",
        &seedlock::urls::StripQuery::parse(&[]).unwrap(),
    )
    .unwrap_err();
    let shown = text(&out.stdout);
    assert_eq!(
        shown,
        format!(
            r#"bot: shop
url: {base}/list/7
page: {path} ({bytes} bytes)
kind: listing
items: 2
  A-1 -> {base}/product/A-1
    fingerprint {fp1}: .price="$5" .status="" .title="Lamp"
    updated_at "2026-12-01T10:00:00Z" = 2026-12-01T10:00:00+00:00
  A-2 -> (no detail link)
    fingerprint {fp2}: .price="$2" .status="sold out" .title="Mug"
    updated_at "yesterday" = not a time
follows: 2
  {base}/product/A-1
  {base}/product/X
not followed: 4
  {base}/product/A-1: duplicate
  http://elsewhere.test/x: out of scope: elsewhere.test:80
  {base}/logout: denied by "/logout"
  http://[::1: not a followable URL ({why})
nothing matched: crawl.list.item_id (@data-id): matched nothing in 1 of 3 items
nothing matched: crawl.list.item_link (a@href): matched nothing in 1 of 3 items
nothing matched: crawl.list.fingerprint[0] (.price): matched nothing in 1 of 3 items
nothing matched: crawl.list.fingerprint[1] (.status): matched nothing in 2 of 3 items
nothing matched: crawl.list.fingerprint[2] (.title): matched nothing in 1 of 3 items
nothing matched: crawl.list.updated_at (@data-updated): matched nothing in 1 of 3 items
nothing matched: crawl.list.updated_at (@data-updated): 1 of 3 values are not an RFC 3339 or HTTP date
result: ok: 2 items (1 with a detail link), 2 links to follow
"#,
            path = page.display(),
            bytes = std::fs::metadata(&page).unwrap().len(),
            fp1 = fp1,
            fp2 = fp2,
            why = why,
        )
    );
    // --file without the URL it came from is bad usage.
    let out = seedlock(&cfg, &["try", "shop", "--file", page.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "seedlock: --file needs the URL the page was saved from (--url URL)\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_page_is_bounded_as_the_crawl_bounds_it() {
    let shop = Shop::start(1, 3).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        base,
        ".sku",
        "max_links = 100",
        "max_page_bytes = 2000000",
    );
    // 50,000 links, 20,000 of them out of scope: 100 followed, the refused ones listed up to a
    // bound, the rest counted.
    let mut html = String::from("<html><body>");
    for i in 0..20_000 {
        html.push_str(&format!("<a href=\"http://away.test/{i}\">x</a>"));
    }
    for i in 0..30_000 {
        html.push_str(&format!("<a href=\"/p/{i}\">x</a>"));
    }
    let page = dir.path().join("hostile.html");
    std::fs::write(&page, &html).unwrap();
    let url = format!("{base}/list/1");
    let out = seedlock(
        &cfg,
        &[
            "try",
            "shop",
            "--file",
            page.to_str().unwrap(),
            "--url",
            &url,
            "--json",
        ],
    )
    .await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["follows"].as_array().unwrap().len(), 100);
    assert_eq!(report["over_max_links"], 29_900);
    assert_eq!(
        report["refused"].as_array().unwrap().len(),
        seedlock::crawl::probe::MAX_REFUSED_SHOWN
    );
    assert_eq!(
        report["refused_more"].as_u64().unwrap() as usize,
        20_000 - seedlock::crawl::probe::MAX_REFUSED_SHOWN
    );
    // A saved page over crawl.max_page_bytes is refused as the crawl refuses a body that big.
    std::fs::write(&page, "x".repeat(2_000_001)).unwrap();
    let out = seedlock(
        &cfg,
        &[
            "try",
            "shop",
            "--file",
            page.to_str().unwrap(),
            "--url",
            &url,
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("over crawl.max_page_bytes (2000000)"),
        "{}",
        text(&out.stderr)
    );
    // A fetched body over the cap: no page, exit 1.
    shop.post(
        "/__faults",
        serde_json::json!([{ "path": "/list/1", "huge_body_bytes": 3_000_000 }]),
    )
    .await;
    let out = seedlock(&cfg, &["try", "shop", &url]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("result: FAILED: no page: "),
        "{}",
        text(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_out_of_scope_is_not_followed() {
    let shop = Shop::start(1, 3).await;
    let other = Shop::start(1, 3).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), base, ".sku", "", "");
    shop.post(
        "/__faults",
        serde_json::json!([{ "path": "/list/1", "redirect_to": format!("{}/list/1", other.base) }]),
    )
    .await;
    other.stats().await;
    let url = format!("{base}/list/1");
    let out = seedlock(&cfg, &["try", "shop", &url]).await;
    assert_eq!(out.status.code(), Some(1));
    let host = other.base.trim_start_matches("http://");
    assert_eq!(
        text(&out.stdout),
        format!("bot: shop\nurl: {url}\npage: none\nredirect: 302 {url} -> {}/list/1\nresult: FAILED: no page: redirect out of scope: {host}\n", other.base)
    );
    assert!(
        other.stats().await.is_empty(),
        "the other host got no request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_api_page_shows_its_items_and_record_read_with_jsonpath() {
    let shop = Shop::start(3, 4).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let rules = seedlock::demo_site::api_rules_toml(&[base.trim_start_matches("http://")]);
    let cfg = dir.path().join("api.toml");
    std::fs::write(
        &cfg,
        format!(
            "[mongo]\nuri = \"mongodb://127.0.0.1:1\"\nconnect_timeout = \"1s\"\n[http]\nlisten = \"off\"\n[[bots]]\nid = \"api\"\nseeds = [\"{base}/api/products?page=1\"]\n{rules}"
        ),
    )
    .unwrap();
    let page = format!("{base}/api/products?page=2");
    let out = seedlock(&cfg, &["try", "api", &page, "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kind"], "listing");
    let expected: Vec<Value> = products(base).await[4..8].to_vec();
    let items = report["items"].as_array().unwrap();
    assert_eq!(items.len(), 4);
    for (item, p) in items.iter().zip(&expected) {
        let sku = p["sku"].as_str().unwrap();
        assert_eq!(item["id"], sku);
        assert_eq!(item["link"], format!("{base}/api/product/{sku}"));
        let amount: f64 = p["price"].as_str().unwrap()[1..].parse().unwrap();
        assert_eq!(
            item["fingerprint_fields"][0],
            serde_json::json!({"spec": "$.price.amount", "value": amount.to_string()})
        );
    }
    assert_eq!(
        report["follows"],
        serde_json::json!([format!("{base}/api/products?page=3")])
    );
    let sku = expected[0]["sku"].as_str().unwrap();
    let detail = format!("{base}/api/product/{sku}");
    let out = seedlock(&cfg, &["try", "api", &detail, "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kind"], "detail");
    assert_eq!(report["record"]["natural_key"], sku);
    assert_eq!(report["record"]["fields"]["title"], expected[0]["title"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_product_page_without_a_required_field_fails_naming_the_field_not_the_key() {
    let shop = Shop::start(1, 3).await;
    let base = &shop.base;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), base, ".sku", "", "");
    let strict = std::fs::read_to_string(&cfg).unwrap().replacen(
        "fields = { title = \"h1\", price = \".price\", status = \".status\" }",
        "fields = { title = \"h1\", gtin = { jsonld = \"Product\", path = \"$.gtin13\", required = true } }",
        1,
    );
    std::fs::write(&cfg, strict).unwrap();
    let sku = products(base).await[0]["sku"].as_str().unwrap().to_owned();
    let out = seedlock(
        &cfg,
        &["try", "shop", &format!("{base}/product/{sku}"), "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["no_record"],
        "record.fields.gtin: required, and nothing on the page matched"
    );
    assert_eq!(
        report["unmatched"],
        serde_json::json!([]),
        "the natural key matched: no line blames it"
    );
}
