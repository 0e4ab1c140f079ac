//! Records (collection `records`): one document per item, `_id` = a hash of (source, natural key)
//! — never the URL, never an auto id — so a repeated write is an update, not a duplicate.
//!
//! A record is rewritten only when its content hash changes (`lastChanged` keeps its meaning).
//! A fetched page whose content is unchanged costs one small `$set` (`lastSeenPass`, `lastSeen`,
//! `fetchedAt`) in the same commit; items a pass sees without fetching them (listing pages, in
//! fingerprint mode) are marked in batches ([`Store::mark_seen`]).
//!
//! [`Store::commit_page`] stores a page's record and marks its URL done **together**: in one
//! transaction where the server has them, or else record first (guarded by the lease time, so a
//! stale worker cannot overwrite a newer result), then the fenced done mark. Either way a crash at
//! any line leaves exactly one correct record per item: at worst the URL is fetched again and the
//! record rewritten with the same content, which is a no-op.

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::options::IndexOptions;
use mongodb::{ClientSession, Collection, IndexModel};

use super::frontier::UrlLease;
use super::Store;
use crate::error::{is_duplicate_key, Error, Result};
use crate::ids::BotId;

pub const RECORDS: &str = "records";

/// Runs a driver action inside `session` when there is one (the transaction path), plainly
/// otherwise.
macro_rules! in_session {
    ($action:expr, $session:expr) => {
        match $session.as_deref_mut() {
            Some(s) => $action.session(s).await,
            None => $action.await,
        }
    };
}

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
}

/// What storing a record did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordWrite {
    Inserted,
    Changed,
    /// Same content as stored: not rewritten, only marked seen in this pass.
    Unchanged,
    /// A newer result (a later lease of the same URL) is already stored: nothing written.
    Superseded,
}

impl Store {
    pub(super) fn records(&self) -> Collection<Document> {
        self.database().collection(RECORDS)
    }

    /// Creates the records' indexes (idempotent): deletion detection scans by bot and pass.
    pub async fn ensure_record_indexes(&self) -> Result<()> {
        let index = IndexModel::builder()
            .keys(doc! { "botId": 1, "lastSeenPass": 1 })
            .options(
                IndexOptions::builder()
                    .name("bot_last_seen_pass".to_owned())
                    .build(),
            )
            .build();
        self.index_build("create records index", self.records().create_index(index))
            .await?;
        Ok(())
    }

    /// Stores the page's record (if any) and marks its URL done, together. `transaction` chooses
    /// the path (see the module comment). `UrlLeaseLost` when the lease went to another worker:
    /// then nothing of this page was kept on the transaction path, and on the other path only a
    /// record the newer worker's result supersedes.
    pub async fn commit_page(
        &self,
        lease: &UrlLease,
        record: Option<&Extracted>,
        now: DateTime<Utc>,
        transaction: bool,
    ) -> Result<Option<RecordWrite>> {
        let record_id = record.map(|r| record_id(r.bot.as_str(), &r.natural_key));
        let done = Self::done_update(lease, record_id.as_deref(), now);
        if transaction {
            if let Some(result) = self.commit_in_transaction(lease, record, &done, now).await {
                return result;
            }
            // The transaction kept conflicting — with one a killed process left open, say, which
            // the server ends only at its transaction lifetime limit. The ordered path gives the
            // same guarantee without waiting for it, and keeps the page already fetched.
            tracing::warn!(url = %lease.url, "transactions keep conflicting; committing this page in order instead");
        }
        let write = match record {
            Some(r) => Some(self.upsert_record(r, lease, now, None).await?),
            None => None,
        };
        self.fenced_url(lease, "complete url", done).await?;
        Ok(write)
    }

