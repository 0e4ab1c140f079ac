//! Settle and follow: what a parsed page came to, and what it leads to.
//!
//! [`Crawler::follow`] runs as soon as a page is parsed — the listing fast lane: a listing
//! page's links are enqueued right away, not behind the pages waiting to be committed — and
//! enqueues the links this instance has room for **leased to it** (always the next listing page),
//! straight into the host queues: a pagination hop is fetch + parse + one write. On listing
//! pages the incremental mode decides which items' detail pages this pass fetches — an item the
//! manifests of earlier passes show known stored with the same fingerprint costs no read at all
//! ([`Known`]) — and the page's [`Manifest`] (what it listed) goes with its done mark. An item
//! not fetched is not written: nothing per unchanged item.
//!
//! [`Crawler::settle`] turns a page into a [`Settled`] for the group commit: its record, the
//! record it shows gone, and how its URL's lease ends ([`Mark`]) — done (with the manifest),
//! failed with the reason, or back to the frontier for a retry after max(`Retry-After`,
//! jittered backoff) within the host's retry budget.

use crate::ids::PassNumber;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tracing::debug;

use super::dispatch::{Fetched, HostQueues, Queued};
use super::known::{Known, Listed};
use super::parse::Parsed;
use super::{Crawler, PageResult, Pass};
use crate::backoff::full_jitter;
use crate::config::IncrementalMode;
use crate::error::Result;
use crate::extract::{ListItem, PageData};
use crate::fetch::FetchOutcome;
use crate::store::frontier::{
    fingerprint_hash, url_id, KnownPage, LeaseTo, Manifest, Mark, NewUrl, PageKind, UrlLease,
    UrlStatus,
};
use crate::store::records::Extracted;
use crate::urls::NormalizedUrl;

/// Links remembered per pass as already enqueued (about 100 bytes each).
pub(super) const ENQUEUED_CACHE: usize = 100_000;

