//! The chaos harness (Jepsen-style): real `seedlock` processes, two demo shops, seed sources that
//! change between refreshes and a restartable database; faults injected at random from a seed
//! (SIGKILL + restart, SIGSTOP of a lock holder past its ttl, a network partition of one
//! instance from the database past its ttl, a database restart, an admin unlock mid-refresh, a
//! seed source failing for a while); the history recorded; the invariants checked
//! afterwards. Shared by `scripts/chaos` (examples/chaos.rs, full size) and the suite
//! (tests/chaos.rs, small), as part of the test kit (tests/common).
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

/// One instance's pipeline sizes: a kill can lose at most this many fetched, uncommitted pages
/// per crawling bot (fetches + parse queue + parsers + store queue + writers).
const WORKERS: u32 = 3;
const PARSE_QUEUE: u32 = 1;
const PARSERS: u32 = 1;
const STORE_QUEUE: u32 = 1;
const WRITERS: u32 = 2;
pub const IN_FLIGHT_CAP: u32 = WORKERS + PARSE_QUEUE + PARSERS + STORE_QUEUE + WRITERS;
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
                "{bot}: {} passes, {} records, {} requests, {} repeated (bound {} = interruptions × {IN_FLIGHT_CAP})",
                self.passes.get(bot).copied().unwrap_or(0),
                self.records.get(bot).copied().unwrap_or(0),
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

// ---- the seed sources -----------------------------------------------------------------------

/// What one seed request was answered.
#[derive(Clone, Debug)]
struct Served {
    ok: bool,
    seeds: Vec<String>,
}

#[derive(Default)]
struct SourceState {
    /// Per bot: hits so far, failing flag, what each hit was answered.
    hits: HashMap<String, usize>,
    failing: HashMap<String, bool>,
    served: HashMap<String, Vec<Served>>,
    shops: HashMap<String, (String, u32)>,
}

/// `GET /seeds/{bot}`: hit n of a crawling bot names its shop's first listing page and listing
/// page 1 + n mod lists (a seed list that changes every refresh and still leads to the whole
/// shop); the seeds-only bot gets `http://catalog.test/gen{n}/a` and `/b`.
#[derive(Clone)]
struct SeedSources {
    base: String,
    state: Arc<Mutex<SourceState>>,
}

impl SeedSources {
    async fn start(shops: HashMap<String, (String, u32)>) -> Self {
        let state = Arc::new(Mutex::new(SourceState {
            shops,
            ..Default::default()
        }));
        let app = axum::Router::new()
            .route("/seeds/{bot}", axum::routing::get(serve_seeds))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { base, state }
    }

    fn url(&self, bot: &str) -> String {
        format!("{}/seeds/{bot}", self.base)
    }

    fn set_failing(&self, bot: &str, failing: bool) {
        self.state
            .lock()
            .unwrap()
            .failing
            .insert(bot.to_owned(), failing);
    }

    fn served(&self, bot: &str) -> Vec<Served> {
        self.state
            .lock()
            .unwrap()
            .served
            .get(bot)
            .cloned()
            .unwrap_or_default()
    }
}

async fn serve_seeds(
    axum::extract::State(state): axum::extract::State<Arc<Mutex<SourceState>>>,
    axum::extract::Path(bot): axum::extract::Path<String>,
) -> (axum::http::StatusCode, String) {
    tokio::time::sleep(SEED_LATENCY).await;
    let mut s = state.lock().unwrap();
    let n = {
        let hits = s.hits.entry(bot.clone()).or_default();
        *hits += 1;
        *hits
    };
    let seeds = match s.shops.get(&bot) {
        Some((base, lists)) => vec![
            format!("{base}/list/1"),
            format!("{base}/list/{}", 1 + n as u32 % lists),
        ],
        None => vec![
            format!("http://catalog.test/gen{n}/a"),
            format!("http://catalog.test/gen{n}/b"),
        ],
    };
    let ok = !s.failing.get(&bot).copied().unwrap_or(false);
    s.served.entry(bot).or_default().push(Served {
        ok,
        seeds: seeds.clone(),
    });
    if ok {
        (axum::http::StatusCode::OK, seeds.join("\n") + "\n")
    } else {
        (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "down for chaos\n".into(),
        )
    }
}

