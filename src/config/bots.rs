//! `[[bots]]`: each bot's seeds, refresh schedule and crawl rules (listing and detail
//! selectors, incremental mode, priorities, headers), from a config file or a stored spec.

use super::selectors::{self, RawSelectors};
use super::*;

/// A bot's definition as kept in its document's `spec`: the `[[bots]]` entry as the file wrote
/// it (defaults are filled in when it is read), without its `id` (the document's `_id`).
#[derive(Clone, Debug)]
pub struct BotSpec {
    pub settings: BotSettings,
    pub spec: bson::Document,
}

/// Reads the `[[bots]]` of a file (a whole config file, or one with only `[[bots]]`), validated
/// exactly as at start-up: the first bad key is one line naming the bot and the key.
pub(crate) fn specs_from_file(path: &Path) -> Result<Vec<BotSpec>, ConfigError> {
    let error = |message: String| ConfigError {
        path: path.display().to_string(),
        message,
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| error(format!("cannot read the file: {e}")))?;
    #[derive(Deserialize)]
    struct BotsOnly<T> {
        #[serde(default = "Vec::new")]
        bots: Vec<T>,
    }
    let figment = Figment::from(Toml::string(&text));
    let raw: BotsOnly<RawBot> = figment
        .extract()
        .map_err(|e| error(describe_figment_error(e)))?;
    // The spec keeps the keys the file wrote, not the defaults filled in: a default that changes
    // in a later version, or a key an older instance does not know, stays out of the stored spec.
    let written: BotsOnly<figment::value::Value> = figment
        .extract()
        .map_err(|e| error(describe_figment_error(e)))?;
    if raw.bots.is_empty() {
        return Err(error("the file has no [[bots]]".into()));
    }
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(raw.bots.len());
    for (i, (bot, written)) in raw.bots.into_iter().zip(written.bots).enumerate() {
        let mut spec =
            bson::to_document(&written).map_err(|e| error(format!("key `bots[{i}]`: {e}")))?;
        spec.remove("id");
        let name = bot.id.clone();
        let settings = bot
            .validate(&format!("bots[{i}]"))
            .map_err(|e| error(format!("bot {name:?}: {}", one_line(&e))))?;
        if !seen.insert(settings.id.clone()) {
            return Err(error(format!(
                "key `bots[{i}].id`: bot {name:?} is defined twice"
            )));
        }
        out.push(BotSpec { settings, spec });
    }
    Ok(out)
}

/// The settings of the database's bot `id` from its document's `spec`, validated as a file's
/// `[[bots]]` entry is; an error names the key (`spec.crawl.list.item`, …) in one line.
pub(crate) fn bot_from_spec(id: &BotId, spec: &bson::Document) -> Result<BotSettings, String> {
    let mut with_id = spec.clone();
    with_id.insert("id", id.as_str());
    let deserializer = bson::Deserializer::new(bson::Bson::Document(with_id));
    let raw: RawBot = serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            format!("key `spec`: {}", one_line(&inner))
        } else {
            format!("key `spec.{path}`: {}", one_line(&inner))
        }
    })?;
    raw.validate("spec").map_err(|e| one_line(&e))
}

pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[derive(Clone, Debug)]
pub struct BotSettings {
    pub id: BotId,
    pub seeds: SeedSource,
    pub refresh: RefreshSchedule,
    pub on_refresh_failure: OnRefreshFailure,
    /// What to crawl from the seeds (`[bots.crawl]`); `None` keeps the bot to seed refreshes.
    pub crawl: Option<CrawlSettings>,
}

