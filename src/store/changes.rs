//! The change feed (collection `changes`): one document per record event of a pass — `added`,
//! `changed` (with each field's `from` and `to`), `removed`, `restored` — numbered per bot by
//! `seq`, and visible only once its pass is **released**.
//!
//! Exactly once without transactions: the write that changes a record also pushes its event
//! onto the record (`pending`, one entry per write, each naming its pass) — the record's insert,
//! its compare-and-swap, a 404's removal, and the `update_many` of the removals and
//! restorations at a pass's end. A record and its event are therefore one write: a crash leaves
//! both or neither. At the pass's end the instance that evaluates it **stages** the passes not
//! staged yet (`crawlFeed.staged` up to this one; an earlier pass whose evaluator stopped before
//! the next pass ended is among them): it reads the records holding their events (an index on
//! `{botId, pending.pass}`), folds each record's events of one pass into one (an item added and
//! changed in one pass is one `added`), and inserts them into `changes` with `_id` = a hash of
//! (bot, record, pass) — a second staging (a crash, a claim taken over, a slow evaluator beside
//! the next pass's end) inserts nothing twice — and `seq` past the bot's highest (a unique index
//! on `{botId, seq}` refuses two events one number). Staged events are still invisible: readers
//! read only up to the bot's released watermark (`crawlFeed.seq` in its `bots` document), which
//! the pass's release moves past all of them in one conditional write — the write that records
//! the pass's evaluation. A record's entries stay until its next write, which drops those of the
//! passes staged when its slice started: the feed writes nothing more per record than its event.
//! Staging names its passes (`$in`), so the entries left behind cost it nothing.
//!
//! A **gated** pass (its fields' fill rates fell, or it would remove too much: `store::passes`)
//! stays staged: `crawlFeed.gate` names it and why. `seedlock pass release` moves the watermark
//! past it (and applies the removals it held back, while it is still the bot's latest pass);
//! `seedlock pass discard` — or the end of the next pass — deletes its staged events.

use std::collections::BTreeMap;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};

use super::indexes::IndexDef;
use super::records::field as rf;
use super::{date, reply, Store};
use crate::error::{Error, Result};
use crate::ids::{BotId, PassNumber};

pub(crate) const CHANGES: &str = "changes";

/// `changes` document field names.
pub(crate) mod field {
    pub(crate) const ID: &str = "_id";
    pub(crate) const BOT: &str = "botId";
    pub(crate) const PASS: &str = "pass";
    pub(crate) const SEQ: &str = "seq";
    pub(crate) const RECORD: &str = "recordId";
    pub(crate) const NATURAL_KEY: &str = "naturalKey";
    pub(crate) const KIND: &str = "kind";
    pub(crate) const FIELDS: &str = "fields";
    pub(crate) const AT: &str = "at";
}

use field as f;

/// Field names of a pending event on a record (`records.pending`, an array).
pub(crate) mod pending {
    pub(crate) const PASS: &str = "pass";
    pub(crate) const KIND: &str = "kind";
    pub(crate) const FIELDS: &str = "fields";
    pub(crate) const AT: &str = "at";
}

/// What happened to a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Changed,
    Removed,
    Restored,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "added",
            ChangeKind::Changed => "changed",
            ChangeKind::Removed => "removed",
            ChangeKind::Restored => "restored",
        }
    }

    fn parse(text: &str) -> Option<ChangeKind> {
        Some(match text {
            "added" => ChangeKind::Added,
            "changed" => ChangeKind::Changed,
            "removed" => ChangeKind::Removed,
            "restored" => ChangeKind::Restored,
            _ => return None,
        })
    }
}

/// One event as the write that makes the change pushes it onto the record.
pub(crate) fn pending_event(
    pass: PassNumber,
    kind: ChangeKind,
    fields: Document,
    at: DateTime<Utc>,
) -> Document {
    doc! {
        pending::PASS: pass, pending::KIND: kind.as_str(), pending::FIELDS: fields,
        pending::AT: date(at),
    }
}