// ---- processes --------------------------------------------------------------------------------

struct Instance {
    name: String,
    child: Child,
    /// Its own way to the database, cut during a partition (with the run's own server).
    proxy: Option<super::blackhole::Blackhole>,
    stopped: bool,
    /// Cut off from the database by the harness.
    cut: bool,
    /// SIGKILLed by the harness.
    killed: bool,
}

impl Instance {
    fn pid(&self) -> Option<Pid> {
        self.child.id().map(|id| Pid::from_raw(id as i32))
    }
    fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(pid, sig);
        }
    }
}

struct Shop {
    base: String,
    lists: u32,
    child: Child,
}

async fn start_shop(cfg: &ChaosConfig, prefix: &str, seed: u64) -> Shop {
    let lists = cfg.products_per_shop.div_ceil(cfg.per_list);
    let out = cfg.dir.join(format!("shop-{prefix}.out"));
    let child = Command::new(&cfg.seedlock_bin)
        .args(["demo-site", "--addr", "127.0.0.1:0"])
        .args(["--lists", &lists.to_string()])
        .args(["--per-list", &cfg.per_list.to_string()])
        .args(["--seed", &seed.to_string(), "--sku-prefix", prefix])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(cfg.dir.join(format!("shop-{prefix}.log"))).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start the demo shop");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(at) = text.find("http://") {
            let base = text[at..].split_whitespace().next().unwrap().to_owned();
            return Shop { base, lists, child };
        }
        assert!(Instant::now() < deadline, "the demo shop did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The run's database: a server of its own (restartable), or an outside one.
struct Database {
    uri: String,
    own: Option<super::OwnServer>,
}

impl Database {
    async fn start(cfg: &ChaosConfig) -> Database {
        match (&cfg.server_bin, &cfg.uri) {
            (Some(bin), _) => {
                let own = super::OwnServer::start(bin.clone(), &cfg.dir.join("db")).await;
                Database {
                    uri: own.uri.clone(),
                    own: Some(own),
                }
            }
            (None, Some(uri)) => Database {
                uri: uri.clone(),
                own: None,
            },
            (None, None) => panic!("chaos: give a server binary or a MONGODB_URI"),
        }
    }

    fn restartable(&self) -> bool {
        self.own.is_some()
    }

    /// Stops the server (SIGTERM; SIGKILL after 10 s), then starts it again on the same
    /// storage and port after `down_for`.
    async fn restart(&mut self, down_for: Duration) {
        if let Some(own) = self.own.as_mut() {
            own.stop_gracefully().await;
            tokio::time::sleep(down_for).await;
            own.restart().await;
        }
    }
}

// ---- the run ----------------------------------------------------------------------------------

type Bots = BTreeMap<String, Document>;

struct Run {
    cfg: ChaosConfig,
    config_path: PathBuf,
    db: mongodb::Database,
    instances: Vec<Instance>,
    started: u32,
    history: HashMap<String, Vec<Document>>,
    history_gaps: Vec<String>,
    seen_seeds: HashMap<String, Vec<Vec<String>>>,
    /// Per crawling bot, every pass number seen current (passes that ran).
    passes: HashMap<String, std::collections::BTreeSet<i64>>,
    /// Per crawling bot, the pass a refresh was asked for and when.
    asked: HashMap<String, (i64, Instant)>,
    admin_failures: Vec<String>,
    /// The run's own server (`host:port`), which each instance reaches through a proxy of its
    /// own; `None` with an outside server (partitions are skipped then).
    upstream: Option<String>,
    db_uri: String,
}

impl Run {
    async fn spawn_instance(&mut self) {
        self.started += 1;
        let name = format!("i{}", self.started);
        let proxy = match &self.upstream {
            Some(upstream) => Some(super::blackhole::Blackhole::start(upstream).await),
            None => None,
        };
        let mut command = Command::new(&self.cfg.seedlock_bin);
        match &proxy {
            Some(proxy) => command.env("MONGODB_URI", proxy.uri(&self.db_uri)),
            None => command.env_remove("MONGODB_URI"),
        };
        let child = command
            .arg("-c")
            .arg(&self.config_path)
            .arg("run")
            .env_remove("SEEDLOCK_DATABASE")
            .env("SEEDLOCK_INSTANCE_ID", &name)
            .env("SEEDLOCK_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.cfg.dir.join(format!("{name}.log"))).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("start seedlock");
        self.instances.push(Instance {
            name,
            child,
            proxy,
            stopped: false,
            cut: false,
            killed: false,
        });
    }

    /// `seedlock -c CONFIG ARGS…` (an admin command); its output, or why it failed. A panic
    /// is recorded as a violation.
    async fn admin(&mut self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.cfg.seedlock_bin)
            .arg("-c")
            .arg(&self.config_path)
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .output()
            .await
            .map_err(|e| e.to_string())?;
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if stderr.contains("panicked") {
            self.admin_failures
                .push(format!("`seedlock {}` panicked: {stderr}", args.join(" ")));
        }
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(stderr)
        }
    }

    async fn bots(&self) -> Option<Bots> {
        let docs: Vec<Document> = tokio::time::timeout(Duration::from_secs(2), async {
            self.db
                .collection::<Document>("bots")
                .find(doc! {})
                .await?
                .try_collect()
                .await
        })
        .await
        .ok()?
        .ok()?;
        Some(
            docs.into_iter()
                .filter_map(|d| Some((d.get_str("_id").ok()?.to_owned(), d)))
                .collect(),
        )
    }

    /// Folds the documents' (capped) histories into the full record, samples the seeds of
    /// ready bots and notes the passes that ran.
    fn observe(&mut self, bots: &Bots) {
        for (bot, d) in bots {
            let snapshot: Vec<Document> = d
                .get_array("history")
                .map(|a| a.iter().filter_map(|e| e.as_document().cloned()).collect())
                .unwrap_or_default();
            let known = self.history.entry(bot.clone()).or_default();
            match known.last() {
                None => known.extend(snapshot),
                Some(last) => match snapshot.iter().rposition(|e| e == last) {
                    Some(i) => known.extend(snapshot.into_iter().skip(i + 1)),
                    None => {
                        // The last entry seen is gone: more entries than the document keeps went
                        // by (or the database lost writes). Keep what is new; report the gap.
                        self.history_gaps.push(format!(
                            "{bot}: the history entry {last} vanished between two polls (more than the document keeps went by, or the database lost it)"
                        ));
                        let fresh: Vec<Document> = snapshot
                            .into_iter()
                            .filter(|e| !known.contains(e))
                            .collect();
                        known.extend(fresh);
                    }
                },
            }
            if d.get_bool("isReady").unwrap_or(false) {
                let seeds = seeds_of(d);
                let seen = self.seen_seeds.entry(bot.clone()).or_default();
                if seen.last() != Some(&seeds) {
                    seen.push(seeds);
                }
            }
            if let Ok(pass) = d.get_i64("crawlPass") {
                if pass > 0 {
                    self.passes.entry(bot.clone()).or_default().insert(pass);
                }
            }
        }
    }

    /// Running (not stopped) instances, by name order.
    fn live(&mut self) -> Vec<usize> {
        (0..self.instances.len())
            .filter(|&i| {
                matches!(self.instances[i].child.try_wait(), Ok(None)) && !self.instances[i].stopped
            })
            .collect()
    }

    /// Asks for a refresh of a crawling bot whose pass ended and which nobody is refreshing;
    /// again if one asked for earlier did not start a pass within 5 s (it failed, or was lost).
    async fn refresh_if_ended(&mut self, bot: &str, d: &Document) -> bool {
        let pass = d.get_i64("crawlPass").unwrap_or(0);
        let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
        let quiet =
            d.get_bool("isReady").unwrap_or(false) && !d.get_bool("isEditing").unwrap_or(true);
        if pass == 0 || !ended || !quiet {
            return false;
        }
        if let Some((asked, at)) = self.asked.get(bot) {
            if *asked == pass && at.elapsed() < Duration::from_secs(5) {
                return false;
            }
        }
        if self.admin(&["refresh", bot]).await.is_ok() {
            self.asked.insert(bot.to_owned(), (pass, Instant::now()));
            return true;
        }
        false
    }
}

