//! What one instance does once for all of its bots, so its database work grows with what changes,
//! not with the number of bots:
//!
//! - **Wake-ups.** One change stream on `bots` (not one per bot) wakes the runner of the bot an
//!   event names, and the fleet loop when a bot is added, removed, replaced or its spec changed.
//!   A holder's heartbeat (only `heartbeatAt` and `lockExpiresAt`) is filtered out on the server:
//!   it changes no decision, so it wakes nobody.
//!   Every `lock.poll` one read of every bot document's digest (without seeds, history, specs or
//!   the holder's heartbeat) wakes the runners whose document changed since the last read — the
//!   fallback for a server without change streams or an event lost while a stream reopened.
//!   A runner waits for its wake-up or for the moment its document says something can change
//!   (a lock's expiry, a refresh falling due); it does not poll its document.
//! - **Lock upkeep.** The heartbeats of every edit lock the instance holds go in one `update`
//!   command per `lock.heartbeat`, each statement fenced on its own lock (`_id`, `isEditing`,
//!   `editingBy`, `lockEpoch`); when fewer statements matched than were sent, one read tells which
//!   locks are lost. Each holder reads its lock's beats ([`Beat`]) and still races them against
//!   its lock's confirmed end.
//! - **Refresh permits.** At most `refresh.concurrency` refreshes run at once (a [`Permit`] per
//!   refresh, taken before the claim): a bot that cannot be worked now is not locked, it waits for
//!   a permit. An instance that already holds locks waits a little before each further claim, in
//!   proportion to how many it holds, so the next bots go to instances that hold fewer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::backoff::{full_jitter, jittered};
use crate::clock::ServerClock;
use crate::config::LockSettings;
use crate::ids::BotId;
use crate::store::document::CatalogueStats;
use crate::store::{EditLock, Store};

/// What a holder hears of its lock from the upkeep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Beat {
    /// Nothing yet since the lock was taken.
    Taken,
    /// Renewed: the lock holds until then (server time).
    Renewed(DateTime<Utc>),
    /// A statement fenced on this lock matched nothing: another instance (or an admin) owns it.
    Lost,
    /// The round trip failed; the lock's confirmed end stands.
    Failed(String),
}

/// A held lock's registration with the upkeep; dropping it stops the lock's heartbeats (before
/// the holder's last write).
pub(crate) struct Heartbeats {
    hub: Weak<Inner>,
    bot: BotId,
    pub beats: watch::Receiver<Beat>,
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.bot);
        }
    }
}

/// A refresh permit: held from before the claim to after the holder's last write.
pub(crate) type Permit = OwnedSemaphorePermit;

struct Held {
    lock: EditLock,
    beats: watch::Sender<Beat>,
}

struct Inner {
    store: Store,
    clock: Arc<ServerClock>,
    lock: LockSettings,
    wakes: Mutex<HashMap<BotId, Arc<Notify>>>,
    fleet: Arc<Notify>,
    held: Mutex<HashMap<BotId, Held>>,
    permits: Arc<Semaphore>,
    concurrency: usize,
    stop: CancellationToken,
    started: std::sync::Once,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Every bot's catalogue figures as the last digest read found them (for the metrics).
    catalogues: Mutex<HashMap<String, CatalogueStats>>,
}

/// The instance's hub (see the module comment). Its tasks start with the first runner that
/// registers and stop when the hub is closed or dropped.
pub struct Hub {
    inner: Arc<Inner>,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

impl Hub {
    pub fn new(
        store: Store,
        clock: Arc<ServerClock>,
        lock: LockSettings,
        refresh_concurrency: usize,
    ) -> Hub {
        let concurrency = refresh_concurrency.max(1);
        Hub {
            inner: Arc::new(Inner {
                store,
                clock,
                lock,
                wakes: Default::default(),
                fleet: Arc::new(Notify::new()),
                held: Default::default(),
                permits: Arc::new(Semaphore::new(concurrency)),
                concurrency,
                stop: CancellationToken::new(),
                started: std::sync::Once::new(),
                tasks: Default::default(),
                catalogues: Default::default(),
            }),
        }
    }

    /// Every bot's catalogue figures as the last read of the digests found them (nothing before
    /// the hub's first read).
    pub(crate) fn catalogues(&self) -> Vec<(String, CatalogueStats)> {
        let catalogues = self
            .inner
            .catalogues
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        catalogues
            .iter()
            .map(|(bot, stats)| (bot.clone(), stats.clone()))
            .collect()
    }

