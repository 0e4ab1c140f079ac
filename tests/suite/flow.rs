//! Flow control end to end (seed 004): per-host limits, pauses and robots.txt, throttling hosts
//! published, load shedding, a slow store bounding what is leased, the leaser's dry spells.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::time::Duration;

use bson::{doc, Document};
use kit::crawl::*;
use kit::test_db;
use seedlock::daemon::{run, Mode};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_throttling_above_three_in_flight_holds_the_limit_between_two_and_four() {
    let db = test_db("flow_aimd").await;
    let base = shop(10, 20).await;
    let host = base.trim_start_matches("http://").to_owned();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/", "latency_ms": 20, "status": 429, "max_in_flight": 3}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        workers: 16,
        crawl: "attempts = 20\nretry_budget = 1.0",
        listen: &listen,
        ..Setup::default()
    };
    // Sample the host's limit while the crawl runs.
    let stop = CancellationToken::new();
    let sampler = {
        let (stop, listen) = (stop.clone(), listen.clone());
        let limit = format!("seedlock_host_limit{{host=\"{host}\"}}");
        let throttles = format!("seedlock_host_throttles_total{{host=\"{host}\"}}");
        tokio::spawn(async move {
            let mut after_warm_up = Vec::new();
            while !stop.is_cancelled() {
                if metric(&listen, &throttles).await.unwrap_or(0.0) >= 1.0 {
                    if let Some(l) = metric(&listen, &limit).await {
                        after_warm_up.push(l);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            after_warm_up
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let limits = sampler.await.unwrap();
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "the crawl completes"
    );
    assert!(
        limits.len() >= 10,
        "the limit was sampled after warm-up: {limits:?}"
    );
    // The limiter admits floor(limit) requests at once; the fraction is growth in progress.
    assert!(
        limits.iter().all(|l| (2.0..5.0).contains(&l.floor())),
        "the limit stayed between 2 and 4: {limits:?}"
    );
    let requests = Requests::take(&base).await;
    let throttled = requests.repeated();
    assert!(
        (throttled as f64) < 0.2 * requests.0.len() as f64,
        "few requests were throttled: {throttled} repeats over {} paths",
        requests.0.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_pauses_only_that_host_while_the_other_keeps_fetching() {
    let db = test_db("flow_pause").await;
    let (a, b) = (shop_named(2, 10, "A").await, shop_named(20, 20, "B").await);
    // A's second listing page answers 429 with Retry-After: 2, once.
    post(
        &format!("{a}/__faults"),
        json!([{"path": "/list/2", "status": 429, "retry_after": "2", "times": 1}]),
    )
    .await;
    let seeds = seeds_of(&[&a, &b]).await;
    let b_host = b.trim_start_matches("http://").to_owned();
    let scope = [b_host.as_str()];
    let setup = Setup {
        workers: 8,
        seeds: Some(&seeds),
        scope: &scope,
        ..Setup::default()
    };
    once(settings(&db, &a, &setup, "a")).await;
    let (log_a, log_b) = (request_log(&a).await, request_log(&b).await);
    let throttled_at = log_a
        .iter()
        .find(|(p, _)| p == "/list/2")
        .map(|(_, t)| *t)
        .expect("A's /list/2 was requested");
    // Requests A had in flight when the 429 came may land a moment later; none after that
    // until the pause ends.
    let quiet = (throttled_at + 300)..(throttled_at + 1900);
    let a_during: Vec<_> = log_a.iter().filter(|(_, t)| quiet.contains(t)).collect();
    let b_during = log_b.iter().filter(|(_, t)| quiet.contains(t)).count();
    assert!(a_during.is_empty(), "A was paused: {a_during:?}");
    assert!(
        b_during >= 10,
        "B kept fetching during A's pause: {b_during} requests"
    );
    let second_try = log_a
        .iter()
        .filter(|(p, _)| p == "/list/2")
        .nth(1)
        .map(|(_, t)| *t)
        .expect("A's /list/2 was fetched again");
    assert!(
        second_try - throttled_at >= 1900,
        "Retry-After was honoured"
    );
    let mut expected = truth(&a).await;
    expected.extend(truth(&b).await);
    assert_eq!(live_records(&db).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robots_txt_disallow_is_honoured_and_crawl_delay_spaces_requests() {
    let db = test_db("flow_robots").await;
    let base = shop(1, 8).await;
    let mut products: Vec<String> = truth(&base).await.into_keys().collect();
    products.sort();
    let hidden = products[3].clone();
    reqwest::Client::new()
        .post(format!("{base}/__robots"))
        .body(format!(
            "User-agent: *\nDisallow: /product/{hidden}\nCrawl-delay: 0.2\n"
        ))
        .send()
        .await
        .unwrap();
    let setup = Setup {
        workers: 8,
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let log: Vec<(String, i64)> = request_log(&base)
        .await
        .into_iter()
        .filter(|(p, _)| p.starts_with("/list/") || p.starts_with("/product/"))
        .collect();
    assert!(
        !log.iter().any(|(p, _)| p.ends_with(&hidden)),
        "the disallowed page was not fetched"
    );
    assert_eq!(log.len(), 1 + 7, "{log:?}");
    let gaps: Vec<i64> = log.windows(2).map(|w| w[1].1 - w[0].1).collect();
    assert!(
        gaps.iter().all(|g| *g >= 190),
        "requests were at least Crawl-delay apart: {gaps:?}"
    );
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(failed.len(), 1);
    assert_eq!(
        failed[0].get_str("lastError").unwrap(),
        "disallowed by robots.txt"
    );
    assert_eq!(live_records(&db).await.len(), 7);

    // Ignoring robots.txt (one's own site) fetches it.
    let db = test_db("flow_robots_ignored").await;
    let setup = Setup {
        crawl: "robots = false",
        ..Setup::default()
    };
    Requests::take(&base).await;
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(
        Requests::take(&base)
            .await
            .under(&format!("/product/{hidden}")),
        1
    );
    assert_eq!(live_records(&db).await.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_robots_txt_pauses_the_host_until_it_answers() {
    let db = test_db("flow_robots_503").await;
    let base = shop(1, 5).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/robots.txt", "status": 503, "times": 1}]),
    )
    .await;
    let setup = Setup {
        crawl: "robots_retry = \"1s\"",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let log = request_log(&base).await;
    let robots: Vec<i64> = log
        .iter()
        .filter(|(p, _)| p == "/robots.txt")
        .map(|(_, t)| *t)
        .collect();
    assert_eq!(robots.len(), 2, "asked again after the pause: {log:?}");
    let first_page = log
        .iter()
        .find(|(p, _)| p.starts_with("/list/") || p.starts_with("/product/"))
        .map(|(_, t)| *t)
        .unwrap();
    assert!(
        first_page - robots[0] >= 950,
        "no page was fetched while robots.txt was unavailable: {log:?}"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
    // The URL given back while the host was paused did not use up an attempt.
    assert!(frontier(&db, doc! { "status": "failed" }).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_host_is_published_for_status() {
    let db = test_db("flow_hosts").await;
    let base = shop(5, 20).await;
    let host = base.trim_start_matches("http://").to_owned();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "status": 429, "retry_after": "1", "every": 3}]),
    )
    .await;
    let setup = Setup {
        crawl: "retry_budget = 1.0\nattempts = 10",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(run(
        settings(&db, &base, &setup, "a"),
        Mode::Daemon,
        stop.clone(),
    ));
    // Published every 5 s while the host throttles.
    let store = db.store();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let rows = loop {
        let since = chrono::Utc::now() - chrono::Duration::seconds(30);
        let rows = store.hosts().recent(since).await.unwrap();
        if !rows.is_empty() {
            break rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no host row was published within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.cancel();
    daemon.await.unwrap().unwrap();
    assert_eq!(rows[0].host, host);
    assert_eq!(rows[0].instance, "a");
    assert!(
        rows[0].throttles >= 1 && rows[0].last_throttle_at.is_some(),
        "{rows:?}"
    );
    let text = seedlock::ops::admin::render_hosts(&rows, chrono::Utc::now());
    assert!(text.contains(&host), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_low_priority_work_for_a_throttling_host_is_shed_and_still_crawled() {
    let db = test_db("flow_shed").await;
    let base = shop(4, 20).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/product/", "status": 429, "retry_after": "0", "every": 4, "latency_ms": 0}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        workers: 2,
        crawl: "retry_budget = 1.0\nattempts = 20\nshed_after = \"100ms\"",
        listen: &listen,
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let sampler = {
        let (stop, listen) = (stop.clone(), listen.clone());
        tokio::spawn(async move {
            let mut most = 0.0_f64;
            while !stop.is_cancelled() {
                if let Some(n) = metric(&listen, "seedlock_crawl_shed_total{bot=\"shop\"}").await {
                    most = most.max(n);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let shed = sampler.await.unwrap();
    assert!(
        shed >= 1.0,
        "detail pages waiting on a throttling host were shed: {shed}"
    );
    // Deferred, not lost: every product is stored.
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_bounds_the_urls_leased_by_the_host_queue_and_the_commit_window() {
    let db = test_db("flow_slow_store").await;
    let base = shop(10, 20).await;
    // At most: 4 waiting for their host + the next listing page (leased here whatever the
    // room) + 10 fetched (or being fetched) and not yet committed.
    let bound = 4 + 1 + 10;
    let setup = Setup {
        workers: 4,
        crawl: "host_queue = 4\nwriters = 1\nparsers = 1\nparse_queue = 2\nstore_queue = 2\nmax_uncommitted = 10\nstore_delay = \"30ms\"",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let sampler = {
        let stop = stop.clone();
        let frontier = db.db.collection::<Document>("frontier");
        tokio::spawn(async move {
            let mut most = 0;
            while !stop.is_cancelled() {
                let leased = frontier
                    .count_documents(doc! { "status": "leased" })
                    .await
                    .unwrap();
                most = most.max(leased);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            most
        })
    };
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    let most = sampler.await.unwrap();
    assert!(most <= bound, "leased URLs peaked at {most}, above {bound}");
    assert!(
        most >= 6,
        "the pipeline filled up behind the slow store: {most}"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
}

/// The highest value of the bot's `/metrics` `series` (sampled) while one instance crawls a shop
/// of `listings` listing pages of `per` products, answering as `faults` say (the shop's
/// `/__faults` rules), with `setup` (its `listen` set here), every record stored.
async fn peak_while_crawling(
    hint: &str,
    (listings, per): (u32, u32),
    faults: serde_json::Value,
    series: &str,
    setup: Setup<'_>,
) -> f64 {
    let db = test_db(hint).await;
    let base = shop(listings, per).await;
    post(&format!("{base}/__faults"), faults).await;
    let listen = free_addr();
    let setup = Setup {
        listen: &listen,
        ..setup
    };
    let stop = CancellationToken::new();
    let peak = sampler(listen.clone(), series.into(), stop.clone());
    once(settings(&db, &base, &setup, "a")).await;
    stop.cancel();
    assert_eq!(live_records(&db).await, truth(&base).await, "nothing lost");
    peak.await.unwrap().into_iter().fold(0.0_f64, f64::max)
}

/// The most pages a crawl of a 22-page shop held in its store stage at once behind a slow store,
/// with `[crawl]` `extra`.
async fn most_pages_in_the_store_stage(hint: &str, extra: &str) -> f64 {
    let crawl = format!(
        "writers = 1\nparse_queue = 8\nstore_queue = 8\nmax_uncommitted = 64\nstore_delay = \"100ms\"\n{extra}"
    );
    let setup = Setup {
        workers: 4,
        crawl: &crawl,
        ..Setup::default()
    };
    let series = r#"seedlock_crawl_stage_depth{bot="shop",stage="store"}"#;
    peak_while_crawling(hint, (2, 10), json!([]), series, setup).await
}

/// The most commits in flight the window allowed in a crawl of a 210-page shop with `[crawl]`
/// `extra`, the database `rtt` away (the delay proxy).
async fn most_commits_in_flight(hint: &str, extra: &str, rtt: Duration) -> f64 {
    let through = kit::delay::Delay::test_server(rtt);
    let setup = Setup {
        workers: 16,
        crawl: extra,
        uri: Some(&through),
        ..Setup::default()
    };
    let series = r#"seedlock_crawl_commit_writers{bot="shop"}"#;
    peak_while_crawling(hint, (10, 20), json!([]), series, setup).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_in_flight_follow_the_measured_commit_latency_up_to_crawl_writers() {
    // Every page costs its commit 100 ms and a commit carries at most 4: two commits in flight
    // carry 20 pages/s, fewer than the shop's pages come. Each measurement of the rate and the
    // latency doubles the commits in flight (twice the rate times the latency, in commits of 4
    // pages) until `crawl.writers` holds them.
    let slow = most_commits_in_flight(
        "flow_writers_slow",
        "writers = 8\nstore_queue = 4\nstore_delay = \"100ms\"",
        Duration::ZERO,
    )
    .await;
    assert_eq!(
        slow, 8.0,
        "a slow store took every commit crawl.writers allows"
    );
    // The database 40 ms away: most of a commit is its round trips, whatever it carries. More
    // commits travel at once than the two a batch needs, so the database has work meanwhile.
    let far =
        most_commits_in_flight("flow_writers_far", "writers = 8", Duration::from_millis(40)).await;
    assert!(
        far > 2.0,
        "a database 40 ms away kept only {far} commits in flight"
    );
}

/// The chain's listing pages this instance fetched ahead of their lease writes and kept (as
/// `/metrics` showed while it crawled), in a crawl of an 8-page chain whose every page the shop
/// answers after `answer`, with the database `rtt` away (the delay proxy). One product a page:
/// what a page reveals always leaves its host's queue room, so the writes' time alone decides.
async fn chain_pages_fetched_ahead(hint: &str, answer: Duration, rtt: Duration) -> f64 {
    let through = kit::delay::Delay::test_server(rtt);
    let setup = Setup {
        uri: Some(&through),
        ..Setup::default()
    };
    let faults = json!([{ "path": "/", "latency_ms": answer.as_millis() as u64 }]);
    let series = r#"seedlock_crawl_chain_fetched_ahead_total{bot="shop",kind="kept"}"#;
    peak_while_crawling(hint, (8, 1), faults, series, setup).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chain_is_fetched_ahead_while_its_writes_outlast_the_shops_answers_and_waits_otherwise()
{
    // Writes of 60 ms and more against answers of 10 ms (with room for a loaded machine's
    // scheduling on either side): each next listing page is fetched while the write that leases
    // it travels, once the shop's answers are measured.
    let ahead = chain_pages_fetched_ahead(
        "flow_chain_ahead",
        Duration::from_millis(10),
        Duration::from_millis(60),
    )
    .await;
    assert!(
        ahead >= 1.0,
        "no listing page was fetched ahead of a 60 ms write (counter {ahead})"
    );
    // The database near (the proxy adds nothing), the shop answering after 150 ms: the write is
    // shorter than the fetch it would hide, and the chain waits for it.
    let waited = chain_pages_fetched_ahead(
        "flow_chain_waits",
        Duration::from_millis(150),
        Duration::ZERO,
    )
    .await;
    assert_eq!(
        waited, 0.0,
        "listing pages were fetched ahead of writes shorter than the shop's answers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_budget_of_one_page_holds_one_page_uncommitted_at_a_time() {
    // Every page weighs at least 1 KiB: a budget of 1 KiB lets one page at a time past its
    // fetch, however many `max_uncommitted` allows.
    let held =
        most_pages_in_the_store_stage("flow_bytes_one", "max_uncommitted_bytes = 1024").await;
    assert!(
        held <= 1.0,
        "{held} pages waited for the store at once under a budget of one page"
    );
    // The same crawl under the default budget: the slow store holds several pages at once
    // (this sampling sees them).
    let held = most_pages_in_the_store_stage("flow_bytes_default", "").await;
    assert!(
        held >= 2.0,
        "under the default budget the slow store held only {held} pages at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_slow_page_is_in_flight_and_nothing_is_pending_the_leaser_waits_instead_of_polling()
{
    let db = test_db("flow_dry_spell").await;
    // Listing page 2 takes 3 s; once page 1's products are done, it is the only page in flight
    // and the frontier has nothing pending until it is read.
    let base = shop(2, 5).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/list/2", "latency_ms": 3000}]),
    )
    .await;
    let listen = free_addr();
    let setup = Setup {
        listen: &listen,
        timeout: "10s",
        lease: "20s",
        ..Setup::default()
    };
    let stop = CancellationToken::new();
    let empty_attempts = sampler(
        listen.clone(),
        r#"seedlock_crawl_lease_queries_total{bot="shop",kind="empty"}"#.into(),
        stop.clone(),
    );
    let started = std::time::Instant::now();
    once(settings(&db, &base, &setup, "a")).await;
    let took = started.elapsed();
    stop.cancel();
    let empty = empty_attempts
        .await
        .unwrap()
        .into_iter()
        .fold(0.0_f64, f64::max);
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "the crawl completes"
    );
    assert!(
        took >= Duration::from_secs(3),
        "the slow page was waited for: {took:?}"
    );
    // Without the wait, four lease queries in flight go round as fast as the database answers
    // (thousands in 3 s); with it, the pauses grow from 20 ms to 500 ms: about a dozen.
    assert!(
        empty <= 40.0,
        "{empty} empty lease attempts while one slow page was in flight for 3 s"
    );
}
