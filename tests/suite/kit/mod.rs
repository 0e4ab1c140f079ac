//! Test harness: a fresh database per test on the real server named by `MONGODB_URI` (started by
//! `scripts/test`), a seed source whose behaviour a test controls, real `seedlock` processes, and
//! `eventually` for awaiting a condition with a deadline.
#![allow(dead_code)]

pub mod blackhole;
pub mod chaos;
pub mod crawl;
pub mod delay;
pub mod faults;
pub mod frontier;
pub mod shop;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, Document};
use mongodb::{Client, Collection, Database};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use seedlock::clock::{LocalClock, ServerClock};
use seedlock::config::{
    BotSettings, LockSettings, OnRefreshFailure, RefreshLimits, RefreshSchedule, SeedFormat,
    SeedSource,
};
use seedlock::ids::{BotId, InstanceId};
use seedlock::metrics::Metrics;
use seedlock::runner::hub::Hub;
use seedlock::runner::{BotRunner, Context};
use seedlock::seeds::SeedReader;
use seedlock::store::Store;
use seedlock::urls::NormalizedUrl;

pub fn mongodb_uri() -> String {
    std::env::var("MONGODB_URI").expect("MONGODB_URI is not set: run the suite with scripts/test")
}

pub struct TestDb {
    pub uri: String,
    pub name: String,
    pub db: Database,
}

/// A database of its own for one test, on the server named by `MONGODB_URI` (or `uri`).
pub async fn test_db(hint: &str) -> TestDb {
    test_db_at(&mongodb_uri(), hint).await
}

pub async fn test_db_at(uri: &str, hint: &str) -> TestDb {
    let suffix: u32 = rand::random();
    let mut name = format!("sl_{hint}_{suffix:08x}");
    name.truncate(60);
    let client = Client::with_uri_str(uri)
        .await
        .expect("a client for the test server");
    let db = client.database(&name);
    TestDb {
        uri: uri.to_owned(),
        name,
        db,
    }
}

impl TestDb {
    pub fn bots(&self) -> Collection<Document> {
        self.db.collection("bots")
    }

    pub async fn doc(&self, bot: &str) -> Option<Document> {
        self.bots()
            .find_one(doc! {"_id": bot})
            .await
            .expect("read the bot document")
    }

    pub async fn epoch(&self, bot: &str) -> i64 {
        let doc = self.doc(bot).await.expect("bot document exists");
        seedlock::store::document::integer(doc.get("lockEpoch").expect("lockEpoch"))
            .expect("integer epoch")
    }

    /// Writes the bot document `d` (its `_id` names the bot) as it is, replacing any.
    pub async fn put_bot(&self, d: Document) {
        let id = d.get("_id").cloned().expect("a bot document has an _id");
        self.bots()
            .replace_one(doc! {"_id": id}, d)
            .upsert(true)
            .await
            .unwrap();
    }

    pub async fn history(&self, bot: &str) -> Vec<Document> {
        let doc = self.doc(bot).await.expect("bot document exists");
        doc.get_array("history")
            .map(|a| a.iter().filter_map(|h| h.as_document().cloned()).collect())
            .unwrap_or_default()
    }

    pub fn store(&self) -> Store {
        Store::new(self.db.clone())
    }
}

/// A JSON answer, or `None` when the request or the body fails.
pub async fn try_get_json(url: &str) -> Option<serde_json::Value> {
    reqwest::get(url).await.ok()?.json().await.ok()
}

/// Polls `check` every 25 ms until it returns true; panics naming `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

// ---- a seed source the test controls --------------------------------------------------------

#[derive(Default)]
pub struct SeedState {
    pub hits: AtomicUsize,
    /// Requests per bot at `/bots/{bot}.txt`.
    per_bot: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    /// While true, every bot's own seed source holds its answer back.
    bots_held: Option<watch::Sender<bool>>,
    /// Requests numbered 1..=stall wait until `release` is called.
    stall: AtomicUsize,
    failing: AtomicBool,
    gate: Option<watch::Sender<bool>>,
}

