//! One URL at a time, for tests that drive the frontier and the records by hand: lease any
//! pending (or expired) URL of a pass, settle it done or failed, commit one page. The crawl
//! itself leases and settles in batches; these go through the same store calls with a batch
//! of one.

use std::time::Duration;

use chrono::{DateTime, Utc};

use seedlock::error::{Error, Result};
use seedlock::ids::{BotId, InstanceId, PassNumber};
use seedlock::store::frontier::{CandidateQuery, Frontier, Mark, Priority, Takes, UrlLease};
use seedlock::store::records::{Committed, Extracted, PageCommit, RecordWrite, Records};

/// The frontier one URL at a time.
#[allow(async_fn_in_trait)]
pub trait OneUrl {
    /// Leases one URL of pass `pass` to `me`: a pending one of the highest priority, else one
    /// whose lease expired by `now`, picked at random among equals so racing leasers spread.
    /// `None` when the pass has neither.
    async fn lease_url(
        self,
        bot: &BotId,
        pass: PassNumber,
        me: &InstanceId,
        now: DateTime<Utc>,
        lease_for: Duration,
    ) -> Result<Option<UrlLease>>;

    /// Marks a leased URL done, only if the lease is still this worker's (`UrlLeaseLost`).
    async fn complete_url(self, lease: &UrlLease, now: DateTime<Utc>) -> Result<()>;

    /// Marks a leased URL failed with `reason`, only if the lease is still this worker's.
    async fn fail_url(self, lease: &UrlLease, now: DateTime<Utc>, reason: &str) -> Result<()>;
}

impl OneUrl for Frontier<'_> {
    async fn lease_url(
        self,
        bot: &BotId,
        pass: PassNumber,
        me: &InstanceId,
        now: DateTime<Utc>,
        lease_for: Duration,
    ) -> Result<Option<UrlLease>> {
        for _ in 0..20 {
            let queries: Vec<CandidateQuery> = self
                .hosts_with_work(bot, pass)
                .await?
                .into_iter()
                .map(|host| CandidateQuery {
                    host,
                    priority: Priority::Above(i64::MIN),
                    slots: None,
                    limit: 10_000,
                })
                .collect();
            let mut pending: Vec<_> = self
                .lease_candidates(bot, pass, &queries)
                .await?
                .into_iter()
                .flatten()
                .collect();
            let expired: Vec<String> = self
                .leased_entries(bot, pass)
                .await?
                .into_iter()
                .filter(|e| e.expires_at.is_some_and(|t| t <= now))
                .map(|e| e.id)
                .collect();
            if pending.is_empty() && expired.is_empty() {
                return Ok(None);
            }
            let top = pending.iter().map(|c| c.priority).max();
            pending.retain(|c| Some(c.priority) == top);
            let (pending, expired) = if pending.is_empty() {
                let one = expired[rand::random_range(0..expired.len())].clone();
                (Vec::new(), vec![one])
            } else {
                let one = pending.swap_remove(rand::random_range(0..pending.len()));
                (vec![one], Vec::new())
            };
            let takes = Takes {
                pending: &pending,
                expired: &expired,
                reclaim: &[],
            };
            let taken = self
                .take_leases(bot, pass, me, now, lease_for, takes)
                .await?;
            if let Some(lease) = taken.leases.into_iter().next() {
                return Ok(Some(lease));
            }
            // Another worker took it first: look again.
        }
        Ok(None)
    }

    async fn complete_url(self, lease: &UrlLease, now: DateTime<Utc>) -> Result<()> {
        let mark = Mark::Done {
            validators: lease.validators.clone(),
            record_id: None,
            manifest: None,
        };
        settle_one(self, lease, mark, now).await
    }

    async fn fail_url(self, lease: &UrlLease, now: DateTime<Utc>, reason: &str) -> Result<()> {
        let mark = Mark::Failed {
            reason: reason.to_owned(),
        };
        settle_one(self, lease, mark, now).await
    }
}

async fn settle_one(
    frontier: Frontier<'_>,
    lease: &UrlLease,
    mark: Mark,
    now: DateTime<Utc>,
) -> Result<()> {
    if frontier.settle_urls(&[(lease, mark)], now).await?[0] {
        Ok(())
    } else {
        Err(Error::UrlLeaseLost {
            url: lease.url.to_string(),
        })
    }
}

/// The records one page at a time.
#[allow(async_fn_in_trait)]
pub trait OnePage {
    /// Stores the page's record (if any) and marks its URL done, together: a group commit of
    /// one page. `UrlLeaseLost` when the lease went to another worker.
    async fn commit_page(
        self,
        lease: &UrlLease,
        record: Option<&Extracted>,
        now: DateTime<Utc>,
        transaction: bool,
    ) -> Result<Option<RecordWrite>>;
}

impl OnePage for Records<'_> {
    async fn commit_page(
        self,
        lease: &UrlLease,
        record: Option<&Extracted>,
        now: DateTime<Utc>,
        transaction: bool,
    ) -> Result<Option<RecordWrite>> {
        let page = PageCommit {
            lease,
            record,
            removed: None,
            mark: Mark::Done {
                validators: lease.validators.clone(),
                record_id: None,
                manifest: None,
            },
        };
        match self
            .commit_batch(std::slice::from_ref(&page), now, transaction)
            .await?
            .remove(0)
        {
            Committed::Settled(write) => Ok(write),
            Committed::UrlLeaseLost(_) => Err(Error::UrlLeaseLost {
                url: lease.url.to_string(),
            }),
            Committed::Failed(detail) => Err(Error::Protocol {
                what: "store record",
                detail,
            }),
        }
    }
}
