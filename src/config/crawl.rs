//! `[crawl]`: the instance's crawl limits — workers, leases, commit windows, flow control and the
//! per-host overrides.

use super::*;

/// `crawl.max_uncommitted_bytes` by default: 2 MiB of page bodies fetched and not yet committed
/// (a page in flight holds a few times its body while it is parsed and settled).
pub(crate) const DEFAULT_MAX_UNCOMMITTED_BYTES: u64 = 2 << 20;

/// `[crawl]`: how every bot's crawl runs on this instance.
#[derive(Clone, Debug, PartialEq)]
pub struct CrawlLimits {
    /// Pages one instance fetches at once per bot: the global cap above the per-host limits.
    pub workers: usize,
    /// Leased URLs waiting for their hosts, at most, per bot (lease rounds and the links leased on
    /// enqueue fill it).
    pub host_queue: usize,
    /// Group commits on their way at once per bot, at most (the commit window sizes how many;
    /// see `crawl::window`).
    pub writers: usize,
    /// Parsers per bot (on the blocking pool).
    pub parsers: usize,
    /// Fetched pages waiting for a parser (a bounded channel).
    pub parse_queue: usize,
    /// Pages one group commit carries at most (a writer commits what waits in the store queue,
    /// up to this many, as one batch).
    pub store_queue: usize,
    /// At most this many pages are fetched (or being fetched) and not yet committed per bot on
    /// this instance (the commit window sizes how many): what a crash can cost in repeated
    /// fetches.
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

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawCrawlLimits {
    pub(super) workers: u32,
    pub(super) host_queue: u32,
    pub(super) writers: u32,
    pub(super) parsers: u32,
    pub(super) parse_queue: u32,
    pub(super) store_queue: u32,
    pub(super) max_uncommitted: u32,
    pub(super) max_uncommitted_bytes: u64,
    pub(super) store_delay: String,
    pub(super) host_limit: u32,
    pub(super) host_limit_min: u32,
    pub(super) host_limit_max: u32,
    pub(super) politeness: String,
    pub(super) retry_budget: f64,
    pub(super) retry_budget_min: u32,
    pub(super) retry_window: String,
    pub(super) robots: bool,
    pub(super) robots_ttl: String,
    pub(super) robots_retry: String,
    pub(super) shed_after: String,
    pub(super) max_pass: String,
    pub(super) hosts: std::collections::BTreeMap<String, RawHostOverride>,
    pub(super) lease: String,
    pub(super) timeout: String,
    pub(super) max_page_bytes: u64,
    pub(super) attempts: u32,
    pub(super) backoff_base: String,
    pub(super) backoff_max: String,
    pub(super) transactions: Transactions,
    pub(super) min_coverage: f64,
    pub(super) max_error_rate: f64,
}

impl Default for RawCrawlLimits {
    fn default() -> Self {
        Self {
            workers: 32,
            host_queue: 256,
            writers: 8,
            parsers: 2,
            parse_queue: 16,
            store_queue: 256,
            max_uncommitted: 2048,
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
            max_page_bytes: crate::http_client::DEFAULT_MAX_PAGE_BYTES as u64,
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
    pub(super) fn validate(&self, user_agent: &str) -> Result<CrawlLimits, String> {
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
pub(super) struct RawHostOverride {
    pub(super) max_limit: Option<u32>,
    pub(super) min_delay: Option<String>,
}
