//! `seedlock demo-site`: a deterministic shop to crawl in the demo, the tests and the benchmarks.
//!
//! - Listing pages `/list/1…` (newest products first), `per_list` items each, linked by
//!   pagination (`a.next`, `a.prev`). Each item is `.item[data-id]` with `.title`, `.price`,
//!   `.status` and a link to `/product/<sku>`.
//! - Product pages `/product/<sku>` with `.sku`, `h1`, `.price`, `.status` and a schema.org
//!   `Product` in JSON-LD (`sku`, `name`, `offers.price`, `offers.availability`); they carry an
//!   `ETag` and `Last-Modified` and answer conditional GETs with `304`. The same page is at
//!   `/product/<sku>/<anything>`, its `rel=canonical` naming `/product/<sku>`.
//! - A cookie gate: `/members` sets `member=yes` (path `/members`) and links to
//!   `/members/list/1`; `/members/list/<page>` is listing page `page` for a client that sends
//!   the cookie back, `403` for one that does not.
//! - The same catalogue as a JSON API: `/api/products?page=N` (`products`, each with `id`,
//!   `url`, `title`, `price.amount`, `status`, `updated`; `next` the next page's URL) and
//!   `/api/product/<sku>` (one product, with `sku`).
//! - The seed source: `/seeds.txt` and `/seeds.json` (the first listing page), `/sitemap.xml`
//!   (every listing page).
//! - Sitemaps of the products, gzipped: `/sitemaps/index.xml.gz` (an index, each file with the
//!   `lastmod` of its newest change) and `/sitemaps/products-N.xml.gz` (`sitemap_urls` products
//!   a file, by SKU, each with the `lastmod` of its last change: a mutation moves it).
//! - With `calendar`, a crawl trap: every listing page links to `/calendar/2026-01`, and each
//!   month's page to the months before and after it, without end.
//! - Control: `POST /__mutate` `{"change": K, "add": K, "delete": K, "remove": [SKU…]}` answers which products it
//!   touched; `POST /__faults` installs fault rules (latency, a status such as 429 with
//!   `Retry-After`, huge bodies, gzip bombs, redirect loops or redirects elsewhere) on path
//!   patterns, `DELETE /__faults` clears them; `POST /__layout` `{"price_class": "cost"}`
//!   renames the price's class on every page (a layout drift), `DELETE /__layout` undoes it;
//!   `GET /__stats` counts requests per path and
//!   responses per `Content-Encoding`; `GET /__truth` lists every current product;
//!   `POST /__robots` sets the text of `/robots.txt` (404 until then); `GET /__headers` shows the
//!   request headers received (each name with its distinct values), to check what a bot sends.
//! - Every answer is compressed (gzip, deflate, brotli or zstd) when the request's
//!   `Accept-Encoding` asks for it, as shops serve pages.
//!
//! The same `--seed` gives the same catalogue and the same sequence of mutations.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tower_http::compression::predicate::{DefaultPredicate, NotForContentType, Predicate};

#[derive(Clone, Debug)]
pub struct SiteOptions {
    /// Listing pages at the start (the catalogue holds `lists × per_list` products).
    pub lists: u32,
    /// Products per listing page.
    pub per_list: u32,
    /// Seed of the catalogue and of every mutation.
    pub seed: u64,
    /// SKUs are `PREFIX-0000001`…: shops with different prefixes sell different products (a
    /// crawl of several shops, one per port, stores them apart).
    pub sku_prefix: String,
    /// Product URLs per file of the gzipped sitemaps (`/sitemaps/…`), at most 50,000.
    pub sitemap_urls: u32,
    /// A crawl trap: every listing page links to `/calendar/2026-01`, and each month's page to
    /// the months before and after it, without end.
    pub calendar: bool,
}

impl Default for SiteOptions {
    fn default() -> Self {
        Self {
            lists: 5,
            per_list: 20,
            seed: 1,
            sku_prefix: "SKU".into(),
            sitemap_urls: 50_000,
            calendar: false,
        }
    }
}

/// The `[bots.crawl]` rules that crawl this shop (TOML): its listing items (id, detail link,
/// fingerprint, `data-updated`), its product pages' records (`natural_key`: `.sku`, unless a
/// test wants another) and the hosts in `scope`. Callers add `[bots.crawl.incremental]` and any
/// other key; every test, benchmark and chaos run crawls the shop with these.
pub fn crawl_rules_toml(scope: &[&str], natural_key: &str) -> String {
    let scope: Vec<String> = scope.iter().map(|h| format!("{h:?}")).collect();
    format!(
        r#"[bots.crawl]
scope = [{scope}]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
updated_at = "@data-updated"
[bots.crawl.record]
match = "/product/"
natural_key = "{natural_key}"
fields = {{ title = "h1", price = ".price", status = ".status" }}
"#,
        scope = scope.join(", ")
    )
}

