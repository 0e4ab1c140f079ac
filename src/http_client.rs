//! Fetching one page for the crawl, with every way it can go wrong turned into a closed set of
//! outcomes for the caller to route: a page (HTML or JSON, decoded), `304`, a skip (neither HTML
//! nor JSON), a throttle (`429`/`503` with `Retry-After`), a timeout, a permanent failure (a 4xx,
//! a body over the cap, a redirect chain over the limit), a gone page (`404`/`410`), or a
//! transient failure. A bot's client adds its user agent, its cookie jar and its proxy.

use std::time::Duration;

use chrono::{DateTime, Utc};

pub use crate::extract::BodyFormat;
use crate::urls::NormalizedUrl;

/// A fetched HTML or JSON page (invalid UTF-8 is read lossily), or a sitemap file.
#[derive(Clone, Debug, PartialEq)]
pub struct Page {
    pub url: NormalizedUrl,
    /// From the `Content-Type` (HTML when there is none).
    pub format: BodyFormat,
    /// An HTML or JSON page's body (empty for a sitemap: it is read as it arrives).
    pub body: String,
    /// A sitemap file, read as a stream while its body arrived (never held whole), with its
    /// client's sitemap permit: one file of a bot is read and held at a time.
    pub sitemap: Option<(Box<crate::extract::sitemap::Sitemap>, SitemapPermit)>,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FetchOutcome {
    Ok(Page),
    /// The stored validators still match (`304`).
    NotModified,
    /// Neither HTML nor JSON: nothing to read.
    Skipped {
        reason: String,
    },
    /// The site asks us to slow down (`429`, `503`); `retry_after` from its header, if any.
    Throttled {
        status: u16,
        retry_after: Option<Duration>,
    },
    Timeout,
    /// `404` / `410`: the page is gone.
    Gone {
        status: u16,
    },
    /// Will not change by retrying: other 4xx, a body over the cap, too many redirects, bad URL.
    Permanent {
        reason: String,
    },
    /// May work later: 5xx, connection errors.
    Transient {
        reason: String,
    },
    /// `301`, `302`, `303`, `307`, `308` to `to`: not followed here — the caller judges every hop
    /// (scope, robots.txt, the host's flow control) before it is requested.
    Redirect {
        status: u16,
        to: NormalizedUrl,
    },
}

/// What fetching a host's robots.txt came to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RobotsFetch {
    Found(Vec<u8>),
    /// A 4xx: there are no rules, everything is allowed.
    Missing {
        status: u16,
    },
    /// A 5xx or no answer: the host is paused and asked again later.
    Unavailable(String),
}

/// robots.txt bytes read; the rest is ignored (Google's limit is 500 KiB).
pub(crate) const MAX_ROBOTS_BYTES: usize = 512 * 1024;

/// Validators from an earlier fetch, for a conditional GET.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Validators {
    pub etag: Option<String>,
    pub last_modified: Option<String>,
}

/// The request headers a bot sends with every page request (`[bots.crawl] headers`). A value
/// read from an environment variable is a secret: marked sensitive, and shown nowhere — `Debug`
/// and [`RequestHeaders::shown`] print `<from $NAME>` in its place.
#[derive(Clone, Default, PartialEq)]
pub struct RequestHeaders {
    entries: Vec<HeaderEntry>,
}

#[derive(Clone, PartialEq)]
struct HeaderEntry {
    name: reqwest::header::HeaderName,
    value: reqwest::header::HeaderValue,
    /// The environment variable the value was read from.
    env: Option<String>,
}

/// Headers the crawl sets itself (or that would break a request): a bot cannot set them.
const RESERVED_HEADERS: [&str; 9] = [
    "host",
    "user-agent",
    "content-length",
    "transfer-encoding",
    "connection",
    "if-none-match",
    "if-modified-since",
    "te",
    "upgrade",
];

