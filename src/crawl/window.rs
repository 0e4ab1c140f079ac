//! The commit window: how many pages one bot may hold fetched and not yet committed on this
//! instance, and how many group commits may be on their way at once — sized from what this
//! instance measures, as TCP sizes its window to the bandwidth-delay product.
//!
//! A page holds its room from its fetch to its commit. The fetch and parse stages hold at most
//! their own room (`crawl.workers` + `crawl.parse_queue` + `crawl.parsers`), whatever the
//! database; what the database's distance and load change is how long a page waits for its
//! commit. By Little's law the store stage holds the page rate times the commit latency, so the
//! window is the stages' own room plus **twice** the best recent page rate times the median
//! recent commit latency. Twice: the window always lets the pages flow twice as fast as they
//! do, so a window that binds grows until something else binds (the fetches, the parsers, the
//! database's own pace). Commits in flight: enough that each carries at most
//! `crawl.store_queue` pages of that room; enough that the database has work while commits
//! travel (one plus the fastest recent commit's latency over what the median one adds to it);
//! and at least two (one batch gathers while the one before is on its way).
//!
//! The settings are ceilings: the window never exceeds `crawl.max_uncommitted`, commits never
//! `crawl.writers`; the byte budget (`crawl.max_uncommitted_bytes`) holds beside. Before the
//! first measurement the store stage has room for [`INITIAL_STORE`] pages.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::config::CrawlLimits;

/// Commits whose latencies make the median.
const LATENCY_SAMPLES: usize = 16;
/// The page rate is measured per interval this long …
const RATE_INTERVAL: Duration = Duration::from_millis(250);
/// … and the best of this many recent intervals counts (two seconds).
const RATE_INTERVALS: usize = 8;
/// The window's headroom over the measured rate times latency.
const GAIN: f64 = 2.0;
/// Commits in flight at least (when `crawl.writers` allows).
const MIN_WRITERS: usize = 2;
/// Pages the store stage has room for before the first measurement: what a database on the
/// same machine keeps busy.
const INITIAL_STORE: usize = 256;

/// The window's sizes at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sizes {
    /// Pages fetched (or being fetched) and not yet committed, at most.
    pub pages: usize,
    /// Group commits on their way at once, at most.
    pub writers: usize,
}

/// One bot's commit window on this instance: its measurements and the sizes they give. It
/// outlives slices and passes (the database's distance does not change with them).
pub(crate) struct CommitWindow {
    /// The fetch and parse stages' own room.
    stages: usize,
    /// `crawl.store_queue`: the most pages one commit carries.
    batch: usize,
    /// The window's ceiling in pages.
    max_pages: usize,
    /// `crawl.writers`.
    max_writers: usize,
    measured: Mutex<Measured>,
}

#[derive(Default)]
struct Measured {
    latencies: VecDeque<Duration>,
    /// The interval being counted: its start and the pages committed in it so far.
    current: Option<(Instant, usize)>,
    /// Pages per second of the last complete intervals.
    rates: VecDeque<f64>,
}

impl Measured {
    fn commit(&mut self, pages: usize, latency: Duration, now: Instant) {
        if self.latencies.len() == LATENCY_SAMPLES {
            self.latencies.pop_front();
        }
        self.latencies.push_back(latency);
        let sent = now.checked_sub(latency).unwrap_or(now);
        let (start, counted) = self.current.get_or_insert((sent, 0));
        *counted += pages;
        let elapsed = now.saturating_duration_since(*start);
        if elapsed >= RATE_INTERVAL {
            // An interval with a long idle stretch in it (between passes) counts what it saw
            // over its whole length: a low rate, which the best of the recent ones outweighs.
            let rate = *counted as f64 / elapsed.as_secs_f64();
            if self.rates.len() == RATE_INTERVALS {
                self.rates.pop_front();
            }
            self.rates.push_back(rate);
            self.current = Some((now, 0));
        }
    }

    /// The fastest and the median of the recent commits' latencies.
    fn latencies(&self) -> Option<(Duration, Duration)> {
        let mut sorted: Vec<_> = self.latencies.iter().copied().collect();
        sorted.sort_unstable();
        Some((*sorted.first()?, sorted[sorted.len() / 2]))
    }

    fn rate(&self) -> Option<f64> {
        self.rates.iter().copied().reduce(f64::max)
    }
}

impl CommitWindow {
    pub(crate) fn of(limits: &CrawlLimits) -> Self {
        Self::new(
            limits.workers + limits.parse_queue + limits.parsers,
            limits.store_queue,
            limits.max_uncommitted,
            limits.writers,
        )
    }

