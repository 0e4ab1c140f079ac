//! Bot definitions kept in the database (`spec`, `specVersion`, `specUpdatedAt` in each `bots`
//! document), the operator's pause (`paused`, `pausedBy`, `pausedAt`, `pauseReason`), removing a
//! bot (and purging its frontier and records), and the records' export cursor.

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;

use super::{highest_epoch, history_entry, initial_fields, push_history, Store};
use crate::error::{Error, Result};
use crate::ids::BotId;
use crate::store::document::field;

/// What `bots apply` did (or, with `--dry-run`, would do) to one bot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    Created,
    /// The changed keys, dotted (`crawl.list.item`).
    Changed(Vec<String>),
    Unchanged,
}

/// The dotted paths at which two specs differ.
pub fn changed_keys(old: &Document, new: &Document) -> Vec<String> {
    fn walk(prefix: &str, old: Option<&Bson>, new: Option<&Bson>, out: &mut Vec<String>) {
        match (old, new) {
            (Some(Bson::Document(a)), Some(Bson::Document(b))) => {
                let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
                for k in keys {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&path, a.get(k), b.get(k), out);
                }
            }
            (a, b) if a == b => {}
            _ => out.push(prefix.to_owned()),
        }
    }
    let mut out = Vec::new();
    walk(
        "",
        Some(&Bson::Document(old.clone())),
        Some(&Bson::Document(new.clone())),
        &mut out,
    );
    out
}

/// A pause as `pause` writes it.
pub struct Pause<'a> {
    pub by: &'a str,
    pub reason: &'a str,
}

impl Store {
    /// Writes `spec` as `bot`'s definition unless it is already the stored one: a new bot gets its
    /// document, a changed spec a raised `specVersion` (conditional on the version read, so two
    /// concurrent applies cannot both win) and a refresh request — the new spec starts with the
    /// bot's next pass; the running pass ends on the spec it started with. `dry_run` writes nothing.
    pub async fn apply_spec(
        &self,
        bot: &BotId,
        spec: &Document,
        by: &str,
        now: DateTime<Utc>,
        dry_run: bool,
    ) -> Result<Applied> {
        let current = self.load_raw(bot).await?;
        let (applied, version) = match &current {
            None => (Applied::Created, None),
            Some(raw) => match (
                raw.get(field::SPEC),
                raw.get(field::SPEC_VERSION)
                    .and_then(crate::store::document::integer),
            ) {
                (Some(Bson::Document(old)), _) if old == spec => return Ok(Applied::Unchanged),
                (Some(Bson::Document(old)), Some(v)) => {
                    (Applied::Changed(changed_keys(old, spec)), Some(v))
                }
                // Hand-edited into something that is no document: the file's spec replaces it.
                (Some(_), Some(v)) => (Applied::Changed(vec![field::SPEC.to_owned()]), Some(v)),
                // A bot that ran from a config file: the database now defines it.
                _ => (Applied::Created, None),
            },
        };
        if dry_run {
            return Ok(applied);
        }
        let reason = match &applied {
            Applied::Changed(keys) => format!("spec changed: {}", keys.join(", ")),
            _ => "spec applied".to_owned(),
        };
        let epoch = current
            .as_ref()
            .map_or(crate::ids::LockEpoch::ZERO, highest_epoch);
        let entry = history_entry(now, "spec", by, epoch, &reason);
        let mut set = doc! { field::SPEC: spec.clone(), field::SPEC_ERROR: Bson::Null };
        let result = match (&current, version) {
            (None, _) => {
                let mut initial = initial_fields(now, by, "spec applied");
                initial.insert(field::SPEC_VERSION, 1_i64);
                set.remove(field::SPEC_ERROR);
                initial.insert(field::SPEC_ERROR, Bson::Null);
                // Conditional on the document still having no spec: of two applies creating the
                // bot at once, the second's upsert meets the first's document and fails.
                match self
                    .bounded(
                        "create bot",
                        self.bots
                            .update_one(
                                doc! { field::ID: bot.as_str(), field::SPEC: { "$exists": false } },
                                doc! { "$setOnInsert": initial, "$set": set, "$currentDate": { field::SPEC_UPDATED_AT: true } },
                            )
                            .upsert(true),
                    )
                    .await
                {
                    Err(Error::Db(e)) if super::is_duplicate_key(&e) => {
                        return Err(Error::Invalid(format!(
                            "bot {bot}: created by another apply meanwhile; run this one again"
                        )))
                    }
                    other => other?,
                }
            }
            (Some(raw), None) => {
                set.insert(field::SPEC_VERSION, 1_i64);
                // Conditional on the version field as read (absent, or not a number).
                let unchanged = raw
                    .get(field::SPEC_VERSION)
                    .cloned()
                    .unwrap_or_else(|| Bson::Document(doc! { "$exists": false }));
                self.bounded(
                    "adopt bot",
                    self.bots.update_one(
                        doc! { field::ID: bot.as_str(), field::SPEC_VERSION: unchanged },
                        doc! { "$set": set, "$currentDate": { field::SPEC_UPDATED_AT: true }, "$push": push_history(entry) },
                    ),
                )
                .await?
            }
            (Some(_), Some(v)) => {
                self.bounded(
                    "change spec",
                    self.bots.update_one(
                        doc! { field::ID: bot.as_str(), field::SPEC_VERSION: v },
                        doc! {
                            "$set": set,
                            "$inc": { field::SPEC_VERSION: 1_i64 },
                            "$currentDate": { field::SPEC_UPDATED_AT: true, field::REFRESH_REQUESTED_AT: true },
                            "$push": push_history(entry),
                        },
                    ),
                )
                .await?
            }
        };
        if result.matched_count == 0 && result.upserted_id.is_none() {
            return Err(Error::Invalid(format!(
                "bot {bot}: its spec changed while this apply ran; run it again"
            )));
        }
        Ok(applied)
    }