impl RequestHeaders {
    /// Adds `name: value`; `env` names the variable `value` came from (a secret). The error
    /// says what is wrong without the value.
    pub(crate) fn push(
        &mut self,
        name: &str,
        value: &str,
        env: Option<&str>,
    ) -> Result<(), String> {
        let header = reqwest::header::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("{name:?} is not a header name"))?;
        if RESERVED_HEADERS.contains(&header.as_str()) {
            return Err(format!(
                "{name:?} is set by the crawl itself (a bot's user agent is `user_agent`, the instance's `refresh.user_agent`)"
            ));
        }
        if self.entries.iter().any(|e| e.name == header) {
            return Err(format!("{name:?} is given twice"));
        }
        let mut value = reqwest::header::HeaderValue::from_str(value).map_err(|_| match env {
            Some(var) => format!("the value of ${var} is not a valid header value"),
            None => "not a valid header value (no control characters)".to_owned(),
        })?;
        value.set_sensitive(env.is_some());
        self.entries.push(HeaderEntry {
            name: header,
            value,
            env: env.map(str::to_owned),
        });
        Ok(())
    }

    /// The headers to send.
    pub(crate) fn header_map(&self) -> reqwest::header::HeaderMap {
        self.entries
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect()
    }

    /// Each header as it may be shown: a secret's value is `<from $NAME>`.
    pub(crate) fn shown(&self) -> Vec<(String, String)> {
        self.entries
            .iter()
            .map(|e| {
                let value = match &e.env {
                    Some(var) => format!("<from ${var}>"),
                    None => String::from_utf8_lossy(e.value.as_bytes()).into_owned(),
                };
                (e.name.to_string(), value)
            })
            .collect()
    }
}

impl std::fmt::Debug for RequestHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.shown()).finish()
    }
}

/// A value from the bot's config or, a secret, from the instance's environment: shown (in
/// `Debug`, in `try`) as `<from $NAME>`, never as itself.
#[derive(Clone, PartialEq)]
pub struct Secret {
    value: String,
    env: Option<String>,
}

impl Secret {
    pub(crate) fn new(value: String, env: Option<&str>) -> Self {
        Self {
            value,
            env: env.map(str::to_owned),
        }
    }

    /// As it may be shown.
    pub(crate) fn shown(&self) -> String {
        match &self.env {
            Some(var) => format!("<from ${var}>"),
            None => self.value.clone(),
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown())
    }
}

/// How one bot's page requests go out besides its headers (`[bots.crawl]`): its user agent,
/// the proxy it goes through (`proxy = { env = "NAME" }`: http, https or socks5; always a
/// secret, a URL may hold credentials) and the cookies it starts each pass with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BotHttp {
    pub user_agent: Option<String>,
    pub proxy: Option<Secret>,
    /// `cookies = { session = { env = "SHOP_COOKIE" } }`, by name.
    pub cookies: Vec<(String, Secret)>,
}

impl BotHttp {
    /// Whether the bot needs a client of its own (a proxy); its user agent and its cookies are
    /// headers on the shared one.
    fn own_client(&self) -> bool {
        self.proxy.is_some()
    }

    /// The cookies and the proxy as they may be shown.
    pub(crate) fn shown(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .cookies
            .iter()
            .map(|(name, value)| (format!("cookie {name}"), value.shown()))
            .collect();
        if let Some(proxy) = &self.proxy {
            out.push(("proxy".into(), proxy.shown()));
        }
        out
    }
}

/// A bot's cookie jar, one per pass: cookies a site sets are sent back by RFC 6265's scope
/// (domain, path, secure; `reqwest`'s jar) until the bot's next pass starts with a fresh jar
/// holding its configured cookies again. The jar is the bot's; the connection pool is shared.
pub(crate) struct PassJar {
    pass: std::sync::atomic::AtomicI64,
    jar: std::sync::RwLock<std::sync::Arc<reqwest::cookie::Jar>>,
    /// `name=value` and the origins they are set for (each in-scope host).
    initial: Vec<(String, Vec<url::Url>)>,
}

impl PassJar {
    fn new(cookies: &[(String, Secret)], hosts: &[String]) -> Self {
        let origins: Vec<url::Url> = hosts
            .iter()
            .flat_map(|h| {
                let host = h.rsplit_once(':').map_or(h.as_str(), |(host, _)| host);
                ["http", "https"].map(|scheme| url::Url::parse(&format!("{scheme}://{host}/")))
            })
            .filter_map(Result::ok)
            .collect();
        let initial = cookies
            .iter()
            .map(|(name, value)| (format!("{name}={}", value.value), origins.clone()))
            .collect();
        let jar = Self {
            pass: std::sync::atomic::AtomicI64::new(i64::MIN),
            jar: Default::default(),
            initial,
        };
        jar.reset();
        jar
    }

