//! Races and crashes with real `seedlock` processes and real signals.

// Document fields read best as `field == value`.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::time::{Duration, Instant};

use kit::*;
use nix::sys::signal::Signal;

struct Setup {
    db: TestDb,
    source: SeedSourceServer,
    dir: tempfile::TempDir,
}

async fn setup(hint: &str) -> Setup {
    Setup {
        db: test_db(hint).await,
        source: SeedSourceServer::start().await,
        dir: tempfile::tempdir().unwrap(),
    }
}

impl Setup {
    fn config(&self, ttl: &str, poll: &str) -> std::path::PathBuf {
        ProcConfig {
            ttl,
            poll,
            ..ProcConfig::new(&self.db, url_bot("shop", &self.source.url()))
        }
        .write(self.dir.path())
    }

    async fn holder(&self) -> Option<String> {
        let doc = self.db.doc("shop").await?;
        if doc.get_bool("isEditing").ok()? {
            doc.get_str("editingBy").ok().map(str::to_owned)
        } else {
            None
        }
    }

    async fn is_ready(&self) -> bool {
        self.db
            .doc("shop")
            .await
            .is_some_and(|d| d.get_bool("isReady") == Ok(true))
    }

    async fn seeds(&self) -> Vec<String> {
        let d = self.db.doc("shop").await.unwrap();
        d.get_array("seeds")
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    }

    /// Waits until instance "a" holds the lock and its seed request (number `hit`) has reached the
    /// source, so a signal sent next finds it mid-refresh.
    async fn a_holds_the_lock_with_its_fetch_stalled(&self, hit: usize) {
        eventually(
            "a holds the lock, its fetch stalled at the source",
            Duration::from_secs(20),
            || async { self.holder().await.as_deref() == Some("a") && self.source.hits() == hit },
        )
        .await;
    }