/// The fields that differ between a record's stored data and its new data, each as
/// `{from, to}` (a field missing on one side is `null` there). With no stored data (an added
/// record) every field of the new data, from `null`.
pub(crate) fn diff(old: Option<&Document>, new: &Document) -> Document {
    let mut out = Document::new();
    let empty = Document::new();
    let old_data = old.unwrap_or(&empty);
    for (name, to) in new {
        let from = old_data.get(name).cloned().unwrap_or(Bson::Null);
        if old.is_none() || from != *to {
            out.insert(name.clone(), doc! { "from": from, "to": to.clone() });
        }
    }
    for (name, from) in old_data {
        if !new.contains_key(name) && !matches!(from, Bson::Null) {
            out.insert(
                name.clone(),
                doc! { "from": from.clone(), "to": Bson::Null },
            );
        }
    }
    out
}

/// One record's events of a pass, folded into the one its readers see: the first `from` and the
/// last `to` of each field, and a kind that says what the pass did to the record as a whole
/// (added then removed in one pass: nothing; removed then back with other values: changed).
/// `None` when the pass left the record as it found it.
fn fold(events: &[&Document]) -> Option<(ChangeKind, Document, Bson)> {
    let kinds: Vec<ChangeKind> = events
        .iter()
        .filter_map(|e| ChangeKind::parse(e.get_str(pending::KIND).ok()?))
        .collect();
    let (first, last) = (*kinds.first()?, *kinds.last()?);
    let mut fields: BTreeMap<String, (Bson, Bson)> = BTreeMap::new();
    for event in events {
        let Ok(changed) = event.get_document(pending::FIELDS) else {
            continue;
        };
        for (name, change) in changed {
            let Some(change) = change.as_document() else {
                continue;
            };
            let to = change.get("to").cloned().unwrap_or(Bson::Null);
            let from = change.get("from").cloned().unwrap_or(Bson::Null);
            fields
                .entry(name.clone())
                .and_modify(|(_, t)| *t = to.clone())
                .or_insert((from, to));
        }
    }
    // What the record was before the pass (a restoration first: removed) and after it.
    let removed_after = last == ChangeKind::Removed;
    let kind = match (first, first == ChangeKind::Restored, removed_after) {
        (ChangeKind::Added, _, true) => return None,
        (ChangeKind::Added, _, false) => ChangeKind::Added,
        (_, false, false) => ChangeKind::Changed,
        (_, false, true) => ChangeKind::Removed,
        (_, true, false) => ChangeKind::Restored,
        (_, true, true) => return None,
    };
    if kind != ChangeKind::Added {
        fields.retain(|_, (from, to)| from != to);
    }
    if kind == ChangeKind::Changed && fields.is_empty() {
        return None;
    }
    let at = events
        .last()
        .and_then(|e| e.get(pending::AT).cloned())
        .unwrap_or(Bson::Null);
    let fields = fields
        .into_iter()
        .map(|(name, (from, to))| (name, Bson::Document(doc! { "from": from, "to": to })))
        .collect();
    Some((kind, fields, at))
}

/// The pass numbers after `after` up to `pass`.
fn passes_between(after: PassNumber, pass: PassNumber) -> Vec<i64> {
    (after.get().max(0) + 1..=pass.get()).collect()
}

/// What staging a pass found: its events by kind, and the fill of each field over the records
/// the pass wrote (added, changed or restored).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Staged {
    pub added: u64,
    pub changed: u64,
    pub removed: u64,
    pub restored: u64,
    /// Records the pass wrote with data: the fill rates' denominator.
    pub written: u64,
    /// Per field: of the records written, how many hold a non-null value.
    pub filled: BTreeMap<String, u64>,
    /// The highest `seq` of the pass's events (0 when it has none).
    pub last_seq: i64,
}

impl Staged {
    pub fn events(&self) -> u64 {
        self.added + self.changed + self.removed + self.restored
    }

