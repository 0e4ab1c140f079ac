//! Flow control for fetching: one adaptive limiter per host (`host:port`) under a global cap.
//!
//! - **AIMD** per host: the limit starts at `initial`, grows by `1/limit` per success up to the
//!   host's ceiling, and halves (not below the floor) on a throttle (`429`/`503`), a timeout, or
//!   latency rising above twice its long-run average. Like TCP, one halving per window: signals
//!   from requests admitted before the last decrease do not cut again. Near the limit where the
//!   site last throttled, growth is eight times slower (as CUBIC plateaus near its last loss),
//!   so a site with a fixed capacity sees a throttle every few dozen requests, not every few.
//!   Only a success admitted at the limit raises it (a host we do not keep busy says nothing
//!   about its capacity, as TCP's congestion window validation).
//! - **Pause**: `Retry-After` (or robots.txt being unreachable) pauses the host until then; a
//!   paused host admits nothing and the crawl leases none of its URLs.
//! - **Spacing**: a host's request starts are at least its minimum delay apart (politeness, the
//!   host's override, robots.txt `Crawl-delay`, whichever is longest).
//! - **Retry budget**: per host, retries within the sliding window may be at most `retry_budget`
//!   of its first attempts (with a small floor, so a quiet host can still retry).
//!
//! Admission never blocks: [`Flow::try_admit`] answers now, so a caller holding work for a busy
//! host turns to another host instead of waiting in line. [`Flow::changed`] wakes waiters when a
//! permit is returned.
//!
//! **Invariant:** every signal from a site goes to that site's limiter only; nothing here slows
//! a host for another host's trouble.

pub(crate) mod robots;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Per-host settings that differ from the defaults (`[crawl.hosts."host:port"]`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostOverride {
    pub max_limit: Option<u32>,
    pub min_delay: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FlowSettings {
    pub initial_limit: u32,
    pub min_limit: u32,
    pub max_limit: u32,
    /// Politeness: the least time between two request starts on one host.
    pub min_delay: Duration,
    pub hosts: HashMap<String, HostOverride>,
    /// Retries ≤ this share of first attempts over `retry_window`, per host …
    pub retry_budget: f64,
    /// … but at least this many retries per window.
    pub retry_budget_min: u32,
    pub retry_window: Duration,
}

impl Default for FlowSettings {
    fn default() -> Self {
        Self {
            initial_limit: 4,
            min_limit: 1,
            max_limit: 32,
            min_delay: Duration::ZERO,
            hosts: HashMap::new(),
            retry_budget: 0.1,
            retry_budget_min: 10,
            retry_window: Duration::from_secs(60),
        }
    }
}

/// What one fetch told us about its host's capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Signal {
    /// An answer (any status the site chose to send, other than a throttle).
    Answered {
        latency: Duration,
    },
    /// `429` / `503`, with the site's `Retry-After` if it sent one.
    Throttled {
        retry_after: Option<Duration>,
    },
    Timeout,
    /// Nothing learned about the host's capacity (a connection refused, a cancelled fetch).
    Neutral,
}

/// Why a host admits nothing now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Paused until `until` (`Retry-After`, robots.txt unreachable).
    Paused,
    /// Its in-flight requests are at its current limit.
    AtLimit,
    /// It holds its fair share of the caller's fetch slots while other hosts have work.
    AtShare,
    /// Its next request may start only at `until` (minimum delay between requests).
    Spacing,
}

#[derive(Debug)]
pub(crate) enum Admission {
    Admitted(HostPermit),
    Wait { why: Busy, until: Option<Instant> },
}

/// A host's figures for metrics and `status`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HostSnapshot {
    pub host: String,
    pub in_flight: u32,
    pub limit: f64,
    pub paused_for: Option<Duration>,
    pub throttles: u64,
    /// How long ago the host last throttled us.
    pub last_throttle: Option<Duration>,
    pub timeouts: u64,
    pub first_attempts: u64,
    pub retries: u64,
    /// Retries over first attempts within the retry window.
    pub retry_ratio: f64,
    pub blocked: u64,
}

