//! The bot document, typed: what every decision about a bot reads. The store decodes a raw
//! `bots` document into these types (`store::document`) and encodes their changes; nothing here
//! reads or writes the database.

use std::sync::Arc;

use bson::Document;
use chrono::{DateTime, Utc};

use crate::ids::{BotId, LockEpoch, PassNumber};

/// A well-formed bot document.
#[derive(Clone, Debug, PartialEq)]
pub struct BotDoc {
    pub id: BotId,
    pub is_ready: bool,
    pub is_editing: bool,
    pub seeds: Vec<String>,
    pub last_update_started_at: Option<DateTime<Utc>>,
    pub last_seed_updated_at: Option<DateTime<Utc>>,
    pub editing_by: Option<String>,
    pub lock_epoch: LockEpoch,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub lock_expires_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub failed_refreshes: i64,
    pub refresh_requested_at: Option<DateTime<Utc>>,
    /// After a failed refresh, no instance starts another before this (backoff shared by all).
    pub retry_refresh_after: Option<DateTime<Utc>>,
    /// The bot's current crawl pass (0: none started yet).
    pub crawl_pass: PassNumber,
    pub crawl_pass_started_at: Option<DateTime<Utc>>,
    /// Set when the current pass finished; `None` while it runs.
    pub crawl_pass_ended_at: Option<DateTime<Utc>>,
    /// When the last completed pass started: `updated_at` mode re-reads from here − overlap.
    pub crawl_last_run_at: Option<DateTime<Utc>>,
    /// When a refresh succeeded while the current pass ran (the next pass waits for its end).
    pub crawl_next_pass_at: Option<DateTime<Utc>>,
    /// The size (frontier entries) of the last completed pass, `crawlLastPass.pages`: what the
    /// progress displays expect of a running pass. Advisory: an unreadable value is ignored.
    pub crawl_last_pass_pages: Option<u64>,
    /// The current pass's counts as its end recorded them (`crawlLastPass`), once it ended.
    pub crawl_pass_recorded: Option<RecordedCounts>,
    /// The last completed pass's deletion evaluation while it is pending: the pass and until
    /// when its claim holds (`crawlLastPass.evaluation`, `evaluatingUntil`). Advisory.
    pub crawl_evaluation_pending: Option<(PassNumber, DateTime<Utc>)>,
    /// Paused by an operator (`paused: true`): no lock is taken and no URL leased.
    pub paused: bool,
    /// The spec the current pass started with (`crawlPassSpecVersion`, `crawlPassSpec`), for bots
    /// defined in the database.
    pub crawl_pass_spec: Option<Arc<BotSpec>>,
    /// Why the instances cannot run the bot's spec (`specError`), until it is fixed.
    pub spec_error: Option<String>,
    /// `crawlPassRefetch`: the current pass re-extracts every record (its spec changed).
    pub crawl_pass_refetch: bool,
    /// `crawlEvaluatedPass`: the last pass whose deletion evaluation applied its removals (0:
    /// none) — the listing pages' baselines are what they listed then.
    pub crawl_evaluated_pass: PassNumber,
    /// `crawlFeed.staged`: the last pass whose change events were staged (0: none) — records'
    /// pending events of passes up to it may be dropped.
    pub crawl_feed_staged: PassNumber,
}

/// A bot's definition as stored in its document for instances that take their bots from the
/// database: the `[[bots]]` entry (`spec`) and its version (`specVersion`), raised by every change.
#[derive(Clone, Debug, PartialEq)]
pub struct BotSpec {
    pub version: i64,
    pub spec: Document,
}

impl BotSpec {
    /// The spec's refresh schedule as written (`refresh`), unparsed.
    pub(crate) fn refresh(&self) -> Option<&str> {
        self.spec.get_str("refresh").ok()
    }

    /// Whether the spec crawls (it has a `[bots.crawl]` table), not only keeps its seeds fresh.
    pub(crate) fn crawls(&self) -> bool {
        matches!(self.spec.get("crawl"), Some(bson::Bson::Document(_)))
    }
}

/// What a pass records, when it starts, of the spec it runs on: the spec (`None` for a bot from
/// a config file, which clears an earlier pass's) and whether the pass fetches every detail page
/// anew because the pass before it ran on another spec.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PassSpec {
    pub spec: Option<BotSpec>,
    pub refetch: bool,
}

/// What one read of a bot's document found. (`Valid` is much larger than the others; an
/// `Observed` lives for one decision, so it is not boxed.)
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Observed {
    Missing,
    Malformed {
        raw: Document,
        problems: Vec<String>,
    },
    Valid(BotDoc),
}

/// What a pass's end recorded of its pages in `crawlLastPass`: nothing was pending, waiting or
/// leased then, so these are all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedCounts {
    pub done: u64,
    pub failed: u64,
}