    /// Each field's fill rate, of the records the pass wrote.
    pub fn fill(&self) -> BTreeMap<String, f64> {
        self.filled
            .iter()
            .map(|(k, n)| (k.clone(), *n as f64 / self.written.max(1) as f64))
            .collect()
    }
}

/// The `_id` of a record's event of a pass: the same however often the pass is staged.
fn event_id(bot: &BotId, record: &str, pass: PassNumber) -> String {
    crate::ids::sha256_hex(
        &[
            bot.as_str().as_bytes(),
            &[0],
            record.as_bytes(),
            &[0],
            &pass.get().to_be_bytes(),
        ],
        16,
    )
}

/// Events staged per `insert`.
const STAGE_BATCH: usize = 1000;

/// The change feed, reached through [`Store::changes`].
#[derive(Clone, Copy, Debug)]
pub struct Changes<'a> {
    pub(super) store: &'a Store,
}

/// One event as a reader gets it.
pub type Event = Document;

impl Changes<'_> {
    fn collection(self) -> mongodb::Collection<Document> {
        self.store.database().collection(CHANGES)
    }

    /// The feed's indexes: a bot's events by `seq` (unique: two events never share a number),
    /// by pass, and the expiry of events older than `ttl`. The records' pending events by pass
    /// are indexed with the records.
    pub async fn ensure_indexes(self, ttl: std::time::Duration) -> Result<()> {
        let mut by_seq = IndexDef::new("bot_seq", doc! { f::BOT: 1, f::SEQ: 1 });
        by_seq.unique = true;
        let mut expiry = IndexDef::new("expire_at", doc! { f::AT: 1 });
        expiry.expire_after = Some(ttl);
        let wanted = [
            by_seq,
            IndexDef::new("bot_pass_seq", doc! { f::BOT: 1, f::PASS: 1, f::SEQ: 1 }),
            expiry,
        ];
        super::indexes::ensure(self.store, CHANGES, &wanted, &[]).await
    }

    /// The highest `seq` among the bot's events, staged or released — with `passes`
    /// (`(after, pass)`), among those of the passes after `after` up to `pass` — read from the
    /// newest event down (0 when there is none).
    async fn highest_seq(
        self,
        bot: &BotId,
        passes: Option<(PassNumber, PassNumber)>,
    ) -> Result<i64> {
        let mut filter = doc! { f::BOT: bot.as_str() };
        if let Some((after, pass)) = passes {
            filter.insert(f::PASS, doc! { "$gt": after, "$lte": pass });
        }
        let collection = self.collection();
        let read = collection
            .find_one(filter)
            .sort(doc! { f::BOT: -1, f::SEQ: -1 })
            .projection(doc! { f::SEQ: 1 });
        Ok(self
            .store
            .bounded("read the last event", read)
            .await?
            .and_then(|d| d.get(f::SEQ).and_then(super::document::integer))
            .unwrap_or(0))
    }

    /// Stages pass `pass` (see the module comment): every record's events of the passes after
    /// `after` (the last staged) up to `pass` — an earlier pass whose end was never evaluated
    /// (its evaluator stopped and the next pass ended first) is released with it — each pass's
    /// folded into one event, inserted once with the next numbers. Idempotent. Returns the
    /// events by kind and the fill of `pass`'s own writes.
    pub async fn stage(self, bot: &BotId, after: PassNumber, pass: PassNumber) -> Result<Staged> {
        let mut staged = Staged::default();
        let mut batch: Vec<Document> = Vec::new();
        let records = self.store.records().collection();
        let find = records
            // The passes by `$in`, not a range: a multikey index bounds a range by one side only
            // (one array element may meet each), and every record keeps its last entry.
            .find(doc! {
                rf::BOT: bot.as_str(),
                format!("{}.{}", rf::PENDING, pending::PASS): { "$in": passes_between(after, pass) },
            })
            .projection(doc! { rf::NATURAL_KEY: 1, rf::DATA: 1, rf::PENDING: 1, rf::REMOVED_AT: 1 })
            .batch_size(1000);
        // The highest number read beside the first batch (one round trip, not two).
        let (mut cursor, mut next_seq) = tokio::try_join!(
            self.store.bounded("read pending events", find),
            self.highest_seq(bot, None)
        )?;
        use futures_util::TryStreamExt;
        let mut refused_any = false;
        loop {
            // A cursor's next document is no command of its own (its further batches are
            // counted as such): counted per document, a pass of 100,000 changes read as 100,000
            // commands in `seedlock_db_commands_total` and as many trace lines.
            let record = self
                .store
                .unaccounted("read pending events", cursor.try_next())
                .await?;
            let done = record.is_none();
            if let Some(record) = record {
                batch.extend(self.events_of(bot, after, pass, &record, &mut staged));
            }
            if batch.len() >= STAGE_BATCH || (done && !batch.is_empty()) {
                let refused;
                (next_seq, refused) = self.insert_numbered(bot, &mut batch, next_seq).await?;
                refused_any |= refused;
                staged.last_seq = staged.last_seq.max(next_seq);
            }
            if done {
                break;
            }
        }
        // A second staging inserts nothing new; its events were numbered by the first (its
        // inserts were refused: the highest number is read back). Every insert taken: the
        // numbers given are the pass's.
        if staged.events() > 0 && refused_any {
            staged.last_seq = staged
                .last_seq
                .max(self.highest_seq(bot, Some((after, pass))).await?);
        }
        Ok(staged)
    }

    /// The events a staged record carries for the passes after `after` up to `pass`: one per
    /// pass that changed it, each folded from that pass's entries and keyed by record and pass
    /// — so two instances staging one pass (a slow evaluator, and the end of the next pass)
    /// insert the same documents. Counted into `staged`; the fill counts `pass`'s own.
    fn events_of(
        self,
        bot: &BotId,
        after: PassNumber,
        pass: PassNumber,
        record: &Document,
        staged: &mut Staged,
    ) -> Vec<Document> {
        let (Ok(id), Ok(entries)) = (record.get_str(rf::ID), record.get_array(rf::PENDING)) else {
            return Vec::new();
        };
        let entries: Vec<(i64, &Document)> = entries
            .iter()
            .filter_map(Bson::as_document)
            .filter_map(|e| Some((e.get(pending::PASS).and_then(super::document::integer)?, e)))
            .collect();
        let mut passes: Vec<i64> = entries
            .iter()
            .map(|(p, _)| *p)
            .filter(|p| *p > after.get() && *p <= pass.get())
            .collect();
        passes.sort_unstable();
        passes.dedup();
        let empty = Document::new();
        let data = record.get_document(rf::DATA).unwrap_or(&empty);
        let mut out = Vec::new();
        for q in passes {
            let of_pass: Vec<&Document> = entries
                .iter()
                .filter(|(p, _)| *p == q)
                .map(|(_, e)| *e)
                .collect();
            let Some((kind, mut fields, at)) = fold(&of_pass) else {
                continue;
            };
            if kind == ChangeKind::Added {
                // An insert's entry carries no fields: the record's as it stands, taken back
                // through the changes of the passes after this one.
                let mut then = data.clone();
                for (_, later) in entries.iter().filter(|(p, _)| *p > q).rev() {
                    if let Ok(changed) = later.get_document(pending::FIELDS) {
                        for (name, change) in changed {
                            if let Some(from) = change.as_document().and_then(|c| c.get("from")) {
                                then.insert(name.clone(), from.clone());
                            }
                        }
                    }
                }
                fields = diff(None, &then);
            }
            match kind {
                ChangeKind::Added => staged.added += 1,
                ChangeKind::Changed => staged.changed += 1,
                ChangeKind::Removed => staged.removed += 1,
                ChangeKind::Restored => staged.restored += 1,
            }
            if q == pass.get() && kind != ChangeKind::Removed {
                staged.written += 1;
                for (name, value) in data {
                    let n = staged.filled.entry(name.clone()).or_default();
                    if !matches!(value, Bson::Null) {
                        *n += 1;
                    }
                }
            }
            let q = PassNumber::new(q);
            out.push(doc! {
                f::ID: event_id(bot, id, q), f::BOT: bot.as_str(), f::PASS: q,
                f::RECORD: id, f::NATURAL_KEY: record.get_str(rf::NATURAL_KEY).unwrap_or_default(),
                f::KIND: kind.as_str(), f::FIELDS: fields, f::AT: at,
            });
        }
        out
    }

    /// Inserts `batch` (emptied) numbered from `after + 1`; an event already staged (its `_id`)
    /// keeps its number, one whose number another stager took is numbered again past the
    /// highest. Returns the highest number given, and whether any insert was refused.
    async fn insert_numbered(
        self,
        bot: &BotId,
        batch: &mut Vec<Document>,
        mut after: i64,
    ) -> Result<(i64, bool)> {
        let mut todo = std::mem::take(batch);
        let mut highest = after;
        let mut refused_any = false;
        for _ in 0..5 {
            if todo.is_empty() {
                return Ok((highest, refused_any));
            }
            for event in &mut todo {
                after += 1;
                event.insert(f::SEQ, after);
            }
            let reply = self
                .store
                .command(
                    "stage events",
                    doc! { "insert": CHANGES, "documents": &todo, "ordered": false },
                    None,
                )
                .await?;
            let refused = reply::duplicates("stage events", &reply)?;
            let numbered: Vec<i64> = (0..todo.len())
                .filter(|i| !refused.contains(i))
                .filter_map(|i| todo[i].get_i64(f::SEQ).ok())
                .collect();
            highest = highest.max(numbered.into_iter().max().unwrap_or(highest));
            if refused.is_empty() {
                return Ok((highest, refused_any));
            }
            refused_any = true;
            // Refused: staged before (a repeated staging) or a number taken. Only the latter go again.
            let ids: Vec<&str> = refused
                .iter()
                .filter_map(|i| todo[*i].get_str(f::ID).ok())
                .collect();
            let present = self
                .store
                .find_once(
                    "read staged events",
                    CHANGES,
                    doc! { f::ID: { "$in": &ids }, f::BOT: bot.as_str() },
                    doc! { f::ID: 1 },
                    ids.len(),
                    None,
                )
                .await?;
            let present: std::collections::HashSet<&str> = present
                .iter()
                .filter_map(|d| d.get_str(f::ID).ok())
                .collect();
            let again: Vec<Document> = refused
                .iter()
                .map(|i| todo[*i].clone())
                .filter(|e| !e.get_str(f::ID).is_ok_and(|id| present.contains(id)))
                .collect();
            todo = again;
            after = self.highest_seq(bot, None).await?;
        }
        Err(Error::Protocol {
            what: "stage events",
            detail: "event numbers kept being taken by another instance".into(),
        })
    }

    /// Deletes pass `pass`'s staged events (a discarded gated pass).
    pub(crate) async fn delete_pass(self, bot: &BotId, pass: PassNumber) -> Result<u64> {
        let collection = self.collection();
        let delete = collection.delete_many(doc! { f::BOT: bot.as_str(), f::PASS: pass });
        Ok(self
            .store
            .bounded("delete a pass's events", delete)
            .await?
            .deleted_count)
    }

    /// The record ids of pass `pass`'s staged removals.
    pub(crate) async fn removed_in(self, bot: &BotId, pass: PassNumber) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        let collection = self.collection();
        let find = collection
            .find(
                doc! { f::BOT: bot.as_str(), f::PASS: pass, f::KIND: ChangeKind::Removed.as_str() },
            )
            .projection(doc! { f::RECORD: 1 })
            .batch_size(1000);
        self.store
            .each_doc("read held removals", find, |e| {
                ids.extend(e.get_str(f::RECORD).ok().map(str::to_owned));
                Ok(())
            })
            .await?;
        Ok(ids)
    }

    /// Deletes pass `pass`'s staged removal events of `records` (removals a release could not
    /// apply: the records were written again since).
    pub(crate) async fn delete_removals(
        self,
        bot: &BotId,
        pass: PassNumber,
        records: &[String],
    ) -> Result<()> {
        for chunk in records.chunks(super::frontier::IN_CHUNK) {
            let collection = self.collection();
            let delete = collection.delete_many(doc! {
                f::BOT: bot.as_str(), f::PASS: pass, f::RECORD: { "$in": chunk },
            });
            self.store
                .bounded("drop unapplied removals", delete)
                .await?;
        }
        Ok(())
    }

    /// At most `limit` released events of the bot after `after` (by `seq`), up to the released
    /// watermark `upto`, in order.
    pub async fn read(
        self,
        bot: &BotId,
        after: i64,
        upto: i64,
        limit: usize,
    ) -> Result<Vec<Event>> {
        if after >= upto {
            return Ok(Vec::new());
        }
        let find = doc! {
            "find": CHANGES,
            "filter": { f::BOT: bot.as_str(), f::SEQ: { "$gt": after, "$lte": upto } },
            "sort": { f::BOT: 1, f::SEQ: 1 },
            "limit": i64::try_from(limit).unwrap_or(i64::MAX),
            "batchSize": i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX),
            "singleBatch": true,
        };
        let reply = self.store.command("read events", find, None).await?;
        Ok(reply
            .get_document("cursor")
            .and_then(|c| c.get_array("firstBatch"))
            .map(|a| a.iter().filter_map(|d| d.as_document().cloned()).collect())
            .unwrap_or_default())
    }

    /// The `seq` just before pass `pass`'s first released event (or of the first pass after
    /// it): where `--since-pass` starts.
    pub async fn seq_before_pass(self, bot: &BotId, pass: PassNumber) -> Result<i64> {
        let collection = self.collection();
        let read = collection
            .find_one(doc! { f::BOT: bot.as_str(), f::PASS: { "$gte": pass } })
            .sort(doc! { f::BOT: 1, f::PASS: 1, f::SEQ: 1 })
            .projection(doc! { f::SEQ: 1 });
        Ok(self
            .store
            .bounded("read a pass's first event", read)
            .await?
            .and_then(|d| d.get(f::SEQ).and_then(super::document::integer))
            .map_or(i64::MAX, |s| s - 1))
    }

    /// How many events the bot has staged and not released (`after`: its watermark).
    pub async fn unreleased(self, bot: &BotId, after: i64) -> Result<u64> {
        let collection = self.collection();
        self.store
            .bounded(
                "count unreleased events",
                collection.count_documents(doc! { f::BOT: bot.as_str(), f::SEQ: { "$gt": after } }),
            )
            .await
    }
}

