//! JSON pages and JSON in HTML pages: the demo shop's JSON API crawled with JSONPath rules —
//! exactly, its values typed in the records, then incrementally — a JSON page that no rule of
//! its bot reads, failed with why; the product pages' JSON-LD read into typed fields, and a
//! required field a page lacks failing that page while its old record stays.

use crate::kit;

use std::collections::HashMap;

use bson::{doc, Bson};
use kit::crawl::*;
use kit::test_db;
use serde_json::json;

/// `once` with the shop's JSON API rules, seeded with its first listing page.
async fn api_pass(db: &kit::TestDb, base: &str) {
    let host = base.trim_start_matches("http://");
    let setup = Setup {
        rules: Some(seedlock::demo_site::api_rules_toml(&[host])),
        ..Setup::default()
    };
    let mut s = settings(db, base, &setup, "a");
    s.bots[0].seeds = static_seeds(&[format!("{base}/api/products?page=1")]);
    once(s).await;
}

/// Live records by natural key → (title, price, status), the price a BSON double.
async fn typed_records(db: &kit::TestDb) -> HashMap<String, (String, f64, String)> {
    let mut out = HashMap::new();
    for r in records(db).await {
        if !matches!(r.get("removedAt"), None | Some(Bson::Null)) {
            continue;
        }
        let data = r.get_document("data").unwrap();
        let key = r.get_str("naturalKey").unwrap().to_owned();
        let price = match data.get("price") {
            Some(Bson::Double(p)) => *p,
            other => panic!("{key}: the price is stored as {other:?}, not a number"),
        };
        let text = |k: &str| data.get_str(k).unwrap().to_owned();
        out.insert(key, (text("title"), price, text("status")));
    }
    out
}

/// The shop's products as the API types them: the price a number.
async fn typed_truth(base: &str) -> HashMap<String, (String, f64, String)> {
    truth(base)
        .await
        .into_iter()
        .map(|(sku, (title, price, status))| {
            let amount: f64 = price.trim_start_matches('$').parse().unwrap();
            (sku, (title, amount, status))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_api_is_crawled_exactly_with_typed_values_then_only_its_changes() {
    let db = test_db("json_api").await;
    let base = shop(4, 10).await;
    api_pass(&db, &base).await;
    let first = typed_records(&db).await;
    assert_eq!(first.len(), 40);
    assert_eq!(first, typed_truth(&base).await);
    // mongosh finds the cheap ones by range, as it would any number.
    let cheap = db
        .db
        .collection::<bson::Document>("records")
        .count_documents(doc! { "botId": "shop", "data.price": { "$lt": 500.0 } })
        .await
        .unwrap();
    let expected = first.values().filter(|(_, p, _)| *p < 500.0).count();
    assert_eq!(cheap as usize, expected);

    Requests::take(&base).await;
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 3, "delete": 1}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let changed: Vec<String> = skus(&report, "changed")
        .into_iter()
        .filter(|s| !deleted.contains(s))
        .collect();
    let writes = WriteCount::start(&db, "records").await;
    request_refresh(&db).await;
    api_pass(&db, &base).await;
    let writes = writes.stop().await;
    let requests = Requests::take(&base).await;
    let fetched: Vec<String> = requests
        .0
        .keys()
        .filter_map(|k| k.strip_prefix("/api/product/"))
        .map(str::to_owned)
        .collect();
    assert_eq!(fetched, changed, "exactly the changed details fetched");
    assert_eq!(typed_records(&db).await, typed_truth(&base).await);
    assert_eq!(removed_keys(&db).await, deleted, "the deleted one removed");
    let written: u64 = writes.values().sum();
    assert_eq!(
        written as usize,
        changed.len() + deleted.len(),
        "record documents written = changed + removed ({writes:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_page_no_rule_of_its_bot_reads_is_failed_with_why() {
    let db = test_db("json_unread").await;
    let base = shop(1, 3).await;
    // The shop's HTML rules only: no `$…` entry reads the JSON page.
    let mut s = settings(&db, &base, &Setup::default(), "a");
    let json_page = format!("{base}/api/products?page=1");
    s.bots[0].seeds = static_seeds(&[json_page.clone(), format!("{base}/list/1")]);
    once(s).await;
    let unread = frontier(&db, doc! { "kind": "seed", "url": json_page })
        .await
        .remove(0);
    assert_eq!(unread.get_str("status").unwrap(), "failed");
    assert_eq!(
        unread.get_str("lastError").unwrap(),
        "a JSON page, and the bot has no JSONPath rule (`$…`) for one"
    );
    // (XML, neither HTML nor JSON, is skipped: `page_errors::non_html_seeds_are_skipped`.)
    assert_eq!(live_records(&db).await, truth(&base).await);
}

/// The shop's HTML rules with the record read from each product page's JSON-LD, the price a
/// number; `extra` adds fields.
fn json_ld_rules(base: &str, extra: &str) -> String {
    let host = base.trim_start_matches("http://");
    let html = seedlock::demo_site::crawl_rules_toml(&[host], ".sku");
    let record = html.find("[bots.crawl.record]").unwrap();
    format!(
        r#"{}[bots.crawl.record]
match = "/product/"
natural_key = {{ jsonld = "Product", path = "$.sku" }}
[bots.crawl.record.fields]
title = {{ jsonld = "Product", path = "$.name", required = true }}
price = {{ jsonld = "Product", path = "$.offers.price", type = "number", required = true }}
status = ".status"
{extra}
"#,
        &html[..record]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_ld_fields_are_typed_and_a_page_without_a_required_one_fails_keeping_its_record() {
    let db = test_db("json_ld").await;
    let base = shop(2, 10).await;
    let setup = Setup {
        rules: Some(json_ld_rules(&base, "")),
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(typed_records(&db).await, typed_truth(&base).await);

    // A field every page lacks, required: the changed products' pages fail naming it, and
    // their records stay as they were.
    let before = typed_records(&db).await;
    let report = post(&format!("{base}/__mutate"), json!({"change": 2})).await;
    let changed = skus(&report, "changed");
    let strict = Setup {
        rules: Some(json_ld_rules(
            &base,
            r#"gtin = { jsonld = "Product", path = "$.gtin13", required = true }"#,
        )),
        ..Setup::default()
    };
    request_refresh(&db).await;
    once(settings(&db, &base, &strict, "a")).await;
    assert_eq!(typed_records(&db).await, before, "no record written");
    let failed = frontier(&db, doc! { "status": "failed", "pass": 2 }).await;
    let mut failed_urls: Vec<String> = failed
        .iter()
        .map(|f| {
            f.get_str("url")
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_owned()
        })
        .collect();
    failed_urls.sort();
    assert_eq!(failed_urls, changed, "the changed products' pages failed");
    for f in &failed {
        assert_eq!(
            f.get_str("lastError").unwrap(),
            "record.fields.gtin: required, and nothing on the page matched"
        );
    }
}
