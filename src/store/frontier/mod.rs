//! The crawl frontier (collection `frontier`): one document per (bot, normalized URL), shared by
//! every instance. Work is handed out by leases, **in batches**: one round trip finds candidates,
//! one `update` takes them (filtered on `status: pending`, so two leasers racing for a batch
//! never both get a URL), each batch with a fresh lease token and an expiry on the server's
//! clock. Every later write about a URL filters on its `_id` **and** its lease token, so a worker
//! whose lease expired (and was re-leased) cannot mark the URL done.
//!
//! Passes: each crawl pass has a number. Enqueuing a URL for pass `p` is a no-op when the URL is
//! already in pass `p` (rediscovered links are harmless) and resets it to pending when it was last
//! crawled in an earlier pass. URLs this instance will fetch next can be enqueued **already
//! leased** to it ([`Frontier::enqueue_links`]), so a pagination hop needs no lease query.
//!
//! Writes are paid per batch: new URLs go in one `insert`, resets and settle marks in one
//! `update` command whose statements each cover many documents (per-document values — a page's
//! validators, its record id, a retry time — are picked from a literal array by `_id` inside an
//! update pipeline). The test server applies every statement under one collection lock with its
//! own storage transaction, so statements, not documents, are what a write costs.

use crate::ids::PassNumber;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;
use mongodb::Collection;

use super::indexes::IndexDef;

use super::{date, reply, Store};
use crate::error::{Error, Result};
use crate::http_client::Validators;
use crate::ids::{BotId, InstanceId};
use crate::urls::NormalizedUrl;

mod enqueue;
mod known;
mod lease;
mod manifest;
mod pass;
mod settle;

pub use enqueue::*;
pub use known::*;
pub use lease::*;
pub use manifest::*;
pub use pass::*;
pub use settle::*;
pub const FRONTIER: &str = "frontier";

/// The frontier's main index: `{botId, pass, status, host, priority, slot}`. It serves the lease
/// queries (equalities down to `host`, then a range on `priority` or equalities down to
/// `priority` and an `$in` on `slot`), the reads of a pass's leased and waiting entries, the
/// progress counts and the pass's end (prefixes of it).
pub const FRONTIER_INDEX: &str = "bot_pass_status_host_priority_slot";
/// The listing pages' index: `{kind, botId, pass}` over seed and listing entries only (a partial
/// index, [`listing_partial`]). A pass's start and end ask for the listing pages an earlier pass
/// read: on [`FRONTIER_INDEX`] that query is bounded by every entry of the earlier passes (`kind`
/// is not in it) and reads the whole frontier. Detail entries never enter it, so their writes do
/// not pay for it. It is read without a hint, through [`listing_filters`]: the test server answers
/// a hinted query by reading the whole collection (0.2–0.5 s at 200,000 entries; 30–55 ms through
/// the index: `scripts/bench/listing-reads`). `kind` leads: the test server, given an equality
/// on `kind` alone, reads the index's first field with it.
pub const LISTINGS_INDEX: &str = "bot_pass_listings";
/// Indexes of earlier versions, dropped at start-up: every index is paid on every status change.
pub(crate) const RETIRED_INDEXES: [&str; 3] = [
    "bot_pass_status_expiry",
    "bot_pass_status_slot",
    "bot_pass_status_priority_slot",
];
/// Pending URLs are spread over this many random slots; a leaser asks for a few slots of a host
/// (an `$in` on the index's last field) so that every lease query reads about as many entries as
/// it wants, whatever the pass's size — a server that reads every entry inside a query's bounds
/// (the test server does) would otherwise pay for the whole pass on every lease.
pub(crate) const SLOTS: u32 = 1024;
/// Statements or documents per command: well under the servers' limits (100,000 statements,
/// 16 MiB).
pub(in crate::store) const CHUNK: usize = 1000;
/// `_id`s per `$in` of one multi-document statement: the test server matches a statement's
/// `$in` against every document it updates, so a statement of 1,000 ids costs half as much
/// again per document as ten of 100 in one command (measured: 51 against 35 µs a document).
pub(in crate::store) const IN_CHUNK: usize = 100;
/// Listing pages per cursor batch when manifests are streamed, at most (an HTML listing's is a
/// few KiB, so a reply stays small; large ones, a sitemap file's, go fewer to a batch:
/// `Frontier::each_listing`).
pub(in crate::store) const MANIFESTS_PER_BATCH: u32 = 25;