/// The `[bots.crawl]` rules that crawl this shop from sitemaps (TOML): no listing rules — the
/// items come from the sitemap files `sitemaps` names (such as `/sitemaps/index.xml.gz`, each
/// product's `lastmod` its fingerprint) — and the product pages' records as
/// [`crawl_rules_toml`] reads them; `follow` names the links an HTML seed page leads to.
pub fn sitemap_rules_toml(scope: &[&str], sitemaps: &[&str], follow: &str) -> String {
    let quoted = |list: &[&str]| {
        list.iter()
            .map(|h| format!("{h:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        r#"[bots.crawl]
scope = [{scope}]
sitemaps = [{sitemaps}]
follow = {follow:?}
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = {{ title = "h1", price = ".price", status = ".status" }}
"#,
        scope = quoted(scope),
        sitemaps = quoted(sitemaps),
    )
}

/// The `[bots.crawl]` rules that crawl this shop's JSON API (TOML): `/api/products` pages
/// (seed the first, `?page=1`) followed by `next`, their items by `id` with `price.amount`,
/// `status` and `title` as the fingerprint, `/api/product/<sku>` records with the price a
/// number.
pub fn api_rules_toml(scope: &[&str]) -> String {
    let scope: Vec<String> = scope.iter().map(|h| format!("{h:?}")).collect();
    format!(
        r#"[bots.crawl]
scope = [{scope}]
follow = "$.next"
[bots.crawl.list]
item = "$.products[*]"
item_id = "$.id"
item_link = "$.url"
fingerprint = ["$.price.amount", "$.status", "$.title"]
updated_at = "$.updated"
[bots.crawl.record]
match = "/api/product/"
natural_key = "$.sku"
fields = {{ title = "$.title", price = "$.price.amount", status = "$.status" }}
"#,
        scope = scope.join(", ")
    )
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct Product {
    pub sku: String,
    pub title: String,
    pub price: String,
    pub status: String,
    #[serde(skip)]
    changed_at: DateTime<Utc>,
}

struct Catalog {
    /// Newest first: the order of the listing pages.
    products: Vec<Product>,
    /// Position of each SKU in `products` (rebuilt after every mutation).
    by_sku: std::collections::HashMap<String, usize>,
    per_list: usize,
    rng: StdRng,
    next_sku: u64,
    stats: BTreeMap<String, u64>,
    faults: Vec<FaultRule>,
    /// The class of the price's element on listing and product pages (`POST /__layout` renames
    /// it: a layout drift).
    price_class: String,
    sku_prefix: String,
    /// `GET /robots.txt` (`POST /__robots` sets it); `None`: 404.
    robots: Option<String>,
    /// Requests being answered now (for `max_in_flight` fault rules).
    in_flight: u64,
    /// The last [`MAX_LOG`] requests: path and arrival (Unix milliseconds), for tests that look
    /// at timing (`GET /__stats?log=true`).
    log: std::collections::VecDeque<(String, i64)>,
    /// Request headers received: each name with its distinct values (bounded), for
    /// `GET /__headers`.
    headers: BTreeMap<String, std::collections::BTreeSet<String>>,
    /// Responses sent, by `Content-Encoding` (`identity` without one), for `GET /__stats`.
    encodings: BTreeMap<String, u64>,
    /// Product URLs per sitemap file.
    sitemap_urls: usize,
    /// Listing pages link to the calendar trap.
    calendar: bool,
}

const MAX_LOG: usize = 100_000;

const ADJECTIVES: &[&str] = &[
    "Blue", "Quiet", "Sturdy", "Tiny", "Golden", "Rustic", "Swift", "Bright", "Soft", "Classic",
];
const NOUNS: &[&str] = &[
    "Lamp", "Chair", "Kettle", "Backpack", "Clock", "Mug", "Desk", "Blanket", "Speaker", "Vase",
];

impl Catalog {
    fn new(options: &SiteOptions) -> Self {
        let mut catalog = Catalog {
            products: Vec::new(),
            by_sku: Default::default(),
            per_list: options.per_list.max(1) as usize,
            rng: StdRng::seed_from_u64(options.seed),
            next_sku: 1,
            stats: BTreeMap::new(),
            faults: Vec::new(),
            price_class: "price".into(),
            sku_prefix: options.sku_prefix.clone(),
            robots: None,
            in_flight: 0,
            log: Default::default(),
            headers: Default::default(),
            encodings: Default::default(),
            sitemap_urls: options.sitemap_urls.clamp(1, 50_000) as usize,
            calendar: options.calendar,
        };
        let total = u64::from(options.lists) * u64::from(options.per_list);
        let now = Utc::now();
        let mut initial: Vec<Product> = (0..total).map(|_| catalog.new_product(now)).collect();
        initial.reverse(); // the highest SKU is the newest
        catalog.products = initial;
        catalog.reindex();
        catalog
    }

    /// Counts a request in the per-path table (at most [`MAX_STATS_PATHS`] paths; the rest
    /// under "(other)") and the request log.
    /// The fault rule (without a concurrency limit) whose turn it is for a request of `path`:
    /// every matching rule counts the request, and the first whose `every` comes round (and
    /// whose `times` are not used up) applies.
    fn next_fault(&mut self, path: &str) -> Option<FaultRule> {
        for rule in self.faults.iter_mut().filter(|r| {
            path.contains(&r.path)
                && r.max_in_flight.is_none()
                && r.times.is_none_or(|t| r.applied < t)
        }) {
            rule.seen += 1;
            if rule.seen % rule.every.max(1) == 0 {
                rule.applied += 1;
                return Some(rule.clone());
            }
        }
        None
    }

    fn count_request(&mut self, path: &str) {
        let key = if self.stats.len() < MAX_STATS_PATHS || self.stats.contains_key(path) {
            path.to_owned()
        } else {
            "(other)".to_owned()
        };
        *self.stats.entry(key).or_default() += 1;
        self.log_request(path);
    }

    fn log_request(&mut self, path: &str) {
        if self.log.len() == MAX_LOG {
            self.log.pop_front();
        }
        self.log
            .push_back((path.to_owned(), Utc::now().timestamp_millis()));
    }

    fn new_product(&mut self, now: DateTime<Utc>) -> Product {
        let n = self.next_sku;
        self.next_sku += 1;
        let title = format!(
            "{} {} {n}",
            ADJECTIVES[self.rng.random_range(0..ADJECTIVES.len())],
            NOUNS[self.rng.random_range(0..NOUNS.len())]
        );
        Product {
            sku: format!("{}-{n:07}", self.sku_prefix),
            title,
            price: self.random_price(),
            status: if self.rng.random_bool(0.85) {
                "in stock"
            } else {
                "sold out"
            }
            .to_owned(),
            changed_at: now,
        }
    }

    fn random_price(&mut self) -> String {
        let cents: u32 = self.rng.random_range(100..100_000);
        format!("${}.{:02}", cents / 100, cents % 100)
    }

    fn pages(&self) -> usize {
        self.products.len().div_ceil(self.per_list).max(1)
    }

    fn find(&self, sku: &str) -> Option<&Product> {
        self.by_sku.get(sku).map(|&i| &self.products[i])
    }

    fn reindex(&mut self) {
        self.by_sku = self
            .products
            .iter()
            .enumerate()
            .map(|(i, p)| (p.sku.clone(), i))
            .collect();
    }

    /// Picks `k` distinct random positions (deterministic for the seed).
    fn pick(&mut self, k: usize) -> Vec<usize> {
        let k = k.min(self.products.len());
        rand::seq::index::sample(&mut self.rng, self.products.len(), k).into_vec()
    }

    fn mutate(&mut self, request: &Mutation) -> MutationReport {
        let now = Utc::now();
        let mut report = MutationReport::default();
        for i in self.pick(request.change) {
            let mut price = self.random_price();
            while price == self.products[i].price {
                price = self.random_price();
            }
            self.products[i].price = price;
            self.products[i].changed_at = now;
            report.changed.push(self.products[i].sku.clone());
        }
        let mut delete = self.pick(request.delete);
        delete.extend(
            request
                .remove
                .iter()
                .filter_map(|sku| self.by_sku.get(sku).copied()),
        );
        delete.sort_unstable_by(|a, b| b.cmp(a));
        delete.dedup();
        for i in delete {
            report.deleted.push(self.products.remove(i).sku);
        }
        for _ in 0..request.add {
            let product = self.new_product(now);
            report.added.push(product.sku.clone());
            self.products.insert(0, product);
        }
        self.reindex();
        report
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Mutation {
    pub change: usize,
    pub add: usize,
    pub delete: usize,
    /// These products (by SKU) are deleted too.
    pub remove: Vec<String>,
}

#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MutationReport {
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub deleted: Vec<String>,
}

/// One fault rule: applies to requests whose path contains `path`, to every `every`-th of them.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FaultRule {
    pub path: String,
    #[serde(default)]
    pub latency_ms: u64,
    /// Answer with this status instead of the page (e.g. 429, 503).
    pub status: Option<u16>,
    /// `Retry-After` value sent with `status`.
    pub retry_after: Option<String>,
    /// Answer with a body of this many bytes instead of the page.
    pub huge_body_bytes: Option<usize>,
    /// Answer with a gzip-encoded body that inflates to this many bytes (at most 4 GiB) from
    /// about a thousandth of that: a decompression bomb.
    pub gzip_bomb_bytes: Option<u64>,
    /// Redirect to the same path again (a loop).
    #[serde(default)]
    pub redirect_loop: bool,
    /// Redirect (`302`) to this URL, anywhere.
    pub redirect_to: Option<String>,
    #[serde(default = "one")]
    pub every: u64,
    /// Applies at most this many times (then the rule is spent).
    pub times: Option<u64>,
    /// With this, `status` answers only requests that find more than this many requests (to
    /// matching paths) in flight — a site that throttles concurrency; `latency_ms` applies to
    /// every matching request.
    pub max_in_flight: Option<u64>,
    #[serde(skip)]
    seen: u64,
    #[serde(skip)]
    applied: u64,
}

fn one() -> u64 {
    1
}

type Shared = Arc<Mutex<Catalog>>;

/// Bounds on what a control request may ask for, so the demo site itself stays up.
const MAX_HUGE_BODY: usize = 256 * 1024 * 1024;
const MAX_BOMB: u64 = 4 << 30;
const MAX_MUTATION: usize = 1_000_000;
const MAX_STATS_PATHS: usize = 100_000;
const MAX_HEADER_NAMES: usize = 64;
const MAX_HEADER_VALUES: usize = 16;

/// Notes every request's headers (but `/__headers`' own) for `GET /__headers`, and counts the
/// response by its `Content-Encoding` for `GET /__stats`.
async fn note_headers(
    State(c): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.uri().path() != "/__headers" {
        let mut catalog = lock(&c);
        for (name, value) in request.headers() {
            let room = catalog.headers.len() < MAX_HEADER_NAMES;
            let known = catalog.headers.contains_key(name.as_str());
            if !room && !known {
                continue;
            }
            let values = catalog.headers.entry(name.as_str().to_owned()).or_default();
            if values.len() < MAX_HEADER_VALUES {
                values.insert(String::from_utf8_lossy(value.as_bytes()).into_owned());
            }
        }
    }
    let response = next.run(request).await;
    let encoding = response
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity");
    let mut catalog = lock(&c);
    if catalog.encodings.len() < MAX_HEADER_VALUES || catalog.encodings.contains_key(encoding) {
        *catalog.encodings.entry(encoding.to_owned()).or_default() += 1;
    }
    drop(catalog);
    response
}

/// `GET /__headers`: `{"name": ["value", …], …}` for every request header received so far.
async fn headers_seen(State(c): State<Shared>) -> Response {
    Json(serde_json::json!(lock(&c).headers)).into_response()
}

/// Serves the site on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    options: SiteOptions,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let catalog: Shared = Arc::new(Mutex::new(Catalog::new(&options)));
    let app = Router::new()
        .route("/seeds.txt", get(seeds_txt))
        .route("/seeds.json", get(seeds_json))
        .route("/sitemap.xml", get(sitemap))
        .route("/sitemaps/index.xml.gz", get(sitemap_index))
        .route("/sitemaps/{file}", get(sitemap_file))
        .route("/calendar/{month}", get(calendar_month))
        .route("/list/{page}", get(list_page))
        .route("/product/{sku}", get(product_page))
        .route("/product/{sku}/{variant}", get(product_variant))
        .route("/members", get(members_gate))
        .route("/members/list/{page}", get(members_list))
        .route("/api/products", get(api_products))
        .route("/api/product/{sku}", get(api_product))
        .route("/__mutate", post(mutate))
        .route("/__faults", post(set_faults).delete(clear_faults))
        .route("/__layout", post(set_layout).delete(clear_layout))
        .route("/__stats", get(stats))
        .route("/robots.txt", get(robots_txt))
        .route("/__robots", post(set_robots))
        .route("/__truth", get(truth))
        .route("/__headers", get(headers_seen))
        .fallback(not_found)
        // Compressed when the client asks (`Accept-Encoding`), as shops serve pages.
        .layer(
            tower_http::compression::CompressionLayer::new().compress_when(
                DefaultPredicate::new().and(NotForContentType::const_new("application/gzip")),
            ),
        )
        .layer(axum::middleware::from_fn_with_state(
            catalog.clone(),
            note_headers,
        ))
        .with_state(catalog);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

fn lock(catalog: &Shared) -> std::sync::MutexGuard<'_, Catalog> {
    catalog.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a fault rule decided for one request.
enum Fault {
    None,
    Respond(Response),
}

/// Counts the request and applies the first matching fault rule whose `every` count comes up
/// (each matching rule counts the request), after its latency.
async fn visit(catalog: &Shared, uri: &Uri) -> Fault {
    let path = uri.path().to_owned();
    // Counts this request in flight while a concurrency rule holds it.
    struct InFlight<'a>(&'a Shared);
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            let mut c = lock(self.0);
            c.in_flight = c.in_flight.saturating_sub(1);
        }
    }
    let limited = {
        let mut c = lock(catalog);
        let rule = c
            .faults
            .iter()
            .find(|r| r.max_in_flight.is_some() && path.contains(&r.path))
            .cloned();
        rule.map(|rule| {
            c.in_flight += 1;
            (
                rule.clone(),
                c.in_flight > rule.max_in_flight.unwrap_or(u64::MAX),
            )
        })
    };
    if let Some((rule, over)) = limited {
        let _in_flight = InFlight(catalog);
        lock(catalog).count_request(&path);
        if over {
            let status = StatusCode::from_u16(rule.status.unwrap_or(429))
                .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
            return Fault::Respond(status_response(
                status,
                "too many requests at once\n",
                rule.retry_after.as_deref(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(rule.latency_ms)).await;
        return Fault::None;
    }
    let rule = {
        let mut c = lock(catalog);
        c.count_request(&path);
        c.next_fault(&path)
    };
    let Some(rule) = rule else { return Fault::None };
    if rule.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(rule.latency_ms)).await;
    }
    if rule.redirect_loop {
        return Fault::Respond((StatusCode::FOUND, [(header::LOCATION, path)]).into_response());
    }
    if let Some(to) = &rule.redirect_to {
        return Fault::Respond(
            (StatusCode::FOUND, [(header::LOCATION, to.clone())]).into_response(),
        );
    }
    if let Some(status) = rule.status {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Fault::Respond(status_response(
            status,
            "fault injected\n",
            rule.retry_after.as_deref(),
        ));
    }
    if let Some(bytes) = rule.gzip_bomb_bytes {
        let body = match tokio::task::spawn_blocking(move || gzip_bomb(bytes.min(MAX_BOMB))).await {
            Ok(body) => body,
            Err(_) => return Fault::Respond(StatusCode::INTERNAL_SERVER_ERROR.into_response()),
        };
        return Fault::Respond(
            (
                [
                    (header::CONTENT_TYPE, "text/html"),
                    (header::CONTENT_ENCODING, "gzip"),
                ],
                body,
            )
                .into_response(),
        );
    }
    if let Some(bytes) = rule.huge_body_bytes {
        let body = "x".repeat(bytes.min(MAX_HUGE_BODY));
        return Fault::Respond(([(header::CONTENT_TYPE, "text/html")], body).into_response());
    }
    Fault::None
}

/// `bytes` spaces, gzip-compressed as tightly as gzip goes (about 1,000 to 1).
fn gzip_bomb(bytes: u64) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let block = vec![b' '; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        // Writing into memory cannot fail.
        let _ = encoder.write_all(&block[..n]);
        left -= n as u64;
    }
    encoder.finish().unwrap_or_default()
}

