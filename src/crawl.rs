//! The crawl of one bot on this instance: lease a URL of the bot's current pass, fetch it,
//! extract off the async runtime, enqueue what it links to, and commit its record together with
//! the URL's done mark. [`Crawler::crawl_step`] is one turn and returns a [`CrawlStep`];
//! [`Crawler::crawl_for`] runs `crawl.workers` of them at once for a while.
//!
//! Incremental passes: listing pages are fetched every pass; a detail page only when it is new,
//! when its listing fingerprint changed (`fingerprint`), when its item changed since the last
//! run minus the overlap (`updated_at`), or — in every mode — when a conditional GET with the
//! stored ETag / Last-Modified says it changed. `watermark` stops paginating at the first
//! listing page that shows an item already stored. Items a pass sees on a listing page without
//! fetching their detail page are marked seen in one batched write per page.

use std::collections::HashSet;
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
use crate::ids::{BotId, InstanceId};
use crate::metrics::Metrics;
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

/// The result of one [`Crawler::crawl_step`].
#[derive(Clone, Debug, PartialEq)]
pub enum CrawlStep {
    Crawled {
        url: NormalizedUrl,
        kind: PageKind,
        result: PageResult,
    },
    /// Nothing to lease now, but the pass is not over: URLs are leased by others or wait for a
    /// retry time.
    Idle,
    /// Nothing pending or leased: the pass is over.
    PassFinished(PassEnd),
    /// The URL's lease went to another worker; nothing of this page was kept.
    LeaseLost { url: String },
    /// Shutdown arrived mid-fetch: the URL was given back.
    Released,
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
}

