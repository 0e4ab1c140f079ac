//! Adding URLs to a pass: new links inserted (or enqueued already leased to this instance, so a
//! pagination hop needs no lease query), links of earlier passes reset, and the one-write upsert
//! of the links a listing page shows.

use super::*;

/// What [`Frontier::take_leases`] should take: pending candidates, leases past their expiry, and
/// leases a dead predecessor of this instance id still holds (by their token).
#[derive(Clone, Debug, Default)]
pub struct Takes<'a> {
    pub pending: &'a [Candidate],
    pub expired: &'a [String],
    pub reclaim: &'a [(String, String)],
}

/// A link new to the frontier, being inserted.
pub(super) struct Insert<'a> {
    pub(super) link: &'a NewUrl,
    /// Its frontier id.
    pub(super) id: String,
    /// Whether it is leased to the taker on enqueue.
    pub(super) leased: bool,
}

/// A link of an earlier pass being enqueued again.
pub(super) struct Reset<'a> {
    pub(super) link: &'a NewUrl,
    /// Its frontier id.
    pub(super) id: String,
    /// Whether it is leased to the taker on enqueue.
    pub(super) leased: bool,
    /// What the frontier knew of it.
    pub(super) known: &'a KnownPage,
}

/// An enqueue's writer and what it takes: the bot, the pass and the time, and — when the write
/// leases links as it enqueues them — their owner, a fresh token and the expiry. It writes every
/// new or reset entry's fields and the leases it took, the same for every kind of enqueue.
pub(super) struct Taking<'a> {
    bot: &'a BotId,
    pass: PassNumber,
    owner: Option<&'a str>,
    token: String,
    expires_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
}

impl<'a> Taking<'a> {
    pub(super) fn new(
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
            expires_at: lease.map(|l| crate::store::plus(now, l.lease_for)),
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
            f::DEPTH: i64::from(link.depth),
        };
        for (name, value) in self.lease_fields(leased) {
            entry.insert(name, value);
        }
        entry
    }

    /// The lease taken on `link` (frontier id `id`) as it was enqueued; an entry reset from an
    /// earlier pass (`known`) keeps its validators and record id.
    pub(super) fn lease(&self, link: &NewUrl, id: &str, known: Option<&KnownPage>) -> UrlLease {
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
            depth: link.depth,
            eligible_since: Some(self.now),
        }
    }
}

