//! Server time. Lock expiry is judged on the database server's clock, never the instance's: the
//! store samples `hello`'s `localTime`, and [`ServerClock`] anchors the best sample (smallest round
//! trip, as in NTP, corrected by half of it) to the monotonic clock. An instance whose own wall
//! clock is hours off, or jumps, computes the same cutoffs as every other instance.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

/// The local wall clock, behind a seam so tests (and `SEEDLOCK_FAKE_CLOCK_SKEW`) can skew it.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalClock {
    skew: chrono::Duration,
}

impl LocalClock {
    pub(crate) fn skewed(skew: chrono::Duration) -> Self {
        Self { skew }
    }

    /// Reads `SEEDLOCK_FAKE_CLOCK_SKEW` (such as `+2h` or `-90m`): a test knob that makes this
    /// instance's local clock wrong on purpose, to show that nothing depends on it.
    pub(crate) fn from_env() -> Result<Self, String> {
        match std::env::var("SEEDLOCK_FAKE_CLOCK_SKEW") {
            Ok(raw) if !raw.trim().is_empty() => parse_skew(&raw).map(Self::skewed),
            _ => Ok(Self::default()),
        }
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.skew
    }
}

fn parse_skew(raw: &str) -> Result<chrono::Duration, String> {
    let raw = raw.trim();
    let (sign, magnitude) = match raw.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, raw.strip_prefix('+').unwrap_or(raw)),
    };
    let d = humantime::parse_duration(magnitude).map_err(|e| {
        format!("SEEDLOCK_FAKE_CLOCK_SKEW={raw:?} is not a duration such as +2h ({e})")
    })?;
    let d = chrono::Duration::from_std(d)
        .map_err(|e| format!("SEEDLOCK_FAKE_CLOCK_SKEW={raw:?}: {e}"))?;
    Ok(d * sign)
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    /// The server's time at the monotonic instant `at` (its reported time plus half the round trip).
    server_at: DateTime<Utc>,
    at: Instant,
    rtt: Duration,
}

/// An estimate of the database server's current time: the best sample's server time plus the
/// monotonic time elapsed since. The local wall clock is not read at all once a sample exists, so
/// neither a wrong nor a jumping local clock moves the estimate.
#[derive(Debug)]
pub struct ServerClock {
    local: LocalClock,
    best: Mutex<Option<Sample>>,
    /// The primary changed since the best sample: the next sample replaces it, whatever its
    /// round trip (the new primary's clock may differ from the old one's).
    new_primary: std::sync::atomic::AtomicBool,
}

/// A sample older than this no longer beats a fresh one with a longer round trip (drift between
/// the two clocks' rates stays far below a millisecond over it).
const SAMPLE_MAX_AGE: Duration = Duration::from_secs(300);

