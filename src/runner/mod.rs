//! The runner: one bot's loop on this instance, above the lock and crawl wings. Each step reads
//! the bot's document, asks the pure [`decide`] what to do, and takes the turn it names — the
//! refresh turn under the edit lock ([`refresh`]) or the crawl turn of a ready bot
//! ([`crawl_turn`]) — then waits for the moment the document names or a change of it.
//! [`BotRunner::step`] is one turn and returns a [`StepOutcome`]; [`BotRunner::run`] loops over
//! it with bounded, jittered waits.
//!
//! Beside the loop: [`hub`] (what an instance does once for all its bots: one change stream, one
//! poll, one heartbeat round trip per tick, the refresh permits), [`roster`] (the bots defined in
//! the database, followed at runtime) and [`presence`] (one live process per instance id).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, trace, warn};

use crate::backoff::{full_jitter, jittered};
use crate::clock::ServerClock;
use crate::config::{BotSettings, LockSettings, OnRefreshFailure, RefreshSchedule};
use crate::crawl::{CrawlContext, Crawler, PassState, SliceEnd};
use crate::error::{Error, Result};
use crate::ids::{BotId, InstanceId};
use crate::ids::{LockEpoch, PassNumber};
use crate::lock::bot::{BotDoc, BotSpec, Observed, PassSpec};
use crate::lock::decide::{decide, ready_until, Decision, Me, Policy};
use crate::lock::state::{BotState, Claim};
use crate::metrics::Metrics;
use crate::runner::hub::{Beat, Hub, Permit};
use crate::seeds::{SeedError, SeedReader, Seeds};
use crate::store::{EditLock, NextPass, Store};

mod crawl_turn;
pub mod hub;
mod notify;
pub mod presence;
mod refresh;
pub(crate) mod roster;

use crawl_turn::RecordedSpec;
use refresh::ClaimRequest;

/// What every bot runner of one instance shares.
pub struct Context {
    pub store: Store,
    pub clock: Arc<ServerClock>,
    pub me: InstanceId,
    /// When this process started, on the server's clock (see `decide::Me`).
    pub started_at: DateTime<Utc>,
    pub lock: LockSettings,
    pub fetcher: SeedReader,
    pub metrics: Arc<Metrics>,
    /// Backoff for failed refreshes (`refresh.backoff_base` / `backoff_max`).
    pub refresh_backoff: (Duration, Duration),
    /// What crawling bots need (`None`: bots only keep their seeds fresh).
    pub crawl: Option<CrawlContext>,
    /// The instance's shared wake-ups, lock upkeep and refresh permits.
    pub hub: Hub,
    /// Reads of a bot's document at the start of a step, at most as many at once as the
    /// driver's pool has connections: the rest would only queue in the driver, each holding its
    /// command's buffers (10,000 bots starting at once held about 90 MB that way).
    pub reads: tokio::sync::Semaphore,
}

/// The result of one [`BotRunner::step`].
#[derive(Debug, PartialEq)]
pub enum StepOutcome {
    /// The bot is Ready: its seeds are usable; crawl on them. `pass` is the crawl's state
    /// (`None` for a bot without `[bots.crawl]`).
    Ready {
        seeds: usize,
        epoch: LockEpoch,
        pass: Option<PassState>,
    },
    /// Nothing to do before `until` or a change of the document.
    Wait {
        until: Option<DateTime<Utc>>,
        state: BotState,
    },
    /// The document was created.
    Initialized,
    /// Another instance claimed the lock first (or the document changed since it was read).
    LostRace,
    /// A contradictory or malformed document was rewritten.
    Repaired,
    /// This instance refreshed the seeds and marked the bot ready.
    Refreshed { seeds: usize, epoch: LockEpoch },
    /// The refresh failed; the failure is recorded and the lock released.
    RefreshFailed { error: String },
    /// A fenced write matched nothing: someone else owns the bot now. Nothing more was written.
    EditLockLost,
    /// Shutdown arrived mid-refresh: work stopped, then the lock was released.
    Released,
    /// The bot, defined in the database, was removed: its runner ends.
    Removed,
    /// A refresh is due, but every refresh permit of this instance is in use: nothing was
    /// claimed; the runner waits for a permit (or for another instance to do it).
    Busy,
}

/// When [`BotRunner::run`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// Once the bot is done: Ready, and (for a crawling bot) its current pass finished
    /// (`run --once`).
    Done,
    /// Only at shutdown (the daemon).
    Shutdown,
}

