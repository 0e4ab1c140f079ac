//! The lease stage: one [`Leaser::step`] is one batched lease round trip — the pending URLs of
//! the hosts with room in this instance's queues, as many as there is room for, taken in one
//! conditional `update` ([`Frontier::take_leases`](crate::store::Frontier::take_leases)) — and
//! `Rounds` is when the dispatcher sends the next one.
//!
//! Lease queries are per host (`{botId, pass, status: pending, host, …}`), so a slow or paused
//! host's URLs are never leased, read or skipped while another host has room: leasing cannot
//! fill with them, nor pay for avoiding them. Per host, priorities above the lowest (seeds,
//! listing pages) are one range query; each level is asked for in as many random slots as the
//! level's measured density says hold the wanted number (a sparse level is asked for whole), so a
//! query reads about what it wants whatever the pass's size and no priority is missed for want of
//! a slot. The hosts with pending work are those this instance enqueued, and those a `distinct`
//! finds when it knows none or the pass still has work it cannot see.
//!
//! Expired leases and those a dead predecessor of this instance id still holds are taken in the
//! same round trip; retries that came due go back to pending about once a second. A round that
//! finds nothing, with nothing in flight here, looks whether the pass is over and ends it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::dispatch::{HostQueues, QueueSizing, Queued};
use super::pass::Pass;
use super::shared::{PassMemory, Shared, WaitingListing};
use crate::error::Result;
use crate::ids::PassNumber;
use crate::store::frontier::{
    Candidate, CandidateQuery, KnownPage, LeaseTo, LeasedEntry, Mark, NewUrl, PageKind, Priority,
    Takes, UrlLease, SLOTS,
};
use crate::store::passes::PassEnd;

/// A level asked for whole when it holds at most about this many pending URLs of a host.
const SPARSE: f64 = 256.0;
/// Hosts asked for in one round (the others in the next ones).
const HOSTS_PER_ROUND: usize = 8;
/// How often the pass's leased entries are read for expired leases while work flows.
const LEASED_CHECK: Duration = Duration::from_secs(1);
/// How often, at most, the hosts with pending work are read (a `distinct` over the pass's
/// pending entries: the test server reads every one of them) when the pass has work this
/// instance cannot find on the hosts it knows.
const HOSTS_REFRESH: Duration = Duration::from_secs(30);
/// Slots a level of unknown size is first asked for in (then as many as its density says).
const FIRST_SLOTS: u32 = 8;
/// The most slots one query asks for: an eighth of a level, whatever its density was.
const MAX_SLOTS: u32 = 128;
/// How long URLs whose lease write met an open transaction's documents are left alone (the
/// transaction ends by then, or is ended: a killed process's lives at most 60 s on MongoDB).
const BUSY_FOR: Duration = Duration::from_secs(10);

/// What one lease round found.
#[derive(Debug)]
pub(crate) enum LeaseStep {
    /// URLs leased to this instance (already in its host queues).
    Leased,
    /// Nothing to lease now, but pages are in the pipeline or their hosts are busy: wait for
    /// one of them.
    Busy,
    /// Nothing to lease now, nothing in flight here, but the pass is not over: URLs are leased
    /// by others or wait for a retry time.
    Idle,
    /// Nothing pending, waiting or leased: the pass is over.
    PassFinished(PassEnd),
}

/// What the leaser remembers between rounds (per crawler; reset for a new pass).
#[derive(Debug, Default)]
struct Memory {
    pass: PassNumber,
    /// Pending URLs per slot, per (host, priority), as the last queries found them.
    density: HashMap<(String, i64), f64>,
    last_promotion: Option<Instant>,
    last_leased_check: Option<Instant>,
    last_hosts_refresh: Option<Instant>,
    /// No lease of a dead process (a predecessor under this id, or an owner whose registration
    /// expired or was taken over) is left in this pass.
    reclaimed: bool,
    /// URLs a lease write found held by an open transaction, left alone until then.
    busy: HashMap<String, Instant>,
    /// Tokens of lease writes given up on before their answer: entries leased to this
    /// instance under one of them (the write landed late) are reclaimed.
    abandoned: HashSet<String>,
    /// Where the next round starts among the hosts.
    rotate: usize,
}

impl Memory {
    fn start(&mut self, pass: PassNumber) {
        if self.pass != pass {
            *self = Memory {
                pass,
                ..Memory::default()
            };
        }
    }

    fn due(last: &mut Option<Instant>, every: Duration, now: Instant) -> bool {
        let due = last.is_none_or(|t| now.duration_since(t) >= every);
        if due {
            *last = Some(now);
        }
        due
    }

