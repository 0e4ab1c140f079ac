//! Writes the store sends itself (`run_command`), against replies a failing-over replica set gives:
//! a `writeConcernError` in an `ok: 1` reply is an error, never a success; a write refused by a
//! primary that stepped down, lost with its connection, or applied with its majority wait cut
//! short, is sent again within `op_timeout` and applied once. The replies come from a wire-level proxy (`tests/suite/kit/faults.rs`): the
//! test server has no `configureFailPoint`.

use crate::kit;

use std::time::Duration;

use chrono::Utc;
use kit::crawl::*;
use kit::faults::{not_primary, write_concern_error, Fault, Faults, Rule};
use kit::test_db;
use seedlock::config::MongoSettings;
use seedlock::daemon::{run_with_store, Mode};
use seedlock::error::Error;
use seedlock::ids::{BotId, InstanceId};
use seedlock::store::Store;
use tokio_util::sync::CancellationToken;

async fn through(faults: &Faults, db: &kit::TestDb) -> Store {
    Store::connect(&MongoSettings {
        uri: faults.uri(&db.uri),
        database: db.name.clone(),
        connect_timeout: Duration::from_secs(10),
        server_selection_timeout: Duration::from_secs(30),
        op_timeout: Duration::from_secs(10),
        max_pool_size: seedlock::config::DEFAULT_MAX_POOL_SIZE,
    })
    .await
    .expect("connect through the proxy")
}

fn rule(command: &str, collection: &str, times: usize, fault: Fault) -> Rule {
    Rule {
        command: command.into(),
        collection: collection.into(),
        times,
        fault,
    }
}