#[derive(Debug, PartialEq)]
pub enum RunEnd {
    /// Ready (and its pass finished, for a crawling bot), on `seeds` seeds at `epoch`.
    Ready {
        seeds: usize,
        epoch: LockEpoch,
    },
    Shutdown,
    /// The bot, defined in the database, was removed.
    Removed,
}

pub struct BotRunner {
    bot: BotSettings,
    policy: Policy,
    ctx: Arc<Context>,
    wake: Arc<Notify>,
    crawler: Option<Arc<Crawler>>,
    /// For a bot defined in the database: its spec (`specVersion`, `spec`). A pass started here
    /// records it; the bot's document going away stops this runner (nothing re-creates it).
    spec: Option<BotSpec>,
    /// The crawler of a pass that started on another spec version than this runner's.
    pass_crawler: std::sync::Mutex<Option<(RecordedSpec, Arc<Crawler>)>>,
    /// The spec the bot's current (or last) pass recorded, as last read.
    last_pass_spec: std::sync::Mutex<Option<RecordedSpec>>,
    /// A refresh permit the loop waited for, for the next step's claim.
    reserved: std::sync::Mutex<Option<Permit>>,
    /// While the bot is Ready: when its document says a refresh falls due (or its backoff
    /// ends), as last read — until then the loop waits for a wake-up only.
    ready_until: std::sync::Mutex<Option<DateTime<Utc>>>,
    /// The bot's document as this runner's last write left it (the document created, the lock
    /// given up on fresh seeds): the next step decides from it instead of reading it again — a
    /// read then would only be a round trip later.
    written: std::sync::Mutex<Option<bson::Document>>,
}

impl Drop for BotRunner {
    fn drop(&mut self) {
        self.ctx.hub.unregister(&self.bot.id, &self.wake);
    }
}

/// The longest a runner waits without reading its document when nothing it knows of can change
/// it: the hub's wake-ups and poll carry every change, so this only bounds a mistake.
const IDLE_CHECK: Duration = Duration::from_secs(300);

impl BotRunner {
    pub fn new(bot: BotSettings, ctx: Arc<Context>) -> Self {
        let policy = Policy {
            stuck_grace: ctx.lock.stuck_grace,
            refresh: bot.refresh,
            max_refresh: ctx.lock.max_refresh,
        };
        let crawler = match (&bot.crawl, &ctx.crawl) {
            (Some(rules), Some(crawl)) => Some(Crawler::new(bot.id.clone(), rules.clone(), crawl)),
            _ => None,
        };
        Self {
            wake: ctx.hub.register(&bot.id),
            bot,
            policy,
            ctx,
            crawler,
            spec: None,
            pass_crawler: std::sync::Mutex::new(None),
            last_pass_spec: std::sync::Mutex::new(None),
            reserved: std::sync::Mutex::new(None),
            ready_until: std::sync::Mutex::new(None),
            written: std::sync::Mutex::new(None),
        }
    }

    /// A runner for a bot defined in the database, from its stored spec.
    pub(crate) fn from_spec(bot: BotSettings, spec: BotSpec, ctx: Arc<Context>) -> Self {
        let mut runner = Self::new(bot, ctx);
        runner.spec = Some(spec);
        runner
    }

    /// One turn of the state machine, on the document as read now.
    pub async fn step(&self, shutdown: &CancellationToken) -> Result<StepOutcome> {
        self.written.lock().expect("written lock").take();
        let read = self.read_permit().await;
        self.step_reading(read, None, shutdown).await
    }

    /// A permit to read the bot's document (see [`Context::reads`]). The permits are never
    /// closed (`ok()`: a closed semaphore would only lift the limit).
    async fn read_permit(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.ctx.reads.acquire().await.ok()
    }

