//! The lease stage: one [`Crawler::lease_step`] is one batched lease round trip — the pending
//! URLs of the hosts with room in this instance's queues, as many as there is room for, taken in
//! one conditional `update` ([`Frontier::take_leases`](crate::store::Frontier::take_leases)).
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
//! same round trip; retries that came due go back to pending about once a second.

use crate::ids::PassNumber;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::dispatch::{HostQueues, Queued};
use super::{Crawler, Pass};
use crate::error::Result;
use crate::store::frontier::{
    Candidate, CandidateQuery, PageKind, Priority, Takes, UrlLease, SLOTS,
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
pub enum LeaseStep {
    /// URLs leased to this instance (already in its host queues).
    Leased(usize),
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
pub struct Leaser {
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

impl Leaser {
    fn start(&mut self, pass: PassNumber) {
        if self.pass != pass {
            *self = Leaser {
                pass,
                ..Leaser::default()
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

impl Crawler {
    /// One lease round: up to the room in this instance's host queues, per host, highest
    /// priority first, leased in one round trip and put into `queues`. Finds the pipeline busy,
    /// the pass idle, or the pass over when there is nothing to lease.
    pub async fn lease_step(
        &self,
        pass: &Pass,
        queues: &HostQueues,
        in_pipeline: bool,
    ) -> Result<LeaseStep> {
        let mut leaser = self.leaser.lock().await;
        leaser.start(pass.number);
        let now = Instant::now();
        // Retries that came due go back to pending about once a second.
        if Leaser::due(&mut leaser.last_promotion, Duration::from_secs(1), now) {
            self.store
                .frontier()
                .promote_due(&self.bot, pass.number, self.clock.now())
                .await?;
        }
        let mut hosts = self.pass_hosts(pass.number);
        if hosts.is_empty() {
            // The hosts of the seeds and of the scope, to begin with; more are learnt from
            // what this instance enqueues and leases, and from a `distinct` when the pass has
            // work on none of them.
            for host in pass.seed_hosts.iter().chain(&self.rules.links.scope) {
                if host.contains(':') {
                    self.note_host(pass.number, host.clone());
                }
            }
            hosts = self.pass_hosts(pass.number);
        }
        // Leases past their expiry, and a dead predecessor's (same instance id, taken before
        // this process started: reclaimed at once): read about once a second, and until no
        // predecessor's is left. (An idle instance that asked every round would cost the busy
        // ones a read of every lease of the pass each time.)
        let mut takeovers = Vec::new();
        let check =
            !leaser.reclaimed || Leaser::due(&mut leaser.last_leased_check, LEASED_CHECK, now);
        if check {
            let server_now = self.clock.now();
            let entries = self
                .store
                .frontier()
                .leased_entries(&self.bot, pass.number)
                .await?;
            let dead = self.dead_owners(&entries, server_now).await?;
            let mut predecessor = false;
            for entry in entries {
                let mine = entry.owner.as_deref() == Some(self.me.as_str());
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
                        .is_some_and(|t| leaser.abandoned.contains(t));
                let reclaim = (mine && (before || late)) || orphan;
                predecessor |= reclaim;
                if reclaim || entry.expires_at.is_some_and(|t| t <= server_now) {
                    hosts.insert(entry.host.clone());
                    takeovers.push((entry, reclaim));
                }
            }
            leaser.reclaimed = !predecessor;
        }
        let paused: HashSet<String> = self
            .flow
            .paused_hosts(now)
            .into_iter()
            .map(|(h, _)| h)
            .collect();
        // Room per host, reserved for this round's leases.
        let mut rooms: Vec<(String, usize)> = Vec::new();
        let order: Vec<&String> = hosts.iter().collect();
        let start = leaser.rotate % order.len().max(1);
        leaser.rotate = leaser.rotate.wrapping_add(1);
        for host in order.iter().cycle().skip(start).take(order.len()) {
            if paused.contains(*host) || rooms.len() >= HOSTS_PER_ROUND {
                continue;
            }
            let target = self.queue_target(host, queues);
            let room = queues.reserve(host, usize::MAX, target);
            tracing::trace!(host = %host, target, room, queued = queues.len(), all = queues.room(), "room");
            if room > 0 {
                rooms.push(((*host).clone(), room));
            }
        }
        let t0 = Instant::now();
        let result = self
            .lease_into(&mut leaser, pass, queues, &rooms, takeovers)
            .await;
        tracing::trace!(rooms = ?rooms, took = ?t0.elapsed(), leased = ?result.as_ref().ok(), "lease round");
        if result.is_ok() && !rooms.is_empty() {
            self.lease_round_took(t0.elapsed());
        }
        for (host, room) in &rooms {
            queues.unreserve(host, *room);
        }
        let leased = result?;
        self.metrics.lease_query(&self.bot, leased > 0);
        if leased > 0 {
            return Ok(LeaseStep::Leased(leased));
        }
        let refresh = Leaser::due(&mut leaser.last_hosts_refresh, HOSTS_REFRESH, now);
        drop(leaser);
        self.nothing_to_lease(
            pass,
            in_pipeline,
            !paused.is_empty() || rooms.is_empty(),
            refresh,
        )
        .await
    }

    /// Among the owners of `entries` other than this instance, those whose process is gone:
    /// its registration expired (no heartbeat for `lock.ttl`), or another process took the id
    /// over. Each maps to the time before which its leases are a dead process's (a taken-over
    /// id's new process leases too). One read, only when others hold leases that have not
    /// expired; an owner without a registration is left to its lease's expiry.
    async fn dead_owners(
        &self,
        entries: &[crate::store::frontier::LeasedEntry],
        server_now: chrono::DateTime<chrono::Utc>,
    ) -> Result<HashMap<String, chrono::DateTime<chrono::Utc>>> {
        let mut owners: Vec<&str> = entries
            .iter()
            .filter(|e| e.expires_at.is_some_and(|t| t > server_now))
            .filter_map(|e| e.owner.as_deref())
            .filter(|o| *o != self.me.as_str())
            .collect();
        owners.sort_unstable();
        owners.dedup();
        if owners.is_empty() {
            return Ok(HashMap::new());
        }
        let registrations = self.store.instances().registrations(&owners).await?;
        Ok(registrations
            .into_iter()
            .filter_map(|(id, p)| {
                if p.expires_at.is_none_or(|t| t <= server_now) {
                    // Every lease it took is a dead process's.
                    Some((id, chrono::DateTime::<chrono::Utc>::MAX_UTC))
                } else {
                    // Taken over: the leases its predecessor took before this process started.
                    p.started_at.map(|started| (id, started))
                }
            })
            .collect())
    }

    /// The round trips of a round: candidates of every host with room (one query per level,
    /// all at once), expired and reclaimable leases, then the take. Returns how many were
    /// leased (and queued).
    async fn lease_into(
        &self,
        leaser: &mut Leaser,
        pass: &Pass,
        queues: &HostQueues,
        rooms: &[(String, usize)],
        takeovers: Vec<(crate::store::frontier::LeasedEntry, bool)>,
    ) -> Result<usize> {
        let server_now = self.clock.now();
        let mut queries = Vec::new();
        for (host, room) in rooms {
            // Levels above the lowest are few (seeds, listing pages): one range query, unless
            // one of them turned out dense here (then each is asked for by slot).
            let dense = self.levels.iter().any(|level| {
                leaser
                    .density
                    .get(&(host.clone(), *level))
                    .is_some_and(|d| d * f64::from(SLOTS) > SPARSE)
            });
            if dense {
                for level in &self.levels {
                    queries.push(leaser.query(host, Priority::Exactly(*level), *level, *room));
                }
            } else if !self.levels.is_empty() {
                queries.push(leaser.query(
                    host,
                    Priority::Above(self.lowest),
                    self.levels[0],
                    *room,
                ));
            }
            queries.push(leaser.query(host, Priority::Exactly(self.lowest), self.lowest, *room));
        }
        let found = self
            .store
            .frontier()
            .lease_candidates(&self.bot, pass.number, &queries)
            .await?;
        for (query, found) in queries.iter().zip(&found) {
            leaser.learn(query, &self.levels, found);
        }
        // Per host: the highest priorities first, up to its room.
        let room_of: HashMap<&str, usize> = rooms.iter().map(|(h, r)| (h.as_str(), *r)).collect();
        let mut by_host: HashMap<&str, Vec<Candidate>> = HashMap::new();
        for candidate in found.into_iter().flatten() {
            by_host
                .entry(
                    rooms
                        .iter()
                        .find(|(h, _)| *h == candidate.host)
                        .map_or("", |(h, _)| h.as_str()),
                )
                .or_default()
                .push(candidate);
        }
        let now = Instant::now();
        leaser.busy.retain(|_, until| *until > now);
        let busy = &leaser.busy;
        let mut pending: Vec<Candidate> = Vec::new();
        for (host, mut candidates) in by_host {
            candidates.sort_by_key(|c| std::cmp::Reverse(c.priority));
            let mut seen = HashSet::new();
            candidates.retain(|c| !busy.contains_key(&c.id) && seen.insert(c.id.clone()));
            candidates.truncate(room_of.get(host).copied().unwrap_or(0));
            pending.extend(candidates);
        }
        // Takeovers fit in the room their host has left after its pending URLs.
        let mut left: HashMap<&str, usize> = room_of.clone();
        for c in &pending {
            if let Some(r) = left.get_mut(c.host.as_str()) {
                *r = r.saturating_sub(1);
            }
        }
        let mut expired = Vec::new();
        let mut reclaim = Vec::new();
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
        if pending.is_empty() && expired.is_empty() && reclaim.is_empty() {
            return Ok(0);
        }
        let taken = self
            .store
            .frontier()
            .take_leases(
                &self.bot,
                pass.number,
                &self.me,
                server_now,
                self.limits.url_lease,
                Takes {
                    pending: &pending,
                    expired: &expired,
                    reclaim: &reclaim,
                },
            )
            .await?;
        if let Some(token) = taken.abandoned {
            leaser.abandoned.insert(token);
            // Checked every round until none of its entries is left.
            leaser.reclaimed = false;
        }
        if taken.held {
            // What the write could not take is held by a transaction: other URLs first.
            let ours: HashSet<&str> = taken.leases.iter().map(|l| l.id.as_str()).collect();
            let until = Instant::now() + BUSY_FOR;
            let held = pending
                .iter()
                .map(|c| c.id.as_str())
                .chain(expired.iter().map(String::as_str))
                .chain(reclaim.iter().map(|(id, _)| id.as_str()))
                .filter(|id| !ours.contains(id));
            for id in held {
                leaser.busy.insert(id.to_owned(), until);
            }
            debug!(bot = %self.bot, busy = leaser.busy.len(), "lease write met an open transaction; leasing other URLs");
        }
        let n = taken.leases.len();
        self.queue_leases(taken.leases, queues).await?;
        Ok(n)
    }

    /// Puts leased URLs into the host queues — except a lowest-priority URL that should be shed
    /// (see [`super::should_shed`]), which is deferred unfetched.
    async fn queue_leases(&self, leases: Vec<UrlLease>, queues: &HostQueues) -> Result<()> {
        let now = self.clock.now();
        let mut shed = Vec::new();
        for lease in leases {
            if lease.reclaimed {
                debug!(bot = %self.bot, url = %lease.url, "reclaimed a dead process's lease");
            }
            if self.should_shed(&lease, now) {
                shed.push(lease);
            } else {
                queues.push(Queued {
                    ticket: self.stages.host_queue.enter(),
                    lease,
                });
            }
        }
        if !shed.is_empty() {
            let until = crate::store::plus(now, self.limits.shed_after);
            let marks: Vec<_> = shed
                .iter()
                .map(|l| (l, crate::store::frontier::Mark::Shed { not_before: until }))
                .collect();
            self.store.frontier().settle_urls(&marks, now).await?;
            for _ in &shed {
                self.metrics.shed(&self.bot);
            }
        }
        Ok(())
    }

    /// Enqueues the listing pages the last complete pass read into `pass` at its start (where
    /// the incremental mode reads every listing page): they are read side by side instead of one
    /// pagination link after the other, and the chain still finds the pages that are new. (A
    /// listing page that the chain does not reach any more is read as before, when the pass
    /// would end — see [`Crawler::nothing_to_lease`].)
    pub(super) async fn enqueue_known_listings(&self, pass: &Pass) -> Result<()> {
        let (true, Some(since)) = (self.deletion_rules(pass).enabled, pass.last_run_at) else {
            return Ok(());
        };
        let known = self
            .store
            .passes()
            .unreached_list_urls(&self.bot, pass.number, since)
            .await?;
        if known.is_empty() {
            return Ok(());
        }
        for url in &known {
            self.note_host(pass.number, url.host_port());
        }
        let links: Vec<crate::store::frontier::NewUrl> = known
            .into_iter()
            .map(|url| crate::store::frontier::NewUrl {
                priority: self.priority_of(&url, PageKind::List),
                url,
                kind: PageKind::List,
                fingerprint: None,
            })
            .collect();
        let added = self
            .store
            .frontier()
            .enqueue_urls(&self.bot, pass.number, &links, self.clock.now())
            .await?;
        // In the pass now: a listing page that links to one of them (the next page of the chain)
        // needs no round trip to enqueue it again.
        self.remember_enqueued(
            pass.number,
            links
                .iter()
                .map(|l| crate::store::frontier::url_id(&self.bot, &l.url))
                .collect(),
        );
        debug!(bot = %self.bot, pass = pass.number.get(), pages = links.len(), added, "the last pass's listing pages enqueued");
        Ok(())
    }

    /// Whether this instance enqueued the last pass's listing pages into `pass` (then none can
    /// be unreached at its end).
    fn listings_enqueued(&self, pass: &Pass) -> bool {
        self.listings_in.load(std::sync::atomic::Ordering::Relaxed) == pass.number.get()
    }

    /// The hosts this instance knows to have work in `pass`.
    fn pass_hosts(&self, pass: PassNumber) -> BTreeSet<String> {
        let hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        if hosts.0 == pass {
            hosts.1.clone()
        } else {
            BTreeSet::new()
        }
    }

    /// Adds `host` to the hosts with work in `pass`.
    pub(super) fn note_host(&self, pass: PassNumber, host: String) {
        let mut hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        if hosts.0 != pass {
            *hosts = (pass, BTreeSet::new());
        }
        hosts.1.insert(host);
    }

    /// Reads the hosts with pending work in `pass` (one `distinct`) and remembers them.
    async fn refresh_hosts(&self, pass: PassNumber) -> Result<BTreeSet<String>> {
        let found = self
            .store
            .frontier()
            .hosts_with_work(&self.bot, pass)
            .await?;
        for host in found {
            self.note_host(pass, host);
        }
        Ok(self.pass_hosts(pass))
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
        debug!(bot = %self.bot, pass = pass.number.get(), "nothing to lease and nothing in flight here");
        if self
            .store
            .frontier()
            .pass_has_work(&self.bot, pass.number)
            .await?
        {
            // Work on a host this instance does not know of is found by a later round.
            if refresh_hosts {
                match self.refresh_hosts(pass.number).await {
                    Ok(_) => {}
                    // A huge pending set can take longer than an operation may: the hosts
                    // the instance knows keep it busy meanwhile.
                    Err(e) if e.is_transient() => {
                        warn!(bot = %self.bot, error = %e, "could not read the hosts with pending work; trying again later");
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
        // Listing pages link one to the next: one that failed hides the rest from this pass.
        // The listing pages the last complete pass read and this one never reached are
        // enqueued before the pass may end (not in watermark mode, which stops on purpose) —
        // unless this instance enqueued them all when the pass started.
        let mut rules = self.deletion_rules(pass);
        if self.listings_enqueued(pass) {
            rules.known_since = None;
        }
        if let (true, Some(since)) = (rules.enabled, rules.known_since) {
            let missed = self
                .store
                .passes()
                .unreached_list_urls(&self.bot, pass.number, since)
                .await?;
            if !missed.is_empty() {
                warn!(
                    bot = %self.bot, pass = pass.number.get(), pages = missed.len(),
                    "listing pages the last pass read were not reached (a broken pagination chain?); enqueuing them"
                );
                for url in &missed {
                    self.note_host(pass.number, url.host_port());
                }
                self.store
                    .frontier()
                    .enqueue(
                        &self.bot,
                        pass.number,
                        PageKind::List,
                        &missed,
                        self.clock.now(),
                    )
                    .await?;
                return Ok(LeaseStep::Busy);
            }
        }
        // One leaser of this instance ends the pass (it counts the whole pass).
        let Ok(_finishing) = self.finishing.try_lock() else {
            return Ok(LeaseStep::Idle);
        };
        let end = self
            .store
            .passes()
            .finish(
                &self.bot,
                pass.number,
                pass.started_at,
                rules,
                &self.me,
                self.clock.now(),
            )
            .await?;
        if !end.finished {
            return Ok(LeaseStep::Idle);
        }
        // The pass's table of listed items is of no use any more (the next pass reads its own).
        self.forget_known(pass.number).await;
        if end.recorded {
            self.metrics.pass_finished(&self.bot);
            info!(
                bot = %self.bot, pass = end.pass.get(), done = end.progress.done, failed = end.progress.failed,
                coverage = end.coverage, error_rate = end.error_rate, removed = end.removed,
                restored = end.restored,
                deletion = end.deletion_skipped.as_deref().unwrap_or("applied"),
                "crawl pass finished"
            );
        }
        Ok(LeaseStep::PassFinished(end))
    }
}