fn seeds_of(d: &Document) -> Vec<String> {
    d.get_array("seeds")
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn config_toml(
    uri: &str,
    database: &str,
    transactions: &str,
    sources: &SeedSources,
    shops: &[&Shop; 2],
) -> String {
    let mut s = format!(
        r#"[mongo]
uri = "{uri}"
database = "{database}"
connect_timeout = "20s"
op_timeout = "3s"
[lock]
ttl = "{ttl}s"
max_refresh = "20s"
poll = "200ms"
[refresh]
timeout = "3s"
attempts = 2
backoff_base = "200ms"
backoff_max = "1s"
[crawl]
workers = {WORKERS}
parse_queue = {PARSE_QUEUE}
parsers = {PARSERS}
store_queue = {STORE_QUEUE}
writers = {WRITERS}
lease = "8s"
timeout = "4s"
attempts = 10
backoff_base = "100ms"
backoff_max = "1s"
transactions = "{transactions}"
[http]
listen = "127.0.0.1:0"
[log]
format = "json"
"#,
        ttl = TTL.as_secs()
    );
    for (bot, shop) in CRAWLING.iter().zip(shops) {
        let host = shop.base.trim_start_matches("http://");
        let _ = write!(
            s,
            "\n[[bots]]\nid = \"{bot}\"\nseeds = {{ url = \"{url}\", format = \"lines\" }}\nrefresh = \"7d\"\n{rules}",
            url = sources.url(bot),
            rules = seedlock::demo_site::crawl_rules_toml(&[host], ".sku"),
        );
    }
    let _ = write!(
        s,
        "\n[[bots]]\nid = \"{SEEDS_ONLY}\"\nseeds = {{ url = \"{}\", format = \"lines\" }}\nrefresh = \"3s\"\n",
        sources.url(SEEDS_ONLY)
    );
    s
}

/// Every fault of a run, drawn from the seed before it starts: the same seed, the same plan.
/// (What a fault hits — which instance holds a lock at that moment — depends on timing.)
#[derive(Debug)]
struct Plan {
    /// SIGKILL times (s) and, for each, a number choosing the victim among the live instances.
    kills: Vec<(f64, u64)>,
    /// SIGSTOP of a lock holder: when to start looking for one, and for how long past ttl.
    stops: Vec<(f64, f64)>,
    /// Partitions of one instance from the database: when (a lock holder's if there is one,
    /// else a live instance chosen by the number), and for how long past ttl.
    partitions: Vec<(f64, f64, u64)>,
    unlocks: Vec<f64>,
    /// The database restart: when, and how long it stays down (ms).
    restart: (f64, u64),
    /// The seeds-only bot's source fails over this window.
    catalog_failing: (f64, f64),
    /// One crawling bot's source fails at its first refresh asked for after this time.
    crawl_failing: (usize, f64, f64),
    /// Shop mutations: when, and which shop.
    mutations: Vec<(f64, usize)>,
}

impl Plan {
    fn draw(seed: u64, chaos: f64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut kills = Vec::new();
        let mut t = rng.random_range(0.5..2.0);
        while t < chaos {
            kills.push((t, rng.random::<u64>()));
            t += rng.random_range(0.5..2.0);
        }
        let stops = (0..(chaos / 8.0).ceil().max(1.0) as usize)
            .map(|_| {
                (
                    rng.random_range(0.1..0.7) * chaos,
                    rng.random_range(0.5..2.0),
                )
            })
            .collect();
        let unlocks = (0..2).map(|_| rng.random_range(0.1..0.7) * chaos).collect();
        let partitions = (0..(chaos / 10.0).ceil().max(1.0) as usize)
            .map(|_| {
                (
                    rng.random_range(0.1..0.7) * chaos,
                    rng.random_range(0.5..2.0),
                    rng.random::<u64>(),
                )
            })
            .collect();
        let restart = (
            rng.random_range(0.3..0.6) * chaos,
            rng.random_range(300..1500),
        );
        let catalog_failing = (
            rng.random_range(0.1..0.6) * chaos,
            rng.random_range(2.0..5.0),
        );
        let crawl_failing = (
            rng.random_range(0..CRAWLING.len()),
            rng.random_range(0.1..0.6) * chaos,
            rng.random_range(2.0..5.0),
        );
        let mutations = (0..4)
            .map(|i| (rng.random_range(0.1..0.8) * chaos, i % 2))
            .collect();
        Plan {
            kills,
            stops,
            partitions,
            unlocks,
            restart,
            catalog_failing,
            crawl_failing,
            mutations,
        }
    }
}

/// What the shops' mutations did, per crawling bot: sku → times changed, and the deleted.
#[derive(Default)]
struct Mutated {
    changed: HashMap<String, HashMap<String, u32>>,
    deleted: HashMap<String, std::collections::HashSet<String>>,
}

async fn mutate(shop: &Shop, per_kind: u32) -> Option<serde_json::Value> {
    reqwest::Client::new()
        .post(format!("{}/__mutate", shop.base))
        .json(&serde_json::json!({ "change": per_kind, "add": per_kind, "delete": per_kind }))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
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

// ---- the checks -------------------------------------------------------------------------------

/// 1. Per bot, lock epochs strictly increase, and every accepted holder write names the epoch
///    and the instance that won it: no two instances' writes accepted under one epoch.
pub fn check_history(history: &HashMap<String, Vec<Document>>, report: &mut ChaosReport) {
    for bot in BOTS {
        let entries = history.get(bot).cloned().unwrap_or_default();
        report.history_entries += entries.len();
        let mut highest = -1_i64;
        let mut owner: HashMap<i64, String> = HashMap::new();
        // Epochs whose holder made its last write: nothing more may be accepted under them.
        let mut closed: std::collections::HashSet<i64> = Default::default();
        for e in &entries {
            let event = e.get_str("event").unwrap_or("?");
            let by = e.get_str("by").unwrap_or("?").to_owned();
            let epoch = match e.get("epoch") {
                Some(Bson::Int64(n)) => *n,
                Some(Bson::Int32(n)) => i64::from(*n),
                _ => {
                    report
                        .violations
                        .push(format!("{bot}: history entry without an epoch: {e}"));
                    continue;
                }
            };
            match event {
                "created" | "acquired" | "took_over" | "repaired" | "unlocked" => {
                    // A contradiction repair keeps the holder's epoch; everything else raises it.
                    let raises = !(event == "repaired" && epoch == highest);
                    if raises && epoch <= highest {
                        report.violations.push(format!(
                            "{bot}: epoch {epoch} ({event} by {by}) does not exceed {highest}"
                        ));
                    }
                    highest = highest.max(epoch);
                    if event == "took_over" {
                        report.takeovers += 1;
                    }
                    if matches!(event, "acquired" | "took_over") {
                        if let Some(first) = owner.insert(epoch, by.clone()) {
                            report.violations.push(format!(
                                "{bot}: epoch {epoch} won twice, by {first} and by {by}"
                            ));
                        }
                    }
                }
                "refreshed" | "refresh_failed" | "released" => {
                    if event == "refreshed" {
                        report.refreshes += 1;
                    }
                    if !closed.insert(epoch) {
                        report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch} after its last write"
                        ));
                    }
                    match owner.get(&epoch) {
                        Some(o) if *o == by && epoch == highest => {}
                        Some(o) if *o == by => report.violations.push(format!(
                            "{bot}: {by}'s {event} under epoch {epoch} was accepted after epoch {highest} began"
                        )),
                        Some(o) => report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch}, which {o} holds"
                        )),
                        None => report.violations.push(format!(
                            "{bot}: {event} by {by} accepted under epoch {epoch}, which nobody won"
                        )),
                    }
                }
                _ => {}
            }
        }
    }
}