    /// The transaction path of [`Store::commit_page`]; `None` when it conflicted on every attempt.
    async fn commit_in_transaction(
        &self,
        lease: &UrlLease,
        record: Option<&Extracted>,
        done: &Document,
        now: DateTime<Utc>,
    ) -> Option<Result<Option<RecordWrite>>> {
        // A transaction that fails with a transient label is retried from the start, a few times.
        for attempt in 1..=5 {
            let mut session = match self
                .bounded("start session", self.database().client().start_session())
                .await
            {
                Ok(session) => session,
                Err(e) => return Some(Err(e)),
            };
            if let Err(e) = self
                .bounded("start transaction", session.start_transaction())
                .await
            {
                return Some(Err(e));
            }
            // The record first, the fenced done mark last: when the fence matches nothing the
            // transaction is aborted and the record write rolls back with it.
            let result = async {
                let write = match record {
                    Some(r) => Some(
                        self.upsert_record(r, lease, now, Some(&mut session))
                            .await?,
                    ),
                    None => None,
                };
                let fenced = self
                    .frontier()
                    .update_one(Self::lease_fence(lease), done.clone())
                    .session(&mut session)
                    .await?;
                if fenced.matched_count != 1 {
                    return Err(Error::UrlLeaseLost {
                        url: lease.url.to_string(),
                    });
                }
                // A commit whose outcome is unknown (a network blip) is retried as it is: the
                // server applies a transaction's commit at most once.
                let mut unknown = 0;
                loop {
                    match session.commit_transaction().await {
                        Ok(()) => break,
                        Err(e)
                            if e.contains_label("UnknownTransactionCommitResult")
                                && unknown < 3 =>
                        {
                            unknown += 1;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(write)
            };
            let result = self.bounded_result("commit page", result).await;
            if result.is_err() {
                // Best effort: the server also aborts a transaction whose session goes away.
                let _ = tokio::time::timeout(self.op_timeout, session.abort_transaction()).await;
            }
            match result {
                Err(Error::Db(e)) if e.contains_label("TransientTransactionError") => {
                    // Another transaction holds a document this one writes: back off a little.
                    tokio::time::sleep(crate::backoff::full_jitter(
                        std::time::Duration::from_millis(10),
                        std::time::Duration::from_millis(500),
                        attempt,
                    ))
                    .await;
                }
                other => return Some(other),
            }
        }
        None
    }

    /// Runs a multi-step future under the operation timeout.
    async fn bounded_result<T>(
        &self,
        what: &'static str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.op_timeout * 3, work).await {
            Ok(result) => result,
            Err(_) => Err(Error::Timeout {
                what,
                after: self.op_timeout * 3,
            }),
        }
    }

    /// Inserts, changes or leaves a record, guarded so a result from an older lease never
    /// replaces one from a newer lease (`fetchedAt` is the lease time).
    async fn upsert_record(
        &self,
        record: &Extracted,
        lease: &UrlLease,
        now: DateTime<Utc>,
        mut session: Option<&mut ClientSession>,
    ) -> Result<RecordWrite> {
        let id = record_id(record.bot.as_str(), &record.natural_key);
        let hash = content_hash(&record.data);
        let fetched_at = Bson::DateTime(bson::DateTime::from_chrono(lease.leased_at));
        let now_b = Bson::DateTime(bson::DateTime::from_chrono(now));
        let records = self.records();
        for _ in 0..5 {
            let find = records.find_one(doc! { "_id": &id });
            let existing = in_session!(find, session)?;
            match existing {
                None => {
                    let full = doc! {
                        "_id": &id, "botId": record.bot.as_str(), "naturalKey": &record.natural_key,
                        "url": lease.url.as_str(), "data": record.data.clone(), "contentHash": &hash,
                        "firstSeen": now_b.clone(), "lastChanged": now_b.clone(), "lastSeen": now_b.clone(),
                        "lastSeenPass": lease.pass, "removedAt": Bson::Null, "fetchedAt": fetched_at.clone(),
                    };
                    let insert = records.insert_one(full);
                    let inserted = in_session!(insert, session);
                    match inserted {
                        Ok(_) => return Ok(RecordWrite::Inserted),
                        // Another worker inserted it first: read it and decide again.
                        Err(e) if is_duplicate_key(&e) && session.is_none() => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                Some(old) => {
                    let old_hash = old.get_str("contentHash").unwrap_or_default().to_owned();
                    let newer_stored = matches!(old.get("fetchedAt"), Some(Bson::DateTime(t)) if t.to_chrono() > lease.leased_at);
                    if newer_stored {
                        return Ok(RecordWrite::Superseded);
                    }
                    // Compare-and-swap on the version read: its hash and its `fetchedAt`
                    // (equalities only, which every server answers from the `_id` lookup).
                    let read_at = old.get("fetchedAt").cloned().unwrap_or(Bson::Null);
                    let guard = doc! { "fetchedAt": read_at.clone() };
                    if old_hash == hash
                        && old.get("removedAt").is_none_or(|v| matches!(v, Bson::Null))
                    {
                        // Same content: no rewrite, but record that this pass saw it (deletion
                        // detection) and move `fetchedAt` on, so an older lease cannot write over it.
                        let mut filter = doc! { "_id": &id, "contentHash": &hash };
                        filter.extend(guard.clone());
                        // `$max`: a late commit from an older pass never moves `lastSeenPass` back.
                        let seen = doc! {
                            "$set": { "fetchedAt": fetched_at.clone(), "lastSeen": now_b.clone() },
                            "$max": { "lastSeenPass": lease.pass },
                        };
                        let update = records.update_one(filter, seen);
                        let result = in_session!(update, session)?;
                        if result.matched_count == 1 {
                            return Ok(RecordWrite::Unchanged);
                        }
                        continue;
                    }
                    let filter = doc! {
                        "_id": &id, "contentHash": &old_hash,
                        "fetchedAt": read_at,
                    };
                    let changed = old_hash != hash;
                    let mut set = doc! {
                        "url": lease.url.as_str(), "data": record.data.clone(), "contentHash": &hash,
                        "lastSeen": now_b.clone(), "removedAt": Bson::Null,
                        "fetchedAt": fetched_at.clone(),
                    };
                    if changed {
                        set.insert("lastChanged", now_b.clone());
                    }
                    let update = records.update_one(
                        filter,
                        doc! { "$set": set, "$max": { "lastSeenPass": lease.pass } },
                    );
                    let result = in_session!(update, session)?;
                    if result.matched_count == 1 {
                        return Ok(if changed {
                            RecordWrite::Changed
                        } else {
                            RecordWrite::Unchanged
                        });
                    }
                    // The record changed between our read and our write: decide again.
                }
            }
        }
        Err(Error::Protocol {
            what: "store record",
            detail: format!("record {id} kept changing under concurrent writers"),
        })
    }

    /// Whether the server runs multi-document transactions (`crawl.transactions = "auto"`): one
    /// empty transaction, aborted. A transient failure is an error, not a "no".
    pub async fn supports_transactions(&self) -> Result<bool> {
        let probe = async {
            let mut session = self.database().client().start_session().await?;
            session.start_transaction().await?;
            self.records()
                .find_one(doc! { "_id": "__seedlock_probe" })
                .session(&mut session)
                .await?;
            session.abort_transaction().await
        };
        match self.bounded("probe transactions", probe).await {
            Ok(()) => Ok(true),
            Err(e) if e.is_transient() => Err(e),
            Err(_) => Ok(false),
        }
    }

    /// Marks records seen in `pass` in one write (unchanged records get no other write).
    pub async fn mark_seen(&self, ids: &[String], pass: i64, now: DateTime<Utc>) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let records = self.records();
        let update = records.update_many(
            doc! { "_id": { "$in": ids }, "lastSeenPass": { "$lt": pass } },
            doc! { "$set": { "lastSeenPass": pass, "lastSeen": Bson::DateTime(bson::DateTime::from_chrono(now)) } },
        );
        Ok(self.bounded("mark seen", update).await?.modified_count)
    }
}