/// A fault's answer: `status` with `body`, and `Retry-After` when the rule names one.
fn status_response(status: StatusCode, body: &'static str, retry_after: Option<&str>) -> Response {
    let mut response = (status, body).into_response();
    if let Some(value) = retry_after.and_then(|v| HeaderValue::from_str(v).ok()) {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

macro_rules! fault_first {
    ($catalog:expr, $uri:expr) => {
        if let Fault::Respond(response) = visit(&$catalog, &$uri).await {
            return response;
        }
    };
}

fn host(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
        })
        .unwrap_or("127.0.0.1")
        .to_owned()
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

async fn seeds_txt(State(c): State<Shared>, uri: Uri, headers: HeaderMap) -> Response {
    fault_first!(c, uri);
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("http://{}/list/1\n", host(&headers)),
    )
        .into_response()
}

async fn seeds_json(State(c): State<Shared>, uri: Uri, headers: HeaderMap) -> Response {
    fault_first!(c, uri);
    Json(vec![format!("http://{}/list/1", host(&headers))]).into_response()
}

async fn sitemap(State(c): State<Shared>, uri: Uri, headers: HeaderMap) -> Response {
    fault_first!(c, uri);
    let pages = lock(&c).pages();
    let host = host(&headers);
    let mut body = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<urlset xmlns=\"http://www.sitemaps.org/schemas/sitemap/0.9\">\n");
    for page in 1..=pages {
        body.push_str(&format!(
            "  <url><loc>http://{host}/list/{page}</loc></url>\n"
        ));
    }
    body.push_str("</urlset>\n");
    ([(header::CONTENT_TYPE, "application/xml")], body).into_response()
}

