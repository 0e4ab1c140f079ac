//! The crawl of one bot on this instance, as a pipeline of stages with bounded queues between
//! them ([`Crawler::crawl_for`]). Each stage is a type of its own, in a file of its own, that
//! owns its state and returns what its step came to:
//!
//! - [`lease`]: [`Leaser`] — a batched lease round trip fills the host queues ([`LeaseStep`]);
//! - [`dispatch`]: [`Dispatcher`] — per-host queues, admission by the host's limiter
//!   ([`DispatchStep`]);
//! - [`fetch`]: [`Fetcher`] — robots.txt, the page, its redirects ([`Fetched`]);
//! - [`parse`]: [`Parser`] — HTML read off the async runtime ([`Parsed`]);
//! - [`follow`]: [`Follower`] — the page's links enqueued at once, leased to this instance where
//!   it has room ([`Followed`]);
//! - [`resolve`]: [`Resolver`] — what the page came to ([`Settled`]);
//! - [`commit`]: [`Committer`] — group commit of what waits in the store queue ([`Committed`]).
//!
//! [`Crawler`] is the wiring between them: it holds the stages, and a slice's queues and
//! standing tasks ([`slice`](mod@slice)); [`shared`] is what the stages share.
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

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Hosts whose robots.txt a pass start reads for `Sitemap:` lines, at most.
const MAX_ROBOTS_ORIGINS: usize = 16;

use crate::clock::ServerClock;
use crate::config::{CrawlLimits, CrawlSettings};
use crate::error::Result;
use crate::flow::robots::RobotsCache;
use crate::flow::Flow;
use crate::http_client::HttpClient;
use crate::ids::{BotId, InstanceId};
use crate::metrics::Metrics;
use crate::store::frontier::{Mark, UrlLease};
use crate::store::Store;
use crate::urls::NormalizedUrl;

pub(crate) mod bounds;
pub(crate) mod commit;
pub(crate) mod dispatch;
pub(crate) mod fetch;
pub(crate) mod follow;
pub(crate) mod known;
pub(crate) mod lease;
pub(crate) mod parse;
pub(crate) mod pass;
pub mod probe;
pub(crate) mod queue;
pub(crate) mod resolve;
pub(crate) mod shared;
pub(crate) mod slice;
pub(crate) mod stages;
pub(crate) mod window;

pub(crate) use commit::Committer;
pub(crate) use dispatch::{Dispatcher, HostQueues};
pub(crate) use fetch::Fetcher;
pub(crate) use follow::Follower;
pub(crate) use lease::{LeaseStep, Leaser};
pub(crate) use parse::Parser;
pub(crate) use pass::{Pass, PassState};
pub(crate) use resolve::{Resolver, Settled};

use dispatch::{Admitted, Confirmation, QueueSizing};
use lease::Rounds;
use queue::Queue;
use shared::{MovingAverage, PassMemory, Shared};
use slice::{body_weight, Item, Slice, SliceTasks, Storing, Uncommitted};
use stages::Stages;
use window::{CommitWindow, Resizable};

/// How a [`Crawler::crawl_for`] slice ended.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SliceEnd {
    Finished(crate::store::passes::PassEnd),
    Idle,
    TimeUp,
    Shutdown,
}

