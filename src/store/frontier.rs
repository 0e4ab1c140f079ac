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

use super::indexes::Wanted;

use super::{reply, Store};
use crate::error::{Error, Result};
use crate::fetch::Validators;
use crate::ids::{BotId, InstanceId};
use crate::urls::NormalizedUrl;

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
pub const RETIRED_INDEXES: [&str; 3] = [
    "bot_pass_status_expiry",
    "bot_pass_status_slot",
    "bot_pass_status_priority_slot",
];
/// Pending URLs are spread over this many random slots; a leaser asks for a few slots of a host
/// (an `$in` on the index's last field) so that every lease query reads about as many entries as
/// it wants, whatever the pass's size — a server that reads every entry inside a query's bounds
/// (the test server does) would otherwise pay for the whole pass on every lease.
pub const SLOTS: u32 = 1024;
/// Statements or documents per command: well under the servers' limits (100,000 statements,
/// 16 MiB).
pub(super) const CHUNK: usize = 1000;
/// `_id`s per `$in` of one multi-document statement: the test server matches a statement's
/// `$in` against every document it updates, so a statement of 1,000 ids costs half as much
/// again per document as ten of 100 in one command (measured: 51 against 35 µs a document).
pub(super) const IN_CHUNK: usize = 100;
/// Listing pages per cursor batch when manifests are streamed (each several KiB: a reply stays
/// small enough that decoding it never takes much memory at once).
pub(super) const MANIFESTS_PER_BATCH: u32 = 25;

/// Frontier document field names.
pub mod field {
    pub const ID: &str = "_id";
    pub const BOT: &str = "botId";
    pub const URL: &str = "url";
    pub const KIND: &str = "kind";
    pub const PASS: &str = "pass";
    pub const STATUS: &str = "status";
    pub const ATTEMPTS: &str = "attempts";
    pub const SHEDS: &str = "sheds";
    pub const NOT_BEFORE: &str = "notBefore";
    pub const SLOT: &str = "slot";
    pub const HOST: &str = "host";
    pub const PRIORITY: &str = "priority";
    pub const LEASE_OWNER: &str = "leaseOwner";
    pub const LEASE_TOKEN: &str = "leaseToken";
    pub const LEASED_AT: &str = "leasedAt";
    pub const LEASE_EXPIRES_AT: &str = "leaseExpiresAt";
    /// The token of the lease whose result settled the entry (done, failed, given back).
    pub const LAST_LEASE_TOKEN: &str = "lastLeaseToken";
    /// The settle write that did it (a random id per write: a repeated settle matches nothing).
    pub const SETTLED_BY: &str = "settledBy";
    pub const LAST_ERROR: &str = "lastError";
    pub const ETAG: &str = "etag";
    pub const LAST_MODIFIED: &str = "lastModified";
    pub const LIST_FINGERPRINT: &str = "listFingerprint";
    pub const FINGERPRINT: &str = "fingerprint";
    pub const RECORD_ID: &str = "recordId";
    pub const ENQUEUED_AT: &str = "enqueuedAt";
    pub const DISCOVERED_AT: &str = "discoveredAt";
    pub const DONE_AT: &str = "doneAt";
    /// A listing (or seed) page's manifest, as its last done mark wrote it ([`Manifest`](super::Manifest)): the
    /// frontier ids of the detail pages it listed, in page order…
    pub const LISTED: &str = "listed";
    /// …each one's fingerprint hash (0: a plain link, no item)…
    pub const LISTED_FP: &str = "listedFp";
    /// …the positions of those that pass enqueued to fetch (not yet known to be stored)…
    pub const LISTED_FETCH: &str = "listedFetch";
    /// …a hash of the list as a set, and the pass that read it.
    pub const LISTED_HASH: &str = "listedHash";
    pub const LISTED_PASS: &str = "listedPass";
    /// Every detail page the page listed since the last deletion evaluation (this pass's list
    /// included): the evaluation's baseline for this page.
    pub const LISTED_SINCE: &str = "listedSince";
    /// True when `listedSince` holds pages `listed` no longer does: the page's list changed
    /// since the last evaluation.
    pub const LISTED_SINCE_MORE: &str = "listedSinceMore";
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
    pub fn as_str(self) -> &'static str {
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

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "seed" => Some(PageKind::Seed),
            "list" => Some(PageKind::List),
            "detail" => Some(PageKind::Detail),
            _ => None,
        }
    }

    /// The kinds [`PageKind::is_listing`] answers yes for: exactly those whose name sorts after
    /// `detail`, the bound of [`LISTINGS_INDEX`]'s partial filter (a unit test holds them to it).
    pub const LISTING: [PageKind; 2] = [PageKind::List, PageKind::Seed];

    /// Seeds and listing pages: read every pass, their links are the pass's evidence.
    pub fn is_listing(self) -> bool {
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
    pub const ALL: [UrlStatus; 5] = [
        UrlStatus::Pending,
        UrlStatus::Waiting,
        UrlStatus::Leased,
        UrlStatus::Done,
        UrlStatus::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            UrlStatus::Pending => "pending",
            UrlStatus::Waiting => "waiting",
            UrlStatus::Leased => "leased",
            UrlStatus::Done => "done",
            UrlStatus::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
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
    /// Since when the URL could be leased (its `notBefore`): how long it waited.
    pub eligible_since: Option<DateTime<Utc>>,
}

impl UrlLease {
    pub fn host(&self) -> String {
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
}

/// What the frontier remembers of a URL from any pass (the incremental modes decide from it
/// whether a detail page needs fetching; an enqueue, whether to insert or reset it).
#[derive(Clone, Debug, PartialEq)]
pub struct KnownPage {
    pub pass: PassNumber,
    pub status: Option<UrlStatus>,
    /// The listing fingerprint the page was last stored with.
    pub fingerprint: Option<String>,
    pub record_id: Option<String>,
    pub validators: Validators,
}

/// Counts of a pass's URLs by status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassProgress {
    pub pending: u64,
    /// Retries whose `notBefore` has not come yet.
    pub waiting: u64,
    pub leased: u64,
    pub done: u64,
    pub failed: u64,
}

impl From<crate::store::document::RecordedCounts> for PassProgress {
    fn from(c: crate::store::document::RecordedCounts) -> Self {
        PassProgress {
            done: c.done,
            failed: c.failed,
            ..PassProgress::default()
        }
    }
}

impl PassProgress {
    /// The pass is over only when nothing is pending or waiting and nothing is leased by anyone.
    pub fn is_finished(&self) -> bool {
        self.pending == 0 && self.waiting == 0 && self.leased == 0
    }
}

/// What a listing (or seed) page listed when this pass read it, carried by the page's fenced done
/// mark — one write per listing page, none per item, and nothing at all for where an item sits in
/// the pagination. `listed` holds the frontier ids of the detail pages the page points at (its
/// items' links, then its other links the record rules match), `fingerprints` the hash of each
/// item's listing fingerprint ([`fingerprint_hash`]; 0 for a plain link), `fetched` the
/// positions of the items this pass enqueued to fetch (their records are not known stored until
/// the fetch commits).
///
/// The next pass decides from the manifests which items need no fetch and no read
/// (`crawl::known`); deletion detection compares them with what the page listed at the last
/// evaluation (`store::deletions`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Manifest {
    pub listed: Vec<String>,
    pub fingerprints: Vec<i64>,
    pub fetched: Vec<i32>,
    /// The last pass whose evaluation applied its removals, as the reader knew it: a page whose
    /// previous read was that pass's starts its baseline anew from that read (an older value
    /// only keeps more — a superset is always safe).
    pub evaluated: PassNumber,
}

impl Manifest {
    /// Adds a detail page (once: a page that lists an item twice lists it once).
    pub fn push(&mut self, id: String, fingerprint: i64, fetched: bool) -> bool {
        if self.listed.contains(&id) {
            return false;
        }
        if fetched {
            self.fetched
                .push(i32::try_from(self.listed.len()).unwrap_or(i32::MAX));
        }
        self.listed.push(id);
        self.fingerprints.push(fingerprint);
        true
    }

    /// A hash of the list as a set (order and repeats do not count).
    pub fn hash(&self) -> String {
        let mut ids: Vec<&str> = self.listed.iter().map(String::as_str).collect();
        ids.sort_unstable();
        ids.dedup();
        let joined = ids.join("\n");
        crate::ids::sha256_hex(&[joined.as_bytes()], 16)
    }
}

/// A listing fingerprint as a manifest keeps it: 64 bits of its hash, never 0 (0 marks a plain
/// link).
pub fn fingerprint_hash(fingerprint: &str) -> i64 {
    match crate::ids::sha256_u64(&[fingerprint.as_bytes()]) as i64 {
        0 => 1,
        n => n,
    }
}

/// Failed URLs of a pass that share a reason ([`Frontier::failure_reasons`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FailureReason {
    pub reason: String,
    pub count: u64,
    /// One of them (the smallest URL, so that the example is stable).
    pub example: String,
}

/// How a leased URL ends its lease.
#[derive(Clone, Debug, PartialEq)]
pub enum Mark {
    /// Done: its validators, listing fingerprint (`listFingerprint` → `fingerprint`) and the
    /// record it produced (if any; else the one it had) are kept for the next pass; a listing
    /// or seed page's done mark carries its [`Manifest`].
    Done {
        validators: Validators,
        record_id: Option<String>,
        manifest: Option<Box<Manifest>>,
    },
    /// Failed for good, with the reason.
    Failed { reason: String },
    /// Another attempt no earlier than `not_before` (the attempt counts).
    Retry {
        not_before: DateTime<Utc>,
        reason: String,
    },
    /// Given back unfetched or uncounted (shutdown, a paused host, a slice's end): the attempt
    /// does not count.
    Release {
        not_before: DateTime<Utc>,
        reason: String,
    },
    /// Deferred by load shedding (counted in `sheds`, not in `attempts`).
    Shed { not_before: DateTime<Utc> },
}

impl Mark {
    fn group(&self) -> u8 {
        match self {
            Mark::Done { manifest: None, .. } => 0,
            Mark::Done {
                manifest: Some(_), ..
            } => 5,
            Mark::Failed { .. } => 1,
            Mark::Retry { .. } => 2,
            Mark::Release { .. } => 3,
            Mark::Shed { .. } => 4,
        }
    }
}

/// A pending URL found by [`Frontier::lease_candidates`], not leased yet.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub id: String,
    pub host: String,
    pub priority: i64,
    pub slot: u32,
    doc: Document,
}

/// Which pending URLs of one host a lease query looks for.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateQuery {
    pub host: String,
    pub priority: Priority,
    /// The slots to look in (`None`: all of them).
    pub slots: Option<Vec<u32>>,
    pub limit: usize,
}

/// The priority part of a [`CandidateQuery`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// Every priority above this one (a range on the index's `priority`).
    Above(i64),
    Exactly(i64),
}

