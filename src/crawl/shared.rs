//! What the stages of one bot's crawl share: the bot and its rules with the instance's handles
//! ([`Shared`], read-only), and what this instance remembers of the pass it crawls
//! ([`PassMemory`]: the hosts with work, the links it enqueued, the table of listed items) —
//! written by the lease and follow stages, each through its own method here.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::known::Known;
use super::pass::Pass;
use super::stages::Stages;
use crate::clock::ServerClock;
use crate::config::{CrawlLimits, CrawlSettings, IncrementalMode};
use crate::error::Result;
use crate::flow::Flow;
use crate::ids::{BotId, InstanceId, PassNumber};
use crate::metrics::Metrics;
use crate::store::frontier::{KnownPage, NewUrl, PageKind, UrlLease};
use crate::store::passes::DeletionRules;
use crate::store::Store;
use crate::urls::NormalizedUrl;

/// Links remembered per pass as already enqueued (about 20 bytes each: their ids as numbers).
const ENQUEUED_CACHE: usize = 100_000;

/// A frontier id as [`PassMemory`] remembers it: its 128 bits as one number (every `url_id` is
/// 32 hex digits; another id is not remembered, so it is never taken as enqueued).
fn id_bits(id: &str) -> Option<u128> {
    crate::store::frontier::packed_id(id).map(u128::from_be_bytes)
}

/// The bot a crawler crawls, its rules, and the instance's handles every stage reads.
pub(crate) struct Shared {
    pub bot: BotId,
    pub rules: Arc<CrawlSettings>,
    pub limits: CrawlLimits,
    pub store: Store,
    pub clock: Arc<ServerClock>,
    pub me: InstanceId,
    pub metrics: Arc<Metrics>,
    /// Per-host limits, shared by every bot of the instance.
    pub flow: Arc<Flow>,
    /// How many items each stage holds (for an operator).
    pub stages: Arc<Stages>,
    /// The priorities above the lowest, highest first.
    pub levels: Vec<i64>,
    pub lowest: i64,
    /// How long the pagination chain's writes (a listing page's next page enqueued and leased
    /// here) take lately, the server's load included.
    pub chain_writes: MovingAverage,
}

/// A fast-moving average of durations (each new one weighs a fifth), shared between tasks.
#[derive(Debug, Default)]
pub(crate) struct MovingAverage {
    /// In µs; 0 before the first.
    micros: AtomicU64,
}