/// `[bots.crawl]`, validated: selectors compiled, patterns compiled.
#[derive(Clone, Debug)]
pub struct CrawlSettings {
    pub links: crate::extract::LinkRules,
    pub list: Option<crate::extract::ListRules>,
    pub record: Option<crate::extract::RecordRules>,
    pub incremental: Incremental,
    /// URL patterns with their priority (0–9, higher is leased first; the first match wins);
    /// unmatched URLs get their kind's default (seeds 2, listing pages 1, detail pages 0).
    pub priorities: Vec<(regex::Regex, i64)>,
    /// Sent with every page request (`headers`); values from the environment are secrets.
    pub headers: crate::http_client::RequestHeaders,
    /// The bot's user agent, proxy and cookies.
    pub http: crate::http_client::BotHttp,
    /// Sitemap files read as listings every pass (`sitemaps`), beside the seeds.
    pub sitemaps: Vec<NormalizedUrl>,
    /// Also the sitemaps the `Sitemap:` lines of the seeds' hosts' robots.txt name.
    pub sitemaps_from_robots: bool,
    /// The crawl-trap bounds of a pass (`max_url_length` is in `links`).
    pub bounds: CrawlBounds,
    /// When a pass is gated instead of released (`[bots.crawl.drift]`).
    pub drift: DriftRules,
    /// Where released change events are pushed (`[bots.crawl.notify]`), if anywhere.
    pub notify: Option<NotifySettings>,
}

/// `[bots.crawl.notify]`: a webhook that receives each released pass's change events, in
/// batches of one pass, each with an idempotency key.
#[derive(Clone, Debug)]
pub struct NotifySettings {
    pub url: reqwest::Url,
    /// Sent with every delivery; values from the environment are secrets.
    pub headers: crate::http_client::RequestHeaders,
    /// Events per request, at most.
    pub batch: usize,
    /// Per request.
    pub timeout: Duration,
}

/// The drift gate (`[bots.crawl.drift]`): a pass whose fields' fill rates fell, or that would
/// remove too much of the catalogue, is **gated** — its records keep their new values, but its
/// change events and removals wait for an operator's `seedlock pass release` or `discard`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DriftRules {
    /// A field's fill rate (the share of the records a pass wrote that hold a value for it)
    /// falling by more than this (absolute) against the last released pass gates the pass.
    pub max_fill_drop: f64,
    /// A pass that would remove more than this share of the bot's live records is gated.
    pub max_removed: f64,
    /// Fill rates are judged only on passes that wrote at least this many records.
    pub min_records: u64,
}

impl Default for DriftRules {
    fn default() -> Self {
        DriftRules {
            max_fill_drop: 0.2,
            max_removed: 0.1,
            min_records: 20,
        }
    }
}

/// How far one pass of a bot goes, at most: what stops a crawl trap (a calendar, a faceted
/// search with endless links) and never binds a normal shop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrawlBounds {
    /// Links followed from a seed (pagination counts too).
    pub max_depth: u32,
    /// Pages in one pass.
    pub max_pages: u64,
    /// Pages of one host in one pass.
    pub max_pages_per_host: u64,
}

