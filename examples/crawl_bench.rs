//! Crawl benchmarks against the demo shop and a real server (run them with `scripts/bench/kill-test`
//! and `scripts/bench/crawl`). Needs `MONGODB_URI` and `SEEDLOCK_BIN` (the release binary).
//!
//! - `kill [RUNS]`: seed 000's kill test — 25 listing pages, 500 products; SIGKILL the crawler at
//!   a random 0.2–1.0 s of its life, ten times, then let it finish. seedlock with 1 instance and
//!   with 3 (kills spread among them), each with one request in flight, next to the naive
//!   baseline (auto ids, no persisted frontier: every restart begins again at page 1).
//! - `throughput`: pages/s and records/s, 500 and 10,000 products, 1 and 3 instances, peak RSS.
//! - `incremental [ITEMS]`: a full pass of ITEMS products (100 per listing page), then 500
//!   changed and 200 added: detail requests and record writes of the second pass, wall time
//!   against the full pass; watermark mode: listing pages read for 200 new items.
//! - `deletion`: 50 products deleted: exactly 50 `removedAt` after a complete pass, none after
//!   an incomplete one.
//!
//! - `head-of-line`: host A answering after 2 s and host B fast, crawled together by one
//!   instance: B's pages/s against B crawled alone.
//! - `throttling`: a host answering 429 above 6 requests in flight: time to the first throttle,
//!   the limit's range after it, the 429 share after it.
//! - `memory [URLS]`: peak RSS of an instance crawling a frontier of URLS pending entries (default
//!   1,000,000) for 60 s, against one of 10,000.
//!
//! Prints Markdown tables.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bson::{doc, Document};
use futures_util::TryStreamExt;
use mongodb::{Client, Database};
use rand::Rng;
use seedlock::demo_site::{serve, SiteOptions};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

struct Shop {
    base: String,
    stop: CancellationToken,
}

impl Shop {
    async fn start(lists: u32, per_list: u32) -> Shop {
        Self::start_named(lists, per_list, "SKU").await
    }

