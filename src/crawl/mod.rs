//! The crawl of one bot on this instance, as a pipeline of stages with bounded queues between
//! them ([`Crawler::crawl_for`]); each stage is a step function in a file of its own that
//! returns what it came to:
//!
//! - [`lease`]: a batched lease round trip fills the host queues ([`LeaseStep`]);
//! - [`dispatch`]: per-host queues, admission by the host's limiter, the fetch ([`Fetched`]);
//! - [`parse`]: HTML read off the async runtime ([`Parsed`]);
//! - [`settle`]: the page's links enqueued at once — leased to this instance where it has room —
//!   and what the page came to ([`Settled`]);
//! - [`commit`]: group commit of what waits in the store queue ([`Committed`]).
//!
//! Database work is paid per batch, not per page: a lease round trip hands out many URLs, a
//! listing page's links go into the frontier in one write (the ones this instance will fetch
//! next already leased to it), and a commit round trip carries many pages' records and marks.
//!
//! Incremental passes: listing pages are fetched every pass; a detail page only when it is new,
//! when its listing fingerprint changed (`fingerprint`), when its item changed since the last
//! run minus the overlap (`updated_at`), or — in every mode — when a conditional GET with the
//! stored ETag / Last-Modified says it changed. `watermark` stops paginating at the first
//! listing page that shows an item already stored. An item a pass does not fetch is not
//! written: a listing page's done mark carries what it listed (its manifest), and deletion
//! detection compares the manifests at the pass's end.

use crate::ids::PassNumber;
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::clock::ServerClock;
use crate::config::{CrawlLimits, CrawlSettings, IncrementalMode};
use crate::crawl::stages::{Stages, Ticket};
use crate::error::{Error, Result};
use crate::fetch::PageFetcher;
use crate::flow::robots::RobotsCache;
use crate::flow::Flow;
use crate::ids::{BotId, InstanceId};
use crate::metrics::Metrics;
use crate::store::frontier::{Mark, PageKind, UrlLease};
use crate::store::passes::{DeletionRules, PassEnd};
use crate::store::records::RecordWrite;
use crate::store::Store;
use crate::urls::NormalizedUrl;

pub mod commit;
pub mod dispatch;
pub mod known;
pub mod lease;
pub mod parse;
pub mod probe;
pub mod queue;
pub mod settle;
pub mod stages;

pub use crate::store::records::Committed;
pub use dispatch::{Fetched, HostQueues};
pub use lease::LeaseStep;
pub use parse::Parsed;
pub use settle::{Followed, Settled};

use queue::Queue;

/// The pass a crawl works on, as the bot document shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pass {
    pub number: PassNumber,
    pub started_at: Option<DateTime<Utc>>,
    /// When the last completed pass started (`updated_at` mode reads from here − overlap).
    pub last_run_at: Option<DateTime<Utc>>,
    /// The hosts (`host:port`) of the bot's seeds: where the pass's work starts.
    pub seed_hosts: Vec<String>,
    /// The spec the pass started with (`crawlPassSpecVersion`, `crawlPassSpec`), for bots defined
    /// in the database: the pass ends on it whatever changes meanwhile.
    pub spec: Option<std::sync::Arc<(i64, bson::Document)>>,
    /// The pass started on another spec than the one before it (`crawlPassRefetch`): every
    /// detail page is fetched, unconditionally, so every record is extracted by the new rules.
    pub refetch: bool,
    /// The last pass whose deletion evaluation applied its removals (`crawlEvaluatedPass`): a
    /// listing page read then has that read as its baseline.
    pub evaluated: PassNumber,
}

/// A crawling bot's pass as its document shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum PassState {
    /// No pass has run yet (`crawlPass` unset or 0), or none since a repair.
    NotStarted {
        current: PassNumber,
        seeds: Vec<String>,
    },
    Running(Pass),
    Finished {
        number: PassNumber,
        /// A refresh succeeded while it ran: the next pass starts now, on the current seeds.
        next: Option<Vec<String>>,
        /// Its deletion evaluation is pending, claimed until then (see
        /// [`Passes::resume_evaluation`](crate::store::Passes::resume_evaluation)).
        evaluation_claimed_until: Option<DateTime<Utc>>,
    },
}