    /// [`step`](Self::step) with its read permit, given back once the document is read — or
    /// decided from `written`, the document as the step just before left it.
    async fn step_reading(
        &self,
        read: Option<tokio::sync::SemaphorePermit<'_>>,
        written: Option<bson::Document>,
        shutdown: &CancellationToken,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        // The permit the loop waited for serves this step's claim; any other step gives it back.
        let reserved = self.reserved.lock().expect("permit lock").take();
        let observed = match written {
            Some(raw) => Ok(crate::store::document::observe(Some(raw))),
            None => ctx.store.bots().load(id).await,
        };
        drop(read);
        let observed = observed?;
        ctx.metrics.db_ok();
        if let Observed::Valid(doc) = &observed {
            ctx.metrics.saw_epoch(id, doc.lock_epoch);
            *self.last_pass_spec.lock().expect("pass spec lock") = doc.crawl_pass_spec.clone();
        }
        if self.spec.is_some() && observed == Observed::Missing {
            info!(bot = %id, "the bot's document was removed: stopping the bot");
            return Ok(StepOutcome::Removed);
        }
        let paused = matches!(&observed, Observed::Valid(doc) if doc.paused);
        ctx.metrics.set_paused(id, paused);
        let now = ctx.clock.now();
        let me = Me {
            id: &ctx.me,
            since: ctx.started_at,
        };
        let decision = decide(&observed, now, me, &self.policy);
        let state = decision.state();
        trace!(bot = %id, rule = decision.branch().code(), state = state.as_str(), "decided");
        ctx.metrics.set_state(id, state);
        if paused {
            // No lock, no lease: the runner waits (the change stream wakes it on resume).
            debug!(bot = %id, "paused");
            return Ok(StepOutcome::Wait { until: None, state });
        }
        match decision {
            Decision::Ready { note, .. } => {
                let Observed::Valid(doc) = observed else {
                    unreachable!("Ready comes from a valid document")
                };
                Ok(self.ready(&doc, note, now))
            }
            Decision::Initialize => {
                let created = ctx.store.bots().initialize(id, &ctx.me, now).await?;
                *self.written.lock().expect("written lock") = created;
                info!(bot = %id, "created the bot document");
                Ok(StepOutcome::Initialized)
            }
            Decision::Wait { until, reason, .. } => {
                debug!(bot = %id, %reason, ?until, "waiting");
                Ok(StepOutcome::Wait { until, state })
            }
            Decision::RepairContradiction { expected } => {
                self.repair_contradiction(expected, now).await
            }
            Decision::RepairMalformed { problems } => {
                let Observed::Malformed { raw, .. } = &observed else {
                    unreachable!("RepairMalformed comes from a malformed document")
                };
                self.repair_malformed(raw, &problems, now).await
            }
            Decision::Claim {
                expected,
                claim,
                reason,
                ..
            } => {
                let request = ClaimRequest {
                    expected,
                    claim,
                    reason,
                    now,
                };
                self.claim_and_refresh(request, reserved, shutdown).await
            }
        }
    }

    /// The outcome of a step that found the bot Ready: notes when its refresh falls due (the
    /// loop sleeps until then) and reports its seeds, epoch and — for a crawling bot — its pass.
    fn ready(&self, doc: &BotDoc, note: Option<String>, now: DateTime<Utc>) -> StepOutcome {
        *self.ready_until.lock().expect("ready lock") = ready_until(doc, now, &self.policy);
        if let Some(note) = note {
            debug!(bot = %self.bot.id, %note, "using the previous seeds");
        }
        StepOutcome::Ready {
            seeds: doc.seeds.len(),
            epoch: doc.lock_epoch,
            pass: self.crawler.as_ref().map(|_| PassState::of(doc)),
        }
    }

    /// Rewrites a document that is Ready and editing at once (fenced on the epoch `expected`):
    /// `Repaired`, or `LostRace` when the document changed since it was read.
    async fn repair_contradiction(
        &self,
        expected: LockEpoch,
        now: DateTime<Utc>,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let repaired = ctx
            .store
            .bots()
            .repair_contradiction(id, expected, &ctx.me, now)
            .await?;
        if repaired {
            warn!(bot = %id, epoch = expected.get(), "repaired a contradictory document (ready and editing)");
            ctx.metrics.repaired(id, "contradictory");
        }
        Ok(repair_outcome(repaired))
    }

    /// Rewrites a malformed document (fenced on its exact content `raw`) into a sane, not-ready
    /// one: `Repaired`, or `LostRace` when the document changed since it was read.
    async fn repair_malformed(
        &self,
        raw: &bson::Document,
        problems: &[String],
        now: DateTime<Utc>,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let repaired = ctx
            .store
            .bots()
            .repair_malformed(raw, problems, &ctx.me, now)
            .await?;
        if repaired {
            warn!(bot = %id, problems = %problems.join("; "), "repaired a malformed document");
            ctx.metrics.repaired(id, "malformed");
        }
        Ok(repair_outcome(repaired))
    }

