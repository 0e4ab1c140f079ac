//! The operator's wing: what a person running a fleet reads and types.
//!
//! - [`admin`]: `status`, `inspect`, `unlock`, `refresh`;
//! - [`bots`]: `bots apply | list | remove`, `pause`, `resume`, `export`;
//! - [`export`]: `seedlock export`'s JSON lines and CSV;
//! - [`fleet`]: the fleet as the database shows it, read once for every status view;
//! - [`http`]: the instance's HTTP endpoint (`/`, `/status.json`, `/healthz`, `/metrics`);
//! - [`page`]: the status page's HTML;
//! - [`metrics`]: the Prometheus registry;
//! - [`progress`]: a pass's expected size and ETA, `seedlock crawl BOT`'s bars and summary.

pub mod admin;
pub mod bots;
pub mod export;
pub mod fleet;
pub mod http;
pub mod metrics;
pub mod page;
pub mod progress;
pub mod try_page;