/// Serves `/seeds.txt`: request n answers `http://site.test/gen{n}/a` and `/b`, so every
/// refresh's seeds are distinguishable; it can stall the first requests or fail with 500.
#[derive(Clone)]
pub struct SeedSourceServer {
    pub addr: std::net::SocketAddr,
    state: Arc<SeedState>,
    gate: watch::Sender<bool>,
}

impl SeedSourceServer {
    pub async fn start() -> Self {
        use axum::routing::get;
        let (gate, _) = watch::channel(false);
        let state = Arc::new(SeedState {
            gate: Some(gate.clone()),
            bots_held: Some(watch::channel(false).0),
            ..Default::default()
        });
        let app = axum::Router::new()
            .route("/seeds.txt", get(serve_seeds))
            .route("/bots/{file}", get(serve_bot_seeds))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { addr, state, gate }
    }

    pub fn url(&self) -> String {
        format!("http://{}/seeds.txt", self.addr)
    }

    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    /// A seed source of bot `bot`'s own: it answers at once (two seeds), and counts its requests
    /// apart from every other bot's ([`bot_hits`](Self::bot_hits)).
    pub fn bot_url(&self, bot: &str) -> String {
        format!("http://{}/bots/{bot}.txt", self.addr)
    }

    /// Requests so far at each bot's own seed source ([`bot_url`](Self::bot_url)).
    pub fn bot_hits(&self) -> std::collections::HashMap<String, usize> {
        self.state.per_bot.lock().unwrap().clone()
    }

    /// Every bot's own seed source holds its answers back (`true`) until released (`false`):
    /// refreshes hang mid-fetch, their locks held.
    pub fn hold_bot_sources(&self, held: bool) {
        if let Some(gate) = &self.state.bots_held {
            gate.send_replace(held);
        }
    }

    /// Requests numbered up to `n` (counting from the first ever) hang until
    /// [`release`](Self::release); calling it again re-arms the gate.
    pub fn stall_first(&self, n: usize) {
        self.gate.send_replace(false);
        self.state.stall.store(n, Ordering::SeqCst);
    }

    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    pub fn set_failing(&self, failing: bool) {
        self.state.failing.store(failing, Ordering::SeqCst);
    }

    pub fn seeds_of_hit(n: usize) -> Vec<String> {
        vec![
            format!("http://site.test/gen{n}/a"),
            format!("http://site.test/gen{n}/b"),
        ]
    }
}

async fn serve_bot_seeds(
    axum::extract::State(state): axum::extract::State<Arc<SeedState>>,
    axum::extract::Path(file): axum::extract::Path<String>,
) -> String {
    let bot = file.trim_end_matches(".txt").to_owned();
    *state
        .per_bot
        .lock()
        .unwrap()
        .entry(bot.clone())
        .or_default() += 1;
    if let Some(gate) = &state.bots_held {
        let mut held = gate.subscribe();
        let _ = held.wait_for(|held| !*held).await;
    }
    format!("http://site.test/{bot}/a\nhttp://site.test/{bot}/b\n")
}

async fn serve_seeds(
    axum::extract::State(state): axum::extract::State<Arc<SeedState>>,
) -> (axum::http::StatusCode, String) {
    let n = state.hits.fetch_add(1, Ordering::SeqCst) + 1;
    if n <= state.stall.load(Ordering::SeqCst) {
        let mut open = state.gate.as_ref().expect("gate").subscribe();
        let _ = open.wait_for(|open| *open).await;
    }
    if state.failing.load(Ordering::SeqCst) {
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "down\n".into(),
        );
    }
    (
        axum::http::StatusCode::OK,
        SeedSourceServer::seeds_of_hit(n).join("\n") + "\n",
    )
}

// ---- in-process runners ----------------------------------------------------------------------

pub fn lock(ttl_ms: u64, max_refresh_ms: u64, poll_ms: u64) -> LockSettings {
    LockSettings {
        ttl: Duration::from_millis(ttl_ms),
        heartbeat: Duration::from_millis(ttl_ms / 3),
        max_refresh: Duration::from_millis(max_refresh_ms),
        stuck_grace: Duration::from_millis(ttl_ms),
        poll: Duration::from_millis(poll_ms),
    }
}

