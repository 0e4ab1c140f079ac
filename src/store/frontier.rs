//! The crawl frontier (collection `frontier`): one document per (bot, normalized URL), shared by
//! every instance. Workers pull work with leases: one `find_one_and_update` hands a URL to one
//! worker with a fresh lease token and an expiry on the server's clock; completion is fenced on
//! that token, so a worker whose lease expired (and was re-leased) cannot mark the URL done.
//!
//! Passes: each crawl pass has a number. Enqueuing a URL for pass `p` is a no-op when the URL is
//! already in pass `p` (rediscovered links are harmless) and resets it to pending when it was last
//! crawled in an earlier pass.

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::options::{IndexOptions, ReturnDocument};
use mongodb::{Collection, IndexModel};

use super::Store;
use crate::error::{Error, Result};
use crate::ids::{BotId, InstanceId};
use crate::urls::NormalizedUrl;

pub const FRONTIER: &str = "frontier";

/// The index of expired-lease lookups and progress counts; `ensure_frontier_indexes` creates it.
pub const LEASE_INDEX: &str = "bot_pass_status_expiry";
/// The index of the pending-URL lookup: equality on (bot, pass, status, slot).
pub const SLOT_INDEX: &str = "bot_pass_status_slot";
/// The index of the pending-URL lookup by priority: equality on (bot, pass, status, priority,
/// slot).
pub const PRIORITY_INDEX: &str = "bot_pass_status_priority_slot";
/// Pending URLs are spread over this many random slots, and a worker leases from a random slot
/// first: every lookup is an equality on the whole index key and meets a few hundred entries even
/// in a pass of 200,000 URLs (a server that reads every entry matching a key prefix — as the test
/// server does — would otherwise pay for the whole pass on every lease).
pub const SLOTS: u32 = 1024;

/// What a page is to the crawl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

