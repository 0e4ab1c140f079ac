//! An instance whose config file has no `[[bots]]` runs the bots defined in the database: every
//! `bots` document with a `spec` (matching `[instance] bots`). [`follow`] keeps one runner per
//! bot in step with the documents — within one `lock.poll`, sooner when the collection's change
//! stream reports a change: a new bot starts; a removed one stops (its runner ends as at
//! shutdown: in-flight pages settle, leases go back, a held lock is released); a changed spec
//! restarts the bot's runner on it (a pass that is running ends on the spec it started with,
//! which the pass recorded); a spec that does not parse puts that bot alone into Error with
//! `lastError` naming the key, until it is fixed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bson::Document;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::backoff::jittered;

use crate::config::{bot_from_spec, BotSettings, Settings};
use crate::ids::BotId;
use crate::lock::bot::BotSpec;
use crate::lock::state::BotState;
use crate::runner::{BotRunner, Context, RunEnd, Until};
use crate::store::document::{bot_id, definition};

struct Running {
    /// The spec it runs, as its version and digest: a different one restarts it. (The runner
    /// holds the spec itself; ten thousand bots need not hold it twice.)
    spec: SpecSeen,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<RunEnd>,
}

/// A spec as [`Running`] remembers it: its `specVersion` and the SHA-256 of its BSON bytes, so a
/// spec edited by hand under the same version is told apart.
#[derive(Clone, Copy, Debug, PartialEq)]
struct SpecSeen {
    version: i64,
    digest: [u8; 32],
}

impl SpecSeen {
    fn of(spec: &BotSpec) -> Self {
        use sha2::{Digest, Sha256};
        let bytes = bson::to_vec(&spec.spec).unwrap_or_default();
        Self {
            version: spec.version,
            digest: Sha256::digest(&bytes).into(),
        }
    }
}

/// What one document with a spec asks of this instance.
enum Wanted {
    /// Keep the runner that runs exactly this spec.
    Keep,
    Run {
        spec: BotSpec,
        settings: Box<BotSettings>,
        marked_error: bool,
    },
    Bad {
        version: i64,
        error: String,
    },
    /// A spec this version cannot read, written by a newer seedlock (`specBy`): keys added
    /// since. Left to the newer instances of a rolling upgrade — not run here, not marked.
    Newer {
        version: i64,
        by: String,
        error: String,
    },
}

/// Whether version `by` (`major.minor.patch`) is newer than this build's.
fn is_newer(by: &str) -> bool {
    let parse = |v: &str| -> Option<(u64, u64, u64)> {
        let core = v.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        Some((parts.next()??, parts.next()??, parts.next()??))
    };
    match (parse(by), parse(env!("CARGO_PKG_VERSION"))) {
        (Some(by), Some(mine)) => by > mine,
        _ => false,
    }
}

/// What bot `id`'s document asks; a spec equal to the running one is not parsed again.
fn wanted(id: &BotId, raw: &Document, running: Option<&Running>) -> Option<Wanted> {
    let definition = definition(raw);
    let version = definition.version.unwrap_or(0);
    let wanted = match definition.spec? {
        Ok(spec) => {
            if running.is_some_and(|r| r.spec == SpecSeen::of(&spec) && !r.handle.is_finished()) {
                Wanted::Keep
            } else {
                match bot_from_spec(id, &spec.spec) {
                    Ok(settings) => Wanted::Run {
                        spec,
                        settings: Box::new(settings),
                        marked_error: definition.spec_error.is_some(),
                    },
                    Err(error) => match definition.spec_by.filter(|by| is_newer(by)) {
                        Some(by) => Wanted::Newer { version, by, error },
                        None => Wanted::Bad { version, error },
                    },
                }
            }
        }
        Err(error) => Wanted::Bad { version, error },
    };
    Some(wanted)
}

