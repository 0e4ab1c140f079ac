//! The follow stage: what a parsed page leads to.
//!
//! [`Follower::step`] runs as soon as a page is parsed — the listing fast lane: a listing
//! page's links are enqueued right away, not behind the pages waiting to be committed — and
//! enqueues the links this instance has room for **leased to it** (always the next listing page),
//! straight into the host queues: a pagination hop is fetch + parse + one write. On listing
//! pages the incremental mode decides which items' detail pages this pass fetches — an item the
//! manifests of earlier passes show known stored with the same fingerprint costs no read at all
//! ([`Known`](super::known::Known)) — and the page's [`Manifest`] (what it listed) goes with its
//! done mark. An item not fetched is not written: nothing per unchanged item.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::watch;

use super::dispatch::{Confirmation, HostQueues, QueueSizing, Queued};
use super::known::Listed;
use super::pass::Pass;
use super::shared::{PassMemory, Shared};
use crate::config::IncrementalMode;
use crate::error::Result;
use crate::extract::{Bound, Dropped, ListItem, PageData};
use crate::store::frontier::{
    fingerprint_hash, url_id, KnownPage, LeaseTo, Manifest, NewUrl, PageKind, UrlLease, UrlStatus,
};
use crate::urls::NormalizedUrl;

/// How many of a listing page's items are decided and enqueued at a time: all of an HTML
/// listing's, a slice of a sitemap file's.
const ITEMS_AT_ONCE: usize = 2_000;

/// What following a page's links did.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Followed {
    /// What a listing or seed page listed (for its done mark).
    pub manifest: Option<Arc<Manifest>>,
    /// Links added to the pass (new, or back from an earlier pass).
    pub added: u64,
    /// Of those, leased to this instance as they were enqueued (now in its host queues).
    pub leased: usize,
}

/// A fetched page's links, sorted for [`Follower::step`].
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
    /// The depth of the detail pages it enqueues (one below the page).
    depth: u32,
}

/// How a listed item is known stored: with the fingerprint it is listed with now (its
/// manifests agree on that one), or with the fingerprint its frontier entry was stored with.
#[derive(Clone, Copy, Debug)]
enum StoredAs<'a> {
    AsListed,
    Text(Option<&'a str>),
}

