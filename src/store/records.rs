//! Records (collection `records`): one document per item, `_id` = a hash of (source, natural key)
//! — never the URL, never an auto id — so a repeated write is an update, not a duplicate.
//!
//! A record is written only when its content changes, it comes back after a removal, or its
//! page answers 404/410 — never because a pass saw it unchanged: an incremental pass writes as
//! many records as changed. A record with `removedAt: null` is present in the bot's last
//! completed pass by definition; deletion detection reads the listing pages' manifests
//! (`store::deletions`), not per-record marks.
//!
//! [`Records::commit_batch`] is the **group commit**: the pages waiting in the store queue are
//! committed together, the record of each and its URL's settle mark — on the ordered path, in
//! three round trips for the whole batch: one read of the stored records, one write of the new
//! and changed ones (new records in one `insert`, the rest in one `update` command whose every
//! statement is a compare-and-swap on the stored version), one `update` with every fenced done /
//! failed / retry mark. Only pages whose record write succeeded are marked; a page whose lease
//! was lost keeps nothing but a record the newer lease's result supersedes, and the rest of the
//! batch commits. With transactions, the batch is one transaction instead. Either way a crash at
//! any line leaves exactly one correct record per item: at worst a URL is fetched again and its
//! record rewritten with the same content, which is a no-op.

use std::collections::{HashMap, HashSet};

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;
use mongodb::{ClientSession, Collection};

use super::changes::{diff, pending_event, ChangeKind};
use super::indexes::IndexDef;

use super::frontier::{field as fr, settle_statements, Mark, UrlLease, UrlStatus, FRONTIER};
use super::{reply, Store};
use crate::error::{Error, Result};
use crate::ids::{BotId, PassNumber};
use crate::urls::NormalizedUrl;

pub(crate) const RECORDS: &str = "records";

/// Indexes of earlier versions, dropped at start-up: `bot_last_seen_pass` served deletion
/// detection by per-record seen marks (replaced by the listing manifests); `bot_list_key` a
/// listing check that was backed out.
pub const RETIRED_RECORD_INDEXES: [&str; 2] = ["bot_last_seen_pass", "bot_list_key"];

/// How many times a batch's records are read and written again when they change under concurrent
/// writers (each time only the pages whose compare-and-swap lost).
const ROUNDS: usize = 5;

/// Record document field names.
pub(crate) mod field {
    pub(crate) const ID: &str = "_id";
    pub(crate) const BOT: &str = "botId";
    pub(crate) const NATURAL_KEY: &str = "naturalKey";
    pub(crate) const URL: &str = "url";
    pub(crate) const DATA: &str = "data";
    pub(crate) const CONTENT_HASH: &str = "contentHash";
    pub(crate) const FIRST_SEEN: &str = "firstSeen";
    pub(crate) const LAST_CHANGED: &str = "lastChanged";
    /// The lease time of the fetch whose result is stored (moves only with a write)…
    pub(crate) const FETCHED_AT: &str = "fetchedAt";
    /// …and its pass.
    pub(crate) const FETCHED_PASS: &str = "fetchedPass";
    pub(crate) const REMOVED_AT: &str = "removedAt";
    pub(crate) const REMOVED_IN_PASS: &str = "removedInPass";
    /// The record's events not yet staged into the change feed (`store::changes`), each pushed
    /// by the write that made the change.
    pub(crate) const PENDING: &str = "pending";
}

use field as f;

/// `records._id`: the same item gets the same id on every instance, every run.
pub fn record_id(source: &str, natural_key: &str) -> String {
    crate::ids::sha256_hex(&[source.as_bytes(), &[0], natural_key.as_bytes()], 16)
}

/// The hash of a record's data: keys sorted, so field order never counts as a change.
pub fn content_hash(data: &Document) -> String {
    fn canonical(value: &Bson) -> serde_json::Value {
        match value {
            Bson::Document(d) => {
                let sorted: std::collections::BTreeMap<_, _> =
                    d.iter().map(|(k, v)| (k.clone(), canonical(v))).collect();
                serde_json::to_value(sorted).unwrap_or_default()
            }
            Bson::Array(items) => serde_json::Value::Array(items.iter().map(canonical).collect()),
            other => other.clone().into_relaxed_extjson(),
        }
    }
    let text = canonical(&Bson::Document(data.clone())).to_string();
    crate::ids::sha256_hex(&[text.as_bytes()], 16)
}

/// One extracted item, ready to store.
#[derive(Clone, Debug, PartialEq)]
pub struct Extracted {
    pub bot: BotId,
    pub natural_key: String,
    pub data: Document,
    /// The page's canonical URL (`rel=canonical`, in scope) when it names another than the
    /// fetched one: the record's `url`. `None`: the fetched URL.
    pub url: Option<crate::urls::NormalizedUrl>,
}

impl Extracted {
    pub fn id(&self) -> String {
        record_id(self.bot.as_str(), &self.natural_key)
    }

    /// The record's `url`: its canonical one, else the fetched one.
    fn url_of<'a>(&'a self, lease: &'a UrlLease) -> &'a str {
        self.url.as_ref().unwrap_or(&lease.url).as_str()
    }
}