/// A page ready for the group commit.
#[derive(Debug)]
pub struct Settled {
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

/// What following a page's links did.
#[derive(Debug, Default, PartialEq)]
pub struct Followed {
    /// What a listing or seed page listed (for its done mark).
    pub manifest: Option<Box<Manifest>>,
    /// Links added to the pass (new, or back from an earlier pass).
    pub added: u64,
    /// Of those, leased to this instance as they were enqueued (now in its host queues).
    pub leased: usize,
}

/// A fetched page's links, sorted for [`Crawler::follow`].
struct PageLinks<'a> {
    /// A listing page's items with a detail link, each detail page once, in page order.
    items: Vec<(&'a ListItem, &'a NormalizedUrl)>,
    /// The detail pages a listing page links to besides its items.
    detail_links: Vec<&'a NormalizedUrl>,
    /// Every other link (and its frontier id) not known enqueued in this pass already.
    plain: Vec<(&'a NormalizedUrl, String)>,
}

/// What a listing page's items came to.
#[derive(Default)]
struct Listing {
    /// What the page listed (for its done mark); none for a detail page.
    manifest: Option<Manifest>,
    /// Detail pages to fetch whose entries were read (or that have none).
    new: Vec<NewUrl>,
    /// Detail pages to fetch known stored but changed, from the manifests: enqueued without a
    /// read of their entries.
    changed: Vec<NewUrl>,
    /// Watermark mode met an item known stored: the listing's pagination ends here.
    stop_paginating: bool,
}

/// How a listed item is known stored: by the fingerprint hash its manifests agree on, or by the
/// fingerprint its frontier entry was stored with.
#[derive(Clone, Copy, Debug)]
enum StoredAs<'a> {
    Hash(i64),
    Text(Option<&'a str>),
}

/// Whether a listed item's detail page is fetched this pass by the incremental `mode`, given
/// how it is known stored (`None`: not known stored) and, for `updated_at`, the time since
/// which a change counts. `None`: that is not enough to say — never in `full` mode or for an
/// item not known stored (fetch it), or an `updated_at` item without a readable time.
fn fetch_item(
    mode: IncrementalMode,
    item: &ListItem,
    stored: Option<StoredAs<'_>>,
    since: Option<DateTime<Utc>>,
) -> Option<bool> {
    match (mode, stored) {
        (IncrementalMode::Full, _) | (_, None) => None,
        (IncrementalMode::Fingerprint, Some(StoredAs::Hash(fp))) => {
            Some(fp != fingerprint_hash(&item.fingerprint))
        }
        (IncrementalMode::Fingerprint, Some(StoredAs::Text(fp))) => {
            Some(fp != Some(item.fingerprint.as_str()))
        }
        (IncrementalMode::Watermark, Some(_)) => Some(false),
        (IncrementalMode::UpdatedAt, Some(_)) => match (item.updated_at, since) {
            (Some(updated), Some(since)) => Some(updated >= since),
            _ => None,
        },
    }
}

impl Crawler {
    /// Enqueues what a fetched page leads to, leasing to this instance the links it has room
    /// for (see the module comment), and — for a listing or seed page — what it listed: its
    /// [`Manifest`] for the page's done mark.
    pub async fn follow(
        &self,
        lease: &UrlLease,
        pass: &Pass,
        data: &PageData,
        queues: &HostQueues,
        now: DateTime<Utc>,
    ) -> Result<Followed> {
        let mode = if pass.refetch {
            IncrementalMode::Full
        } else {
            self.rules.incremental.mode
        };
        let PageLinks {
            items,
            detail_links,
            mut plain,
        } = self.page_links(lease, data);
        let mut followed = Followed::default();
        // The pagination chain first, in one write, leased here: the next listing page is
        // fetched while this page's items are decided. (Not in watermark mode, where the items
        // decide whether pagination goes on.)
        if mode != IncrementalMode::Watermark {
            let lists;
            (lists, plain) = plain
                .into_iter()
                .partition(|(link, _)| self.kind_of(link) == PageKind::List);
            self.follow_pagination(lease, &lists, queues, now, &mut followed)
                .await?;
        }
        let since = pass.last_run_at.map(|t| {
            t - chrono::Duration::from_std(self.rules.incremental.overlap).unwrap_or_default()
        });
        let mut listed = Listing {
            manifest: lease.kind.is_listing().then(|| Manifest {
                evaluated: pass.evaluated,
                ..Manifest::default()
            }),
            ..Listing::default()
        };
        // What the manifests of earlier passes say of the items: an item listed with the same
        // fingerprint and known stored needs no read and no fetch.
        let decided = self
            .decide_from_manifests(lease, &items, mode, since, &mut listed)
            .await?;
        let to_read: Vec<String> = items
            .iter()
            .enumerate()
            .filter(|(i, _)| !decided.contains_key(i))
            .map(|(_, (_, url))| url_id(&self.bot, url))
            .chain(plain.iter().map(|(_, id)| id.clone()))
            .collect();
        let known = if to_read.is_empty() {
            HashMap::new()
        } else {
            self.store
                .frontier()
                .known_by_id(&self.bot, &to_read)
                .await?
        };
        self.decide_items(&items, &decided, &known, mode, since, &mut listed);
        if !listed.changed.is_empty() {
            listed.changed.sort_by_key(|n| -n.priority);
            let (added, leased) = self
                .upsert_links(lease, &listed.changed, queues, false, now)
                .await?;
            followed.added += added;
            followed.leased += leased;
        }
        if let Some(m) = listed.manifest.as_mut() {
            for link in &detail_links {
                m.push(url_id(&self.bot, link), 0, false);
            }
        }
        followed.manifest = listed.manifest.map(Box::new);
        if items.is_empty() && plain.is_empty() {
            return Ok(followed);
        }
        let mut new = listed.new;
        for (link, _) in &plain {
            let kind = self.kind_of(link);
            if listed.stop_paginating && kind == PageKind::List {
                continue;
            }
            new.push(NewUrl {
                url: (*link).clone(),
                kind,
                fingerprint: None,
                priority: self.priority_of(link, kind),
            });
        }
        if new.is_empty() {
            return Ok(followed);
        }
        let (added, leased) = self
            .enqueue_leasing_what_fits(lease, new, &known, queues, now)
            .await?;
        self.remember_enqueued(lease.pass, plain.into_iter().map(|(_, id)| id).collect());
        followed.added += added;
        followed.leased += leased;
        Ok(followed)
    }

    /// Enqueues a page's listing links (the pagination chain) leased here, into `followed`.
    async fn follow_pagination(
        &self,
        lease: &UrlLease,
        lists: &[(&NormalizedUrl, String)],
        queues: &HostQueues,
        now: DateTime<Utc>,
        followed: &mut Followed,
    ) -> Result<()> {
        let t0 = tokio::time::Instant::now();
        let (f, ids) = self.follow_listing(lease, lists, queues, now).await?;
        tracing::trace!(took = ?t0.elapsed(), leased = f.leased, "listing links enqueued");
        followed.added += f.added;
        followed.leased += f.leased;
        self.remember_enqueued(lease.pass, ids);
        Ok(())
    }

