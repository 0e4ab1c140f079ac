//! seedlock: always-on crawler bots that coordinate through MongoDB documents.
//!
//! The binary's entry is [`cli::main`]; one instance is [`daemon::run`]. The modules below are
//! listed in the order a page travels: a bot's runner takes its turn, the crawl leases a URL
//! from the frontier, requests and reads the page, and commits the record with the URL's mark.
//! Each module names only modules listed further down (`tests/suite/layers.rs` holds the
//! order; ARCHITECTURE.md draws it).
//!
//! Most items are crate-private. What stays `pub` is the surface the integration tests, the
//! benchmarks and the examples drive: the daemon's `run`, the settings, the store's calls, the
//! ids and the demo shop.

// The command line and one instance's tasks.
pub mod cli;
pub mod daemon;
// What operators see and type: status, the HTTP endpoint, `try`, `bots apply`, export.
pub mod ops;
// One bot's loop: decide, then the refresh turn or the crawl turn; the instance's hub.
pub mod runner;
// The crawl pipeline: lease, dispatch, fetch, parse, follow, resolve, commit.
pub mod crawl;
// The Prometheus registry the wings above feed.
pub mod metrics;
// Every MongoDB operation and the documents' field names.
pub mod store;
// The edit lock's vocabulary and its pure state machine (no I/O: below the store).
pub mod lock;
// Seed sources: a list, a URL file, a sitemap.
pub mod seeds;
// The validated settings, by section.
pub mod config;
// Per-host admission and robots.txt.
pub mod flow;
// One page requested; one page read.
pub mod extract;
pub mod http_client;
// The deterministic shop of the demo, the tests and the benchmarks.
pub mod demo_site;
// The ground: ids, URLs, the server clock, redaction, backoff, errors.
mod backoff;
pub mod clock;
pub mod error;
pub mod ids;
mod redact;
pub mod urls;