/// The products by SKU, in files of `sitemap_urls`: each file's (products, newest change).
fn sitemap_files(catalog: &Catalog) -> Vec<(Vec<&Product>, DateTime<Utc>)> {
    let mut by_sku: Vec<&Product> = catalog.products.iter().collect();
    by_sku.sort_unstable_by(|a, b| a.sku.cmp(&b.sku));
    by_sku
        .chunks(catalog.sitemap_urls)
        .map(|chunk| {
            let newest = chunk.iter().map(|p| p.changed_at).max().unwrap_or_default();
            (chunk.to_vec(), newest)
        })
        .collect()
}

fn w3c(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A gzip file, as `.xml.gz` sitemaps are served (the compression layer leaves it alone).
fn gzip_file(xml: &str) -> Response {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let _ = encoder.write_all(xml.as_bytes());
    match encoder.finish() {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/gzip")], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

const SITEMAP_NS: &str = "http://www.sitemaps.org/schemas/sitemap/0.9";

/// `GET /sitemaps/index.xml.gz`: a gzipped sitemap index of the product sitemaps, each with the
/// `lastmod` of its newest change.
async fn sitemap_index(State(c): State<Shared>, uri: Uri, headers: HeaderMap) -> Response {
    fault_first!(c, uri);
    let host = host(&headers);
    let xml = {
        let catalog = lock(&c);
        let mut xml = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<sitemapindex xmlns=\"{SITEMAP_NS}\">\n"
        );
        for (i, (_, newest)) in sitemap_files(&catalog).iter().enumerate() {
            xml.push_str(&format!(
                "  <sitemap><loc>http://{host}/sitemaps/products-{}.xml.gz</loc><lastmod>{}</lastmod></sitemap>\n",
                i + 1,
                w3c(*newest)
            ));
        }
        xml.push_str("</sitemapindex>\n");
        xml
    };
    gzip_file(&xml)
}

/// `GET /sitemaps/products-N.xml.gz`: a gzipped sitemap of the products of file N (by SKU),
/// each with the `lastmod` of its last change.
async fn sitemap_file(
    State(c): State<Shared>,
    uri: Uri,
    headers: HeaderMap,
    Path(file): Path<String>,
) -> Response {
    fault_first!(c, uri);
    let n = file
        .strip_prefix("products-")
        .and_then(|f| f.strip_suffix(".xml.gz"))
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|n| *n >= 1);
    let host = host(&headers);
    let xml = {
        let catalog = lock(&c);
        let files = sitemap_files(&catalog);
        let Some((products, _)) = n.and_then(|n| files.get(n - 1)) else {
            return (StatusCode::NOT_FOUND, "no such sitemap\n").into_response();
        };
        let mut xml = String::with_capacity(products.len() * 110);
        xml.push_str(&format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<urlset xmlns=\"{SITEMAP_NS}\">\n"
        ));
        for p in products {
            xml.push_str(&format!(
                "<url><loc>http://{host}/product/{}</loc><lastmod>{}</lastmod></url>\n",
                p.sku,
                w3c(p.changed_at)
            ));
        }
        xml.push_str("</urlset>\n");
        xml
    };
    gzip_file(&xml)
}