    /// The query for one priority level of `host`, wanting `want` URLs.
    fn query(&self, host: &str, priority: Priority, level: i64, want: usize) -> CandidateQuery {
        let density = self.density.get(&(host.to_owned(), level)).copied();
        let k = match (priority, density) {
            (Priority::Above(_), _) => None,
            // Known to be sparse: the whole level, in one read of a few entries.
            (Priority::Exactly(_), Some(d)) if d * f64::from(SLOTS) <= SPARSE => None,
            (Priority::Exactly(_), Some(d)) => {
                Some(((want as f64 / d).ceil() as u32).clamp(1, MAX_SLOTS))
            }
            // Never read: a few slots first (a level of a million entries must not be read
            // whole to learn that it is large).
            (Priority::Exactly(_), None) => Some(FIRST_SLOTS),
        };
        let slots = k.map(|k| {
            let first = rand::random_range(0..SLOTS);
            (0..k).map(|i| (first + i) % SLOTS).collect()
        });
        CandidateQuery {
            host: host.to_owned(),
            priority,
            slots,
            // Enough to learn the density when a level turns out dense.
            limit: want.max(1) * 4,
        }
    }

    /// Learns each level's density from what `query` found.
    fn learn(&mut self, query: &CandidateQuery, levels: &[i64], found: &[Candidate]) {
        let slots = query
            .slots
            .as_ref()
            .map_or(SLOTS, |s| s.len() as u32)
            .max(1);
        let truncated = found.len() >= query.limit;
        let levels: Vec<i64> = match query.priority {
            Priority::Exactly(p) => vec![p],
            Priority::Above(_) => levels.to_vec(),
        };
        for level in levels {
            let n = found.iter().filter(|c| c.priority == level).count() as f64;
            let mut d = n / f64::from(slots);
            if truncated {
                // More than were returned: at least twice, so the next query asks by slot.
                d = d.max(SPARSE * 2.0 / f64::from(SLOTS));
            }
            self.density.insert((query.host.clone(), level), d);
        }
    }
}

/// The shortest and longest pause between lease rounds that keep finding nothing while pages
/// are in flight (the wait doubles from one to the other; a lease, a settled page or new work
/// ends it).
const DRY_SPELL_MIN: Duration = Duration::from_millis(20);
const DRY_SPELL_MAX: Duration = Duration::from_millis(500);
/// A slice in which lease rounds keep finding the pass idle (and nothing is in flight) ends
/// after this.
const IDLE_END: Duration = Duration::from_secs(2);

/// The leaser's state across the dispatcher's turns: the lease round out (one at a time), the
/// dry spell and how long the pass has looked idle here.
#[derive(Default)]
pub(super) struct Rounds {
    pub(super) round: Option<BoxFuture<'static, Result<LeaseStep>>>,
    /// `Slice::new_work` when the round out now was sent, and when the dispatcher last looked.
    sent_at_work: u64,
    /// Pages were in flight when the round out now was sent (a round that then finds nothing
    /// to lease says only that: busy).
    sent_busy: bool,
    work_seen: u64,
    /// No new lease round before this (a dry spell: the last ones found nothing while pages
    /// were in flight — every pending URL taken, the next listing page not read yet). Without
    /// it every instance re-queries as fast as the database answers, and the database spends
    /// itself answering "nothing" (measured: 5 instances, 600 ops/s, 7 pages/s on the test
    /// server). A lease, a settled page or new work ends it.
    pub(super) dry: Option<Instant>,
    dry_spell: Duration,
    /// Since when lease rounds have found the pass idle here (its URLs leased by others, or
    /// waiting for a retry time): they go on at the longest dry spell, and the slice ends idle
    /// after `IDLE_END` of it with nothing in flight (the coordinator looks at the bot document,
    /// then crawls on).
    idle_since: Option<Instant>,
    /// Pages were in flight at the last turn: when the pipeline drains, the pass may be over.
    was_busy: bool,
}

impl Rounds {
    /// The slice ends idle: nothing in flight, no round out, and idle rounds for `IDLE_END`.
    pub(super) fn idle_over(&self, busy: bool) -> bool {
        !busy
            && self.round.is_none()
            && self
                .idle_since
                .is_some_and(|since| since.elapsed() >= IDLE_END)
    }

    /// New pending work here, or nothing left in flight (the pass may be over): the dry spell
    /// ends. (A committed page alone does not end it: its links were enqueued when it was
    /// parsed.)
    pub(super) fn look(&mut self, new_work: u64, busy: bool) {
        if new_work != self.work_seen || (self.was_busy && !busy) {
            self.work_seen = new_work;
            self.dry = None;
        }
        self.was_busy = busy;
    }

    /// A new round goes out: none is out, the host queues have room and want more, and no dry
    /// spell holds it back.
    pub(super) fn due(&self, queues: &HostQueues, now: Instant) -> bool {
        self.round.is_none()
            && queues.room() > 0
            && queues.wants_more()
            && self.dry.is_none_or(|until| now >= until)
    }