impl PassState {
    pub fn of(doc: &crate::store::document::BotDoc) -> PassState {
        if doc.crawl_pass == PassNumber::NONE || doc.crawl_pass_started_at.is_none() {
            PassState::NotStarted {
                current: doc.crawl_pass,
                seeds: doc.seeds.clone(),
            }
        } else if doc.crawl_pass_ended_at.is_some() {
            PassState::Finished {
                number: doc.crawl_pass,
                next: doc.crawl_next_pass_at.map(|_| doc.seeds.clone()),
                evaluation_claimed_until: doc
                    .crawl_evaluation_pending
                    .filter(|(pass, _)| *pass == doc.crawl_pass)
                    .map(|(_, until)| until),
            }
        } else {
            let mut seed_hosts: Vec<String> = doc
                .seeds
                .iter()
                .filter_map(|s| NormalizedUrl::parse(s).ok())
                .map(|u| u.host_port())
                .collect();
            seed_hosts.sort();
            seed_hosts.dedup();
            PassState::Running(Pass {
                number: doc.crawl_pass,
                started_at: doc.crawl_pass_started_at,
                last_run_at: doc.crawl_last_run_at,
                seed_hosts,
                spec: doc.crawl_pass_spec.clone(),
                refetch: doc.crawl_pass_refetch,
                evaluated: doc.crawl_evaluated_pass,
            })
        }
    }
}

/// What one page came to.
#[derive(Clone, Debug, PartialEq)]
pub enum PageResult {
    /// A detail page's record was stored (or found unchanged).
    Stored(RecordWrite),
    /// A page without a record (a listing page), done.
    Done,
    /// `304`: the stored record still holds (not written).
    NotModified,
    /// Not HTML: done, nothing read.
    Skipped,
    /// `404`/`410` on a detail page: its record is marked removed.
    Gone,
    /// Given back to the frontier for a later attempt.
    Retry,
    /// Recorded failed with this reason.
    Failed(String),
}

/// How a [`Crawler::crawl_for`] slice ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SliceEnd {
    Finished(PassEnd),
    Idle,
    TimeUp,
    Shutdown,
}

/// The shortest and longest pause between lease rounds that keep finding nothing while pages
/// are in flight (the wait doubles from one to the other; a lease, a settled page or new work
/// ends it).
const DRY_SPELL_MIN: Duration = Duration::from_millis(20);
const DRY_SPELL_MAX: Duration = Duration::from_millis(500);
/// A slice in which lease rounds keep finding the pass idle (and nothing is in flight) ends
/// after this.
const IDLE_END: Duration = Duration::from_secs(2);

pub struct Crawler {
    bot: BotId,
    rules: Arc<CrawlSettings>,
    limits: CrawlLimits,
    store: Store,
    clock: Arc<ServerClock>,
    me: InstanceId,
    /// Leases this instance id took before this are a dead predecessor's: reclaimed at once.
    started_at: DateTime<Utc>,
    fetcher: PageFetcher,
    transactions: bool,
    metrics: Arc<Metrics>,
    /// No fetch starts while the database has left an operation unanswered longer than this
    /// (the lock's ttl): cut off from it, this instance could neither confirm its leases nor
    /// commit what it fetched.
    cut_off_after: Duration,
    /// Held by the worker that is ending a pass.
    finishing: tokio::sync::Mutex<()>,
    /// The leaser's memory (one lease round at a time).
    leaser: tokio::sync::Mutex<lease::Leaser>,
    /// Hosts with work in a pass, as far as this instance knows.
    hosts: std::sync::Mutex<(PassNumber, BTreeSet<String>)>,
    /// The pass into which this instance enqueued the last complete pass's listing pages.
    listings_in: std::sync::atomic::AtomicI64,
    /// Frontier ids of links this instance enqueued in a pass (bounded; cleared when full).
    enqueued: std::sync::Mutex<(PassNumber, HashSet<String>)>,
    /// The listed items known stored, read from the manifests once per pass.
    known: tokio::sync::Mutex<Option<Arc<known::Known>>>,
    flow: Arc<Flow>,
    robots: Arc<RobotsCache>,
    stages: Arc<Stages>,
    /// Page requests sent and records stored by this crawler (requests per stored record is
    /// seed 000's health signal).
    requests: std::sync::atomic::AtomicU64,
    records: std::sync::atomic::AtomicU64,
    /// How long a lease round takes here (µs, a moving average): the host queues hold enough
    /// work to fetch while the next round is out (see [`Crawler::queue_target`]).
    lease_round_us: std::sync::atomic::AtomicU64,
    /// The priorities above the lowest, highest first.
    levels: Vec<i64>,
    lowest: i64,
}

/// Everything a crawler needs besides its bot.
#[derive(Clone)]
pub struct CrawlContext {
    pub store: Store,
    pub clock: Arc<ServerClock>,
    pub me: InstanceId,
    pub started_at: DateTime<Utc>,
    pub limits: CrawlLimits,
    pub fetcher: PageFetcher,
    /// Resolved `crawl.transactions`.
    pub transactions: bool,
    pub metrics: Arc<Metrics>,
    /// `lock.ttl`: how long the database may leave an operation unanswered before this instance
    /// stops starting fetches.
    pub cut_off_after: Duration,
    /// Per-host limits, shared by every bot this instance crawls.
    pub flow: Arc<Flow>,
    pub robots: Arc<RobotsCache>,
}

