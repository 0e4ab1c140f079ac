//! Elections: the primary steps down (the test server's `replSetStepDown`, which answers writes
//! with a real `NotWritablePrimary`, without the retryable label, and `hello` as a secondary for
//! the given seconds) while a crawl or a fleet of bots is at work. Nothing goes to Error, no lock
//! is lost, no URL waits out its lease, every record is exact, and the work takes about the
//! election's length longer than it would without one. The same through an election's silence:
//! the fault proxy holds every message, heartbeats included, for as long. Step-downs run on a
//! server of the test's own, connected as to a replica set (`replicaSet=`): stepping down a
//! server shared with other tests would fail theirs. Against an outside `MONGODB_URI` without the test server's binary the
//! tests say they are skipped.

use crate::kit;

use std::time::{Duration, Instant};

use bson::doc;
use kit::crawl::*;
use kit::faults::Faults;
use kit::{eventually, test_db_at, OwnServer};
use seedlock::daemon::{run_with_store, Mode};
use seedlock::store::Store;
use tokio_util::sync::CancellationToken;

/// How long the primary stays stepped down: a replica set's election takes 10-12 s.
const ELECTION: Duration = Duration::from_secs(12);

/// A server of the test's own, and its URI as a replica set's (the driver then sees the set
/// without a primary through the step-down, as it would through an election).
async fn own_replica_set(dir: &std::path::Path) -> Option<(OwnServer, String)> {
    let Some(bin) = OwnServer::available() else {
        eprintln!("skipped: elections need the test server's binary (SEEDLOCK_TEST_SERVER_BIN)");
        return None;
    };
    let server = OwnServer::start(bin, dir).await;
    let client = mongodb::Client::with_uri_str(&server.uri).await.unwrap();
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .unwrap();
    let set = hello
        .get_str("setName")
        .expect("the test server names its set")
        .to_owned();
    let port = server
        .uri
        .rsplit(':')
        .next()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let uri = format!("mongodb://127.0.0.1:{port}/?replicaSet={set}");
    Some((server, uri))
}

/// Steps the primary down for [`ELECTION`].
async fn step_down(uri: &str) {
    let client = mongodb::Client::with_uri_str(uri).await.unwrap();
    client
        .database("admin")
        .run_command(doc! { "replSetStepDown": ELECTION.as_secs() as i64, "force": true })
        .await
        .expect("replSetStepDown");
}