pub fn limits() -> RefreshLimits {
    RefreshLimits {
        timeout: Duration::from_secs(30),
        max_bytes: 1 << 20,
        max_seeds: 1000,
        attempts: 1,
        // Long enough that a test's next step always lands inside the backoff after a failure.
        backoff_base: Duration::from_secs(2),
        backoff_max: Duration::from_secs(5),
        sitemap_depth: 2,
        user_agent: "seedlock-test".into(),
        concurrency: seedlock::config::DEFAULT_REFRESH_CONCURRENCY,
    }
}

pub fn bot(
    id: &str,
    source_url: &str,
    refresh: RefreshSchedule,
    on_failure: OnRefreshFailure,
) -> BotSettings {
    BotSettings {
        id: BotId::parse(id).unwrap(),
        seeds: SeedSource::Url {
            url: NormalizedUrl::parse(source_url).unwrap(),
            format: SeedFormat::Lines,
        },
        refresh,
        on_refresh_failure: on_failure,
        crawl: None,
    }
}

/// An instance's context in this process, with its clock synced to the server.
pub async fn context(db: &TestDb, me: &str, lock: LockSettings, local: LocalClock) -> Arc<Context> {
    context_with_permits(
        db,
        me,
        lock,
        local,
        seedlock::config::DEFAULT_REFRESH_CONCURRENCY,
    )
    .await
}

/// [`context`] with `permits` refreshes at once (`refresh.concurrency`).
pub async fn context_with_permits(
    db: &TestDb,
    me: &str,
    lock: LockSettings,
    local: LocalClock,
    permits: usize,
) -> Arc<Context> {
    let store = db.store();
    let clock = Arc::new(ServerClock::new(local));
    for _ in 0..3 {
        store
            .sync_clock(&clock)
            .await
            .expect("hello answers with localTime");
    }
    Arc::new(Context {
        store: store.clone(),
        clock: clock.clone(),
        me: InstanceId::parse(me).unwrap(),
        started_at: clock.now(),
        lock,
        fetcher: SeedReader::new(limits()).unwrap(),
        metrics: Arc::new(Metrics::new()),
        refresh_backoff: (limits().backoff_base, limits().backoff_max),
        crawl: None,
        hub: Hub::new(store, clock.clone(), lock, permits),
    })
}

pub fn runner(bot: BotSettings, ctx: Arc<Context>) -> BotRunner {
    BotRunner::new(bot, ctx)
}

// ---- real processes --------------------------------------------------------------------------

/// A config file for processes; `bots` is raw TOML for the `[[bots]]` entries.
pub struct ProcConfig<'a> {
    pub uri: &'a str,
    pub database: &'a str,
    pub ttl: &'a str,
    pub max_refresh: &'a str,
    pub poll: &'a str,
    /// `refresh.backoff_base` and `refresh.backoff_max` (failed refreshes back off between them).
    pub backoff: (&'a str, &'a str),
    pub bots: String,
    pub extra: &'a str,
}

impl<'a> ProcConfig<'a> {
    /// The defaults most tests use: ttl 5 s, max_refresh 60 s, poll 200 ms.
    pub fn new(db: &'a TestDb, bots: String) -> Self {
        ProcConfig {
            uri: &db.uri,
            database: &db.name,
            ttl: "5s",
            max_refresh: "60s",
            poll: "200ms",
            backoff: ("200ms", "1s"),
            bots,
            extra: "",
        }
    }

    pub fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join(format!("seedlock-{}.toml", rand::random::<u32>()));
        let text = format!(
            "[mongo]\nuri = \"{}\"\ndatabase = \"{}\"\nconnect_timeout = \"2s\"\n[lock]\nttl = \"{}\"\nmax_refresh = \"{}\"\npoll = \"{}\"\n[refresh]\nattempts = 1\nbackoff_base = \"{}\"\nbackoff_max = \"{}\"\n[http]\nlisten = \"off\"\n{}\n{}\n",
            self.uri,
            self.database,
            self.ttl,
            self.max_refresh,
            self.poll,
            self.backoff.0,
            self.backoff.1,
            self.extra,
            self.bots
        );
        std::fs::write(&path, text).unwrap();
        path
    }
}

