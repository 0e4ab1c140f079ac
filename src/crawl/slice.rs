//! One crawl slice's shared state (`Slice`: the queues between the stages, the semaphores
//! that bound what is in flight, the first failure) and its standing tasks (`SliceTasks`);
//! what travels between the stages (`Item`, `Storing`) and what an uncommitted page holds
//! (`Uncommitted`: its page permit and its body's weight in the byte budget).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::dispatch::{Confirmation, HostQueues};
use super::fetch::Fetched;
use super::queue::Queue;
use super::resolve::Settled;
use super::stages::Ticket;
use crate::error::Error;
use crate::store::frontier::UrlLease;

/// What a page fetched and not yet committed holds until its commit (or until it is given up):
/// one of the commit window's pages, and its body's weight in `crawl.max_uncommitted_bytes`.
pub(super) struct Uncommitted {
    pub(super) _page: OwnedSemaphorePermit,
    pub(super) _bytes: Option<OwnedSemaphorePermit>,
}

/// A page between stages: its lease, what it holds as fetched-and-uncommitted, and the ticket of
/// the stage it is in.
pub(super) struct Item<T> {
    pub(super) lease: UrlLease,
    pub(super) what: T,
    /// For a page fetched while the write leasing it was on its way: whether it took the lease
    /// (the page is committed only if it did).
    pub(super) confirm: Option<Confirmation>,
    pub(super) uncommitted: Uncommitted,
    pub(super) _ticket: Ticket,
}

/// A settled page in the store stage.
pub(super) struct Storing {
    pub(super) settled: Settled,
    pub(super) _uncommitted: Uncommitted,
    pub(super) _ticket: Ticket,
}

/// The weight of a fetched page in the byte budget, in KiB (the budget's unit): its body (a
/// sitemap's entries as read),
/// rounded up, at least 1 and at most the whole budget (a page larger than the budget waits
/// until nothing else is uncommitted, then goes alone).
pub(super) fn body_weight(fetched: &Fetched, budget_kib: u32) -> u32 {
    let bytes = match fetched {
        Fetched::Outcome(crate::http_client::FetchOutcome::Ok(page)) => page
            .sitemap
            .as_ref()
            .map_or(page.body.len(), |(sitemap, _)| sitemap.weight()),
        _ => 0,
    };
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, budget_kib.max(1))
}

/// What the stages of one slice share.
pub(super) struct Slice {
    pub(super) queues: HostQueues,
    pub(super) parse: Queue<Item<Fetched>>,
    pub(super) store: Queue<Storing>,
    /// Fetches in flight (`crawl.workers`).
    pub(super) slots: Arc<Semaphore>,
    /// Pages fetched (or being fetched) and not yet committed: the commit window's pages
    /// (`crawl.max_uncommitted` at most).
    pub(super) uncommitted: super::window::Resizable,
    /// Group commits on their way at once: the commit window's writers (`crawl.writers` at
    /// most).
    pub(super) commits: super::window::Resizable,
    /// The bodies of the pages fetched and not yet committed, in KiB
    /// (`crawl.max_uncommitted_bytes`).
    pub(super) bytes: Arc<Semaphore>,
    pub(super) bytes_kib: u32,
    /// A page was committed or work was queued here: the dispatcher looks again.
    pub(super) progressed: Notify,
    /// How often a page here put new pending work into the frontier (links it did not lease):
    /// a lease round that found nothing before that may be stale, and a dry spell ends.
    pub(super) new_work: AtomicU64,
    pub(super) failed: CancellationToken,
    pub(super) failure: Mutex<Option<Error>>,
    /// Pages being settled (followed and decided), beside the parsers.
    pub(super) settling: TaskTracker,
    /// The last pass whose change events were staged, as the slice started: a record's write
    /// drops its pending events of passes up to it.
    pub(super) feed_staged: crate::ids::PassNumber,
}

/// A slice's standing tasks, beside its shared state.
pub(super) struct SliceTasks {
    pub(super) run: Arc<Slice>,
    pub(super) parsers: JoinSet<()>,
    pub(super) writers: JoinSet<()>,
    pub(super) fetches: JoinSet<()>,
}

impl Slice {
    /// A task of the slice that panicked or was cancelled fails the slice.
    pub(super) fn check_task(
        &self,
        what: &'static str,
        joined: std::result::Result<(), tokio::task::JoinError>,
    ) {
        if let Err(e) = joined {
            self.fail(Error::Task {
                what,
                detail: e.to_string(),
            });
        }
    }

    pub(super) fn progressed(&self, new_work: bool) {
        if new_work {
            self.new_work.fetch_add(1, Ordering::Relaxed);
        }
        self.progressed.notify_one();
    }

    pub(super) fn new_work(&self) -> u64 {
        self.new_work.load(Ordering::Relaxed)
    }

    pub(super) fn fail(&self, e: Error) {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
        self.failed.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::urls::NormalizedUrl;

    #[test]
    fn a_page_weighs_its_body_in_kib_rounded_up_within_the_budget() {
        let page = |len: usize| {
            Fetched::Outcome(crate::http_client::FetchOutcome::Ok(
                crate::http_client::Page {
                    url: NormalizedUrl::parse("http://shop/").unwrap(),
                    format: crate::http_client::BodyFormat::Html,
                    body: "x".repeat(len),
                    sitemap: None,
                    etag: None,
                    last_modified: None,
                },
            ))
        };
        assert_eq!(body_weight(&page(0), 4096), 1, "an empty page still counts");
        assert_eq!(body_weight(&page(1024), 4096), 1);
        assert_eq!(body_weight(&page(1025), 4096), 2);
        assert_eq!(body_weight(&page(24 * 1024), 4096), 24);
        assert_eq!(
            body_weight(&page(10 << 20), 4096),
            4096,
            "a page over the budget takes all of it"
        );
        assert_eq!(body_weight(&Fetched::Released, 4096), 1);
    }
}
