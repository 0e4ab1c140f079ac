//! The integration suite, one binary: every area's tests against a real MongoDB-compatible
//! server (`MONGODB_URI`, or the test server `scripts/test` starts), real HTTP servers and real
//! `seedlock` processes. `kit` is the test kit the areas share.

mod kit;

mod alerts;
mod bot_http;
mod branches;
mod chaos;
mod cli;
mod crawl;
mod crawl_traps;
mod cursors;
mod dashboard;
mod demo_site;
mod durability;
mod elections;
mod faults;
mod feed;
mod fetch;
mod fleet;
mod flow;
mod frontier;
mod hub;
mod incremental;
mod indexes;
mod json_pages;
mod layers;
mod lock;
mod own_site;
mod page_errors;
mod partition;
mod processes;
mod records;
mod seeds;
mod sitemaps;
mod status_page;
mod try_page;