use super::try_get_json as get_json;

/// 2. Every product has exactly one record, equal to the shop's final state.
/// 2. Every product has exactly one record, equal to the shop's final state; the records of
///    deleted products are marked removed, and only those.
async fn check_records(
    run: &Run,
    bot: &str,
    base: &str,
    mutated: &Mutated,
    report: &mut ChaosReport,
) {
    let Some(truth) = get_json(&format!("{base}/__truth")).await else {
        report
            .violations
            .push(format!("{bot}: the shop's truth could not be read"));
        return;
    };
    let truth: HashMap<String, [String; 3]> = truth["products"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or_default().to_owned();
            (s("sku"), [s("title"), s("price"), s("status")])
        })
        .collect();
    let records: Vec<Document> = match run
        .db
        .collection::<Document>("records")
        .find(doc! { "botId": bot })
        .await
    {
        Ok(cursor) => cursor.try_collect().await.unwrap_or_default(),
        Err(e) => {
            report
                .violations
                .push(format!("{bot}: records unreadable: {e}"));
            return;
        }
    };
    report.records.insert(bot.to_owned(), records.len());
    let deleted = mutated.deleted.get(bot).cloned().unwrap_or_default();
    let mut by_key: HashMap<String, u32> = HashMap::new();
    let (mut wrong, mut removed, mut kept) = (Vec::new(), Vec::new(), Vec::new());
    for r in &records {
        let key = r.get_str("naturalKey").unwrap_or("?").to_owned();
        *by_key.entry(key.clone()).or_default() += 1;
        let is_removed = !matches!(r.get("removedAt"), None | Some(Bson::Null));
        match (is_removed, deleted.contains(&key)) {
            (true, true) => continue, // a deleted product, marked removed: right
            (false, true) => {
                kept.push(key);
                continue;
            }
            (true, false) => removed.push(key.clone()),
            (false, false) => {}
        }
        let data = r.get_document("data").cloned().unwrap_or_default();
        let got = ["title", "price", "status"].map(|f| data.get_str(f).unwrap_or("").to_owned());
        if truth.get(&key) != Some(&got) {
            wrong.push(key);
        }
    }
    let duplicates = by_key.values().filter(|&&n| n > 1).count();
    let missing = truth.keys().filter(|k| !by_key.contains_key(*k)).count();
    for (what, n) in [
        ("duplicate records", duplicates),
        ("products without a record", missing),
        ("records not equal to the shop", wrong.len()),
        ("records of existing products marked removed", removed.len()),
        ("records of deleted products not marked removed", kept.len()),
    ] {
        if n > 0 {
            report.violations.push(format!(
                "{bot}: {n} {what} (of {} products){}",
                truth.len(),
                match what {
                    "records not equal to the shop" =>
                        format!(", e.g. {:?}", &wrong[..wrong.len().min(3)]),
                    "records of existing products marked removed" =>
                        format!(", e.g. {:?}", &removed[..removed.len().min(3)]),
                    "records of deleted products not marked removed" =>
                        format!(", e.g. {:?}", &kept[..kept.len().min(3)]),
                    _ => String::new(),
                }
            ));
        }
    }
}

