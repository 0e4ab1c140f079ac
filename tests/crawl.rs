//! The crawl end to end: the demo shop over real HTTP, the real server, the daemon's own `run`
//! (`run --once`): one correct record per product, incremental passes that fetch only what
//! changed, deletion detection and its thresholds, retries, hostile pages, several instances.
#![allow(clippy::bool_assert_comparison)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bson::{doc, Bson, Document};
use common::crawl::*;
use common::{test_db, TestDb};
use futures_util::TryStreamExt;
use seedlock::daemon::{run, Mode};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// Requests per path since the last call (the counters are reset).
struct Requests(BTreeMap<String, u64>);

impl Requests {
    async fn take(base: &str) -> Requests {
        Self::read(base, true).await
    }

    /// Without resetting the counters.
    async fn peek(base: &str) -> Requests {
        Self::read(base, false).await
    }

    async fn read(base: &str, reset: bool) -> Requests {
        let stats = get_json(&format!("{base}/__stats?reset={reset}")).await;
        let paths = stats["paths"].as_object().unwrap();
        Requests(
            paths
                .iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect(),
        )
    }

    fn under(&self, prefix: &str) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    }

    /// Pages requested more than once (robots.txt is read once per process by design).
    fn repeated(&self) -> u64 {
        self.0
            .iter()
            .filter(|(path, _)| *path != "/robots.txt")
            .map(|(_, v)| v.saturating_sub(1))
            .sum()
    }
}

/// The shop's products: sku → (title, price, status).
async fn truth(base: &str) -> HashMap<String, (String, String, String)> {
    let truth = get_json(&format!("{base}/__truth")).await;
    truth["products"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap().to_owned();
            (s("sku"), (s("title"), s("price"), s("status")))
        })
        .collect()
}