/// What storing a record did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordWrite {
    Inserted,
    Changed,
    /// Same content as stored: not written.
    Unchanged,
    /// Same content as stored, but the record was marked removed: back, `removedAt` cleared.
    Restored,
    /// A newer result (a later lease of the same URL) is already stored: nothing written.
    Superseded,
}

/// One page of a group commit: its record (if it produced one), the record it shows gone, and
/// how its URL's lease ends.
#[derive(Clone, Debug)]
pub struct PageCommit<'a> {
    pub lease: &'a UrlLease,
    pub record: Option<&'a Extracted>,
    /// A record whose detail page answered 404/410: marked removed.
    pub removed: Option<String>,
    /// How the URL's lease ends. A `Done` carries the id of the record written here.
    pub mark: Mark,
}

/// What a group commit did with one page.
#[derive(Clone, Debug, PartialEq)]
pub enum Committed {
    /// The record (if any) is stored and the URL's lease ended as marked.
    Settled(Option<RecordWrite>),
    /// The URL's lease went to another worker before the mark: its result wins. On the ordered
    /// path this page's record may have been written (`Some`) — a newer lease's write replaces
    /// it, and never the other way round (`fetchedAt`).
    UrlLeaseLost(Option<RecordWrite>),
    /// Not committed (the record kept changing under concurrent writers): the URL stays leased
    /// and is fetched again after its lease.
    Failed(String),
}

/// A record write decided from the stored version.
enum Plan {
    Insert(Document),
    /// A compare-and-swap on the version read: the statement, and what it does when it matches.
    Swap(Document, RecordWrite),
    /// The same content as stored, by the URL's first lease of the pass: nothing to write.
    Unchanged,
    Superseded,
}

use super::date;

