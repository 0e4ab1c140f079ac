//! The chaos harness (Jepsen-style): real `seedlock` processes, two demo shops, seed sources that
//! change between refreshes and a restartable database; faults injected at random from a seed
//! (SIGKILL + restart, SIGSTOP of a lock holder past its ttl, a database restart, an admin unlock
//! mid-refresh, a seed source failing for a while); the history recorded; the invariants checked
//! afterwards. Shared by `scripts/chaos` (examples/chaos.rs, full size) and the suite
//! (tests/chaos.rs, small). Self-contained: it is compiled into both.
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
    pub db_restarts: u32,
    pub db_restart_skipped: bool,
    pub unlocks: u32,
    pub source_failures: u32,
    /// Instances running at once.
    pub instances: usize,
    pub instances_started: u32,
    pub takeovers: u32,
    pub lock_leases_lost: u32,
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
            "faults: {} SIGKILLs ({} instances started), {} SIGSTOPs of a lock holder past ttl, {} database restart(s){}, {} admin unlock(s), {} seed-source failure window(s)",
            self.kills,
            self.instances_started,
            self.stops,
            self.db_restarts,
            if self.db_restart_skipped { " (skipped: no server binary)" } else { "" },
            self.unlocks,
            self.source_failures
        );
        let _ = writeln!(
            s,
            "seen: {} takeovers, {} refreshes, {} lock leases lost, {} URL leases lost, {} history entries checked",
            self.takeovers, self.refreshes, self.lock_leases_lost, self.url_leases_lost, self.history_entries
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
    /// lease, and a database restart (every live instance's commits fail once).
    fn interruptions(&self) -> u64 {
        u64::from(self.kills)
            + u64::from(self.stops)
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
    stopped: bool,
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

struct Database {
    uri: String,
    port: u16,
    child: Option<std::process::Child>,
    bin: Option<PathBuf>,
    storage: PathBuf,
}

impl Database {
    async fn start(cfg: &ChaosConfig) -> Database {
        match (&cfg.server_bin, &cfg.uri) {
            (Some(bin), _) => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                let mut db = Database {
                    uri: format!("mongodb://127.0.0.1:{port}/?directConnection=true"),
                    port,
                    child: None,
                    bin: Some(bin.clone()),
                    storage: cfg.dir.join("db"),
                };
                db.start_server().await;
                db
            }
            (None, Some(uri)) => Database {
                uri: uri.clone(),
                port: 0,
                child: None,
                bin: None,
                storage: PathBuf::new(),
            },
            (None, None) => panic!("chaos: give a server binary or a MONGODB_URI"),
        }
    }

    async fn start_server(&mut self) {
        let bin = self.bin.as_ref().expect("own server");
        std::fs::create_dir_all(&self.storage).unwrap();
        let child = std::process::Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--log-level", "WARNING", "--cache-size", "256M"])
            .arg("--storage-path")
            .arg(&self.storage)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the test server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "the database did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn restartable(&self) -> bool {
        self.bin.is_some()
    }

    /// SIGKILL, then start again on the same storage and port.
    async fn restart(&mut self, down_for: Duration) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
        }
        tokio::time::sleep(down_for).await;
        self.start_server().await;
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---- the run ----------------------------------------------------------------------------------

struct Run {
    cfg: ChaosConfig,
    config_path: PathBuf,
    db: mongodb::Database,
    instances: Vec<Instance>,
    started: u32,
    history: HashMap<String, Vec<Document>>,
    history_gaps: Vec<String>,
    seen_seeds: HashMap<String, Vec<Vec<String>>>,
}

impl Run {
    fn spawn_instance(&mut self) {
        self.started += 1;
        let name = format!("i{}", self.started);
        let child = Command::new(&self.cfg.seedlock_bin)
            .arg("-c")
            .arg(&self.config_path)
            .arg("run")
            .env_remove("MONGODB_URI")
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
            stopped: false,
        });
    }

    /// `seedlock -c CONFIG ARGS…` (an admin command); its output line, or why it failed.
    async fn admin(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.cfg.seedlock_bin)
            .arg("-c")
            .arg(&self.config_path)
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .output()
            .await
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }

    async fn bots(&self) -> Option<HashMap<String, Document>> {
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

    /// Folds the documents' (capped) histories into the full record and samples the seeds.
    fn observe(&mut self, bots: &HashMap<String, Document>) {
        for (bot, d) in bots {
            let snapshot: Vec<Document> = d
                .get_array("history")
                .map(|a| a.iter().filter_map(|e| e.as_document().cloned()).collect())
                .unwrap_or_default();
            let known = self.history.entry(bot.clone()).or_default();
            let new_from = match known.last() {
                None => 0,
                Some(last) => match snapshot.iter().rposition(|e| e == last) {
                    Some(i) => i + 1,
                    None => {
                        if !snapshot.is_empty() {
                            self.history_gaps.push(format!(
                                "{bot}: more history entries than the document keeps went by between two polls"
                            ));
                        }
                        0
                    }
                },
            };
            known.extend(snapshot.into_iter().skip(new_from));
            if d.get_bool("isReady").unwrap_or(false) {
                let seeds: Vec<String> = d
                    .get_array("seeds")
                    .map(|a| {
                        a.iter()
                            .filter_map(|s| s.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                let seen = self.seen_seeds.entry(bot.clone()).or_default();
                if seen.last() != Some(&seeds) {
                    seen.push(seeds);
                }
            }
        }
    }

    fn live(&mut self) -> Vec<usize> {
        (0..self.instances.len())
            .filter(|&i| {
                matches!(self.instances[i].child.try_wait(), Ok(None)) && !self.instances[i].stopped
            })
            .collect()
    }
}

fn config_toml(uri: &str, database: &str, sources: &SeedSources, shops: &[&Shop; 2]) -> String {
    let mut s = format!(
        r#"[mongo]
uri = "{uri}"
database = "{database}"
connect_timeout = "3s"
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
lease = "5s"
timeout = "4s"
attempts = 10
backoff_base = "100ms"
backoff_max = "1s"
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
            r#"
[[bots]]
id = "{bot}"
seeds = {{ url = "{url}", format = "lines" }}
refresh = "7d"
[bots.crawl]
scope = ["{host}"]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = {{ title = "h1", price = ".price", status = ".status" }}
"#,
            url = sources.url(bot)
        );
    }
    let _ = write!(
        s,
        "\n[[bots]]\nid = \"{SEEDS_ONLY}\"\nseeds = {{ url = \"{}\", format = \"lines\" }}\nrefresh = \"3s\"\n",
        sources.url(SEEDS_ONLY)
    );
    s
}

/// Runs the whole scenario and checks it. Panics only on a broken harness (a process that
/// cannot start); broken invariants are returned in the report.
pub async fn run(cfg: ChaosConfig) -> ChaosReport {
    let wall = Instant::now();
    std::fs::create_dir_all(&cfg.dir).unwrap();
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut report = ChaosReport {
        seed: cfg.seed,
        instances: cfg.instances,
        ..Default::default()
    };
    let mut database = Database::start(&cfg).await;
    let shop_a = start_shop(&cfg, "A", cfg.seed).await;
    let shop_b = start_shop(&cfg, "B", cfg.seed.wrapping_add(1)).await;
    let shops: HashMap<String, (String, u32)> = [
        (CRAWLING[0].to_owned(), (shop_a.base.clone(), shop_a.lists)),
        (CRAWLING[1].to_owned(), (shop_b.base.clone(), shop_b.lists)),
    ]
    .into();
    let sources = SeedSources::start(shops).await;
    let database_name = format!(
        "chaos_{}_{:06x}",
        cfg.seed,
        rand::random::<u32>() & 0xff_ffff
    );
    let config_path = cfg.dir.join("seedlock.toml");
    std::fs::write(
        &config_path,
        config_toml(&database.uri, &database_name, &sources, &[&shop_a, &shop_b]),
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
    };
    for _ in 0..cfg.instances {
        run.spawn_instance();
    }

    // The fault plan: kills all along; stops, unlocks, the restart and a failure window at
    // planned times (all from the seed).
    let chaos = cfg.chaos_for.as_secs_f64();
    let mut next_kill = rng.random_range(0.5..2.0);
    let mut stop_at: Vec<f64> = (0..(chaos / 8.0).ceil().max(1.0) as usize)
        .map(|_| rng.random_range(0.1..0.9) * chaos)
        .collect();
    let mut unlock_at: Vec<f64> = (0..2).map(|_| rng.random_range(0.1..0.9) * chaos).collect();
    let mut restart_at = Some(rng.random_range(0.3..0.6) * chaos);
    let failing_bot = BOTS[rng.random_range(0..BOTS.len())];
    let mut failing_from = Some(rng.random_range(0.1..0.7) * chaos);
    let mut failing_until: Option<f64> = None;
    let mut resume: Vec<(f64, usize)> = Vec::new();
    let t0 = Instant::now();
    let mut last_pass: HashMap<String, i64> = HashMap::new();
    let mut refresh_asked: HashMap<String, i64> = HashMap::new();

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
        if t >= next_kill {
            let live = run.live();
            if !live.is_empty() {
                let victim = live[rng.random_range(0..live.len())];
                run.instances[victim].signal(Signal::SIGKILL);
                report.kills += 1;
                run.spawn_instance();
            }
            next_kill = t + rng.random_range(0.5..2.0);
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
        // SIGSTOP a bot's lock holder for longer than ttl (waits for one to appear).
        if let (Some(pos), Some(bots)) = (stop_at.iter().position(|&at| t >= at), &bots) {
            let holder = bots.values().find_map(|d| {
                let by = d.get_str("editingBy").ok()?;
                d.get_bool("isEditing").ok()?.then_some(by.to_owned())
            });
            if let Some(i) = holder.and_then(|by| {
                (0..run.instances.len())
                    .find(|&i| run.instances[i].name == by && !run.instances[i].stopped)
            }) {
                run.instances[i].signal(Signal::SIGSTOP);
                run.instances[i].stopped = true;
                resume.push((t + TTL.as_secs_f64() + rng.random_range(0.5..2.0), i));
                report.stops += 1;
                stop_at.remove(pos);
            }
        }
        // An admin unlock of a bot mid-refresh.
        if let (Some(pos), Some(bots)) = (unlock_at.iter().position(|&at| t >= at), &bots) {
            let editing = bots
                .iter()
                .find(|(_, d)| d.get_bool("isEditing").unwrap_or(false))
                .map(|(bot, _)| bot.clone());
            if let Some(bot) = editing {
                if let Ok(out) = run.admin(&["unlock", &bot, "--reason", "chaos"]).await {
                    if !out.contains("not locked") {
                        report.unlocks += 1;
                        unlock_at.remove(pos);
                    }
                }
            }
        }
        // The database restarts once, data kept.
        if restart_at.is_some_and(|at| t >= at) {
            restart_at = None;
            if database.restartable() {
                database
                    .restart(Duration::from_millis(rng.random_range(300..1500)))
                    .await;
                report.db_restarts += 1;
            } else {
                report.db_restart_skipped = true;
            }
        }
        // A seed source answers 500 for a while: the seeds-only bot's at once (it refreshes
        // every few seconds), a crawling bot's when its next refresh is asked for (so no pass is
        // cut short by a retry that succeeds mid-pass).
        if failing_from.is_some_and(|at| t >= at) && failing_bot == SEEDS_ONLY {
            failing_from = None;
            sources.set_failing(failing_bot, true);
            report.source_failures += 1;
            failing_until = Some(t + rng.random_range(2.0..5.0));
        }
        if failing_until.is_some_and(|until| t >= until) {
            failing_until = None;
            sources.set_failing(failing_bot, false);
        }
        // A crawling bot whose pass ended gets refreshed (a new pass, new seeds).
        if let Some(bots) = &bots {
            for bot in CRAWLING {
                let Some(d) = bots.get(bot) else { continue };
                let pass = d.get_i64("crawlPass").unwrap_or(0);
                let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
                last_pass.insert(bot.to_owned(), pass);
                if pass > 0 && ended && refresh_asked.get(bot) != Some(&pass) {
                    if failing_from.is_some_and(|at| t >= at) && failing_bot == bot {
                        failing_from = None;
                        sources.set_failing(failing_bot, true);
                        report.source_failures += 1;
                        failing_until = Some(t + rng.random_range(2.0..5.0));
                    }
                    if run.admin(&["refresh", bot]).await.is_ok() {
                        refresh_asked.insert(bot.to_owned(), pass);
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Settle: every process running, sources healthy; once each crawling bot's pass is over,
    // one last refresh and its pass must complete, and the seeds-only bot must be ready.
    let settle = Instant::now();
    for (_, i) in resume.drain(..) {
        run.instances[i].signal(Signal::SIGCONT);
        run.instances[i].stopped = false;
    }
    sources.set_failing(failing_bot, false);
    let mut final_pass: HashMap<String, i64> = HashMap::new();
    let mut final_bots: HashMap<String, Document> = HashMap::new();
    let settled = loop {
        if settle.elapsed() > cfg.settle_for {
            break false;
        }
        let served_before: Vec<usize> = BOTS.iter().map(|b| sources.served(b).len()).collect();
        if let Some(bots) = run.bots().await {
            run.observe(&bots);
            // A quiet moment: no bot editing and no seed answer sent meanwhile, so the last
            // answer each source sent belongs to a refresh that has ended.
            let mut done = BOTS
                .iter()
                .map(|b| sources.served(b).len())
                .collect::<Vec<_>>()
                == served_before;
            for bot in BOTS {
                let Some(d) = bots.get(bot) else {
                    done = false;
                    continue;
                };
                let ready = d.get_bool("isReady").unwrap_or(false)
                    && !d.get_bool("isEditing").unwrap_or(true);
                if bot == SEEDS_ONLY {
                    done &= ready;
                    continue;
                }
                let pass = d.get_i64("crawlPass").unwrap_or(0);
                let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
                match final_pass.get(bot) {
                    // Asked for in the chaos phase and not yet served: that refresh is the last.
                    None if refresh_asked.get(bot) == Some(&pass) => {
                        final_pass.insert(bot.to_owned(), pass + 1);
                        done = false;
                    }
                    None if pass > 0 && ended => {
                        if run.admin(&["refresh", bot]).await.is_ok() {
                            final_pass.insert(bot.to_owned(), pass + 1);
                        }
                        done = false;
                    }
                    Some(&want) => done &= ready && pass >= want && ended,
                    None => done = false,
                }
            }
            if done {
                final_bots = bots;
                break true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    report.settle = settle.elapsed();
    if !settled {
        report.violations.push(format!(
            "the run did not settle within {:?} (a bot not ready or its last pass unfinished): {:?}",
            cfg.settle_for,
            run.bots()
                .await
                .map(|b| b
                    .iter()
                    .map(|(k, d)| format!(
                        "{k}: ready={:?} editing={:?} pass={:?} ended={:?}",
                        d.get("isReady"),
                        d.get("isEditing"),
                        d.get("crawlPass"),
                        d.get("crawlPassEndedAt")
                    ))
                    .collect::<Vec<_>>())
        ));
    }
    // Stop everything before reading the logs.
    for inst in &mut run.instances {
        inst.signal(Signal::SIGCONT);
        inst.signal(Signal::SIGTERM);
    }
    for inst in &mut run.instances {
        if tokio::time::timeout(Duration::from_secs(40), inst.child.wait())
            .await
            .is_err()
        {
            let _ = inst.child.kill().await;
            report
                .violations
                .push(format!("{} did not stop within 40 s of SIGTERM", inst.name));
        }
    }
    if let Some(bots) = run.bots().await {
        run.observe(&bots);
    }
    report.instances_started = run.started;
    report.violations.append(&mut run.history_gaps.clone());

    check_history(&run.history, &mut report);
    for (bot, shop) in CRAWLING.iter().zip([&shop_a, &shop_b]) {
        check_records(&run, bot, &shop.base, &mut report).await;
        check_requests(&run, bot, shop, &mut report).await;
    }
    check_seeds(&run, &final_bots, &sources, &mut report);
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

async fn get_json(url: &str) -> Option<serde_json::Value> {
    reqwest::get(url).await.ok()?.json().await.ok()
}

/// 2. Every product has exactly one record, equal to the shop's final state.
async fn check_records(run: &Run, bot: &str, base: &str, report: &mut ChaosReport) {
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
    let mut by_key: HashMap<String, u32> = HashMap::new();
    let (mut wrong, mut removed) = (Vec::new(), Vec::new());
    for r in &records {
        let key = r.get_str("naturalKey").unwrap_or("?").to_owned();
        *by_key.entry(key.clone()).or_default() += 1;
        if !matches!(r.get("removedAt"), None | Some(Bson::Null)) {
            removed.push(key.clone());
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
        ("records marked removed", removed.len()),
    ] {
        if n > 0 {
            report.violations.push(format!(
                "{bot}: {n} {what} (of {} products){}",
                truth.len(),
                match what {
                    "records not equal to the shop" =>
                        format!(", e.g. {:?}", &wrong[..wrong.len().min(3)]),
                    "records marked removed" =>
                        format!(", e.g. {:?}", &removed[..removed.len().min(3)]),
                    _ => String::new(),
                }
            ));
        }
    }
}

/// 3. Repeated requests ≤ interruptions × the in-flight cap. The shop never changes, so each
///    listing page is read once per pass and each product page once in all: the rest repeat.
async fn check_requests(run: &Run, bot: &str, shop: &Shop, report: &mut ChaosReport) {
    let Some(stats) = get_json(&format!("{}/__stats", shop.base)).await else {
        report
            .violations
            .push(format!("{bot}: the shop's stats could not be read"));
        return;
    };
    let passes = run
        .db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": bot })
        .await
        .ok()
        .flatten()
        .and_then(|d| d.get_i64("crawlPass").ok())
        .unwrap_or(0);
    report.passes.insert(bot.to_owned(), passes);
    let (mut total, mut repeated) = (0_u64, 0_u64);
    for (path, n) in stats["paths"].as_object().into_iter().flatten() {
        let n = n.as_u64().unwrap_or(0);
        if path == "/robots.txt" {
            continue; // read once by every process
        }
        total += n;
        let expected = if path.starts_with("/list/") {
            passes.max(0) as u64
        } else {
            1
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
    bots: &HashMap<String, Document>,
    sources: &SeedSources,
    report: &mut ChaosReport,
) {
    if bots.is_empty() {
        return; // the run did not settle: already a violation
    }
    for bot in BOTS {
        let served = sources.served(bot);
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
        let seeds: Vec<String> = d
            .get_array("seeds")
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
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
                "lease lost; stopped without writing" => report.lock_leases_lost += 1,
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
