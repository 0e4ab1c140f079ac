//! Configuration: the TOML file, the environment overrides, and the validated [`Settings`] the
//! rest of the daemon runs on. Every check happens here, at start-up, so a bad value is one clear
//! line naming its key, never a failure later in a loop.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::ids::{BotId, InstanceId};
use crate::urls::NormalizedUrl;

/// Environment variables that override the file (the names are part of the user-facing contract).
pub const ENV_URI: &str = "MONGODB_URI";
pub const ENV_DATABASE: &str = "SEEDLOCK_DATABASE";
pub const ENV_INSTANCE_ID: &str = "SEEDLOCK_INSTANCE_ID";
pub const ENV_HTTP_LISTEN: &str = "SEEDLOCK_HTTP_LISTEN";

#[derive(Debug, thiserror::Error)]
#[error("config {path}: {message}")]
pub struct ConfigError {
    path: String,
    message: String,
}

/// Validated settings: everything the daemon and the admin commands need.
#[derive(Clone, Debug)]
pub struct Settings {
    pub mongo: MongoSettings,
    pub instance_id: InstanceId,
    pub lock: LockSettings,
    pub refresh: RefreshLimits,
    pub crawl: CrawlLimits,
    pub http_listen: Option<String>,
    pub log: LogSettings,
    /// The file's `[[bots]]`; empty: the instance runs the bots defined in the database.
    pub bots: Vec<BotSettings>,
    /// `[instance] bots`: which of the database's bots to run (globs; empty: all).
    pub bot_filter: Vec<String>,
}

impl Settings {
    /// True when the bots come from the database (the file has no `[[bots]]`).
    pub fn bots_from_database(&self) -> bool {
        self.bots.is_empty()
    }

    /// Whether this instance runs the database's bot `id` (`[instance] bots`).
    pub fn runs(&self, id: &BotId) -> bool {
        self.bot_filter.is_empty() || self.bot_filter.iter().any(|g| glob_match(g, id.as_str()))
    }
}

/// `*` matches any run of characters, `?` one character; everything else itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// A bot's definition as kept in its document's `spec`: the `[[bots]]` entry as the file wrote
/// it (defaults are filled in when it is read), without its `id` (the document's `_id`).
#[derive(Clone, Debug)]
pub struct BotSpec {
    pub settings: BotSettings,
    pub spec: bson::Document,
}

