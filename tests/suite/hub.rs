//! An instance's shared upkeep against the real server (`lock::hub`): every held lock renewed in
//! one round trip a tick, fenced per lock; refreshes bounded by the permits; an idle instance
//! reads no bot document on a timer of its own.

use crate::kit;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bson::doc;
use chrono::Utc;
use kit::*;
use seedlock::clock::LocalClock;
use seedlock::config::{OnRefreshFailure, RefreshSchedule};
use seedlock::ids::{BotId, InstanceId};
use seedlock::runner::{RunEnd, Until};
use tokio_util::sync::CancellationToken;

fn id(s: &str) -> BotId {
    BotId::parse(s).unwrap()
}

/// The `name` commands a store sent between two of its counts.
fn sent_between(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, name: &str) -> u64 {
    after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_held_lock_is_renewed_in_one_round_trip_and_a_lost_one_is_named() {
    let db = test_db("hub_beats").await;
    let store = db.store();
    let me = InstanceId::parse("me").unwrap();
    let now = Utc::now();
    let mut held = Vec::new();
    for i in 0..5 {
        let bot = id(&format!("b{i}"));
        store.bots().initialize(&bot, &me, now).await.unwrap();
        held.push(claim_free(&store, &bot, &me, now).await);
    }
    // An admin unlocks b2: its epoch moves past the one held here.
    store
        .bots()
        .admin_unlock(&id("b2"), "admin", "test", now)
        .await
        .unwrap();
    let before = store.command_counts();
    let later = now + chrono::Duration::seconds(5);
    let locks: Vec<_> = held.iter().collect();
    let (expires, alive) = store
        .bots()
        .heartbeat_all(&locks, later, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(alive, [true, true, false, true, true]);
    let after = store.command_counts();
    let sent = |name: &str| sent_between(&before, &after, name);
    assert_eq!(
        sent("heartbeat locks"),
        1,
        "one round trip for every lock: {after:?}"
    );
    assert_eq!(sent("read held locks"), 1, "one read to name the lost one");
    for i in 0..5 {
        let doc = db.doc(&format!("b{i}")).await.unwrap();
        let renewed = doc
            .get_datetime("lockExpiresAt")
            .ok()
            .map(|t| t.to_chrono());
        if i == 2 {
            assert_eq!(renewed, None, "the unlocked bot is not written");
        } else {
            assert_eq!(
                renewed.map(|t| t.timestamp_millis()),
                Some(expires.timestamp_millis())
            );
        }
    }
    // With every lock alive, the answer needs no read.
    let locks: Vec<_> = held.iter().filter(|l| l.bot != id("b2")).collect();
    let before = store.command_counts();
    let (_, alive) = store
        .bots()
        .heartbeat_all(&locks, later, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(alive, [true; 4]);
    let after = store.command_counts();
    assert_eq!(after.get("read held locks"), before.get("read held locks"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bots_beyond_the_refresh_permits_are_not_locked_until_a_permit_is_free() {
    // One permit, three bots due at once, each refresh held at the source: the bots are
    // refreshed one after another — never two locks at a time — and each exactly once.
    let db = test_db("hub_permits").await;
    let source = SeedSourceServer::start().await;
    let ctx = context_with_permits(
        &db,
        "me",
        lock(3_000, 20_000, 100),
        LocalClock::default(),
        1,
    )
    .await;
    source.hold_bot_sources(true);
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for name in ["p1", "p2", "p3"] {
        let mut settings = bot(
            name,
            &source.bot_url(name),
            RefreshSchedule::Daily,
            OnRefreshFailure::KeepPrevious,
        );
        settings.id = id(name);
        let runner = Arc::new(runner(settings, ctx.clone()));
        let stop = stop.clone();
        runs.push(tokio::spawn(
            async move { runner.run(Until::Done, &stop).await },
        ));
    }
    eventually(
        "one refresh is held at its source",
        Duration::from_secs(20),
        || async { source.bot_hits().values().sum::<usize>() == 1 },
    )
    .await;
    let editing = db
        .bots()
        .count_documents(doc! { "isEditing": true })
        .await
        .unwrap();
    assert_eq!(editing, 1, "the bots without a permit are not locked");
    source.hold_bot_sources(false);
    for run in runs {
        assert!(matches!(run.await.unwrap(), RunEnd::Ready { .. }));
    }
    let hits = source.bot_hits();
    assert_eq!(
        ["p1", "p2", "p3"].map(|b| hits.get(b).copied()),
        [Some(1); 3],
        "each bot refreshed exactly once"
    );
    // The lock spans (claim → last write) never overlap.
    let mut spans = Vec::new();
    for name in ["p1", "p2", "p3"] {
        let history = db.history(name).await;
        let at = |event: &str| {
            history
                .iter()
                .find(|h| h.get_str("event") == Ok(event))
                .and_then(|h| h.get_datetime("at").ok())
                .map(|t| t.timestamp_millis())
                .unwrap_or_else(|| panic!("{name}: no {event} in {history:?}"))
        };
        spans.push((at("acquired"), at("refreshed")));
    }
    spans.sort();
    for pair in spans.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "two locks held at once: {spans:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_reads_no_bot_document_on_a_timer_of_its_own() {
    // Ten ready bots, nothing due: in the hub's next polls the instance sends its one digest read
    // per poll and reads no bot's document; one change stream serves every runner.
    let db = test_db("hub_idle").await;
    let source = SeedSourceServer::start().await;
    let ctx = context(&db, "me", lock(3_000, 20_000, 100), LocalClock::default()).await;
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for i in 0..10 {
        let name = format!("i{i}");
        let mut settings = bot(
            &name,
            &source.bot_url(&name),
            RefreshSchedule::Daily,
            OnRefreshFailure::KeepPrevious,
        );
        settings.id = id(&name);
        let runner = Arc::new(runner(settings, ctx.clone()));
        let stop = stop.clone();
        runs.push(tokio::spawn(async move {
            runner.run(Until::Shutdown, &stop).await
        }));
    }
    eventually("every bot ready", Duration::from_secs(30), || async {
        db.bots()
            .count_documents(doc! { "isReady": true, "isEditing": false })
            .await
            .unwrap()
            == 10
    })
    .await;
    // Let the last wake-ups of the refreshes settle: two polls.
    let digests = || {
        ctx.store
            .command_counts()
            .get("read bot digests")
            .copied()
            .unwrap_or(0)
    };
    let settled = digests() + 2;
    eventually("two hub polls", Duration::from_secs(10), || async {
        digests() >= settled
    })
    .await;
    let counts = ctx.store.command_counts();
    let reads = counts.get("find bot").copied().unwrap_or(0);
    let polls = digests();
    eventually("five more hub polls", Duration::from_secs(10), || async {
        digests() >= polls + 5
    })
    .await;
    let after = ctx.store.command_counts();
    assert_eq!(
        after.get("find bot").copied().unwrap_or(0),
        reads,
        "an idle bot's document is not read: {after:?}"
    );
    assert_eq!(
        after.get("watch bots").copied(),
        Some(1),
        "one change stream: {after:?}"
    );
    stop.cancel();
    for run in runs {
        assert_eq!(run.await.unwrap(), RunEnd::Shutdown);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_bot_is_created_locked_refreshed_and_ready_on_one_read_of_its_document() {
    // The steps after the document's creation and after the lock's last write decide from the
    // document those writes returned: one read in all, the first step's, which found nothing.
    let db = test_db("hub_one_read").await;
    let source = SeedSourceServer::start().await;
    let ctx = context(&db, "me", lock(3_000, 20_000, 100), LocalClock::default()).await;
    let mut settings = bot(
        "fresh",
        &source.bot_url("fresh"),
        RefreshSchedule::Daily,
        OnRefreshFailure::KeepPrevious,
    );
    settings.id = id("fresh");
    let runner = runner(settings, ctx.clone());
    let before = ctx.store.command_counts();
    let end = runner.run(Until::Done, &CancellationToken::new()).await;
    assert!(matches!(end, RunEnd::Ready { seeds: 1.., .. }), "{end:?}");
    let after = ctx.store.command_counts();
    let sent = |name: &str| sent_between(&before, &after, name);
    assert_eq!(sent("initialize"), 1, "{after:?}");
    assert_eq!(sent("claim"), 1, "{after:?}");
    assert_eq!(sent("find bot"), 1, "one read of the document: {after:?}");
    let doc = db.doc("fresh").await.unwrap();
    assert_eq!(doc.get_bool("isReady"), Ok(true));
    assert_eq!(doc.get_bool("isEditing"), Ok(false));
    assert_eq!(source.bot_hits().get("fresh").copied(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_wakes_no_runner_and_a_change_of_a_document_does() {
    use futures_util::StreamExt;
    let db = test_db("hub_quiet_beats").await;
    let store = db.store();
    let me = InstanceId::parse("me").unwrap();
    let now = Utc::now();
    for bot in ["beating", "asked"] {
        store.bots().initialize(&id(bot), &me, now).await.unwrap();
    }
    let lock = claim_free(&store, &id("beating"), &me, now).await;
    let mut changes = store.bots().watch_bots().await.expect("a change stream");
    // The holder's heartbeat first, then an admin's refresh request on another bot: the stream's
    // first event is the request, so the heartbeat woke nobody.
    let later = now + chrono::Duration::seconds(5);
    let (_, alive) = store
        .bots()
        .heartbeat_all(&[&lock], later, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(alive, [true], "the heartbeat was written");
    assert!(store
        .bots()
        .request_refresh(&id("asked"), "admin", later)
        .await
        .unwrap());
    let first = tokio::time::timeout(Duration::from_secs(10), changes.next())
        .await
        .expect("an event within 10 s")
        .expect("the stream goes on")
        .unwrap();
    assert_eq!(first.id.as_deref(), Some("asked"), "{first:?}");
    assert!(!first.concerns_fleet);
}
