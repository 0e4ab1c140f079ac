//! The dispatch stage: leased URLs wait in per-host queues, in the order they came, until
//! their host's limiter admits them ([`Flow::try_admit`], with the host's fair share of the
//! fetch slots) and a fetch slot and an uncommitted-page permit are free; [`Dispatcher::step`]
//! hands them to the fetch stage (`crawl::fetch`).
//!
//! [`HostQueues`] is shared with the lease and follow stages, which put the URLs they lease
//! into it: room is counted here, per host ([`QueueSizing::target`]) and in all (at most
//! `crawl.host_queue` URLs waiting), with room *reserved* for links whose enqueue is on its
//! way.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::debug;

use super::shared::{MovingAverage, Shared};
use super::stages::Ticket;
use crate::flow::robots::RobotsCache;
use crate::flow::{Admission, Busy, Flow, HostPermit};
use crate::store::frontier::UrlLease;

/// How far ahead a host's queue is filled: enough URLs for this long at its pace.
const QUEUE_HORIZON: Duration = Duration::from_millis(100);
/// At most this much is added to the horizon for slow lease rounds (a database that takes
/// seconds to answer does not make every host's queue hold seconds of work).
const MAX_ROUND_ALLOWANCE: Duration = Duration::from_millis(400);

/// A leased URL waiting for its host.
#[derive(Debug)]
pub(crate) struct Queued {
    pub lease: UrlLease,
    pub ticket: Ticket,
    /// For a URL queued while the write that leases it is on its way (the pagination chain):
    /// whether the write took the lease. Its page is kept only if it did.
    pub confirm: Option<Confirmation>,
}

/// Whether a write that leases a URL to this instance took the lease, known once its answer
/// came back ([`Confirmation::pending`]).
#[derive(Clone, Debug)]
pub(crate) struct Confirmation(tokio::sync::watch::Receiver<Option<bool>>);

impl Confirmation {
    /// A confirmation to come, and its sender: `send(Some(true))` once the write took the
    /// lease, `Some(false)` when it did not or failed. Dropped unsent, it reads as not taken.
    pub(crate) fn pending() -> (tokio::sync::watch::Sender<Option<bool>>, Self) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (tx, Self(rx))
    }

    /// Whether the lease was taken, once the write's answer is known.
    pub(crate) async fn taken(mut self) -> bool {
        match self.0.wait_for(Option::is_some).await {
            Ok(answer) => *answer == Some(true),
            Err(_) => false,
        }
    }

    /// Whether the write's answer is in (without waiting).
    pub(crate) fn known(&self) -> bool {
        self.0.borrow().is_some()
    }

    /// Whether the lease was taken, as far as is known now (not yet known: false).
    pub(crate) fn taken_now(&self) -> bool {
        *self.0.borrow() == Some(true)
    }
}

#[derive(Debug, Default)]
struct HostQueue {
    items: VecDeque<Queued>,
    /// Links being enqueued leased to this instance (on their way here).
    reserved: usize,
}

#[derive(Debug, Default)]
struct Inner {
    hosts: HashMap<String, HostQueue>,
    queued: usize,
    reserved: usize,
}

/// The per-host queues of one crawl slice.
#[derive(Debug)]
pub(crate) struct HostQueues {
    inner: Mutex<Inner>,
    /// At most this many URLs wait for their hosts (`crawl.host_queue`).
    capacity: usize,
    /// A URL was queued: the dispatcher looks at once.
    arrived: tokio::sync::Notify,
}

/// A URL admitted to a fetch, with what it holds until its page is committed.
#[derive(Debug)]
pub(crate) struct Admitted {
    /// The URL and its place in the host queue.
    pub queued: Queued,
    /// Its host's admission (the host's limiter counts it in flight).
    pub host: HostPermit,
    /// A fetch slot (`crawl.workers`).
    pub slot: OwnedSemaphorePermit,
    /// An uncommitted-page permit (`crawl.max_uncommitted`).
    pub uncommitted: OwnedSemaphorePermit,
}

/// What one dispatch turn did.