/// Everything a crawler needs besides its bot.
#[derive(Clone)]
pub struct CrawlContext {
    pub store: Store,
    pub clock: Arc<ServerClock>,
    pub me: InstanceId,
    pub started_at: DateTime<Utc>,
    pub limits: CrawlLimits,
    pub fetcher: HttpClient,
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

/// One bot's crawl on this instance: its stages, wired together by [`Crawler::crawl_for`].
pub(crate) struct Crawler {
    shared: Arc<Shared>,
    memory: Arc<PassMemory>,
    leaser: Leaser,
    dispatcher: Dispatcher,
    fetcher: Fetcher,
    parser: Parser,
    settler: Resolver,
    committer: Committer,
    /// How many pages may be uncommitted, and commits on their way, sized from the measured
    /// commit latency and page rate.
    window: CommitWindow,
    /// No fetch starts while the database has left an operation unanswered longer than this
    /// (the lock's ttl): cut off from it, this instance could neither confirm its leases nor
    /// commit what it fetched.
    cut_off_after: Duration,
}

impl Crawler {
    pub(crate) fn new(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Arc<Self> {
        let crawler = Arc::new(Self::build(bot, rules, ctx));
        let weak = Arc::downgrade(&crawler);
        ctx.metrics
            .add_source(Box::new(move |m| match weak.upgrade() {
                Some(c) => {
                    for (name, stage) in c.shared.stages.all() {
                        m.observe_stage(&c.shared.bot, name, stage.depth(), stage.oldest());
                    }
                    if let Some(ratio) = c.requests_per_record() {
                        m.requests_per_record(&c.shared.bot, ratio);
                    }
                    let window = c.window.sizes();
                    m.commit_window(&c.shared.bot, window.pages, window.writers);
                    true
                }
                None => false,
            }));
        crawler
    }

    fn build(bot: BotId, rules: CrawlSettings, ctx: &CrawlContext) -> Self {
        let (levels, lowest) = Shared::levels(&rules);
        let client = ctx
            .fetcher
            .for_bot(&rules.headers, &rules.http, &rules.links.scope);
        let rules = Arc::new(rules);
        let shared = Arc::new(Shared {
            bot,
            rules: rules.clone(),
            limits: ctx.limits.clone(),
            store: ctx.store.clone(),
            clock: ctx.clock.clone(),
            me: ctx.me.clone(),
            metrics: ctx.metrics.clone(),
            flow: ctx.flow.clone(),
            stages: Arc::new(Stages::default()),
            levels,
            lowest,
            chain_writes: MovingAverage::default(),
        });
        let memory = Arc::new(PassMemory::default());
        let sizing = Arc::new(QueueSizing::new(ctx.flow.clone(), ctx.limits.workers));
        let follower = Follower::new(shared.clone(), memory.clone(), sizing.clone());
        Self {
            leaser: Leaser::new(shared.clone(), memory.clone(), sizing, ctx.started_at),
            dispatcher: Dispatcher::new(shared.clone(), ctx.robots.clone()),
            fetcher: Fetcher::new(shared.clone(), client, ctx.robots.clone()),
            parser: Parser::new(rules),
            settler: Resolver::new(shared.clone(), follower),
            committer: Committer::new(shared.clone(), ctx.transactions),
            window: CommitWindow::of(&ctx.limits),
            cut_off_after: ctx.cut_off_after,
            memory,
            shared,
        }
    }

    /// Page requests sent per record stored, so far (`None` before the first record).
    pub(crate) fn requests_per_record(&self) -> Option<f64> {
        let records = self.committer.records();
        (records > 0).then(|| self.fetcher.requests() as f64 / records as f64)
    }

    pub(crate) fn bot(&self) -> &BotId {
        &self.shared.bot
    }

    /// What a pass starts from: the stored seeds (the unparsable skipped: refresh stored only
    /// valid URLs, so this drops nothing in practice), then the bot's `sitemaps`, then — with
    /// `sitemaps_from_robots` — the sitemaps the robots.txt of the seeds' and sitemaps' in-scope
    /// hosts name, each URL once. A robots.txt that cannot be read now is passed over with a
    /// warning: the pass starts without its sitemaps, and the coverage gate counts the sitemap
    /// files an earlier pass read and this one did not, so nothing they list is removed.
    pub(crate) async fn pass_sources(&self, seeds: &[String]) -> Vec<NormalizedUrl> {
        let rules = &self.shared.rules;
        let parse = |s: &str| NormalizedUrl::parse_with(s, &rules.links.strip).ok();
        let mut urls: Vec<NormalizedUrl> = seeds.iter().filter_map(|s| parse(s)).collect();
        let mut seen: std::collections::HashSet<NormalizedUrl> = urls.iter().cloned().collect();
        for url in &rules.sitemaps {
            if seen.insert(url.clone()) {
                urls.push(url.clone());
            }
        }
        if !rules.sitemaps_from_robots {
            return urls;
        }
        let mut origins: Vec<String> = Vec::new();
        for url in &urls {
            let new = !origins.contains(&url.origin());
            if rules.links.in_scope(url) && new && origins.len() < MAX_ROBOTS_ORIGINS {
                origins.push(url.origin());
            }
        }
        for origin in origins {
            match self.fetcher.robots_sitemaps(&origin).await {
                Ok(found) => {
                    for url in found.iter().filter_map(|s| parse(s)) {
                        if seen.insert(url.clone()) {
                            urls.push(url);
                        }
                    }
                }
                Err(why) => tracing::warn!(
                    bot = %self.shared.bot,
                    %origin,
                    %why,
                    "the pass starts without the sitemaps of this robots.txt"
                ),
            }
        }
        urls
    }

    /// Crawls `pass` through the pipeline until the pass is over, there is nothing to lease,
    /// `slice` has passed, or shutdown:
    ///
    /// lease (batched) → host queues (≤ `crawl.host_queue` URLs) → fetch (≤ `crawl.workers` at
    /// once, each admitted by its host's limiter) → parse queue (`crawl.parse_queue`, listing
    /// pages first) → `crawl.parsers` (each follows its page's links at once) → store queue
    /// (waiting or being committed) → group commits of up to `crawl.store_queue` pages each.
    ///
    /// Every stage pulls from the one before, and each queue is bounded: a full parse queue
    /// keeps fetches holding their slots, and without room in the host queues nothing is
    /// leased. The commit window ([`window`]) bounds the pages fetched and not yet committed,
    /// and the commits on their way, by the measured commit latency and page rate (at most
    /// `crawl.max_uncommitted` pages and `crawl.writers` commits); at most
    /// `crawl.max_uncommitted_bytes` of their bodies are held at once (a fetch whose body does
    /// not fit waits for room, holding its slot). Slow commits hold their pages, and a full
    /// window stops fetching, then leasing. At the end of the slice the pages in flight are
    /// finished (fetched pages are committed); URLs still waiting for their host are given
    /// back. Only `shutdown` interrupts fetches (their URLs are given back too).
    pub(crate) async fn crawl_for(
        self: &Arc<Self>,
        pass: &Pass,
        slice: Duration,
        shutdown: &CancellationToken,
    ) -> Result<SliceEnd> {
        let deadline = Instant::now() + slice;
        let mut tasks = self.open_slice(pass);
        let run = tasks.run.clone();
        let mut rounds = Rounds::default();
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
            let busy = self.shared.stages.in_pipeline() > 0;
            if rounds.idle_over(busy) {
                end = SliceEnd::Idle;
                break;
            }
            let now = Instant::now();
            let cut_off = self.cut_off(&mut was_cut_off);
            let mut wake = self
                .dispatch_turn(&mut tasks, pass, now, cut_off, shutdown)
                .await;
            rounds.look(run.new_work(), busy);
            if rounds.due(&run.queues, now) {
                self.send_lease_round(&mut rounds, &run, pass);
            }
            if let Some(until) = rounds.dry {
                wake = wake.min(until);
            }
            let leased = tokio::select! {
                _ = shutdown.cancelled() => None,
                _ = run.failed.cancelled() => None,
                step = async { rounds.round.as_mut().expect("checked").await }, if rounds.round.is_some() => Some(step),
                _ = run.progressed.notified() => None,
                _ = run.queues.arrived() => None,
                _ = self.shared.flow.changed() => None,
                _ = tokio::time::sleep_until(wake.min(deadline)) => None,
            };
            let Some(step) = leased else {
                continue;
            };
            rounds.round = None;
            match step {
                Ok(LeaseStep::PassFinished(pass_end)) => {
                    end = SliceEnd::Finished(pass_end);
                    break;
                }
                Ok(step) => {
                    rounds.landed(&step, run.new_work(), self.shared.stages.in_pipeline() > 0)
                }
                Err(e) => {
                    run.fail(e);
                    break;
                }
            }
        }
        self.close_slice(tasks, rounds.round.take()).await;
        self.slice_end(pass, end, shutdown, &run)
    }