impl CrawlSettings {
    /// Whether the bot lists items from sitemaps: a listing source beside `[bots.crawl.list]`.
    pub fn reads_sitemaps(&self) -> bool {
        !self.sitemaps.is_empty() || self.sitemaps_from_robots
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IncrementalMode {
    Fingerprint,
    Watermark,
    UpdatedAt,
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Incremental {
    pub mode: IncrementalMode,
    pub overlap: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SeedSource {
    Url {
        url: NormalizedUrl,
        format: SeedFormat,
    },
    Static(Vec<NormalizedUrl>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SeedFormat {
    Lines,
    Json,
    Sitemap,
}

/// When a ready bot's seeds are due for a refresh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefreshSchedule {
    /// When the UTC date (on the database server's clock) differs from the last refresh's.
    Daily,
    /// When this long has passed since the last refresh.
    Every(Duration),
}

impl RefreshSchedule {
    /// `"daily"`, or an interval such as `"6h"` (1 s to 7 days).
    pub(crate) fn parse(text: &str) -> Result<RefreshSchedule, String> {
        match text.trim() {
            "daily" => Ok(RefreshSchedule::Daily),
            other => {
                let every = positive("refresh", other).map_err(|_| {
                    format!("{other:?} is neither \"daily\" nor an interval such as \"6h\" (at most 7 days)")
                })?;
                if every < Duration::from_secs(1) {
                    return Err("an interval must be at least 1s".into());
                }
                Ok(RefreshSchedule::Every(every))
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnRefreshFailure {
    /// The bot goes back to Ready on its previous seeds (when it has any) while it retries.
    KeepPrevious,
    /// The bot stays not ready until a refresh succeeds.
    Wait,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBot {
    pub(super) id: String,
    pub(super) seeds: RawSeeds,
    #[serde(default = "default_refresh")]
    pub(super) refresh: String,
    #[serde(default = "default_on_failure")]
    pub(super) on_refresh_failure: OnRefreshFailure,
    pub(super) crawl: Option<RawCrawl>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCrawl {
    pub(super) scope: Vec<String>,
    #[serde(default = "default_follow")]
    pub(super) follow: RawSelectors,
    #[serde(default)]
    pub(super) allow: Vec<String>,
    #[serde(default)]
    pub(super) deny: Vec<String>,
    #[serde(default)]
    pub(super) strip_query: Vec<String>,
    #[serde(default = "default_max_links")]
    pub(super) max_links: u64,
    pub(super) list: Option<RawList>,
    pub(super) record: Option<RawRecord>,
    #[serde(default)]
    pub(super) incremental: RawIncremental,
    #[serde(default)]
    pub(super) priority: Vec<RawPriority>,
    #[serde(default)]
    pub(super) headers: std::collections::BTreeMap<String, RawHeader>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) user_agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) proxy: Option<RawEnv>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub(super) cookies: std::collections::BTreeMap<String, RawHeader>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) sitemaps: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) sitemaps_from_robots: bool,
    #[serde(default = "default_max_depth")]
    pub(super) max_depth: u64,
    #[serde(default = "default_max_pages")]
    pub(super) max_pages: u64,
    #[serde(default = "default_max_pages_per_host")]
    pub(super) max_pages_per_host: u64,
    #[serde(default = "default_max_url_length")]
    pub(super) max_url_length: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) drift: Option<RawDrift>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) notify: Option<RawNotify>,
}

/// `[bots.crawl.notify]`.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNotify {
    pub(super) url: String,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub(super) headers: std::collections::BTreeMap<String, RawHeader>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) batch: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) timeout: Option<String>,
}

impl RawNotify {
    fn validate(&self, keys: CrawlKeys<'_>) -> Result<NotifySettings, String> {
        let url = reqwest::Url::parse(self.url.trim())
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| {
                format!(
                    "key `{}`: {:?} is not an http(s) URL",
                    keys.key("notify.url"),
                    self.url
                )
            })?;
        let batch = match self.batch {
            None => 100,
            Some(n @ 1..=10_000) => n as usize,
            Some(n) => {
                return Err(format!(
                    "key `{}`: {n} is not between 1 and 10000",
                    keys.key("notify.batch")
                ))
            }
        };
        let timeout = match &self.timeout {
            None => Duration::from_secs(10),
            Some(raw) => super::positive(&keys.key("notify.timeout"), raw)?,
        };
        let headers = headers_at(&keys.key("notify.headers"), &self.headers)?;
        Ok(NotifySettings {
            url,
            headers,
            batch,
            timeout,
        })
    }
}

/// `[bots.crawl.drift]`.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDrift {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) max_fill_drop: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) max_removed: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) min_records: Option<u64>,
}

impl RawDrift {
    fn validate(&self, keys: CrawlKeys<'_>) -> Result<DriftRules, String> {
        let d = DriftRules::default();
        let share = |k: &str, v: Option<f64>, default: f64| match v {
            None => Ok(default),
            Some(x) if (0.0..=1.0).contains(&x) => Ok(x),
            Some(x) => Err(format!(
                "key `{}`: {x} is not a share between 0 and 1",
                keys.key(k)
            )),
        };
        Ok(DriftRules {
            max_fill_drop: share("drift.max_fill_drop", self.max_fill_drop, d.max_fill_drop)?,
            max_removed: share("drift.max_removed", self.max_removed, d.max_removed)?,
            min_records: self.min_records.unwrap_or(d.min_records).max(1),
        })
    }
}

pub(super) fn default_max_depth() -> u64 {
    50
}

pub(super) fn default_max_pages() -> u64 {
    10_000_000
}

pub(super) fn default_max_pages_per_host() -> u64 {
    5_000_000
}

pub(super) fn default_max_url_length() -> u64 {
    2048
}

/// `proxy = { env = "SHOP_PROXY" }`: a value read from the instance's environment only.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnv {
    pub(super) env: String,
}