/// Decides a record's write from the stored version (`stored`: its `contentHash`, `fetchedAt`,
/// `removedAt`). A compare-and-swap statement filters on exactly the version read; with
/// `report_misses` it is an upsert, so that a swap that misses (the record changed since it was
/// read) fails with a duplicate `_id` at its own index in the reply instead of passing silently.
///
/// The same content as stored is not written — except by a lease that is not the URL's first
/// of the pass (a retry, or a dead predecessor's reclaimed): an earlier lease of the same URL
/// may still commit late, and its older result must find `fetchedAt` moved past its own lease
/// time, or it would replace this one's.
fn plan(
    record: &Extracted,
    lease: &UrlLease,
    stored: Option<&Document>,
    now: DateTime<Utc>,
    staged: PassNumber,
    report_misses: bool,
) -> Plan {
    let id = record.id();
    let hash = content_hash(&record.data);
    let Some(old) = stored else {
        return Plan::Insert(new_record(record, lease, &hash, now));
    };
    let newer_stored = matches!(old.get(f::FETCHED_AT), Some(Bson::DateTime(t)) if t.to_chrono() > lease.leased_at);
    if newer_stored {
        return Plan::Superseded;
    }
    let old_hash = old.get_str(f::CONTENT_HASH).unwrap_or_default().to_owned();
    let read_at = old.get(f::FETCHED_AT).cloned().unwrap_or(Bson::Null);
    let removed = !old
        .get(f::REMOVED_AT)
        .is_none_or(|v| matches!(v, Bson::Null));
    let first_lease = lease.attempt <= 1 && !lease.reclaimed;
    if old_hash == hash && !removed && first_lease {
        return Plan::Unchanged;
    }
    // Equalities only, which every server answers from the `_id` lookup; `botId` too, a prefix
    // of the shard key (ARCHITECTURE.md, "Cross-cutting concerns").
    let filter = doc! {
        f::ID: &id, f::BOT: record.bot.as_str(), f::CONTENT_HASH: &old_hash, f::FETCHED_AT: read_at,
    };
    let (mut update, on_insert, write) =
        swap_update(record, lease, &hash, old_hash != hash, removed, now);
    if write != RecordWrite::Unchanged {
        let kind = if removed {
            ChangeKind::Restored
        } else {
            ChangeKind::Changed
        };
        let fields = diff(old.get_document(f::DATA).ok(), &record.data);
        // The entries of passes already staged are rewritten away here, in the write that
        // happens anyway; the rest stay for their pass's end.
        let mut pending: Vec<Bson> = old
            .get_array(f::PENDING)
            .map(|entries| {
                entries
                    .iter()
                    .filter(|e| {
                        e.as_document()
                            .and_then(|e| e.get(super::changes::pending::PASS))
                            .and_then(super::document::integer)
                            .is_some_and(|p| p > staged.get())
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        pending.push(Bson::Document(pending_event(lease.pass, kind, fields, now)));
        if let Ok(set) = update.get_document_mut("$set") {
            set.insert(f::PENDING, pending);
        }
    }
    if report_misses {
        update.insert("$setOnInsert", on_insert);
    }
    let mut statement = doc! { "q": filter, "u": update };
    if report_misses {
        statement.insert("upsert", true);
    }
    Plan::Swap(statement, write)
}

/// A record as it is first inserted, with content hash `hash`.
fn new_record(record: &Extracted, lease: &UrlLease, hash: &str, now: DateTime<Utc>) -> Document {
    // Its fields are the record's own: staging reads them from it.
    let event = pending_event(lease.pass, ChangeKind::Added, Document::new(), now);
    let now = date(now);
    doc! {
        f::PENDING: [event],
        f::ID: record.id(), f::BOT: record.bot.as_str(), f::NATURAL_KEY: &record.natural_key,
        f::URL: record.url_of(lease), f::DATA: record.data.clone(), f::CONTENT_HASH: hash,
        f::FIRST_SEEN: now.clone(), f::LAST_CHANGED: now,
        f::REMOVED_AT: Bson::Null, f::REMOVED_IN_PASS: Bson::Null,
        f::FETCHED_AT: date(lease.leased_at), f::FETCHED_PASS: lease.pass,
    }
}

/// A compare-and-swap's update of a stored record (its content `changed`, or it was `removed`),
/// what an upsert that only reports a miss would need to create a whole record, and the write
/// it is.
fn swap_update(
    record: &Extracted,
    lease: &UrlLease,
    hash: &str,
    changed: bool,
    removed: bool,
    now: DateTime<Utc>,
) -> (Document, Document, RecordWrite) {
    let fetched_at = date(lease.leased_at);
    let now_b = date(now);
    // What an upsert that only reports a miss would need to create a whole record (it never
    // does: the `_id` exists, so the insert fails — unless the record was deleted meanwhile).
    // The filter's equalities (`botId` among them) are part of such a document already.
    let mut on_insert = doc! {
        f::NATURAL_KEY: &record.natural_key, f::FIRST_SEEN: now_b.clone(),
    };
    if !changed && !removed {
        // Same content, by a retry: only `fetchedAt` moves on (see `plan`).
        on_insert.insert(f::URL, record.url_of(lease));
        on_insert.insert(f::DATA, record.data.clone());
        on_insert.insert(f::LAST_CHANGED, now_b);
        on_insert.insert(f::REMOVED_AT, Bson::Null);
        on_insert.insert(f::FETCHED_PASS, lease.pass);
        let update = doc! { "$set": { f::FETCHED_AT: fetched_at } };
        return (update, on_insert, RecordWrite::Unchanged);
    }
    // A change, or a record back after a removal: `lastChanged` moves either way (an export
    // `--changed-since` must carry a record that came back).
    let set = doc! {
        f::URL: record.url_of(lease), f::DATA: record.data.clone(), f::CONTENT_HASH: hash,
        f::REMOVED_AT: Bson::Null, f::REMOVED_IN_PASS: Bson::Null, f::FETCHED_AT: fetched_at,
        f::FETCHED_PASS: lease.pass, f::LAST_CHANGED: now_b,
    };
    let write = if changed {
        RecordWrite::Changed
    } else {
        RecordWrite::Restored
    };
    (doc! { "$set": set }, on_insert, write)
}

/// Splits a batch's pages (their indexes; `ids`: each one's record id) into waves in which no record id appears twice: two pages of
/// one batch that produced the same item are written one after the other.
fn waves(ids: &[Option<String>]) -> Vec<Vec<usize>> {
    let mut waves: Vec<(HashSet<&str>, Vec<usize>)> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        match id.as_deref() {
            None => match waves.first_mut() {
                Some((_, members)) => members.push(i),
                None => waves.push((HashSet::new(), vec![i])),
            },
            Some(id) => match waves.iter_mut().find(|(seen, _)| !seen.contains(id)) {
                Some((seen, members)) => {
                    seen.insert(id);
                    members.push(i);
                }
                None => waves.push((HashSet::from([id]), vec![i])),
            },
        }
    }
    waves.into_iter().map(|(_, members)| members).collect()
}

/// The statements that mark the records of `pages` whose detail pages are gone removed
/// (idempotent: filtered on `removedAt: null`). A 404 is a result of its lease like a record:
/// it applies only to a record no newer lease wrote (`fetchedAt` at most this lease's time),
/// and it moves `fetchedAt` to its lease's time, so an older lease's record that commits late
/// finds it superseded instead of bringing the record back.
fn removed_statements(pages: &[&PageCommit<'_>], now: DateTime<Utc>) -> Vec<Document> {
    // Every filter carries `botId`, a prefix of the shard key (ARCHITECTURE.md, "Cross-cutting concerns").
    pages
        .iter()
        .filter_map(|page| {
            let id = page.removed.as_ref()?;
            let leased_at = date(page.lease.leased_at);
            Some(doc! {
                "q": {
                    f::ID: id.as_str(), f::BOT: page.lease.bot.as_str(), f::REMOVED_AT: Bson::Null,
                    "$or": [
                        { f::FETCHED_AT: { "$lte": leased_at.clone() } },
                        { f::FETCHED_AT: Bson::Null },
                    ],
                },
                "u": {
                    "$set": { f::REMOVED_AT: date(now), f::REMOVED_IN_PASS: page.lease.pass },
                    "$max": { f::FETCHED_AT: leased_at },
                    "$push": { f::PENDING: pending_event(page.lease.pass, ChangeKind::Removed, Document::new(), now) },
                },
            })
        })
        .collect()
}

/// Why a transaction attempt stopped.
enum Abort {
    /// Try the whole batch again (a conflict, a record that changed, a lease lost meanwhile).
    Again,
    Fail(Error),
}

impl From<Error> for Abort {
    fn from(e: Error) -> Self {
        match &e {
            Error::Db(db) if db.contains_label("TransientTransactionError") => Abort::Again,
            _ if crate::error::is_write_conflict(&e) => Abort::Again,
            Error::Db(db) if crate::error::is_duplicate_key(db) => Abort::Again,
            _ => Abort::Fail(e),
        }
    }
}

/// The `records` collection, reached through [`Store::records`].
#[derive(Clone, Copy, Debug)]
pub struct Records<'a> {
    pub(super) store: &'a Store,
}

impl Records<'_> {
    pub(super) fn collection(self) -> Collection<Document> {
        self.store.database().collection(RECORDS)
    }

    /// Creates the records' indexes — an operator's reads by natural key, "changed since" and
    /// "removed" (the README's mongosh recipes, `export`, restoring records at a pass's end) by
    /// bot and `naturalKey` / `lastChanged` / `removedAt`; the natural key never changes, so its
    /// index costs an insert, not a rewrite — rebuilds one whose definition changed and drops
    /// those of earlier versions (idempotent; see `store::indexes`).
    pub async fn ensure_indexes(self) -> Result<()> {
        let wanted = [
            IndexDef::new("bot_natural_key", doc! { f::BOT: 1, f::NATURAL_KEY: 1 }),
            IndexDef::new("bot_last_changed", doc! { f::BOT: 1, f::LAST_CHANGED: 1 }),
            IndexDef::new("bot_removed_at", doc! { f::BOT: 1, f::REMOVED_AT: 1 }),
            IndexDef::new(
                "bot_pending_pass",
                doc! { f::BOT: 1, format!("{}.{}", f::PENDING, super::changes::pending::PASS): 1 },
            ),
        ];
        super::indexes::ensure(self.store, RECORDS, &wanted, &RETIRED_RECORD_INDEXES).await
    }

    /// The group commit: every page's record, the records it shows seen or gone, and its URL's
    /// settle mark — fenced on its lease — for the whole batch at once. `transaction` chooses the
    /// path: one transaction for the batch (retried as a whole on a conflict, the pages kept;
    /// after five conflicts in a row the batch is committed in order instead), or in order —
    /// records first (guarded by the lease time, so an older lease's result never replaces a
    /// newer one), then the marks. Returns what became of each page, in order.
    pub async fn commit_batch(
        self,
        pages: &[PageCommit<'_>],
        now: DateTime<Utc>,
        transaction: bool,
    ) -> Result<Vec<Committed>> {
        self.commit_batch_keeping(pages, now, transaction, PassNumber::NONE)
            .await
    }

    /// As [`Records::commit_batch`]; a record written drops its pending change events of the
    /// passes up to `feed_staged` (staged already: see `store::changes`) and keeps the rest.
    pub async fn commit_batch_keeping(
        self,
        pages: &[PageCommit<'_>],
        now: DateTime<Utc>,
        transaction: bool,
        feed_staged: PassNumber,
    ) -> Result<Vec<Committed>> {
        let staged = feed_staged;
        if pages.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Option<String>> = pages.iter().map(|p| p.record.map(Extracted::id)).collect();
        let mut out = vec![None; pages.len()];
        for wave in waves(&ids) {
            let committed = if transaction {
                match self
                    .commit_in_transaction(pages, &ids, &wave, now, staged)
                    .await?
                {
                    Some(done) => done,
                    None => {
                        // A transaction a killed process left open holds a document until the
                        // server ends it: the ordered path gives the same guarantee without
                        // waiting, and keeps the pages already fetched.
                        tracing::warn!(
                            pages = wave.len(),
                            "transactions keep conflicting; committing this batch in order instead"
                        );
                        self.commit_ordered(pages, &ids, &wave, now, staged).await?
                    }
                }
            } else {
                self.commit_ordered(pages, &ids, &wave, now, staged).await?
            };
            for (i, c) in wave.iter().zip(committed) {
                out[*i] = Some(c);
            }
        }
        Ok(out
            .into_iter()
            .map(|c| c.unwrap_or_else(|| Committed::Failed("not committed".into())))
            .collect())
    }

    /// The stored versions of `ids` (their `contentHash`, `fetchedAt`, `removedAt`).
    async fn stored_versions(
        self,
        bot: &BotId,
        ids: &[&str],
        session: Option<&mut ClientSession>,
    ) -> Result<HashMap<String, Document>> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let docs = self
            .store
            .find_once(
                "read records",
                RECORDS,
                doc! { f::ID: { "$in": ids }, f::BOT: bot.as_str() },
                doc! { f::CONTENT_HASH: 1, f::FETCHED_AT: 1, f::REMOVED_AT: 1, f::DATA: 1, f::PENDING: 1 },
                ids.len(),
                session,
            )
            .await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| Some((d.get_str(f::ID).ok()?.to_owned(), d)))
            .collect())
    }

    /// How many records the bot has, live or marked removed (over the `bot_removed_at` index).
    pub(crate) async fn count_all(self, bot: &BotId) -> Result<u64> {
        self.store
            .bounded_scan(
                "count records",
                self.collection()
                    .count_documents(doc! { f::BOT: bot.as_str() }),
            )
            .await
    }

    /// Up to `n` of the bot's live records (their `url`, `naturalKey` and `data`), for
    /// `bots apply --check`.
    pub(crate) async fn sample_live(self, bot: &BotId, n: usize) -> Result<Vec<Document>> {
        self.store
            .find_once(
                "sample records",
                RECORDS,
                doc! { f::BOT: bot.as_str(), f::REMOVED_AT: Bson::Null },
                doc! { f::URL: 1, f::NATURAL_KEY: 1, f::DATA: 1 },
                n,
                None,
            )
            .await
            .map(|mut docs| {
                docs.truncate(n);
                docs
            })
    }

    /// How many of the bot's records are live (not marked removed).
    pub(crate) async fn count_live(self, bot: &BotId) -> Result<u64> {
        let (all, removed) = tokio::try_join!(self.count_all(bot), self.count_removed(bot))?;
        Ok(all.saturating_sub(removed))
    }

    /// How many of the bot's records are marked removed.
    pub(crate) async fn count_removed(self, bot: &BotId) -> Result<u64> {
        self.store
            .bounded(
                "count removed records",
                self.collection().count_documents(
                    doc! { f::BOT: bot.as_str(), f::REMOVED_AT: { "$ne": Bson::Null } },
                ),
            )
            .await
    }

    /// The live record stored for a detail page's URL, if any. For a page whose record may have
    /// been stored without its done mark (an earlier lease of it in this pass never settled: a
    /// crash between the two writes, or a lease taken over), found gone: its frontier entry does
    /// not know the record. No index serves it (it reads the bot's records); it is asked only
    /// in that case.
    pub(crate) async fn live_record_at(
        self,
        bot: &BotId,
        url: &NormalizedUrl,
    ) -> Result<Option<String>> {
        let docs = self
            .store
            .find_once(
                "read the record of a gone page",
                RECORDS,
                doc! { f::BOT: bot.as_str(), f::URL: url.as_str(), f::REMOVED_AT: Bson::Null },
                doc! { f::ID: 1 },
                1,
                None,
            )
            .await?;
        Ok(docs
            .first()
            .and_then(|d| d.get_str(f::ID).ok())
            .map(str::to_owned))
    }

    /// The ordered path for one wave: records (rounds of read + write while compare-and-swaps
    /// lose), then the marks of the pages whose record is settled.
    async fn commit_ordered(
        self,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        wave: &[usize],
        now: DateTime<Utc>,
        staged: PassNumber,
    ) -> Result<Vec<Committed>> {
        let mut writes: HashMap<usize, RecordWrite> = HashMap::new();
        let mut todo: Vec<usize> = wave
            .iter()
            .copied()
            .filter(|i| pages[*i].record.is_some())
            .collect();
        let members: Vec<&PageCommit<'_>> = wave.iter().map(|i| &pages[*i]).collect();
        let mut extra = removed_statements(&members, now);
        for _ in 0..ROUNDS {
            if todo.is_empty() && extra.is_empty() {
                break;
            }
            let bot = &pages[wave[0]].lease.bot;
            let wanted: Vec<&str> = todo.iter().filter_map(|i| ids[*i].as_deref()).collect();
            let stored = self.stored_versions(bot, &wanted, None).await?;
            let mut inserts: Vec<(usize, Document)> = Vec::new();
            let mut swaps: Vec<(usize, Document, RecordWrite)> = Vec::new();
            for i in &todo {
                let page = &pages[*i];
                let record = page.record.expect("pages to write have records");
                let id = ids[*i].as_deref().unwrap_or_default();
                match plan(record, page.lease, stored.get(id), now, staged, true) {
                    Plan::Insert(doc) => inserts.push((*i, doc)),
                    Plan::Swap(statement, write) => swaps.push((*i, statement, write)),
                    Plan::Unchanged => {
                        writes.insert(*i, RecordWrite::Unchanged);
                    }
                    Plan::Superseded => {
                        writes.insert(*i, RecordWrite::Superseded);
                    }
                }
            }
            let mut statements: Vec<Document> = swaps.iter().map(|(_, s, _)| s.clone()).collect();
            statements.append(&mut extra);
            let docs: Vec<&Document> = inserts.iter().map(|(_, d)| d).collect();
            let (lost_inserts, lost_swaps) = self.write_round(&docs, &statements).await?;
            let mut again = Vec::new();
            // A duplicate `_id` on an insert: another worker stored the item first. On a swap: the
            // record changed since it was read. Either way, read it and decide again.
            for (n, (i, _)) in inserts.iter().enumerate() {
                if lost_inserts.contains(&n) {
                    again.push(*i);
                } else {
                    writes.insert(*i, RecordWrite::Inserted);
                }
            }
            for (n, (i, _, write)) in swaps.iter().enumerate() {
                if lost_swaps.contains(&n) {
                    again.push(*i);
                } else {
                    writes.insert(*i, *write);
                }
            }
            todo = again;
        }
        self.mark_wave(pages, ids, wave, &todo, &writes, now).await
    }

    /// One round of an ordered commit's writes, at once: the new records in one `insert`, the
    /// compare-and-swaps and removal statements in one `update`. Returns the indexes of the
    /// inserts and of the statements that met a duplicate `_id` (another worker's insert, or a
    /// record changed since it was read).
    async fn write_round(
        self,
        inserts: &[&Document],
        statements: &[Document],
    ) -> Result<(HashSet<usize>, HashSet<usize>)> {
        let insert = async {
            if inserts.is_empty() {
                return Ok(HashSet::new());
            }
            let reply = self
                .store
                .command(
                    "insert records",
                    doc! { "insert": RECORDS, "documents": inserts, "ordered": false },
                    None,
                )
                .await?;
            reply::duplicates("insert records", &reply)
                .map(|d| d.into_iter().collect::<HashSet<_>>())
        };
        let update = async {
            if statements.is_empty() {
                return Ok(HashSet::new());
            }
            let reply = self
                .store
                .command(
                    "write records",
                    doc! { "update": RECORDS, "updates": statements, "ordered": false },
                    None,
                )
                .await?;
            reply::duplicates("write records", &reply)
                .map(|d| d.into_iter().collect::<HashSet<_>>())
        };
        tokio::try_join!(insert, update)
    }

    /// The fenced marks of a wave's pages whose record write succeeded (`failed`: those whose
    /// record kept changing are not marked), in one `update`; what became of each page.
    async fn mark_wave(
        self,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        wave: &[usize],
        failed: &[usize],
        writes: &HashMap<usize, RecordWrite>,
        now: DateTime<Utc>,
    ) -> Result<Vec<Committed>> {
        let mut marks: Vec<(&UrlLease, Mark)> = Vec::new();
        let mut marked: Vec<usize> = Vec::new();
        for i in wave {
            if failed.contains(i) {
                continue;
            }
            marks.push((pages[*i].lease, mark_of(&pages[*i], ids[*i].as_deref())));
            marked.push(*i);
        }
        let applied = self.store.frontier().settle_urls(&marks, now).await?;
        let by_page: HashMap<usize, bool> = marked.into_iter().zip(applied).collect();
        Ok(wave
            .iter()
            .map(|i| match by_page.get(i) {
                Some(true) => Committed::Settled(writes.get(i).copied()),
                Some(false) => Committed::UrlLeaseLost(writes.get(i).copied()),
                None => Committed::Failed(format!(
                    "record {} kept changing under concurrent writers",
                    ids[*i].as_deref().unwrap_or("?")
                )),
            })
            .collect())
    }

    /// The transaction path for one wave: `None` when it conflicted on every attempt.
    async fn commit_in_transaction(
        self,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        wave: &[usize],
        now: DateTime<Utc>,
        staged: PassNumber,
    ) -> Result<Option<Vec<Committed>>> {
        for attempt in 1..=ROUNDS as u32 {
            let mut session = self
                .store
                .bounded(
                    "start session",
                    self.store.database().client().start_session(),
                )
                .await?;
            // Named before it writes: a successor can end it if this process dies inside it.
            self.store.instances().name_session(&session).await?;
            self.store
                .bounded(
                    "start transaction",
                    session
                        .start_transaction()
                        .write_concern(super::durable())
                        .selection_criteria(super::primary()),
                )
                .await?;
            let result = self
                .bounded_result(
                    "commit batch",
                    self.transaction_attempt(&mut session, pages, ids, wave, now, staged),
                )
                .await;
            match result {
                Ok(committed) => return Ok(Some(committed)),
                Err(abort) => {
                    // Best effort: the server also aborts a transaction whose session goes away.
                    let _ =
                        tokio::time::timeout(self.store.op_timeout, session.abort_transaction())
                            .await;
                    match abort {
                        Abort::Again => {
                            tokio::time::sleep(crate::backoff::full_jitter(
                                std::time::Duration::from_millis(10),
                                std::time::Duration::from_millis(500),
                                attempt,
                            ))
                            .await;
                        }
                        Abort::Fail(e) => return Err(e),
                    }
                }
            }
        }
        Ok(None)
    }

    /// One attempt of a batch's transaction: read the leases (a lost one is left out), read and
    /// write the records, mark the URLs, commit.
    async fn transaction_attempt(
        self,
        session: &mut ClientSession,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        wave: &[usize],
        now: DateTime<Utc>,
        staged: PassNumber,
    ) -> std::result::Result<Vec<Committed>, Abort> {
        let alive = self.leases_held(session, pages, wave).await?;
        let planned = self
            .plan_writes(session, pages, ids, &alive, now, staged)
            .await?;
        self.write_records(session, planned.inserts, planned.swaps)
            .await?;
        self.mark_in_transaction(session, pages, ids, &alive, now)
            .await?;
        commit_with_retries(session).await?;
        let alive: HashSet<usize> = alive.into_iter().collect();
        Ok(wave
            .iter()
            .map(|i| {
                if alive.contains(i) {
                    Committed::Settled(planned.writes.get(i).copied())
                } else {
                    Committed::UrlLeaseLost(None)
                }
            })
            .collect())
    }

    /// The pages of `wave` whose lease this transaction reads as still theirs.
    async fn leases_held(
        self,
        session: &mut ClientSession,
        pages: &[PageCommit<'_>],
        wave: &[usize],
    ) -> std::result::Result<Vec<usize>, Abort> {
        let bot = &pages[wave[0]].lease.bot;
        let urls: Vec<&str> = wave.iter().map(|i| pages[*i].lease.id.as_str()).collect();
        let fences = self
            .store
            .find_once(
                "read leases",
                FRONTIER,
                doc! { fr::ID: { "$in": &urls }, fr::BOT: bot.as_str() },
                doc! { fr::STATUS: 1, fr::LEASE_TOKEN: 1 },
                urls.len(),
                Some(session),
            )
            .await?;
        let tokens: HashMap<String, Option<String>> = fences
            .into_iter()
            .filter_map(|d| {
                let leased = d.get_str(fr::STATUS).ok() == Some(UrlStatus::Leased.as_str());
                let token = leased
                    .then(|| d.get_str(fr::LEASE_TOKEN).ok().map(str::to_owned))
                    .flatten();
                Some((d.get_str(fr::ID).ok()?.to_owned(), token))
            })
            .collect();
        Ok(wave
            .iter()
            .copied()
            .filter(|i| {
                let lease = pages[*i].lease;
                tokens.get(&lease.id).and_then(|t| t.as_deref()) == Some(lease.token.as_str())
            })
            .collect())
    }

    /// What each of `alive`'s records becomes (read in the transaction): the inserts, the
    /// conditional swaps, and each page's write.
    async fn plan_writes(
        self,
        session: &mut ClientSession,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        alive: &[usize],
        now: DateTime<Utc>,
        staged: PassNumber,
    ) -> std::result::Result<PlannedWrites, Abort> {
        let with_records: Vec<usize> = alive
            .iter()
            .copied()
            .filter(|i| pages[*i].record.is_some())
            .collect();
        let wanted: Vec<&str> = with_records
            .iter()
            .filter_map(|i| ids[*i].as_deref())
            .collect();
        let stored = match with_records.first() {
            Some(first) => {
                let bot = &pages[*first].lease.bot;
                self.stored_versions(bot, &wanted, Some(session)).await?
            }
            None => HashMap::new(),
        };
        let mut writes: HashMap<usize, RecordWrite> = HashMap::new();
        let mut inserts = Vec::new();
        let mut swaps = Vec::new();
        for i in &with_records {
            let page = &pages[*i];
            let record = page.record.expect("filtered on records");
            match plan(
                record,
                page.lease,
                stored.get(ids[*i].as_deref().unwrap_or_default()),
                now,
                staged,
                false,
            ) {
                Plan::Insert(doc) => {
                    inserts.push(doc);
                    writes.insert(*i, RecordWrite::Inserted);
                }
                Plan::Swap(statement, write) => {
                    swaps.push(statement);
                    writes.insert(*i, write);
                }
                Plan::Unchanged => {
                    writes.insert(*i, RecordWrite::Unchanged);
                }
                Plan::Superseded => {
                    writes.insert(*i, RecordWrite::Superseded);
                }
            }
        }
        Ok(PlannedWrites {
            writes,
            inserts,
            swaps,
        })
    }

    /// The records' inserts and swaps; a duplicate or a swap that matched nothing (another
    /// writer got there first) aborts the attempt to run again.
    async fn write_records(
        self,
        session: &mut ClientSession,
        inserts: Vec<Document>,
        swaps: Vec<Document>,
    ) -> std::result::Result<(), Abort> {
        if !inserts.is_empty() {
            let reply = self
                .store
                .command(
                    "insert records",
                    doc! { "insert": RECORDS, "documents": inserts, "ordered": true },
                    Some(session),
                )
                .await?;
            if !reply::duplicates("insert records", &reply)?.is_empty() {
                return Err(Abort::Again);
            }
        }
        if !swaps.is_empty() {
            let expected = swaps.len();
            let reply = self
                .store
                .command(
                    "write records",
                    doc! { "update": RECORDS, "updates": swaps, "ordered": true },
                    Some(session),
                )
                .await?;
            reply::duplicates("write records", &reply)?;
            // A swap that matched nothing: the record changed since this transaction read it.
            if reply::count(&reply) != expected {
                return Err(Abort::Again);
            }
        }
        Ok(())
    }

    /// The removed records' marks and every live page's done mark; a lease lost since the read
    /// aborts the attempt to run again.
    async fn mark_in_transaction(
        self,
        session: &mut ClientSession,
        pages: &[PageCommit<'_>],
        ids: &[Option<String>],
        alive: &[usize],
        now: DateTime<Utc>,
    ) -> std::result::Result<(), Abort> {
        let members: Vec<&PageCommit<'_>> = alive.iter().map(|i| &pages[*i]).collect();
        let extra = removed_statements(&members, now);
        if !extra.is_empty() {
            self.store
                .command(
                    "mark records",
                    doc! { "update": RECORDS, "updates": extra, "ordered": true },
                    Some(session),
                )
                .await?;
        }
        let marks: Vec<(&UrlLease, Mark)> = alive
            .iter()
            .map(|i| (pages[*i].lease, mark_of(&pages[*i], ids[*i].as_deref())))
            .collect();
        if !marks.is_empty() {
            let statements = settle_statements(&marks, now, &super::frontier::new_token());
            let reply = self
                .store
                .command(
                    "settle urls",
                    doc! { "update": FRONTIER, "updates": statements, "ordered": true },
                    Some(session),
                )
                .await?;
            reply::duplicates("settle urls", &reply)?;
            // A lease lost since this transaction read it.
            if reply::count(&reply) != marks.len() {
                return Err(Abort::Again);
            }
        }
        Ok(())
    }

    /// Runs a multi-step future under the operation timeout.
    async fn bounded_result<T, E: From<Error>>(
        self,
        what: &'static str,
        work: impl std::future::Future<Output = std::result::Result<T, E>>,
    ) -> std::result::Result<T, E> {
        match tokio::time::timeout(self.store.op_timeout * 3, work).await {
            Ok(result) => result,
            Err(_) => Err(E::from(Error::Timeout {
                what,
                after: self.store.op_timeout * 3,
            })),
        }
    }

    /// Whether the server runs multi-document transactions (`crawl.transactions = "auto"`): one
    /// empty transaction, aborted. A transient failure is an error, not a "no".
    pub(crate) async fn supports_transactions(self) -> Result<bool> {
        let probe = async {
            let mut session = self.store.database().client().start_session().await?;
            session
                .start_transaction()
                .selection_criteria(super::primary())
                .await?;
            self.store
                .records()
                .collection()
                .find_one(doc! { f::ID: "__seedlock_probe" })
                .session(&mut session)
                .await?;
            session.abort_transaction().await
        };
        match self.store.bounded("probe transactions", probe).await {
            Ok(()) => Ok(true),
            Err(e) if e.is_transient() => Err(e),
            Err(_) => Ok(false),
        }
    }

    /// The bot's records for `export`, in `_id` order, a batch at a time (constant memory):
    /// those changed since `changed_since`, and removed ones only with `include_removed`. The
    /// find and each further batch are bounded by the operation timeout: a server that stops
    /// answering mid-export is an error, not a hang.
    pub async fn export_records(
        self,
        bot: &BotId,
        changed_since: Option<DateTime<Utc>>,
        include_removed: bool,
    ) -> Result<ExportRecords> {
        use super::records::field as rf;
        let mut filter = doc! { rf::BOT: bot.as_str() };
        if let Some(since) = changed_since {
            filter.insert(rf::LAST_CHANGED, doc! { "$gte": super::date(since) });
        }
        if !include_removed {
            filter.insert(rf::REMOVED_AT, Bson::Null);
        }
        let cursor = self
            .store
            .bounded(
                "export records",
                // The URI's read preference applies: an export may lag; nothing decides from it.
                self.store
                    .views
                    .collection::<Document>(super::records::RECORDS)
                    .find(filter)
                    // The feed's pending events are the store's own bookkeeping.
                    .projection(doc! { rf::PENDING: 0 })
                    .batch_size(1000),
            )
            .await?;
        Ok(ExportRecords {
            store: self.store.clone(),
            cursor,
        })
    }
}

/// A page's mark, with the id of the record it wrote on a `Done`.
fn mark_of(page: &PageCommit<'_>, record_id: Option<&str>) -> Mark {
    match (&page.mark, record_id) {
        (
            Mark::Done {
                validators,
                manifest,
                ..
            },
            Some(id),
        ) => Mark::Done {
            validators: validators.clone(),
            record_id: Some(id.to_owned()),
            manifest: manifest.clone(),
        },
        (mark, _) => mark.clone(),
    }
}

/// The header of a CSV export whose spec's record has `fields`: the natural key, the URL, each
/// field, when the record was first seen, last changed and removed.
pub(crate) fn export_header(fields: &[String]) -> Vec<&str> {
    let mut names = vec![f::NATURAL_KEY, f::URL];
    names.extend(fields.iter().map(String::as_str));
    names.extend([f::FIRST_SEEN, f::LAST_CHANGED, f::REMOVED_AT]);
    names
}

/// A record's values in the order of [`export_header`] (a missing one: `None`).
pub(crate) fn export_cells<'r>(record: &'r Document, fields: &[String]) -> Vec<Option<&'r Bson>> {
    let data = record.get_document(f::DATA).ok();
    let mut cells = vec![record.get(f::NATURAL_KEY), record.get(f::URL)];
    cells.extend(fields.iter().map(|name| data.and_then(|d| d.get(name))));
    cells.extend([f::FIRST_SEEN, f::LAST_CHANGED, f::REMOVED_AT].map(|name| record.get(name)));
    cells
}

/// The records an export reads, one at a time off the cursor.
pub struct ExportRecords {
    store: Store,
    cursor: mongodb::Cursor<Document>,
}

impl ExportRecords {
    /// The next record; `None` at the end. A further batch is waited for at most the operation
    /// timeout.
    pub async fn next(&mut self) -> Result<Option<Document>> {
        self.store
            .unaccounted("export records", self.cursor.try_next())
            .await
    }
}

/// What a transaction writes to `records`: the inserts, the conditional swaps, and each page's
/// write (by its index in the batch).
struct PlannedWrites {
    writes: HashMap<usize, RecordWrite>,
    inserts: Vec<Document>,
    swaps: Vec<Document>,
}

/// Commits the session's transaction. A commit whose outcome is unknown (a network blip) is
/// retried as it is: the server applies a transaction's commit at most once.
async fn commit_with_retries(session: &mut ClientSession) -> std::result::Result<(), Abort> {
    let mut unknown = 0;
    loop {
        match session.commit_transaction().await {
            Ok(()) => break,
            Err(e) if e.contains_label("UnknownTransactionCommitResult") && unknown < 3 => {
                unknown += 1;
            }
            Err(e) => return Err(Error::from(e).into()),
        }
    }
    Ok(())
}