    /// How a slice that came to `end` ends: shutdown, unless the pass finished; the slice's
    /// failure, unless the pass finished anyway.
    fn slice_end(
        &self,
        pass: &Pass,
        mut end: SliceEnd,
        shutdown: &CancellationToken,
        run: &Slice,
    ) -> Result<SliceEnd> {
        if shutdown.is_cancelled() && !matches!(end, SliceEnd::Finished(_)) {
            end = SliceEnd::Shutdown;
        }
        debug!(bot = %self.shared.bot, pass = pass.number.get(), ?end, "crawl slice ended");
        let error = run.failure.lock().unwrap_or_else(|p| p.into_inner()).take();
        match error {
            Some(e) if !matches!(end, SliceEnd::Finished(_)) => Err(e),
            _ => Ok(end),
        }
    }

    /// One turn of the dispatcher: finished fetches reaped, the admitted URLs sent to fetches,
    /// a paused host's waiting URLs given back until the pause ends. Returns when to look again
    /// at the latest.
    async fn dispatch_turn(
        self: &Arc<Self>,
        tasks: &mut SliceTasks,
        pass: &Pass,
        now: Instant,
        cut_off: bool,
        shutdown: &CancellationToken,
    ) -> Instant {
        let run = tasks.run.clone();
        while let Some(joined) = tasks.fetches.try_join_next() {
            run.check_task("fetch task", joined);
        }
        let server_now = self.shared.clock.now();
        let turn = dispatch::Turn {
            slots: &run.slots,
            uncommitted: run.uncommitted.semaphore(),
            server_now,
            now,
            cut_off,
        };
        let step = self.dispatcher.step(&run.queues, turn);
        for started in step.started {
            self.start_fetch(&run, &mut tasks.fetches, pass, started, shutdown);
        }
        // A URL whose lease is still being written is given back once the write took it; one
        // the write did not take is not this instance's to give back.
        let mut back = Vec::new();
        for (mut q, wait) in step.paused {
            match q.confirm.take() {
                Some(confirm) if !confirm.known() => {
                    let (crawler, run2) = (self.clone(), run.clone());
                    run.settling.spawn(async move {
                        if confirm.taken().await {
                            let not_before = crate::store::plus(crawler.shared.clock.now(), wait);
                            let back = std::iter::once((&q.lease, not_before, "host paused"));
                            crawler.give_back(&run2, back).await;
                        }
                    });
                }
                Some(confirm) if !confirm.taken_now() => {}
                _ => back.push((q, wait)),
            }
        }
        let back = back.iter().map(|(q, wait)| {
            (
                &q.lease,
                crate::store::plus(server_now, *wait),
                "host paused",
            )
        });
        self.give_back(&run, back).await;
        step.wake.unwrap_or(now + Duration::from_millis(250))
    }