/// A leased entry of a pass, as [`Frontier::leased_entries`] reads it.
#[derive(Clone, Debug)]
pub struct LeasedEntry {
    pub id: String,
    pub host: String,
    pub owner: Option<String>,
    pub token: Option<String>,
    pub leased_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// What [`Frontier::take_leases`] should take: pending candidates, leases past their expiry, and
/// leases a dead predecessor of this instance id still holds (by their token).
#[derive(Clone, Debug, Default)]
pub struct Takes<'a> {
    pub pending: &'a [Candidate],
    pub expired: &'a [String],
    pub reclaim: &'a [(String, String)],
}

/// A link of an earlier pass being enqueued again: the link, its frontier id, whether it is
/// leased on enqueue, what the frontier knew of it.
type Reset<'a> = (&'a NewUrl, String, bool, &'a KnownPage);

/// An enqueue's writer and what it takes: the bot, the pass and the time, and — when the write
/// leases links as it enqueues them — their owner, a fresh token and the expiry. It writes every
/// new or reset entry's fields and the leases it took, the same for every kind of enqueue.
struct Taking<'a> {
    bot: &'a BotId,
    pass: PassNumber,
    owner: Option<&'a str>,
    token: String,
    expires_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
}

impl<'a> Taking<'a> {
    fn new(
        bot: &'a BotId,
        pass: PassNumber,
        lease: Option<&LeaseTo<'a>>,
        now: DateTime<Utc>,
    ) -> Self {
        Taking {
            bot,
            pass,
            owner: lease.map(|l| l.me.as_str()),
            token: new_token(),
            expires_at: lease.map(|l| super::plus(now, l.lease_for)),
            now,
        }
    }

    /// The lease fields of an entry enqueued `leased` (to the owner, with this write's token),
    /// or pending.
    fn lease_fields(&self, leased: bool) -> Document {
        match (leased, self.owner, self.expires_at) {
            (true, Some(owner), Some(expires)) => doc! {
                f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_OWNER: owner,
                f::LEASE_TOKEN: self.token.as_str(), f::LEASE_EXPIRES_AT: date(expires),
                f::LEASED_AT: date(self.now),
            },
            _ => doc! {
                f::STATUS: UrlStatus::Pending.as_str(), f::LEASE_OWNER: Bson::Null,
                f::LEASE_TOKEN: Bson::Null, f::LEASE_EXPIRES_AT: Bson::Null,
            },
        }
    }

    /// A new or reset entry's fields for `link` (all but `_id` and `discoveredAt`).
    fn entry(&self, link: &NewUrl, leased: bool) -> Document {
        let mut entry = doc! {
            f::BOT: self.bot.as_str(), f::URL: link.url.as_str(), f::KIND: link.kind.as_str(),
            f::PASS: self.pass, f::ATTEMPTS: i64::from(leased), f::SHEDS: 0_i64,
            f::LAST_ERROR: Bson::Null, f::ENQUEUED_AT: date(self.now),
            f::NOT_BEFORE: date(self.now), f::SLOT: i64::from(rand::random_range(0..SLOTS)),
            f::HOST: link.url.host_port(), f::PRIORITY: link.priority,
            f::LIST_FINGERPRINT: text(link.fingerprint.as_deref()),
        };
        for (name, value) in self.lease_fields(leased) {
            entry.insert(name, value);
        }
        entry
    }

    /// The lease taken on `link` (frontier id `id`) as it was enqueued; an entry reset from an
    /// earlier pass (`known`) keeps its validators and record id.
    fn lease(&self, link: &NewUrl, id: &str, known: Option<&KnownPage>) -> UrlLease {
        UrlLease {
            bot: self.bot.clone(),
            id: id.to_owned(),
            url: link.url.clone(),
            kind: link.kind,
            pass: self.pass,
            token: self.token.clone(),
            expires_at: self.expires_at.unwrap_or(self.now),
            attempt: 1,
            leased_at: self.now,
            validators: known.map(|k| k.validators.clone()).unwrap_or_default(),
            list_fingerprint: link.fingerprint.clone(),
            record_id: known.and_then(|k| k.record_id.clone()),
            reclaimed: false,
            priority: link.priority,
            sheds: 0,
            eligible_since: Some(self.now),
        }
    }
}

/// The frontier `_id`: a hash of (bot, normalized URL), the same on every instance and every run.
pub fn url_id(bot: &BotId, url: &NormalizedUrl) -> String {
    crate::ids::sha256_hex(
        &[bot.as_str().as_bytes(), &[0], url.as_str().as_bytes()],
        16,
    )
}

/// The filter of one lease query ([`CandidateQuery`]): equalities down to `host`, then a range
/// on `priority`, or equalities down to `priority` and an `$in` on `slot`. Every server answers
/// it from the index alone (the test server only when the one non-equality is on the field after
/// the equalities). Public for the `explain` test, so the test checks the queries the code sends.
pub fn candidate_filter(bot: &BotId, pass: PassNumber, query: &CandidateQuery) -> Document {
    let mut filter = doc! {
        f::BOT: bot.as_str(), f::PASS: pass, f::STATUS: UrlStatus::Pending.as_str(),
        f::HOST: query.host.as_str(),
    };
    match query.priority {
        Priority::Above(p) => {
            // Priorities are whole numbers; `$gte` (not `$gt`, which the test server answers by
            // reading every entry of the host) keeps the range on the index.
            filter.insert(f::PRIORITY, doc! { "$gte": p.saturating_add(1) });
        }
        Priority::Exactly(p) => {
            filter.insert(f::PRIORITY, p);
            if let Some(slots) = &query.slots {
                let slots: Vec<i64> = slots.iter().map(|s| i64::from(*s)).collect();
                filter.insert(f::SLOT, doc! { "$in": slots });
            }
        }
    }
    filter
}

/// The filters that read `bot`'s seed and listing entries whose `pass` meets `pass` (one operator:
/// `{$eq: n}`, `{$lt: n}`, `{$gte: 0}` for all), one per listing kind. Each is the index's own
/// fields, equalities then one operator — a shape every server answers from [`LISTINGS_INDEX`]
/// with no hint (the test server routes only that shape through an index, and a bare `pass: n`
/// beside the partial filter's field not at all). Conditions on other fields are the reader's.
pub fn listing_filters(bot: &BotId, pass: Document) -> Vec<Document> {
    PageKind::LISTING
        .iter()
        .map(|kind| doc! { f::KIND: kind.as_str(), f::BOT: bot.as_str(), f::PASS: pass.clone() })
        .collect()
}

/// The seed and listing entries an earlier pass than `pass` read (see [`listing_filters`]); of
/// them, [`read_since`] tells those the last complete pass read.
pub fn unreached_listings_filters(bot: &BotId, pass: PassNumber) -> Vec<Document> {
    listing_filters(bot, doc! { "$lt": pass })
}

/// Whether a listing entry (read with its `status` and `doneAt`) was read, done, since `since`.
pub fn read_since(entry: &bson::RawDocument, since: DateTime<Utc>) -> bool {
    entry.get_str(f::STATUS).ok() == Some(UrlStatus::Done.as_str())
        && entry
            .get_datetime(f::DONE_AT)
            .ok()
            .is_some_and(|at| at.to_chrono() >= since)
}

/// [`LISTINGS_INDEX`]'s partial filter: the kinds that link to other pages, as the one bound
/// every server proves a query implies (`list` and `seed` sort after `detail`; an `$in` of the
/// kinds is a filter the test server never proves implied, and MongoDB accepts only from 6.0).
fn listing_partial() -> Document {
    doc! { f::KIND: { "$gt": PageKind::Detail.as_str() } }
}

/// The filter that reads a pass's entries of one status (a prefix of the index).
pub fn status_filter(bot: &BotId, pass: PassNumber, status: UrlStatus) -> Document {
    doc! { f::BOT: bot.as_str(), f::PASS: pass, f::STATUS: status.as_str() }
}

use super::date;

fn text(v: Option<&str>) -> Bson {
    v.map_or(Bson::Null, |s| Bson::String(s.to_owned()))
}

