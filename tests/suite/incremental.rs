//! Incremental passes against the demo shop (seed 003): each mode fetches only what it should,
//! conditional GETs, deletion detection and its thresholds, a broken pagination chain mended.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;
use crate::kit::frontier::{OnePage, OneUrl};

use seedlock::ids::PassNumber;
use std::collections::HashMap;

use bson::{doc, Bson, Document};
use kit::crawl::*;
use kit::test_db;
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
    // An unchanged record's document is not written at all in the second pass; a changed one
    // is rewritten, `lastChanged` moved.
    let changed: Vec<&str> = report["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let mut unchanged = 0;
    for r in records(&db).await {
        let key = r.get_str("naturalKey").unwrap();
        let Some(old) = before.get(key) else { continue };
        if deleted.iter().any(|d| d == key) {
            continue;
        }
        if changed.contains(&key) {
            assert_ne!(
                r.get("lastChanged"),
                old.get("lastChanged"),
                "{key} changed"
            );
            assert_eq!(
                r.get_i64("fetchedPass").unwrap(),
                2,
                "{key} fetched in pass 2"
            );
        } else {
            assert_eq!(&r, old, "{key}: an unchanged record is not written");
            unchanged += 1;
        }
    }
    let expected = before
        .keys()
        .filter(|k| !deleted.contains(k) && !changed.contains(&k.as_str()))
        .count();
    assert!(
        expected > 80,
        "most of the catalog is unchanged ({expected})"
    );
    assert_eq!(unchanged, expected, "every unchanged record compared");
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
    let before: HashMap<String, Document> = records(&db)
        .await
        .into_iter()
        .map(|r| (r.get_str("naturalKey").unwrap().to_owned(), r))
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
        assert_eq!(Some(&r), before.get(key), "304: {key} not written");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pass_writes_only_what_changed_however_the_pagination_shifted() {
    // Five items added at the top of the shop shift every later item onto another page: every
    // listing page's list changes, and none of that is a write. The second pass writes exactly
    // the changed, the added and the removed records, and reads no listed item one by one
    // except those no manifest lists.
    let db = test_db("crawl_manifests").await;
    let base = shop(10, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let before: HashMap<String, Document> = records(&db)
        .await
        .into_iter()
        .map(|r| (r.get_str("naturalKey").unwrap().to_owned(), r))
        .collect();
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 3, "add": 5, "delete": 2}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let changed: Vec<String> = skus(&report, "changed")
        .into_iter()
        .filter(|s| !deleted.contains(s))
        .collect();
    let added = skus(&report, "added");
    let writes = WriteCount::start(&db, "records").await;
    let frontier_writes = WriteCount::start(&db, "frontier").await;
    request_refresh(&db).await;
    let (store, sent) = monitored_store(&db.uri, &db.name).await;
    once_on(settings(&db, &base, &Setup::default(), "a"), store).await;
    let writes = writes.stop().await;
    let frontier_writes = frontier_writes.stop().await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(
        removed_keys(&db).await,
        deleted,
        "exactly the deleted removed"
    );
    let written: u64 = writes.values().sum();
    assert_eq!(
        written as usize,
        changed.len() + added.len() + deleted.len(),
        "record documents written = changed + added + removed ({writes:?})"
    );
    for r in records(&db).await {
        let key = r.get_str("naturalKey").unwrap();
        if !changed.iter().any(|c| c == key) && !deleted.iter().any(|d| d == key) {
            if let Some(old) = before.get(key) {
                assert_eq!(&r, old, "{key} is unchanged and not written");
            }
        }
    }
    let listing_ids = listing_ids(&base, 11);
    // The changed items are known stored from the manifests: fetched without a read. Only the
    // new ones, which no manifest lists, are read one by one.
    assert_eq!(
        item_reads(&sent, &listing_ids),
        added.len(),
        "only the items no manifest lists were read one by one"
    );
    // Every listing page's done mark carried what it listed.
    let pages = frontier(
        &db,
        doc! { "kind": { "$in": ["list", "seed"] }, "pass": 2_i64 },
    )
    .await;
    assert_eq!(pages.len(), 11, "the shop has 11 pages now");
    let listed: usize = pages
        .iter()
        .map(|p| {
            assert_eq!(p.get_i64("listedPass").unwrap(), 2, "{p}");
            assert!(p.get_str("listedHash").is_ok(), "{p}");
            manifest_len(p).expect("a manifest")
        })
        .sum();
    assert_eq!(listed, truth(&base).await.len());
    // A listing page the last pass read is leased into this one straight from its entry: two
    // frontier writes a pass (that lease and its done mark), never a pending reset first. (The
    // new page 11 is inserted leased, then done: two as well.)
    for page in pages.iter().filter(|p| p.get_str("kind") == Ok("list")) {
        let id = Bson::String(page.get_str("_id").unwrap().to_owned()).to_string();
        assert_eq!(
            frontier_writes.get(&id),
            Some(&2),
            "frontier writes of {} in the second pass",
            page.get_str("url").unwrap()
        );
    }
    let last = bot_doc(&db)
        .await
        .get_document("crawlLastPass")
        .unwrap()
        .clone();
    assert_eq!(last.get_str("evaluation").unwrap(), "done", "{last}");
    assert_eq!(last.get_i64("removed").unwrap(), 2, "{last}");
    // A third pass over an unchanged shop: every page's baseline is what it lists — the
    // second pass's lists became the baselines, nothing piles up.
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    for page in frontier(
        &db,
        doc! { "kind": { "$in": ["list", "seed"] }, "pass": 3_i64 },
    )
    .await
    {
        assert_eq!(page.get_bool("listedSinceMore").unwrap(), false, "{page}");
        // Null: no more than what it lists.
        assert_eq!(page.get("listedSince"), Some(&Bson::Null), "{page}");
    }
    assert_eq!(removed_keys(&db).await, deleted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_remove_exactly_the_deleted_and_write_nothing_unchanged() {
    let db = test_db("crawl_manifests_three").await;
    let base = shop(20, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 6, "add": 12, "delete": 7}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    let changed = skus(&report, "changed")
        .into_iter()
        .filter(|s| !deleted.contains(s))
        .count();
    let writes = WriteCount::start(&db, "records").await;
    request_refresh(&db).await;
    let setup = Setup::default();
    tokio::join!(
        once(settings(&db, &base, &setup, "a")),
        once(settings(&db, &base, &setup, "b")),
        once(settings(&db, &base, &setup, "c")),
    );
    let written: u64 = writes.stop().await.values().sum();
    assert_eq!(live_records(&db).await, truth(&base).await);
    assert_eq!(removed_keys(&db).await, deleted);
    assert_eq!(written as usize, changed + 12 + deleted.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_added_in_an_incomplete_pass_and_gone_by_the_next_complete_one_is_removed() {
    // The next complete pass catches every departure since the last evaluation — also of items
    // that only an incomplete pass ever listed.
    let db = test_db("crawl_incomplete_added").await;
    // Small pages: the page the shop loses at the end is under 5% of the listing.
    let base = shop(20, 5).await;
    let setup = Setup {
        crawl: "attempts = 2",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let report = post(&format!("{base}/__mutate"), json!({"add": 3})).await;
    let added = skus(&report, "added");
    // Pass 2 cannot read listing page 4 of 21: coverage 95.2%… with the pages the chain did not
    // reach after it, under 95%: nothing is removed.
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/list/4", "status": 500}]),
    )
    .await;
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    for sku in &added {
        assert!(
            live_records(&db).await.contains_key(sku),
            "{sku} stored in pass 2"
        );
    }
    reqwest::Client::new()
        .delete(format!("{base}/__faults"))
        .send()
        .await
        .unwrap();
    // The added items go again, with two others.
    let report = post(
        &format!("{base}/__mutate"),
        json!({"remove": added, "delete": 2}),
    )
    .await;
    let deleted = skus(&report, "deleted");
    assert_eq!(deleted.len(), 5);
    request_refresh(&db).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(removed_keys(&db).await, deleted);
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detail_page_gone_while_listed_is_removed_and_the_next_listing_restores_it() {
    // A 404 or 410 marks the record removed at once; the listing still shows the item, and the
    // next pass that lists it — without fetching it — restores it (the listing is the evidence).
    let db = test_db("crawl_gone_listed").await;
    let base = shop(3, 10).await;
    let full = Setup {
        mode: "full",
        ..Setup::default()
    };
    once(settings(&db, &base, &full, "a")).await;
    let mut keys: Vec<String> = live_records(&db).await.into_keys().take(2).collect();
    keys.sort();
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{}", keys[0]), "status": 404},
            {"path": format!("/product/{}", keys[1]), "status": 410},
        ]),
    )
    .await;
    request_refresh(&db).await;
    once(settings(&db, &base, &full, "a")).await;
    assert_eq!(
        removed_keys(&db).await,
        keys,
        "removed by their pages' answers"
    );
    reqwest::Client::new()
        .delete(format!("{base}/__faults"))
        .send()
        .await
        .unwrap();
    Requests::take(&base).await;
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(Requests::take(&base).await.under("/product/"), 0);
    assert!(removed_keys(&db).await.is_empty(), "listed again: restored");
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_written_by_the_previous_version_keeps_working() {
    // Yesterday's documents: records with `lastSeen`/`lastSeenPass` and no `fetchedPass`,
    // listing pages without manifests, a last pass evaluated the old way, the retired indexes.
    let db = test_db("crawl_upgrade").await;
    let base = shop(5, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let frontier_docs = db.db.collection::<Document>("frontier");
    let record_docs = db.db.collection::<Document>("records");
    frontier_docs
        .update_many(
            doc! {},
            doc! { "$unset": {
                "listed": "", "listedFp": "", "listedFetch": "", "listedHash": "", "listedPass": "",
                "listedSince": "", "listedSinceMore": "",
            } },
        )
        .await
        .unwrap();
    record_docs
        .update_many(
            doc! {},
            doc! {
                "$set": { "lastSeen": bson::DateTime::now(), "lastSeenPass": 1_i64 },
                "$unset": { "fetchedPass": "" },
            },
        )
        .await
        .unwrap();
    db.bots()
        .update_one(
            doc! { "_id": "shop" },
            doc! { "$unset": {
                "crawlLastPass.evaluation": "", "crawlLastPass.removed": "",
                "crawlLastPass.restored": "", "crawlLastPass.candidates": "",
                "crawlLastPass.changedPages": "", "crawlLastPass.evaluatedAt": "",
                "crawlLastPass.sweep": "",
            } },
        )
        .await
        .unwrap();
    for (name, keys) in [
        ("bot_last_seen_pass", doc! { "botId": 1, "lastSeenPass": 1 }),
        ("bot_list_key", doc! { "botId": 1, "listKey": 1 }),
    ] {
        let index = mongodb::IndexModel::builder()
            .keys(keys)
            .options(
                mongodb::options::IndexOptions::builder()
                    .name(name.to_owned())
                    .build(),
            )
            .build();
        record_docs.create_index(index).await.unwrap();
    }
    // Two items go while the old version is gone, two change.
    let report = post(
        &format!("{base}/__mutate"),
        json!({"change": 2, "delete": 2}),
    )
    .await;
    let mut deleted = skus(&report, "deleted");
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "nothing removed wrongly"
    );
    assert_eq!(
        removed_keys(&db).await,
        deleted,
        "the departed caught by the upgrade's sweep"
    );
    let indexes = record_docs.list_index_names().await.unwrap();
    assert!(
        !indexes
            .iter()
            .any(|n| n == "bot_last_seen_pass" || n == "bot_list_key"),
        "retired indexes dropped: {indexes:?}"
    );
    let pages = frontier(&db, doc! { "kind": "list", "pass": 2_i64 }).await;
    assert!(
        !pages.is_empty() && pages.iter().all(|p| manifest_len(p).is_some()),
        "manifests built: {} listing pages",
        pages.len()
    );
    // From here on the manifests carry deletion detection.
    let report = post(&format!("{base}/__mutate"), json!({"delete": 1})).await;
    deleted.extend(skus(&report, "deleted"));
    deleted.sort();
    request_refresh(&db).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(removed_keys(&db).await, deleted);
    assert_eq!(live_records(&db).await, truth(&base).await);
    let last = bot_doc(&db)
        .await
        .get_document("crawlLastPass")
        .unwrap()
        .clone();
    assert!(
        !last.contains_key("sweep") || last.get_bool("sweep") == Ok(false),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_item_fetched_without_a_read_whose_page_is_gone_is_removed() {
    // A changed item is fetched without a read of its frontier entry (the manifests say it is
    // stored); a 404 or 410 still finds the record to mark removed.
    let db = test_db("crawl_changed_gone").await;
    let base = shop(3, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    let report = post(&format!("{base}/__mutate"), json!({"change": 2})).await;
    let changed = skus(&report, "changed");
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{}", changed[0]), "status": 404},
            {"path": format!("/product/{}", changed[1]), "status": 410},
        ]),
    )
    .await;
    request_refresh(&db).await;
    let (store, sent) = monitored_store(&db.uri, &db.name).await;
    once_on(settings(&db, &base, &Setup::default(), "a"), store).await;
    assert_eq!(removed_keys(&db).await, changed);
    // No read decided their fetch; a page leased on enqueue (without its entry) reads the
    // entry's record id at its 404/410, one leased by a lease round has it already.
    assert!(
        item_reads(&sent, &listing_ids(&base, 3)) <= changed.len(),
        "only the gone pages' entries may be read"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_without_its_mark_whose_page_is_then_gone_is_removed() {
    // In a running pass, a worker stores a product's record and its done mark is refused (its
    // lease was taken over; a kill between the two writes leaves the same), and the product is
    // gone before its page is fetched again. The crawl that finds the page gone must mark that
    // record removed although the frontier entry never learned the record's id — no listing
    // shows the item, so nothing else would.
    use seedlock::ids::{BotId, InstanceId};
    use seedlock::store::frontier::{LeaseTo, NewUrl, PageKind};
    use seedlock::store::records::Extracted;
    use seedlock::urls::NormalizedUrl;
    use std::collections::HashMap;
    use std::time::Duration;

    let db = test_db("crawl_orphan_gone").await;
    let base = shop(2, 5).await;
    // Both listing pages answer after 4 s (within `crawl.timeout`): the pass is open, and
    // nothing but the test's page is pending meanwhile.
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": "/list/1", "latency_ms": 4000},
            {"path": "/list/2", "latency_ms": 4000},
        ]),
    )
    .await;
    let full = Setup {
        mode: "full",
        lease: "30s",
        timeout: "6s",
        ..Setup::default()
    };
    let crawl = tokio::spawn(once(settings(&db, &base, &full, "a")));
    let pass = eventually_pass(&db).await;

    // A product the shop no longer has (its page answers 404), stored by a worker in this pass.
    let (bot, sku) = (BotId::parse("shop").unwrap(), "SKU-9999999".to_owned());
    let url = NormalizedUrl::parse(&format!("{base}/product/{sku}")).unwrap();
    let store = db.store();
    // The page is enqueued already leased to "dying" (a pending page would be the crawl's to take)
    // and taken over by "taker", both 5 s ahead of the crawl's clock, so the crawl cannot lease it
    // first; both leases last 1 ms, and once its clock passes them the crawl leases the page a
    // third time (the pass cannot end before: the page is in it).
    let at = chrono::Utc::now() + chrono::Duration::seconds(5);
    let (dying_id, taker_id) = (
        InstanceId::parse("dying").unwrap(),
        InstanceId::parse("taker").unwrap(),
    );
    let lease_for = Duration::from_millis(1);
    let enqueued = store
        .frontier()
        .enqueue_links(
            &bot,
            PassNumber::new(pass),
            &[NewUrl {
                url: url.clone(),
                kind: PageKind::Detail,
                fingerprint: None,
                priority: 0,
                depth: 1,
            }],
            &HashMap::new(),
            Some(LeaseTo {
                me: &dying_id,
                lease_for,
                first: 1,
            }),
            at,
        )
        .await
        .unwrap();
    let frontier = || async {
        let found = db
            .db
            .collection::<Document>("frontier")
            .find(doc! {})
            .projection(doc! { "url": 1, "status": 1, "leaseOwner": 1, "leaseExpiresAt": 1 })
            .await
            .unwrap();
        futures_util::TryStreamExt::try_collect::<Vec<Document>>(found)
            .await
            .unwrap()
    };
    let [dying] = <[_; 1]>::try_from(enqueued.leased).unwrap_or_else(|leased| {
        panic!("dying was leased {leased:?} on enqueue");
    });
    // A lease write can meet another test's transaction on the shared server and take nothing:
    // asked again until it takes the page (nothing else is leasable: the listings are slow and
    // the crawl's clock is before the expired lease).
    let taken = at + chrono::Duration::milliseconds(2);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        match store
            .frontier()
            .lease_url(&bot, PassNumber::new(pass), &taker_id, taken, lease_for)
            .await
            .unwrap()
        {
            Some(lease) if lease.url == url => break,
            None if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => panic!(
                "taker leased {other:?}; the frontier: {:?}",
                frontier().await
            ),
        }
    }
    let record = Extracted {
        bot: bot.clone(),
        natural_key: sku.clone(),
        data: doc! { "title": "stored before it went" },
        url: None,
    };
    let half = store
        .records()
        .commit_page(&dying, Some(&record), taken, false)
        .await;
    assert!(half.is_err(), "the done mark is refused: {half:?}");
    assert!(
        live_records(&db).await.contains_key(&sku),
        "the record landed without its mark"
    );

    crawl.await.unwrap();
    assert_eq!(
        removed_keys(&db).await,
        std::slice::from_ref(&sku),
        "found gone: removed"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
}

/// The pass the bot's crawl is on, once it has one and has leased its seed (the test's own
/// leases then find only the page the test put there).
async fn eventually_pass(db: &kit::TestDb) -> i64 {
    let pass = || async {
        db.doc("shop")
            .await
            .and_then(|d| d.get_i64("crawlPass").ok())
            .unwrap_or(0)
    };
    let frontier = db.db.collection::<Document>("frontier");
    kit::eventually(
        "the bot leases its seed",
        std::time::Duration::from_secs(20),
        || async {
            let pass = pass().await;
            let count = |status: &'static str| {
                frontier.count_documents(doc! { "pass": pass, "status": status })
            };
            pass > 0 && count("pending").await.unwrap() == 0 && count("leased").await.unwrap() > 0
        },
    )
    .await;
    pass().await
}