    fn reset(&self) {
        let fresh = reqwest::cookie::Jar::default();
        for (cookie, origins) in &self.initial {
            for origin in origins {
                fresh.add_cookie_str(cookie, origin);
            }
        }
        *self.jar.write().unwrap_or_else(|p| p.into_inner()) = std::sync::Arc::new(fresh);
    }

    /// A fresh jar when `pass` is another pass than the last one asked for.
    fn enter_pass(&self, pass: i64) {
        use std::sync::atomic::Ordering;
        if self.pass.swap(pass, Ordering::AcqRel) != pass {
            self.reset();
        }
    }

    fn current(&self) -> std::sync::Arc<reqwest::cookie::Jar> {
        self.jar.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl PassJar {
    /// The `Cookie` header for a request to `url`.
    fn cookies(&self, url: &url::Url) -> Option<reqwest::header::HeaderValue> {
        use reqwest::cookie::CookieStore;
        let mut value = self.current().cookies(url)?;
        value.set_sensitive(true);
        Some(value)
    }

    /// Keeps the cookies a response from `url` sets.
    fn store(&self, response: &reqwest::Response) {
        use reqwest::cookie::CookieStore;
        let mut set = response
            .headers()
            .get_all(reqwest::header::SET_COOKIE)
            .iter();
        self.current().set_cookies(&mut set, response.url());
    }
}

/// A client's one permit to read and hold a sitemap file: a file of 50,000 URLs weighs
/// megabytes once read, so a bot reads the next only when the one before is parsed (its
/// entries moved into the crawl's own budget).
#[derive(Clone, Debug, Default)]
pub struct SitemapPermit {
    _held: Option<std::sync::Arc<tokio::sync::OwnedSemaphorePermit>>,
}

impl SitemapPermit {
    /// Whether this is a file's permit (not the empty one a page that is no sitemap carries).
    pub fn holds_a_file(&self) -> bool {
        self._held.is_some()
    }
}

impl PartialEq for SitemapPermit {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

#[derive(Clone)]
pub struct HttpClient {
    /// Follows no redirect: each hop is a fetch of its own ([`FetchOutcome::Redirect`]).
    http: reqwest::Client,
    /// The bot's request headers, sent with every page request (not with robots.txt, which is
    /// shared by every bot crawling the host).
    headers: std::sync::Arc<RequestHeaders>,
    /// For robots.txt: follows up to [`MAX_REDIRECTS`] redirects on the same host (a scheme or
    /// path change, as RFC 9309 allows), none to another host.
    robots_http: reqwest::Client,
    max_bytes: usize,
    timeout: Duration,
    /// The instance's user agent.
    agent: String,
    /// The bot's own user agent, sent in place of the instance's.
    user_agent: Option<reqwest::header::HeaderValue>,
    /// The bot's cookie jar (none for the instance's own client).
    jar: Option<std::sync::Arc<PassJar>>,
    /// Why the bot's own client could not be built: every request fails with it (never sent
    /// around the bot's proxy).
    broken: Option<String>,
    /// One sitemap file read at a time ([`SitemapPermit`]); a bot's client has its own.
    sitemaps: std::sync::Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("headers", &self.headers)
            .field("user_agent", &self.user_agent)
            .field("cookie_jar", &self.jar.is_some())
            .finish_non_exhaustive()
    }
}

/// Whether a fetch follows its redirect to `to`, as its hop `hop` (from 0): `Err` is why the
/// page fails — past [`MAX_REDIRECTS`], or out of the bot's scope or allow/deny patterns
/// (`redirect out of scope: HOST`; that host gets no request).
pub(crate) fn next_hop(
    links: &crate::extract::LinkRules,
    hop: usize,
    to: &NormalizedUrl,
) -> Result<(), String> {
    if hop >= MAX_REDIRECTS {
        return Err(format!("more than {MAX_REDIRECTS} redirects"));
    }
    if !links.admits(to) {
        return Err(format!("redirect out of scope: {}", to.host_port()));
    }
    Ok(())
}

/// The default page body cap.
pub const DEFAULT_MAX_PAGE_BYTES: usize = 5 * 1024 * 1024;
/// Redirects followed before a fetch fails.
pub(crate) const MAX_REDIRECTS: usize = 5;

impl HttpClient {
    pub fn new(user_agent: &str, timeout: Duration, max_bytes: usize) -> Result<Self, String> {
        let (http, robots_http) = clients(user_agent, timeout, None)?;
        Ok(Self {
            http,
            headers: Default::default(),
            robots_http,
            max_bytes,
            timeout,
            agent: user_agent.to_owned(),
            user_agent: None,
            jar: None,
            broken: None,
            sitemaps: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
        })
    }

    /// The client bot requests go out with: `headers` on every page request, the bot's own
    /// user agent, and — with a proxy or cookies — a client of its own (its own connection
    /// pool) through that proxy with a jar per pass; else this client's pool. `hosts` are the
    /// bot's scope, where its configured cookies are sent. (Its settings were validated with
    /// the config; should the client still not build, every request fails saying why.)
    pub(crate) fn for_bot(
        &self,
        headers: &RequestHeaders,
        http: &BotHttp,
        hosts: &[String],
    ) -> Self {
        self.try_for_bot(headers, http, hosts)
            .unwrap_or_else(|e| Self {
                broken: Some(format!("the bot's HTTP client: {e}")),
                ..self.clone()
            })
    }

    fn try_for_bot(
        &self,
        headers: &RequestHeaders,
        http: &BotHttp,
        hosts: &[String],
    ) -> Result<Self, String> {
        let user_agent = http
            .user_agent
            .as_deref()
            .map(reqwest::header::HeaderValue::from_str)
            .transpose()
            .map_err(|_| "the user agent is not a valid header value".to_owned())?;
        let mut out = Self {
            headers: std::sync::Arc::new(headers.clone()),
            user_agent,
            sitemaps: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            ..self.clone()
        };
        // A bot that sends a `Cookie` header of its own keeps no jar: one `Cookie` header a
        // request (RFC 6265 §5.4), and it is the bot's.
        let own_cookie = headers
            .entries
            .iter()
            .any(|e| e.name == reqwest::header::COOKIE);
        out.jar = (!own_cookie).then(|| std::sync::Arc::new(PassJar::new(&http.cookies, hosts)));
        if http.own_client() {
            let proxy = http.proxy.as_ref().map(|p| p.value.as_str());
            let agent = http.user_agent.as_deref().unwrap_or(&self.agent);
            let (page, robots) = clients(agent, self.timeout, proxy)?;
            out.http = page;
            out.robots_http = robots;
        }
        Ok(out)
    }

    /// The bot's own user agent, when it has one.
    pub(crate) fn own_user_agent(&self) -> Option<&str> {
        self.user_agent.as_ref().and_then(|v| v.to_str().ok())
    }

    /// Starts pass `pass`'s cookie jar afresh if this is the pass's first request.
    pub(crate) fn enter_pass(&self, pass: i64) {
        if let Some(jar) = &self.jar {
            jar.enter_pass(pass);
        }
    }
}

/// The page client (no redirect followed) and the robots.txt client (same-host redirects),
/// through `proxy` when given.
fn clients(
    user_agent: &str,
    timeout: Duration,
    proxy: Option<&str>,
) -> Result<(reqwest::Client, reqwest::Client), String> {
    let proxy = proxy
        .map(|url| {
            reqwest::Proxy::all(url)
                .map_err(|_| "the proxy is not an http, https or socks5 URL".to_owned())
        })
        .transpose()?;
    let client = |redirect| {
        let mut builder = reqwest::Client::builder()
            .user_agent(user_agent)
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .redirect(redirect);
        if let Some(proxy) = &proxy {
            builder = builder.proxy(proxy.clone());
        }
        builder
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))
    };
    let same_host = reqwest::redirect::Policy::custom(|attempt| {
        let same = attempt.previous().first().is_some_and(|first| {
            first.host_str() == attempt.url().host_str()
                && first.port_or_known_default() == attempt.url().port_or_known_default()
        });
        if same && attempt.previous().len() <= MAX_REDIRECTS {
            attempt.follow()
        } else {
            attempt.stop()
        }
    });
    Ok((
        client(reqwest::redirect::Policy::none())?,
        client(same_host)?,
    ))
}

