//! seedlock: always-on crawler bots that coordinate through MongoDB documents.
//!
//! Start at [`daemon::run`]; the state machine is [`decide::decide`]; the lock's writes are in
//! [`store`]. ARCHITECTURE.md has the code map and the invariants.

pub mod admin;
pub mod backoff;
pub mod cli;
pub mod clock;
pub mod config;
pub mod coordinator;
pub mod crawl;
pub mod daemon;
pub mod decide;
pub mod demo_site;
pub mod document;
pub mod error;
pub mod extract;
pub mod fetch;
pub mod flow;
pub mod http;
pub mod ids;
pub mod metrics;
pub mod progress;
pub mod redact;
pub mod robots;
pub mod seeds;
pub mod stages;
pub mod store;
pub mod urls;
