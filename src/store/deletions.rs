//! Deletion detection from the listing manifests, at a pass's end: the records whose detail
//! pages the listings showed since the last evaluation and no longer show are marked removed;
//! the records marked removed that a listing of this pass shows again are restored. Nothing is
//! written per unchanged item, before or during this.
//!
//! Every listing (and seed) page keeps, beside what it listed in its last read (`listed`, its
//! [`Manifest`]), everything it listed since the last evaluation (`listedSince`, its baseline)
//! and whether that holds more than `listed` does (`listedSinceMore`). Its done marks maintain
//! both, server-side in the same update pipeline: the baseline becomes the previous read if that
//! read was the last evaluated pass's (`crawlEvaluatedPass`, as the reader knew it — an older
//! value only keeps more, and a superset is always safe), else stays; then this read's list is
//! added by set union. So, for pass *p*:
//!
//! - **present** = every detail page listed by a listing page read in *p* (`listedPass` = *p*,
//!   `status: done`), 8 bytes an item in memory;
//! - **candidates** = what the pages whose list changed (`listedSinceMore`) listed since the last
//!   evaluation and no longer do, plus everything the listing pages *p* never reached listed since
//!   then — minus the present (an item that moved to another page is present there, however the
//!   pagination shifted) and minus what the pages whose read failed in *p* listed since then
//!   (unknown: kept). Departures are compared by 64-bit keys; only those left are read again in
//!   full, from the few pages that hold them;
//! - a page whose list did not change since the last evaluation adds nothing.
//!
//! Removing a candidate's record is conditional on `removedAt: null` and skipped when the
//! record's own URL is present; restoring is conditional on `removedAt` set. Then the unreached
//! pages' baselines become empty, and — when removals applied — the final write sets
//! `crawlEvaluatedPass`, from which the pages read in *p* start their baselines anew: nothing is
//! written per listing page. Each step is idempotent and no baseline moves before the marks, so
//! an evaluation cut short (a kill) is simply run again — by another instance once its claim
//! expires, or by the next complete pass, whose candidates still include everything since the
//! last evaluation that finished. An incomplete pass (the coverage and error-rate gates) removes
//! nothing and moves no baseline, so the next complete pass catches every departure since —
//! including items only an incomplete pass ever listed.
//!
//! An item that moves onto a listing page this pass had already read (an item above it deleted
//! mid-pass) is listed nowhere in the pass: it is marked removed, and the next pass that lists it
//! restores it. Records whose detail pages no listing or seed page links to (reached only from
//! other detail pages) are never candidates: they are removed only by a 404/410 of their own.
//!
//! [`Manifest`]: super::frontier::Manifest

use crate::ids::PassNumber;
use std::collections::HashSet;

use bson::{doc, Bson, Document, RawDocumentBuf};
use chrono::{DateTime, Utc};

use super::changes::{pending_event, ChangeKind};
use super::frontier::{
    baseline_lists, field as fr, listing_filters, raw_integer, unreached_listings_filters, url_id,
    Ids, UrlStatus, FRONTIER, IN_CHUNK,
};
use super::records::field as rf;
use super::{date, Store};
use crate::error::Result;
use crate::ids::BotId;
use crate::urls::NormalizedUrl;

/// A `removed` event of pass `pass`.
fn removed_event(pass: PassNumber, now: DateTime<Utc>) -> Document {
    pending_event(pass, ChangeKind::Removed, Document::new(), now)
}

/// What an evaluation did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evaluation {
    /// Listing pages read in the pass (their lists are the present).
    pub pages: u64,
    /// Of those, pages whose list changed since the last evaluation.
    pub changed_pages: u64,
    /// Detail pages listed since the last evaluation and listed nowhere now.
    pub candidates: u64,
    /// Records marked removed (0 when removals were not applied).
    pub removed: u64,
    /// Records marked removed earlier that a listing of this pass shows again.
    pub restored: u64,
    /// Records the pass would have removed and held back instead: more than its share of the
    /// live records (the drift gate's `max_removed`). Removed only if the pass is released.
    pub held: u64,
    /// The bot's live records before the evaluation, when they were counted (a removal to judge).
    pub live_before: Option<u64>,
}

