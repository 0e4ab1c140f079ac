//! Server time. Lock expiry is judged on the database server's clock, never the instance's: the
//! store samples `hello`'s `localTime`, and [`ServerClock`] turns the samples into an offset with
//! round-trip correction (the sample with the smallest round trip wins, as in NTP). An instance
//! whose own clock is hours off computes the same cutoffs as every other instance.

use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// The local wall clock, behind a seam so tests (and `SEEDLOCK_FAKE_CLOCK_SKEW`) can skew it.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalClock {
    skew: chrono::Duration,
}

impl LocalClock {
    pub fn skewed(skew: chrono::Duration) -> Self {
        Self { skew }
    }

    /// Reads `SEEDLOCK_FAKE_CLOCK_SKEW` (such as `+2h` or `-90m`): a test knob that makes this
    /// instance's local clock wrong on purpose, to show that nothing depends on it.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("SEEDLOCK_FAKE_CLOCK_SKEW") {
            Ok(raw) if !raw.trim().is_empty() => parse_skew(&raw).map(Self::skewed),
            _ => Ok(Self::default()),
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
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
    /// server time − local time.
    offset: chrono::Duration,
    rtt: chrono::Duration,
    taken_at: DateTime<Utc>,
}

/// An estimate of the database server's current time.
#[derive(Debug)]
pub struct ServerClock {
    local: LocalClock,
    best: Mutex<Option<Sample>>,
}

/// A sample older than this no longer beats a fresh one with a longer round trip (drift).
const SAMPLE_MAX_AGE: Duration = Duration::from_secs(300);

impl ServerClock {
    pub fn new(local: LocalClock) -> Self {
        Self {
            local,
            best: Mutex::new(None),
        }
    }

    pub fn local(&self) -> LocalClock {
        self.local
    }

    /// Records one exchange: the local time before sending, the server's reported time, and the
    /// local time after the answer. Returns the offset now in use.
    pub fn record(
        &self,
        sent: DateTime<Utc>,
        server: DateTime<Utc>,
        received: DateTime<Utc>,
    ) -> chrono::Duration {
        let rtt = (received - sent).max(chrono::Duration::zero());
        // The server read its clock, on average, half a round trip before we received the answer.
        let offset = server + rtt / 2 - received;
        let sample = Sample {
            offset,
            rtt,
            taken_at: received,
        };
        let mut best = self
            .best
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let replace = match *best {
            None => true,
            Some(old) => {
                let stale = (received - old.taken_at)
                    .to_std()
                    .is_ok_and(|age| age > SAMPLE_MAX_AGE);
                stale || rtt <= old.rtt
            }
        };
        if replace {
            *best = Some(sample);
        }
        best.map(|s| s.offset).unwrap_or(offset)
    }

    pub fn is_synced(&self) -> bool {
        self.best.lock().map(|b| b.is_some()).unwrap_or(false)
    }

    /// Server time now. Before the first sample, the local clock (callers sync first).
    pub fn now(&self) -> DateTime<Utc> {
        let offset = self
            .best
            .lock()
            .ok()
            .and_then(|b| b.map(|s| s.offset))
            .unwrap_or_else(chrono::Duration::zero);
        self.local.now() + offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn offset_is_corrected_by_half_the_round_trip() {
        let clock = ServerClock::new(LocalClock::default());
        let sent = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let received = sent + chrono::Duration::milliseconds(100);
        // The server's clock is exactly 2 hours ahead; it answered mid-way.
        let server = sent + chrono::Duration::hours(2) + chrono::Duration::milliseconds(50);
        assert_eq!(
            clock.record(sent, server, received),
            chrono::Duration::hours(2)
        );
    }

    #[test]
    fn the_sample_with_the_shortest_round_trip_wins() {
        let clock = ServerClock::new(LocalClock::default());
        let t = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let ms = chrono::Duration::milliseconds;
        clock.record(t, t + ms(5), t + ms(10)); // offset 0, rtt 10
                                                // A slow exchange (rtt 400) with an asymmetric delay would suggest +150ms: ignored.
        let later = t + ms(1000);
        let offset = clock.record(later, later + ms(350), later + ms(400));
        assert_eq!(offset, chrono::Duration::zero());
    }

    #[test]
    fn a_skewed_local_clock_still_yields_server_time() {
        let skew = chrono::Duration::hours(2);
        let clock = ServerClock::new(LocalClock::skewed(skew));
        let sent = clock.local().now();
        let server_now = Utc::now();
        let received = clock.local().now();
        clock.record(sent, server_now, received);
        let error = (clock.now() - Utc::now()).num_milliseconds().abs();
        assert!(
            error < 1000,
            "estimate is {error} ms off despite a 2h local skew"
        );
    }

    #[test]
    fn skew_knob_parses_signed_durations() {
        assert_eq!(parse_skew("+2h").unwrap(), chrono::Duration::hours(2));
        assert_eq!(parse_skew("-90m").unwrap(), chrono::Duration::minutes(-90));
        assert!(parse_skew("soon").is_err());
    }
}
