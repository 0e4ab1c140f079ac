//! The fleet benchmark (run it with `scripts/bench/fleet [BOTS]`): BOTS trivial bots (default
//! 1,000), each with a seed source of its own that answers at once, applied with `bots apply` to
//! three running instances whose config files define no bots.
//!
//! 1. **Ready**, with ttl 3 s / heartbeat 1 s and with the defaults (ttl 30 s / heartbeat 10 s):
//!    the time from `bots apply` returning to every bot ready, requests per bot at its source
//!    (exactly one each), locks lost and operation timeouts in the logs, each instance's peak RSS.
//! 2. **Idle** (every bot ready, nothing due), right after: each instance's CPU share of one core
//!    and its database round trips per second over 30 s (from `/metrics`).
//! 3. **Views**: `/` and `/status.json` of one instance (bytes, time to answer), `seedlock status`
//!    as a process.
//! 4. **Kill** (KILL_BOTS bots, default BOTS): `refresh.concurrency` = KILL_BOTS, ttl 3 s /
//!    heartbeat 1 s; every bot asked to refresh while the seed sources hold their answers; the
//!    instance holding the most locks is SIGKILLed, the sources released: each of its bots taken
//!    over (time from the kill), each refreshed exactly once more, no other bot taken over or
//!    refreshed twice.
//!
//! Needs `MONGODB_URI` and `SEEDLOCK_BIN` (the release binary). Prints Markdown.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use futures_util::TryStreamExt;
use nix::sys::signal::Signal;

#[path = "../tests/suite/kit/mod.rs"]
mod kit;

use kit::{eventually, test_db_at, url_bot, Proc, ProcConfig, SeedSourceServer, TestDb};

const INSTANCES: [&str; 3] = ["fleet-a", "fleet-b", "fleet-c"];

/// A config with no bots: poll 1 s, the given ttl and heartbeat, and `refresh_concurrency` when
/// given.
fn config(
    db: &TestDb,
    dir: &Path,
    ttl: &str,
    heartbeat: &str,
    refresh_concurrency: Option<usize>,
) -> std::path::PathBuf {
    let mut c = ProcConfig::new(db, String::new());
    c.ttl = ttl;
    c.poll = "1s";
    c.max_refresh = "60s";
    let path = c.write(dir);
    // ProcConfig writes the [lock] and [refresh] tables; the keys it has no field for go in them.
    let mut text = std::fs::read_to_string(&path).unwrap();
    text = text.replacen(
        "[lock]\n",
        &format!("[lock]\nheartbeat = \"{heartbeat}\"\n"),
        1,
    );
    if let Some(n) = refresh_concurrency {
        text = text.replacen("[refresh]\n", &format!("[refresh]\nconcurrency = {n}\n"), 1);
    }
    std::fs::write(&path, text).unwrap();
    path
}

fn start(dir: &Path, config: &Path) -> Vec<Proc> {
    INSTANCES
        .iter()
        .map(|name| {
            Proc::spawn(
                dir,
                config,
                name,
                &["run"],
                &[
                    ("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0"),
                    ("SEEDLOCK_LOG", "info"),
                ],
            )
        })
        .collect()
}

async fn apply(dir: &Path, config: &Path, file: &Path) -> Duration {
    let t0 = Instant::now();
    let mut p = Proc::spawn(
        dir,
        config,
        "apply",
        &["bots", "apply", file.to_str().unwrap()],
        &[("SEEDLOCK_LOG", "warn")],
    );
    let status = p.wait(Duration::from_secs(600)).await;
    assert!(status.success(), "bots apply failed: {}", p.log());
    t0.elapsed()
}

async fn count(db: &TestDb, filter: Document) -> u64 {
    db.bots().count_documents(filter).await.unwrap()
}

fn vm_hwm_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // After the command name: state is field 0; utime 11, stime 12.
    field(11) + field(12)
}