/// Runs the database's bots until `stop`. Returns when `stop` fires, every runner stopped.
pub(crate) async fn follow(settings: Settings, ctx: Arc<Context>, stop: CancellationToken) {
    let poll = ctx.lock.poll;
    // The hub wakes this loop when a bot is added, removed or replaced, or its spec version
    // changes; a spec edited by hand (same version) is read within `RECHECK`.
    let wake = ctx.hub.fleet_changes();
    let mut roster = Roster {
        settings: &settings,
        ctx: &ctx,
        stop: &stop,
        running: HashMap::new(),
        reported: HashMap::new(),
    };
    loop {
        match ctx.store.bots().spec_documents().await {
            Ok(docs) => {
                let round = roster.plan(&docs).await;
                // The documents (a few KB a bot) are not held while the runners start.
                drop(docs);
                roster.carry_out(round).await;
            }
            Err(e) => warn!(error = %e, "cannot read the bots' specs; retrying"),
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(jittered(RECHECK.max(poll), 0.2)) => {}
            _ = wake.notified() => {
                // A burst of changes (`bots apply` of a whole file) is read once.
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(poll / 4) => {}
                }
            }
        }
    }
    roster.stop_all().await;
}

/// The runners [`follow`] keeps for the database's bots, the spec errors it has logged (once
/// per bot and spec version), and what it needs to start and stop runners.
struct Roster<'a> {
    settings: &'a Settings,
    ctx: &'a Arc<Context>,
    /// Every runner's stop is a child of this token.
    stop: &'a CancellationToken,
    running: HashMap<BotId, Running>,
    reported: HashMap<BotId, i64>,
}

/// What one reading of the specs asks of the runners: the ones to stop, the bots whose documents
/// are gone, and the runners to start once every stop has ended.
/// A runner to start: the bot, the spec it runs, and its settings read from that spec.
struct Start {
    id: BotId,
    spec: BotSpec,
    settings: Box<BotSettings>,
}

#[derive(Default)]
struct Round {
    stopping: Vec<Running>,
    starting: Vec<Start>,
    removed: Vec<BotId>,
}