/// Counts per second over a sliding window.
#[derive(Debug, Default)]
struct Window {
    buckets: VecDeque<(u64, u64)>,
}

impl Window {
    fn add(&mut self, second: u64, n: u64) {
        match self.buckets.back_mut() {
            Some((s, count)) if *s == second => *count += n,
            _ => self.buckets.push_back((second, n)),
        }
    }

    fn sum(&mut self, second: u64, window: u64) -> u64 {
        while self
            .buckets
            .front()
            .is_some_and(|(s, _)| *s + window <= second)
        {
            self.buckets.pop_front();
        }
        self.buckets.iter().map(|(_, n)| n).sum()
    }
}

#[derive(Debug)]
struct Host {
    limit: f64,
    floor: f64,
    ceiling: f64,
    min_delay: Duration,
    crawl_delay: Duration,
    in_flight: u32,
    last_start: Option<Instant>,
    next_start: Option<Instant>,
    paused_until: Option<Instant>,
    /// Bumped by every decrease; a permit from an older generation cannot cut again.
    generation: u64,
    /// The limit at the last throttle: growth near it is slow, so the limit stays just under
    /// what the site allows instead of hitting it every few requests.
    throttled_at: Option<f64>,
    fast_latency: Option<f64>,
    slow_latency: Option<f64>,
    throttles: u64,
    last_throttle: Option<Instant>,
    timeouts: u64,
    first_attempts: u64,
    retries: u64,
    blocked: u64,
    firsts_window: Window,
    retries_window: Window,
}

impl Host {
    fn decrease(&mut self, generation: u64, throttled: bool) {
        if generation == self.generation {
            if throttled {
                self.throttled_at = Some(self.limit);
            }
            self.limit = (self.limit / 2.0).max(self.floor);
            self.generation += 1;
        }
    }

    /// Additive increase: `1/limit` per success, an eighth of that within one of the limit
    /// where the site last throttled (a CUBIC-like plateau; past it, full speed again).
    fn increase(&mut self) {
        let mut step = 1.0 / self.limit.floor().max(1.0);
        if self
            .throttled_at
            .is_some_and(|t| self.limit >= t - 1.0 && self.limit < t + 1.0)
        {
            step /= 8.0;
        }
        self.limit = (self.limit + step).min(self.ceiling);
    }

    fn spacing(&self) -> Duration {
        self.min_delay.max(self.crawl_delay)
    }
}

pub struct Flow {
    settings: FlowSettings,
    hosts: Mutex<HashMap<String, Host>>,
    changed: Notify,
    epoch: Instant,
}

/// The right to one request on one host. Return it with [`HostPermit::finish`]; dropped
/// unfinished, it counts as [`Signal::Neutral`].
#[derive(Debug)]
pub(crate) struct HostPermit {
    flow: Arc<Flow>,
    host: String,
    generation: u64,
    /// Admitted with the host at its limit: only such a request's success shows the limit is
    /// too low (a host we do not keep busy teaches nothing about its capacity).
    saturated: bool,
    finished: bool,
}

impl std::fmt::Debug for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flow").finish_non_exhaustive()
    }
}