/// What a page fetched and not yet committed holds until its commit (or until it is given up):
/// one of `crawl.max_uncommitted` pages, and its body's weight in `crawl.max_uncommitted_bytes`.
struct Uncommitted {
    _page: OwnedSemaphorePermit,
    _bytes: Option<OwnedSemaphorePermit>,
}

/// A page between stages: its lease, what it holds as fetched-and-uncommitted, and the ticket of
/// the stage it is in.
struct Item<T> {
    lease: UrlLease,
    what: T,
    uncommitted: Uncommitted,
    _ticket: Ticket,
}

/// A settled page in the store stage.
struct Storing {
    settled: Settled,
    _uncommitted: Uncommitted,
    _ticket: Ticket,
}

/// The weight of a fetched page in the byte budget, in KiB (the budget's unit): its body,
/// rounded up, at least 1 and at most the whole budget (a page larger than the budget waits
/// until nothing else is uncommitted, then goes alone).
fn body_weight(fetched: &Fetched, budget_kib: u32) -> u32 {
    let bytes = match fetched {
        Fetched::Outcome(crate::fetch::FetchOutcome::Ok(page)) => page.body.len(),
        _ => 0,
    };
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, budget_kib.max(1))
}

/// What the stages of one slice share.
struct Slice {
    queues: HostQueues,
    parse: Queue<Item<Fetched>>,
    store: Queue<Storing>,
    /// Fetches in flight (`crawl.workers`).
    slots: Arc<Semaphore>,
    /// Pages fetched (or being fetched) and not yet committed (`crawl.max_uncommitted`).
    uncommitted: Arc<Semaphore>,
    /// The bodies of the pages fetched and not yet committed, in KiB
    /// (`crawl.max_uncommitted_bytes`).
    bytes: Arc<Semaphore>,
    bytes_kib: u32,
    /// A page was committed or work was queued here: the dispatcher looks again.
    progressed: tokio::sync::Notify,
    /// How often a page here put new pending work into the frontier (links it did not lease):
    /// a lease round that found nothing before that may be stale, and a dry spell ends.
    new_work: std::sync::atomic::AtomicU64,
    failed: CancellationToken,
    failure: std::sync::Mutex<Option<Error>>,
    /// Pages being settled (followed and decided), beside the parsers.
    settling: tokio_util::task::TaskTracker,
}

/// A slice's standing tasks, beside its shared state.
struct SliceTasks {
    run: Arc<Slice>,
    parsers: tokio::task::JoinSet<()>,
    writers: tokio::task::JoinSet<()>,
    fetches: tokio::task::JoinSet<()>,
}

/// The leaser's state across the dispatcher's turns: the lease round out (one at a time), the
/// dry spell and how long the pass has looked idle here.
#[derive(Default)]
struct Leasing {
    round: Option<futures_util::future::BoxFuture<'static, Result<LeaseStep>>>,
    /// `Slice::new_work` when the round out now was sent, and when the dispatcher last looked.
    sent_at_work: u64,
    work_seen: u64,
    /// No new lease round before this (a dry spell: the last ones found nothing while pages
    /// were in flight — every pending URL taken, the next listing page not read yet). Without
    /// it every instance re-queries as fast as the database answers, and the database spends
    /// itself answering "nothing" (measured: 5 instances, 600 ops/s, 7 pages/s on the test
    /// server). A lease, a settled page or new work ends it.
    dry: Option<Instant>,
    dry_spell: Duration,
    /// Since when lease rounds have found the pass idle here (its URLs leased by others, or
    /// waiting for a retry time): they go on at the longest dry spell, and the slice ends idle
    /// after `IDLE_END` of it with nothing in flight (the coordinator looks at the bot document,
    /// then crawls on).
    idle_since: Option<Instant>,
    /// Pages were in flight at the last turn: when the pipeline drains, the pass may be over.
    was_busy: bool,
}

impl Leasing {
    /// The slice ends idle: nothing in flight, no round out, and idle rounds for `IDLE_END`.
    fn idle_over(&self, busy: bool) -> bool {
        !busy
            && self.round.is_none()
            && self
                .idle_since
                .is_some_and(|since| since.elapsed() >= IDLE_END)
    }

    /// New pending work here, or nothing left in flight (the pass may be over): the dry spell
    /// ends. (A committed page alone does not end it: its links were enqueued when it was
    /// parsed.)
    fn look(&mut self, new_work: u64, busy: bool) {
        if new_work != self.work_seen || (self.was_busy && !busy) {
            self.work_seen = new_work;
            self.dry = None;
        }
        self.was_busy = busy;
    }

    /// A new round goes out: none is out, the host queues have room and want more, and no dry
    /// spell holds it back.
    fn due(&self, run: &Slice, now: Instant) -> bool {
        self.round.is_none()
            && run.queues.room() > 0
            && run.queues.wants_more()
            && self.dry.is_none_or(|until| now >= until)
    }

