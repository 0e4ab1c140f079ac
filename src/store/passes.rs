//! Crawl passes, as the bot document records them (`crawlPass`, `crawlPassStartedAt`,
//! `crawlPassEndedAt`, `crawlLastRunAt`, `crawlLastPass`): starting a pass, finishing it (with
//! deletion detection), and the figures `seedlock status` shows.
//!
//! A pass starts in two steps, in this order: its seeds are enqueued into the frontier under the
//! new number (idempotent: any instance may repeat it), then one conditional write moves
//! `crawlPass` to that number — the refresh holder's fenced `complete`, or [`Passes::start`]
//! for a bot that never crawled. So no instance ever sees a pass whose seeds are not queued yet.
//!
//! A pass finishes when none of its URLs is pending, waiting or leased by anyone. One conditional
//! write (`crawlPass` unchanged, `crawlPassEndedAt` unset) records the end — so the last-run mark
//! is saved only after every record write of the pass was committed — and claims the pass's
//! deletion evaluation for the instance whose write won (`crawlLastPass.evaluation: "pending"`,
//! `evaluatingBy`, `evaluatingUntil`). That instance evaluates the pass from the listing
//! manifests (`store::deletions`: removals only when the pass covered enough of its listing pages
//! and failed few enough pages, in the modes that read every listing page; restorations always)
//! and records what it did (`evaluation: "done"`, `removed`, `restored`). A claim whose holder
//! died is taken over once it expires ([`Passes::resume_evaluation`]).

use crate::ids::PassNumber;
use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};

use super::frontier::{
    field as fr, read_since, unreached_listings_filters, KnownPage, NewUrl, PageKind, PassProgress,
    UrlStatus,
};
use super::Store;
use crate::error::Result;
use crate::ids::{BotId, InstanceId};
use crate::lock::bot::{BotDoc, PassSpec};
use crate::store::document::field;
use crate::urls::NormalizedUrl;

/// The thresholds deletion detection runs under (`crawl.min_coverage`, `crawl.max_error_rate`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeletionRules {
    /// False in modes that do not read every listing page (watermark): nothing is removed then.
    pub enabled: bool,
    pub min_coverage: f64,
    pub max_error_rate: f64,
    /// When the last completed pass started: listing pages read since then but not reached by
    /// this pass count against its coverage (a broken pagination chain — one failed listing
    /// page — hides every page after it from this pass's own count).
    pub known_since: Option<DateTime<Utc>>,
    /// When the pass is gated instead of released (the drift gate).
    pub drift: crate::config::DriftRules,
}

impl DeletionRules {
    /// Why a finished pass with this coverage and error rate removes nothing; `None` when it
    /// may.
    fn skipped(&self, coverage: f64, error_rate: f64) -> Option<String> {
        if !self.enabled {
            Some("this incremental mode does not read every listing page".to_owned())
        } else if coverage < self.min_coverage {
            Some(format!(
                "listing coverage {:.1}% is under {:.1}%",
                coverage * 100.0,
                self.min_coverage * 100.0
            ))
        } else if error_rate > self.max_error_rate {
            Some(format!(
                "error rate {:.1}% is over {:.1}%",
                error_rate * 100.0,
                self.max_error_rate * 100.0
            ))
        } else {
            None
        }
    }
}

/// `part / whole`, 0 of nothing.
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// A pass's figures when it ended.
#[derive(Clone, Debug, PartialEq)]
pub struct PassEnd {
    pub pass: PassNumber,
    pub progress: PassProgress,
    /// Listing (and seed) pages done / all listing pages of the pass.
    pub coverage: f64,
    /// Failed pages / all pages of the pass.
    pub error_rate: f64,
    /// Records this call marked removed.
    pub removed: u64,
    /// Records this call restored (marked removed earlier, listed again).
    pub restored: u64,
    /// Why deletion detection did not run, if it did not.
    pub deletion_skipped: Option<String>,
    /// True for the instance whose write recorded the end (the others found it recorded).
    pub recorded: bool,
    /// What the end did to the change feed (for the instance that recorded it).
    pub judged: Box<super::release::Judged>,
    /// False when the count found work left after all: the pass goes on.
    pub finished: bool,
}