    /// `stages`: the fetch and parse stages' room; then `crawl.store_queue`,
    /// `crawl.max_uncommitted` and `crawl.writers`.
    fn new(stages: usize, store_queue: usize, max_uncommitted: usize, writers: usize) -> Self {
        let batch = store_queue.max(1);
        Self {
            stages,
            batch,
            max_pages: max_uncommitted.max(1),
            max_writers: writers.max(1),
            measured: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Measured> {
        self.measured.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A commit of `pages` took `latency`, answered at `now`.
    pub(crate) fn commit(&self, pages: usize, latency: Duration, now: Instant) {
        self.lock().commit(pages, latency, now);
    }

    /// The sizes the measurements give (see the module's comment).
    pub(crate) fn sizes(&self) -> Sizes {
        let (rate, latencies) = {
            let m = self.lock();
            (m.rate(), m.latencies())
        };
        let (in_store, pipeline) = match (rate, latencies) {
            (Some(rate), Some((fastest, median))) => (
                (GAIN * rate * median.as_secs_f64()).ceil() as usize,
                pipeline(fastest, median),
            ),
            _ => (INITIAL_STORE, MIN_WRITERS),
        };
        Sizes {
            pages: self
                .stages
                .saturating_add(in_store.max(1))
                .min(self.max_pages)
                .max(1),
            writers: in_store
                .div_ceil(self.batch)
                .max(pipeline)
                .max(MIN_WRITERS)
                .min(self.max_writers),
        }
    }
}

/// Commits in flight that keep the database busy while commits travel: a commit's latency is
/// a part every commit pays whatever it carries (the round trips; the fastest recent commit, at
/// most) and a part that grows with its batch (the median's rest, the database's work). While
/// one commit's work is done, the others travel: one plus as many as the fixed part spans.
/// Locally the work dominates (two); across a network the round trips do (more).
fn pipeline(fastest: Duration, median: Duration) -> usize {
    let work = median.saturating_sub(fastest);
    if work.is_zero() {
        return MIN_WRITERS;
    }
    // A float past `usize` converts to its largest value; the ceiling holds it.
    ((fastest.as_secs_f64() / work.as_secs_f64()).ceil() as usize).saturating_add(1)
}

/// A semaphore whose number of permits follows a target: grown at once, shrunk as permits come
/// back (a permit held is never taken away).
pub(crate) struct Resizable {
    semaphore: Arc<Semaphore>,
    /// Permits that exist, held or free.
    size: Mutex<usize>,
}

impl Resizable {
    pub(crate) fn new(size: usize) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(size)),
            size: Mutex::new(size),
        }
    }

    pub(crate) fn semaphore(&self) -> &Arc<Semaphore> {
        &self.semaphore
    }

    /// Moves the number of permits toward `target`: adds what is missing; forgets what is free
    /// of what is too many (the rest on a later call, once it is back).
    pub(crate) fn resize(&self, target: usize) {
        let mut size = self.size.lock().unwrap_or_else(|p| p.into_inner());
        if target > *size {
            self.semaphore.add_permits(target - *size);
            *size = target;
        } else {
            *size -= self.semaphore.forget_permits(*size - target);
        }
    }