impl MovingAverage {
    /// Counts `took` into the average.
    pub(crate) fn note(&self, took: Duration) {
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        let _ = self
            .micros
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 {
                    took
                } else {
                    avg.saturating_mul(4).saturating_add(took) / 5
                })
            });
    }

    /// The average, `None` before the first duration.
    pub(crate) fn get(&self) -> Option<Duration> {
        match self.micros.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

impl Shared {
    /// Whether the pagination chain's write outlasts a fetch from `host`: the chain's writes as
    /// long as they take lately (before the first, the database's shortest round trip) at least
    /// the host's recent answer time. Only then is the chain's next page fetched while the write
    /// that leases it is on its way (see `Follower::upsert_links`): the fetch hides the write.
    /// Not before both are measured. The server's load counts, not only its distance: with the
    /// database and the demo shop on one machine, a round trip of 0.5 ms grows to 2–9 ms while
    /// the pages a listing page revealed are committed, against answers of about 1 ms.
    pub(crate) fn write_outlasts_fetch(&self, host: &str) -> bool {
        let write = self.chain_writes.get().or_else(|| self.clock.round_trip());
        match (write, self.flow.latency(host)) {
            (Some(write), Some(fetch)) => write >= fetch,
            _ => false,
        }
    }

    /// The priority levels of `rules`: those above the lowest (highest first) and the lowest.
    pub(crate) fn levels(rules: &CrawlSettings) -> (Vec<i64>, i64) {
        let mut all: Vec<i64> = [PageKind::Seed, PageKind::List, PageKind::Detail]
            .iter()
            .map(|k| k.default_priority())
            .chain(rules.priorities.iter().map(|(_, p)| *p))
            .collect();
        all.sort_unstable_by(|a, b| b.cmp(a));
        all.dedup();
        let lowest = all.pop().unwrap_or(0);
        (all, lowest)
    }

    /// The first `[bots.crawl] priority` pattern that matches, else the kind's default.
    pub(crate) fn priority_of(&self, url: &NormalizedUrl, kind: PageKind) -> i64 {
        self.rules
            .priorities
            .iter()
            .find(|(pattern, _)| pattern.is_match(url.as_str()))
            .map_or_else(|| kind.default_priority(), |(_, p)| *p)
    }

    /// A followed link's kind: a detail page when the record rules match it, else a listing
    /// page.
    pub(crate) fn kind_of(&self, link: &NormalizedUrl) -> PageKind {
        match &self.rules.record {
            Some(r) if r.url_match.is_match(link.as_str()) => PageKind::Detail,
            _ => PageKind::List,
        }
    }

    /// The incremental mode a pass crawls in: `full` for a pass that refetches everything (its
    /// spec changed), else the bot's.
    pub(crate) fn mode(&self, pass: &Pass) -> IncrementalMode {
        if pass.refetch {
            IncrementalMode::Full
        } else {
            self.rules.incremental.mode
        }
    }

    /// Load shedding: a lowest-priority URL that waited longer than `crawl.shed_after` for a
    /// host that throttled us within the last minute is deferred (once a pass), before it costs
    /// a fetch.
    pub(crate) fn should_shed(&self, lease: &UrlLease, now: DateTime<Utc>) -> bool {
        lease.sheds == 0
            && should_shed(
                lease.priority,
                self.lowest,
                !self.levels.is_empty(),
                lease
                    .eligible_since
                    .and_then(|t| (now - t).to_std().ok())
                    .unwrap_or_default(),
                self.limits.shed_after,
                self.flow
                    .throttled_within(&lease.host(), Duration::from_secs(60)),
            )
    }

    /// What a pass's end may remove, by the bot's rules and the pass.
    pub(crate) fn deletion_rules(&self, pass: &Pass) -> DeletionRules {
        DeletionRules {
            known_since: pass.last_run_at,
            enabled: self.rules.incremental.mode != IncrementalMode::Watermark,
            min_coverage: self.limits.min_coverage,
            max_error_rate: self.limits.max_error_rate,
            drift: self.rules.drift,
        }
    }

    /// `crawl.max_uncommitted_bytes` in KiB (the byte budget's unit).
    pub(crate) fn bytes_kib(&self) -> u32 {
        u32::try_from(self.limits.max_uncommitted_bytes / 1024)
            .unwrap_or(u32::MAX)
            .max(1)
    }
}

/// Whether to defer a leased URL rather than fetch it: only the lowest priority class (and only
/// when there is a higher one), only once it has waited past `shed_after`, and only for a host
/// that is pushing back.
pub(crate) fn should_shed(
    priority: i64,
    lowest: i64,
    has_higher: bool,
    waited: Duration,
    shed_after: Duration,
    host_throttling: bool,
) -> bool {
    has_higher && priority <= lowest && waited > shed_after && host_throttling
}

/// A listing page of the last complete pass waiting to be leased into the current one: the link,
/// its frontier id, and what its entry held (its validators go with the lease).
#[derive(Clone, Debug)]
pub(crate) struct WaitingListing {
    pub url: NewUrl,
    pub id: String,
    pub known: KnownPage,
}

/// What this instance remembers of the pass it crawls, across slices; each part belongs to one
/// pass and starts empty in the next.
#[derive(Default)]
pub(crate) struct PassMemory {
    /// Hosts with work in a pass, as far as this instance knows.
    hosts: Mutex<(PassNumber, BTreeSet<String>)>,
    /// Frontier ids of links this instance enqueued in a pass (bounded; cleared when full).
    enqueued: Mutex<(PassNumber, HashSet<u128>)>,
    /// The pass into which this instance enqueued the last complete pass's listing pages.
    listings_in: AtomicI64,
    /// The pass in which a page fetched ahead of its enqueue's answer was not this instance's.
    ahead_missed_in: AtomicI64,
    /// The last complete pass's listing pages still to be leased into a pass, per host (see
    /// [`PassMemory::wait_listings`]).
    waiting: Mutex<(PassNumber, HashMap<String, VecDeque<WaitingListing>>)>,
    /// The listed items known stored, read from the manifests once per pass.
    known: tokio::sync::Mutex<Option<Arc<Known>>>,
    /// The pass's page bounds, as this instance counts them.
    pub(crate) budget: super::bounds::PageBudget,
}

impl PassMemory {
    /// The hosts this instance knows to have work in `pass`.
    pub(crate) fn hosts(&self, pass: PassNumber) -> BTreeSet<String> {
        let hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        if hosts.0 == pass {
            hosts.1.clone()
        } else {
            BTreeSet::new()
        }
    }

    /// Adds `host` to the hosts with work in `pass`.
    pub(crate) fn note_host(&self, pass: PassNumber, host: String) {
        let mut hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        if hosts.0 != pass {
            *hosts = (pass, BTreeSet::new());
        }
        hosts.1.insert(host);
    }

    /// Remembers frontier ids this instance put into `pass` (bounded: cleared when full).
    pub(crate) fn remember_enqueued(&self, pass: PassNumber, ids: Vec<String>) {
        let mut cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 != pass || cache.1.len() + ids.len() > ENQUEUED_CACHE {
            *cache = (pass, HashSet::new());
        }
        cache.1.extend(ids.iter().filter_map(|id| id_bits(id)));
    }

    /// Whether a page this instance fetched ahead of its enqueue's answer in `pass` turned out
    /// not to be its own (then it fetches no more ahead in that pass).
    pub(crate) fn ahead_missed(&self, pass: PassNumber) -> bool {
        self.ahead_missed_in.load(Ordering::Relaxed) == pass.get()
    }

    pub(crate) fn note_ahead_missed(&self, pass: PassNumber) {
        self.ahead_missed_in.store(pass.get(), Ordering::Relaxed);
    }

    /// Forgets frontier ids remembered for `pass` whose enqueue failed.
    pub(crate) fn forget_enqueued(&self, pass: PassNumber, ids: &[String]) {
        let mut cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 == pass {
            for bits in ids.iter().filter_map(|id| id_bits(id)) {
                cache.1.remove(&bits);
            }
        }
    }

    /// Whether this instance put the link with frontier id `id` into `pass` (as far as it
    /// remembers).
    pub(crate) fn enqueued(&self, pass: PassNumber, id: &str) -> bool {
        let cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        cache.0 == pass && id_bits(id).is_some_and(|bits| cache.1.contains(&bits))
    }

    /// Whether this instance enqueued the last pass's listing pages into `pass` (then none can
    /// be unreached at its end).
    pub(crate) fn listings_enqueued(&self, pass: PassNumber) -> bool {
        self.listings_in.load(Ordering::Relaxed) == pass.get()
    }

    pub(crate) fn set_listings_enqueued(&self, pass: PassNumber) {
        self.listings_in.store(pass.get(), Ordering::Relaxed);
    }

    /// The last complete pass's listing pages, read at `pass`'s start, wait here to be leased
    /// into it straight from their entries ([`PassMemory::take_listings`]): one write a page
    /// moves it into the pass and leases it, where resetting every page pending first and
    /// leasing it later took two. (Replaces what waited before: a slice reads them again.)
    pub(crate) fn wait_listings(&self, pass: PassNumber, pages: Vec<WaitingListing>) {
        let mut by_host: HashMap<String, VecDeque<WaitingListing>> = HashMap::new();
        for page in pages {
            by_host
                .entry(page.url.url.host_port())
                .or_default()
                .push_back(page);
        }
        *self.waiting.lock().unwrap_or_else(|p| p.into_inner()) = (pass, by_host);
    }

    /// Listing pages taken from those waiting for `pass` whose lease write failed: they wait
    /// again, first in line (unless a new read replaced what waits).
    pub(crate) fn wait_again(&self, pass: PassNumber, pages: Vec<WaitingListing>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting.0 != pass {
            return;
        }
        for page in pages.into_iter().rev() {
            waiting
                .1
                .entry(page.url.url.host_port())
                .or_default()
                .push_front(page);
        }
    }

    /// Up to `n` of the listing pages waiting for `pass` on `host`, taken out, and whether none
    /// is left waiting on any host after them.
    pub(crate) fn take_listings(
        &self,
        pass: PassNumber,
        host: &str,
        n: usize,
    ) -> (Vec<WaitingListing>, bool) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting.0 != pass {
            return (Vec::new(), false);
        }
        let taken = match waiting.1.get_mut(host) {
            Some(queue) => {
                let k = n.min(queue.len());
                queue.drain(..k).collect()
            }
            None => Vec::new(),
        };
        waiting.1.retain(|_, queue| !queue.is_empty());
        (taken, waiting.1.is_empty())
    }

    /// The table of listed items known stored ([`Known`]) for `pass`: read once per pass (ahead,
    /// when a slice opens; a listing page that comes first waits for it), then shared.
    pub(crate) async fn known_items(
        &self,
        store: &Store,
        bot: &BotId,
        pass: PassNumber,
    ) -> Result<Arc<Known>> {
        let mut held = self.known.lock().await;
        if let Some(table) = held.as_ref().filter(|t| t.pass == pass) {
            return Ok(table.clone());
        }
        // The last pass's table goes first: two at once would double the memory.
        *held = None;
        let t0 = tokio::time::Instant::now();
        let table = Arc::new(Known::read(store, bot, pass).await?);
        tracing::debug!(%bot, pass = pass.get(), items = table.len(), took = ?t0.elapsed(), "listed items read from the manifests");
        *held = Some(table.clone());
        Ok(table)
    }

    /// Whether the table of listed items of `pass` is read, or being read (its reader holds
    /// the lock).
    pub(crate) fn holds_known(&self, pass: PassNumber) -> bool {
        match self.known.try_lock() {
            Ok(held) => held.as_ref().is_some_and(|t| t.pass == pass),
            Err(_) => true,
        }
    }

    /// Drops the table of listed items of `pass` (its pass is over).
    pub(crate) async fn forget_known(&self, pass: PassNumber) {
        let mut held = self.known.lock().await;
        if held.as_ref().is_some_and(|t| t.pass == pass) {
            *held = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moving_average_starts_at_its_first_duration_and_weighs_each_next_a_fifth() {
        let average = MovingAverage::default();
        assert_eq!(average.get(), None, "nothing measured yet");
        average.note(Duration::from_millis(10));
        assert_eq!(average.get(), Some(Duration::from_millis(10)));
        // (4 × 10 + 60) / 5 = 20: a loaded write moves it at once, and a fast one back.
        average.note(Duration::from_millis(60));
        assert_eq!(average.get(), Some(Duration::from_millis(20)));
        average.note(Duration::from_millis(5));
        assert_eq!(average.get(), Some(Duration::from_millis(17)));
        // A zero-length duration still counts as measured, and nothing overflows.
        let quick = MovingAverage::default();
        quick.note(Duration::ZERO);
        assert!(quick.get().is_some());
        quick.note(Duration::MAX);
        quick.note(Duration::MAX);
        assert!(quick
            .get()
            .is_some_and(|d| d > Duration::from_secs(1_000_000)));
    }

    #[test]
    fn only_old_lowest_priority_work_of_a_throttling_host_is_shed() {
        let (after, long, short) = (
            Duration::from_secs(600),
            Duration::from_secs(601),
            Duration::from_secs(599),
        );
        assert!(should_shed(0, 0, true, long, after, true));
        // Not a higher priority, not fresh work, not a calm host, not when all work is alike.
        assert!(!should_shed(1, 0, true, long, after, true));
        assert!(!should_shed(0, 0, true, short, after, true));
        assert!(!should_shed(0, 0, true, long, after, false));
        assert!(!should_shed(0, 0, false, long, after, true));
    }

    #[test]
    fn what_is_remembered_of_a_pass_is_forgotten_in_the_next() {
        let memory = PassMemory::default();
        let (one, two) = (PassNumber::new(1), PassNumber::new(2));
        let x = "0123456789abcdef0123456789abcdef";
        memory.note_host(one, "a:80".into());
        memory.remember_enqueued(one, vec![x.into(), "not-an-id".into()]);
        assert!(memory.hosts(one).contains("a:80"));
        assert!(memory.enqueued(one, x));
        assert!(
            !memory.enqueued(one, "not-an-id"),
            "an id that is not 32 hex digits is never taken as enqueued"
        );
        memory.forget_enqueued(one, &[x.to_owned()]);
        assert!(!memory.enqueued(one, x), "a failed enqueue is forgotten");
        memory.remember_enqueued(one, vec![x.into()]);
        memory.remember_enqueued(one, vec![x.to_uppercase()]);
        assert!(
            !memory.enqueued(one, &x.to_uppercase()),
            "nor one in capitals (no url_id is spelt so)"
        );
        assert!(
            !memory.enqueued(one, "0123456789abcdef0123456789abcdee"),
            "every bit of an id counts"
        );
        assert!(memory.hosts(two).is_empty() && !memory.enqueued(two, x));
        memory.note_host(two, "b:80".into());
        assert!(memory.hosts(one).is_empty(), "a new pass starts afresh");
    }

    #[test]
    fn waiting_listing_pages_are_taken_per_host_until_none_is_left() {
        let page = |url: &str| WaitingListing {
            url: NewUrl {
                url: NormalizedUrl::parse(url).unwrap(),
                kind: PageKind::List,
                fingerprint: None,
                priority: 1,
                depth: 0,
            },
            id: url.to_owned(),
            known: KnownPage {
                pass: PassNumber::new(1),
                status: None,
                fingerprint: None,
                record_id: None,
                validators: Default::default(),
                depth: 0,
            },
        };
        let memory = PassMemory::default();
        let (one, two) = (PassNumber::new(1), PassNumber::new(2));
        let urls = [
            "http://a.test/1",
            "http://b.test/1",
            "http://a.test/2",
            "http://a.test/3",
        ];
        memory.wait_listings(two, urls.iter().map(|u| page(u)).collect());
        let ids = |taken: Vec<WaitingListing>| taken.into_iter().map(|w| w.id).collect::<Vec<_>>();
        let (taken, drained) = memory.take_listings(one, "a.test:80", 10);
        assert!(
            taken.is_empty() && !drained,
            "another pass's pages are not this one's"
        );
        let (taken, drained) = memory.take_listings(two, "a.test:80", 2);
        assert_eq!(
            ids(taken),
            ["http://a.test/1", "http://a.test/2"],
            "in order, up to the room"
        );
        assert!(!drained);
        let (taken, drained) = memory.take_listings(two, "a.test:80", 2);
        assert_eq!(ids(taken), ["http://a.test/3"]);
        assert!(!drained, "b.test's page still waits");
        let (taken, drained) = memory.take_listings(two, "b.test:80", 0);
        assert!(taken.is_empty() && !drained, "no room takes nothing");
        let (taken, drained) = memory.take_listings(two, "b.test:80", 5);
        assert_eq!(ids(taken.clone()), ["http://b.test/1"]);
        assert!(drained, "none is left");
        // A lease write that failed puts its pages back, first in line.
        memory.wait_again(two, taken);
        let (taken, drained) = memory.take_listings(two, "b.test:80", 5);
        assert_eq!(ids(taken), ["http://b.test/1"]);
        assert!(drained);
    }
}
