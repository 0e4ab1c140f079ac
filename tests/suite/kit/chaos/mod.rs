//! The chaos harness (Jepsen-style): real `seedlock` processes, two demo shops, seed sources that
//! change between refreshes and a restartable database; faults injected at random from a seed
//! (SIGKILL + restart, SIGSTOP of a lock holder past its ttl, a network partition of one
//! instance from the database past its ttl, a database restart, an admin unlock mid-refresh, a
//! seed source failing for a while); the history recorded; the invariants checked
//! afterwards. Shared by `scripts/chaos` (examples/chaos.rs, full size) and the suite
//! (tests/suite/chaos.rs, small), as part of the test kit.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use futures_util::TryStreamExt;
use mongodb::Client;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::process::{Child, Command};

mod checks;
mod plan;
mod processes;
mod sources;

pub use checks::check_history;
use checks::*;
use plan::*;
use processes::*;
use sources::*;

/// The two crawling bots (one shop each) and the seeds-only bot.
const CRAWLING: [&str; 2] = ["shop-a", "shop-b"];
const SEEDS_ONLY: &str = "catalog";
const BOTS: [&str; 3] = ["shop-a", "shop-b", "catalog"];

#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// Every random choice (which fault, when, which victim) comes from this.
    pub seed: u64,
    pub instances: usize,
    /// Products per shop (two shops, one host each).
    pub products_per_shop: u32,
    pub per_list: u32,
    /// How long faults are injected; then the run settles and is checked.
    pub chaos_for: Duration,
    /// The settling phase's bound (every bot ready, a final pass completed).
    pub settle_for: Duration,
    pub seedlock_bin: PathBuf,
    /// The test server's binary: the harness runs its own (restartable) server. Without it,
    /// `uri` is used and the database restart is skipped (said in the report).
    pub server_bin: Option<PathBuf>,
    pub uri: Option<String>,
    /// Logs and the server's storage go here.
    pub dir: PathBuf,
    /// `crawl.transactions` of the instances: "off" by default (see `scripts/chaos`), "auto"
    /// or "on" to put the transaction path under the same faults.
    pub transactions: String,
}

/// One instance's pipeline sizes, and the ceiling of its commit window: a kill can lose at most
/// `IN_FLIGHT_CAP` fetched, uncommitted pages per crawling bot.
const WORKERS: u32 = 3;
const PARSE_QUEUE: u32 = 1;
const PARSERS: u32 = 1;
const STORE_QUEUE: u32 = 1;
const WRITERS: u32 = 2;
pub const IN_FLIGHT_CAP: u32 = 8;
const TTL: Duration = Duration::from_secs(2);
/// Seed fetches take this long, so locks are held long enough to be stopped or unlocked.
const SEED_LATENCY: Duration = Duration::from_millis(800);

#[derive(Debug, Default)]
pub struct ChaosReport {
    pub seed: u64,
    pub kills: u32,
    pub stops: u32,
    /// Instances cut off from the database (a blackholing proxy) for longer than ttl.
    pub partitions: u32,
    pub db_restarts: u32,
    pub db_restart_skipped: bool,
    pub unlocks: u32,
    pub source_failures: u32,
    pub mutations: u32,
    /// Instances running at once.
    pub instances: usize,
    pub instances_started: u32,
    pub takeovers: u32,
    pub edit_locks_lost: u32,
    pub url_leases_lost: u32,
    pub refreshes: u32,
    pub passes: BTreeMap<String, i64>,
    /// Per crawling bot: requests to its shop, and requests beyond one per page and pass.
    pub requests: BTreeMap<String, u64>,
    pub repeated: BTreeMap<String, u64>,
    pub records: BTreeMap<String, usize>,
    /// Per crawling bot: released change events checked against its records.
    pub events: BTreeMap<String, usize>,
    /// What a run could not check, and why (not a violation).
    pub notes: Vec<String>,
    pub history_entries: usize,
    pub wall: Duration,
    pub settle: Duration,
    /// Every broken invariant, one line each; empty = the run passed.
    pub violations: Vec<String>,
}