    /// Permits that exist, held or free.
    #[cfg(test)]
    fn size(&self) -> usize {
        *self.size.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window over 30 workers, 8 queued for a parser and 2 parsers.
    fn window(writers: usize, store_queue: usize, max: usize) -> CommitWindow {
        CommitWindow::new(30 + 8 + 2, store_queue, max, writers)
    }

    #[test]
    fn commits_in_flight_span_the_part_of_a_commit_that_does_not_grow_with_its_batch() {
        let ms = Duration::from_millis;
        // Locally the database's work is most of a commit: two.
        assert_eq!(pipeline(ms(10), ms(40)), 2);
        // 10 ms away, three round trips: 30 ms of travel beside 20 ms of work.
        assert_eq!(pipeline(ms(30), ms(50)), 3);
        // 50 ms away: the travel is nine times the work.
        assert_eq!(pipeline(ms(150), ms(167)), 10);
        // Every commit alike: nothing tells travel from work.
        assert_eq!(pipeline(ms(30), ms(30)), MIN_WRITERS);
        // A nanosecond of work: as many as there can be (the ceiling holds them).
        assert_eq!(
            pipeline(ms(30), ms(30) + Duration::from_nanos(1)),
            30_000_001
        );
    }

    #[test]
    fn a_far_database_keeps_more_commits_in_flight_than_the_batches_need() {
        let w = window(16, 1_000, 10_000);
        let start = Instant::now();
        let mut now = start;
        // 50 ms round trips: small commits take 160 ms, larger ones 180.
        for i in 0..40 {
            let (pages, latency) = if i % 2 == 0 { (5, 160) } else { (50, 180) };
            now += Duration::from_millis(60);
            w.commit(pages, Duration::from_millis(latency), now);
        }
        // 1 + 160 / 20 = 9 in flight, though two commits of 1,000 would carry the window.
        assert_eq!(w.sizes().writers, 9);
    }

    /// Commits of `pages` each taking `latency`, back to back from `start` for `total`.
    fn commits(w: &CommitWindow, start: Instant, pages: usize, latency: Duration, total: Duration) {
        let mut now = start;
        while now < start + total {
            now += latency;
            w.commit(pages, latency, now);
        }
    }

    #[test]
    fn before_any_commit_the_store_stage_has_room_for_its_initial_pages() {
        let w = window(8, 1_000, 10_000);
        assert_eq!(
            w.sizes(),
            Sizes {
                pages: 30 + 8 + 2 + INITIAL_STORE,
                writers: 2
            }
        );
    }

    #[test]
    fn the_store_stages_room_is_twice_the_page_rate_times_the_commit_latency() {
        let w = window(8, 1_000, 10_000);
        // 50 pages every 20 ms: 2,500 pages/s, committed 20 ms after they were sent.
        commits(
            &w,
            Instant::now(),
            50,
            Duration::from_millis(20),
            Duration::from_secs(2),
        );
        // 2 × 2,500/s × 0.02 s = 100 pages in the store stage, beside the stages' 40.
        assert_eq!(w.sizes().pages, 140);
    }

    #[test]
    fn a_database_farther_away_gets_a_wider_window_and_more_commits_in_flight() {
        let near = window(16, 1_000, 10_000);
        let far = window(16, 1_000, 10_000);
        let start = Instant::now();
        let total = Duration::from_secs(2);
        commits(&near, start, 10, Duration::from_millis(4), total);
        // The same 2,500 pages/s, each commit ten times as long.
        commits(&far, start, 100, Duration::from_millis(40), total);
        let (near, far) = (near.sizes(), far.sizes());
        assert_eq!(near.pages, 40 + 20);
        assert_eq!(far.pages, 40 + 200);
        assert_eq!(near.writers, 2);
        // 200 pages fit one commit of at most 1,000: two in flight, the floor. Four times the
        // rate, in commits of at most 100 pages, takes eight.
        assert_eq!(far.writers, 2);
        let faster = window(16, 100, 10_000);
        commits(&faster, start, 400, Duration::from_millis(40), total);
        assert_eq!(faster.sizes().writers, 8);
    }

    #[test]
    fn the_settings_are_ceilings() {
        // Each asked for 2 × 10,000/s × 0.1 s = 2,000 pages in the store stage, in 20 commits
        // of 100: held to `max_uncommitted` and to `writers`.
        let cases = [
            (
                window(3, 100, 500),
                Sizes {
                    pages: 500,
                    writers: 3,
                },
            ),
            (
                window(1, 100, 50),
                Sizes {
                    pages: 50,
                    writers: 1,
                },
            ),
        ];
        for (w, held) in cases {
            let (latency, total) = (Duration::from_millis(100), Duration::from_secs(2));
            commits(&w, Instant::now(), 1_000, latency, total);
            assert_eq!(w.sizes(), held);
        }
    }

    #[test]
    fn the_best_recent_rate_counts_not_an_idle_stretch() {
        let w = window(8, 1_000, 10_000);
        let start = Instant::now();
        commits(
            &w,
            start,
            50,
            Duration::from_millis(20),
            Duration::from_secs(1),
        );
        // A commit after an idle second: its interval counts a low rate, the best one holds.
        w.commit(
            50,
            Duration::from_millis(20),
            start + Duration::from_secs(2),
        );
        assert_eq!(w.sizes().pages, 140);
    }

    #[test]
    fn a_resizable_semaphore_grows_at_once_and_shrinks_as_permits_come_back() {
        let r = Resizable::new(4);
        let held = r.semaphore().clone().try_acquire_many_owned(3).unwrap();
        r.resize(6);
        assert_eq!(r.semaphore().available_permits(), 3);
        r.resize(2);
        // Three free permits forgotten; one more is owed by the three held.
        assert_eq!(r.semaphore().available_permits(), 0);
        assert_eq!(r.size(), 3);
        drop(held);
        r.resize(2);
        assert_eq!(r.size(), 2);
        assert_eq!(r.semaphore().available_permits(), 2);
    }
}
