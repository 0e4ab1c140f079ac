//! A seed source whose answers, failures and latency a test controls.

use super::*;

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