#[derive(Debug, Default)]
pub(crate) struct DispatchStep {
    /// URLs admitted and handed to fetch tasks.
    pub started: Vec<Admitted>,
    /// URLs whose lease ran out while they waited: dropped unfetched.
    pub expired: usize,
    /// Paused hosts' queued URLs, to give back until the pause ends.
    pub paused: Vec<(Queued, Duration)>,
    /// The next moment a host's spacing or pause ends.
    pub wake: Option<Instant>,
}

impl HostQueues {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            arrived: tokio::sync::Notify::new(),
        }
    }

    /// Resolves when a URL was queued since the last call (or spuriously).
    pub(crate) async fn arrived(&self) {
        self.arrived.notified().await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// URLs waiting for their hosts.
    pub(crate) fn len(&self) -> usize {
        self.lock().queued
    }

    /// Hosts with URLs waiting.
    pub(crate) fn hosts(&self) -> Vec<String> {
        self.lock()
            .hosts
            .iter()
            .filter(|(_, q)| !q.items.is_empty())
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// Whether a lease round is worth its round trips: the queues are empty, or at least a
    /// quarter of them is free (a round per freed slot would cost three round trips a URL).
    pub(crate) fn wants_more(&self) -> bool {
        let inner = self.lock();
        let free = self.capacity.saturating_sub(inner.queued + inner.reserved);
        free > 0 && (inner.queued == 0 || free * 4 >= self.capacity)
    }

    /// Room for more URLs in all (`crawl.host_queue` minus those waiting or on their way).
    pub(crate) fn room(&self) -> usize {
        let inner = self.lock();
        self.capacity.saturating_sub(inner.queued + inner.reserved)
    }

    /// Room for `host`, given its target queue length (and the room in all).
    #[cfg(test)]
    pub(crate) fn room_for(&self, host: &str, target: usize) -> usize {
        let inner = self.lock();
        let all = self.capacity.saturating_sub(inner.queued + inner.reserved);
        let mine = inner
            .hosts
            .get(host)
            .map_or(0, |q| q.items.len() + q.reserved);
        all.min(target.saturating_sub(mine))
    }

    /// Reserves room for up to `want` URLs of `host` (target queue length `target`); returns how
    /// many were granted. Give back what did not arrive with [`HostQueues::unreserve`].
    pub(crate) fn reserve(&self, host: &str, want: usize, target: usize) -> usize {
        let mut inner = self.lock();
        let all = self.capacity.saturating_sub(inner.queued + inner.reserved);
        let q = inner.hosts.entry(host.to_owned()).or_default();
        let mine = q.items.len() + q.reserved;
        let granted = want.min(target.saturating_sub(mine)).min(all);
        q.reserved += granted;
        inner.reserved += granted;
        granted
    }

    /// Reserves room for `n` URLs of `host` whatever the room (the next listing page is always
    /// leased on enqueue).
    pub(crate) fn reserve_beyond_room(&self, host: &str, n: usize) -> usize {
        let mut inner = self.lock();
        inner.hosts.entry(host.to_owned()).or_default().reserved += n;
        inner.reserved += n;
        n
    }

    pub(crate) fn unreserve(&self, host: &str, n: usize) {
        let mut inner = self.lock();
        let n = match inner.hosts.get_mut(host) {
            Some(q) => {
                let n = n.min(q.reserved);
                q.reserved -= n;
                n
            }
            None => 0,
        };
        inner.reserved = inner.reserved.saturating_sub(n);
    }

    /// Whether `host`'s queue, its reservations and `more` URLs would fill at most half of its
    /// room: `target`, within what the queues hold in all.
    pub(crate) fn half_empty_with(&self, host: &str, more: usize, target: usize) -> bool {
        let inner = self.lock();
        let held = inner
            .hosts
            .get(host)
            .map_or(0, |q| q.items.len() + q.reserved);
        (held + more) * 2 <= target.min(self.capacity)
    }

    /// Queues a leased URL, behind the others of its host.
    pub(crate) fn push(&self, queued: Queued) {
        self.push_where(queued, |_| false);
    }

    /// Queues a listing page leased on enqueue (the pagination chain): ahead of its host's
    /// queued pages while they fill at most half of `target` (the host's queue length), behind
    /// them otherwise. The chain reveals the pages that keep the host busy, so it takes the
    /// host's next free slot rather than waiting for the pages the listing before it revealed;
    /// but it never runs further ahead of the fetches than the queue holds, where the pages it
    /// reveals would find no room to be leased on enqueue and cost lease rounds instead
    /// (measured: a 200,000-item pass took 93 s with listing pages always behind, 128–178 s with
    /// them always first).
    pub(crate) fn push_chain(&self, queued: Queued, target: usize) {
        self.push_where(queued, |q| q.items.len() * 2 <= target);
    }

    fn push_where(&self, queued: Queued, first: impl FnOnce(&HostQueue) -> bool) {
        let mut inner = self.lock();
        let q = inner.hosts.entry(queued.lease.host()).or_default();
        if first(q) {
            q.items.push_front(queued);
        } else {
            q.items.push_back(queued);
        }
        inner.queued += 1;
        drop(inner);
        self.arrived.notify_one();
    }

    /// Everything still queued (the slice is ending).
    pub(crate) fn drain(&self) -> Vec<Queued> {
        let mut inner = self.lock();
        inner.queued = 0;
        inner
            .hosts
            .values_mut()
            .flat_map(|q| q.items.drain(..))
            .collect()
    }
}

/// The dispatch stage: which queued URLs go to a fetch now.
pub(crate) struct Dispatcher {
    shared: Arc<Shared>,
    /// Whose rules are read: until a host's are, it gets one request at a time.
    robots: Arc<RobotsCache>,
}

/// What a dispatch turn works with: the fetch slots and uncommitted-page permits it takes
/// from, the time (the server's, for lease expiry), and whether the database has cut this
/// instance off (then nothing starts).
pub(crate) struct Turn<'a> {
    pub slots: &'a Arc<Semaphore>,
    pub uncommitted: &'a Arc<Semaphore>,
    pub server_now: DateTime<Utc>,
    pub now: Instant,
    pub cut_off: bool,
}

