//! Incremental passes against the demo shop (seed 003): each mode fetches only what it should,
//! conditional GETs, deletion detection and its thresholds, a broken pagination chain mended.
#![allow(clippy::bool_assert_comparison)]

mod common;

use std::collections::HashMap;

use bson::{doc, Bson, Document};
use common::crawl::*;
use common::test_db;
use serde_json::{json, Value};

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
async fn a_record_marked_removed_that_a_listing_page_shows_again_is_restored() {
    // A listing that changes while a pass reads it can hide an item from that pass (items deleted
    // above it move it onto a page already read), and deletion detection marks it removed. The
    // next pass that sees it on a listing page — without fetching its unchanged detail page —
    // must take the mark back.
    let db = test_db("crawl_restored").await;
    let base = shop(3, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let hidden: Vec<Document> = records(&db).await.into_iter().take(5).collect();
    for r in &hidden {
        db.db
            .collection::<Document>("records")
            .update_one(
                doc! {"_id": r.get_str("_id").unwrap()},
                doc! {"$set": {"removedAt": bson::DateTime::now(), "removedInPass": 1_i64}},
            )
            .await
            .unwrap();
    }
    assert_eq!(removed_keys(&db).await.len(), 5);
    Requests::take(&base).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    // Only the listing pages were read; every item is back.
    assert_eq!(Requests::take(&base).await.under("/product/"), 0);
    assert_eq!(removed_keys(&db).await, Vec::<String>::new());
    let restored = records(&db).await;
    assert!(restored
        .iter()
        .all(|r| r.get("removedInPass") == Some(&Bson::Null)));
    assert_eq!(live_records(&db).await, truth(&base).await);
}