async fn metrics_sum(addr: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn log_count(procs: &[Proc], needle: &str) -> usize {
    procs.iter().map(|p| p.log().matches(needle).count()).sum()
}

struct Ready {
    apply: Duration,
    ready: Duration,
    exactly_once: usize,
    lost: usize,
    timeouts: usize,
    rss_mib: Vec<f64>,
}

async fn ready_run(
    uri: &str,
    bots: usize,
    ttl: &str,
    heartbeat: &str,
    idle: bool,
) -> (Ready, Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let db = test_db_at(uri, "fleetbench").await;
    let source = SeedSourceServer::start().await;
    let config = config(&db, dir.path(), ttl, heartbeat, None);
    let mut procs = start(dir.path(), &config);
    let mut addrs = Vec::new();
    for p in &procs {
        addrs.push(p.http_addr().await);
    }
    let names: Vec<String> = (0..bots).map(|i| format!("bot{i:04}")).collect();
    let file = dir.path().join("bots.toml");
    std::fs::write(
        &file,
        names
            .iter()
            .map(|b| url_bot(b, &source.bot_url(b)))
            .collect::<String>(),
    )
    .unwrap();
    let apply = apply(dir.path(), &config, &file).await;
    let t0 = Instant::now();
    eventually("every bot ready", Duration::from_secs(600), || async {
        count(&db, doc! { "isReady": true, "isEditing": false }).await == bots as u64
    })
    .await;
    let ready = t0.elapsed();
    let hits = source.bot_hits();
    let exactly_once = names
        .iter()
        .filter(|b| hits.get(*b).copied() == Some(1))
        .count();
    let lost = log_count(&procs, "edit lock lost");
    let timeouts = log_count(&procs, "did not finish within");
    let rss_mib = procs
        .iter()
        .map(|p| vm_hwm_kib(p.pid().as_raw()) as f64 / 1024.0)
        .collect();
    let mut extra = None;
    if idle {
        extra = Some(idle_and_views(&procs, &addrs, &config, dir.path()).await);
    }
    for p in &procs {
        p.signal(Signal::SIGTERM);
    }
    for p in &mut procs {
        p.wait(Duration::from_secs(60)).await;
    }
    let _ = db.db.drop().await;
    (
        Ready {
            apply,
            ready,
            exactly_once,
            lost,
            timeouts,
            rss_mib,
        },
        extra,
    )
}

/// Idle CPU and round trips, then the views, as Markdown.
async fn idle_and_views(procs: &[Proc], addrs: &[String], config: &Path, dir: &Path) -> String {
    // Let the last refreshes' wake-ups settle.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let window = Duration::from_secs(30);
    let ticks: Vec<u64> = procs.iter().map(|p| cpu_ticks(p.pid().as_raw())).collect();
    let mut commands = Vec::new();
    for a in addrs {
        commands.push(metrics_sum(a, "seedlock_db_commands_total").await);
    }
    tokio::time::sleep(window).await;
    let hz = 100.0; // USER_HZ on Linux
    let mut out =
        String::from("| instance | CPU (% of one core) | round trips/s |\n|---|---|---|\n");
    for (i, p) in procs.iter().enumerate() {
        let cpu = (cpu_ticks(p.pid().as_raw()) - ticks[i]) as f64 / hz / window.as_secs_f64();
        let after = metrics_sum(&addrs[i], "seedlock_db_commands_total").await;
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} |\n",
            p.name,
            cpu * 100.0,
            (after - commands[i]) / window.as_secs_f64()
        ));
    }
    out.push('\n');
    // The views of one instance, for the whole fleet.
    let client = reqwest::Client::new();
    let mut views = Vec::new();
    for path in ["/", "/status.json"] {
        // The first read is fresh from the database; the views share one read for 2 s.
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let t0 = Instant::now();
        let body = client
            .get(format!("http://{}{path}", addrs[0]))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        views.push(format!(
            "`{path}` {} KB in {} ms",
            body.len() / 1000,
            t0.elapsed().as_millis()
        ));
    }
    let t0 = Instant::now();
    let mut status = Proc::spawn(
        dir,
        config,
        "status",
        &["status"],
        &[("SEEDLOCK_LOG", "warn")],
    );
    status.wait(Duration::from_secs(60)).await;
    let last = status.out().lines().last().unwrap_or("").to_owned();
    views.push(format!(
        "`seedlock status` {} ms as a process (its last line: \"{last}\")",
        t0.elapsed().as_millis()
    ));
    out.push_str(&format!("Views: {}.\n", views.join("; ")));
    // The metrics' cardinality at this size.
    let text = reqwest::get(format!("http://{}/metrics", addrs[0]))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let per_bot = series.iter().filter(|l| l.contains("bot=\"")).count();
    out.push_str(&format!(
        "\n`/metrics` of one instance: {} series, {per_bot} of them with a `bot` label ({} KB).\n",
        series.len(),
        text.len() / 1000
    ));
    out
}

