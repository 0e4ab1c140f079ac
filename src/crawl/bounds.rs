//! The page bounds of a pass (`max_pages`, `max_pages_per_host`) on this instance: a URL new to
//! the pass is enqueued only while the pass — and its host's share of it — holds fewer pages
//! than the bound.
//!
//! The bound is shared by every instance crawling the pass, and the frontier is what they share:
//! each instance counts what it adds, and checks the pass's real count (one count per status, of
//! the pass or of one host, plus what it admitted and has not written yet) whenever it has added
//! half the room its last check left — from the start of the pass, half the bound. So a normal shop, far below its bounds, never pays a count,
//! and a trap costs a handful of counts as it nears its bound. Instances that add at once may
//! go past a bound by what each added since its last check (at most half the room left then).
//! Once a check finds a bound reached, this instance drops every further new URL it covers for
//! the rest of the pass.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::Result;
use crate::extract::{Bound, Dropped};
use crate::ids::{BotId, PassNumber};
use crate::store::frontier::NewUrl;
use crate::store::Store;

/// What this instance knows of one bound's count.
#[derive(Clone, Copy, Debug, Default)]
struct Count {
    /// The pass's count at the last check (none yet: taken as 0).
    counted: u64,
    /// Added here since.
    since: u64,
    /// A check found the bound reached.
    full: bool,
}

/// Whether one more page fits under a bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Room {
    Yes,
    Full,
    /// Not without a check of the real count.
    Check,
}

impl Count {
    fn room(&self, max: u64) -> Room {
        if self.full {
            return Room::Full;
        }
        let slack = max.saturating_sub(self.counted).div_ceil(2);
        if self.since < slack {
            Room::Yes
        } else {
            Room::Check
        }
    }

    fn checked(&mut self, count: u64, max: u64) {
        *self = Count {
            counted: count,
            since: 0,
            full: count >= max,
        };
    }
}

#[derive(Debug, Default)]
struct Counts {
    pass: PassNumber,
    total: Count,
    hosts: HashMap<String, Count>,
}

/// The page bounds of the pass this instance crawls (see the module comment).
#[derive(Debug, Default)]
pub(crate) struct PageBudget {
    counts: Mutex<Counts>,
}

/// The bound a check is for: the pass, or one host of it.
enum Check {
    Total,
    Host(String),
}

impl PageBudget {
    fn counts(&self, pass: PassNumber) -> std::sync::MutexGuard<'_, Counts> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if counts.pass != pass {
            *counts = Counts {
                pass,
                ..Counts::default()
            };
        }
        counts
    }

    /// The links of `links` the page bounds admit into pass `pass`, in order; the rest are
    /// counted into `dropped`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn admit(
        &self,
        store: &Store,
        bot: &BotId,
        pass: PassNumber,
        max_pages: u64,
        max_per_host: u64,
        links: Vec<NewUrl>,
        dropped: &mut Dropped,
    ) -> Result<Vec<NewUrl>> {
        let mut admitted: Vec<NewUrl> = Vec::with_capacity(links.len());
        for link in links {
            let host = link.url.host_port();
            loop {
                let check = {
                    let mut counts = self.counts(pass);
                    let total = counts.total.room(max_pages);
                    let own = counts
                        .hosts
                        .entry(host.clone())
                        .or_default()
                        .room(max_per_host);
                    match (total, own) {
                        (Room::Full, _) => {
                            dropped.add(Bound::MaxPages, 1);
                            break;
                        }
                        (_, Room::Full) => {
                            dropped.add(Bound::MaxPagesPerHost, 1);
                            break;
                        }
                        (Room::Yes, Room::Yes) => {
                            counts.total.since += 1;
                            if let Some(h) = counts.hosts.get_mut(&host) {
                                h.since += 1;
                            }
                            admitted.push(link);
                            break;
                        }
                        (Room::Check, _) => Check::Total,
                        (_, Room::Check) => Check::Host(host.clone()),
                    }
                };
                let frontier = store.frontier();
                // What this call admitted is not in the frontier yet: it counts beside the count.
                match check {
                    Check::Total => {
                        let n = frontier.pages_in_pass(bot, pass, None).await?;
                        let pending = admitted.len() as u64;
                        self.counts(pass).total.checked(n + pending, max_pages);
                    }
                    Check::Host(host) => {
                        let n = frontier.pages_in_pass(bot, pass, Some(&host)).await?;
                        let pending = admitted
                            .iter()
                            .filter(|l| l.url.host_port() == host)
                            .count() as u64;
                        let mut counts = self.counts(pass);
                        let count = counts.hosts.entry(host).or_default();
                        count.checked(n + pending, max_per_host);
                    }
                }
            }
        }
        Ok(admitted)
    }
}

/// The links of `links` (listing pages the lease rounds put into pass `pass` themselves: the
/// last pass's, or those a broken chain left unreached) that `max_depth` and the page bounds
/// admit; the rest are counted (in `/metrics` and the bot document).
pub(crate) async fn admit_listings(
    shared: &super::shared::Shared,
    budget: &PageBudget,
    pass: PassNumber,
    links: Vec<NewUrl>,
) -> Result<Vec<NewUrl>> {
    let bounds = shared.rules.bounds;
    let mut dropped = Dropped::default();
    let (deep, links): (Vec<NewUrl>, Vec<NewUrl>) =
        links.into_iter().partition(|l| l.depth > bounds.max_depth);
    dropped.add(Bound::Depth, deep.len() as u64);
    let admitted = budget
        .admit(
            &shared.store,
            &shared.bot,
            pass,
            bounds.max_pages,
            bounds.max_pages_per_host,
            links,
            &mut dropped,
        )
        .await?;
    note_dropped(shared, pass, &dropped).await?;
    Ok(admitted)
}

/// Counts what the trap bounds dropped: in `/metrics` at once, and in the bot document's counts
/// for the pass (one write, only when something was dropped).
pub(crate) async fn note_dropped(
    shared: &super::shared::Shared,
    pass: PassNumber,
    dropped: &Dropped,
) -> Result<()> {
    if dropped.is_empty() {
        return Ok(());
    }
    let counts: Vec<(&str, u64)> = dropped.counts().map(|(b, n)| (b.as_str(), n)).collect();
    for (bound, n) in &counts {
        shared.metrics.urls_dropped(&shared.bot, bound, *n);
    }
    tracing::debug!(bot = %shared.bot, pass = pass.get(), ?counts, "crawl-trap bounds dropped links");
    shared
        .store
        .passes()
        .add_dropped(&shared.bot, pass, &counts)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_is_checked_when_half_the_room_left_is_used_and_full_once_reached() {
        let mut count = Count::default();
        let max = 10;
        let mut before_check = 0;
        while count.room(max) == Room::Yes {
            count.since += 1;
            before_check += 1;
        }
        assert_eq!(before_check, 5, "half the bound before the first check");
        count.checked(8, max);
        assert_eq!(count.room(max), Room::Yes);
        count.since += 1;
        assert_eq!(count.room(max), Room::Check, "half of the 2 left");
        count.checked(10, max);
        assert_eq!(count.room(max), Room::Full);
    }
}
