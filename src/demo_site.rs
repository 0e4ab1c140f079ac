//! `seedlock demo-site`: a small deterministic site to point bots at in the demo, the tests and
//! docker-compose. It serves the seed source — `/seeds.txt` (lines), `/seeds.json` (array) and
//! `/sitemap.xml` — naming its listing pages, and `/__stats` with request counts per path.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct SiteOptions {
    /// Number of listing pages the seeds name.
    pub lists: u32,
}

#[derive(Default)]
struct Stats {
    per_path: BTreeMap<String, u64>,
}

#[derive(Clone)]
struct Site {
    options: SiteOptions,
    stats: Arc<Mutex<Stats>>,
}

/// Serves the site on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    options: SiteOptions,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let site = Site {
        options,
        stats: Arc::default(),
    };
    let app = Router::new()
        .route("/seeds.txt", get(seeds_txt))
        .route("/seeds.json", get(seeds_json))
        .route("/sitemap.xml", get(sitemap))
        .route("/__stats", get(stats))
        .fallback(not_found)
        .with_state(site);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

impl Site {
    fn count(&self, uri: &Uri) {
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        *stats.per_path.entry(uri.path().to_owned()).or_default() += 1;
    }

    /// Absolute listing-page URLs, on the host the client used (so it works behind docker names).
    fn lists(&self, headers: &HeaderMap) -> Vec<String> {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .filter(|h| {
                h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
            })
            .unwrap_or("127.0.0.1");
        (1..=self.options.lists)
            .map(|i| format!("http://{host}/list/{i}"))
            .collect()
    }
}

async fn seeds_txt(State(site): State<Site>, uri: Uri, headers: HeaderMap) -> Response {
    site.count(&uri);
    let body = site.lists(&headers).join("\n") + "\n";
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

async fn seeds_json(State(site): State<Site>, uri: Uri, headers: HeaderMap) -> Response {
    site.count(&uri);
    axum::Json(site.lists(&headers)).into_response()
}

async fn sitemap(State(site): State<Site>, uri: Uri, headers: HeaderMap) -> Response {
    site.count(&uri);
    let mut body = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<urlset xmlns=\"http://www.sitemaps.org/schemas/sitemap/0.9\">\n");
    for url in site.lists(&headers) {
        body.push_str(&format!("  <url><loc>{url}</loc></url>\n"));
    }
    body.push_str("</urlset>\n");
    ([(header::CONTENT_TYPE, "application/xml")], body).into_response()
}

async fn stats(State(site): State<Site>) -> Response {
    let stats = site.stats.lock().unwrap_or_else(|p| p.into_inner());
    axum::Json(&stats.per_path).into_response()
}

async fn not_found(State(site): State<Site>, uri: Uri) -> Response {
    site.count(&uri);
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}
