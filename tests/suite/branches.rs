//! Every branch of the state machine, executed by `BotRunner::step` against the real server.

// Document fields read best as `field == value`.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::Utc;
use kit::*;
use seedlock::clock::LocalClock;
use seedlock::config::{OnRefreshFailure, RefreshSchedule};
use seedlock::lock::state::BotState;
use seedlock::runner::StepOutcome;
use tokio_util::sync::CancellationToken;

use seedlock::store::date as bdate;

/// A ready bot document with the given seeds, refreshed at `updated` (server time).
fn ready_doc(seeds: &[&str], updated: chrono::DateTime<Utc>) -> Document {
    doc! {
        "_id": "shop", "isReady": true, "isEditing": false, "seeds": seeds.to_vec(),
        "lastUpdateStartedAt": bdate(updated), "lastSeedUpdatedAt": bdate(updated),
        "editingBy": Bson::Null, "lockEpoch": 5_i64, "heartbeatAt": Bson::Null, "lockExpiresAt": Bson::Null,
        "lastError": Bson::Null, "failedRefreshes": 0, "refreshRequestedAt": Bson::Null,
        "retryRefreshAfter": Bson::Null, "history": [],
    }
}

/// A document locked by another instance ("ghost") that started at `started` and expires at `expires`.
fn locked_doc(started: chrono::DateTime<Utc>, expires: chrono::DateTime<Utc>) -> Document {
    let mut d = ready_doc(&["http://old/"], started);
    d.insert("isReady", false);
    d.insert("isEditing", true);
    d.insert("editingBy", "ghost");
    d.insert("lockExpiresAt", bdate(expires));
    d
}

struct Fixture {
    db: TestDb,
    source: SeedSourceServer,
    runner: seedlock::runner::BotRunner,
    ctx: std::sync::Arc<seedlock::runner::Context>,
}

async fn fixture(hint: &str, refresh: RefreshSchedule, on_failure: OnRefreshFailure) -> Fixture {
    let db = test_db(hint).await;
    let source = SeedSourceServer::start().await;
    let ctx = context(&db, "me", lock(3_000, 10_000, 100), LocalClock::default()).await;
    let runner = runner(bot("shop", &source.url(), refresh, on_failure), ctx.clone());
    Fixture {
        db,
        source,
        runner,
        ctx,
    }
}

impl Fixture {
    async fn put(&self, d: Document) {
        self.db.put_bot(d).await;
    }

    async fn step(&self) -> StepOutcome {
        self.runner
            .step(&CancellationToken::new())
            .await
            .expect("step")
    }

    fn now(&self) -> chrono::DateTime<Utc> {
        self.ctx.clock.now()
    }

    async fn last_event(&self) -> (String, String) {
        let h = self
            .db
            .history("shop")
            .await
            .pop()
            .expect("a history entry");
        (
            h.get_str("event").unwrap().to_owned(),
            h.get_str("reason").unwrap_or("").to_owned(),
        )
    }

    async fn seeds(&self) -> Vec<String> {
        let d = self.db.doc("shop").await.unwrap();
        d.get_array("seeds")
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    }
}