    /// Sends a lease round (it fills the host queues; its step comes back to the dispatcher).
    fn send_lease_round(self: &Arc<Self>, rounds: &mut Rounds, run: &Arc<Slice>, pass: &Pass) {
        let in_pipeline = self.shared.stages.in_pipeline() > 0;
        let new_work = run.new_work();
        let (crawler, run, pass) = (self.clone(), run.clone(), pass.clone());
        rounds.send(
            new_work,
            in_pipeline,
            Box::pin(async move { crawler.leaser.step(&pass, &run.queues, in_pipeline).await }),
        );
    }

    /// A slice's shared state and its standing tasks: the parsers, the writers and (once a
    /// pass, until every one is leased) the read of the last complete pass's listing pages,
    /// which then wait to be leased into this one, beside the crawl (see
    /// [`Leaser::read_known_listings`]).
    fn open_slice(self: &Arc<Self>, pass: &Pass) -> SliceTasks {
        let (shared, limits) = (&self.shared, &self.shared.limits);
        let sizes = self.window.sizes();
        let run = Arc::new(Slice {
            queues: HostQueues::new(limits.host_queue),
            parse: Queue::new(limits.parse_queue),
            // The window bounds the pages in the store stage (each holds one of its pages).
            store: Queue::new(limits.max_uncommitted),
            slots: Arc::new(Semaphore::new(limits.workers.max(1))),
            uncommitted: Resizable::new(sizes.pages),
            commits: Resizable::new(sizes.writers),
            bytes: Arc::new(Semaphore::new(shared.bytes_kib() as usize)),
            bytes_kib: shared.bytes_kib(),
            progressed: tokio::sync::Notify::new(),
            new_work: Default::default(),
            failed: CancellationToken::new(),
            failure: Default::default(),
            settling: tokio_util::task::TaskTracker::new(),
            feed_staged: pass.feed_staged,
        });
        let mut parsers = JoinSet::new();
        for _ in 0..limits.parsers.max(1) {
            parsers.spawn(self.clone().parse_pages(run.clone(), pass.clone()));
        }
        if !self.memory.listings_enqueued(pass.number) {
            let (crawler, run, pass) = (self.clone(), run.clone(), pass.clone());
            run.clone().settling.spawn(async move {
                match crawler.leaser.read_known_listings(&pass).await {
                    Ok(none_waits) => {
                        if none_waits {
                            crawler.memory.set_listings_enqueued(pass.number);
                        }
                        run.progressed(true);
                    }
                    Err(e) => run.fail(e),
                }
            });
        }
        // The pass's table of listed items known stored, read while the first pages are
        // enqueued, leased and fetched: the first listing page finds it ready instead of
        // waiting for it. Once a pass (held until the pass ends); a failed read is read again
        // by the first listing page that needs it.
        if !self.memory.holds_known(pass.number) {
            let (crawler, number) = (self.clone(), pass.number);
            run.settling.spawn(async move {
                let (store, bot) = (&crawler.shared.store, &crawler.shared.bot);
                if let Err(e) = crawler.memory.known_items(store, bot, number).await {
                    debug!(%bot, pass = number.get(), error = %e, "listed items not read ahead: the first listing page reads them");
                }
            });
        }
        // `crawl.writers` tasks; as many commit at once as the window's `writers`.
        let mut writers = JoinSet::new();
        for _ in 0..limits.writers.max(1) {
            let (crawler, run) = (self.clone(), run.clone());
            writers.spawn(async move { crawler.commit_pages(&run).await });
        }
        SliceTasks {
            run,
            parsers,
            writers,
            fetches: JoinSet::new(),
        }
    }

