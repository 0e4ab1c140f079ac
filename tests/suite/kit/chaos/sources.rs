//! The chaos run's seed sources: one HTTP server per bot whose answers the plan changes and fails.

use super::*;

/// What one seed request was answered.
#[derive(Clone, Debug)]
pub(super) struct Served {
    pub(super) ok: bool,
    pub(super) seeds: Vec<String>,
}

#[derive(Default)]
pub(super) struct SourceState {
    /// Per bot: hits so far, failing flag, what each hit was answered.
    pub(super) hits: HashMap<String, usize>,
    pub(super) failing: HashMap<String, bool>,
    pub(super) served: HashMap<String, Vec<Served>>,
    pub(super) shops: HashMap<String, (String, u32)>,
}

/// `GET /seeds/{bot}`: hit n of a crawling bot names its shop's first listing page and listing
/// page 1 + n mod lists (a seed list that changes every refresh and still leads to the whole
/// shop); the seeds-only bot gets `http://catalog.test/gen{n}/a` and `/b`.
#[derive(Clone)]
pub(super) struct SeedSources {
    pub(super) base: String,
    pub(super) state: Arc<Mutex<SourceState>>,
}

impl SeedSources {
    pub(super) async fn start(shops: HashMap<String, (String, u32)>) -> Self {
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

    pub(super) fn url(&self, bot: &str) -> String {
        format!("{}/seeds/{bot}", self.base)
    }

    pub(super) fn set_failing(&self, bot: &str, failing: bool) {
        self.state
            .lock()
            .unwrap()
            .failing
            .insert(bot.to_owned(), failing);
    }

    pub(super) fn served(&self, bot: &str) -> Vec<Served> {
        self.state
            .lock()
            .unwrap()
            .served
            .get(bot)
            .cloned()
            .unwrap_or_default()
    }
}

pub(super) async fn serve_seeds(
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
