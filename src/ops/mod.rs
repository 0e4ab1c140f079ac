//! The operator's wing: what a person running a fleet reads and types.
//!
//! - [`admin`]: `status`, `inspect`, `unlock`, `refresh`;
//! - [`http`]: the instance's loopback endpoint (`/healthz`, `/metrics`);
//! - [`metrics`]: the Prometheus registry;
//! - [`progress`]: `seedlock crawl BOT`'s progress line and summary.

pub mod admin;
pub mod http;
pub mod metrics;
pub mod progress;