/// Frontier document field names.
pub(crate) mod field {
    pub(crate) const ID: &str = "_id";
    pub(crate) const BOT: &str = "botId";
    pub(crate) const URL: &str = "url";
    pub(crate) const KIND: &str = "kind";
    pub(crate) const PASS: &str = "pass";
    pub(crate) const STATUS: &str = "status";
    pub(crate) const ATTEMPTS: &str = "attempts";
    pub(crate) const SHEDS: &str = "sheds";
    pub(crate) const NOT_BEFORE: &str = "notBefore";
    pub(crate) const SLOT: &str = "slot";
    pub(crate) const HOST: &str = "host";
    pub(crate) const PRIORITY: &str = "priority";
    /// Links followed from a seed to reach the page (seeds 0; pagination counts too).
    pub(crate) const DEPTH: &str = "depth";
    pub(crate) const LEASE_OWNER: &str = "leaseOwner";
    pub(crate) const LEASE_TOKEN: &str = "leaseToken";
    pub(crate) const LEASED_AT: &str = "leasedAt";
    pub(crate) const LEASE_EXPIRES_AT: &str = "leaseExpiresAt";
    /// The token of the lease whose result settled the entry (done, failed, given back).
    pub(crate) const LAST_LEASE_TOKEN: &str = "lastLeaseToken";
    /// The settle write that did it (a random id per write: a repeated settle matches nothing).
    pub(crate) const SETTLED_BY: &str = "settledBy";
    pub(crate) const LAST_ERROR: &str = "lastError";
    pub(crate) const ETAG: &str = "etag";
    pub(crate) const LAST_MODIFIED: &str = "lastModified";
    pub(crate) const LIST_FINGERPRINT: &str = "listFingerprint";
    pub(crate) const FINGERPRINT: &str = "fingerprint";
    pub(crate) const RECORD_ID: &str = "recordId";
    pub(crate) const ENQUEUED_AT: &str = "enqueuedAt";
    pub(crate) const DISCOVERED_AT: &str = "discoveredAt";
    pub(crate) const DONE_AT: &str = "doneAt";
    /// A listing (or seed) page's manifest, as its last done mark wrote it ([`Manifest`](super::Manifest)): the
    /// frontier ids of the detail pages it listed, in page order…
    pub(crate) const LISTED: &str = "listed";
    /// …each one's fingerprint hash (0: a plain link, no item)…
    pub(crate) const LISTED_FP: &str = "listedFp";
    /// …the positions of those that pass enqueued to fetch (not yet known to be stored)…
    pub(crate) const LISTED_FETCH: &str = "listedFetch";
    /// …a hash of the list as a set, and the pass that read it.
    pub(crate) const LISTED_HASH: &str = "listedHash";
    pub(crate) const LISTED_PASS: &str = "listedPass";
    /// Every detail page the page listed since the last deletion evaluation (this pass's list
    /// included): the evaluation's baseline for this page.
    pub(crate) const LISTED_SINCE: &str = "listedSince";
    /// True when `listedSince` holds pages `listed` no longer does: the page's list changed
    /// since the last evaluation.
    pub(crate) const LISTED_SINCE_MORE: &str = "listedSinceMore";
}

use field as f;

/// What a page is to the crawl.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageKind {
    Seed,
    List,
    Detail,
}

impl PageKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PageKind::Seed => "seed",
            PageKind::List => "list",
            PageKind::Detail => "detail",
        }
    }

    /// Leased first when higher: seeds 2, listing pages 1, detail pages 0.
    pub fn default_priority(self) -> i64 {
        match self {
            PageKind::Seed => 2,
            PageKind::List => 1,
            PageKind::Detail => 0,
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "seed" => Some(PageKind::Seed),
            "list" => Some(PageKind::List),
            "detail" => Some(PageKind::Detail),
            _ => None,
        }
    }

    /// The kinds [`PageKind::is_listing`] answers yes for: exactly those whose name sorts after
    /// `detail`, the bound of [`LISTINGS_INDEX`]'s partial filter (a unit test holds them to it).
    pub(crate) const LISTING: [PageKind; 2] = [PageKind::List, PageKind::Seed];

    /// Seeds and listing pages: read every pass, their links are the pass's evidence.
    pub(crate) fn is_listing(self) -> bool {
        Self::LISTING.contains(&self)
    }
}

/// A frontier entry's `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UrlStatus {
    /// Waiting to be leased.
    Pending,
    /// A retry (or a deferral) whose `notBefore` has not come yet.
    Waiting,
    /// Some worker's until `leaseExpiresAt`.
    Leased,
    Done,
    Failed,
}