impl ChaosReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "seed {}", self.seed);
        let _ = writeln!(
            s,
            "faults: {} SIGKILLs ({} instances started), {} SIGSTOPs of a lock holder past ttl, {} partitions from the database past ttl, {} database restart(s){}, {} admin unlock(s), {} seed-source failure window(s), {} shop mutations",
            self.kills,
            self.instances_started,
            self.stops,
            self.partitions,
            self.db_restarts,
            if self.db_restart_skipped { " (skipped: no server binary)" } else { "" },
            self.unlocks,
            self.source_failures,
            self.mutations
        );
        let _ = writeln!(
            s,
            "seen: {} takeovers, {} refreshes, {} edit locks lost, {} URL leases lost, {} history entries checked",
            self.takeovers, self.refreshes, self.edit_locks_lost, self.url_leases_lost, self.history_entries
        );
        for bot in CRAWLING {
            let _ = writeln!(
                s,
                "{bot}: {} passes, {} records, {} change events, {} requests, {} repeated (bound {} = interruptions × {IN_FLIGHT_CAP})",
                self.passes.get(bot).copied().unwrap_or(0),
                self.records.get(bot).copied().unwrap_or(0),
                self.events.get(bot).copied().unwrap_or(0),
                self.requests.get(bot).copied().unwrap_or(0),
                self.repeated.get(bot).copied().unwrap_or(0),
                self.repeat_bound()
            );
        }
        let _ = writeln!(
            s,
            "wall {:.1} s (settling {:.1} s)",
            self.wall.as_secs_f64(),
            self.settle.as_secs_f64()
        );
        for note in &self.notes {
            let _ = writeln!(s, "note: {note}");
        }
        if self.violations.is_empty() {
            let _ = writeln!(s, "verdict: ok, every invariant held");
        } else {
            let _ = writeln!(s, "verdict: FAILED ({} violations)", self.violations.len());
            for v in &self.violations {
                let _ = writeln!(s, "  - {v}");
            }
        }
        s
    }

    /// Events that can lose an instance's fetched, uncommitted pages: a kill, a stop past the
    /// lease, a partition past it, and a database restart (every live instance's commits fail
    /// once).
    fn interruptions(&self) -> u64 {
        u64::from(self.kills)
            + u64::from(self.stops)
            + u64::from(self.partitions)
            + u64::from(self.db_restarts) * self.instances as u64
    }

    pub fn repeat_bound(&self) -> u64 {
        self.interruptions() * u64::from(IN_FLIGHT_CAP)
    }
}