    /// Every bot document that carries a spec, by id: its `_id`, `spec`, `specVersion` and
    /// `specError` only (not its seeds and history).
    pub async fn spec_documents(&self) -> Result<Vec<Document>> {
        let all = async {
            let cursor = self
                .bots
                .find(doc! { field::SPEC: { "$exists": true } })
                .projection(doc! { field::SPEC: 1, field::SPEC_VERSION: 1, field::SPEC_ERROR: 1 })
                .sort(doc! { field::ID: 1 })
                .await?;
            cursor.try_collect().await
        };
        self.bounded("list bot specs", all).await
    }

    /// Records why the instances cannot run the spec at `version` (only while it is the current
    /// one, so a fixed spec is never marked): the bot shows Error with `lastError` naming the key.
    pub async fn mark_spec_error(&self, bot: &BotId, version: i64, error: &str) -> Result<()> {
        let text = format!("bad spec (specVersion {version}): {error}");
        self.bounded(
            "mark spec error",
            self.bots.update_one(
                doc! { field::ID: bot.as_str(), field::SPEC_VERSION: version, field::SPEC_ERROR: { "$ne": &text } },
                doc! { "$set": { field::SPEC_ERROR: &text, field::LAST_ERROR: &text } },
            ),
        )
        .await?;
        Ok(())
    }

    /// Clears a spec error once the spec at `version` runs.
    pub async fn clear_spec_error(&self, bot: &BotId, version: i64) -> Result<()> {
        self.bounded(
            "clear spec error",
            self.bots.update_one(
                doc! { field::ID: bot.as_str(), field::SPEC_VERSION: version, field::SPEC_ERROR: { "$type": "string" } },
                doc! { "$set": { field::SPEC_ERROR: Bson::Null, field::LAST_ERROR: Bson::Null } },
            ),
        )
        .await?;
        Ok(())
    }

    /// `pause` (with `Some`) or `resume`; false if there is no such bot.
    pub async fn set_paused(
        &self,
        bot: &BotId,
        pause: Option<Pause<'_>>,
        by: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let Some(raw) = self.load_raw(bot).await? else {
            return Ok(false);
        };
        let epoch = highest_epoch(&raw);
        let update = match pause {
            Some(p) => doc! {
                "$set": { field::PAUSED: true, field::PAUSED_BY: p.by, field::PAUSE_REASON: p.reason },
                "$currentDate": { field::PAUSED_AT: true },
                "$push": push_history(history_entry(now, "paused", by, epoch, p.reason)),
            },
            None => doc! {
                "$set": { field::PAUSED: false, field::PAUSED_BY: Bson::Null, field::PAUSE_REASON: Bson::Null, field::PAUSED_AT: Bson::Null },
                "$push": push_history(history_entry(now, "resumed", by, epoch, "resumed")),
            },
        };
        let result = self
            .bounded(
                "pause or resume",
                self.bots
                    .update_one(doc! { field::ID: bot.as_str() }, update),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// Deletes the bot's document: every instance running it from the database stops it within
    /// one poll. False if there was none.
    pub async fn remove_bot(&self, bot: &BotId) -> Result<bool> {
        let result = self
            .bounded(
                "remove bot",
                self.bots.delete_one(doc! { field::ID: bot.as_str() }),
            )
            .await?;
        Ok(result.deleted_count == 1)
    }

    /// URLs of the bot leased by anyone whose lease has not run out.
    pub async fn live_leases(&self, bot: &BotId, now: DateTime<Utc>) -> Result<u64> {
        use super::frontier::field as fr;
        self.bounded(
            "count live leases",
            self.frontier().count_documents(doc! {
                fr::BOT: bot.as_str(),
                fr::STATUS: "leased",
                fr::LEASE_EXPIRES_AT: { "$gt": super::date(now) },
            }),
        )
        .await
    }

    /// Deletes the bot's frontier and records; returns how many of each.
    pub async fn purge_bot(&self, bot: &BotId) -> Result<(u64, u64)> {
        let frontier = self
            .bounded(
                "purge frontier",
                self.frontier()
                    .delete_many(doc! { super::frontier::field::BOT: bot.as_str() }),
            )
            .await?
            .deleted_count;
        let records = self
            .bounded(
                "purge records",
                self.records()
                    .delete_many(doc! { super::records::field::BOT: bot.as_str() }),
            )
            .await?
            .deleted_count;
        Ok((frontier, records))
    }

    /// The bot's records for `export`, in `_id` order, a batch at a time (constant memory):
    /// those changed since `changed_since`, and removed ones only with `include_removed`. The
    /// find and each further batch are bounded by the operation timeout: a server that stops
    /// answering mid-export is an error, not a hang.
    pub async fn export_records(
        &self,
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
            .bounded(
                "export records",
                self.records().find(filter).batch_size(1000),
            )
            .await?;
        Ok(ExportRecords {
            store: self.clone(),
            cursor,
        })
    }
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
