//! Crawl benchmarks against the demo shop and a real server (run them with `scripts/bench/kill-test`
//! and `scripts/bench/crawl`). Needs `MONGODB_URI` and `SEEDLOCK_BIN` (the release binary).
//!
//! - `kill [RUNS]`: seed 000's kill test — 25 listing pages, 500 products; SIGKILL the crawler at
//!   a random 0.2–1.0 s of its life, ten times, then let it finish. seedlock with 1 instance and
//!   with 3 (kills spread among them), each with one request in flight, next to the naive
//!   baseline (auto ids, no persisted frontier: every restart begins again at page 1).
//! - `kill-new-ids [RUNS]`: the kill test with a new instance id for every restart — 520
//!   products, two instances, 8 SIGKILLs, `crawl.lease` 60 s: the pass must end at most 15 s
//!   after the last kill (dead owners' URL leases are taken at their registration's expiry).
//! - `network [RUNS]`: one instance, 5,000 products, the database behind a delay proxy adding a
//!   round trip of 0, 2 and 10 ms: pages/s at each, and as a share of the 0 ms speed.
//! - `chain [RUNS]`: the pagination chain's hop (25 listing pages of 1 and of 20 products, 200 of
//!   5; the database local and 10 ms away), and the 525-page shop from process start to exit
//!   next to seed 000's reference crawler and Scrapy (see `chain.rs`).
//! - `throughput`: pages/s over the pass, process wall, database commands per detail page (the
//!   whole run, and the steady state from `/metrics`), 500 and 10,000 products, 1 and 3
//!   instances, peak RSS.
//! - `ceilings`: the database's ceiling (a minimal batched lease + record + done loop, no HTTP)
//!   and the HTTP ceiling (fetch-only, no database) next to one seedlock instance, in one run.
//! - `indexes`: the database ceiling's loop with seedlock's one frontier index, and with each
//!   index of earlier versions added: what each costs the lease and commit paths.
//! - `incremental [ITEMS]`: a full pass of ITEMS products (100 per listing page), then 500
//!   changed and 200 added: detail requests and record writes of the second pass, wall time
//!   against the full pass, and the pass's database floor on the same server (its unchanged
//!   records marked seen, nothing else); watermark mode: listing pages read for 200 new items.
//! - `deletion`: 50 products deleted: exactly 50 `removedAt` after a complete pass, none after
//!   an incomplete one.
//!
//! - `head-of-line`: host A answering after 1.5 s and host B fast (1,000 products), crawled
//!   together by one instance: B's pages/s against B crawled alone.
//! - `throttling`: a host answering 429 above 6 requests in flight: time to the first throttle,
//!   the limit's range after it, the 429 share after it.
//! - `memory [URLS]`: peak RSS of an instance crawling a frontier of URLS pending entries (default
//!   1,000,000) for 60 s, against one of 10,000.
//! - `export [RECORDS]`: `seedlock export` of RECORDS records (default 1,000,000) as JSON lines and
//!   as CSV, against 10,000: every line checked against the record it came from (count and
//!   content), wall time, records/s and the exporting process's peak RSS.
//!
//! Prints Markdown tables.

use seedlock::ids::PassNumber;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bson::{doc, Document};
use futures_util::TryStreamExt;
use mongodb::{Client, Database};
use rand::Rng;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

#[path = "../tests/suite/kit/mod.rs"]
mod kit;

#[path = "crawl_bench/chain.rs"]
mod chain;

use kit::crawl::{free_addr, seeds_of};
use kit::shop::Shop;

fn under(stats: &BTreeMap<String, u64>, prefix: &str) -> u64 {
    stats
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

fn total(stats: &BTreeMap<String, u64>) -> u64 {
    stats.values().sum()
}

/// Requests beyond the first per page. robots.txt is left out: every seedlock process reads it
/// once by design (a restarted instance reads it again), which is not a repeated page.
fn repeated(stats: &BTreeMap<String, u64>) -> u64 {
    stats
        .iter()
        .filter(|(path, _)| *path != "/robots.txt")
        .map(|(_, v)| v.saturating_sub(1))
        .sum()
}

/// The crawl settings a benchmark run varies (`[crawl]` lines; empty: the defaults).
struct Run<'a> {
    crawl: &'a str,
    mode: &'a str,
}

fn config(dir: &Path, uri: &str, database: &str, base: &str, run: &Run<'_>) -> PathBuf {
    let Run { crawl, mode } = run;
    config_with(
        dir,
        uri,
        database,
        &format!("{base}/seeds.txt"),
        &[base],
        crawl,
        mode,
        "off",
    )
}

/// A bot "shop" crawling the shops at `bases` from the seed source `seeds`; `crawl` holds extra
/// `[crawl]` lines, `listen` the `[http]` address.
#[allow(clippy::too_many_arguments)]
fn config_with(
    dir: &Path,
    uri: &str,
    database: &str,
    seeds: &str,
    bases: &[&str],
    crawl: &str,
    mode: &str,
    listen: &str,
) -> PathBuf {
    let scope: Vec<&str> = bases
        .iter()
        .map(|b| b.trim_start_matches("http://"))
        .collect();
    // Every pagination hop counts toward `max_depth` (50 by default): a catalogue of 2,000
    // listing pages needs more.
    let mut rules = seedlock::demo_site::crawl_rules_toml(&scope, ".sku").replacen(
        "[bots.crawl]\n",
        "[bots.crawl]\nmax_depth = 1000000\n",
        1,
    );
    // BENCH_IDENTITY=1: pages uncompressed (the shop compresses what a client asks for).
    if std::env::var("BENCH_IDENTITY").is_ok_and(|v| v == "1") {
        rules = rules.replacen(
            "[bots.crawl]\n",
            "[bots.crawl]\nheaders = { Accept-Encoding = \"identity\" }\n",
            1,
        );
    }
    let seeds = format!("{{ url = \"{seeds}\", format = \"lines\" }}");
    write_config(dir, uri, database, &seeds, &rules, crawl, mode, listen)
}