    /// Loops over [`step`](Self::step) until `until` or shutdown. Every wait ends early when the
    /// bot's document changes (the instance's hub: one change stream, one poll of every bot's
    /// digest); a waiting bot otherwise sleeps until the moment its document says something can
    /// change (±20% jitter on the poll where one applies). Database errors back off
    /// exponentially with full jitter.
    pub async fn run(&self, until: Until, shutdown: &CancellationToken) -> RunEnd {
        let poll = self.ctx.lock.poll;
        let interval = match self.bot.refresh {
            RefreshSchedule::Daily => Duration::from_secs(24 * 60 * 60),
            RefreshSchedule::Every(every) => every,
        };
        self.ctx
            .metrics
            .set_refresh_interval(&self.bot.id, interval);
        // The bot's webhook, delivered beside the loop for as long as it runs.
        let notify_stop = shutdown.child_token();
        let _notify_guard = notify_stop.clone().drop_guard();
        if let Some(notify) = self.bot.crawl.as_ref().and_then(|c| c.notify.clone()) {
            if until == Until::Shutdown {
                tokio::spawn(notify::deliver(
                    self.ctx.clone(),
                    self.bot.id.clone(),
                    notify,
                    notify_stop,
                ));
            }
        }
        let mut db_failures: u32 = 0;
        let mut failover_since: Option<Instant> = None;
        let mut waiting_since: Option<Instant> = None;
        loop {
            if shutdown.is_cancelled() {
                return RunEnd::Shutdown;
            }
            // What the last step wrote, when it moved on at once (see `written`): the step
            // decides from it without a read, so without a read permit.
            let written = self.written.lock().expect("written lock").take();
            // Each turn's future is boxed, once its read permit is held: an idle or queued bot's
            // task holds only this loop's small state (10,000 bots' tasks at 8 KB each were
            // 80 MB of an instance's memory).
            let read = match written {
                Some(_) => None,
                None => self.read_permit().await,
            };
            let outcome = match Box::pin(self.step_reading(read, written, shutdown)).await {
                Ok(StepOutcome::Ready {
                    seeds,
                    epoch,
                    pass: Some(pass),
                }) => {
                    self.waited(&mut waiting_since);
                    match Box::pin(self.crawl_turn(pass, until, shutdown)).await {
                        Ok(turn) => {
                            failover_since = None;
                            self.reachable_again(&mut db_failures);
                            if let Some(end) =
                                Box::pin(self.after_crawl_turn(turn, until, seeds, epoch, shutdown))
                                    .await
                            {
                                return end;
                            }
                            continue;
                        }
                        Err(e) => Err(e),
                    }
                }
                other => other,
            };
            if outcome.is_err() {
                // Whatever a failed step wrote last is read again after the pause.
                self.written.lock().expect("written lock").take();
            }
            let outcome = match outcome {
                Ok(outcome) => {
                    failover_since = None;
                    self.reachable_again(&mut db_failures);
                    outcome
                }
                Err(e) if self.waits_out_failover(&e, &mut failover_since) => {
                    // A step met an election: taken again once the new primary is known (or
                    // after a short pause), and the bot keeps its state meanwhile.
                    let primary = self.ctx.store.primary_changes();
                    let pause = full_jitter(poll / 4, Duration::from_secs(1), 1);
                    tokio::select! {
                        _ = primary.notified() => {}
                        _ = tokio::time::sleep(pause) => {}
                        _ = shutdown.cancelled() => return RunEnd::Shutdown,
                    }
                    continue;
                }
                Err(e) => {
                    db_failures += 1;
                    self.step_failed(&e, db_failures);
                    let delay = full_jitter(poll / 4, poll * 8, db_failures);
                    if self.pause(delay, shutdown).await {
                        return RunEnd::Shutdown;
                    }
                    continue;
                }
            };
            if let Some(end) =
                Box::pin(self.after_step(outcome, until, &mut waiting_since, shutdown)).await
            {
                return end;
            }
        }
    }

    /// Records how long the bot waited (for a permit, a lock, a backoff) once it is Ready, and
    /// notes that it no longer waits.
    fn waited(&self, waiting_since: &mut Option<Instant>) {
        if let Some(since) = waiting_since.take() {
            self.ctx.metrics.waited(&self.bot.id, since.elapsed());
        }
    }

    /// Whether a failed step is a failover's to wait out: the error is one an election gives
    /// and the first such failure in a row came less than `mongo.server_selection_timeout` ago.
    /// Past that it is a failure like any other (the bot shows Error).
    fn waits_out_failover(&self, e: &Error, since: &mut Option<Instant>) -> bool {
        // An operation that found no server for the whole window already waited it out.
        if !e.is_failover() || e.is_selection_timeout() {
            *since = None;
            return false;
        }
        let first = *since.get_or_insert_with(|| {
            debug!(bot = %self.bot.id, error = %e, "no primary: the step waits for one, the bot keeps its state");
            Instant::now()
        });
        first.elapsed() < self.ctx.store.failover_window()
    }

    /// After a step or crawl turn that reached the database: says so when the ones before
    /// failed, and starts the count of failures over.
    fn reachable_again(&self, db_failures: &mut u32) {
        if *db_failures > 0 {
            info!(bot = %self.bot.id, after = *db_failures, "database reachable again");
        }
        *db_failures = 0;
    }