/// `GET /calendar/YYYY-MM` (with `--calendar`): a month's page linking to the months before and
/// after it, for ever — the crawl trap a shop's event calendar is.
async fn calendar_month(State(c): State<Shared>, uri: Uri, Path(month): Path<String>) -> Response {
    fault_first!(c, uri);
    let parsed = month
        .split_once('-')
        .and_then(|(y, m)| Some((y.parse::<i32>().ok()?, m.parse::<u32>().ok()?)))
        .filter(|(y, m)| (1..=9999).contains(y) && (1..=12).contains(m));
    let Some((year, m)) = parsed.filter(|_| lock(&c).calendar) else {
        return (StatusCode::NOT_FOUND, "no such month\n").into_response();
    };
    let index = year * 12 + (m as i32 - 1);
    let name = |i: i32| format!("{:04}-{:02}", i.div_euclid(12), i.rem_euclid(12) + 1);
    let body = format!(
        "<!doctype html>\n<html><head><title>Events, {month}</title></head><body>\n<h1>Events in {month}</h1>\n<p>No events.</p>\n<nav><a class=\"prev\" href=\"/calendar/{}\">earlier</a> <a class=\"next\" href=\"/calendar/{}\">later</a></nav>\n</body></html>\n",
        name(index - 1),
        name(index + 1),
    );
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

async fn list_page(State(c): State<Shared>, uri: Uri, Path(page): Path<String>) -> Response {
    fault_first!(c, uri);
    let catalog = lock(&c);
    let pages = catalog.pages();
    let Some(page) = page
        .parse::<usize>()
        .ok()
        .filter(|p| (1..=pages).contains(p))
    else {
        return (StatusCode::NOT_FOUND, "no such page\n").into_response();
    };
    let mut body = format!("<!doctype html>\n<html><head><title>Shop, page {page}</title></head><body>\n<h1>Products, page {page} of {pages}</h1>\n<div class=\"items\">\n");
    let start = (page - 1) * catalog.per_list;
    for p in catalog.products.iter().skip(start).take(catalog.per_list) {
        body.push_str(&format!(
            "<div class=\"item\" data-id=\"{sku}\" data-updated=\"{updated}\"><a href=\"/product/{sku}\"><span class=\"title\">{title}</span></a> <span class=\"{price_class}\">{price}</span> <span class=\"status\">{status}</span></div>\n",
            price_class = catalog.price_class,
            sku = p.sku,
            updated = p.changed_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            title = html_escape(&p.title),
            price = html_escape(&p.price),
            status = html_escape(&p.status),
        ));
    }
    body.push_str("</div>\n<nav>");
    if page > 1 {
        body.push_str(&format!(
            "<a class=\"prev\" href=\"/list/{}\">previous</a> ",
            page - 1
        ));
    }
    if page < pages {
        body.push_str(&format!(
            "<a class=\"next\" href=\"/list/{}\">next</a>",
            page + 1
        ));
    }
    if catalog.calendar {
        body.push_str(" <a class=\"calendar\" href=\"/calendar/2026-01\">calendar</a>");
    }
    body.push_str("</nav>\n</body></html>\n");
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

/// A product as the JSON API shows it: the price as a number with its currency.
fn api_json(p: &Product) -> serde_json::Value {
    let amount: f64 = p.price.trim_start_matches('$').parse().unwrap_or(0.0);
    serde_json::json!({
        "id": p.sku,
        "url": format!("/api/product/{}", p.sku),
        "title": p.title,
        "price": { "amount": amount, "currency": "USD" },
        "status": p.status,
        "updated": p.changed_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    })
}

#[derive(Deserialize)]
struct ApiPage {
    page: Option<String>,
}

/// `GET /api/products?page=N`: the listing page N as JSON, `next` the next page's URL (null on
/// the last).
async fn api_products(State(c): State<Shared>, uri: Uri, Query(q): Query<ApiPage>) -> Response {
    fault_first!(c, uri);
    let catalog = lock(&c);
    let pages = catalog.pages();
    let Some(page) = q
        .page
        .as_deref()
        .unwrap_or("1")
        .parse::<usize>()
        .ok()
        .filter(|p| (1..=pages).contains(p))
    else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "no such page"})),
        )
            .into_response();
    };
    let start = (page - 1) * catalog.per_list;
    let products: Vec<serde_json::Value> = catalog
        .products
        .iter()
        .skip(start)
        .take(catalog.per_list)
        .map(api_json)
        .collect();
    let next = (page < pages).then(|| format!("/api/products?page={}", page + 1));
    Json(serde_json::json!({ "page": page, "pages": pages, "products": products, "next": next }))
        .into_response()
}

