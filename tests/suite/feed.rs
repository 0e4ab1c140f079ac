//! The change feed and the drift gate against the demo shop: every change of the shop's
//! mutation log is one released event and nothing else is, with transactions off and on;
//! events stay invisible until their pass is released; a layout drift and a mass removal gate a
//! pass, which an operator releases or discards; `seedlock changes --follow` resumes where it
//! stopped; `export --delta` writes the same events.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use bson::{Bson, Document};
use kit::crawl::*;
use kit::test_db;
use serde_json::json;

use crate::kit;

/// The shop's HTML rules with `drift` lines under `[bots.crawl.drift]`.
fn rules_with_drift(base: &str, drift: &str) -> String {
    let host = base.trim_start_matches("http://");
    format!(
        "{}[bots.crawl.drift]\n{drift}\n",
        seedlock::demo_site::crawl_rules_toml(&[host], ".sku")
    )
}

/// A record's data field as the shop's truth gives it (title, price, status).
fn field<'a>(
    truth: &'a HashMap<String, (String, String, String)>,
    key: &str,
    name: &str,
) -> &'a str {
    let (title, price, status) = &truth[key];
    match name {
        "title" => title,
        "price" => price,
        "status" => status,
        other => panic!("no field {other}"),
    }
}

async fn every_change_is_one_event(transactions: &str) {
    let db = test_db(&format!("feed_once_{transactions}")).await;
    let base = shop(5, 20).await;
    let setup = Setup {
        transactions,
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let first = truth(&base).await;
    let events1 = events(&db).await;
    assert_eq!(events1.len(), 100, "one `added` per product");
    assert_eq!(keys_of(&events1, 1, "added").len(), 100);
    for e in &events1 {
        let key = e.get_str("naturalKey").unwrap();
        let fields = e.get_document("fields").unwrap();
        for name in ["title", "price", "status"] {
            let change = fields.get_document(name).unwrap();
            assert_eq!(change.get("from"), Some(&Bson::Null), "{e}");
            assert_eq!(
                change.get_str("to").unwrap(),
                field(&first, key, name),
                "{e}"
            );
        }
    }
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 6, "add": 3, "delete": 2}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let changed: Vec<String> = skus(&report, "changed")
        .into_iter()
        .filter(|s| !deleted.contains(s))
        .collect();
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let now = truth(&base).await;
    let all = events(&db).await;
    let events2: Vec<Document> = all
        .iter()
        .filter(|e| e.get_i64("pass").unwrap() == 2)
        .cloned()
        .collect();
    assert_eq!(keys_of(&events2, 2, "added"), skus(&report, "added"));
    assert_eq!(keys_of(&events2, 2, "changed"), changed);
    assert_eq!(keys_of(&events2, 2, "removed"), deleted);
    assert_eq!(
        events2.len(),
        changed.len() + 3 + deleted.len(),
        "nothing else: {events2:?}"
    );
    for e in events2
        .iter()
        .filter(|e| e.get_str("kind").unwrap() == "changed")
    {
        let key = e.get_str("naturalKey").unwrap();
        let price = e
            .get_document("fields")
            .unwrap()
            .get_document("price")
            .unwrap();
        assert_eq!(price.get_str("from").unwrap(), field(&first, key, "price"));
        assert_eq!(price.get_str("to").unwrap(), field(&now, key, "price"));
        assert_eq!(
            e.get_document("fields").unwrap().len(),
            1,
            "only the price moved: {e}"
        );
    }
    // Numbered once each, in order, with no gap.
    let seqs: Vec<i64> = all.iter().map(|e| e.get_i64("seq").unwrap()).collect();
    assert_eq!(seqs, (1..=all.len() as i64).collect::<Vec<_>>());
    // A pass that finds nothing changed adds nothing.
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(events(&db).await.len(), all.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_of_the_shop_is_one_event_and_nothing_else_is_without_transactions() {
    every_change_is_one_event("off").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_of_the_shop_is_one_event_and_nothing_else_is_in_transactions() {
    every_change_is_one_event("on").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_drift_gates_the_pass_its_events_stay_invisible_until_it_is_released() {
    let db = test_db("feed_drift_release").await;
    let base = shop(3, 20).await;
    let setup = Setup {
        rules: Some(rules_with_drift(&base, "")),
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(events(&db).await.len(), 60);
    // The shop renames the price's class: every listing fingerprint moves, every product page
    // is read again, and the price selector matches nothing.
    post(&format!("{base}/__layout"), json!({"price_class": "cost"})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let doc = bot_doc(&db).await;
    let gate = doc
        .get_document("crawlFeed")
        .unwrap()
        .get_document("gate")
        .unwrap_or_else(|_| panic!("pass 2 is gated: {doc}"));
    assert_eq!(gate.get_i64("pass").unwrap(), 2);
    let reasons: Vec<&str> = gate
        .get_array("reasons")
        .unwrap()
        .iter()
        .filter_map(Bson::as_str)
        .collect();
    assert_eq!(reasons, vec!["field price filled 0% (last pass 100%)"]);
    // The crawl's truth is kept: the records hold what the pages showed.
    for r in records(&db).await {
        assert_eq!(
            r.get_document("data").unwrap().get("price"),
            Some(&Bson::Null),
            "{r}"
        );
    }
    // Staged, not visible.
    assert_eq!(
        events(&db).await.len(),
        60,
        "pass 2's events are not visible"
    );
    assert_eq!(staged_events(&db).await.len(), 120);
    let status = String::from_utf8(kit::run_cli(&db, &["status"]).await.stdout).unwrap();
    assert!(
        status.contains("pass 2 gated: field price filled 0% (last pass 100%)"),
        "{status}"
    );
    use seedlock::store::release::Settle;
    assert!(settle(&db, 2, Settle::Release).await.is_some());
    let all = events(&db).await;
    assert_eq!(all.len(), 120);
    assert_eq!(keys_of(&all, 2, "changed").len(), 60);
    // Released once: a second release finds nothing gated.
    assert_eq!(settle(&db, 2, Settle::Release).await, None);
    // The released pass is the new baseline: the same layout gates nothing.
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert!(bot_doc(&db)
        .await
        .get_document("crawlFeed")
        .unwrap()
        .get("gate")
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_gated_pass_releases_nothing_and_the_next_pass_compares_with_the_last_released()
{
    let db = test_db("feed_drift_discard").await;
    let base = shop(3, 20).await;
    let setup = Setup {
        rules: Some(rules_with_drift(&base, "min_records = 1")),
        ..Setup::default()
    };
    let gate = |doc: Document| {
        doc.get_document("crawlFeed")
            .unwrap()
            .get_document("gate")
            .ok()
            .cloned()
    };
    once(settings(&db, &base, &setup, "a")).await;
    post(&format!("{base}/__layout"), json!({"price_class": "cost"})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let out = kit::run_cli(&db, &["pass", "discard", "shop", "2"]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("pass 2 discarded"),
        "{out:?}"
    );
    assert_eq!(
        staged_events(&db).await.len(),
        60,
        "pass 2's events are gone"
    );
    let again = kit::run_cli(&db, &["pass", "discard", "shop", "2"]).await;
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stderr)
            .contains("pass 2 is not gated (no pass is gated now)"),
        "{again:?}"
    );
    // Still drifted, one product added: pass 3 writes one record, without a price. Compared
    // with the discarded pass 2 (0% filled) it would pass; compared with pass 1, the last
    // released (100%), it is gated.
    post(&format!("{base}/__mutate"), json!({"add": 1})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let gated = gate(bot_doc(&db).await).expect("pass 3 is gated");
    assert_eq!(gated.get_i64("pass").unwrap(), 3, "{gated}");
    assert_eq!(
        events(&db).await.len(),
        60,
        "only pass 1's events are visible"
    );
    // The shop is fixed; pass 4's end discards the unsettled pass 3, and pass 4 is released.
    kit::crawl::delete(&format!("{base}/__layout")).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let doc = bot_doc(&db).await;
    assert_eq!(gate(doc.clone()), None, "{doc}");
    assert_eq!(
        doc.get_document("crawlFeed")
            .unwrap()
            .get_i64("pass")
            .unwrap(),
        4
    );
    let all = events(&db).await;
    assert!(
        all.iter()
            .all(|e| [1, 4].contains(&e.get_i64("pass").unwrap())),
        "{all:?}"
    );
    // Pass 4 read every product again (their fingerprints moved back): each one's price came
    // back, the product pass 3 added included.
    assert_eq!(keys_of(&all, 4, "changed").len(), 61);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mass_removal_is_held_until_released_then_applied_with_its_events() {
    let db = test_db("feed_mass_removal").await;
    let base = shop(4, 10).await;
    let setup = Setup {
        rules: Some(rules_with_drift(&base, "max_removed = 0.2")),
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let report = post(&format!("{base}/__mutate"), json!({"delete": 9})).await;
    let deleted = skus(&report, "deleted");
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    let gate = bot_doc(&db)
        .await
        .get_document("crawlFeed")
        .unwrap()
        .get_document("gate")
        .unwrap()
        .clone();
    let reasons: Vec<&str> = gate
        .get_array("reasons")
        .unwrap()
        .iter()
        .filter_map(Bson::as_str)
        .collect();
    assert_eq!(
        reasons,
        vec!["would remove 9 of 40 records (22.5%, more than 20.0%)"]
    );
    assert!(
        removed_keys(&db).await.is_empty(),
        "nothing removed while gated"
    );
    let out = kit::run_cli(&db, &["pass", "release", "shop", "2"]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("9 held removals applied"),
        "{out:?}"
    );
    assert_eq!(removed_keys(&db).await, deleted);
    assert_eq!(keys_of(&events(&db).await, 2, "removed"), deleted);
    // Within the threshold, a pass removes without a gate.
    let report = post(&format!("{base}/__mutate"), json!({"delete": 2, "add": 2})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert!(bot_doc(&db)
        .await
        .get_document("crawlFeed")
        .unwrap()
        .get("gate")
        .is_none());
    assert_eq!(
        keys_of(&events(&db).await, 3, "removed"),
        skus(&report, "deleted")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_follow_resumes_after_a_restart_without_gaps_or_repeats() {
    use kit::{Proc, ProcConfig};
    let db = test_db("feed_follow").await;
    let base = shop(2, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let config = ProcConfig::new(&db, crawl_bot_toml(&base)).write(dir.path());
    let mut reader = Proc::spawn(
        dir.path(),
        &config,
        "r1",
        &["changes", "shop", "--follow", "--json"],
        &[],
    );
    let seen = |p: &Proc| -> Vec<Document> {
        p.out()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| {
                bson::to_document(&serde_json::from_str::<serde_json::Value>(l).unwrap()).unwrap()
            })
            .collect()
    };
    kit::eventually(
        "the first pass's events",
        Duration::from_secs(30),
        || async { seen(&reader).len() == 20 },
    )
    .await;
    // A release while it waits reaches it.
    post(&format!("{base}/__mutate"), json!({"change": 3})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    kit::eventually("pass 2's events", Duration::from_secs(30), || async {
        seen(&reader).len() == 23
    })
    .await;
    let mut got = seen(&reader);
    let last = got
        .last()
        .unwrap()
        .get("seq")
        .and_then(|v| v.as_i64())
        .unwrap();
    reader.kill9().await;
    // Released while no reader runs.
    post(&format!("{base}/__mutate"), json!({"change": 4, "add": 1})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let since = last.to_string();
    let mut again = Proc::spawn(
        dir.path(),
        &config,
        "r2",
        &["changes", "shop", "--follow", "--json", "--since", &since],
        &[],
    );
    kit::eventually("pass 3's events", Duration::from_secs(30), || async {
        seen(&again).len() == 5
    })
    .await;
    got.extend(seen(&again));
    again.kill9().await;
    let seqs: Vec<i64> = got
        .iter()
        .map(|e| e.get("seq").and_then(|v| v.as_i64()).unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=28).collect::<Vec<_>>(),
        "every event once, in order"
    );
    let stored: Vec<i64> = events(&db)
        .await
        .iter()
        .map(|e| e.get_i64("seq").unwrap())
        .collect();
    assert_eq!(seqs, stored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_delta_writes_the_released_events_of_a_pass_and_later_ones() {
    let db = test_db("feed_export_delta").await;
    let base = shop(2, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let report = post(&format!("{base}/__mutate"), json!({"change": 2, "add": 1})).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let out = kit::run_cli(
        &db,
        &[
            "export",
            "shop",
            "--delta",
            "--since-pass",
            "2",
            "--format",
            "csv",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("seq,pass,kind,naturalKey,recordId,field,from,to,at")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let changed: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r[2] == "changed")
        .map(|r| r[3])
        .collect();
    let want = skus(&report, "changed");
    assert_eq!(changed, want.iter().map(String::as_str).collect());
    assert!(
        rows.iter()
            .filter(|r| r[2] == "changed")
            .all(|r| r[5] == "price"),
        "{text}"
    );
    // The added product: one row per field.
    assert_eq!(rows.iter().filter(|r| r[2] == "added").count(), 3, "{text}");
    assert!(rows.iter().all(|r| r[1] == "2"), "{text}");
    let json = kit::run_cli(&db, &["export", "shop", "--delta", "--since-pass", "1"]).await;
    assert_eq!(
        String::from_utf8(json.stdout).unwrap().lines().count(),
        20 + 3
    );
}

/// A webhook receiver on a fixed address: it answers 500 to its first `fail` requests, then 200,
/// and keeps every request it answered 200 (the `Idempotency-Key` and the body).
struct Receiver {
    got: std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>,
    stop: tokio_util::sync::CancellationToken,
    served: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(
        addr: &str,
        fail: usize,
        got: std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>,
    ) -> Receiver {
        use axum::{http::HeaderMap, http::StatusCode, routing::post, Json, Router};
        let failed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let kept = got.clone();
        let app = Router::new().route(
            "/hook",
            post(
                move |headers: HeaderMap, Json(body): Json<serde_json::Value>| {
                    let (kept, failed) = (kept.clone(), failed.clone());
                    async move {
                        if failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < fail {
                            return StatusCode::INTERNAL_SERVER_ERROR;
                        }
                        let key = headers
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        kept.lock().unwrap().push((key, body));
                        StatusCode::OK
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let until = stop.clone();
        let served = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { until.cancelled().await })
                .await
                .unwrap();
        });
        Receiver { got, stop, served }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.served.await.unwrap();
    }

    /// The event keys received, in order (repeats included).
    fn keys(&self) -> Vec<String> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(_, body)| {
                body["events"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e["key"].as_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_gets_every_event_through_failures_and_restarts_with_keys_that_dedupe_repeats()
{
    use seedlock::daemon::{run, Mode};
    let db = test_db("feed_webhook").await;
    let base = shop(2, 10).await;
    let addr = free_addr();
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    // The receiver fails its first two requests.
    let receiver = Receiver::start(&addr, 2, got.clone()).await;
    let listen = free_addr();
    let host = base.trim_start_matches("http://");
    let rules = format!(
        "{}[bots.crawl.notify]\nurl = \"http://{addr}/hook\"\nbatch = 6\nheaders = {{ Authorization = \"Bearer t\" }}\n",
        seedlock::demo_site::crawl_rules_toml(&[host], ".sku")
    );
    let setup = Setup {
        rules: Some(rules),
        listen: &listen,
        ..Setup::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let daemon = tokio::spawn(run(
        settings(&db, &base, &setup, "a"),
        Mode::Daemon,
        stop.clone(),
    ));
    kit::eventually(
        "pass 1's 20 events delivered",
        Duration::from_secs(60),
        || async { receiver.keys().len() >= 20 },
    )
    .await;
    assert_eq!(
        metric(&listen, r#"seedlock_webhook_failures_total{bot="shop"}"#).await,
        Some(2.0)
    );
    // Batches of one pass, at most 6 events, keyed by their first event.
    for (key, body) in got.lock().unwrap().iter() {
        let events = body["events"].as_array().unwrap();
        assert!(!events.is_empty() && events.len() <= 6, "{body}");
        assert_eq!(key, events[0]["key"].as_str().unwrap());
        assert!(events.iter().all(|e| e["pass"] == body["pass"]), "{body}");
    }
    // The receiver goes away; pass 2 is released meanwhile; the instance stops and starts again.
    receiver.stop().await;
    post(&format!("{base}/__mutate"), json!({"change": 4})).await;
    request_refresh(&db).await;
    kit::eventually("pass 2 released", Duration::from_secs(60), || async {
        keys_of(&events(&db).await, 2, "changed").len() == 4
    })
    .await;
    kit::eventually("a delivery failed", Duration::from_secs(30), || async {
        metric(&listen, r#"seedlock_webhook_failures_total{bot="shop"}"#)
            .await
            .is_some_and(|n| n >= 3.0)
    })
    .await;
    stop.cancel();
    daemon.await.unwrap().unwrap();
    let before_restart = got.lock().unwrap().len();
    let receiver = Receiver::start(&addr, 0, got.clone()).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let daemon = tokio::spawn(run(
        settings(&db, &base, &setup, "a"),
        Mode::Daemon,
        stop.clone(),
    ));
    kit::eventually(
        "pass 2's events delivered",
        Duration::from_secs(60),
        || async {
            let keys: BTreeSet<String> = receiver.keys().into_iter().collect();
            keys.len() == 24
        },
    )
    .await;
    stop.cancel();
    daemon.await.unwrap().unwrap();
    // Every event's key, once each after deduplication, and nothing else.
    let expected: BTreeSet<String> = events(&db)
        .await
        .iter()
        .map(|e| {
            format!(
                "shop:{}:{}",
                e.get_i64("pass").unwrap(),
                e.get_i64("seq").unwrap()
            )
        })
        .collect();
    let received: BTreeSet<String> = receiver.keys().into_iter().collect();
    assert_eq!(received, expected);
    // Resumed from the stored position: after the restart only pass 2 was sent.
    let after: Vec<String> = got.lock().unwrap()[before_restart..]
        .iter()
        .flat_map(|(_, b)| {
            b["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["key"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(after.iter().all(|k| k.starts_with("shop:2:")), "{after:?}");
    receiver.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bots_apply_check_catches_a_selector_typo_on_stored_pages_and_writes_nothing() {
    use kit::{Proc, ProcConfig};
    let db = test_db("feed_apply_check").await;
    let base = shop(2, 10).await;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let good = file("bots.toml", crawl_bot_toml(&base));
    let out = kit::run_cli(&db, &["bots", "apply", &good]).await;
    assert!(out.status.success(), "{out:?}");
    // A bot with no stored records yet says so and passes.
    let typo = file(
        "typo.toml",
        crawl_bot_toml(&base).replace(r#"price = ".price""#, r#"price = ".prise""#),
    );
    let early = kit::run_cli(&db, &["bots", "apply", "--check", &typo]).await;
    assert!(early.status.success(), "{early:?}");
    assert!(
        String::from_utf8_lossy(&early.stdout).contains("no stored records to compare with"),
        "{early:?}"
    );
    let config = ProcConfig::new(&db, String::new()).write(dir.path());
    let mut crawl = Proc::spawn(dir.path(), &config, "c", &["run", "--once"], &[]);
    crawl.expect_ok(Duration::from_secs(60)).await;
    assert_eq!(records(&db).await.len(), 20);
    let version = bot_doc(&db).await.get("specVersion").cloned();
    Requests::take(&base).await;

    let out = kit::run_cli(&db, &["bots", "apply", "--check", &typo]).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(stdout.contains("shop: changed"), "{stdout}");
    assert!(
        stdout.contains("20 stored pages read with the new spec"),
        "{stdout}"
    );
    let row = |name: &str| -> Vec<String> {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row {name}: {stdout}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(row("price"), ["price", "0", "0", "20"], "{stdout}");
    assert_eq!(row("title"), ["title", "20", "0", "0"], "{stdout}");
    assert!(
        stdout.contains("would go missing on more than 20% of the sample: price"),
        "{stdout}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing written"),
        "{out:?}"
    );
    // It read the stored pages (and robots.txt), one at a time, and wrote nothing.
    assert_eq!(Requests::take(&base).await.under("/product/"), 20);
    assert_eq!(bot_doc(&db).await.get("specVersion").cloned(), version);
    // A change that reads the same passes.
    let same = file("same.toml", crawl_bot_toml_every(&base, "2h"));
    let out = kit::run_cli(&db, &["bots", "apply", "--check", &same]).await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let price: Vec<&str> = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("price "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(price, ["price", "20", "0", "0"], "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_of_more_events_than_one_insert_numbers_each_once_in_order() {
    // 2,500 products: the pass's end stages its events in three inserts.
    let db = test_db("feed_many").await;
    let base = shop(25, 100).await;
    let setup = Setup {
        rules: Some(rules_with_drift(&base, "")),
        workers: 16,
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let all = events(&db).await;
    assert_eq!(all.len(), 2_500);
    let seqs: Vec<i64> = all.iter().map(|e| e.get_i64("seq").unwrap()).collect();
    assert_eq!(seqs, (1..=2_500).collect::<Vec<_>>());
    let keys: BTreeSet<&str> = all
        .iter()
        .map(|e| e.get_str("naturalKey").unwrap())
        .collect();
    assert_eq!(keys.len(), 2_500);
    assert_eq!(
        bot_doc(&db)
            .await
            .get_document("crawlFeed")
            .unwrap()
            .get_i64("seq")
            .unwrap(),
        2_500
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_whose_events_are_all_inserted_reads_its_pending_events_and_the_highest_number_once()
{
    // The highest number is read beside the pending events; read back after the inserts only
    // when one was refused (a staging repeated).
    let db = test_db("feed_one_read").await;
    let base = shop(5, 20).await;
    let (store, sent) = monitored_store(&db.uri, &db.name).await;
    let counted = store.clone();
    once_on(settings(&db, &base, &Setup::default(), "a"), store).await;
    assert_eq!(
        counted.command_counts().get("read pending events"),
        Some(&1),
        "the pending events' read is one command, not one per record"
    );
    let highest_reads = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, body)| {
            name == "find" && body.get_str("find") == Ok("changes") && body.contains_key("sort")
        })
        .count();
    assert_eq!(highest_reads, 1, "one read of the highest event number");
    let all = events(&db).await;
    assert_eq!(all.len(), 100);
    let last = all.iter().map(|e| e.get_i64("seq").unwrap()).max().unwrap();
    assert_eq!(last, 100);
    let feed = bot_doc(&db).await;
    let feed = feed.get_document("crawlFeed").unwrap();
    assert_eq!(
        feed.get_i64("seq").unwrap(),
        last,
        "the feed's last number: {feed}"
    );
}
