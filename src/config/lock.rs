//! `[lock]`: the edit lock's timing — its time to live, heartbeat, poll interval and the grace
//! before a stuck refresh is taken over.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LockSettings {
    pub ttl: Duration,
    pub heartbeat: Duration,
    pub max_refresh: Duration,
    /// Waiters take a refresh that still heartbeats over only after `max_refresh` + this: the
    /// holder gives up at `max_refresh` and records the failure (with its backoff) within it.
    pub stuck_grace: Duration,
    pub poll: Duration,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLock {
    pub(super) ttl: String,
    pub(super) heartbeat: Option<String>,
    pub(super) max_refresh: String,
    pub(super) stuck_grace: Option<String>,
    pub(super) poll: String,
}

impl Default for RawLock {
    fn default() -> Self {
        Self {
            ttl: "30s".into(),
            heartbeat: None,
            max_refresh: "10m".into(),
            stuck_grace: None,
            poll: "1s".into(),
        }
    }
}

impl RawLock {
    pub(super) fn validate(&self) -> Result<LockSettings, String> {
        let ttl = positive("lock.ttl", &self.ttl)?;
        let heartbeat = match &self.heartbeat {
            Some(raw) => positive("lock.heartbeat", raw)?,
            None => ttl / 3,
        };
        if heartbeat >= ttl {
            return Err(format!(
                "key `lock.heartbeat`: {} must be shorter than lock.ttl ({}), or the lock expires between heartbeats",
                humantime::format_duration(heartbeat),
                humantime::format_duration(ttl)
            ));
        }
        let max_refresh = positive("lock.max_refresh", &self.max_refresh)?;
        if max_refresh <= ttl {
            return Err(format!(
                "key `lock.max_refresh`: {} must be longer than lock.ttl ({})",
                humantime::format_duration(max_refresh),
                humantime::format_duration(ttl)
            ));
        }
        let stuck_grace = match &self.stuck_grace {
            Some(raw) => positive("lock.stuck_grace", raw)?,
            None => ttl,
        };
        let poll = positive("lock.poll", &self.poll)?;
        Ok(LockSettings {
            ttl,
            heartbeat,
            max_refresh,
            stuck_grace,
            poll,
        })
    }
}
