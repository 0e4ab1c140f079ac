//! Sitemaps as listings: the demo shop's gzipped sitemap index crawled exactly, then only the
//! products whose `lastmod` moved (one fetch and one record write each); a product gone from a
//! complete pass's sitemaps removed, none from a pass that missed a sitemap file; the sitemaps
//! a robots.txt names read with `sitemaps_from_robots`; `try` on a sitemap printing its items; a
//! file longer than one decision slice crawled and passed again as exactly.

use crate::kit;

use bson::doc;
use kit::crawl::*;
use kit::shop::Shop;
use kit::test_db;
use seedlock::demo_site::SiteOptions;
use serde_json::json;

const INDEX: &str = "/sitemaps/index.xml.gz";

/// A shop of `lists × per_list` products whose sitemaps hold `per_file` products a file.
async fn sitemap_shop(lists: u32, per_list: u32, per_file: u32) -> String {
    Shop::start_options(SiteOptions {
        lists,
        per_list,
        seed: 11,
        sitemap_urls: per_file,
        ..SiteOptions::default()
    })
    .await
    .leak()
}

/// A pass of the shop's sitemap bot: seeded with its first listing page (only its `a.next`
/// links followed: the items come from the sitemaps), `sitemaps` the index unless `from_robots`.
async fn sitemap_pass(db: &kit::TestDb, base: &str, from_robots: bool) {
    let host = base.trim_start_matches("http://");
    let index = format!("{base}{INDEX}");
    let listed: &[&str] = if from_robots { &[] } else { &[&index] };
    let mut rules = seedlock::demo_site::sitemap_rules_toml(&[host], listed, "a.next");
    if from_robots {
        rules = rules.replacen(
            "[bots.crawl]\n",
            "[bots.crawl]\nsitemaps_from_robots = true\n",
            1,
        );
    }
    let setup = Setup {
        rules: Some(rules),
        ..Setup::default()
    };
    let mut s = settings(db, base, &setup, "a");
    s.bots[0].seeds = static_seeds(&[format!("{base}/list/1")]);
    once(s).await;
}

/// Another pass of the sitemap bot, asked for as an admin would; the requests it made.
async fn pass_again(db: &kit::TestDb, base: &str) -> Requests {
    request_refresh(db).await;
    sitemap_pass(db, base, false).await;
    Requests::take(base).await
}