    /// What a fetched page links to, sorted for [`Crawler::follow`]: a listing page's items (each
    /// detail page once), the detail pages it links to besides its items (listed in its
    /// manifest with a fingerprint of 0: nothing to compare; enqueued like every link), and the
    /// plain links — without those this instance already put into this pass (every product
    /// page links back to the first listing page, say): enqueuing them again would be a no-op.
    fn page_links<'a>(&self, lease: &UrlLease, data: &'a PageData) -> PageLinks<'a> {
        let listing = lease.kind.is_listing();
        let mut item_urls: HashSet<&NormalizedUrl> = HashSet::new();
        let items: Vec<_> = if listing {
            data.items
                .iter()
                .filter_map(|item| item.url.as_ref().map(|url| (item, url)))
                .filter(|(_, url)| item_urls.insert(url))
                .collect()
        } else {
            Vec::new()
        };
        let detail_links: Vec<&NormalizedUrl> = if listing {
            data.links
                .iter()
                .filter(|link| !item_urls.contains(link) && self.kind_of(link) == PageKind::Detail)
                .collect()
        } else {
            Vec::new()
        };
        let cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        let plain = data
            .links
            .iter()
            .filter(|link| !item_urls.contains(link))
            .map(|link| (link, url_id(&self.bot, link)))
            .filter(|(_, id)| cache.0 != lease.pass || !cache.1.contains(id))
            .collect();
        PageLinks {
            items,
            detail_links,
            plain,
        }
    }

    /// The items decided without a read, by page position: `false` skipped (known stored, as
    /// listed), `true` fetched (known stored, but changed: nothing to read for it — a changed
    /// page needs no validators). The rest are read from the frontier.
    async fn decide_from_manifests(
        &self,
        lease: &UrlLease,
        items: &[(&ListItem, &NormalizedUrl)],
        mode: IncrementalMode,
        since: Option<DateTime<Utc>>,
        listed: &mut Listing,
    ) -> Result<HashMap<usize, bool>> {
        let mut decided = HashMap::new();
        if items.is_empty() {
            return Ok(decided);
        }
        let table = self.known_items(lease.pass).await?;
        for (i, (item, url)) in items.iter().enumerate() {
            let stored = match table.get(&url_id(&self.bot, url)) {
                Listed::Stored(fp) => Some(StoredAs::Hash(fp)),
                _ => None,
            };
            listed.stop_paginating |= mode == IncrementalMode::Watermark && stored.is_some();
            if let Some(fetch) = fetch_item(mode, item, stored, since) {
                decided.insert(i, fetch);
            }
        }
        Ok(decided)
    }

    /// Decides every item (those the manifests did not, from their frontier entries in `known`)
    /// into `listed`: the manifest, and the detail pages to fetch — new ones, and changed ones
    /// known stored (enqueued without a read of their entries).
    fn decide_items(
        &self,
        items: &[(&ListItem, &NormalizedUrl)],
        decided: &HashMap<usize, bool>,
        known: &HashMap<String, KnownPage>,
        mode: IncrementalMode,
        since: Option<DateTime<Utc>>,
        listed: &mut Listing,
    ) {
        for (i, (item, url)) in items.iter().enumerate() {
            let id = url_id(&self.bot, url);
            let fingerprint = fingerprint_hash(&item.fingerprint);
            let fetch = match decided.get(&i) {
                Some(fetch) => *fetch,
                None => {
                    // Known: stored by an earlier fetch (done, with a record).
                    let stored = known
                        .get(&id)
                        .filter(|k| k.status == Some(UrlStatus::Done) && k.record_id.is_some())
                        .map(|k| StoredAs::Text(k.fingerprint.as_deref()));
                    listed.stop_paginating |=
                        mode == IncrementalMode::Watermark && stored.is_some();
                    fetch_item(mode, item, stored, since).unwrap_or(true)
                }
            };
            if let Some(m) = listed.manifest.as_mut() {
                m.push(id, fingerprint, fetch);
            }
            if fetch {
                let link = NewUrl {
                    url: (*url).clone(),
                    kind: PageKind::Detail,
                    fingerprint: Some(item.fingerprint.clone()),
                    priority: self.priority_of(url, PageKind::Detail),
                };
                if decided.contains_key(&i) {
                    listed.changed.push(link);
                } else {
                    listed.new.push(link);
                }
            }
        }
    }

    /// Enqueues `new` in one write, leasing to this instance those its host queues have room
    /// for (listing pages first — the next one always —, then the highest priority); only links
    /// new to this pass (by `known`) can be leased here. Returns (added, leased here).
    async fn enqueue_leasing_what_fits(
        &self,
        lease: &UrlLease,
        mut new: Vec<NewUrl>,
        known: &HashMap<String, KnownPage>,
        queues: &HostQueues,
        now: DateTime<Utc>,
    ) -> Result<(u64, usize)> {
        for n in &new {
            self.note_host(lease.pass, n.url.host_port());
        }
        let fresh = |n: &NewUrl| {
            known
                .get(&url_id(&self.bot, &n.url))
                .is_none_or(|k| k.pass < lease.pass)
        };
        new.sort_by_key(|n| (!n.kind.is_listing(), -n.priority));
        let mut wishes: HashMap<String, usize> = HashMap::new();
        for n in new.iter().filter(|n| fresh(n)) {
            *wishes.entry(n.url.host_port()).or_default() += 1;
        }
        let mut granted: HashMap<String, usize> = HashMap::new();
        for (host, want) in &wishes {
            let target = self.queue_target(host, queues);
            let mut got = queues.reserve(host, *want, target);
            let listing = new
                .iter()
                .any(|n| n.kind.is_listing() && fresh(n) && n.url.host_port() == *host);
            if got == 0 && listing {
                // Always the next listing page: the pass's pagination never waits for a lease.
                got = queues.reserve_beyond_room(host, 1);
            }
            granted.insert(host.clone(), got);
        }
        // The granted links go first (enqueued leased), in the order above.
        let mut left = granted.clone();
        let (mut first, mut rest): (Vec<NewUrl>, Vec<NewUrl>) = (Vec::new(), Vec::new());
        for n in new {
            match left.get_mut(&n.url.host_port()) {
                Some(k) if *k > 0 && fresh(&n) => {
                    *k -= 1;
                    first.push(n);
                }
                _ => rest.push(n),
            }
        }
        let leased_here = first.len();
        tracing::trace!(
            links = first.len() + rest.len(),
            leased_here,
            queued = queues.len(),
            "follow"
        );
        first.extend(rest);
        let result = self
            .store
            .frontier()
            .enqueue_links(
                &self.bot,
                lease.pass,
                &first,
                known,
                Some(LeaseTo {
                    me: &self.me,
                    lease_for: self.limits.url_lease,
                    first: leased_here,
                }),
                now,
            )
            .await;
        self.take_reserved(queues, &granted, result)
    }

    /// Drops the table of listed items of `pass` (its pass is over).
    pub(super) async fn forget_known(&self, pass: PassNumber) {
        let mut held = self.known.lock().await;
        if held.as_ref().is_some_and(|t| t.pass == pass) {
            *held = None;
        }
    }

    /// The table of listed items known stored ([`Known`]) for `pass`: read once per pass (the
    /// first listing page waits for it), then shared.
    async fn known_items(&self, pass: PassNumber) -> Result<Arc<Known>> {
        let mut held = self.known.lock().await;
        if let Some(table) = held.as_ref().filter(|t| t.pass == pass) {
            return Ok(table.clone());
        }
        // The last pass's table goes first: two at once would double the memory.
        *held = None;
        let t0 = tokio::time::Instant::now();
        let table = Arc::new(Known::read(&self.store, &self.bot, pass).await?);
        debug!(bot = %self.bot, pass = pass.get(), items = table.len(), took = ?t0.elapsed(), "listed items read from the manifests");
        *held = Some(table.clone());
        Ok(table)
    }

    /// Settles the host-queue room `granted` for an enqueue whose links could be leased here:
    /// the links that arrived leased take the room reserved for them, and the reservation is
    /// returned whatever came of it (all of it on an error). The URLs added and leased.
    fn take_reserved(
        &self,
        queues: &HostQueues,
        granted: &HashMap<String, usize>,
        result: Result<crate::store::frontier::Enqueued>,
    ) -> Result<(u64, usize)> {
        let outcome = result.map(|enqueued| {
            let leased = enqueued.leased.len();
            for lease in enqueued.leased {
                queues.push(Queued {
                    ticket: self.stages.host_queue.enter(),
                    lease,
                });
            }
            (enqueued.added, leased)
        });
        for (host, n) in granted {
            queues.unreserve(host, *n);
        }
        outcome
    }

    /// A followed link's kind: a detail page when the record rules match it, else a listing
    /// page.
    fn kind_of(&self, link: &NormalizedUrl) -> PageKind {
        match &self.rules.record {
            Some(r) if r.url_match.is_match(link.as_str()) => PageKind::Detail,
            _ => PageKind::List,
        }
    }

    /// Remembers frontier ids this instance put into `pass` (bounded: cleared when full).
    pub(super) fn remember_enqueued(&self, pass: PassNumber, ids: Vec<String>) {
        let mut cache = self.enqueued.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 != pass || cache.1.len() + ids.len() > ENQUEUED_CACHE {
            *cache = (pass, HashSet::new());
        }
        cache.1.extend(ids);
    }

    /// Enqueues listing links in one write ([`Crawler::upsert_links`]) — the first of each host
    /// leased here whatever the room (the pagination never waits for a lease round), more if
    /// there is room. Returns what it did and the links' frontier ids.
    async fn follow_listing(
        &self,
        lease: &UrlLease,
        lists: &[(&NormalizedUrl, String)],
        queues: &HostQueues,
        now: DateTime<Utc>,
    ) -> Result<(Followed, Vec<String>)> {
        if lists.is_empty() {
            return Ok((Followed::default(), Vec::new()));
        }
        let links: Vec<NewUrl> = lists
            .iter()
            .map(|(url, _)| NewUrl {
                url: (*url).clone(),
                kind: PageKind::List,
                fingerprint: None,
                priority: self.priority_of(url, PageKind::List),
            })
            .collect();
        let (added, leased) = self.upsert_links(lease, &links, queues, true, now).await?;
        let ids = lists.iter().map(|(_, id)| id.clone()).collect();
        Ok((
            Followed {
                manifest: None,
                added,
                leased,
            },
            ids,
        ))
    }

    /// Enqueues `links` in one write without reading what the frontier holds of them
    /// ([`Frontier::enqueue_listing`]: an upsert per link, which inserts it, resets it when it was
    /// last crawled in an earlier pass, and leaves it alone when it is in this pass already),
    /// the ones this instance has room for leased here and queued for their host at once — with
    /// `always_first`, the first of each host whatever the room. The URLs added and leased.
    async fn upsert_links(
        &self,
        lease: &UrlLease,
        links: &[NewUrl],
        queues: &HostQueues,
        always_first: bool,
        now: DateTime<Utc>,
    ) -> Result<(u64, usize)> {
        if links.is_empty() {
            return Ok((0, 0));
        }
        // The leased ones are a prefix: as many as have room, in order.
        let mut granted: HashMap<String, usize> = HashMap::new();
        let mut first = 0;
        for link in links {
            let host = link.url.host_port();
            self.note_host(lease.pass, host.clone());
            let got = if always_first && !granted.contains_key(&host) {
                queues.reserve_beyond_room(&host, 1)
            } else {
                queues.reserve(&host, 1, self.queue_target(&host, queues))
            };
            if got == 0 {
                break;
            }
            *granted.entry(host).or_default() += 1;
            first += 1;
        }
        let result = self
            .store
            .frontier()
            .enqueue_listing(
                &self.bot,
                lease.pass,
                links,
                LeaseTo {
                    me: &self.me,
                    lease_for: self.limits.url_lease,
                    first,
                },
                now,
            )
            .await;
        self.take_reserved(queues, &granted, result)
    }

    /// The settle step: what the page came to, as the group commit will store it. A parsed page
    /// is followed first (its links enqueued).
    pub async fn settle(
        &self,
        mut lease: UrlLease,
        parsed: Parsed,
        pass: &Pass,
        queues: &HostQueues,
    ) -> Result<Settled> {
        let now = self.clock.now();
        let settled = |lease: UrlLease, mark: Mark, result: Option<PageResult>| Settled {
            lease,
            record: None,
            removed: None,
            mark,
            result,
            new_pending: 0,
        };
        let outcome = match parsed {
            Parsed::Page { data, validators } => {
                lease.validators = validators;
                let followed = self.follow(&lease, pass, &data, queues, now).await?;
                let done = Mark::Done {
                    validators: lease.validators.clone(),
                    record_id: None,
                    manifest: followed.manifest,
                };
                let mut page = match data.record {
                    Some(Ok((natural_key, fields))) => {
                        let record = Extracted {
                            bot: self.bot.clone(),
                            natural_key,
                            data: fields,
                        };
                        let mut s = settled(
                            lease,
                            done,
                            Some(PageResult::Stored(
                                crate::store::records::RecordWrite::Unchanged,
                            )),
                        );
                        s.record = Some(record);
                        s
                    }
                    Some(Err(reason)) => self.fail(lease, &reason),
                    None => settled(lease, done, Some(PageResult::Done)),
                };
                page.new_pending = followed.added.saturating_sub(followed.leased as u64);
                return Ok(page);
            }
            Parsed::Other(Fetched::Released) => {
                let mark = Mark::Release {
                    not_before: now,
                    reason: "given back at shutdown".into(),
                };
                return Ok(settled(lease, mark, None));
            }
            Parsed::Other(Fetched::HostPaused { wait, reason }) => {
                let mark = Mark::Release {
                    not_before: crate::store::plus(now, wait),
                    reason,
                };
                return Ok(settled(lease, mark, None));
            }
            Parsed::Other(Fetched::Disallowed) => {
                return Ok(self.fail(lease, "disallowed by robots.txt"));
            }
            Parsed::Other(Fetched::Outcome(outcome)) => outcome,
        };
        let done = |lease: &UrlLease| Mark::Done {
            validators: lease.validators.clone(),
            record_id: None,
            manifest: None,
        };
        Ok(match outcome {
            FetchOutcome::Ok(_) => unreachable!("pages are parsed before they are settled"),
            FetchOutcome::NotModified => {
                settled(lease.clone(), done(&lease), Some(PageResult::NotModified))
            }
            FetchOutcome::Skipped { reason } => {
                debug!(bot = %self.bot, url = %lease.url, %reason, "skipped");
                settled(lease.clone(), done(&lease), Some(PageResult::Skipped))
            }
            FetchOutcome::Gone { status } if lease.kind == PageKind::Detail => {
                debug!(bot = %self.bot, url = %lease.url, status, "detail page gone; record marked removed");
                // A lease taken without a read of its entry (a changed item) does not carry the
                // record's id: the entry does. An entry leased before in this pass may not know
                // it either: that lease's record can have landed without its mark (a crash
                // between the two writes, a lease taken over), so the records are asked by URL.
                let record = match &lease.record_id {
                    Some(id) => Some(id.clone()),
                    None => match self
                        .store
                        .frontier()
                        .known_by_id(&self.bot, std::slice::from_ref(&lease.id))
                        .await?
                        .remove(&lease.id)
                        .and_then(|k| k.record_id)
                    {
                        Some(id) => Some(id),
                        None if lease.attempt > 1 || lease.reclaimed => {
                            self.store
                                .records()
                                .live_record_at(&self.bot, &lease.url)
                                .await?
                        }
                        None => None,
                    },
                };
                let mut s = settled(lease.clone(), done(&lease), Some(PageResult::Gone));
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

    /// Failed with its reason. (A detail page that failed is no evidence its item is gone:
    /// deletion detection reads the listings, not the detail pages.)
    fn fail(&self, lease: UrlLease, reason: &str) -> Settled {
        debug!(bot = %self.bot, url = %lease.url, %reason, "page failed");
        Settled {
            record: None,
            removed: None,
            mark: Mark::Failed {
                reason: reason.to_owned(),
            },
            result: Some(PageResult::Failed(reason.to_owned())),
            new_pending: 0,
            lease,
        }
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
        if lease.attempt >= i64::from(self.limits.attempts) {
            let why = format!("{reason} (after {} attempts)", lease.attempt);
            return self.fail(lease, &why);
        }
        let attempt = u32::try_from(lease.attempt.max(1)).unwrap_or(u32::MAX);
        let backoff = full_jitter(self.limits.backoff_base, self.limits.backoff_max, attempt);
        let mut wait = retry_after.map_or(backoff, |r| r.max(backoff));
        // Retries are load: past the host's budget, the retry waits out the budget's window.
        if !self.flow.may_retry(&lease.host(), Instant::now()) {
            wait = wait.max(self.flow.settings().retry_window);
            self.metrics.retry_deferred(&self.bot);
        }
        debug!(bot = %self.bot, url = %lease.url, %reason, ?wait, "will retry");
        Settled {
            mark: Mark::Retry {
                not_before: crate::store::plus(now, wait),
                reason: reason.to_owned(),
            },
            record: None,
            removed: None,
            result: Some(PageResult::Retry),
            new_pending: 0,
            lease,
        }
    }
}