/// The config file of a bot "shop" with `seeds` (a TOML value) and `rules` (its
/// `[bots.crawl]` tables); `crawl` holds extra `[crawl]` lines, `listen` the `[http]` address.
#[allow(clippy::too_many_arguments)]
fn write_config(
    dir: &Path,
    uri: &str,
    database: &str,
    seeds: &str,
    rules: &str,
    crawl: &str,
    mode: &str,
    listen: &str,
) -> PathBuf {
    let text = format!(
        r#"
[mongo]
uri = "{uri}"
database = "{database}"
[lock]
ttl = "5s"
poll = "200ms"
[crawl]
timeout = "5s"
{crawl}
[http]
listen = "{listen}"
[log]
level = "info"
[[bots]]
id = "shop"
seeds = {seeds}
refresh = "1h"
{rules}[bots.crawl.incremental]
mode = "{mode}"
"#
    );
    let path = dir.join(format!("{database}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The middle of `values` (the upper one of an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn seedlock(config: &Path, instance: &str, args: &[&str]) -> Child {
    let bin = std::env::var("SEEDLOCK_BIN").expect("SEEDLOCK_BIN");
    Command::new(bin)
        .arg("-c")
        .arg(config)
        .args(args)
        .env("SEEDLOCK_INSTANCE_ID", instance)
        .env_remove("MONGODB_URI")
        .stdout(std::process::Stdio::null())
        .stderr(match std::env::var("BENCH_LOG_DIR") {
            // BENCH_LOG_DIR=DIR keeps every instance's log (appended per instance id).
            Ok(dir) => std::process::Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(Path::new(&dir).join(format!("{instance}.log")))
                    .expect("open the instance log"),
            ),
            Err(_) => std::process::Stdio::null(),
        })
        .kill_on_drop(true)
        .spawn()
        .expect("spawn seedlock")
}

/// A running process's peak RSS so far (`VmHWM`, KiB).
fn vm_hwm(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
}

/// Waits for `child`, sampling its peak RSS (VmHWM) meanwhile; returns (success, peak KiB).
async fn wait_with_rss(child: &mut Child) -> (bool, u64) {
    let pid = child.id().unwrap_or(0);
    let mut peak = 0;
    loop {
        if let Some(kb) = vm_hwm(pid) {
            peak = peak.max(kb);
        }
        tokio::select! {
            status = child.wait() => return (status.map(|s| s.success()).unwrap_or(false), peak),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

async fn fresh_db(uri: &str, name: &str) -> Database {
    let client = Client::with_uri_str(uri).await.unwrap();
    let name = format!("bench_{name}_{:08x}", rand::random::<u32>());
    client.database(&name)
}

async fn docs(db: &Database, collection: &str, filter: Document) -> Vec<Document> {
    db.collection::<Document>(collection)
        .find(filter)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// (rows, distinct, correct) of seedlock's records against the shop.
async fn judge_records(
    db: &Database,
    truth: &HashMap<String, (String, String, String)>,
) -> (usize, usize, usize) {
    let rows = docs(db, "records", doc! {}).await;
    let mut distinct = HashSet::new();
    let mut correct = 0;
    for r in &rows {
        let key = r.get_str("naturalKey").unwrap_or_default().to_owned();
        let data = r.get_document("data").cloned().unwrap_or_default();
        let s = |k: &str| data.get_str(k).unwrap_or_default().to_owned();
        if truth.get(&key) == Some(&(s("title"), s("price"), s("status"))) && distinct.insert(key) {
            correct += 1;
        }
    }
    let distinct_keys: HashSet<String> = rows
        .iter()
        .map(|r| r.get_str("naturalKey").unwrap_or_default().to_owned())
        .collect();
    (rows.len(), distinct_keys.len(), correct)
}

// ---- the kill test ----------------------------------------------------------------------------

struct KillRun {
    rows: usize,
    distinct: usize,
    correct: usize,
    requests: u64,
    repeated: u64,
    kills: usize,
    wall: Duration,
    /// From the last kill to the end of the pass.
    after_last_kill: Duration,
}

const KILLS: usize = 10;
/// `crawl.max_uncommitted` in the kill test: the pages an instance may hold fetched and not yet
/// committed, so a kill repeats at most this many.
const KILL_TEST_CAP: u64 = 4;
/// Per-request latency of the shop in the kill test, so a crawl outlives ten kills.
const KILL_TEST_LATENCY_MS: u64 = 20;

/// The shape of one seedlock kill run.
struct KillShape<'a> {
    instances: usize,
    transactions: &'a str,
    /// Listing pages of 20 products.
    lists: u32,
    kills: usize,
    /// Every restart under an instance id never used before (a pod restarted under a new
    /// name), instead of the victim's own.
    fresh_ids: bool,
    /// `crawl.lease`.
    lease: &'a str,
}

async fn kill_seedlock(uri: &str, shape: &KillShape<'_>, dir: &Path) -> KillRun {
    let &KillShape {
        instances,
        transactions,
        lists,
        kills: wanted_kills,
        fresh_ids,
        lease,
    } = shape;
    let shop = Shop::start(lists, 20).await;
    shop.post(
        "/__faults",
        json!([{"path": "/", "latency_ms": KILL_TEST_LATENCY_MS}]),
    )
    .await;
    let db = fresh_db(uri, &format!("kill{instances}")).await;
    let config = config(
        dir,
        uri,
        db.name(),
        &shop.base,
        &Run {
            crawl: &format!(
                "workers = 1\nmax_uncommitted = {KILL_TEST_CAP}\nlease = \"{lease}\"\ntransactions = \"{transactions}\""
            ),
            mode: "fingerprint",
        },
    );
    let names: Vec<String> = (0..instances).map(|i| format!("crawler-{i}")).collect();
    let started = Instant::now();
    let mut children: Vec<Option<Child>> = names
        .iter()
        .map(|n| Some(seedlock(&config, n, &["run", "--once"])))
        .collect();
    let mut born: Vec<Instant> = vec![Instant::now(); instances];
    let mut kills = 0;
    let mut last_kill = started;
    let mut rng = rand::rng();
    while kills < wanted_kills {
        // The next victim: a random running instance, at a random 0.2–1.0 s of its life.
        let running: Vec<usize> = (0..instances).filter(|&i| children[i].is_some()).collect();
        if running.is_empty() {
            break;
        }
        let victim = running[rng.random_range(0..running.len())];
        let at = born[victim] + Duration::from_millis(rng.random_range(200..=1000));
        tokio::time::sleep_until(at.into()).await;
        let child = children[victim].as_mut().unwrap();
        if child.try_wait().unwrap().is_some() {
            // It finished the pass before its kill.
            children[victim] = None;
            continue;
        }
        child.kill().await.unwrap();
        kills += 1;
        last_kill = Instant::now();
        let name = if fresh_ids {
            format!("{}-{kills}", names[victim])
        } else {
            names[victim].clone()
        };
        children[victim] = Some(seedlock(&config, &name, &["run", "--once"]));
        born[victim] = Instant::now();
    }
    for child in children.iter_mut().flatten() {
        let status = child.wait().await.unwrap();
        assert!(status.success(), "an instance failed: {status}");
    }
    let wall = started.elapsed();
    let after_last_kill = last_kill.elapsed();
    let stats = shop.stats().await;
    let truth = shop.truth().await;
    let (rows, distinct, correct) = judge_records(&db, &truth).await;
    let _ = db.drop().await;
    KillRun {
        rows,
        distinct,
        correct,
        requests: total(&stats),
        repeated: repeated(&stats),
        kills,
        wall,
        after_last_kill,
    }
}

/// The naive crawler of seed 000, as a process of its own: page 1 onwards, every product
/// inserted with an auto id, nothing remembered across restarts.
async fn naive_worker(base: &str, uri: &str, database: &str) {
    let client = Client::with_uri_str(uri).await.unwrap();
    let rows = client.database(database).collection::<Document>("rows");
    let http = reqwest::Client::new();
    let item = scraper::Selector::parse(".item").unwrap();
    let link = scraper::Selector::parse("a").unwrap();
    let next = scraper::Selector::parse("a.next").unwrap();
    let text = |html: &scraper::Html, css: &str| {
        let s = scraper::Selector::parse(css).unwrap();
        html.select(&s)
            .next()
            .map(|e| e.text().collect::<String>().trim().to_owned())
            .unwrap_or_default()
    };
    let mut page = format!("{base}/list/1");
    loop {
        let body = http.get(&page).send().await.unwrap().text().await.unwrap();
        let (details, next_page) = {
            let html = scraper::Html::parse_document(&body);
            let details: Vec<String> = html
                .select(&item)
                .filter_map(|i| i.select(&link).next())
                .filter_map(|a| a.value().attr("href").map(|h| format!("{base}{h}")))
                .collect();
            let next_page = html
                .select(&next)
                .next()
                .and_then(|a| a.value().attr("href"))
                .map(|h| format!("{base}{h}"));
            (details, next_page)
        };
        for url in details {
            let body = http.get(&url).send().await.unwrap().text().await.unwrap();
            let row = {
                let html = scraper::Html::parse_document(&body);
                doc! {
                    "sku": text(&html, ".sku"), "title": text(&html, "h1"),
                    "price": text(&html, ".price"), "status": text(&html, ".status"),
                }
            };
            rows.insert_one(row).await.unwrap();
        }
        match next_page {
            Some(p) => page = p,
            None => break,
        }
    }
}

async fn kill_naive(uri: &str) -> KillRun {
    let shop = Shop::start(25, 20).await;
    shop.post(
        "/__faults",
        json!([{"path": "/", "latency_ms": KILL_TEST_LATENCY_MS}]),
    )
    .await;
    let db = fresh_db(uri, "naive").await;
    let me = std::env::current_exe().unwrap();
    let spawn = || {
        Command::new(&me)
            .args(["naive-worker", &shop.base, uri, db.name()])
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let mut rng = rand::rng();
    let mut kills = 0;
    let mut child = spawn();
    while kills < KILLS {
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..=1000))).await;
        if child.try_wait().unwrap().is_some() {
            break;
        }
        child.kill().await.unwrap();
        kills += 1;
        child = spawn();
    }
    assert!(child.wait().await.unwrap().success());
    let wall = started.elapsed();
    let stats = shop.stats().await;
    let truth = shop.truth().await;
    let rows = docs(&db, "rows", doc! {}).await;
    let distinct: HashSet<String> = rows
        .iter()
        .map(|r| r.get_str("sku").unwrap_or_default().to_owned())
        .collect();
    let correct = distinct
        .iter()
        .filter(|sku| {
            rows.iter().any(|r| {
                r.get_str("sku").ok() == Some(sku.as_str())
                    && truth.get(sku.as_str())
                        == Some(&(
                            r.get_str("title").unwrap_or_default().to_owned(),
                            r.get_str("price").unwrap_or_default().to_owned(),
                            r.get_str("status").unwrap_or_default().to_owned(),
                        ))
            })
        })
        .count();
    let _ = db.drop().await;
    KillRun {
        rows: rows.len(),
        distinct: distinct.len(),
        correct,
        requests: total(&stats),
        repeated: repeated(&stats),
        kills,
        wall,
        // Not measured for the baseline.
        after_last_kill: Duration::ZERO,
    }
}

async fn kill(uri: &str, runs: usize) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Kill test (seed 000): 25 listing pages, 500 products, {KILLS} SIGKILLs per run at a random 0.2–1.0 s of the victim's life");
    println!();
    println!("One request in flight per instance (`crawl.workers = 1`) and at most {KILL_TEST_CAP} pages fetched and not yet committed (`crawl.max_uncommitted = {KILL_TEST_CAP}`); the shop answers every request after {KILL_TEST_LATENCY_MS} ms so a crawl outlives ten kills. A full crawl is 525 page requests (+1 for `/seeds.txt` and 1 `/robots.txt` per seedlock process, which `repeated` leaves out). A seedlock run passes with exactly 500 correct records, repeated ≤ kills × {KILL_TEST_CAP}, and a wall under 2× the naive baseline's median.");
    println!();
    println!("| crawler | run | kills | rows | distinct | correct | requests | repeated | wall (s) | verdict |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    // BENCH_KILL_ONLY=1 or 3: only seedlock with that many instances (for investigating).
    let crawlers: &[(&str, usize, &str)] = match std::env::var("BENCH_KILL_ONLY").as_deref() {
        Ok("1") => &[("seedlock, 1 instance", 1, "off")],
        Ok("3") => &[("seedlock, 3 instances", 3, "off")],
        _ => &[
            ("naive (auto ids, no frontier)", 0, "-"),
            (
                "seedlock, 1 instance (default: ordered group commits)",
                1,
                "off",
            ),
            (
                "seedlock, 3 instances (default: ordered group commits)",
                3,
                "off",
            ),
            ("seedlock, 1 instance, `transactions = \"on\"`", 1, "on"),
            ("seedlock, 3 instances, `transactions = \"on\"`", 3, "on"),
        ],
    };
    let mut naive_walls: Vec<f64> = Vec::new();
    for &(label, instances, transactions) in crawlers {
        for run in 1..=runs {
            let r = if instances == 0 {
                kill_naive(uri).await
            } else {
                let shape = KillShape {
                    instances,
                    transactions,
                    lists: 25,
                    kills: KILLS,
                    fresh_ids: false,
                    lease: "10s",
                };
                kill_seedlock(uri, &shape, dir.path()).await
            };
            let verdict = if instances == 0 {
                naive_walls.push(r.wall.as_secs_f64());
                "baseline".to_owned()
            } else {
                let bound = r.kills as u64 * KILL_TEST_CAP;
                let wall_bound = naive_walls
                    .get(naive_walls.len() / 2)
                    .map(|median| 2.0 * median);
                let exact = r.rows == 500 && r.distinct == 500 && r.correct == 500;
                let mut problems = Vec::new();
                if !exact {
                    problems.push("records not exact".to_owned());
                }
                if r.repeated > bound {
                    problems.push(format!("repeated > {bound}"));
                }
                if let Some(w) = wall_bound.filter(|w| r.wall.as_secs_f64() > *w) {
                    problems.push(format!("wall > {w:.1} s"));
                }
                if problems.is_empty() {
                    format!("ok: 500 correct, repeated ≤ {bound}, wall ≤ 2× naive")
                } else {
                    // The transaction path is not the default; its misses are reported, not
                    // counted against the default's guarantee.
                    if transactions != "on" {
                        failures += 1;
                    }
                    format!("FAILED: {}", problems.join(", "))
                }
            };
            println!(
                "| {label} | {run} | {} | {} | {} | {} | {} | {} | {:.1} | {verdict} |",
                r.kills,
                r.rows,
                r.distinct,
                r.correct,
                r.requests,
                r.repeated,
                r.wall.as_secs_f64()
            );
        }
        if instances == 0 {
            naive_walls.sort_by(f64::total_cmp);
        }
    }
    if failures > 0 {
        eprintln!("kill test: {failures} seedlock run(s) broke the guarantee");
        std::process::exit(1);
    }
}

/// The kill test with a new instance id for every restart: 520 products, two
/// instances, 8 SIGKILLs, `crawl.lease` at its default (60 s). The dead processes' URL leases
/// must be taken when their registrations expire (`lock.ttl`, 5 s here), so the pass ends at
/// most 15 s after the last kill.
async fn kill_new_ids(uri: &str, runs: usize) {
    const LISTS: u32 = 26;
    const NEW_ID_KILLS: usize = 8;
    const AFTER_LAST_KILL: Duration = Duration::from_secs(15);
    let dir = tempfile::tempdir().unwrap();
    println!("## Kill test under new instance ids: {} products, 2 instances, {NEW_ID_KILLS} SIGKILLs, each restart under an id never used before", LISTS * 20);
    println!();
    println!("`crawl.lease` 60 s (the default), `lock.ttl` 5 s, one request in flight per instance, at most {KILL_TEST_CAP} pages fetched and not yet committed, the shop answers after {KILL_TEST_LATENCY_MS} ms. A run passes with every record exact, repeated ≤ kills × {KILL_TEST_CAP} and the pass over ≤ {} s after the last kill.", AFTER_LAST_KILL.as_secs());
    println!();
    println!("| run | kills | rows | correct | requests | repeated | after the last kill (s) | wall (s) | verdict |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    let mut after: Vec<f64> = Vec::new();
    for run in 1..=runs {
        let shape = KillShape {
            instances: 2,
            transactions: "off",
            lists: LISTS,
            kills: NEW_ID_KILLS,
            fresh_ids: true,
            lease: "60s",
        };
        let r = kill_seedlock(uri, &shape, dir.path()).await;
        let products = LISTS as usize * 20;
        let bound = r.kills as u64 * KILL_TEST_CAP;
        let mut problems = Vec::new();
        if !(r.rows == products && r.distinct == products && r.correct == products) {
            problems.push("records not exact".to_owned());
        }
        if r.repeated > bound {
            problems.push(format!("repeated > {bound}"));
        }
        if r.after_last_kill > AFTER_LAST_KILL {
            problems.push(format!(
                "over {} s after the last kill",
                AFTER_LAST_KILL.as_secs()
            ));
        }
        let verdict = if problems.is_empty() {
            "ok".to_owned()
        } else {
            failures += 1;
            format!("FAILED: {}", problems.join(", "))
        };
        after.push(r.after_last_kill.as_secs_f64());
        println!(
            "| {run} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {verdict} |",
            r.kills,
            r.rows,
            r.correct,
            r.requests,
            r.repeated,
            r.after_last_kill.as_secs_f64(),
            r.wall.as_secs_f64()
        );
    }
    after.sort_by(f64::total_cmp);
    println!();
    println!(
        "Median after the last kill: {:.1} s",
        after[after.len() / 2]
    );
    if failures > 0 {
        eprintln!("kill test under new ids: {failures} run(s) failed");
        std::process::exit(1);
    }
}

// ---- throughput -------------------------------------------------------------------------------

/// What one `run --once` of one or more instances cost.
struct Crawl {
    /// When the first process was spawned (wall clock: set against the shop's and the
    /// database's timestamps).
    spawned_at: chrono::DateTime<chrono::Utc>,
    /// From the first process start to the last exit.
    wall: Duration,
    /// The pass in the bot document: `crawlPassStartedAt` to `crawlPassEndedAt` (server time).
    pass: Duration,
    peak_kib: u64,
    /// Database commands of every instance over the whole run (command monitoring).
    commands: u64,
    /// Commands per stored detail page while 20–80% of them were stored (`/metrics` samples).
    steady: Option<f64>,
}

/// Sums every series of `name` in a Prometheus / OpenMetrics text (all labels), or the series
/// whose labels contain `labels`.
fn sum_series(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The last `database commands sent` line of an instance's log, summed over commands.
fn commands_in_log(log: &Path) -> u64 {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .rev()
        .find(|l| l.contains("database commands sent"))
        .and_then(|l| l.split("commands=").nth(1))
        .and_then(|rest| rest.split(" waited_ms=").next())
        .and_then(|json| serde_json::from_str::<BTreeMap<String, u64>>(json.trim()).ok())
        .map_or(0, |m| m.values().sum())
}

/// Runs `instances` × `run --once` on `config` together, sampling their `/metrics`.
async fn crawl_measured(config: &Path, db: &Database, instances: usize) -> Crawl {
    let bin = std::env::var("SEEDLOCK_BIN").expect("SEEDLOCK_BIN");
    crawl_measured_by(&bin, config, db, instances).await
}

/// [`crawl_measured`] with the seedlock binary `bin` (an A/B against another build).
async fn crawl_measured_by(bin: &str, config: &Path, db: &Database, instances: usize) -> Crawl {
    let logs = tempfile::tempdir().unwrap();
    // BENCH_LOG_DIR=DIR keeps the instances' logs: DIR/run-<unix ms>-<instance>.log.
    let kept = std::env::var("BENCH_LOG_DIR").ok();
    let addrs: Vec<String> = (0..instances).map(|_| free_addr()).collect();
    let spawned_at = chrono::Utc::now();
    let started = Instant::now();
    let mut children: Vec<Child> = (0..instances)
        .map(|i| {
            let log = std::fs::File::create(logs.path().join(format!("{i}.log"))).unwrap();
            Command::new(bin)
                .arg("-c")
                .arg(config)
                .args(["run", "--once", "--timeout"])
                // BENCH_TIMEOUT (default 3600s): how long a run may take (a contended machine).
                .arg(std::env::var("BENCH_TIMEOUT").unwrap_or_else(|_| "3600s".into()))
                .env("SEEDLOCK_INSTANCE_ID", format!("bench-{i}"))
                .env("SEEDLOCK_HTTP_LISTEN", &addrs[i])
                // BENCH_SEEDLOCK_LOG adds directives (say `seedlock::crawl=trace`) to the log.
                .env(
                    "SEEDLOCK_LOG",
                    match std::env::var("BENCH_SEEDLOCK_LOG") {
                        Ok(more) => format!("info,seedlock::daemon=debug,{more}"),
                        Err(_) => "info,seedlock::daemon=debug".to_owned(),
                    },
                )
                .env_remove("MONGODB_URI")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::from(log))
                .kill_on_drop(true)
                .spawn()
                .expect("spawn seedlock")
        })
        .collect();
    let stop = CancellationToken::new();
    let sampler = {
        let (stop, addrs) = (stop.clone(), addrs.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut samples: Vec<(f64, f64)> = Vec::new();
            while !stop.is_cancelled() {
                let mut sample = Some((0.0, 0.0));
                for addr in &addrs {
                    let asked = Instant::now();
                    let text = match http
                        .get(format!("http://{addr}/metrics"))
                        .timeout(Duration::from_secs(2))
                        .send()
                        .await
                    {
                        Ok(r) => r.text().await.unwrap_or_default(),
                        Err(_) => String::new(),
                    };
                    if std::env::var_os("BENCH_TRACE_STAGES").is_some() && text.is_empty() {
                        eprintln!(
                            "{:>8.3} /metrics unanswered after {:?}",
                            started.elapsed().as_secs_f64(),
                            asked.elapsed()
                        );
                    }
                    if text.is_empty() {
                        sample = None;
                        break;
                    }
                    // BENCH_TRACE_STAGES=1 prints every sample's pipeline depths (stderr).
                    if std::env::var_os("BENCH_TRACE_STAGES").is_some() {
                        let depths: Vec<String> = text
                            .lines()
                            .filter(|l| {
                                l.starts_with("seedlock_crawl_stage_depth")
                                    || l.starts_with("seedlock_host_limit")
                                    || l.starts_with("seedlock_host_in_flight")
                            })
                            .map(|l| {
                                let name = l.split('"').nth(3).unwrap_or(l);
                                let value = l.rsplit(' ').next().unwrap_or("");
                                format!("{name}={value}")
                            })
                            .collect();
                        eprintln!(
                            "{:>8.3} {}",
                            started.elapsed().as_secs_f64(),
                            depths.join(" ")
                        );
                    }
                    if let Some((commands, stored)) = sample.as_mut() {
                        *commands += sum_series(&text, "seedlock_db_commands_total", "");
                        *stored +=
                            sum_series(&text, "seedlock_crawl_pages_total", "kind=\"stored\"");
                    }
                }
                if let Some(sample) = sample {
                    samples.push(sample);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            samples
        })
    };
    let mut peak = 0;
    for (i, child) in children.iter_mut().enumerate() {
        let (ok, rss) = wait_with_rss(child).await;
        if !ok {
            // Its log dies with the temporary directory: its last lines say why.
            let log =
                std::fs::read_to_string(logs.path().join(format!("{i}.log"))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            for line in tail.iter().rev() {
                eprintln!("instance {i}: {line}");
            }
            panic!("instance {i} failed (its last log lines above)");
        }
        peak = peak.max(rss);
    }
    let wall = started.elapsed();
    stop.cancel();
    let samples = sampler.await.unwrap();
    let commands = (0..instances)
        .map(|i| {
            let log = logs.path().join(format!("{i}.log"));
            if let Some(dir) = &kept {
                let stamp = chrono::Utc::now().timestamp_millis();
                let _ = std::fs::copy(&log, Path::new(dir).join(format!("run-{stamp}-{i}.log")));
            }
            commands_in_log(&log)
        })
        .sum();
    let stored = samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let steady = {
        let from = samples.iter().find(|s| s.1 >= 0.2 * stored);
        let to = samples.iter().rev().find(|s| s.1 <= 0.8 * stored);
        match (from, to) {
            (Some(a), Some(b)) if b.1 > a.1 => Some((b.0 - a.0) / (b.1 - a.1)),
            _ => None,
        }
    };
    let bot = db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": "shop" })
        .await
        .unwrap()
        .unwrap_or_default();
    let pass = match (
        bot.get_datetime("crawlPassStartedAt"),
        bot.get_datetime("crawlPassEndedAt"),
    ) {
        (Ok(a), Ok(b)) => {
            Duration::from_millis((b.timestamp_millis() - a.timestamp_millis()).max(0) as u64)
        }
        _ => wall,
    };
    Crawl {
        spawned_at,
        wall,
        pass,
        peak_kib: peak,
        commands,
        steady,
    }
}

async fn crawl_once(
    uri: &str,
    dir: &Path,
    shop: &Shop,
    db: &Database,
    instances: usize,
    mode: &str,
    crawl: &str,
) -> Crawl {
    let config = config(dir, uri, db.name(), &shop.base, &Run { crawl, mode });
    crawl_measured(&config, db, instances).await
}

async fn request_refresh(db: &Database) {
    db.collection::<Document>("bots")
        .update_one(
            doc! { "_id": "shop" },
            doc! { "$currentDate": { "refreshRequestedAt": true } },
        )
        .await
        .unwrap();
}

/// The database's ceiling: the least database work a crawl of `pages` detail pages needs with
/// nothing else in the way — a minimal loop of batched leases (one `find` of a host's pending
/// URLs in a few slots, one `update` of them), one read of their records, one `insert` of them,
/// one `update` marking the batch done — on seedlock's own frontier index (plus `extra` indexes,
/// to measure what an index costs). Returns (pages/s, lease time, commit time).
async fn db_ceiling(
    uri: &str,
    pages: u32,
    batch: usize,
    extra: &[Document],
) -> (f64, Duration, Duration) {
    let client = Client::with_uri_str(uri).await.unwrap();
    let db = fresh_db(uri, "ceiling").await;
    let store = seedlock::store::Store::new(client.database(db.name()));
    store.frontier().ensure_indexes().await.unwrap();
    store.records().ensure_indexes().await.unwrap();
    let frontier = db.collection::<Document>("frontier");
    for keys in extra {
        frontier
            .create_index(mongodb::IndexModel::builder().keys(keys.clone()).build())
            .await
            .unwrap();
    }
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    let urls: Vec<seedlock::urls::NormalizedUrl> = (0..pages)
        .map(|i| {
            seedlock::urls::NormalizedUrl::parse(&format!("http://shop.test/product/{i}")).unwrap()
        })
        .collect();
    store
        .frontier()
        .enqueue(
            &bot,
            PassNumber::new(1),
            seedlock::store::frontier::PageKind::Detail,
            &urls,
            chrono::Utc::now(),
        )
        .await
        .unwrap();
    let records = db.collection::<Document>("records");
    let (mut lease, mut commit) = (Duration::ZERO, Duration::ZERO);
    let started = Instant::now();
    let mut done = 0_u32;
    loop {
        let t0 = Instant::now();
        let remaining = f64::from((pages - done).max(1));
        let k = ((batch as f64 * 1024.0 / remaining).ceil() as i64).clamp(1, 1024);
        let first = rand::rng().random_range(0..1024_i64);
        let slots: Vec<i64> = (0..k).map(|i| (first + i) % 1024).collect();
        let filter = |slots: Option<Vec<i64>>| {
            let mut f = doc! { "botId": "shop", "pass": 1_i64, "status": "pending", "host": "shop.test:80", "priority": 0_i64 };
            if let Some(slots) = slots {
                f.insert("slot", doc! { "$in": slots });
            }
            f
        };
        let mut found: Vec<Document> = frontier
            .find(filter(Some(slots)))
            .limit(batch as i64)
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        if found.is_empty() {
            found = frontier
                .find(filter(None))
                .limit(batch as i64)
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
        }
        if found.is_empty() {
            break;
        }
        let ids: Vec<bson::Bson> = found
            .iter()
            .map(|d| d.get("_id").unwrap().clone())
            .collect();
        let token = format!("{:032x}", rand::random::<u128>());
        let now = bson::DateTime::now();
        frontier
            .update_many(
                doc! { "_id": { "$in": &ids }, "botId": "shop", "status": "pending" },
                doc! { "$set": { "status": "leased", "leaseToken": &token, "leaseExpiresAt": now, "leasedAt": now }, "$inc": { "attempts": 1_i64 } },
            )
            .await
            .unwrap();
        lease += t0.elapsed();
        let t0 = Instant::now();
        let record_ids: Vec<String> = ids
            .iter()
            .map(|id| format!("r{}", id.as_str().unwrap()))
            .collect();
        let _stored: Vec<Document> = records
            .find(doc! { "_id": { "$in": &record_ids }, "botId": "shop" })
            .projection(doc! { "contentHash": 1, "fetchedAt": 1, "removedAt": 1 })
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let new: Vec<Document> = record_ids
            .iter()
            .map(|id| {
                doc! {
                    "_id": id, "botId": "shop", "naturalKey": id, "url": "http://shop.test/",
                    "data": { "title": "Lamp", "price": "$1.00", "status": "in stock" },
                    "contentHash": "h", "firstSeen": now, "lastChanged": now,
                    "fetchedPass": 1_i64, "removedAt": bson::Bson::Null, "fetchedAt": now,
                }
            })
            .collect();
        records.insert_many(new).await.unwrap();
        frontier
            .update_many(
                doc! { "_id": { "$in": &ids }, "botId": "shop", "status": "leased", "leaseToken": &token },
                doc! { "$set": { "status": "done", "doneAt": now, "leaseOwner": bson::Bson::Null, "leaseToken": bson::Bson::Null, "leaseExpiresAt": bson::Bson::Null } },
            )
            .await
            .unwrap();
        commit += t0.elapsed();
        done += ids.len() as u32;
    }
    let rate = f64::from(done) / started.elapsed().as_secs_f64();
    let _ = db.drop().await;
    (rate, lease / done.max(1), commit / done.max(1))
}

/// The path of the next listing page a demo-shop listing page links to.
fn next_listing_path(body: &str) -> Option<&str> {
    body.split_once("class=\"next\" href=\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map(|(path, _)| path)
}

/// The HTTP ceiling: every page of the shop fetched, nothing parsed (beyond finding the links)
/// or stored — listing pages one after the other, each one's product pages `concurrency` at a
/// time.
async fn http_ceiling(base: &str, concurrency: usize) -> (u64, f64) {
    use futures_util::StreamExt;
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut fetched = 0_u64;
    let mut next = Some(format!("{base}/list/1"));
    while let Some(list) = next.take() {
        let body = client
            .get(&list)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        fetched += 1;
        let products: Vec<String> = body
            .split("href=\"/product/")
            .skip(1)
            .filter_map(|s| s.split('"').next())
            .map(|sku| format!("{base}/product/{sku}"))
            .collect();
        next = next_listing_path(&body).map(|path| format!("{base}{path}"));
        let got: Vec<()> = futures_util::stream::iter(products)
            .map(|url| {
                let client = client.clone();
                async move {
                    let _ = client.get(url).send().await.unwrap().bytes().await.unwrap();
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        fetched += got.len() as u64;
    }
    (fetched, fetched as f64 / started.elapsed().as_secs_f64())
}

/// A bot crawling the shop at `base` through its JSON API (`demo_site::api_rules_toml`), seeded
/// with its first page.
fn config_api(dir: &Path, uri: &str, database: &str, base: &str) -> PathBuf {
    let rules = seedlock::demo_site::api_rules_toml(&[base.trim_start_matches("http://")]);
    let seeds = format!("[\"{base}/api/products?page=1\"]");
    write_config(dir, uri, database, &seeds, &rules, "", "fingerprint", "off")
}

/// The same catalogue of 5,000 products crawled as HTML pages and as the JSON API (one
/// instance, a full pass each, interleaved RUNS times): pages/s, medians and their ratio. A JSON
/// run's records are checked against the shop (natural keys, and the price as a number).
async fn json_vs_html(uri: &str, runs: usize) {
    let dir = tempfile::tempdir().unwrap();
    println!("## JSON API against HTML: 5,000 products, one instance, a full pass");
    println!();
    println!("Runs interleaved; medians of {runs}. Pages: listing pages and detail pages (100 listing pages of 50, then 5,000 products, either way).");
    println!();
    println!("| format | run | pages | pass (s) | pages/s | correct |");
    println!("|---|---|---|---|---|---|");
    let mut rates: HashMap<&str, Vec<f64>> = HashMap::new();
    for run in 1..=runs {
        for format in ["html", "json"] {
            let shop = Shop::start(100, 50).await;
            let db = fresh_db(uri, "jsonbench").await;
            let config = if format == "html" {
                config(
                    dir.path(),
                    uri,
                    db.name(),
                    &shop.base,
                    &Run {
                        crawl: "",
                        mode: "fingerprint",
                    },
                )
            } else {
                config_api(dir.path(), uri, db.name(), &shop.base)
            };
            let c = crawl_measured(&config, &db, 1).await;
            let stats = shop.stats().await;
            let truth = shop.truth().await;
            let (pages, correct) = if format == "html" {
                let (_, _, correct) = judge_records(&db, &truth).await;
                (
                    under(&stats, "/list/") + under(&stats, "/product/"),
                    correct,
                )
            } else {
                let mut correct = 0;
                for r in docs(&db, "records", doc! {}).await {
                    let key = r.get_str("naturalKey").unwrap_or_default();
                    let data = r.get_document("data").cloned().unwrap_or_default();
                    let price = data.get_f64("price").unwrap_or(f64::NAN);
                    let expected = truth.get(key).map(|(title, price, status)| {
                        (
                            title.clone(),
                            price.trim_start_matches('$').parse::<f64>().ok(),
                            status.clone(),
                        )
                    });
                    let got = (
                        data.get_str("title").unwrap_or_default().to_owned(),
                        Some(price),
                        data.get_str("status").unwrap_or_default().to_owned(),
                    );
                    if expected == Some(got) {
                        correct += 1;
                    }
                }
                (under(&stats, "/api/product"), correct)
            };
            let rate = pages as f64 / c.pass.as_secs_f64();
            rates.entry(format).or_default().push(rate);
            println!(
                "| {format} | {run} | {pages} | {:.3} | {rate:.0} | {correct}/{} |",
                c.pass.as_secs_f64(),
                truth.len()
            );
            let _ = db.drop().await;
        }
    }
    let html = median(rates.get_mut("html").unwrap());
    let json = median(rates.get_mut("json").unwrap());
    println!();
    println!(
        "Medians: HTML **{html:.0}** pages/s, JSON **{json:.0}** pages/s; JSON / HTML = **{:.2}**.",
        json / html
    );
}

async fn throughput(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Throughput: one full pass (`run --once`, default `[crawl]` unless the row says otherwise)");
    println!();
    println!("`pass` is the bot document's `crawlPassStartedAt` → `crawlPassEndedAt`; `wall` is the first process start to the last exit. Database commands are the driver's command monitoring (`seedlock_db_commands_total`), summed over the instances, per detail page stored: over the whole run, and in the steady state (while 20–80% of the detail pages were stored).");
    println!();
    println!("| products | instances | `[crawl]` | pages | pass (s) | pages/s (pass) | wall (s) | db commands / detail page (run) | (steady) | peak RSS per instance (MiB) | correct records |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let only: Option<Vec<usize>> = std::env::var("BENCH_ROWS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect());
    let runs: Vec<_> = [
        (25, 20, 1, ""),
        (25, 20, 3, ""),
        (100, 100, 1, ""),
        (100, 100, 3, ""),
        (100, 100, 1, "transactions = \"on\""),
    ]
    .into_iter()
    .enumerate()
    .filter(|(i, _)| only.as_ref().is_none_or(|o| o.contains(i)))
    .map(|(_, r)| r)
    .collect();
    for (lists, per_list, instances, crawl) in runs {
        let shop = Shop::start(lists, per_list).await;
        let db = fresh_db(uri, "throughput").await;
        let c = crawl_once(uri, dir.path(), &shop, &db, instances, "fingerprint", crawl).await;
        let stats = shop.stats().await;
        let pages = under(&stats, "/list/") + under(&stats, "/product/");
        let details = under(&stats, "/product/");
        let truth = shop.truth().await;
        let (_, _, correct) = judge_records(&db, &truth).await;
        println!(
            "| {} | {instances} | {} | {pages} | {:.3} | {:.0} | {:.3} | {:.2} | {} | {:.1} | {correct}/{} |",
            lists * per_list,
            if crawl.is_empty() { "defaults".into() } else { format!("`{crawl}`") },
            c.pass.as_secs_f64(),
            pages as f64 / c.pass.as_secs_f64(),
            c.wall.as_secs_f64(),
            c.commands as f64 / details.max(1) as f64,
            c.steady.map_or("-".into(), |s| format!("{s:.2}")),
            c.peak_kib as f64 / 1024.0,
            truth.len()
        );
        let _ = db.drop().await;
    }
}

/// One instance crawling 5,000 products with the database behind a proxy that adds a round-trip
/// time (`tests/suite/kit/delay.rs`): pages/s at each RTT, and as a share of the 0 ms speed measured
/// in the same run (runs interleaved, medians).
async fn network(uri: &str, runs: usize) {
    // `BENCH_RTTS=0,10` runs only those (the first is the baseline of the share column).
    let rtts: Vec<u64> = std::env::var("BENCH_RTTS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<u64>| !v.is_empty())
        .unwrap_or_else(|| vec![0, 2, 10]);
    // `BENCH_NETWORK_SHOP=10,500` crawls 10 listing pages of 500 products instead of 50 of 100
    // (a shorter pagination chain under the same detail pages).
    let (listings, per) = std::env::var("BENCH_NETWORK_SHOP")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once(',')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        })
        .unwrap_or((50, 100));
    let dir = tempfile::tempdir().unwrap();
    println!("## The database across a network: {listings} listing pages of {per} products, one instance, a delay proxy in front of the database");
    println!();
    println!("The proxy holds every byte for half the round trip in each direction (no bandwidth limit). `0 ms` goes through the proxy too. Runs interleaved; medians of {runs}.");
    println!();
    println!("| RTT (ms) | run | pages | pass (s) | pages/s | correct |");
    println!("|---|---|---|---|---|---|");
    let upstream = kit::blackhole::server_of(uri);
    let mut rates: HashMap<u64, Vec<f64>> = HashMap::new();
    for run in 1..=runs {
        for &rtt in &rtts {
            let proxy = kit::delay::Delay::start(&upstream, Duration::from_millis(rtt));
            let through = proxy.uri(uri);
            let shop = Shop::start(listings, per).await;
            let db = fresh_db(uri, "network").await;
            let config = config(
                dir.path(),
                &through,
                db.name(),
                &shop.base,
                &Run {
                    crawl: &std::env::var("BENCH_CRAWL").unwrap_or_default(),
                    mode: "fingerprint",
                },
            );
            let c = crawl_measured(&config, &db, 1).await;
            let stats = shop.stats().await;
            let pages = under(&stats, "/list/") + under(&stats, "/product/");
            let truth = shop.truth().await;
            let (_, _, correct) = judge_records(&db, &truth).await;
            let rate = pages as f64 / c.pass.as_secs_f64();
            rates.entry(rtt).or_default().push(rate);
            println!(
                "| {rtt} | {run} | {pages} | {:.3} | {rate:.0} | {correct}/{} |",
                c.pass.as_secs_f64(),
                truth.len()
            );
            let _ = db.drop().await;
        }
    }
    let base = median(rates.get_mut(&rtts[0]).unwrap());
    println!();
    println!("| RTT (ms) | median pages/s | share of 0 ms |");
    println!("|---|---|---|");
    for &rtt in &rtts {
        let m = median(rates.get_mut(&rtt).unwrap());
        println!("| {rtt} | {m:.0} | {:.2} |", m / base);
    }
}

/// The two ceilings and seedlock, side by side in one run: the database's (no HTTP), the HTTP
/// one (no database), and one seedlock instance on the same 10,000-product shop.
async fn ceilings(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Ceilings: the same work with nothing else in the way, next to seedlock (10,000 products)");
    println!();
    let (db_rate, lease, commit) = db_ceiling(uri, 10_000, 50, &[]).await;
    let shop = Shop::start(100, 100).await;
    let (http_pages, http_rate) = http_ceiling(&shop.base, 32).await;
    shop.stats().await;
    let db = fresh_db(uri, "ceilings").await;
    // BENCH_CRAWL adds `[crawl]` lines to seedlock's run (an A/B of its settings).
    let extra = std::env::var("BENCH_CRAWL").unwrap_or_default();
    let c = crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", &extra).await;
    let stats = shop.stats().await;
    let pages = under(&stats, "/list/") + under(&stats, "/product/");
    let rate = pages as f64 / c.pass.as_secs_f64();
    let _ = db.drop().await;
    println!("| what | pages | pages/s |");
    println!("|---|---|---|");
    println!(
        "| database ceiling: batched lease + record + done loop, 50 a batch, no HTTP (lease {:.0} µs + commit {:.0} µs a page) | 10000 | {db_rate:.0} |",
        lease.as_secs_f64() * 1e6,
        commit.as_secs_f64() * 1e6
    );
    println!(
        "| HTTP ceiling: fetch-only, 32 at a time, no database | {http_pages} | {http_rate:.0} |"
    );
    println!("| seedlock, 1 instance, defaults (pass) | {pages} | {rate:.0} |");
    println!();
    println!(
        "seedlock at {:.0}% of the lower ceiling ({}).",
        100.0 * rate / db_rate.min(http_rate),
        if db_rate <= http_rate {
            "the database's"
        } else {
            "HTTP's"
        }
    );
}

/// What each frontier index costs the lease and commit paths: the database ceiling's loop with
/// seedlock's indexes, and with each index of earlier versions added.
async fn indexes(uri: &str) {
    println!("## Frontier indexes: what each one costs (the database ceiling's loop, 10,000 pages, 50 a batch)");
    println!();
    println!("| indexes | lease µs / page | commit µs / page | pages/s |");
    println!("|---|---|---|---|");
    let retired = [
        (
            "+ `{botId, pass, status, leaseExpiresAt}`",
            doc! { "botId": 1, "pass": 1, "status": 1, "leaseExpiresAt": 1 },
        ),
        (
            "+ `{botId, pass, status, slot}`",
            doc! { "botId": 1, "pass": 1, "status": 1, "slot": 1 },
        ),
        (
            "+ `{botId, pass, status, priority, slot}`",
            doc! { "botId": 1, "pass": 1, "status": 1, "priority": 1, "slot": 1 },
        ),
    ];
    let sets: Vec<(String, Vec<Document>)> = std::iter::once((
        "seedlock's: `bot_pass_status_host_priority_slot` (and `bot_pass_listings`, which no detail page enters)".to_owned(),
        Vec::new(),
    ))
    .chain(
        retired
            .iter()
            .map(|(name, keys)| (name.to_string(), vec![keys.clone()])),
    )
    .chain(std::iter::once((
        "+ all three (the indexes before this version)".to_owned(),
        retired.iter().map(|(_, k)| k.clone()).collect(),
    )))
    .collect();
    for (name, extra) in sets {
        let (rate, lease, commit) = db_ceiling(uri, 10_000, 50, &extra).await;
        println!(
            "| {name} | {:.0} | {:.0} | {rate:.0} |",
            lease.as_secs_f64() * 1e6,
            commit.as_secs_f64() * 1e6
        );
    }
}

// ---- incremental ------------------------------------------------------------------------------

/// Counts the writes a collection's change stream reports (one event per document written:
/// inserts, updates, replacements, deletes) from now until `stop`, by operation type.
/// The server's operation time now (a `ping`'s `operationTime`): where a change stream opened
/// later starts, so that the documents a pass writes are counted after it, not while it runs.
async fn operation_time(db: &Database) -> Option<bson::Timestamp> {
    let reply = db.run_command(doc! { "ping": 1 }).await.ok()?;
    reply.get_timestamp("operationTime").ok()
}

/// Counts the documents written to `collection` (by kind of write) as its change stream shows
/// them: from `since` on when that is known — the stream is opened after the pass, so the
/// counting costs the pass nothing (a stream open during the pass took about a tenth of the
/// server's CPU) — else live, from the moment this is called until `stop`. Ends when the
/// stream has been quiet for 1.5 s after `stop`.
async fn count_writes(
    db: &Database,
    collection: &str,
    since: Option<bson::Timestamp>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<BTreeMap<String, u64>> {
    use futures_util::StreamExt;
    let coll = db.collection::<Document>(collection);
    let mut stream = match since {
        Some(at) => coll.watch().start_at_operation_time(at).await,
        None => coll.watch().await,
    }
    .expect("a change stream");
    tokio::spawn(async move {
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        let mut count = |e: mongodb::change_stream::event::ChangeStreamEvent<Document>| {
            *counts
                .entry(format!("{:?}", e.operation_type).to_lowercase())
                .or_default() += 1;
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                event = stream.next() => match event {
                    Some(Ok(e)) => count(e),
                    _ => break,
                },
            }
        }
        // What was written before the stop and is still on its way.
        while let Ok(Some(Ok(e))) =
            tokio::time::timeout(Duration::from_millis(1500), stream.next()).await
        {
            count(e);
        }
        counts
    })
}

/// Frontier entries of `kinds` that are done: the pages a finished pass fetched.
async fn frontier_done(db: &Database, kinds: &[&str]) -> u64 {
    db.collection::<Document>("frontier")
        .count_documents(doc! { "status": "done", "kind": { "$in": kinds } })
        .await
        .unwrap()
}

/// The pass as the bot document shows it, its deletion evaluation included: from
/// `crawlPassStartedAt` to `crawlLastPass.evaluatedAt` (server time).
async fn pass_with_evaluation(db: &Database) -> Option<Duration> {
    let bot = db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": "shop" })
        .await
        .ok()??;
    let start = bot.get_datetime("crawlPassStartedAt").ok()?;
    let end = bot
        .get_document("crawlLastPass")
        .ok()?
        .get_datetime("evaluatedAt")
        .ok()?;
    Some(Duration::from_millis(
        (end.timestamp_millis() - start.timestamp_millis()).max(0) as u64,
    ))
}

async fn incremental(uri: &str, items: u32, change: u32, add: u32, delete: u32) {
    let dir = tempfile::tempdir().unwrap();
    let lists = items.div_ceil(100);
    println!("## Incremental passes (seed 003): {items} products, 100 per listing page");
    println!();
    let shop = Shop::start(lists, 100).await;
    let db = fresh_db(uri, "incremental").await;
    // BENCH_CRAWL adds `[crawl]` lines to both passes (for experiments).
    let extra = std::env::var("BENCH_CRAWL").unwrap_or_default();
    let full = crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", &extra).await;
    let full_pass = pass_with_evaluation(&db).await.unwrap_or(full.pass);
    let stats = shop.stats().await;
    // The shop's per-path table keeps 100,000 paths (the rest count as "(other)"): past that,
    // the full pass's pages are counted in the frontier, which holds one done entry per page.
    let (full_lists, full_details) = if stats.contains_key("(other)") {
        (
            frontier_done(&db, &["seed", "list"]).await,
            frontier_done(&db, &["detail"]).await,
        )
    } else {
        (under(&stats, "/list/"), under(&stats, "/product/"))
    };
    let full_writes = db
        .collection::<Document>("records")
        .count_documents(doc! {})
        .await
        .unwrap();
    let report = shop
        .post(
            "/__mutate",
            json!({"change": change, "add": add, "delete": delete}),
        )
        .await;
    let list = |name: &str| -> HashSet<String> {
        report[name]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let deleted = list("deleted");
    let changed: HashSet<String> = list("changed").difference(&deleted).cloned().collect();
    let added = list("added");
    let expect_fetch = (changed.len() + added.len()) as u64;
    let expect_writes = (changed.len() + added.len() + deleted.len()) as u64;
    // Every document written in the second pass, as the collections' change streams see them:
    // opened after the pass from the operation time before it (BENCH_LIVE_STREAMS=1: open
    // during the pass: the earlier way of counting).
    let live = std::env::var("BENCH_LIVE_STREAMS").as_deref() == Ok("1");
    let since = if live {
        None
    } else {
        operation_time(&db).await
    };
    let stop = CancellationToken::new();
    let (mut record_writes, mut frontier_writes, mut event_writes) = (None, None, None);
    if since.is_none() {
        record_writes = Some(count_writes(&db, "records", None, stop.clone()).await);
        frontier_writes = Some(count_writes(&db, "frontier", None, stop.clone()).await);
        event_writes = Some(count_writes(&db, "changes", None, stop.clone()).await);
    }
    request_refresh(&db).await;
    let second = crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", &extra).await;
    if since.is_some() {
        record_writes = Some(count_writes(&db, "records", since, stop.clone()).await);
        frontier_writes = Some(count_writes(&db, "frontier", since, stop.clone()).await);
        event_writes = Some(count_writes(&db, "changes", since, stop.clone()).await);
    }
    stop.cancel();
    let record_writes = record_writes.expect("counted").await.unwrap();
    let frontier_writes = frontier_writes.expect("counted").await.unwrap();
    let event_writes: u64 = event_writes.expect("counted").await.unwrap().values().sum();
    let second_pass = pass_with_evaluation(&db).await.unwrap_or(second.pass);
    let stats = shop.stats().await;
    let details = under(&stats, "/product/");
    let listings = under(&stats, "/list/");
    let fetched = total(&stats) - under(&stats, "/__");
    let writes: u64 = record_writes.values().sum();
    let frontier_docs: u64 = frontier_writes.values().sum();
    let truth = shop.truth().await;
    let (_, _, correct) = judge_records(&db, &truth).await;
    let removed = docs(&db, "records", doc! { "removedAt": { "$type": "date" } })
        .await
        .into_iter()
        .filter_map(|r| r.get_str("naturalKey").ok().map(str::to_owned))
        .collect::<HashSet<String>>();
    let last = db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": "shop" })
        .await
        .unwrap()
        .unwrap_or_default()
        .get_document("crawlLastPass")
        .cloned()
        .unwrap_or_default();
    println!(
        "| pass | listing pages | detail requests | record documents written | pass (s) | pages/s | wall (s) | peak RSS (MiB) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| full | {full_lists} | {full_details} | {full_writes} | {:.1} | {:.0} | {:.1} | {:.1} |",
        full_pass.as_secs_f64(),
        (full_lists + full_details) as f64 / full_pass.as_secs_f64(),
        full.wall.as_secs_f64(),
        full.peak_kib as f64 / 1024.0
    );
    println!(
        "| after {} changed + {} added + {} deleted | {listings} | {details} | {writes} | {:.2} | {:.0} | {:.1} | {:.1} |",
        changed.len(),
        added.len(),
        deleted.len(),
        second_pass.as_secs_f64(),
        (listings + details) as f64 / second_pass.as_secs_f64(),
        second.wall.as_secs_f64(),
        second.peak_kib as f64 / 1024.0
    );
    println!();
    println!(
        "Change feed documents written in the second pass: {event_writes} (one per changed, added and removed record: {expect_writes})."
    );
    println!();
    println!(
        "Second pass (its deletion evaluation included): {details} detail requests (expected {expect_fetch}), {writes} record documents written (expected {expect_writes} = changed + added + removed; by operation {record_writes:?}), {} records removed (exactly the deleted: {}); {:.2} s = {:.1}% of the full pass; records correct: {correct}/{}. Frontier documents written: {frontier_docs} ({frontier_writes:?}) for {fetched} pages fetched. Evaluation: {} listing pages changed, {} candidates, {} removed, {} restored.",
        removed.len(),
        removed == deleted,
        second_pass.as_secs_f64(),
        100.0 * second_pass.as_secs_f64() / full_pass.as_secs_f64(),
        truth.len(),
        last.get_i64("changedPages").unwrap_or(-1),
        last.get_i64("candidates").unwrap_or(-1),
        last.get_i64("removed").unwrap_or(-1),
        last.get_i64("restored").unwrap_or(-1),
    );
    let ok = details == expect_fetch
        && writes == expect_writes
        && removed == deleted
        && correct == truth.len();
    let _ = db.drop().await;

    // Watermark mode on an append-only catalogue: 200 new items.
    let shop = Shop::start(lists.min(50), 100).await;
    let db = fresh_db(uri, "watermark").await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "watermark", "").await;
    shop.stats().await;
    shop.post("/__mutate", json!({"add": 200})).await;
    request_refresh(&db).await;
    let wall = crawl_once(uri, dir.path(), &shop, &db, 1, "watermark", "")
        .await
        .pass;
    let stats = shop.stats().await;
    println!();
    println!(
        "Watermark mode ({} products, then 200 added): the second pass read {} listing pages and {} detail pages in {:.2} s.",
        lists.min(50) * 100,
        under(&stats, "/list/"),
        under(&stats, "/product/"),
        wall.as_secs_f64()
    );
    let _ = db.drop().await;
    if !ok {
        eprintln!("incremental: the second pass did not cost exactly what changed");
        std::process::exit(1);
    }
}

// ---- sitemaps -----------------------------------------------------------------------------------

/// A catalogue of `items` products read from its gzipped sitemap index (files of 50,000 URLs,
/// each with its `lastmod`), seeded with the index itself: a full pass, then `change` products
/// changed (their `lastmod` moves). The second pass must fetch exactly the changed pages and
/// write exactly their records; peak RSS of both passes.
async fn sitemaps(uri: &str, items: u32, change: u32) {
    let dir = tempfile::tempdir().unwrap();
    let shop = Shop::start_options(seedlock::demo_site::SiteOptions {
        lists: items.div_ceil(100),
        per_list: 100,
        seed: 1,
        ..Default::default()
    })
    .await;
    let db = fresh_db(uri, "sitemaps").await;
    let host = shop.base.trim_start_matches("http://");
    let index = format!("{}/sitemaps/index.xml.gz", shop.base);
    let rules = seedlock::demo_site::sitemap_rules_toml(&[host], &[&index], "a.next");
    let seeds = format!("[\"{index}\"]");
    let extra = std::env::var("BENCH_CRAWL").unwrap_or_default();
    let config = write_config(
        dir.path(),
        uri,
        db.name(),
        &seeds,
        &rules,
        &extra,
        "fingerprint",
        "off",
    );
    let files = items.div_ceil(50_000);
    println!(
        "## Sitemaps as listings: {items} products in {files} gzipped files of at most 50,000 URLs"
    );
    println!();
    let full = crawl_measured(&config, &db, 1).await;
    let full_pass = pass_with_evaluation(&db).await.unwrap_or(full.pass);
    let full_details = frontier_done(&db, &["detail"]).await;
    let full_records = db
        .collection::<Document>("records")
        .count_documents(doc! {})
        .await
        .unwrap();
    shop.stats().await;
    let report = shop.post("/__mutate", json!({"change": change})).await;
    let changed: HashSet<String> = report["changed"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let since = operation_time(&db).await;
    request_refresh(&db).await;
    let second = crawl_measured(&config, &db, 1).await;
    let stop = CancellationToken::new();
    let record_writes = count_writes(&db, "records", since, stop.clone()).await;
    stop.cancel();
    let record_writes = record_writes.await.unwrap();
    let second_pass = pass_with_evaluation(&db).await.unwrap_or(second.pass);
    let stats = shop.stats().await;
    let mut fetched: Vec<String> = stats
        .keys()
        .filter_map(|k| k.strip_prefix("/product/"))
        .map(str::to_owned)
        .collect();
    fetched.sort();
    let mut expected: Vec<String> = changed.iter().cloned().collect();
    expected.sort();
    let sitemap_requests = under(&stats, "/sitemaps/");
    let writes: u64 = record_writes.values().sum();
    let truth = shop.truth().await;
    let (_, _, correct) = judge_records(&db, &truth).await;
    println!("| pass | sitemap files | detail requests | record documents written | pass (s) | peak RSS (MiB) |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| full | {} | {full_details} | {full_records} | {:.1} | {:.1} |",
        files + 1,
        full_pass.as_secs_f64(),
        full.peak_kib as f64 / 1024.0
    );
    println!(
        "| after {} changed ({:.2}%) | {sitemap_requests} | {} | {writes} | {:.2} | {:.1} |",
        changed.len(),
        100.0 * changed.len() as f64 / f64::from(items),
        fetched.len(),
        second_pass.as_secs_f64(),
        second.peak_kib as f64 / 1024.0
    );
    println!();
    let exact = fetched == expected && writes == changed.len() as u64;
    println!(
        "Second pass: {} detail requests and {writes} record documents written for {} changed lastmods (exactly those: {exact}); {:.1}% of the full pass's time; records correct: {correct}/{}.",
        fetched.len(),
        changed.len(),
        100.0 * second_pass.as_secs_f64() / full_pass.as_secs_f64(),
        truth.len()
    );
    let _ = db.drop().await;
    if !exact || correct != truth.len() {
        eprintln!("sitemaps: the second pass did not cost exactly what changed");
        std::process::exit(1);
    }
}

// ---- flow control -----------------------------------------------------------------------------

/// Pages per second between the first and the last page request in `times`.
fn rate(times: &[i64]) -> f64 {
    let (Some(first), Some(last)) = (times.iter().min(), times.iter().max()) else {
        return 0.0;
    };
    times.len() as f64 / ((last - first) as f64 / 1000.0).max(1e-3)
}

async fn run_once(config: &Path) -> Duration {
    let started = Instant::now();
    let mut child = seedlock(config, "bench-0", &["run", "--once", "--timeout", "3600s"]);
    let (ok, _) = wait_with_rss(&mut child).await;
    assert!(ok, "the instance failed");
    started.elapsed()
}

async fn head_of_line(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Head-of-line: a slow host (1.5 s a page) next to a fast one of 1,000 products (1 instance, default `[crawl]`)");
    println!();
    println!("| run | B pages | B pages/s | A pages | wall (s) |");
    println!("|---|---|---|---|---|");
    let b = Shop::start_named(50, 20, "B").await;
    let db = fresh_db(uri, "hol_alone").await;
    let seeds = seeds_of(&[&b.base]).await;
    let config = config_with(
        dir.path(),
        uri,
        db.name(),
        &seeds,
        &[&b.base],
        "",
        "fingerprint",
        "off",
    );
    let wall = run_once(&config).await;
    let alone = b.page_times().await;
    println!(
        "| B alone | {} | {:.1} | - | {:.1} |",
        alone.len(),
        rate(&alone),
        wall.as_secs_f64()
    );
    let _ = db.drop().await;

    let a = Shop::start_named(5, 20, "A").await;
    a.post("/__faults", json!([{"path": "/", "latency_ms": 1500}]))
        .await;
    let b = Shop::start_named(50, 20, "B").await;
    let db = fresh_db(uri, "hol_both").await;
    let seeds = seeds_of(&[&a.base, &b.base]).await;
    let config = config_with(
        dir.path(),
        uri,
        db.name(),
        &seeds,
        &[&a.base, &b.base],
        "",
        "fingerprint",
        "off",
    );
    let wall = run_once(&config).await;
    let with_a = b.page_times().await;
    let a_pages = a.page_times().await.len();
    println!(
        "| B with A (1.5 s per page) | {} | {:.1} | {a_pages} | {:.1} |",
        with_a.len(),
        rate(&with_a),
        wall.as_secs_f64()
    );
    println!();
    println!(
        "B's pages/s next to the slow host: {:.0}% of B alone.",
        100.0 * rate(&with_a) / rate(&alone)
    );
    let _ = db.drop().await;
}

/// One series' value from `/metrics` text.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn throttling(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Throttling: a host answering 429 above 6 requests in flight (1 instance)");
    println!();
    let shop = Shop::start(20, 20).await;
    shop.post(
        "/__faults",
        json!([{"path": "/", "latency_ms": 20, "status": 429, "max_in_flight": 6}]),
    )
    .await;
    let host = shop.base.trim_start_matches("http://").to_owned();
    let db = fresh_db(uri, "throttling").await;
    let listen = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let config = config_with(
        dir.path(),
        uri,
        db.name(),
        &format!("{}/seeds.txt", shop.base),
        &[&shop.base],
        "attempts = 10",
        "fingerprint",
        &listen,
    );
    let started = Instant::now();
    let mut child = seedlock(&config, "bench-0", &["run"]);
    let name = |metric: &str, extra: &str| format!("seedlock_{metric}{{host=\"{host}\"{extra}}}");
    let mut first_throttle: Option<(Duration, f64)> = None;
    let mut limits: Vec<f64> = Vec::new();
    let mut last: (f64, f64);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let Ok(response) = reqwest::get(format!("http://{listen}/metrics")).await else {
            continue;
        };
        let text = response.text().await.unwrap_or_default();
        let throttles = series(&text, &name("host_throttles_total", "")).unwrap_or(0.0);
        let requests = series(&text, &name("host_requests_total", ",kind=\"first\""))
            .unwrap_or(0.0)
            + series(&text, &name("host_requests_total", ",kind=\"retry\"")).unwrap_or(0.0);
        if throttles >= 1.0 && first_throttle.is_none() {
            first_throttle = Some((started.elapsed(), requests));
        }
        last = (throttles, requests);
        if first_throttle.is_some() {
            if let Some(l) = series(&text, &name("host_limit", "")) {
                limits.push(l);
            }
        }
        let pass_done = series(&text, "seedlock_crawl_passes_finished_total").unwrap_or(0.0);
        if pass_done >= 1.0 || started.elapsed() > Duration::from_secs(600) {
            break;
        }
    }
    let wall = started.elapsed();
    let _ = child.kill().await;
    let (throttles, requests) = last;
    let (converged, at_requests) = first_throttle.unwrap_or((wall, requests));
    let after = (requests - at_requests).max(1.0);
    let min = limits.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = limits.iter().cloned().fold(0.0, f64::max);
    println!("| first throttle after (s) | limit after it (min–max) | requests after it | 429s after it | 429 share | wall (s) |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {:.2} | {min:.2}–{max:.2} | {after:.0} | {:.0} | {:.1}% | {:.1} |",
        converged.as_secs_f64(),
        (throttles - 1.0).max(0.0),
        100.0 * (throttles - 1.0).max(0.0) / after,
        wall.as_secs_f64()
    );
    let truth = shop.truth().await;
    let (_, _, correct) = judge_records(&db, &truth).await;
    println!();
    println!("Records correct: {correct}/{}.", truth.len());
    let _ = db.drop().await;
}

/// A ready bot whose running pass 1 holds `urls` pending detail pages (they answer 404: cheap to
/// crawl), its seeds fresh for the configured hour.
async fn fill_frontier(db: &Database, base: &str, urls: u32) {
    let host = base.trim_start_matches("http://");
    let now = bson::DateTime::now();
    // The indexes exist before the frontier grows, as they do in a deployment.
    seedlock::store::Store::new(db.clone())
        .frontier()
        .ensure_indexes()
        .await
        .unwrap();
    db.collection::<Document>("bots")
        .insert_one(doc! {
            "_id": "shop", "isReady": true, "isEditing": false,
            "seeds": [format!("{base}/list/1")], "lockEpoch": 1_i64,
            "lastSeedUpdatedAt": now, "crawlPass": 1_i64, "crawlPassStartedAt": now,
            "crawlPassEndedAt": bson::Bson::Null, "history": [],
        })
        .await
        .unwrap();
    let frontier = db.collection::<Document>("frontier");
    let mut batch = Vec::with_capacity(10_000);
    for i in 0..urls {
        let url = format!("{base}/product/X-{i:08}");
        batch.push(doc! {
            "_id": format!("shop {url}"), "botId": "shop", "url": url, "kind": "detail",
            "pass": 1_i64, "status": "pending", "attempts": 0_i64, "enqueuedAt": now,
            "notBefore": now, "slot": rand::rng().random_range(0..1024_i64), "host": host,
            "priority": 0_i64,
        });
        if batch.len() == 10_000 {
            frontier
                .insert_many(std::mem::take(&mut batch))
                .await
                .unwrap();
        }
    }
    if !batch.is_empty() {
        frontier.insert_many(batch).await.unwrap();
    }
}

async fn memory(uri: &str, urls: u32) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Memory: peak RSS crawling a large frontier for 60 s (1 instance)");
    println!();
    println!("| frontier entries | insert (s) | pages crawled in 60 s | peak RSS (MiB) |");
    println!("|---|---|---|---|");
    for size in [10_000, urls] {
        let shop = Shop::start(1, 10).await;
        let db = fresh_db(uri, "memory").await;
        let started = Instant::now();
        fill_frontier(&db, &shop.base, size).await;
        let insert = started.elapsed();
        let config = config(
            dir.path(),
            uri,
            db.name(),
            &shop.base,
            &Run {
                crawl: "",
                mode: "fingerprint",
            },
        );
        let mut child = seedlock(&config, "bench-0", &["run"]);
        let watch = async {
            let (_, peak) = wait_with_rss(&mut child).await;
            peak
        };
        let peak = tokio::select! {
            peak = watch => peak,
            _ = tokio::time::sleep(Duration::from_secs(60)) => 0,
        };
        // The watcher was cut short: read the high-water mark once more, then stop it.
        let pid = child.id().unwrap_or(0);
        let hwm = vm_hwm(pid).unwrap_or(peak);
        let _ = child.kill().await;
        let crawled = shop.stats().await.values().sum::<u64>();
        println!(
            "| {size} | {:.1} | {crawled} | {:.1} |",
            insert.as_secs_f64(),
            hwm.max(peak) as f64 / 1024.0
        );
        let _ = db.drop().await;
    }
}

// ---- deletion ---------------------------------------------------------------------------------

async fn deletion(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    let shop = Shop::start(25, 20).await;
    let db = fresh_db(uri, "deletion").await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "").await;
    let report = shop.post("/__mutate", json!({"delete": 50})).await;
    let removed = || async {
        docs(&db, "records", doc! { "removedAt": { "$type": "date" } })
            .await
            .into_iter()
            .map(|r| r.get_str("naturalKey").unwrap().to_owned())
            .collect::<HashSet<String>>()
    };
    // An incomplete pass: two listing pages of 25 fail (coverage 92% < 95%).
    shop.post(
        "/__faults",
        json!([{"path": "/list/7", "status": 500}, {"path": "/list/8", "status": 500}]),
    )
    .await;
    request_refresh(&db).await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "").await;
    let after_incomplete = removed().await.len();
    reqwest::Client::new()
        .delete(format!("{}/__faults", shop.base))
        .send()
        .await
        .unwrap();
    request_refresh(&db).await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "").await;
    let after_complete = removed().await;
    let deleted: HashSet<String> = report["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    println!("## Deletion detection: 500 products, 50 deleted");
    println!();
    println!("| pass | removedAt set | exactly the deleted |");
    println!("|---|---|---|");
    println!("| incomplete (2 of 25 listing pages fail) | {after_incomplete} | - |");
    println!(
        "| complete | {} | {} |",
        after_complete.len(),
        after_complete == deleted
    );
    let _ = db.drop().await;
    if after_incomplete != 0 || after_complete != deleted {
        std::process::exit(1);
    }
}

/// Record `i` of the export benchmark, as stored.
fn export_record(i: u32, at: bson::DateTime) -> Document {
    doc! {
        "_id": format!("r{i:08}"), "botId": "shop", "naturalKey": format!("SKU-{i:08}"),
        "url": format!("http://127.0.0.1:9/product/SKU-{i:08}"),
        "data": {"title": format!("Item, \"{i}\""), "price": format!("${}.{:02}", i % 1000, i % 100), "status": "in stock"},
        "contentHash": format!("{:032x}", u128::from(i) * 7919),
        "firstSeen": at, "lastChanged": at, "fetchedAt": at, "fetchedPass": 1_i64,
        "removedAt": null,
    }
}

async fn export(uri: &str, records: u32) {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    println!("## Export: `seedlock export` streaming a bot's records (1 process)");
    println!();
    println!("| records | format | insert (s) | export wall (s) | records/s | lines checked | peak RSS (MiB) |");
    println!("|---|---|---|---|---|---|---|");
    for size in [10_000, records] {
        let db = fresh_db(uri, "export").await;
        let at = bson::DateTime::from_millis(1_764_547_200_000);
        let started = Instant::now();
        let store = seedlock::store::Store::new(db.clone());
        store.records().ensure_indexes().await.unwrap();
        let mut i = 0;
        while i < size {
            let batch: Vec<Document> = (i..(i + 10_000).min(size))
                .map(|n| export_record(n, at))
                .collect();
            i += batch.len() as u32;
            db.collection::<Document>("records")
                .insert_many(batch)
                .await
                .unwrap();
        }
        let insert = started.elapsed();
        let bots = dir.path().join("bots.toml");
        std::fs::write(
            &bots,
            format!(
                "[[bots]]\nid = \"shop\"\nseeds = {{ url = \"http://127.0.0.1:9/seeds.txt\" }}\n{}",
                seedlock::demo_site::crawl_rules_toml(&["127.0.0.1:9"], ".sku")
            ),
        )
        .unwrap();
        let config = dir.path().join("export.toml");
        std::fs::write(
            &config,
            format!(
                "[mongo]\nuri = \"{uri}\"\ndatabase = \"{}\"\n[http]\nlisten = \"off\"\n",
                db.name()
            ),
        )
        .unwrap();
        let mut apply = seedlock(
            &config,
            "bench-apply",
            &["bots", "apply", bots.to_str().unwrap()],
        );
        assert!(apply.wait().await.unwrap().success(), "bots apply failed");
        for format in ["jsonl", "csv"] {
            let bin = std::env::var("SEEDLOCK_BIN").expect("SEEDLOCK_BIN");
            let started = Instant::now();
            let mut child = Command::new(bin)
                .arg("-c")
                .arg(&config)
                .args(["export", "shop", "--format", format])
                .env_remove("MONGODB_URI")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let stdout = child.stdout.take().unwrap();
            let pid = child.id().unwrap_or(0);
            let check = async move {
                let mut lines = tokio::io::BufReader::with_capacity(1 << 20, stdout).lines();
                let mut n: u32 = 0;
                if format == "csv" {
                    let header = lines.next_line().await.unwrap().unwrap();
                    assert_eq!(
                        header,
                        "naturalKey,url,price,status,title,firstSeen,lastChanged,removedAt"
                    );
                }
                while let Some(line) = lines.next_line().await.unwrap() {
                    let want = export_record(n, at);
                    if format == "jsonl" {
                        let got: serde_json::Value = serde_json::from_str(&line).unwrap();
                        assert_eq!(
                            got,
                            seedlock::ops::admin::to_json(&bson::Bson::Document(want)),
                            "line {n}"
                        );
                    } else {
                        let fields =
                            vec!["price".to_owned(), "status".to_owned(), "title".to_owned()];
                        assert_eq!(
                            line,
                            seedlock::ops::export::csv_row(&want, &fields),
                            "line {n}"
                        );
                    }
                    n += 1;
                }
                n
            };
            let rss = move |peak: std::sync::Arc<std::sync::atomic::AtomicU64>| async move {
                loop {
                    if let Some(kb) = vm_hwm(pid) {
                        peak.fetch_max(kb, std::sync::atomic::Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            // Sampled until its output ends (the process exits right after).
            let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let sampler = {
                let peak = peak.clone();
                tokio::spawn(async move {
                    let _: () = rss(peak).await;
                })
            };
            let checked = check.await;
            sampler.abort();
            let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
            let status = child.wait().await.unwrap();
            assert!(status.success(), "export failed");
            let wall = started.elapsed();
            assert_eq!(checked, size, "every record exported once");
            println!(
                "| {size} | {format} | {:.1} | {:.1} | {:.0} | {checked} | {:.1} |",
                insert.as_secs_f64(),
                wall.as_secs_f64(),
                f64::from(size) / wall.as_secs_f64(),
                peak as f64 / 1024.0
            );
        }
        db.drop().await.unwrap();
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("naive-worker") {
        naive_worker(&args[1], &args[2], &args[3]).await;
        return;
    }
    let uri = std::env::var("MONGODB_URI").expect("MONGODB_URI");
    let number = |i: usize, default: u32| {
        args.get(i)
            .and_then(|a| a.parse::<u32>().ok())
            .unwrap_or(default)
    };
    match args.first().map(String::as_str) {
        Some("kill") => kill(&uri, number(1, 3) as usize).await,
        Some("network") => network(&uri, number(1, 3) as usize).await,
        Some("kill-new-ids") => kill_new_ids(&uri, number(1, 3) as usize).await,
        Some("throughput") => throughput(&uri).await,
        Some("chain") => chain::chain(&uri, number(1, 3) as usize).await,
        Some("json") => json_vs_html(&uri, number(1, 3) as usize).await,
        Some("ceilings") => ceilings(&uri).await,
        Some("indexes") => indexes(&uri).await,
        Some("incremental") => {
            let items = number(1, 200_000);
            // Default changes: 500 changed + 200 added at 200,000 items (seed 003's figures),
            // scaled to the catalogue, none deleted.
            let scale = |n: u32| (u64::from(n) * u64::from(items) / 200_000).max(1) as u32;
            incremental(
                &uri,
                items,
                number(2, scale(500)),
                number(3, scale(200)),
                number(4, 0),
            )
            .await
        }
        Some("sitemaps") => {
            let items = number(1, 1_000_000);
            // 0.35% of the lastmods moved by default (seed 003's share).
            let change = number(2, (u64::from(items) * 35 / 10_000).max(1) as u32);
            sitemaps(&uri, items, change).await
        }
        Some("deletion") => deletion(&uri).await,
        Some("head-of-line") => head_of_line(&uri).await,
        Some("throttling") => throttling(&uri).await,
        Some("memory") => memory(&uri, number(1, 1_000_000)).await,
        Some("export") => export(&uri, number(1, 1_000_000)).await,
        _ => {
            eprintln!(
                "usage: crawl_bench kill [RUNS] | kill-new-ids [RUNS] | network [RUNS] | throughput | chain [RUNS] | json [RUNS] | ceilings | indexes | incremental [ITEMS [CHANGED ADDED DELETED]] | sitemaps [ITEMS [CHANGED]] | deletion | head-of-line | throttling | memory [URLS] | export [RECORDS]"
            );
            std::process::exit(2);
        }
    }
}
