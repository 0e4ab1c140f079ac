//! The alert rules (deploy/alerts.yml): every rule's metric, produced by the behaviour the rule
//! is about — a stuck lock taken over, failing refreshes, a takeover storm, a fenced holder, crawl
//! leases lost, a host answering with errors, a stalled stage, an instance gone. The rules'
//! thresholds and `for` durations are checked by promtool's unit tests (deploy/alerts.test.yml,
//! scripts/check-alerts); here, that seedlock really exports what they read.

use crate::kit;

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::Utc;
use kit::crawl::*;
use kit::*;
use seedlock::clock::LocalClock;
use seedlock::config::{OnRefreshFailure, RefreshSchedule};
use seedlock::daemon::{run, Mode};
use seedlock::ids::BotId;
use seedlock::runner::StepOutcome;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Every rule in deploy/alerts.yml: the metric its expression reads and the test here that
/// produces it.
const ALERTS: &[(&str, &str, &str)] = &[
    (
        "SeedlockPassGated",
        "seedlock_pass_gated",
        "a_pass_that_removes_records_is_exported_from_the_document_by_every_instance",
    ),
    (
        "SeedlockLockHeldPastMaxRefresh",
        "seedlock_lock_takeovers_total",
        "a_lock_held_past_max_refresh_is_counted_as_a_stuck_takeover",
    ),
    (
        "SeedlockRefreshesFailing",
        "seedlock_refreshes_total",
        "failing_refreshes_are_counted_one_by_one",
    ),
    (
        "SeedlockTakeoverStorm",
        "seedlock_lock_takeovers_total",
        "every_takeover_is_counted_for_the_storm_alert",
    ),
    (
        "SeedlockEditLockLost",
        "seedlock_edit_locks_lost_total",
        "a_holder_fenced_by_an_unlock_counts_a_lost_edit_lock",
    ),
    (
        "SeedlockCrawlLeasesLost",
        "seedlock_crawl_url_leases_lost_total",
        "pages_stored_after_their_lease_went_to_another_worker_are_counted",
    ),
    (
        "SeedlockHostRetryRatioHigh",
        "seedlock_host_retry_ratio",
        "a_host_answering_503_raises_its_retry_ratio_above_the_alert_threshold",
    ),
    (
        "SeedlockCrawlItemsOld",
        "seedlock_crawl_stage_oldest_seconds",
        "a_slow_store_shows_as_the_age_of_the_oldest_item_in_the_store_stage",
    ),
    (
        "SeedlockNoCompletePass",
        "seedlock_last_complete_pass_timestamp_seconds",
        "a_pass_that_removes_records_is_exported_from_the_document_by_every_instance",
    ),
    (
        "SeedlockRemovalSpike",
        "seedlock_records_removed_total",
        "a_pass_that_removes_records_is_exported_from_the_document_by_every_instance",
    ),
    (
        "SeedlockInstanceDown",
        "up",
        "a_killed_instance_stops_answering_scrapes",
    ),
];

/// The rules file as (alert, expr) pairs.
fn rules() -> Vec<(String, String)> {
    let text = include_str!("../../deploy/alerts.yml");
    let mut out: Vec<(String, String)> = Vec::new();
    // Inside a folded `expr: >-`: the lines of the expression, until the next key.
    let mut folded = false;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            out.push((name.to_owned(), String::new()));
            folded = false;
        } else if let Some(expr) = line.strip_prefix("expr: ") {
            folded = expr == ">-";
            if !folded {
                out.last_mut().expect("expr after alert").1 = expr.to_owned();
            }
        } else if folded && (line.contains(": ") || line.ends_with(':')) {
            folded = false;
        } else if folded {
            let expr = &mut out.last_mut().expect("expr after alert").1;
            expr.push(' ');
            expr.push_str(line);
        }
    }
    out
}