    /// Sends `round`; `busy`: pages are in flight as it goes.
    pub(super) fn send(
        &mut self,
        new_work: u64,
        busy: bool,
        round: BoxFuture<'static, Result<LeaseStep>>,
    ) {
        self.sent_at_work = new_work;
        self.sent_busy = busy;
        self.round = Some(round);
    }

    /// A round came back with `step` (not the pass's end); `busy`: pages are in flight now. A
    /// lease ends any dry spell; a round that found nothing starts or doubles one, unless pages
    /// settled while it was out (what it found may be stale already) or the pages in flight
    /// when it went out, all it found, are gone (the pass may be over: the next round looks at
    /// once); an idle pass waits the longest.
    pub(super) fn landed(&mut self, step: &LeaseStep, new_work: u64, busy: bool) {
        match step {
            LeaseStep::Leased => {
                self.dry = None;
                self.dry_spell = Duration::ZERO;
                self.idle_since = None;
            }
            LeaseStep::Busy if new_work != self.sent_at_work => self.dry = None,
            LeaseStep::Busy if self.sent_busy && !busy => self.dry = None,
            LeaseStep::Busy => {
                self.dry_spell = (self.dry_spell * 2).clamp(DRY_SPELL_MIN, DRY_SPELL_MAX);
                self.dry = Some(Instant::now() + self.dry_spell);
            }
            LeaseStep::Idle => {
                self.idle_since.get_or_insert_with(Instant::now);
                self.dry_spell = DRY_SPELL_MAX;
                self.dry = Some(Instant::now() + self.dry_spell);
            }
            LeaseStep::PassFinished(_) => {}
        }
    }
}

/// The lease stage: what the leaser remembers between rounds, what this instance remembers of
/// the pass (shared with the follow stage), and the end of the pass, which the leaser finds.
pub(crate) struct Leaser {
    shared: Arc<Shared>,
    memory: Arc<PassMemory>,
    sizing: Arc<QueueSizing>,
    /// One lease round at a time.
    rounds: tokio::sync::Mutex<Memory>,
    /// Held by the round that is ending a pass.
    finishing: tokio::sync::Mutex<()>,
    /// Leases this instance id took before this are a dead predecessor's: reclaimed at once.
    started_at: DateTime<Utc>,
}

/// The URLs a round may take besides the pending ones: leases past their expiry, and those of
/// dead processes (`true`: reclaimed by their token).
type Takeovers = Vec<(LeasedEntry, bool)>;

impl Leaser {
    pub(crate) fn new(
        shared: Arc<Shared>,
        memory: Arc<PassMemory>,
        sizing: Arc<QueueSizing>,
        started_at: DateTime<Utc>,
    ) -> Self {
        Self {
            shared,
            memory,
            sizing,
            rounds: Default::default(),
            finishing: Default::default(),
            started_at,
        }
    }

    /// One lease round: up to the room in this instance's host queues, per host, highest
    /// priority first, leased in one round trip and put into `queues`. Finds the pipeline busy,
    /// the pass idle, or the pass over when there is nothing to lease.
    pub(crate) async fn step(
        &self,
        pass: &Pass,
        queues: &HostQueues,
        in_pipeline: bool,
    ) -> Result<LeaseStep> {
        let mut memory = self.rounds.lock().await;
        memory.start(pass.number);
        let now = Instant::now();
        // Retries that came due go back to pending about once a second, beside the look at the
        // leases (one round trip where both are due, as at a pass's start).
        let promote = Memory::due(&mut memory.last_promotion, Duration::from_secs(1), now);
        let promoted = async {
            if promote {
                self.shared
                    .store
                    .frontier()
                    .promote_due(&self.shared.bot, pass.number, self.shared.clock.now())
                    .await?;
            }
            Ok(())
        };
        let mut hosts = self.pass_hosts(pass);
        let ((), takeovers) =
            tokio::try_join!(promoted, self.takeovers(&mut memory, pass, &mut hosts, now))?;
        let paused: HashSet<String> = self
            .shared
            .flow
            .paused_hosts(now)
            .into_iter()
            .map(|(h, _)| h)
            .collect();
        let rooms = self.rooms(&mut memory, &hosts, &paused, queues);
        let t0 = Instant::now();
        let result = self
            .lease_into(&mut memory, pass, queues, &rooms, takeovers)
            .await;
        tracing::trace!(rooms = ?rooms, took = ?t0.elapsed(), leased = ?result.as_ref().ok(), "lease round");
        if result.is_ok() && !rooms.is_empty() {
            self.sizing.lease_round_took(t0.elapsed());
        }
        for (host, room) in &rooms {
            queues.unreserve(host, *room);
        }
        let leased = result?;
        self.shared
            .metrics
            .lease_query(&self.shared.bot, leased > 0);
        if leased > 0 {
            return Ok(LeaseStep::Leased);
        }
        let refresh = Memory::due(&mut memory.last_hosts_refresh, HOSTS_REFRESH, now);
        drop(memory);
        self.nothing_to_lease(
            pass,
            in_pipeline,
            !paused.is_empty() || rooms.is_empty(),
            refresh,
        )
        .await
    }