pub fn url_bot(id: &str, url: &str) -> String {
    format!("[[bots]]\nid = \"{id}\"\nseeds = {{ url = \"{url}\", format = \"lines\" }}\n")
}

/// The `seedlock` binary: cargo's for the tests, `SEEDLOCK_BIN` for the examples.
pub fn seedlock_bin() -> PathBuf {
    option_env!("CARGO_BIN_EXE_seedlock")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("SEEDLOCK_BIN").map(PathBuf::from))
        .expect("the seedlock binary (SEEDLOCK_BIN)")
}

pub struct Proc {
    pub name: String,
    child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Proc {
    /// Starts `seedlock -c CONFIG ARGS…` as instance `name`. The test's own `MONGODB_URI` is not
    /// passed down: the config file says which server to use.
    pub fn spawn(
        dir: &Path,
        config: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let stdout = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.err"));
        let mut cmd = Command::new(seedlock_bin());
        cmd.arg("-c")
            .arg(config)
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .env_remove("SEEDLOCK_HTTP_LISTEN")
            .env("SEEDLOCK_INSTANCE_ID", name)
            .env("SEEDLOCK_LOG", "info,seedlock=debug")
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn seedlock");
        Proc {
            name: name.to_owned(),
            child,
            stdout,
            stderr,
        }
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id().expect("process is running") as i32)
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), sig).expect("send signal");
    }

    pub async fn kill9(&mut self) {
        self.child.kill().await.expect("SIGKILL");
    }

    pub async fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.expect("wait for seedlock"),
            Err(_) => panic!(
                "{} did not exit within {timeout:?}; stderr:\n{}",
                self.name,
                self.log()
            ),
        }
    }

    /// The HTTP address (status page, `/healthz`, `/metrics`) of a process started with
    /// `SEEDLOCK_HTTP_LISTEN=127.0.0.1:0`, once its log says it serves them.
    pub async fn http_addr(&self) -> String {
        eventually("the endpoint is up", Duration::from_secs(20), || async {
            self.log().contains("serving the status page")
        })
        .await;
        let log = self.log();
        log.split("addr=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .expect("the log names the address")
            .to_owned()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn out(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Waits for the process to exit and asserts it succeeded and logged no panic; the failure
    /// message carries its log.
    pub async fn expect_ok(&mut self, timeout: Duration) {
        let status = self.wait(timeout).await;
        assert!(
            status.success(),
            "{} exited {status}:\n{}",
            self.name,
            self.log()
        );
        self.assert_clean();
    }

    /// Asserts what every process must satisfy: no panic, no unhandled error.
    pub fn assert_clean(&self) {
        let log = self.log();
        assert!(!log.contains("panicked"), "{} panicked:\n{log}", self.name);
    }
}

/// Starts a SecantusDB server of this test's own on `storage` (for restarts). None when the
/// suite runs against an outside `MONGODB_URI` without the binary.
pub struct OwnServer {
    pub uri: String,
    port: u16,
    storage: PathBuf,
    child: Option<std::process::Child>,
    bin: PathBuf,
}

impl OwnServer {
    pub fn available() -> Option<PathBuf> {
        std::env::var_os("SEEDLOCK_TEST_SERVER_BIN")
            .map(PathBuf::from)
            .filter(|p| p.exists())
    }

    pub async fn start(bin: PathBuf, storage: &Path) -> OwnServer {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut server = OwnServer {
            uri: format!("mongodb://127.0.0.1:{port}/?directConnection=true"),
            port,
            storage: storage.to_owned(),
            child: None,
            bin,
        };
        server.restart().await;
        server
    }

    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the server first");
        let child = std::process::Command::new(&self.bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--log-level",
                "WARNING",
            ])
            .args([
                "--log-file-max",
                "16MB",
                "--cache-size",
                "256M",
                "--storage-path",
            ])
            .arg(&self.storage)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start secantusd-rs");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        eventually(
            "the restarted server accepts connections",
            Duration::from_secs(30),
            || {
                let addr = addr.clone();
                async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
            },
        )
        .await;
    }

    /// Stops the server as an operator would: SIGTERM, SIGKILL after 10 s.
    pub async fn stop_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
    }
}