    /// A shop whose SKUs start with `prefix` (shops on several ports sell different products).
    async fn start_named(lists: u32, per_list: u32, prefix: &str) -> Shop {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let options = SiteOptions {
            lists,
            per_list,
            seed: 5,
            sku_prefix: prefix.to_owned(),
        };
        tokio::spawn(serve(listener, options, stop.clone()));
        Shop { base, stop }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Requests per path since the last call.
    async fn stats(&self) -> BTreeMap<String, u64> {
        let v: Value = reqwest::get(format!("{}/__stats?reset=true", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["paths"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect()
    }

    /// Request arrival times (Unix ms) of the crawled pages (listing and product pages).
    async fn page_times(&self) -> Vec<i64> {
        let v: Value = reqwest::get(format!("{}/__stats?log=true", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["log"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| {
                let p = e[0].as_str().unwrap_or_default();
                p.starts_with("/list/") || p.starts_with("/product/")
            })
            .map(|e| e[1].as_i64().unwrap())
            .collect()
    }

    async fn truth(&self) -> HashMap<String, (String, String, String)> {
        let v: Value = reqwest::get(format!("{}/__truth", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["products"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let s = |k: &str| p[k].as_str().unwrap().to_owned();
                (s("sku"), (s("title"), s("price"), s("status")))
            })
            .collect()
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

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

/// The crawl settings a benchmark run varies.
struct Run<'a> {
    workers: u32,
    mode: &'a str,
    lease: &'a str,
    transactions: &'a str,
}

fn config(dir: &Path, uri: &str, database: &str, base: &str, run: &Run<'_>) -> PathBuf {
    let Run {
        workers,
        mode,
        lease,
        transactions,
    } = run;
    let crawl =
        format!("workers = {workers}\nlease = \"{lease}\"\ntransactions = \"{transactions}\"");
    config_with(
        dir,
        uri,
        database,
        &format!("{base}/seeds.txt"),
        &[base],
        &crawl,
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
    let scope: Vec<String> = bases
        .iter()
        .map(|b| format!("{:?}", b.trim_start_matches("http://")))
        .collect();
    let scope = scope.join(", ");
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
seeds = {{ url = "{seeds}", format = "lines" }}
refresh = "1h"
[bots.crawl]
scope = [{scope}]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = {{ title = "h1", price = ".price", status = ".status" }}
[bots.crawl.incremental]
mode = "{mode}"
"#
    );
    let path = dir.join(format!("{database}.toml"));
    std::fs::write(&path, text).unwrap();
    path
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

/// Waits for `child`, sampling its peak RSS (VmHWM) meanwhile; returns (success, peak KiB).
async fn wait_with_rss(child: &mut Child) -> (bool, u64) {
    let pid = child.id().unwrap_or(0);
    let mut peak = 0;
    loop {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if let Some(kb) = status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
            {
                peak = peak.max(kb);
            }
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
}

const KILLS: usize = 10;
/// Per-request latency of the shop in the kill test, so a crawl outlives ten kills.
const KILL_TEST_LATENCY_MS: u64 = 20;

async fn kill_seedlock(uri: &str, instances: usize, transactions: &str, dir: &Path) -> KillRun {
    let shop = Shop::start(25, 20).await;
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
            workers: 1,
            mode: "fingerprint",
            lease: "10s",
            transactions,
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
    let mut rng = rand::rng();
    while kills < KILLS {
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
        children[victim] = Some(seedlock(&config, &names[victim], &["run", "--once"]));
        born[victim] = Instant::now();
    }
    for child in children.iter_mut().flatten() {
        let status = child.wait().await.unwrap();
        assert!(status.success(), "an instance failed: {status}");
    }
    let wall = started.elapsed();
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
    }
}

async fn kill(uri: &str, runs: usize) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Kill test (seed 000): 25 listing pages, 500 products, {KILLS} SIGKILLs per run at a random 0.2–1.0 s of the victim's life");
    println!();
    println!("One request in flight per instance (`crawl.workers = 1`); the shop answers every request after {KILL_TEST_LATENCY_MS} ms so a crawl outlives ten kills. A full crawl is 525 page requests (+1 for `/seeds.txt` and 1 `/robots.txt` per seedlock process, which `repeated` leaves out).");
    println!();
    println!("| crawler | run | kills | rows | distinct | correct | requests | repeated | wall (s) | verdict |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    // BENCH_KILL_ONLY=1 or 3: only seedlock with that many instances (for investigating).
    let crawlers: &[(&str, usize, &str)] = match std::env::var("BENCH_KILL_ONLY").as_deref() {
        Ok("1") => &[("seedlock, 1 instance", 1, "auto")],
        Ok("3") => &[("seedlock, 3 instances", 3, "auto")],
        _ => &[
            ("naive (auto ids, no frontier)", 0, "-"),
            ("seedlock, 1 instance, transactions", 1, "auto"),
            ("seedlock, 3 instances, transactions", 3, "auto"),
            ("seedlock, 1 instance, `transactions = \"off\"`", 1, "off"),
            ("seedlock, 3 instances, `transactions = \"off\"`", 3, "off"),
        ],
    };
    for &(label, instances, transactions) in crawlers {
        for run in 1..=runs {
            let r = if instances == 0 {
                kill_naive(uri).await
            } else {
                kill_seedlock(uri, instances, transactions, dir.path()).await
            };
            let verdict = if instances == 0 {
                "baseline".to_owned()
            } else {
                // Each kill repeats at most the one page its victim had in flight.
                let ok = r.rows == 500
                    && r.distinct == 500
                    && r.correct == 500
                    && r.repeated <= r.kills as u64;
                if !ok {
                    failures += 1;
                }
                if ok {
                    "ok: 500 correct, repeated ≤ kills".into()
                } else {
                    "FAILED".into()
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
    }
    if failures > 0 {
        eprintln!("kill test: {failures} seedlock run(s) broke the guarantee");
        std::process::exit(1);
    }
}

// ---- throughput -------------------------------------------------------------------------------

async fn crawl_once(
    uri: &str,
    dir: &Path,
    shop: &Shop,
    db: &Database,
    instances: usize,
    mode: &str,
    transactions: &str,
) -> (Duration, u64) {
    let config = config(
        dir,
        uri,
        db.name(),
        &shop.base,
        &Run {
            workers: 16,
            mode,
            lease: "60s",
            transactions,
        },
    );
    let started = Instant::now();
    let mut children: Vec<Child> = (0..instances)
        .map(|i| {
            seedlock(
                &config,
                &format!("bench-{i}"),
                &["run", "--once", "--timeout", "3600s"],
            )
        })
        .collect();
    let mut peak = 0;
    for child in &mut children {
        let (ok, rss) = wait_with_rss(child).await;
        assert!(ok, "an instance failed");
        peak = peak.max(rss);
    }
    (started.elapsed(), peak)
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

async fn throughput(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    println!("## Throughput: one full pass (`run --once`, `crawl.workers = 16`, `writers = 4` per instance)");
    println!();
    println!("| products | instances | transactions | pages | wall (s) | pages/s | records/s | peak RSS per instance (MiB) | correct records |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let only: Option<Vec<usize>> = std::env::var("BENCH_ROWS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect());
    let runs: Vec<_> = [
        (25, 20, 1, "auto"),
        (25, 20, 3, "auto"),
        (25, 20, 1, "off"),
        (25, 20, 3, "off"),
        (100, 100, 1, "auto"),
        (100, 100, 3, "auto"),
        (100, 100, 1, "off"),
        (100, 100, 3, "off"),
    ]
    .into_iter()
    .enumerate()
    .filter(|(i, _)| only.as_ref().is_none_or(|o| o.contains(i)))
    .map(|(_, r)| r)
    .collect();
    {
        for (lists, per_list, instances, transactions) in runs {
            let shop = Shop::start(lists, per_list).await;
            let db = fresh_db(uri, "throughput").await;
            let (wall, peak) = crawl_once(
                uri,
                dir.path(),
                &shop,
                &db,
                instances,
                "fingerprint",
                transactions,
            )
            .await;
            let stats = shop.stats().await;
            let pages = under(&stats, "/list/") + under(&stats, "/product/");
            let truth = shop.truth().await;
            let (rows, _, correct) = judge_records(&db, &truth).await;
            println!(
                "| {} | {instances} | {transactions} | {pages} | {:.2} | {:.0} | {:.0} | {:.1} | {correct}/{} |",
                lists * per_list,
                wall.as_secs_f64(),
                pages as f64 / wall.as_secs_f64(),
                rows as f64 / wall.as_secs_f64(),
                peak as f64 / 1024.0,
                truth.len()
            );
            let _ = db.drop().await;
        }
    }
}

// ---- incremental ------------------------------------------------------------------------------

async fn records_written_since(db: &Database, since: bson::DateTime) -> usize {
    docs(db, "records", doc! { "lastChanged": { "$gte": since } })
        .await
        .len()
}

/// Frontier entries of `kinds` that are done: the pages a finished pass fetched.
async fn frontier_done(db: &Database, kinds: &[&str]) -> u64 {
    db.collection::<Document>("frontier")
        .count_documents(doc! { "status": "done", "kind": { "$in": kinds } })
        .await
        .unwrap()
}

async fn incremental(uri: &str, items: u32) {
    let dir = tempfile::tempdir().unwrap();
    let lists = items.div_ceil(100);
    println!("## Incremental passes (seed 003): {items} products, 100 per listing page");
    println!();
    let shop = Shop::start(lists, 100).await;
    let db = fresh_db(uri, "incremental").await;
    let (full, full_rss) = crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "auto").await;
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
    shop.post("/__mutate", json!({"change": 500, "add": 200}))
        .await;
    let before = bson::DateTime::now();
    request_refresh(&db).await;
    let (second, second_rss) =
        crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "auto").await;
    let stats = shop.stats().await;
    let details = under(&stats, "/product/");
    let writes = records_written_since(&db, before).await;
    let truth = shop.truth().await;
    let (_, _, correct) = judge_records(&db, &truth).await;
    println!(
        "| pass | listing pages | detail requests | record writes | wall (s) | peak RSS (MiB) |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| full | {full_lists} | {full_details} | {full_writes} | {:.1} | {:.1} |",
        full.as_secs_f64(),
        full_rss as f64 / 1024.0
    );
    println!(
        "| after 500 changed + 200 added (fingerprint) | {} | {details} | {writes} | {:.1} | {:.1} |",
        under(&stats, "/list/"),
        second.as_secs_f64(),
        second_rss as f64 / 1024.0
    );
    println!();
    println!(
        "Second pass: {details} detail requests and {writes} record writes (expected 700 and 700); wall {:.1}% of the full pass; records correct: {correct}/{}.",
        100.0 * second.as_secs_f64() / full.as_secs_f64(),
        truth.len()
    );
    let ok = details == 700 && writes == 700 && correct == truth.len();
    let _ = db.drop().await;

    // Watermark mode on an append-only catalogue: 200 new items.
    let shop = Shop::start(lists.min(50), 100).await;
    let db = fresh_db(uri, "watermark").await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "watermark", "auto").await;
    shop.stats().await;
    shop.post("/__mutate", json!({"add": 200})).await;
    request_refresh(&db).await;
    let (wall, _) = crawl_once(uri, dir.path(), &shop, &db, 1, "watermark", "auto").await;
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

// ---- flow control -----------------------------------------------------------------------------

/// A seed source naming each shop's first listing page.
async fn seed_source(bases: &[&str]) -> String {
    let body: String = bases.iter().map(|b| format!("{b}/list/1\n")).collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/seeds.txt", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/seeds.txt",
        axum::routing::get(move || {
            let body = body.clone();
            async move { body }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

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
    println!("## Head-of-line: a slow host next to a fast one (1 instance, default `[crawl]`)");
    println!();
    println!("| run | B pages | B pages/s | A pages | wall (s) |");
    println!("|---|---|---|---|---|");
    let b = Shop::start_named(20, 20, "B").await;
    let db = fresh_db(uri, "hol_alone").await;
    let seeds = seed_source(&[&b.base]).await;
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
    a.post("/__faults", json!([{"path": "/", "latency_ms": 2000}]))
        .await;
    let b = Shop::start_named(20, 20, "B").await;
    let db = fresh_db(uri, "hol_both").await;
    let seeds = seed_source(&[&a.base, &b.base]).await;
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
        "| B with A (2 s per page) | {} | {:.1} | {a_pages} | {:.1} |",
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
        .ensure_frontier_indexes()
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
                workers: 16,
                mode: "fingerprint",
                lease: "60s",
                transactions: "auto",
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
        let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .unwrap_or(peak);
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
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "auto").await;
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
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "auto").await;
    let after_incomplete = removed().await.len();
    reqwest::Client::new()
        .delete(format!("{}/__faults", shop.base))
        .send()
        .await
        .unwrap();
    request_refresh(&db).await;
    crawl_once(uri, dir.path(), &shop, &db, 1, "fingerprint", "auto").await;
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
        Some("throughput") => throughput(&uri).await,
        Some("incremental") => incremental(&uri, number(1, 200_000)).await,
        Some("deletion") => deletion(&uri).await,
        Some("head-of-line") => head_of_line(&uri).await,
        Some("throttling") => throttling(&uri).await,
        Some("memory") => memory(&uri, number(1, 1_000_000)).await,
        _ => {
            eprintln!(
                "usage: crawl_bench kill [RUNS] | throughput | incremental [ITEMS] | deletion | head-of-line | throttling | memory [URLS]"
            );
            std::process::exit(2);
        }
    }
}
