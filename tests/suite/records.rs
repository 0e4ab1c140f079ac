//! Records against the real server: derived ids, writes only on change, and the record + "done"
//! mark committed together — in a transaction, and without one.

use crate::kit;
use crate::kit::frontier::{OnePage, OneUrl};

use seedlock::ids::PassNumber;
use std::time::Duration;

use bson::{doc, Document};
use chrono::Utc;
use kit::crawl::records;
use kit::*;
use seedlock::error::Error;
use seedlock::ids::{BotId, InstanceId};
use seedlock::store::frontier::Mark;
use seedlock::store::frontier::{PageKind, UrlLease};
use seedlock::store::records::{
    content_hash, record_id, Committed, Extracted, PageCommit, RecordWrite,
};
use seedlock::store::Store;
use seedlock::urls::NormalizedUrl;

fn bot() -> BotId {
    BotId::parse("shop").unwrap()
}

fn item(price: &str) -> Extracted {
    Extracted {
        bot: bot(),
        natural_key: "SKU-1".into(),
        data: doc! { "title": "Lamp", "price": price },
        url: None,
    }
}

fn url() -> NormalizedUrl {
    NormalizedUrl::parse("http://shop.test/product/SKU-1").unwrap()
}

async fn lease(store: &Store, pass: i64, who: &str, at: chrono::DateTime<Utc>) -> UrlLease {
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(pass),
            PageKind::Detail,
            &[url()],
            at,
        )
        .await
        .unwrap();
    store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(pass),
            &InstanceId::parse(who).unwrap(),
            at,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .expect("a URL to lease")
}