impl Dispatcher {
    pub(crate) fn new(shared: Arc<Shared>, robots: Arc<RobotsCache>) -> Self {
        Self { shared, robots }
    }

    /// One dispatch turn: for each host with URLs waiting, while its limiter admits (within its
    /// fair share of the fetch slots) and a fetch slot and an uncommitted-page permit are free,
    /// the front URL goes to a fetch. A URL whose lease ran out while it waited (a stopped
    /// process, a long Crawl-delay) is dropped unfetched before it takes a slot — it may be
    /// another worker's already; whoever leases it next fetches it. A paused host's URLs are
    /// taken out, to be given back until the pause ends.
    pub(crate) fn step(&self, queues: &HostQueues, turn: Turn<'_>) -> DispatchStep {
        let mut step = DispatchStep::default();
        let hosts = queues.hosts();
        let share = self
            .shared
            .flow
            .fair_share(self.shared.limits.workers, hosts.iter().map(String::as_str));
        let mut inner = queues.lock();
        let mut removed = 0;
        for host in hosts {
            let Some(queue) = inner.hosts.get_mut(&host) else {
                continue;
            };
            let (taken, more) = self.host_turn(&host, queue, &turn, share, &mut step);
            removed += taken;
            if !more {
                break;
            }
        }
        inner.queued = inner.queued.saturating_sub(removed);
        debug_assert_eq!(
            inner.queued,
            inner.hosts.values().map(|q| q.items.len()).sum::<usize>(),
            "the queued count matches the queues"
        );
        inner
            .hosts
            .retain(|_, q| !q.items.is_empty() || q.reserved > 0);
        step
    }