/// The key of a detail page's frontier id in the sets below (see [`super::frontier::id_key`]).
fn key(id: &str) -> u64 {
    super::frontier::id_key(id)
}

/// The detail pages the listings of a pass show, as a sorted set of keys (8 bytes an item).
#[derive(Debug, Default)]
struct Present(Vec<u64>);

impl Present {
    fn has(&self, key: u64) -> bool {
        self.0.binary_search(&key).is_ok()
    }

    fn contains(&self, id: &str) -> bool {
        self.has(key(id))
    }

    /// Whether the record with this stored URL is listed.
    fn lists_url(&self, bot: &BotId, url: Option<&str>) -> bool {
        url.and_then(|u| NormalizedUrl::parse(u).ok())
            .is_some_and(|u| self.contains(&url_id(bot, &u)))
    }
}

/// The keys of a listing page's baseline (every list it showed since the last evaluation).
fn baseline_keys(page: &bson::RawDocument) -> Vec<u64> {
    baseline_lists(page)
        .iter()
        .flat_map(|list| list.keys().collect::<Vec<_>>())
        .collect()
}

/// Listing pages per cursor batch when the present is read, at most: each batch fewer is a
/// round trip fewer (2,000 pages: 0.8 s in batches of 25, 0.5 s of 100). Large pages go fewer to
/// a batch (`Frontier::each_listing`): a hundred sitemap files' manifests are a reply of 16 MiB,
/// which at a million items raised the pass's peak by 28 MiB at its end.
const PRESENT_PER_BATCH: u32 = 100;

/// The earliest date a record can have been removed at: `{$gte: epoch()}` is the index range of
/// every removed record (dates sort after null).
fn epoch() -> Bson {
    Bson::DateTime(bson::DateTime::from_millis(0))
}

/// Deletion detection at a pass's end, reached through [`Store::deletions`].
#[derive(Clone, Copy, Debug)]
pub struct Deletions<'a> {
    pub(super) store: &'a Store,
}

/// Departures gathered between two comparisons with the present read so far (see
/// [`Listings::depart`]): 1 MiB of them.
const DEPARTURES_BETWEEN_CHECKS: usize = 65_536;

/// What an evaluation reads of the listing pages.
#[derive(Default)]
struct Listings {
    /// Pages whose baseline holds departures to check, by position in `pages`; each
    /// departure by key (its full id is read again only if it is a candidate).
    pages: Vec<String>,
    departures: Vec<(u64, usize)>,
    /// The length of `departures` at which they are next compared with the present.
    check_at: usize,
    /// What the pages read in the pass list (8 bytes an item).
    present: Vec<u64>,
    /// What the pages this pass could not read listed since the last evaluation: kept.
    unknown: Vec<u64>,
}

impl Listings {
    /// Page `id` (`None`: a page without a readable id, whose departures are still checked)
    /// shows `departed` no more.
    ///
    /// When the pagination shifts, every page's list changes and nearly every item departs
    /// from one page to show up on another: held until the end, the departures would weigh
    /// twice the present (16 bytes an item, 16 MiB at a million). So every
    /// [`DEPARTURES_BETWEEN_CHECKS`] the departures already present on a page read so far are
    /// dropped (the present only grows, so each drop is final); what is held is the items whose
    /// new page is still to come, a quarter of the catalogue at the worst.
    fn depart(&mut self, id: Option<&str>, departed: Vec<u64>) {
        let at = self.pages.len();
        self.pages.extend(id.map(str::to_owned));
        self.departures
            .extend(departed.into_iter().map(|k| (k, at)));
        if self.departures.len() >= self.check_at.max(DEPARTURES_BETWEEN_CHECKS) {
            self.present.sort_unstable();
            self.present.dedup();
            let present = &self.present;
            self.departures
                .retain(|(k, _)| present.binary_search(k).is_err());
            self.check_at = self.departures.len() + DEPARTURES_BETWEEN_CHECKS;
        }
    }
}