/// `GET /api/product/SKU`: one product as JSON, with the validators of its HTML page.
async fn api_product(State(c): State<Shared>, uri: Uri, Path(sku): Path<String>) -> Response {
    fault_first!(c, uri);
    let product = lock(&c).find(&sku).cloned();
    let Some(p) = product else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "no such product"})),
        )
            .into_response();
    };
    let mut body = api_json(&p);
    body["sku"] = serde_json::json!(p.sku);
    (
        [(header::LAST_MODIFIED, http_date(p.changed_at))],
        Json(body),
    )
        .into_response()
}

fn http_date(t: DateTime<Utc>) -> String {
    t.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

async fn product_page(
    State(c): State<Shared>,
    uri: Uri,
    headers: HeaderMap,
    Path(sku): Path<String>,
) -> Response {
    fault_first!(c, uri);
    let (product, price_class) = {
        let catalog = lock(&c);
        (catalog.find(&sku).cloned(), catalog.price_class.clone())
    };
    let Some(p) = product else {
        return (StatusCode::NOT_FOUND, "no such product\n").into_response();
    };
    // schema.org data as shops embed it: the price a string without its currency sign.
    let json_ld = serde_json::json!({
        "@context": "https://schema.org",
        "@type": "Product",
        "sku": p.sku,
        "name": p.title,
        "offers": {
            "@type": "Offer",
            "price": p.price.trim_start_matches('$'),
            "priceCurrency": "USD",
            "availability": p.status,
        },
    })
    .to_string()
    .replace("</", "<\\/");
    let body = format!(
        "<!doctype html>\n<html><head><title>{title}</title>\n<link rel=\"canonical\" href=\"/product/{sku}\">\n<script type=\"application/ld+json\">{json_ld}</script></head><body>\n<h1>{title}</h1>\n<div class=\"sku\">{sku}</div>\n<div class=\"{price_class}\">{price}</div>\n<div class=\"status\">{status}</div>\n<a href=\"/list/1\">all products</a>\n</body></html>\n",
        title = html_escape(&p.title),
        sku = p.sku,
        price = html_escape(&p.price),
        status = html_escape(&p.status),
    );
    let etag = format!("\"{}\"", crate::ids::sha256_hex(&[body.as_bytes()], 8));
    let last_modified = http_date(p.changed_at);
    let not_modified = match headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
    {
        Some(tags) => tags.split(',').any(|t| t.trim() == etag || t.trim() == "*"),
        None => headers
            .get(header::IF_MODIFIED_SINCE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| DateTime::parse_from_rfc2822(&v.replace("GMT", "+0000")).ok())
            .is_some_and(|since| p.changed_at.timestamp() <= since.timestamp()),
    };
    let validators = [(header::ETAG, etag), (header::LAST_MODIFIED, last_modified)];
    if not_modified {
        return (StatusCode::NOT_MODIFIED, validators).into_response();
    }
    (
        validators,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8".to_owned())],
        body,
    )
        .into_response()
}

/// `GET /product/<sku>/<variant>`: the product's page under another URL; its canonical link
/// names `/product/<sku>`.
async fn product_variant(
    State(c): State<Shared>,
    uri: Uri,
    headers: HeaderMap,
    Path((sku, _variant)): Path<(String, String)>,
) -> Response {
    product_page(State(c), uri, headers, Path(sku)).await
}

/// `GET /members`: sets the cookie `member=yes` and links to `/members/list/1`.
async fn members_gate(State(c): State<Shared>, uri: Uri) -> Response {
    fault_first!(c, uri);
    (
        [
            (header::SET_COOKIE, "member=yes; Path=/members"),
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        ],
        "<!doctype html>\n<html><body><a href=\"/members/list/1\">the members' catalogue</a></body></html>\n",
    )
        .into_response()
}

/// `GET /members/list/<page>`: listing page `page`, for a client that sends back the cookie
/// `/members` set (`403` without it).
async fn members_list(
    State(c): State<Shared>,
    uri: Uri,
    headers: HeaderMap,
    Path(page): Path<String>,
) -> Response {
    let member = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .any(|c| c.trim() == "member=yes");
    if !member {
        lock(&c).count_request(uri.path());
        return (
            StatusCode::FORBIDDEN,
            "members only: visit /members first\n",
        )
            .into_response();
    }
    list_page(State(c), uri, Path(page)).await
}

async fn mutate(State(c): State<Shared>, Json(request): Json<Mutation>) -> Response {
    if request
        .change
        .max(request.add)
        .max(request.delete)
        .max(request.remove.len())
        > MAX_MUTATION
    {
        return (
            StatusCode::BAD_REQUEST,
            format!("at most {MAX_MUTATION} products per kind of change\n"),
        )
            .into_response();
    }
    Json(lock(&c).mutate(&request)).into_response()
}

async fn robots_txt(State(c): State<Shared>, uri: Uri) -> Response {
    fault_first!(c, uri);
    match lock(&c).robots.clone() {
        Some(text) => ([(header::CONTENT_TYPE, "text/plain")], text).into_response(),
        None => (StatusCode::NOT_FOUND, "no robots.txt\n").into_response(),
    }
}

/// `POST /__robots` with the robots.txt text (an empty body: none, 404).
async fn set_robots(State(c): State<Shared>, body: String) -> Response {
    lock(&c).robots = (!body.is_empty()).then_some(body);
    StatusCode::NO_CONTENT.into_response()
}

async fn set_faults(State(c): State<Shared>, Json(rules): Json<Vec<FaultRule>>) -> Response {
    let n = rules.len();
    lock(&c).faults = rules;
    Json(serde_json::json!({ "faults": n })).into_response()
}

/// `POST /__layout`: `{"price_class": "cost"}` renames the price's class on every listing and
/// product page, as a shop's redesign would.
#[derive(Deserialize)]
struct Layout {
    price_class: String,
}

async fn set_layout(State(c): State<Shared>, Json(layout): Json<Layout>) -> Response {
    let class = layout.price_class.trim();
    if class.is_empty()
        || class.len() > 32
        || !class
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
    {
        return (
            StatusCode::BAD_REQUEST,
            "price_class: letters, digits, - and _, at most 32\n",
        )
            .into_response();
    }
    lock(&c).price_class = class.to_owned();
    Json(serde_json::json!({ "price_class": class })).into_response()
}

/// `DELETE /__layout`: the price's class is `price` again.
async fn clear_layout(State(c): State<Shared>) -> Response {
    lock(&c).price_class = "price".into();
    Json(serde_json::json!({ "price_class": "price" })).into_response()
}

async fn clear_faults(State(c): State<Shared>) -> Response {
    lock(&c).faults.clear();
    Json(serde_json::json!({ "faults": 0 })).into_response()
}

#[derive(Deserialize)]
struct StatsQuery {
    #[serde(default)]
    reset: bool,
    /// Include the request log: `[[path, unix_ms], …]`, oldest first.
    #[serde(default)]
    log: bool,
}

async fn stats(State(c): State<Shared>, Query(q): Query<StatsQuery>) -> Response {
    let mut catalog = lock(&c);
    let total: u64 = catalog.stats.values().sum();
    let mut body = serde_json::json!({ "total": total, "paths": catalog.stats, "encodings": catalog.encodings });
    if q.log {
        body["log"] = serde_json::json!(catalog.log);
    }
    if q.reset {
        catalog.stats.clear();
        catalog.log.clear();
        catalog.encodings.clear();
    }
    Json(body).into_response()
}

async fn truth(State(c): State<Shared>) -> Response {
    let catalog = lock(&c);
    Json(serde_json::json!({ "count": catalog.products.len(), "products": catalog.products }))
        .into_response()
}

async fn not_found(State(c): State<Shared>, uri: Uri) -> Response {
    fault_first!(c, uri);
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}