impl HttpClient {
    /// Fetches `url`, following redirects that stay on its host and port (at most
    /// [`MAX_REDIRECTS`]); a redirect elsewhere comes back as [`FetchOutcome::Redirect`],
    /// unfollowed. (The crawl judges every hop itself: [`HttpClient::fetch_one`].)
    pub async fn fetch(&self, url: &NormalizedUrl, validators: &Validators) -> FetchOutcome {
        let mut at = url.clone();
        let mut validators = validators.clone();
        for _ in 0..=MAX_REDIRECTS {
            match self.fetch_one(&at, &validators).await {
                FetchOutcome::Redirect { to, .. } if to.host_port() == url.host_port() => {
                    at = to;
                    validators = Validators::default();
                }
                outcome => return outcome,
            }
        }
        FetchOutcome::Permanent {
            reason: format!("more than {MAX_REDIRECTS} redirects"),
        }
    }

    /// One request: a redirect comes back as [`FetchOutcome::Redirect`], for the caller to judge
    /// (scope, robots.txt, the target host's flow control) before it asks for the next hop.
    pub(crate) async fn fetch_one(
        &self,
        url: &NormalizedUrl,
        validators: &Validators,
    ) -> FetchOutcome {
        if let Some(reason) = &self.broken {
            return FetchOutcome::Permanent {
                reason: reason.clone(),
            };
        }
        let mut request = self.http.get(url.as_str());
        if let Some(agent) = &self.user_agent {
            request = request.header(reqwest::header::USER_AGENT, agent.clone());
        }
        for e in &self.headers.entries {
            request = request.header(&e.name, &e.value);
        }
        if let Some(etag) = &validators.etag {
            request = request.header(reqwest::header::IF_NONE_MATCH, etag);
        }
        if let Some(since) = &validators.last_modified {
            request = request.header(reqwest::header::IF_MODIFIED_SINCE, since);
        }
        if let Some(cookies) = self.jar.as_ref().and_then(|jar| jar.cookies(&url.to_url())) {
            request = request.header(reqwest::header::COOKIE, cookies);
        }
        let mut response = match request.send().await {
            Ok(r) => r,
            Err(e) => return classify_error(&e),
        };
        if let Some(jar) = &self.jar {
            jar.store(&response);
        }
        if let Some(outcome) = by_status(&response) {
            return outcome;
        }
        let header = |name: reqwest::header::HeaderName| header_text(&response, name);
        let content_type = header(reqwest::header::CONTENT_TYPE).unwrap_or_default();
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let gz_file = essence == "application/octet-stream" && url.as_str().ends_with(".gz");
        let format = match BodyFormat::of_content_type(&essence) {
            Some(format) => format,
            None if gz_file => BodyFormat::Sitemap,
            None => {
                return FetchOutcome::Skipped {
                    reason: format!("neither HTML, JSON nor a sitemap ({essence})"),
                }
            }
        };
        let (etag, last_modified) = (
            header(reqwest::header::ETAG),
            header(reqwest::header::LAST_MODIFIED),
        );
        let final_url =
            NormalizedUrl::parse(response.url().as_str()).unwrap_or_else(|_| url.clone());
        if format == BodyFormat::Sitemap {
            let permit = self.sitemaps.clone().acquire_owned().await.ok();
            let sitemap = match read_sitemap(&mut response).await {
                Ok(sitemap) => sitemap,
                Err(outcome) => return outcome,
            };
            let permit = SitemapPermit {
                _held: permit.map(std::sync::Arc::new),
            };
            return FetchOutcome::Ok(Page {
                url: final_url,
                format,
                body: String::new(),
                sitemap: Some((Box::new(sitemap), permit)),
                etag,
                last_modified,
            });
        }
        if response
            .content_length()
            .is_some_and(|len| len > self.max_bytes as u64)
        {
            return self.too_large();
        }
        let body = match self.read_body(&mut response).await {
            Ok(body) => body,
            Err(outcome) => return outcome,
        };
        FetchOutcome::Ok(Page {
            url: final_url,
            format,
            body: String::from_utf8_lossy(&body).into_owned(),
            sitemap: None,
            etag,
            last_modified,
        })
    }

