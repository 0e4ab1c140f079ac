//! The commit stage: group commit. A writer takes everything waiting in the store queue (up to
//! `crawl.store_queue` pages, without lingering for more) and commits it as one batch
//! ([`Records::commit_batch`](crate::store::Records::commit_batch)): one read of the stored
//! records, one write of the new and changed ones, one `update` with every fenced settle mark —
//! or one transaction, with `crawl.transactions`. A commit that fails for a transient reason is
//! retried with the pages kept (never fetched again), while their leases last.

use std::time::Duration;

use tracing::{debug, warn};

use super::settle::Settled;
use super::{Crawler, PageResult};
use crate::error::Result;
use crate::store::records::{Committed, PageCommit, RecordWrite};

/// Attempts of one batch's commit when the database fails transiently.
const COMMIT_ATTEMPTS: u32 = 5;

impl Crawler {
    /// The commit step: one group commit of `batch`. Returns what became of each page, in
    /// order.
    pub async fn commit_step(&self, batch: &[&Settled]) -> Result<Vec<Committed>> {
        if !self.limits.store_delay.is_zero() {
            // A slow database, for tests: as slow per page as the setting says.
            let pages = u32::try_from(batch.len()).unwrap_or(u32::MAX);
            tokio::time::sleep(self.limits.store_delay * pages).await;
        }
        let pages: Vec<PageCommit<'_>> = batch
            .iter()
            .map(|s| PageCommit {
                lease: &s.lease,
                record: s.record.as_ref(),
                removed: s.removed.clone(),
                mark: s.mark.clone(),
            })
            .collect();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let now = self.clock.now();
            match self
                .store
                .records()
                .commit_batch(&pages, now, self.transactions)
                .await
            {
                Ok(committed) => return Ok(committed),
                // Retried as a whole: every write in it is conditional and idempotent. Only while
                // the leases last; after that, others fetch the pages again.
                Err(e)
                    if e.is_transient()
                        && attempt < COMMIT_ATTEMPTS
                        && batch.iter().all(|s| s.lease.expires_at > now) =>
                {
                    warn!(bot = %self.bot, error = %e, pages = batch.len(), attempt, "commit failed; retrying with the pages kept");
                    tokio::time::sleep(crate::backoff::full_jitter(
                        Duration::from_millis(50),
                        Duration::from_secs(2),
                        attempt,
                    ))
                    .await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Counts a committed page in the metrics (and the log).
    pub(super) fn account(&self, settled: &Settled, committed: &Committed) {
        match committed {
            Committed::Settled(write) => {
                let Some(result) = &settled.result else {
                    return;
                };
                let result = match result {
                    PageResult::Stored(_) => {
                        PageResult::Stored(write.unwrap_or(RecordWrite::Unchanged))
                    }
                    other => other.clone(),
                };
                self.metrics
                    .page_crawled(&self.bot, super::page_result_label(&result));
                if let PageResult::Stored(write) = &result {
                    self.records
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.metrics
                        .record_written(&self.bot, super::write_label(*write));
                }
                debug!(bot = %self.bot, url = %settled.lease.url, kind = settled.lease.kind.as_str(), ?result, "page crawled");
            }
            Committed::UrlLeaseLost(_) => {
                self.metrics.url_lease_lost(&self.bot);
                warn!(bot = %self.bot, url = %settled.lease.url, "url lease lost; the newer worker's result wins");
            }
            Committed::Failed(why) => {
                warn!(bot = %self.bot, url = %settled.lease.url, %why, "page not committed; it is fetched again after its lease");
            }
        }
    }
}