/// Runs the whole scenario and checks it. Panics only on a broken harness (a process that
/// cannot start); broken invariants are returned in the report.
pub async fn run(cfg: ChaosConfig) -> ChaosReport {
    let wall = Instant::now();
    std::fs::create_dir_all(&cfg.dir).unwrap();
    let chaos = cfg.chaos_for.as_secs_f64();
    let plan = Plan::draw(cfg.seed, chaos);
    let mut report = ChaosReport {
        seed: cfg.seed,
        instances: cfg.instances,
        ..Default::default()
    };
    let mut database = Database::start(&cfg).await;
    let shop_a = start_shop(&cfg, "A", cfg.seed).await;
    let shop_b = start_shop(&cfg, "B", cfg.seed.wrapping_add(1)).await;
    let shops = [&shop_a, &shop_b];
    let sources = SeedSources::start(
        CRAWLING
            .iter()
            .zip(shops)
            .map(|(bot, shop)| (bot.to_string(), (shop.base.clone(), shop.lists)))
            .collect(),
    )
    .await;
    let database_name = format!(
        "chaos_{}_{:06x}",
        cfg.seed,
        rand::random::<u32>() & 0xff_ffff
    );
    let config_path = cfg.dir.join("seedlock.toml");
    std::fs::write(
        &config_path,
        config_toml(
            &database.uri,
            &database_name,
            &cfg.transactions,
            &sources,
            &shops,
        ),
    )
    .unwrap();
    let client = Client::with_uri_str(&database.uri).await.unwrap();
    let mut run = Run {
        cfg: cfg.clone(),
        config_path,
        db: client.database(&database_name),
        instances: Vec::new(),
        started: 0,
        history: HashMap::new(),
        history_gaps: Vec::new(),
        seen_seeds: HashMap::new(),
        passes: HashMap::new(),
        asked: HashMap::new(),
        admin_failures: Vec::new(),
        upstream: database
            .restartable()
            .then(|| super::blackhole::server_of(&database.uri)),
        db_uri: database.uri.clone(),
    };
    for _ in 0..cfg.instances {
        run.spawn_instance().await;
    }
    let per_kind = (cfg.products_per_shop / 100).max(1);
    let mut mutated = Mutated::default();

    let mut partitions = if run.upstream.is_some() {
        plan.partitions.clone()
    } else {
        Vec::new()
    };
    let mut heal: Vec<(f64, usize)> = Vec::new();
    let (mut kills, mut stops, mut unlocks, mut mutations) = (
        plan.kills.iter().peekable(),
        plan.stops.clone(),
        plan.unlocks.clone(),
        plan.mutations.iter().peekable(),
    );
    let mut restart = Some(plan.restart);
    let mut catalog_failing = Some(plan.catalog_failing);
    let mut crawl_failing = Some(plan.crawl_failing);
    let mut failing_until: Vec<(f64, &str)> = Vec::new();
    let mut resume: Vec<(f64, usize)> = Vec::new();
    let t0 = Instant::now();
    loop {
        let t = t0.elapsed().as_secs_f64();
        if t >= chaos {
            break;
        }
        let bots = run.bots().await;
        if let Some(bots) = &bots {
            run.observe(bots);
        }
        // SIGKILL a live instance and start a new one.
        while let Some((_, pick)) = kills.next_if(|(at, _)| t >= *at) {
            let live = run.live();
            if !live.is_empty() {
                let victim = live[(*pick % live.len() as u64) as usize];
                run.instances[victim].signal(Signal::SIGKILL);
                run.instances[victim].killed = true;
                report.kills += 1;
                run.spawn_instance().await;
            }
        }
        // SIGCONT the stopped ones whose time is up.
        resume.retain(|&(until, i)| {
            if t >= until {
                run.instances[i].signal(Signal::SIGCONT);
                run.instances[i].stopped = false;
                false
            } else {
                true
            }
        });
        // Heal the partitions whose time is up: what the instance sent meanwhile arrives late.
        heal.retain(|&(until, i)| {
            if t >= until {
                if let Some(proxy) = &run.instances[i].proxy {
                    proxy.heal();
                }
                run.instances[i].cut = false;
                false
            } else {
                true
            }
        });
        // A running instance holding a bot's lock now (by bot name order).
        let holder = match &bots {
            Some(bots) => {
                let live: Vec<(usize, String)> = run
                    .live()
                    .into_iter()
                    .map(|i| (i, run.instances[i].name.clone()))
                    .collect();
                bots.iter().find_map(|(bot, d)| {
                    let by = d.get_str("editingBy").ok()?;
                    let editing = d.get_bool("isEditing").ok()?;
                    let i = live.iter().find(|(_, name)| name == by)?.0;
                    editing.then(|| (bot.clone(), i))
                })
            }
            None => None,
        };
        // SIGSTOP a lock holder for longer than ttl (the plan says when to start looking).
        if let (Some(pos), Some((_, i))) = (stops.iter().position(|(at, _)| t >= *at), &holder) {
            let (_, extra) = stops.remove(pos);
            run.instances[*i].signal(Signal::SIGSTOP);
            run.instances[*i].stopped = true;
            resume.push((t + TTL.as_secs_f64() + extra, *i));
            report.stops += 1;
        } else if let (Some(pos), Some((bot, _))) =
            (unlocks.iter().position(|at| t >= *at), &holder)
        {
            // An admin unlock of a bot mid-refresh.
            if let Ok(out) = run.admin(&["unlock", bot, "--reason", "chaos"]).await {
                if !out.contains("not locked") {
                    report.unlocks += 1;
                    unlocks.remove(pos);
                }
            }
        }
        // Cut one instance off from the database for longer than ttl: a lock holder if there is
        // one (its refresh must stop within ttl), else a live crawler.
        if let Some(pos) = partitions.iter().position(|(at, _, _)| t >= *at) {
            let live: Vec<usize> = run
                .live()
                .into_iter()
                .filter(|&i| !run.instances[i].cut)
                .collect();
            let (_, extra, pick) = partitions[pos];
            let victim = holder
                .as_ref()
                .map(|(_, i)| *i)
                .filter(|i| live.contains(i))
                .or_else(|| (!live.is_empty()).then(|| live[(pick % live.len() as u64) as usize]));
            if let Some(i) = victim {
                if let Some(proxy) = &run.instances[i].proxy {
                    proxy.cut();
                    run.instances[i].cut = true;
                    heal.push((t + TTL.as_secs_f64() + extra, i));
                    report.partitions += 1;
                    partitions.remove(pos);
                }
            }
        }
        // The database restarts once, data kept.
        if let Some((at, down_ms)) = restart {
            if t >= at {
                restart = None;
                if database.restartable() {
                    database.restart(Duration::from_millis(down_ms)).await;
                    report.db_restarts += 1;
                } else {
                    report.db_restart_skipped = true;
                }
            }
        }
        // The shops change: prices, new products, deleted products.
        while let Some((_, which)) = mutations.next_if(|(at, _)| t >= *at) {
            let bot = CRAWLING[*which];
            if let Some(answer) = mutate(shops[*which], per_kind).await {
                report.mutations += 1;
                let skus = |k: &str| -> Vec<String> {
                    answer[k]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                };
                for sku in skus("changed") {
                    *mutated
                        .changed
                        .entry(bot.to_owned())
                        .or_default()
                        .entry(sku)
                        .or_default() += 1;
                }
                mutated
                    .deleted
                    .entry(bot.to_owned())
                    .or_default()
                    .extend(skus("deleted"));
            }
        }
        // A seed source answers 500 for a while.
        if let Some((at, length)) = catalog_failing {
            if t >= at {
                catalog_failing = None;
                sources.set_failing(SEEDS_ONLY, true);
                report.source_failures += 1;
                failing_until.push((t + length, SEEDS_ONLY));
            }
        }
        failing_until.retain(|&(until, bot)| {
            if t >= until {
                sources.set_failing(bot, false);
            }
            t < until
        });
        // A crawling bot whose pass ended gets refreshed (a new pass, new seeds); one of them
        // with its source failing for a while (the refresh is asked for again until it works).
        if let Some(bots) = &bots {
            for (b, bot) in CRAWLING.iter().enumerate() {
                let Some(d) = bots.get(*bot) else { continue };
                let due = crawl_failing.is_some_and(|(which, at, _)| which == b && t >= at);
                if run.refresh_if_ended(bot, d).await && due {
                    let (_, _, length) = crawl_failing.take().expect("due");
                    sources.set_failing(bot, true);
                    report.source_failures += 1;
                    failing_until.push((t + length, bot));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Settle: every process running, sources healthy; each crawling bot gets one more pass
    // after the faults, which must complete; every bot must be ready; then a quiet moment (no
    // bot editing, no seed answer in flight) is the final state.
    let settle = Instant::now();
    for (_, i) in resume.drain(..) {
        run.instances[i].signal(Signal::SIGCONT);
        run.instances[i].stopped = false;
    }
    for (_, i) in heal.drain(..) {
        if let Some(proxy) = &run.instances[i].proxy {
            proxy.heal();
        }
        run.instances[i].cut = false;
    }
    for bot in BOTS {
        sources.set_failing(bot, false);
    }
    let mut target: HashMap<String, i64> = HashMap::new();
    let mut final_state: Option<(Bots, HashMap<String, Vec<Served>>)> = None;
    while settle.elapsed() < cfg.settle_for {
        let served_before: Vec<usize> = BOTS.iter().map(|b| sources.served(b).len()).collect();
        if let Some(bots) = run.bots().await {
            run.observe(&bots);
            let mut done = true;
            for bot in BOTS {
                let Some(d) = bots.get(bot) else {
                    done = false;
                    continue;
                };
                done &= d.get_bool("isReady").unwrap_or(false)
                    && !d.get_bool("isEditing").unwrap_or(true);
                if bot == SEEDS_ONLY {
                    continue;
                }
                let pass = d.get_i64("crawlPass").unwrap_or(0);
                let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
                match target.get(bot).copied() {
                    Some(want) if pass >= want => done &= ended,
                    Some(_) => {
                        run.refresh_if_ended(bot, d).await;
                        done = false;
                    }
                    None => {
                        // A refresh asked for in the chaos phase and not yet served is the
                        // last one; otherwise ask once the current pass has ended.
                        let pending = run.asked.get(bot).is_some_and(|(p, _)| *p == pass);
                        if pending || run.refresh_if_ended(bot, d).await {
                            target.insert(bot.to_owned(), pass + 1);
                        }
                        done = false;
                    }
                }
            }
            let served_after: Vec<usize> = BOTS.iter().map(|b| sources.served(b).len()).collect();
            if done && served_after == served_before {
                let served = BOTS
                    .iter()
                    .map(|b| (b.to_string(), sources.served(b)))
                    .collect();
                final_state = Some((bots, served));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.settle = settle.elapsed();
    if final_state.is_none() {
        report.violations.push(format!(
            "the run did not settle within {:?} (a bot not ready, or its last pass unfinished): {:?}",
            cfg.settle_for,
            run.bots().await.map(|b| b
                .iter()
                .map(|(k, d)| format!(
                    "{k}: ready={:?} editing={:?} pass={:?} ended={:?} error={:?}",
                    d.get("isReady"),
                    d.get("isEditing"),
                    d.get("crawlPass"),
                    d.get("crawlPassEndedAt"),
                    d.get("lastError")
                ))
                .collect::<Vec<_>>())
        ));
    }
    // An instance that exited on its own (not killed by the harness) is a failure.
    for inst in &mut run.instances {
        if !inst.killed {
            if let Ok(Some(status)) = inst.child.try_wait() {
                report
                    .violations
                    .push(format!("{} exited on its own: {status}", inst.name));
            }
        }
    }
    // Stop everything before reading the logs: SIGTERM must end each cleanly.
    for inst in &mut run.instances {
        inst.signal(Signal::SIGCONT);
        inst.signal(Signal::SIGTERM);
    }
    for inst in &mut run.instances {
        match tokio::time::timeout(Duration::from_secs(40), inst.child.wait()).await {
            Ok(Ok(status)) if inst.killed || status.success() => {}
            Ok(Ok(status)) => report
                .violations
                .push(format!("{} ended with {status} after SIGTERM", inst.name)),
            _ => {
                let _ = inst.child.kill().await;
                report
                    .violations
                    .push(format!("{} did not stop within 40 s of SIGTERM", inst.name));
            }
        }
    }
    if let Some(bots) = run.bots().await {
        run.observe(&bots);
    }
    report.instances_started = run.started;
    report.violations.append(&mut run.history_gaps.clone());
    report.violations.append(&mut run.admin_failures.clone());
    for (what, n, planned) in [
        ("SIGKILL", report.kills, !plan.kills.is_empty()),
        ("SIGSTOP of a lock holder", report.stops, true),
        (
            "partition from the database",
            report.partitions,
            !report.db_restart_skipped,
        ),
        ("admin unlock", report.unlocks, true),
        ("seed-source failure", report.source_failures, true),
        ("shop mutation", report.mutations, true),
        (
            "database restart",
            report.db_restarts,
            !report.db_restart_skipped,
        ),
    ] {
        if planned && n == 0 {
            report.violations.push(format!(
                "no {what} was injected: the run proves less than it should"
            ));
        }
    }

    check_history(&run.history, &mut report);
    for (b, bot) in CRAWLING.iter().enumerate() {
        check_records(&run, bot, &shops[b].base, &mutated, &mut report).await;
        check_events(&run, bot, &mut report).await;
        check_requests(&run, bot, shops[b], &mutated, &mut report).await;
    }
    if let Some((bots, served)) = &final_state {
        check_seeds(&run, bots, served, &mut report);
    }
    check_logs(&run, &mut report);
    report.wall = wall.elapsed();
    let _ = run.db.drop().await;
    drop(shop_a.child);
    drop(shop_b.child);
    report
}

/// Where a run keeps its files: `target/chaos/seed-N` under the crate.
pub fn default_dir(root: &Path, seed: u64) -> PathBuf {
    root.join("target")
        .join("chaos")
        .join(format!("seed-{seed}"))
}
