//! One live process per instance id. The lock trusts instance ids: a lock held by this id and
//! claimed before this process started is reclaimed as an orphan of a previous run, without
//! waiting for it to expire. Two live processes sharing an id would therefore take each other's
//! live locks, so an instance registers its id (collection `instances`) before any lock work and
//! refuses to start while a live process holds it. A registration is dead — and taken over —
//! when its heartbeat expired, or when it names this host and a process that has exited (or this
//! very pid: a container restarted). A process whose registration was taken over (it looked dead:
//! stopped, or cut off from the database, for longer than `ttl`) stops on its next beat.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::clock::ServerClock;
use crate::ids::InstanceId;
use crate::store::instances::{Presence, Registration};
use crate::store::Store;

/// Whether a registration found under this process's id belongs to a live process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Dead: take it over (why, for the log).
    Dead(String),
    /// Live: refuse to start (who, for the error).
    Live(String),
}

/// Judges `theirs` for a process `mine` at server time `now`; `alive(pid)` says whether a
/// process of this host runs.
pub(crate) fn judge(
    theirs: &Presence,
    mine: &Presence,
    now: DateTime<Utc>,
    alive: impl Fn(u32) -> bool,
) -> Verdict {
    if theirs.expires_at.is_none_or(|at| at <= now) {
        return Verdict::Dead("its heartbeat stopped".into());
    }
    if theirs.host == mine.host {
        if theirs.pid == mine.pid {
            return Verdict::Dead(format!(
                "an earlier run under this pid ({}) on this host",
                theirs.pid
            ));
        }
        if !alive(theirs.pid) {
            return Verdict::Dead(format!("process {} on this host has exited", theirs.pid));
        }
    }
    let ago = theirs
        .heartbeat_at
        .map(|at| format!(", heartbeat {}s ago", (now - at).num_seconds().max(0)))
        .unwrap_or_default();
    Verdict::Live(format!(
        "host {}, pid {}{ago}",
        if theirs.host.is_empty() {
            "?"
        } else {
            &theirs.host
        },
        theirs.pid
    ))
}

/// Whether process `pid` of this host runs (a zombie does not).
pub(crate) fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses: Z (zombie) and X (dead) ran out.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        // No /proc to ask: assume it runs (the registration then dies with its heartbeat).
        Err(_) => true,
    }
}

/// Registers `me` for this process: `Err` (one line, for the operator) when a live process
/// holds the id.
pub async fn register(
    store: &Store,
    me: &InstanceId,
    clock: &ServerClock,
    ttl: Duration,
) -> Result<Presence, String> {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let mine = Presence {
        host,
        pid: std::process::id(),
        token: format!("{:032x}", rand::random::<u128>()),
        started_at: None,
        heartbeat_at: None,
        expires_at: None,
        sessions: Vec::new(),
    };
    let failed = |e: crate::error::Error| format!("cannot register instance id {me}: {e}");
    for _ in 0..10 {
        let now = clock.now();
        match store
            .instances()
            .insert(me, &mine, now, ttl)
            .await
            .map_err(failed)?
        {
            Registration::Registered => {
                return Ok(mine);
            }
            Registration::Vanished => continue,
            Registration::HeldBy(theirs) => match judge(&theirs, &mine, now, process_alive) {
                Verdict::Dead(why) => {
                    if store
                        .instances()
                        .replace(me, &theirs, &mine, now, ttl)
                        .await
                        .map_err(failed)?
                    {
                        // A transaction it was inside when it died holds what it wrote until the
                        // server ends it: end it now.
                        let ended = store.instances().end_sessions(&theirs.sessions).await;
                        info!(instance = %me, previous = %why, sessions = theirs.sessions.len(), ended, "took over this instance id from a process that is gone");
                        return Ok(mine);
                    }
                }
                Verdict::Live(who) => {
                    return Err(format!(
                        "instance id {me} is in use by a live process ({who}): give every instance \
                         its own id ([instance] id or SEEDLOCK_INSTANCE_ID; empty generates one), or \
                         stop the other process first"
                    ));
                }
            },
        }
    }
    Err(format!(
        "cannot register instance id {me}: it changed hands ten times while being read"
    ))
}