    /// The hosts this instance knows to have work in the pass — to begin with, those of the
    /// seeds and of the scope; more are learnt from what this instance enqueues and leases, and
    /// from a `distinct` when the pass has work on none of them.
    fn pass_hosts(&self, pass: &Pass) -> BTreeSet<String> {
        let hosts = self.memory.hosts(pass.number);
        if !hosts.is_empty() {
            return hosts;
        }
        for host in pass.seed_hosts.iter().chain(&self.shared.rules.links.scope) {
            if host.contains(':') {
                self.memory.note_host(pass.number, host.clone());
            }
        }
        self.memory.hosts(pass.number)
    }

    /// Leases past their expiry, and a dead predecessor's (same instance id, taken before this
    /// process started: reclaimed at once) or a dead owner's: read about once a second, and
    /// until no predecessor's is left. (An idle instance that asked every round would cost the
    /// busy ones a read of every lease of the pass each time.) Their hosts join `hosts`.
    async fn takeovers(
        &self,
        memory: &mut Memory,
        pass: &Pass,
        hosts: &mut BTreeSet<String>,
        now: Instant,
    ) -> Result<Takeovers> {
        let mut takeovers = Vec::new();
        if memory.reclaimed && !Memory::due(&mut memory.last_leased_check, LEASED_CHECK, now) {
            return Ok(takeovers);
        }
        let server_now = self.shared.clock.now();
        let entries = self
            .shared
            .store
            .frontier()
            .leased_entries(&self.shared.bot, pass.number)
            .await?;
        let dead = self.dead_owners(&entries, server_now).await?;
        let mut predecessor = false;
        for entry in entries {
            let mine = entry.owner.as_deref() == Some(self.shared.me.as_str());
            let before = entry.leased_at.is_some_and(|t| t < self.started_at);
            let orphan = entry
                .owner
                .as_deref()
                .and_then(|o| dead.get(o))
                .is_some_and(|since| entry.leased_at.is_none_or(|at| at < *since));
            let late = mine
                && entry
                    .token
                    .as_ref()
                    .is_some_and(|t| memory.abandoned.contains(t));
            let reclaim = (mine && (before || late)) || orphan;
            predecessor |= reclaim;
            if reclaim || entry.expires_at.is_some_and(|t| t <= server_now) {
                hosts.insert(entry.host.clone());
                takeovers.push((entry, reclaim));
            }
        }
        memory.reclaimed = !predecessor;
        Ok(takeovers)
    }

    /// Room per host with room (at most [`HOSTS_PER_ROUND`], taking turns), reserved for this
    /// round's leases.
    fn rooms(
        &self,
        memory: &mut Memory,
        hosts: &BTreeSet<String>,
        paused: &HashSet<String>,
        queues: &HostQueues,
    ) -> Vec<(String, usize)> {
        let mut rooms: Vec<(String, usize)> = Vec::new();
        let order: Vec<&String> = hosts.iter().collect();
        let start = memory.rotate % order.len().max(1);
        memory.rotate = memory.rotate.wrapping_add(1);
        for host in order.iter().cycle().skip(start).take(order.len()) {
            if paused.contains(*host) || rooms.len() >= HOSTS_PER_ROUND {
                continue;
            }
            let target = self.sizing.target(host, queues);
            let room = queues.reserve(host, usize::MAX, target);
            tracing::trace!(host = %host, target, room, queued = queues.len(), all = queues.room(), "room");
            if room > 0 {
                rooms.push(((*host).clone(), room));
            }
        }
        rooms
    }