/// Whether a listed item's detail page is fetched this pass by the incremental `mode`, given
/// how it is known stored (`None`: not known stored) and, for `updated_at`, the time since
/// which a change counts. `None`: that is not enough to say — never in `full` mode or for an
/// item not known stored (fetch it), an item without a change signal (a sitemap `<url>`
/// without `<lastmod>`), or an `updated_at` item without a readable time.
fn fetch_item(
    mode: IncrementalMode,
    item: &ListItem,
    stored: Option<StoredAs<'_>>,
    since: Option<DateTime<Utc>>,
) -> Option<bool> {
    if item.unversioned {
        return None;
    }
    match (mode, stored) {
        (IncrementalMode::Full, _) | (_, None) => None,
        (IncrementalMode::Fingerprint, Some(StoredAs::AsListed)) => Some(false),
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

/// The follow stage: what this instance remembers of the pass (the hosts with work, the links
/// it enqueued, the table of listed items) and how much each host's queue holds.
pub(crate) struct Follower {
    shared: Arc<Shared>,
    memory: Arc<PassMemory>,
    sizing: Arc<QueueSizing>,
}

/// A listing page's pagination links, as [`Follower::upsert_links`] enqueues them: the first of
/// each host leased here whatever the room, and fetched ahead of the write where that pays.
#[derive(Clone, Copy, Debug)]
struct Chain {
    /// The links the page names besides its pagination (its items, detail pages, plain links).
    reveals: usize,
}

impl Follower {
    pub(crate) fn new(
        shared: Arc<Shared>,
        memory: Arc<PassMemory>,
        sizing: Arc<QueueSizing>,
    ) -> Self {
        Self {
            shared,
            memory,
            sizing,
        }
    }

    /// The follow step: enqueues what a fetched page leads to, leasing to this instance the
    /// links it has room for (see the module comment), and — for a listing or seed page — what
    /// it listed: its [`Manifest`] for the page's done mark.
    pub(crate) async fn step(
        &self,
        lease: &UrlLease,
        pass: &Pass,
        data: &PageData,
        queues: &HostQueues,
        now: DateTime<Utc>,
    ) -> Result<Followed> {
        let mode = self.shared.mode(pass);
        // What the trap bounds drop of this page's links: by their shape (read with the page),
        // by depth (all of them, past `max_depth`), by the pass's page bounds (as enqueued).
        let mut dropped = data.bounded;
        let depth = lease.depth.saturating_add(1);
        if depth > self.shared.rules.bounds.max_depth {
            let links = data.links.len() + data.items.iter().filter(|i| i.url.is_some()).count();
            dropped.add(Bound::Depth, links as u64);
            self.note_dropped(lease, &dropped).await?;
            return Ok(Followed {
                manifest: lease.kind.is_listing().then(|| {
                    Arc::new(Manifest {
                        evaluated: pass.evaluated,
                        ..Manifest::default()
                    })
                }),
                ..Followed::default()
            });
        }
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
                .partition(|(link, _)| self.shared.kind_of(link) == PageKind::List);
            // What the page reveals besides its pagination: the chain goes ahead of its writes
            // only while these find room in their host's queue (see `upsert_links`).
            let reveals = items.len() + detail_links.len() + plain.len();
            let chain = Chain { reveals };
            self.follow_pagination(
                lease,
                &lists,
                chain,
                queues,
                now,
                &mut followed,
                &mut dropped,
            )
            .await?;
        }
        // A listing's items in slices of `ITEMS_AT_ONCE` (a sitemap file lists up to 50,000):
        // each slice is decided and its detail pages enqueued before the next, so what the
        // decision holds (ids, frontier entries, links) stays small. The page's other links go
        // with the last slice.
        let mut manifest = lease.kind.is_listing().then(|| Manifest {
            evaluated: pass.evaluated,
            ..Manifest::default()
        });
        let mut stop_paginating = false;
        let mut slices = items.chunks(ITEMS_AT_ONCE).peekable();
        let (mut listed, known) = loop {
            let slice = slices.next().unwrap_or_default();
            let last = slices.peek().is_none();
            let (mut listed, known) = self
                .list_items(
                    lease,
                    pass,
                    mode,
                    slice,
                    if last { &plain } else { &[] },
                    manifest.take(),
                    queues,
                    now,
                    &mut followed,
                    &mut dropped,
                )
                .await?;
            listed.stop_paginating |= stop_paginating;
            if last {
                break (listed, known);
            }
            stop_paginating = listed.stop_paginating;
            manifest = listed.manifest.take();
            let new = std::mem::take(&mut listed.new);
            self.enqueue_within_bounds(
                lease,
                new,
                &known,
                queues,
                now,
                &mut followed,
                &mut dropped,
            )
            .await?;
        };
        if let Some(m) = listed.manifest.as_mut() {
            for link in &detail_links {
                m.push(&url_id(&self.shared.bot, link), 0, false);
            }
        }
        followed.manifest = listed.manifest.take().map(Arc::new);
        let (new, ids) = self.plain_links(plain, &mut listed, depth);
        if self
            .enqueue_within_bounds(lease, new, &known, queues, now, &mut followed, &mut dropped)
            .await?
        {
            self.memory.remember_enqueued(lease.pass, ids);
        }
        self.note_dropped(lease, &dropped).await?;
        Ok(followed)
    }

    /// Enqueues the links of `new` the pass's page bounds admit
    /// ([`Follower::enqueue_leasing_what_fits`]), into `followed`; whether any were.
    #[allow(clippy::too_many_arguments)]
    async fn enqueue_within_bounds(
        &self,
        lease: &UrlLease,
        new: Vec<NewUrl>,
        known: &HashMap<String, KnownPage>,
        queues: &HostQueues,
        now: DateTime<Utc>,
        followed: &mut Followed,
        dropped: &mut Dropped,
    ) -> Result<bool> {
        let new = self.within_bounds(lease, new, dropped).await?;
        if new.is_empty() {
            return Ok(false);
        }
        let (added, leased) = self
            .enqueue_leasing_what_fits(lease, new, known, queues, now)
            .await?;
        followed.added += added;
        followed.leased += leased;
        Ok(true)
    }

    /// The links of `links` the pass's page bounds admit (see `crawl::bounds`); the rest are
    /// counted into `dropped`.
    async fn within_bounds(
        &self,
        lease: &UrlLease,
        links: Vec<NewUrl>,
        dropped: &mut Dropped,
    ) -> Result<Vec<NewUrl>> {
        if links.is_empty() {
            return Ok(links);
        }
        let bounds = self.shared.rules.bounds;
        self.memory
            .budget
            .admit(
                &self.shared.store,
                &self.shared.bot,
                lease.pass,
                bounds.max_pages,
                bounds.max_pages_per_host,
                links,
                dropped,
            )
            .await
    }

    /// Counts what the trap bounds dropped of a page's links ([`super::bounds::note_dropped`]).
    async fn note_dropped(&self, lease: &UrlLease, dropped: &Dropped) -> Result<()> {
        super::bounds::note_dropped(&self.shared, lease.pass, dropped).await
    }

    /// Decides a listing page's items (see [`Listing`]): from the manifests of earlier passes
    /// where they tell, else from the frontier entries of the items and of `plain` (read in one
    /// round trip, returned for the plain links' enqueue); the changed items known stored are
    /// enqueued here.
    #[allow(clippy::too_many_arguments)]
    async fn list_items(
        &self,
        lease: &UrlLease,
        pass: &Pass,
        mode: IncrementalMode,
        items: &[(&ListItem, &NormalizedUrl)],
        plain: &[(&NormalizedUrl, String)],
        manifest: Option<Manifest>,
        queues: &HostQueues,
        now: DateTime<Utc>,
        followed: &mut Followed,
        dropped: &mut Dropped,
    ) -> Result<(Listing, HashMap<String, KnownPage>)> {
        let since = pass.last_run_at.map(|t| {
            t - chrono::Duration::from_std(self.shared.rules.incremental.overlap)
                .unwrap_or_default()
        });
        let mut listed = Listing {
            manifest,
            depth: lease.depth.saturating_add(1),
            ..Listing::default()
        };
        // Each item's frontier id and fingerprint hash, once for every decision below.
        let hashed: Vec<(String, i64)> = items
            .iter()
            .map(|(item, url)| {
                let id = url_id(&self.shared.bot, url);
                (id, fingerprint_hash(&item.fingerprint))
            })
            .collect();
        // What the manifests of earlier passes say of the items: an item listed with the same
        // fingerprint and known stored needs no read and no fetch.
        let decided = self
            .decide_from_manifests(lease, items, &hashed, mode, since, &mut listed)
            .await?;
        let to_read: Vec<String> = hashed
            .iter()
            .enumerate()
            .filter(|(i, _)| !decided.contains_key(i))
            .map(|(_, (id, _))| id.clone())
            .chain(plain.iter().map(|(_, id)| id.clone()))
            .collect();
        let known = if to_read.is_empty() {
            HashMap::new()
        } else {
            self.shared
                .store
                .frontier()
                .known_by_id(&self.shared.bot, &to_read)
                .await?
        };
        let ids = items.iter().zip(hashed);
        self.decide_items(ids, &decided, &known, mode, since, &mut listed);
        let changed = std::mem::take(&mut listed.changed);
        listed.changed = self.within_bounds(lease, changed, dropped).await?;
        if !listed.changed.is_empty() {
            listed.changed.sort_by_key(|n| -n.priority);
            let (added, leased) = self
                .upsert_links(lease, &listed.changed, queues, None, now)
                .await?;
            followed.added += added;
            followed.leased += leased;
        }
        Ok((listed, known))
    }

    /// What to enqueue of a page: the new items' detail pages `listed` decided to fetch, and its
    /// plain links — without further listing pages once watermark mode stopped paginating —
    /// with the frontier ids of the plain links enqueued.
    fn plain_links(
        &self,
        plain: Vec<(&NormalizedUrl, String)>,
        listed: &mut Listing,
        depth: u32,
    ) -> (Vec<NewUrl>, Vec<String>) {
        let mut new = std::mem::take(&mut listed.new);
        let mut ids = Vec::with_capacity(plain.len());
        for (link, id) in plain {
            let kind = self.shared.kind_of(link);
            if listed.stop_paginating && kind == PageKind::List {
                continue;
            }
            new.push(NewUrl {
                url: link.clone(),
                kind,
                fingerprint: None,
                priority: self.shared.priority_of(link, kind),
                depth,
            });
            ids.push(id);
        }
        (new, ids)
    }

    /// Enqueues a page's listing links (the pagination chain) leased here, into `followed`.
    #[allow(clippy::too_many_arguments)]
    async fn follow_pagination(
        &self,
        lease: &UrlLease,
        lists: &[(&NormalizedUrl, String)],
        chain: Chain,
        queues: &HostQueues,
        now: DateTime<Utc>,
        followed: &mut Followed,
        dropped: &mut Dropped,
    ) -> Result<()> {
        let t0 = tokio::time::Instant::now();
        // Remembered before the write is sent: the pages fetched ahead of it (see
        // `upsert_links`) link back to these, and must not fetch them ahead again. A failed
        // write forgets them, and the page is followed again.
        let ids: Vec<String> = lists.iter().map(|(_, id)| id.clone()).collect();
        self.memory.remember_enqueued(lease.pass, ids.clone());
        let f = match self
            .follow_listing(lease, lists, chain, queues, now, dropped)
            .await
        {
            Ok(f) => f,
            Err(e) => {
                self.memory.forget_enqueued(lease.pass, &ids);
                return Err(e);
            }
        };
        tracing::trace!(took = ?t0.elapsed(), leased = f.leased, "listing links enqueued");
        followed.added += f.added;
        followed.leased += f.leased;
        Ok(())
    }

    /// What a fetched page links to, sorted for [`Follower::step`]: a listing page's items (each
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
                .filter(|link| {
                    !item_urls.contains(link) && self.shared.kind_of(link) == PageKind::Detail
                })
                .collect()
        } else {
            Vec::new()
        };
        let plain = data
            .links
            .iter()
            .filter(|link| !item_urls.contains(link))
            .map(|link| (link, url_id(&self.shared.bot, link)))
            .filter(|(_, id)| !self.memory.enqueued(lease.pass, id))
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
        hashed: &[(String, i64)],
        mode: IncrementalMode,
        since: Option<DateTime<Utc>>,
        listed: &mut Listing,
    ) -> Result<HashMap<usize, bool>> {
        let mut decided = HashMap::new();
        if items.is_empty() {
            return Ok(decided);
        }
        let table = self
            .memory
            .known_items(&self.shared.store, &self.shared.bot, lease.pass)
            .await?;
        for (i, ((item, _), (id, fp))) in items.iter().zip(hashed).enumerate() {
            let stored = match table.get(id, *fp) {
                Listed::Stored => Some(StoredAs::AsListed),
                // Only a fetch can follow, and only `fingerprint` mode says so without a read
                // (an upsert: right for a new item that shares the key bits, too).
                Listed::Changed if mode == IncrementalMode::Fingerprint => {
                    decided.insert(i, true);
                    continue;
                }
                Listed::Changed | Listed::Unknown => None,
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
    fn decide_items<'i>(
        &self,
        items: impl Iterator<Item = (&'i (&'i ListItem, &'i NormalizedUrl), (String, i64))>,
        decided: &HashMap<usize, bool>,
        known: &HashMap<String, KnownPage>,
        mode: IncrementalMode,
        since: Option<DateTime<Utc>>,
        listed: &mut Listing,
    ) {
        for (i, ((item, url), (id, fingerprint))) in items.enumerate() {
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
                m.push(&id, fingerprint, fetch);
            }
            if fetch {
                let link = NewUrl {
                    url: (*url).clone(),
                    kind: PageKind::Detail,
                    fingerprint: Some(item.fingerprint.clone()),
                    priority: self.shared.priority_of(url, PageKind::Detail),
                    depth: listed.depth,
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
            self.memory.note_host(lease.pass, n.url.host_port());
        }
        let fresh = |n: &NewUrl| {
            known
                .get(&url_id(&self.shared.bot, &n.url))
                .is_none_or(|k| k.pass < lease.pass)
        };
        new.sort_by_key(|n| (!n.kind.is_listing(), -n.priority));
        let mut wishes: HashMap<String, usize> = HashMap::new();
        for n in new.iter().filter(|n| fresh(n)) {
            *wishes.entry(n.url.host_port()).or_default() += 1;
        }
        let mut granted: HashMap<String, usize> = HashMap::new();
        for (host, want) in &wishes {
            let target = self.sizing.target(host, queues);
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
            .shared
            .store
            .frontier()
            .enqueue_links(
                &self.shared.bot,
                lease.pass,
                &first,
                known,
                Some(LeaseTo {
                    me: &self.shared.me,
                    lease_for: self.shared.limits.url_lease,
                    first: leased_here,
                }),
                now,
            )
            .await;
        self.take_reserved(queues, &granted, result)
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
                    ticket: self.shared.stages.host_queue.enter(),
                    lease,
                    confirm: None,
                });
            }
            (enqueued.added, leased)
        });
        for (host, n) in granted {
            queues.unreserve(host, *n);
        }
        outcome
    }

    /// Enqueues listing links in one write ([`Follower::upsert_links`]) — the first of each host
    /// leased here whatever the room (the pagination never waits for a lease round), more if
    /// there is room. Returns what it did.
    async fn follow_listing(
        &self,
        lease: &UrlLease,
        lists: &[(&NormalizedUrl, String)],
        chain: Chain,
        queues: &HostQueues,
        now: DateTime<Utc>,
        dropped: &mut Dropped,
    ) -> Result<Followed> {
        if lists.is_empty() {
            return Ok(Followed::default());
        }
        let links: Vec<NewUrl> = lists
            .iter()
            .map(|(url, _)| NewUrl {
                url: (*url).clone(),
                kind: PageKind::List,
                fingerprint: None,
                priority: self.shared.priority_of(url, PageKind::List),
                depth: lease.depth.saturating_add(1),
            })
            .collect();
        let links = self.within_bounds(lease, links, dropped).await?;
        let (added, leased) = self
            .upsert_links(lease, &links, queues, Some(chain), now)
            .await?;
        Ok(Followed {
            manifest: None,
            added,
            leased,
        })
    }

    /// Enqueues `links` in one write without reading what the frontier holds of them
    /// ([`Frontier::upsert_links`]: an upsert per link, which inserts it, resets it when it was
    /// last crawled in an earlier pass, and leaves it alone when it is in this pass already),
    /// the ones this instance has room for leased here and queued for their host at once — for
    /// a `chain`, the first of each host whatever the room. The URLs added and leased.
    async fn upsert_links(
        &self,
        lease: &UrlLease,
        links: &[NewUrl],
        queues: &HostQueues,
        chain: Option<Chain>,
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
            self.memory.note_host(lease.pass, host.clone());
            let got = if chain.is_some() && !granted.contains_key(&host) {
                queues.reserve_beyond_room(&host, 1)
            } else {
                queues.reserve(&host, 1, self.sizing.target(&host, queues))
            };
            if got == 0 {
                break;
            }
            *granted.entry(host).or_default() += 1;
            first += 1;
        }
        // The pagination chain (the listing links of a listing page), while its writes take at
        // least as long as a fetch from the host (see [`Shared::write_outlasts_fetch`]: the
        // database's distance and its load): the leases are
        // queued for their hosts as the write is sent, each with a confirmation its page waits
        // for before it is committed — the next listing page is fetched while its write is on
        // its way, and kept only if the write took its lease. A lease the write did not take was
        // a wasted request (another instance walks the same chain, or the pass resumed): after
        // one, this instance waits for the write for the rest of the pass. Other links (a
        // product page's link back to its listing) wait for the write, and so does the chain
        // unless its host's queue, with what this page reveals, stays at most half full: the
        // chain does not pace the crawl then, and running it ahead would reveal detail pages with
        // no room to be leased on enqueue, which cost lease rounds instead (measured with the
        // database 10 ms away, 50 listing pages of 100 products, the chain fetched ahead while
        // its host's queue alone was half empty: 0.73–0.82 of the speed of waiting, with 1.3
        // times the lease reads and 1.7 times the lease writes). While the write is shorter
        // than the fetch it would hide, the chain waits for it (see BENCHMARKS.md, "The
        // pagination chain").
        let fetch_ahead = chain.is_some_and(|c| {
            lease.kind.is_listing()
                && !self.memory.ahead_missed(lease.pass)
                && first > 0
                && links.iter().take(first).all(|l| {
                    let host = l.url.host_port();
                    self.shared.write_outlasts_fetch(&host)
                        && queues.half_empty_with(
                            &host,
                            c.reveals,
                            self.sizing.target(&host, queues),
                        )
                })
        });
        let mut ahead: Vec<(String, watch::Sender<Option<bool>>)> = Vec::new();
        let sent = tokio::time::Instant::now();
        let result = self
            .shared
            .store
            .frontier()
            .upsert_links(
                &self.shared.bot,
                lease.pass,
                links,
                LeaseTo {
                    me: &self.shared.me,
                    lease_for: self.shared.limits.url_lease,
                    first,
                },
                now,
                |leases| {
                    if !fetch_ahead {
                        return;
                    }
                    for lease in leases {
                        let (tx, confirm) = Confirmation::pending();
                        ahead.push((lease.id.clone(), tx));
                        let target = self.sizing.target(&lease.host(), queues);
                        let queued = Queued {
                            ticket: self.shared.stages.host_queue.enter(),
                            lease,
                            confirm: Some(confirm),
                        };
                        queues.push_chain(queued, target);
                    }
                    for (host, n) in &granted {
                        queues.unreserve(host, *n);
                    }
                },
            )
            .await;
        if chain.is_some() && first > 0 && result.is_ok() {
            self.shared.chain_writes.note(sent.elapsed());
        }
        if !fetch_ahead {
            return self.take_reserved(queues, &granted, result);
        }
        let taken: HashSet<&str> = match &result {
            Ok(enqueued) => enqueued.leased.iter().map(|l| l.id.as_str()).collect(),
            Err(_) => HashSet::new(),
        };
        for (id, tx) in &ahead {
            let took = taken.contains(id.as_str());
            if !took && result.is_ok() {
                self.memory.note_ahead_missed(lease.pass);
            }
            let _ = tx.send(Some(took));
        }
        result.map(|enqueued| (enqueued.added, enqueued.leased.len()))
    }
}
