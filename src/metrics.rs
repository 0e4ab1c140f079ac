//! Metrics, served at `/metrics` by `http` in the OpenMetrics text format (scraped by
//! Prometheus): per-bot state, acquisitions, takeovers, edit locks lost, refresh outcomes and
//! durations, waiting time, repairs; crawl requests, crawled pages by result, record writes by
//! kind, URL leases lost, the current pass and finished passes.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::ids::BotId;
use crate::ids::PassNumber;
use crate::lock::state::BotState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct BotLabel {
    pub bot: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StateLabels {
    pub bot: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabels {
    pub bot: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HostLabel {
    pub host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HostKindLabels {
    pub host: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StageLabels {
    pub bot: String,
    pub stage: String,
}

/// A reader of gauges owned elsewhere (see [`Metrics::add_source`]).
pub(crate) type Source = Box<dyn Fn(&Metrics) -> bool + Send + Sync>;

type Ratio = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Pressure, not only throughput: per stage and per host.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabel {
    command: String,
}

struct FlowMetrics {
    stage_depth: Family<StageLabels, Gauge>,
    stage_oldest: Family<StageLabels, Ratio>,
    in_flight: Family<HostLabel, Gauge>,
    limit: Family<HostLabel, Ratio>,
    paused_seconds: Family<HostLabel, Ratio>,
    throttles: Family<HostLabel, Counter>,
    timeouts: Family<HostLabel, Counter>,
    blocked: Family<HostLabel, Counter>,
    requests: Family<HostKindLabels, Counter>,
    retry_ratio: Family<HostLabel, Ratio>,
    retry_deferred: Family<BotLabel, Counter>,
    shed: Family<BotLabel, Counter>,
    requests_per_record: Family<BotLabel, Ratio>,
    commit_window: Family<BotLabel, Gauge>,
    commit_writers: Family<BotLabel, Gauge>,
    db_commands: Family<CommandLabel, Counter>,
    pool_wait: Counter<f64, std::sync::atomic::AtomicU64>,
    pool_checkouts: Counter,
    /// The last pool-wait totals, so the counters advance by the difference.
    last_pool: std::sync::Mutex<(Duration, u64)>,
    /// The last command counts, so the counters advance by the difference.
    last_commands: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    /// The last snapshot per host, so counters advance by the difference.
    last: std::sync::Mutex<std::collections::HashMap<String, crate::flow::HostSnapshot>>,
}

impl FlowMetrics {
    /// Creates the flow series and registers them: the database's, the pipeline stages', the
    /// hosts', then the per-bot pressure series.
    fn register(registry: &mut Registry) -> Self {
        let m = Self {
            stage_depth: Default::default(),
            stage_oldest: Default::default(),
            in_flight: Default::default(),
            limit: Default::default(),
            paused_seconds: Default::default(),
            throttles: Default::default(),
            timeouts: Default::default(),
            blocked: Default::default(),
            requests: Default::default(),
            retry_ratio: Default::default(),
            retry_deferred: Default::default(),
            shed: Default::default(),
            requests_per_record: Default::default(),
            commit_window: Default::default(),
            commit_writers: Default::default(),
            db_commands: Default::default(),
            pool_wait: Default::default(),
            pool_checkouts: Default::default(),
            last_pool: Default::default(),
            last_commands: Default::default(),
            last: Default::default(),
        };
        m.register_database(registry);
        m.register_stages(registry);
        m.register_hosts(registry);
        m.register_pressure(registry);
        m
    }

    /// Registers the database series: commands sent, pool waits and connections checked out.
    fn register_database(&self, registry: &mut Registry) {
        registry.register(
            "db_commands",
            "Database commands (round trips) this instance sent, by command name",
            self.db_commands.clone(),
        );
        registry.register(
            "db_pool_wait_seconds",
            "Time database operations waited for a pooled connection (counted toward mongo.op_timeout)",
            self.pool_wait.clone(),
        );
        registry.register(
            "db_pool_checkouts",
            "Connections checked out of the driver's pool (one per command sent)",
            self.pool_checkouts.clone(),
        );
    }

    /// Registers the crawl pipeline's series: items per stage and the age of each stage's oldest.
    fn register_stages(&self, registry: &mut Registry) {
        registry.register(
            "crawl_stage_depth",
            "Items in each crawl pipeline stage (host_queue, fetch, parse, store)",
            self.stage_depth.clone(),
        );
        registry.register(
            "crawl_stage_oldest_seconds",
            "Age of the oldest item in each crawl pipeline stage",
            self.stage_oldest.clone(),
        );
    }

    /// Registers the per-host limiter series: requests in flight, limit, pause, throttles,
    /// timeouts, admissions blocked, requests by kind and retry ratio.
    fn register_hosts(&self, registry: &mut Registry) {
        registry.register(
            "host_in_flight",
            "Requests in flight per host",
            self.in_flight.clone(),
        );
        registry.register(
            "host_limit",
            "The adaptive (AIMD) concurrency limit per host",
            self.limit.clone(),
        );
        registry.register(
            "host_paused_seconds",
            "Seconds until a paused host (Retry-After, robots.txt unavailable) admits again; 0 when not paused",
            self.paused_seconds.clone(),
        );
        registry.register(
            "host_throttles",
            "429/503 answers per host",
            self.throttles.clone(),
        );
        registry.register(
            "host_timeouts",
            "Fetch timeouts per host",
            self.timeouts.clone(),
        );
        registry.register(
            "host_admissions_blocked",
            "Times a host's limiter turned a request away (at its limit, paused, or spacing)",
            self.blocked.clone(),
        );
        registry.register(
            "host_requests",
            "Requests admitted per host, by kind (first, retry)",
            self.requests.clone(),
        );
        registry.register(
            "host_retry_ratio",
            "Retries over first attempts per host within the retry window",
            self.retry_ratio.clone(),
        );
    }

    /// Registers the per-bot pressure series: retries deferred, URLs shed and page requests per
    /// record stored.
    fn register_pressure(&self, registry: &mut Registry) {
        registry.register(
            "crawl_retries_deferred",
            "Retries pushed past the host's retry window because its retry budget was spent",
            self.retry_deferred.clone(),
        );
        registry.register(
            "crawl_shed",
            "Lowest-priority URLs deferred at the frontier, unfetched, because their host was throttling",
            self.shed.clone(),
        );
        registry.register(
            "crawl_requests_per_record",
            "Page requests sent per record stored by this instance (seed 000's health signal)",
            self.requests_per_record.clone(),
        );
        registry.register(
            "crawl_commit_window_pages",
            "Pages this instance may hold fetched and not yet committed per bot, sized from the measured commit latency and page rate (crawl.max_uncommitted at most)",
            self.commit_window.clone(),
        );
        registry.register(
            "crawl_commit_writers",
            "Group commits this instance may have on their way at once per bot, sized with the commit window (crawl.writers at most)",
            self.commit_writers.clone(),
        );
    }
}

type Seconds = Family<BotLabel, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

/// Per-bot state and the edit lock: state, pause, epoch, acquisitions, takeovers, locks lost.
struct LockMetrics {
    bot_state: Family<StateLabels, Gauge>,
    bot_paused: Family<BotLabel, Gauge>,
    lock_epoch: Family<BotLabel, Gauge>,
    acquisitions: Family<BotLabel, Counter>,
    takeovers: Family<KindLabels, Counter>,
    edit_locks_lost: Family<BotLabel, Counter>,
}

impl LockMetrics {
    /// Creates the state and edit-lock series and registers them, in that order.
    fn register(registry: &mut Registry) -> Self {
        let bot_state = Family::<StateLabels, Gauge>::default();
        registry.register(
            "bot_state",
            "1 for the state this instance is in for a bot, 0 otherwise",
            bot_state.clone(),
        );
        let bot_paused = Family::<BotLabel, Gauge>::default();
        registry.register(
            "bot_paused",
            "1 while an operator has paused the bot (no lock taken, no URL leased), 0 otherwise",
            bot_paused.clone(),
        );
        let lock_epoch = Family::<BotLabel, Gauge>::default();
        registry.register(
            "lock_epoch",
            "The last lock epoch this instance saw for a bot",
            lock_epoch.clone(),
        );
        let acquisitions = Family::<BotLabel, Counter>::default();
        registry.register(
            "lock_acquisitions",
            "Edit locks this instance won (including takeovers)",
            acquisitions.clone(),
        );
        let takeovers = Family::<KindLabels, Counter>::default();
        registry.register(
            "lock_takeovers",
            "Stuck locks this instance took over, by kind (expired, stuck, orphaned)",
            takeovers.clone(),
        );
        let edit_locks_lost = Family::<BotLabel, Counter>::default();
        registry.register(
            "edit_locks_lost",
            "Refreshes this instance stopped without writing: a fenced write (heartbeat or last write) matched nothing, or heartbeats went unconfirmed until the lock ran out",
            edit_locks_lost.clone(),
        );
        Self {
            bot_state,
            bot_paused,
            lock_epoch,
            acquisitions,
            takeovers,
            edit_locks_lost,
        }
    }
}

/// Refresh outcomes, repairs, and the time refreshes and waits took.
struct RefreshMetrics {
    refreshes: Family<KindLabels, Counter>,
    repairs: Family<KindLabels, Counter>,
    refresh_duration: Seconds,
    wait_duration: Seconds,
}

impl RefreshMetrics {
    /// Creates the refresh series and registers them: outcomes, repairs, then the durations.
    fn register(registry: &mut Registry) -> Self {
        let refreshes = Family::<KindLabels, Counter>::default();
        registry.register(
            "refreshes",
            "Refreshes finished by this instance, by result (ok, failed, released, lost)",
            refreshes.clone(),
        );
        let repairs = Family::<KindLabels, Counter>::default();
        registry.register(
            "repairs",
            "Broken documents this instance repaired, by kind (contradictory, malformed)",
            repairs.clone(),
        );
        let refresh_duration =
            Seconds::new_with_constructor(seconds_histogram as fn() -> Histogram);
        registry.register(
            "refresh_duration_seconds",
            "Time from winning the lock to the refresh's last write",
            refresh_duration.clone(),
        );
        let wait_duration = Seconds::new_with_constructor(seconds_histogram as fn() -> Histogram);
        registry.register(
            "wait_duration_seconds",
            "Time spent waiting for another instance's refresh",
            wait_duration.clone(),
        );
        Self {
            refreshes,
            repairs,
            refresh_duration,
            wait_duration,
        }
    }
}

/// The crawl's series: pages by result, requests, record writes, URL leases lost, lease
/// attempts, the chain's pages fetched ahead, the current pass and finished passes.
struct CrawlMetrics {
    pages: Family<KindLabels, Counter>,
    requests: Family<BotLabel, Counter>,
    records: Family<KindLabels, Counter>,
    url_leases_lost: Family<BotLabel, Counter>,
    urls_dropped: Family<KindLabels, Counter>,
    lease_queries: Family<KindLabels, Counter>,
    chain_fetched_ahead: Family<KindLabels, Counter>,
    crawl_pass: Family<BotLabel, Gauge>,
    passes_finished: Family<BotLabel, Counter>,
}

impl CrawlMetrics {
    /// Creates the crawl series and registers them, pages first, finished passes last.
    fn register(registry: &mut Registry) -> Self {
        let pages = Family::<KindLabels, Counter>::default();
        registry.register(
            "crawl_pages",
            "Pages this instance crawled, by result (stored, done, not_modified, skipped, gone, retry, failed)",
            pages.clone(),
        );
        let requests = Family::<BotLabel, Counter>::default();
        registry.register(
            "crawl_requests",
            "Page requests this instance sent (robots.txt not counted), as each is sent",
            requests.clone(),
        );
        let records = Family::<KindLabels, Counter>::default();
        registry.register(
            "crawl_records",
            "Record writes by this instance, by kind (inserted, changed, unchanged, superseded)",
            records.clone(),
        );
        let url_leases_lost = Family::<BotLabel, Counter>::default();
        registry.register(
            "crawl_url_leases_lost",
            "URL leases this instance lost: pages whose lease went to another worker before their commit, and leases that ran out while the URL waited for its host (not fetched)",
            url_leases_lost.clone(),
        );
        let urls_dropped = Family::<KindLabels, Counter>::default();
        registry.register(
            "crawl_urls_dropped",
            "URLs this instance did not follow because a crawl-trap bound dropped them, by bound (max_depth, max_url_length, repeated_segment, max_pages, max_pages_per_host)",
            urls_dropped.clone(),
        );
        let lease_queries = Family::<KindLabels, Counter>::default();
        registry.register(
            "crawl_lease_queries",
            "Frontier lease attempts by this instance, by result (leased, empty)",
            lease_queries.clone(),
        );
        let chain_fetched_ahead = Family::<KindLabels, Counter>::default();
        registry.register(
            "crawl_chain_fetched_ahead",
            "Listing pages of a pagination chain this instance fetched while the write leasing them was on its way, by outcome (kept: the write took the lease; dropped: it did not, and nothing of the page was written)",
            chain_fetched_ahead.clone(),
        );
        let crawl_pass = Family::<BotLabel, Gauge>::default();
        registry.register(
            "crawl_pass",
            "The crawl pass this instance last worked on for a bot",
            crawl_pass.clone(),
        );
        let passes_finished = Family::<BotLabel, Counter>::default();
        registry.register(
            "crawl_passes_finished",
            "Crawl passes whose end this instance recorded",
            passes_finished.clone(),
        );
        Self {
            pages,
            requests,
            records,
            url_leases_lost,
            urls_dropped,
            lease_queries,
            chain_fetched_ahead,
            crawl_pass,
            passes_finished,
        }
    }
}

/// The catalogue's freshness, as the bots' documents keep it at each pass end (every instance
/// exports every bot's; the alert rules take the `max by (bot)`), and each bot's refresh interval
/// as this instance runs it.
struct CatalogueMetrics {
    last_complete_pass: Family<BotLabel, Ratio>,
    coverage: Family<BotLabel, Ratio>,
    removed: Family<BotLabel, Counter>,
    live_records: Family<BotLabel, Gauge>,
    refresh_interval: Family<BotLabel, Ratio>,
    gated: Family<BotLabel, Gauge>,
    events_released: Family<BotLabel, Counter>,
    webhook_delivered: Family<BotLabel, Counter>,
    webhook_failures: Family<BotLabel, Counter>,
    webhook_lag: Family<BotLabel, Gauge>,
}

impl CatalogueMetrics {
    fn register(registry: &mut Registry) -> Self {
        let last_complete_pass = Family::<BotLabel, Ratio>::default();
        registry.register(
            "last_complete_pass_timestamp_seconds",
            "When the bot's last complete pass (trusted to remove: coverage and error rate passed the deletion gate) was evaluated, in Unix seconds",
            last_complete_pass.clone(),
        );
        let coverage = Family::<BotLabel, Ratio>::default();
        registry.register(
            "pass_coverage_ratio",
            "The listing coverage of the bot's last finished pass (0 to 1)",
            coverage.clone(),
        );
        let removed = Family::<BotLabel, Counter>::default();
        registry.register(
            "records_removed",
            "Records the bot's passes marked removed, in all (kept in the bot's document at each pass end)",
            removed.clone(),
        );
        let live_records = Family::<BotLabel, Gauge>::default();
        registry.register(
            "live_records",
            "The bot's live records after its last pass's evaluation",
            live_records.clone(),
        );
        let refresh_interval = Family::<BotLabel, Ratio>::default();
        registry.register(
            "refresh_interval_seconds",
            "How often this instance refreshes the bot's seeds (a day for \"daily\")",
            refresh_interval.clone(),
        );
        let gated = Family::<BotLabel, Gauge>::default();
        registry.register(
            "pass_gated",
            "1 while one of the bot's passes is gated by the drift gate (its change events and removals wait for `seedlock pass release` or `discard`)",
            gated.clone(),
        );
        let events_released = Family::<BotLabel, Counter>::default();
        registry.register(
            "change_events_released",
            "Change feed events the bot's released passes made visible, in all (kept in the bot's document)",
            events_released.clone(),
        );
        let webhook_delivered = Family::<BotLabel, Counter>::default();
        registry.register(
            "webhook_events_delivered",
            "Change events this instance delivered to the bot's webhook (a 2xx answer)",
            webhook_delivered.clone(),
        );
        let webhook_failures = Family::<BotLabel, Counter>::default();
        registry.register(
            "webhook_failures",
            "Webhook deliveries of the bot's events that failed (an error, a timeout or a non-2xx answer): retried with backoff",
            webhook_failures.clone(),
        );
        let webhook_lag = Family::<BotLabel, Gauge>::default();
        registry.register(
            "webhook_lag_events",
            "Released change events of the bot not yet delivered to its webhook, as the delivering instance last saw",
            webhook_lag.clone(),
        );
        Self {
            last_complete_pass,
            coverage,
            removed,
            live_records,
            refresh_interval,
            gated,
            events_released,
            webhook_delivered,
            webhook_failures,
            webhook_lag,
        }
    }
}

/// A total the bot's document keeps, carried into `counter`: it only grows.
fn carry_total(counter: &Counter, total: i64) {
    let shown = counter.get();
    if let Ok(total) = u64::try_from(total) {
        if total > shown {
            counter.inc_by(total - shown);
        }
    }
}

pub struct Metrics {
    registry: Registry,
    catalogue: CatalogueMetrics,
    lock: LockMetrics,
    refresh: RefreshMetrics,
    db_errors: Counter,
    crawl: CrawlMetrics,
    flow: FlowMetrics,
    /// Called before every encode, to read gauges from their owners (hosts, stages).
    sources: std::sync::Mutex<Vec<Source>>,
    /// Milliseconds after `started` of the last successful database round trip (for `/healthz`);
    /// monotonic, so a jumping wall clock cannot fake health.
    last_db_ok: AtomicI64,
    started: std::time::Instant,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates every series and registers them under the `seedlock` prefix, in exposition order:
    /// state and edit lock, refreshes, database errors, crawl, then flow.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("seedlock");
        let lock = LockMetrics::register(&mut registry);
        let refresh = RefreshMetrics::register(&mut registry);
        let db_errors = Counter::default();
        registry.register(
            "db_errors",
            "Database operations that failed (transient ones are retried)",
            db_errors.clone(),
        );
        let crawl = CrawlMetrics::register(&mut registry);
        let catalogue = CatalogueMetrics::register(&mut registry);
        let flow = FlowMetrics::register(&mut registry);
        Self {
            flow,
            catalogue,
            sources: Default::default(),
            crawl,
            registry,
            lock,
            refresh,
            db_errors,
            last_db_ok: AtomicI64::new(-1),
            started: std::time::Instant::now(),
        }
    }

    fn bot(bot: &BotId) -> BotLabel {
        BotLabel {
            bot: bot.to_string(),
        }
    }

    fn kind(bot: &BotId, kind: &str) -> KindLabels {
        KindLabels {
            bot: bot.to_string(),
            kind: kind.to_owned(),
        }
    }

    pub(crate) fn page_requested(&self, bot: &BotId) {
        self.crawl.requests.get_or_create(&Self::bot(bot)).inc();
    }

    pub(crate) fn page_crawled(&self, bot: &BotId, result: &str) {
        self.crawl
            .pages
            .get_or_create(&Self::kind(bot, result))
            .inc();
    }

    pub(crate) fn record_written(&self, bot: &BotId, kind: &str) {
        self.crawl
            .records
            .get_or_create(&Self::kind(bot, kind))
            .inc();
    }

    pub(crate) fn url_lease_lost(&self, bot: &BotId) {
        self.crawl
            .url_leases_lost
            .get_or_create(&Self::bot(bot))
            .inc();
    }

    /// `n` URLs a crawl-trap bound (`kind`: its name) dropped.
    pub(crate) fn urls_dropped(&self, bot: &BotId, bound: &str, n: u64) {
        self.crawl
            .urls_dropped
            .get_or_create(&Self::kind(bot, bound))
            .inc_by(n);
    }

    /// A chain's listing page fetched ahead of its lease write: `kept` when the write took it.
    pub(crate) fn chain_fetched_ahead(&self, bot: &BotId, kept: bool) {
        let outcome = if kept { "kept" } else { "dropped" };
        self.crawl
            .chain_fetched_ahead
            .get_or_create(&Self::kind(bot, outcome))
            .inc();
    }

    /// One lease attempt (a turn of the leaser, one or more queries): `leased` or `empty`.
    pub(crate) fn lease_query(&self, bot: &BotId, leased: bool) {
        let result = if leased { "leased" } else { "empty" };
        self.crawl
            .lease_queries
            .get_or_create(&Self::kind(bot, result))
            .inc();
    }

    pub(crate) fn crawling(&self, bot: &BotId, pass: PassNumber) {
        self.crawl
            .crawl_pass
            .get_or_create(&Self::bot(bot))
            .set(pass.get());
    }

    pub(crate) fn pass_finished(&self, bot: &BotId) {
        self.crawl
            .passes_finished
            .get_or_create(&Self::bot(bot))
            .inc();
    }

    /// Every bot's catalogue figures, as the bots' documents keep them.
    pub(crate) fn observe_catalogues(
        &self,
        catalogues: &[(String, crate::store::document::CatalogueStats)],
    ) {
        let c = &self.catalogue;
        for (bot, stats) in catalogues {
            let label = BotLabel { bot: bot.clone() };
            if let Some(at) = stats.last_complete_pass {
                c.last_complete_pass
                    .get_or_create(&label)
                    .set(at.timestamp_millis() as f64 / 1000.0);
            }
            if let Some(coverage) = stats.coverage {
                c.coverage.get_or_create(&label).set(coverage);
            }
            if let Some(live) = stats.live_records {
                c.live_records.get_or_create(&label).set(live);
            }
            c.gated.get_or_create(&label).set(i64::from(stats.gated));
            carry_total(
                &c.events_released.get_or_create(&label),
                stats.events_released,
            );
            carry_total(&c.removed.get_or_create(&label), stats.removed_total);
        }
    }

    /// A webhook delivery of `events` events of `bot`'s; `lag`: those still to deliver after it.
    pub(crate) fn webhook_delivered(&self, bot: &BotId, events: u64, lag: i64) {
        let label = Self::bot(bot);
        self.catalogue
            .webhook_delivered
            .get_or_create(&label)
            .inc_by(events);
        self.catalogue.webhook_lag.get_or_create(&label).set(lag);
    }

    /// A failed webhook delivery of `bot`'s events; `lag`: the events waiting.
    pub(crate) fn webhook_failed(&self, bot: &BotId, lag: i64) {
        let label = Self::bot(bot);
        self.catalogue.webhook_failures.get_or_create(&label).inc();
        self.catalogue.webhook_lag.get_or_create(&label).set(lag);
    }

    /// How often this instance refreshes `bot`'s seeds.
    pub(crate) fn set_refresh_interval(&self, bot: &BotId, every: Duration) {
        self.catalogue
            .refresh_interval
            .get_or_create(&Self::bot(bot))
            .set(every.as_secs_f64());
    }

    pub(crate) fn set_state(&self, bot: &BotId, state: BotState) {
        for s in BotState::ALL {
            let labels = StateLabels {
                bot: bot.to_string(),
                state: s.as_str().to_owned(),
            };
            self.lock
                .bot_state
                .get_or_create(&labels)
                .set(i64::from(s == state));
        }
    }

    /// Drops a bot's state and pause series (the bot was removed from this instance's fleet).
    pub(crate) fn forget_bot(&self, bot: &BotId) {
        for s in BotState::ALL {
            self.lock.bot_state.remove(&StateLabels {
                bot: bot.to_string(),
                state: s.as_str().to_owned(),
            });
        }
        self.lock.bot_paused.remove(&Self::bot(bot));
        self.catalogue.refresh_interval.remove(&Self::bot(bot));
    }

    pub(crate) fn set_paused(&self, bot: &BotId, paused: bool) {
        self.lock
            .bot_paused
            .get_or_create(&Self::bot(bot))
            .set(i64::from(paused));
    }

    pub(crate) fn saw_epoch(&self, bot: &BotId, epoch: crate::ids::LockEpoch) {
        self.lock
            .lock_epoch
            .get_or_create(&Self::bot(bot))
            .set(epoch.get());
    }

    pub(crate) fn acquired(&self, bot: &BotId, takeover: Option<&str>) {
        self.lock.acquisitions.get_or_create(&Self::bot(bot)).inc();
        if let Some(kind) = takeover {
            self.lock
                .takeovers
                .get_or_create(&Self::kind(bot, kind))
                .inc();
        }
    }

    pub(crate) fn edit_lock_lost(&self, bot: &BotId) {
        self.lock
            .edit_locks_lost
            .get_or_create(&Self::bot(bot))
            .inc();
    }

    pub(crate) fn refresh_finished(&self, bot: &BotId, result: &str, took: Duration) {
        self.refresh
            .refreshes
            .get_or_create(&Self::kind(bot, result))
            .inc();
        self.refresh
            .refresh_duration
            .get_or_create(&Self::bot(bot))
            .observe(took.as_secs_f64());
    }

    pub(crate) fn repaired(&self, bot: &BotId, kind: &str) {
        self.refresh
            .repairs
            .get_or_create(&Self::kind(bot, kind))
            .inc();
    }

    pub(crate) fn waited(&self, bot: &BotId, took: Duration) {
        self.refresh
            .wait_duration
            .get_or_create(&Self::bot(bot))
            .observe(took.as_secs_f64());
    }

    pub(crate) fn db_error(&self) {
        self.db_errors.inc();
    }

    pub(crate) fn db_ok(&self) {
        let at = i64::try_from(self.started.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.last_db_ok.store(at, Ordering::Relaxed);
    }

    /// How long ago the database last answered, if it ever did.
    pub(crate) fn since_db_ok(&self) -> Option<Duration> {
        let at = u64::try_from(self.last_db_ok.load(Ordering::Relaxed)).ok()?;
        Some(
            self.started
                .elapsed()
                .saturating_sub(Duration::from_millis(at)),
        )
    }

    /// Registers a reader of gauges owned elsewhere; it runs before every encode and is dropped
    /// once it returns `false` (its owner is gone).
    pub(crate) fn add_source(&self, source: Source) {
        self.sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(source);
    }

    pub(crate) fn shed(&self, bot: &BotId) {
        self.flow.shed.get_or_create(&Self::bot(bot)).inc();
    }

    pub(crate) fn retry_deferred(&self, bot: &BotId) {
        self.flow
            .retry_deferred
            .get_or_create(&Self::bot(bot))
            .inc();
    }

    /// Per-host flow figures (from [`crate::flow::Flow::snapshot`]).
    pub(crate) fn observe_hosts(&self, hosts: &[crate::flow::HostSnapshot]) {
        let f = &self.flow;
        let mut last = f.last.lock().unwrap_or_else(|p| p.into_inner());
        for h in hosts {
            let label = HostLabel {
                host: h.host.clone(),
            };
            f.in_flight
                .get_or_create(&label)
                .set(i64::from(h.in_flight));
            f.limit.get_or_create(&label).set(h.limit);
            f.paused_seconds
                .get_or_create(&label)
                .set(h.paused_for.map_or(0.0, |d| d.as_secs_f64()));
            f.retry_ratio.get_or_create(&label).set(h.retry_ratio);
            let before = last.get(&h.host).cloned();
            let delta = |now: u64, then: fn(&crate::flow::HostSnapshot) -> u64| {
                now.saturating_sub(before.as_ref().map_or(0, then))
            };
            f.throttles
                .get_or_create(&label)
                .inc_by(delta(h.throttles, |b| b.throttles));
            f.timeouts
                .get_or_create(&label)
                .inc_by(delta(h.timeouts, |b| b.timeouts));
            f.blocked
                .get_or_create(&label)
                .inc_by(delta(h.blocked, |b| b.blocked));
            let kind = |kind: &str| HostKindLabels {
                host: h.host.clone(),
                kind: kind.to_owned(),
            };
            f.requests
                .get_or_create(&kind("first"))
                .inc_by(delta(h.first_attempts, |b| b.first_attempts));
            f.requests
                .get_or_create(&kind("retry"))
                .inc_by(delta(h.retries, |b| b.retries));
            last.insert(h.host.clone(), h.clone());
        }
    }

    /// The database commands sent so far, by name (from [`crate::store::Store::command_counts`]).
    pub(crate) fn observe_db_commands(&self, counts: &std::collections::BTreeMap<String, u64>) {
        let mut last = self
            .flow
            .last_commands
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (name, n) in counts {
            let before = last.get(name).copied().unwrap_or(0);
            self.flow
                .db_commands
                .get_or_create(&CommandLabel {
                    command: name.clone(),
                })
                .inc_by(n.saturating_sub(before));
            last.insert(name.clone(), *n);
        }
    }

    /// The pool's waits so far (from [`crate::store::Store::pool_wait`]).
    pub(crate) fn observe_pool_wait(&self, waited: Duration, checkouts: u64) {
        let mut last = self
            .flow
            .last_pool
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.flow
            .pool_wait
            .inc_by(waited.saturating_sub(last.0).as_secs_f64());
        self.flow
            .pool_checkouts
            .inc_by(checkouts.saturating_sub(last.1));
        *last = (waited, checkouts);
    }

    /// One stage of one bot's pipeline: the items it holds and the age of its oldest.
    pub(crate) fn observe_stage(
        &self,
        bot: &BotId,
        stage: &str,
        depth: usize,
        oldest: Option<Duration>,
    ) {
        let label = StageLabels {
            bot: bot.to_string(),
            stage: stage.to_owned(),
        };
        self.flow
            .stage_depth
            .get_or_create(&label)
            .set(depth as i64);
        self.flow
            .stage_oldest
            .get_or_create(&label)
            .set(oldest.map_or(0.0, |d| d.as_secs_f64()));
    }

    pub(crate) fn requests_per_record(&self, bot: &BotId, ratio: f64) {
        self.flow
            .requests_per_record
            .get_or_create(&Self::bot(bot))
            .set(ratio);
    }

    /// A bot's commit window: `pages` uncommitted and `writers` commits in flight, at most.
    pub(crate) fn commit_window(&self, bot: &BotId, pages: usize, writers: usize) {
        let label = Self::bot(bot);
        self.flow
            .commit_window
            .get_or_create(&label)
            .set(pages as i64);
        self.flow
            .commit_writers
            .get_or_create(&label)
            .set(writers as i64);
    }

    pub fn encode(&self) -> String {
        {
            let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
            sources.retain(|source| source(self));
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_the_documented_series() {
        let m = Metrics::new();
        let bot = BotId::parse("shop").unwrap();
        m.set_state(&bot, BotState::Updating);
        m.acquired(&bot, Some("expired"));
        m.edit_lock_lost(&bot);
        m.refresh_finished(&bot, "ok", Duration::from_millis(20));
        m.waited(&bot, Duration::from_millis(5));
        m.urls_dropped(&bot, "max_depth", 4);
        m.chain_fetched_ahead(&bot, true);
        m.chain_fetched_ahead(&bot, true);
        m.chain_fetched_ahead(&bot, false);
        let text = m.encode();
        for needle in [
            r#"seedlock_bot_state{bot="shop",state="updating"} 1"#,
            r#"seedlock_bot_state{bot="shop",state="ready"} 0"#,
            r#"seedlock_lock_acquisitions_total{bot="shop"} 1"#,
            r#"seedlock_lock_takeovers_total{bot="shop",kind="expired"} 1"#,
            r#"seedlock_edit_locks_lost_total{bot="shop"} 1"#,
            r#"seedlock_refreshes_total{bot="shop",kind="ok"} 1"#,
            "seedlock_refresh_duration_seconds_count",
            "seedlock_wait_duration_seconds_count",
            r#"seedlock_crawl_urls_dropped_total{bot="shop",kind="max_depth"} 4"#,
            r#"seedlock_crawl_chain_fetched_ahead_total{bot="shop",kind="kept"} 2"#,
            r#"seedlock_crawl_chain_fetched_ahead_total{bot="shop",kind="dropped"} 1"#,
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
