//! The operator's wing: what a person running a fleet reads and types.
//!
//! - [`admin`]: `status`, `inspect`, `unlock`, `refresh`;
//! - [`bots`]: `bots apply | list | remove`, `pause`, `resume`, `export`;
//! - [`check`]: `bots apply --check`, a new spec read on stored pages;
//! - [`changes`]: `changes` (the change feed), `pass release | discard`, `export --delta`;
//! - [`export`]: `seedlock export`'s JSON lines and CSV;
//! - [`fleet`]: the fleet as the database shows it, read once for every status view;
//! - [`http`]: the instance's HTTP endpoint (`/`, `/status.json`, `/healthz`, `/metrics`);
//! - [`page`]: the status page's HTML;
//! - [`progress`]: a pass's expected size and ETA, `seedlock crawl BOT`'s bars and summary.

pub mod admin;
pub(crate) mod bots;
pub mod changes;
pub(crate) mod check;
pub mod export;
pub(crate) mod overview;
pub(crate) mod page;
pub mod progress;
pub(crate) mod server;
pub(crate) mod try_page;

use std::process::ExitCode;

use crate::config::Settings;
use crate::ids::BotId;

/// Exit codes: 0 done, 1 the command failed, 2 bad usage, bad config or unreachable database.
pub(crate) const EXIT_FAILED: u8 = 1;
pub(crate) const EXIT_USAGE: u8 = 2;

pub(crate) fn fail(code: u8, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("seedlock: {message}");
    ExitCode::from(code)
}

pub(crate) fn bot_arg(raw: &str) -> Result<BotId, ExitCode> {
    BotId::parse(raw).map_err(|e| fail(EXIT_USAGE, e))
}

/// Connects, runs `body`, shuts the client down (a client dropped at exit spawns
/// end_all_sessions, which races the runtime's teardown). A failed connection is exit code 2.
pub(crate) async fn with_store<F, Fut>(settings: &Settings, body: F) -> ExitCode
where
    F: FnOnce(crate::store::Store, std::sync::Arc<crate::clock::ServerClock>) -> Fut,
    Fut: std::future::Future<Output = ExitCode>,
{
    let (store, clock) = match crate::store::startup::open(&settings.mongo).await {
        Ok(c) => c,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let code = body(store.clone(), clock).await;
    store.shutdown().await;
    code
}

pub(crate) fn admin_name() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "admin".into());
    format!(
        "admin:{user}@{}",
        gethostname::gethostname().to_string_lossy()
    )
}
