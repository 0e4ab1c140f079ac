//! Backoff with full jitter (AWS architecture blog's "full jitter"): the delay before retry `n`
//! is uniform in `[0, min(cap, base * 2^n)]`, so contenders spread out instead of retrying in step.

use std::time::Duration;

use rand::Rng;

pub(crate) fn full_jitter(base: Duration, cap: Duration, attempt: u32) -> Duration {
    let ceiling = base.saturating_mul(1_u32 << attempt.min(20)).min(cap);
    rand::rng().random_range(Duration::ZERO..=ceiling)
}

/// `d` scaled by a random factor in `[1 - spread, 1 + spread]` (the waiters' ±20% poll jitter).
pub(crate) fn jittered(d: Duration, spread: f64) -> Duration {
    let factor = rand::rng().random_range((1.0 - spread)..=(1.0 + spread));
    d.mul_f64(factor.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_jitter_stays_under_the_exponential_ceiling_and_the_cap() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(1);
        for attempt in 0..30 {
            let ceiling = (base * 2_u32.pow(attempt.min(20))).min(cap);
            for _ in 0..50 {
                assert!(full_jitter(base, cap, attempt) <= ceiling);
            }
        }
    }

    #[test]
    fn jitter_spreads_around_the_interval() {
        let d = Duration::from_secs(1);
        let samples: Vec<_> = (0..200).map(|_| jittered(d, 0.2)).collect();
        assert!(samples
            .iter()
            .all(|s| *s >= Duration::from_millis(800) && *s <= Duration::from_millis(1200)));
        assert!(samples.iter().any(|s| *s != samples[0]), "jitter must vary");
    }
}