impl Crawler {
    pub fn new(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Self {
        Self {
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
        }
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

    fn deletion_rules(&self) -> DeletionRules {
        DeletionRules {
            enabled: self.rules.incremental.mode != IncrementalMode::Watermark,
            min_coverage: self.limits.min_coverage,
            max_error_rate: self.limits.max_error_rate,
        }
    }

    /// One turn: lease a URL of `pass` and carry it through, or find the pass idle or over.
    pub async fn crawl_step(&self, pass: &Pass, shutdown: &CancellationToken) -> Result<CrawlStep> {
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
        let mut lease = self.lease(pass).await?;
        if lease.is_none()
            && self
                .store
                .promote_due(&self.bot, pass.number, self.clock.now())
                .await?
                > 0
        {
            lease = self.lease(pass).await?;
        }
        let Some(lease) = lease else {
            if self.store.pass_has_work(&self.bot, pass.number).await? {
                return Ok(CrawlStep::Idle);
            }
            // One worker of this instance ends the pass (it counts the whole pass); the others
            // find it ended on their next turn.
            let Ok(_finishing) = self.finishing.try_lock() else {
                return Ok(CrawlStep::Idle);
            };
            let end = self
                .store
                .finish_pass(
                    &self.bot,
                    pass.number,
                    pass.started_at,
                    self.deletion_rules(),
                    self.clock.now(),
                )
                .await?;
            if !end.finished {
                return Ok(CrawlStep::Idle);
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
            return Ok(CrawlStep::PassFinished(end));
        };
        let url = lease.url.clone();
        let kind = lease.kind;
        match self.carry(lease, pass, shutdown).await {
            Ok(Some(result)) => {
                self.metrics
                    .page_crawled(&self.bot, page_result_label(&result));
                if let PageResult::Stored(write) = &result {
                    self.metrics.record_written(&self.bot, write_label(*write));
                }
                debug!(bot = %self.bot, %url, kind = kind.as_str(), ?result, "page crawled");
                Ok(CrawlStep::Crawled { url, kind, result })
            }
            Ok(None) => Ok(CrawlStep::Released),
            Err(Error::UrlLeaseLost { url }) => {
                self.metrics.url_lease_lost(&self.bot);
                warn!(bot = %self.bot, %url, "url lease lost; the newer worker's result wins");
                Ok(CrawlStep::LeaseLost { url })
            }
            Err(e) => Err(e),
        }
    }

    async fn lease(&self, pass: &Pass) -> Result<Option<UrlLease>> {
        // A dead predecessor's leases can only predate this process: look for them until a
        // lease comes without one, then never again for this pass.
        let look = self.reclaimed_in.load(std::sync::atomic::Ordering::Relaxed) != pass.number;
        let lease = self
            .store
            .lease_next(
                &self.bot,
                pass.number,
                &self.me,
                look.then_some(self.started_at),
                self.clock.now(),
                self.limits.lease,
            )
            .await?;
        if look
            && lease
                .as_ref()
                .is_none_or(|l| l.leased_at > self.started_at && !l.reclaimed)
        {
            self.reclaimed_in
                .store(pass.number, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(lease)
    }

    /// Fetches and stores one leased page. `None` when shutdown interrupted the fetch (the URL
    /// was given back).
    async fn carry(
        &self,
        mut lease: UrlLease,
        pass: &Pass,
        shutdown: &CancellationToken,
    ) -> Result<Option<PageResult>> {
        // Listing pages are read every pass (their items are the pass's evidence of what exists);
        // only detail pages are fetched conditionally.
        let validators = match lease.kind {
            PageKind::Detail => lease.validators.clone(),
            PageKind::List | PageKind::Seed => Validators::default(),
        };
        let outcome = tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                let now = self.clock.now();
                self.store.retry_url(&lease, now, now, "given back at shutdown").await?;
                return Ok(None);
            }
            outcome = self.fetcher.fetch(&lease.url, &validators) => outcome,
        };
        let now = self.clock.now();
        let result = match outcome {
            FetchOutcome::Ok(page) => {
                lease.validators = Validators {
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
                self.follow(&lease, pass, &data, now).await?;
                match data.record {
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
                }
            }
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
        let wait = retry_after.map_or(backoff, |r| r.max(backoff));
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

    /// Runs `crawl.workers` steps at once on `pass` until the pass is over, there is nothing to
    /// lease, `slice` has passed, or shutdown. Each worker finishes (or gives back) its page
    /// before returning.
    pub async fn crawl_for(
        self: &Arc<Self>,
        pass: &Pass,
        slice: Duration,
        shutdown: &CancellationToken,
    ) -> Result<SliceEnd> {
        let deadline = Instant::now() + slice;
        // `drain` stops the workers from leasing more; a page in flight is finished, not
        // abandoned (an abandoned fetch would be a repeated request). Only `shutdown` interrupts.
        let drain = CancellationToken::new();
        // Workers inside a step (they may enqueue more) and a signal when one finishes a page: an
        // idle worker waits for its peers' pages before it gives up the slice.
        let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let progressed = Arc::new(tokio::sync::Notify::new());
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..self.limits.workers {
            let crawler = self.clone();
            let pass = pass.clone();
            let drain = drain.clone();
            let shutdown = shutdown.clone();
            let busy = busy.clone();
            let progressed = progressed.clone();
            workers.spawn(async move {
                use std::sync::atomic::Ordering;
                loop {
                    if shutdown.is_cancelled() {
                        return Ok(SliceEnd::Shutdown);
                    }
                    if drain.is_cancelled() || Instant::now() >= deadline {
                        return Ok(SliceEnd::TimeUp);
                    }
                    busy.fetch_add(1, Ordering::SeqCst);
                    let step = crawler.crawl_step(&pass, &shutdown).await;
                    let others_busy = busy.fetch_sub(1, Ordering::SeqCst) > 1;
                    match step? {
                        CrawlStep::Crawled { .. } | CrawlStep::LeaseLost { .. } => {
                            progressed.notify_waiters();
                        }
                        CrawlStep::Idle if others_busy => {
                            tokio::select! {
                                _ = shutdown.cancelled() => {}
                                _ = drain.cancelled() => {}
                                _ = progressed.notified() => {}
                                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                            }
                        }
                        CrawlStep::Idle => return Ok(SliceEnd::Idle),
                        CrawlStep::PassFinished(end) => return Ok(SliceEnd::Finished(end)),
                        CrawlStep::Released => return Ok(SliceEnd::Shutdown),
                    }
                }
            });
        }
        let mut end = SliceEnd::TimeUp;
        let mut error = None;
        while let Some(joined) = workers.join_next().await {
            let result: Result<SliceEnd> = joined.unwrap_or_else(|e| {
                Err(Error::Protocol {
                    what: "crawl worker",
                    detail: e.to_string(),
                })
            });
            match result {
                // The first worker to see the pass over ends the slice for all.
                Ok(SliceEnd::Finished(pass_end)) => {
                    end = SliceEnd::Finished(pass_end);
                    drain.cancel();
                }
                Ok(SliceEnd::Shutdown) => {
                    if !matches!(end, SliceEnd::Finished(_)) {
                        end = SliceEnd::Shutdown;
                    }
                }
                Ok(SliceEnd::Idle) => {
                    if matches!(end, SliceEnd::TimeUp) {
                        end = SliceEnd::Idle;
                    }
                }
                Ok(SliceEnd::TimeUp) => {}
                Err(e) => {
                    // One worker's database trouble ends the slice (the others finish their
                    // pages first); the loop backs off.
                    drain.cancel();
                    error.get_or_insert(e);
                }
            }
        }
        if shutdown.is_cancelled() && !matches!(end, SliceEnd::Finished(_)) {
            end = SliceEnd::Shutdown;
        }
        match error {
            Some(e) if !matches!(end, SliceEnd::Finished(_)) => Err(e),
            _ => Ok(end),
        }
    }
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