/// `headers = { "Accept-Language" = "de", Authorization = { env = "SHOP_TOKEN" } }`: a value, or
/// the environment variable to read it from on the instance (the stored spec keeps the name,
/// never the value).
#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(super) enum RawHeader {
    Value(String),
    Env { env: String },
}

/// `priority = [{ match = "/sale/", priority = 3 }]`
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPriority {
    #[serde(rename = "match")]
    pub(super) url_match: String,
    pub(super) priority: i64,
}

/// Links (and listing items) read from one page at most: a hostile page with a million links
/// must not become a million frontier writes.
pub(super) fn default_max_links() -> u64 {
    10_000
}

pub(super) fn default_follow() -> RawSelectors {
    "a[href]".into()
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawList {
    pub(super) item: RawSelectors,
    pub(super) item_id: RawSelectors,
    pub(super) item_link: RawSelectors,
    #[serde(default)]
    pub(super) fingerprint: Vec<super::selectors::RawEntry>,
    pub(super) updated_at: Option<RawSelectors>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRecord {
    #[serde(rename = "match")]
    pub(super) url_match: String,
    pub(super) natural_key: RawSelectors,
    #[serde(default)]
    pub(super) fields: std::collections::BTreeMap<String, RawSelectors>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawIncremental {
    pub(super) mode: String,
    pub(super) overlap: String,
}

impl Default for RawIncremental {
    fn default() -> Self {
        Self {
            mode: "fingerprint".into(),
            overlap: "5m".into(),
        }
    }
}

/// The keys of one bot's `[bots.crawl]` section, for its errors: `key("scope")` is
/// `bots[0].crawl.scope`, and `named("follow")` prefixes an error with that key.
#[derive(Clone, Copy)]
pub(super) struct CrawlKeys<'a>(&'a str);

impl CrawlKeys<'_> {
    fn key(self, k: &str) -> String {
        format!("{}.crawl.{k}", self.0)
    }

    fn named(self, k: &str) -> impl Fn(String) -> String {
        let k = self.key(k);
        move |e: String| format!("key `{k}`: {e}")
    }

    fn regexes(self, k: &str, list: &[String]) -> Result<Vec<regex::Regex>, String> {
        list.iter()
            .map(|r| {
                regex::Regex::new(r).map_err(|e| {
                    format!(
                        "key `{}`: {r:?} is not a regular expression ({e})",
                        self.key(k)
                    )
                })
            })
            .collect()
    }
}

impl RawCrawl {
    pub(super) fn validate(self, p: &str) -> Result<CrawlSettings, String> {
        let keys = CrawlKeys(p);
        let links = self.link_rules(keys)?;
        let list = self.list.as_ref().map(|l| l.validate(keys)).transpose()?;
        let record = self.record.as_ref().map(|r| r.validate(keys)).transpose()?;
        let mut sitemaps = Vec::with_capacity(self.sitemaps.len());
        for raw in &self.sitemaps {
            let url = NormalizedUrl::parse_with(raw, &links.strip)
                .map_err(|e| format!("key `{}`: {raw:?}: {e}", keys.key("sitemaps")))?;
            if !sitemaps.contains(&url) {
                sitemaps.push(url);
            }
        }
        let listings = Listings {
            list: list.as_ref(),
            sitemaps: !sitemaps.is_empty() || self.sitemaps_from_robots,
        };
        let incremental = self.incremental.validate(keys, listings)?;
        let positive = |k: &str, n: u64| {
            if n == 0 {
                Err(format!("key `{}`: must be at least 1", keys.key(k)))
            } else {
                Ok(n)
            }
        };
        let bounds = CrawlBounds {
            max_depth: u32::try_from(positive("max_depth", self.max_depth)?)
                .map_err(|_| format!("key `{}`: too large", keys.key("max_depth")))?,
            max_pages: positive("max_pages", self.max_pages)?,
            max_pages_per_host: positive("max_pages_per_host", self.max_pages_per_host)?,
        };
        let drift = match &self.drift {
            Some(raw) => raw.validate(keys)?,
            None => DriftRules::default(),
        };
        let notify = self
            .notify
            .as_ref()
            .map(|raw| raw.validate(keys))
            .transpose()?;
        Ok(CrawlSettings {
            notify,
            drift,
            bounds,
            sitemaps,
            sitemaps_from_robots: self.sitemaps_from_robots,
            links,
            list,
            record,
            incremental,
            priorities: priorities(keys, &self.priority)?,
            headers: headers(keys, &self.headers)?,
            http: self.bot_http(keys)?,
        })
    }

    /// `user_agent`, `proxy` and `cookies`: each value checked as it will be sent.
    fn bot_http(&self, keys: CrawlKeys<'_>) -> Result<crate::http_client::BotHttp, String> {
        use crate::http_client::Secret;
        let user_agent = match &self.user_agent {
            Some(ua)
                if ua.trim().is_empty() || reqwest::header::HeaderValue::from_str(ua).is_err() =>
            {
                return Err(format!(
                    "key `{}`: a user agent is a non-empty header value",
                    keys.key("user_agent")
                ))
            }
            other => other.clone(),
        };
        let proxy = match &self.proxy {
            None => None,
            Some(RawEnv { env }) => {
                let key = keys.key("proxy");
                let url = std::env::var(env).map_err(|_| {
                    format!("key `{key}`: the environment variable ${env} is not set")
                })?;
                let scheme = url.split("://").next().unwrap_or("");
                let known = ["http", "https", "socks5", "socks5h"].contains(&scheme);
                if !known || reqwest::Proxy::all(&url).is_err() {
                    return Err(format!(
                        "key `{key}`: ${env} is not an http, https or socks5 proxy URL"
                    ));
                }
                Some(Secret::new(url, Some(env)))
            }
        };
        let has_cookie_header = self
            .headers
            .keys()
            .any(|h| h.eq_ignore_ascii_case("cookie"));
        if has_cookie_header && !self.cookies.is_empty() {
            return Err(format!(
                "key `{}`: a `Cookie` header and `cookies` do not go together; put every cookie in `cookies`",
                keys.key("cookies")
            ));
        }
        let mut cookies = Vec::new();
        for (name, raw) in &self.cookies {
            let key = keys.key(&format!("cookies.{name}"));
            let token = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
            if !token {
                return Err(format!("key `{key}`: {name:?} is not a cookie name"));
            }
            let (value, env) = match raw {
                RawHeader::Value(v) => (v.clone(), None),
                RawHeader::Env { env } => (
                    std::env::var(env).map_err(|_| {
                        format!("key `{key}`: the environment variable ${env} is not set")
                    })?,
                    Some(env.as_str()),
                ),
            };
            if value.bytes().any(|b| b.is_ascii_control() || b == b';') {
                return Err(match env {
                    Some(var) => format!("key `{key}`: the value of ${var} is not a cookie value"),
                    None => {
                        format!("key `{key}`: not a cookie value (no ';', no control characters)")
                    }
                });
            }
            cookies.push((name.clone(), Secret::new(value, env)));
        }
        Ok(crate::http_client::BotHttp {
            user_agent,
            proxy,
            cookies,
        })
    }

    /// `scope`, `follow`, `allow`, `deny`, `strip_query`, `max_links`.
    fn link_rules(&self, keys: CrawlKeys<'_>) -> Result<crate::extract::LinkRules, String> {
        if self.scope.is_empty() {
            return Err(format!(
                "key `{}`: name at least one host:port links may lead to",
                keys.key("scope")
            ));
        }
        for host in &self.scope {
            let ok = url::Url::parse(&format!("http://{host}/"))
                .is_ok_and(|u| u.host_str().is_some() && u.path() == "/");
            if !ok || host.contains(['/', '?', '#', '@']) {
                return Err(format!(
                    "key `{}`: {host:?} is not a host or host:port",
                    keys.key("scope")
                ));
            }
        }
        let (follow, follow_json) = selectors::follow(&keys.key("follow"), &self.follow)?;
        Ok(crate::extract::LinkRules {
            scope: self
                .scope
                .iter()
                .map(|s| s.trim().to_ascii_lowercase())
                .collect(),
            follow,
            follow_json,
            allow: keys.regexes("allow", &self.allow)?,
            deny: keys.regexes("deny", &self.deny)?,
            strip: crate::urls::StripQuery::parse(&self.strip_query)
                .map_err(keys.named("strip_query"))?,
            max_url_length: match usize::try_from(self.max_url_length) {
                Ok(n) if n >= 16 => n,
                _ => {
                    return Err(format!(
                        "key `{}`: must be at least 16 (bytes)",
                        keys.key("max_url_length")
                    ))
                }
            },
            max: match usize::try_from(self.max_links) {
                Ok(0) | Err(_) => {
                    return Err(format!(
                        "key `{}`: must be between 1 and {}",
                        keys.key("max_links"),
                        usize::MAX
                    ))
                }
                Ok(n) => n,
            },
        })
    }
}

impl RawList {
    pub(super) fn validate(
        &self,
        keys: CrawlKeys<'_>,
    ) -> Result<crate::extract::ListRules, String> {
        let key = |k: &str| keys.key(k);
        let (fingerprint, fingerprint_json) =
            selectors::fingerprint(&key("list.fingerprint"), &self.fingerprint)?;
        Ok(crate::extract::ListRules {
            item: selectors::item(&key("list.item"), &self.item)?,
            item_id: selectors::value(&key("list.item_id"), &self.item_id)?,
            item_link: selectors::value(&key("list.item_link"), &self.item_link)?,
            fingerprint,
            fingerprint_json,
            updated_at: match &self.updated_at {
                Some(u) => selectors::value(&key("list.updated_at"), u)?,
                None => crate::extract::Pick {
                    html: None,
                    json: None,
                },
            },
        })
    }
}

impl RawRecord {
    pub(super) fn validate(
        &self,
        keys: CrawlKeys<'_>,
    ) -> Result<crate::extract::RecordRules, String> {
        let mut fields = std::collections::BTreeMap::new();
        for (name, spec) in &self.fields {
            if name.is_empty() || name.contains('.') || name.starts_with('$') {
                return Err(format!(
                    "key `{}`: {name:?} cannot be a field name (no '.', no leading '$')",
                    keys.key("record.fields")
                ));
            }
            let field = selectors::field(&keys.key(&format!("record.fields.{name}")), spec)?;
            fields.insert(name.clone(), field);
        }
        Ok(crate::extract::RecordRules {
            url_match: regex::Regex::new(&self.url_match).map_err(|e| {
                format!(
                    "key `{}`: {:?} is not a regular expression ({e})",
                    keys.key("record.match"),
                    self.url_match
                )
            })?,
            natural_key: selectors::value(&keys.key("record.natural_key"), &self.natural_key)?,
            fields,
        })
    }
}

/// Where a bot's listing items come from: its `[bots.crawl.list]` rules, sitemaps, or both.
#[derive(Clone, Copy)]
pub(super) struct Listings<'a> {
    pub(super) list: Option<&'a crate::extract::ListRules>,
    pub(super) sitemaps: bool,
}