/// The product pages a pass fetched, by SKU, sorted.
fn products_fetched(requests: &Requests) -> Vec<String> {
    let mut out: Vec<String> = requests
        .0
        .keys()
        .filter_map(|k| k.strip_prefix("/product/"))
        .map(str::to_owned)
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzipped_sitemap_index_is_crawled_exactly_then_only_the_lastmods_that_moved() {
    let db = test_db("sitemap_index").await;
    // 40 products in three gzipped files of at most 15.
    let base = sitemap_shop(4, 10, 15).await;
    Requests::take(&base).await;
    sitemap_pass(&db, &base, false).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let first = Requests::take(&base).await;
    assert_eq!(
        first.under("/sitemaps/"),
        4,
        "the index and its three files"
    );
    assert_eq!(products_fetched(&first).len(), 40);
    let files = frontier(
        &db,
        doc! { "kind": "list", "url": { "$regex": "products-" } },
    )
    .await;
    assert_eq!(files.len(), 3, "each file a listing page of the pass");

    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 3, "add": 2, "delete": 1}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let mut moved: Vec<String> = skus(&report, "changed")
        .into_iter()
        .chain(skus(&report, "added"))
        .filter(|s| !deleted.contains(s))
        .collect();
    moved.sort();
    let writes = WriteCount::start(&db, "records").await;
    let second = pass_again(&db, &base).await;
    let writes = writes.stop().await;
    assert_eq!(
        products_fetched(&second),
        moved,
        "exactly the new and changed products fetched"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(removed_keys(&db).await, deleted, "the deleted one removed");
    let written: u64 = writes.values().sum();
    assert_eq!(
        written as usize,
        moved.len() + deleted.len(),
        "record documents written = new + changed + removed ({writes:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_missed_a_sitemap_file_removes_nothing_and_the_next_complete_one_does() {
    let db = test_db("sitemap_incomplete").await;
    let base = sitemap_shop(3, 10, 10).await;
    sitemap_pass(&db, &base, false).await;
    assert_eq!(live_records(&db).await.len(), 30);

    let report = post(&format!("{base}/__mutate"), json!({"delete": 2})).await;
    let deleted = skus(&report, "deleted");
    // One of the three files fails for the whole pass: a third of the listings not read.
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/sitemaps/products-2.xml.gz", "status": 404}]),
    )
    .await;
    request_refresh(&db).await;
    sitemap_pass(&db, &base, false).await;
    assert_eq!(
        removed_keys(&db).await,
        Vec::<String>::new(),
        "nothing removed"
    );
    let last = bot_doc(&db).await;
    let why = last
        .get_document("crawlLastPass")
        .unwrap()
        .get_str("deletion")
        .unwrap()
        .to_owned();
    assert!(why.contains("coverage"), "the gate says why: {why:?}");

    reqwest::Client::new()
        .delete(format!("{base}/__faults"))
        .send()
        .await
        .unwrap();
    request_refresh(&db).await;
    sitemap_pass(&db, &base, false).await;
    assert_eq!(removed_keys(&db).await, deleted);
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sitemaps_a_robots_txt_names_are_read_with_sitemaps_from_robots() {
    let db = test_db("sitemap_robots").await;
    let base = sitemap_shop(2, 10, 50_000).await;
    reqwest::Client::new()
        .post(format!("{base}/__robots"))
        .body(format!("User-agent: *\nAllow: /\nSitemap: {base}{INDEX}\n"))
        .send()
        .await
        .unwrap();
    sitemap_pass(&db, &base, true).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let index = frontier(&db, doc! { "url": format!("{base}{INDEX}") }).await;
    assert_eq!(index.len(), 1);
    assert_eq!(
        index[0].get_str("kind").unwrap(),
        "seed",
        "a source of the pass"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_on_a_sitemap_prints_its_items_with_their_lastmods() {
    let base = sitemap_shop(1, 3, 50_000).await;
    let host = base.trim_start_matches("http://");
    let dir = tempfile::tempdir().unwrap();
    let file = format!("{base}/sitemaps/products-1.xml.gz");
    let rules = seedlock::demo_site::sitemap_rules_toml(&[host], &[&file], "a.next");
    let path = dir.path().join("try.toml");
    std::fs::write(
        &path,
        format!(
            "[mongo]\nuri = \"mongodb://127.0.0.1:1\"\n[http]\nlisten = \"off\"\n[[bots]]\nid = \"shop\"\nseeds = [\"{base}/list/1\"]\n{rules}"
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_seedlock"))
        .arg("-c")
        .arg(&path)
        .args(["try", "shop", &file, "--json"])
        .env_remove("MONGODB_URI")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let truth = get_json(&format!("{base}/__truth")).await;
    let mut expected: Vec<String> = truth["products"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{base}/product/{}", p["sku"].as_str().unwrap()))
        .collect();
    expected.sort();
    let items = report["items"].as_array().unwrap();
    let links: Vec<String> = items
        .iter()
        .map(|i| i["link"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(links, expected, "every product, by SKU");
    for item in items {
        let lastmod = item["fingerprint_fields"][0]["value"].as_str().unwrap();
        assert!(
            chrono::DateTime::parse_from_rfc3339(lastmod).is_ok(),
            "{lastmod:?} is the product's lastmod"
        );
        assert_eq!(item["fingerprint_fields"][0]["spec"], "lastmod");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sitemap_file_longer_than_a_decision_slice_is_crawled_exactly_then_only_what_moved() {
    let db = test_db("sitemap_slices").await;
    // One file of 4,500 products: its items are decided in three slices.
    let base = sitemap_shop(45, 100, 5_000).await;
    sitemap_pass(&db, &base, false).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let files = frontier(
        &db,
        doc! { "kind": "list", "url": { "$regex": "products-" } },
    )
    .await;
    assert_eq!(files.len(), 1, "one sitemap file");
    assert_eq!(
        manifest_len(&files[0]),
        Some(4_500),
        "the file's manifest lists every item once"
    );

    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 4, "delete": 2}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let mut moved: Vec<String> = skus(&report, "changed")
        .into_iter()
        .filter(|s| !deleted.contains(s))
        .collect();
    moved.sort();
    Requests::take(&base).await;
    let second = pass_again(&db, &base).await;
    assert_eq!(
        products_fetched(&second),
        moved,
        "exactly the changed products fetched"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(removed_keys(&db).await, deleted, "the deleted ones removed");
}