#[test]
fn ids_and_hashes_derive_from_the_data() {
    assert_eq!(record_id("shop", "SKU-1"), record_id("shop", "SKU-1"));
    assert_ne!(record_id("shop", "SKU-1"), record_id("shop", "SKU-2"));
    assert_ne!(record_id("shop", "SKU-1"), record_id("other", "SKU-1"));
    assert_eq!(
        content_hash(&doc! {"a": 1, "b": "x"}),
        content_hash(&doc! {"b": "x", "a": 1}),
        "field order is not a change"
    );
    assert_ne!(content_hash(&doc! {"a": 1}), content_hash(&doc! {"a": 2}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_written_once_and_rewritten_only_on_change() {
    for transaction in [true, false] {
        let db = test_db(if transaction { "rec_txn" } else { "rec_notxn" }).await;
        let store = db.store();
        let first = lease(&store, 1, "w", Utc::now()).await;
        assert_eq!(
            store
                .records()
                .commit_page(&first, Some(&item("$1.00")), Utc::now(), transaction)
                .await
                .unwrap(),
            Some(RecordWrite::Inserted)
        );
        assert!(
            store
                .frontier()
                .pass_progress(&bot(), PassNumber::new(1))
                .await
                .unwrap()
                .is_finished(),
            "the URL is done with its record"
        );
        let stored = records(&db).await.remove(0);
        assert_eq!(stored.get_str("_id").unwrap(), record_id("shop", "SKU-1"));
        assert_eq!(stored.get_str("url").unwrap(), url().as_str());

        // Pass 2, same content: the record's document is not written at all.
        let second = lease(&store, 2, "w", Utc::now()).await;
        assert_eq!(
            store
                .records()
                .commit_page(&second, Some(&item("$1.00")), Utc::now(), transaction)
                .await
                .unwrap(),
            Some(RecordWrite::Unchanged)
        );
        assert_eq!(
            records(&db).await.remove(0),
            stored,
            "transaction={transaction}: an unchanged record is not written"
        );
        assert!(store
            .frontier()
            .pass_progress(&bot(), PassNumber::new(2))
            .await
            .unwrap()
            .is_finished());

        // Pass 3, a new price: rewritten, firstSeen kept.
        let third = lease(&store, 3, "w", Utc::now()).await;
        assert_eq!(
            store
                .records()
                .commit_page(&third, Some(&item("$2.00")), Utc::now(), transaction)
                .await
                .unwrap(),
            Some(RecordWrite::Changed)
        );
        let changed = records(&db).await.remove(0);
        assert_eq!(
            changed
                .get_document("data")
                .unwrap()
                .get_str("price")
                .unwrap(),
            "$2.00"
        );
        assert_eq!(
            changed.get_datetime("firstSeen").unwrap(),
            stored.get_datetime("firstSeen").unwrap()
        );
        assert!(
            changed.get_datetime("lastChanged").unwrap()
                > stored.get_datetime("lastChanged").unwrap()
        );
        assert_eq!(records(&db).await.len(), 1, "transaction={transaction}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_cannot_overwrite_the_newer_result() {
    for transaction in [true, false] {
        let db = test_db(if transaction {
            "rec_stale_txn"
        } else {
            "rec_stale"
        })
        .await;
        let store = db.store();
        let t0 = Utc::now();
        let stale = lease(&store, 1, "stale", t0).await;
        // The stale worker's lease expires; another worker re-leases and commits newer data.
        let later = t0 + chrono::Duration::seconds(6);
        let fresh = store
            .frontier()
            .lease_url(
                &bot(),
                PassNumber::new(1),
                &InstanceId::parse("fresh").unwrap(),
                later,
                Duration::from_secs(5),
            )
            .await
            .unwrap()
            .unwrap();
        store
            .records()
            .commit_page(&fresh, Some(&item("$9.99")), later, transaction)
            .await
            .unwrap();
        // Now the stale worker tries to commit what it fetched long ago.
        let result = store
            .records()
            .commit_page(&stale, Some(&item("$1.00")), later, transaction)
            .await;
        match (transaction, &result) {
            (true, Err(Error::UrlLeaseLost { .. })) => {}
            (false, Err(Error::UrlLeaseLost { .. })) => {}
            _ => panic!("transaction={transaction}: expected the stale commit to be fenced out, got {result:?}"),
        }
        let all = records(&db).await;
        assert_eq!(all.len(), 1);
        assert_eq!(
            all[0]
                .get_document("data")
                .unwrap()
                .get_str("price")
                .unwrap(),
            "$9.99",
            "transaction={transaction}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_finds_the_content_unchanged_still_fences_out_the_older_lease() {
    // An unchanged record is not written — but a URL's second lease in a pass must still leave
    // a trace newer than the first lease: the first may commit late (a stalled worker, a write
    // held up in the network) with what it fetched earlier.
    for transaction in [true, false] {
        let db = test_db(if transaction {
            "rec_retry_txn"
        } else {
            "rec_retry"
        })
        .await;
        let store = db.store();
        let t0 = Utc::now();
        let pass1 = lease(&store, 1, "w", t0).await;
        store
            .records()
            .commit_page(&pass1, Some(&item("$1.00")), t0, transaction)
            .await
            .unwrap();
        let t1 = t0 + chrono::Duration::seconds(1);
        let stalled = lease(&store, 2, "stalled", t1).await;
        assert_eq!(stalled.attempt, 1);
        // Its lease runs out; the retry finds the content as stored.
        let t2 = t1 + chrono::Duration::seconds(6);
        let retry = store
            .frontier()
            .lease_url(
                &bot(),
                PassNumber::new(2),
                &InstanceId::parse("retry").unwrap(),
                t2,
                Duration::from_secs(5),
            )
            .await
            .unwrap()
            .unwrap();
        assert_eq!(retry.attempt, 2);
        assert_eq!(
            store
                .records()
                .commit_page(&retry, Some(&item("$1.00")), t2, transaction)
                .await
                .unwrap(),
            Some(RecordWrite::Unchanged)
        );
        let late = store
            .records()
            .commit_page(&stalled, Some(&item("$0.50")), t2, transaction)
            .await;
        assert!(
            matches!(late, Err(Error::UrlLeaseLost { .. })),
            "transaction={transaction}: {late:?}"
        );
        let all = records(&db).await;
        assert_eq!(
            all[0]
                .get_document("data")
                .unwrap()
                .get_str("price")
                .unwrap(),
            "$1.00",
            "transaction={transaction}: the older lease's result does not replace the newer"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_record_and_done_mark_leaves_exactly_one_record() {
    // Without a transaction the record is written first; if the worker dies before the done mark
    // (here: its lease is taken over before it gets there), the URL is fetched again and the
    // rewrite of the same content is a no-op.
    let db = test_db("rec_crash").await;
    let store = db.store();
    let t0 = Utc::now();
    let dying = lease(&store, 1, "dying", t0).await;
    let later = t0 + chrono::Duration::seconds(6);
    let retry = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(1),
            &InstanceId::parse("retry").unwrap(),
            later,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .unwrap();
    let half = store
        .records()
        .commit_page(&dying, Some(&item("$1.00")), later, false)
        .await;
    assert!(matches!(half, Err(Error::UrlLeaseLost { .. })), "{half:?}");
    assert_eq!(
        records(&db).await.len(),
        1,
        "the record landed, the done mark did not"
    );
    assert!(!store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(1))
        .await
        .unwrap()
        .is_finished());
    let write = store
        .records()
        .commit_page(&retry, Some(&item("$1.00")), later, false)
        .await
        .unwrap();
    assert_eq!(write, Some(RecordWrite::Unchanged));
    assert_eq!(records(&db).await.len(), 1);
    assert!(store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(1))
        .await
        .unwrap()
        .is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_transaction_a_fenced_out_commit_keeps_nothing() {
    let db = test_db("rec_rollback").await;
    let store = db.store();
    let t0 = Utc::now();
    let stale = lease(&store, 1, "stale", t0).await;
    let later = t0 + chrono::Duration::seconds(6);
    let _fresh = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(1),
            &InstanceId::parse("fresh").unwrap(),
            later,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .unwrap();
    let result = store
        .records()
        .commit_page(&stale, Some(&item("$1.00")), later, true)
        .await;
    assert!(
        matches!(result, Err(Error::UrlLeaseLost { .. })),
        "{result:?}"
    );
    assert!(
        records(&db).await.is_empty(),
        "the transaction kept no record"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_newer_fetch_still_fences_out_an_older_different_one() {
    // Without a transaction: the fresh worker finds the content unchanged; the stale worker,
    // which fetched earlier and saw different content, must not overwrite the record.
    let db = test_db("rec_unchanged_stale").await;
    let store = db.store();
    let first = lease(&store, 1, "w", Utc::now()).await;
    store
        .records()
        .commit_page(&first, Some(&item("$1.00")), Utc::now(), false)
        .await
        .unwrap();
    let t0 = Utc::now();
    let stale = lease(&store, 2, "stale", t0).await;
    let later = t0 + chrono::Duration::seconds(6);
    let fresh = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(2),
            &InstanceId::parse("fresh").unwrap(),
            later,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        store
            .records()
            .commit_page(&fresh, Some(&item("$1.00")), later, false)
            .await
            .unwrap(),
        Some(RecordWrite::Unchanged)
    );
    let result = store
        .records()
        .commit_page(&stale, Some(&item("$0.50")), later, false)
        .await;
    assert!(
        matches!(result, Err(Error::UrlLeaseLost { .. })),
        "{result:?}"
    );
    let all = records(&db).await;
    assert_eq!(
        all[0]
            .get_document("data")
            .unwrap()
            .get_str("price")
            .unwrap(),
        "$1.00"
    );
}

/// Leases `n` products of pass `pass` to `who` (one batch).
async fn lease_many(
    store: &Store,
    n: usize,
    pass: i64,
    who: &str,
    at: chrono::DateTime<Utc>,
) -> Vec<UrlLease> {
    let urls: Vec<NormalizedUrl> = (0..n)
        .map(|i| NormalizedUrl::parse(&format!("http://shop.test/product/SKU-{i}")).unwrap())
        .collect();
    store
        .frontier()
        .enqueue(&bot(), PassNumber::new(pass), PageKind::Detail, &urls, at)
        .await
        .unwrap();
    let mut leases = Vec::new();
    while let Some(lease) = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(pass),
            &InstanceId::parse(who).unwrap(),
            at,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    {
        leases.push(lease);
    }
    leases.sort_by(|a, b| a.url.as_str().cmp(b.url.as_str()));
    leases
}

fn item_n(i: usize, price: &str) -> Extracted {
    Extracted {
        bot: bot(),
        natural_key: format!("SKU-{i}"),
        data: doc! { "title": format!("Lamp {i}"), "price": price },
        url: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_commit_marks_done_only_pages_whose_record_was_written_and_whose_lease_holds() {
    use seedlock::store::frontier::Mark;
    use seedlock::store::records::{Committed, PageCommit};
    for transaction in [false, true] {
        let db = test_db(if transaction {
            "rec_group_txn"
        } else {
            "rec_group"
        })
        .await;
        let store = db.store();
        let t0 = Utc::now();
        let leases = lease_many(&store, 4, 1, "w", t0).await;
        assert_eq!(leases.len(), 4);
        // Page 1's lease runs out and another worker takes it before the batch commits.
        let later = t0 + chrono::Duration::seconds(6);
        let newer = store
            .frontier()
            .take_leases(
                &bot(),
                PassNumber::new(1),
                &InstanceId::parse("newer").unwrap(),
                later,
                Duration::from_secs(5),
                seedlock::store::frontier::Takes {
                    expired: std::slice::from_ref(&leases[1].id),
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .leases
            .pop()
            .unwrap();
        assert_eq!(newer.id, leases[1].id);
        let items: Vec<Extracted> = (0..4).map(|i| item_n(i, "$1.00")).collect();
        let pages: Vec<PageCommit<'_>> = leases
            .iter()
            .zip(&items)
            .map(|(lease, item)| PageCommit {
                lease,
                record: Some(item),
                removed: None,
                mark: Mark::Done {
                    validators: Default::default(),
                    record_id: None,
                    manifest: None,
                },
            })
            .collect();
        let committed = store
            .records()
            .commit_batch(&pages, later, transaction)
            .await
            .unwrap();
        let ok = Committed::Settled(Some(RecordWrite::Inserted));
        assert_eq!(committed[0], ok, "transaction={transaction}");
        assert_eq!(committed[2], ok, "transaction={transaction}");
        assert_eq!(committed[3], ok, "transaction={transaction}");
        assert!(
            matches!(committed[1], Committed::UrlLeaseLost(_)),
            "transaction={transaction}: {:?}",
            committed[1]
        );
        let progress = store
            .frontier()
            .pass_progress(&bot(), PassNumber::new(1))
            .await
            .unwrap();
        assert_eq!(
            (progress.done, progress.leased),
            (3, 1),
            "transaction={transaction}: the lost page is not marked done, the rest of the batch is"
        );
        let stored: Vec<String> = records(&db)
            .await
            .iter()
            .map(|r| r.get_str("naturalKey").unwrap().to_owned())
            .collect();
        // Ordered, the lost page's record was written before its mark failed (the newer lease's
        // result replaces it); in a transaction, nothing of it was kept.
        let expected = if transaction { 3 } else { 4 };
        assert_eq!(
            stored.len(),
            expected,
            "transaction={transaction}: {stored:?}"
        );
        // Every mark carries the id of the record its page wrote.
        let frontier = db.db.collection::<Document>("frontier");
        for (lease, item) in leases.iter().zip(&items) {
            if lease.id == newer.id {
                continue;
            }
            let doc = frontier
                .find_one(doc! { "_id": &lease.id })
                .await
                .unwrap()
                .unwrap();
            assert_eq!(doc.get_str("recordId").unwrap(), item.id());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_conflicts_keeps_its_pages_and_commits_once_the_conflict_is_gone() {
    use seedlock::store::frontier::Mark;
    use seedlock::store::records::{Committed, PageCommit};
    let db = test_db("rec_txn_retry").await;
    let store = db.store();
    let first = lease(&store, 1, "w", Utc::now()).await;
    store
        .records()
        .commit_page(&first, Some(&item("$1.00")), Utc::now(), true)
        .await
        .unwrap();
    // Another transaction holds the record (as a killed worker's open commit would) and lets go
    // after a while.
    let client = mongodb::Client::with_uri_str(&db.uri).await.unwrap();
    let mut holder = client.start_session().await.unwrap();
    holder.start_transaction().await.unwrap();
    client
        .database(&db.name)
        .collection::<Document>("records")
        .update_one(
            doc! { "_id": record_id("shop", "SKU-1") },
            doc! { "$set": { "heldBy": "another transaction" } },
        )
        .session(&mut holder)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        holder.abort_transaction().await.unwrap();
    });
    let second = lease(&store, 2, "w", Utc::now()).await;
    let changed = item("$2.00");
    let page = PageCommit {
        lease: &second,
        record: Some(&changed),
        removed: None,
        mark: Mark::Done {
            validators: Default::default(),
            record_id: None,
            manifest: None,
        },
    };
    let committed = store
        .records()
        .commit_batch(std::slice::from_ref(&page), Utc::now(), true)
        .await
        .unwrap();
    release.await.unwrap();
    assert_eq!(
        committed,
        vec![Committed::Settled(Some(RecordWrite::Changed))],
        "the commit was retried with the page it had, not given up"
    );
    let stored = records(&db).await.remove(0);
    assert_eq!(
        stored
            .get_document("data")
            .unwrap()
            .get_str("price")
            .unwrap(),
        "$2.00"
    );
    assert!(store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(2))
        .await
        .unwrap()
        .is_finished());
}

/// Commits a 404 of `lease`'s detail page: its record (`id`) marked removed, the URL done.
async fn commit_gone(store: &Store, lease: &UrlLease, id: &str, transaction: bool) -> Committed {
    let page = PageCommit {
        lease,
        record: None,
        removed: Some(id.to_owned()),
        mark: Mark::Done {
            validators: lease.validators.clone(),
            record_id: None,
            manifest: None,
        },
    };
    store
        .records()
        .commit_batch(std::slice::from_ref(&page), Utc::now(), transaction)
        .await
        .unwrap()
        .remove(0)
}

/// Whether the record `id` is marked removed.
async fn is_removed(db: &TestDb, id: &str) -> bool {
    let record = db
        .db
        .collection::<Document>("records")
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
        .expect("the record");
    !matches!(record.get("removedAt"), None | Some(bson::Bson::Null))
}

/// The item stored by pass 1, then its URL leased in pass 2 by "slow" and — once that lease
/// ran out — by "fast": both leases and the later one's time.
async fn stored_then_leased_twice(
    store: &Store,
    transaction: bool,
) -> (UrlLease, UrlLease, chrono::DateTime<Utc>) {
    let t0 = Utc::now();
    let first = lease(store, 1, "first", t0).await;
    store
        .records()
        .commit_page(&first, Some(&item("$1.00")), t0, transaction)
        .await
        .unwrap();
    let t1 = t0 + chrono::Duration::seconds(1);
    let slow = lease(store, 2, "slow", t1).await;
    let t2 = t1 + chrono::Duration::seconds(6);
    let fast = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(2),
            &InstanceId::parse("fast").unwrap(),
            t2,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .expect("the expired lease, taken again");
    (slow, fast, t2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_and_a_record_of_one_url_from_two_leases_end_as_the_newer_lease_saw_it() {
    let id = item("$1.00").id();
    for transaction in [false, true] {
        // The newer lease's 404 settles first; the older lease's record comes late: the record
        // stays removed (the late write must not bring it back).
        let db = test_db("rec_gone_first").await;
        let store = db.store();
        let (slow, fast, t2) = stored_then_leased_twice(&store, transaction).await;
        assert!(matches!(
            commit_gone(&store, &fast, &id, transaction).await,
            Committed::Settled(_)
        ));
        assert!(
            is_removed(&db, &id).await,
            "transaction={transaction}: the 404 removed it"
        );
        let late = store
            .records()
            .commit_page(&slow, Some(&item("$1.00")), t2, transaction)
            .await;
        assert!(matches!(late, Err(Error::UrlLeaseLost { .. })), "{late:?}");
        assert!(
            is_removed(&db, &id).await,
            "transaction={transaction}: the older lease's late record did not bring it back"
        );

        // The newer lease's record settles first; the older lease's 404 comes late: the record
        // stays live.
        let db = test_db("rec_gone_late").await;
        let store = db.store();
        let (slow, fast, t2) = stored_then_leased_twice(&store, transaction).await;
        store
            .records()
            .commit_page(&fast, Some(&item("$2.00")), t2, transaction)
            .await
            .unwrap();
        assert!(matches!(
            commit_gone(&store, &slow, &id, transaction).await,
            Committed::UrlLeaseLost(_)
        ));
        assert!(
            !is_removed(&db, &id).await,
            "transaction={transaction}: the older lease's late 404 did not remove it"
        );
    }
}