    /// Among the owners of `entries` other than this instance, those whose process is gone:
    /// its registration expired (no heartbeat for `lock.ttl`), or another process took the id
    /// over. Each maps to the time before which its leases are a dead process's (a taken-over
    /// id's new process leases too). One read, only when others hold leases that have not
    /// expired; an owner without a registration is left to its lease's expiry.
    async fn dead_owners(
        &self,
        entries: &[LeasedEntry],
        server_now: DateTime<Utc>,
    ) -> Result<HashMap<String, DateTime<Utc>>> {
        let mut owners: Vec<&str> = entries
            .iter()
            .filter(|e| e.expires_at.is_some_and(|t| t > server_now))
            .filter_map(|e| e.owner.as_deref())
            .filter(|o| *o != self.shared.me.as_str())
            .collect();
        owners.sort_unstable();
        owners.dedup();
        if owners.is_empty() {
            return Ok(HashMap::new());
        }
        let registrations = self.shared.store.instances().registrations(&owners).await?;
        Ok(registrations
            .into_iter()
            .filter_map(|(id, p)| {
                if p.expires_at.is_none_or(|t| t <= server_now) {
                    // Every lease it took is a dead process's.
                    Some((id, DateTime::<Utc>::MAX_UTC))
                } else {
                    // Taken over: the leases its predecessor took before this process started.
                    p.started_at.map(|started| (id, started))
                }
            })
            .collect())
    }

    /// The round trips of a round: candidates of every host with room (one query per level,
    /// all at once), then the take of those, the expired and the reclaimable. Returns how many
    /// were leased (and queued).
    async fn lease_into(
        &self,
        memory: &mut Memory,
        pass: &Pass,
        queues: &HostQueues,
        rooms: &[(String, usize)],
        takeovers: Takeovers,
    ) -> Result<usize> {
        // The last pass's listing pages waiting here go first, each leased from its entry.
        let mut rooms = rooms.to_vec();
        let mut leased = 0;
        for (host, room) in &mut rooms {
            let n = self
                .lease_waiting_listings(pass.number, host, *room, queues)
                .await?;
            *room -= n.min(*room);
            leased += n;
        }
        rooms.retain(|(_, room)| *room > 0);
        let rooms = &rooms[..];
        let server_now = self.shared.clock.now();
        let queries = self.queries(memory, rooms);
        let found = self
            .shared
            .store
            .frontier()
            .lease_candidates(&self.shared.bot, pass.number, &queries)
            .await?;
        for (query, found) in queries.iter().zip(&found) {
            memory.learn(query, &self.shared.levels, found);
        }
        let now = Instant::now();
        memory.busy.retain(|_, until| *until > now);
        let pending = pick_pending(found.into_iter().flatten(), rooms, &memory.busy);
        let (expired, reclaim) = fit_takeovers(&pending, takeovers, rooms, &memory.busy);
        if pending.is_empty() && expired.is_empty() && reclaim.is_empty() {
            return Ok(leased);
        }
        let takes = Takes {
            pending: &pending,
            expired: &expired,
            reclaim: &reclaim,
        };
        let taken = self
            .shared
            .store
            .frontier()
            .take_leases(
                &self.shared.bot,
                pass.number,
                &self.shared.me,
                server_now,
                self.shared.limits.url_lease,
                takes.clone(),
            )
            .await?;
        if let Some(token) = &taken.abandoned {
            memory.abandoned.insert(token.clone());
            // Checked every round until none of its entries is left.
            memory.reclaimed = false;
        }
        if taken.held {
            memory.leave_alone(&taken.leases, &takes);
            debug!(bot = %self.shared.bot, busy = memory.busy.len(), "lease write met an open transaction; leasing other URLs");
        }
        let n = taken.leases.len();
        self.queue_leases(taken.leases, queues).await?;
        Ok(leased + n)
    }

    /// One query per host with room: levels above the lowest are few (seeds, listing pages):
    /// one range query, unless one of them turned out dense here (then each is asked for by
    /// slot); the lowest level by slot.
    fn queries(&self, memory: &Memory, rooms: &[(String, usize)]) -> Vec<CandidateQuery> {
        let (levels, lowest) = (&self.shared.levels, self.shared.lowest);
        let mut queries = Vec::new();
        for (host, room) in rooms {
            let dense = levels.iter().any(|level| {
                memory
                    .density
                    .get(&(host.clone(), *level))
                    .is_some_and(|d| d * f64::from(SLOTS) > SPARSE)
            });
            if dense {
                for level in levels {
                    queries.push(memory.query(host, Priority::Exactly(*level), *level, *room));
                }
            } else if !levels.is_empty() {
                queries.push(memory.query(host, Priority::Above(lowest), levels[0], *room));
            }
            queries.push(memory.query(host, Priority::Exactly(lowest), lowest, *room));
        }
        queries
    }