/// 3. Repeated requests ≤ interruptions × the in-flight cap. A listing page is due once per
///    pass that ran; a product page once, plus up to two more per change of that product (the
///    next pass's fetch, and one more if the change landed between its listing and its page)
///    and one for a deleted product (its page's 404); the rest repeat.
async fn check_requests(
    run: &Run,
    bot: &str,
    shop: &Shop,
    mutated: &Mutated,
    report: &mut ChaosReport,
) {
    let Some(stats) = get_json(&format!("{}/__stats", shop.base)).await else {
        report
            .violations
            .push(format!("{bot}: the shop's stats could not be read"));
        return;
    };
    // Passes that ran (a refresh that lost its lock after preparing a pass skips a number).
    let passes = run.passes.get(bot).map_or(0, |p| p.len() as i64);
    report.passes.insert(bot.to_owned(), passes);
    let changed = mutated.changed.get(bot).cloned().unwrap_or_default();
    let deleted = mutated.deleted.get(bot).cloned().unwrap_or_default();
    let (mut total, mut repeated) = (0_u64, 0_u64);
    for (path, n) in stats["paths"].as_object().into_iter().flatten() {
        let n = n.as_u64().unwrap_or(0);
        if path == "/robots.txt" {
            continue; // read once by every process
        }
        total += n;
        let expected = match path.strip_prefix("/product/") {
            Some(sku) => {
                1 + 2 * u64::from(changed.get(sku).copied().unwrap_or(0))
                    + u64::from(deleted.contains(sku))
            }
            None => passes.max(0) as u64,
        };
        repeated += n.saturating_sub(expected);
    }
    report.requests.insert(bot.to_owned(), total);
    report.repeated.insert(bot.to_owned(), repeated);
    if repeated > report.repeat_bound() {
        report.violations.push(format!(
            "{bot}: {repeated} repeated requests exceed the bound {} ({} interruptions × {IN_FLIGHT_CAP})",
            report.repeat_bound(),
            report.interruptions()
        ));
    }
}

