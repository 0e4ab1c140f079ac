//! Handing out work: the lease queries by host, priority and slot, the batched lease write
//! fenced on `status: pending`, the read-back of a write whose answer was lost, waiting entries
//! promoted when due, and the live leases counted.

use super::*;

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

/// How long a lease write may wait on the server (`maxTimeMS`) for documents an open
/// transaction holds before it gives up on them.
pub(crate) const LEASE_WRITE_MAX_TIME: Duration = Duration::from_secs(2);

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
pub(super) const LEASE_WRITE_WAIT: Duration = Duration::from_secs(3);

/// The lease this worker took of `doc` (as read before the take; `attempts` before it).
pub(super) fn lease_of(
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
        depth: depth_of(doc),
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
pub(super) fn whole_batch(n: usize) -> u32 {
    u32::try_from(n.saturating_add(1)).unwrap_or(u32::MAX)
}

/// The fields a lease read needs.
pub(super) fn lease_projection() -> Document {
    doc! {
        f::URL: 1, f::KIND: 1, f::ATTEMPTS: 1, f::ETAG: 1, f::LAST_MODIFIED: 1,
        f::LIST_FINGERPRINT: 1, f::RECORD_ID: 1, f::PRIORITY: 1, f::SHEDS: 1, f::NOT_BEFORE: 1,
        f::HOST: 1, f::SLOT: 1, f::LEASE_TOKEN: 1, f::STATUS: 1, f::DEPTH: 1,
    }
}

impl Frontier<'_> {
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
        let expires_at = crate::store::plus(now, lease_for);
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

    /// Makes the pass's waiting retries whose `notBefore` has come pending again (one write).
    pub(crate) async fn promote_due(
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

    /// URLs of the bot leased by anyone whose lease has not run out.
    pub(crate) async fn live_leases(self, bot: &BotId, now: DateTime<Utc>) -> Result<u64> {
        use super::field as fr;
        self.store
            .bounded(
                "count live leases",
                self.collection().count_documents(doc! {
                    fr::BOT: bot.as_str(),
                    fr::STATUS: "leased",
                    fr::LEASE_EXPIRES_AT: { "$gt": crate::store::date(now) },
                }),
            )
            .await
    }
}