/// A URL leased to this worker until `expires_at`. Times here are the caller's estimate of the
/// server's time (`ServerClock::now`, as for the bot lock). Every write about it carries `token`.
#[derive(Clone, Debug, PartialEq)]
pub struct UrlLease {
    pub id: String,
    pub url: NormalizedUrl,
    pub kind: PageKind,
    pub pass: i64,
    pub token: String,
    pub expires_at: DateTime<Utc>,
    /// How many times this URL has been leased in this pass, this lease included.
    pub attempt: i64,
    /// When this lease was taken (server time): a later lease of the same URL is always later,
    /// which orders the results of two workers without a transaction.
    pub leased_at: DateTime<Utc>,
    /// The page's validators for a conditional GET: as stored when leased; the crawl replaces
    /// them with the fetched page's before the done mark stores them.
    pub validators: crate::fetch::Validators,
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

/// What the frontier remembers of a detail page from earlier passes (fingerprint mode decides
/// from it whether the page needs fetching).
#[derive(Clone, Debug, PartialEq)]
pub struct KnownPage {
    pub pass: i64,
    pub status: String,
    /// The listing fingerprint the page was last stored with.
    pub fingerprint: Option<String>,
    pub record_id: Option<String>,
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

impl PassProgress {
    /// The pass is over only when nothing is pending or waiting and nothing is leased by anyone.
    pub fn is_finished(&self) -> bool {
        self.pending == 0 && self.waiting == 0 && self.leased == 0
    }
}

/// The frontier `_id`: a hash of (bot, normalized URL), the same on every instance and every run.
pub fn url_id(bot: &BotId, url: &NormalizedUrl) -> String {
    crate::ids::sha256_hex(
        &[bot.as_str().as_bytes(), &[0], url.as_str().as_bytes()],
        16,
    )
}

/// The filters of [`Store::lease_next`], tried in this order: a pending URL of each of
/// `priorities` (highest first) in slot `slot`; a pending URL in slot `slot`; when that slot is
/// empty (then few are pending), one in slot `slot` or above, then any pending URL; a lease past
/// its expiry. Leasers draw `slot` at random, so concurrent leasers look at different points of
/// the index and rarely race for the same document (a lost race is a write conflict the server
/// retries; on the test server, with few URLs pending and a dozen leasers all asking for "any",
/// those retries took seconds). The exact slot comes first because the test server reads every
/// index entry inside a query's bounds: a range over many pending entries costs in proportion
/// (a `$gte` first made a 10,000-entry frontier crawl at a third of the speed). Each is
/// equalities on an index's leading fields (and a range on its last), which every server answers
/// from the index alone; a range on a field outside the index would make the test server scan
/// the collection. Public for the `explain` test, so the test checks the queries the code sends.
pub fn lease_filters(
    bot: &BotId,
    pass: i64,
    slot: u32,
    now: DateTime<Utc>,
    priorities: &[i64],
) -> Vec<Document> {
    let mut filters: Vec<Document> = priorities
        .iter()
        .map(|p| doc! { "botId": bot.as_str(), "pass": pass, "status": "pending", "priority": p, "slot": i64::from(slot) })
        .collect();
    filters.extend([
        doc! { "botId": bot.as_str(), "pass": pass, "status": "pending", "slot": i64::from(slot) },
        doc! { "botId": bot.as_str(), "pass": pass, "status": "pending", "slot": { "$gte": i64::from(slot) } },
        doc! { "botId": bot.as_str(), "pass": pass, "status": "pending" },
        doc! { "botId": bot.as_str(), "pass": pass, "status": "leased", "leaseExpiresAt": { "$lte": date(now) } },
    ]);
    filters
}

fn date(at: DateTime<Utc>) -> Bson {
    Bson::DateTime(bson::DateTime::from_chrono(at))
}

fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl Store {
    pub(super) fn frontier(&self) -> Collection<Document> {
        self.database().collection(FRONTIER)
    }

    /// Creates the frontier's indexes (idempotent).
    pub async fn ensure_frontier_indexes(&self) -> Result<()> {
        let indexes = [
            IndexModel::builder()
                .keys(doc! { "botId": 1, "pass": 1, "status": 1, "leaseExpiresAt": 1 })
                .options(IndexOptions::builder().name(LEASE_INDEX.to_owned()).build())
                .build(),
            IndexModel::builder()
                .keys(doc! { "botId": 1, "pass": 1, "status": 1, "slot": 1 })
                .options(IndexOptions::builder().name(SLOT_INDEX.to_owned()).build())
                .build(),
            IndexModel::builder()
                .keys(doc! { "botId": 1, "pass": 1, "status": 1, "priority": 1, "slot": 1 })
                .options(
                    IndexOptions::builder()
                        .name(PRIORITY_INDEX.to_owned())
                        .build(),
                )
                .build(),
        ];
        self.index_build(
            "create frontier indexes",
            self.frontier().create_indexes(indexes),
        )
        .await?;
        Ok(())
    }

    /// Adds `urls` (all of one kind) to pass `pass`; see [`Store::enqueue_urls`].
    pub async fn enqueue(
        &self,
        bot: &BotId,
        pass: i64,
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

    /// Adds `urls` to pass `pass`, one round trip per 1,000 URLs: new URLs are inserted pending;
    /// URLs last crawled in an earlier pass become pending again (keeping their validators and
    /// record id); URLs already in this pass are left alone. Returns how many were added or reset.
    pub async fn enqueue_urls(
        &self,
        bot: &BotId,
        pass: i64,
        urls: &[NewUrl],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        // A page may carry many links: send them in chunks well under the server's limits
        // (100,000 statements, 16 MiB) so no page is too large to enqueue.
        let mut total = 0;
        for chunk in urls.chunks(1000) {
            total += self.enqueue_chunk(bot, pass, chunk, now).await?;
        }
        Ok(total)
    }

    async fn enqueue_chunk(
        &self,
        bot: &BotId,
        pass: i64,
        urls: &[NewUrl],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let updates: Vec<Document> = urls
            .iter()
            .map(|new| {
                let url = &new.url;
                doc! {
                    "q": { "_id": url_id(bot, url), "pass": { "$lt": pass } },
                    "u": {
                        "$set": {
                            "botId": bot.as_str(), "url": url.as_str(), "kind": new.kind.as_str(),
                            "pass": pass, "status": "pending", "attempts": 0_i64, "sheds": 0_i64,
                            "leaseOwner": Bson::Null, "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null,
                            "lastError": Bson::Null, "enqueuedAt": date(now), "notBefore": date(now),
                            "slot": i64::from(rand::random_range(0..SLOTS)),
                            "host": url.host_port(),
                            "priority": new.priority,
                            "listFingerprint": new.fingerprint.as_deref().map_or(Bson::Null, |f| Bson::String(f.to_owned())),
                        },
                        "$setOnInsert": { "discoveredAt": date(now) },
                    },
                    "upsert": true,
                }
            })
            .collect();
        let command = doc! { "update": FRONTIER, "updates": updates, "ordered": false };
        let reply = self
            .bounded("enqueue", self.database().run_command(command))
            .await?;
        // Duplicate keys mean "already in this pass": the no-op enqueue is meant to be.
        if let Ok(errors) = reply.get_array("writeErrors") {
            for error in errors {
                let code = error
                    .as_document()
                    .and_then(|e| e.get("code"))
                    .and_then(crate::document::integer);
                if code != Some(11000) {
                    return Err(Error::Protocol {
                        what: "enqueue",
                        detail: format!("{error}"),
                    });
                }
            }
        }
        let upserted = reply
            .get_array("upserted")
            .map(|a| a.len() as u64)
            .unwrap_or(0);
        let modified = reply
            .get("nModified")
            .and_then(crate::document::integer)
            .unwrap_or(0)
            .max(0) as u64;
        Ok(upserted + modified)
    }

    /// Leases one URL of pass `pass`: a pending one, or one whose lease expired (its worker died).
    /// `None` when there is nothing to lease right now (which does not mean the pass is over).
    pub async fn lease_url(
        &self,
        bot: &BotId,
        pass: i64,
        me: &InstanceId,
        now: DateTime<Utc>,
        lease_for: Duration,
    ) -> Result<Option<UrlLease>> {
        self.lease_next(bot, pass, me, None, now, lease_for, &[], &[])
            .await
    }

    /// As [`Store::lease_url`], and with `reclaim_before` also the leases this instance id took
    /// before that time — a previous run of this instance that died holding them — without
    /// waiting for them to expire. (Instance ids must be unique among live processes.) URLs on
    /// the hosts in `avoid` (`host:port`; paused or at their limit) are left for later; URLs of
    /// `priorities` (highest first) are looked for before any other.
    #[allow(clippy::too_many_arguments)]
    pub async fn lease_next(
        &self,
        bot: &BotId,
        pass: i64,
        me: &InstanceId,
        reclaim_before: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
        lease_for: Duration,
        avoid: &[String],
        priorities: &[i64],
    ) -> Result<Option<UrlLease>> {
        let expires_at = super::plus(now, lease_for);
        let token = new_token();
        let update = doc! {
            "$set": {
                "status": "leased", "leaseOwner": me.as_str(), "leaseToken": token.as_str(),
                "leaseExpiresAt": date(expires_at), "leasedAt": date(now),
            },
            "$inc": { "attempts": 1_i64 },
        };
        let mut filters = lease_filters(bot, pass, rand::random_range(0..SLOTS), now, priorities);
        if !avoid.is_empty() {
            for filter in &mut filters {
                filter.insert("host", doc! { "$nin": avoid });
            }
        }
        let mut reclaiming = false;
        if let Some(before) = reclaim_before {
            if let Some(token) = self.dead_lease(bot, pass, me, before).await? {
                reclaiming = true;
                filters.insert(
                    0,
                    doc! { "botId": bot.as_str(), "pass": pass, "status": "leased", "leaseToken": token },
                );
            }
        }
        let mut leased = None;
        let mut reclaimed = false;
        for (i, filter) in filters.into_iter().enumerate() {
            let attempt = self
                .bounded(
                    "lease url",
                    self.frontier()
                        .find_one_and_update(filter, update.clone())
                        .return_document(ReturnDocument::After),
                )
                .await;
            leased = match attempt {
                Ok(found) => found,
                // The candidate is held by an open transaction (a killed worker's commit, until
                // the server ends it): leave it, lease something else.
                Err(e) if crate::error::is_write_conflict(&e) => {
                    tracing::debug!(bot = %bot, error = %e, "a lease candidate is busy; trying the next");
                    None
                }
                Err(e) => return Err(e),
            };
            if leased.is_some() {
                reclaimed = reclaiming && i == 0;
                break;
            }
        }
        let Some(doc) = leased else { return Ok(None) };
        let bad = |what: &str| Error::Protocol {
            what: "lease url",
            detail: format!("frontier document without a valid {what}: {doc}"),
        };
        let url = doc
            .get_str("url")
            .ok()
            .and_then(|u| NormalizedUrl::parse(u).ok())
            .ok_or_else(|| bad("url"))?;
        let kind = doc
            .get_str("kind")
            .ok()
            .and_then(PageKind::parse)
            .ok_or_else(|| bad("kind"))?;
        let text = |name: &str| doc.get_str(name).ok().map(str::to_owned);
        Ok(Some(UrlLease {
            validators: crate::fetch::Validators {
                etag: text("etag"),
                last_modified: text("lastModified"),
            },
            list_fingerprint: text("listFingerprint"),
            record_id: text("recordId"),
            reclaimed,
            priority: doc
                .get("priority")
                .and_then(crate::document::integer)
                .unwrap_or_else(|| kind.default_priority()),
            sheds: doc
                .get("sheds")
                .and_then(crate::document::integer)
                .unwrap_or(0),
            eligible_since: match doc.get("notBefore") {
                Some(Bson::DateTime(t)) => Some(t.to_chrono()),
                _ => None,
            },
            id: doc.get_str("_id").map_err(|_| bad("_id"))?.to_owned(),
            url,
            kind,
            pass,
            token,
            expires_at,
            leased_at: now,
            attempt: doc
                .get("attempts")
                .and_then(crate::document::integer)
                .unwrap_or(1),
        }))
    }

    /// The token of a lease this instance id took before `before` (a dead predecessor's), if the
    /// pass has one: the pass's few leased entries are read and filtered here.
    async fn dead_lease(
        &self,
        bot: &BotId,
        pass: i64,
        me: &InstanceId,
        before: DateTime<Utc>,
    ) -> Result<Option<String>> {
        use futures_util::TryStreamExt;
        let leased: Vec<Document> = self
            .bounded("read leases", async {
                self.frontier()
                    .find(doc! { "botId": bot.as_str(), "pass": pass, "status": "leased" })
                    .projection(doc! { "leaseOwner": 1, "leasedAt": 1, "leaseToken": 1 })
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        let dead: Vec<String> = leased
            .into_iter()
            .filter_map(|d| {
                let mine = d.get_str("leaseOwner").ok() == Some(me.as_str());
                let old =
                    matches!(d.get("leasedAt"), Some(Bson::DateTime(t)) if t.to_chrono() < before);
                (mine && old)
                    .then(|| d.get_str("leaseToken").ok().map(str::to_owned))
                    .flatten()
            })
            .collect();
        // A random one: concurrent leasers of this instance then rarely race for the same.
        Ok((!dead.is_empty()).then(|| dead[rand::random_range(0..dead.len())].clone()))
    }

    /// Whether this instance id holds leases of pass `pass` taken before `before` (a dead
    /// predecessor's, left to reclaim).
    pub async fn has_dead_leases(
        &self,
        bot: &BotId,
        pass: i64,
        me: &InstanceId,
        before: DateTime<Utc>,
    ) -> Result<bool> {
        Ok(self.dead_lease(bot, pass, me, before).await?.is_some())
    }

    pub(super) fn lease_fence(lease: &UrlLease) -> Document {
        doc! { "_id": lease.id.as_str(), "status": "leased", "leaseToken": lease.token.as_str() }
    }

    pub(super) async fn fenced_url(
        &self,
        lease: &UrlLease,
        what: &'static str,
        update: Document,
    ) -> Result<()> {
        let result = self
            .bounded(
                what,
                self.frontier().update_one(Self::lease_fence(lease), update),
            )
            .await?;
        if result.matched_count == 1 {
            Ok(())
        } else {
            Err(Error::UrlLeaseLost {
                url: lease.url.to_string(),
            })
        }
    }

    /// The update that marks a leased URL done, keeping what the next pass needs: the page's
    /// validators, its listing fingerprint and the record it produced.
    pub(super) fn done_update(
        lease: &UrlLease,
        record_id: Option<&str>,
        now: DateTime<Utc>,
    ) -> Document {
        let text = |v: Option<&str>| v.map_or(Bson::Null, |s| Bson::String(s.to_owned()));
        let mut set = doc! {
            "status": "done", "doneAt": date(now), "leaseOwner": Bson::Null,
            "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "lastError": Bson::Null,
            "etag": text(lease.validators.etag.as_deref()),
            "lastModified": text(lease.validators.last_modified.as_deref()),
            "fingerprint": text(lease.list_fingerprint.as_deref()),
        };
        if let Some(id) = record_id.or(lease.record_id.as_deref()) {
            set.insert("recordId", id);
        }
        doc! { "$set": set }
    }

    /// Marks a leased URL done — only if the lease is still this worker's.
    pub async fn complete_url(&self, lease: &UrlLease, now: DateTime<Utc>) -> Result<()> {
        self.fenced_url(lease, "complete url", Self::done_update(lease, None, now))
            .await
    }

    /// The update that gives a leased URL back: pending again, or waiting until `not_before`,
    /// with `reason` as its last error and `inc` applied to its counters.
    fn give_back_update(
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
        reason: &str,
        inc: Option<Document>,
    ) -> Document {
        let status = if not_before <= now {
            "pending"
        } else {
            "waiting"
        };
        let mut update = doc! { "$set": {
            "status": status, "notBefore": date(not_before), "leaseOwner": Bson::Null,
            "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "lastError": reason,
        } };
        if let Some(inc) = inc {
            update.insert("$inc", inc);
        }
        update
    }

    /// Gives a leased URL back for another attempt no earlier than `not_before` — only if the
    /// lease is still this worker's. A retry due later waits in the frontier (status `waiting`,
    /// `notBefore`), not in memory; [`Store::promote_due`] makes it pending when its time comes.
    pub async fn retry_url(
        &self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
        reason: &str,
    ) -> Result<()> {
        let update = Self::give_back_update(now, not_before, reason, None);
        self.fenced_url(lease, "retry url", update).await
    }

    /// Gives a leased URL back without counting the attempt (shutdown, a paused host): pending
    /// again, or waiting until `not_before` — only if the lease is still this worker's.
    pub async fn release_url(
        &self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
        reason: &str,
    ) -> Result<()> {
        let inc = doc! { "attempts": -1_i64 };
        let update = Self::give_back_update(now, not_before, reason, Some(inc));
        self.fenced_url(lease, "release url", update).await
    }

    /// Defers a leased URL unfetched (load shedding) until `not_before`, counting the deferral
    /// (a URL is shed at most once a pass) and not the attempt.
    pub async fn shed_url(
        &self,
        lease: &UrlLease,
        now: DateTime<Utc>,
        not_before: DateTime<Utc>,
    ) -> Result<()> {
        let inc = doc! { "attempts": -1_i64, "sheds": 1_i64 };
        let reason = "shed: its host is throttling";
        let update = Self::give_back_update(now, not_before, reason, Some(inc));
        self.fenced_url(lease, "shed url", update).await
    }

    /// Makes the pass's waiting retries whose `notBefore` has come pending again (one write).
    pub async fn promote_due(&self, bot: &BotId, pass: i64, now: DateTime<Utc>) -> Result<u64> {
        use futures_util::TryStreamExt;
        // The waiting entries are few: read them by the index, pick the due ones here.
        let waiting: Vec<Document> = self
            .bounded("read waiting retries", async {
                self.frontier()
                    .find(doc! { "botId": bot.as_str(), "pass": pass, "status": "waiting" })
                    .projection(doc! { "notBefore": 1 })
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        let due: Vec<Bson> = waiting
            .iter()
            .filter(
                |d| matches!(d.get("notBefore"), Some(Bson::DateTime(t)) if t.to_chrono() <= now),
            )
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        if due.is_empty() {
            return Ok(0);
        }
        let frontier = self.frontier();
        let update = frontier.update_many(
            doc! { "_id": { "$in": due }, "status": "waiting" },
            doc! { "$set": { "status": "pending" } },
        );
        Ok(self
            .bounded("promote due retries", update)
            .await?
            .modified_count)
    }

    /// What the frontier knows of these URLs from any pass, by frontier `_id`.
    pub async fn known_pages(
        &self,
        bot: &BotId,
        urls: &[&NormalizedUrl],
    ) -> Result<std::collections::HashMap<String, KnownPage>> {
        use futures_util::TryStreamExt;
        let ids: Vec<String> = urls.iter().map(|u| url_id(bot, u)).collect();
        let mut known = std::collections::HashMap::with_capacity(ids.len());
        for chunk in ids.chunks(1000) {
            let found: Vec<Document> = self
                .bounded("read known pages", async {
                    self.frontier()
                        .find(doc! { "_id": { "$in": chunk } })
                        .projection(
                            doc! { "pass": 1, "status": 1, "fingerprint": 1, "recordId": 1 },
                        )
                        .await?
                        .try_collect()
                        .await
                })
                .await?;
            for doc in found {
                let Ok(id) = doc.get_str("_id") else { continue };
                known.insert(
                    id.to_owned(),
                    KnownPage {
                        pass: doc
                            .get("pass")
                            .and_then(crate::document::integer)
                            .unwrap_or(0),
                        status: doc.get_str("status").unwrap_or_default().to_owned(),
                        fingerprint: doc.get_str("fingerprint").ok().map(str::to_owned),
                        record_id: doc.get_str("recordId").ok().map(str::to_owned),
                    },
                );
            }
        }
        Ok(known)
    }

    /// The highest pass any of the bot's URLs is in (0 when none): a new pass numbers above it.
    pub async fn highest_pass(&self, bot: &BotId) -> Result<i64> {
        let top = self
            .bounded(
                "highest pass",
                self.frontier()
                    .find_one(doc! { "botId": bot.as_str() })
                    .sort(doc! { "botId": 1, "pass": -1 })
                    .projection(doc! { "pass": 1 }),
            )
            .await?;
        Ok(top
            .and_then(|d| d.get("pass").and_then(crate::document::integer))
            .unwrap_or(0))
    }

    /// Marks a leased URL failed with its reason — only if the lease is still this worker's.
    pub async fn fail_url(&self, lease: &UrlLease, now: DateTime<Utc>, reason: &str) -> Result<()> {
        let update = doc! { "$set": {
            "status": "failed", "doneAt": date(now), "leaseOwner": Bson::Null,
            "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "lastError": reason,
        } };
        self.fenced_url(lease, "fail url", update).await
    }

    /// True while any URL of the pass is pending or leased (by anyone): two bounded index
    /// lookups, cheap enough for every idle worker, where [`Store::pass_progress`] counts all.
    pub async fn pass_has_work(&self, bot: &BotId, pass: i64) -> Result<bool> {
        for status in ["pending", "leased", "waiting"] {
            let found = self
                .bounded(
                    "pass has work",
                    self.frontier()
                        .find_one(doc! { "botId": bot.as_str(), "pass": pass, "status": status })
                        .projection(doc! { "_id": 1 }),
                )
                .await?;
            if found.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Counts pass `pass`'s URLs by status (leases past their expiry still count as leased until
    /// someone re-leases them: the pass waits for them).
    /// Up to `limit` failed URLs of a pass with their reasons (for `seedlock crawl`'s summary).
    pub async fn failed_urls(
        &self,
        bot: &BotId,
        pass: i64,
        limit: i64,
    ) -> Result<Vec<(String, String)>> {
        use futures_util::TryStreamExt;
        let failed: Vec<Document> = self
            .bounded("read failed urls", async {
                self.frontier()
                    .find(doc! { "botId": bot.as_str(), "pass": pass, "status": "failed" })
                    .projection(doc! { "url": 1, "lastError": 1 })
                    .limit(limit)
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        Ok(failed
            .iter()
            .map(|d| {
                (
                    d.get_str("url").unwrap_or("?").to_owned(),
                    d.get_str("lastError").unwrap_or("").to_owned(),
                )
            })
            .collect())
    }

    pub async fn pass_progress(&self, bot: &BotId, pass: i64) -> Result<PassProgress> {
        // The same one aggregation that ends a pass; its coverage figures are not needed here.
        Ok(self.pass_coverage(bot, pass).await?.0)
    }
}