    /// Counts a step (or crawl turn) that failed, the `failures`-th in a row: the bot is in
    /// Error; the first failure and every tenth are logged.
    fn step_failed(&self, e: &Error, failures: u32) {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        ctx.metrics.db_error();
        ctx.metrics.set_state(id, BotState::Error);
        if failures == 1 || failures % 10 == 0 {
            if e.is_transient() {
                warn!(bot = %id, error = %e, failures, "database unavailable; retrying");
            } else {
                error!(bot = %id, error = %e, failures, "step failed; retrying");
            }
        }
    }

    /// Carries out what a step's `outcome` leaves the loop to do (a bot without a crawl pass to
    /// take a turn on): end it, wait — for the moment the document names, a refresh permit, or a
    /// moment when another instance moved first — or step again at once. `Some` when the run
    /// ends.
    async fn after_step(
        &self,
        outcome: StepOutcome,
        until: Until,
        waiting_since: &mut Option<Instant>,
        shutdown: &CancellationToken,
    ) -> Option<RunEnd> {
        let ctx = &self.ctx;
        let poll = ctx.lock.poll;
        match outcome {
            StepOutcome::Ready { seeds, epoch, .. } | StepOutcome::Refreshed { seeds, epoch } => {
                self.waited(waiting_since);
                if matches!(outcome, StepOutcome::Ready { .. }) {
                    if until == Until::Done {
                        return Some(RunEnd::Ready { seeds, epoch });
                    }
                    if self.pause(self.idle_for(), shutdown).await {
                        return Some(RunEnd::Shutdown);
                    }
                }
            }
            StepOutcome::Wait { until: wake_at, .. } => {
                waiting_since.get_or_insert_with(Instant::now);
                if self.pause(self.wait_for(wake_at), shutdown).await {
                    return Some(RunEnd::Shutdown);
                }
            }
            StepOutcome::Busy => {
                waiting_since.get_or_insert_with(Instant::now);
                // A permit, or a change of the document (another instance refreshed it).
                let permit = tokio::select! {
                    _ = shutdown.cancelled() => return Some(RunEnd::Shutdown),
                    permit = ctx.hub.permit() => Some(permit),
                    _ = self.wake.notified() => None,
                };
                *self.reserved.lock().expect("permit lock") = permit;
            }
            StepOutcome::Initialized
            | StepOutcome::Repaired
            | StepOutcome::RefreshFailed { .. } => {}
            StepOutcome::LostRace | StepOutcome::EditLockLost => {
                // Someone else moved first: read again soon, spread out.
                if self
                    .pause(full_jitter(poll / 20, poll / 4, 1), shutdown)
                    .await
                {
                    return Some(RunEnd::Shutdown);
                }
            }
            StepOutcome::Released => return Some(RunEnd::Shutdown),
            StepOutcome::Removed => return Some(RunEnd::Removed),
        }
        None
    }

    /// How long a waiting bot sleeps unless woken: until the moment its document says the
    /// situation can change (`wake_at`), if it names one, at most [`IDLE_CHECK`] — any change
    /// before it wakes the loop.
    fn wait_for(&self, wake_at: Option<DateTime<Utc>>) -> Duration {
        match wake_at {
            Some(at) => ((at - self.ctx.clock.now()).to_std().unwrap_or_default()
                + Duration::from_millis(20))
            .min(IDLE_CHECK),
            None => jittered(IDLE_CHECK, 0.2),
        }
    }

    /// How long a Ready bot with nothing to crawl sleeps unless woken: until its refresh falls
    /// due, at most [`IDLE_CHECK`].
    fn idle_for(&self) -> Duration {
        let until = *self.ready_until.lock().expect("ready lock");
        let cap = jittered(IDLE_CHECK, 0.2);
        match until {
            Some(at) => ((at - self.ctx.clock.now()).to_std().unwrap_or_default()
                + Duration::from_millis(20))
            .min(cap),
            None => cap,
        }
    }

    /// Sleeps up to `delay`, waking early on a change of the document. True if shutdown arrived.
    async fn pause(&self, delay: Duration, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            _ = shutdown.cancelled() => true,
            _ = tokio::time::sleep(delay) => false,
            _ = self.wake.notified() => false,
        }
    }
}

/// The outcome of a repair's conditional write: `Repaired`, or `LostRace` when it matched
/// nothing (the document changed since it was read).
fn repair_outcome(repaired: bool) -> StepOutcome {
    if repaired {
        StepOutcome::Repaired
    } else {
        StepOutcome::LostRace
    }
}
