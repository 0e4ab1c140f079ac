//! The crawl of one bot on this instance: lease a URL of the bot's current pass, fetch it,
//! extract off the async runtime, enqueue what it links to, and commit its record together with
//! the URL's done mark. [`Crawler::crawl_for`] runs the pipeline (lease → host queue → fetch →
//! parse → store, bounded between stages; see there) for a while; its leaser turns are
//! `lease_step`s.
//!
//! Incremental passes: listing pages are fetched every pass; a detail page only when it is new,
//! when its listing fingerprint changed (`fingerprint`), when its item changed since the last
//! run minus the overlap (`updated_at`), or — in every mode — when a conditional GET with the
//! stored ETag / Last-Modified says it changed. `watermark` stops paginating at the first
//! listing page that shows an item already stored. Items a pass sees on a listing page without
//! fetching their detail page are marked seen in one batched write per page.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::full_jitter;
use crate::clock::ServerClock;
use crate::config::{CrawlLimits, CrawlSettings, IncrementalMode};
use crate::error::{Error, Result};
use crate::extract::{extract, PageData};
use crate::fetch::{FetchOutcome, PageFetcher, Validators};
use crate::flow::{Admission, Busy, Flow, HostPermit, Signal};
use crate::ids::{BotId, InstanceId};
use crate::metrics::Metrics;
use crate::robots::{RobotsCache, Verdict};
use crate::stages::{Stages, Ticket};
use crate::store::frontier::{url_id, NewUrl, PageKind, UrlLease};
use crate::store::passes::{DeletionRules, PassEnd};
use crate::store::records::{Extracted, RecordWrite};
use crate::store::Store;
use crate::urls::NormalizedUrl;

/// The pass a crawl works on, as the bot document shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pass {
    pub number: i64,
    pub started_at: Option<DateTime<Utc>>,
    /// When the last completed pass started (`updated_at` mode reads from here − overlap).
    pub last_run_at: Option<DateTime<Utc>>,
}

/// A crawling bot's pass as its document shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum PassState {
    /// No pass has run yet (`crawlPass` unset or 0), or none since a repair.
    NotStarted {
        current: i64,
        seeds: Vec<String>,
    },
    Running(Pass),
    Finished {
        number: i64,
    },
}

impl PassState {
    pub fn of(doc: &crate::document::BotDoc) -> PassState {
        if doc.crawl_pass == 0 || doc.crawl_pass_started_at.is_none() {
            PassState::NotStarted {
                current: doc.crawl_pass,
                seeds: doc.seeds.clone(),
            }
        } else if doc.crawl_pass_ended_at.is_some() {
            PassState::Finished {
                number: doc.crawl_pass,
            }
        } else {
            PassState::Running(Pass {
                number: doc.crawl_pass,
                started_at: doc.crawl_pass_started_at,
                last_run_at: doc.crawl_last_run_at,
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
    /// `304`: the stored record still holds; marked seen.
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

/// What the leaser found on one turn.
#[derive(Debug)]
enum LeaseStep {
    Leased(UrlLease),
    /// Nothing to lease now, but pages are in the pipeline or their hosts are busy: wait for
    /// one of them.
    Busy,
    /// Nothing to lease now, nothing in flight here, but the pass is not over: URLs are leased
    /// by others or wait for a retry time.
    Idle,
    /// Nothing pending, waiting or leased: the pass is over.
    PassFinished(PassEnd),
}

/// A fetch stage's answer for one leased URL.
#[derive(Debug)]
enum Fetched {
    Outcome(FetchOutcome),
    /// robots.txt disallows the URL.
    Disallowed,
    /// robots.txt could not be read: the host is paused and the URL goes back without an
    /// attempt counted.
    HostPaused {
        wait: Duration,
        reason: String,
    },
    /// Shutdown came first: the URL goes back.
    Released,
}

/// What the store stage receives: an extracted page, or any other answer as it came.
#[derive(Debug)]
enum Ready {
    Page {
        data: Box<PageData>,
        validators: Validators,
    },
    Other(Fetched),
}

/// Lease queries a leaser keeps in flight at once.
const LEASES_AT_ONCE: usize = 4;
/// The shortest and longest pause between lease queries that keep finding nothing while pages
/// are in flight (the wait doubles from one to the other; a lease or a settled page ends it).
const DRY_SPELL_MIN: Duration = Duration::from_millis(20);
const DRY_SPELL_MAX: Duration = Duration::from_millis(500);

/// A fetch slot, counted for its host while held.
struct HostSlot {
    _slot: tokio::sync::OwnedSemaphorePermit,
    host: String,
    holding: Arc<std::sync::Mutex<HashMap<String, usize>>>,
}

impl HostSlot {
    fn new(
        slot: tokio::sync::OwnedSemaphorePermit,
        host: &str,
        holding: &Arc<std::sync::Mutex<HashMap<String, usize>>>,
    ) -> Self {
        *holding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(host.to_owned())
            .or_default() += 1;
        Self {
            _slot: slot,
            host: host.to_owned(),
            holding: holding.clone(),
        }
    }
}

impl Drop for HostSlot {
    fn drop(&mut self) {
        let mut held = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.host);
            }
        }
    }
}

/// A leased URL moving through the pipeline, holding the ticket of the stage it is in.
struct Item<T> {
    lease: UrlLease,
    what: T,
    _ticket: Ticket,
}

/// How a [`Crawler::crawl_for`] slice ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SliceEnd {
    Finished(PassEnd),
    Idle,
    TimeUp,
    Shutdown,
}

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
    /// When this crawler last moved due retries back to pending.
    last_promotion: std::sync::Mutex<Option<Instant>>,
    /// Held by the worker that is ending a pass.
    finishing: tokio::sync::Mutex<()>,
    /// The pass in which no dead predecessor's lease is left to reclaim.
    reclaimed_in: std::sync::atomic::AtomicI64,
    /// Frontier ids of links this instance enqueued in a pass (bounded; cleared when full).
    enqueued: std::sync::Mutex<(i64, HashSet<String>)>,
    flow: Arc<Flow>,
    robots: Arc<RobotsCache>,
    stages: Arc<Stages>,
    /// Page requests sent and records stored by this crawler (requests per stored record is
    /// seed 000's health signal).
    requests: std::sync::atomic::AtomicU64,
    records: std::sync::atomic::AtomicU64,
    /// The priorities looked for before the rest, highest first (the lowest is "the rest").
    levels: Vec<i64>,
    lowest: i64,
    /// When each level was last found with nothing pending.
    empty_levels: std::sync::Mutex<HashMap<i64, Instant>>,
}