impl ServerClock {
    pub fn new(local: LocalClock) -> Self {
        Self {
            local,
            best: Mutex::new(None),
            new_primary: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The primary changed (an election, a failover): the next sample is taken from the new
    /// primary and replaces the best one, so no expiry is judged on the old primary's clock
    /// longer than one round trip.
    pub(crate) fn primary_changed(&self) {
        self.new_primary
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Records one exchange: the monotonic instant before sending, the server's reported time, and
    /// the instant the answer arrived. Returns the estimate of the server's time now.
    pub(crate) fn record(
        &self,
        sent: Instant,
        server: DateTime<Utc>,
        received: Instant,
    ) -> DateTime<Utc> {
        let rtt = received.saturating_duration_since(sent);
        // The server read its clock, on average, half a round trip before the answer arrived.
        let half = chrono::Duration::from_std(rtt / 2).unwrap_or_default();
        let sample = Sample {
            server_at: server + half,
            at: received,
            rtt,
        };
        let mut best = self
            .best
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let new_primary = self
            .new_primary
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        let replace = match *best {
            None => true,
            Some(_) if new_primary => true,
            Some(old) => {
                received.saturating_duration_since(old.at) > SAMPLE_MAX_AGE || rtt <= old.rtt
            }
        };
        if replace {
            *best = Some(sample);
        }
        drop(best);
        self.now()
    }

    /// The shortest round trip to the database among the samples kept (the network's distance,
    /// whatever the server's load): `None` before the first sample.
    pub(crate) fn round_trip(&self) -> Option<Duration> {
        self.best
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .map(|s| s.rtt)
    }

    /// Server time now. Before the first sample, the local clock (every command syncs first).
    pub fn now(&self) -> DateTime<Utc> {
        let best = *self
            .best
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match best {
            Some(s) => s.server_at + chrono::Duration::from_std(s.at.elapsed()).unwrap_or_default(),
            None => self.local.now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn close(a: DateTime<Utc>, b: DateTime<Utc>, ms: i64) -> bool {
        (a - b).num_milliseconds().abs() <= ms
    }

    #[test]
    fn the_estimate_is_corrected_by_half_the_round_trip() {
        let clock = ServerClock::new(LocalClock::default());
        let received = Instant::now();
        let sent = received - Duration::from_millis(100);
        let server = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let estimate = clock.record(sent, server, received);
        assert!(
            close(estimate, server + chrono::Duration::milliseconds(50), 20),
            "{estimate}"
        );
    }

    #[test]
    fn the_sample_with_the_shortest_round_trip_wins() {
        let clock = ServerClock::new(LocalClock::default());
        let t = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let now = Instant::now();
        clock.record(now - Duration::from_millis(10), t, now); // rtt 10 ms
                                                               // A slow exchange (rtt 400 ms) whose answer says +300 ms: not trusted over the fast one.
        let later = Instant::now();
        clock.record(
            later - Duration::from_millis(400),
            t + chrono::Duration::milliseconds(300),
            later,
        );
        assert!(
            close(clock.now(), t + chrono::Duration::milliseconds(5), 30),
            "{}",
            clock.now()
        );
    }

    #[test]
    fn after_a_change_of_primary_the_next_sample_replaces_the_best_whatever_its_round_trip() {
        let clock = ServerClock::new(LocalClock::default());
        let t = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let now = Instant::now();
        clock.record(now - Duration::from_millis(10), t, now); // rtt 10 ms
        clock.primary_changed();
        // The new primary's clock is an hour ahead; its first answer took 400 ms.
        let later = Instant::now();
        let ahead = t + chrono::Duration::hours(1);
        clock.record(later - Duration::from_millis(400), ahead, later);
        assert!(
            close(clock.now(), ahead + chrono::Duration::milliseconds(200), 50),
            "{}",
            clock.now()
        );
        // Only the first sample after the change: a slower one later is judged as before.
        let again = Instant::now();
        clock.record(
            again - Duration::from_millis(900),
            ahead + chrono::Duration::hours(1),
            again,
        );
        assert!(
            close(clock.now(), ahead + chrono::Duration::milliseconds(200), 50),
            "{}",
            clock.now()
        );
    }

    #[test]
    fn a_skewed_local_clock_does_not_move_the_estimate() {
        let clock = ServerClock::new(LocalClock::skewed(chrono::Duration::hours(2)));
        assert!(
            !close(clock.now(), Utc::now(), 1000),
            "before a sample, the (skewed) local clock"
        );
        let sent = Instant::now();
        let server_now = Utc::now();
        clock.record(sent, server_now, Instant::now());
        assert!(
            close(clock.now(), Utc::now(), 200),
            "after a sample, server time despite a 2h skew"
        );
    }

    #[test]
    fn skew_knob_parses_signed_durations() {
        assert_eq!(parse_skew("+2h").unwrap(), chrono::Duration::hours(2));
        assert_eq!(parse_skew("-90m").unwrap(), chrono::Duration::minutes(-90));
        assert!(parse_skew("soon").is_err());
    }
}
