//! The `bots` collection: the lock documents this wing's state machine runs over (claimed,
//! heartbeaten, completed, released, repaired), the bot definitions kept in them (`spec`,
//! `specVersion`, `specUpdatedAt`), the operator's pause (`paused`, `pausedBy`, `pausedAt`,
//! `pauseReason`), and the change stream an instance watches them by.

use crate::ids::PassNumber;
use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;
use mongodb::options::ReturnDocument;

use std::time::Duration;

use super::{date, indexes, plus, Store, BOTS};
use crate::error::{is_duplicate_key, Error, Result};
use crate::ids::{BotId, InstanceId, LockEpoch};
use crate::lock::bot::{Observed, PassSpec};
use crate::lock::state::Claim;
use crate::store::document::{field, integer, HISTORY_LEN};

/// A lock this process holds: the fence for every write it makes while refreshing.
#[derive(Clone, Debug)]
pub struct EditLock {
    pub bot: BotId,
    pub me: InstanceId,
    pub epoch: LockEpoch,
    /// `lastUpdateStartedAt` as the server set it: `max_refresh` counts from here.
    pub started_at: DateTime<Utc>,
    /// The seeds before this refresh (kept on failure with `keep_previous`).
    pub previous_seeds: Vec<String>,
    /// Consecutive failed refreshes before this one (sizes the shared backoff on failure).
    pub failed_refreshes: i64,
    /// The bot's crawl pass when the lock was taken: a successful refresh starts the next one.
    pub crawl_pass: PassNumber,
    /// When that pass started, if it was still running (its end not recorded).
    pub crawl_pass_running_since: Option<DateTime<Utc>>,
}

impl EditLock {
    fn fence(&self) -> Document {
        doc! {
            field::ID: self.bot.as_str(),
            field::IS_EDITING: true,
            field::EDITING_BY: self.me.as_str(),
            field::LOCK_EPOCH: self.epoch.get(),
        }
    }
}

/// What a successful refresh does to a crawling bot's passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextPass {
    /// Not a crawling bot.
    None,
    /// Start this pass now (its seeds are enqueued).
    Start(PassNumber),
    /// The current pass runs: the next starts when it ends, on the seeds stored now.
    AfterCurrent,
}

/// What `seedlock unlock` found.
#[derive(Debug, PartialEq)]
pub enum UnlockOutcome {
    Unlocked {
        holder: Option<String>,
        /// `lockEpoch` as the document showed it: raw, since the document unlocked may be malformed.
        old_epoch: Option<i64>,
    },
    NotLocked,
    NoSuchBot,
}

/// What `bots apply` did (or, with `--dry-run`, would do) to one bot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Applied {
    Created,
    /// The changed keys, dotted (`crawl.list.item`).
    Changed(Vec<String>),
    Unchanged,
}

/// The dotted paths at which two specs differ.
pub(crate) fn changed_keys(old: &Document, new: &Document) -> Vec<String> {
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
pub(crate) struct Pause<'a> {
    pub by: &'a str,
    pub reason: &'a str,
}

/// The `bots` collection, reached through [`Store::bots`].
#[derive(Clone, Copy, Debug)]
pub struct Bots<'a> {
    pub(super) store: &'a Store,
}