/// Links remembered per pass as already enqueued (about 100 bytes each).
const ENQUEUED_CACHE: usize = 100_000;

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
    /// Per-host limits, shared by every bot this instance crawls.
    pub flow: Arc<Flow>,
    pub robots: Arc<RobotsCache>,
}

impl Crawler {
    pub fn new(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Arc<Self> {
        let crawler = Arc::new(Self::build(bot, rules, ctx));
        let weak = Arc::downgrade(&crawler);
        ctx.metrics
            .add_source(Box::new(move |m| match weak.upgrade() {
                Some(c) => {
                    m.observe_stages(&c.bot, &c.stages);
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
        Self {
            levels: all,
            lowest,
            empty_levels: Default::default(),
            bot,
            rules: Arc::new(rules),
            limits: ctx.limits.clone(),
            store: ctx.store.clone(),
            clock: ctx.clock.clone(),
            me: ctx.me.clone(),
            started_at: ctx.started_at,
            fetcher: ctx.fetcher.clone(),
            transactions: ctx.transactions,
            metrics: ctx.metrics.clone(),
            last_promotion: std::sync::Mutex::new(None),
            finishing: tokio::sync::Mutex::new(()),
            reclaimed_in: std::sync::atomic::AtomicI64::new(0),
            enqueued: std::sync::Mutex::new((0, HashSet::new())),
            flow: ctx.flow.clone(),
            robots: ctx.robots.clone(),
            stages: Arc::new(Stages::default()),
            requests: Default::default(),
            records: Default::default(),
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
                    .throttled_within(&lease.url.host_port(), Duration::from_secs(60)),
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

    /// One leaser turn: lease a URL of `pass` (none on the hosts in `avoid`), or find the
    /// pipeline busy, the pass idle, or the pass over.
    async fn lease_step(
        &self,
        pass: &Pass,
        avoid: &[String],
        in_pipeline: bool,
    ) -> Result<LeaseStep> {
        // Retries that came due go back to pending about once a second, and whenever there is
        // nothing else to lease.
        let promote_now = {
            let mut last = self
                .last_promotion
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        if promote_now {
            self.store
                .promote_due(&self.bot, pass.number, self.clock.now())
                .await?;
        }
        let mut lease = self.lease(pass, avoid).await?;
        if lease.is_none()
            && !in_pipeline
            && self
                .store
                .promote_due(&self.bot, pass.number, self.clock.now())
                .await?
                > 0
        {
            lease = self.lease(pass, avoid).await?;
        }
        if let Some(lease) = lease {
            return Ok(LeaseStep::Leased(lease));
        }
        // Pages in the pipeline may enqueue more.
        if in_pipeline {
            return Ok(LeaseStep::Busy);
        }
        debug!(bot = %self.bot, pass = pass.number, "nothing to lease and nothing in flight here");
        if self.store.pass_has_work(&self.bot, pass.number).await? {
            // Work on a paused host waits here for the pause to end.
            return Ok(if avoid.is_empty() {
                LeaseStep::Idle
            } else {
                LeaseStep::Busy
            });
        }
        // Listing pages link one to the next: one that failed hides the rest from this pass.
        // The listing pages the last complete pass read and this one never reached are
        // enqueued before the pass may end (not in watermark mode, which stops on purpose).
        if let (true, Some(since)) = (self.deletion_rules(pass).enabled, pass.last_run_at) {
            let missed = self
                .store
                .unreached_list_urls(&self.bot, pass.number, since)
                .await?;
            if !missed.is_empty() {
                warn!(
                    bot = %self.bot, pass = pass.number, pages = missed.len(),
                    "listing pages the last pass read were not reached (a broken pagination chain?); enqueuing them"
                );
                self.store
                    .enqueue(
                        &self.bot,
                        pass.number,
                        PageKind::List,
                        &missed,
                        self.clock.now(),
                    )
                    .await?;
                return Ok(LeaseStep::Busy);
            }
        }
        // One leaser of this instance ends the pass (it counts the whole pass); the others find
        // it ended on their next turn.
        let Ok(_finishing) = self.finishing.try_lock() else {
            return Ok(LeaseStep::Idle);
        };
        let end = self
            .store
            .finish_pass(
                &self.bot,
                pass.number,
                pass.started_at,
                self.deletion_rules(pass),
                self.clock.now(),
            )
            .await?;
        if !end.finished {
            return Ok(LeaseStep::Idle);
        }
        if end.recorded {
            self.metrics.pass_finished(&self.bot);
            info!(
                bot = %self.bot, pass = end.pass, done = end.progress.done, failed = end.progress.failed,
                coverage = end.coverage, error_rate = end.error_rate, removed = end.removed,
                deletion = end.deletion_skipped.as_deref().unwrap_or("applied"),
                "crawl pass finished"
            );
        }
        Ok(LeaseStep::PassFinished(end))
    }

    async fn lease(&self, pass: &Pass, avoid: &[String]) -> Result<Option<UrlLease>> {
        // Higher priorities are looked for first, except those found empty within the last
        // second (each costs a query; listing pages are few).
        let tried: Vec<i64> = {
            let empty = self.empty_levels.lock().unwrap_or_else(|p| p.into_inner());
            self.levels
                .iter()
                .copied()
                .filter(|p| {
                    empty
                        .get(p)
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
                })
                .collect()
        };
        // A dead predecessor's leases can only predate this process: look for them until none
        // is left, then never again for this pass.
        let mut look = self.reclaimed_in.load(std::sync::atomic::Ordering::Relaxed) != pass.number;
        if look
            && !self
                .store
                .has_dead_leases(&self.bot, pass.number, &self.me, self.started_at)
                .await?
        {
            self.reclaimed_in
                .store(pass.number, std::sync::atomic::Ordering::Relaxed);
            look = false;
        }
        let lease = self
            .store
            .lease_next(
                &self.bot,
                pass.number,
                &self.me,
                look.then_some(self.started_at),
                self.clock.now(),
                self.limits.lease,
                avoid,
                &tried,
            )
            .await?;
        self.metrics.lease_query(&self.bot, lease.is_some());
        {
            let leased = lease.as_ref().map_or(i64::MIN, |l| l.priority);
            let mut empty = self.empty_levels.lock().unwrap_or_else(|p| p.into_inner());
            for p in tried.into_iter().filter(|p| *p > leased) {
                empty.insert(p, Instant::now());
            }
        }
        Ok(lease)
    }

    /// The fetch stage for one admitted URL: robots.txt, then the page (raced against
    /// shutdown). The host's limiter learns from the answer.
    async fn fetch(
        &self,
        lease: &UrlLease,
        permit: HostPermit,
        shutdown: &CancellationToken,
    ) -> Fetched {
        let host = permit.host().to_owned();
        match self.robots.check(&self.fetcher, &lease.url).await {
            Verdict::Allowed { crawl_delay } => {
                if let Some(delay) = crawl_delay {
                    self.flow.set_crawl_delay(&host, delay);
                }
            }
            Verdict::Disallowed => {
                permit.finish(Signal::Neutral);
                return Fetched::Disallowed;
            }
            Verdict::Unavailable { reason } => {
                let wait = self.limits.robots_retry;
                self.flow.pause(&host, Instant::now() + wait);
                permit.finish(Signal::Neutral);
                warn!(bot = %self.bot, %host, %reason, ?wait, "host paused");
                return Fetched::HostPaused { wait, reason };
            }
        }
        // Listing pages are read every pass (their items are the pass's evidence of what
        // exists); only detail pages are fetched conditionally.
        let validators = match lease.kind {
            PageKind::Detail => lease.validators.clone(),
            PageKind::List | PageKind::Seed => Validators::default(),
        };
        self.requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let started = Instant::now();
        self.flow.sending(&host, started);
        let outcome = tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                permit.finish(Signal::Neutral);
                return Fetched::Released;
            }
            outcome = self.fetcher.fetch(&lease.url, &validators) => outcome,
        };
        permit.finish(match &outcome {
            FetchOutcome::Throttled { retry_after, .. } => Signal::Throttled {
                retry_after: *retry_after,
            },
            FetchOutcome::Timeout => Signal::Timeout,
            // A connection refused or reset says nothing about how much the host can take.
            FetchOutcome::Transient { reason } if !reason.starts_with("HTTP ") => Signal::Neutral,
            _ => Signal::Answered {
                latency: started.elapsed(),
            },
        });
        Fetched::Outcome(outcome)
    }

    /// The parse stage: extraction runs on the blocking pool, off the runtime's workers.
    async fn parse(&self, fetched: Fetched) -> Result<Ready> {
        let Fetched::Outcome(FetchOutcome::Ok(page)) = fetched else {
            return Ok(Ready::Other(fetched));
        };
        let validators = Validators {
            etag: page.etag.clone(),
            last_modified: page.last_modified.clone(),
        };
        let rules = self.rules.clone();
        let page_url = page.url.to_url();
        let data = tokio::task::spawn_blocking(move || {
            extract(
                &page_url,
                &page.body,
                &rules.links,
                rules.list.as_ref(),
                rules.record.as_ref(),
            )
        })
        .await
        .map_err(|e| Error::Protocol {
            what: "extract",
            detail: format!("the extraction task failed: {e}"),
        })?;
        Ok(Ready::Page {
            data: Box::new(data),
            validators,
        })
    }

    /// The store stage: what the page came to, committed (fenced on the URL's lease). `None`
    /// when the URL was given back.
    async fn settle(
        &self,
        mut lease: UrlLease,
        ready: Ready,
        pass: &Pass,
    ) -> Result<Option<PageResult>> {
        if !self.limits.store_delay.is_zero() {
            tokio::time::sleep(self.limits.store_delay).await;
        }
        let now = self.clock.now();
        let outcome = match ready {
            Ready::Page { data, validators } => {
                lease.validators = validators;
                self.follow(&lease, pass, &data, now).await?;
                let result = match data.record {
                    Some(Ok((natural_key, fields))) => {
                        let record = Extracted {
                            bot: self.bot.clone(),
                            natural_key,
                            data: fields,
                        };
                        let write = self
                            .store
                            .commit_page(&lease, Some(&record), now, self.transactions)
                            .await?;
                        PageResult::Stored(write.unwrap_or(RecordWrite::Unchanged))
                    }
                    Some(Err(reason)) => self.fail(&lease, now, &reason).await?,
                    None => {
                        self.store
                            .commit_page(&lease, None, now, self.transactions)
                            .await?;
                        PageResult::Done
                    }
                };
                return Ok(Some(result));
            }
            Ready::Other(Fetched::Released) => {
                self.store
                    .release_url(&lease, now, now, "given back at shutdown")
                    .await?;
                return Ok(None);
            }
            Ready::Other(Fetched::HostPaused { wait, reason }) => {
                let not_before = crate::store::plus(now, wait);
                self.store
                    .release_url(&lease, now, not_before, &reason)
                    .await?;
                return Ok(None);
            }
            Ready::Other(Fetched::Disallowed) => {
                return Ok(Some(
                    self.fail(&lease, now, "disallowed by robots.txt").await?,
                ));
            }
            Ready::Other(Fetched::Outcome(outcome)) => outcome,
        };
        let result = match outcome {
            FetchOutcome::Ok(_) => unreachable!("pages are parsed before they are stored"),
            FetchOutcome::NotModified => {
                if let Some(id) = &lease.record_id {
                    self.store
                        .mark_seen(std::slice::from_ref(id), lease.pass, now)
                        .await?;
                }
                self.store.complete_url(&lease, now).await?;
                PageResult::NotModified
            }
            FetchOutcome::Skipped { reason } => {
                debug!(bot = %self.bot, url = %lease.url, %reason, "skipped");
                self.store.complete_url(&lease, now).await?;
                PageResult::Skipped
            }
            FetchOutcome::Gone { status } if lease.kind == PageKind::Detail => {
                if let Some(id) = &lease.record_id {
                    self.store.mark_removed(id, lease.pass, now).await?;
                }
                self.store.complete_url(&lease, now).await?;
                debug!(bot = %self.bot, url = %lease.url, status, "detail page gone; record marked removed");
                PageResult::Gone
            }
            FetchOutcome::Gone { status } => {
                self.fail(&lease, now, &format!("HTTP {status}")).await?
            }
            FetchOutcome::Permanent { reason } => self.fail(&lease, now, &reason).await?,
            FetchOutcome::Throttled {
                status,
                retry_after,
            } => {
                self.retry_or_fail(&lease, now, &format!("HTTP {status}"), retry_after)
                    .await?
            }
            FetchOutcome::Timeout => self.retry_or_fail(&lease, now, "timed out", None).await?,
            FetchOutcome::Transient { reason } => {
                self.retry_or_fail(&lease, now, &reason, None).await?
            }
        };
        Ok(Some(result))
    }

    /// Records the URL failed. A detail page that failed is no evidence its item is gone: its
    /// record is marked seen, so deletion detection leaves it alone.
    async fn fail(&self, lease: &UrlLease, now: DateTime<Utc>, reason: &str) -> Result<PageResult> {
        if let Some(id) = &lease.record_id {
            self.store
                .mark_seen(std::slice::from_ref(id), lease.pass, now)
                .await?;
        }
        self.store.fail_url(lease, now, reason).await?;
        debug!(bot = %self.bot, url = %lease.url, %reason, "page failed");
        Ok(PageResult::Failed(reason.to_owned()))
    }

    /// Another attempt later (after `Retry-After` when the site sent one, else a jittered
    /// backoff), or failed once `crawl.attempts` are used.
    async fn retry_or_fail(
        &self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        reason: &str,
        retry_after: Option<Duration>,
    ) -> Result<PageResult> {
        if lease.attempt >= i64::from(self.limits.attempts) {
            let why = format!("{reason} (after {} attempts)", lease.attempt);
            return self.fail(lease, now, &why).await;
        }
        let attempt = u32::try_from(lease.attempt.max(1)).unwrap_or(u32::MAX);
        let backoff = full_jitter(self.limits.backoff_base, self.limits.backoff_max, attempt);
        let mut wait = retry_after.map_or(backoff, |r| r.max(backoff));
        // Retries are load: past the host's budget, the retry waits out the budget's window.
        if !self.flow.may_retry(&lease.url.host_port(), Instant::now()) {
            wait = wait.max(self.flow.settings().retry_window);
            self.metrics.retry_deferred(&self.bot);
        }
        let not_before = crate::store::plus(now, wait);
        self.store.retry_url(lease, now, not_before, reason).await?;
        debug!(bot = %self.bot, url = %lease.url, %reason, ?wait, "will retry");
        Ok(PageResult::Retry)
    }

    /// Enqueues what a fetched page leads to. On listing pages, the incremental mode decides
    /// which items' detail pages this pass fetches; the rest are marked seen.
    async fn follow(
        &self,
        lease: &UrlLease,
        pass: &Pass,
        data: &PageData,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let mode = self.rules.incremental.mode;
        let mut new = Vec::new();
        let mut item_urls: HashSet<&NormalizedUrl> = HashSet::new();
        let mut stop_paginating = false;
        let items: Vec<_> = data
            .items
            .iter()
            .filter_map(|item| item.url.as_ref().map(|url| (item, url)))
            .collect();
        if lease.kind != PageKind::Detail && !items.is_empty() {
            let known = if mode == IncrementalMode::Full {
                Default::default()
            } else {
                let urls: Vec<&NormalizedUrl> = items.iter().map(|(_, url)| *url).collect();
                self.store.known_pages(&self.bot, &urls).await?
            };
            let since = pass.last_run_at.map(|t| {
                t - chrono::Duration::from_std(self.rules.incremental.overlap).unwrap_or_default()
            });
            let mut seen = Vec::new();
            for (item, url) in items {
                if !item_urls.insert(url) {
                    continue;
                }
                // Known: stored by an earlier fetch (done, with a record).
                let stored = known
                    .get(&url_id(&self.bot, url))
                    .filter(|k| k.status == "done" && k.record_id.is_some());
                let fetch = match (mode, stored) {
                    (IncrementalMode::Full, _) | (_, None) => true,
                    (IncrementalMode::Fingerprint, Some(k)) => {
                        k.fingerprint.as_deref() != Some(item.fingerprint.as_str())
                    }
                    (IncrementalMode::Watermark, Some(_)) => {
                        stop_paginating = true;
                        false
                    }
                    (IncrementalMode::UpdatedAt, Some(_)) => match (item.updated_at, since) {
                        (Some(updated), Some(since)) => updated >= since,
                        _ => true,
                    },
                };
                if fetch {
                    new.push(NewUrl {
                        url: url.clone(),
                        kind: PageKind::Detail,
                        fingerprint: Some(item.fingerprint.clone()),
                        priority: self.priority_of(url, PageKind::Detail),
                    });
                } else if let Some(id) = stored.and_then(|k| k.record_id.clone()) {
                    seen.push(id);
                }
            }
            self.store.mark_seen(&seen, lease.pass, now).await?;
        }
        for link in &data.links {
            if item_urls.contains(link) {
                continue;
            }
            let kind = match &self.rules.record {
                Some(r) if r.url_match.is_match(link.as_str()) => PageKind::Detail,
                _ => PageKind::List,
            };
            if stop_paginating && kind == PageKind::List {
                continue;
            }
            new.push(NewUrl {
                url: link.clone(),
                kind,
                fingerprint: None,
                priority: self.priority_of(link, kind),
            });
        }
        // Links this instance already put into this pass (every product page links back to the
        // first listing page, say) need no round trip: enqueuing them again would be a no-op.
        let plain: Vec<String> = new
            .iter()
            .filter(|n| n.fingerprint.is_none())
            .map(|n| url_id(&self.bot, &n.url))
            .collect();
        {
            let cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
            if cache.0 == lease.pass {
                new.retain(|n| {
                    n.fingerprint.is_some() || !cache.1.contains(&url_id(&self.bot, &n.url))
                });
            }
        }
        self.store
            .enqueue_urls(&self.bot, lease.pass, &new, now)
            .await?;
        let mut cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 != lease.pass || cache.1.len() + plain.len() > ENQUEUED_CACHE {
            *cache = (lease.pass, HashSet::new());
        }
        cache.1.extend(plain);
        Ok(())
    }

    /// Crawls `pass` through the pipeline until the pass is over, there is nothing to lease,
    /// `slice` has passed, or shutdown:
    ///
    /// lease → host queue → fetch (≤ `crawl.workers` at once, each admitted by its host's
    /// limiter) → parse queue (`crawl.parse_queue`) → `crawl.parsers` → store queue
    /// (`crawl.store_queue`) → `crawl.writers`.
    ///
    /// Every stage pulls from the one before, and each queue is bounded: a full store queue
    /// stalls the parsers, a full parse queue keeps fetches holding their slots, and without a
    /// free slot nothing is leased. A URL is leased only for a host with room in its queue and
    /// not paused, so one slow or throttling host delays only itself. At the end of the slice the
    /// pages in flight are finished (fetched pages are stored); URLs still waiting for their host
    /// are given back. Only `shutdown` interrupts fetches (their URLs are given back too).
    pub async fn crawl_for(
        self: &Arc<Self>,
        pass: &Pass,
        slice: Duration,
        shutdown: &CancellationToken,
    ) -> Result<SliceEnd> {
        let deadline = Instant::now() + slice;
        // Set by a failing stage: stop leasing, let the rest finish.
        let failed = CancellationToken::new();
        let failure: Arc<std::sync::Mutex<Option<Error>>> = Default::default();
        let fail = {
            let failed = failed.clone();
            let failure = failure.clone();
            move |e: Error| {
                failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                failed.cancel();
            }
        };
        let progressed = Arc::new(tokio::sync::Notify::new());
        let slots = Arc::new(tokio::sync::Semaphore::new(self.limits.workers));
        // Fetch slots held per host.
        let holding: Arc<std::sync::Mutex<HashMap<String, usize>>> = Default::default();
        let (fetched_tx, fetched_rx) =
            tokio::sync::mpsc::channel::<Item<Fetched>>(self.limits.parse_queue);
        let (parsed_tx, parsed_rx) =
            tokio::sync::mpsc::channel::<Item<Ready>>(self.limits.store_queue);
        let mut stages = tokio::task::JoinSet::new();

        let fetched_rx = Arc::new(tokio::sync::Mutex::new(fetched_rx));
        for _ in 0..self.limits.parsers {
            let (crawler, rx, tx, fail) = (
                self.clone(),
                fetched_rx.clone(),
                parsed_tx.clone(),
                fail.clone(),
            );
            stages.spawn(async move {
                loop {
                    let Some(item) = rx.lock().await.recv().await else {
                        return;
                    };
                    let Item {
                        lease,
                        what,
                        _ticket: parsing,
                    } = item;
                    match crawler.parse(what).await {
                        Ok(ready) => {
                            let next = Item {
                                lease,
                                what: ready,
                                _ticket: crawler.stages.store.enter(),
                            };
                            drop(parsing);
                            // Blocks while the store queue is full: slow writes slow parsing.
                            if tx.send(next).await.is_err() {
                                return;
                            }
                        }
                        // The URL's lease runs out and another worker retries it.
                        Err(e) => fail(e),
                    }
                }
            });
        }
        drop(parsed_tx);

        let parsed_rx = Arc::new(tokio::sync::Mutex::new(parsed_rx));
        for _ in 0..self.limits.writers {
            let (crawler, rx, fail, progressed, pass) = (
                self.clone(),
                parsed_rx.clone(),
                fail.clone(),
                progressed.clone(),
                pass.clone(),
            );
            stages.spawn(async move {
                loop {
                    let Some(item) = rx.lock().await.recv().await else { return };
                    let (url, kind) = (item.lease.url.clone(), item.lease.kind);
                    match crawler.settle(item.lease, item.what, &pass).await {
                        Ok(Some(result)) => {
                            crawler
                                .metrics
                                .page_crawled(&crawler.bot, page_result_label(&result));
                            if let PageResult::Stored(write) = &result {
                                crawler.records.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                crawler.metrics.record_written(&crawler.bot, write_label(*write));
                            }
                            debug!(bot = %crawler.bot, %url, kind = kind.as_str(), ?result, "page crawled");
                        }
                        Ok(None) => {}
                        Err(Error::UrlLeaseLost { url }) => {
                            crawler.metrics.url_lease_lost(&crawler.bot);
                            warn!(bot = %crawler.bot, %url, "url lease lost; the newer worker's result wins");
                        }
                        Err(e) => fail(e),
                    }
                    drop(item._ticket);
                    // The leaser waits for this (a permit is kept if it is busy right now).
                    progressed.notify_one();
                }
            });
        }

        // The leaser and dispatcher: this task.
        let mut queues: HashMap<String, VecDeque<Item<()>>> = HashMap::new();
        let mut fetches = tokio::task::JoinSet::new();
        // The last lease that found nothing: the hosts it avoided, and until when no new query
        // goes out unless one of those hosts leaves the avoided set or a page settles here (its
        // links may be new work). With no host avoided — the frontier has nothing pending while
        // pages are in flight, e.g. every product leased and the next listing page not yet
        // read — the wait grows from `DRY_SPELL_MIN` to `DRY_SPELL_MAX` while queries keep
        // coming back empty: without it every instance re-queries in a tight loop, and the
        // database spends itself answering "nothing" (measured: 5 instances, 600 ops/s, 7
        // pages/s on the test server).
        let mut fruitless: Option<(Vec<String>, Instant)> = None;
        let mut dry_spell = Duration::ZERO;
        let mut leasing = futures_util::stream::FuturesUnordered::new();
        // A lease found the pass idle here: no new lease query until something wakes the loop;
        // once the other queries are back and nothing is in flight, the slice ends idle.
        let mut quiet = false;
        let mut end = SliceEnd::TimeUp;
        loop {
            if shutdown.is_cancelled() {
                end = SliceEnd::Shutdown;
                break;
            }
            if failed.is_cancelled() || Instant::now() >= deadline {
                break;
            }
            if quiet && leasing.is_empty() && self.stages.in_pipeline() == 0 {
                end = SliceEnd::Idle;
                break;
            }
            while let Some(joined) = fetches.try_join_next() {
                if let Err(e) = joined {
                    fail(Error::Protocol {
                        what: "fetch task",
                        detail: e.to_string(),
                    });
                }
            }
            let now = Instant::now();
            let mut wake = now + Duration::from_millis(250);
            // Dispatch: URLs whose host admits them now, while a fetch slot is free.
            let mut paused = Vec::new();
            // A host may hold at most its fair share of the fetch slots while others have work,
            // so a slow host cannot take them all (head-of-line blocking at the global cap).
            let share = {
                let held = holding.lock().unwrap_or_else(|p| p.into_inner());
                let mut active: HashSet<&String> = held
                    .iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(h, _)| h)
                    .collect();
                active.extend(queues.keys());
                self.limits.workers.div_ceil(active.len().max(1))
            };
            let server_now = self.clock.now();
            'hosts: for (host, queue) in queues.iter_mut() {
                while let Some(front) = queue.front() {
                    // A lease that ran out while its URL waited here (a stopped process, a long
                    // Crawl-delay) may be another worker's now: drop the URL unfetched, before
                    // it takes a slot, and write nothing about it. Whoever leases it next
                    // fetches it.
                    if server_now >= front.lease.expires_at {
                        let item = queue.pop_front().expect("front exists");
                        debug!(bot = %self.bot, url = %item.lease.url, "lease expired while queued; not fetched");
                        self.metrics.url_lease_lost(&self.bot);
                        continue;
                    }
                    let held = holding
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(host)
                        .copied()
                        .unwrap_or(0);
                    if held >= share {
                        break;
                    }
                    // Until its robots.txt is read, one request at a time: its Crawl-delay must
                    // space the first requests too (an instance joining a running pass).
                    if held > 0 && !self.robots.known(&front.lease.url) {
                        break;
                    }
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        break 'hosts;
                    };
                    let slot = HostSlot::new(slot, host, &holding);
                    match self.flow.try_admit(host, front.lease.attempt > 1, now) {
                        Admission::Admitted(permit) => {
                            let item = queue.pop_front().expect("front exists");
                            let (crawler, tx, shutdown) =
                                (self.clone(), fetched_tx.clone(), shutdown.clone());
                            let ticket = self.stages.fetch.enter();
                            fetches.spawn(async move {
                                let fetched = crawler.fetch(&item.lease, permit, &shutdown).await;
                                let ticket_parse = crawler.stages.parse.enter();
                                drop(ticket);
                                let next = Item {
                                    lease: item.lease,
                                    what: fetched,
                                    _ticket: ticket_parse,
                                };
                                // Blocks while the parse queue is full, holding the fetch slot:
                                // slow parsing stops fetching, and then leasing.
                                let _ = tx.send(next).await;
                                drop(slot);
                            });
                        }
                        Admission::Wait { why, until } => {
                            if why == Busy::Paused {
                                paused.push((host.clone(), until));
                            }
                            if let Some(until) = until {
                                wake = wake.min(until);
                            }
                            break;
                        }
                    }
                }
            }
            // A paused host's waiting URLs go back to the frontier until the pause ends.
            for (host, until) in paused {
                let wait = until.map_or(Duration::ZERO, |u| u.saturating_duration_since(now));
                let now = self.clock.now();
                for item in queues.remove(&host).unwrap_or_default() {
                    let not_before = crate::store::plus(now, wait);
                    match self
                        .store
                        .release_url(&item.lease, now, not_before, "host paused")
                        .await
                    {
                        Ok(()) | Err(Error::UrlLeaseLost { .. }) => {}
                        Err(e) => fail(e),
                    }
                }
            }
            queues.retain(|_, q| !q.is_empty());

            // Lease: while a fetch slot is free and few URLs wait for their hosts, with up to
            // `LEASES_AT_ONCE` lease queries in flight (one round trip each).
            let waiting: usize = queues.values().map(VecDeque::len).sum::<usize>() + leasing.len();
            if slots.available_permits() > leasing.len()
                && waiting < self.limits.workers
                && leasing.len() < LEASES_AT_ONCE
                && !quiet
            {
                let mut avoid: Vec<String> = self
                    .flow
                    .paused_hosts(now)
                    .into_iter()
                    .map(|(h, _)| h)
                    .collect();
                for (host, queue) in &queues {
                    if queue.len() >= self.flow.limit(host).min(share).max(1) {
                        avoid.push(host.clone());
                    }
                }
                avoid.sort();
                avoid.dedup();
                let skip = fruitless.as_ref().is_some_and(|(hosts, until)| {
                    now < *until && hosts.iter().all(|h| avoid.contains(h))
                });
                if let (true, Some((_, until))) = (skip, &fruitless) {
                    wake = wake.min(*until);
                }
                if !skip {
                    // Other lease queries in flight do not count: one that finds a URL leaves it
                    // leased in the database, which the pass's end counts.
                    let in_pipeline = self.stages.in_pipeline() > 0;
                    let (crawler, pass) = (self.clone(), pass.clone());
                    leasing.push(async move {
                        let step = crawler.lease_step(&pass, &avoid, in_pipeline).await;
                        (step, avoid)
                    });
                    continue;
                }
            }
            // Wait for a lease, a page to settle, a permit to come back, a host's time, or the
            // end.
            let step = tokio::select! {
                _ = shutdown.cancelled() => None,
                _ = failed.cancelled() => None,
                Some(step) = futures_util::StreamExt::next(&mut leasing), if !leasing.is_empty() => Some(step),
                _ = progressed.notified() => {
                    fruitless = None;
                    None
                }
                _ = self.flow.changed() => None,
                _ = tokio::time::sleep_until(wake.min(deadline)) => None,
            };
            let Some((step, avoid)) = step else {
                quiet = false;
                continue;
            };
            match step {
                Ok(LeaseStep::Leased(lease)) if self.should_shed(&lease, self.clock.now()) => {
                    let now = self.clock.now();
                    let until = crate::store::plus(now, self.limits.shed_after);
                    match self.store.shed_url(&lease, now, until).await {
                        Ok(()) | Err(Error::UrlLeaseLost { .. }) => {}
                        Err(e) => fail(e),
                    }
                    self.metrics.shed(&self.bot);
                }
                Ok(LeaseStep::Leased(lease)) => {
                    fruitless = None;
                    dry_spell = Duration::ZERO;
                    quiet = false;
                    let host = lease.url.host_port();
                    let ticket = self.stages.host_queue.enter();
                    queues.entry(host).or_default().push_back(Item {
                        lease,
                        what: (),
                        _ticket: ticket,
                    });
                }
                Ok(LeaseStep::Busy) => {
                    let wait = if avoid.is_empty() {
                        dry_spell = (dry_spell * 2).clamp(DRY_SPELL_MIN, DRY_SPELL_MAX);
                        dry_spell
                    } else {
                        Duration::from_secs(1)
                    };
                    fruitless = Some((avoid, Instant::now() + wait));
                }
                // With other leases still out, "idle" may be stale: the slice ends idle once
                // they are back with nothing (checked at the top of the loop).
                Ok(LeaseStep::Idle) => quiet = true,
                Ok(LeaseStep::PassFinished(pass_end)) => {
                    end = SliceEnd::Finished(pass_end);
                    break;
                }
                Err(e) => {
                    fail(e);
                    break;
                }
            }
        }
        // Leases still out are given back with the queued URLs below.
        while let Some((step, _)) = futures_util::StreamExt::next(&mut leasing).await {
            if let Ok(LeaseStep::Leased(lease)) = step {
                let ticket = self.stages.host_queue.enter();
                queues
                    .entry(lease.url.host_port())
                    .or_default()
                    .push_back(Item {
                        lease,
                        what: (),
                        _ticket: ticket,
                    });
            }
        }
        // URLs still waiting for their host go back; fetches finish (or, at shutdown, give
        // their URLs back); then the stages drain.
        let now = self.clock.now();
        for item in queues.into_values().flatten() {
            match self
                .store
                .release_url(
                    &item.lease,
                    now,
                    now,
                    "slice ended before its host admitted it",
                )
                .await
            {
                Ok(()) | Err(Error::UrlLeaseLost { .. }) => {}
                Err(e) => fail(e),
            }
        }
        drop(fetched_tx);
        while let Some(joined) = fetches.join_next().await {
            if let Err(e) = joined {
                fail(Error::Protocol {
                    what: "fetch task",
                    detail: e.to_string(),
                });
            }
        }
        while let Some(joined) = stages.join_next().await {
            if let Err(e) = joined {
                fail(Error::Protocol {
                    what: "crawl stage",
                    detail: e.to_string(),
                });
            }
        }
        if shutdown.is_cancelled() && !matches!(end, SliceEnd::Finished(_)) {
            end = SliceEnd::Shutdown;
        }
        debug!(bot = %self.bot, pass = pass.number, ?end, "crawl slice ended");
        let error = failure.lock().unwrap_or_else(|p| p.into_inner()).take();
        match error {
            Some(e) if !matches!(end, SliceEnd::Finished(_)) => Err(e),
            _ => Ok(end),
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
        RecordWrite::Superseded => "superseded",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