impl RawIncremental {
    /// The mode and its overlap; the modes that decide from the listings need `list` or
    /// sitemaps (and `updated_at` a time: `list.updated_at`, or the sitemaps' `lastmod`).
    pub(super) fn validate(
        &self,
        keys: CrawlKeys<'_>,
        listings: Listings<'_>,
    ) -> Result<Incremental, String> {
        let Listings { list, sitemaps } = listings;
        let mode = match self.mode.as_str() {
            "fingerprint" => IncrementalMode::Fingerprint,
            "watermark" => IncrementalMode::Watermark,
            "updated_at" => IncrementalMode::UpdatedAt,
            "full" => IncrementalMode::Full,
            other => {
                return Err(format!(
                    "key `{}`: {other:?} is not one of \"fingerprint\", \"watermark\", \"updated_at\", \"full\"",
                    keys.key("incremental.mode")
                ))
            }
        };
        if mode != IncrementalMode::Full && list.is_none() && !sitemaps {
            return Err(format!(
                "key `{}`: {:?} needs a [bots.crawl.list] section or `sitemaps` (or use \"full\")",
                keys.key("incremental.mode"),
                self.mode
            ));
        }
        if mode == IncrementalMode::UpdatedAt
            && !sitemaps
            && list.is_some_and(|l| l.updated_at.is_empty())
        {
            return Err(format!(
                "key `{}`: \"updated_at\" needs `list.updated_at` (where an item shows when it changed) or `sitemaps` (their lastmod)",
                keys.key("incremental.mode")
            ));
        }
        let overlap = duration(&keys.key("incremental.overlap"), &self.overlap)?;
        if overlap > MAX_DURATION {
            return Err(format!(
                "key `{}`: longer than the 7-day maximum",
                keys.key("incremental.overlap")
            ));
        }
        Ok(Incremental { mode, overlap })
    }
}