    fn send(
        &mut self,
        new_work: u64,
        round: futures_util::future::BoxFuture<'static, Result<LeaseStep>>,
    ) {
        self.sent_at_work = new_work;
        self.round = Some(round);
    }

    /// A round came back with `step` (not the pass's end): a lease ends any dry spell; a round
    /// that found nothing starts or doubles one, unless pages settled while it was out (what it
    /// found may be stale already); an idle pass waits the longest.
    fn landed(&mut self, step: &LeaseStep, new_work: u64) {
        match step {
            LeaseStep::Leased(_) => {
                self.dry = None;
                self.dry_spell = Duration::ZERO;
                self.idle_since = None;
            }
            LeaseStep::Busy if new_work != self.sent_at_work => self.dry = None,
            LeaseStep::Busy => {
                self.dry_spell = (self.dry_spell * 2).clamp(DRY_SPELL_MIN, DRY_SPELL_MAX);
                self.dry = Some(Instant::now() + self.dry_spell);
            }
            LeaseStep::Idle => {
                self.idle_since.get_or_insert_with(Instant::now);
                self.dry_spell = DRY_SPELL_MAX;
                self.dry = Some(Instant::now() + self.dry_spell);
            }
            LeaseStep::PassFinished(_) => {}
        }
    }
}

impl Slice {
    /// A task of the slice that panicked or was cancelled fails the slice.
    fn check_task(
        &self,
        what: &'static str,
        joined: std::result::Result<(), tokio::task::JoinError>,
    ) {
        if let Err(e) = joined {
            self.fail(Error::Task {
                what,
                detail: e.to_string(),
            });
        }
    }

