//! What every command does first: connect, sync the server clock, and start-up database work
//! retried while the server may be restarting.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::clock::{LocalClock, ServerClock};
use crate::config::MongoSettings;
use crate::store::Store;

/// Connects to the database and syncs the server clock. The error is one line for the operator.
pub(crate) async fn open(mongo: &MongoSettings) -> Result<(Store, Arc<ServerClock>), String> {
    let store = Store::connect(mongo).await.map_err(|e| e.to_string())?;
    let clock = server_clock(&store, mongo.connect_timeout).await?;
    Ok((store, clock))
}

/// The server's time as this instance judges every expiry by it.
pub(crate) async fn server_clock(
    store: &Store,
    patience: Duration,
) -> Result<Arc<ServerClock>, String> {
    let local = LocalClock::from_env()?;
    let clock = Arc::new(ServerClock::new(local));
    // One sample: its offset is off by at most half its round trip, milliseconds against
    // leases and locks of seconds. The daemon's resync takes more at once, beside its start
    // (see `daemon::resync_clock`), and the one with the shortest round trip sets the offset
    // from then on: a database across a network pays one round trip here, not three.
    with_patience("read the server's time", patience, || {
        store.sync_clock(&clock)
    })
    .await
    .map_err(|e| format!("cannot read the server's time: {e}"))?;
    Ok(clock)
}

/// Start-up database work, retried while it fails transiently — the server restarting just as
/// this instance starts (its ping answered, the next operation's connection was reset) — until
/// `patience` (`mongo.connect_timeout`) runs out; then the last error. Each retry logs a warning.
pub(crate) async fn with_patience<T, F, Fut>(
    what: &str,
    patience: Duration,
    mut op: F,
) -> crate::error::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = crate::error::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    let mut wait = Duration::from_millis(100);
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) if e.is_transient() && tokio::time::Instant::now() + wait < deadline => {
                warn!(error = %e, ?wait, "start-up: could not {what}; the database may be restarting, retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}
