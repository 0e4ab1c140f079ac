//! The settle stage: what a page came to. [`Resolver::step`] follows a parsed page first (its
//! links enqueued: [`Follower::step`]), then turns it into a [`Settled`] for the group commit:
//! its record, the record it shows gone, and how its URL's lease ends ([`Mark`]) — done (with
//! the manifest), failed with the reason, or back to the frontier for a retry after
//! max(`Retry-After`, jittered backoff) within the host's retry budget.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tracing::debug;

use super::dispatch::HostQueues;
use super::fetch::Fetched;
use super::follow::Follower;
use super::parse::Parsed;
use super::pass::Pass;
use super::shared::Shared;
use crate::backoff::full_jitter;
use crate::error::Result;
use crate::extract::PageData;
use crate::http_client::{FetchOutcome, Validators};
use crate::store::frontier::{Mark, PageKind, UrlLease};
use crate::store::records::{Extracted, RecordWrite};

/// What one page came to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum PageResult {
    /// A detail page's record was stored (or found unchanged).
    Stored(RecordWrite),
    /// A page without a record (a listing page), done.
    Done,
    /// `304`: the stored record still holds (not written).
    NotModified,
    /// Not HTML: done, nothing read.
    Skipped,
    /// `404`/`410` on a detail page: its record is marked removed.
    Gone,
    /// Given back to the frontier for a later attempt.
    Retry,
    /// Recorded failed with this reason.
    Failed(String),
}

/// A page ready for the group commit.
#[derive(Debug)]
pub(crate) struct Settled {
    pub lease: UrlLease,
    pub record: Option<Extracted>,
    /// A record whose detail page is gone (marked removed).
    pub removed: Option<String>,
    pub mark: Mark,
    /// What the page counts as (`None`: given back, not counted). A `Stored` learns its record
    /// write from the commit.
    pub result: Option<PageResult>,
    /// Links this page put into the frontier pending (not leased here): work for any leaser.
    pub new_pending: u64,
}

impl Settled {
    fn new(lease: UrlLease, mark: Mark, result: Option<PageResult>) -> Self {
        Self {
            lease,
            record: None,
            removed: None,
            mark,
            result,
            new_pending: 0,
        }
    }
}

/// A done mark keeping the page's validators (its record id and manifest, if any, come later).
fn done(lease: &UrlLease) -> Mark {
    Mark::Done {
        validators: lease.validators.clone(),
        record_id: None,
        manifest: None,
    }
}

/// The settle stage: the follow stage it runs first, and the bot's retry rules.
pub(crate) struct Resolver {
    shared: Arc<Shared>,
    follower: Follower,
}

impl Resolver {
    pub(crate) fn new(shared: Arc<Shared>, follower: Follower) -> Self {
        Self { shared, follower }
    }

    /// [`Resolver::step`], again after a transient database failure (following is idempotent),
    /// up to three times.
    pub(crate) async fn step_retrying(
        &self,
        lease: UrlLease,
        parsed: Parsed,
        pass: &Pass,
        queues: &HostQueues,
    ) -> Result<Settled> {
        let Parsed::Page {
            data,
            validators,
            held,
        } = parsed
        else {
            return self.step(lease, parsed, pass, queues).await;
        };
        let mut attempt = 0;
        let settled = loop {
            attempt += 1;
            let now = self.shared.clock.now();
            let settled = self
                .page(lease.clone(), &data, validators.clone(), pass, queues, now)
                .await;
            match settled {
                Err(e) if e.is_transient() && attempt < 3 => {
                    tokio::time::sleep(full_jitter(
                        Duration::from_millis(50),
                        Duration::from_secs(1),
                        attempt,
                    ))
                    .await;
                }
                other => break other,
            }
        };
        // A sitemap file's items are followed: their megabytes go back to the system before
        // the bot's next file is read (freed in the heap's middle, they would stay resident).
        drop(data);
        if held.holds_a_file() {
            drop(held);
            release_free_memory();
        }
        settled
    }

    /// The settle step: what the page came to, as the group commit will store it. A parsed page
    /// is followed first (its links enqueued).
    pub(crate) async fn step(
        &self,
        lease: UrlLease,
        parsed: Parsed,
        pass: &Pass,
        queues: &HostQueues,
    ) -> Result<Settled> {
        let now = self.shared.clock.now();
        let outcome = match parsed {
            Parsed::Page {
                data, validators, ..
            } => {
                return self.page(lease, &data, validators, pass, queues, now).await;
            }
            Parsed::Other(Fetched::Released) => {
                let mark = Mark::Release {
                    not_before: now,
                    reason: "given back at shutdown".into(),
                };
                return Ok(Settled::new(lease, mark, None));
            }
            Parsed::Other(Fetched::HostPaused { wait, reason }) => {
                let mark = Mark::Release {
                    not_before: crate::store::plus(now, wait),
                    reason,
                };
                return Ok(Settled::new(lease, mark, None));
            }
            Parsed::Other(Fetched::Disallowed) => {
                return Ok(self.fail(lease, "disallowed by robots.txt"));
            }
            Parsed::Other(Fetched::Outcome(outcome)) => outcome,
        };
        self.answer(lease, outcome, now).await
    }