impl UrlStatus {
    pub(crate) const ALL: [UrlStatus; 5] = [
        UrlStatus::Pending,
        UrlStatus::Waiting,
        UrlStatus::Leased,
        UrlStatus::Done,
        UrlStatus::Failed,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            UrlStatus::Pending => "pending",
            UrlStatus::Waiting => "waiting",
            UrlStatus::Leased => "leased",
            UrlStatus::Done => "done",
            UrlStatus::Failed => "failed",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        UrlStatus::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// A URL leased to this worker until `expires_at`. Times here are the caller's estimate of the
/// server's time (`ServerClock::now`, as for the bot lock). Every write about it carries `token`.
#[derive(Clone, Debug, PartialEq)]
pub struct UrlLease {
    pub bot: BotId,
    pub id: String,
    pub url: NormalizedUrl,
    pub kind: PageKind,
    pub pass: PassNumber,
    /// The lease's token: shared by the URLs leased in one round trip, and every write about this
    /// URL filters on its `_id` and this token.
    pub token: String,
    pub expires_at: DateTime<Utc>,
    /// How many times this URL has been leased in this pass, this lease included.
    pub attempt: i64,
    /// When this lease was taken (server time): a later lease of the same URL is always later,
    /// which orders the results of two workers without a transaction.
    pub leased_at: DateTime<Utc>,
    /// The page's validators for a conditional GET: as stored when leased; the crawl replaces
    /// them with the fetched page's before the done mark stores them.
    pub validators: Validators,
    /// The listing fingerprint this URL was enqueued with (stored as `fingerprint` when done).
    pub list_fingerprint: Option<String>,
    /// The record this page produced last time it was crawled, if any.
    pub record_id: Option<String>,
    /// True when this lease took over one a dead predecessor of this instance id held.
    pub reclaimed: bool,
    pub priority: i64,
    /// Times this URL was shed in this pass.
    pub sheds: i64,
    /// Links followed from a seed to reach it (its links are one deeper).
    pub depth: u32,
    /// Since when the URL could be leased (its `notBefore`): how long it waited.
    pub eligible_since: Option<DateTime<Utc>>,
}

impl UrlLease {
    pub(crate) fn host(&self) -> String {
        self.url.host_port()
    }
}

/// A URL to add to a pass.
#[derive(Clone, Debug, PartialEq)]
pub struct NewUrl {
    pub url: NormalizedUrl,
    pub kind: PageKind,
    /// For detail pages found on a listing: the item's fingerprint there.
    pub fingerprint: Option<String>,
    /// Leased first when higher (see [`PageKind::default_priority`]).
    pub priority: i64,
    /// Links followed from a seed to reach it (seeds 0).
    pub depth: u32,
}

/// The frontier `_id`: a hash of (bot, normalized URL), the same on every instance and every run.
pub fn url_id(bot: &BotId, url: &NormalizedUrl) -> String {
    crate::ids::sha256_hex(
        &[bot.as_str().as_bytes(), &[0], url.as_str().as_bytes()],
        16,
    )
}

fn text(v: Option<&str>) -> Bson {
    v.map_or(Bson::Null, |s| Bson::String(s.to_owned()))
}

pub(in crate::store) fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn get_date(doc: &Document, name: &str) -> Option<DateTime<Utc>> {
    match doc.get(name) {
        Some(Bson::DateTime(t)) => Some(t.to_chrono()),
        _ => None,
    }
}

fn get_text(doc: &Document, name: &str) -> Option<String> {
    doc.get_str(name).ok().map(str::to_owned)
}

/// An entry's `depth` (0 when it has none: an entry written before depths were kept).
fn depth_of(doc: &Document) -> u32 {
    get_int(doc, f::DEPTH).map_or(0, |d| u32::try_from(d.max(0)).unwrap_or(u32::MAX))
}

fn get_int(doc: &Document, name: &str) -> Option<i64> {
    doc.get(name).and_then(crate::store::document::integer)
}

/// Inside an update pipeline: this document's value out of `values`, by the position of its
/// `_id` in `ids` (both literal, so no value is read as a field path or an operator).
fn pick(ids: &[Bson], values: Vec<Bson>) -> Bson {
    Bson::Document(doc! {
        "$arrayElemAt": [
            { "$literal": values },
            { "$indexOfArray": [ { "$literal": ids }, "$_id" ] },
        ]
    })
}

/// A pipeline value that is literally `value` (a string starting with `$` stays a string).
fn literal(value: impl Into<Bson>) -> Bson {
    Bson::Document(doc! { "$literal": value.into() })
}

/// The `frontier` collection, reached through [`Store::frontier`].
#[derive(Clone, Copy, Debug)]
pub struct Frontier<'a> {
    pub(in crate::store) store: &'a Store,
}

impl Frontier<'_> {
    pub(in crate::store) fn collection(self) -> Collection<Document> {
        self.store.database().collection(FRONTIER)
    }

    /// Creates the frontier's indexes, rebuilds one whose definition changed, drops those of
    /// earlier versions (idempotent; see `store::indexes`).
    pub async fn ensure_indexes(self) -> Result<()> {
        let main = IndexDef::new(
            FRONTIER_INDEX,
            doc! { f::BOT: 1, f::PASS: 1, f::STATUS: 1, f::HOST: 1, f::PRIORITY: 1, f::SLOT: 1 },
        );
        let listings = IndexDef {
            partial: Some(listing_partial()),
            ..IndexDef::new(LISTINGS_INDEX, doc! { f::KIND: 1, f::BOT: 1, f::PASS: 1 })
        };
        super::indexes::ensure(self.store, FRONTIER, &[main, listings], &RETIRED_INDEXES).await
    }
}

/// A listing page of `shop.test` at `path`, as a link to enqueue (for the unit tests).
#[cfg(test)]
fn listing_link(path: &str) -> NewUrl {
    NewUrl {
        url: NormalizedUrl::parse(&format!("http://shop.test/{path}")).unwrap(),
        kind: PageKind::List,
        fingerprint: None,
        priority: 1,
        depth: 0,
    }
}