/// The `update` statement that resets `chunk` (links of earlier passes) into the pass of
/// `taking` — one statement, per-link values picked by `_id`; the links to lease leased to its
/// owner. Filtered on `pass < current`: sent twice, the second matches nothing.
pub(super) fn reset_statement(taking: &Taking<'_>, chunk: &[Reset<'_>]) -> Document {
    let (bot, pass) = (taking.bot, taking.pass);
    let ids: Vec<Bson> = chunk.iter().map(|r| Bson::String(r.id.clone())).collect();
    let filter = doc! { f::ID: { "$in": &ids }, f::BOT: bot.as_str(), f::PASS: { "$lt": pass } };
    // Links leased here and alike in everything else the reset sets (the last pass's listing
    // pages, leased into this one): a plain `$set` of the entry as `Taking::entry` writes it —
    // a pipeline of per-link columns costs the server an evaluation of every column for every
    // entry — with one random slot for the chunk. (Not for pending links: the lease queries
    // sample pending entries by slot, and a hundred in one slot would make that lumpy.)
    let alike = |a: &Reset<'_>, b: &Reset<'_>| {
        (
            a.link.kind,
            a.link.priority,
            &a.link.fingerprint,
            a.link.depth,
        ) == (
            b.link.kind,
            b.link.priority,
            &b.link.fingerprint,
            b.link.depth,
        )
    };
    if chunk.iter().all(|r| r.leased) && chunk.windows(2).all(|w| alike(&w[0], &w[1])) {
        if let Some(first) = chunk.first() {
            let mut set = taking.entry(first.link, true);
            // Each link's own fields stay as its entry holds them.
            for own in [f::URL, f::HOST] {
                set.remove(own);
            }
            return doc! { "q": filter, "u": { "$set": set }, "multi": true };
        }
    }
    let column = |value: &dyn Fn(&Reset<'_>) -> Bson| pick(&ids, chunk.iter().map(value).collect());
    let mut set = doc! {
        f::KIND: column(&|r| Bson::String(r.link.kind.as_str().into())),
        f::PASS: pass,
        f::ATTEMPTS: column(&|r| Bson::Int64(i64::from(r.leased))),
        f::SHEDS: 0_i64,
        f::LAST_ERROR: Bson::Null,
        f::ENQUEUED_AT: date(taking.now),
        f::NOT_BEFORE: date(taking.now),
        f::SLOT: column(&|_| Bson::Int64(i64::from(rand::random_range(0..SLOTS)))),
        f::PRIORITY: column(&|r| Bson::Int64(r.link.priority)),
        f::LIST_FINGERPRINT: column(&|r| text(r.link.fingerprint.as_deref())),
        f::DEPTH: column(&|r| Bson::Int64(i64::from(r.link.depth))),
    };
    if chunk.iter().any(|r| r.leased) {
        for name in [
            f::STATUS,
            f::LEASE_OWNER,
            f::LEASE_TOKEN,
            f::LEASE_EXPIRES_AT,
            f::LEASED_AT,
        ] {
            let value = column(&|r| {
                taking
                    .lease_fields(r.leased)
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

impl Frontier<'_> {
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
                depth: 0,
            })
            .collect();
        self.enqueue_urls(bot, pass, &urls, now).await
    }

    /// Adds `urls` to pass `pass`: new URLs are inserted pending; URLs last crawled in an earlier
    /// pass become pending again (keeping their validators and record id); URLs already in this
    /// pass are left alone. Returns how many were added or reset.
    pub(crate) async fn enqueue_urls(
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
        let mut inserts: Vec<Insert<'_>> = Vec::new();
        let mut resets: Vec<Reset<'_>> = Vec::new();
        for (i, link) in links.iter().enumerate() {
            let id = url_id(bot, &link.url);
            if !seen.insert(id.clone()) {
                continue;
            }
            let leased = i < first && taking.owner.is_some();
            match known.get(&id) {
                Some(k) if k.pass >= pass => {}
                Some(known) => resets.push(Reset {
                    link,
                    id,
                    leased,
                    known,
                }),
                None => inserts.push(Insert { link, id, leased }),
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
        chunk: &[Insert<'_>],
        out: &mut Enqueued,
    ) -> Result<()> {
        let docs: Vec<Document> = chunk
            .iter()
            .map(|new| {
                let mut entry = taking.entry(new.link, new.leased);
                entry.insert(f::ID, new.id.as_str());
                if !new.leased {
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
            .filter(|(_, new)| new.leased)
            .map(|(i, new)| (i, new.link, new.id.as_str()));
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
        let leased: Vec<&Reset<'_>> = chunk.iter().filter(|r| r.leased).collect();
        if leased.is_empty() {
            return Ok(());
        }
        // Every reset matched: every leased one is ours. Otherwise another instance reset some
        // first: read which carry our token.
        let ours = if matched == chunk.len() {
            None
        } else {
            let ids = leased.iter().map(|r| r.id.as_str());
            Some(self.ours_after_all(bot, ids, &taking.token).await?)
        };
        for r in leased {
            if ours.as_ref().is_none_or(|o| o.contains(&r.id)) {
                out.leased.push(taking.lease(r.link, &r.id, Some(r.known)));
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
    ///
    /// The leases are made here, before the write is sent (a fresh token, `me`, the expiry):
    /// `ahead` gets them first, so their pages can be fetched while the write is on its way; the
    /// answer's `leased` says which the write took (the others are not this instance's).
    pub(crate) async fn upsert_links(
        self,
        bot: &BotId,
        pass: PassNumber,
        links: &[NewUrl],
        lease: LeaseTo<'_>,
        now: DateTime<Utc>,
        ahead: impl FnOnce(Vec<UrlLease>),
    ) -> Result<Enqueued> {
        let mut out = Enqueued::default();
        if links.is_empty() {
            ahead(Vec::new());
            return Ok(out);
        }
        let taking = Taking::new(bot, pass, Some(&lease), now);
        ahead(
            links
                .iter()
                .take(lease.first)
                .map(|link| taking.lease(link, &url_id(bot, &link.url), None))
                .collect(),
        );
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
pub(super) fn lease_statements(
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
            depth: 0,
        };
        let leased: Vec<Reset<'_>> = vec![
            Reset {
                link: &one,
                id: "1".into(),
                leased: true,
                known: &known,
            },
            Reset {
                link: &two,
                id: "2".into(),
                leased: true,
                known: &known,
            },
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
            Reset {
                link: &one,
                id: "1".into(),
                leased: false,
                known: &known,
            },
            Reset {
                link: &two,
                id: "2".into(),
                leased: false,
                known: &known,
            },
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
            Reset {
                link: &one,
                id: "1".into(),
                leased: true,
                known: &known,
            },
            Reset {
                link: &two,
                id: "2".into(),
                leased: false,
                known: &known,
            },
        ];
        assert!(reset_statement(&taking, &mixed).get_array("u").is_ok());
    }
}