    /// `host`'s part of a dispatch turn (see [`Dispatcher::step`]), into `step`: how many URLs
    /// it took off the host's queue, and whether other hosts may still start fetches (false
    /// once the fetch slots or the uncommitted-page permits ran out).
    fn host_turn(
        &self,
        host: &str,
        queue: &mut HostQueue,
        turn: &Turn<'_>,
        share: usize,
        step: &mut DispatchStep,
    ) -> (usize, bool) {
        let mut removed = 0;
        while let Some(front) = queue.items.front() {
            if turn.server_now >= front.lease.expires_at {
                let item = queue.items.pop_front().expect("front exists");
                debug!(bot = %self.shared.bot, url = %item.lease.url, "lease expired while queued; not fetched");
                self.shared.metrics.url_lease_lost(&self.shared.bot);
                step.expired += 1;
                removed += 1;
                continue;
            }
            // Cut off from the database: nothing new starts (the queued leases run out here).
            if turn.cut_off {
                break;
            }
            // Until its robots.txt is read, one request at a time: its Crawl-delay must space
            // the first requests too (an instance joining a running pass).
            if !self.robots.known(&front.lease.url) && self.shared.flow.in_flight(host) > 0 {
                break;
            }
            let Ok(slot) = turn.slots.clone().try_acquire_owned() else {
                return (removed, false);
            };
            let Ok(permit) = turn.uncommitted.clone().try_acquire_owned() else {
                return (removed, false);
            };
            let retry = front.lease.attempt > 1;
            match self.shared.flow.try_admit(host, retry, turn.now, share) {
                Admission::Admitted(host) => {
                    let queued = queue.items.pop_front().expect("front exists");
                    removed += 1;
                    step.started.push(Admitted {
                        queued,
                        host,
                        slot,
                        uncommitted: permit,
                    });
                }
                Admission::Wait { why, until } => {
                    if why == Busy::Paused {
                        let wait =
                            until.map_or(Duration::ZERO, |u| u.saturating_duration_since(turn.now));
                        removed += queue.items.len();
                        step.paused
                            .extend(queue.items.drain(..).map(|item| (item, wait)));
                    }
                    if let Some(until) = until {
                        step.wake = Some(step.wake.map_or(until, |w| w.min(until)));
                    }
                    break;
                }
            }
        }
        (removed, true)
    }
}

/// How many URLs each host's queue holds: enough for `QUEUE_HORIZON` of its pace plus two
/// lease rounds as long as they take here (a moving average the lease stage feeds).
pub(crate) struct QueueSizing {
    flow: Arc<Flow>,
    /// `crawl.workers`: the fetch slots the hosts share.
    workers: usize,
    /// How long a lease round takes here.
    lease_rounds: MovingAverage,
}

impl QueueSizing {
    pub(crate) fn new(flow: Arc<Flow>, workers: usize) -> Self {
        Self {
            flow,
            workers,
            lease_rounds: MovingAverage::default(),
        }
    }

    /// The target queue length of `host` (see [`Flow::queue_target`]).
    pub(crate) fn target(&self, host: &str, queues: &HostQueues) -> usize {
        let share = self.flow.fair_share(
            self.workers,
            queues.hosts().iter().map(String::as_str).chain([host]),
        );
        self.flow.queue_target(host, share, self.horizon())
    }

    /// How much fetching a host's queue holds: [`QUEUE_HORIZON`], plus two lease rounds as
    /// long as they take here — what the queue must last while the next round is out and the
    /// one after it is sent, so that the database's round trip does not pace fetching (a
    /// database 10 ms away makes a round 30–50 ms).
    fn horizon(&self) -> Duration {
        let round = self.lease_rounds.get().unwrap_or_default();
        QUEUE_HORIZON + round.saturating_mul(2).min(MAX_ROUND_ALLOWANCE)
    }