    fn progressed(&self, new_work: bool) {
        if new_work {
            self.new_work
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.progressed.notify_one();
    }

    fn new_work(&self) -> u64 {
        self.new_work.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn fail(&self, e: Error) {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
        self.failed.cancel();
    }
}

impl Crawler {
    pub fn new(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Arc<Self> {
        let crawler = Arc::new(Self::build(bot, rules, ctx));
        let weak = Arc::downgrade(&crawler);
        ctx.metrics
            .add_source(Box::new(move |m| match weak.upgrade() {
                Some(c) => {
                    for (name, stage) in c.stages.all() {
                        m.observe_stage(&c.bot, name, stage.depth(), stage.oldest());
                    }
                    if let Some(ratio) = c.requests_per_record() {
                        m.requests_per_record(&c.bot, ratio);
                    }
                    true
                }
                None => false,
            }));
        crawler
    }

    fn build(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Self {
        let mut all: Vec<i64> = [PageKind::Seed, PageKind::List, PageKind::Detail]
            .iter()
            .map(|k| k.default_priority())
            .chain(rules.priorities.iter().map(|(_, p)| *p))
            .collect();
        all.sort_unstable_by(|a, b| b.cmp(a));
        all.dedup();
        let lowest = all.pop().unwrap_or(0);
        let fetcher = ctx.fetcher.with_headers(&rules.headers);
        Self {
            levels: all,
            lowest,
            bot,
            rules: Arc::new(rules),
            limits: ctx.limits.clone(),
            store: ctx.store.clone(),
            clock: ctx.clock.clone(),
            me: ctx.me.clone(),
            started_at: ctx.started_at,
            fetcher,
            transactions: ctx.transactions,
            metrics: ctx.metrics.clone(),
            cut_off_after: ctx.cut_off_after,
            finishing: tokio::sync::Mutex::new(()),
            leaser: Default::default(),
            hosts: std::sync::Mutex::new((PassNumber::NONE, BTreeSet::new())),
            listings_in: std::sync::atomic::AtomicI64::new(0),
            enqueued: std::sync::Mutex::new((PassNumber::NONE, HashSet::new())),
            known: Default::default(),
            flow: ctx.flow.clone(),
            robots: ctx.robots.clone(),
            stages: Arc::new(Stages::default()),
            requests: Default::default(),
            records: Default::default(),
            lease_round_us: Default::default(),
        }
    }

    pub fn stages(&self) -> &Arc<Stages> {
        &self.stages
    }

    /// Page requests sent per record stored, so far (`None` before the first record).
    pub fn requests_per_record(&self) -> Option<f64> {
        use std::sync::atomic::Ordering::Relaxed;
        let records = self.records.load(Relaxed);
        (records > 0).then(|| self.requests.load(Relaxed) as f64 / records as f64)
    }

    pub fn bot(&self) -> &BotId {
        &self.bot
    }

    /// Parses stored seed strings for a pass; the unparsable are skipped (refresh stored only
    /// valid URLs, so this drops nothing in practice).
    pub fn seed_urls(&self, seeds: &[String]) -> Vec<NormalizedUrl> {
        seeds
            .iter()
            .filter_map(|s| NormalizedUrl::parse_with(s, &self.rules.links.strip).ok())
            .collect()
    }

    /// The first `[bots.crawl] priority` pattern that matches, else the kind's default.
    fn priority_of(&self, url: &NormalizedUrl, kind: PageKind) -> i64 {
        self.rules
            .priorities
            .iter()
            .find(|(pattern, _)| pattern.is_match(url.as_str()))
            .map_or_else(|| kind.default_priority(), |(_, p)| *p)
    }

    /// Load shedding: a lowest-priority URL that waited longer than `crawl.shed_after` for a
    /// host that throttled us within the last minute is deferred (once a pass), before it costs
    /// a fetch.
    fn should_shed(&self, lease: &UrlLease, now: DateTime<Utc>) -> bool {
        lease.sheds == 0
            && should_shed(
                lease.priority,
                self.lowest,
                !self.levels.is_empty(),
                lease
                    .eligible_since
                    .and_then(|t| (now - t).to_std().ok())
                    .unwrap_or_default(),
                self.limits.shed_after,
                self.flow
                    .throttled_within(&lease.host(), Duration::from_secs(60)),
            )
    }

    fn deletion_rules(&self, pass: &Pass) -> DeletionRules {
        DeletionRules {
            known_since: pass.last_run_at,
            enabled: self.rules.incremental.mode != IncrementalMode::Watermark,
            min_coverage: self.limits.min_coverage,
            max_error_rate: self.limits.max_error_rate,
        }
    }

    /// At most this many pages are fetched (or being fetched) and not yet committed here at
    /// once: `crawl.max_uncommitted`, and never more than the stages can hold.
    pub fn uncommitted_cap(&self) -> usize {
        let l = &self.limits;
        l.max_uncommitted
            .min(l.workers + l.parse_queue + l.parsers + l.store_queue)
            .max(1)
    }

    /// `crawl.max_uncommitted_bytes` in KiB (the byte budget's unit).
    fn bytes_kib(&self) -> u32 {
        u32::try_from(self.limits.max_uncommitted_bytes / 1024)
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// Crawls `pass` through the pipeline until the pass is over, there is nothing to lease,
    /// `slice` has passed, or shutdown:
    ///
    /// lease (batched) → host queues (≤ `crawl.host_queue` URLs) → fetch (≤ `crawl.workers` at
    /// once, each admitted by its host's limiter) → parse queue (`crawl.parse_queue`, listing
    /// pages first) → `crawl.parsers` (each follows its page's links at once) → store queue
    /// (`crawl.store_queue`, waiting or being committed) → `crawl.writers` group commits.
    ///
    /// Every stage pulls from the one before, and each queue is bounded: a full store queue
    /// stalls the parsers, a full parse queue keeps fetches holding their slots, and without
    /// room in the host queues nothing is leased. At most `crawl.max_uncommitted` pages, and
    /// `crawl.max_uncommitted_bytes` of their bodies, are fetched and uncommitted at once (a
    /// fetch whose body does not fit waits for room, holding its slot). At the end of the slice the pages in flight are finished
    /// (fetched pages are committed); URLs still waiting for their host are given back. Only
    /// `shutdown` interrupts fetches (their URLs are given back too).
    pub async fn crawl_for(
        self: &Arc<Self>,
        pass: &Pass,
        slice: Duration,
        shutdown: &CancellationToken,
    ) -> Result<SliceEnd> {
        let deadline = Instant::now() + slice;
        let mut tasks = self.open_slice(pass);
        let run = tasks.run.clone();
        let mut leasing = Leasing::default();
        let mut was_cut_off = false;
        let mut end = SliceEnd::TimeUp;
        loop {
            if shutdown.is_cancelled() {
                end = SliceEnd::Shutdown;
                break;
            }
            if run.failed.is_cancelled() || Instant::now() >= deadline {
                break;
            }
            let busy = self.stages.in_pipeline() > 0;
            if leasing.idle_over(busy) {
                end = SliceEnd::Idle;
                break;
            }
            while let Some(joined) = tasks.fetches.try_join_next() {
                run.check_task("fetch task", joined);
            }
            let now = Instant::now();
            let cut_off = self.cut_off(&mut was_cut_off);
            let step = self.dispatch_step(
                &run.queues,
                &run.slots,
                &run.uncommitted,
                self.clock.now(),
                now,
                cut_off,
            );
            for started in step.started {
                self.start_fetch(&run, &mut tasks.fetches, pass, started, shutdown);
            }
            // A paused host's waiting URLs go back to the frontier until the pause ends.
            let server_now = self.clock.now();
            let back = step.paused.iter().map(|(q, wait)| {
                (
                    &q.lease,
                    crate::store::plus(server_now, *wait),
                    "host paused",
                )
            });
            self.give_back(&run, back).await;
            let mut wake = step.wake.unwrap_or(now + Duration::from_millis(250));
            leasing.look(run.new_work(), busy);
            if leasing.due(&run, now) {
                self.send_lease_round(&mut leasing, &run, pass);
            }
            if let Some(until) = leasing.dry {
                wake = wake.min(until);
            }
            let leased = tokio::select! {
                _ = shutdown.cancelled() => None,
                _ = run.failed.cancelled() => None,
                step = async { leasing.round.as_mut().expect("checked").await }, if leasing.round.is_some() => Some(step),
                _ = run.progressed.notified() => None,
                _ = run.queues.arrived() => None,
                _ = self.flow.changed() => None,
                _ = tokio::time::sleep_until(wake.min(deadline)) => None,
            };
            let Some(step) = leased else {
                continue;
            };
            leasing.round = None;
            match step {
                Ok(LeaseStep::PassFinished(pass_end)) => {
                    end = SliceEnd::Finished(pass_end);
                    break;
                }
                Ok(step) => leasing.landed(&step, run.new_work()),
                Err(e) => {
                    run.fail(e);
                    break;
                }
            }
        }
        self.close_slice(tasks, leasing.round.take()).await;
        if shutdown.is_cancelled() && !matches!(end, SliceEnd::Finished(_)) {
            end = SliceEnd::Shutdown;
        }
        debug!(bot = %self.bot, pass = pass.number.get(), ?end, "crawl slice ended");
        let error = run.failure.lock().unwrap_or_else(|p| p.into_inner()).take();
        match error {
            Some(e) if !matches!(end, SliceEnd::Finished(_)) => Err(e),
            _ => Ok(end),
        }
    }

    /// Sends a lease round (it fills the host queues; its step comes back to the dispatcher).
    fn send_lease_round(self: &Arc<Self>, leasing: &mut Leasing, run: &Arc<Slice>, pass: &Pass) {
        let in_pipeline = self.stages.in_pipeline() > 0;
        let new_work = run.new_work();
        let (crawler, run, pass) = (self.clone(), run.clone(), pass.clone());
        leasing.send(
            new_work,
            Box::pin(async move { crawler.lease_step(&pass, &run.queues, in_pipeline).await }),
        );
    }

    /// A slice's shared state and its standing tasks: the parsers, the writers and (once a
    /// pass) the last complete pass's listing pages enqueued into this one, beside the crawl
    /// (see `enqueue_known_listings`).
    fn open_slice(self: &Arc<Self>, pass: &Pass) -> SliceTasks {
        let run = Arc::new(Slice {
            queues: HostQueues::new(self.limits.host_queue),
            parse: Queue::new(self.limits.parse_queue),
            store: Queue::new(self.limits.store_queue),
            slots: Arc::new(Semaphore::new(self.limits.workers.max(1))),
            uncommitted: Arc::new(Semaphore::new(self.uncommitted_cap())),
            bytes: Arc::new(Semaphore::new(self.bytes_kib() as usize)),
            bytes_kib: self.bytes_kib(),
            progressed: tokio::sync::Notify::new(),
            new_work: Default::default(),
            failed: CancellationToken::new(),
            failure: Default::default(),
            settling: tokio_util::task::TaskTracker::new(),
        });
        let mut parsers = tokio::task::JoinSet::new();
        for _ in 0..self.limits.parsers.max(1) {
            parsers.spawn(self.clone().parser(run.clone(), pass.clone()));
        }
        if self.listings_in.load(std::sync::atomic::Ordering::Relaxed) != pass.number.get() {
            let (crawler, run, pass) = (self.clone(), run.clone(), pass.clone());
            run.clone().settling.spawn(async move {
                match crawler.enqueue_known_listings(&pass).await {
                    Ok(()) => {
                        crawler
                            .listings_in
                            .store(pass.number.get(), std::sync::atomic::Ordering::Relaxed);
                        run.progressed(true);
                    }
                    Err(e) => run.fail(e),
                }
            });
        }
        let mut writers = tokio::task::JoinSet::new();
        for _ in 0..self.limits.writers.max(1) {
            let (crawler, run) = (self.clone(), run.clone());
            writers.spawn(async move { crawler.writer(&run).await });
        }
        SliceTasks {
            run,
            parsers,
            writers,
            fetches: tokio::task::JoinSet::new(),
        }
    }

    /// Whether the database has left this instance unanswered past `lock.ttl` (then no fetch
    /// starts); logs each change of that against `was`.
    fn cut_off(&self, was: &mut bool) -> bool {
        let silent = self.store.unanswered_for();
        let cut_off = silent > self.cut_off_after;
        if cut_off != *was {
            if cut_off {
                warn!(bot = %self.bot, silent = ?silent, "the database has not answered for longer than lock.ttl: no fetch starts until it does");
            } else {
                info!(bot = %self.bot, "the database answers again: fetching again");
            }
            *was = cut_off;
        }
        cut_off
    }

    /// Fetches one admitted URL in a task of `fetches`, then hands the page to the parse queue
    /// once the byte budget has room for it (see [`Slice::bytes`]).
    fn start_fetch(
        self: &Arc<Self>,
        run: &Arc<Slice>,
        fetches: &mut tokio::task::JoinSet<()>,
        pass: &Pass,
        (queued, admitted, slot, uncommitted): dispatch::Started,
        shutdown: &CancellationToken,
    ) {
        let (crawler, run, shutdown) = (self.clone(), run.clone(), shutdown.clone());
        let fetching = self.stages.fetch.enter();
        drop(queued.ticket);
        let refetch = pass.refetch;
        fetches.spawn(async move {
            let mut lease = queued.lease;
            if refetch {
                lease.validators = Default::default();
            }
            let fetched = crawler.fetch(&lease, admitted, &shutdown).await;
            let fast = lease.kind.is_listing();
            // Waits while the bodies uncommitted here weigh the whole byte budget, holding the
            // fetch slot: big pages in flight stop fetching, then leasing.
            let weight = body_weight(&fetched, run.bytes_kib);
            let bytes = run.bytes.clone().acquire_many_owned(weight).await.ok();
            let item = Item {
                lease,
                what: fetched,
                uncommitted: Uncommitted {
                    _page: uncommitted,
                    _bytes: bytes,
                },
                _ticket: crawler.stages.parse.enter(),
            };
            drop(fetching);
            // Waits while the parse queue is full, holding the fetch slot: slow parsing stops
            // fetching, and then leasing.
            let _ = run.parse.push(item, fast).await;
            drop(slot);
        });
    }

    /// Gives leased URLs back to the frontier, each not before its time and with its reason (a
    /// failed write fails the slice; the leases run out instead).
    async fn give_back<'a>(
        &self,
        run: &Slice,
        back: impl Iterator<Item = (&'a UrlLease, DateTime<Utc>, &'static str)>,
    ) {
        let marks: Vec<_> = back
            .map(|(lease, not_before, reason)| {
                let mark = Mark::Release {
                    not_before,
                    reason: reason.into(),
                };
                (lease, mark)
            })
            .collect();
        if marks.is_empty() {
            return;
        }
        if let Err(e) = self
            .store
            .frontier()
            .settle_urls(&marks, self.clock.now())
            .await
        {
            run.fail(e);
        }
    }

    /// Ends a slice: a lease round still out lands in the host queues; fetches finish (or, at
    /// shutdown, give their URLs back); then the parsers and the writers drain; then what still
    /// waits for its host goes back.
    async fn close_slice(
        &self,
        mut tasks: SliceTasks,
        round: Option<futures_util::future::BoxFuture<'static, Result<LeaseStep>>>,
    ) {
        let run = tasks.run.clone();
        if let Some(round) = round {
            if let Err(e) = round.await {
                run.fail(e);
            }
        }
        while let Some(joined) = tasks.fetches.join_next().await {
            run.check_task("fetch task", joined);
        }
        run.parse.close();
        while let Some(joined) = tasks.parsers.join_next().await {
            run.check_task("parse task", joined);
        }
        run.settling.close();
        run.settling.wait().await;
        run.store.close();
        while let Some(joined) = tasks.writers.join_next().await {
            run.check_task("commit task", joined);
        }
        let left = run.queues.drain();
        let now = self.clock.now();
        let back = left
            .iter()
            .map(|q| (&q.lease, now, "slice ended before its host admitted it"));
        self.give_back(&run, back).await;
    }

    /// A parser: takes fetched pages (listing pages first), parses them, follows their links at
    /// once and hands them to the store queue.
    async fn parser(self: Arc<Self>, run: Arc<Slice>, pass: Pass) {
        while let Some(slot) = run.parse.pop().await {
            let Item {
                lease,
                what,
                uncommitted,
                _ticket: parsing,
            } = slot.item;
            drop(slot.room);
            let parsed = match self.parse(what).await {
                Ok(parsed) => parsed,
                // The URL's lease runs out and another worker retries it.
                Err(e) => {
                    run.fail(e);
                    continue;
                }
            };
            // Settling (following the links, deciding the items) waits on the database: it goes
            // on beside the parser, which takes the next page — the next listing page of a
            // pagination chain never waits for the items of the one before.
            let (crawler, run2, pass) = (self.clone(), run.clone(), pass.clone());
            let settle = async move {
                let settled = crawler
                    .settle_retrying(lease, parsed, &pass, &run2.queues)
                    .await;
                match settled {
                    Ok(settled) => {
                        let new_work = settled.new_pending > 0;
                        let storing = Storing {
                            settled,
                            _uncommitted: uncommitted,
                            _ticket: crawler.stages.store.enter(),
                        };
                        drop(parsing);
                        // Links queued here wake the dispatcher; new pending work, the leaser.
                        run2.progressed(new_work);
                        // Waits while the store queue is full: slow commits hold the pages here,
                        // and their uncommitted permits stop fetching, then leasing.
                        let _ = run2.store.push(storing, false).await;
                    }
                    Err(e) => run2.fail(e),
                }
            };
            run.settling.spawn(settle);
        }
    }

    /// [`Crawler::settle`], again after a transient database failure (following is
    /// idempotent), up to three times.
    async fn settle_retrying(
        &self,
        lease: UrlLease,
        parsed: Parsed,
        pass: &Pass,
        queues: &HostQueues,
    ) -> Result<Settled> {
        let Parsed::Page { data, validators } = parsed else {
            return self.settle(lease, parsed, pass, queues).await;
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let parsed = Parsed::Page {
                data: data.clone(),
                validators: validators.clone(),
            };
            match self.settle(lease.clone(), parsed, pass, queues).await {
                Err(e) if e.is_transient() && attempt < 3 => {
                    tokio::time::sleep(crate::backoff::full_jitter(
                        Duration::from_millis(50),
                        Duration::from_secs(1),
                        attempt,
                    ))
                    .await;
                }
                other => return other,
            }
        }
    }

    /// A writer: takes what waits in the store queue and commits it as one batch.
    async fn writer(&self, run: &Slice) {
        loop {
            let batch = run.store.pop_up_to(self.limits.store_queue).await;
            if batch.is_empty() {
                return;
            }
            let settled: Vec<&Settled> = batch.iter().map(|s| &s.item.settled).collect();
            let t0 = Instant::now();
            let result = self.commit_step(&settled).await;
            tracing::trace!(pages = settled.len(), took = ?t0.elapsed(), "commit");
            match result {
                Ok(committed) => {
                    for (s, c) in settled.iter().zip(&committed) {
                        self.account(s, c);
                    }
                }
                Err(e) => run.fail(e),
            }
            drop(settled);
            drop(batch);
            run.progressed(false);
        }
    }
}

/// Whether to defer a leased URL rather than fetch it: only the lowest priority class (and only
/// when there is a higher one), only once it has waited past `shed_after`, and only for a host
/// that is pushing back.
pub fn should_shed(
    priority: i64,
    lowest: i64,
    has_higher: bool,
    waited: Duration,
    shed_after: Duration,
    host_throttling: bool,
) -> bool {
    has_higher && priority <= lowest && waited > shed_after && host_throttling
}

fn page_result_label(result: &PageResult) -> &'static str {
    match result {
        PageResult::Stored(_) => "stored",
        PageResult::Done => "done",
        PageResult::NotModified => "not_modified",
        PageResult::Skipped => "skipped",
        PageResult::Gone => "gone",
        PageResult::Retry => "retry",
        PageResult::Failed(_) => "failed",
    }
}

fn write_label(write: RecordWrite) -> &'static str {
    match write {
        RecordWrite::Inserted => "inserted",
        RecordWrite::Changed => "changed",
        RecordWrite::Unchanged => "unchanged",
        RecordWrite::Restored => "restored",
        RecordWrite::Superseded => "superseded",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_page_weighs_its_body_in_kib_rounded_up_within_the_budget() {
        let page = |len: usize| {
            Fetched::Outcome(crate::fetch::FetchOutcome::Ok(crate::fetch::Page {
                url: NormalizedUrl::parse("http://shop/").unwrap(),
                body: "x".repeat(len),
                etag: None,
                last_modified: None,
            }))
        };
        assert_eq!(body_weight(&page(0), 4096), 1, "an empty page still counts");
        assert_eq!(body_weight(&page(1024), 4096), 1);
        assert_eq!(body_weight(&page(1025), 4096), 2);
        assert_eq!(body_weight(&page(24 * 1024), 4096), 24);
        assert_eq!(
            body_weight(&page(10 << 20), 4096),
            4096,
            "a page over the budget takes all of it"
        );
        assert_eq!(body_weight(&Fetched::Released, 4096), 1);
    }

    #[test]
    fn only_old_lowest_priority_work_of_a_throttling_host_is_shed() {
        let (after, long, short) = (
            Duration::from_secs(600),
            Duration::from_secs(601),
            Duration::from_secs(599),
        );
        assert!(should_shed(0, 0, true, long, after, true));
        // Not a higher priority, not fresh work, not a calm host, not when all work is alike.
        assert!(!should_shed(1, 0, true, long, after, true));
        assert!(!should_shed(0, 0, true, short, after, true));
        assert!(!should_shed(0, 0, true, long, after, false));
        assert!(!should_shed(0, 0, false, long, after, true));
    }
}