impl Deletions<'_> {
    /// Evaluates pass `pass` of `bot` (see the module comment): restores the records a listing
    /// of the pass shows again and — with `remove` (a complete pass in a mode that reads every
    /// listing page) — marks removed those the listings no longer show, then empties the
    /// baselines of the listing pages the pass never reached. Idempotent.
    ///
    /// `sweep` is for the first evaluation after an upgrade from a version without manifests:
    /// no listing page has a baseline yet, so every live record that no listing of this pass
    /// shows and whose detail page this pass did not fetch is a candidate (one read of the live
    /// records, once).
    ///
    /// `max_removed`: when the departures' records are more than this share of the live records,
    /// they are held back (`hold_removed`), not removed, and no baseline moves.
    pub async fn evaluate(
        self,
        bot: &BotId,
        pass: PassNumber,
        remove: bool,
        sweep: bool,
        max_removed: Option<f64>,
        now: DateTime<Utc>,
    ) -> Result<Evaluation> {
        let mut outcome = Evaluation::default();
        let t0 = std::time::Instant::now();
        // The pages this pass never reached are read beside its own (a removal needs both; the
        // pass's coverage bounds how many there are).
        let unreached_pages = async {
            match remove {
                true => self.read_unreached(bot, pass).await,
                false => Ok(Vec::new()),
            }
        };
        let (mut read, unreached_pages) = tokio::try_join!(
            self.read_pass_listings(bot, pass, &mut outcome),
            unreached_pages
        )?;
        let mut unreached: Vec<String> = Vec::with_capacity(unreached_pages.len());
        for (id, since) in unreached_pages {
            read.depart(Some(&id), since);
            unreached.push(id);
        }
        let present = Present(std::mem::take(&mut read.present));
        tracing::debug!(%bot, pass = pass.get(), took = ?t0.elapsed(), items = present.0.len(), "evaluation: the listings read");
        if remove {
            // Listed nowhere now (an item that moved pages is present on its new one), and not
            // on a page this pass could not read.
            read.unknown.sort_unstable();
            read.departures
                .retain(|(k, _)| !present.has(*k) && read.unknown.binary_search(k).is_err());
            let candidates = self
                .departed_ids(bot, &read.pages, &read.departures)
                .await?;
            outcome.candidates = candidates.len() as u64;
            let gone = self.departed_records(bot, &candidates, &present).await?;
            let hold = match max_removed {
                Some(share) if !gone.is_empty() => {
                    let live = self.store.records().count_live(bot).await?;
                    outcome.live_before = Some(live);
                    gone.len() as f64 > share * live as f64
                }
                _ => false,
            };
            if hold {
                self.hold_removed(bot, pass, &gone, now).await?;
                outcome.held = gone.len() as u64;
            } else {
                outcome.removed = self.mark_removed(bot, pass, &gone, now).await?;
            }
            if sweep {
                let (swept, removed) = self.sweep_unlisted(bot, pass, &present, now).await?;
                outcome.candidates += swept;
                outcome.removed += removed;
            }
        }
        tracing::debug!(%bot, pass = pass.get(), took = ?t0.elapsed(), "evaluation: removals done");
        outcome.restored = self.restore_listed(bot, pass, &present, now).await?;
        tracing::debug!(%bot, pass = pass.get(), took = ?t0.elapsed(), "evaluation: restorations done");
        if remove && outcome.held == 0 {
            self.clear_baselines(bot, pass, &unreached).await?;
        }
        Ok(outcome)
    }

    /// Reads the manifests of the listing pages of pass `pass`: what they list now (the
    /// present, sorted), the departures of the pages whose baseline holds other lists, and what
    /// the pages this pass could not read listed since the last evaluation (unknown: kept).
    async fn read_pass_listings(
        self,
        bot: &BotId,
        pass: PassNumber,
        outcome: &mut Evaluation,
    ) -> Result<Listings> {
        let mut read = Listings::default();
        self.store
            .frontier()
            .each_listing(
                "read this pass's listings",
                listing_filters(bot, doc! { "$eq": pass }),
                doc! {
                    fr::LISTED: 1, fr::LISTED_SINCE: 1, fr::LISTED_PASS: 1, fr::STATUS: 1,
                    fr::LISTED_SINCE_MORE: 1,
                },
                Some(PRESENT_PER_BATCH),
                |page| {
                    let read_now = page.get_str(fr::STATUS).ok() == Some(UrlStatus::Done.as_str())
                        && raw_integer(page, fr::LISTED_PASS).map(PassNumber::new) == Some(pass);
                    if !read_now {
                        read.unknown.extend(baseline_keys(page));
                        return Ok(());
                    }
                    outcome.pages += 1;
                    let listed: Vec<u64> = Ids::of(page, fr::LISTED).keys().collect();
                    read.present.extend(&listed);
                    if page.get_bool(fr::LISTED_SINCE_MORE).ok() == Some(true) {
                        let listed: HashSet<u64> = listed.into_iter().collect();
                        let departed: Vec<u64> = baseline_keys(page)
                            .into_iter()
                            .filter(|k| !listed.contains(k))
                            .collect();
                        if !departed.is_empty() {
                            outcome.changed_pages += 1;
                            read.depart(page.get_str(fr::ID).ok(), departed);
                        }
                    }
                    Ok(())
                },
            )
            .await?;
        read.present.sort_unstable();
        read.present.dedup();
        read.present.shrink_to_fit();
        Ok(read)
    }

    /// The pages this pass never reached, each with everything it listed since the last
    /// evaluation (their departures; their baselines are emptied at the end).
    async fn read_unreached(
        self,
        bot: &BotId,
        pass: PassNumber,
    ) -> Result<Vec<(String, Vec<u64>)>> {
        let mut unreached: Vec<(String, Vec<u64>)> = Vec::new();
        self.store
            .frontier()
            .each_listing(
                "read unreached listings",
                unreached_listings_filters(bot, pass),
                doc! { fr::LISTED_SINCE: 1, fr::LISTED: 1 },
                Some(super::frontier::MANIFESTS_PER_BATCH),
                |page| {
                    let since = baseline_keys(page);
                    if let (false, Ok(id)) = (since.is_empty(), page.get_str(fr::ID)) {
                        unreached.push((id.to_owned(), since));
                    }
                    Ok(())
                },
            )
            .await?;
        Ok(unreached)
    }

    /// The full frontier ids of the departures left (by key), read again from their pages'
    /// baselines — only the pages that hold one.
    async fn departed_ids(
        self,
        bot: &BotId,
        pages: &[String],
        departures: &[(u64, usize)],
    ) -> Result<Vec<String>> {
        let wanted: HashSet<u64> = departures.iter().map(|(k, _)| *k).collect();
        let mut holding: Vec<&str> = departures
            .iter()
            .map(|(_, at)| pages[*at].as_str())
            .collect();
        holding.sort_unstable();
        holding.dedup();
        let mut ids: HashSet<String> = HashSet::new();
        let frontier = self.store.database().collection::<RawDocumentBuf>(FRONTIER);
        for chunk in holding.chunks(IN_CHUNK) {
            let find = frontier
                .find(doc! { fr::ID: { "$in": chunk }, fr::BOT: bot.as_str() })
                .projection(doc! { fr::LISTED_SINCE: 1, fr::LISTED: 1 })
                .batch_size(u32::try_from(chunk.len() + 1).unwrap_or(u32::MAX));
            self.store
                .each_raw("read departed listings", find, |page| {
                    for list in baseline_lists(page) {
                        ids.extend(
                            (0..list.len())
                                .filter(|i| wanted.contains(&list.key(*i)))
                                .map(|i| list.id(i)),
                        );
                    }
                    Ok(())
                })
                .await?;
        }
        Ok(ids.into_iter().collect())
    }

    /// The live records of the detail pages `departed` (frontier ids), less those whose own URL
    /// is present after all: what the pass would mark removed.
    async fn departed_records(
        self,
        bot: &BotId,
        departed: &[String],
        present: &Present,
    ) -> Result<Vec<String>> {
        let mut gone: Vec<String> = Vec::new();
        for chunk in departed.chunks(IN_CHUNK) {
            let mut records: Vec<String> = Vec::new();
            let frontier = self.store.frontier().collection();
            let find = frontier
                .find(doc! { fr::ID: { "$in": chunk }, fr::BOT: bot.as_str() })
                .projection(doc! { fr::RECORD_ID: 1 })
                .batch_size(u32::try_from(chunk.len() + 1).unwrap_or(u32::MAX));
            self.store
                .each_doc("read departed pages", find, |entry| {
                    records.extend(entry.get_str(fr::RECORD_ID).ok().map(str::to_owned));
                    Ok(())
                })
                .await?;
            if records.is_empty() {
                continue;
            }
            // A record stored from another URL that is still listed stays.
            let collection = self.store.records().collection();
            let find = collection
                .find(doc! { rf::ID: { "$in": &records }, rf::BOT: bot.as_str(), rf::REMOVED_AT: Bson::Null })
                .projection(doc! { rf::URL: 1 })
                .batch_size(u32::try_from(records.len() + 1).unwrap_or(u32::MAX));
            self.store
                .each_doc("read departed records", find, |record| {
                    if !present.lists_url(bot, record.get_str(rf::URL).ok()) {
                        gone.extend(record.get_str(rf::ID).ok().map(str::to_owned));
                    }
                    Ok(())
                })
                .await?;
        }
        Ok(gone)
    }

    /// Marks the live records `gone` removed in pass `pass`, each with its `removed` event.
    /// Returns how many were marked.
    async fn mark_removed(
        self,
        bot: &BotId,
        pass: PassNumber,
        gone: &[String],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let mut removed = 0;
        let collection = self.store.records().collection();
        for chunk in gone.chunks(IN_CHUNK) {
            let update = collection.update_many(
                doc! { rf::ID: { "$in": chunk }, rf::BOT: bot.as_str(), rf::REMOVED_AT: Bson::Null },
                doc! {
                    "$set": { rf::REMOVED_AT: date(now), rf::REMOVED_IN_PASS: pass },
                    "$push": { rf::PENDING: removed_event(pass, now) },
                },
            );
            removed += self
                .store
                .bounded("mark removed", update)
                .await?
                .modified_count;
        }
        Ok(removed)
    }

    /// Holds back the removal of the live records `gone` in a gated pass: each gets its
    /// `removed` event, and stays live until the pass is released (`Passes::release`). Run again,
    /// a record gets the event twice, which staging folds into one.
    async fn hold_removed(
        self,
        bot: &BotId,
        pass: PassNumber,
        gone: &[String],
        now: DateTime<Utc>,
    ) -> Result<()> {
        let collection = self.store.records().collection();
        for chunk in gone.chunks(IN_CHUNK) {
            let update = collection.update_many(
                doc! { rf::ID: { "$in": chunk }, rf::BOT: bot.as_str(), rf::REMOVED_AT: Bson::Null },
                doc! { "$push": { rf::PENDING: removed_event(pass, now) } },
            );
            self.store.bounded("hold removals", update).await?;
        }
        Ok(())
    }

    /// Applies the removals a gated pass `pass` held back (its staged `removed` events), on its
    /// release: only to records still live and not written since the pass. Returns the records
    /// removed and those it could not remove (written again since: their events are dropped).
    pub(crate) async fn apply_held(
        self,
        bot: &BotId,
        pass: PassNumber,
        held: &[String],
        now: DateTime<Utc>,
    ) -> Result<(u64, Vec<String>)> {
        let collection = self.store.records().collection();
        let mut removed = 0;
        for chunk in held.chunks(IN_CHUNK) {
            let update = collection.update_many(
                doc! {
                    rf::ID: { "$in": chunk }, rf::BOT: bot.as_str(), rf::REMOVED_AT: Bson::Null,
                    rf::FETCHED_PASS: { "$lte": pass },
                },
                doc! { "$set": { rf::REMOVED_AT: date(now), rf::REMOVED_IN_PASS: pass } },
            );
            removed += self
                .store
                .bounded("apply held removals", update)
                .await?
                .modified_count;
        }
        // Which held records did not become removed by this pass (written again since).
        let mut kept = Vec::new();
        for chunk in held.chunks(IN_CHUNK) {
            let find = collection
                .find(doc! { rf::ID: { "$in": chunk }, rf::BOT: bot.as_str(), rf::REMOVED_IN_PASS: { "$ne": pass } })
                .projection(doc! { rf::ID: 1 })
                .batch_size(u32::try_from(chunk.len() + 1).unwrap_or(u32::MAX));
            self.store
                .each_doc("read unapplied removals", find, |r| {
                    kept.extend(r.get_str(rf::ID).ok().map(str::to_owned));
                    Ok(())
                })
                .await?;
        }
        Ok((removed, kept))
    }

    /// The upgrade's sweep (see [`Deletions::evaluate`]): live records that no listing of this
    /// pass shows and whose detail page was not fetched in it are marked removed. Returns
    /// (candidates, removed).
    async fn sweep_unlisted(
        self,
        bot: &BotId,
        pass: PassNumber,
        present: &Present,
        now: DateTime<Utc>,
    ) -> Result<(u64, u64)> {
        // The live records no listing shows, by their detail page's frontier id.
        let mut unlisted: Vec<(String, String)> = Vec::new();
        let collection = self.store.records().collection();
        let find = collection
            .find(doc! { rf::BOT: bot.as_str(), rf::REMOVED_AT: Bson::Null })
            .projection(doc! { rf::URL: 1 })
            .batch_size(1000);
        self.store
            .each_doc("read live records", find, |record| {
                let url = record.get_str(rf::URL).ok();
                if !present.lists_url(bot, url) {
                    let page = url
                        .and_then(|u| NormalizedUrl::parse(u).ok())
                        .map(|u| url_id(bot, &u))
                        .unwrap_or_default();
                    unlisted.extend(record.get_str(rf::ID).ok().map(|id| (id.to_owned(), page)));
                }
                Ok(())
            })
            .await?;
        let mut removed = 0;
        for chunk in unlisted.chunks(IN_CHUNK) {
            let pages: Vec<&str> = chunk.iter().map(|(_, p)| p.as_str()).collect();
            let mut fetched: HashSet<String> = HashSet::new();
            let frontier = self.store.frontier().collection();
            let find = frontier
                .find(doc! { fr::ID: { "$in": &pages }, fr::BOT: bot.as_str(), fr::PASS: pass })
                .projection(doc! { fr::ID: 1 })
                .batch_size(u32::try_from(pages.len() + 1).unwrap_or(u32::MAX));
            self.store
                .each_doc("read fetched pages", find, |entry| {
                    fetched.extend(entry.get_str(fr::ID).ok().map(str::to_owned));
                    Ok(())
                })
                .await?;
            let gone: Vec<String> = chunk
                .iter()
                .filter(|(_, page)| !fetched.contains(page))
                .map(|(id, _)| id.clone())
                .collect();
            removed += self.mark_removed(bot, pass, &gone, now).await?;
        }
        Ok((unlisted.len() as u64, removed))
    }

    /// Restores the records marked removed (before this pass: a 404 in it stands) whose URL a
    /// listing of this pass shows. Reads the removed records by the `bot_removed_at` index.
    async fn restore_listed(
        self,
        bot: &BotId,
        pass: PassNumber,
        present: &Present,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let mut back: Vec<Bson> = Vec::new();
        let collection = self.store.records().collection();
        let find = collection
            // A range on the index (`$ne: null` is not one on every server: the test server
            // reads every entry of the bot for it).
            .find(doc! { rf::BOT: bot.as_str(), rf::REMOVED_AT: { "$gte": epoch() } })
            .projection(doc! { rf::URL: 1, rf::REMOVED_IN_PASS: 1 })
            .batch_size(1000);
        self.store
            .each_doc("read removed records", find, |record| {
                let this_pass = record
                    .get(rf::REMOVED_IN_PASS)
                    .and_then(crate::store::document::integer)
                    .map(PassNumber::new)
                    == Some(pass);
                if !this_pass && present.lists_url(bot, record.get_str(rf::URL).ok()) {
                    back.extend(record.get(rf::ID).cloned());
                }
                Ok(())
            })
            .await?;
        let mut restored = 0;
        for chunk in back.chunks(IN_CHUNK) {
            let update = collection.update_many(
                doc! { rf::ID: { "$in": chunk }, rf::BOT: bot.as_str(), rf::REMOVED_AT: { "$ne": Bson::Null } },
                doc! {
                    "$set": {
                        rf::REMOVED_AT: Bson::Null, rf::REMOVED_IN_PASS: Bson::Null,
                        rf::LAST_CHANGED: date(now),
                    },
                    "$push": { rf::PENDING: pending_event(pass, ChangeKind::Restored, Document::new(), now) },
                },
            );
            restored += self
                .store
                .bounded("restore records", update)
                .await?
                .modified_count;
        }
        Ok(restored)
    }

    /// After the marks: the listing pages this pass never reached start an empty baseline (what
    /// they listed was a candidate now). The pages it read start theirs anew from this read at
    /// their next done mark (`crawlEvaluatedPass`): nothing is written per page here.
    async fn clear_baselines(
        self,
        bot: &BotId,
        pass: PassNumber,
        unreached: &[String],
    ) -> Result<()> {
        let statements: Vec<Document> = unreached
            .chunks(IN_CHUNK)
            .map(|chunk| {
                doc! {
                    "q": { fr::ID: { "$in": chunk }, fr::BOT: bot.as_str(), fr::PASS: { "$lt": pass } },
                    "u": { "$set": { fr::LISTED_SINCE: [], fr::LISTED_SINCE_MORE: false } },
                    "multi": true,
                }
            })
            .collect();
        for chunk in statements.chunks(super::frontier::CHUNK) {
            let reply = self
                .store
                .command(
                    "clear listing baselines",
                    doc! { "update": FRONTIER, "updates": chunk, "ordered": false },
                    None,
                )
                .await?;
            super::reply::duplicates("clear listing baselines", &reply)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn departures_present_on_a_page_read_so_far_are_dropped_as_they_pile_up() {
        let n = DEPARTURES_BETWEEN_CHECKS as u64;
        let mut read = Listings::default();
        // Page "a" shows 0..n no more, and a page read before it lists them now (the
        // pagination shifted): dropped at the check, not held to the end.
        read.present.extend(0..n);
        read.depart(Some("a"), (0..n).collect());
        assert!(read.departures.is_empty());
        // Below the next check, held whatever they are; an item listed nowhere yet stays.
        read.present.push(n + 1);
        read.depart(Some("b"), vec![n + 1, n + 2]);
        assert_eq!(read.departures, vec![(n + 1, 1), (n + 2, 1)]);
        read.depart(Some("c"), (n + 3..2 * n + 3).collect());
        assert_eq!(
            read.departures.len() as u64,
            n + 1,
            "only n + 1 was present"
        );
        assert_eq!(read.departures[0], (n + 2, 1));
        assert_eq!(read.pages, ["a", "b", "c"]);
    }
}