    /// (event, by, epoch) of every history entry.
    async fn events(&self) -> Vec<(String, String, i64)> {
        self.db
            .history("shop")
            .await
            .iter()
            .map(|h| {
                (
                    h.get_str("event").unwrap().to_owned(),
                    h.get_str("by").unwrap().to_owned(),
                    h.get_i64("epoch").unwrap(),
                )
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_processes_on_a_fresh_bot_make_exactly_one_refresh() {
    let s = setup("ten").await;
    let config = s.config("5s", "200ms");
    let mut procs: Vec<Proc> = (0..10)
        .map(|i| {
            Proc::spawn(
                s.dir.path(),
                &config,
                &format!("p{i}"),
                &["run", "--once", "--timeout", "60s"],
                &[],
            )
        })
        .collect();
    let mut lines = Vec::new();
    for p in &mut procs {
        p.expect_ok(Duration::from_secs(90)).await;
        let out = p.out();
        let line = out
            .lines()
            .find(|l| l.starts_with("shop ready"))
            .unwrap_or_else(|| panic!("{}: no summary in {out:?}", p.name));
        lines.push(line.to_owned());
    }
    assert_eq!(
        s.source.hits(),
        1,
        "exactly one refresh reached the seed source"
    );
    assert!(
        lines.iter().all(|l| l == &lines[0]),
        "all ten saw the same epoch and seeds: {lines:#?}"
    );
    assert_eq!(s.seeds().await, SeedSourceServer::seeds_of_hit(1));
    assert_eq!(s.db.epoch("shop").await, 1, "one acquisition, no takeover");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_holder_is_taken_over_within_ttl_and_poll() {
    let s = setup("sigkill").await;
    s.source.stall_first(1);
    let (ttl, poll) = (Duration::from_secs(2), Duration::from_millis(200));
    let config = s.config("2s", "200ms");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    let mut b = Proc::spawn(
        s.dir.path(),
        &config,
        "b",
        &["run", "--once", "--timeout", "60s"],
        &[],
    );
    eventually(
        "b is running and waiting",
        Duration::from_secs(20),
        || async { b.log().contains("waiting") },
    )
    .await;
    a.kill9().await;
    let killed = Instant::now();
    // The history, not the live lock: b may finish its refresh between two looks.
    eventually("b takes over", Duration::from_secs(20), || async {
        s.events()
            .await
            .iter()
            .any(|(e, by, _)| e == "took_over" && by == "b")
    })
    .await;
    let took = killed.elapsed();
    // The last heartbeat was at most ttl/3 before the kill, so expiry is at most ttl after it.
    // The allowance above ttl + poll covers poll jitter (+20%) and process scheduling.
    assert!(
        took <= ttl + poll + poll / 5 + Duration::from_millis(700),
        "takeover took {took:?}"
    );
    b.expect_ok(Duration::from_secs(30)).await;
    assert!(s.is_ready().await);
    assert_eq!(s.db.epoch("shop").await, 2, "the takeover raised the epoch");
    assert_eq!(
        s.seeds().await,
        SeedSourceServer::seeds_of_hit(2),
        "b's refresh"
    );
    assert!(s
        .events()
        .await
        .iter()
        .any(|(e, by, epoch)| e == "took_over" && by == "b" && *epoch == 2));
    s.source.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_holder_resumes_and_its_writes_are_rejected() {
    let s = setup("sigstop").await;
    s.source.stall_first(1);
    let config = s.config("1500ms", "200ms");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    a.signal(Signal::SIGSTOP);
    let mut b = Proc::spawn(
        s.dir.path(),
        &config,
        "b",
        &["run", "--once", "--timeout", "60s"],
        &[],
    );
    let status = b.wait(Duration::from_secs(30)).await;
    assert!(
        status.success(),
        "b completes while a is stopped: {}",
        b.log()
    );
    assert_eq!(s.seeds().await, SeedSourceServer::seeds_of_hit(2));
    // Let a's stalled fetch answer (with generation-1 seeds) and wake a up.
    s.source.release();
    a.signal(Signal::SIGCONT);
    eventually(
        "a notices it lost the lease",
        Duration::from_secs(20),
        || async { a.log().contains("edit lock lost") },
    )
    .await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(20)).await;
    assert_eq!(
        s.seeds().await,
        SeedSourceServer::seeds_of_hit(2),
        "the seeds are the new holder's"
    );
    let events = s.events().await;
    assert!(
        !events
            .iter()
            .any(|(e, by, _)| by == "a" && e != "acquired" && e != "created"),
        "no write of a's was accepted after it was stopped: {events:?}"
    );
    let epochs: Vec<i64> = events
        .iter()
        .filter(|(e, _, _)| e == "acquired" || e == "took_over")
        .map(|x| x.2)
        .collect();
    assert!(
        epochs.windows(2).all(|w| w[0] < w[1]),
        "epochs strictly increase: {epochs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_refresh_stops_the_work_then_releases() {
    let s = setup("sigterm").await;
    s.source.stall_first(1);
    let config = s.config("5s", "200ms");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(20)).await;
    let doc = s.db.doc("shop").await.unwrap();
    assert_eq!(
        doc.get_bool("isEditing").unwrap(),
        false,
        "the lock was released"
    );
    let last = s.events().await.pop().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1.as_str(), last.2),
        ("released", "a", 1)
    );
    // The next instance claims at once instead of waiting out the ttl.
    let mut b = Proc::spawn(
        s.dir.path(),
        &config,
        "b",
        &["run", "--once", "--timeout", "4s"],
        &[],
    );
    b.expect_ok(Duration::from_secs(20)).await;
    s.source.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_with_a_two_hour_clock_skew_behaves_like_the_others() {
    let s = setup("skew").await;
    s.source.stall_first(1);
    let config = s.config("1500ms", "200ms");
    let mut a = Proc::spawn(
        s.dir.path(),
        &config,
        "a",
        &["run"],
        &[("SEEDLOCK_FAKE_CLOCK_SKEW", "-2h")],
    );
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    // An instance two hours ahead would see a's lock as long expired if it trusted its own clock.
    let mut ahead = Proc::spawn(
        s.dir.path(),
        &config,
        "ahead",
        &["run", "--once", "--timeout", "60s"],
        &[("SEEDLOCK_FAKE_CLOCK_SKEW", "+2h")],
    );
    eventually(
        "the skewed instance is waiting",
        Duration::from_secs(20),
        || async { ahead.log().contains("waiting") },
    )
    .await;
    // While a heartbeats for several ttls, nobody may take over.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        assert_eq!(
            s.holder().await.as_deref(),
            Some("a"),
            "the live holder keeps its lock"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.source.release();
    ahead.expect_ok(Duration::from_secs(30)).await;
    assert_eq!(s.db.epoch("shop").await, 1, "no takeover happened");
    assert_eq!(s.source.hits(), 1);
    // And the skewed instance does take over a dead holder, on time.
    s.source.stall_first(2);
    let mut c = Proc::spawn(s.dir.path(), &config, "c", &["refresh", "shop"], &[]);
    c.expect_ok(Duration::from_secs(20)).await;
    s.a_holds_the_lock_with_its_fetch_stalled(2).await;
    let mut ahead = Proc::spawn(
        s.dir.path(),
        &config,
        "ahead2",
        &["run", "--once", "--timeout", "60s"],
        &[("SEEDLOCK_FAKE_CLOCK_SKEW", "+2h")],
    );
    a.kill9().await;
    let killed = Instant::now();
    ahead.expect_ok(Duration::from_secs(30)).await;
    assert!(
        killed.elapsed() < Duration::from_secs(4),
        "took over after {:?}",
        killed.elapsed()
    );
    assert!(s
        .events()
        .await
        .iter()
        .any(|(e, by, _)| e == "took_over" && by == "ahead2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_unlock_fences_the_running_holder() {
    let s = setup("unlock").await;
    s.source.stall_first(1);
    let config = s.config("5s", "200ms");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    let mut admin = Proc::spawn(
        s.dir.path(),
        &config,
        "admin",
        &["unlock", "shop", "--reason", "test"],
        &[],
    );
    admin.expect_ok(Duration::from_secs(20)).await;
    assert!(
        admin.out().contains("was held by a at epoch 1"),
        "{}",
        admin.out()
    );
    eventually(
        "a notices at its next heartbeat",
        Duration::from_secs(20),
        || async { a.log().contains("edit lock lost") },
    )
    .await;
    s.source.release();
    eventually("the bot ends ready", Duration::from_secs(20), || async {
        s.is_ready().await
    })
    .await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(20)).await;
    let events = s.events().await;
    assert!(
        events
            .iter()
            .any(|(e, _, epoch)| e == "unlocked" && *epoch == 2),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|(e, by, epoch)| by == "a" && *epoch == 1 && e == "refreshed"),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_restarting_while_instances_wait_is_survived() {
    let Some(bin) = OwnServer::available() else {
        eprintln!("skipped: needs SEEDLOCK_TEST_SERVER_BIN (scripts/test sets it) to restart a server of its own");
        return;
    };
    let storage = tempfile::tempdir().unwrap();
    let mut server = OwnServer::start(bin, storage.path()).await;
    let db = test_db_at(&server.uri, "restart").await;
    let source = SeedSourceServer::start().await;
    source.stall_first(1);
    let dir = tempfile::tempdir().unwrap();
    // test_db_at gave `db` the restartable server's URI.
    let config = ProcConfig {
        ttl: "2s",
        ..ProcConfig::new(&db, url_bot("shop", &source.url()))
    }
    .write(dir.path());
    let mut a = Proc::spawn(dir.path(), &config, "a", &["run"], &[]);
    eventually(
        "a holds the lock, its fetch stalled at the source",
        Duration::from_secs(20),
        || async {
            db.doc("shop")
                .await
                .is_some_and(|d| d.get_str("editingBy") == Ok("a"))
                && source.hits() == 1
        },
    )
    .await;
    let mut waiters: Vec<Proc> = (0..2)
        .map(|i| {
            Proc::spawn(
                dir.path(),
                &config,
                &format!("w{i}"),
                &["run", "--once", "--timeout", "90s"],
                &[],
            )
        })
        .collect();
    for w in &waiters {
        eventually("the waiter is waiting", Duration::from_secs(20), || async {
            w.log().contains("waiting")
        })
        .await;
    }
    server.stop();
    eventually(
        "an instance notices the database is gone",
        Duration::from_secs(20),
        || async {
            waiters
                .iter()
                .any(|w| w.log().contains("database unavailable"))
        },
    )
    .await;
    server.restart().await;
    source.release();
    for w in &mut waiters {
        let status = w.wait(Duration::from_secs(90)).await;
        assert!(
            status.success(),
            "{} finishes after the restart:\n{}",
            w.name,
            w.log()
        );
        w.assert_clean();
        // A waiter reads nothing until its bot changes (lock::hub): one may sit the outage out
        // without an operation of its own failing. One that noticed says it is over.
        if w.log().contains("database unavailable") {
            assert!(w.log().contains("database reachable again"), "{}", w.log());
        }
    }
    let doc = db.doc("shop").await.unwrap();
    assert_eq!(doc.get_bool("isReady").unwrap(), true);
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_serves_health_and_metrics() {
    let s = setup("metrics").await;
    let config = s.config("5s", "200ms");
    let mut a = Proc::spawn(
        s.dir.path(),
        &config,
        "a",
        &["run"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    );
    let addr = a.http_addr().await;
    eventually("the bot is ready", Duration::from_secs(20), || async {
        s.is_ready().await
    })
    .await;
    let health = reqwest::get(format!("http://{addr}/healthz"))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let metrics = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap();
    // OpenMetrics (README: "Metrics"), which Prometheus negotiates and parses.
    assert_eq!(
        metrics.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let metrics = metrics.text().await.unwrap();
    assert!(metrics.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    for needle in [
        r#"seedlock_lock_acquisitions_total{bot="shop"} 1"#,
        r#"seedlock_refreshes_total{bot="shop",kind="ok"} 1"#,
        "seedlock_refresh_duration_seconds_count",
    ] {
        assert!(metrics.contains(needle), "missing {needle}:\n{metrics}");
    }
    eventually(
        "the state gauge shows ready",
        Duration::from_secs(5),
        || async {
            let m = reqwest::get(format!("http://{addr}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            m.contains(r#"seedlock_bot_state{bot="shop",state="ready"} 1"#)
        },
    )
    .await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_wake_on_the_change_stream_not_only_the_poll() {
    let s = setup("wake").await;
    s.source.stall_first(1);
    // A long ttl and a 10 s poll: only a change-stream event can wake the waiter quickly.
    let config = s.config("30s", "10s");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    let mut b = Proc::spawn(
        s.dir.path(),
        &config,
        "b",
        &["run", "--once", "--timeout", "60s"],
        &[],
    );
    eventually("b is waiting", Duration::from_secs(20), || async {
        b.log().contains("waiting")
    })
    .await;
    s.source.release();
    eventually("a completes", Duration::from_secs(20), || async {
        s.is_ready().await
    })
    .await;
    let ready = Instant::now();
    b.expect_ok(Duration::from_secs(30)).await;
    let woke = ready.elapsed();
    assert!(
        woke < Duration::from_secs(3),
        "b saw the change after {woke:?}; its poll is 10 s"
    );
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line_with_bot_and_epoch() {
    let s = setup("jsonlog").await;
    let config = s.config("5s", "200ms");
    let mut a = Proc::spawn(
        s.dir.path(),
        &config,
        "a",
        &["--log-format", "json", "run", "--once"],
        &[],
    );
    a.expect_ok(Duration::from_secs(30)).await;
    let log = a.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let won = lines
        .iter()
        .find(|l| l["fields"]["message"] == "won the edit lock")
        .unwrap_or_else(|| panic!("no lock line in {log}"));
    assert_eq!(won["fields"]["bot"], "shop");
    assert_eq!(won["fields"]["epoch"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_reclaims_its_own_orphaned_lock_at_once() {
    let s = setup("orphan").await;
    s.source.stall_first(1);
    // A 30 s ttl: waiting for expiry would take 30 s; the restarted instance must not need to.
    let config = s.config("30s", "200ms");
    let mut a = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    a.kill9().await;
    let restarted = Instant::now();
    let mut again = Proc::spawn(
        s.dir.path(),
        &config,
        "a",
        &["run", "--once", "--timeout", "20s"],
        &[],
    );
    again.expect_ok(Duration::from_secs(30)).await;
    assert!(
        restarted.elapsed() < Duration::from_secs(10),
        "reclaimed after {:?}",
        restarted.elapsed()
    );
    assert_eq!(
        s.db.epoch("shop").await,
        2,
        "the reclaim raised the epoch, fencing the dead run"
    );
    let took =
        s.db.history("shop")
            .await
            .into_iter()
            .find(|h| h.get_str("event") == Ok("took_over"))
            .unwrap();
    assert!(
        took.get_str("reason").unwrap().contains("previous run"),
        "{took}"
    );
    s.source.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_documents_are_repaired_by_real_processes_without_a_panic() {
    use bson::doc;
    let broken = [
        doc! {"_id": "shop", "isReady": "true", "isEditing": false, "seeds": ["http://keep/"], "lockEpoch": 3_i64},
        doc! {"_id": "shop", "isReady": true, "isEditing": false, "seeds": {"not": "an array"}},
        doc! {"_id": "shop", "isReady": true, "isEditing": true, "seeds": [], "lockEpoch": 2_i64, "editingBy": "ghost",
        "lastUpdateStartedAt": bson::DateTime::from_millis(0), "lockExpiresAt": bson::DateTime::from_millis(0)},
        doc! {"_id": "shop", "weird.key": 1, "isReady": 1},
    ];
    for (i, bad) in broken.into_iter().enumerate() {
        let s = setup("broken").await;
        s.db.bots().insert_one(bad.clone()).await.unwrap();
        let config = s.config("5s", "200ms");
        let mut p = Proc::spawn(
            s.dir.path(),
            &config,
            &format!("p{i}"),
            &["run", "--once", "--timeout", "30s"],
            &[],
        );
        p.expect_ok(Duration::from_secs(60)).await;
        assert!(s.is_ready().await, "case {i}: ready after the repair");
        assert_eq!(
            s.seeds().await,
            SeedSourceServer::seeds_of_hit(1),
            "case {i}"
        );
        let events = s.events().await;
        assert!(
            events.iter().any(|(e, _, _)| e == "repaired"),
            "case {i}: {events:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_interrupted_by_sigterm_says_so_and_exits_1() {
    let s = setup("interrupt").await;
    s.source.stall_first(1);
    let config = s.config("5s", "200ms");
    let mut a = Proc::spawn(
        s.dir.path(),
        &config,
        "a",
        &["run", "--once", "--timeout", "60s"],
        &[],
    );
    s.a_holds_the_lock_with_its_fetch_stalled(1).await;
    a.signal(Signal::SIGTERM);
    let status = a.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(1), "{}", a.log());
    assert!(
        a.log()
            .contains("interrupted before every bot was ready; not ready: shop"),
        "{}",
        a.log()
    );
    a.assert_clean();
    assert_eq!(
        s.holder().await,
        None,
        "the lock was released on the way out"
    );
    s.source.release();
}

/// Instances racing over a refresh whose seed source never answers: the holder gives up at
/// `max_refresh` and records its failure with the backoff; nobody takes the lock over as stuck
/// (waiters wait out `max_refresh` + the grace), and nobody claims again before the backoff ends.
async fn a_refresh_past_max_refresh_fails_with_its_backoff_and_is_not_taken_over(instances: usize) {
    let s = setup(&format!("grace{instances}")).await;
    s.source.stall_first(usize::MAX);
    let config = ProcConfig {
        ttl: "1s",
        max_refresh: "2s",
        poll: "100ms",
        backoff: ("3s", "3s"),
        ..ProcConfig::new(&s.db, url_bot("shop", &s.source.url()))
    }
    .write(s.dir.path());
    let mut procs: Vec<Proc> = (0..instances)
        .map(|i| Proc::spawn(s.dir.path(), &config, &format!("p{i}"), &["run"], &[]))
        .collect();
    // Two refreshes fail, one after the other's backoff.
    eventually("two refreshes failed", Duration::from_secs(40), || async {
        s.db.doc("shop").await.is_some()
            && s.events()
                .await
                .iter()
                .filter(|(e, _, _)| e == "refresh_failed")
                .count()
                >= 2
    })
    .await;
    for p in &procs {
        p.signal(Signal::SIGTERM);
    }
    for p in &mut procs {
        p.expect_ok(Duration::from_secs(20)).await;
    }
    s.source.release();
    let history = s.db.history("shop").await;
    let at = |h: &bson::Document| h.get_datetime("at").unwrap().timestamp_millis();
    let mut holder: Option<(String, i64)> = None;
    let mut backoff_until: Option<i64> = None;
    let mut failures = 0;
    for h in &history {
        let (event, by) = (h.get_str("event").unwrap(), h.get_str("by").unwrap());
        let reason = h.get_str("reason").unwrap_or_default();
        assert_ne!(
            event, "took_over",
            "no takeover while the holders are alive: {reason}\n{history:?}"
        );
        match event {
            "acquired" => {
                if let Some(until) = backoff_until {
                    // history `at` is each instance's server-time estimate: a few ms apart.
                    assert!(
                        at(h) + 50 >= until,
                        "{by} claimed {} ms before the backoff ended\n{history:?}",
                        until - at(h)
                    );
                }
                holder = Some((by.to_owned(), h.get_i64("epoch").unwrap()));
            }
            "refresh_failed" => {
                let (who, epoch) = holder.clone().expect("a failure follows a claim");
                assert_eq!(
                    (by, h.get_i64("epoch").unwrap()),
                    (who.as_str(), epoch),
                    "the holder itself recorded its failure\n{history:?}"
                );
                assert!(reason.contains("max_refresh"), "{reason}");
                failures += 1;
                // Its backoff: 3 s ± 20% after it was recorded.
                backoff_until = Some(at(h) + 2_400);
            }
            _ => {}
        }
    }
    assert!(failures >= 2, "{history:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_instances_a_refresh_past_max_refresh_fails_with_its_backoff_and_is_not_taken_over(
) {
    a_refresh_past_max_refresh_fails_with_its_backoff_and_is_not_taken_over(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_instances_a_refresh_past_max_refresh_fails_with_its_backoff_and_is_not_taken_over(
) {
    a_refresh_past_max_refresh_fails_with_its_backoff_and_is_not_taken_over(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_process_under_one_instance_id_is_refused_and_a_restart_after_a_kill_is_not()
{
    let s = setup("same_id").await;
    let config = s.config("5s", "200ms");
    let mut first = Proc::spawn(s.dir.path(), &config, "a", &["run"], &[]);
    eventually("the first a is running", Duration::from_secs(20), || {
        s.is_ready()
    })
    .await;
    // The same id, while the first lives: refused at start, in one line, exit code 2.
    let mut second = Proc::spawn(
        s.dir.path(),
        &config,
        "a-second",
        &["run"],
        &[("SEEDLOCK_INSTANCE_ID", "a")],
    );
    let status = second.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(2), "{}", second.log());
    let log = second.log();
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("instance id a is in use by a live process"))
        .collect();
    assert_eq!(refused.len(), 1, "{}", second.log());
    assert!(
        refused[0].contains(&format!("pid {}", first.pid())),
        "{}",
        refused[0]
    );
    let registration =
        s.db.db
            .collection::<bson::Document>("instances")
            .find_one(bson::doc! {"_id": "a"})
            .await
            .unwrap()
            .expect("the first a is registered");
    assert_eq!(
        registration.get_i64("pid").unwrap(),
        i64::from(first.pid().as_raw()),
        "the refused process wrote nothing"
    );

    // Killed, and restarted at once (well within ttl): its registration names a process that
    // exited, so the restart takes the id over instead of waiting.
    first.kill9().await;
    let mut again = Proc::spawn(
        s.dir.path(),
        &config,
        "a-again",
        &["run"],
        &[("SEEDLOCK_INSTANCE_ID", "a")],
    );
    eventually(
        "the restart took the id over",
        Duration::from_secs(20),
        || async {
            again
                .log()
                .contains("took over this instance id from a process that is gone")
        },
    )
    .await;
    again.signal(Signal::SIGTERM);
    again.expect_ok(Duration::from_secs(20)).await;
    // A clean stop frees the id.
    assert!(s
        .db
        .db
        .collection::<bson::Document>("instances")
        .find_one(bson::doc! {"_id": "a"})
        .await
        .unwrap()
        .is_none());
}