impl Bots<'_> {
    pub async fn load(self, bot: &BotId) -> Result<Observed> {
        Ok(crate::store::document::observe(self.load_raw(bot).await?))
    }

    pub(crate) async fn load_raw(self, bot: &BotId) -> Result<Option<Document>> {
        self.store
            .bounded(
                "find bot",
                self.store.bots.find_one(doc! { field::ID: bot.as_str() }),
            )
            .await
    }

    /// The bots' state index (idempotent; rebuilt if its definition changed): an operator's
    /// reads of bots by state — ready, locked, failing, stuck (the README's mongosh recipes) —
    /// select on `isEditing` and `isReady`.
    pub async fn ensure_indexes(self) -> Result<()> {
        let state = indexes::IndexDef::new(
            "editing_ready",
            doc! { field::IS_EDITING: 1, field::IS_READY: 1 },
        );
        super::indexes::ensure(self.store, BOTS, &[state], &[]).await
    }

    /// Whether the bot is paused (`paused: true`), read alone — not its seeds and history;
    /// `None` when it has no document.
    pub(crate) async fn paused(self, bot: &BotId) -> Result<Option<bool>> {
        let found = self
            .store
            .bounded(
                "find bot pause",
                self.store
                    .bots
                    .find_one(doc! { field::ID: bot.as_str() })
                    .projection(doc! { field::PAUSED: 1 }),
            )
            .await?;
        Ok(found.map(|d| matches!(d.get(field::PAUSED), Some(Bson::Boolean(true)))))
    }

    /// Every bot document without its history and the spec its pass recorded, sorted by id (for
    /// `status` and `bots list`: at a thousand bots the histories alone are megabytes).
    pub async fn load_all(self) -> Result<Vec<Document>> {
        use futures_util::TryStreamExt;
        // A status view: the URI's read preference applies (a lagging secondary shows an older
        // state; nothing decides from it).
        let bots = self.store.views.collection_with_options::<Document>(
            BOTS,
            mongodb::options::CollectionOptions::builder()
                .read_concern(mongodb::options::ReadConcern::majority())
                .build(),
        );
        let all = async {
            let cursor = bots
                .find(doc! {})
                .projection(doc! { field::HISTORY: 0, field::CRAWL_PASS_SPEC: 0 })
                .sort(doc! { field::ID: 1 })
                .await?;
            cursor.try_collect().await
        };
        self.store.bounded_view("list bots", all).await
    }

    /// Creates the initial document if there is none. Idempotent: concurrent callers all succeed
    /// and exactly one document exists afterwards. The document as the write left it (the
    /// caller's next read, saved), or `None` when another instance inserted it first.
    pub async fn initialize(
        self,
        bot: &BotId,
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<Option<Document>> {
        let initial = initial_fields(now, me.as_str(), "C: no document yet");
        let upsert = self
            .store
            .bots
            .find_one_and_update(
                doc! { field::ID: bot.as_str() },
                doc! { "$setOnInsert": initial },
            )
            .upsert(true)
            .return_document(ReturnDocument::After);
        match self.store.bounded("initialize", upsert).await {
            Ok(after) => Ok(after),
            // Another instance inserted it between our filter and our insert: the goal is met.
            Err(Error::Db(e)) if is_duplicate_key(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Claims the edit lock in ONE `find_one_and_update`: `isEditing=true` and `isReady=false`
    /// together, the epoch incremented, start and heartbeat stamped by the server. The filter holds
    /// the observed epoch and the claim's condition, so at most one claimant per epoch wins.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim(
        self,
        bot: &BotId,
        me: &InstanceId,
        expected: LockEpoch,
        claim: Claim,
        now: DateTime<Utc>,
        ttl: Duration,
        reason: &str,
    ) -> Result<Option<EditLock>> {
        let filter = claim_filter(bot, me, expected, claim);
        let epoch = expected.next().ok_or_else(|| Error::EpochExhausted {
            bot: bot.to_string(),
        })?;
        let event = if claim.is_takeover() {
            "took_over"
        } else {
            "acquired"
        };
        let update = doc! {
            "$set": {
                field::IS_EDITING: true,
                field::IS_READY: false,
                field::EDITING_BY: me.as_str(),
                field::LOCK_EXPIRES_AT: date(plus(now, ttl)),
            },
            "$inc": { field::LOCK_EPOCH: 1_i64 },
            "$currentDate": { field::LAST_UPDATE_STARTED_AT: true, field::HEARTBEAT_AT: true },
            "$push": push_history(history_entry(now, event, me.as_str(), epoch, reason)),
        };
        // An attempt whose answer was lost may have taken the lock: the epoch this claim moves
        // to, held by this instance, says it did (nobody else writes that pair).
        let Some(raw) = self
            .modify_returning("claim", bot, &filter, &update, |raw| {
                shows_applied(raw, epoch, me, false)
            })
            .await?
        else {
            return Ok(None);
        };
        let doc = crate::store::document::parse_bot(&raw).map_err(|problems| Error::Protocol {
            what: "claim",
            detail: problems.join("; "),
        })?;
        if doc.lock_epoch != epoch || doc.editing_by.as_deref() != Some(me.as_str()) {
            return Err(Error::Protocol {
                what: "claim",
                detail: format!(
                    "expected epoch {epoch} held by {me}, read {} by {:?}",
                    doc.lock_epoch, doc.editing_by
                ),
            });
        }
        Ok(Some(EditLock {
            bot: bot.clone(),
            me: me.clone(),
            epoch,
            started_at: doc.last_update_started_at.unwrap_or(now),
            previous_seeds: doc.seeds,
            failed_refreshes: doc.failed_refreshes,
            crawl_pass: doc.crawl_pass,
            crawl_pass_running_since: doc
                .crawl_pass_started_at
                .filter(|_| doc.crawl_pass > PassNumber::NONE && doc.crawl_pass_ended_at.is_none()),
        }))
    }

    /// A holder's write, fenced on its lock (`held`); `ends_lock` when it gives the lock up. Sent
    /// again through a failover; when an attempt whose answer was lost may have been applied and
    /// the next matches nothing, the document says whether it was: the epoch is still the
    /// holder's and the lock is given up (`ends_lock`) or still this instance's — nobody else
    /// writes at that epoch.
    async fn fenced(self, held: &EditLock, update: Document, ends_lock: bool) -> Result<()> {
        let (result, maybe_applied) = self
            .store
            .resend("fenced write", || {
                self.store.bots.update_one(held.fence(), update.clone())
            })
            .await?;
        let applied = result.matched_count == 1
            || (maybe_applied
                && self
                    .load_raw(&held.bot)
                    .await?
                    .is_some_and(|raw| shows_applied(&raw, held.epoch, &held.me, ends_lock)));
        if applied {
            Ok(())
        } else {
            Err(Error::EditLockLost {
                bot: held.bot.clone(),
                epoch: held.epoch,
            })
        }
    }

    /// [`fenced`](Self::fenced) for a write that gives the lock up, returning the document as
    /// the write left it (read back when an attempt whose answer was lost turns out applied).
    async fn fenced_returning(self, held: &EditLock, update: Document) -> Result<Document> {
        self.modify_returning("fenced write", &held.bot, &held.fence(), &update, |raw| {
            shows_applied(raw, held.epoch, &held.me, true)
        })
        .await?
        .ok_or_else(|| Error::EditLockLost {
            bot: held.bot.clone(),
            epoch: held.epoch,
        })
    }

    /// One conditional `findAndModify` of `bot`'s document, returning the document as it left
    /// it; sent again through a failover. When an attempt whose answer was lost may have been
    /// applied and the next matches nothing, the document is read back and taken if `applied`
    /// sees the write in it. `None`: the filter matched nothing.
    async fn modify_returning(
        self,
        what: &'static str,
        bot: &BotId,
        filter: &Document,
        update: &Document,
        applied: impl Fn(&Document) -> bool,
    ) -> Result<Option<Document>> {
        let (after, maybe_applied) = self
            .store
            .resend(what, || {
                self.store
                    .bots
                    .find_one_and_update(filter.clone(), update.clone())
                    .return_document(ReturnDocument::After)
            })
            .await?;
        Ok(match after {
            Some(after) => Some(after),
            None if maybe_applied => self.load_raw(bot).await?.filter(|raw| applied(raw)),
            None => None,
        })
    }

    /// Renews the edit lock until `now + ttl`. `EditLockLost` if it is no longer ours.
    pub async fn heartbeat(
        self,
        held: &EditLock,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<DateTime<Utc>> {
        let expires = plus(now, ttl);
        self.fenced(
            held,
            doc! {
                "$set": { field::LOCK_EXPIRES_AT: date(expires) },
                "$currentDate": { field::HEARTBEAT_AT: true },
            },
            false,
        )
        .await?;
        Ok(expires)
    }

    /// Renews every lock in `held` until `now + ttl` in one round trip: one statement per lock,
    /// each fenced on its own lock. Returns the new expiry and, per lock, whether it is still
    /// this instance's — when fewer statements matched than were sent, one read of the locks'
    /// documents tells which (a fence once broken never holds again: epochs only rise).
    pub async fn heartbeat_all(
        self,
        held: &[&EditLock],
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<(DateTime<Utc>, Vec<bool>)> {
        let expires = plus(now, ttl);
        if held.is_empty() {
            return Ok((expires, Vec::new()));
        }
        let statements: Vec<Document> = held
            .iter()
            .map(|lock| {
                doc! {
                    "q": lock.fence(),
                    "u": {
                        "$set": { field::LOCK_EXPIRES_AT: date(expires) },
                        "$currentDate": { field::HEARTBEAT_AT: true },
                    },
                }
            })
            .collect();
        let reply = self
            .store
            .command(
                "heartbeat locks",
                doc! { "update": BOTS, "updates": statements, "ordered": false },
                None,
            )
            .await?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            if let Some(first) = errors.first() {
                return Err(Error::Protocol {
                    what: "heartbeat locks",
                    detail: format!("{first}"),
                });
            }
        }
        let matched = reply.get("n").and_then(integer).unwrap_or(0);
        if usize::try_from(matched).is_ok_and(|n| n == held.len()) {
            return Ok((expires, vec![true; held.len()]));
        }
        let ids: Vec<&str> = held.iter().map(|l| l.bot.as_str()).collect();
        let mut found: std::collections::HashMap<String, Document> = Default::default();
        let read = self
            .store
            .bots
            .find(doc! { field::ID: { "$in": &ids } })
            .projection(doc! {
                field::IS_EDITING: 1, field::EDITING_BY: 1, field::LOCK_EPOCH: 1,
            });
        self.store
            .each_doc("read held locks", read, |d| {
                if let Ok(id) = d.get_str(field::ID) {
                    found.insert(id.to_owned(), d.clone());
                }
                Ok(())
            })
            .await?;
        let alive = held
            .iter()
            .map(|lock| {
                found.get(lock.bot.as_str()).is_some_and(|d| {
                    d.get_bool(field::IS_EDITING).ok() == Some(true)
                        && d.get_str(field::EDITING_BY).ok() == Some(lock.me.as_str())
                        && d.get(field::LOCK_EPOCH).and_then(integer) == Some(lock.epoch.get())
                })
            })
            .collect();
        Ok((expires, alive))
    }

    /// Every bot document's digest (see [`BotDigest`]), in one read.
    pub(crate) async fn bot_digests(self) -> Result<Vec<BotDigest>> {
        use std::hash::{Hash, Hasher};
        // Read concern `majority`, as every read of the bots: a wake-up never rests on a write
        // a failover could roll back.
        let bots = self.store.bots.clone_with_type::<bson::RawDocumentBuf>();
        // One reply for any fleet up to 10,000 bots (the driver's first batch is 101).
        let find = bots
            .find(doc! {})
            .projection(doc! {
                field::SEEDS: 0, field::HISTORY: 0, field::SPEC: 0, field::CRAWL_PASS_SPEC: 0,
                field::HEARTBEAT_AT: 0, field::LOCK_EXPIRES_AT: 0,
            })
            .batch_size(10_000);
        let mut out = Vec::new();
        self.store
            .each_raw("read bot digests", find, |raw| {
                let Ok(id) = raw.get_str(field::ID) else {
                    return Ok(());
                };
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                raw.as_bytes().hash(&mut hasher);
                let spec_version = match raw.get(field::SPEC_VERSION) {
                    Ok(Some(bson::RawBsonRef::Int64(v))) => Some(v),
                    Ok(Some(bson::RawBsonRef::Int32(v))) => Some(i64::from(v)),
                    _ => None,
                };
                out.push(BotDigest {
                    id: id.to_owned(),
                    digest: hasher.finish(),
                    spec_version,
                    catalogue: super::document::catalogue_stats(raw),
                });
                Ok(())
            })
            .await?;
        Ok(out)
    }

    /// Replaces the seeds and marks the bot ready, releasing the lock — fenced. For a crawling
    /// bot, the same write starts the next pass (whose seeds the caller already enqueued), or —
    /// while the current pass runs — marks it to start when that one ends (`crawlNextPassAt`).
    pub async fn complete(
        self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        pass: NextPass,
    ) -> Result<()> {
        self.complete_with(held, seeds, now, pass, None)
            .await
            .map(|_| ())
    }

    /// [`complete`](Self::complete), also recording the spec a pass it starts runs on (`spec`):
    /// the document as the write left it (the holder's next read, saved).
    pub(crate) async fn complete_with(
        self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        pass: NextPass,
        spec: Option<&PassSpec>,
    ) -> Result<Document> {
        let mut reason = format!("{} seeds", seeds.len());
        let mut set = doc! {
            field::SEEDS: seeds,
            field::IS_READY: true,
            field::IS_EDITING: false,
            field::EDITING_BY: Bson::Null,
            field::LOCK_EXPIRES_AT: Bson::Null,
            field::LAST_ERROR: Bson::Null,
            field::FAILED_REFRESHES: 0_i32,
            field::RETRY_AFTER: Bson::Null,
        };
        let mut current = doc! { field::LAST_SEED_UPDATED_AT: true, field::HEARTBEAT_AT: true };
        match pass {
            NextPass::None => {}
            NextPass::Start(pass) => {
                if let Some(spec) = spec {
                    set.extend(super::document::pass_spec_fields(spec));
                }
                set.insert(field::CRAWL_PASS, pass);
                set.insert(field::CRAWL_PASS_ENDED_AT, Bson::Null);
                set.insert(field::CRAWL_NEXT_PASS_AT, Bson::Null);
                current.insert(field::CRAWL_PASS_STARTED_AT, true);
                reason.push_str(&format!("; crawl pass {pass}"));
            }
            NextPass::AfterCurrent => {
                current.insert(field::CRAWL_NEXT_PASS_AT, true);
                reason.push_str(&format!(
                    "; the next crawl pass starts when pass {} ends",
                    held.crawl_pass
                ));
            }
        }
        self.fenced_returning(
            held,
            doc! {
                "$set": set,
                "$currentDate": current,
                "$push": push_history(history_entry(now, "refreshed", held.me.as_str(), held.epoch, &reason)),
            },
        )
        .await
    }

    /// Records a failed refresh and releases the lock — fenced. `stay_ready` returns the bot to
    /// Ready on its previous seeds (`keep_previous`); nobody retries before `retry_after`.
    pub async fn fail(
        self,
        held: &EditLock,
        now: DateTime<Utc>,
        error: &str,
        retry_after: DateTime<Utc>,
        stay_ready: bool,
    ) -> Result<()> {
        self.fenced(
            held,
            doc! {
                "$set": {
                    field::IS_READY: stay_ready,
                    field::IS_EDITING: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                    field::LAST_ERROR: error,
                    field::RETRY_AFTER: date(retry_after),
                },
                "$inc": { field::FAILED_REFRESHES: 1_i32 },
                "$push": push_history(history_entry(now, "refresh_failed", held.me.as_str(), held.epoch, error)),
            },
            true,
        )
        .await
    }

    /// Gives the lock back without a result (shutdown) — fenced. The bot is left not ready, so the
    /// next instance claims it at once (rule C).
    pub async fn release(self, held: &EditLock, now: DateTime<Utc>, reason: &str) -> Result<()> {
        self.fenced(
            held,
            doc! {
                "$set": {
                    field::IS_READY: false,
                    field::IS_EDITING: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                },
                "$push": push_history(history_entry(now, "released", held.me.as_str(), held.epoch, reason)),
            },
            true,
        )
        .await
    }

    /// Rule D: ready and editing at once. Clears `isReady` only, keeping the lock and its epoch, so a
    /// live holder is not disturbed and an expired one is then taken over by rule B.
    pub(crate) async fn repair_contradiction(
        self,
        bot: &BotId,
        expected: LockEpoch,
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let filter = doc! {
            field::ID: bot.as_str(),
            field::IS_READY: true,
            field::IS_EDITING: true,
            field::LOCK_EPOCH: expected.get(),
        };
        let reason = "D: ready and editing at once; cleared isReady, kept the lock";
        let update = doc! {
            "$set": { field::IS_READY: false },
            "$push": push_history(history_entry(now, "repaired", me.as_str(), expected, reason)),
        };
        Ok(self
            .store
            .bounded("repair", self.store.bots.update_one(filter, update))
            .await?
            .modified_count
            == 1)
    }

    /// Rule E: rewrites a malformed document into a not-ready one, keeping whatever can be
    /// salvaged (valid seeds, dates, history) and raising the epoch above any it held. The filter is
    /// the exact document that was read, so a concurrent change makes this a no-op.
    pub async fn repair_malformed(
        self,
        raw: &Document,
        problems: &[String],
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let Some(id) = raw.get(field::ID).cloned() else {
            return Ok(false);
        };
        let filter = exactly(raw);
        let seeds: Vec<Bson> = match raw.get(field::SEEDS) {
            Some(Bson::Array(items)) if items.iter().all(|s| matches!(s, Bson::String(_))) => {
                items.clone()
            }
            _ => Vec::new(),
        };
        let epoch = highest_epoch(raw)
            .next()
            .ok_or_else(|| Error::EpochExhausted {
                bot: id.as_str().map_or_else(|| id.to_string(), str::to_owned),
            })?;
        let salvage_date = |name: &str| match raw.get(name) {
            Some(Bson::DateTime(d)) => Bson::DateTime(*d),
            _ => Bson::Null,
        };
        let reason = format!("E: malformed document repaired: {}", problems.join("; "));
        let history = salvaged_history(
            raw,
            history_entry(now, "repaired", me.as_str(), epoch, &reason),
        );
        let replacement = doc! {
            field::ID: id,
            field::IS_READY: false,
            field::IS_EDITING: false,
            field::SEEDS: seeds,
            field::LAST_UPDATE_STARTED_AT: salvage_date(field::LAST_UPDATE_STARTED_AT),
            field::LAST_SEED_UPDATED_AT: salvage_date(field::LAST_SEED_UPDATED_AT),
            field::EDITING_BY: Bson::Null,
            field::LOCK_EPOCH: epoch.get(),
            field::HEARTBEAT_AT: Bson::Null,
            field::LOCK_EXPIRES_AT: Bson::Null,
            field::LAST_ERROR: reason,
            field::FAILED_REFRESHES: 0_i32,
            field::REFRESH_REQUESTED_AT: Bson::Null,
            field::RETRY_AFTER: Bson::Null,
            field::HISTORY: history,
        };
        let mut replacement = replacement;
        // The crawl's pass number survives a repair when it is readable (a new pass must not
        // reuse an old number); `Passes::start` also looks at the frontier for the highest one.
        if let Some(pass) = raw
            .get(field::CRAWL_PASS)
            .and_then(integer)
            .filter(|p| *p >= 0)
        {
            replacement.insert(field::CRAWL_PASS, pass);
            for name in [
                field::CRAWL_PASS_STARTED_AT,
                field::CRAWL_PASS_ENDED_AT,
                field::CRAWL_LAST_RUN_AT,
            ] {
                replacement.insert(name, salvage_date(name));
            }
        }
        Ok(self
            .store
            .bounded("repair", self.store.bots.replace_one(filter, replacement))
            .await?
            .modified_count
            == 1)
    }

    /// `seedlock unlock`: the admin's override. Clears the lock of an editing bot and raises its
    /// epoch, so the old holder's fenced writes fail from now on. Conditional on the epoch it read
    /// (retried if the document changed in between), so the history names the right epoch.
    pub async fn admin_unlock(
        self,
        bot: &BotId,
        by: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<UnlockOutcome> {
        let note = format!("unlocked by admin: {reason}");
        for _ in 0..10 {
            let Some(raw) = self.load_raw(bot).await? else {
                return Ok(UnlockOutcome::NoSuchBot);
            };
            if raw.get(field::IS_EDITING) != Some(&Bson::Boolean(true)) {
                return Ok(UnlockOutcome::NotLocked);
            }
            let observed_epoch = raw.get(field::LOCK_EPOCH).cloned().unwrap_or(Bson::Null);
            let old_epoch = integer(&observed_epoch);
            let epoch = highest_epoch(&raw)
                .next()
                .ok_or_else(|| Error::EpochExhausted {
                    bot: bot.to_string(),
                })?;
            let filter = doc! { field::ID: bot.as_str(), field::IS_EDITING: true, field::LOCK_EPOCH: observed_epoch };
            let update = doc! {
                "$set": {
                    field::IS_EDITING: false,
                    field::IS_READY: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                    field::RETRY_AFTER: Bson::Null,
                    field::LAST_ERROR: note.as_str(),
                    field::LOCK_EPOCH: epoch.get(),
                },
                "$push": push_history(history_entry(now, "unlocked", by, epoch, &note)),
            };
            if self
                .store
                .bounded("unlock", self.store.bots.update_one(filter, update))
                .await?
                .matched_count
                == 1
            {
                return Ok(UnlockOutcome::Unlocked {
                    holder: raw.get_str(field::EDITING_BY).ok().map(str::to_owned),
                    old_epoch,
                });
            }
        }
        Err(Error::Protocol {
            what: "unlock",
            detail: "the document kept changing; try again".into(),
        })
    }

    /// `seedlock refresh`: asks for a refresh at the next opportunity. False if there is no such bot.
    pub async fn request_refresh(self, bot: &BotId, by: &str, now: DateTime<Utc>) -> Result<bool> {
        let Some(raw) = self.load_raw(bot).await? else {
            return Ok(false);
        };
        let epoch = highest_epoch(&raw);
        let update = self.store.bots.update_one(
            doc! { field::ID: bot.as_str() },
            doc! {
                "$currentDate": { field::REFRESH_REQUESTED_AT: true },
                "$push": push_history(history_entry(now, "refresh_requested", by, epoch, "requested by admin")),
            },
        );
        let result = self.store.bounded("request refresh", update).await?;
        Ok(result.matched_count == 1)
    }

    /// The one change stream on the `bots` collection an instance keeps open (the runner's hub):
    /// each event names the bot it concerns and whether the fleet loop should look (a bot added,
    /// removed or replaced, or its `specVersion` changed). Only those fields travel — not the
    /// seeds a refresh wrote. Its events only prompt reads, so it uses the server's default read
    /// concern (the test server delivers no events on a stream opened with `majority`).
    pub async fn watch_bots(self) -> Result<BotChanges> {
        let bots = self.store.db.collection::<Document>(BOTS);
        let spec_version = format!("updateDescription.updatedFields.{}", field::SPEC_VERSION);
        // A holder's heartbeat sets only `heartbeatAt` and `lockExpiresAt`: no decision changes
        // with it (a runner waiting for the lock's expiry reads the new one when the old one
        // comes), so it wakes no runner on any instance.
        let heartbeat_only = doc! { "$expr": { "$gt": [
            { "$size": { "$setDifference": [
                { "$map": {
                    // Events other than updates have no `updateDescription`.
                    "input": { "$objectToArray": {
                        "$ifNull": ["$updateDescription.updatedFields", {}],
                    } },
                    "in": "$$this.k",
                } },
                [field::HEARTBEAT_AT, field::LOCK_EXPIRES_AT],
            ] } },
            0,
        ] } };
        let watch = bots.watch().pipeline([
            doc! { "$match": { "$or": [
                { "operationType": { "$ne": "update" } },
                { "updateDescription.removedFields.0": { "$exists": true } },
                heartbeat_only,
            ] } },
            doc! { "$project": {
                "operationType": 1, "documentKey": 1, &spec_version: 1,
            } },
        ]);
        let stream = self.store.bounded("watch bots", watch).await?;
        // Events as plain documents: the projection leaves out what the driver's typed event
        // requires (`ns`, `removedFields`).
        Ok(BotChanges {
            stream: stream.with_type::<Document>(),
        })
    }
    /// Writes `spec` as `bot`'s definition unless it is already the stored one: a new bot gets its
    /// document, a changed spec a raised `specVersion` (conditional on the version read, so two
    /// concurrent applies cannot both win) and a refresh request — the new spec starts with the
    /// bot's next pass; the running pass ends on the spec it started with. `dry_run` writes nothing.
    pub(crate) async fn apply_spec(
        self,
        bot: &BotId,
        spec: &Document,
        by: &str,
        now: DateTime<Utc>,
        dry_run: bool,
    ) -> Result<Applied> {
        let current = self.load_raw(bot).await?;
        let Some((applied, version)) = compare_spec(current.as_ref(), spec) else {
            return Ok(Applied::Unchanged);
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
        let mut set = doc! {
            field::SPEC: spec.clone(), field::SPEC_ERROR: Bson::Null,
            field::SPEC_BY: env!("CARGO_PKG_VERSION"),
        };
        let result = match (&current, version) {
            (None, _) => self.create_with_spec(bot, set, by, now).await?,
            (Some(raw), None) => {
                set.insert(field::SPEC_VERSION, 1_i64);
                // Conditional on the version field as read (absent, or not a number).
                let unchanged = raw
                    .get(field::SPEC_VERSION)
                    .cloned()
                    .unwrap_or_else(|| Bson::Document(doc! { "$exists": false }));
                self.store.bounded(
                    "adopt bot",
                    self.store.bots.update_one(
                        doc! { field::ID: bot.as_str(), field::SPEC_VERSION: unchanged },
                        doc! { "$set": set, "$currentDate": { field::SPEC_UPDATED_AT: true }, "$push": push_history(entry) },
                    ),
                )
                .await?
            }
            (Some(_), Some(v)) => {
                self.store.bounded(
                    "change spec",
                    self.store.bots.update_one(
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

    /// Creates bot `bot` with its spec (`set`), conditional on the document still having no
    /// spec: of two applies creating the bot at once, the second's upsert meets the first's
    /// document and fails.
    async fn create_with_spec(
        self,
        bot: &BotId,
        mut set: Document,
        by: &str,
        now: DateTime<Utc>,
    ) -> Result<mongodb::results::UpdateResult> {
        let mut initial = initial_fields(now, by, "spec applied");
        initial.insert(field::SPEC_VERSION, 1_i64);
        set.remove(field::SPEC_ERROR);
        initial.insert(field::SPEC_ERROR, Bson::Null);
        let created = self
            .store
            .bounded(
                "create bot",
                self.store
                    .bots
                    .update_one(
                        doc! { field::ID: bot.as_str(), field::SPEC: { "$exists": false } },
                        doc! { "$setOnInsert": initial, "$set": set, "$currentDate": { field::SPEC_UPDATED_AT: true } },
                    )
                    .upsert(true),
            )
            .await;
        match created {
            Err(Error::Db(e)) if super::is_duplicate_key(&e) => Err(Error::Invalid(format!(
                "bot {bot}: created by another apply meanwhile; run this one again"
            ))),
            other => other,
        }
    }

    /// Every bot document that carries a spec, by id: its `_id`, `spec`, `specVersion` and
    /// `specError` only (not its seeds and history).
    pub(crate) async fn spec_documents(self) -> Result<Vec<Document>> {
        let all = async {
            let cursor = self
                .store
                .bots
                .find(doc! { field::SPEC: { "$exists": true } })
                .projection(doc! { field::SPEC: 1, field::SPEC_VERSION: 1, field::SPEC_ERROR: 1, field::SPEC_BY: 1 })
                .sort(doc! { field::ID: 1 })
                .await?;
            cursor.try_collect().await
        };
        self.store.bounded("list bot specs", all).await
    }

    /// Records why the instances cannot run the spec at `version` (only while it is the current
    /// one, so a fixed spec is never marked): the bot shows Error with `lastError` naming the key.
    pub(crate) async fn mark_spec_error(
        self,
        bot: &BotId,
        version: i64,
        error: &str,
    ) -> Result<()> {
        let text = format!("bad spec (specVersion {version}): {error}");
        self.store.bounded(
            "mark spec error",
            self.store.bots.update_one(
                doc! { field::ID: bot.as_str(), field::SPEC_VERSION: version, field::SPEC_ERROR: { "$ne": &text } },
                doc! { "$set": { field::SPEC_ERROR: &text, field::LAST_ERROR: &text } },
            ),
        )
        .await?;
        Ok(())
    }

    /// Clears a spec error once the spec at `version` runs.
    pub(crate) async fn clear_spec_error(self, bot: &BotId, version: i64) -> Result<()> {
        self.store.bounded(
            "clear spec error",
            self.store.bots.update_one(
                doc! { field::ID: bot.as_str(), field::SPEC_VERSION: version, field::SPEC_ERROR: { "$type": "string" } },
                doc! { "$set": { field::SPEC_ERROR: Bson::Null, field::LAST_ERROR: Bson::Null } },
            ),
        )
        .await?;
        Ok(())
    }

    /// `pause` (with `Some`) or `resume`; false if there is no such bot.
    pub(crate) async fn set_paused(
        self,
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
            .store
            .bounded(
                "pause or resume",
                self.store
                    .bots
                    .update_one(doc! { field::ID: bot.as_str() }, update),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// Deletes the bot's document: every instance running it from the database stops it within
    /// one poll. False if there was none.
    pub(crate) async fn remove(self, bot: &BotId) -> Result<bool> {
        let result = self
            .store
            .bounded(
                "remove bot",
                self.store.bots.delete_one(doc! { field::ID: bot.as_str() }),
            )
            .await?;
        Ok(result.deleted_count == 1)
    }
}

/// A bot document as [`Bots::bot_digests`] reads it: its `_id`, a digest of every field that can
/// change what an instance does (not the seeds, history, specs, or the holder's heartbeat —
/// waiters wake at the lock's expiry anyway), and its `specVersion`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct BotDigest {
    pub id: String,
    pub digest: u64,
    pub spec_version: Option<i64>,
    /// What the document says of the catalogue's freshness, for the metrics.
    pub catalogue: Option<super::document::CatalogueStats>,
}

/// One event of [`Bots::watch_bots`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BotChange {
    /// The bot's `_id` (when it is a string).
    pub id: Option<String>,
    /// A bot added, removed or replaced, or its spec changed.
    pub concerns_fleet: bool,
}

/// The stream of [`BotChange`]s.
pub struct BotChanges {
    stream: mongodb::change_stream::ChangeStream<Document>,
}

impl futures_util::Stream for BotChanges {
    type Item = Result<BotChange>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.stream)
            .poll_next(cx)
            .map(|event| {
                event.map(|event| {
                    let event = event?;
                    let id = event
                        .get_document("documentKey")
                        .ok()
                        .and_then(|k| k.get_str(field::ID).ok())
                        .map(str::to_owned);
                    let concerns_fleet = match event.get_str("operationType") {
                        Ok("insert" | "delete" | "replace") => true,
                        Ok("update") => event
                            .get_document("updateDescription")
                            .ok()
                            .and_then(|u| u.get_document("updatedFields").ok())
                            .is_some_and(|f| f.contains_key(field::SPEC_VERSION)),
                        _ => false,
                    };
                    Ok(BotChange { id, concerns_fleet })
                })
            })
    }
}

/// A new bot document's fields (its lock free, not ready, no seeds), created by `by` for `why`.
fn initial_fields(now: DateTime<Utc>, by: &str, why: &str) -> Document {
    doc! {
        field::IS_READY: false,
        field::IS_EDITING: false,
        field::SEEDS: [],
        field::LAST_UPDATE_STARTED_AT: Bson::Null,
        field::LAST_SEED_UPDATED_AT: Bson::Null,
        field::EDITING_BY: Bson::Null,
        field::LOCK_EPOCH: 0_i64,
        field::HEARTBEAT_AT: Bson::Null,
        field::LOCK_EXPIRES_AT: Bson::Null,
        field::LAST_ERROR: Bson::Null,
        field::FAILED_REFRESHES: 0_i32,
        field::REFRESH_REQUESTED_AT: Bson::Null,
        field::RETRY_AFTER: Bson::Null,
        field::HISTORY: [history_entry(now, "created", by, LockEpoch::ZERO, why)],
    }
}

fn history_entry(
    now: DateTime<Utc>,
    event: &str,
    by: &str,
    epoch: LockEpoch,
    reason: &str,
) -> Document {
    doc! {
        "at": bson::DateTime::from_chrono(now),
        "event": event,
        "by": by,
        "epoch": epoch.get(),
        "reason": reason,
    }
}

fn push_history(entry: Document) -> Document {
    doc! { field::HISTORY: { "$each": [entry], "$slice": -HISTORY_LEN } }
}

/// The highest epoch a (possibly malformed) document shows, in `lockEpoch` or in its history: a
/// repair or an unlock moves past it, so no epoch is ever handed out twice.
fn highest_epoch(raw: &Document) -> LockEpoch {
    let in_field = raw.get(field::LOCK_EPOCH).and_then(integer);
    let in_history = match raw.get(field::HISTORY) {
        Some(Bson::Array(entries)) => entries
            .iter()
            .filter_map(|e| {
                e.as_document()
                    .and_then(|d| d.get("epoch"))
                    .and_then(integer)
            })
            .max(),
        _ => None,
    };
    let highest = in_field.into_iter().chain(in_history).max().unwrap_or(0);
    LockEpoch::new(highest.max(0)).unwrap_or(LockEpoch::ZERO)
}
/// How `spec` compares with the bot document `current` holds: `None` when it is the same spec;
/// else what applying it does and the spec version it replaces (none: the bot is created, or
/// its document has no version yet).
fn compare_spec(current: Option<&Document>, spec: &Document) -> Option<(Applied, Option<i64>)> {
    let Some(raw) = current else {
        return Some((Applied::Created, None));
    };
    let version = raw
        .get(field::SPEC_VERSION)
        .and_then(crate::store::document::integer);
    Some(match (raw.get(field::SPEC), version) {
        (Some(Bson::Document(old)), _) if old == spec => return None,
        (Some(Bson::Document(old)), Some(v)) => {
            (Applied::Changed(changed_keys(old, spec)), Some(v))
        }
        // Hand-edited into something that is no document: the file's spec replaces it.
        (Some(_), Some(v)) => (Applied::Changed(vec![field::SPEC.to_owned()]), Some(v)),
        // A bot that ran from a config file: the database now defines it.
        _ => (Applied::Created, None),
    })
}

/// A filter that matches `raw` exactly as it was read: equality on every field that can be
/// queried by equality (a key with a '.' or a leading '$' cannot be, so it is left out — the
/// rest still pins the document down), and the lock's fields that it lacks still missing.
fn exactly(raw: &Document) -> Document {
    let mut filter = Document::new();
    for (key, value) in raw {
        if !key.contains('.') && !key.starts_with('$') {
            filter.insert(key.clone(), value.clone());
        }
    }
    for name in [
        field::IS_READY,
        field::IS_EDITING,
        field::SEEDS,
        field::LOCK_EPOCH,
    ] {
        if !raw.contains_key(name) {
            filter.insert(name, doc! { "$exists": false });
        }
    }
    filter
}

/// A repaired document's history: the entries of `raw`'s that are documents, then `entry`, the
/// last [`HISTORY_LEN`] kept.
fn salvaged_history(raw: &Document, entry: Document) -> Vec<Bson> {
    let mut history: Vec<Bson> = match raw.get(field::HISTORY) {
        Some(Bson::Array(items)) => items
            .iter()
            .filter(|h| matches!(h, Bson::Document(_)))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    history.push(Bson::Document(entry));
    let keep = history.len().saturating_sub(HISTORY_LEN as usize);
    history.into_iter().skip(keep).collect()
}

/// A claim's filter: the bot at the epoch read, and the claim's condition — free, expired by
/// `now`, stuck since before `started_before`, or held by this very instance id before its
/// process started (orphaned).
/// Whether the document `raw` shows a lock write of `me` at `epoch` applied, read back after an
/// attempt whose answer was lost: the epoch is still that one — nobody else writes at it — and
/// the lock is given up (`ends_lock`) or held by `me`.
fn shows_applied(raw: &Document, epoch: LockEpoch, me: &InstanceId, ends_lock: bool) -> bool {
    let editing = raw.get_bool(field::IS_EDITING).unwrap_or(false);
    raw.get_i64(field::LOCK_EPOCH).ok() == Some(epoch.get())
        && if ends_lock {
            !editing
        } else {
            editing && raw.get_str(field::EDITING_BY).ok() == Some(me.as_str())
        }
}

fn claim_filter(bot: &BotId, me: &InstanceId, expected: LockEpoch, claim: Claim) -> Document {
    let mut filter = doc! { field::ID: bot.as_str(), field::LOCK_EPOCH: expected.get() };
    match claim {
        Claim::Free => {
            filter.insert(field::IS_EDITING, false);
        }
        Claim::Expired { now: cutoff } => {
            filter.insert(field::IS_EDITING, true);
            filter.insert(field::LOCK_EXPIRES_AT, doc! { "$lte": date(cutoff) });
        }
        Claim::Stuck { started_before } => {
            filter.insert(field::IS_EDITING, true);
            filter.insert(
                field::LAST_UPDATE_STARTED_AT,
                doc! { "$lte": date(started_before) },
            );
        }
        Claim::Orphaned => {
            filter.insert(field::IS_EDITING, true);
            filter.insert(field::EDITING_BY, me.as_str());
        }
    }
    filter
}