fn daily() -> RefreshSchedule {
    RefreshSchedule::Daily
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_missing_document_is_created_then_refreshed() {
    let f = fixture("c_missing", daily(), OnRefreshFailure::KeepPrevious).await;
    assert_eq!(f.step().await, StepOutcome::Initialized);
    assert_eq!(
        f.step().await,
        StepOutcome::Refreshed {
            seeds: 2,
            epoch: epoch(1)
        }
    );
    assert_eq!(f.seeds().await, SeedSourceServer::seeds_of_hit(1));
    assert_eq!(
        f.step().await,
        StepOutcome::Ready {
            seeds: 2,
            epoch: epoch(1),
            pass: None
        }
    );
    assert_eq!(f.source.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1_ready_with_empty_seeds_refreshes() {
    let f = fixture("a1", daily(), OnRefreshFailure::KeepPrevious).await;
    f.put(ready_doc(&[], f.now())).await;
    assert_eq!(
        f.step().await,
        StepOutcome::Refreshed {
            seeds: 2,
            epoch: epoch(6)
        }
    );
    let acquired =
        f.db.history("shop")
            .await
            .into_iter()
            .find(|h| h.get_str("event") == Ok("acquired"))
            .unwrap();
    assert!(acquired.get_str("reason").unwrap().starts_with("A-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2_daily_refresh_on_utc_date_change() {
    let f = fixture("a2_daily", daily(), OnRefreshFailure::KeepPrevious).await;
    // Refreshed late yesterday (server time): due today.
    let yesterday = (f.now() - chrono::Duration::days(1))
        .date_naive()
        .and_hms_opt(23, 59, 0)
        .unwrap()
        .and_utc();
    f.put(ready_doc(&["http://old/"], yesterday)).await;
    assert!(matches!(
        f.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == 6
    ));
    assert_eq!(f.seeds().await, SeedSourceServer::seeds_of_hit(1));
    // Refreshed earlier today: not due, no fetch.
    assert!(matches!(f.step().await, StepOutcome::Ready { .. }));
    assert_eq!(f.source.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2_interval_refresh_when_the_interval_passed() {
    let f = fixture(
        "a2_interval",
        RefreshSchedule::Every(Duration::from_secs(60)),
        OnRefreshFailure::KeepPrevious,
    )
    .await;
    f.put(ready_doc(
        &["http://old/"],
        f.now() - chrono::Duration::seconds(30),
    ))
    .await;
    assert!(
        matches!(f.step().await, StepOutcome::Ready { .. }),
        "30s < 60s: not due"
    );
    assert_eq!(f.source.hits(), 0);
    f.put(ready_doc(
        &["http://old/"],
        f.now() - chrono::Duration::seconds(61),
    ))
    .await;
    assert!(
        matches!(f.step().await, StepOutcome::Refreshed { .. }),
        "61s > 60s: due"
    );
    let acquired =
        f.db.history("shop")
            .await
            .into_iter()
            .find(|h| h.get_str("event") == Ok("acquired"))
            .unwrap();
    assert!(
        acquired.get_str("reason").unwrap().contains("interval"),
        "{acquired}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2_admin_request_is_served_once() {
    let f = fixture("a2_request", daily(), OnRefreshFailure::KeepPrevious).await;
    f.put(ready_doc(&["http://old/"], f.now())).await;
    assert!(matches!(f.step().await, StepOutcome::Ready { .. }));
    let store = f.db.store();
    assert!(store
        .bots()
        .request_refresh(
            &seedlock::ids::BotId::parse("shop").unwrap(),
            "admin",
            f.now()
        )
        .await
        .unwrap());
    assert!(matches!(f.step().await, StepOutcome::Refreshed { .. }));
    assert!(
        matches!(f.step().await, StepOutcome::Ready { .. }),
        "the request was served"
    );
    assert_eq!(f.source.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b1_expired_lock_is_taken_over() {
    let f = fixture("b1", daily(), OnRefreshFailure::KeepPrevious).await;
    let now = f.now();
    f.put(locked_doc(
        now - chrono::Duration::seconds(5),
        now - chrono::Duration::seconds(1),
    ))
    .await;
    assert!(matches!(
        f.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == 6
    ));
    let took =
        f.db.history("shop")
            .await
            .into_iter()
            .find(|h| h.get_str("event") == Ok("took_over"))
            .unwrap();
    assert!(took.get_str("reason").unwrap().starts_with("B-1"), "{took}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b2_heartbeating_refresh_past_max_refresh_is_taken_over() {
    let f = fixture("b2", daily(), OnRefreshFailure::KeepPrevious).await;
    let now = f.now();
    // Started 14 s ago (max_refresh 10 s + stuck_grace 3 s) and still heartbeating: expires in
    // the future.
    f.put(locked_doc(
        now - chrono::Duration::seconds(14),
        now + chrono::Duration::seconds(20),
    ))
    .await;
    assert!(matches!(
        f.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == 6
    ));
    let took =
        f.db.history("shop")
            .await
            .into_iter()
            .find(|h| h.get_str("event") == Ok("took_over"))
            .unwrap();
    assert!(took.get_str("reason").unwrap().starts_with("B-2"), "{took}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_live_holder_is_waited_for_and_left_alone() {
    let f = fixture("b3", daily(), OnRefreshFailure::KeepPrevious).await;
    let now = f.now();
    // Expires in 5 s, well before max_refresh (10 s) runs out: the wait ends at the expiry.
    let expires = now + chrono::Duration::seconds(5);
    f.put(locked_doc(now - chrono::Duration::seconds(1), expires))
        .await;
    let before = f.db.doc("shop").await.unwrap();
    match f.step().await {
        StepOutcome::Wait { until, state } => {
            assert_eq!(state, BotState::Waiting);
            let until = until.expect("a wait names when it can end");
            assert!(
                (until - expires).num_milliseconds().abs() < 5,
                "wait until the expiry: {until} vs {expires}"
            );
        }
        other => panic!("expected a wait, got {other:?}"),
    }
    assert_eq!(
        f.db.doc("shop").await.unwrap(),
        before,
        "waiting writes nothing"
    );
    assert_eq!(f.source.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_contradictory_document_keeps_a_live_lock() {
    let f = fixture("d_live", daily(), OnRefreshFailure::KeepPrevious).await;
    let now = f.now();
    let mut d = locked_doc(now, now + chrono::Duration::seconds(20));
    d.insert("isReady", true);
    f.put(d).await;
    assert_eq!(f.step().await, StepOutcome::Repaired);
    let doc = f.db.doc("shop").await.unwrap();
    assert_eq!(doc.get_bool("isReady").unwrap(), false, "isReady cleared");
    assert_eq!(
        doc.get_bool("isEditing").unwrap(),
        true,
        "the live holder keeps its lock (no force-unlock)"
    );
    assert_eq!(doc.get_str("editingBy").unwrap(), "ghost");
    assert_eq!(f.db.epoch("shop").await, 5);
    assert!(
        matches!(f.step().await, StepOutcome::Wait { .. }),
        "then rule B-3 applies"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_contradictory_document_with_an_expired_lock_ends_ready() {
    let f = fixture("d_expired", daily(), OnRefreshFailure::KeepPrevious).await;
    let now = f.now();
    let mut d = locked_doc(
        now - chrono::Duration::seconds(5),
        now - chrono::Duration::seconds(1),
    );
    d.insert("isReady", true);
    f.put(d).await;
    assert_eq!(f.step().await, StepOutcome::Repaired);
    assert!(matches!(
        f.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == 6
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_malformed_documents_are_repaired_and_refreshed() {
    let cases: Vec<(&str, Document)> = vec![
        (
            "string flag",
            doc! {"_id": "shop", "isReady": "true", "isEditing": false, "seeds": ["http://keep/"], "lockEpoch": 3_i64},
        ),
        (
            "seeds not an array",
            doc! {"_id": "shop", "isReady": true, "isEditing": false, "seeds": "http://x/", "lockEpoch": 3_i64},
        ),
        (
            "missing flags",
            doc! {"_id": "shop", "seeds": ["http://keep/"]},
        ),
        (
            "editing without holder",
            doc! {"_id": "shop", "isReady": false, "isEditing": true, "seeds": [], "lockEpoch": 9_i64},
        ),
        (
            "epoch as string",
            // The history shows epoch 7 was handed out: the repair must move past it.
            doc! {"_id": "shop", "isReady": true, "isEditing": false, "seeds": [], "lockEpoch": "7",
            "history": [{"event": "acquired", "by": "x", "epoch": 7_i64}]},
        ),
    ];
    for (name, bad) in cases {
        let f = fixture("e", daily(), OnRefreshFailure::KeepPrevious).await;
        let old_epoch = match name {
            "epoch as string" => 7,
            _ => bad
                .get("lockEpoch")
                .and_then(seedlock::store::document::integer)
                .unwrap_or(0),
        };
        f.put(bad.clone()).await;
        assert_eq!(f.step().await, StepOutcome::Repaired, "{name}");
        let (event, reason) = f.last_event().await;
        assert_eq!(event, "repaired", "{name}");
        assert!(reason.starts_with("E: malformed"), "{name}: {reason}");
        let repaired = f.db.doc("shop").await.unwrap();
        assert!(
            seedlock::store::document::parse_bot(&repaired).is_ok(),
            "{name}: repaired document parses"
        );
        assert_eq!(
            f.db.epoch("shop").await,
            old_epoch + 1,
            "{name}: the epoch rises past any holder's"
        );
        if bad.get_array("seeds").is_ok() && name != "editing without holder" {
            assert_eq!(
                repaired.get_array("seeds").unwrap(),
                bad.get_array("seeds").unwrap(),
                "{name}: seeds kept"
            );
        }
        assert!(
            matches!(f.step().await, StepOutcome::Refreshed { .. }),
            "{name}"
        );
        assert!(
            matches!(f.step().await, StepOutcome::Ready { .. }),
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_is_conditional_on_the_document_read() {
    let f = fixture("e_race", daily(), OnRefreshFailure::KeepPrevious).await;
    let bad = doc! {"_id": "shop", "isReady": "true", "isEditing": false, "seeds": [], "lockEpoch": 3_i64};
    f.put(bad.clone()).await;
    // Someone fixes the document between our read and our repair: the repair must not apply.
    f.put(ready_doc(&["http://fixed/"], f.now())).await;
    let applied =
        f.db.store()
            .bots()
            .repair_malformed(
                &bad,
                &["x".into()],
                &seedlock::ids::InstanceId::parse("me").unwrap(),
                f.now(),
            )
            .await
            .unwrap();
    assert!(!applied);
    assert_eq!(f.seeds().await, vec!["http://fixed/"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_refresh_keeps_previous_seeds_and_backs_off() {
    let f = fixture("fail_keep", daily(), OnRefreshFailure::KeepPrevious).await;
    let yesterday = f.now() - chrono::Duration::days(1);
    f.put(ready_doc(&["http://old/"], yesterday)).await;
    f.source.set_failing(true);
    match f.step().await {
        StepOutcome::RefreshFailed { error } => assert!(error.contains("HTTP 500"), "{error}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    let doc = f.db.doc("shop").await.unwrap();
    assert_eq!(
        doc.get_bool("isReady").unwrap(),
        true,
        "keep_previous: ready on the old seeds"
    );
    assert_eq!(f.seeds().await, vec!["http://old/"]);
    assert_eq!(doc.get_i32("failedRefreshes").unwrap(), 1);
    assert!(doc.get_str("lastError").unwrap().contains("500"));
    assert!(doc.get_datetime("retryRefreshAfter").is_ok());
    // Due, but backing off: crawl on the old seeds without fetching again.
    assert!(matches!(f.step().await, StepOutcome::Ready { .. }));
    assert_eq!(f.source.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_refresh_with_wait_policy_is_not_ready_and_never_empty() {
    let f = fixture("fail_wait", daily(), OnRefreshFailure::Wait).await;
    f.source.set_failing(true);
    assert_eq!(f.step().await, StepOutcome::Initialized);
    assert!(matches!(f.step().await, StepOutcome::RefreshFailed { .. }));
    let doc = f.db.doc("shop").await.unwrap();
    assert_eq!(
        doc.get_bool("isReady").unwrap(),
        false,
        "never ready with an empty list"
    );
    match f.step().await {
        StepOutcome::Wait { state, until } => {
            assert_eq!(state, BotState::Error);
            assert!(until.is_some());
        }
        other => panic!("expected a backoff wait, got {other:?}"),
    }
    f.source.set_failing(false);
    eventually(
        "the backoff passes and the retry succeeds",
        Duration::from_secs(10),
        || async {
            matches!(
                f.step().await,
                StepOutcome::Refreshed { .. } | StepOutcome::Ready { .. }
            )
        },
    )
    .await;
    assert_eq!(
        f.db.doc("shop")
            .await
            .unwrap()
            .get_i32("failedRefreshes")
            .unwrap(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_past_max_refresh_is_abandoned_by_its_holder() {
    let db = test_db("abandon").await;
    let source = SeedSourceServer::start().await;
    source.stall_first(1);
    // ttl 600 ms (heartbeat 200 ms), max_refresh 1.5 s.
    let ctx = context(&db, "me", lock(600, 1_500, 100), LocalClock::default()).await;
    let r = runner(
        bot("shop", &source.url(), daily(), OnRefreshFailure::Wait),
        ctx,
    );
    assert_eq!(
        r.step(&CancellationToken::new()).await.unwrap(),
        StepOutcome::Initialized
    );
    match r.step(&CancellationToken::new()).await.unwrap() {
        StepOutcome::RefreshFailed { error } => assert!(error.contains("max_refresh"), "{error}"),
        other => panic!("expected the refresh to be abandoned, got {other:?}"),
    }
    let doc = db.doc("shop").await.unwrap();
    assert_eq!(
        doc.get_bool("isEditing").unwrap(),
        false,
        "the lock was released"
    );
    source.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeating_refresh_longer_than_ttl_is_not_taken_over() {
    let db = test_db("slow").await;
    let source = SeedSourceServer::start().await;
    source.stall_first(1);
    let holder_ctx = context(&db, "holder", lock(600, 20_000, 100), LocalClock::default()).await;
    let holder = runner(
        bot("shop", &source.url(), daily(), OnRefreshFailure::Wait),
        holder_ctx,
    );
    let waiter_ctx = context(&db, "waiter", lock(600, 20_000, 100), LocalClock::default()).await;
    let waiter = runner(
        bot("shop", &source.url(), daily(), OnRefreshFailure::Wait),
        waiter_ctx,
    );
    let stop = CancellationToken::new();
    assert_eq!(holder.step(&stop).await.unwrap(), StepOutcome::Initialized);
    let holding =
        tokio::spawn(async move { holder.step(&CancellationToken::new()).await.unwrap() });
    eventually(
        "the holder took the lock",
        Duration::from_secs(5),
        || async {
            db.doc("shop")
                .await
                .is_some_and(|d| d.get_str("editingBy") == Ok("holder"))
        },
    )
    .await;
    // Five ttls pass while the holder heartbeats; the waiter steps throughout and must only wait.
    let until = tokio::time::Instant::now() + Duration::from_millis(3_000);
    while tokio::time::Instant::now() < until {
        assert!(matches!(
            waiter.step(&stop).await.unwrap(),
            StepOutcome::Wait { .. }
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    source.release();
    assert_eq!(
        holding.await.unwrap(),
        StepOutcome::Refreshed {
            seeds: 2,
            epoch: epoch(1)
        }
    );
    assert_eq!(source.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_epoch_at_the_int64_maximum_is_refused_with_one_clear_line_and_nothing_changed() {
    use seedlock::error::Error;
    let f = fixture("epoch_max", daily(), OnRefreshFailure::KeepPrevious).await;
    // One below the maximum: the claim takes the last epoch there is.
    let mut near = ready_doc(&[], f.now());
    near.insert("lockEpoch", i64::MAX - 1);
    f.put(near).await;
    assert!(matches!(
        f.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == i64::MAX
    ));
    assert_eq!(f.db.epoch("shop").await, i64::MAX);

    let refused = |e: &Error| {
        let line = e.to_string();
        matches!(e, Error::EpochExhausted { .. })
            && line.contains("Int64 maximum")
            && line.contains("shop")
            && !line.contains('\n')
    };
    // A claim (the seeds emptied, so rule A-1 wants one), then a malformed document's repair
    // (rule E), which would raise the epoch too: each refused, the document untouched.
    for change in [doc! {"seeds": []}, doc! {"isReady": "yes"}] {
        f.db.bots()
            .update_one(doc! {"_id": "shop"}, doc! {"$set": change})
            .await
            .unwrap();
        let before = f.db.doc("shop").await.unwrap();
        let err = f.runner.step(&CancellationToken::new()).await.unwrap_err();
        assert!(refused(&err), "{err}");
        assert_eq!(f.db.doc("shop").await.unwrap(), before);
    }

    // And so is an admin's unlock of a lock held at the maximum.
    f.put(locked_doc(f.now(), f.now() + chrono::Duration::seconds(20)))
        .await;
    f.db.bots()
        .update_one(doc! {"_id": "shop"}, doc! {"$set": {"lockEpoch": i64::MAX}})
        .await
        .unwrap();
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    let err =
        f.db.store()
            .bots()
            .admin_unlock(&bot, "admin", "test", Utc::now())
            .await
            .unwrap_err();
    assert!(refused(&err), "{err}");
    assert_eq!(f.db.epoch("shop").await, i64::MAX);
}

/// The epoch numbered `n`.
fn epoch(n: i64) -> seedlock::ids::LockEpoch {
    seedlock::ids::LockEpoch::new(n).expect("a non-negative epoch")
}
