//! The daemon's HTTP endpoint: `/` (the fleet's status page, [`crate::ops::page`]),
//! `/status.json` (what `seedlock status --json` prints), `/healthz` (200 while the database
//! answers) and `/metrics` in the OpenMetrics text format (what Prometheus negotiates).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::ServerClock;
use crate::ids::{BotId, InstanceId};
use crate::metrics::Metrics;
use crate::ops::overview::Overview;
use crate::ops::page::{self, Serving};
use crate::store::Store;

/// What the status views read: the database, and who is serving them.
#[derive(Clone)]
pub(crate) struct StatusSource {
    pub store: Store,
    pub clock: Arc<ServerClock>,
    /// The bots in this instance's config (shown as `missing` until they have a document).
    pub configured: Vec<(BotId, crate::config::RefreshSchedule)>,
    pub me: InstanceId,
    pub started: std::time::Instant,
    /// The last read, shared for `FRESH_FOR` by every page and JSON request (many open tabs
    /// reloading every 5 s cost the database one read, not one each); one read at a time.
    pub cache: Arc<tokio::sync::Mutex<Option<(std::time::Instant, Overview)>>>,
}

/// How long one read of the fleet serves the status views.
const FRESH_FOR: Duration = Duration::from_secs(2);

impl StatusSource {
    async fn read(&self) -> crate::error::Result<Overview> {
        let mut cached = self.cache.lock().await;
        if let Some((at, fleet)) = cached.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return Ok(fleet.clone());
            }
        }
        let fleet =
            crate::ops::overview::read(&self.store, &self.configured, self.clock.now()).await?;
        *cached = Some((std::time::Instant::now(), fleet.clone()));
        Ok(fleet)
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    stale_after: Duration,
    status: StatusSource,
}

/// Binds `addr` (a bad or busy address is a start-up error) and returns the bound address and the
/// server's future, which ends when `shutdown` fires.
pub(crate) async fn bind(
    addr: &str,
    metrics: Arc<Metrics>,
    stale_after: Duration,
    status: StatusSource,
    shutdown: CancellationToken,
) -> Result<(std::net::SocketAddr, impl std::future::Future<Output = ()>), String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (key `http.listen`): {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let app = Router::new()
        .route("/", get(status_page))
        .route("/status.json", get(status_json))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState {
            metrics,
            stale_after,
            status,
        });
    let server = async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "http endpoint failed");
        }
    };
    Ok((local, server))
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    match state.metrics.since_db_ok() {
        Some(age) if age <= state.stale_after => (StatusCode::OK, "ok\n".to_owned()),
        Some(age) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database last answered {}s ago\n", age.as_secs()),
        ),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "database not reached yet\n".to_owned(),
        ),
    }
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn status_page(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> impl IntoResponse {
    // `?page=N`; anything else shows the first page.
    let number = query
        .get("page")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(1);
    let source = &state.status;
    let serving = Serving {
        instance: source.me.as_str(),
        uptime: source.started.elapsed(),
    };
    let (code, body) = match source.read().await {
        Ok(fleet) => (StatusCode::OK, page::render(&fleet, &serving, number)),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            page::render_unavailable(&e.to_string(), &serving),
        ),
    };
    (
        code,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
}

async fn status_json(State(state): State<AppState>) -> impl IntoResponse {
    let (code, body) = match state.status.read().await {
        Ok(fleet) => (StatusCode::OK, crate::ops::admin::render_json(&fleet.rows)),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "error": e.to_string() }).to_string() + "\n",
        ),
    };
    (
        code,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
}