    /// Puts leased URLs into the host queues — except a lowest-priority URL that should be shed
    /// (see [`Shared::should_shed`]), which is deferred unfetched.
    async fn queue_leases(&self, leases: Vec<UrlLease>, queues: &HostQueues) -> Result<()> {
        let now = self.shared.clock.now();
        // Listing pages leased here are in the pass: a page linking to one need not enqueue it
        // again, nor fetch it ahead of its enqueue (see `Follower::upsert_links`).
        let listings: Vec<String> = leases
            .iter()
            .filter(|l| l.kind.is_listing())
            .map(|l| l.id.clone())
            .collect();
        if let (Some(first), false) = (leases.first(), listings.is_empty()) {
            self.memory.remember_enqueued(first.pass, listings);
        }
        let mut shed = Vec::new();
        for lease in leases {
            if lease.reclaimed {
                debug!(bot = %self.shared.bot, url = %lease.url, "reclaimed a dead process's lease");
            }
            if self.shared.should_shed(&lease, now) {
                shed.push(lease);
            } else {
                queues.push(Queued {
                    ticket: self.shared.stages.host_queue.enter(),
                    lease,
                    confirm: None,
                });
            }
        }
        if !shed.is_empty() {
            let until = crate::store::plus(now, self.shared.limits.shed_after);
            let marks: Vec<_> = shed
                .iter()
                .map(|l| (l, Mark::Shed { not_before: until }))
                .collect();
            self.shared
                .store
                .frontier()
                .settle_urls(&marks, now)
                .await?;
            for _ in &shed {
                self.shared.metrics.shed(&self.shared.bot);
            }
        }
        Ok(())
    }

    /// Reads the listing pages the last complete pass read, at `pass`'s start (where the
    /// deletion rules apply), and leaves them waiting in this instance's memory: each lease
    /// round takes as many as there is room for ([`Leaser::lease_waiting_listings`]) — a
    /// pagination chain broken this time is mended at once, and the pages are read side by side
    /// instead of one after the other. True when none waits (all are in the pass already).
    pub(crate) async fn read_known_listings(&self, pass: &Pass) -> Result<bool> {
        let (true, Some(since)) = (self.shared.deletion_rules(pass).enabled, pass.last_run_at)
        else {
            return Ok(true);
        };
        let (bot, store) = (&self.shared.bot, &self.shared.store);
        let mut known = store
            .passes()
            .unreached_list_pages(bot, pass.number, since)
            .await?;
        if known.is_empty() {
            return Ok(true);
        }
        // Instances that start the pass together take the pages from different places.
        let start = rand::random_range(0..known.len());
        known.rotate_left(start);
        let mut waiting = Vec::with_capacity(known.len());
        for page in known {
            let url = page.url;
            self.memory.note_host(pass.number, url.host_port());
            waiting.push(WaitingListing {
                url: NewUrl {
                    priority: self.shared.priority_of(&url, PageKind::List),
                    url,
                    kind: PageKind::List,
                    fingerprint: None,
                    depth: page.known.depth,
                },
                id: page.id,
                known: page.known,
            });
        }
        // In the pass once leased: a listing page that links to one of them (the next page of
        // the chain) leaves it to the lease rounds instead of enqueuing it with a write of its
        // own. (Should this process stop before it leases them all, the pass's end enqueues
        // the rest: `mend_pagination`.)
        let ids = waiting.iter().map(|w| w.id.clone()).collect();
        self.memory.remember_enqueued(pass.number, ids);
        debug!(%bot, pass = pass.number.get(), pages = waiting.len(), "the last pass's listing pages wait to be leased");
        self.memory.wait_listings(pass.number, waiting);
        Ok(false)
    }

    /// Leases up to `room` of the last pass's listing pages waiting for `host` into the pass,
    /// each straight from its entry (one `update`: the entry moves into the pass leased here,
    /// its validators kept; one another instance took first is left to it) and queues them.
    /// Returns how many it leased.
    async fn lease_waiting_listings(
        &self,
        pass: PassNumber,
        host: &str,
        room: usize,
        queues: &HostQueues,
    ) -> Result<usize> {
        let (waiting, drained) = self.memory.take_listings(pass, host, room);
        let mut leased = 0;
        if !waiting.is_empty() {
            let links: Vec<NewUrl> = waiting.iter().map(|w| w.url.clone()).collect();
            let links =
                match super::bounds::admit_listings(&self.shared, &self.memory.budget, pass, links)
                    .await
                {
                    Ok(links) => links,
                    Err(e) => {
                        self.memory.wait_again(pass, waiting);
                        return Err(e);
                    }
                };
            let known: HashMap<String, KnownPage> = waiting
                .iter()
                .map(|w| (w.id.clone(), w.known.clone()))
                .collect();
            let sent = self
                .shared
                .store
                .frontier()
                .enqueue_links(
                    &self.shared.bot,
                    pass,
                    &links,
                    &known,
                    Some(LeaseTo {
                        me: &self.shared.me,
                        lease_for: self.shared.limits.url_lease,
                        first: links.len(),
                    }),
                    self.shared.clock.now(),
                )
                .await;
            // Not lost on a failed write: the pages wait again (and none waiting means none
            // left out of the pass).
            let taken = match sent {
                Ok(taken) => taken,
                Err(e) => {
                    self.memory.wait_again(pass, waiting);
                    return Err(e);
                }
            };
            leased = taken.leased.len();
            self.queue_leases(taken.leased, queues).await?;
        }
        if drained {
            self.memory.set_listings_enqueued(pass);
        }
        Ok(leased)
    }