#[test]
fn every_alert_rule_has_a_test_producing_its_metric() {
    let rules = rules();
    assert!(rules.len() >= 8, "{rules:?}");
    let source = include_str!("alerts.rs");
    for (alert, expr) in &rules {
        let Some((_, metric, test)) = ALERTS.iter().find(|(a, _, _)| a == alert) else {
            panic!("alert {alert} has no test in tests/alerts.rs");
        };
        assert!(
            expr.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|token| token == *metric),
            "{alert}'s expression `{expr}` does not read {metric}"
        );
        assert!(
            source.contains(&format!("async fn {test}()")),
            "{alert}: no test named {test}"
        );
    }
    for (alert, _, _) in ALERTS {
        assert!(
            rules.iter().any(|(a, _)| a == alert),
            "{alert} is tested but not in deploy/alerts.yml"
        );
    }
}

/// One series' value in a Prometheus text exposition (`name{labels}` exactly as exported).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

// ---- lock alerts: an instance's state machine, in-process -----------------------------------

use seedlock::store::date as bdate;

/// A bot document locked by "ghost", its refresh started at `started`, expiring at `expires`.
fn locked_doc(
    epoch: i64,
    started: chrono::DateTime<Utc>,
    expires: chrono::DateTime<Utc>,
) -> Document {
    doc! {
        "_id": "shop", "isReady": false, "isEditing": true, "seeds": ["http://old/"],
        "lastUpdateStartedAt": bdate(started), "lastSeedUpdatedAt": bdate(started),
        "editingBy": "ghost", "lockEpoch": epoch, "heartbeatAt": bdate(started),
        "lockExpiresAt": bdate(expires), "lastError": Bson::Null, "failedRefreshes": 0,
        "refreshRequestedAt": Bson::Null, "retryRefreshAfter": Bson::Null, "history": [],
    }
}

struct Instance {
    db: TestDb,
    source: SeedSourceServer,
    runner: seedlock::runner::BotRunner,
    ctx: std::sync::Arc<seedlock::runner::Context>,
}

/// ttl 3 s, max_refresh 10 s.
async fn instance(hint: &str) -> Instance {
    let db = test_db(hint).await;
    let source = SeedSourceServer::start().await;
    let ctx = context(&db, "me", lock(3_000, 10_000, 100), LocalClock::default()).await;
    let runner = runner(
        bot(
            "shop",
            &source.url(),
            RefreshSchedule::Daily,
            OnRefreshFailure::KeepPrevious,
        ),
        ctx.clone(),
    );
    Instance {
        db,
        source,
        runner,
        ctx,
    }
}

impl Instance {
    async fn put(&self, d: Document) {
        self.db.put_bot(d).await;
    }

    async fn step(&self) -> StepOutcome {
        self.runner
            .step(&CancellationToken::new())
            .await
            .expect("step")
    }