/// 4. Every bot ends Ready with the seeds of its last successful refresh; and whenever it was
///    seen ready, its seeds were one answer of its source (never a mix, never a stale
///    holder's).
fn check_seeds(
    run: &Run,
    bots: &Bots,
    served: &HashMap<String, Vec<Served>>,
    report: &mut ChaosReport,
) {
    for bot in BOTS {
        let served = served.get(bot).cloned().unwrap_or_default();
        let answers: Vec<&Vec<String>> = served.iter().filter(|s| s.ok).map(|s| &s.seeds).collect();
        let Some(d) = bots.get(bot) else {
            report.violations.push(format!("{bot}: no document"));
            continue;
        };
        if !d.get_bool("isReady").unwrap_or(false) {
            report
                .violations
                .push(format!("{bot}: not ready at the end"));
        }
        let seeds = seeds_of(d);
        if answers.last().map(|a| same_set(a, &seeds)) != Some(true) {
            report.violations.push(format!(
                "{bot}: ends with seeds {seeds:?}, not its source's last answer {:?}",
                answers.last()
            ));
        }
        for seen in run.seen_seeds.get(bot).into_iter().flatten() {
            if !answers.iter().any(|a| same_set(a, seen)) {
                report.violations.push(format!(
                    "{bot}: was ready with seeds {seen:?}, which its source never answered"
                ));
            }
        }
    }
}