    /// Whether the database has left this instance unanswered past `lock.ttl` (then no fetch
    /// starts); logs each change of that against `was`.
    fn cut_off(&self, was: &mut bool) -> bool {
        let silent = self.shared.store.unanswered_for();
        let cut_off = silent > self.cut_off_after;
        if cut_off != *was {
            let bot = &self.shared.bot;
            if cut_off {
                warn!(%bot, silent = ?silent, "the database has not answered for longer than lock.ttl: no fetch starts until it does");
            } else {
                info!(%bot, "the database answers again: fetching again");
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
        fetches: &mut JoinSet<()>,
        pass: &Pass,
        started: Admitted,
        shutdown: &CancellationToken,
    ) {
        let Admitted {
            queued,
            host: admitted,
            slot,
            uncommitted,
        } = started;
        let (crawler, run, shutdown) = (self.clone(), run.clone(), shutdown.clone());
        let stages = &self.shared.stages;
        let fetching = stages.fetch.enter();
        drop(queued.ticket);
        let refetch = pass.refetch;
        fetches.spawn(async move {
            let mut lease = queued.lease;
            if refetch {
                lease.validators = Default::default();
            }
            let fetched = crawler.fetcher.step(&lease, admitted, &shutdown).await;
            let fast = lease.kind.is_listing();
            // Waits while the bodies uncommitted here weigh the whole byte budget, holding the
            // fetch slot: big pages in flight stop fetching, then leasing.
            let weight = body_weight(&fetched, run.bytes_kib);
            let bytes = run.bytes.clone().acquire_many_owned(weight).await.ok();
            let item = Item {
                lease,
                what: fetched,
                confirm: queued.confirm,
                uncommitted: Uncommitted {
                    _page: uncommitted,
                    _bytes: bytes,
                },
                _ticket: crawler.shared.stages.parse.enter(),
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
        let now = self.shared.clock.now();
        if let Err(e) = self.shared.store.frontier().settle_urls(&marks, now).await {
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
        let now = self.shared.clock.now();
        // Every write is answered by now (the settling tasks ended): a lease written ahead that
        // the write did not take is not this instance's to give back.
        let back = left
            .iter()
            .filter(|q| q.confirm.as_ref().is_none_or(Confirmation::taken_now))
            .map(|q| (&q.lease, now, "slice ended before its host admitted it"));
        self.give_back(&run, back).await;
    }

    /// A parser: takes fetched pages (listing pages first), parses them, and has each settled
    /// beside it (its links followed at once) and handed to the store queue.
    async fn parse_pages(self: Arc<Self>, run: Arc<Slice>, pass: Pass) {
        while let Some(slot) = run.parse.pop().await {
            let Item {
                lease,
                what,
                confirm,
                uncommitted,
                _ticket: parsing,
            } = slot.item;
            drop(slot.room);
            let parsed = match self.parser.step(what).await {
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
                // The URL, for the line that says a page fetched ahead was dropped.
                let ahead = confirm.map(|c| (c, lease.url.clone()));
                let settled = crawler
                    .settler
                    .step_retrying(lease, parsed, &pass, &run2.queues)
                    .await;
                // Fetched while the write leasing it was on its way: its links are followed
                // like any page's (enqueuing them twice is a no-op), but it is committed only if
                // the write took its lease; otherwise it is someone else's and nothing of it is
                // written.
                if let Some((confirm, url)) = ahead {
                    let kept = confirm.taken().await;
                    let bot = &crawler.shared.bot;
                    crawler.shared.metrics.chain_fetched_ahead(bot, kept);
                    if !kept {
                        debug!(%bot, %url, "fetched ahead of a lease this instance did not get; dropped");
                        return;
                    }
                }
                match settled {
                    Ok(settled) => {
                        let new_work = settled.new_pending > 0;
                        let storing = Storing {
                            settled,
                            _uncommitted: uncommitted,
                            _ticket: crawler.shared.stages.store.enter(),
                        };
                        drop(parsing);
                        // Links queued here wake the dispatcher; new pending work, the leaser.
                        run2.progressed(new_work);
                        // The store queue has room for the whole window: slow commits hold the
                        // pages here, and their uncommitted permits stop fetching, then leasing.
                        let _ = run2.store.push(storing, false).await;
                    }
                    Err(e) => run2.fail(e),
                }
            };
            run.settling.spawn(settle);
        }
    }

    /// A writer: once one of the window's commits is free, takes what waits in the store queue
    /// and commits it as one batch; each commit's latency resizes the window.
    async fn commit_pages(&self, run: &Slice) {
        loop {
            let Ok(_commit) = run.commits.semaphore().acquire().await else {
                return;
            };
            let batch = run.store.pop_up_to(self.shared.limits.store_queue).await;
            if batch.is_empty() {
                return;
            }
            let settled: Vec<&Settled> = batch.iter().map(|s| &s.item.settled).collect();
            let result = self.committer.step(&settled, run.feed_staged).await;
            if let Ok((_, took)) = &result {
                self.window.commit(settled.len(), *took, Instant::now());
            }
            let sizes = self.window.sizes();
            match result {
                Ok((committed, took)) => {
                    tracing::trace!(
                        pages = settled.len(),
                        ?took,
                        window = sizes.pages,
                        writers = sizes.writers,
                        "commit"
                    );
                    for (s, c) in settled.iter().zip(&committed) {
                        self.committer.account(s, c);
                    }
                }
                Err(e) => run.fail(e),
            }
            drop(settled);
            drop(batch);
            run.uncommitted.resize(sizes.pages);
            run.commits.resize(sizes.writers);
            run.progressed(false);
        }
    }
}