    fn metric(&self, series: &str) -> Option<f64> {
        sample(&self.ctx.metrics.encode(), series)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_past_max_refresh_is_counted_as_a_stuck_takeover() {
    let i = instance("alert_stuck").await;
    let now = i.ctx.clock.now();
    // Heartbeating (expires in the future) but started 14 s ago: past max_refresh (10 s) and
    // its grace (3 s).
    i.put(locked_doc(
        5,
        now - chrono::Duration::seconds(14),
        now + chrono::Duration::seconds(20),
    ))
    .await;
    assert_eq!(
        i.metric(r#"seedlock_lock_takeovers_total{bot="shop",kind="stuck"}"#),
        None
    );
    assert!(matches!(
        i.step().await,
        StepOutcome::Refreshed { epoch, .. } if epoch.get() == 6
    ));
    // The rule: increase(seedlock_lock_takeovers_total{kind="stuck"}[30m]) > 0.
    assert_eq!(
        i.metric(r#"seedlock_lock_takeovers_total{bot="shop",kind="stuck"}"#),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_refreshes_are_counted_one_by_one() {
    let i = instance("alert_failing").await;
    i.source.set_failing(true);
    let bot = BotId::parse("shop").unwrap();
    for n in 1..=3 {
        if n > 1 {
            // An admin's request overrides the failure backoff: the next step refreshes again.
            assert!(i
                .db
                .store()
                .bots()
                .request_refresh(&bot, "test", Utc::now())
                .await
                .unwrap());
        }
        let outcome = i.step().await;
        let outcome = if matches!(outcome, StepOutcome::Initialized) {
            i.step().await
        } else {
            outcome
        };
        assert!(
            matches!(outcome, StepOutcome::RefreshFailed { .. }),
            "refresh {n}: {outcome:?}"
        );
    }
    // The rule: increase(seedlock_refreshes_total{kind="failed"}[1h]) >= 3.
    assert_eq!(
        i.metric(r#"seedlock_refreshes_total{bot="shop",kind="failed"}"#),
        Some(3.0)
    );
    assert_eq!(i.source.hits(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_takeover_is_counted_for_the_storm_alert() {
    let i = instance("alert_storm").await;
    for n in 1..=4_i64 {
        // A holder that died: its lock expired a second ago.
        let now = i.ctx.clock.now();
        let epoch = 10 * n;
        i.put(locked_doc(
            epoch,
            now - chrono::Duration::seconds(5),
            now - chrono::Duration::seconds(1),
        ))
        .await;
        let outcome = i.step().await;
        assert!(
            matches!(outcome, StepOutcome::Refreshed { epoch: e, .. } if e.get() == epoch + 1),
            "takeover {n}: {outcome:?}"
        );
    }
    // The rule: sum by (bot) (increase(seedlock_lock_takeovers_total[10m])) > 3.
    assert_eq!(
        i.metric(r#"seedlock_lock_takeovers_total{bot="shop",kind="expired"}"#),
        Some(4.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_fenced_by_an_unlock_counts_a_lost_edit_lock() {
    let i = std::sync::Arc::new(instance("alert_lease_lost").await);
    i.source.stall_first(2);
    let holder = {
        let i = i.clone();
        tokio::spawn(async move {
            loop {
                match i.step().await {
                    StepOutcome::Initialized => continue,
                    outcome => return outcome,
                }
            }
        })
    };
    eventually(
        "the holder is fetching its seeds",
        Duration::from_secs(10),
        || async { i.source.hits() == 1 },
    )
    .await;
    let bot = BotId::parse("shop").unwrap();
    i.db.store()
        .bots()
        .admin_unlock(&bot, "admin", "alert test", Utc::now())
        .await
        .unwrap();
    i.source.release();
    let outcome = tokio::time::timeout(Duration::from_secs(10), holder)
        .await
        .expect("the holder stops")
        .unwrap();
    assert!(matches!(outcome, StepOutcome::EditLockLost), "{outcome:?}");
    // The rule: increase(seedlock_edit_locks_lost_total[30m]) > 0.
    assert_eq!(
        i.metric(r#"seedlock_edit_locks_lost_total{bot="shop"}"#),
        Some(1.0)
    );
    assert_eq!(
        i.db.doc("shop")
            .await
            .unwrap()
            .get_array("seeds")
            .map(|s| s.len())
            .unwrap_or(0),
        0
    );
}

// ---- crawl alerts: the daemon in-process, its /metrics scraped --------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_stored_after_their_lease_went_to_another_worker_are_counted() {
    let db = test_db("alert_url_leases").await;
    let base = shop(2, 10).await;
    let (slow_addr, fast_addr) = (free_addr(), free_addr());
    // The slow instance holds every fetched page for 2.5 s before storing it; its 1 s leases
    // run out meanwhile and the fast instance takes the pages over.
    let slow = Setup {
        workers: 4,
        crawl: "store_delay = \"2500ms\"",
        listen: &slow_addr,
        lease: "1s",
        timeout: "900ms",
        ..Setup::default()
    };
    let fast = Setup {
        workers: 4,
        listen: &fast_addr,
        lease: "1s",
        timeout: "900ms",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let slow = tokio::spawn(run(
        settings(&db, &base, &slow, "slow"),
        Mode::Daemon,
        stop.clone(),
    ));
    // The fast one joins once the slow one holds pages in its store stage.
    eventually(
        "the slow instance holds pages in its store stage",
        Duration::from_secs(20),
        || async {
            metric(
                &slow_addr,
                r#"seedlock_crawl_stage_depth{bot="shop",stage="store"}"#,
            )
            .await
            .unwrap_or(0.0)
                >= 1.0
        },
    )
    .await;
    once(settings(&db, &base, &fast, "fast")).await;
    eventually(
        "the slow instance finds its late pages taken over",
        Duration::from_secs(20),
        || async {
            metric(
                &slow_addr,
                r#"seedlock_crawl_url_leases_lost_total{bot="shop"}"#,
            )
            .await
            .unwrap_or(0.0)
                >= 1.0
        },
    )
    .await;
    // (The wait above read the counter from /metrics: it is exported, at 1 or more.)
    stop.cancel();
    let _ = slow.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_answering_503_raises_its_retry_ratio_above_the_alert_threshold() {
    let db = test_db("alert_retry_ratio").await;
    let base = shop(1, 10).await;
    let host = base.trim_start_matches("http://").to_owned();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "status": 503}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        // Two retries a product, all within the budget.
        crawl: "attempts = 3\nretry_budget_min = 30",
        listen: &listen,
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let ratios = sampler(
        listen.clone(),
        format!(r#"seedlock_host_retry_ratio{{host="{host}"}}"#),
        stop.clone(),
    );
    once(settings(&db, &base, &setup, "a")).await;
    // Sampled once more after the pass: the ratio is over the retry window, not the pass.
    let after = metric(
        &listen,
        &format!(r#"seedlock_host_retry_ratio{{host="{host}"}}"#),
    )
    .await;
    stop.cancel();
    let seen = ratios.await.unwrap();
    // The rule: max by (host) (seedlock_host_retry_ratio) > 0.5.
    let peak = seen.iter().chain(after.iter()).copied().fold(0.0, f64::max);
    assert!(peak > 0.5, "retry ratio peaked at {peak}: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_shows_as_the_age_of_the_oldest_item_in_the_store_stage() {
    let db = test_db("alert_oldest").await;
    let base = shop(1, 6).await;
    let listen = free_addr();
    let setup = Setup {
        workers: 4,
        crawl: "writers = 1\nstore_delay = \"1500ms\"",
        lease: "30s",
        listen: &listen,
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let ages = sampler(
        listen.clone(),
        r#"seedlock_crawl_stage_oldest_seconds{bot="shop",stage="store"}"#.into(),
        stop.clone(),
    );
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let seen = ages.await.unwrap();
    // The rule: max by (bot, stage) (seedlock_crawl_stage_oldest_seconds) > 300 for 5m. With
    // one writer at 1.5 s a page, pages queue behind each other: the oldest waits > 1.5 s.
    let peak = seen.iter().copied().fold(0.0, f64::max);
    assert!(
        peak >= 1.5,
        "the store stage's oldest item reached {peak} s: {seen:?}"
    );
}

// ---- instance down: a real process, killed ---------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_stops_answering_scrapes() {
    let db = test_db("alert_down").await;
    let source = SeedSourceServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = ProcConfig::new(&db, url_bot("shop", &source.url())).write(dir.path());
    let mut a = Proc::spawn(
        dir.path(),
        &config,
        "a",
        &["run"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    );
    let addr = a.http_addr().await;
    let scrape = |addr: String| async move {
        reqwest::Client::new()
            .get(format!("http://{addr}/metrics"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    };
    // Prometheus' `up` is 1 while the scrape succeeds…
    assert!(scrape(addr.clone()).await, "a live instance answers");
    a.kill9().await;
    // …and 0 once it fails: the rule `up{job="seedlock"} == 0`.
    assert!(!scrape(addr).await, "a killed instance answers nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_connection_pool_shows_its_waits_in_the_metrics() {
    // Two connections (the bots change stream holds one) for a crawl with four workers: its
    // operations queue for the other, and the time they wait is exported.
    let db = test_db("alert_pool").await;
    let base = shop(3, 10).await;
    let listen = free_addr();
    let setup = Setup {
        workers: 4,
        listen: &listen,
        ..Setup::default()
    };
    let mut settings = settings(&db, &base, &setup, "a");
    settings.mongo.max_pool_size = 2;
    let stop = CancellationToken::new();
    let waits = sampler(
        listen.clone(),
        "seedlock_db_pool_wait_seconds_total".into(),
        stop.clone(),
    );
    let checkouts = sampler(
        listen.clone(),
        "seedlock_db_pool_checkouts_total".into(),
        stop.clone(),
    );
    once(settings).await;
    stop.cancel();
    let most = |v: Vec<f64>| v.into_iter().fold(0.0, f64::max);
    let (waited, checked_out) = (most(waits.await.unwrap()), most(checkouts.await.unwrap()));
    assert!(checked_out > 0.0, "no check-out counted");
    assert!(waited > 0.0, "{checked_out} check-outs and no wait counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_removes_records_is_exported_from_the_document_by_every_instance() {
    // Instance a crawls the shop twice; between the passes the shop drops 4 of its 20
    // products, more than the drift gate lets a pass remove (10%): the pass is gated until it is
    // released. Instance b, which crawled nothing, exports what a's passes kept in the bot's
    // document: the rules read `max by (bot)` over every instance.
    let db = test_db("alert_catalogue").await;
    let base = shop(2, 10).await;
    once(settings(&db, &base, &Setup::default(), "a")).await;
    post(&format!("{base}/__mutate"), json!({"delete": 4})).await;
    request_refresh(&db).await;
    let before_second = Utc::now();
    once(settings(&db, &base, &Setup::default(), "a")).await;
    assert_eq!(removed_keys(&db).await.len(), 0, "held by the gate");

    let listen = free_addr();
    let setup = Setup {
        listen: &listen,
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let b = tokio::spawn(run(
        settings(&db, &base, &setup, "b"),
        Mode::Daemon,
        stop.clone(),
    ));
    let series = |name: &str| format!(r#"{name}{{bot="shop"}}"#);
    eventually("b exports the gated pass", Duration::from_secs(20), || {
        let (listen, gated) = (listen.clone(), series("seedlock_pass_gated"));
        async move { metric(&listen, &gated).await == Some(1.0) }
    })
    .await;
    let released = settle(&db, 2, seedlock::store::release::Settle::Release).await;
    assert_eq!(released.map(|r| r.removed), Some(4));
    eventually(
        "b exports the removed total",
        Duration::from_secs(20),
        || {
            let (listen, removed) = (listen.clone(), series("seedlock_records_removed_total"));
            async move { metric(&listen, &removed).await == Some(4.0) }
        },
    )
    .await;
    let value = |name: &'static str| {
        let (listen, name) = (listen.clone(), series(name));
        async move { metric(&listen, &name).await }
    };
    assert_eq!(value("seedlock_live_records").await, Some(16.0));
    assert_eq!(value("seedlock_pass_gated").await, Some(0.0));
    assert_eq!(
        value("seedlock_change_events_released_total").await,
        Some(24.0),
        "20 added, then 4 removed"
    );
    assert_eq!(value("seedlock_pass_coverage_ratio").await, Some(1.0));
    // The settings' `refresh = "1h"`: the rule's "twice the refresh interval".
    assert_eq!(
        value("seedlock_refresh_interval_seconds").await,
        Some(3600.0)
    );
    let complete = value("seedlock_last_complete_pass_timestamp_seconds")
        .await
        .expect("the last complete pass");
    let second = before_second.timestamp_millis() as f64 / 1000.0;
    assert!(
        complete >= second && complete <= Utc::now().timestamp_millis() as f64 / 1000.0,
        "the last complete pass at {complete}, the second pass started at {second}"
    );
    stop.cancel();
    b.await.unwrap().expect("b stops cleanly");
}
