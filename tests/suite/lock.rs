//! The lock's writes against the real server: one winner per epoch, fencing, conditional takeover.

// Document fields read best as `field == value`.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::time::Duration;

use bson::doc;
use chrono::Utc;
use kit::*;
use seedlock::error::Error;
use seedlock::ids::{BotId, InstanceId, LockEpoch};
use seedlock::lock::state::Claim;
use seedlock::store::{NextPass, UnlockOutcome};

fn id(s: &str) -> BotId {
    BotId::parse(s).unwrap()
}

fn me(s: &str) -> InstanceId {
    InstanceId::parse(s).unwrap()
}

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_on_one_epoch_have_exactly_one_winner() {
    let db = test_db("race").await;
    let store = db.store();
    store
        .bots()
        .initialize(&id("shop"), &me("setup"), Utc::now())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .bots()
                .claim(
                    &id("shop"),
                    &me(&format!("i{i}")),
                    LockEpoch::ZERO,
                    Claim::Free,
                    Utc::now(),
                    TTL,
                    "race",
                )
                .await
                .unwrap()
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let Some(lease) = t.await.unwrap() {
            winners.push(lease);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claimant wins epoch 1");
    let doc = db.doc("shop").await.unwrap();
    assert_eq!(doc.get_bool("isEditing").unwrap(), true);
    assert_eq!(
        doc.get_bool("isReady").unwrap(),
        false,
        "acquire clears isReady in the same write"
    );
    assert_eq!(doc.get_str("editingBy").unwrap(), winners[0].me.as_str());
    assert_eq!(db.epoch("shop").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holder_cannot_write_after_a_takeover() {
    let db = test_db("fence").await;
    let store = db.store();
    let bot = id("shop");
    store
        .bots()
        .initialize(&bot, &me("setup"), Utc::now())
        .await
        .unwrap();
    let t0 = Utc::now();
    let old = store
        .bots()
        .claim(
            &bot,
            &me("old"),
            LockEpoch::ZERO,
            Claim::Free,
            t0,
            Duration::from_secs(1),
            "first",
        )
        .await
        .unwrap()
        .expect("old wins epoch 1");
    // Taking over before the lock expired must fail: the filter carries the expiry condition.
    let early = store
        .bots()
        .claim(
            &bot,
            &me("new"),
            old.epoch,
            Claim::Expired { now: t0 },
            t0,
            TTL,
            "too early",
        )
        .await
        .unwrap();
    assert!(early.is_none(), "a live lock is not taken over");
    let later = t0 + chrono::Duration::seconds(2);
    let new = store
        .bots()
        .claim(
            &bot,
            &me("new"),
            old.epoch,
            Claim::Expired { now: later },
            later,
            TTL,
            "expired",
        )
        .await
        .unwrap()
        .expect("an expired lock is taken over");
    assert_eq!(new.epoch.get(), 2);

    for (what, result) in [
        (
            "heartbeat",
            store.bots().heartbeat(&old, later, TTL).await.map(|_| ()),
        ),
        (
            "complete",
            store
                .bots()
                .complete(&old, &["http://stale/".into()], later, NextPass::None)
                .await,
        ),
        (
            "fail",
            store.bots().fail(&old, later, "x", later, true).await,
        ),
        ("release", store.bots().release(&old, later, "x").await),
    ] {
        assert!(
            matches!(result, Err(Error::EditLockLost { .. })),
            "{what} by the stale holder: {result:?}"
        );
    }
    store
        .bots()
        .complete(&new, &["http://fresh/".into()], later, NextPass::None)
        .await
        .expect("the new holder's write lands");
    let doc = db.doc("shop").await.unwrap();
    assert_eq!(
        doc.get_array("seeds").unwrap(),
        &vec![bson::Bson::String("http://fresh/".into())]
    );
    assert_eq!(doc.get_bool("isReady").unwrap(), true);
    let events: Vec<_> = db
        .history("shop")
        .await
        .iter()
        .map(|h| h.get_str("event").unwrap().to_owned())
        .collect();
    assert_eq!(events, ["created", "acquired", "took_over", "refreshed"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_fails_if_the_epoch_moved_since_the_read() {
    let db = test_db("epoch").await;
    let store = db.store();
    let bot = id("shop");
    store
        .bots()
        .initialize(&bot, &me("setup"), Utc::now())
        .await
        .unwrap();
    let a = store
        .bots()
        .claim(
            &bot,
            &me("a"),
            LockEpoch::ZERO,
            Claim::Free,
            Utc::now(),
            TTL,
            "a",
        )
        .await
        .unwrap()
        .unwrap();
    store.bots().release(&a, Utc::now(), "done").await.unwrap();
    // The lock is free again, but at epoch 1: a claim based on the epoch-0 read must fail.
    let stale = store
        .bots()
        .claim(
            &bot,
            &me("b"),
            LockEpoch::ZERO,
            Claim::Free,
            Utc::now(),
            TTL,
            "b",
        )
        .await
        .unwrap();
    assert!(stale.is_none());
    let fresh = store
        .bots()
        .claim(&bot, &me("b"), a.epoch, Claim::Free, Utc::now(), TTL, "b")
        .await
        .unwrap();
    assert_eq!(fresh.map(|l| l.epoch.get()), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_unlock_bumps_the_epoch_and_fences_the_holder() {
    let db = test_db("unlock").await;
    let store = db.store();
    let bot = id("shop");
    assert_eq!(
        store
            .bots()
            .admin_unlock(&bot, "admin", "x", Utc::now())
            .await
            .unwrap(),
        UnlockOutcome::NoSuchBot
    );
    store
        .bots()
        .initialize(&bot, &me("setup"), Utc::now())
        .await
        .unwrap();
    assert_eq!(
        store
            .bots()
            .admin_unlock(&bot, "admin", "x", Utc::now())
            .await
            .unwrap(),
        UnlockOutcome::NotLocked
    );
    let holder = store
        .bots()
        .claim(
            &bot,
            &me("h"),
            LockEpoch::ZERO,
            Claim::Free,
            Utc::now(),
            TTL,
            "h",
        )
        .await
        .unwrap()
        .unwrap();
    let outcome = store
        .bots()
        .admin_unlock(&bot, "admin", "stuck", Utc::now())
        .await
        .unwrap();
    assert_eq!(
        outcome,
        UnlockOutcome::Unlocked {
            holder: Some("h".into()),
            old_epoch: Some(1)
        }
    );
    assert_eq!(db.epoch("shop").await, 2);
    let late = store
        .bots()
        .complete(
            &holder,
            &["http://late/".into()],
            Utc::now(),
            NextPass::None,
        )
        .await;
    assert!(matches!(late, Err(Error::EditLockLost { .. })), "{late:?}");
    let last = db.history("shop").await.pop().unwrap();
    assert_eq!(
        (
            last.get_str("event").unwrap(),
            last.get_i64("epoch").unwrap()
        ),
        ("unlocked", 2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_initialization_creates_one_document() {
    let db = test_db("init").await;
    let store = db.store();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .bots()
                .initialize(&id("shop"), &me(&format!("i{i}")), Utc::now())
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("every initializer succeeds");
    }
    assert_eq!(db.bots().count_documents(doc! {}).await.unwrap(), 1);
    assert_eq!(
        db.history("shop").await.len(),
        1,
        "only the inserting call wrote"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_keeps_the_last_fifty_transitions() {
    let db = test_db("history").await;
    let store = db.store();
    let bot = id("shop");
    store
        .bots()
        .initialize(&bot, &me("setup"), Utc::now())
        .await
        .unwrap();
    let mut epoch = LockEpoch::ZERO;
    for _ in 0..30 {
        let lease = store
            .bots()
            .claim(&bot, &me("h"), epoch, Claim::Free, Utc::now(), TTL, "loop")
            .await
            .unwrap()
            .unwrap();
        store
            .bots()
            .release(&lease, Utc::now(), "loop")
            .await
            .unwrap();
        epoch = lease.epoch;
    }
    let history = db.history("shop").await;
    assert_eq!(history.len(), 50);
    assert_eq!(
        history.last().unwrap().get_i64("epoch").unwrap(),
        30,
        "newest entry last"
    );
}