/// Reads the `[[bots]]` of a file (a whole config file, or one with only `[[bots]]`), validated
/// exactly as at start-up: the first bad key is one line naming the bot and the key.
pub fn specs_from_file(path: &Path) -> Result<Vec<BotSpec>, ConfigError> {
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
pub fn bot_from_spec(id: &BotId, spec: &bson::Document) -> Result<BotSettings, String> {
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

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[derive(Clone, Debug)]
pub struct MongoSettings {
    pub uri: String,
    pub database: String,
    pub connect_timeout: Duration,
    /// Longest any one database operation may take before it counts as failed (transient);
    /// the wait for a pooled connection counts toward it.
    pub op_timeout: Duration,
    /// The driver's connection pool, at most (`mongo.max_pool_size`).
    pub max_pool_size: u32,
}

/// The default of `refresh.concurrency`: refreshes one instance runs at once. Each holds a lock
/// (a heartbeat statement per tick) and a seed fetch; sixteen keep a seed source's burst and the
/// database's share of one instance small while a fleet of a thousand trivial bots still becomes
/// ready within seconds.
pub const DEFAULT_REFRESH_CONCURRENCY: usize = 16;

/// `crawl.max_uncommitted_bytes` by default: 2 MiB of page bodies fetched and not yet committed
/// (a page in flight holds a few times its body while it is parsed and settled).
pub const DEFAULT_MAX_UNCOMMITTED_BYTES: u64 = 2 << 20;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LockSettings {
    pub ttl: Duration,
    pub heartbeat: Duration,
    pub max_refresh: Duration,
    /// Waiters take a refresh that still heartbeats over only after `max_refresh` + this: the
    /// holder gives up at `max_refresh` and records the failure (with its backoff) within it.
    pub stuck_grace: Duration,
    pub poll: Duration,
}

/// Bounds on one refresh of a seed source.
#[derive(Clone, Debug, PartialEq)]
pub struct RefreshLimits {
    pub timeout: Duration,
    pub max_bytes: usize,
    pub max_seeds: usize,
    pub attempts: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub sitemap_depth: u32,
    pub user_agent: String,
    /// Refreshes one instance runs at once (`refresh.concurrency`), across all its bots.
    pub concurrency: usize,
}

/// `[crawl]`: how every bot's crawl runs on this instance.
#[derive(Clone, Debug, PartialEq)]
pub struct CrawlLimits {
    /// Pages one instance fetches at once per bot: the global cap above the per-host limits.
    pub workers: usize,
    /// Leased URLs waiting for their hosts, at most, per bot (lease rounds and the links leased on
    /// enqueue fill it).
    pub host_queue: usize,
    /// Pages stored at once per bot (the store stage's concurrency).
    pub writers: usize,
    /// Parsers per bot (on the blocking pool).
    pub parsers: usize,
    /// Fetched pages waiting for a parser (a bounded channel).
    pub parse_queue: usize,
    /// Parsed pages waiting for a commit or being committed (a writer commits what waits, up to
    /// this many, as one batch).
    pub store_queue: usize,
    /// At most this many pages are fetched (or being fetched) and not yet committed per bot on
    /// this instance: what a crash can cost in repeated fetches.
    pub max_uncommitted: usize,
    /// At most this many bytes of page bodies are fetched and not yet committed per bot on this
    /// instance (beside `max_uncommitted`): a listing page of a hundred items weighs as much as
    /// dozens of detail pages, and holds that much more memory until its commit.
    pub max_uncommitted_bytes: usize,
    /// Added to every page's store step (to test a slow database); zero in production.
    pub store_delay: Duration,
    pub flow: crate::flow::FlowSettings,
    /// Honour robots.txt (`--ignore-robots` turns it off for one's own sites).
    pub robots: bool,
    pub robots_ttl: Duration,
    /// How long a host whose robots.txt is unavailable (5xx, no answer) stays paused.
    pub robots_retry: Duration,
    /// Load shedding: a lowest-priority URL that has waited longer than this for a host that
    /// throttled us within the last minute is deferred by as long, before it costs a fetch.
    pub shed_after: Duration,
    /// A running pass finishes before a refresh's next pass starts — unless it is older than
    /// this (then the refresh cuts it short).
    pub max_pass: Duration,
    /// How long a leased URL stays this worker's: sized to the slowest normal fetch.
    pub url_lease: Duration,
    /// Per page fetch.
    pub timeout: Duration,
    pub max_page_bytes: usize,
    /// Fetches of one URL per pass before it is recorded failed.
    pub attempts: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub transactions: Transactions,
    /// Deletion detection needs at least this share of the pass's listing pages done …
    pub min_coverage: f64,
    /// … and at most this share of its pages failed.
    pub max_error_rate: f64,
    pub user_agent: String,
}

/// `crawl.transactions`: how a page's record and its done mark commit together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transactions {
    /// In a transaction when the server supports them (probed at start-up), else ordered writes.
    Auto,
    /// Always in a transaction; start-up fails when the server has none.
    On,
    /// Never: record first (guarded by lease time), then the fenced done mark.
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug)]
pub struct LogSettings {
    pub format: LogFormat,
    pub level: String,
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
    pub headers: crate::fetch::RequestHeaders,
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
    pub fn parse(text: &str) -> Result<RefreshSchedule, String> {
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

// ---- the file's shape -------------------------------------------------------------------------

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    mongo: RawMongo,
    #[serde(default)]
    instance: RawInstance,
    #[serde(default)]
    lock: RawLock,
    #[serde(default)]
    refresh: RawRefresh,
    #[serde(default)]
    crawl: RawCrawlLimits,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    bots: Vec<RawBot>,
}

/// The default of `mongo.max_pool_size`: connections one instance opens, at most. Every bot's
/// crawl keeps a few operations in flight (a lease round, group commits, enqueues) and the hub
/// one change stream; 32 leave room for a handful of crawling bots and a burst of refreshes
/// without opening a connection per bot (the driver's default is 10).
pub const DEFAULT_MAX_POOL_SIZE: u32 = 32;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawMongo {
    uri: String,
    database: String,
    connect_timeout: String,
    op_timeout: String,
    max_pool_size: u32,
}

impl Default for RawMongo {
    fn default() -> Self {
        Self {
            uri: "mongodb://127.0.0.1:27017".into(),
            database: "seedlock".into(),
            connect_timeout: "5s".into(),
            op_timeout: "10s".into(),
            max_pool_size: DEFAULT_MAX_POOL_SIZE,
        }
    }
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawInstance {
    id: String,
    /// With no `[[bots]]` in the file: run only the database's bots whose id matches one of these
    /// globs (`*`, `?`); empty runs them all.
    bots: Vec<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawLock {
    ttl: String,
    heartbeat: Option<String>,
    max_refresh: String,
    stuck_grace: Option<String>,
    poll: String,
}

impl Default for RawLock {
    fn default() -> Self {
        Self {
            ttl: "30s".into(),
            heartbeat: None,
            max_refresh: "10m".into(),
            stuck_grace: None,
            poll: "1s".into(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawRefresh {
    timeout: String,
    max_bytes: u64,
    max_seeds: u64,
    attempts: u32,
    backoff_base: String,
    backoff_max: String,
    sitemap_depth: u32,
    user_agent: String,
    concurrency: u32,
}

impl Default for RawRefresh {
    fn default() -> Self {
        Self {
            timeout: "30s".into(),
            max_bytes: 10 * 1024 * 1024,
            max_seeds: 100_000,
            attempts: 3,
            backoff_base: "1s".into(),
            backoff_max: "5m".into(),
            sitemap_depth: 2,
            user_agent: concat!("seedlock/", env!("CARGO_PKG_VERSION")).into(),
            concurrency: DEFAULT_REFRESH_CONCURRENCY as u32,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawCrawlLimits {
    workers: u32,
    host_queue: u32,
    writers: u32,
    parsers: u32,
    parse_queue: u32,
    store_queue: u32,
    max_uncommitted: u32,
    max_uncommitted_bytes: u64,
    store_delay: String,
    host_limit: u32,
    host_limit_min: u32,
    host_limit_max: u32,
    politeness: String,
    retry_budget: f64,
    retry_budget_min: u32,
    retry_window: String,
    robots: bool,
    robots_ttl: String,
    robots_retry: String,
    shed_after: String,
    max_pass: String,
    hosts: std::collections::BTreeMap<String, RawHostOverride>,
    lease: String,
    timeout: String,
    max_page_bytes: u64,
    attempts: u32,
    backoff_base: String,
    backoff_max: String,
    transactions: Transactions,
    min_coverage: f64,
    max_error_rate: f64,
}

impl Default for RawCrawlLimits {
    fn default() -> Self {
        Self {
            workers: 32,
            host_queue: 256,
            writers: 4,
            parsers: 2,
            parse_queue: 16,
            store_queue: 256,
            max_uncommitted: 512,
            max_uncommitted_bytes: DEFAULT_MAX_UNCOMMITTED_BYTES,
            store_delay: "0s".into(),
            host_limit: 4,
            host_limit_min: 1,
            host_limit_max: 32,
            politeness: "0s".into(),
            retry_budget: 0.1,
            retry_budget_min: 10,
            retry_window: "60s".into(),
            robots: true,
            robots_ttl: "1h".into(),
            robots_retry: "60s".into(),
            shed_after: "10m".into(),
            max_pass: "24h".into(),
            hosts: Default::default(),
            lease: "60s".into(),
            timeout: "30s".into(),
            max_page_bytes: crate::fetch::DEFAULT_MAX_PAGE_BYTES as u64,
            attempts: 3,
            backoff_base: "1s".into(),
            backoff_max: "5m".into(),
            transactions: Transactions::Off,
            min_coverage: 0.95,
            max_error_rate: 0.05,
        }
    }
}

impl RawCrawlLimits {
    fn validate(&self, user_agent: &str) -> Result<CrawlLimits, String> {
        self.check_sizes()?;
        let flow = self.flow()?;
        self.check_pages()?;
        let lease = positive("crawl.lease", &self.lease)?;
        let timeout = positive("crawl.timeout", &self.timeout)?;
        if timeout >= lease {
            return Err(format!(
                "key `crawl.lease`: {} must be longer than crawl.timeout ({}), or a slow fetch outlives its lease",
                humantime::format_duration(lease),
                humantime::format_duration(timeout)
            ));
        }
        let backoff_base = positive("crawl.backoff_base", &self.backoff_base)?;
        let backoff_max = positive("crawl.backoff_max", &self.backoff_max)?;
        if backoff_max < backoff_base {
            return Err(
                "key `crawl.backoff_max`: must not be shorter than crawl.backoff_base".into(),
            );
        }
        Ok(CrawlLimits {
            workers: self.workers as usize,
            host_queue: self.host_queue as usize,
            writers: self.writers as usize,
            parsers: self.parsers as usize,
            parse_queue: self.parse_queue as usize,
            store_queue: self.store_queue as usize,
            max_uncommitted: self.max_uncommitted as usize,
            max_uncommitted_bytes: usize::try_from(self.max_uncommitted_bytes)
                .unwrap_or(usize::MAX),
            store_delay: bounded("crawl.store_delay", &self.store_delay)?,
            flow,
            robots: self.robots,
            robots_ttl: positive("crawl.robots_ttl", &self.robots_ttl)?,
            robots_retry: positive("crawl.robots_retry", &self.robots_retry)?,
            shed_after: positive("crawl.shed_after", &self.shed_after)?,
            max_pass: positive("crawl.max_pass", &self.max_pass)?,
            url_lease: lease,
            timeout,
            max_page_bytes: usize::try_from(self.max_page_bytes).unwrap_or(usize::MAX),
            attempts: self.attempts,
            backoff_base,
            backoff_max,
            transactions: self.transactions,
            min_coverage: self.min_coverage,
            max_error_rate: self.max_error_rate,
            user_agent: user_agent.to_owned(),
        })
    }

    /// The queue and pool sizes (each 1 to its maximum), the host limits and the retry budget.
    fn check_sizes(&self) -> Result<(), String> {
        for (key, value, max) in [
            ("crawl.workers", self.workers, 1024),
            ("crawl.host_queue", self.host_queue, 100_000),
            ("crawl.writers", self.writers, 256),
            ("crawl.parsers", self.parsers, 256),
            ("crawl.parse_queue", self.parse_queue, 100_000),
            ("crawl.store_queue", self.store_queue, 100_000),
            ("crawl.max_uncommitted", self.max_uncommitted, 100_000),
            ("crawl.host_limit", self.host_limit, 1024),
            ("crawl.host_limit_min", self.host_limit_min, 1024),
            ("crawl.host_limit_max", self.host_limit_max, 1024),
        ] {
            if value == 0 || value > max {
                return Err(format!("key `{key}`: {value} must be between 1 and {max}"));
            }
        }
        if self.host_limit_min > self.host_limit_max
            || !(self.host_limit_min..=self.host_limit_max).contains(&self.host_limit)
        {
            return Err(format!(
                "key `crawl.host_limit`: {} must lie between crawl.host_limit_min ({}) and crawl.host_limit_max ({})",
                self.host_limit, self.host_limit_min, self.host_limit_max
            ));
        }
        if !(0.0..=10.0).contains(&self.retry_budget) {
            return Err(format!(
                "key `crawl.retry_budget`: {} must be a share of first attempts between 0 and 10",
                self.retry_budget
            ));
        }
        Ok(())
    }

    /// How hard each host is asked: the limits, the spacing, the retry budget, the overrides.
    fn flow(&self) -> Result<crate::flow::FlowSettings, String> {
        let hosts = self.host_overrides()?;
        Ok(crate::flow::FlowSettings {
            initial_limit: self.host_limit,
            min_limit: self.host_limit_min,
            max_limit: self.host_limit_max,
            min_delay: bounded("crawl.politeness", &self.politeness)?,
            hosts,
            retry_budget: self.retry_budget,
            retry_budget_min: self.retry_budget_min,
            retry_window: positive("crawl.retry_window", &self.retry_window)?,
        })
    }

    /// `[crawl.hosts."host:port"]`.
    fn host_overrides(
        &self,
    ) -> Result<std::collections::HashMap<String, crate::flow::HostOverride>, String> {
        let mut hosts = std::collections::HashMap::new();
        for (host, o) in &self.hosts {
            let key = format!("crawl.hosts.\"{host}\"");
            let well_formed = host
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !well_formed {
                return Err(format!(
                    "key `{key}`: a host is written \"host:port\" (e.g. \"example.com:443\")"
                ));
            }
            if o.max_limit == Some(0) {
                return Err(format!("key `{key}.max_limit`: must be at least 1"));
            }
            let min_delay = o
                .min_delay
                .as_deref()
                .map(|d| bounded(&format!("{key}.min_delay"), d))
                .transpose()?;
            hosts.insert(
                host.to_ascii_lowercase(),
                crate::flow::HostOverride {
                    max_limit: o.max_limit,
                    min_delay,
                },
            );
        }
        Ok(hosts)
    }

    /// The attempts, the page size caps and the pass-end shares.
    fn check_pages(&self) -> Result<(), String> {
        if self.attempts == 0 || self.attempts > 20 {
            return Err(format!(
                "key `crawl.attempts`: {} must be between 1 and 20",
                self.attempts
            ));
        }
        if self.max_page_bytes == 0 {
            return Err("key `crawl.max_page_bytes`: must be greater than zero".into());
        }
        if !(1024..=1 << 40).contains(&self.max_uncommitted_bytes) {
            return Err(format!(
                "key `crawl.max_uncommitted_bytes`: {} must be between 1024 (1 KiB) and {} (1 TiB)",
                self.max_uncommitted_bytes,
                1_u64 << 40
            ));
        }
        for (key, share) in [
            ("crawl.min_coverage", self.min_coverage),
            ("crawl.max_error_rate", self.max_error_rate),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return Err(format!(
                    "key `{key}`: {share} must be a share between 0 and 1"
                ));
            }
        }
        Ok(())
    }
}

/// `[crawl.hosts."host:port"]`: one host's own ceiling and spacing.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawHostOverride {
    max_limit: Option<u32>,
    min_delay: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawHttp {
    listen: String,
}

impl Default for RawHttp {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawLog {
    format: LogFormat,
    level: String,
}

impl Default for RawLog {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawBot {
    id: String,
    seeds: RawSeeds,
    #[serde(default = "default_refresh")]
    refresh: String,
    #[serde(default = "default_on_failure")]
    on_refresh_failure: OnRefreshFailure,
    crawl: Option<RawCrawl>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawCrawl {
    scope: Vec<String>,
    #[serde(default = "default_follow")]
    follow: String,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    #[serde(default)]
    strip_query: Vec<String>,
    #[serde(default = "default_max_links")]
    max_links: u64,
    list: Option<RawList>,
    record: Option<RawRecord>,
    #[serde(default)]
    incremental: RawIncremental,
    #[serde(default)]
    priority: Vec<RawPriority>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, RawHeader>,
}

/// `headers = { "Accept-Language" = "de", Authorization = { env = "SHOP_TOKEN" } }`: a value, or
/// the environment variable to read it from on the instance (the stored spec keeps the name,
/// never the value).
#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
enum RawHeader {
    Value(String),
    Env { env: String },
}

/// `priority = [{ match = "/sale/", priority = 3 }]`
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawPriority {
    #[serde(rename = "match")]
    url_match: String,
    priority: i64,
}

/// Links (and listing items) read from one page at most: a hostile page with a million links
/// must not become a million frontier writes.
fn default_max_links() -> u64 {
    10_000
}

fn default_follow() -> String {
    "a[href]".into()
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawList {
    item: String,
    item_id: String,
    item_link: String,
    #[serde(default)]
    fingerprint: Vec<String>,
    updated_at: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawRecord {
    #[serde(rename = "match")]
    url_match: String,
    natural_key: String,
    #[serde(default)]
    fields: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawIncremental {
    mode: String,
    overlap: String,
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
struct CrawlKeys<'a>(&'a str);

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
    fn validate(self, p: &str) -> Result<CrawlSettings, String> {
        let keys = CrawlKeys(p);
        let links = self.link_rules(keys)?;
        let list = self.list.as_ref().map(|l| l.validate(keys)).transpose()?;
        let record = self.record.as_ref().map(|r| r.validate(keys)).transpose()?;
        let incremental = self.incremental.validate(keys, list.as_ref())?;
        Ok(CrawlSettings {
            links,
            list,
            record,
            incremental,
            priorities: priorities(keys, &self.priority)?,
            headers: headers(keys, &self.headers)?,
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
        Ok(crate::extract::LinkRules {
            scope: self
                .scope
                .iter()
                .map(|s| s.trim().to_ascii_lowercase())
                .collect(),
            follow: crate::extract::selector(&self.follow).map_err(keys.named("follow"))?,
            allow: keys.regexes("allow", &self.allow)?,
            deny: keys.regexes("deny", &self.deny)?,
            strip: crate::urls::StripQuery::parse(&self.strip_query)
                .map_err(keys.named("strip_query"))?,
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
    fn validate(&self, keys: CrawlKeys<'_>) -> Result<crate::extract::ListRules, String> {
        use crate::extract::ValueSpec;
        Ok(crate::extract::ListRules {
            item: crate::extract::selector(&self.item).map_err(keys.named("list.item"))?,
            item_id: ValueSpec::parse(&self.item_id).map_err(keys.named("list.item_id"))?,
            item_link: ValueSpec::parse(&self.item_link).map_err(keys.named("list.item_link"))?,
            fingerprint: self
                .fingerprint
                .iter()
                .map(|f| ValueSpec::parse(f).map_err(keys.named("list.fingerprint")))
                .collect::<Result<_, _>>()?,
            updated_at: self
                .updated_at
                .as_deref()
                .map(|u| ValueSpec::parse(u).map_err(keys.named("list.updated_at")))
                .transpose()?,
        })
    }
}

impl RawRecord {
    fn validate(&self, keys: CrawlKeys<'_>) -> Result<crate::extract::RecordRules, String> {
        use crate::extract::ValueSpec;
        let mut fields = std::collections::BTreeMap::new();
        for (name, spec) in &self.fields {
            if name.is_empty() || name.contains('.') || name.starts_with('$') {
                return Err(format!(
                    "key `{}`: {name:?} cannot be a field name (no '.', no leading '$')",
                    keys.key("record.fields")
                ));
            }
            let spec =
                ValueSpec::parse(spec).map_err(keys.named(&format!("record.fields.{name}")))?;
            fields.insert(name.clone(), spec);
        }
        Ok(crate::extract::RecordRules {
            url_match: regex::Regex::new(&self.url_match).map_err(|e| {
                format!(
                    "key `{}`: {:?} is not a regular expression ({e})",
                    keys.key("record.match"),
                    self.url_match
                )
            })?,
            natural_key: ValueSpec::parse(&self.natural_key)
                .map_err(keys.named("record.natural_key"))?,
            fields,
        })
    }
}

impl RawIncremental {
    /// The mode and its overlap; the modes that decide from the listings need `list` (and
    /// `updated_at` its `list.updated_at`).
    fn validate(
        &self,
        keys: CrawlKeys<'_>,
        list: Option<&crate::extract::ListRules>,
    ) -> Result<Incremental, String> {
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
        if mode != IncrementalMode::Full && list.is_none() {
            return Err(format!(
                "key `{}`: {:?} needs a [bots.crawl.list] section (or use \"full\")",
                keys.key("incremental.mode"),
                self.mode
            ));
        }
        if mode == IncrementalMode::UpdatedAt && list.is_some_and(|l| l.updated_at.is_none()) {
            return Err(format!(
                "key `{}`: \"updated_at\" needs `list.updated_at` (where an item shows when it changed)",
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
fn priorities(
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
fn headers(
    keys: CrawlKeys<'_>,
    raw: &std::collections::BTreeMap<String, RawHeader>,
) -> Result<crate::fetch::RequestHeaders, String> {
    let mut headers = crate::fetch::RequestHeaders::default();
    for (name, raw) in raw {
        let k = keys.key(&format!("headers.{name}"));
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

fn default_refresh() -> String {
    "daily".into()
}

fn default_on_failure() -> OnRefreshFailure {
    OnRefreshFailure::KeepPrevious
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
enum RawSeeds {
    Static(Vec<String>),
    Source(RawSeedSource),
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawSeedSource {
    url: String,
    #[serde(default = "default_format")]
    format: SeedFormat,
}

fn default_format() -> SeedFormat {
    SeedFormat::Lines
}

// ---- loading ----------------------------------------------------------------------------------

impl Settings {
    /// Reads `path`, applies the environment overrides (`MONGODB_URI`, `SEEDLOCK_DATABASE`,
    /// `SEEDLOCK_INSTANCE_ID`, `SEEDLOCK_HTTP_LISTEN`) and validates everything.
    pub fn load(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            message: format!("cannot read the file: {e}"),
        })?;
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Self::from_toml(&text, env).map_err(|message| ConfigError {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses a config from its TOML text, with `env` standing in for the process environment.
    pub fn from_toml(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig {
            mongo: RawMongo::default(),
            instance: RawInstance::default(),
            lock: RawLock::default(),
            refresh: RawRefresh::default(),
            crawl: RawCrawlLimits::default(),
            http: RawHttp::default(),
            log: RawLog::default(),
            bots: Vec::new(),
        }))
        .merge(Toml::string(text));
        for (var, key) in [
            (ENV_URI, "mongo.uri"),
            (ENV_DATABASE, "mongo.database"),
            (ENV_INSTANCE_ID, "instance.id"),
            (ENV_HTTP_LISTEN, "http.listen"),
        ] {
            if let Some(value) = env(var) {
                figment = figment.merge((key, value));
            }
        }
        let raw: RawConfig = figment.extract().map_err(describe_figment_error)?;
        // Errors from parsers (regex, CSS) can span lines; the contract is one line.
        raw.validate()
            .map_err(|e| e.split_whitespace().collect::<Vec<_>>().join(" "))
    }
}

fn describe_figment_error(err: figment::Error) -> String {
    // One line: the first error, with its key path; figment lists the rest on further lines.
    let first = err.into_iter().next();
    match first {
        Some(e) if !e.path.is_empty() => format!("key `{}`: {}", e.path.join("."), e.kind),
        Some(e) => e.kind.to_string().replace('\n', " "),
        None => "invalid configuration".into(),
    }
}

fn duration(key: &str, raw: &str) -> Result<Duration, String> {
    humantime::parse_duration(raw.trim()).map_err(|e| {
        format!("key `{key}`: {raw:?} is not a duration such as \"30s\" or \"10m\" ({e})")
    })
}

/// Longest duration any setting accepts: a week. Longer values are typos, and bounding them
/// keeps every timestamp computation far from overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// A duration that may be zero, at most [`MAX_DURATION`].
fn bounded(key: &str, raw: &str) -> Result<Duration, String> {
    let d = duration(key, raw)?;
    if d > MAX_DURATION {
        return Err(format!(
            "key `{key}`: {raw:?} is longer than the 7-day maximum"
        ));
    }
    Ok(d)
}

fn positive(key: &str, raw: &str) -> Result<Duration, String> {
    let d = duration(key, raw)?;
    if d.is_zero() {
        return Err(format!("key `{key}`: must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(format!(
            "key `{key}`: {raw:?} is longer than the 7-day maximum"
        ));
    }
    Ok(d)
}

impl RawConfig {
    fn validate(self) -> Result<Settings, String> {
        let mongo = MongoSettings {
            uri: self.mongo.uri.trim().to_owned(),
            database: validate_database(&self.mongo.database)?,
            connect_timeout: positive("mongo.connect_timeout", &self.mongo.connect_timeout)?,
            op_timeout: positive("mongo.op_timeout", &self.mongo.op_timeout)?,
            max_pool_size: match self.mongo.max_pool_size {
                n @ 1..=1000 => n,
                n => {
                    return Err(format!(
                        "key `mongo.max_pool_size`: {n} must be between 1 and 1000"
                    ))
                }
            },
        };
        if !(mongo.uri.starts_with("mongodb://") || mongo.uri.starts_with("mongodb+srv://")) {
            return Err(format!(
                "key `mongo.uri`: {} must start with mongodb:// or mongodb+srv://",
                crate::redact::redact_uri(&mongo.uri)
            ));
        }
        let instance_id = if self.instance.id.trim().is_empty() {
            InstanceId::generate()
        } else {
            InstanceId::parse(&self.instance.id).map_err(|e| format!("key `instance.id`: {e}"))?
        };
        let lock = self.lock.validate()?;
        let refresh = self.refresh.validate()?;
        let crawl = self.crawl.validate(&refresh.user_agent)?;
        let listen = self.http.listen.trim();
        let http_listen = if listen.is_empty() || listen == "off" {
            None
        } else {
            listen.parse::<std::net::SocketAddr>().map_err(|_| {
                format!("key `http.listen`: {listen:?} is not an address such as \"127.0.0.1:9464\" (or \"off\")")
            })?;
            Some(listen.to_owned())
        };
        let level = self.log.level.trim().to_owned();
        tracing_subscriber::EnvFilter::try_new(&level)
            .map_err(|e| format!("key `log.level`: {level:?} is not a log filter ({e})"))?;
        let mut seen = HashSet::new();
        let mut bots = Vec::with_capacity(self.bots.len());
        for (i, bot) in self.bots.into_iter().enumerate() {
            let bot = bot.validate(&format!("bots[{i}]"))?;
            if !seen.insert(bot.id.clone()) {
                return Err(format!(
                    "key `bots[{i}].id`: bot {:?} is configured twice",
                    bot.id.as_str()
                ));
            }
            bots.push(bot);
        }
        Ok(Settings {
            mongo,
            instance_id,
            lock,
            refresh,
            crawl,
            http_listen,
            log: LogSettings {
                format: self.log.format,
                level,
            },
            bots,
            bot_filter: validate_globs(&self.instance.bots)?,
        })
    }
}

fn validate_globs(globs: &[String]) -> Result<Vec<String>, String> {
    globs
        .iter()
        .map(|g| {
            let g = g.trim();
            let id = g.replace(['*', '?'], "a");
            BotId::parse(&id)
                .map(|_| g.to_owned())
                .map_err(|e| format!("key `instance.bots`: {g:?} is not a bot id glob ({e})"))
        })
        .collect()
}

fn validate_database(raw: &str) -> Result<String, String> {
    let name = raw.trim();
    if name.is_empty()
        || name.len() > 63
        || name
            .chars()
            .any(|c| "/\\. \"$".contains(c) || c.is_control())
    {
        return Err(format!(
            "key `mongo.database`: {raw:?} is not a database name (1-63 characters, none of / \\ . \" $ or space)"
        ));
    }
    Ok(name.to_owned())
}

impl RawLock {
    fn validate(&self) -> Result<LockSettings, String> {
        let ttl = positive("lock.ttl", &self.ttl)?;
        let heartbeat = match &self.heartbeat {
            Some(raw) => positive("lock.heartbeat", raw)?,
            None => ttl / 3,
        };
        if heartbeat >= ttl {
            return Err(format!(
                "key `lock.heartbeat`: {} must be shorter than lock.ttl ({}), or the lock expires between heartbeats",
                humantime::format_duration(heartbeat),
                humantime::format_duration(ttl)
            ));
        }
        let max_refresh = positive("lock.max_refresh", &self.max_refresh)?;
        if max_refresh <= ttl {
            return Err(format!(
                "key `lock.max_refresh`: {} must be longer than lock.ttl ({})",
                humantime::format_duration(max_refresh),
                humantime::format_duration(ttl)
            ));
        }
        let stuck_grace = match &self.stuck_grace {
            Some(raw) => positive("lock.stuck_grace", raw)?,
            None => ttl,
        };
        let poll = positive("lock.poll", &self.poll)?;
        Ok(LockSettings {
            ttl,
            heartbeat,
            max_refresh,
            stuck_grace,
            poll,
        })
    }
}

impl RawRefresh {
    fn validate(&self) -> Result<RefreshLimits, String> {
        let backoff_base = positive("refresh.backoff_base", &self.backoff_base)?;
        let backoff_max = positive("refresh.backoff_max", &self.backoff_max)?;
        if backoff_max < backoff_base {
            return Err(
                "key `refresh.backoff_max`: must not be shorter than refresh.backoff_base".into(),
            );
        }
        if self.attempts == 0 || self.attempts > 20 {
            return Err(format!(
                "key `refresh.attempts`: {} must be between 1 and 20",
                self.attempts
            ));
        }
        if self.max_bytes == 0 || self.max_seeds == 0 {
            return Err(
                "keys `refresh.max_bytes` and `refresh.max_seeds` must be greater than zero".into(),
            );
        }
        if self.sitemap_depth > 5 {
            return Err(format!(
                "key `refresh.sitemap_depth`: {} must be at most 5",
                self.sitemap_depth
            ));
        }
        let user_agent = self.user_agent.trim();
        if user_agent.is_empty() || reqwest::header::HeaderValue::from_str(user_agent).is_err() {
            return Err(format!(
                "key `refresh.user_agent`: {user_agent:?} is not a valid header value"
            ));
        }
        Ok(RefreshLimits {
            timeout: positive("refresh.timeout", &self.timeout)?,
            max_bytes: usize::try_from(self.max_bytes).unwrap_or(usize::MAX),
            max_seeds: usize::try_from(self.max_seeds).unwrap_or(usize::MAX),
            attempts: self.attempts,
            backoff_base,
            backoff_max,
            sitemap_depth: self.sitemap_depth,
            user_agent: user_agent.to_owned(),
            concurrency: match self.concurrency {
                n @ 1..=10_000 => n as usize,
                n => {
                    return Err(format!(
                        "key `refresh.concurrency`: {n} must be between 1 and 10000"
                    ))
                }
            },
        })
    }
}

impl RawBot {
    fn validate(self, p: &str) -> Result<BotSettings, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[mongo]
uri = "mongodb://127.0.0.1:27017"
database = "seedlock"
[instance]
id = ""
[lock]
ttl = "30s"
heartbeat = "10s"
max_refresh = "10m"
poll = "1s"
[[bots]]
id = "shop"
seeds = { url = "http://127.0.0.1:8000/seeds.txt", format = "lines" }
refresh = "daily"
on_refresh_failure = "keep_previous"
[[bots]]
id = "static"
seeds = ["https://example.com/a", "https://EXAMPLE.com/a#frag"]
refresh = "6h"
on_refresh_failure = "wait"
"#;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn the_documented_example_parses() {
        let s = Settings::from_toml(EXAMPLE, no_env).unwrap();
        assert_eq!(s.mongo.database, "seedlock");
        assert_eq!(s.lock.ttl, Duration::from_secs(30));
        assert_eq!(s.lock.heartbeat, Duration::from_secs(10));
        assert_eq!(s.bots.len(), 2);
        assert_eq!(s.bots[0].refresh, RefreshSchedule::Daily);
        assert_eq!(
            s.bots[1].refresh,
            RefreshSchedule::Every(Duration::from_secs(6 * 3600))
        );
        assert_eq!(s.bots[1].on_refresh_failure, OnRefreshFailure::Wait);
        match &s.bots[1].seeds {
            SeedSource::Static(urls) => assert_eq!(urls.len(), 1, "normalized duplicates collapse"),
            other => panic!("expected a static list, got {other:?}"),
        }
        assert!(
            s.instance_id.as_str().contains(':'),
            "an empty id is generated as host:pid:random"
        );
    }

    #[test]
    fn the_shipped_configs_parse() {
        let compose = Settings::from_toml(include_str!("../deploy/seedlock.toml"), no_env).unwrap();
        assert!(
            compose.bots_from_database(),
            "the compose instances run the database's bots"
        );
        let bots = specs_from_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/bots.toml"
        )))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(bots.len(), 2);
        // The README's configuration reference is a complete, valid config (with the variable
        // its secret header names set, as on an instance; nextest runs each test alone).
        std::env::set_var("SHOP_TOKEN", "t");
        let s = Settings::from_toml(readme_reference(), no_env)
            .unwrap_or_else(|e| panic!("README config: {e}"));
        assert_eq!(s.lock.heartbeat, Duration::from_secs(10));
        assert_eq!(
            s.refresh.user_agent,
            concat!("seedlock/", env!("CARGO_PKG_VERSION"))
        );
    }

    /// The README's configuration reference, as text.
    fn readme_reference() -> &'static str {
        let readme = include_str!("../README.md");
        let start = readme
            .find("## Configuration reference")
            .expect("README has the reference");
        let block = &readme[start..];
        let body = &block[block.find("```toml").unwrap() + 7..];
        &body[..body.find("```").unwrap()]
    }

    /// Every key path of a TOML value: `crawl.workers`, `bots[].crawl.list.item`; the keys of the
    /// free-form maps (`crawl.hosts`, `bots[].crawl.record.fields`) become `*`.
    fn key_paths(value: &toml::Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
        match value {
            toml::Value::Table(table) => {
                let free_form = prefix.ends_with("crawl.hosts")
                    || prefix.ends_with("record.fields")
                    || prefix.ends_with("crawl.headers");
                for (key, child) in table {
                    let key = if free_form { "*" } else { key.as_str() };
                    let path = if prefix.is_empty() {
                        key.to_owned()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    out.insert(path.clone());
                    key_paths(child, &path, out);
                }
            }
            toml::Value::Array(items) => {
                for item in items.iter().filter(|item| item.is_table()) {
                    key_paths(item, &format!("{prefix}[]"), out);
                }
            }
            _ => {}
        }
    }

    /// Every key the file format has, from a config with every optional part present. A struct
    /// literal without `..`: a new field in any `Raw*` struct fails to compile here until it is
    /// added, and then the test below fails until the README documents it.
    fn every_key() -> std::collections::BTreeSet<String> {
        let full = RawConfig {
            mongo: RawMongo {
                uri: "mongodb://h".into(),
                database: "d".into(),
                connect_timeout: "1s".into(),
                op_timeout: "1s".into(),
                max_pool_size: 1,
            },
            instance: RawInstance {
                id: "i".into(),
                bots: vec!["shop-*".into()],
            },
            lock: RawLock {
                ttl: "1s".into(),
                heartbeat: Some("1s".into()),
                max_refresh: "1s".into(),
                stuck_grace: Some("1s".into()),
                poll: "1s".into(),
            },
            refresh: RawRefresh {
                timeout: "1s".into(),
                max_bytes: 1,
                max_seeds: 1,
                attempts: 1,
                backoff_base: "1s".into(),
                backoff_max: "1s".into(),
                sitemap_depth: 1,
                user_agent: "u".into(),
                concurrency: 1,
            },
            crawl: RawCrawlLimits {
                workers: 1,
                host_queue: 1,
                writers: 1,
                parsers: 1,
                parse_queue: 1,
                store_queue: 1,
                max_uncommitted: 1,
                max_uncommitted_bytes: 1024,
                store_delay: "0s".into(),
                host_limit: 1,
                host_limit_min: 1,
                host_limit_max: 1,
                politeness: "0s".into(),
                retry_budget: 0.1,
                retry_budget_min: 1,
                retry_window: "1s".into(),
                robots: true,
                robots_ttl: "1s".into(),
                robots_retry: "1s".into(),
                shed_after: "1s".into(),
                max_pass: "1s".into(),
                hosts: [(
                    "h:1".to_owned(),
                    RawHostOverride {
                        max_limit: Some(1),
                        min_delay: Some("1s".into()),
                    },
                )]
                .into(),
                lease: "1s".into(),
                timeout: "1s".into(),
                max_page_bytes: 1,
                attempts: 1,
                backoff_base: "1s".into(),
                backoff_max: "1s".into(),
                transactions: Transactions::Auto,
                min_coverage: 0.5,
                max_error_rate: 0.5,
            },
            http: RawHttp {
                listen: "off".into(),
            },
            log: RawLog {
                format: LogFormat::Text,
                level: "info".into(),
            },
            bots: vec![RawBot {
                id: "b".into(),
                seeds: RawSeeds::Source(RawSeedSource {
                    url: "http://h/".into(),
                    format: SeedFormat::Lines,
                }),
                refresh: "daily".into(),
                on_refresh_failure: OnRefreshFailure::Wait,
                crawl: Some(RawCrawl {
                    scope: vec!["h".into()],
                    follow: "a".into(),
                    allow: vec!["a".into()],
                    deny: vec!["d".into()],
                    strip_query: vec!["s".into()],
                    max_links: 7,
                    list: Some(RawList {
                        item: "i".into(),
                        item_id: "@id".into(),
                        item_link: "a@href".into(),
                        fingerprint: vec!["f".into()],
                        updated_at: Some("@u".into()),
                    }),
                    record: Some(RawRecord {
                        url_match: "/p/".into(),
                        natural_key: ".k".into(),
                        fields: [("f".to_owned(), "s".to_owned())].into(),
                    }),
                    incremental: RawIncremental {
                        mode: "full".into(),
                        overlap: "1s".into(),
                    },
                    priority: vec![RawPriority {
                        url_match: "/".into(),
                        priority: 1,
                    }],
                    headers: [
                        ("a".to_owned(), RawHeader::Value("v".into())),
                        ("b".to_owned(), RawHeader::Env { env: "E".into() }),
                    ]
                    .into(),
                }),
            }],
        };
        let mut keys = std::collections::BTreeSet::new();
        key_paths(&toml::Value::try_from(&full).unwrap(), "", &mut keys);
        keys
    }

    #[test]
    fn every_config_key_is_documented_in_the_readme() {
        let known = every_key();
        assert!(known.contains("crawl.hosts.*.min_delay"), "{known:?}");
        assert!(known.contains("bots[].crawl.priority[].match"), "{known:?}");
        let mut documented = std::collections::BTreeSet::new();
        key_paths(
            &readme_reference().parse::<toml::Value>().unwrap(),
            "",
            &mut documented,
        );
        let undocumented: Vec<_> = known.difference(&documented).collect();
        assert!(
            undocumented.is_empty(),
            "config keys missing from the README's configuration reference: {undocumented:?}"
        );
        let unknown: Vec<_> = documented.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "the README documents keys the config does not have: {unknown:?}"
        );
    }

    #[test]
    fn the_crawl_example_parses() {
        let text = r#"
[[bots]]
id = "shop"
seeds = { url = "http://127.0.0.1:8080/seeds.txt" }
[bots.crawl]
scope = ["127.0.0.1:8080"]
follow = "a[href]"
strip_query = ["utm_*", "ref"]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = { title = "h1", price = ".price", status = ".status" }
[bots.crawl.incremental]
mode = "fingerprint"
overlap = "5m"
"#;
        let s = Settings::from_toml(text, no_env).unwrap();
        let crawl = s.bots[0].crawl.as_ref().expect("a crawl section");
        assert_eq!(crawl.list.as_ref().unwrap().fingerprint.len(), 3);
        assert_eq!(crawl.record.as_ref().unwrap().fields.len(), 3);
        assert_eq!(crawl.incremental.mode, IncrementalMode::Fingerprint);
        assert_eq!(crawl.incremental.overlap, Duration::from_secs(300));
        assert!(crawl.links.strip.matches("utm_source") && crawl.links.strip.matches("ref"));
    }

    #[test]
    fn heartbeat_defaults_to_a_third_of_ttl() {
        let s = Settings::from_toml("[lock]\nttl = \"9s\"", no_env).unwrap();
        assert_eq!(s.lock.heartbeat, Duration::from_secs(3));
    }

    #[test]
    fn environment_overrides_the_file() {
        let env = |name: &str| match name {
            ENV_URI => Some("mongodb://db.example:27018".to_owned()),
            ENV_DATABASE => Some("other".to_owned()),
            ENV_INSTANCE_ID => Some("12345".to_owned()),
            _ => None,
        };
        let s = Settings::from_toml(EXAMPLE, env).unwrap();
        assert_eq!(s.mongo.uri, "mongodb://db.example:27018");
        assert_eq!(s.mongo.database, "other");
        assert_eq!(
            s.instance_id.as_str(),
            "12345",
            "a numeric id stays a string"
        );
    }

    /// A bot with a `[bots.crawl]` table: `scope` first, then `extra` lines.
    fn crawl(extra: &str) -> String {
        let scope = if extra.starts_with("scope") {
            ""
        } else {
            "scope = [\"h:1\"]\n"
        };
        format!("[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\n[bots.crawl]\n{scope}{extra}\n")
    }

    #[test]
    fn bad_values_name_their_key() {
        let crawl_cases = [
            (crawl("follow = \"a[\""), "bots[0].crawl.follow"),
            (crawl("scope = []"), "bots[0].crawl.scope"),
            (crawl("deny = [\"(\"]"), "bots[0].crawl.deny"),
            (crawl("[bots.crawl.list]\nitem = \"..x\"\nitem_id = \"@id\"\nitem_link = \"a@href\""), "bots[0].crawl.list.item"),
            (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = \"!!\" }"), "bots[0].crawl.record.fields.price"),
            (crawl("[bots.crawl.incremental]\nmode = \"sometimes\""), "bots[0].crawl.incremental.mode"),
            (crawl("headers = { \"a b\" = \"x\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.a b"),
            (crawl("headers = { Host = \"x\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.Host"),
            (crawl("headers = { X-A = \"line\\nbreak\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.X-A"),
            (crawl("headers = { X-Token = { env = \"SEEDLOCK_TEST_NEVER_SET\" } }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.X-Token"),
        ];
        let mut cases: Vec<(String, &str)> = crawl_cases.into_iter().collect();
        cases.extend([
            ("[lock]\nttl = \"soon\"", "lock.ttl"),
            ("[lock]\nttl = \"300000y\"\nmax_refresh = \"400000y\"", "lock.ttl"),
            ("[lock]\npoll = \"1000y\"", "lock.poll"),
            ("[mongo]\nop_timeout = \"0s\"", "mongo.op_timeout"),
            ("[crawl]\nmax_uncommitted_bytes = 100", "crawl.max_uncommitted_bytes"),
            ("[lock]\nttl = \"10s\"\nheartbeat = \"10s\"", "lock.heartbeat"),
            ("[lock]\nttl = \"10m\"\nmax_refresh = \"5m\"", "lock.max_refresh"),
            ("[mongo]\nuri = \"http://x\"", "mongo.uri"),
            ("[mongo]\ndatabase = \"a.b\"", "mongo.database"),
            ("[mongo]\nport = 1", "port"),
            ("[[bots]]\nid = \"a b\"\nseeds = [\"http://x/\"]", "bots[0].id"),
            ("[[bots]]\nid = \"a\"\nseeds = []", "bots[0].seeds"),
            ("[[bots]]\nid = \"a\"\nseeds = [\"ftp://x/\"]", "bots[0].seeds"),
            ("[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\nrefresh = \"weekly\"", "bots[0].refresh"),
            ("[[bots]]\nid = \"a\"\nseeds = { url = \"http://x/\", format = \"csv\" }", "seeds"),
            (
                "[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\n[[bots]]\nid = \"a\"\nseeds = [\"http://y/\"]",
                "bots[1].id",
            ),
            ("[http]\nlisten = \"nowhere\"", "http.listen"),
            ("[log]\nformat = \"xml\"", "log.format"),
        ].map(|(t, k): (&str, &str)| (t.to_owned(), k)));
        for (text, key) in &cases {
            let (text, key): (&str, &str) = (text, key);
            let err = Settings::from_toml(text, no_env).expect_err(text);
            assert!(
                err.contains(key),
                "error for {text:?} should name {key}: {err}"
            );
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[test]
    fn a_header_from_the_environment_is_sent_but_never_shown() {
        let var = "SEEDLOCK_TEST_HEADER_SECRET";
        // No other test reads or writes this variable (and nextest runs each test alone).
        std::env::set_var(var, "s3cr3t-value");
        let text = crawl(&format!(
            "headers = {{ Accept-Language = \"de\", X-Token = {{ env = \"{var}\" }} }}\n[bots.crawl.incremental]\nmode = \"full\""
        ));
        let settings = Settings::from_toml(&text, no_env).unwrap();
        let headers = &settings.bots[0].crawl.as_ref().unwrap().headers;
        assert_eq!(
            headers.shown(),
            [
                ("accept-language".to_owned(), "de".to_owned()),
                ("x-token".to_owned(), format!("<from ${var}>")),
            ]
        );
        let debug = format!("{:?}", settings.bots[0]);
        assert!(!debug.contains("s3cr3t-value"), "{debug}");
        assert!(debug.contains(&format!("<from ${var}>")), "{debug}");
    }

    #[test]
    fn a_bad_uri_is_reported_without_its_password() {
        let err = Settings::from_toml("[mongo]\nuri = \"postgres://u:hunter2@h/db\"", no_env)
            .unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
    }
}