    fn start(&self) {
        let inner = &self.inner;
        inner.started.call_once(|| {
            let watch = tokio::spawn(watch(Arc::downgrade(inner), inner.stop.clone()));
            let poll = tokio::spawn(poll(Arc::downgrade(inner), inner.stop.clone()));
            let upkeep = tokio::spawn(upkeep(Arc::downgrade(inner), inner.stop.clone()));
            inner
                .tasks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend([watch, poll, upkeep]);
        });
    }

    /// Stops the hub's tasks and waits for them (the daemon, before it closes its client).
    pub(crate) async fn close(&self) {
        self.inner.stop.cancel();
        let tasks: Vec<_> =
            std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for task in tasks {
            let _ = task.await;
        }
    }

    /// The wake-up of bot `id`'s runner: notified when its document changes. A later registration
    /// of the same bot (a runner restarted on a new spec) replaces it.
    pub(crate) fn register(&self, id: &BotId) -> Arc<Notify> {
        self.start();
        let wake = Arc::new(Notify::new());
        self.inner
            .wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), wake.clone());
        wake
    }

    /// Ends `wake`'s registration (if it is still the bot's).
    pub(crate) fn unregister(&self, id: &BotId, wake: &Arc<Notify>) {
        let mut wakes = self.inner.wakes.lock().unwrap_or_else(|p| p.into_inner());
        if wakes.get(id).is_some_and(|w| Arc::ptr_eq(w, wake)) {
            wakes.remove(id);
        }
    }

    /// Notified when a bot is added, removed or replaced, or its spec changes (the fleet loop).
    pub(crate) fn fleet_changes(&self) -> Arc<Notify> {
        self.start();
        self.inner.fleet.clone()
    }

    /// A refresh permit if one is free now.
    pub(crate) fn try_permit(&self) -> Option<Permit> {
        self.inner.permits.clone().try_acquire_owned().ok()
    }

    /// Waits for a refresh permit.
    pub(crate) async fn permit(&self) -> Permit {
        self.inner
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the permits are never closed")
    }

    /// How long to wait before claiming another lock: nothing while this instance holds none,
    /// else up to a quarter poll in proportion to the share of its permits in use — so that
    /// instances holding fewer locks win the next claims.
    pub(crate) fn claim_delay(&self) -> Duration {
        let held = self.held_locks();
        if held == 0 {
            return Duration::ZERO;
        }
        let share = held as f64 / self.inner.concurrency as f64;
        jittered(self.inner.lock.poll.mul_f64(share.min(1.0) / 4.0), 0.5)
    }

    /// Locks this instance holds now.
    pub(crate) fn held_locks(&self) -> usize {
        self.inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Heartbeats `lock` from now on, in the instance's batched upkeep, until the returned
    /// registration is dropped.
    pub(crate) fn heartbeats(&self, lock: &EditLock) -> Heartbeats {
        self.start();
        let (tx, rx) = watch::channel(Beat::Taken);
        self.inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                lock.bot.clone(),
                Held {
                    lock: lock.clone(),
                    beats: tx,
                },
            );
        Heartbeats {
            hub: Arc::downgrade(&self.inner),
            bot: lock.bot.clone(),
            beats: rx,
        }
    }
}

impl Inner {
    fn wake(&self, id: &str) {
        let Ok(id) = BotId::parse(id) else { return };
        if let Some(wake) = self
            .wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
        {
            wake.notify_one();
        }
    }

    fn wake_all(&self) {
        for wake in self
            .wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            wake.notify_one();
        }
        self.fleet.notify_one();
    }
}

