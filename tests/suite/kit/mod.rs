//! The test kit, by concern: the database (`db`: a fresh one per test on the real server named by
//! `MONGODB_URI`, started by `scripts/test`), a seed source whose behaviour a test controls
//! (`seed_source`), bot runners in the test's process (`runner`), real `seedlock` processes
//! (`process`), waiting with a deadline (`wait`); the shops, the crawl helpers, the proxies that
//! delay, blackhole or fault the database, the one-URL frontier helpers and the chaos harness.
#![allow(dead_code)]

pub mod blackhole;
pub mod chaos;
pub mod crawl;
mod db;
pub mod delay;
pub mod faults;
pub mod frontier;
mod process;
mod runner;
mod seed_source;
pub mod shop;
mod wait;

// The examples that include the kit use only some of it.
#[allow(unused_imports)]
pub use {db::*, process::*, runner::*, seed_source::*, wait::*};

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, Document};
use mongodb::{Client, Collection, Database};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use seedlock::clock::{LocalClock, ServerClock};
use seedlock::config::{
    BotSettings, LockSettings, OnRefreshFailure, RefreshLimits, RefreshSchedule, SeedFormat,
    SeedSource,
};
use seedlock::ids::{BotId, InstanceId};
use seedlock::metrics::Metrics;
use seedlock::runner::hub::Hub;
use seedlock::runner::{BotRunner, Context};
use seedlock::seeds::SeedReader;
use seedlock::store::Store;
use seedlock::urls::NormalizedUrl;