    /// A page's body, at most [`HttpClient`]'s size cap (past it: the page is too large).
    async fn read_body(&self, response: &mut reqwest::Response) -> Result<Vec<u8>, FetchOutcome> {
        let mut body = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if body.len() + chunk.len() > self.max_bytes {
                        return Err(self.too_large());
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => return Ok(body),
                Err(e) => return Err(classify_error(&e)),
            }
        }
    }

    /// Fetches `origin/robots.txt` (at most [`MAX_ROBOTS_BYTES`]; the rest is ignored).
    pub(crate) async fn fetch_robots(&self, origin: &str) -> RobotsFetch {
        if let Some(reason) = &self.broken {
            return RobotsFetch::Unavailable(reason.clone());
        }
        let response = match self
            .robots_http
            .get(format!("{origin}/robots.txt"))
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return RobotsFetch::Unavailable(error_chain(&e)),
        };
        let status = response.status().as_u16();
        match status {
            200..=299 => {}
            // A redirect to another host, or a chain over the limit, is as good as no file
            // (RFC 9309 §2.3.1.2), as is a 4xx: no rules.
            300..=499 => return RobotsFetch::Missing { status },
            _ => return RobotsFetch::Unavailable(format!("HTTP {status}")),
        }
        let mut response = response;
        let mut body = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    body.extend_from_slice(&chunk);
                    if body.len() >= MAX_ROBOTS_BYTES {
                        body.truncate(MAX_ROBOTS_BYTES);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => return RobotsFetch::Unavailable(error_chain(&e)),
            }
        }
        RobotsFetch::Found(body)
    }

    fn too_large(&self) -> FetchOutcome {
        FetchOutcome::Permanent {
            reason: format!("body larger than {} bytes (cut off)", self.max_bytes),
        }
    }
}

