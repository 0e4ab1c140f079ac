//! Drives one bot: read the document, [`decide`], carry the decision out, repeat. [`BotRunner::step`]
//! is one turn and returns a [`StepOutcome`]; [`BotRunner::run`] loops over it with bounded,
//! jittered waits. While this instance holds the lock, [`BotRunner::step`] refreshes the seeds
//! under a heartbeat and stops all work before its last (fenced) write.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::{full_jitter, jittered};
use crate::clock::ServerClock;
use crate::config::{BotSettings, LockSettings, OnRefreshFailure};
use crate::crawl::{CrawlContext, Crawler, PassState, SliceEnd};
use crate::error::{Error, Result};
use crate::ids::{BotId, InstanceId};
use crate::ids::{LockEpoch, PassNumber};
use crate::lock::decide::{decide, ready_until, Decision, Me, Policy};
use crate::lock::hub::{Beat, Hub, Permit};
use crate::lock::seeds::{SeedError, SeedFetcher, Seeds};
use crate::metrics::Metrics;
use crate::store::document::{BotDoc, BotState, Claim, Observed};
use crate::store::{EditLock, NextPass, Store};

/// What every bot runner of one instance shares.
pub struct Context {
    pub store: Store,
    pub clock: Arc<ServerClock>,
    pub me: InstanceId,
    /// When this process started, on the server's clock (see `decide::Me`).
    pub started_at: DateTime<Utc>,
    pub lock: LockSettings,
    pub fetcher: SeedFetcher,
    pub metrics: Arc<Metrics>,
    /// Backoff for failed refreshes (`refresh.backoff_base` / `backoff_max`).
    pub refresh_backoff: (Duration, Duration),
    /// What crawling bots need (`None`: bots only keep their seeds fresh).
    pub crawl: Option<CrawlContext>,
    /// The instance's shared wake-ups, lock upkeep and refresh permits.
    pub hub: Hub,
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

/// A spec as a pass recorded it (`crawlPassSpecVersion`, `crawlPassSpec`).
type RecordedSpec = Arc<(i64, bson::Document)>;

pub struct BotRunner {
    bot: BotSettings,
    policy: Policy,
    ctx: Arc<Context>,
    wake: Arc<Notify>,
    crawler: Option<Arc<Crawler>>,
    /// For a bot defined in the database: its spec (`specVersion`, `spec`). A pass started here
    /// records it; the bot's document going away stops this runner (nothing re-creates it).
    spec: Option<(i64, bson::Document)>,
    /// The crawler of a pass that started on another spec version than this runner's.
    pass_crawler: std::sync::Mutex<Option<(RecordedSpec, Arc<Crawler>)>>,
    /// The spec the bot's current (or last) pass recorded, as last read.
    last_pass_spec: std::sync::Mutex<Option<RecordedSpec>>,
    /// A refresh permit the loop waited for, for the next step's claim.
    reserved: std::sync::Mutex<Option<Permit>>,
    /// While the bot is Ready: when its document says a refresh falls due (or its backoff
    /// ends), as last read — until then the loop waits for a wake-up only.
    ready_until: std::sync::Mutex<Option<DateTime<Utc>>>,
}

impl Drop for BotRunner {
    fn drop(&mut self) {
        self.ctx.hub.unregister(&self.bot.id, &self.wake);
    }
}

/// The longest a runner waits without reading its document when nothing it knows of can change
/// it: the hub's wake-ups and poll carry every change, so this only bounds a mistake.
const IDLE_CHECK: Duration = Duration::from_secs(300);

/// Which pass a crawl turn starts.
#[derive(Clone, Copy)]
enum Starting {
    /// The bot's first.
    First,
    /// The next, after a pass that is over.
    Next,
}

/// How one crawl turn of a ready bot ended.
enum CrawlTurn {
    /// This instance started the bot's first pass (or lost that race): read the document again.
    Started,
    /// The pass is over (now or before).
    Finished,
    /// Nothing to lease here right now; others hold the rest of the pass.
    Idle,
    /// The slice ran out; read the document again (a refresh may be due).
    TimeUp,
    Shutdown,
}

/// How a refresh under the lock ended, before its last write.
enum End {
    Fetched(std::result::Result<Seeds, SeedError>),
    Abandoned,
    Lost,
    Shutdown,
}

/// Seeds may take at most this much of the 16 MiB document (the rest is history and fields).
pub const MAX_SEED_BYTES: usize = 8 * 1024 * 1024;

/// The holder's last write.
enum Finish {
    Complete(Vec<String>),
    Fail(String),
    Release,
}

/// The claim a step's decision asks for: the epoch it is fenced on, how the lock is taken, why,
/// and when the document was read.
struct ClaimRequest {
    expected: LockEpoch,
    claim: Claim,
    reason: String,
    now: DateTime<Utc>,
}

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
        }
    }

    /// A runner for a bot defined in the database, from its spec at `version`.
    pub fn from_spec(
        bot: BotSettings,
        version: i64,
        spec: bson::Document,
        ctx: Arc<Context>,
    ) -> Self {
        let mut runner = Self::new(bot, ctx);
        runner.spec = Some((version, spec));
        runner
    }

    /// What a pass started by this runner records of the spec it runs on — and, when the pass
    /// before ran on another spec, that this one fetches every page anew (an unchanged page
    /// answering 304, or an item whose listing did not change, would keep what the old rules
    /// extracted).
    fn pass_fields(&self) -> bson::Document {
        use crate::store::document::field;
        match &self.spec {
            Some((version, spec)) => {
                let before = self.last_pass_spec.lock().expect("pass spec lock");
                let changed = before
                    .as_ref()
                    .is_some_and(|b| b.0 != *version || b.1 != *spec);
                bson::doc! {
                    field::CRAWL_PASS_SPEC_VERSION: *version,
                    field::CRAWL_PASS_SPEC: spec.clone(),
                    field::CRAWL_PASS_REFETCH: changed,
                }
            }
            // A bot from a config file: no spec, and nothing left of an earlier pass's.
            None => bson::doc! {
                field::CRAWL_PASS_SPEC_VERSION: bson::Bson::Null,
                field::CRAWL_PASS_SPEC: bson::Bson::Null,
                field::CRAWL_PASS_REFETCH: false,
            },
        }
    }

    /// The crawler for `pass`: this runner's, or — when the pass started on another spec
    /// version — one built from the spec the pass recorded, so it ends on the rules it began with.
    fn crawler_for(&self, pass: &crate::crawl::Pass) -> Option<Arc<Crawler>> {
        let mine = self.crawler.clone()?;
        let (Some(_), Some(recorded)) = (&self.spec, &pass.spec) else {
            return Some(mine);
        };
        let (version, spec) = &**recorded;
        if self.spec.as_ref() == Some(&**recorded) {
            return Some(mine);
        }
        let mut cached = self.pass_crawler.lock().expect("pass crawler lock");
        if let Some((cached_spec, crawler)) = cached.as_ref() {
            if Arc::ptr_eq(cached_spec, recorded) || **cached_spec == **recorded {
                return Some(crawler.clone());
            }
        }
        let rules = crate::config::bot_from_spec(&self.bot.id, spec)
            .ok()
            .and_then(|b| b.crawl);
        match (rules, &self.ctx.crawl) {
            (Some(rules), Some(crawl)) => {
                info!(bot = %self.bot.id, pass = pass.number.get(), spec_version = *version, "this pass started on an earlier spec: crawling it on that one");
                let crawler = Crawler::new(self.bot.id.clone(), rules, crawl);
                *cached = Some((recorded.clone(), crawler.clone()));
                Some(crawler)
            }
            _ => Some(mine),
        }
    }

    pub fn id(&self) -> &BotId {
        &self.bot.id
    }

    /// One turn of the state machine.
    pub async fn step(&self, shutdown: &CancellationToken) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        // The permit the loop waited for serves this step's claim; any other step gives it back.
        let reserved = self.reserved.lock().expect("permit lock").take();
        let observed = ctx.store.bots().load(id).await?;
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
                ctx.store.bots().initialize(id, &ctx.me, now).await?;
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

    /// Takes a refresh permit (the one the loop `reserved`, or a free one), claims the edit lock
    /// and refreshes under it; the permit is given back after the refresh's last write. `Busy`
    /// when no permit is free, `LostRace` when another instance claimed first (or shutdown
    /// arrived while this instance left others a moment to claim).
    async fn claim_and_refresh(
        &self,
        request: ClaimRequest,
        reserved: Option<Permit>,
        shutdown: &CancellationToken,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let ClaimRequest {
            expected,
            claim,
            reason,
            now,
        } = request;
        // A permit first: a bot this instance cannot refresh now is not locked.
        let Some(permit) = reserved.or_else(|| ctx.hub.try_permit()) else {
            debug!(bot = %id, "every refresh permit is in use; waiting for one");
            return Ok(StepOutcome::Busy);
        };
        // An instance that holds locks leaves a moment for those that hold fewer.
        let delay = ctx.hub.claim_delay();
        if !delay.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(StepOutcome::LostRace),
                _ = tokio::time::sleep(delay) => {}
            }
        }
        let now = if delay.is_zero() {
            now
        } else {
            ctx.clock.now()
        };
        let held = ctx
            .store
            .bots()
            .claim(id, &ctx.me, expected, claim, now, ctx.lock.ttl, &reason)
            .await?;
        let Some(held) = held else {
            debug!(bot = %id, epoch = expected.get(), "another instance claimed the lock first");
            return Ok(StepOutcome::LostRace);
        };
        let takeover = takeover_kind(claim);
        ctx.metrics.acquired(id, takeover);
        ctx.metrics.saw_epoch(id, held.epoch);
        info!(bot = %id, epoch = held.epoch.get(), %reason, takeover = takeover.unwrap_or("no"), "won the edit lock");
        let outcome = self.refresh(held, shutdown).await;
        drop(permit);
        outcome
    }

    /// Refreshes under `held`: fetch the seeds while heartbeating; stop the work when the lock is
    /// lost, `max_refresh` passes or shutdown arrives; then make exactly one fenced last write.
    async fn refresh(&self, held: EditLock, shutdown: &CancellationToken) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let timer = Instant::now();
        let max_refresh =
            chrono::Duration::from_std(ctx.lock.max_refresh).unwrap_or(chrono::Duration::MAX);
        let deadline = held.started_at + max_refresh;
        let mut confirmed_until =
            ctx.clock.now() + chrono::Duration::from_std(ctx.lock.ttl).unwrap_or_default();
        let work = CancellationToken::new();
        let end = {
            let fetch = ctx.fetcher.fetch(&self.bot.seeds, &work);
            tokio::pin!(fetch);
            // Renewed with every other lock this instance holds, one round trip a tick.
            let mut heartbeats = ctx.hub.heartbeats(&held);
            // The holder gives up at `max_refresh` exactly (others wait out a grace on top), so
            // its failure and backoff land before anyone may take the lock over as stuck.
            let give_up = Instant::now()
                + (deadline - ctx.clock.now())
                    .to_std()
                    .unwrap_or(Duration::ZERO);
            loop {
                // Raced against the lock's confirmed end: a database that swallows the
                // heartbeats (a partition) must not keep this holder refreshing past it.
                let runs_out = Instant::now()
                    + (confirmed_until - ctx.clock.now())
                        .to_std()
                        .unwrap_or(Duration::ZERO);
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break End::Shutdown,
                    result = &mut fetch => {
                        break End::Fetched(result)
                    }
                    _ = tokio::time::sleep_until(give_up) => break End::Abandoned,
                    _ = tokio::time::sleep_until(runs_out) => break End::Lost,
                    changed = heartbeats.beats.changed() => {
                        if changed.is_err() {
                            break End::Lost;
                        }
                        let beat = heartbeats.beats.borrow_and_update().clone();
                        match beat {
                            Beat::Taken => {}
                            Beat::Renewed(expires) => {
                                ctx.metrics.db_ok();
                                confirmed_until = expires;
                            }
                            Beat::Lost => break End::Lost,
                            Beat::Failed(error) => {
                                ctx.metrics.db_error();
                                warn!(bot = %id, epoch = held.epoch.get(), %error, "heartbeat failed");
                            }
                        }
                    }
                }
            }
            // `fetch` is dropped here: the HTTP request (and any retry sleep) stops before any
            // last write is attempted — and so are the heartbeats.
        };
        work.cancel();
        let finish = match end {
            End::Fetched(Ok(seeds)) => self.checked_seeds(seeds),
            End::Fetched(Err(SeedError::Cancelled)) | End::Shutdown => Finish::Release,
            End::Fetched(Err(e)) => Finish::Fail(format!("refresh failed: {e}")),
            End::Abandoned => Finish::Fail(format!(
                "refresh abandoned: it ran longer than max_refresh ({})",
                humantime::format_duration(ctx.lock.max_refresh)
            )),
            End::Lost => {
                return Ok(self.lost(
                    &held,
                    timer,
                    "a heartbeat matched nothing or could not be confirmed",
                ));
            }
        };
        self.finish(held, finish, confirmed_until, timer).await
    }

    /// Turns fetched seeds into the last write: the new list, or a failure when it cannot fit in
    /// one document.
    fn checked_seeds(&self, seeds: Seeds) -> Finish {
        let id = &self.bot.id;
        if seeds.truncated {
            warn!(bot = %id, kept = seeds.urls.len(), "the seed source has more URLs than refresh.max_seeds; the rest were dropped");
        }
        if seeds.rejected > 0 {
            info!(bot = %id, rejected = seeds.rejected, "seed entries rejected (not http(s) URLs)");
        }
        let list: Vec<String> = seeds
            .urls
            .into_iter()
            .map(|u| u.as_str().to_owned())
            .collect();
        // Each array element costs its bytes plus about 16 bytes of BSON framing.
        let bytes: usize = list.iter().map(|s| s.len() + 16).sum();
        if bytes > MAX_SEED_BYTES {
            return Finish::Fail(format!(
                "refresh failed: {} seeds take {bytes} bytes, over the {MAX_SEED_BYTES}-byte share of one document; lower refresh.max_seeds",
                list.len()
            ));
        }
        Finish::Complete(list)
    }

    fn lost(&self, held: &EditLock, timer: Instant, why: &str) -> StepOutcome {
        let id = &self.bot.id;
        warn!(bot = %id, epoch = held.epoch.get(), %why, "edit lock lost; stopped without writing");
        self.ctx.metrics.edit_lock_lost(id);
        self.ctx
            .metrics
            .refresh_finished(id, "lost", timer.elapsed());
        StepOutcome::EditLockLost
    }

    /// The holder's one last write, retried on transient errors while the lock is still ours.
    async fn finish(
        &self,
        held: EditLock,
        mut finish: Finish,
        confirmed_until: DateTime<Utc>,
        timer: Instant,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let mut attempt = 0;
        // A crawling bot's refresh starts its next pass: seeds enqueued first, then the same
        // fenced write that stores them records the pass.
        let mut new_pass = None;
        loop {
            let now = ctx.clock.now();
            // Each attempt races the lock's confirmed end: past it, another instance may hold
            // the lock, and a write still unanswered then (a partition) may land late — the
            // fence rejects it, and this holder has stopped.
            let runs_out =
                Instant::now() + (confirmed_until - now).to_std().unwrap_or(Duration::ZERO);
            let attempt_result = tokio::time::timeout_at(
                runs_out,
                self.last_write(&held, &finish, now, &mut new_pass),
            )
            .await;
            let Ok(result) = attempt_result else {
                return Ok(self.lost(
                    &held,
                    timer,
                    "the last write was not answered before the lock ran out",
                ));
            };
            match result {
                Ok(()) => break,
                Err(Error::EditLockLost { .. }) => {
                    return Ok(self.lost(&held, timer, "the last write matched nothing"))
                }
                // The server refused the new seeds for good (a document too large, say): record
                // that as the refresh's failure rather than leave the lock to expire.
                Err(e) if !e.is_transient() && matches!(finish, Finish::Complete(_)) => {
                    finish = Finish::Fail(format!(
                        "refresh failed: the seeds could not be stored: {e}"
                    ));
                }
                Err(e) if e.is_transient() && ctx.clock.now() < confirmed_until => {
                    ctx.metrics.db_error();
                    attempt += 1;
                    warn!(bot = %id, epoch = held.epoch.get(), error = %e, attempt, "last write failed; retrying");
                    tokio::time::sleep(full_jitter(
                        Duration::from_millis(100),
                        ctx.lock.heartbeat,
                        attempt,
                    ))
                    .await;
                }
                Err(e) => return Err(e),
            }
        }
        ctx.metrics.db_ok();
        Ok(self.finished(held.epoch, finish, new_pass, timer))
    }

    /// One attempt at the holder's last write, at `now`: the new seeds (with the next pass of a
    /// crawling bot), the failure and when to try again, or the lock's release at shutdown.
    async fn last_write(
        &self,
        held: &EditLock,
        finish: &Finish,
        now: DateTime<Utc>,
        new_pass: &mut Option<PassNumber>,
    ) -> Result<()> {
        match finish {
            Finish::Complete(seeds) => self.write_complete(held, seeds, now, new_pass).await,
            Finish::Fail(error) => self.write_failure(held, error, now).await,
            Finish::Release => {
                self.ctx
                    .store
                    .bots()
                    .release(held, now, "shutdown: work stopped, lock released")
                    .await
            }
        }
    }

    /// The last write of a successful refresh: stores `seeds` and marks the bot ready. For a
    /// crawling bot it also starts the next pass — its seeds enqueued first, once: the pass's
    /// number is kept in `new_pass` for a retry — or, while a young pass runs, marks the next one
    /// to start when that pass ends.
    async fn write_complete(
        &self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        new_pass: &mut Option<PassNumber>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        let young = self.pass_is_young(held, now);
        let next = match (&self.crawler, *new_pass) {
            (None, _) => Ok(NextPass::None),
            (Some(_), _) if young => Ok(NextPass::AfterCurrent),
            (Some(_), Some(pass)) => Ok(NextPass::Start(pass)),
            (Some(crawler), None) => ctx
                .store
                .passes()
                .prepare(
                    &self.bot.id,
                    held.crawl_pass,
                    &crawler.seed_urls(seeds),
                    now,
                )
                .await
                .map(NextPass::Start),
        };
        match next {
            Ok(next) => {
                if let NextPass::Start(pass) = next {
                    *new_pass = Some(pass);
                }
                ctx.store
                    .bots()
                    .complete_with(held, seeds, now, next, self.pass_fields())
                    .await
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the pass that ran when the lock was taken is, at `now`, younger than
    /// `crawl.max_pass`: a refresh lets such a pass go on to its end (the next one starts then,
    /// on the new seeds); an older one is cut short.
    fn pass_is_young(&self, held: &EditLock, now: DateTime<Utc>) -> bool {
        let max_pass = self
            .ctx
            .crawl
            .as_ref()
            .map_or(Duration::MAX, |c| c.limits.max_pass);
        held.crawl_pass_running_since
            .is_some_and(|since| (now - since).to_std().unwrap_or_default() < max_pass)
    }

    /// The last write of a failed refresh: records `error` and when to try again (the refresh
    /// backoff, grown with the failures before this one); the bot stays Ready on its previous
    /// seeds when `on_refresh_failure` keeps them and there are any.
    async fn write_failure(&self, held: &EditLock, error: &str, now: DateTime<Utc>) -> Result<()> {
        let ctx = &self.ctx;
        let (base, cap) = ctx.refresh_backoff;
        let exponent = u32::try_from(held.failed_refreshes.clamp(0, 20)).unwrap_or(20);
        let backoff = jittered(base.saturating_mul(1 << exponent).min(cap), 0.2);
        let retry_after = now + chrono::Duration::from_std(backoff).unwrap_or_default();
        let stay_ready = self.bot.on_refresh_failure == OnRefreshFailure::KeepPrevious
            && !held.previous_seeds.is_empty();
        ctx.store
            .bots()
            .fail(held, now, error, retry_after, stay_ready)
            .await
    }

    /// The outcome of a refresh whose last write (`finish`) landed at `epoch`, logged and counted.
    fn finished(
        &self,
        epoch: LockEpoch,
        finish: Finish,
        new_pass: Option<PassNumber>,
        timer: Instant,
    ) -> StepOutcome {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        match finish {
            Finish::Complete(seeds) => {
                info!(bot = %id, epoch = epoch.get(), seeds = seeds.len(), pass = new_pass.map(PassNumber::get), "seeds refreshed; bot is ready");
                ctx.metrics.refresh_finished(id, "ok", timer.elapsed());
                StepOutcome::Refreshed {
                    seeds: seeds.len(),
                    epoch,
                }
            }
            Finish::Fail(error) => {
                warn!(bot = %id, epoch = epoch.get(), %error, "refresh failed; recorded and released");
                ctx.metrics.refresh_finished(id, "failed", timer.elapsed());
                StepOutcome::RefreshFailed { error }
            }
            Finish::Release => {
                info!(bot = %id, epoch = epoch.get(), "shutdown mid-refresh: work stopped, lock released");
                ctx.metrics
                    .refresh_finished(id, "released", timer.elapsed());
                StepOutcome::Released
            }
        }
    }

    /// Loops over [`step`](Self::step) until `until` or shutdown. Every wait ends early when the
    /// bot's document changes (the instance's hub: one change stream, one poll of every bot's
    /// digest); a waiting bot otherwise sleeps until the moment its document says something can
    /// change (±20% jitter on the poll where one applies). Database errors back off
    /// exponentially with full jitter.
    pub async fn run(&self, until: Until, shutdown: &CancellationToken) -> RunEnd {
        let poll = self.ctx.lock.poll;
        let mut db_failures: u32 = 0;
        let mut waiting_since: Option<Instant> = None;
        loop {
            if shutdown.is_cancelled() {
                return RunEnd::Shutdown;
            }
            let outcome = match self.step(shutdown).await {
                Ok(StepOutcome::Ready {
                    seeds,
                    epoch,
                    pass: Some(pass),
                }) => {
                    self.waited(&mut waiting_since);
                    match self.crawl_turn(pass, until, shutdown).await {
                        Ok(turn) => {
                            self.reachable_again(&mut db_failures);
                            if let Some(end) = self
                                .after_crawl_turn(turn, until, seeds, epoch, shutdown)
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
            let outcome = match outcome {
                Ok(outcome) => {
                    self.reachable_again(&mut db_failures);
                    outcome
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
            if let Some(end) = self
                .after_step(outcome, until, &mut waiting_since, shutdown)
                .await
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

    /// Carries out what a crawl turn of a Ready bot (on `seeds` seeds at `epoch`) leaves the loop
    /// to do: end it (the pass finished for `run --once`, or shutdown), or pause as the turn asks
    /// before the next step. `Some` when the run ends.
    async fn after_crawl_turn(
        &self,
        turn: CrawlTurn,
        until: Until,
        seeds: usize,
        epoch: LockEpoch,
        shutdown: &CancellationToken,
    ) -> Option<RunEnd> {
        let pause = match turn {
            CrawlTurn::Finished if until == Until::Done => {
                return Some(RunEnd::Ready { seeds, epoch });
            }
            CrawlTurn::Shutdown => return Some(RunEnd::Shutdown),
            CrawlTurn::Started | CrawlTurn::TimeUp => None,
            // Others hold the rest of the pass: look again soon.
            CrawlTurn::Idle => Some(jittered(self.ctx.lock.poll / 4, 0.2)),
            // Nothing to do until the document changes or a refresh is due.
            CrawlTurn::Finished => Some(self.idle_for()),
        };
        if let Some(delay) = pause {
            if self.pause(delay, shutdown).await {
                return Some(RunEnd::Shutdown);
            }
        }
        None
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

    /// One crawl turn of a ready bot: start its first pass, or crawl its current pass for a
    /// slice (bounded, so a due refresh is noticed), or see it finished.
    async fn crawl_turn(
        &self,
        pass: PassState,
        until: Until,
        shutdown: &CancellationToken,
    ) -> Result<CrawlTurn> {
        let Some(crawler) = &self.crawler else {
            return Ok(CrawlTurn::Finished);
        };
        let ctx = &self.ctx;
        match pass {
            // A refresh came while the pass ran: the next pass starts now that it is over (not
            // for `run --once`, whose pass is the one that just finished).
            PassState::Finished {
                number,
                next: Some(seeds),
                ..
            } if until == Until::Shutdown => {
                self.start_pass(crawler, Starting::Next, number, &seeds)
                    .await?;
                Ok(CrawlTurn::Started)
            }
            PassState::Finished {
                number,
                evaluation_claimed_until: Some(claimed_until),
                ..
            } if claimed_until <= ctx.clock.now() => {
                // The instance that ended the pass stopped before its evaluation did.
                self.resume_evaluation(crawler, number, claimed_until)
                    .await?;
                Ok(CrawlTurn::Finished)
            }
            PassState::Finished { .. } => Ok(CrawlTurn::Finished),
            PassState::NotStarted { seeds, current } => {
                self.start_pass(crawler, Starting::First, current, &seeds)
                    .await?;
                Ok(CrawlTurn::Started)
            }
            PassState::Running(pass) => {
                let crawler = self.crawler_for(&pass).unwrap_or_else(|| crawler.clone());
                self.crawl_slice(&crawler, &pass, shutdown).await
            }
        }
    }

    /// Starts a pass on the stored `seeds` unless another instance started it first: the bot's
    /// first (`after`: its pass number, 0 when it has none yet), or the next after `after`,
    /// which is over, on the seeds a refresh stored while it ran.
    async fn start_pass(
        &self,
        crawler: &Crawler,
        which: Starting,
        after: PassNumber,
        seeds: &[String],
    ) -> Result<()> {
        let ctx = &self.ctx;
        let seeds = crawler.seed_urls(seeds);
        let (bot, passes) = (crawler.bot(), ctx.store.passes());
        let (now, fields) = (ctx.clock.now(), self.pass_fields());
        let started = match which {
            Starting::First => passes.start(bot, after, &seeds, now, fields).await?,
            Starting::Next => passes.start_next(bot, after, &seeds, now, fields).await?,
        };
        match (started, which) {
            (None, _) => {}
            (Some(pass), Starting::First) => {
                info!(%bot, pass = pass.get(), seeds = seeds.len(), "started the first crawl pass");
            }
            (Some(pass), Starting::Next) => {
                info!(%bot, pass = pass.get(), seeds = seeds.len(), "the pass is over; started the next, on the latest seeds");
            }
        }
        Ok(())
    }

    /// Takes over the deletion evaluation of pass `number`, whose claim ran out at
    /// `claimed_until`: the instance that ended the pass stopped before its evaluation did.
    async fn resume_evaluation(
        &self,
        crawler: &Crawler,
        number: PassNumber,
        claimed_until: DateTime<Utc>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        ctx.store
            .passes()
            .resume_evaluation(
                crawler.bot(),
                number,
                claimed_until,
                &ctx.me,
                ctx.clock.now(),
            )
            .await?;
        Ok(())
    }

    /// Crawls the running `pass` for one slice of 10 × `poll` (5–60 s), ended early by
    /// shutdown, or — as shutdown would, without ending the runner — by the bot's pause or
    /// removal.
    async fn crawl_slice(
        &self,
        crawler: &Arc<Crawler>,
        pass: &crate::crawl::Pass,
        shutdown: &CancellationToken,
    ) -> Result<CrawlTurn> {
        let ctx = &self.ctx;
        ctx.metrics.crawling(crawler.bot(), pass.number);
        let slice = (ctx.lock.poll * 10).clamp(Duration::from_secs(5), Duration::from_secs(60));
        // A pause (or the bot's removal) ends the slice as shutdown would — in-flight
        // pages settle and commit, unfetched leases go back — without ending the runner.
        let stop_slice = shutdown.child_token();
        let watch = tokio::spawn(watch_for_pause(
            ctx.store.clone(),
            self.bot.id.clone(),
            ctx.lock.poll,
            stop_slice.clone(),
        ));
        let end = crawler.crawl_for(pass, slice, &stop_slice).await;
        watch.abort();
        Ok(match end? {
            SliceEnd::Finished(_) => CrawlTurn::Finished,
            SliceEnd::Idle => CrawlTurn::Idle,
            SliceEnd::TimeUp => CrawlTurn::TimeUp,
            SliceEnd::Shutdown if shutdown.is_cancelled() => CrawlTurn::Shutdown,
            SliceEnd::Shutdown => CrawlTurn::TimeUp,
        })
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

/// What taking the lock by `claim` is called in the metrics and the log: `None` for a free
/// lock, else the kind of takeover.
fn takeover_kind(claim: Claim) -> Option<&'static str> {
    match claim {
        Claim::Free => None,
        Claim::Expired { .. } => Some("expired"),
        Claim::Stuck { .. } => Some("stuck"),
        Claim::Orphaned => Some("orphaned"),
    }
}

/// Cancels `stop` once the bot is paused or its document is gone (its flag read every `poll`).
async fn watch_for_pause(store: Store, bot: BotId, poll: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
        // Only the flag: the document's seeds and history are not read every poll of a slice.
        match store.bots().paused(&bot).await {
            Ok(Some(true)) => {
                info!(%bot, "paused: the in-flight pages settle, nothing more is leased");
                stop.cancel();
                return;
            }
            Ok(None) => {
                stop.cancel();
                return;
            }
            _ => {}
        }
    }
}