impl Roster<'_> {
    /// Reads `docs` (every `bots` document with a spec) against the running runners: which
    /// stop, which start, which bots are gone. A spec's error is cleared or recorded on the way.
    async fn plan(&mut self, docs: &[Document]) -> Round {
        let mut seen = HashSet::new();
        let mut round = Round::default();
        for raw in docs {
            let Some(id) = bot_id(raw).filter(|id| self.settings.runs(id)) else {
                continue;
            };
            let Some(want) = wanted(&id, raw, self.running.get(&id)) else {
                continue;
            };
            seen.insert(id.clone());
            match want {
                Wanted::Keep => {}
                Wanted::Run {
                    spec,
                    settings,
                    marked_error,
                } => {
                    self.plan_start(&mut round, id, spec, settings, marked_error)
                        .await;
                }
                Wanted::Bad { version, error } => {
                    self.plan_error(&mut round, id, version, &error).await;
                }
                Wanted::Newer { version, by, error } => {
                    self.plan_leave(&mut round, id, version, &by, &error);
                }
            }
        }
        self.plan_removals(&seen, &mut round);
        round
    }

    /// Plans bot `id`'s runner on `spec`: a runner on another spec stops first (the bot
    /// restarts on the new one), and an error marked on the document (`marked_error`) is cleared.
    async fn plan_start(
        &mut self,
        round: &mut Round,
        id: BotId,
        spec: BotSpec,
        settings: Box<BotSettings>,
        marked_error: bool,
    ) {
        if let Some(old) = self.running.remove(&id) {
            info!(bot = %id, from = old.spec.version, to = spec.version, "the bot's spec changed: restarting it on the new one");
            round.stopping.push(old);
        }
        if marked_error {
            if let Err(e) = self
                .ctx
                .store
                .bots()
                .clear_spec_error(&id, spec.version)
                .await
            {
                warn!(bot = %id, error = %e, "could not clear the spec error");
            }
        }
        self.reported.remove(&id);
        round.starting.push(Start { id, spec, settings });
    }

    /// Plans the stop of bot `id`, whose spec at `version` cannot be run: the bot is in Error,
    /// the `error` is logged once per version and recorded on its document.
    async fn plan_error(&mut self, round: &mut Round, id: BotId, version: i64, error: &str) {
        if let Some(old) = self.running.remove(&id) {
            round.stopping.push(old);
        }
        self.ctx.metrics.set_state(&id, BotState::Error);
        if self.reported.get(&id) != Some(&version) {
            error!(bot = %id, spec_version = version, %error, "the bot's spec cannot be run; it stays stopped until it is fixed");
            self.reported.insert(id.clone(), version);
        }
        if let Err(e) = self
            .ctx
            .store
            .bots()
            .mark_spec_error(&id, version, error)
            .await
        {
            warn!(bot = %id, error = %e, "could not record the spec error");
        }
    }

    /// Plans the stop of bot `id`'s runner, if any: its spec at `version` was written by
    /// seedlock `by`, newer than this instance, with what this version cannot read (`error`).
    /// Logged once per version; the bot is left to the newer instances, unmarked.
    fn plan_leave(&mut self, round: &mut Round, id: BotId, version: i64, by: &str, error: &str) {
        if let Some(old) = self.running.remove(&id) {
            round.stopping.push(old);
        }
        if self.reported.get(&id) != Some(&version) {
            warn!(bot = %id, spec_version = version, spec_by = by, %error, "the bot's spec was written by a newer seedlock; left to the newer instances");
            self.reported.insert(id, version);
        }
    }

    /// Plans the stop of every runner whose bot was not `seen` among the documents with a spec:
    /// its document is gone (or no longer has one).
    fn plan_removals(&mut self, seen: &HashSet<BotId>, round: &mut Round) {
        let gone: Vec<BotId> = self
            .running
            .keys()
            .filter(|id| !seen.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(old) = self.running.remove(&id) {
                info!(bot = %id, "the bot was removed from the database: stopping it");
                round.stopping.push(old);
                round.removed.push(id);
            }
        }
    }

    /// Carries out a `round`: its stops, then forgets the removed bots' metrics, then starts its
    /// runners.
    async fn carry_out(&mut self, round: Round) {
        // Every stop at once (each waits for its in-flight pages), before any runner of
        // the same bot starts again: one process never runs a bot twice.
        futures_util::future::join_all(round.stopping.into_iter().map(stop_runner)).await;
        for id in &round.removed {
            self.ctx.metrics.forget_bot(id);
        }
        for Start { id, spec, settings } in round.starting {
            self.start(id, spec, settings);
        }
    }

    /// Starts bot `id`'s runner on `spec` (read into `bot`), until the bot's stop or the fleet's.
    fn start(&mut self, id: BotId, spec: BotSpec, bot: Box<BotSettings>) {
        info!(bot = %id, spec_version = spec.version, "running the bot (defined in the database)");
        let seen = SpecSeen::of(&spec);
        let runner = BotRunner::from_spec(*bot, spec, self.ctx.clone());
        let token = self.stop.child_token();
        let run_stop = token.clone();
        let handle = tokio::spawn(async move { runner.run(Until::Shutdown, &run_stop).await });
        self.running.insert(
            id,
            Running {
                spec: seen,
                stop: token,
                handle,
            },
        );
    }

    /// Stops every runner as shutdown would, all at once, and waits for them.
    async fn stop_all(mut self) {
        futures_util::future::join_all(self.running.drain().map(|(_, old)| stop_runner(old))).await;
    }
}

/// The longest the loop goes without reading the specs when nothing woke it.
const RECHECK: Duration = Duration::from_secs(60);

/// Stops a runner as shutdown would (its work settles, its lock is released) and waits for it.
async fn stop_runner(old: Running) {
    old.stop.cancel();
    if let Err(e) = old.handle.await {
        error!(error = %e, "a bot task crashed");
    }
}