impl Flow {
    pub(crate) fn new(settings: FlowSettings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            hosts: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            epoch: Instant::now(),
        })
    }

    pub(crate) fn settings(&self) -> &FlowSettings {
        &self.settings
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Host>> {
        self.hosts.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn second(&self, now: Instant) -> u64 {
        now.duration_since(self.epoch).as_secs()
    }

    fn host<'a>(&self, hosts: &'a mut HashMap<String, Host>, name: &str) -> &'a mut Host {
        hosts.entry(name.to_owned()).or_insert_with(|| {
            let o = self.settings.hosts.get(name).cloned().unwrap_or_default();
            let ceiling = f64::from(o.max_limit.unwrap_or(self.settings.max_limit).max(1));
            let floor = f64::from(self.settings.min_limit.max(1)).min(ceiling);
            Host {
                limit: f64::from(self.settings.initial_limit).clamp(floor, ceiling),
                floor,
                ceiling,
                min_delay: o.min_delay.unwrap_or(self.settings.min_delay),
                crawl_delay: Duration::ZERO,
                in_flight: 0,
                last_start: None,
                next_start: None,
                paused_until: None,
                generation: 0,
                throttled_at: None,
                fast_latency: None,
                slow_latency: None,
                throttles: 0,
                last_throttle: None,
                timeouts: 0,
                first_attempts: 0,
                retries: 0,
                blocked: 0,
                firsts_window: Window::default(),
                retries_window: Window::default(),
            }
        })
    }

    /// The fair share of `slots` fetch slots for each host, when `queued` hosts have work
    /// waiting and others have requests in flight: a slow host may not hold them all
    /// (head-of-line blocking at the global cap).
    pub(crate) fn fair_share<'a>(
        &self,
        slots: usize,
        queued: impl IntoIterator<Item = &'a str>,
    ) -> usize {
        let mut active: std::collections::HashSet<String> =
            queued.into_iter().map(str::to_owned).collect();
        active.extend(
            self.lock()
                .iter()
                .filter(|(_, h)| h.in_flight > 0)
                .map(|(name, _)| name.clone()),
        );
        slots.div_ceil(active.len().max(1))
    }

    /// `host`'s recent answer time (its fast-moving average; `None` before its first answer).
    pub(crate) fn latency(&self, host: &str) -> Option<Duration> {
        let ms = self.lock().get(host).and_then(|h| h.fast_latency)?;
        Some(Duration::from_secs_f64(ms.max(0.0) / 1000.0))
    }

    /// How many leased URLs `host` should have waiting for it: enough to keep it busy for
    /// `horizon` at its current limit and latency (a fast host needs many; a slow one, one
    /// round of its limit), at least its limit within `share` (four rounds of it while its
    /// latency is unknown).
    pub(crate) fn queue_target(&self, host: &str, share: usize, horizon: Duration) -> usize {
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        let round = (h.limit.floor() as usize).min(share).max(1);
        match h.fast_latency.filter(|ms| *ms > 0.0) {
            Some(ms) => {
                let per_second = h.limit.floor() * 1000.0 / ms;
                round.max((per_second * horizon.as_secs_f64()).ceil() as usize)
            }
            // Its pace is not known yet: a few rounds of its limit.
            None => round * 4,
        }
    }

    /// Admits one request on `host` now, or says why not and until when (if known). `retry`
    /// counts the request against the host's retry budget window; `share` is the most requests
    /// the host may have in flight (see [`Flow::fair_share`]).
    pub(crate) fn try_admit(
        self: &Arc<Self>,
        host: &str,
        retry: bool,
        now: Instant,
        share: usize,
    ) -> Admission {
        let second = self.second(now);
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        let wait = if let Some(until) = h.paused_until.filter(|u| *u > now) {
            Some((Busy::Paused, Some(until)))
        } else if f64::from(h.in_flight) + 1.0 > h.limit.floor() {
            Some((Busy::AtLimit, None))
        } else if h.in_flight as usize >= share.max(1) {
            Some((Busy::AtShare, None))
        } else {
            h.next_start
                .filter(|at| *at > now)
                .map(|at| (Busy::Spacing, Some(at)))
        };
        if let Some((why, until)) = wait {
            h.blocked += 1;
            return Admission::Wait { why, until };
        }
        h.paused_until = None;
        h.in_flight += 1;
        let saturated = f64::from(h.in_flight) >= h.limit.floor();
        h.last_start = Some(now);
        h.next_start = Some(now + h.spacing());
        if retry {
            h.retries += 1;
            h.retries_window.add(second, 1);
        } else {
            h.first_attempts += 1;
            h.firsts_window.add(second, 1);
        }
        Admission::Admitted(HostPermit {
            flow: self.clone(),
            host: host.to_owned(),
            generation: h.generation,
            saturated,
            finished: false,
        })
    }

    /// Requests in flight to `host` now.
    pub(crate) fn in_flight(&self, host: &str) -> u32 {
        self.lock().get(host).map_or(0, |h| h.in_flight)
    }

    /// Whether `host` would admit a request now (for choosing what to lease).
    #[cfg(test)]
    pub(crate) fn is_busy(&self, host: &str, now: Instant) -> bool {
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        h.paused_until.is_some_and(|u| u > now)
            || f64::from(h.in_flight) + 1.0 > h.limit.floor()
            || h.next_start.is_some_and(|at| at > now)
    }

    /// Hosts that admit nothing now: paused, at their limit, or waiting out their spacing.
    #[cfg(test)]
    pub(crate) fn busy_hosts(&self, now: Instant) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, h)| {
                h.paused_until.is_some_and(|u| u > now)
                    || f64::from(h.in_flight) + 1.0 > h.limit.floor()
                    || h.next_start.is_some_and(|at| at > now)
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Hosts paused now, with how long they stay paused.
    pub(crate) fn paused_hosts(&self, now: Instant) -> Vec<(String, Duration)> {
        self.lock()
            .iter()
            .filter_map(|(name, h)| {
                h.paused_until
                    .filter(|u| *u > now)
                    .map(|u| (name.clone(), u - now))
            })
            .collect()
    }

    /// Whether `host` throttled us (429/503) within `recent`.
    pub(crate) fn throttled_within(&self, host: &str, recent: Duration) -> bool {
        let mut hosts = self.lock();
        self.host(&mut hosts, host)
            .last_throttle
            .is_some_and(|t| t.elapsed() < recent)
    }

    /// Pauses `host` until `until` (later pauses win).
    pub(crate) fn pause(&self, host: &str, until: Instant) {
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        if h.paused_until.is_none_or(|u| u < until) {
            h.paused_until = Some(until);
        }
    }

    /// robots.txt's `Crawl-delay` for `host`.
    pub(crate) fn set_crawl_delay(&self, host: &str, delay: Duration) {
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        h.crawl_delay = delay;
        // Learned during the first request: the next one waits from that one's start.
        if let Some(last) = h.last_start {
            h.next_start = h.next_start.max(Some(last + h.spacing()));
        }
    }

    /// The admitted request to `host` goes out now (robots.txt read, if it had to be): the
    /// spacing counts from here, so time spent between admission and sending (a robots.txt
    /// fetch, a busy runtime) does not shorten the gap the host sees.
    pub(crate) fn sending(&self, host: &str, now: Instant) {
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        h.last_start = Some(now);
        h.next_start = h.next_start.max(Some(now + h.spacing()));
    }

    /// Whether `host`'s retry budget has room for one more retry now.
    pub(crate) fn may_retry(&self, host: &str, now: Instant) -> bool {
        let second = self.second(now);
        let window = self.settings.retry_window.as_secs().max(1);
        let mut hosts = self.lock();
        let h = self.host(&mut hosts, host);
        let firsts = h.firsts_window.sum(second, window);
        let retries = h.retries_window.sum(second, window);
        let budget = (self.settings.retry_budget * firsts as f64)
            .floor()
            .max(f64::from(self.settings.retry_budget_min));
        (retries as f64) < budget
    }

    /// Resolves when some permit was returned or a host changed (or spuriously).
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    pub(crate) fn snapshot(&self, now: Instant) -> Vec<HostSnapshot> {
        let second = self.second(now);
        let window = self.settings.retry_window.as_secs().max(1);
        let mut hosts = self.lock();
        let mut all: Vec<HostSnapshot> = hosts
            .iter_mut()
            .map(|(name, h)| {
                let firsts = h.firsts_window.sum(second, window);
                let retries = h.retries_window.sum(second, window);
                HostSnapshot {
                    host: name.clone(),
                    in_flight: h.in_flight,
                    limit: h.limit,
                    paused_for: h.paused_until.filter(|u| *u > now).map(|u| u - now),
                    throttles: h.throttles,
                    last_throttle: h.last_throttle.map(|t| now.saturating_duration_since(t)),
                    timeouts: h.timeouts,
                    first_attempts: h.first_attempts,
                    retries: h.retries,
                    retry_ratio: if firsts == 0 {
                        0.0
                    } else {
                        retries as f64 / firsts as f64
                    },
                    blocked: h.blocked,
                }
            })
            .collect();
        all.sort_by(|a, b| a.host.cmp(&b.host));
        all
    }

    fn release(&self, host: &str, generation: u64, saturated: bool, signal: Signal) {
        let now = Instant::now();
        {
            let mut hosts = self.lock();
            let h = self.host(&mut hosts, host);
            h.in_flight = h.in_flight.saturating_sub(1);
            match signal {
                Signal::Answered { latency } => {
                    let ms = latency.as_secs_f64() * 1000.0;
                    let fast = h.fast_latency.map_or(ms, |f| f * 0.7 + ms * 0.3);
                    let slow = h.slow_latency.map_or(ms, |s| s * 0.98 + ms * 0.02);
                    h.fast_latency = Some(fast);
                    h.slow_latency = Some(slow);
                    // Rising latency is the site asking for less before it says so.
                    if fast > 2.0 * slow && fast > 250.0 {
                        h.decrease(generation, false);
                    } else if saturated {
                        h.increase();
                    }
                }
                Signal::Throttled { retry_after } => {
                    h.throttles += 1;
                    h.last_throttle = Some(now);
                    h.decrease(generation, true);
                    if let Some(wait) = retry_after.filter(|w| !w.is_zero()) {
                        let until = now + wait;
                        if h.paused_until.is_none_or(|u| u < until) {
                            h.paused_until = Some(until);
                        }
                    }
                }
                Signal::Timeout => {
                    h.timeouts += 1;
                    h.decrease(generation, true);
                }
                Signal::Neutral => {}
            }
        }
        self.changed.notify_waiters();
    }
}