pub(super) fn new_token() -> String {
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

/// The `update` statement that resets `chunk` (links of earlier passes) into the pass of
/// `taking` — one statement, per-link values picked by `_id`; the links to lease leased to its
/// owner. Filtered on `pass < current`: sent twice, the second matches nothing.
fn reset_statement(taking: &Taking<'_>, chunk: &[Reset<'_>]) -> Document {
    let (bot, pass) = (taking.bot, taking.pass);
    let ids: Vec<Bson> = chunk
        .iter()
        .map(|(_, id, _, _)| Bson::String(id.clone()))
        .collect();
    let filter = doc! { f::ID: { "$in": &ids }, f::BOT: bot.as_str(), f::PASS: { "$lt": pass } };
    // Links leased here and alike in everything else the reset sets (the last pass's listing
    // pages, leased into this one): a plain `$set` of the entry as `Taking::entry` writes it —
    // a pipeline of per-link columns costs the server an evaluation of every column for every
    // entry — with one random slot for the chunk. (Not for pending links: the lease queries
    // sample pending entries by slot, and a hundred in one slot would make that lumpy.)
    let alike = |a: &Reset<'_>, b: &Reset<'_>| {
        (a.0.kind, a.0.priority, &a.0.fingerprint) == (b.0.kind, b.0.priority, &b.0.fingerprint)
    };
    if chunk.iter().all(|(_, _, leased, _)| *leased)
        && chunk.windows(2).all(|w| alike(&w[0], &w[1]))
    {
        if let Some((link, _, _, _)) = chunk.first() {
            let mut set = taking.entry(link, true);
            // Each link's own fields stay as its entry holds them.
            for own in [f::URL, f::HOST] {
                set.remove(own);
            }
            return doc! { "q": filter, "u": { "$set": set }, "multi": true };
        }
    }
    let column = |value: &dyn Fn(&Reset<'_>) -> Bson| pick(&ids, chunk.iter().map(value).collect());
    let mut set = doc! {
        f::KIND: column(&|(l, _, _, _)| Bson::String(l.kind.as_str().into())),
        f::PASS: pass,
        f::ATTEMPTS: column(&|(_, _, leased, _)| Bson::Int64(i64::from(*leased))),
        f::SHEDS: 0_i64,
        f::LAST_ERROR: Bson::Null,
        f::ENQUEUED_AT: date(taking.now),
        f::NOT_BEFORE: date(taking.now),
        f::SLOT: column(&|_| Bson::Int64(i64::from(rand::random_range(0..SLOTS)))),
        f::PRIORITY: column(&|(l, _, _, _)| Bson::Int64(l.priority)),
        f::LIST_FINGERPRINT: column(&|(l, _, _, _)| text(l.fingerprint.as_deref())),
    };
    if chunk.iter().any(|(_, _, leased, _)| *leased) {
        for name in [
            f::STATUS,
            f::LEASE_OWNER,
            f::LEASE_TOKEN,
            f::LEASE_EXPIRES_AT,
            f::LEASED_AT,
        ] {
            let value = column(&|(_, _, leased, _)| {
                taking
                    .lease_fields(*leased)
                    .remove(name)
                    .unwrap_or(Bson::Null)
            });
            set.insert(name, value);
        }
    } else {
        for (name, value) in taking.lease_fields(false) {
            set.insert(name, value);
        }
    }
    doc! { "q": filter, "u": [ { "$set": set } ], "multi": true }
}

/// A pipeline value that is literally `value` (a string starting with `$` stays a string).
fn literal(value: impl Into<Bson>) -> Bson {
    Bson::Document(doc! { "$literal": value.into() })
}

/// How long a lease write may wait on the server (`maxTimeMS`) for documents an open
/// transaction holds before it gives up on them.
pub const LEASE_WRITE_MAX_TIME: Duration = Duration::from_secs(2);

/// What [`Frontier::take_leases`] took.
#[derive(Debug, Default)]
pub struct Taken {
    /// Highest priority first.
    pub leases: Vec<UrlLease>,
    /// The write met documents an open transaction holds (it was cut short at
    /// [`LEASE_WRITE_MAX_TIME`], or refused with a write conflict): the URLs not in `leases`
    /// are busy, and worth leaving alone for a while.
    pub held: bool,
    /// The token of a write given up on before its answer: what it takes when it lands later
    /// carries this token, and is this process's to reclaim.
    pub abandoned: Option<String>,
}

/// How long the leaser waits for a lease write's answer: its `maxTimeMS` and a second more,
/// for a server that does not honour `maxTimeMS` on a write that waits for a transaction.
const LEASE_WRITE_WAIT: Duration = Duration::from_secs(3);

impl KnownPage {
    /// The fields a read of known pages projects (with `extra`).
    pub fn projection(extra: &[&str]) -> Document {
        let mut projection = doc! {
            f::PASS: 1, f::STATUS: 1, f::FINGERPRINT: 1, f::RECORD_ID: 1, f::ETAG: 1,
            f::LAST_MODIFIED: 1,
        };
        for name in extra {
            projection.insert(*name, 1);
        }
        projection
    }

    /// What an entry read raw with [`KnownPage::projection`] holds (a field that does not read
    /// is missing).
    pub fn from_raw(entry: &bson::RawDocument) -> KnownPage {
        Document::try_from(entry).map_or_else(
            |_| KnownPage::from_doc(&Document::new()),
            |doc| KnownPage::from_doc(&doc),
        )
    }

    fn from_doc(doc: &Document) -> KnownPage {
        KnownPage {
            pass: get_int(doc, f::PASS).map_or(PassNumber::NONE, PassNumber::new),
            status: doc.get_str(f::STATUS).ok().and_then(UrlStatus::parse),
            fingerprint: get_text(doc, f::FINGERPRINT),
            record_id: get_text(doc, f::RECORD_ID),
            validators: Validators {
                etag: get_text(doc, f::ETAG),
                last_modified: get_text(doc, f::LAST_MODIFIED),
            },
        }
    }
}

/// The lease this worker took of `doc` (as read before the take; `attempts` before it).
fn lease_of(
    bot: &BotId,
    doc: &Document,
    pass: PassNumber,
    token: &str,
    now: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    reclaimed: bool,
) -> Result<UrlLease> {
    let bad = |what: &str| Error::Protocol {
        what: "lease url",
        detail: format!("frontier document without a valid {what}: {doc}"),
    };
    let url = doc
        .get_str(f::URL)
        .ok()
        .and_then(|u| NormalizedUrl::parse(u).ok())
        .ok_or_else(|| bad("url"))?;
    let kind = doc
        .get_str(f::KIND)
        .ok()
        .and_then(PageKind::parse)
        .ok_or_else(|| bad("kind"))?;
    let attempts = get_int(doc, f::ATTEMPTS).unwrap_or(0);
    Ok(UrlLease {
        bot: bot.clone(),
        id: doc.get_str(f::ID).map_err(|_| bad("_id"))?.to_owned(),
        validators: Validators {
            etag: get_text(doc, f::ETAG),
            last_modified: get_text(doc, f::LAST_MODIFIED),
        },
        list_fingerprint: get_text(doc, f::LIST_FINGERPRINT),
        record_id: get_text(doc, f::RECORD_ID),
        reclaimed,
        priority: get_int(doc, f::PRIORITY).unwrap_or_else(|| kind.default_priority()),
        sheds: get_int(doc, f::SHEDS).unwrap_or(0),
        eligible_since: get_date(doc, f::NOT_BEFORE),
        url,
        kind,
        pass,
        token: token.to_owned(),
        expires_at,
        leased_at: now,
        // A reclaimed lease is the same attempt as the one its predecessor took.
        attempt: if reclaimed {
            attempts.max(1)
        } else {
            attempts + 1
        },
    })
}

/// The cursor batch for an answer of at most `n` documents: all of it in the first reply (the
/// driver's default first batch is 101 documents, and every further batch is one more round
/// trip). One more than `n`: a batch the answer fills exactly leaves the cursor open on the
/// test server, and the driver then sends a `getMore` to learn that it is exhausted.
fn whole_batch(n: usize) -> u32 {
    u32::try_from(n.saturating_add(1)).unwrap_or(u32::MAX)
}

/// The fields a lease read needs.
fn lease_projection() -> Document {
    doc! {
        f::URL: 1, f::KIND: 1, f::ATTEMPTS: 1, f::ETAG: 1, f::LAST_MODIFIED: 1,
        f::LIST_FINGERPRINT: 1, f::RECORD_ID: 1, f::PRIORITY: 1, f::SHEDS: 1, f::NOT_BEFORE: 1,
        f::HOST: 1, f::SLOT: 1, f::LEASE_TOKEN: 1, f::STATUS: 1,
    }
}

/// The `frontier` collection, reached through [`Store::frontier`].
#[derive(Clone, Copy, Debug)]
pub struct Frontier<'a> {
    pub(super) store: &'a Store,
}