/// A wake-up for a reader waiting for a bot's next release: a change stream on the bot's
/// document, or — where the server has none — nothing (the reader polls).
pub struct FeedWakeups {
    stream: Option<
        mongodb::change_stream::ChangeStream<
            mongodb::change_stream::event::ChangeStreamEvent<Document>,
        >,
    >,
}

impl FeedWakeups {
    /// Waits until the bot's document changes, at most `poll` (then the caller reads again).
    pub async fn next(&mut self, poll: std::time::Duration) {
        use futures_util::StreamExt;
        match &mut self.stream {
            Some(stream) => {
                if let Ok(None | Some(Err(_))) = tokio::time::timeout(poll, stream.next()).await {
                    // The stream ended or failed: poll from now on.
                    self.stream = None;
                    tokio::time::sleep(poll).await;
                }
            }
            None => tokio::time::sleep(poll).await,
        }
    }

    /// Whether a change stream carries the wake-ups (false: polling).
    pub fn streams(&self) -> bool {
        self.stream.is_some()
    }
}

impl Changes<'_> {
    /// The bot's released watermark and last released pass (`crawlFeed.seq`, `.pass`).
    pub async fn watermark(self, bot: &BotId) -> Result<Option<(i64, i64)>> {
        let read = self
            .store
            .bots
            .find_one(doc! { super::document::field::ID: bot.as_str() })
            .projection(doc! { super::release::FEED: 1 });
        let doc = self.store.bounded("read the feed", read).await?;
        Ok(doc.map(|d| {
            let feed = d.get_document(super::release::FEED).ok();
            let get = |k: &str| {
                feed.and_then(|f| f.get(k))
                    .and_then(super::document::integer)
                    .unwrap_or(0)
            };
            (
                get(super::release::feed::SEQ),
                get(super::release::feed::PASS),
            )
        }))
    }

    /// Wake-ups on the bot's document changing: a change stream when the server offers one.
    pub async fn wakeups(self, bot: &BotId) -> FeedWakeups {
        let bots = self.store.database().collection::<Document>("bots");
        let watch = bots.watch().pipeline([doc! { "$match": {
            "documentKey._id": bot.as_str(), "operationType": { "$in": ["update", "replace"] },
        } }]);
        let stream = self.store.bounded("watch the feed", watch).await.ok();
        FeedWakeups { stream }
    }
}

