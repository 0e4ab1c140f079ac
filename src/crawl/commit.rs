//! The commit stage: group commit. A writer takes everything waiting in the store queue (up to
//! `crawl.store_queue` pages, without lingering for more) and commits it as one batch
//! ([`Records::commit_batch`](crate::store::Records::commit_batch)): one read of the stored
//! records, one write of the new and changed ones, one `update` with every fenced settle mark —
//! or one transaction, with `crawl.transactions`. A commit that fails for a transient reason is
//! retried with the pages kept (never fetched again), while their leases last.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::resolve::{PageResult, Settled};
use super::shared::Shared;
use crate::error::Result;
use crate::store::records::{Committed, PageCommit, RecordWrite};

/// Attempts of one batch's commit when the database fails transiently.
const COMMIT_ATTEMPTS: u32 = 5;

/// The commit stage: how the group commit is sent, and the records it stored.
pub(crate) struct Committer {
    shared: Arc<Shared>,
    /// Resolved `crawl.transactions`: each batch is one transaction.
    transactions: bool,
    /// Records stored (requests per stored record is seed 000's health signal).
    records: AtomicU64,
}

impl Committer {
    pub(crate) fn new(shared: Arc<Shared>, transactions: bool) -> Self {
        Self {
            shared,
            transactions,
            records: AtomicU64::new(0),
        }
    }

    /// Records stored so far.
    pub(crate) fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// The commit step: one group commit of `batch`. Returns what became of each page, in
    /// order, and how long the commit that took took (a retried commit's failed attempts and
    /// backoff left out: the commit window sizes itself by the database's pace, not its faults).
    /// `feed_staged`: the last pass whose change events were staged (see
    /// [`Records::commit_batch_keeping`](crate::store::Records::commit_batch_keeping)).
    pub(crate) async fn step(
        &self,
        batch: &[&Settled],
        feed_staged: crate::ids::PassNumber,
    ) -> Result<(Vec<Committed>, Duration)> {
        let delayed = tokio::time::Instant::now();
        if !self.shared.limits.store_delay.is_zero() {
            // A slow database, for tests: as slow per page as the setting says.
            let pages = u32::try_from(batch.len()).unwrap_or(u32::MAX);
            tokio::time::sleep(self.shared.limits.store_delay * pages).await;
        }
        let delay = delayed.elapsed();
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
            let now = self.shared.clock.now();
            let sent = tokio::time::Instant::now();
            match self
                .shared
                .store
                .records()
                .commit_batch_keeping(&pages, now, self.transactions, feed_staged)
                .await
            {
                Ok(committed) => return Ok((committed, delay + sent.elapsed())),
                // Retried as a whole: every write in it is conditional and idempotent. Only while
                // the leases last (after that, others fetch the pages again); through an election
                // for as long as they do.
                Err(e)
                    if e.is_transient()
                        && (attempt < COMMIT_ATTEMPTS || e.is_failover())
                        && batch.iter().all(|s| s.lease.expires_at > now) =>
                {
                    warn!(bot = %self.shared.bot, error = %e, pages = batch.len(), attempt, "commit failed; retrying with the pages kept");
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
    pub(crate) fn account(&self, settled: &Settled, committed: &Committed) {
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
                self.shared
                    .metrics
                    .page_crawled(&self.shared.bot, page_result_label(&result));
                if let PageResult::Stored(write) = &result {
                    self.records.fetch_add(1, Ordering::Relaxed);
                    self.shared
                        .metrics
                        .record_written(&self.shared.bot, write_label(*write));
                }
                debug!(bot = %self.shared.bot, url = %settled.lease.url, kind = settled.lease.kind.as_str(), ?result, "page crawled");
            }
            Committed::UrlLeaseLost(_) => {
                self.shared.metrics.url_lease_lost(&self.shared.bot);
                warn!(bot = %self.shared.bot, url = %settled.lease.url, "url lease lost; the newer worker's result wins");
            }
            Committed::Failed(why) => {
                warn!(bot = %self.shared.bot, url = %settled.lease.url, %why, "page not committed; it is fetched again after its lease");
            }
        }
    }
}

fn page_result_label(result: &PageResult) -> &'static str {
    match result {
        PageResult::Stored(_) => "stored",
        PageResult::Done => "done",
        PageResult::NotModified => "not_modified",
        PageResult::Skipped => "skipped",
        PageResult::Gone => "gone",
        PageResult::Retry => "retry",
        PageResult::Failed(_) => "failed",
    }
}

fn write_label(write: RecordWrite) -> &'static str {
    match write {
        RecordWrite::Inserted => "inserted",
        RecordWrite::Changed => "changed",
        RecordWrite::Unchanged => "unchanged",
        RecordWrite::Restored => "restored",
        RecordWrite::Superseded => "superseded",
    }
}