/// What `seedlock status` shows of a bot's current pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct PassReport {
    pub pass: PassNumber,
    pub progress: PassProgress,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    pub oldest_pending: Option<DateTime<Utc>>,
    /// The most common reason its failed pages failed for (with their count and an example).
    pub top_failure: Option<super::frontier::FailureReason>,
}

use super::date;

/// A listing entry's URL, when it parses (one written by hand may not: passed over).
fn url_of(entry: &bson::RawDocument) -> Option<NormalizedUrl> {
    NormalizedUrl::parse(entry.get_str(fr::URL).ok()?).ok()
}

/// A listing page an earlier pass read and this one has not reached yet.
#[derive(Clone, Debug)]
pub(crate) struct UnreachedPage {
    pub url: NormalizedUrl,
    /// Its frontier id.
    pub id: String,
    /// What its entry holds (validators, pass, status), to lease it from its entry.
    pub known: KnownPage,
}

/// A bot's passes, reached through [`Store::passes`].
#[derive(Clone, Copy, Debug)]
pub struct Passes<'a> {
    pub(super) store: &'a Store,
}

impl Passes<'_> {
    /// Enqueues `seeds` into the pass after `current` (numbered above every pass the frontier
    /// has seen, so a repaired document never reuses a number) and returns that pass. The caller
    /// then records it in the bot document with one conditional write.
    pub async fn prepare(
        self,
        bot: &BotId,
        current: PassNumber,
        seeds: &[NormalizedUrl],
        now: DateTime<Utc>,
    ) -> Result<PassNumber> {
        let urls: Vec<NewUrl> = seeds
            .iter()
            .map(|url| NewUrl {
                url: url.clone(),
                kind: PageKind::Seed,
                fingerprint: None,
                priority: PageKind::Seed.default_priority(),
                depth: 0,
            })
            .collect();
        // What the frontier holds of the seeds (any pass) is read beside the highest pass: one
        // round trip, not two, before the enqueue.
        let frontier = self.store.frontier();
        let seed_urls: Vec<&NormalizedUrl> = seeds.iter().collect();
        let (highest, known) = tokio::try_join!(
            frontier.highest_pass_above(bot, current),
            frontier.known_pages(bot, &seed_urls)
        )?;
        let next = highest.next();
        frontier
            .enqueue_links(bot, next, &urls, &known, None, now)
            .await?;
        Ok(next)
    }

    /// Starts the first pass of a ready bot that has none yet (`crawlPass` unset or 0): one
    /// instance's conditional write wins; the others' seeds enqueues were no-ops. Returns the
    /// pass number when this call started it.
    pub(crate) async fn start(
        self,
        bot: &BotId,
        current: PassNumber,
        seeds: &[NormalizedUrl],
        now: DateTime<Utc>,
        pass: &PassSpec,
    ) -> Result<Option<PassNumber>> {
        let pass_fields = super::document::pass_spec_fields(pass);
        let mut filter = doc! { field::ID: bot.as_str(), field::IS_READY: true };
        if current == PassNumber::NONE {
            filter.insert(
                "$or",
                vec![
                    doc! { field::CRAWL_PASS: { "$exists": false } },
                    doc! { field::CRAWL_PASS: Bson::Null },
                    doc! { field::CRAWL_PASS: 0_i64 },
                ],
            );
        } else {
            filter.insert(field::CRAWL_PASS, current);
        }
        self.move_to_next_pass("start pass", bot, current, seeds, filter, now, pass_fields)
            .await
    }

    /// Starts the pass after `current`, which has ended while a refresh asked for the next
    /// (`crawlNextPassAt`): its seeds are enqueued, then one conditional write (the pass
    /// unchanged, ended, the next asked for) moves `crawlPass`. Returns the pass number when this
    /// call started it.
    pub(crate) async fn start_next(
        self,
        bot: &BotId,
        current: PassNumber,
        seeds: &[NormalizedUrl],
        now: DateTime<Utc>,
        pass: &PassSpec,
    ) -> Result<Option<PassNumber>> {
        let pass_fields = super::document::pass_spec_fields(pass);
        let filter = doc! {
            field::ID: bot.as_str(),
            field::CRAWL_PASS: current,
            field::CRAWL_PASS_ENDED_AT: { "$ne": Bson::Null },
            field::CRAWL_NEXT_PASS_AT: { "$ne": Bson::Null },
        };
        self.move_to_next_pass(
            "start the next pass",
            bot,
            current,
            seeds,
            filter,
            now,
            pass_fields,
        )
        .await
    }

    /// A pass's start after `current`: the seeds enqueued under the next number first, then one
    /// write, conditional on `filter`, moves `crawlPass` there (clearing its end and any waiting
    /// next pass). The pass number when this call's write won.
    #[allow(clippy::too_many_arguments)]
    async fn move_to_next_pass(
        self,
        what: &'static str,
        bot: &BotId,
        current: PassNumber,
        seeds: &[NormalizedUrl],
        filter: Document,
        now: DateTime<Utc>,
        pass_fields: Document,
    ) -> Result<Option<PassNumber>> {
        let next = self.prepare(bot, current, seeds, now).await?;
        let mut set = pass_fields;
        set.insert(field::CRAWL_PASS, next);
        set.insert(field::CRAWL_PASS_ENDED_AT, Bson::Null);
        set.insert(field::CRAWL_NEXT_PASS_AT, Bson::Null);
        let update = doc! {
            "$set": set,
            "$currentDate": { field::CRAWL_PASS_STARTED_AT: true },
        };
        let result = self
            .store
            .bounded(what, self.store.bots.update_one(filter, update))
            .await?;
        Ok((result.modified_count == 1).then_some(next))
    }

    /// Counts a pass's URLs by kind and status, in one aggregation: its progress, and (listing
    /// pages, listing pages done, all pages, failed pages).
    pub(super) async fn coverage(
        self,
        bot: &BotId,
        pass: PassNumber,
    ) -> Result<(PassProgress, (u64, u64, u64, u64))> {
        use futures_util::TryStreamExt;
        let pipeline = [
            doc! { "$match": { fr::BOT: bot.as_str(), fr::PASS: pass } },
            doc! { "$group": {
                "_id": { "kind": format!("${}", fr::KIND), "status": format!("${}", fr::STATUS) },
                "n": { "$sum": 1 },
            } },
        ];
        let rows: Vec<Document> = self
            .store
            .bounded_scan("pass coverage", async {
                self.store
                    .frontier()
                    .collection()
                    .aggregate(pipeline)
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        let mut progress = PassProgress::default();
        let (mut lists, mut lists_done, mut all, mut failed) = (0, 0, 0, 0);
        for row in rows {
            let n = row
                .get("n")
                .and_then(crate::store::document::integer)
                .unwrap_or(0)
                .max(0) as u64;
            let key = row.get_document("_id").cloned().unwrap_or_default();
            let kind = key.get_str("kind").ok().and_then(PageKind::parse);
            let status = key.get_str("status").ok().and_then(UrlStatus::parse);
            all += n;
            match status {
                Some(UrlStatus::Pending) => progress.pending += n,
                Some(UrlStatus::Waiting) => progress.waiting += n,
                Some(UrlStatus::Leased) => progress.leased += n,
                Some(UrlStatus::Done) => progress.done += n,
                Some(UrlStatus::Failed) => {
                    progress.failed += n;
                    failed += n;
                }
                None => {}
            }
            if kind.is_some_and(PageKind::is_listing) {
                lists += n;
                if status == Some(UrlStatus::Done) {
                    lists_done += n;
                }
            }
        }
        Ok((progress, (lists, lists_done, all, failed)))
    }

    /// Adds `dropped` (URLs a crawl-trap bound dropped, by bound name) to pass `pass`'s counts
    /// in the bot document: an `$inc` of this pass's counts, or — the first drop of the pass —
    /// a `$set` that starts them (while `pass` is the bot's current one). One write per page
    /// that drops a URL; none otherwise.
    pub async fn add_dropped(
        self,
        bot: &BotId,
        pass: PassNumber,
        dropped: &[(&str, u64)],
    ) -> Result<()> {
        if dropped.is_empty() {
            return Ok(());
        }
        let at = |k: &str| format!("{}.{k}", field::CRAWL_PASS_DROPPED);
        let mut inc = Document::new();
        let mut fresh = doc! { "pass": pass };
        for (bound, n) in dropped {
            inc.insert(at(bound), i64::try_from(*n).unwrap_or(i64::MAX));
            fresh.insert(*bound, i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let this_pass = doc! { field::ID: bot.as_str(), at("pass"): pass };
        let bots = &self.store.bots;
        for _ in 0..2 {
            let added = self
                .store
                .bounded(
                    "count dropped URLs",
                    bots.update_one(this_pass.clone(), doc! { "$inc": inc.clone() }),
                )
                .await?;
            if added.matched_count == 1 {
                return Ok(());
            }
            let started = self
                .store
                .bounded(
                    "count dropped URLs",
                    bots.update_one(
                        doc! {
                            field::ID: bot.as_str(),
                            field::CRAWL_PASS: pass,
                            at("pass"): { "$ne": pass },
                        },
                        doc! { "$set": { field::CRAWL_PASS_DROPPED: fresh.clone() } },
                    ),
                )
                .await?;
            if started.matched_count == 1 {
                return Ok(());
            }
            // Another instance started the counts meanwhile (then the `$inc` matches), or the
            // pass is over (then neither does, and there is nothing to count into).
        }
        Ok(())
    }

    /// What the crawl-trap bounds dropped in pass `pass`, by bound name (none recorded: empty).
    pub async fn dropped(self, bot: &BotId, pass: PassNumber) -> Result<Vec<(String, u64)>> {
        let found = self
            .store
            .bounded(
                "read dropped URLs",
                self.store
                    .bots
                    .find_one(doc! { field::ID: bot.as_str() })
                    .projection(doc! { field::CRAWL_PASS_DROPPED: 1 }),
            )
            .await?;
        Ok(found
            .as_ref()
            .and_then(|d| dropped_of(d, pass))
            .unwrap_or_default())
    }

    /// Ends pass `pass` (the caller saw nothing pending or leased): the conditional write that
    /// records the end, then (by its winner) deletion detection. Safe to run on several
    /// instances at once, and on a pass a refresh has replaced (then it does nothing).
    pub async fn finish(
        self,
        bot: &BotId,
        pass: PassNumber,
        started_at: Option<DateTime<Utc>>,
        rules: DeletionRules,
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<PassEnd> {
        let t0 = std::time::Instant::now();
        // Read side by side (one round trip, not four, at the end of every pass): what the end
        // records needs all of them once the count says the pass is over, which it almost
        // always does here.
        let unreached = async {
            match (rules.enabled, rules.known_since) {
                (true, Some(since)) => self.unreached_lists(bot, pass, since).await,
                _ => Ok(0),
            }
        };
        let ((progress, (mut lists, lists_done, all, failed)), unreached, dropped, sweep) = tokio::try_join!(
            self.coverage(bot, pass),
            unreached,
            self.dropped(bot, pass),
            self.needs_sweep(bot),
        )?;
        tracing::debug!(%bot, pass = pass.get(), took = ?t0.elapsed(), "pass end: counted");
        if rules.enabled && progress.is_finished() {
            lists += unreached;
        }
        let coverage = share(lists_done, lists);
        let error_rate = share(failed, all);
        if !progress.is_finished() {
            // Work appeared between the caller's look and this count (a retry came due, say):
            // the pass goes on; nothing is recorded.
            return Ok(PassEnd {
                pass,
                progress,
                coverage,
                error_rate,
                removed: 0,
                restored: 0,
                deletion_skipped: Some("the pass is not finished".to_owned()),
                recorded: false,
                judged: Box::default(),
                finished: false,
            });
        }
        let bounded: Vec<String> = dropped
            .iter()
            .filter(|(bound, _)| bound == "max_pages" || bound == "max_pages_per_host")
            .map(|(bound, n)| format!("{bound} ({n} URLs not crawled)"))
            .collect();
        let deletion_skipped = if bounded.is_empty() {
            rules.skipped(coverage, error_rate)
        } else {
            Some(format!(
                "the pass is incomplete: it hit {}",
                bounded.join(" and ")
            ))
        };
        let summary = doc! {
            "sweep": sweep,
            "pass": pass,
            "pages": all as i64,
            "done": progress.done as i64,
            "failed": progress.failed as i64,
            "listCoverage": coverage,
            "errorRate": error_rate,
            "dropped": dropped.iter().map(|(k, n)| (k.clone(), Bson::Int64(i64::try_from(*n).unwrap_or(i64::MAX)))).collect::<Document>(),
            "deletion": deletion_skipped.clone().map_or_else(|| Bson::String("applied".into()), |why| Bson::String(format!("skipped: {why}"))),
            "endedAt": date(now),
            "evaluation": "pending",
            "evaluatingBy": me.as_str(),
            "evaluatingUntil": date(super::plus(now, self.evaluation_claim())),
            "drift": drift_doc(&rules.drift),
        };
        // The feed's state read beside the write (its evaluation, if this write wins, needs it).
        let (recorded, feed) = tokio::try_join!(
            self.record_end(bot, pass, summary, started_at),
            self.feed_state(bot)
        )?;
        tracing::debug!(%bot, pass = pass.get(), took = ?t0.elapsed(), recorded, "pass end: recorded");
        // The evaluation only by the instance whose write ended the pass: that write proves the
        // pass was still the bot's current one and complete. (An instance still working on a
        // pass a refresh has replaced must not mark the records it cut short as removed.) A crash
        // here loses nothing: another instance takes the claim over once it expires, or the next
        // complete pass evaluates everything since the last evaluation that finished.
        let mut evaluation = super::deletions::Evaluation::default();
        let mut judged = super::release::Judged::default();
        if recorded {
            (evaluation, judged) = self
                .evaluate_and_record(
                    bot,
                    pass,
                    deletion_skipped.is_none(),
                    sweep,
                    &rules.drift,
                    Some(feed),
                    now,
                )
                .await?;
        }
        Ok(PassEnd {
            pass,
            progress,
            coverage,
            error_rate,
            removed: evaluation.removed,
            restored: evaluation.restored,
            deletion_skipped,
            recorded,
            judged: Box::new(judged),
            finished: true,
        })
    }

    /// Whether the last pass was evaluated by a version before the manifests (no `evaluation`
    /// field), or its upgrade sweep never finished: then this evaluation sweeps.
    async fn needs_sweep(self, bot: &BotId) -> Result<bool> {
        let previous = self
            .store
            .bounded(
                "read the last pass",
                self.store
                    .bots
                    .find_one(doc! { field::ID: bot.as_str() })
                    .projection(doc! { field::CRAWL_LAST_PASS: 1 }),
            )
            .await?;
        Ok(previous
            .as_ref()
            .and_then(|b| b.get_document(field::CRAWL_LAST_PASS).ok())
            .is_some_and(|last| {
                !last.contains_key("evaluation") || last.get_bool("sweep") == Ok(true)
            }))
    }

    /// Ends pass `pass` with its report `summary` — if it is still the bot's current pass and not
    /// ended: true for the one write that did.
    async fn record_end(
        self,
        bot: &BotId,
        pass: PassNumber,
        summary: Document,
        started_at: Option<DateTime<Utc>>,
    ) -> Result<bool> {
        let filter = doc! {
            field::ID: bot.as_str(),
            field::CRAWL_PASS: pass,
            field::CRAWL_PASS_ENDED_AT: Bson::Null,
        };
        let mut set = doc! { field::CRAWL_LAST_PASS: summary };
        if let Some(started) = started_at {
            set.insert(field::CRAWL_LAST_RUN_AT, date(started));
        }
        let update = doc! { "$set": set, "$currentDate": { field::CRAWL_PASS_ENDED_AT: true } };
        Ok(self
            .store
            .bounded("finish pass", self.store.bots.update_one(filter, update))
            .await?
            .modified_count
            == 1)
    }

    /// Listing pages (and seeds) read since `since` that pass `pass` did not enqueue: their
    /// frontier entries still carry an earlier pass. Counted at the end of a pass.
    pub async fn unreached_lists(
        self,
        bot: &BotId,
        pass: PassNumber,
        since: DateTime<Utc>,
    ) -> Result<u64> {
        let mut n = 0;
        self.each_unreached(
            "count unreached listing pages",
            bot,
            pass,
            since,
            doc! { fr::STATUS: 1, fr::DONE_AT: 1 },
            |_| n += 1,
        )
        .await?;
        Ok(n)
    }

    /// The listing pages counted by [`Passes::unreached_lists`], by URL (to enqueue them).
    pub async fn unreached_list_urls(
        self,
        bot: &BotId,
        pass: PassNumber,
        since: DateTime<Utc>,
    ) -> Result<Vec<NormalizedUrl>> {
        let mut urls = Vec::new();
        self.each_unreached(
            "read unreached listing pages",
            bot,
            pass,
            since,
            doc! { fr::URL: 1, fr::STATUS: 1, fr::DONE_AT: 1 },
            |entry| urls.extend(url_of(entry)),
        )
        .await?;
        Ok(urls)
    }

    /// The listing pages counted by [`Passes::unreached_lists`], each with its frontier id and
    /// what its entry holds (to lease them into the pass from their entries).
    pub(crate) async fn unreached_list_pages(
        self,
        bot: &BotId,
        pass: PassNumber,
        since: DateTime<Utc>,
    ) -> Result<Vec<UnreachedPage>> {
        let mut pages = Vec::new();
        self.each_unreached(
            "read unreached listing pages",
            bot,
            pass,
            since,
            KnownPage::projection(&[fr::URL, fr::DONE_AT]),
            |entry| {
                let id = entry.get_str(fr::ID).ok().map(str::to_owned);
                if let (Some(url), Some(id)) = (url_of(entry), id) {
                    pages.push(UnreachedPage {
                        url,
                        id,
                        known: KnownPage::from_raw(entry),
                    });
                }
            },
        )
        .await?;
        Ok(pages)
    }

    /// Streams to `visit` the listing entries an earlier pass than `pass` read, done, since
    /// `since` (read with `projection`, which holds `status` and `doneAt`): one read per listing
    /// kind on the listing pages' index, the time and status checked here (see
    /// [`listing_filters`](super::frontier::listing_filters)).
    async fn each_unreached(
        self,
        what: &'static str,
        bot: &BotId,
        pass: PassNumber,
        since: DateTime<Utc>,
        projection: Document,
        mut visit: impl FnMut(&bson::RawDocument),
    ) -> Result<()> {
        self.store
            .frontier()
            .each_listing(
                what,
                unreached_listings_filters(bot, pass),
                projection,
                None,
                |entry| {
                    if read_since(entry, since) {
                        visit(entry);
                    }
                    Ok(())
                },
            )
            .await
    }

    /// How long an instance's claim on a pass's evaluation holds before another may take it over.
    fn evaluation_claim(self) -> std::time::Duration {
        (self.store.op_timeout * 6).max(std::time::Duration::from_secs(30))
    }

    /// Evaluates pass `pass` ([`Deletions::evaluate`]) and records what it did in
    /// `crawlLastPass` (while it is still this pass's). `feed`: the feed's state as the caller
    /// read it at the pass's end (`None`: read here).
    #[allow(clippy::too_many_arguments)]
    async fn evaluate_and_record(
        self,
        bot: &BotId,
        pass: PassNumber,
        remove: bool,
        sweep: bool,
        drift: &crate::config::DriftRules,
        feed: Option<super::release::FeedState>,
        now: DateTime<Utc>,
    ) -> Result<(super::deletions::Evaluation, super::release::Judged)> {
        let feed = match feed {
            Some(feed) => feed,
            None => self.feed_state(bot).await?,
        };
        self.settle_earlier(bot, pass, &feed, now).await?;
        // Read again if an earlier gate was settled just now (its release moved the fill).
        let feed = if feed.gate.is_some() {
            self.feed_state(bot).await?
        } else {
            feed
        };
        // The live records, counted once a pass by the instance that evaluates it (the
        // stale-catalogue metrics read them from the document; nothing counts records per
        // scrape): all of the bot's records, counted while the evaluation runs (it changes no
        // record's existence), less those marked removed once it is done (few: a short range
        // of the `bot_removed_at` index).
        let (evaluation, all) = tokio::join!(
            self.store.deletions().evaluate(
                bot,
                pass,
                remove,
                sweep,
                (drift.max_removed < 1.0).then_some(drift.max_removed),
                now
            ),
            self.store.records().count_all(bot),
        );
        let evaluation = evaluation?;
        // The records marked removed, counted while the events are staged (staging marks
        // nothing).
        let ((feed_set, judged), removed) = tokio::try_join!(
            self.stage_and_judge(bot, pass, &feed, &evaluation, drift, now),
            self.store.records().count_removed(bot)
        )?;
        let live = all?.saturating_sub(removed);
        let last = field::CRAWL_LAST_PASS;
        let mut unset = doc! {
            format!("{last}.evaluatingBy"): "", format!("{last}.evaluatingUntil"): "",
        };
        if remove {
            // A sweep that did not run (removals gated off) waits for the next complete pass.
            unset.insert(format!("{last}.sweep"), "");
        }
        let released = judged.gated.is_empty();
        let mut set = doc! {
                    format!("{last}.evaluation"): "done",
                    format!("{last}.removed"): evaluation.removed as i64,
                    format!("{last}.restored"): evaluation.restored as i64,
                    format!("{last}.candidates"): evaluation.candidates as i64,
                    format!("{last}.changedPages"): evaluation.changed_pages as i64,
                    format!("{last}.liveRecords"): live as i64,
                    format!("{last}.held"): evaluation.held as i64,
                    format!("{last}.events"): judged.staged.events() as i64,
                    format!("{last}.gated"): judged.gated.clone(),
        };
        set.extend(feed_set);
        let mut inc = doc! { field::CRAWL_REMOVED_TOTAL: evaluation.removed as i64 };
        if released {
            inc.insert(
                format!("{}.{}", super::release::FEED, super::release::feed::EVENTS),
                judged.staged.events() as i64,
            );
        }
        let mut update = doc! {
                "$set": set,
                "$currentDate": { format!("{last}.evaluatedAt"): true },
                "$unset": unset,
                "$inc": inc,
        };
        let mut max = doc! {
            format!("{}.{}", super::release::FEED, super::release::feed::STAGED): pass,
        };
        if remove && evaluation.held == 0 {
            // The pages this pass read start their baselines anew from that read; the pass is
            // complete (trusted to remove).
            max.insert(field::CRAWL_EVALUATED_PASS, pass);
            max.insert(field::CRAWL_LAST_COMPLETE_PASS_AT, date(now));
        }
        update.insert("$max", max);
        // Once per pass: an evaluation taken over after its first run recorded it adds nothing
        // to the removed total again.
        let update = self.store.bots.update_one(
            doc! {
                field::ID: bot.as_str(),
                format!("{last}.pass"): pass,
                format!("{last}.evaluation"): { "$ne": "done" },
            },
            update,
        );
        self.store.bounded("record the evaluation", update).await?;
        tracing::info!(
            bot = %bot, pass = pass.get(), removed = evaluation.removed, restored = evaluation.restored,
            candidates = evaluation.candidates, changed_pages = evaluation.changed_pages,
            events = judged.staged.events(), held = evaluation.held,
            "deletion evaluation done"
        );
        if !released {
            tracing::warn!(
                bot = %bot, pass = pass.get(), reasons = %judged.gated.join("; "),
                "pass gated: its change events and removals wait for `seedlock pass release` or `discard`"
            );
        }
        Ok((evaluation, judged))
    }

    /// Takes over the evaluation of pass `pass` whose claim expired (its instance died or hung
    /// mid-way) — conditional on the claim read — and runs it again (it is idempotent). `None`
    /// when another instance took it first or it is no longer pending.
    pub async fn resume_evaluation(
        self,
        bot: &BotId,
        pass: PassNumber,
        claimed_until: DateTime<Utc>,
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<Option<super::deletions::Evaluation>> {
        let last = field::CRAWL_LAST_PASS;
        let claim = self.store.bots.find_one_and_update(
            doc! {
                field::ID: bot.as_str(),
                field::CRAWL_PASS: pass,
                format!("{last}.pass"): pass,
                format!("{last}.evaluation"): "pending",
                format!("{last}.evaluatingUntil"): date(claimed_until),
            },
            doc! { "$set": {
                format!("{last}.evaluatingBy"): me.as_str(),
                format!("{last}.evaluatingUntil"): date(super::plus(now, self.evaluation_claim())),
            } },
        );
        let Some(doc) = self.store.bounded("claim an evaluation", claim).await? else {
            return Ok(None);
        };
        let summary = doc.get_document(last).ok();
        let remove = summary.and_then(|l| l.get_str("deletion").ok()) == Some("applied");
        let sweep = summary.is_some_and(|l| l.get_bool("sweep") == Ok(true));
        let drift = drift_of(summary.and_then(|l| l.get_document("drift").ok()));
        tracing::warn!(bot = %bot, pass = pass.get(), "taking over a pass evaluation whose instance stopped mid-way");
        Ok(Some(
            self.evaluate_and_record(bot, pass, remove, sweep, &drift, None, now)
                .await?
                .0,
        ))
    }

    /// An ended pass's counts as its end recorded them (`crawlLastPass`) — `None` if the bot's
    /// last recorded pass is another one. One read of the bot document, where counting the
    /// frontier again costs an aggregation over every entry of the pass (seconds at a million
    /// pages).
    pub(crate) async fn recorded_progress(
        self,
        bot: &BotId,
        pass: PassNumber,
    ) -> Result<Option<PassProgress>> {
        let read = self.store.bots.find_one(doc! { field::ID: bot.as_str() });
        let doc = self
            .store
            .bounded(
                "read the last pass",
                read.projection(doc! { field::CRAWL_LAST_PASS: 1 }),
            )
            .await?;
        Ok(doc
            .and_then(|d| crate::store::document::recorded_counts(&d, pass))
            .map(PassProgress::from))
    }

    /// The current pass of a bot as `seedlock status` shows it: an ended pass with the counts
    /// its end recorded, a running one counted on the frontier.
    pub(crate) async fn report(self, doc: &BotDoc) -> Result<PassReport> {
        let (bot, pass) = (&doc.id, doc.crawl_pass);
        if pass == PassNumber::NONE {
            return Ok(PassReport::default());
        }
        let progress = match doc
            .crawl_pass_recorded
            .filter(|_| doc.crawl_pass_ended_at.is_some())
        {
            Some(recorded) => recorded.into(),
            None => self.store.frontier().pass_progress(bot, pass).await?,
        };
        let oldest = self
            .store
            .bounded(
                "oldest pending",
                self.store
                    .frontier()
                    .collection()
                    .find_one(super::frontier::status_filter(
                        bot,
                        pass,
                        UrlStatus::Pending,
                    ))
                    .sort(doc! { fr::ENQUEUED_AT: 1 })
                    .projection(doc! { fr::ENQUEUED_AT: 1 }),
            )
            .await?;
        let top_failure = if progress.failed > 0 {
            self.store
                .frontier()
                .failure_reasons(bot, pass, 1)
                .await?
                .into_iter()
                .next()
        } else {
            None
        };
        Ok(PassReport {
            pass,
            top_failure,
            progress,
            started_at: doc.crawl_pass_started_at,
            ended_at: doc.crawl_pass_ended_at,
            oldest_pending: oldest.and_then(|d| match d.get(fr::ENQUEUED_AT) {
                Some(Bson::DateTime(t)) => Some(t.to_chrono()),
                _ => None,
            }),
        })
    }
}

/// The drift rules a pass's end recorded, for whoever finishes its evaluation.
fn drift_doc(rules: &crate::config::DriftRules) -> Document {
    doc! {
        "maxFillDrop": rules.max_fill_drop, "maxRemoved": rules.max_removed,
        "minRecords": i64::try_from(rules.min_records).unwrap_or(i64::MAX),
    }
}

/// The drift rules of [`drift_doc`]. A pass ended by a version without the gate (no rules
/// recorded) is not gated: it is evaluated as that version would have.
fn drift_of(doc: Option<&Document>) -> crate::config::DriftRules {
    let d = crate::config::DriftRules::default();
    let Some(doc) = doc else {
        return crate::config::DriftRules {
            max_fill_drop: 1.0,
            max_removed: 1.0,
            ..d
        };
    };
    crate::config::DriftRules {
        max_fill_drop: doc.get_f64("maxFillDrop").unwrap_or(d.max_fill_drop),
        max_removed: doc.get_f64("maxRemoved").unwrap_or(d.max_removed),
        min_records: doc
            .get("minRecords")
            .and_then(crate::store::document::integer)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(d.min_records),
    }
}

/// The counts of `crawlPassDropped` in a bot document, when they are pass `pass`'s.
pub(crate) fn dropped_of(bot: &Document, pass: PassNumber) -> Option<Vec<(String, u64)>> {
    let dropped = bot.get_document(field::CRAWL_PASS_DROPPED).ok()?;
    let of = dropped
        .get("pass")
        .and_then(crate::store::document::integer)?;
    (of == pass.get()).then(|| {
        dropped
            .iter()
            .filter(|(k, _)| k.as_str() != "pass")
            .filter_map(|(k, v)| {
                let n = crate::store::document::integer(v)?;
                Some((k.clone(), u64::try_from(n).unwrap_or(0)))
            })
            .collect()
    })
}
