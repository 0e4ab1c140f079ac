//! An instance whose config file has no `[[bots]]` runs the bots defined in the database: every
//! `bots` document with a `spec` (matching `[instance] bots`). [`follow`] keeps one runner per
//! bot in step with the documents — within one `lock.poll`, sooner when the collection's change
//! stream reports a change: a new bot starts; a removed one stops (its runner ends as at
//! shutdown: in-flight pages settle, leases go back, a held lock is released); a changed spec
//! restarts the bot's runner on it (a pass that is running ends on the spec it started with,
//! which the pass recorded); a spec that does not parse puts that bot alone into Error with
//! `lastError` naming the key, until it is fixed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, Document};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::backoff::jittered;

use crate::config::{bot_from_spec, Settings};
use crate::ids::BotId;
use crate::lock::coordinator::{BotRunner, Context, RunEnd, Until};
use crate::store::document::{field, integer, BotState};

struct Running {
    /// The spec it runs (`specVersion`, `spec`): a different one restarts it.
    spec: (i64, Document),
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<RunEnd>,
}

/// What one document with a spec asks of this instance.
enum Wanted {
    /// Keep the runner that runs exactly this spec.
    Keep,
    Run {
        spec: (i64, Document),
        settings: Box<crate::config::BotSettings>,
        marked_error: bool,
    },
    Bad {
        version: i64,
        error: String,
    },
}

/// The bot a document with a spec defines, when its `_id` is a valid bot id.
pub(crate) fn spec_bot(raw: &Document) -> Option<BotId> {
    BotId::parse(raw.get_str(field::ID).ok()?).ok()
}

/// What bot `id`'s document asks; a spec equal to the running one is not parsed again.
fn wanted(id: &BotId, raw: &Document, running: Option<&Running>) -> Option<Wanted> {
    let version = raw.get(field::SPEC_VERSION).and_then(integer).unwrap_or(0);
    let wanted = match raw.get(field::SPEC) {
        Some(Bson::Document(spec)) => {
            if running.is_some_and(|r| {
                r.spec.0 == version && r.spec.1 == *spec && !r.handle.is_finished()
            }) {
                Wanted::Keep
            } else {
                match bot_from_spec(id, spec) {
                    Ok(settings) => Wanted::Run {
                        spec: (version, spec.clone()),
                        settings: Box::new(settings),
                        marked_error: matches!(raw.get(field::SPEC_ERROR), Some(Bson::String(_))),
                    },
                    Err(error) => Wanted::Bad { version, error },
                }
            }
        }
        Some(other) => Wanted::Bad {
            version,
            error: format!(
                "key `spec`: must be a document, found {:?}",
                other.element_type()
            ),
        },
        None => return None,
    };
    Some(wanted)
}

/// Runs the database's bots until `stop`. Returns when `stop` fires, every runner stopped.
pub async fn follow(settings: Settings, ctx: Arc<Context>, stop: CancellationToken) {
    let poll = ctx.lock.poll;
    // The hub wakes this loop when a bot is added, removed or replaced, or its spec version
    // changes; a spec edited by hand (same version) is read within `RECHECK`.
    let wake = ctx.hub.fleet_changes();
    let mut running: HashMap<BotId, Running> = HashMap::new();
    let mut reported: HashMap<BotId, i64> = HashMap::new();
    loop {
        match ctx.store.bots().spec_documents().await {
            Ok(docs) => {
                let mut seen = std::collections::HashSet::new();
                let mut stopping = Vec::new();
                let mut starting = Vec::new();
                let mut removed = Vec::new();
                for raw in &docs {
                    let Some(id) = spec_bot(raw).filter(|id| settings.runs(id)) else {
                        continue;
                    };
                    let Some(want) = wanted(&id, raw, running.get(&id)) else {
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
                            if let Some(old) = running.remove(&id) {
                                info!(bot = %id, from = old.spec.0, to = spec.0, "the bot's spec changed: restarting it on the new one");
                                stopping.push(old);
                            }
                            if marked_error {
                                if let Err(e) = ctx.store.bots().clear_spec_error(&id, spec.0).await
                                {
                                    warn!(bot = %id, error = %e, "could not clear the spec error");
                                }
                            }
                            reported.remove(&id);
                            starting.push((id, spec, settings));
                        }
                        Wanted::Bad { version, error } => {
                            if let Some(old) = running.remove(&id) {
                                stopping.push(old);
                            }
                            ctx.metrics.set_state(&id, BotState::Error);
                            if reported.get(&id) != Some(&version) {
                                error!(bot = %id, spec_version = version, %error, "the bot's spec cannot be run; it stays stopped until it is fixed");
                                reported.insert(id.clone(), version);
                            }
                            if let Err(e) =
                                ctx.store.bots().mark_spec_error(&id, version, &error).await
                            {
                                warn!(bot = %id, error = %e, "could not record the spec error");
                            }
                        }
                    }
                }
                let gone: Vec<BotId> = running
                    .keys()
                    .filter(|id| !seen.contains(*id))
                    .cloned()
                    .collect();
                for id in gone {
                    if let Some(old) = running.remove(&id) {
                        info!(bot = %id, "the bot was removed from the database: stopping it");
                        stopping.push(old);
                        removed.push(id);
                    }
                }
                // Every stop at once (each waits for its in-flight pages), before any runner of
                // the same bot starts again: one process never runs a bot twice.
                futures_util::future::join_all(stopping.into_iter().map(stop_runner)).await;
                for id in &removed {
                    ctx.metrics.forget_bot(id);
                }
                for (id, spec, bot) in starting {
                    info!(bot = %id, spec_version = spec.0, "running the bot (defined in the database)");
                    let runner = BotRunner::from_spec(*bot, spec.0, spec.1.clone(), ctx.clone());
                    let token = stop.child_token();
                    let run_stop = token.clone();
                    let handle =
                        tokio::spawn(async move { runner.run(Until::Shutdown, &run_stop).await });
                    running.insert(
                        id,
                        Running {
                            spec,
                            stop: token,
                            handle,
                        },
                    );
                }
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
    futures_util::future::join_all(running.drain().map(|(_, old)| stop_runner(old))).await;
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