/// Three locks held by `me`, for heartbeats.
async fn held_locks(store: &Store) -> Vec<seedlock::store::EditLock> {
    let me = InstanceId::parse("me").unwrap();
    let now = Utc::now();
    let mut held = Vec::new();
    for i in 0..3 {
        let bot = BotId::parse(&format!("f{i}")).unwrap();
        store.bots().initialize(&bot, &me, now).await.unwrap();
        held.push(kit::claim_free(store, &bot, &me, now).await);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_concern_error_in_an_ok_reply_is_an_error_and_a_majority_wait_that_ran_out_is_sent_again(
) {
    let db = test_db("faults_wce").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let store = through(&faults, &db).await;
    let held = held_locks(&store).await;
    let locks: Vec<_> = held.iter().collect();
    // Applied on the primary, its majority wait cut short — by its `wtimeout`
    // (WriteConcernFailed) or by the `maxTimeMS` that also bounds the wait (MaxTimeMSExpired):
    // sent again, and the fenced statements match the locks as before.
    for (code, name) in [(64, "WriteConcernFailed"), (50, "MaxTimeMSExpired")] {
        faults.add(rule(
            "update",
            "bots",
            1,
            Fault::AddToReply(write_concern_error(code, name, &[])),
        ));
        let before = faults.seen("update", "bots");
        let (_, alive) = store
            .bots()
            .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{name} is sent again, not the caller's error: {e}"));
        assert_eq!(alive, [true; 3], "{name}: applied twice, fenced the same");
        assert_eq!(
            faults.seen("update", "bots") - before,
            2,
            "{name}: sent again once"
        );
    }
    // A write concern the deployment cannot satisfy: no second attempt would pass, so the
    // caller hears it — an `ok: 1` reply with a `writeConcernError` is never a success.
    faults.add(rule(
        "update",
        "bots",
        1,
        Fault::AddToReply(write_concern_error(100, "UnsatisfiableWriteConcern", &[])),
    ));
    let before = faults.seen("update", "bots");
    let result = store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await;
    match result {
        Err(Error::WriteConcern { code: 100, .. }) => {}
        other => panic!("expected the write concern error, got {other:?}"),
    }
    assert_eq!(faults.seen("update", "bots") - before, 1, "not sent again");
    assert_eq!(faults.applied("update", "bots"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_or_lost_in_a_failover_is_sent_again_and_applied_once() {
    let db = test_db("faults_retry").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let store = through(&faults, &db).await;
    let held = held_locks(&store).await;
    let locks: Vec<_> = held.iter().collect();
    // Refused twice (not primary), then applied with its acknowledgment failing as the primary
    // steps down (a retryable write concern error), then lost with its connection: every time
    // the store sends it again, and the fenced statements match the locks as before.
    faults.add(rule("update", "bots", 2, Fault::Answer(not_primary())));
    let before = faults.seen("update", "bots");
    let (_, alive) = store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await
        .expect("sent again until it was applied");
    assert_eq!(alive, [true; 3]);
    assert_eq!(faults.seen("update", "bots") - before, 3);

    faults.add(rule(
        "update",
        "bots",
        1,
        Fault::AddToReply(write_concern_error(
            189,
            "PrimarySteppedDown",
            &["RetryableWriteError"],
        )),
    ));
    let (_, alive) = store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await
        .expect("sent again after the write concern error");
    assert_eq!(
        alive, [true; 3],
        "applied twice, fenced the same: still ours"
    );

    faults.add(rule("update", "bots", 1, Fault::Drop));
    let before = faults.seen("update", "bots");
    let (_, alive) = store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await
        .expect("sent again on a new connection");
    assert_eq!(alive, [true; 3]);
    assert_eq!(faults.seen("update", "bots") - before, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crawl_through_a_failing_over_primary_stores_every_record_exactly() {
    // Leases, done marks, enqueues and record writes refused, unacknowledged, lost on the way or
    // applied with their majority wait cut short: the pass ends with every record as the shop
    // has it, seconds after a clean pass would — no step fails and no URL waits out its lease
    // (a minute here).
    let base = shop(3, 10).await;
    let setup = Setup {
        lease: "60s",
        ..Setup::default()
    };
    let timed_pass = |db: kit::TestDb, store: Store| {
        let settings = settings(&db, &base, &setup, "a");
        let base = &base;
        async move {
            let started = std::time::Instant::now();
            run_with_store(
                settings,
                store,
                Mode::Once {
                    timeout: Duration::from_secs(120),
                },
                CancellationToken::new(),
            )
            .await
            .expect("the pass finishes");
            assert_eq!(live_records(&db).await, truth(base).await);
            started.elapsed()
        }
    };
    let clean_db = test_db("faults_crawl_clean").await;
    let clean_faults = Faults::start(&kit::blackhole::server_of(&clean_db.uri)).await;
    let store = through(&clean_faults, &clean_db).await;
    let clean = timed_pass(clean_db, store).await;

    let db = test_db("faults_crawl").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let stepped_down = || {
        Fault::AddToReply(write_concern_error(
            189,
            "PrimarySteppedDown",
            &["RetryableWriteError"],
        ))
    };
    for (command, collection, times, fault) in [
        ("update", "frontier", 3, Fault::Answer(not_primary())),
        ("update", "frontier", 2, stepped_down()),
        ("insert", "frontier", 1, Fault::Answer(not_primary())),
        ("insert", "records", 2, stepped_down()),
        ("insert", "records", 1, Fault::Drop),
        ("update", "frontier", 1, Fault::Drop),
        (
            "update",
            "frontier",
            2,
            Fault::AddToReply(write_concern_error(64, "WriteConcernFailed", &[])),
        ),
        (
            "insert",
            "records",
            1,
            Fault::AddToReply(write_concern_error(50, "MaxTimeMSExpired", &[])),
        ),
    ] {
        faults.add(rule(command, collection, times, fault));
    }
    let store = through(&faults, &db).await;
    let took = timed_pass(db, store).await;
    for (command, collection) in [
        ("update", "frontier"),
        ("insert", "frontier"),
        ("insert", "records"),
    ] {
        assert!(
            faults.applied(command, collection) > 0,
            "no fault met {command} {collection}: the test proves nothing"
        );
    }
    // Each refusal costs the driver a check of the server (up to 2 s, its heartbeat here).
    assert!(
        took < clean + Duration::from_secs(30),
        "the pass took {took:?}, a clean one {clean:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_real_mongodb_writes_refused_by_the_fail_point_are_sent_again() {
    // Real MongoDB's own fault injection (`failCommand`, a test command the workflow's mongod
    // enables), scoped to this test's client by its application name, and set only once the
    // locks are held: its two refusals meet the heartbeat under test, not the claims before it.
    use bson::doc;
    let db = test_db("faults_failpoint").await;
    let mut options = mongodb::options::ClientOptions::parse(&db.uri)
        .await
        .unwrap();
    options.app_name = Some("seedlock-failpoint".into());
    options.heartbeat_freq = Some(Duration::from_millis(500));
    // The driver's own retry of a retryable write would take one refusal for itself.
    options.retry_writes = Some(false);
    let client = mongodb::Client::with_options(options).unwrap();
    let admin = client.database("admin");
    let store = Store::new(client.database(&db.name));
    let held = held_locks(&store).await;
    let locks: Vec<_> = held.iter().collect();
    let set = admin
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 2 },
            "data": {
                "failCommands": ["update"], "errorCode": 10107,
                "errorLabels": ["RetryableWriteError"], "appName": "seedlock-failpoint",
            },
        })
        .await;
    if let Err(e) = set {
        eprintln!("skipped: this server has no failCommand fail point ({e})");
        return;
    }
    let before = store.command_counts();
    let result = store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await;
    let after = store.command_counts();
    let _ = admin
        .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
        .await;
    let (_, alive) = result.expect("sent again past the fail point");
    assert_eq!(alive, [true; 3], "applied once, every lock still held");
    let sent = |counts: &std::collections::BTreeMap<String, u64>| {
        counts.get("heartbeat locks").copied().unwrap_or(0)
    };
    assert_eq!(
        sent(&after) - sent(&before),
        3,
        "refused twice by the fail point, then sent a third time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_by_a_member_no_longer_primary_is_seen_as_a_change_of_primary() {
    // The server clock is re-sampled when the primary changes: the store must notice.
    let db = test_db("faults_primary_change").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let store = through(&faults, &db).await;
    let held = held_locks(&store).await;
    let locks: Vec<_> = held.iter().collect();
    let before = store.primary_changes_seen();
    faults.add(rule("update", "bots", 1, Fault::Answer(not_primary())));
    store
        .bots()
        .heartbeat_all(&locks, Utc::now(), Duration::from_secs(30))
        .await
        .expect("sent again");
    assert!(
        store.primary_changes_seen() > before,
        "the not-primary answer was seen as a change of primary"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_was_lost_is_read_back_and_held() {
    // The server takes the claim and the connection closes before its answer: the claim is
    // sent again, matches nothing (the epoch moved), and the document says the lock is ours.
    let db = test_db("faults_claim_lost").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let store = through(&faults, &db).await;
    let (bot, me) = (BotId::parse("c").unwrap(), InstanceId::parse("me").unwrap());
    store
        .bots()
        .initialize(&bot, &me, Utc::now())
        .await
        .unwrap();
    faults.add(rule("findAndModify", "bots", 1, Fault::Drop));
    let held = store
        .bots()
        .claim(
            &bot,
            &me,
            seedlock::ids::LockEpoch::ZERO,
            seedlock::lock::state::Claim::Free,
            Utc::now(),
            Duration::from_secs(30),
            "t",
        )
        .await
        .expect("no error")
        .expect("the claim the server took is held, not waited out");
    assert_eq!(
        faults.applied("findAndModify", "bots"),
        1,
        "the answer was lost"
    );
    assert_eq!(held.epoch.get(), 1);
    assert_eq!(db.epoch("c").await, 1, "claimed once");
    // The lock works: its holder's writes pass the fence.
    store
        .bots()
        .complete(
            &held,
            &["http://x.test/".to_owned()],
            Utc::now(),
            seedlock::store::NextPass::None,
        )
        .await
        .expect("the holder completes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_write_whose_answer_was_lost_is_read_back_not_reported_as_a_lost_lock() {
    let db = test_db("faults_fenced_lost").await;
    let faults = Faults::start(&kit::blackhole::server_of(&db.uri)).await;
    let store = through(&faults, &db).await;
    let (bot, me) = (BotId::parse("r").unwrap(), InstanceId::parse("me").unwrap());
    store
        .bots()
        .initialize(&bot, &me, Utc::now())
        .await
        .unwrap();
    let held = kit::claim_free(&store, &bot, &me, Utc::now()).await;
    // The completion returns the document it left (a `findAndModify`).
    faults.add(rule("findAndModify", "bots", 1, Fault::Drop));
    store
        .bots()
        .complete(
            &held,
            &["http://x.test/".to_owned()],
            Utc::now(),
            seedlock::store::NextPass::None,
        )
        .await
        .expect("the completion the server took is seen as done, not as a lost lock");
    assert_eq!(
        faults.applied("findAndModify", "bots"),
        1,
        "the answer was lost"
    );
    let doc = db.doc("r").await.unwrap();
    assert_eq!(doc.get_bool("isReady"), Ok(true));
    assert_eq!(doc.get_bool("isEditing"), Ok(false));
    let events = |event: &'static str| {
        let db = &db;
        async move {
            db.history("r")
                .await
                .iter()
                .filter(|h| h.get_str("event") == Ok(event))
                .count()
        }
    };
    assert_eq!(events("refreshed").await, 1, "applied once");
    // The other last writes (an `update`): a release whose answer was lost.
    let held = store
        .bots()
        .claim(
            &bot,
            &me,
            held.epoch,
            seedlock::lock::state::Claim::Free,
            Utc::now(),
            Duration::from_secs(30),
            "t",
        )
        .await
        .unwrap()
        .expect("claimed again");
    faults.add(rule("update", "bots", 1, Fault::Drop));
    store
        .bots()
        .release(&held, Utc::now(), "test")
        .await
        .expect("the release the server took is seen as done, not as a lost lock");
    assert_eq!(faults.applied("update", "bots"), 1, "the answer was lost");
    let doc = db.doc("r").await.unwrap();
    assert_eq!(doc.get_bool("isEditing"), Ok(false));
    assert_eq!(events("released").await, 1, "applied once");
}