impl HostPermit {
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// Returns the permit with what the request taught about the host.
    pub(crate) fn finish(mut self, signal: Signal) {
        self.finished = true;
        self.flow
            .release(&self.host, self.generation, self.saturated, signal);
    }
}

impl Drop for HostPermit {
    fn drop(&mut self) {
        if !self.finished {
            self.flow
                .release(&self.host, self.generation, self.saturated, Signal::Neutral);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(flow: &Arc<Flow>, host: &str) -> HostPermit {
        match flow.try_admit(host, false, Instant::now(), usize::MAX) {
            Admission::Admitted(p) => p,
            Admission::Wait { why, .. } => panic!("{host} not admitted: {why:?}"),
        }
    }

    /// Fills `host` to its limit, then answers every request: one round trip's worth of
    /// successes, the last of them admitted at the limit.
    fn round(flow: &Arc<Flow>, host: &str) {
        let mut permits = Vec::new();
        while let Admission::Admitted(p) = flow.try_admit(host, false, Instant::now(), usize::MAX) {
            permits.push(p);
        }
        for p in permits {
            p.finish(Signal::Answered {
                latency: Duration::from_millis(5),
            });
        }
    }

    fn limit(flow: &Flow, host: &str) -> f64 {
        flow.snapshot(Instant::now())
            .into_iter()
            .find(|h| h.host == host)
            .map(|h| h.limit)
            .unwrap()
    }

    #[tokio::test]
    async fn a_host_admits_up_to_its_limit_and_no_more() {
        let flow = Flow::new(FlowSettings::default());
        let permits: Vec<_> = (0..4).map(|_| admit(&flow, "a:80")).collect();
        assert!(matches!(
            flow.try_admit("a:80", false, Instant::now(), usize::MAX),
            Admission::Wait {
                why: Busy::AtLimit,
                ..
            }
        ));
        // Another host is not affected.
        let _b = admit(&flow, "b:80");
        drop(permits);
        let _again = admit(&flow, "a:80");
    }

    #[tokio::test]
    async fn a_host_at_its_fair_share_waits_while_others_have_work() {
        let flow = Flow::new(FlowSettings::default());
        // 4 slots among two hosts with work: 2 each.
        let share = flow.fair_share(4, ["a:80", "b:80"]);
        assert_eq!(share, 2);
        let _a: Vec<_> = (0..2)
            .map(
                |_| match flow.try_admit("a:80", false, Instant::now(), share) {
                    Admission::Admitted(p) => p,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert!(matches!(
            flow.try_admit("a:80", false, Instant::now(), share),
            Admission::Wait {
                why: Busy::AtShare,
                ..
            }
        ));
        // A host with requests in flight counts as contending even with nothing queued.
        assert_eq!(flow.fair_share(4, ["b:80"]), 2);
        assert_eq!(flow.fair_share(4, ["a:80"]), 4);
    }

    #[tokio::test]
    async fn successes_at_the_limit_add_one_per_limit_and_a_throttle_halves_once_per_window() {
        let flow = Flow::new(FlowSettings::default());
        // A host not kept busy teaches nothing: its limit stays.
        for _ in 0..10 {
            admit(&flow, "a:80").finish(Signal::Answered {
                latency: Duration::from_millis(5),
            });
        }
        assert!((limit(&flow, "a:80") - 4.0).abs() < 1e-9);
        for _ in 0..4 {
            round(&flow, "a:80");
        }
        assert!((limit(&flow, "a:80") - 5.0).abs() < 1e-9, "4 + 4 × 1/4");
        // Two requests in flight when the site throttles both: one halving, not two.
        let p1 = admit(&flow, "a:80");
        let p2 = admit(&flow, "a:80");
        p1.finish(Signal::Throttled { retry_after: None });
        p2.finish(Signal::Throttled { retry_after: None });
        assert!((limit(&flow, "a:80") - 2.5).abs() < 1e-9);
        // A request admitted after the cut may cut again; never below the floor.
        for _ in 0..5 {
            admit(&flow, "a:80").finish(Signal::Timeout);
        }
        assert!((limit(&flow, "a:80") - 1.0).abs() < 1e-9);
    }

    #[tokio::test]
    async fn growth_is_slow_near_the_limit_where_the_site_throttled() {
        let flow = Flow::new(FlowSettings::default());
        admit(&flow, "a:80").finish(Signal::Throttled { retry_after: None });
        assert!((limit(&flow, "a:80") - 2.0).abs() < 1e-9);
        let ok = || round(&flow, "a:80");
        // Far below it: 1/limit per success.
        ok();
        ok();
        assert!((limit(&flow, "a:80") - 3.0).abs() < 1e-9);
        // Within one of it: an eighth of that.
        for _ in 0..12 {
            ok();
        }
        assert!((limit(&flow, "a:80") - 3.5).abs() < 1e-9);
    }

    #[tokio::test]
    async fn the_limit_never_passes_the_ceiling_of_the_host_override() {
        let mut settings = FlowSettings::default();
        settings.hosts.insert(
            "slow:80".into(),
            HostOverride {
                max_limit: Some(2),
                min_delay: None,
            },
        );
        let flow = Flow::new(settings);
        for _ in 0..50 {
            round(&flow, "slow:80");
        }
        assert!((limit(&flow, "slow:80") - 2.0).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_pauses_only_that_host_until_then() {
        let flow = Flow::new(FlowSettings::default());
        admit(&flow, "a:80").finish(Signal::Throttled {
            retry_after: Some(Duration::from_secs(2)),
        });
        let now = Instant::now();
        assert!(matches!(
            flow.try_admit("a:80", false, now, usize::MAX),
            Admission::Wait { why: Busy::Paused, until: Some(u) } if u == now + Duration::from_secs(2)
        ));
        assert_eq!(flow.busy_hosts(now), vec!["a:80".to_owned()]);
        let _b = admit(&flow, "b:80");
        tokio::time::advance(Duration::from_secs(2)).await;
        let _a = admit(&flow, "a:80");
    }

    #[tokio::test(start_paused = true)]
    async fn request_starts_on_a_host_are_spaced_by_its_delay() {
        let flow = Flow::new(FlowSettings {
            min_delay: Duration::from_millis(100),
            ..FlowSettings::default()
        });
        flow.set_crawl_delay("a:80", Duration::from_millis(500));
        admit(&flow, "a:80").finish(Signal::Neutral);
        assert!(matches!(
            flow.try_admit("a:80", false, Instant::now(), usize::MAX),
            Admission::Wait {
                why: Busy::Spacing,
                ..
            }
        ));
        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(flow.is_busy("a:80", Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        admit(&flow, "a:80");
        // Another host only has the politeness delay.
        admit(&flow, "b:80").finish(Signal::Neutral);
        tokio::time::advance(Duration::from_millis(100)).await;
        admit(&flow, "b:80");
    }

    #[tokio::test(start_paused = true)]
    async fn the_spacing_counts_from_when_the_request_is_sent_not_from_its_admission() {
        let flow = Flow::new(FlowSettings::default());
        flow.set_crawl_delay("a:80", Duration::from_millis(500));
        let permit = admit(&flow, "a:80");
        // robots.txt (or a busy runtime) takes 300 ms before the request goes out.
        tokio::time::advance(Duration::from_millis(300)).await;
        flow.sending("a:80", Instant::now());
        permit.finish(Signal::Neutral);
        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(
            flow.is_busy("a:80", Instant::now()),
            "500 ms after the send, not after the admission"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        admit(&flow, "a:80");
    }

    #[tokio::test]
    async fn rising_latency_halves_the_limit() {
        let flow = Flow::new(FlowSettings::default());
        for _ in 0..20 {
            admit(&flow, "a:80").finish(Signal::Answered {
                latency: Duration::from_millis(100),
            });
        }
        let before = limit(&flow, "a:80");
        admit(&flow, "a:80").finish(Signal::Answered {
            latency: Duration::from_secs(2),
        });
        assert!(limit(&flow, "a:80") <= before / 2.0 + 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_stay_within_the_budget_of_first_attempts() {
        let flow = Flow::new(FlowSettings {
            retry_budget: 0.1,
            retry_budget_min: 2,
            ..FlowSettings::default()
        });
        let now = Instant::now();
        // A quiet host still gets the floor of 2 retries per window.
        for _ in 0..2 {
            assert!(flow.may_retry("a:80", now));
            if let Admission::Admitted(p) = flow.try_admit("a:80", true, now, usize::MAX) {
                p.finish(Signal::Neutral);
            }
        }
        assert!(!flow.may_retry("a:80", now));
        // 40 first attempts make room for 4 retries.
        for _ in 0..40 {
            if let Admission::Admitted(p) = flow.try_admit("a:80", false, now, usize::MAX) {
                p.finish(Signal::Neutral);
            }
        }
        assert!(flow.may_retry("a:80", now));
        for _ in 0..2 {
            if let Admission::Admitted(p) = flow.try_admit("a:80", true, now, usize::MAX) {
                p.finish(Signal::Neutral);
            }
        }
        assert!(!flow.may_retry("a:80", now));
        // The window slides: a minute later the old counts are gone and the floor applies.
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(flow.may_retry("a:80", Instant::now()));
        let snapshot = flow.snapshot(Instant::now());
        assert_eq!(snapshot[0].retries, 4);
        assert_eq!(snapshot[0].first_attempts, 40);
    }
}