/// Reads a sitemap file as it arrives: the body's chunks go through a small channel to a
/// reader on the blocking pool (gunzipping a `.xml.gz` file, told by its magic bytes), so at
/// most a few chunks and the entries read so far are held, never the whole file. Its limits
/// are the protocol's ([`crate::extract::sitemap`]), not a page's `max_page_bytes`.
async fn read_sitemap(
    response: &mut reqwest::Response,
) -> Result<crate::extract::sitemap::Sitemap, FetchOutcome> {
    use crate::extract::sitemap::{self, SitemapError};
    use std::io::BufRead;
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    let reader = tokio::task::spawn_blocking(move || {
        let mut input = std::io::BufReader::with_capacity(
            64 * 1024,
            ChunkReader {
                rx,
                chunk: Vec::new(),
                at: 0,
            },
        );
        let gzip = input
            .fill_buf()
            .map_err(|e| SitemapError::Broken(e.to_string()))?
            .starts_with(&[0x1f, 0x8b]);
        if gzip {
            sitemap::read(flate2::bufread::MultiGzDecoder::new(input))
        } else {
            sitemap::read(input)
        }
    });
    let mut failed = None;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if tx.send(chunk.to_vec()).await.is_err() {
                    break; // the reader is done (or gave up): the rest is not needed
                }
            }
            Ok(None) => break,
            Err(e) => {
                failed = Some(classify_error(&e));
                break;
            }
        }
    }
    drop(tx);
    let read = reader.await.map_err(|e| FetchOutcome::Transient {
        reason: format!("the sitemap reader failed: {e}"),
    })?;
    if let Some(outcome) = failed {
        return Err(outcome);
    }
    read.map_err(|e| match e {
        SitemapError::NotASitemap(_) => FetchOutcome::Skipped {
            reason: e.to_string(),
        },
        SitemapError::TooLarge | SitemapError::Broken(_) => FetchOutcome::Permanent {
            reason: e.to_string(),
        },
    })
}

/// The body's chunks, as they arrive, as a blocking reader.
struct ChunkReader {
    rx: tokio::sync::mpsc::Receiver<Vec<u8>>,
    chunk: Vec<u8>,
    at: usize,
}