/// `[[bots.crawl.priority]]`: each `match` a regular expression, each `priority` 0–9.
pub(super) fn priorities(
    keys: CrawlKeys<'_>,
    raw: &[RawPriority],
) -> Result<Vec<(regex::Regex, i64)>, String> {
    let mut priorities = Vec::new();
    for (j, p) in raw.iter().enumerate() {
        let k = keys.key(&format!("priority[{j}]"));
        let pattern = regex::Regex::new(&p.url_match).map_err(|e| {
            format!(
                "key `{k}.match`: {:?} is not a regular expression ({e})",
                p.url_match
            )
        })?;
        if !(0..=9).contains(&p.priority) {
            return Err(format!(
                "key `{k}.priority`: {} must be between 0 and 9",
                p.priority
            ));
        }
        priorities.push((pattern, p.priority));
    }
    Ok(priorities)
}

/// `headers`: each a value or the environment variable it is read from here.
pub(super) fn headers(
    keys: CrawlKeys<'_>,
    raw: &std::collections::BTreeMap<String, RawHeader>,
) -> Result<crate::http_client::RequestHeaders, String> {
    headers_at(&keys.key("headers"), raw)
}

/// Headers under the config key `at`: each a value or the environment variable it is read from.
fn headers_at(
    at: &str,
    raw: &std::collections::BTreeMap<String, RawHeader>,
) -> Result<crate::http_client::RequestHeaders, String> {
    let mut headers = crate::http_client::RequestHeaders::default();
    for (name, raw) in raw {
        let k = format!("{at}.{name}");
        let pushed = match raw {
            RawHeader::Value(value) => headers.push(name, value, None),
            RawHeader::Env { env } => match std::env::var(env) {
                Ok(value) => headers.push(name, &value, Some(env)),
                Err(_) => Err(format!(
                    "the environment variable {env} is not set (or not UTF-8)"
                )),
            },
        };
        pushed.map_err(|e| format!("key `{k}`: {e}"))?;
    }
    Ok(headers)
}