    /// Counts a lease round's duration into the moving average `QueueSizing::horizon` reads.
    pub(crate) fn lease_round_took(&self, took: Duration) {
        self.lease_rounds.note(took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crawl::stages::Stages;
    use crate::http_client::Validators;
    use crate::ids::BotId;
    use crate::store::frontier::PageKind;
    use crate::urls::NormalizedUrl;

    fn queued(stages: &Stages, url: &str, kind: PageKind) -> Queued {
        let url = NormalizedUrl::parse(url).unwrap();
        Queued {
            lease: UrlLease {
                bot: BotId::parse("b").unwrap(),
                id: url.as_str().into(),
                url,
                kind,
                pass: crate::ids::PassNumber::new(1),
                token: "t".into(),
                expires_at: Utc::now(),
                attempt: 1,
                leased_at: Utc::now(),
                validators: Validators::default(),
                list_fingerprint: None,
                record_id: None,
                reclaimed: false,
                priority: 0,
                sheds: 0,
                depth: 0,
                eligible_since: None,
            },
            ticket: stages.host_queue.enter(),
            confirm: None,
        }
    }

    #[test]
    fn room_counts_what_waits_and_what_is_reserved_per_host_and_in_all() {
        let stages = Stages::default();
        let queues = HostQueues::new(10);
        assert!(queues.wants_more());
        // A host's target bounds its share; the capacity bounds all.
        assert_eq!(queues.reserve("a:80", 100, 6), 6);
        assert_eq!(queues.room_for("a:80", 6), 0);
        assert_eq!(queues.reserve("b:80", 100, 6), 4, "only 4 left in all");
        assert_eq!(queues.room(), 0);
        assert!(!queues.wants_more());
        // What arrives takes the room its reservation held.
        for i in 0..3 {
            queues.push(queued(&stages, &format!("http://a/{i}"), PageKind::Detail));
        }
        queues.unreserve("a:80", 6);
        assert_eq!(queues.len(), 3);
        assert_eq!(queues.room_for("a:80", 6), 3);
        queues.unreserve("b:80", 4);
        assert_eq!(queues.room(), 7);
        // The next listing page is leased whatever the room.
        assert_eq!(queues.reserve_beyond_room("a:80", 1), 1);
        queues.unreserve("a:80", 1);
        // In the order they came.
        queues.push(queued(&stages, "http://a/list/2", PageKind::List));
        let drained = queues.drain();
        assert_eq!(drained[3].lease.kind, PageKind::List);
        assert_eq!((drained.len(), queues.len()), (4, 0));
        assert_eq!(stages.host_queue.depth(), 4, "tickets travel with the URLs");
        drop(drained);
        assert_eq!(stages.host_queue.depth(), 0);
    }

    #[test]
    fn the_next_listing_page_goes_ahead_of_its_host_until_the_queue_is_half_full() {
        let stages = Stages::default();
        let queues = HostQueues::new(100);
        for i in 0..3 {
            queues.push(queued(&stages, &format!("http://a/{i}"), PageKind::Detail));
        }
        queues.push(queued(&stages, "http://b/0", PageKind::Detail));
        // 3 queued of a target of 6: the chain goes first on its host, others untouched.
        queues.push_chain(queued(&stages, "http://a/list/2", PageKind::List), 6);
        // 5 queued of a target of 6: the chain waits its turn.
        queues.push(queued(&stages, "http://a/3", PageKind::Detail));
        queues.push_chain(queued(&stages, "http://a/list/3", PageKind::List), 6);
        let inner = queues.lock();
        let a: Vec<&str> = inner.hosts["a:80"]
            .items
            .iter()
            .map(|q| q.lease.url.as_str())
            .collect();
        assert_eq!(
            a,
            [
                "http://a/list/2",
                "http://a/0",
                "http://a/1",
                "http://a/2",
                "http://a/3",
                "http://a/list/3"
            ]
        );
        assert_eq!(inner.hosts["b:80"].items.len(), 1);
        assert_eq!(inner.queued, 7);
    }

    #[test]
    fn the_chain_goes_ahead_only_while_what_a_page_reveals_leaves_half_the_room() {
        let stages = Stages::default();
        let queues = HostQueues::new(40);
        for i in 0..3 {
            queues.push(queued(&stages, &format!("http://a/{i}"), PageKind::Detail));
        }
        assert_eq!(queues.reserve("a:80", 2, 100), 2);
        // 3 queued and 2 reserved: 5 more fill half of a target of 20, 6 more do not.
        assert!(queues.half_empty_with("a:80", 5, 20));
        assert!(!queues.half_empty_with("a:80", 6, 20));
        // A target beyond what the queues hold in all counts as their capacity (40).
        assert!(queues.half_empty_with("a:80", 15, 1000));
        assert!(!queues.half_empty_with("a:80", 16, 1000));
        // A host with nothing queued.
        assert!(queues.half_empty_with("b:80", 10, 20));
    }

    #[tokio::test]
    async fn a_lease_written_ahead_is_taken_only_when_its_write_says_so() {
        let (tx, confirm) = Confirmation::pending();
        assert!(!confirm.known());
        let waiting = tokio::spawn(confirm.clone().taken());
        tx.send(Some(true)).unwrap();
        assert!(waiting.await.unwrap());
        assert!(confirm.known());
        let (tx, confirm) = Confirmation::pending();
        tx.send(Some(false)).unwrap();
        assert!(!confirm.taken().await);
        // A write that never answered (its task ended) took nothing.
        let (tx, confirm) = Confirmation::pending();
        drop(tx);
        assert!(!confirm.taken().await);
    }
}
