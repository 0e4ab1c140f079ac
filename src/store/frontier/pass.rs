//! Pass bookkeeping: which pass is the highest, whether a pass still has work, its progress
//! counts and its grouped failure reasons.

use super::*;

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

impl From<crate::lock::bot::RecordedCounts> for PassProgress {
    fn from(c: crate::lock::bot::RecordedCounts) -> Self {
        PassProgress {
            done: c.done,
            failed: c.failed,
            ..PassProgress::default()
        }
    }
}

impl PassProgress {
    /// The pass is over only when nothing is pending or waiting and nothing is leased by anyone.
    pub fn is_finished(&self) -> bool {
        self.pending == 0 && self.waiting == 0 && self.leased == 0
    }
}

/// The filter that reads a pass's entries of one status (a prefix of the index).
pub fn status_filter(bot: &BotId, pass: PassNumber, status: UrlStatus) -> Document {
    doc! { f::BOT: bot.as_str(), f::PASS: pass, f::STATUS: status.as_str() }
}

impl Frontier<'_> {
    /// The URLs in pass `pass` (of `host` alone, when given): one count per status, each a
    /// range of the crawl index. What the page bounds (`max_pages`, `max_pages_per_host`) are
    /// checked against, rarely (see `crawl::bounds`).
    pub async fn pages_in_pass(
        self,
        bot: &BotId,
        pass: PassNumber,
        host: Option<&str>,
    ) -> Result<u64> {
        let collection = self.collection();
        let counts = UrlStatus::ALL.map(|status| {
            let mut filter = status_filter(bot, pass, status);
            if let Some(host) = host {
                filter.insert(f::HOST, host);
            }
            self.store
                .bounded("count the pass's pages", collection.count_documents(filter))
        });
        Ok(futures_util::future::try_join_all(counts)
            .await?
            .iter()
            .sum())
    }

    /// The highest pass any of the bot's URLs is in, or `floor` when none is above it: a new pass
    /// numbers above it. `floor` is the bot document's pass, which every URL is at or below
    /// unless a pass was prepared and never recorded, or the document was set back (restored,
    /// repaired): one bounded probe above `floor` on the frontier index answers the usual case —
    /// without the probe, a server that reads every entry a sort matches reads the whole frontier
    /// (3.7 s at 200,000 entries on the test server; the probe 0.2 s) — and only when it finds
    /// one does the full answer follow.
    pub(crate) async fn highest_pass_above(
        self,
        bot: &BotId,
        floor: PassNumber,
    ) -> Result<PassNumber> {
        let above = self
            .store
            .bounded(
                "highest pass",
                self.store
                    .frontier()
                    .collection()
                    // `$gte` (not `$gt`, which the test server answers by reading the whole
                    // collection) and no hint (a hinted query it answers the same way).
                    .find_one(doc! {
                        f::BOT: bot.as_str(), f::PASS: { "$gte": floor.get().saturating_add(1) },
                    })
                    .projection(doc! { f::PASS: 1 }),
            )
            .await?;
        if above.is_none() {
            return Ok(floor);
        }
        let top = self
            .store
            .bounded(
                "highest pass",
                self.store
                    .frontier()
                    .collection()
                    .find_one(doc! { f::BOT: bot.as_str() })
                    .sort(doc! { f::BOT: 1, f::PASS: -1 })
                    .projection(doc! { f::PASS: 1 }),
            )
            .await?;
        Ok(top
            .and_then(|d| get_int(&d, f::PASS))
            .map_or(PassNumber::NONE, PassNumber::new)
            .max(floor))
    }

    /// True while any URL of the pass is pending, waiting or leased (by anyone): bounded index
    /// lookups, cheap enough for every idle worker, where [`Frontier::pass_progress`] counts all.
    pub(crate) async fn pass_has_work(self, bot: &BotId, pass: PassNumber) -> Result<bool> {
        let has = |status: UrlStatus| async move {
            let found = self
                .store
                .bounded(
                    "pass has work",
                    self.store
                        .frontier()
                        .collection()
                        .find_one(status_filter(bot, pass, status))
                        .projection(doc! { f::ID: 1 }),
                )
                .await?;
            Ok::<_, crate::error::Error>(found.is_some())
        };
        // The few leased and waiting entries first, side by side (one round trip): a server
        // that reads every entry a query matches pays for the pending ones only when there are
        // no others.
        let (leased, waiting) = tokio::try_join!(has(UrlStatus::Leased), has(UrlStatus::Waiting))?;
        if leased || waiting {
            return Ok(true);
        }
        has(UrlStatus::Pending).await
    }

    /// A pass's failed URLs grouped by reason, the most common first: up to `limit` reasons,
    /// each with its count and one example URL (one aggregation on the frontier index's
    /// `bot, pass, status` prefix).
    pub(crate) async fn failure_reasons(
        self,
        bot: &BotId,
        pass: PassNumber,
        limit: i64,
    ) -> Result<Vec<FailureReason>> {
        let pipeline = [
            doc! { "$match": status_filter(bot, pass, UrlStatus::Failed) },
            doc! { "$group": {
                "_id": format!("${}", f::LAST_ERROR),
                "n": { "$sum": 1 },
                "example": { "$min": format!("${}", f::URL) },
            } },
            doc! { "$sort": { "n": -1, "_id": 1 } },
            doc! { "$limit": limit.max(1) },
        ];
        let rows: Vec<Document> = self
            .store
            .bounded("read failure reasons", async {
                self.store
                    .frontier()
                    .collection()
                    .aggregate(pipeline)
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        Ok(rows
            .iter()
            .map(|row| FailureReason {
                reason: row
                    .get_str("_id")
                    .unwrap_or("(no reason recorded)")
                    .to_owned(),
                count: row
                    .get("n")
                    .and_then(crate::store::document::integer)
                    .unwrap_or(0)
                    .max(0) as u64,
                example: row.get_str("example").unwrap_or("?").to_owned(),
            })
            .collect())
    }

    /// Counts pass `pass`'s URLs by status (leases past their expiry still count as leased until
    /// someone re-leases them: the pass waits for them).
    pub async fn pass_progress(self, bot: &BotId, pass: PassNumber) -> Result<PassProgress> {
        // The same one aggregation that ends a pass; its coverage figures are not needed here.
        Ok(self.store.passes().coverage(bot, pass).await?.0)
    }
    /// The frontier ids of pass `pass`'s entries that did not end done (pending, waiting, leased,
    /// failed): after a pass, the detail pages it enqueued whose records are not known stored.
    /// One read per status on the main index.
    pub(crate) async fn not_done_in(self, bot: &BotId, pass: PassNumber) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for status in [
            UrlStatus::Failed,
            UrlStatus::Pending,
            UrlStatus::Waiting,
            UrlStatus::Leased,
        ] {
            let frontier = self.collection();
            let find = frontier
                .find(status_filter(bot, pass, status))
                .projection(doc! { f::ID: 1 })
                .batch_size(whole_batch(CHUNK));
            self.store
                .each_doc("read the entries a pass did not finish", find, |doc| {
                    ids.extend(get_text(&doc, f::ID));
                    Ok(())
                })
                .await?;
        }
        Ok(ids)
    }
}