/// One `run --once` pass of the shop at `base` on `db`, with `/metrics` sampled throughout:
/// how long it took, and every value of the bot's Error state and of the failed steps seen.
async fn timed_pass(
    db: &kit::TestDb,
    base: &str,
    during: impl std::future::Future<Output = ()>,
) -> (Duration, Vec<f64>, Vec<f64>) {
    let listen = free_addr();
    let setup = Setup {
        listen: &listen,
        // A URL that waited out its lease would cost a minute.
        lease: "60s",
        timeout: "5s",
        ..Setup::default()
    };
    let settings = settings(db, base, &setup, "a");
    let store = Store::connect(&settings.mongo).await.expect("connect");
    let stop = CancellationToken::new();
    let errors = sampler(
        listen.clone(),
        r#"seedlock_bot_state{bot="shop",state="error"}"#.into(),
        stop.clone(),
    );
    let failed = sampler(listen, "seedlock_db_errors_total".into(), stop.clone());
    let started = Instant::now();
    let pass = run_with_store(
        settings,
        store,
        Mode::Once {
            timeout: Duration::from_secs(120),
        },
        CancellationToken::new(),
    );
    let (result, ()) = tokio::join!(pass, during);
    let took = started.elapsed();
    stop.cancel();
    result.expect("the pass finishes");
    (took, errors.await.unwrap(), failed.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crawl_through_an_election_stores_every_record_and_takes_about_the_election_longer() {
    let dir = tempfile::tempdir().unwrap();
    let Some((_server, uri)) = own_replica_set(dir.path()).await else {
        return;
    };
    crawl_through(&uri, "election", || step_down(&uri)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crawl_through_an_elections_silence_stores_every_record_and_takes_about_the_silence_longer(
) {
    // The primary stops answering anything, heartbeats included, for an election's length:
    // operations in flight wait past their timeout while no writable server is known.
    let faults = Faults::start(&kit::blackhole::server_of(&kit::mongodb_uri())).await;
    let uri = faults.uri(&kit::mongodb_uri());
    crawl_through(&uri, "silence", || async {
        faults.stall(ELECTION);
    })
    .await;
    assert!(
        faults.held() > 0,
        "the stall held nothing: the test proves nothing"
    );
}

/// A clean pass on `uri`, then one that meets `election` mid-pass: every record exact, the bot
/// never in Error, no step failed, and the pass about the election longer than the clean one.
async fn crawl_through<F, Fut>(uri: &str, hint: &str, election: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // Product pages answer in 100 ms: the pass lasts a few seconds, long enough to step down in.
    let base = shop(3, 20).await;
    post(
        &format!("{base}/__faults"),
        serde_json::json!([{ "path": "/product/", "latency_ms": 100 }]),
    )
    .await;

    let clean_db = test_db_at(uri, &format!("{hint}_clean")).await;
    let (clean, _, _) = timed_pass(&clean_db, &base, async {}).await;
    assert_eq!(live_records(&clean_db).await, truth(&base).await);

    let db = test_db_at(uri, &format!("{hint}_crawl")).await;
    let mid_pass = async {
        // Once the pass has stored a few records: mid-pass.
        eventually("a few records stored", Duration::from_secs(30), || async {
            live_records(&db).await.len() >= 5
        })
        .await;
        election().await;
    };
    let (took, errors, failed) = timed_pass(&db, &base, mid_pass).await;
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "every record, once"
    );
    assert!(
        errors.iter().all(|&v| v == 0.0),
        "the bot showed Error through the election: {errors:?}"
    );
    assert!(
        failed.iter().all(|&v| v == 0.0),
        "a step failed through the election: {failed:?}"
    );
    let bound = clean + ELECTION + Duration::from_secs(6);
    assert!(
        took <= bound,
        "the pass took {took:?}: more than a clean pass ({clean:?}) and the election ({ELECTION:?}) allow"
    );
}

/// `/metrics` at `addr`: for each `(name, label)` of `series`, the sum of the samples of `name`
/// whose labels include `label`; `None` while the daemon does not answer.
async fn sums<const N: usize>(addr: &str, series: [(&str, &str); N]) -> Option<[f64; N]> {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(series.map(|(name, label)| {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_refreshing_through_an_election_loses_no_lock_and_shows_no_error() {
    let dir = tempfile::tempdir().unwrap();
    let Some((_server, uri)) = own_replica_set(dir.path()).await else {
        return;
    };
    fleet_through(&uri, "election_fleet", || step_down(&uri)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_refreshing_through_an_elections_silence_loses_no_lock_and_shows_no_error() {
    // The primary stops answering anything, heartbeats included, for an election's length.
    let faults = Faults::start(&kit::blackhole::server_of(&kit::mongodb_uri())).await;
    let uri = faults.uri(&kit::mongodb_uri());
    fleet_through(&uri, "silence_fleet", || async {
        faults.stall(ELECTION);
    })
    .await;
    assert!(
        faults.held() > 0,
        "the stall held nothing: the test proves nothing"
    );
}

/// A fleet of bots on `uri`, every refresh holding its lock when `election` starts: no bot in
/// Error, no lock lost, no step failed, each bot refreshed once, all ready about the election's
/// length later.
async fn fleet_through<F, Fut>(uri: &str, hint: &str, election: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    const BOTS: usize = 12;
    let db = test_db_at(uri, hint).await;
    let source = kit::SeedSourceServer::start().await;
    let listen = free_addr();
    let mut text = format!(
        "[mongo]\nuri = \"{uri}\"\ndatabase = \"{}\"\n[instance]\nid = \"a\"\n\
         [lock]\npoll = \"100ms\"\n[refresh]\nattempts = 1\n[http]\nlisten = \"{listen}\"\n",
        db.name
    );
    for i in 0..BOTS {
        let bot = format!("b{i}");
        text.push_str(&format!(
            "[[bots]]\nid = \"{bot}\"\nseeds = {{ url = \"{}\", format = \"lines\" }}\nrefresh = \"1h\"\n",
            source.bot_url(&bot)
        ));
    }
    let settings = seedlock::config::Settings::from_toml(&text, |_| None).unwrap();
    let permits = settings.refresh.concurrency.min(BOTS);
    let store = Store::connect(&settings.mongo).await.expect("connect");
    // Every refresh with a permit holds its lock while its source holds the answer back; the
    // election starts, then the answers come: every refresh's writes meet the stepped-down
    // primary.
    source.hold_bot_sources(true);
    let run = tokio::spawn(run_with_store(
        settings,
        store,
        Mode::Once {
            timeout: Duration::from_secs(120),
        },
        CancellationToken::new(),
    ));
    eventually(
        "the refreshes with a permit wait at their sources",
        Duration::from_secs(30),
        || async { source.bot_hits().values().sum::<usize>() >= permits },
    )
    .await;
    let stop = CancellationToken::new();
    let sampled = {
        let (listen, stop) = (listen.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.is_cancelled() {
                let series = [
                    ("seedlock_bot_state{", r#"state="error""#),
                    ("seedlock_edit_locks_lost_total", ""),
                    ("seedlock_db_errors_total", ""),
                ];
                if let Some(sample) = sums(&listen, series).await {
                    seen.push(sample);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            seen
        })
    };
    let stepped = Instant::now();
    election().await;
    source.hold_bot_sources(false);
    let summaries = run.await.unwrap().expect("every bot ready");
    let took = stepped.elapsed();
    stop.cancel();
    let seen = sampled.await.unwrap();
    assert_eq!(summaries.len(), BOTS);
    assert!(
        !seen.is_empty(),
        "no /metrics sample: the test proves nothing"
    );
    assert!(
        seen.iter().all(|&sample| sample == [0.0; 3]),
        "(bots in Error, locks lost, failed steps) through the election: {seen:?}"
    );
    let hits = source.bot_hits();
    assert!(
        (0..BOTS).all(|i| hits.get(&format!("b{i}")) == Some(&1)),
        "each bot refreshed once (a lost lock refreshes again): {hits:?}"
    );
    assert!(
        took <= ELECTION + Duration::from_secs(8),
        "ready {took:?} after the step-down of {ELECTION:?}"
    );
}