/// The kill run: how the fleet heals when the instance holding the most locks dies mid-refresh.
async fn kill_run(uri: &str, bots: usize) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let db = test_db_at(uri, "fleetkill").await;
    let source = SeedSourceServer::start().await;
    let config = config(&db, dir.path(), "3s", "1s", Some(bots));
    let mut procs = start(dir.path(), &config);
    for p in &procs {
        p.http_addr().await;
    }
    let names: Vec<String> = (0..bots).map(|i| format!("bot{i:04}")).collect();
    let file = dir.path().join("bots.toml");
    std::fs::write(
        &file,
        names
            .iter()
            .map(|b| url_bot(b, &source.bot_url(b)))
            .collect::<String>(),
    )
    .unwrap();
    apply(dir.path(), &config, &file).await;
    eventually("every bot ready", Duration::from_secs(600), || async {
        count(&db, doc! { "isReady": true, "isEditing": false }).await == bots as u64
    })
    .await;
    let before = source.bot_hits();
    // Every bot asked to refresh while the sources hold their answers: the locks stay held.
    source.hold_bot_sources(true);
    db.bots()
        .update_many(
            doc! {},
            doc! { "$currentDate": { "refreshRequestedAt": true } },
        )
        .await
        .unwrap();
    eventually(
        "every bot locked, mid-refresh",
        Duration::from_secs(120),
        || async { count(&db, doc! { "isEditing": true }).await == bots as u64 },
    )
    .await;
    let mut held: HashMap<String, Vec<String>> = HashMap::new();
    let mut cursor = db
        .bots()
        .find(doc! { "isEditing": true })
        .projection(doc! { "editingBy": 1 })
        .await
        .unwrap();
    while let Some(d) = cursor.try_next().await.unwrap() {
        held.entry(d.get_str("editingBy").unwrap_or("?").to_owned())
            .or_default()
            .push(d.get_str("_id").unwrap().to_owned());
    }
    let (victim, victim_bots) = held
        .iter()
        .max_by_key(|(_, b)| b.len())
        .map(|(v, b)| (v.clone(), b.clone()))
        .unwrap();
    let spread: Vec<String> = INSTANCES
        .iter()
        .map(|i| format!("{i} {}", held.get(*i).map_or(0, Vec::len)))
        .collect();
    let killed = procs.iter().position(|p| p.name == victim).unwrap();
    let kill_at = chrono::Utc::now();
    procs[killed].kill9().await;
    source.hold_bot_sources(false);
    eventually(
        "every bot ready again",
        Duration::from_secs(600),
        || async { count(&db, doc! { "isReady": true, "isEditing": false }).await == bots as u64 },
    )
    .await;
    // Takeover times from the history, and the requests of this phase.
    let after = source.bot_hits();
    let mut takeovers: Vec<f64> = Vec::new();
    let mut disturbed = 0;
    let mut cursor = db.bots().find(doc! {}).await.unwrap();
    let victims: std::collections::HashSet<&String> = victim_bots.iter().collect();
    while let Some(d) = cursor.try_next().await.unwrap() {
        let id = d.get_str("_id").unwrap().to_owned();
        let took_over = d
            .get_array("history")
            .unwrap()
            .iter()
            .filter_map(|h| h.as_document())
            .filter(|h| h.get_str("event") == Ok("took_over"))
            .filter_map(|h| h.get_datetime("at").ok())
            .map(|at| at.to_chrono())
            .find(|at| *at > kill_at);
        if victims.contains(&id) {
            if let Some(at) = took_over {
                takeovers.push((at - kill_at).num_milliseconds() as f64 / 1000.0);
            }
        } else if took_over.is_some() {
            disturbed += 1;
        }
    }
    // The victim's bots: its own stalled request, then exactly one by the taker; the others one.
    let phase =
        |b: &String| after.get(b).copied().unwrap_or(0) - before.get(b).copied().unwrap_or(0);
    let victims_once_more = victim_bots.iter().filter(|b| phase(b) == 2).count();
    let others_once = names
        .iter()
        .filter(|b| !victims.contains(b))
        .filter(|b| phase(b) == 1)
        .count();
    takeovers.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = takeovers
        .get(takeovers.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    let max = takeovers.last().copied().unwrap_or(f64::NAN);
    let others = bots - victim_bots.len();
    let ok = takeovers.len() == victim_bots.len()
        && victims_once_more == victim_bots.len()
        && others_once == others
        && disturbed == 0;
    let text = format!(
        "Kill run, {bots} bots (`refresh.concurrency` {bots}). Locks held when {victim} was SIGKILLed: {}. Its {} bots taken over: {}/{} (median {median:.2} s, max {max:.2} s after the kill; ttl 3 s + poll 1 s = 4 s); refreshed exactly once more: {victims_once_more}/{}; the other {others} bots: {others_once} refreshed exactly once, {disturbed} taken over.\n",
        spread.join(", "),
        victim_bots.len(),
        takeovers.len(),
        victim_bots.len(),
        victim_bots.len(),
    );
    for (i, p) in procs.iter_mut().enumerate() {
        if i != killed {
            p.signal(Signal::SIGTERM);
            p.wait(Duration::from_secs(60)).await;
        }
    }
    let _ = db.db.drop().await;
    (ok, text)
}