    /// Reads the hosts with pending work in `pass` (one `distinct`) and remembers them.
    async fn refresh_hosts(&self, pass: PassNumber) -> Result<()> {
        let found = self
            .shared
            .store
            .frontier()
            .hosts_with_work(&self.shared.bot, pass)
            .await?;
        for host in found {
            self.memory.note_host(pass, host);
        }
        Ok(())
    }

    /// Nothing was leased: the pipeline is busy, the pass idle (others hold its URLs, or they
    /// wait for a retry time or a paused host), or over.
    async fn nothing_to_lease(
        &self,
        pass: &Pass,
        in_pipeline: bool,
        hosts_busy: bool,
        refresh_hosts: bool,
    ) -> Result<LeaseStep> {
        // Pages in the pipeline may enqueue more.
        if in_pipeline {
            return Ok(LeaseStep::Busy);
        }
        let bot = &self.shared.bot;
        debug!(%bot, pass = pass.number.get(), "nothing to lease and nothing in flight here");
        let store = &self.shared.store;
        if store.frontier().pass_has_work(bot, pass.number).await? {
            // Work on a host this instance does not know of is found by a later round.
            if refresh_hosts {
                match self.refresh_hosts(pass.number).await {
                    Ok(()) => {}
                    // A huge pending set can take longer than an operation may: the hosts
                    // the instance knows keep it busy meanwhile.
                    Err(e) if e.is_transient() => {
                        warn!(%bot, error = %e, "could not read the hosts with pending work; trying again later");
                    }
                    Err(e) => return Err(e),
                }
            }
            // Work on a paused (or full) host waits here for the pause to end.
            return Ok(if hosts_busy {
                LeaseStep::Busy
            } else {
                LeaseStep::Idle
            });
        }
        if self.mend_pagination(pass).await? {
            return Ok(LeaseStep::Busy);
        }
        self.finish(pass).await
    }

    /// Listing pages link one to the next: one that failed hides the rest from this pass. The
    /// listing pages the last complete pass read and this one never reached are enqueued
    /// before the pass may end (not in watermark mode, which stops on purpose) — unless this
    /// instance enqueued them all when the pass started. True when it enqueued some.
    async fn mend_pagination(&self, pass: &Pass) -> Result<bool> {
        let rules = self.shared.deletion_rules(pass);
        let (true, Some(since), false) = (
            rules.enabled,
            rules.known_since,
            self.memory.listings_enqueued(pass.number),
        ) else {
            return Ok(false);
        };
        let (bot, store) = (&self.shared.bot, &self.shared.store);
        let missed = store
            .passes()
            .unreached_list_urls(bot, pass.number, since)
            .await?;
        if missed.is_empty() {
            return Ok(false);
        }
        warn!(
            %bot, pass = pass.number.get(), pages = missed.len(),
            "listing pages the last pass read were not reached (a broken pagination chain?); enqueuing them"
        );
        let links: Vec<NewUrl> = missed
            .into_iter()
            .map(|url| NewUrl {
                priority: self.shared.priority_of(&url, PageKind::List),
                url,
                kind: PageKind::List,
                fingerprint: None,
                depth: 0,
            })
            .collect();
        let links =
            super::bounds::admit_listings(&self.shared, &self.memory.budget, pass.number, links)
                .await?;
        if links.is_empty() {
            return Ok(false);
        }
        for link in &links {
            self.memory.note_host(pass.number, link.url.host_port());
        }
        store
            .frontier()
            .enqueue_urls(bot, pass.number, &links, self.shared.clock.now())
            .await?;
        Ok(true)
    }

    /// The pass has nothing pending, waiting or leased: one round of this instance ends it
    /// (it counts the whole pass; [`Passes::finish`](crate::store::Passes::finish)).
    async fn finish(&self, pass: &Pass) -> Result<LeaseStep> {
        let Ok(_finishing) = self.finishing.try_lock() else {
            return Ok(LeaseStep::Idle);
        };
        // The pass's table of listed items is of no use any more (nothing is left to follow;
        // the next pass reads its own), and the evaluation needs the room: gone before it.
        self.memory.forget_known(pass.number).await;
        let mut rules = self.shared.deletion_rules(pass);
        if self.memory.listings_enqueued(pass.number) {
            rules.known_since = None;
        }
        let (bot, me) = (&self.shared.bot, &self.shared.me);
        let end = self
            .shared
            .store
            .passes()
            .finish(
                bot,
                pass.number,
                pass.started_at,
                rules,
                me,
                self.shared.clock.now(),
            )
            .await?;
        if !end.finished {
            return Ok(LeaseStep::Idle);
        }
        if end.recorded {
            self.shared.metrics.pass_finished(bot);
            info!(
                %bot, pass = end.pass.get(), done = end.progress.done, failed = end.progress.failed,
                coverage = end.coverage, error_rate = end.error_rate, removed = end.removed,
                restored = end.restored,
                deletion = end.deletion_skipped.as_deref().unwrap_or("applied"),
                "crawl pass finished"
            );
        }
        Ok(LeaseStep::PassFinished(end))
    }
}