/// The change stream: each event wakes the runner of the bot it names (and the fleet loop for
/// the kinds of change that concern it); every (re)opening wakes everyone, since a change made
/// while the stream opened is in no event. Where the server has no change streams it returns,
/// and the poll carries on alone.
async fn watch(hub: Weak<Inner>, stop: CancellationToken) {
    let mut failures: u32 = 0;
    loop {
        let Some(inner) = hub.upgrade() else { return };
        let poll = inner.lock.poll;
        let opened = tokio::select! {
            _ = stop.cancelled() => return,
            s = inner.store.bots().watch_bots() => s,
        };
        match opened {
            Ok(mut stream) => {
                failures = 0;
                inner.wake_all();
                drop(inner);
                loop {
                    let event = tokio::select! {
                        _ = stop.cancelled() => return,
                        event = stream.next() => event,
                    };
                    let Some(inner) = hub.upgrade() else { return };
                    match event {
                        Some(Ok(event)) => {
                            if let Some(id) = event.id.as_deref() {
                                inner.wake(id);
                            }
                            if event.concerns_fleet {
                                inner.fleet.notify_one();
                            }
                        }
                        Some(Err(e)) => {
                            debug!(error = %e, "the bots change stream ended; reopening");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(e) if !e.is_transient() => {
                debug!(error = %e, "no change streams on this server; polling only");
                return;
            }
            Err(e) => debug!(error = %e, "cannot open the bots change stream; retrying"),
        }
        failures += 1;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(full_jitter(poll, poll * 16, failures)) => {}
        }
    }
}

/// Every `lock.poll` (±20%): one read of every bot's digest; the runners of the bots whose
/// digest changed are woken, and the fleet loop when a bot or its spec version came or went.
async fn poll(hub: Weak<Inner>, stop: CancellationToken) {
    let mut last: HashMap<String, (u64, Option<i64>)> = HashMap::new();
    let mut failures: u32 = 0;
    loop {
        let Some(inner) = hub.upgrade() else { return };
        let poll = inner.lock.poll;
        let read = tokio::select! {
            _ = stop.cancelled() => return,
            read = inner.store.bots().bot_digests() => read,
        };
        let delay = match read {
            Ok(digests) => {
                failures = 0;
                let mut fleet = digests.len() != last.len();
                let mut now: HashMap<String, (u64, Option<i64>)> =
                    HashMap::with_capacity(digests.len());
                let catalogues: HashMap<String, CatalogueStats> = digests
                    .iter()
                    .filter_map(|d| Some((d.id.clone(), d.catalogue.clone()?)))
                    .collect();
                *inner.catalogues.lock().unwrap_or_else(|p| p.into_inner()) = catalogues;
                for d in digests {
                    match last.get(&d.id) {
                        Some((digest, version)) => {
                            if *digest != d.digest {
                                inner.wake(&d.id);
                            }
                            fleet |= *version != d.spec_version;
                        }
                        None => {
                            inner.wake(&d.id);
                            fleet = true;
                        }
                    }
                    now.insert(d.id, (d.digest, d.spec_version));
                }
                if !fleet {
                    fleet = last.keys().any(|id| !now.contains_key(id));
                }
                if fleet {
                    inner.fleet.notify_one();
                }
                last = now;
                jittered(poll, 0.2)
            }
            Err(e) => {
                failures += 1;
                if failures == 1 || failures % 10 == 0 {
                    warn!(error = %e, failures, "cannot read the bots' digests; retrying");
                }
                full_jitter(poll / 4, poll * 8, failures)
            }
        };
        drop(inner);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Every `lock.heartbeat`: one fenced round trip renews every lock held; each holder hears how
/// its own lock fared.
async fn upkeep(hub: Weak<Inner>, stop: CancellationToken) {
    let Some(heartbeat) = hub.upgrade().map(|i| i.lock.heartbeat) else {
        return;
    };
    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; a lock's first renewal is due one interval after it was taken.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some(inner) = hub.upgrade() else { return };
        let held: Vec<(EditLock, watch::Sender<Beat>)> = inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|h| (h.lock.clone(), h.beats.clone()))
            .collect();
        if held.is_empty() {
            continue;
        }
        let locks: Vec<&EditLock> = held.iter().map(|(l, _)| l).collect();
        let now = inner.clock.now();
        let renewed = tokio::select! {
            _ = stop.cancelled() => return,
            r = inner.store.bots().heartbeat_all(&locks, now, inner.lock.ttl) => r,
        };
        match renewed {
            Ok((expires, alive)) => {
                for ((lock, beats), alive) in held.iter().zip(alive) {
                    let beat = if alive {
                        Beat::Renewed(expires)
                    } else {
                        Beat::Lost
                    };
                    if !alive {
                        debug!(bot = %lock.bot, epoch = lock.epoch.get(), "a heartbeat matched nothing: the lock is lost");
                    }
                    beats.send_replace(beat);
                }
            }
            Err(e) => {
                let why = e.to_string();
                for (_, beats) in &held {
                    beats.send_replace(Beat::Failed(why.clone()));
                }
            }
        }
    }
}