impl Frontier<'_> {
    pub(super) fn collection(self) -> Collection<Document> {
        self.store.database().collection(FRONTIER)
    }

    /// Creates the frontier's indexes, rebuilds one whose definition changed, drops those of
    /// earlier versions (idempotent; see `store::indexes`).
    pub async fn ensure_indexes(self) -> Result<()> {
        let main = Wanted::new(
            FRONTIER_INDEX,
            doc! { f::BOT: 1, f::PASS: 1, f::STATUS: 1, f::HOST: 1, f::PRIORITY: 1, f::SLOT: 1 },
        );
        let listings = Wanted {
            partial: Some(listing_partial()),
            ..Wanted::new(LISTINGS_INDEX, doc! { f::KIND: 1, f::BOT: 1, f::PASS: 1 })
        };
        super::indexes::ensure(self.store, FRONTIER, &[main, listings], &RETIRED_INDEXES).await
    }

    /// Adds `urls` (all of one kind) to pass `pass`; see [`Frontier::enqueue_urls`].
    pub async fn enqueue(
        self,
        bot: &BotId,
        pass: PassNumber,
        kind: PageKind,
        urls: &[NormalizedUrl],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let urls: Vec<NewUrl> = urls
            .iter()
            .map(|url| NewUrl {
                url: url.clone(),
                kind,
                fingerprint: None,
                priority: kind.default_priority(),
            })
            .collect();
        self.enqueue_urls(bot, pass, &urls, now).await
    }

    /// Adds `urls` to pass `pass`: new URLs are inserted pending; URLs last crawled in an earlier
    /// pass become pending again (keeping their validators and record id); URLs already in this
    /// pass are left alone. Returns how many were added or reset.
    pub async fn enqueue_urls(
        self,
        bot: &BotId,
        pass: PassNumber,
        urls: &[NewUrl],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let ids: Vec<String> = urls.iter().map(|n| url_id(bot, &n.url)).collect();
        let known = self.known_by_id(bot, &ids).await?;
        Ok(self
            .enqueue_links(bot, pass, urls, &known, None, now)
            .await?
            .added)
    }

    /// Adds `links` to pass `pass` as [`Frontier::enqueue_urls`] does, given what the frontier
    /// already holds of them (`known`, by frontier `_id`, as [`Frontier::known_pages`] read it; a
    /// link missing from it is taken to be new). With `lease`, the first `lease.first` links are
    /// enqueued **leased** to `lease.me` — in the same write, so nobody else can take them — and
    /// returned as leases (those another instance enqueued first are not).
    ///
    /// Round trips: one `insert` for the new links, one `update` for those of earlier passes
    /// (none when there are none).
    pub async fn enqueue_links(
        self,
        bot: &BotId,
        pass: PassNumber,
        links: &[NewUrl],
        known: &HashMap<String, KnownPage>,
        lease: Option<LeaseTo<'_>>,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        let taking = Taking::new(bot, pass, lease.as_ref(), now);
        let first = lease.as_ref().map_or(0, |l| l.first);
        let mut seen = HashSet::with_capacity(links.len());
        let mut inserts: Vec<(&NewUrl, String, bool)> = Vec::new();
        let mut resets: Vec<Reset<'_>> = Vec::new();
        for (i, link) in links.iter().enumerate() {
            let id = url_id(bot, &link.url);
            if !seen.insert(id.clone()) {
                continue;
            }
            let leased = i < first && taking.owner.is_some();
            match known.get(&id) {
                Some(k) if k.pass >= pass => {}
                Some(k) => resets.push((link, id, leased, k)),
                None => inserts.push((link, id, leased)),
            }
        }
        let mut out = Enqueued::default();
        for chunk in inserts.chunks(CHUNK) {
            self.insert_new(&taking, chunk, &mut out).await?;
        }
        for chunk in resets.chunks(IN_CHUNK) {
            self.reset_known(&taking, chunk, &mut out).await?;
        }
        Ok(out)
    }

    /// Inserts new links into the pass (one `insert`), those marked leased leased to the taker.
    async fn insert_new(
        self,
        taking: &Taking<'_>,
        chunk: &[(&NewUrl, String, bool)],
        out: &mut Enqueued,
    ) -> Result<()> {
        let docs: Vec<Document> = chunk
            .iter()
            .map(|(link, id, leased)| {
                let mut entry = taking.entry(link, *leased);
                entry.insert(f::ID, id.as_str());
                if !*leased {
                    entry.insert(f::LEASED_AT, Bson::Null);
                }
                entry.insert(f::DISCOVERED_AT, date(taking.now));
                entry
            })
            .collect();
        let reply = self
            .store
            .command(
                "enqueue",
                doc! { "insert": FRONTIER, "documents": docs, "ordered": false },
                None,
            )
            .await?;
        // A duplicate key: another instance enqueued the URL into this pass first (it is there,
        // and not ours to fetch).
        let duplicates = reply::duplicates("enqueue", &reply)?;
        out.added += reply::count(&reply) as u64;
        let leased = chunk
            .iter()
            .enumerate()
            .filter(|(_, (_, _, leased))| *leased)
            .map(|(i, (link, id, _))| (i, *link, id.as_str()));
        out.leased
            .extend(self.leases_taken(taking, leased, &duplicates).await?);
        Ok(())
    }

    /// The leases a write that enqueued `leased` (statement index, link, frontier id) leased to
    /// its taker took: every one it wrote, and of those it met as duplicates the ones that carry
    /// its token — written by an earlier attempt of this very write, whose answer was lost.
    async fn leases_taken<'l>(
        self,
        taking: &Taking<'_>,
        leased: impl Iterator<Item = (usize, &'l NewUrl, &'l str)>,
        duplicates: &[usize],
    ) -> Result<Vec<UrlLease>> {
        let leased: Vec<_> = leased.collect();
        let taken_before = self
            .ours_after_all(
                taking.bot,
                leased
                    .iter()
                    .filter(|(i, _, _)| duplicates.contains(i))
                    .map(|(_, _, id)| *id),
                &taking.token,
            )
            .await?;
        Ok(leased
            .into_iter()
            .filter(|(i, _, id)| !duplicates.contains(i) || taken_before.contains(*id))
            .map(|(_, link, id)| taking.lease(link, id, None))
            .collect())
    }

    /// Resets links last crawled in an earlier pass into this one (one `update`: per-URL values
    /// picked by `_id`), those marked leased leased to the taker; another instance may have
    /// reset some first.
    async fn reset_known(
        self,
        taking: &Taking<'_>,
        chunk: &[Reset<'_>],
        out: &mut Enqueued,
    ) -> Result<()> {
        let bot = taking.bot;
        let statement = reset_statement(taking, chunk);
        let reply = self
            .store
            .command(
                "enqueue again",
                doc! { "update": FRONTIER, "updates": [statement], "ordered": false },
                None,
            )
            .await?;
        reply::duplicates("enqueue again", &reply)?;
        let matched = reply::count(&reply);
        out.added += matched as u64;
        let leased: Vec<&Reset<'_>> = chunk.iter().filter(|(_, _, leased, _)| *leased).collect();
        if leased.is_empty() {
            return Ok(());
        }
        // Every reset matched: every leased one is ours. Otherwise another instance reset some
        // first: read which carry our token.
        let ours = if matched == chunk.len() {
            None
        } else {
            let ids = leased.iter().map(|(_, id, _, _)| id.as_str());
            Some(self.ours_after_all(bot, ids, &taking.token).await?)
        };
        for (link, id, _, k) in leased {
            if ours.as_ref().is_none_or(|o| o.contains(id)) {
                out.leased.push(taking.lease(link, id, Some(k)));
            }
        }
        Ok(())
    }

    /// Enqueues links in **one** round trip without reading what the frontier holds of them first
    /// (a page's listing links — the next page of a pagination chain —, or the items a listing
    /// shows changed, known stored): one upsert per link, which
    /// inserts it, or resets it when it was last crawled in an earlier pass, and leaves it alone
    /// when it is in this pass already (a duplicate `_id`, reported per link). The first `first`
    /// links are enqueued leased to `me` and returned as leases (those another instance
    /// enqueued first are not). No validators are kept: a listing page is read every pass, and a
    /// changed item's page needs none.
    pub async fn upsert_links(
        self,
        bot: &BotId,
        pass: PassNumber,
        links: &[NewUrl],
        lease: LeaseTo<'_>,
        now: DateTime<Utc>,
    ) -> Result<Enqueued> {
        let mut out = Enqueued::default();
        if links.is_empty() {
            return Ok(out);
        }
        let taking = Taking::new(bot, pass, Some(&lease), now);
        let statements: Vec<Document> = links
            .iter()
            .enumerate()
            .map(|(i, link)| {
                doc! {
                    "q": {
                        f::ID: url_id(bot, &link.url), f::BOT: bot.as_str(), f::PASS: { "$lt": pass },
                    },
                    "u": {
                        "$set": taking.entry(link, i < lease.first),
                        "$setOnInsert": { f::DISCOVERED_AT: date(now) },
                    },
                    "upsert": true,
                }
            })
            .collect();
        let reply = self
            .store
            .command(
                "upsert links",
                doc! { "update": FRONTIER, "updates": statements, "ordered": false },
                None,
            )
            .await?;
        // A duplicate `_id`: the link is in this pass already (someone else's).
        let duplicates = reply::duplicates("upsert links", &reply)?;
        out.added = reply::count(&reply) as u64;
        let ids: Vec<String> = links.iter().map(|l| url_id(bot, &l.url)).collect();
        let leased = links
            .iter()
            .zip(&ids)
            .enumerate()
            .take(lease.first)
            .map(|(i, (link, id))| (i, link, id.as_str()));
        out.leased = self.leases_taken(&taking, leased, &duplicates).await?;
        Ok(out)
    }

    /// Of `ids`, those leased with `token` now: entries an earlier attempt of a write that was
    /// sent again already took (none read when `ids` is empty).
    async fn ours_after_all<'a>(
        self,
        bot: &BotId,
        ids: impl Iterator<Item = &'a str>,
        token: &str,
    ) -> Result<HashSet<String>> {
        let ids: Vec<&str> = ids.collect();
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        let found = self
            .store
            .find_once(
                "read own leases",
                FRONTIER,
                doc! { f::ID: { "$in": &ids }, f::BOT: bot.as_str(), f::LEASE_TOKEN: token },
                doc! { f::ID: 1 },
                ids.len(),
                None,
            )
            .await?;
        Ok(found
            .iter()
            .filter_map(|d| d.get_str(f::ID).ok().map(str::to_owned))
            .collect())
    }

    /// Pending URLs that `queries` find (one round trip each, all at once), highest priority
    /// first, at most `limit` of each query. None of them is leased yet: see
    /// [`Frontier::take_leases`].
    pub async fn lease_candidates(
        self,
        bot: &BotId,
        pass: PassNumber,
        queries: &[CandidateQuery],
    ) -> Result<Vec<Vec<Candidate>>> {
        let reads = queries.iter().map(|query| {
            let filter = candidate_filter(bot, pass, query);
            let limit = i64::try_from(query.limit.max(1)).unwrap_or(i64::MAX);
            self.store.bounded("find lease candidates", async move {
                self.store
                    .frontier()
                    .collection()
                    .find(filter)
                    .projection(lease_projection())
                    .limit(limit)
                    .batch_size(whole_batch(query.limit))
                    .await?
                    .try_collect::<Vec<Document>>()
                    .await
            })
        });
        let found = futures_util::future::try_join_all(reads).await?;
        Ok(found
            .into_iter()
            .map(|docs| {
                let mut candidates: Vec<Candidate> = docs
                    .into_iter()
                    .filter_map(|doc| {
                        Some(Candidate {
                            id: get_text(&doc, f::ID)?,
                            host: get_text(&doc, f::HOST).unwrap_or_default(),
                            priority: get_int(&doc, f::PRIORITY).unwrap_or(0),
                            slot: get_int(&doc, f::SLOT)
                                .unwrap_or(0)
                                .clamp(0, i64::from(SLOTS - 1))
                                as u32,
                            doc,
                        })
                    })
                    .collect();
                candidates.sort_by_key(|c| std::cmp::Reverse(c.priority));
                candidates
            })
            .collect())
    }

    /// The pass's leased entries (few: at most every instance's pipeline), for finding leases
    /// past their expiry and a dead predecessor's.
    pub async fn leased_entries(self, bot: &BotId, pass: PassNumber) -> Result<Vec<LeasedEntry>> {
        let docs: Vec<Document> = self
            .store
            .bounded("read leases", async {
                self.store
                    .frontier()
                    .collection()
                    .find(status_filter(bot, pass, UrlStatus::Leased))
                    .projection(doc! {
                        f::HOST: 1, f::LEASE_OWNER: 1, f::LEASE_TOKEN: 1, f::LEASED_AT: 1,
                        f::LEASE_EXPIRES_AT: 1,
                    })
                    .batch_size(whole_batch(CHUNK))
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        Ok(docs
            .iter()
            .filter_map(|d| {
                Some(LeasedEntry {
                    id: get_text(d, f::ID)?,
                    host: get_text(d, f::HOST).unwrap_or_default(),
                    owner: get_text(d, f::LEASE_OWNER),
                    token: get_text(d, f::LEASE_TOKEN),
                    leased_at: get_date(d, f::LEASED_AT),
                    expires_at: get_date(d, f::LEASE_EXPIRES_AT),
                })
            })
            .collect())
    }

    /// Leases what `takes` names to `me` until `now + lease_for`, in one `update` command (one
    /// statement per kind of take, each conditional: pending URLs only while pending, expired
    /// leases only while expired, a predecessor's only under its token) — so racing leasers never
    /// share a URL. When fewer than all were taken, one read finds which carry this lease's
    /// token. Returns the leases taken, highest priority first.
    #[allow(clippy::too_many_arguments)]
    pub async fn take_leases(
        self,
        bot: &BotId,
        pass: PassNumber,
        me: &InstanceId,
        now: DateTime<Utc>,
        lease_for: Duration,
        takes: Takes<'_>,
    ) -> Result<Taken> {
        let wanted = takes.pending.len() + takes.expired.len() + takes.reclaim.len();
        if wanted == 0 {
            return Ok(Taken::default());
        }
        let expires_at = super::plus(now, lease_for);
        let token = new_token();
        let set = doc! {
            f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_OWNER: me.as_str(),
            f::LEASE_TOKEN: token.as_str(), f::LEASE_EXPIRES_AT: date(expires_at), f::LEASED_AT: date(now),
        };
        let statements = lease_statements(bot, pass, &set, now, &takes);
        let (taken, held, abandoned) = self.send_leases(bot, statements, &token).await?;
        // Which are ours: all, or (after a race, or a write cut short) those that carry our
        // token now — read back with everything a lease needs for the expired and reclaimed
        // ones, which were not read.
        let must_read =
            held || taken < wanted || !takes.expired.is_empty() || !takes.reclaim.is_empty();
        let mut leases = if must_read {
            self.read_back_leases(bot, pass, &token, now, expires_at, &takes)
                .await?
        } else {
            takes
                .pending
                .iter()
                .map(|candidate| {
                    lease_of(bot, &candidate.doc, pass, &token, now, expires_at, false)
                })
                .collect::<Result<Vec<_>>>()?
        };
        leases.sort_by_key(|l| std::cmp::Reverse(l.priority));
        Ok(Taken {
            leases,
            held,
            abandoned,
        })
    }

    /// Sends a lease round's write: how many it took, whether it met documents an open
    /// transaction holds, and its token if it was given up on before its answer.
    async fn send_leases(
        self,
        bot: &BotId,
        statements: Vec<Document>,
        token: &str,
    ) -> Result<(usize, bool, Option<String>)> {
        // On MongoDB a write outside a transaction that meets a document an open transaction
        // holds (a killed worker's commit, until the server ends it) waits for it: bounded, so
        // the leaser takes what it could and moves on to other URLs.
        let command = doc! {
            "update": FRONTIER, "updates": statements, "ordered": false,
            "maxTimeMS": i64::try_from(LEASE_WRITE_MAX_TIME.as_millis()).unwrap_or(i64::MAX),
        };
        let mut abandoned = None;
        let sent = self
            .store
            .command_within("lease urls", command, None, LEASE_WRITE_WAIT)
            .await;
        let (taken, held) = match sent {
            Ok(reply) if reply::held_by_transaction(&reply) => (0, true),
            Ok(reply) => {
                reply::duplicates("lease urls", &reply)?;
                (reply::count(&reply), false)
            }
            Err(e)
                if crate::error::is_write_conflict(&e) || crate::error::is_max_time_expired(&e) =>
            {
                tracing::debug!(bot = %bot, error = %e, "lease candidates are held by a transaction");
                (0, true)
            }
            Err(Error::Timeout { .. }) => {
                // A server that does not bound the write itself (the test server waits out the
                // transaction): given up here, it may still land later under this token.
                tracing::debug!(bot = %bot, "a lease write waited past its bound; leasing other URLs");
                abandoned = Some(token.to_owned());
                (0, true)
            }
            Err(e) => return Err(e),
        };
        Ok((taken, held, abandoned))
    }

    /// The URLs of `takes` that carry `token` now, read back whole: the leases this round took.
    async fn read_back_leases(
        self,
        bot: &BotId,
        pass: PassNumber,
        token: &str,
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        takes: &Takes<'_>,
    ) -> Result<Vec<UrlLease>> {
        let reclaimed: std::collections::HashSet<&str> =
            takes.reclaim.iter().map(|(id, _)| id.as_str()).collect();
        let mut leases = Vec::new();
        let ids: Vec<&str> = takes
            .pending
            .iter()
            .map(|c| c.id.as_str())
            .chain(takes.expired.iter().map(String::as_str))
            .chain(takes.reclaim.iter().map(|(id, _)| id.as_str()))
            .collect();
        let docs: Vec<Document> = self
            .store
            .bounded("read leases taken", async {
                self.collection()
                    .find(doc! { f::ID: { "$in": &ids }, f::BOT: bot.as_str() })
                    .projection(lease_projection())
                    .batch_size(whole_batch(ids.len()))
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        for doc in docs {
            if doc.get_str(f::LEASE_TOKEN).ok() != Some(token) {
                continue;
            }
            let id = doc.get_str(f::ID).unwrap_or_default();
            let reclaimed = reclaimed.contains(id);
            let mut lease = lease_of(bot, &doc, pass, token, now, expires_at, reclaimed)?;
            // Read after the take: `attempts` already counts it.
            if !reclaimed {
                lease.attempt -= 1;
            }
            leases.push(lease);
        }
        Ok(leases)
    }

    /// Leases one URL of pass `pass` on any host: a pending one (highest priority first), or one
    /// whose lease expired (its worker died). `None` when there is nothing to lease right now
    /// (which does not mean the pass is over). A simple form of the crawl's batched leasing, for
    /// tools and tests: it reads the whole pending set of the pass.
    pub async fn lease_url(
        self,
        bot: &BotId,
        pass: PassNumber,
        me: &InstanceId,
        now: DateTime<Utc>,
        lease_for: Duration,
    ) -> Result<Option<UrlLease>> {
        for _ in 0..20 {
            let mut pending: Vec<Candidate> = self
                .store
                .bounded("find a pending url", async {
                    self.store
                        .frontier()
                        .collection()
                        .find(status_filter(bot, pass, UrlStatus::Pending))
                        .projection(lease_projection())
                        .await?
                        .try_collect::<Vec<Document>>()
                        .await
                })
                .await?
                .into_iter()
                .filter_map(|doc| {
                    Some(Candidate {
                        id: get_text(&doc, f::ID)?,
                        host: get_text(&doc, f::HOST).unwrap_or_default(),
                        priority: get_int(&doc, f::PRIORITY).unwrap_or(0),
                        slot: 0,
                        doc,
                    })
                })
                .collect();
            let expired: Vec<String> = self
                .leased_entries(bot, pass)
                .await?
                .into_iter()
                .filter(|e| e.expires_at.is_some_and(|t| t <= now))
                .map(|e| e.id)
                .collect();
            if pending.is_empty() && expired.is_empty() {
                return Ok(None);
            }
            // Racing leasers pick different ones among the highest priority.
            let top = pending.iter().map(|c| c.priority).max();
            pending.retain(|c| Some(c.priority) == top);
            let takes = if pending.is_empty() {
                let one = expired[rand::random_range(0..expired.len())].clone();
                (Vec::new(), vec![one])
            } else {
                let one = pending.swap_remove(rand::random_range(0..pending.len()));
                (vec![one], Vec::new())
            };
            let taken = self
                .take_leases(
                    bot,
                    pass,
                    me,
                    now,
                    lease_for,
                    Takes {
                        pending: &takes.0,
                        expired: &takes.1,
                        reclaim: &[],
                    },
                )
                .await?;
            if let Some(lease) = taken.leases.into_iter().next() {
                return Ok(Some(lease));
            }
            // Another worker took it first: look again.
        }
        Ok(None)
    }

    /// The hosts (`host:port`) with pending URLs in pass `pass` (one `distinct`).
    pub async fn hosts_with_work(self, bot: &BotId, pass: PassNumber) -> Result<Vec<String>> {
        let found = self
            .store
            .bounded(
                "hosts with pending urls",
                self.store
                    .frontier()
                    .collection()
                    .distinct(f::HOST, status_filter(bot, pass, UrlStatus::Pending)),
            )
            .await?;
        Ok(found
            .into_iter()
            .filter_map(|h| h.as_str().map(str::to_owned))
            .collect())
    }

    /// Settles leased URLs: each one's [`Mark`], **only while its lease is this worker's** (the
    /// filter holds its `_id` and its token). One `update` command: a statement per kind of mark
    /// and lease token, per-URL values picked by `_id` in an update pipeline. Returns, per mark,
    /// whether it was applied (false: the lease went to another worker, whose result wins).
    pub async fn settle_urls(
        self,
        marks: &[(&UrlLease, Mark)],
        now: DateTime<Utc>,
    ) -> Result<Vec<bool>> {
        if marks.is_empty() {
            return Ok(Vec::new());
        }
        let mut matched = 0;
        let nonce = new_token();
        for chunk in settle_statements(marks, now, &nonce).chunks(CHUNK) {
            let reply = self
                .store
                .command(
                    "settle urls",
                    doc! { "update": FRONTIER, "updates": chunk, "ordered": false },
                    None,
                )
                .await?;
            reply::duplicates("settle urls", &reply)?;
            matched += reply::count(&reply);
        }
        self.applied_marks(marks, matched, &nonce, None).await
    }

    /// Which of `marks` were applied, given that `matched` entries matched their statements: all,
    /// or (when some leases were lost) those whose entry carries the mark's lease token now.
    pub(super) async fn applied_marks(
        self,
        marks: &[(&UrlLease, Mark)],
        matched: usize,
        nonce: &str,
        session: Option<&mut mongodb::ClientSession>,
    ) -> Result<Vec<bool>> {
        if matched == marks.len() {
            return Ok(vec![true; marks.len()]);
        }
        let ids: Vec<&str> = marks.iter().map(|(l, _)| l.id.as_str()).collect();
        let bot = &marks[0].0.bot;
        let docs = self
            .store
            .find_once(
                "read settled urls",
                FRONTIER,
                doc! { f::ID: { "$in": ids }, f::BOT: bot.as_str() },
                doc! { f::LAST_LEASE_TOKEN: 1, f::SETTLED_BY: 1 },
                marks.len(),
                session,
            )
            .await?;
        let settled: HashMap<&str, (Option<&str>, Option<&str>)> = docs
            .iter()
            .filter_map(|d| {
                Some((
                    d.get_str(f::ID).ok()?,
                    (
                        d.get_str(f::LAST_LEASE_TOKEN).ok(),
                        d.get_str(f::SETTLED_BY).ok(),
                    ),
                ))
            })
            .collect();
        Ok(marks
            .iter()
            .map(|(lease, _)| {
                settled.get(lease.id.as_str()).is_some_and(|(token, by)| {
                    *token == Some(lease.token.as_str()) && *by == Some(nonce)
                })
            })
            .collect())
    }
}

/// The `update` statements that settle `marks`: one per kind of mark and lease token (each
/// filtered on the entries' `_id`s, `status: leased` and that token), per-URL values picked by
/// `_id` in an update pipeline (a statement of one URL: its values as literals).
pub(super) fn settle_statements(
    marks: &[(&UrlLease, Mark)],
    now: DateTime<Utc>,
    nonce: &str,
) -> Vec<Document> {
    let mut groups: Vec<((u8, &str), Vec<usize>)> = Vec::new();
    for (i, (lease, mark)) in marks.iter().enumerate() {
        let key = (mark.group(), lease.token.as_str());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    let mut statements = Vec::new();
    for ((group, token), members) in &groups {
        // A listing page's done mark carries its manifest (a hundred ids or so): one statement
        // per page, so that no document's update reads every other page's list (a statement's
        // per-URL columns are literal arrays, evaluated for each document it matches: a shared
        // statement of k pages costs each of them k lists).
        let per_statement = if *group == 5 { 1 } else { IN_CHUNK };
        for chunk in members.chunks(per_statement) {
            let ids: Vec<Bson> = chunk
                .iter()
                .map(|i| Bson::String(marks[*i].0.id.clone()))
                .collect();
            let bot = &marks[chunk[0]].0.bot;
            // One URL: its values as literals (picking by `_id` would cost the server two
            // array scans per field for nothing).
            let column = |value: &dyn Fn(&Mark) -> Bson| match chunk {
                [only] => literal(value(&marks[*only].1)),
                _ => pick(&ids, chunk.iter().map(|i| value(&marks[*i].1)).collect()),
            };
            let mut set = doc! {
                f::LEASE_OWNER: Bson::Null, f::LEASE_TOKEN: Bson::Null,
                f::LEASE_EXPIRES_AT: Bson::Null, f::LAST_LEASE_TOKEN: literal(*token),
                f::SETTLED_BY: literal(nonce),
            };
            // The main `$set`, then the stages after it (a listing page's baseline).
            let after = mark_fields(*group, &mut set, &column, now);
            let mut stages = vec![doc! { "$set": set }];
            stages.extend(after);
            statements.push(doc! {
                "q": {
                    f::ID: { "$in": &ids }, f::BOT: bot.as_str(),
                    f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_TOKEN: *token,
                },
                "u": stages,
                "multi": true,
            });
        }
    }
    statements
}

/// What a settle statement of marks of `group` ([`Mark::group`]) sets, per URL through
/// `column`, into `set`; returns the update stages that go after that `$set`.
fn mark_fields(
    group: u8,
    set: &mut Document,
    column: Column<'_>,
    now: DateTime<Utc>,
) -> Vec<Document> {
    let mut after = Vec::new();
    match group {
        0 | 5 => {
            done_fields(set, column, now);
            if group == 5 {
                manifest_stages(set, &mut after, column);
            }
        }
        1 => {
            set.insert(f::STATUS, UrlStatus::Failed.as_str());
            set.insert(f::DONE_AT, date(now));
            set.insert(
                f::LAST_ERROR,
                column(&|m| match m {
                    Mark::Failed { reason } => Bson::String(reason.clone()),
                    _ => Bson::Null,
                }),
            );
        }
        2 => give_back_fields(set, column, now),
        3 => {
            give_back_fields(set, column, now);
            set.insert(
                f::ATTEMPTS,
                doc! { "$subtract": [format!("${}", f::ATTEMPTS), 1_i64] },
            );
        }
        _ => {
            give_back_fields(set, column, now);
            set.insert(
                f::ATTEMPTS,
                doc! { "$subtract": [format!("${}", f::ATTEMPTS), 1_i64] },
            );
            set.insert(f::SHEDS, doc! { "$add": [format!("${}", f::SHEDS), 1_i64] });
        }
    }
    after
}

/// A done mark's fields: the page's validators and record id (an earlier one kept when the
/// page has none), and the fingerprint it was stored with.
fn done_fields(set: &mut Document, column: Column<'_>, now: DateTime<Utc>) {
    set.insert(f::STATUS, UrlStatus::Done.as_str());
    set.insert(f::DONE_AT, date(now));
    set.insert(f::LAST_ERROR, Bson::Null);
    set.insert(
        f::FINGERPRINT,
        doc! { "$ifNull": [format!("${}", f::LIST_FINGERPRINT), Bson::Null] },
    );
    set.insert(
        f::ETAG,
        column(&|m| match m {
            Mark::Done { validators, .. } => text(validators.etag.as_deref()),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::LAST_MODIFIED,
        column(&|m| match m {
            Mark::Done { validators, .. } => text(validators.last_modified.as_deref()),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::RECORD_ID,
        doc! { "$ifNull": [
            column(&|m| match m {
                Mark::Done { record_id, .. } => text(record_id.as_deref()),
                _ => Bson::Null,
            }),
            format!("${}", f::RECORD_ID),
        ] },
    );
}

/// A URL given back to the frontier: pending again at `not_before` (waiting until then, if that
/// is later than `now`), with the reason.
fn give_back_fields(set: &mut Document, column: Column<'_>, now: DateTime<Utc>) {
    set.insert(
        f::STATUS,
        column(&|m| match m {
            Mark::Retry { not_before, .. }
            | Mark::Release { not_before, .. }
            | Mark::Shed { not_before } => Bson::String(
                if *not_before <= now {
                    UrlStatus::Pending
                } else {
                    UrlStatus::Waiting
                }
                .as_str()
                .into(),
            ),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::NOT_BEFORE,
        column(&|m| match m {
            Mark::Retry { not_before, .. }
            | Mark::Release { not_before, .. }
            | Mark::Shed { not_before } => date(*not_before),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::LAST_ERROR,
        column(&|m| match m {
            Mark::Retry { reason, .. } | Mark::Release { reason, .. } => {
                Bson::String(reason.clone())
            }
            Mark::Shed { .. } => Bson::String("shed: its host is throttling".into()),
            _ => Bson::Null,
        }),
    );
}

/// A settle statement's per-URL column: one value per mark, picked by `_id` (see [`pick`]); a
/// statement of one mark has its value as a literal.
type Column<'a> = &'a dyn Fn(&dyn Fn(&Mark) -> Bson) -> Bson;

/// A listing page's done mark, in the same `$set` as its other fields (every expression there
/// still sees the previous read's `listed` and `listedPass`): the manifest's fields, and what the
/// page listed since the last evaluation — that baseline (the previous read, if it was the
/// evaluated pass's; else what it held) with this list added. Then, in one more stage, whether
/// the baseline holds pages this list lacks.
fn manifest_stages(set: &mut Document, stages: &mut Vec<Document>, column: Column<'_>) {
    fn of<T>(m: &Mark, value: impl Fn(&Manifest) -> T) -> Option<T> {
        match m {
            Mark::Done {
                manifest: Some(manifest),
                ..
            } => Some(value(manifest)),
            _ => None,
        }
    }
    let this_list = column(&|m| of(m, |x| pack_ids(&x.listed)).unwrap_or(Bson::Null));
    let listed = format!("${}", f::LISTED);
    let since = format!("${}", f::LISTED_SINCE);
    let evaluated = column(&|m| of(m, |x| Bson::from(x.evaluated)).unwrap_or(Bson::Null));
    // The previous read's list as a list of lists (none for a page never read); null in
    // `listedSince` means the same as that list.
    let previous = doc! { "$cond": [ { "$ifNull": [&listed, false] }, [&listed], [] ] };
    let baseline = doc! { "$cond": [
        { "$eq": [ format!("${}", f::LISTED_PASS), evaluated ] },
        previous.clone(),
        { "$ifNull": [&since, previous] },
    ] };
    // Lists compare as whole values: a list seen again adds nothing.
    set.insert(
        f::LISTED_SINCE,
        doc! { "$setUnion": [baseline, [this_list.clone()]] },
    );
    set.insert(f::LISTED, this_list);
    set.insert(
        f::LISTED_FP,
        column(&|m| of(m, |x| pack_numbers(&x.fingerprints)).unwrap_or(Bson::Null)),
    );
    // Usually none after a pass that fetched everything once: then the field is null.
    set.insert(
        f::LISTED_FETCH,
        column(&|m| {
            of(m, |x| {
                (!x.fetched.is_empty()).then(|| Bson::from(x.fetched.clone()))
            })
            .flatten()
            .unwrap_or(Bson::Null)
        }),
    );
    set.insert(
        f::LISTED_HASH,
        column(&|m| of(m, |x| Bson::String(x.hash())).unwrap_or(Bson::Null)),
    );
    set.insert(f::LISTED_PASS, format!("${}", f::PASS));
    // Whether the baseline holds another list; if it does not, it is stored as null (the same
    // as `listed`), so an unchanged page carries its list once.
    let more = doc! { "$gt": [ { "$size": &since }, 1 ] };
    stages.push(doc! { "$set": {
        f::LISTED_SINCE_MORE: more.clone(),
        f::LISTED_SINCE: { "$cond": [ more, &since, Bson::Null ] },
    } });
}

impl Frontier<'_> {
    async fn settle_one(self, lease: &UrlLease, mark: Mark, now: DateTime<Utc>) -> Result<()> {
        if self.settle_urls(&[(lease, mark)], now).await?[0] {
            Ok(())
        } else {
            Err(Error::UrlLeaseLost {
                url: lease.url.to_string(),
            })
        }
    }

    /// Marks a leased URL done — only if the lease is still this worker's.
    pub async fn complete_url(self, lease: &UrlLease, now: DateTime<Utc>) -> Result<()> {
        let mark = Mark::Done {
            validators: lease.validators.clone(),
            record_id: None,
            manifest: None,
        };
        self.settle_one(lease, mark, now).await
    }

    /// Marks a leased URL failed with its reason — only if the lease is still this worker's.
    pub async fn fail_url(self, lease: &UrlLease, now: DateTime<Utc>, reason: &str) -> Result<()> {
        let mark = Mark::Failed {
            reason: reason.to_owned(),
        };
        self.settle_one(lease, mark, now).await
    }

    /// Gives a leased URL back for another attempt no earlier than `not_before` — only if the
    /// lease is still this worker's. A retry due later waits in the frontier (status `waiting`,
    /// `notBefore`), not in memory; [`Frontier::promote_due`] makes it pending when its time comes.
    pub async fn retry_url(
        self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
        reason: &str,
    ) -> Result<()> {
        let mark = Mark::Retry {
            not_before,
            reason: reason.to_owned(),
        };
        self.settle_one(lease, mark, now).await
    }

    /// Gives a leased URL back without counting the attempt (shutdown, a paused host): pending
    /// again, or waiting until `not_before` — only if the lease is still this worker's.
    pub async fn release_url(
        self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
        reason: &str,
    ) -> Result<()> {
        let mark = Mark::Release {
            not_before,
            reason: reason.to_owned(),
        };
        self.settle_one(lease, mark, now).await
    }

    /// Makes the pass's waiting retries whose `notBefore` has come pending again (one write).
    pub async fn promote_due(
        self,
        bot: &BotId,
        pass: PassNumber,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        // The waiting entries are few: read them by the index, pick the due ones here.
        let waiting: Vec<Document> = self
            .store
            .bounded("read waiting retries", async {
                self.store
                    .frontier()
                    .collection()
                    .find(status_filter(bot, pass, UrlStatus::Waiting))
                    .projection(doc! { f::NOT_BEFORE: 1 })
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        let due: Vec<Bson> = waiting
            .iter()
            .filter(|d| get_date(d, f::NOT_BEFORE).is_some_and(|t| t <= now))
            .filter_map(|d| d.get(f::ID).cloned())
            .collect();
        if due.is_empty() {
            return Ok(0);
        }
        let frontier = self.collection();
        let update = frontier.update_many(
            doc! { f::ID: { "$in": due }, f::BOT: bot.as_str(), f::STATUS: UrlStatus::Waiting.as_str() },
            doc! { "$set": { f::STATUS: UrlStatus::Pending.as_str() } },
        );
        Ok(self
            .store
            .bounded("promote due retries", update)
            .await?
            .modified_count)
    }

    /// What the frontier knows of these URLs from any pass, by frontier `_id`.
    pub async fn known_pages(
        self,
        bot: &BotId,
        urls: &[&NormalizedUrl],
    ) -> Result<HashMap<String, KnownPage>> {
        let ids: Vec<String> = urls.iter().map(|u| url_id(bot, u)).collect();
        self.known_by_id(bot, &ids).await
    }

    /// As [`Frontier::known_pages`], by frontier `_id`.
    pub async fn known_by_id(
        self,
        bot: &BotId,
        ids: &[String],
    ) -> Result<HashMap<String, KnownPage>> {
        let mut known = HashMap::with_capacity(ids.len());
        for chunk in ids.chunks(CHUNK) {
            let found: Vec<Document> = self
                .store
                .bounded("read known pages", async {
                    self.store
                        .frontier()
                        .collection()
                        .find(doc! { f::ID: { "$in": chunk }, f::BOT: bot.as_str() })
                        .projection(KnownPage::projection(&[]))
                        .batch_size(whole_batch(chunk.len()))
                        .await?
                        .try_collect()
                        .await
                })
                .await?;
            for doc in found {
                if let Some(id) = get_text(&doc, f::ID) {
                    known.insert(id, KnownPage::from_doc(&doc));
                }
            }
        }
        Ok(known)
    }

    /// The highest pass any of the bot's URLs is in, or `floor` when none is above it: a new pass
    /// numbers above it. `floor` is the bot document's pass, which every URL is at or below
    /// unless a pass was prepared and never recorded, or the document was set back (restored,
    /// repaired): one bounded probe above `floor` on the frontier index answers the usual case —
    /// without the probe, a server that reads every entry a sort matches reads the whole frontier
    /// (3.7 s at 200,000 entries on the test server; the probe 0.2 s) — and only when it finds
    /// one does the full answer follow.
    pub async fn highest_pass_above(self, bot: &BotId, floor: PassNumber) -> Result<PassNumber> {
        let above = self
            .store
            .bounded(
                "highest pass",
                self.store
                    .frontier()
                    .collection()
                    // `$gte` (not `$gt`, which the test server answers by reading the whole
                    // collection) and no hint (a hinted query it answers the same way).
                    .find_one(doc! {
                        f::BOT: bot.as_str(), f::PASS: { "$gte": floor.get().saturating_add(1) },
                    })
                    .projection(doc! { f::PASS: 1 }),
            )
            .await?;
        if above.is_none() {
            return Ok(floor);
        }
        let top = self
            .store
            .bounded(
                "highest pass",
                self.store
                    .frontier()
                    .collection()
                    .find_one(doc! { f::BOT: bot.as_str() })
                    .sort(doc! { f::BOT: 1, f::PASS: -1 })
                    .projection(doc! { f::PASS: 1 }),
            )
            .await?;
        Ok(top
            .and_then(|d| get_int(&d, f::PASS))
            .map_or(PassNumber::NONE, PassNumber::new)
            .max(floor))
    }

    /// True while any URL of the pass is pending, waiting or leased (by anyone): bounded index
    /// lookups, cheap enough for every idle worker, where [`Frontier::pass_progress`] counts all.
    pub async fn pass_has_work(self, bot: &BotId, pass: PassNumber) -> Result<bool> {
        // The few leased and waiting entries first: a server that reads every entry a query
        // matches pays for the pending ones only when there are no others.
        for status in [UrlStatus::Leased, UrlStatus::Waiting, UrlStatus::Pending] {
            let found = self
                .store
                .bounded(
                    "pass has work",
                    self.store
                        .frontier()
                        .collection()
                        .find_one(status_filter(bot, pass, status))
                        .projection(doc! { f::ID: 1 }),
                )
                .await?;
            if found.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A pass's failed URLs grouped by reason, the most common first: up to `limit` reasons,
    /// each with its count and one example URL (one aggregation on the frontier index's
    /// `bot, pass, status` prefix).
    pub async fn failure_reasons(
        self,
        bot: &BotId,
        pass: PassNumber,
        limit: i64,
    ) -> Result<Vec<FailureReason>> {
        let pipeline = [
            doc! { "$match": status_filter(bot, pass, UrlStatus::Failed) },
            doc! { "$group": {
                "_id": format!("${}", f::LAST_ERROR),
                "n": { "$sum": 1 },
                "example": { "$min": format!("${}", f::URL) },
            } },
            doc! { "$sort": { "n": -1, "_id": 1 } },
            doc! { "$limit": limit.max(1) },
        ];
        let rows: Vec<Document> = self
            .store
            .bounded("read failure reasons", async {
                self.store
                    .frontier()
                    .collection()
                    .aggregate(pipeline)
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        Ok(rows
            .iter()
            .map(|row| FailureReason {
                reason: row
                    .get_str("_id")
                    .unwrap_or("(no reason recorded)")
                    .to_owned(),
                count: row
                    .get("n")
                    .and_then(crate::store::document::integer)
                    .unwrap_or(0)
                    .max(0) as u64,
                example: row.get_str("example").unwrap_or("?").to_owned(),
            })
            .collect())
    }

    /// Counts pass `pass`'s URLs by status (leases past their expiry still count as leased until
    /// someone re-leases them: the pass waits for them).
    pub async fn pass_progress(self, bot: &BotId, pass: PassNumber) -> Result<PassProgress> {
        // The same one aggregation that ends a pass; its coverage figures are not needed here.
        Ok(self.store.passes().coverage(bot, pass).await?.0)
    }
}

/// One item of a stored manifest, as [`Frontier::listing_manifests`] hands it out: the key of the
/// detail page's frontier id ([`id_key`]), its fingerprint hash (0: a plain link) and whether the
/// pass that read the manifest enqueued it to fetch.
pub type ListedItem = (u64, i64, bool);

/// Bytes of a frontier id as a manifest packs it (`url_id` is 32 hex digits: 16 bytes).
const ID_BYTES: usize = 16;

/// The key of a frontier id: its first 64 bits (16 hex digits). Two ids that share them are one
/// key; whoever compares by key must treat a collision as "unsure", never as "the same".
pub fn id_key(id: &str) -> u64 {
    let end = id.len().min(16);
    u64::from_str_radix(&id[..end], 16).unwrap_or_else(|_| crate::ids::sha256_u64(&[id.as_bytes()]))
}

/// A manifest's ids as they are stored: packed, 16 bytes an id in one binary value (what this
/// version writes — a tenth of the BSON of an array of strings, and one value for the server to
/// copy), or an array of hex strings (a hand-written document, or ids that are not hex).
#[derive(Clone, Debug)]
pub(super) enum Ids<'a> {
    Packed(&'a [u8]),
    Strings(Vec<&'a str>),
}

impl<'a> Ids<'a> {
    /// The ids in `value` (anything else: none).
    pub(super) fn of_value(value: Option<bson::RawBsonRef<'a>>) -> Ids<'a> {
        match value {
            Some(bson::RawBsonRef::Binary(b)) => Ids::Packed(b.bytes),
            Some(bson::RawBsonRef::Array(a)) => {
                Ids::Strings(a.into_iter().filter_map(|v| v.ok()?.as_str()).collect())
            }
            _ => Ids::Strings(Vec::new()),
        }
    }

    /// The ids of field `name`.
    pub(super) fn of(doc: &'a bson::RawDocument, name: &str) -> Ids<'a> {
        Ids::of_value(doc.get(name).ok().flatten())
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Ids::Packed(bytes) => bytes.len() / ID_BYTES,
            Ids::Strings(ids) => ids.len(),
        }
    }

    /// The key ([`id_key`]) of id `i`.
    pub(super) fn key(&self, i: usize) -> u64 {
        match self {
            Ids::Packed(bytes) => {
                let mut first = [0u8; 8];
                first.copy_from_slice(&bytes[i * ID_BYTES..i * ID_BYTES + 8]);
                u64::from_be_bytes(first)
            }
            Ids::Strings(ids) => id_key(ids[i]),
        }
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(|i| self.key(i))
    }

    /// Id `i` in full, as the frontier's `_id` spells it.
    pub(super) fn id(&self, i: usize) -> String {
        match self {
            Ids::Packed(bytes) => bytes[i * ID_BYTES..(i + 1) * ID_BYTES]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            Ids::Strings(ids) => ids[i].to_owned(),
        }
    }
}

/// A page's baseline as stored in `listedSince` (see `store::deletions`): null or missing means
/// its list itself; otherwise every list it showed since the last evaluation — packed lists, or
/// the ids of an array of strings (an empty array: an empty baseline).
pub(super) fn baseline_lists(page: &bson::RawDocument) -> Vec<Ids<'_>> {
    match page.get(f::LISTED_SINCE).ok().flatten() {
        Some(bson::RawBsonRef::Array(items)) => {
            let mut lists = Vec::new();
            let mut loose: Vec<&str> = Vec::new();
            for item in items.into_iter().flatten() {
                match item {
                    bson::RawBsonRef::String(id) => loose.push(id),
                    other => lists.push(Ids::of_value(Some(other))),
                }
            }
            if !loose.is_empty() {
                lists.push(Ids::Strings(loose));
            }
            lists
        }
        _ => vec![Ids::of(page, f::LISTED)],
    }
}

/// A manifest's ids as this version stores them: packed when every id is 32 hex digits (every
/// `url_id` is), else as an array of strings.
fn pack_ids(ids: &[String]) -> Bson {
    let mut bytes = Vec::with_capacity(ids.len() * ID_BYTES);
    for id in ids {
        if id.len() != 2 * ID_BYTES {
            return Bson::from(ids.to_vec());
        }
        for pair in id.as_bytes().chunks(2) {
            match std::str::from_utf8(pair)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => bytes.push(b),
                None => return Bson::from(ids.to_vec()),
            }
        }
    }
    Bson::Binary(bson::Binary {
        subtype: bson::spec::BinarySubtype::Generic,
        bytes,
    })
}

/// Fingerprint hashes as this version stores them: 8 bytes each (little-endian) in one binary.
fn pack_numbers(values: &[i64]) -> Bson {
    Bson::Binary(bson::Binary {
        subtype: bson::spec::BinarySubtype::Generic,
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    })
}

/// The whole numbers of a raw field: an array of numbers, or packed 8 bytes each
/// ([`pack_numbers`]).
fn raw_numbers(doc: &bson::RawDocument, name: &str) -> Vec<i64> {
    match doc.get(name).ok().flatten() {
        Some(bson::RawBsonRef::Binary(b)) => b
            .bytes
            .chunks_exact(8)
            .map(|c| {
                let mut le = [0u8; 8];
                le.copy_from_slice(c);
                i64::from_le_bytes(le)
            })
            .collect(),
        Some(bson::RawBsonRef::Array(a)) => a
            .into_iter()
            .filter_map(|v| match v.ok()? {
                bson::RawBsonRef::Int64(n) => Some(n),
                bson::RawBsonRef::Int32(n) => Some(i64::from(n)),
                bson::RawBsonRef::Double(n) => Some(n as i64),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A raw document's whole number field.
pub(super) fn raw_integer(doc: &bson::RawDocument, name: &str) -> Option<i64> {
    match doc.get(name).ok()?? {
        bson::RawBsonRef::Int64(n) => Some(n),
        bson::RawBsonRef::Int32(n) => Some(i64::from(n)),
        bson::RawBsonRef::Double(n) if n.fract() == 0.0 => Some(n as i64),
        _ => None,
    }
}

impl Frontier<'_> {
    /// Streams the seed and listing entries that `filters` (from [`listing_filters`], one per
    /// listing kind) read to `visit`, raw, with `projection` (and `batch` entries to a batch).
    pub(super) async fn each_listing(
        self,
        what: &'static str,
        filters: Vec<Document>,
        projection: Document,
        batch: Option<u32>,
        mut visit: impl FnMut(&bson::RawDocument) -> Result<()>,
    ) -> Result<()> {
        let frontier = self
            .store
            .database()
            .collection::<bson::RawDocumentBuf>(FRONTIER);
        for filter in filters {
            let find = frontier.find(filter).projection(projection.clone());
            match batch {
                Some(n) => {
                    self.store
                        .each_raw(what, find.batch_size(n), &mut visit)
                        .await?
                }
                None => self.store.each_raw(what, find, &mut visit).await?,
            }
        }
        Ok(())
    }

    /// Every manifest the bot's listing and seed pages carry (one per page, as its last read
    /// wrote it), streamed raw on [`LISTINGS_INDEX`] — what the next pass knows of the items
    /// without reading them one by one. `visit` gets the pass that read each manifest and its
    /// items.
    pub async fn listing_manifests(
        self,
        bot: &BotId,
        mut visit: impl FnMut(PassNumber, &[ListedItem]),
    ) -> Result<()> {
        // Every listing entry: one never read yet carries no manifest and is passed over.
        self.each_listing(
            "read listing manifests",
            listing_filters(bot, doc! { "$gte": 0_i64 }),
            doc! { f::LISTED: 1, f::LISTED_FP: 1, f::LISTED_FETCH: 1, f::LISTED_PASS: 1 },
            Some(MANIFESTS_PER_BATCH),
            |doc| {
                let Some(pass) = raw_integer(doc, f::LISTED_PASS).map(PassNumber::new) else {
                    return Ok(());
                };
                let listed = Ids::of(doc, f::LISTED);
                let fingerprints = raw_numbers(doc, f::LISTED_FP);
                let mut fetched = vec![false; listed.len()];
                for i in raw_numbers(doc, f::LISTED_FETCH) {
                    if let Some(slot) = usize::try_from(i).ok().and_then(|i| fetched.get_mut(i)) {
                        *slot = true;
                    }
                }
                let items: Vec<ListedItem> = listed
                    .keys()
                    .enumerate()
                    .map(|(i, k)| (k, fingerprints.get(i).copied().unwrap_or(0), fetched[i]))
                    .collect();
                visit(pass, &items);
                Ok(())
            },
        )
        .await
    }

    /// The frontier ids of pass `pass`'s entries that did not end done (pending, waiting, leased,
    /// failed): after a pass, the detail pages it enqueued whose records are not known stored.
    /// One read per status on the main index.
    pub async fn not_done_in(self, bot: &BotId, pass: PassNumber) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for status in [
            UrlStatus::Failed,
            UrlStatus::Pending,
            UrlStatus::Waiting,
            UrlStatus::Leased,
        ] {
            let frontier = self.collection();
            let find = frontier
                .find(status_filter(bot, pass, status))
                .projection(doc! { f::ID: 1 })
                .batch_size(whole_batch(CHUNK));
            self.store
                .each_doc("read the entries a pass did not finish", find, |doc| {
                    ids.extend(get_text(&doc, f::ID));
                    Ok(())
                })
                .await?;
        }
        Ok(ids)
    }

    /// URLs of the bot leased by anyone whose lease has not run out.
    pub async fn live_leases(self, bot: &BotId, now: DateTime<Utc>) -> Result<u64> {
        use super::frontier::field as fr;
        self.store
            .bounded(
                "count live leases",
                self.collection().count_documents(doc! {
                    fr::BOT: bot.as_str(),
                    fr::STATUS: "leased",
                    fr::LEASE_EXPIRES_AT: { "$gt": super::date(now) },
                }),
            )
            .await
    }
}

/// Leasing on enqueue ([`Frontier::enqueue_links`]): the first `first` links go to `me`.
#[derive(Clone, Copy, Debug)]
pub struct LeaseTo<'a> {
    pub me: &'a InstanceId,
    pub lease_for: Duration,
    pub first: usize,
}

/// What [`Frontier::enqueue_links`] did.
#[derive(Clone, Debug, Default)]
pub struct Enqueued {
    /// URLs inserted or reset into the pass.
    pub added: u64,
    /// The links leased to the caller as they were enqueued.
    pub leased: Vec<UrlLease>,
}

/// A lease round's update statements: the pending candidates (still pending), the expired leases
/// (still expired), each taken with `set` and one more attempt; the reclaimed ones (still under
/// the predecessor's token) with `set` alone — the same attempt the predecessor counted.
fn lease_statements(
    bot: &BotId,
    pass: PassNumber,
    set: &Document,
    now: DateTime<Utc>,
    takes: &Takes<'_>,
) -> Vec<Document> {
    let take = doc! { "$set": set.clone(), "$inc": { f::ATTEMPTS: 1_i64 } };
    let mut statements = Vec::new();
    if !takes.pending.is_empty() {
        let ids: Vec<&str> = takes.pending.iter().map(|c| c.id.as_str()).collect();
        statements.push(doc! {
            "q": { f::ID: { "$in": ids }, f::BOT: bot.as_str(), f::PASS: pass, f::STATUS: UrlStatus::Pending.as_str() },
            "u": take.clone(), "multi": true,
        });
    }
    if !takes.expired.is_empty() {
        statements.push(doc! {
            "q": {
                f::ID: { "$in": takes.expired }, f::BOT: bot.as_str(), f::PASS: pass,
                f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_EXPIRES_AT: { "$lte": date(now) },
            },
            "u": take.clone(), "multi": true,
        });
    }
    for (id, old) in takes.reclaim {
        statements.push(doc! {
            "q": { f::ID: id.as_str(), f::BOT: bot.as_str(), f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_TOKEN: old.as_str() },
            "u": { "$set": set.clone() },
        });
    }
    statements
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_kinds_are_exactly_those_the_listing_index_holds() {
        // The partial filter's bound: a kind is in the index when its name sorts after it.
        let partial = listing_partial();
        let bound = partial
            .get_document(f::KIND)
            .and_then(|b| b.get_str("$gt"))
            .expect("a `$gt` bound on the kind");
        for kind in [PageKind::Seed, PageKind::List, PageKind::Detail] {
            assert_eq!(kind.is_listing(), kind.as_str() > bound, "{kind:?}");
        }
        // Each listing filter names one listing kind, so it implies the partial filter.
        let bot = BotId::parse("b").unwrap();
        let kinds: Vec<String> = listing_filters(&bot, doc! { "$eq": 1 })
            .iter()
            .map(|filter| filter.get_str(f::KIND).unwrap().to_owned())
            .collect();
        assert_eq!(kinds, ["list", "seed"]);
    }

    /// A listing page of `shop.test` at `path`, as a link to enqueue.
    fn listing_link(path: &str) -> NewUrl {
        NewUrl {
            url: NormalizedUrl::parse(&format!("http://shop.test/{path}")).unwrap(),
            kind: PageKind::List,
            fingerprint: None,
            priority: 1,
        }
    }

    #[test]
    fn leased_alike_resets_are_a_plain_set_and_pending_ones_keep_a_slot_each() {
        let bot = BotId::parse("b").unwrap();
        let me = InstanceId::parse("i").unwrap();
        let now = Utc::now();
        let lease = LeaseTo {
            me: &me,
            lease_for: Duration::from_secs(60),
            first: 2,
        };
        let taking = Taking::new(&bot, PassNumber::new(3), Some(&lease), now);
        let (one, two) = (listing_link("list/1"), listing_link("list/2"));
        let known = KnownPage {
            pass: PassNumber::new(2),
            status: Some(UrlStatus::Done),
            fingerprint: None,
            record_id: None,
            validators: Default::default(),
        };
        let leased: Vec<Reset<'_>> = vec![
            (&one, "1".into(), true, &known),
            (&two, "2".into(), true, &known),
        ];
        let statement = reset_statement(&taking, &leased);
        let set = statement
            .get_document("u")
            .and_then(|u| u.get_document("$set"))
            .expect("a plain $set");
        assert_eq!(set.get_str(f::STATUS), Ok("leased"));
        assert_eq!(set.get_str(f::LEASE_TOKEN), Ok(taking.token.as_str()));
        assert_eq!(set.get_i64(f::PASS), Ok(3));
        assert!(
            set.get(f::URL).is_none() && set.get(f::HOST).is_none(),
            "one statement for many links sets none of a link's own fields"
        );
        let filter = statement.get_document("q").unwrap();
        assert_eq!(
            filter.get_document(f::PASS).unwrap(),
            &doc! { "$lt": 3_i64 },
            "only an entry of an earlier pass"
        );
        // Pending links (or links unalike) keep the pipeline: a slot each.
        let pending: Vec<Reset<'_>> = vec![
            (&one, "1".into(), false, &known),
            (&two, "2".into(), false, &known),
        ];
        let statement = reset_statement(&taking, &pending);
        let stages = statement.get_array("u").expect("a pipeline");
        let set = stages[0]
            .as_document()
            .unwrap()
            .get_document("$set")
            .unwrap();
        assert!(set.get_document(f::SLOT).is_ok(), "a slot picked per link");
        let mixed: Vec<Reset<'_>> = vec![
            (&one, "1".into(), true, &known),
            (&two, "2".into(), false, &known),
        ];
        assert!(reset_statement(&taking, &mixed).get_array("u").is_ok());
    }

    #[test]
    fn a_listing_done_mark_is_one_statement_of_literals_in_two_stages() {
        let bot = BotId::parse("b").unwrap();
        let now = Utc::now();
        let taking = Taking::new(&bot, PassNumber::new(3), None, now);
        let (one, two) = (listing_link("list/1"), listing_link("list/2"));
        let (lease_one, lease_two) = (taking.lease(&one, "1", None), taking.lease(&two, "2", None));
        let listing = |ids: &[&str]| Mark::Done {
            validators: Default::default(),
            record_id: None,
            manifest: Some(Box::new(Manifest {
                listed: ids.iter().map(|id| id.repeat(32)).collect(),
                fingerprints: vec![7; ids.len()],
                fetched: vec![],
                evaluated: PassNumber::new(2),
            })),
        };
        let marks = [
            (&lease_one, listing(&["a", "b"])),
            (&lease_two, listing(&["c"])),
        ];
        let statements = settle_statements(&marks, now, "nonce");
        assert_eq!(statements.len(), 2, "a statement per listing page");
        for (statement, (lease, _)) in statements.iter().zip(&marks) {
            let filter = statement.get_document("q").unwrap();
            assert_eq!(
                filter.get_document(f::ID).unwrap(),
                &doc! { "$in": [lease.id.as_str()] }
            );
            let stages = statement.get_array("u").expect("a pipeline");
            assert_eq!(stages.len(), 2, "the marks, then whether the baseline grew");
            let text = format!("{stages:?}");
            assert!(
                !text.contains("$indexOfArray"),
                "one page's values are literals, not picked by _id: {text}"
            );
            let set = stages[0]
                .as_document()
                .unwrap()
                .get_document("$set")
                .unwrap();
            let this_list = set.get_document(f::LISTED).unwrap().get("$literal");
            assert!(
                matches!(this_list, Some(Bson::Binary(_))),
                "the manifest's list, packed, as a literal: {this_list:?}"
            );
            assert_eq!(
                this_list,
                set.get_document(f::LISTED_SINCE)
                    .unwrap()
                    .get_array("$setUnion")
                    .unwrap()[1]
                    .as_array()
                    .unwrap()[0]
                    .as_document()
                    .unwrap()
                    .get("$literal"),
                "the baseline gains this very list"
            );
        }
    }
}
