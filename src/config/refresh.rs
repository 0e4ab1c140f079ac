//! `[refresh]`: the instance's limits on seed refreshes — how many run at once, how long one may
//! take, the seed list's size and the user agent of seed requests.

use super::*;

/// The default of `refresh.concurrency`: refreshes one instance runs at once. Each holds a lock
/// (a heartbeat statement per tick) and a seed fetch; sixteen keep a seed source's burst and the
/// database's share of one instance small while a fleet of a thousand trivial bots still becomes
/// ready within seconds.
pub const DEFAULT_REFRESH_CONCURRENCY: usize = 16;

/// Bounds on one refresh of a seed source.
#[derive(Clone, Debug, PartialEq)]
pub struct RefreshLimits {
    pub timeout: Duration,
    pub max_bytes: usize,
    pub max_seeds: usize,
    pub attempts: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub sitemap_depth: u32,
    pub user_agent: String,
    /// Refreshes one instance runs at once (`refresh.concurrency`), across all its bots.
    pub concurrency: usize,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRefresh {
    pub(super) timeout: String,
    pub(super) max_bytes: u64,
    pub(super) max_seeds: u64,
    pub(super) attempts: u32,
    pub(super) backoff_base: String,
    pub(super) backoff_max: String,
    pub(super) sitemap_depth: u32,
    pub(super) user_agent: String,
    pub(super) concurrency: u32,
}

impl Default for RawRefresh {
    fn default() -> Self {
        Self {
            timeout: "30s".into(),
            max_bytes: 10 * 1024 * 1024,
            max_seeds: 100_000,
            attempts: 3,
            backoff_base: "1s".into(),
            backoff_max: "5m".into(),
            sitemap_depth: 2,
            user_agent: concat!("seedlock/", env!("CARGO_PKG_VERSION")).into(),
            concurrency: DEFAULT_REFRESH_CONCURRENCY as u32,
        }
    }
}

impl RawRefresh {
    pub(super) fn validate(&self) -> Result<RefreshLimits, String> {
        let backoff_base = positive("refresh.backoff_base", &self.backoff_base)?;
        let backoff_max = positive("refresh.backoff_max", &self.backoff_max)?;
        if backoff_max < backoff_base {
            return Err(
                "key `refresh.backoff_max`: must not be shorter than refresh.backoff_base".into(),
            );
        }
        if self.attempts == 0 || self.attempts > 20 {
            return Err(format!(
                "key `refresh.attempts`: {} must be between 1 and 20",
                self.attempts
            ));
        }
        if self.max_bytes == 0 || self.max_seeds == 0 {
            return Err(
                "keys `refresh.max_bytes` and `refresh.max_seeds` must be greater than zero".into(),
            );
        }
        if self.sitemap_depth > 5 {
            return Err(format!(
                "key `refresh.sitemap_depth`: {} must be at most 5",
                self.sitemap_depth
            ));
        }
        let user_agent = self.user_agent.trim();
        if user_agent.is_empty() || reqwest::header::HeaderValue::from_str(user_agent).is_err() {
            return Err(format!(
                "key `refresh.user_agent`: {user_agent:?} is not a valid header value"
            ));
        }
        Ok(RefreshLimits {
            timeout: positive("refresh.timeout", &self.timeout)?,
            max_bytes: usize::try_from(self.max_bytes).unwrap_or(usize::MAX),
            max_seeds: usize::try_from(self.max_seeds).unwrap_or(usize::MAX),
            attempts: self.attempts,
            backoff_base,
            backoff_max,
            sitemap_depth: self.sitemap_depth,
            user_agent: user_agent.to_owned(),
            concurrency: match self.concurrency {
                n @ 1..=10_000 => n as usize,
                n => {
                    return Err(format!(
                        "key `refresh.concurrency`: {n} must be between 1 and 10000"
                    ))
                }
            },
        })
    }
}