impl std::io::Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.rx.blocking_recv() {
                Some(chunk) => {
                    self.chunk = chunk;
                    self.at = 0;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn classify_error(e: &reqwest::Error) -> FetchOutcome {
    if e.is_timeout() {
        FetchOutcome::Timeout
    } else if e.is_builder() {
        FetchOutcome::Permanent {
            reason: format!("invalid request: {e}"),
        }
    } else {
        let reason = error_chain(e);
        // A name that does not resolve or a certificate that does not verify will not change
        // by asking again within a pass.
        let lower = reason.to_ascii_lowercase();
        if lower.contains("dns error")
            || lower.contains("failed to lookup address")
            || lower.contains("certificate")
            || lower.contains("invalid url")
        {
            FetchOutcome::Permanent { reason }
        } else {
            FetchOutcome::Transient { reason }
        }
    }
}

/// An error with its causes (`reqwest` puts the useful part, such as "dns error", in sources).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `Retry-After`: delay-seconds or an HTTP date (RFC 9110 §10.2.3).
pub(crate) fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds.min(24 * 3600)));
    }
    let date = DateTime::parse_from_rfc2822(&value.replace("GMT", "+0000")).ok()?;
    Some(
        (date.with_timezone(&Utc) - now)
            .to_std()
            .unwrap_or(Duration::ZERO)
            .min(Duration::from_secs(24 * 3600)),
    )
}

/// A response header's value as text (`None`: absent or not text).
fn header_text(response: &reqwest::Response, name: reqwest::header::HeaderName) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// What a response's status alone says: not modified, a redirect (with its target), gone,
/// throttled (with `Retry-After`), a transient or permanent failure; `None` for a success,
/// whose body is read.
fn by_status(response: &reqwest::Response) -> Option<FetchOutcome> {
    let status = response.status().as_u16();
    let header = |name: reqwest::header::HeaderName| header_text(response, name);
    Some(match status {
        304 => FetchOutcome::NotModified,
        301 | 302 | 303 | 307 | 308 => {
            let target = header(reqwest::header::LOCATION)
                .and_then(|to| response.url().join(&to).ok())
                .and_then(|to| NormalizedUrl::parse(to.as_str()).ok());
            match target {
                Some(to) => FetchOutcome::Redirect { status, to },
                None => FetchOutcome::Permanent {
                    reason: format!("HTTP {status} without a usable Location"),
                },
            }
        }
        404 | 410 => FetchOutcome::Gone { status },
        429 | 503 => {
            let retry_after = header(reqwest::header::RETRY_AFTER)
                .and_then(|v| parse_retry_after(&v, Utc::now()));
            FetchOutcome::Throttled {
                status,
                retry_after,
            }
        }
        408 => FetchOutcome::Transient {
            reason: "HTTP 408".into(),
        },
        s if (400..500).contains(&s) => FetchOutcome::Permanent {
            reason: format!("HTTP {s}"),
        },
        s if !(200..300).contains(&s) => FetchOutcome::Transient {
            reason: format!("HTTP {s}"),
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_cookie_jar_keeps_what_sites_set_within_a_pass_and_starts_each_pass_afresh() {
        let jar = PassJar::new(
            &[("session".into(), Secret::new("abc".into(), Some("X")))],
            &["shop.test:8080".into()],
        );
        let url = url::Url::parse("http://shop.test:8080/members/list/1").unwrap();
        let cookies = |jar: &PassJar| {
            jar.cookies(&url)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        jar.enter_pass(1);
        assert_eq!(cookies(&jar), "session=abc", "the configured cookie");
        let set = reqwest::header::HeaderValue::from_static("member=yes; Path=/members");
        use reqwest::cookie::CookieStore;
        jar.current().set_cookies(
            &mut std::iter::once(&set),
            &url::Url::parse("http://shop.test:8080/members").unwrap(),
        );
        assert!(cookies(&jar).contains("member=yes"));
        let elsewhere = url::Url::parse("http://shop.test:8080/list/1").unwrap();
        let outside = jar.cookies(&elsewhere).unwrap();
        assert!(
            !outside.to_str().unwrap().contains("member"),
            "a cookie goes only to its path"
        );
        jar.enter_pass(1);
        assert!(
            cookies(&jar).contains("member=yes"),
            "the same pass keeps it"
        );
        jar.enter_pass(2);
        assert_eq!(cookies(&jar), "session=abc", "a new pass starts afresh");
        assert_eq!(
            format!("{:?}", Secret::new("abc".into(), Some("X"))),
            "<from $X>"
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        assert_eq!(parse_retry_after("2", now), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Mon, 30 Nov 2026 11:00:00 GMT", now),
            Some(Duration::ZERO),
            "a past date: now"
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(
            parse_retry_after("99999999", now),
            Some(Duration::from_secs(24 * 3600)),
            "capped at a day"
        );
    }
}
