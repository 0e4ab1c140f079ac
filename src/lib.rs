//! seedlock: always-on crawler bots that coordinate through MongoDB documents.
//!
//! Start at [`daemon::run`]. The source is grouped in wings on floors; each names only what
//! stands below it (`tests/layers.rs` holds the order, ARCHITECTURE.md draws it):
//!
//! - [`cli`], [`daemon`]: the command line and one instance's tasks;
//! - [`ops`]: what operators see and type — `status`/`inspect`, the HTTP endpoint, progress;
//! - [`lock`]: the pure state machine ([`lock::decide::decide`]), the coordinator that carries
//!   its decisions out, the instance's shared upkeep, and seed sources;
//! - [`crawl`]: the crawl pipeline, one file per stage;
//! - [`metrics`]: the Prometheus registry the wings above feed;
//! - [`store`]: every MongoDB operation and the database's vocabulary (the bot document);
//! - [`config`]: the validated settings;
//! - [`flow`]: per-host admission (AIMD limits, pauses, spacing, retry budgets) and robots.txt;
//! - [`http_client`], [`extract`]: one page requested, one page read;
//! - [`demo_site`]: the deterministic shop of the demo, the tests and the benchmarks;
//! - the ground: [`ids`], [`urls`], [`clock`], [`redact`], [`backoff`], [`error`].
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
pub mod extract;
pub mod flow;
pub mod http_client;
pub mod ids;
pub mod lock;
pub mod metrics;
pub mod ops;
pub mod redact;
pub mod runner;
pub mod seeds;
pub mod store;
pub mod urls;