fn same_set(a: &[String], b: &[String]) -> bool {
    let norm = |v: &[String]| {
        let mut v: Vec<String> = v
            .iter()
            .map(|s| s.trim_end_matches('/').to_owned())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    norm(a) == norm(b)
}

/// 5. No panic and no unhandled error in any log; counts the leases lost.
fn check_logs(run: &Run, report: &mut ChaosReport) {
    for inst in &run.instances {
        let path = run.cfg.dir.join(format!("{}.log", inst.name));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                if line.contains("panicked") {
                    report
                        .violations
                        .push(format!("{}: panicked: {line}", inst.name));
                } else if !line.trim().is_empty() {
                    report.violations.push(format!(
                        "{}: a log line that is not JSON: {line}",
                        inst.name
                    ));
                }
                continue;
            };
            let message = v["fields"]["message"].as_str().unwrap_or("");
            match message {
                "edit lock lost; stopped without writing" => report.edit_locks_lost += 1,
                "url lease lost; the newer worker's result wins" => report.url_leases_lost += 1,
                _ => {}
            }
            if v["level"] == "ERROR" {
                report
                    .violations
                    .push(format!("{}: error logged: {line}", inst.name));
            }
        }
    }
}

/// Where a run keeps its files: `target/chaos/seed-N` under the crate.
pub fn default_dir(root: &Path, seed: u64) -> PathBuf {
    root.join("target")
        .join("chaos")
        .join(format!("seed-{seed}"))
}