pub(super) fn default_refresh() -> String {
    "daily".into()
}

pub(super) fn default_on_failure() -> OnRefreshFailure {
    OnRefreshFailure::KeepPrevious
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(super) enum RawSeeds {
    Static(Vec<String>),
    Source(RawSeedSource),
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSeedSource {
    pub(super) url: String,
    #[serde(default = "default_format")]
    pub(super) format: SeedFormat,
}

pub(super) fn default_format() -> SeedFormat {
    SeedFormat::Lines
}

impl RawBot {
    pub(super) fn validate(self, p: &str) -> Result<BotSettings, String> {
        let id = BotId::parse(&self.id).map_err(|e| format!("key `{p}.id`: {e}"))?;
        let seeds = match self.seeds {
            RawSeeds::Static(list) => {
                if list.is_empty() {
                    return Err(format!(
                        "key `{p}.seeds`: a static seed list must not be empty"
                    ));
                }
                let mut urls = Vec::with_capacity(list.len());
                for raw in &list {
                    let url =
                        NormalizedUrl::parse(raw).map_err(|e| format!("key `{p}.seeds`: {e}"))?;
                    if !urls.contains(&url) {
                        urls.push(url);
                    }
                }
                SeedSource::Static(urls)
            }
            RawSeeds::Source(source) => SeedSource::Url {
                url: NormalizedUrl::parse(&source.url)
                    .map_err(|e| format!("key `{p}.seeds.url`: {e}"))?,
                format: source.format,
            },
        };
        let refresh = RefreshSchedule::parse(&self.refresh)
            .map_err(|why| format!("key `{p}.refresh`: {why}"))?;
        let crawl = match self.crawl {
            Some(c) => Some(c.validate(p)?),
            None => None,
        };
        Ok(BotSettings {
            id,
            seeds,
            refresh,
            on_refresh_failure: self.on_refresh_failure,
            crawl,
        })
    }
}