/// Per host: the highest priorities first, up to its room, each URL once, none that a lease
/// write lately found held by a transaction (`busy`).
fn pick_pending(
    found: impl Iterator<Item = Candidate>,
    rooms: &[(String, usize)],
    busy: &HashMap<String, Instant>,
) -> Vec<Candidate> {
    let room_of: HashMap<&str, usize> = rooms.iter().map(|(h, r)| (h.as_str(), *r)).collect();
    let mut by_host: HashMap<&str, Vec<Candidate>> = HashMap::new();
    for candidate in found {
        let host = rooms
            .iter()
            .find(|(h, _)| *h == candidate.host)
            .map_or("", |(h, _)| h.as_str());
        by_host.entry(host).or_default().push(candidate);
    }
    let mut pending: Vec<Candidate> = Vec::new();
    for (host, mut candidates) in by_host {
        candidates.sort_by_key(|c| std::cmp::Reverse(c.priority));
        let mut seen = HashSet::new();
        candidates.retain(|c| !busy.contains_key(&c.id) && seen.insert(c.id.clone()));
        candidates.truncate(room_of.get(host).copied().unwrap_or(0));
        pending.extend(candidates);
    }
    pending
}

/// The takeovers that fit in the room their host has left after its `pending` URLs: the ids of
/// expired leases, and (id, token) of the dead processes' leases to reclaim.
fn fit_takeovers(
    pending: &[Candidate],
    takeovers: Takeovers,
    rooms: &[(String, usize)],
    busy: &HashMap<String, Instant>,
) -> (Vec<String>, Vec<(String, String)>) {
    let mut left: HashMap<&str, usize> = rooms.iter().map(|(h, r)| (h.as_str(), *r)).collect();
    for c in pending {
        if let Some(r) = left.get_mut(c.host.as_str()) {
            *r = r.saturating_sub(1);
        }
    }
    let (mut expired, mut reclaim) = (Vec::new(), Vec::new());
    for (entry, reclaiming) in takeovers {
        if busy.contains_key(&entry.id) {
            continue;
        }
        let Some(room) = left.get_mut(entry.host.as_str()).filter(|r| **r > 0) else {
            continue;
        };
        *room -= 1;
        if reclaiming {
            if let Some(token) = entry.token {
                reclaim.push((entry.id, token));
            }
        } else {
            expired.push(entry.id);
        }
    }
    (expired, reclaim)
}

impl Memory {
    /// A lease write met documents an open transaction holds: what it could not take of
    /// `takes` is left alone for [`BUSY_FOR`], other URLs first.
    fn leave_alone(&mut self, leases: &[UrlLease], takes: &Takes<'_>) {
        let ours: HashSet<&str> = leases.iter().map(|l| l.id.as_str()).collect();
        let until = Instant::now() + BUSY_FOR;
        let held = takes
            .pending
            .iter()
            .map(|c| c.id.as_str())
            .chain(takes.expired.iter().map(String::as_str))
            .chain(takes.reclaim.iter().map(|(id, _)| id.as_str()))
            .filter(|id| !ours.contains(id));
        for id in held {
            self.busy.insert(id.to_owned(), until);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn land(rounds: &mut Rounds, sent_busy: bool, busy_now: bool) {
        rounds.send(0, sent_busy, Box::pin(async { Ok(LeaseStep::Busy) }));
        rounds.round = None;
        rounds.landed(&LeaseStep::Busy, 0, busy_now);
    }

    #[test]
    fn a_round_that_found_only_pages_in_flight_starts_no_dry_spell_once_they_are_gone() {
        let mut rounds = Rounds::default();
        land(&mut rounds, true, false);
        assert!(rounds.dry.is_none(), "the next round looks at once");
        land(&mut rounds, true, true);
        assert!(
            rounds.dry.is_some(),
            "still in flight: the dry spell starts"
        );
        let mut rounds = Rounds::default();
        land(&mut rounds, false, false);
        assert!(
            rounds.dry.is_some(),
            "busy with nothing in flight (a paused host): the dry spell starts"
        );
    }
}