#[tokio::main]
async fn main() {
    let uri = std::env::var("MONGODB_URI").expect("MONGODB_URI");
    let arg = |i: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse::<usize>().ok())
    };
    let bots = arg(1).unwrap_or(1000);
    // The kill run holds every bot's lock at once (`refresh.concurrency` = its bots); a smaller
    // fleet for it keeps the run short at 10,000 bots.
    let kill_bots = arg(2).unwrap_or(bots).min(bots);
    println!("## A fleet of {bots} bots on 3 instances");
    println!();
    println!("| lock ttl / heartbeat | `bots apply` (s) | every bot ready after it (s) | exactly one request | locks lost | timeouts | peak RSS per instance (MiB) |");
    println!("|---|---|---|---|---|---|---|");
    let mut ok = true;
    let mut idle = None;
    for (ttl, heartbeat, label) in [
        ("3s", "1s", "3 s / 1 s"),
        ("30s", "10s", "30 s / 10 s (defaults)"),
    ] {
        let (r, extra) = ready_run(&uri, bots, ttl, heartbeat, idle.is_none()).await;
        ok &= r.exactly_once == bots && r.lost == 0 && r.timeouts == 0;
        println!(
            "| {label} | {:.2} | {:.2} | {}/{bots} | {} | {} | {} |",
            r.apply.as_secs_f64(),
            r.ready.as_secs_f64(),
            r.exactly_once,
            r.lost,
            r.timeouts,
            r.rss_mib
                .iter()
                .map(|m| format!("{m:.1}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        if extra.is_some() {
            idle = extra;
        }
    }
    println!();
    println!("Idle, every bot ready and nothing due (ttl 3 s / heartbeat 1 s), over 30 s:");
    println!();
    print!("{}", idle.unwrap_or_default());
    println!();
    let (kill_ok, text) = kill_run(&uri, kill_bots).await;
    print!("{text}");
    if !(ok && kill_ok) {
        eprintln!("fleet: a target count was not exact");
        std::process::exit(1);
    }
}