/// Where each bot's webhook deliveries stand (collection `notifiers`, one document per bot):
/// `seq` (every event up to it was delivered), `by` and `until` (the instance that delivers,
/// until when), `failures` (in a row), `lastError`, `deliveredAt`. Kept apart from the bot
/// document, whose every write wakes the bot's runners.
pub(crate) const NOTIFIERS: &str = "notifiers";

/// What a claimed notifier knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notifier {
    /// Every event up to this `seq` was delivered.
    pub seq: i64,
    /// Failed deliveries in a row.
    pub failures: u32,
}

impl Changes<'_> {
    fn notifiers(self) -> mongodb::Collection<Document> {
        self.store.database().collection(NOTIFIERS)
    }

    /// Claims (or keeps) the delivery of the bot's events for `me` until `now + hold`: one
    /// instance delivers at a time, and another takes over once the claim ran out. `None` while
    /// another instance holds it.
    pub async fn claim_notifier(
        self,
        bot: &BotId,
        me: &str,
        now: DateTime<Utc>,
        hold: std::time::Duration,
    ) -> Result<Option<Notifier>> {
        let until = date(super::plus(now, hold));
        let notifiers = self.notifiers();
        let claim = notifiers
            .find_one_and_update(
                doc! { "_id": bot.as_str(), "$or": [ { "until": { "$lt": date(now) } }, { "by": me } ] },
                doc! {
                    "$set": { "by": me, "until": until },
                    "$setOnInsert": { "seq": 0_i64, "failures": 0_i64 },
                },
            )
            .upsert(true)
            .return_document(mongodb::options::ReturnDocument::After);
        match self.store.bounded("claim the notifier", claim).await {
            Ok(Some(d)) => Ok(Some(Notifier {
                seq: d.get("seq").and_then(super::document::integer).unwrap_or(0),
                failures: d
                    .get("failures")
                    .and_then(super::document::integer)
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(0),
            })),
            Ok(None) => Ok(None),
            // Held by another instance: the upsert met its document.
            Err(Error::Db(e)) if crate::error::is_duplicate_key(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Records a delivery of the events after `from` up to `to` by `me` (conditional on its
    /// claim and on the position read): false when the claim was lost meanwhile.
    pub async fn delivered(
        self,
        bot: &BotId,
        me: &str,
        from: i64,
        to: i64,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let notifiers = self.notifiers();
        let update = notifiers.update_one(
            doc! { "_id": bot.as_str(), "by": me, "seq": from },
            doc! { "$set": { "seq": to, "failures": 0_i64, "lastError": Bson::Null, "deliveredAt": date(now) } },
        );
        Ok(self
            .store
            .bounded("record a delivery", update)
            .await?
            .modified_count
            == 1)
    }

    /// Records a failed delivery by `me`.
    pub async fn delivery_failed(self, bot: &BotId, me: &str, error: &str) -> Result<()> {
        let notifiers = self.notifiers();
        let update = notifiers.update_one(
            doc! { "_id": bot.as_str(), "by": me },
            doc! { "$inc": { "failures": 1_i64 }, "$set": { "lastError": error } },
        );
        self.store
            .bounded("record a failed delivery", update)
            .await?;
        Ok(())
    }

    /// Gives the claim up (a clean stop): another instance may deliver at once.
    pub async fn release_notifier(self, bot: &BotId, me: &str) -> Result<()> {
        let notifiers = self.notifiers();
        let update = notifiers.update_one(
            doc! { "_id": bot.as_str(), "by": me },
            doc! { "$set": { "until": date(DateTime::<Utc>::UNIX_EPOCH) } },
        );
        self.store.bounded("release the notifier", update).await?;
        Ok(())
    }

    /// The next delivery after `after`: the released events of one pass, at most `limit`.
    pub async fn next_delivery(
        self,
        bot: &BotId,
        after: i64,
        upto: i64,
        limit: usize,
    ) -> Result<Vec<Event>> {
        let mut events = self.read(bot, after, upto, limit).await?;
        let pass = events.first().and_then(|e| e.get(f::PASS).cloned());
        events.retain(|e| e.get(f::PASS).cloned() == pass);
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: ChangeKind, fields: Document) -> Document {
        pending_event(PassNumber::new(3), kind, fields, Utc::now())
    }

    #[test]
    fn a_diff_names_each_changed_field_with_its_old_and_new_value() {
        let old = doc! { "price": 10, "name": "a", "gone": "x" };
        let new = doc! { "price": 12, "name": "a", "color": "red" };
        let d = diff(Some(&old), &new);
        assert_eq!(
            d.get_document("price").unwrap(),
            &doc! { "from": 10, "to": 12 }
        );
        assert_eq!(
            d.get_document("color").unwrap(),
            &doc! { "from": Bson::Null, "to": "red" }
        );
        assert_eq!(
            d.get_document("gone").unwrap(),
            &doc! { "from": "x", "to": Bson::Null }
        );
        assert!(!d.contains_key("name"));
        let added = diff(None, &new);
        assert_eq!(added.len(), 3);
    }

    #[test]
    fn one_pass_of_events_folds_into_what_the_pass_did_to_the_record() {
        let added = event(
            ChangeKind::Added,
            doc! { "p": { "from": Bson::Null, "to": 1 } },
        );
        let changed = event(ChangeKind::Changed, doc! { "p": { "from": 1, "to": 2 } });
        let back = event(ChangeKind::Changed, doc! { "p": { "from": 2, "to": 1 } });
        let removed = event(ChangeKind::Removed, doc! {});
        let restored = event(ChangeKind::Restored, doc! {});
        let (kind, fields, _) = fold(&[&added, &changed]).unwrap();
        assert_eq!(kind, ChangeKind::Added);
        assert_eq!(
            fields.get_document("p").unwrap(),
            &doc! { "from": Bson::Null, "to": 2 }
        );
        assert_eq!(fold(&[&added, &removed]), None);
        assert_eq!(
            fold(&[&changed, &back]),
            None,
            "changed and back is no change"
        );
        assert_eq!(fold(&[&changed, &removed]).unwrap().0, ChangeKind::Removed);
        assert_eq!(fold(&[&restored]).unwrap().0, ChangeKind::Restored);
        assert_eq!(fold(&[&removed, &restored]), None);
        // Live before and after, whatever happened between: changed.
        assert_eq!(
            fold(&[&changed, &removed, &restored]).unwrap().0,
            ChangeKind::Changed
        );
        assert_eq!(fold(&[&restored, &removed]), None);
        assert_eq!(fold(&[]), None);
    }
}
