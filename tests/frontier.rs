//! The frontier against the real server: idempotent enqueue, exclusive leases, expiry, fenced
//! completion, and passes that wait for every lease.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use chrono::Utc;
use common::*;
use seedlock::error::Error;
use seedlock::ids::{BotId, InstanceId};
use seedlock::store::frontier::{
    url_id, PageKind, PassProgress, LEASE_INDEX, PRIORITY_INDEX, SLOT_INDEX,
};
use seedlock::urls::NormalizedUrl;

fn bot() -> BotId {
    BotId::parse("shop").unwrap()
}

fn me(s: &str) -> InstanceId {
    InstanceId::parse(s).unwrap()
}

fn urls(n: usize) -> Vec<NormalizedUrl> {
    (0..n)
        .map(|i| NormalizedUrl::parse(&format!("http://shop.test/product/{i}")).unwrap())
        .collect()
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_within_a_pass_and_resets_in_the_next() {
    let db = test_db("fr_enqueue").await;
    let store = db.store();
    store.ensure_frontier_indexes().await.unwrap();
    let list = urls(5);
    assert_eq!(
        store
            .enqueue(&bot(), 1, PageKind::Detail, &list, Utc::now())
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        store
            .enqueue(&bot(), 1, PageKind::Detail, &list, Utc::now())
            .await
            .unwrap(),
        0,
        "rediscovery is a no-op"
    );
    let spelled_differently = [NormalizedUrl::parse("HTTP://SHOP.test:80/product/0#x").unwrap()];
    assert_eq!(
        store
            .enqueue(
                &bot(),
                1,
                PageKind::Detail,
                &spelled_differently,
                Utc::now()
            )
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        db.db
            .collection::<bson::Document>("frontier")
            .count_documents(doc! {})
            .await
            .unwrap(),
        5
    );

    // Crawl one URL to done, rediscover it in the same pass: it stays done.
    let lease = store
        .lease_url(&bot(), 1, &me("w"), Utc::now(), LEASE)
        .await
        .unwrap()
        .unwrap();
    store.complete_url(&lease, Utc::now()).await.unwrap();
    store
        .enqueue(
            &bot(),
            1,
            PageKind::Detail,
            std::slice::from_ref(&lease.url),
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!(
        store.pass_progress(&bot(), 1).await.unwrap(),
        PassProgress {
            pending: 4,
            waiting: 0,
            leased: 0,
            done: 1,
            failed: 0
        }
    );

    // The next pass makes every URL pending again.
    assert_eq!(
        store
            .enqueue(&bot(), 2, PageKind::Detail, &list, Utc::now())
            .await
            .unwrap(),
        5
    );
    assert_eq!(store.pass_progress(&bot(), 2).await.unwrap().pending, 5);
    let id = url_id(&bot(), &list[0]);
    assert_eq!(
        id,
        url_id(&bot(), &spelled_differently[0]),
        "the id derives from the normalized URL"
    );
    assert_ne!(
        id,
        url_id(&BotId::parse("other").unwrap(), &list[0]),
        "and from the bot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_workers_lease_each_url_exactly_once() {
    let db = test_db("fr_lease").await;
    let store = db.store();
    store.ensure_frontier_indexes().await.unwrap();
    store
        .enqueue(&bot(), 1, PageKind::Detail, &urls(60), Utc::now())
        .await
        .unwrap();
    let mut workers = Vec::new();
    for w in 0..8 {
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while let Some(lease) = store
                .lease_url(&bot(), 1, &me(&format!("w{w}")), Utc::now(), LEASE)
                .await
                .unwrap()
            {
                store.complete_url(&lease, Utc::now()).await.unwrap();
                mine.push(lease.url.to_string());
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let distinct: HashSet<_> = all.iter().collect();
    assert_eq!(
        (all.len(), distinct.len()),
        (60, 60),
        "every URL leased once, none twice"
    );
    let progress = store.pass_progress(&bot(), 1).await.unwrap();
    assert_eq!(
        progress,
        PassProgress {
            pending: 0,
            waiting: 0,
            leased: 0,
            done: 60,
            failed: 0
        }
    );
    assert!(progress.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_retried_and_the_stale_worker_is_fenced_out() {
    let db = test_db("fr_expiry").await;
    let store = db.store();
    store
        .enqueue(&bot(), 1, PageKind::List, &urls(1), Utc::now())
        .await
        .unwrap();
    let t0 = Utc::now();
    let crashed = store
        .lease_url(&bot(), 1, &me("crashed"), t0, Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(crashed.kind, PageKind::List);
    assert!(
        store
            .lease_url(&bot(), 1, &me("other"), t0, LEASE)
            .await
            .unwrap()
            .is_none(),
        "a live lease is exclusive"
    );
    let progress = store.pass_progress(&bot(), 1).await.unwrap();
    assert!(
        !progress.is_finished(),
        "the pass waits for a URL leased by someone else: {progress:?}"
    );

    let later = t0 + chrono::Duration::seconds(6);
    let retry = store
        .lease_url(&bot(), 1, &me("other"), later, LEASE)
        .await
        .unwrap()
        .expect("the expired lease is retried");
    assert_eq!((retry.attempt, retry.url.clone()), (2, crashed.url.clone()));
    assert_ne!(retry.token, crashed.token);

    let stale = store.complete_url(&crashed, later).await;
    assert!(
        matches!(stale, Err(Error::UrlLeaseLost { .. })),
        "{stale:?}"
    );
    let stale = store.fail_url(&crashed, later, "x").await;
    assert!(
        matches!(stale, Err(Error::UrlLeaseLost { .. })),
        "{stale:?}"
    );
    store.complete_url(&retry, later).await.unwrap();
    assert!(
        matches!(
            store.complete_url(&retry, later).await,
            Err(Error::UrlLeaseLost { .. })
        ),
        "done once"
    );
    assert!(store.pass_progress(&bot(), 1).await.unwrap().is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_urls_record_their_reason_and_end_the_pass() {
    let db = test_db("fr_fail").await;
    let store = db.store();
    store
        .enqueue(&bot(), 3, PageKind::Detail, &urls(1), Utc::now())
        .await
        .unwrap();
    let lease = store
        .lease_url(&bot(), 3, &me("w"), Utc::now(), LEASE)
        .await
        .unwrap()
        .unwrap();
    store
        .fail_url(&lease, Utc::now(), "no natural key (.sku) on the page")
        .await
        .unwrap();
    let doc = db
        .db
        .collection::<bson::Document>("frontier")
        .find_one(doc! {"_id": &lease.id})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_str("status").unwrap(), "failed");
    assert_eq!(
        doc.get_str("lastError").unwrap(),
        "no natural key (.sku) on the page"
    );
    assert_eq!(
        store.pass_progress(&bot(), 3).await.unwrap(),
        PassProgress {
            pending: 0,
            waiting: 0,
            leased: 0,
            done: 0,
            failed: 1
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_query_uses_its_index() {
    let db = test_db("fr_explain").await;
    let store = db.store();
    store.ensure_frontier_indexes().await.unwrap();
    store
        .enqueue(&bot(), 1, PageKind::Detail, &urls(50), Utc::now())
        .await
        .unwrap();
    // The lease queries exactly as `lease_next` sends them.
    let filters = seedlock::store::frontier::lease_filters(&bot(), 1, 7, Utc::now(), &[2, 1]);
    assert_eq!(filters.len(), 6);
    for filter in filters {
        let explain = db
            .db
            .run_command(doc! {
                "explain": { "find": "frontier", "filter": filter.clone() },
                "verbosity": "queryPlanner",
            })
            .await
            .expect("explain");
        let plan = explain
            .get_document("queryPlanner")
            .and_then(|q| q.get_document("winningPlan"))
            .expect("a winning plan");
        let text = plan.to_string();
        eprintln!("winning plan for {filter}: {text}");
        assert!(
            (text.contains(LEASE_INDEX)
                || text.contains(SLOT_INDEX)
                || text.contains(PRIORITY_INDEX))
                && !text.contains("COLLSCAN"),
            "the lease query {filter} should use an index: {text}"
        );
        if filter.contains_key("priority") {
            assert!(text.contains(PRIORITY_INDEX), "{filter}: {text}");
        }
        // The status is an index bound, not a residual filter: a lease never scans the pass's
        // done entries.
        let status = filter.get_str("status").unwrap();
        let bounds = plan
            .get_document("inputStage")
            .and_then(|s| s.get_document("indexBounds"))
            .expect("index bounds");
        assert_eq!(
            bounds.get_array("status").unwrap()[0].as_str().unwrap(),
            format!("[\"{status}\", \"{status}\"]"),
            "{text}"
        );
    }
}