    /// A page read: followed, then done with its record (or failed for want of one) and, for a
    /// listing page, its manifest.
    async fn page(
        &self,
        mut lease: UrlLease,
        data: &PageData,
        validators: Validators,
        pass: &Pass,
        queues: &HostQueues,
        now: DateTime<Utc>,
    ) -> Result<Settled> {
        lease.validators = validators;
        let followed = self.follower.step(&lease, pass, data, queues, now).await?;
        let done = Mark::Done {
            validators: lease.validators.clone(),
            record_id: None,
            manifest: followed.manifest,
        };
        let mut page = match &data.record {
            Some(Ok((natural_key, fields))) => {
                let record = Extracted {
                    bot: self.shared.bot.clone(),
                    natural_key: natural_key.clone(),
                    data: fields.clone(),
                    url: data.canonical.clone(),
                };
                let stored = PageResult::Stored(RecordWrite::Unchanged);
                let mut s = Settled::new(lease, done, Some(stored));
                s.record = Some(record);
                s
            }
            Some(Err(reason)) => self.fail(lease, reason),
            None => Settled::new(lease, done, Some(PageResult::Done)),
        };
        page.new_pending = followed.added.saturating_sub(followed.leased as u64);
        Ok(page)
    }

    /// Any other answer to the fetch: done without a read (not modified, not HTML, gone), failed,
    /// or another attempt later.
    async fn answer(
        &self,
        lease: UrlLease,
        outcome: FetchOutcome,
        now: DateTime<Utc>,
    ) -> Result<Settled> {
        Ok(match outcome {
            FetchOutcome::Ok(_) => unreachable!("pages are parsed before they are settled"),
            FetchOutcome::NotModified => {
                Settled::new(lease.clone(), done(&lease), Some(PageResult::NotModified))
            }
            FetchOutcome::Skipped { reason } => {
                debug!(bot = %self.shared.bot, url = %lease.url, %reason, "skipped");
                Settled::new(lease.clone(), done(&lease), Some(PageResult::Skipped))
            }
            FetchOutcome::Gone { status } if lease.kind == PageKind::Detail => {
                debug!(bot = %self.shared.bot, url = %lease.url, status, "detail page gone; record marked removed");
                let record = self.gone_record(&lease).await?;
                let mut s = Settled::new(lease.clone(), done(&lease), Some(PageResult::Gone));
                s.removed = record;
                s
            }
            FetchOutcome::Gone { status } => self.fail(lease, &format!("HTTP {status}")),
            FetchOutcome::Permanent { reason } => self.fail(lease, &reason),
            FetchOutcome::Throttled {
                status,
                retry_after,
            } => self.retry_or_fail(lease, now, &format!("HTTP {status}"), retry_after),
            FetchOutcome::Timeout => self.retry_or_fail(lease, now, "timed out", None),
            FetchOutcome::Transient { reason } => self.retry_or_fail(lease, now, &reason, None),
            // The fetch stage follows redirects; one that comes back unfollowed is a bug.
            FetchOutcome::Redirect { status, to } => {
                self.fail(lease, &format!("HTTP {status} to {to} not followed"))
            }
        })
    }

    /// The record of a detail page found gone. A lease taken without a read of its entry (a
    /// changed item) does not carry the record's id: the entry does. An entry leased before in
    /// this pass may not know it either: that lease's record can have landed without its mark
    /// (a crash between the two writes, a lease taken over), so the records are asked by URL.
    async fn gone_record(&self, lease: &UrlLease) -> Result<Option<String>> {
        if let Some(id) = &lease.record_id {
            return Ok(Some(id.clone()));
        }
        let store = &self.shared.store;
        let entry = store
            .frontier()
            .known_by_id(&self.shared.bot, std::slice::from_ref(&lease.id))
            .await?
            .remove(&lease.id)
            .and_then(|k| k.record_id);
        match entry {
            Some(id) => Ok(Some(id)),
            None if lease.attempt > 1 || lease.reclaimed => {
                store
                    .records()
                    .live_record_at(&self.shared.bot, &lease.url)
                    .await
            }
            None => Ok(None),
        }
    }

    /// Failed with its reason. (A detail page that failed is no evidence its item is gone:
    /// deletion detection reads the listings, not the detail pages.)
    fn fail(&self, lease: UrlLease, reason: &str) -> Settled {
        debug!(bot = %self.shared.bot, url = %lease.url, %reason, "page failed");
        let mark = Mark::Failed {
            reason: reason.to_owned(),
        };
        Settled::new(lease, mark, Some(PageResult::Failed(reason.to_owned())))
    }

    /// Another attempt later (after `Retry-After` when the site sent one, else a jittered
    /// backoff), or failed once `crawl.attempts` are used.
    fn retry_or_fail(
        &self,
        lease: UrlLease,
        now: DateTime<Utc>,
        reason: &str,
        retry_after: Option<Duration>,
    ) -> Settled {
        let (limits, flow) = (&self.shared.limits, &self.shared.flow);
        if lease.attempt >= i64::from(limits.attempts) {
            let why = format!("{reason} (after {} attempts)", lease.attempt);
            return self.fail(lease, &why);
        }
        let attempt = u32::try_from(lease.attempt.max(1)).unwrap_or(u32::MAX);
        let backoff = full_jitter(limits.backoff_base, limits.backoff_max, attempt);
        let mut wait = retry_after.map_or(backoff, |r| r.max(backoff));
        // Retries are load: past the host's budget, the retry waits out the budget's window.
        if !flow.may_retry(&lease.host(), Instant::now()) {
            wait = wait.max(flow.settings().retry_window);
            self.shared.metrics.retry_deferred(&self.shared.bot);
        }
        debug!(bot = %self.shared.bot, url = %lease.url, %reason, ?wait, "will retry");
        let mark = Mark::Retry {
            not_before: crate::store::plus(now, wait),
            reason: reason.to_owned(),
        };
        Settled::new(lease, mark, Some(PageResult::Retry))
    }
}

/// Gives the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
