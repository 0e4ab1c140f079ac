//! The daemon's loopback HTTP endpoint: `/healthz` (200 while the database answers) and
//! `/metrics` in the OpenMetrics text format (what Prometheus negotiates).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::ops::metrics::Metrics;

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    stale_after: Duration,
}

/// Binds `addr` (a bad or busy address is a start-up error) and returns the bound address and the
/// server's future, which ends when `shutdown` fires.
pub async fn bind(
    addr: &str,
    metrics: Arc<Metrics>,
    stale_after: Duration,
    shutdown: CancellationToken,
) -> Result<(std::net::SocketAddr, impl std::future::Future<Output = ()>), String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (key `http.listen`): {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState {
            metrics,
            stale_after,
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
