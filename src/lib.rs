//! seedlock: always-on crawler bots that coordinate through MongoDB documents.
//!
//! Start at [`daemon::run`]. The source is grouped in wings that follow the architecture:
//!
//! - [`lock`]: the bot document, the pure state machine ([`lock::decide::decide`]), the
//!   coordinator that carries its decisions out, and seed sources;
//! - [`crawl`]: the crawl pipeline, one file per stage, with fetching and extraction;
//! - [`flow`]: per-host admission (AIMD limits, pauses, spacing, retry budgets) and robots.txt;
//! - [`store`]: every MongoDB operation (bots, frontier, records, passes, hosts);
//! - [`ops`]: what operators see — `status`/`inspect`, the HTTP endpoint, metrics, progress;
//! - [`demo_site`]: the deterministic shop of the demo, the tests and the benchmarks.
//!
//! ARCHITECTURE.md has the code map and the invariants.

pub mod backoff;
pub mod cli;
pub mod clock;
pub mod config;
pub mod crawl;
pub mod daemon;
pub mod demo_site;
pub mod error;
pub mod flow;
pub mod ids;
pub mod lock;
pub mod ops;
pub mod redact;
pub mod store;
pub mod urls;