/// Renews the registration every `every` until `stop`. A registration gone from the database (a
/// restarted server that lost it, an admin's delete) is written again. One taken over by another
/// process: logs one line, sets `lost` and cancels `stop` — this instance stops. Database errors
/// are retried on the next beat (the locks have their own heartbeats and fences).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn keep_alive(
    store: Store,
    me: InstanceId,
    mine: Presence,
    clock: Arc<ServerClock>,
    every: Duration,
    ttl: Duration,
    lost: Arc<std::sync::atomic::AtomicBool>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
        let now = clock.now();
        let beat = match store
            .instances()
            .heartbeat(&me, &mine.token, now, ttl)
            .await
        {
            Ok(false) => store
                .instances()
                .insert(&me, &mine, now, ttl)
                .await
                .map(Some),
            Ok(true) => Ok(None),
            Err(e) => Err(e),
        };
        match beat {
            Ok(None | Some(Registration::Vanished)) => {}
            Ok(Some(Registration::Registered)) => {
                warn!(instance = %me, "this instance's registration was gone from the database; registered again");
            }
            Ok(Some(Registration::HeldBy(_))) => {
                error!(instance = %me, "this instance id was taken over by another process (this one looked dead for longer than ttl); stopping");
                lost.store(true, std::sync::atomic::Ordering::SeqCst);
                stop.cancel();
                return;
            }
            Err(e) => debug!(instance = %me, error = %e, "instance heartbeat failed; retrying"),
        }
        // An index drop put off for an instance of another version, done once it has stopped.
        if let Err(e) = store.finish_index_changes().await {
            warn!(instance = %me, error = %e, "could not finish an index change put off for another instance; trying again on the next beat");
        }
    }
    // A clean stop frees the id at once (bounded by the store's operation timeout).
    if let Err(e) = store.instances().remove(&me, &mine.token).await {
        debug!(instance = %me, error = %e, "could not remove the instance registration");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn presence(host: &str, pid: u32, expires_in: i64, now: DateTime<Utc>) -> Presence {
        Presence {
            host: host.into(),
            pid,
            token: "t".into(),
            started_at: Some(now - chrono::Duration::seconds(10)),
            heartbeat_at: Some(now - chrono::Duration::seconds(1)),
            expires_at: Some(now + chrono::Duration::seconds(expires_in)),
            sessions: Vec::new(),
        }
    }

    #[test]
    fn a_registration_is_dead_when_expired_or_its_process_on_this_host_is_gone() {
        let now = Utc::now();
        let mine = presence("h1", 100, 30, now);
        let all_alive = |_| true;
        let none_alive = |_| false;
        // Expired: dead wherever it ran.
        assert!(matches!(
            judge(&presence("h2", 7, -1, now), &mine, now, all_alive),
            Verdict::Dead(_)
        ));
        // Fresh on another host: live, even if a pid of that number is not running here.
        assert!(matches!(
            judge(&presence("h2", 7, 20, now), &mine, now, none_alive),
            Verdict::Live(_)
        ));
        // Fresh on this host: live while its process runs, dead once it exited.
        assert!(matches!(
            judge(&presence("h1", 7, 20, now), &mine, now, all_alive),
            Verdict::Live(_)
        ));
        assert!(matches!(
            judge(&presence("h1", 7, 20, now), &mine, now, none_alive),
            Verdict::Dead(_)
        ));
        // This very pid on this host: an earlier run (a restarted container).
        assert!(matches!(
            judge(&presence("h1", 100, 20, now), &mine, now, all_alive),
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn this_process_is_alive_and_an_unused_pid_is_not() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(u32::MAX - 1));
    }
}