async fn records(db: &TestDb) -> Vec<Document> {
    db.db
        .collection::<Document>("records")
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// Records not marked removed, by natural key → (title, price, status).
async fn live_records(db: &TestDb) -> HashMap<String, (String, String, String)> {
    let mut out = HashMap::new();
    for r in records(db).await {
        if !matches!(r.get("removedAt"), None | Some(Bson::Null)) {
            continue;
        }
        let data = r.get_document("data").unwrap();
        let s = |k: &str| data.get_str(k).unwrap_or_default().to_owned();
        let key = r.get_str("naturalKey").unwrap().to_owned();
        assert!(
            out.insert(key.clone(), (s("title"), s("price"), s("status")))
                .is_none(),
            "two records for {key}"
        );
    }
    out
}

async fn removed_keys(db: &TestDb) -> Vec<String> {
    let mut keys: Vec<String> = records(db)
        .await
        .into_iter()
        .filter(|r| matches!(r.get("removedAt"), Some(Bson::DateTime(_))))
        .map(|r| r.get_str("naturalKey").unwrap().to_owned())
        .collect();
    keys.sort();
    keys
}

async fn frontier(db: &TestDb, filter: Document) -> Vec<Document> {
    db.db
        .collection::<Document>("frontier")
        .find(filter)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

async fn request_refresh(db: &TestDb) {
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    assert!(db
        .store()
        .request_refresh(&bot, "test", chrono::Utc::now())
        .await
        .unwrap());
}

async fn bot_doc(db: &TestDb) -> Document {
    db.doc("shop").await.expect("the bot document")
}

async fn a_full_pass_stores_one_correct_record_per_product(transactions: &str) {
    let db = test_db(&format!("crawl_full_{transactions}")).await;
    let base = shop(5, 20).await;
    let setup = Setup {
        transactions,
        ..Setup::default()
    };
    let summary = once(settings(&db, &base, &setup, "solo")).await;
    assert_eq!(summary.len(), 1);
    assert_eq!(summary[0].pass, 1, "the first refresh started pass 1");
    let requests = Requests::take(&base).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(records(&db).await.len(), 100);
    assert_eq!(requests.under("/product/"), 100, "{:?}", requests.0);
    assert_eq!(requests.under("/list/"), 5);
    assert_eq!(
        requests.repeated(),
        0,
        "no page fetched twice: {:?}",
        requests.0
    );
    let doc = bot_doc(&db).await;
    assert_eq!(doc.get_i64("crawlPass").unwrap(), 1);
    assert!(matches!(
        doc.get("crawlPassEndedAt"),
        Some(Bson::DateTime(_))
    ));
    let last = doc.get_document("crawlLastPass").unwrap();
    assert_eq!(last.get_i64("done").unwrap(), 105, "{last}");
    assert_eq!(last.get_i64("failed").unwrap(), 0);
    // Ids derive from the data: the same item has the same id wherever it is computed.
    for r in records(&db).await {
        let key = r.get_str("naturalKey").unwrap();
        assert_eq!(
            r.get_str("_id").unwrap(),
            seedlock::store::records::record_id("shop", key)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pass_in_transactions_stores_one_correct_record_per_product() {
    a_full_pass_stores_one_correct_record_per_product("on").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pass_without_transactions_stores_one_correct_record_per_product() {
    a_full_pass_stores_one_correct_record_per_product("off").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_pass_is_not_crawled_again_until_a_refresh_starts_the_next() {
    let db = test_db("crawl_no_rerun").await;
    let base = shop(2, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    Requests::take(&base).await;
    let summary = once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(summary[0].pass, 1);
    assert_eq!(
        Requests::take(&base).await.0.len(),
        0,
        "a finished pass costs no request"
    );
    request_refresh(&db).await;
    let summary = once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(
        summary[0].pass, 2,
        "`seedlock refresh` then `run --once`: a new pass"
    );
    let requests = Requests::take(&base).await;
    assert_eq!(
        requests.under("/list/"),
        2,
        "listing pages are read every pass"
    );
    assert_eq!(
        requests.under("/product/"),
        0,
        "nothing changed: no detail page"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_mode_fetches_only_changed_and_new_items_and_marks_the_deleted() {
    let db = test_db("crawl_fingerprint").await;
    let base = shop(5, 20).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let before: HashMap<String, Document> = records(&db)
        .await
        .into_iter()
        .map(|r| (r.get_str("naturalKey").unwrap().to_owned(), r))
        .collect();
    Requests::take(&base).await;
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 5, "add": 3, "delete": 2}),
    )
    .await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let requests = Requests::take(&base).await;
    let was_deleted = |sku: &&Value| report["deleted"].as_array().unwrap().contains(sku);
    let mut expected: Vec<String> = report["changed"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|sku| !was_deleted(sku))
        .chain(report["added"].as_array().unwrap())
        .map(|s| format!("/product/{}", s.as_str().unwrap()))
        .collect();
    expected.sort();
    let fetched: Vec<String> = requests
        .0
        .keys()
        .filter(|k| k.starts_with("/product/"))
        .cloned()
        .collect();
    assert_eq!(fetched, expected, "exactly the changed and the new details");
    assert_eq!(live_records(&db).await, truth(&base).await);
    let mut deleted: Vec<String> = report["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    deleted.sort();
    assert_eq!(removed_keys(&db).await, deleted);
    // Unchanged records were not rewritten: `lastChanged` kept, `lastSeenPass` moved on.
    let changed: Vec<&str> = report["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    for r in records(&db).await {
        let key = r.get_str("naturalKey").unwrap();
        let Some(old) = before.get(key) else { continue };
        if deleted.iter().any(|d| d == key) {
            continue;
        }
        assert_eq!(
            r.get_i64("lastSeenPass").unwrap(),
            2,
            "{key} seen in pass 2"
        );
        let same = r.get("lastChanged") == old.get("lastChanged");
        assert_eq!(
            same,
            !changed.contains(&key),
            "{key}: lastChanged moves only on a change"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_mode_refetches_details_with_conditional_gets_and_rewrites_nothing() {
    let db = test_db("crawl_conditional").await;
    let base = shop(2, 10).await;
    let setup = Setup {
        mode: "full",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let before: HashMap<String, Bson> = records(&db)
        .await
        .into_iter()
        .map(|r| {
            (
                r.get_str("naturalKey").unwrap().to_owned(),
                r.get("lastChanged").unwrap().clone(),
            )
        })
        .collect();
    Requests::take(&base).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(Requests::take(&base).await.under("/product/"), 20);
    let detail_done = frontier(&db, doc! { "kind": "detail", "pass": 2_i64 }).await;
    assert_eq!(detail_done.len(), 20);
    for page in &detail_done {
        assert_eq!(page.get_str("status").unwrap(), "done");
        assert!(
            page.get_str("etag").is_ok(),
            "validators kept for the next pass"
        );
    }
    for r in records(&db).await {
        let key = r.get_str("naturalKey").unwrap();
        assert_eq!(
            r.get("lastChanged"),
            before.get(key),
            "304: {key} not rewritten"
        );
        assert_eq!(
            r.get_i64("lastSeenPass").unwrap(),
            2,
            "304: {key} still seen"
        );
    }
    assert!(removed_keys(&db).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermark_mode_stops_paginating_at_the_first_known_item() {
    let db = test_db("crawl_watermark").await;
    let base = shop(6, 10).await;
    let setup = Setup {
        mode: "watermark",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    Requests::take(&base).await;
    let report = post(&format!("{base}/__mutate"), json!({"add": 15, "delete": 1})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let requests = Requests::take(&base).await;
    assert_eq!(
        requests.under("/list/"),
        2,
        "page 1 is all new, page 2 shows a known item: stop there ({:?})",
        requests.0
    );
    assert_eq!(requests.under("/product/"), 15);
    for sku in report["added"].as_array().unwrap() {
        assert!(live_records(&db).await.contains_key(sku.as_str().unwrap()));
    }
    assert!(
        removed_keys(&db).await.is_empty(),
        "watermark passes do not read every listing page: no deletion detection"
    );
    let last = bot_doc(&db).await;
    let last = last.get_document("crawlLastPass").unwrap();
    assert!(last.get_str("deletion").unwrap().starts_with("skipped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updated_at_mode_rereads_items_changed_since_the_last_run_minus_overlap() {
    let db = test_db("crawl_updated_at").await;
    let base = shop(3, 10).await;
    let setup = Setup {
        mode: "updated_at",
        incremental: "overlap = \"0s\"",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    Requests::take(&base).await;
    let report = post(&format!("{base}/__mutate"), json!({"change": 4})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let fetched = Requests::take(&base).await.under("/product/");
    assert_eq!(fetched, 4, "only the items updated since the last run");
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(report["changed"].as_array().unwrap().len(), 4);
    // A generous overlap reads everything again (the safety margin against clock skew).
    let setup = Setup {
        mode: "updated_at",
        incremental: "overlap = \"1h\"",
        ..Setup::default()
    };
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(Requests::take(&base).await.under("/product/"), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incomplete_pass_marks_nothing_removed_and_the_next_complete_one_does() {
    let db = test_db("crawl_deletion").await;
    let base = shop(5, 10).await;
    let setup = Setup {
        crawl: "attempts = 2",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let report = post(&format!("{base}/__mutate"), json!({"delete": 5})).await;
    // One listing page of five fails for the whole pass: coverage 80% < 95%.
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/list/3", "status": 500}]),
    )
    .await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert!(
        removed_keys(&db).await.is_empty(),
        "nothing removed on an incomplete pass"
    );
    let doc = bot_doc(&db).await;
    let last = doc.get_document("crawlLastPass").unwrap();
    assert!(
        last.get_str("deletion").unwrap().contains("coverage"),
        "{last}"
    );
    let failed = frontier(&db, doc! { "pass": 2_i64, "status": "failed" }).await;
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0].get_str("lastError").unwrap().contains("HTTP 500"),
        "{:?}",
        failed[0]
    );
    reqwest::Client::new()
        .delete(format!("{base}/__faults"))
        .send()
        .await
        .unwrap();
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let mut deleted: Vec<String> = report["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    deleted.sort();
    assert_eq!(removed_keys(&db).await, deleted, "exactly the deleted five");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_pagination_chain_is_mended_from_the_last_pass_and_counted_in_coverage() {
    let db = test_db("crawl_chain").await;
    let base = shop(40, 2).await;
    // Deletion needs every listing page here, so the test shows coverage, not removals.
    let setup = Setup {
        crawl: "attempts = 1\nmin_coverage = 1.0",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    // Listing page 30 of 40 fails: pages 31–40 are linked only from it. The pass enqueues the
    // ten from what the last pass read, so their items are still checked.
    post(&format!("{base}/__mutate"), json!({"change": 80})).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/list/30", "status": 403}]),
    )
    .await;
    Requests::take(&base).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let requests = Requests::take(&base).await;
    for page in 31..=40 {
        assert_eq!(
            requests.under(&format!("/list/{page}")),
            1,
            "{:?}",
            requests.0
        );
    }
    // Every product but the two only page 30 listed is up to date.
    let truth = truth(&base).await;
    let stale: Vec<_> = live_records(&db)
        .await
        .into_iter()
        .filter(|(k, v)| truth.get(k) != Some(v))
        .collect();
    assert!(stale.len() <= 2, "{stale:?}");
    assert!(removed_keys(&db).await.is_empty());
    let doc = bot_doc(&db).await;
    let last = doc.get_document("crawlLastPass").unwrap();
    assert_eq!(last.get_f64("listCoverage").unwrap(), 39.0 / 40.0, "{last}");
    assert!(
        last.get_str("deletion").unwrap().contains("coverage 97.5%"),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_and_failing_fetches_are_retried_from_the_frontier_and_nothing_is_lost() {
    let db = test_db("crawl_retry").await;
    let base = shop(3, 10).await;
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": "/product/", "status": 503, "every": 3},
            {"path": "/list/", "status": 429, "retry_after": "1", "every": 2},
        ]),
    )
    .await;
    // A third of the product fetches fail: this test is about retrying, not the retry budget.
    let setup = Setup {
        crawl: "attempts = 5\nretry_budget = 1.0",
        ..Setup::default()
    };
    let started = std::time::Instant::now();
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let requests = Requests::take(&base).await;
    assert!(
        requests.under("/product/") > 30,
        "some fetches were retried"
    );
    // list/1 ok, list/2 429, list/2 ok, list/3 429, list/3 ok: each retry waited Retry-After.
    assert_eq!(requests.under("/list/"), 5, "{:?}", requests.0);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "Retry-After: 1 was honoured twice"
    );
    assert!(frontier(&db, doc! { "status": "failed" }).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_pages_fail_with_their_reason_and_the_rest_is_stored() {
    let db = test_db("crawl_hostile").await;
    let base = shop(2, 10).await;
    let products: Vec<String> = truth(&base).await.into_keys().collect();
    let (huge, looping) = (&products[0], &products[1]);
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{huge}"), "huge_body_bytes": 200_000},
            {"path": format!("/product/{looping}"), "redirect_loop": true},
        ]),
    )
    .await;
    let setup = Setup {
        crawl: "max_page_bytes = 100000",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    let reasons: HashMap<String, String> = failed
        .iter()
        .map(|f| {
            (
                f.get_str("url")
                    .unwrap()
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .to_owned(),
                f.get_str("lastError").unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[huge].contains("larger than 100000 bytes"),
        "{reasons:?}"
    );
    assert!(reasons[looping].contains("redirects"), "{reasons:?}");
    let stored = live_records(&db).await;
    assert_eq!(stored.len(), 18);
    let truth = truth(&base).await;
    for (key, value) in &stored {
        assert_eq!(Some(value), truth.get(key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detail_page_without_its_natural_key_is_failed_and_writes_no_record() {
    let db = test_db("crawl_no_key").await;
    let base = shop(1, 5).await;
    let setup = Setup {
        natural_key: ".no-such-key",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    assert!(records(&db).await.is_empty());
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(failed.len(), 5);
    for f in failed {
        assert_eq!(
            f.get_str("lastError").unwrap(),
            "no natural key (.no-such-key) on the page"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_html_seeds_are_skipped() {
    let db = test_db("crawl_non_html").await;
    let base = shop(1, 3).await;
    let mut s = settings(&db, &base, &Setup::default(), "a");
    s.bots[0].seeds = seedlock::config::SeedSource::Static(vec![
        seedlock::urls::NormalizedUrl::parse(&format!("{base}/sitemap.xml")).unwrap(),
        seedlock::urls::NormalizedUrl::parse(&format!("{base}/list/1")).unwrap(),
    ]);
    once(s).await;
    let sitemap = frontier(
        &db,
        doc! { "kind": "seed", "url": format!("{base}/sitemap.xml") },
    )
    .await;
    assert_eq!(sitemap[0].get_str("status").unwrap(), "done");
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_share_one_pass_without_fetching_a_page_twice() {
    let db = test_db("crawl_three").await;
    let base = shop(6, 20).await;
    let runs: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|name| tokio::spawn(once(settings(&db, &base, &Setup::default(), name))))
        .collect();
    for r in runs {
        assert_eq!(r.await.unwrap()[0].pass, 1);
    }
    let requests = Requests::take(&base).await;
    assert_eq!(requests.repeated(), 0, "{:?}", requests.0);
    assert_eq!(requests.under("/product/"), 120);
    assert_eq!(live_records(&db).await, truth(&base).await);
    let owners: std::collections::HashSet<String> = db
        .history("shop")
        .await
        .iter()
        .filter(|h| h.get_str("event") == Ok("refreshed"))
        .map(|h| h.get_str("by").unwrap().to_owned())
        .collect();
    assert_eq!(owners.len(), 1, "one refresh started the pass");
}

/// The `[[bots]]` entry of the processes' config (the same rules as [`settings`]).
fn crawl_bot_toml(base: &str) -> String {
    let host = base.trim_start_matches("http://");
    format!(
        r#"[[bots]]
id = "shop"
seeds = {{ url = "{base}/seeds.txt", format = "lines" }}
refresh = "1h"
[bots.crawl]
scope = ["{host}"]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = {{ title = "h1", price = ".price", status = ".status" }}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_crawlers_end_with_one_correct_record_per_product_and_few_repeats() {
    use common::{Proc, ProcConfig};
    let db = test_db("crawl_kill").await;
    let base = shop(5, 10).await;
    // Slow pages, so the crawl is still running at every kill.
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/", "latency_ms": 30}]),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = ProcConfig::new(&db, crawl_bot_toml(&base));
    // The ordered commit path: the one whose every line a kill can split. (A kill inside a
    // transaction leaves it open on the server for about a minute, which would hold the pass's
    // end and slow other tests' change streams; scripts/bench/kill-test covers that case.)
    // Small queues: at most 2 + 1 + 1 + 1 + 1 = 6 pages fetched and not yet committed.
    config.extra = "[crawl]\nworkers = 2\nparse_queue = 1\nparsers = 1\nstore_queue = 1\nwriters = 1\nlease = \"30s\"\ntimeout = \"5s\"\ntransactions = \"off\"\n";
    const IN_FLIGHT_CAP: u64 = 6;
    let config = config.write(dir.path());
    let names = ["k0", "k1"];
    let mut procs: Vec<Proc> = names
        .iter()
        .map(|n| Proc::spawn(dir.path(), &config, n, &["run", "--once"], &[]))
        .collect();
    let frontier_done = || async {
        db.db
            .collection::<Document>("frontier")
            .count_documents(doc! { "status": "done" })
            .await
            .unwrap()
    };
    // Kill an instance each time the crawl has made some progress (55 pages in all).
    let mut kills = 0;
    for (i, threshold) in [8_u64, 20, 32].into_iter().enumerate() {
        common::eventually("crawl progress", Duration::from_secs(30), || async {
            frontier_done().await >= threshold
        })
        .await;
        let victim = i % names.len();
        procs[victim].kill9().await;
        kills += 1;
        // The same instance id again: it reclaims its predecessor's leases at once.
        procs[victim] = Proc::spawn(dir.path(), &config, names[victim], &["run", "--once"], &[]);
    }
    for p in &mut procs {
        let status = p.wait(Duration::from_secs(60)).await;
        assert!(status.success(), "{}: {status}\n{}", p.name, p.log());
        assert!(!p.log().contains("panicked"), "{}", p.log());
    }
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(records(&db).await.len(), 50);
    let requests = Requests::take(&base).await;
    assert!(
        requests.repeated() <= kills * IN_FLIGHT_CAP,
        "at most the pages fetched and uncommitted at each kill are fetched again: {} repeated, {kills} kills × {IN_FLIGHT_CAP} ({:?})",
        requests.repeated(),
        requests.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_crawler_resumes_without_fetching_the_urls_whose_lease_ran_out_while_queued() {
    use common::{Proc, ProcConfig};
    use nix::sys::signal::Signal;
    let db = test_db("crawl_stopped").await;
    let base = shop(1, 4).await;
    // One request a second: the stopped instance has URLs queued behind the spacing.
    reqwest::Client::new()
        .post(format!("{base}/__robots"))
        .body("User-agent: *\nCrawl-delay: 1\n")
        .send()
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = ProcConfig::new(&db, crawl_bot_toml(&base));
    // Ordered commits: a process stopped inside a transaction would hold its page's commit
    // open on the server for up to a minute (see the kill test).
    config.extra =
        "[crawl]\nworkers = 4\nlease = \"2s\"\ntimeout = \"1s\"\ntransactions = \"off\"\n";
    // Crawl slices of 20 s (10 × poll): a is still inside its slice when it resumes, with its
    // queued URLs' leases long gone.
    config.poll = "2s";
    let config = config.write(dir.path());
    let mut a = Proc::spawn(dir.path(), &config, "a", &["run"], &[]);
    // Once it has fetched the listing page, its product URLs wait for their turn.
    common::eventually(
        "a fetched the listing page",
        Duration::from_secs(30),
        || async { Requests::peek(&base).await.under("/product/") >= 1 },
    )
    .await;
    a.signal(Signal::SIGSTOP);
    let before = Requests::peek(&base).await;
    // b finishes the pass while a is stopped (a's leases run out after 2 s).
    let mut b = Proc::spawn(dir.path(), &config, "b", &["run", "--once"], &[]);
    let status = b.wait(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", b.log());
    a.signal(Signal::SIGCONT);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !a.log().contains("lease expired while queued; not fetched") {
        assert!(
            std::time::Instant::now() < deadline,
            "a did not drop the URLs whose lease ran out:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // b joined a running pass: its Crawl-delay spaced its very first requests too.
    let times: Vec<i64> = request_log(&base)
        .await
        .into_iter()
        .filter(|(p, _)| p.starts_with("/product/"))
        .map(|(_, at)| at)
        .collect();
    assert!(times.len() >= 4, "every product was requested: {times:?}");
    let gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.iter().all(|g| *g >= 950),
        "product requests were at least Crawl-delay (1 s) apart: {gaps:?}"
    );
    // A request a already sent before the stop may be repeated by b; nothing a had queued.
    let requests = Requests::take(&base).await;
    let in_flight_at_stop = 1;
    assert!(
        requests.repeated() <= in_flight_at_stop,
        "{} repeated; before the stop {:?}, at the end {:?}",
        requests.repeated(),
        before.0,
        requests.0
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
    a.signal(Signal::SIGTERM);
    assert!(
        a.wait(Duration::from_secs(20)).await.success(),
        "{}",
        a.log()
    );
    a.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_current_pass_ends_and_only_its_end_marks_records_removed() {
    use seedlock::store::passes::DeletionRules;
    let db = test_db("crawl_replaced_pass").await;
    let store = db.store();
    let now = chrono::Utc::now();
    db.bots()
        .insert_one(doc! {
            "_id": "shop", "isReady": true, "isEditing": false, "seeds": [], "lockEpoch": 1_i64,
            "crawlPass": 2_i64, "crawlPassStartedAt": bson::DateTime::from_chrono(now), "crawlPassEndedAt": Bson::Null,
        })
        .await
        .unwrap();
    db.db
        .collection::<Document>("records")
        .insert_one(doc! { "_id": "r1", "botId": "shop", "naturalKey": "SKU-1", "lastSeenPass": 0_i64, "removedAt": Bson::Null })
        .await
        .unwrap();
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    let rules = DeletionRules {
        known_since: None,
        enabled: true,
        min_coverage: 0.0,
        max_error_rate: 1.0,
    };
    // An instance still on pass 1, which a refresh replaced by pass 2: nothing is recorded and
    // nothing is removed, though pass 1 has no work left.
    let stale = store.finish_pass(&bot, 1, None, rules, now).await.unwrap();
    assert!(stale.finished && !stale.recorded);
    assert_eq!(stale.removed, 0);
    assert!(removed_keys(&db).await.is_empty());
    // The current pass ends once, and its end marks the unseen record.
    let end = store.finish_pass(&bot, 2, None, rules, now).await.unwrap();
    assert!(end.recorded);
    assert_eq!(end.removed, 1);
    assert_eq!(removed_keys(&db).await, ["SKU-1"]);
    let again = store.finish_pass(&bot, 2, None, rules, now).await.unwrap();
    assert!(!again.recorded, "the end is recorded once");
}

// ---- flow control ------------------------------------------------------------------------------

/// A seed source listing the first listing page of each shop.
async fn seeds_of(bases: &[&str]) -> String {
    let body: String = bases.iter().map(|b| format!("{b}/list/1\n")).collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/seeds.txt", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/seeds.txt",
        axum::routing::get(move || {
            let body = body.clone();
            async move { body }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// The shop's request log: (path, Unix milliseconds), oldest first.
async fn request_log(base: &str) -> Vec<(String, i64)> {
    let stats = get_json(&format!("{base}/__stats?log=true")).await;
    stats["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap().to_owned(), e[1].as_i64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_throttling_above_three_in_flight_holds_the_limit_between_two_and_four() {
    let db = test_db("flow_aimd").await;
    let base = shop(10, 20).await;
    let host = base.trim_start_matches("http://").to_owned();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/", "latency_ms": 20, "status": 429, "max_in_flight": 3}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        workers: 16,
        crawl: "attempts = 20\nretry_budget = 1.0",
        listen: &listen,
        ..Setup::default()
    };
    // Sample the host's limit while the crawl runs.
    let stop = CancellationToken::new();
    let sampler = {
        let (stop, listen) = (stop.clone(), listen.clone());
        let limit = format!("seedlock_host_limit{{host=\"{host}\"}}");
        let throttles = format!("seedlock_host_throttles_total{{host=\"{host}\"}}");
        tokio::spawn(async move {
            let mut after_warm_up = Vec::new();
            while !stop.is_cancelled() {
                if metric(&listen, &throttles).await.unwrap_or(0.0) >= 1.0 {
                    if let Some(l) = metric(&listen, &limit).await {
                        after_warm_up.push(l);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            after_warm_up
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let limits = sampler.await.unwrap();
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "the crawl completes"
    );
    assert!(
        limits.len() >= 10,
        "the limit was sampled after warm-up: {limits:?}"
    );
    // The limiter admits floor(limit) requests at once; the fraction is growth in progress.
    assert!(
        limits.iter().all(|l| (2.0..5.0).contains(&l.floor())),
        "the limit stayed between 2 and 4: {limits:?}"
    );
    let requests = Requests::take(&base).await;
    let throttled = requests.repeated();
    assert!(
        (throttled as f64) < 0.2 * requests.0.len() as f64,
        "few requests were throttled: {throttled} repeats over {} paths",
        requests.0.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_pauses_only_that_host_while_the_other_keeps_fetching() {
    let db = test_db("flow_pause").await;
    let (a, b) = (shop_named(2, 10, "A").await, shop_named(20, 20, "B").await);
    // A's second listing page answers 429 with Retry-After: 2, once.
    post(
        &format!("{a}/__faults"),
        json!([{"path": "/list/2", "status": 429, "retry_after": "2", "times": 1}]),
    )
    .await;
    let seeds = seeds_of(&[&a, &b]).await;
    let b_host = b.trim_start_matches("http://").to_owned();
    let scope = [b_host.as_str()];
    let setup = Setup {
        workers: 8,
        seeds: Some(&seeds),
        scope: &scope,
        ..Setup::default()
    };
    once(settings(&db, &a, &setup, "a")).await;
    let (log_a, log_b) = (request_log(&a).await, request_log(&b).await);
    let throttled_at = log_a
        .iter()
        .find(|(p, _)| p == "/list/2")
        .map(|(_, t)| *t)
        .expect("A's /list/2 was requested");
    // Requests A had in flight when the 429 came may land a moment later; none after that
    // until the pause ends.
    let quiet = (throttled_at + 300)..(throttled_at + 1900);
    let a_during: Vec<_> = log_a.iter().filter(|(_, t)| quiet.contains(t)).collect();
    let b_during = log_b.iter().filter(|(_, t)| quiet.contains(t)).count();
    assert!(a_during.is_empty(), "A was paused: {a_during:?}");
    assert!(
        b_during >= 10,
        "B kept fetching during A's pause: {b_during} requests"
    );
    let second_try = log_a
        .iter()
        .filter(|(p, _)| p == "/list/2")
        .nth(1)
        .map(|(_, t)| *t)
        .expect("A's /list/2 was fetched again");
    assert!(
        second_try - throttled_at >= 1900,
        "Retry-After was honoured"
    );
    let mut expected = truth(&a).await;
    expected.extend(truth(&b).await);
    assert_eq!(live_records(&db).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_is_not_retried_and_a_503_is_retried_then_recorded_failed() {
    let db = test_db("flow_permanent").await;
    let base = shop(2, 10).await;
    let products: Vec<String> = {
        let mut p: Vec<String> = truth(&base).await.into_keys().collect();
        p.sort();
        p
    };
    let (forbidden, unavailable) = (&products[2], &products[4]);
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{forbidden}"), "status": 403},
            {"path": format!("/product/{unavailable}"), "status": 503},
        ]),
    )
    .await;
    let setup = Setup {
        crawl: "attempts = 3",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let requests = Requests::take(&base).await;
    assert_eq!(
        requests.under(&format!("/product/{forbidden}")),
        1,
        "403 is not retried"
    );
    assert_eq!(
        requests.under(&format!("/product/{unavailable}")),
        3,
        "503 is retried up to the attempt limit"
    );
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    let reason = |sku: &str| {
        failed
            .iter()
            .find(|f| f.get_str("url").unwrap().ends_with(sku))
            .map(|f| f.get_str("lastError").unwrap().to_owned())
    };
    assert_eq!(reason(forbidden).as_deref(), Some("HTTP 403"));
    assert_eq!(
        reason(unavailable).as_deref(),
        Some("HTTP 503 (after 3 attempts)")
    );
    assert_eq!(live_records(&db).await.len(), products.len() - 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robots_txt_disallow_is_honoured_and_crawl_delay_spaces_requests() {
    let db = test_db("flow_robots").await;
    let base = shop(1, 8).await;
    let mut products: Vec<String> = truth(&base).await.into_keys().collect();
    products.sort();
    let hidden = products[3].clone();
    reqwest::Client::new()
        .post(format!("{base}/__robots"))
        .body(format!(
            "User-agent: *\nDisallow: /product/{hidden}\nCrawl-delay: 0.2\n"
        ))
        .send()
        .await
        .unwrap();
    let setup = Setup {
        workers: 8,
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let log: Vec<(String, i64)> = request_log(&base)
        .await
        .into_iter()
        .filter(|(p, _)| p.starts_with("/list/") || p.starts_with("/product/"))
        .collect();
    assert!(
        !log.iter().any(|(p, _)| p.ends_with(&hidden)),
        "the disallowed page was not fetched"
    );
    assert_eq!(log.len(), 1 + 7, "{log:?}");
    let gaps: Vec<i64> = log.windows(2).map(|w| w[1].1 - w[0].1).collect();
    assert!(
        gaps.iter().all(|g| *g >= 190),
        "requests were at least Crawl-delay apart: {gaps:?}"
    );
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(failed.len(), 1);
    assert_eq!(
        failed[0].get_str("lastError").unwrap(),
        "disallowed by robots.txt"
    );
    assert_eq!(live_records(&db).await.len(), 7);

    // Ignoring robots.txt (one's own site) fetches it.
    let db = test_db("flow_robots_ignored").await;
    let setup = Setup {
        crawl: "robots = false",
        ..Setup::default()
    };
    Requests::take(&base).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(
        Requests::take(&base)
            .await
            .under(&format!("/product/{hidden}")),
        1
    );
    assert_eq!(live_records(&db).await.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_robots_txt_pauses_the_host_until_it_answers() {
    let db = test_db("flow_robots_503").await;
    let base = shop(1, 5).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/robots.txt", "status": 503, "times": 1}]),
    )
    .await;
    let setup = Setup {
        crawl: "robots_retry = \"1s\"",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let log = request_log(&base).await;
    let robots: Vec<i64> = log
        .iter()
        .filter(|(p, _)| p == "/robots.txt")
        .map(|(_, t)| *t)
        .collect();
    assert_eq!(robots.len(), 2, "asked again after the pause: {log:?}");
    let first_page = log
        .iter()
        .find(|(p, _)| p.starts_with("/list/") || p.starts_with("/product/"))
        .map(|(_, t)| *t)
        .unwrap();
    assert!(
        first_page - robots[0] >= 950,
        "no page was fetched while robots.txt was unavailable: {log:?}"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
    // The URL given back while the host was paused did not use up an attempt.
    assert!(frontier(&db, doc! { "status": "failed" }).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_host_is_published_for_status() {
    let db = test_db("flow_hosts").await;
    let base = shop(5, 20).await;
    let host = base.trim_start_matches("http://").to_owned();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "status": 429, "retry_after": "1", "every": 3}]),
    )
    .await;
    let setup = Setup {
        crawl: "retry_budget = 1.0\nattempts = 10",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(run(
        settings(&db, &base, &setup, "a"),
        Mode::Daemon,
        stop.clone(),
    ));
    // Published every 5 s while the host throttles.
    let store = db.store();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let rows = loop {
        let since = chrono::Utc::now() - chrono::Duration::seconds(30);
        let rows = store.recent_hosts(since).await.unwrap();
        if !rows.is_empty() {
            break rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no host row was published within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.cancel();
    daemon.await.unwrap().unwrap();
    assert_eq!(rows[0].host, host);
    assert_eq!(rows[0].instance, "a");
    assert!(
        rows[0].throttles >= 1 && rows[0].last_throttle_at.is_some(),
        "{rows:?}"
    );
    let text = seedlock::admin::render_hosts(&rows, chrono::Utc::now());
    assert!(text.contains(&host), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_low_priority_work_for_a_throttling_host_is_shed_and_still_crawled() {
    let db = test_db("flow_shed").await;
    let base = shop(4, 20).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "status": 429, "retry_after": "0", "every": 4, "latency_ms": 0}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        workers: 2,
        crawl: "retry_budget = 1.0\nattempts = 20\nshed_after = \"100ms\"",
        listen: &listen,
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let sampler = {
        let (stop, listen) = (stop.clone(), listen.clone());
        tokio::spawn(async move {
            let mut most = 0.0_f64;
            while !stop.is_cancelled() {
                if let Some(n) = metric(&listen, "seedlock_crawl_shed_total{bot=\"shop\"}").await {
                    most = most.max(n);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let shed = sampler.await.unwrap();
    assert!(
        shed >= 1.0,
        "detail pages waiting on a throttling host were shed: {shed}"
    );
    // Deferred, not lost: every product is stored.
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_bounds_the_urls_leased_by_the_queue_sizes() {
    let db = test_db("flow_slow_store").await;
    let base = shop(10, 20).await;
    // At most: 4 waiting for their host + 4 fetching + (2 queued + 1 parsing) + (2 queued + 1
    // being written).
    let bound = 4 + 4 + 3 + 3;
    let setup = Setup {
        workers: 4,
        crawl: "host_queue = 4\nwriters = 1\nparsers = 1\nparse_queue = 2\nstore_queue = 2\nstore_delay = \"30ms\"",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let sampler = {
        let stop = stop.clone();
        let frontier = db.db.collection::<Document>("frontier");
        tokio::spawn(async move {
            let mut most = 0;
            while !stop.is_cancelled() {
                let leased = frontier
                    .count_documents(doc! { "status": "leased" })
                    .await
                    .unwrap();
                most = most.max(leased);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            most
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let most = sampler.await.unwrap();
    assert!(most <= bound, "leased URLs peaked at {most}, above {bound}");
    assert!(
        most >= 6,
        "the pipeline filled up behind the slow store: {most}"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crawl_command_finishes_one_bot_and_prints_a_summary() {
    use common::{url_bot, Proc, ProcConfig};
    let db = test_db("crawl_command").await;
    let base = shop(2, 5).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/SKU-0000003", "status": 403}]),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let bots = format!(
        "{}{}",
        crawl_bot_toml(&base),
        url_bot("plain", &format!("{base}/seeds.txt"))
    );
    let config = ProcConfig::new(&db, bots).write(dir.path());
    let mut crawl = Proc::spawn(dir.path(), &config, "c", &["crawl", "shop"], &[]);
    let status = crawl.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(0), "{}", crawl.log());
    let out = crawl.out();
    assert!(
        out.starts_with("shop pass=1 finished: 12 pages (11 done, 1 failed) in "),
        "{out}"
    );
    assert!(
        out.contains("failed: http://") && out.contains("/product/SKU-0000003 — HTTP 403"),
        "{out}"
    );
    assert_eq!(live_records(&db).await.len(), 9);
    // Only the named bot ran.
    assert!(db.doc("plain").await.is_none());
    // A bot without [bots.crawl], or none at all: exit 2, one line.
    for (bot, says) in [
        ("plain", "has no [bots.crawl] section"),
        ("nosuch", "no bot \"nosuch\""),
    ] {
        let mut p = Proc::spawn(dir.path(), &config, "u", &["crawl", bot], &[]);
        assert_eq!(p.wait(Duration::from_secs(30)).await.code(), Some(2));
        let log = p.log();
        assert!(log.contains(says) && log.lines().count() == 1, "{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_slow_page_is_in_flight_and_nothing_is_pending_the_leaser_waits_instead_of_polling()
{
    let db = test_db("flow_dry_spell").await;
    // Listing page 2 takes 3 s; once page 1's products are done, it is the only page in flight
    // and the frontier has nothing pending until it is read.
    let base = shop(2, 5).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/list/2", "latency_ms": 3000}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        listen: &listen,
        timeout: "10s",
        lease: "20s",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let empty_attempts = sampler(
        listen.clone(),
        r#"seedlock_crawl_lease_queries_total{bot="shop",kind="empty"}"#.into(),
        stop.clone(),
    );
    let started = std::time::Instant::now();
    once(settings(&db, &base, &setup, "a")).await;
    let took = started.elapsed();
    stop.cancel();
    let empty = empty_attempts
        .await
        .unwrap()
        .into_iter()
        .fold(0.0_f64, f64::max);
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "the crawl completes"
    );
    assert!(
        took >= Duration::from_secs(3),
        "the slow page was waited for: {took:?}"
    );
    // Without the wait, four lease queries in flight go round as fast as the database answers
    // (thousands in 3 s); with it, the pauses grow from 20 ms to 500 ms: about a dozen.
    assert!(
        empty <= 40.0,
        "{empty} empty lease attempts while one slow page was in flight for 3 s"
    );
}
