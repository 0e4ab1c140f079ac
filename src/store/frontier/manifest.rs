//! Listing manifests: what each seed and listing page listed (frontier ids packed as binary,
//! fingerprint hashes), streamed to the next pass through the listing pages' index.

use super::*;

/// What a listing (or seed) page listed when this pass read it, carried by the page's fenced done
/// mark — one write per listing page, none per item, and nothing at all for where an item sits in
/// the pagination. `listed` holds the frontier ids of the detail pages the page points at (its
/// items' links, then its other links the record rules match), `fingerprints` the hash of each
/// item's listing fingerprint ([`fingerprint_hash`]; 0 for a plain link), `fetched` the
/// positions of the items this pass enqueued to fetch (their records are not known stored until
/// the fetch commits).
///
/// The next pass decides from the manifests which items need no fetch and no read
/// (`crawl::known`); deletion detection compares them with what the page listed at the last
/// evaluation (`store::deletions`).
#[derive(Clone, Debug, Default)]
pub struct Manifest {
    pub listed: Vec<String>,
    pub fingerprints: Vec<i64>,
    pub fetched: Vec<i32>,
    /// The last pass whose evaluation applied its removals, as the reader knew it: a page whose
    /// previous read was that pass's starts its baseline anew from that read (an older value
    /// only keeps more — a superset is always safe).
    pub evaluated: PassNumber,
    /// The keys ([`id_key`]) of `listed`, for [`Manifest::push`]'s check.
    pub(crate) keys: std::collections::HashSet<u64>,
}

impl PartialEq for Manifest {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.listed,
            &self.fingerprints,
            &self.fetched,
            self.evaluated,
        ) == (
            &other.listed,
            &other.fingerprints,
            &other.fetched,
            other.evaluated,
        )
    }
}

impl Manifest {
    /// Adds a detail page (once: a page that lists an item twice lists it once, told by the
    /// id's key first — a sitemap of 50,000 pages costs no quadratic scan).
    pub(crate) fn push(&mut self, id: String, fingerprint: i64, fetched: bool) -> bool {
        if self.keys.len() < self.listed.len() {
            self.keys = self.listed.iter().map(|i| id_key(i)).collect();
        }
        if !self.keys.insert(id_key(&id)) && self.listed.contains(&id) {
            return false;
        }
        if fetched {
            self.fetched
                .push(i32::try_from(self.listed.len()).unwrap_or(i32::MAX));
        }
        self.listed.push(id);
        self.fingerprints.push(fingerprint);
        true
    }

    /// A hash of the list as a set (order and repeats do not count).
    pub(crate) fn hash(&self) -> String {
        let mut ids: Vec<&str> = self.listed.iter().map(String::as_str).collect();
        ids.sort_unstable();
        ids.dedup();
        let joined = ids.join("\n");
        crate::ids::sha256_hex(&[joined.as_bytes()], 16)
    }
}

/// A listing fingerprint as a manifest keeps it: 64 bits of its hash, never 0 (0 marks a plain
/// link).
pub fn fingerprint_hash(fingerprint: &str) -> i64 {
    match crate::ids::sha256_u64(&[fingerprint.as_bytes()]) as i64 {
        0 => 1,
        n => n,
    }
}

/// The filters that read `bot`'s seed and listing entries whose `pass` meets `pass` (one operator:
/// `{$eq: n}`, `{$lt: n}`, `{$gte: 0}` for all), one per listing kind. Each is the index's own
/// fields, equalities then one operator — a shape every server answers from [`LISTINGS_INDEX`]
/// with no hint (the test server routes only that shape through an index, and a bare `pass: n`
/// beside the partial filter's field not at all). Conditions on other fields are the reader's.
pub(crate) fn listing_filters(bot: &BotId, pass: Document) -> Vec<Document> {
    PageKind::LISTING
        .iter()
        .map(|kind| doc! { f::KIND: kind.as_str(), f::BOT: bot.as_str(), f::PASS: pass.clone() })
        .collect()
}

/// The seed and listing entries an earlier pass than `pass` read (see [`listing_filters`]); of
/// them, [`read_since`] tells those the last complete pass read.
pub fn unreached_listings_filters(bot: &BotId, pass: PassNumber) -> Vec<Document> {
    listing_filters(bot, doc! { "$lt": pass })
}

/// Whether a listing entry (read with its `status` and `doneAt`) was read, done, since `since`.
pub(crate) fn read_since(entry: &bson::RawDocument, since: DateTime<Utc>) -> bool {
    entry.get_str(f::STATUS).ok() == Some(UrlStatus::Done.as_str())
        && entry
            .get_datetime(f::DONE_AT)
            .ok()
            .is_some_and(|at| at.to_chrono() >= since)
}

/// [`LISTINGS_INDEX`]'s partial filter: the kinds that link to other pages, as the one bound
/// every server proves a query implies (`list` and `seed` sort after `detail`; an `$in` of the
/// kinds is a filter the test server never proves implied, and MongoDB accepts only from 6.0).
pub(super) fn listing_partial() -> Document {
    doc! { f::KIND: { "$gt": PageKind::Detail.as_str() } }
}

/// One item of a stored manifest, as [`Frontier::listing_manifests`] hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ListedItem {
    /// The key of the detail page's frontier id ([`id_key`]).
    pub key: u64,
    /// Its fingerprint hash (0: a plain link, no item).
    pub fingerprint: i64,
    /// Whether the pass that read the manifest enqueued it to fetch.
    pub fetch: bool,
}

/// Bytes of a frontier id as a manifest packs it (`url_id` is 32 hex digits: 16 bytes).
pub(super) const ID_BYTES: usize = 16;

/// The key of a frontier id: its first 64 bits (16 hex digits). Two ids that share them are one
/// key; whoever compares by key must treat a collision as "unsure", never as "the same".
pub(crate) fn id_key(id: &str) -> u64 {
    let end = id.len().min(16);
    u64::from_str_radix(&id[..end], 16).unwrap_or_else(|_| crate::ids::sha256_u64(&[id.as_bytes()]))
}

/// A manifest's ids as they are stored: packed, 16 bytes an id in one binary value (what this
/// version writes — a tenth of the BSON of an array of strings, and one value for the server to
/// copy), or an array of hex strings (a hand-written document, or ids that are not hex).
#[derive(Clone, Debug)]
pub(in crate::store) enum Ids<'a> {
    Packed(&'a [u8]),
    Strings(Vec<&'a str>),
}

impl<'a> Ids<'a> {
    /// The ids in `value` (anything else: none).
    pub(in crate::store) fn of_value(value: Option<bson::RawBsonRef<'a>>) -> Ids<'a> {
        match value {
            Some(bson::RawBsonRef::Binary(b)) => Ids::Packed(b.bytes),
            Some(bson::RawBsonRef::Array(a)) => {
                Ids::Strings(a.into_iter().filter_map(|v| v.ok()?.as_str()).collect())
            }
            _ => Ids::Strings(Vec::new()),
        }
    }

    /// The ids of field `name`.
    pub(in crate::store) fn of(doc: &'a bson::RawDocument, name: &str) -> Ids<'a> {
        Ids::of_value(doc.get(name).ok().flatten())
    }

    pub(in crate::store) fn len(&self) -> usize {
        match self {
            Ids::Packed(bytes) => bytes.len() / ID_BYTES,
            Ids::Strings(ids) => ids.len(),
        }
    }

    /// The key ([`id_key`]) of id `i`.
    pub(in crate::store) fn key(&self, i: usize) -> u64 {
        match self {
            Ids::Packed(bytes) => {
                let mut first = [0u8; 8];
                first.copy_from_slice(&bytes[i * ID_BYTES..i * ID_BYTES + 8]);
                u64::from_be_bytes(first)
            }
            Ids::Strings(ids) => id_key(ids[i]),
        }
    }

    pub(in crate::store) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(|i| self.key(i))
    }

    /// Id `i` in full, as the frontier's `_id` spells it.
    pub(in crate::store) fn id(&self, i: usize) -> String {
        match self {
            Ids::Packed(bytes) => bytes[i * ID_BYTES..(i + 1) * ID_BYTES]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            Ids::Strings(ids) => ids[i].to_owned(),
        }
    }
}

/// A page's baseline as stored in `listedSince` (see `store::deletions`): null or missing means
/// its list itself; otherwise every list it showed since the last evaluation — packed lists, or
/// the ids of an array of strings (an empty array: an empty baseline).
pub(in crate::store) fn baseline_lists(page: &bson::RawDocument) -> Vec<Ids<'_>> {
    match page.get(f::LISTED_SINCE).ok().flatten() {
        Some(bson::RawBsonRef::Array(items)) => {
            let mut lists = Vec::new();
            let mut loose: Vec<&str> = Vec::new();
            for item in items.into_iter().flatten() {
                match item {
                    bson::RawBsonRef::String(id) => loose.push(id),
                    other => lists.push(Ids::of_value(Some(other))),
                }
            }
            if !loose.is_empty() {
                lists.push(Ids::Strings(loose));
            }
            lists
        }
        _ => vec![Ids::of(page, f::LISTED)],
    }
}

/// A manifest's ids as this version stores them: packed when every id is 32 hex digits (every
/// `url_id` is), else as an array of strings.
pub(super) fn pack_ids(ids: &[String]) -> Bson {
    let mut bytes = Vec::with_capacity(ids.len() * ID_BYTES);
    for id in ids {
        if id.len() != 2 * ID_BYTES {
            return Bson::from(ids.to_vec());
        }
        for pair in id.as_bytes().chunks(2) {
            match std::str::from_utf8(pair)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => bytes.push(b),
                None => return Bson::from(ids.to_vec()),
            }
        }
    }
    Bson::Binary(bson::Binary {
        subtype: bson::spec::BinarySubtype::Generic,
        bytes,
    })
}

/// Fingerprint hashes as this version stores them: 8 bytes each (little-endian) in one binary.
pub(super) fn pack_numbers(values: &[i64]) -> Bson {
    Bson::Binary(bson::Binary {
        subtype: bson::spec::BinarySubtype::Generic,
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    })
}

/// The whole numbers of a raw field: an array of numbers, or packed 8 bytes each
/// ([`pack_numbers`]).
pub(super) fn raw_numbers(doc: &bson::RawDocument, name: &str) -> Vec<i64> {
    match doc.get(name).ok().flatten() {
        Some(bson::RawBsonRef::Binary(b)) => b
            .bytes
            .chunks_exact(8)
            .map(|c| {
                let mut le = [0u8; 8];
                le.copy_from_slice(c);
                i64::from_le_bytes(le)
            })
            .collect(),
        Some(bson::RawBsonRef::Array(a)) => a
            .into_iter()
            .filter_map(|v| match v.ok()? {
                bson::RawBsonRef::Int64(n) => Some(n),
                bson::RawBsonRef::Int32(n) => Some(i64::from(n)),
                bson::RawBsonRef::Double(n) => Some(n as i64),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A raw document's whole number field.
pub(in crate::store) fn raw_integer(doc: &bson::RawDocument, name: &str) -> Option<i64> {
    match doc.get(name).ok()?? {
        bson::RawBsonRef::Int64(n) => Some(n),
        bson::RawBsonRef::Int32(n) => Some(i64::from(n)),
        bson::RawBsonRef::Double(n) if n.fract() == 0.0 => Some(n as i64),
        _ => None,
    }
}

impl Frontier<'_> {
    /// Streams the seed and listing entries that `filters` (from [`listing_filters`], one per
    /// listing kind) read to `visit`, raw, with `projection` (and `batch` entries to a batch).
    pub(in crate::store) async fn each_listing(
        self,
        what: &'static str,
        filters: Vec<Document>,
        projection: Document,
        batch: Option<u32>,
        mut visit: impl FnMut(&bson::RawDocument) -> Result<()>,
    ) -> Result<()> {
        let frontier = self
            .store
            .database()
            .collection::<bson::RawDocumentBuf>(FRONTIER);
        for filter in filters {
            let find = frontier.find(filter).projection(projection.clone());
            match batch {
                Some(n) => {
                    self.store
                        .each_raw(what, find.batch_size(n), &mut visit)
                        .await?
                }
                None => self.store.each_raw(what, find, &mut visit).await?,
            }
        }
        Ok(())
    }

    /// Every manifest the bot's listing and seed pages carry (one per page, as its last read
    /// wrote it), streamed raw on [`LISTINGS_INDEX`] — what the next pass knows of the items
    /// without reading them one by one. `visit` gets the pass that read each manifest and its
    /// items.
    pub(crate) async fn listing_manifests(
        self,
        bot: &BotId,
        mut visit: impl FnMut(PassNumber, &[ListedItem]),
    ) -> Result<()> {
        // Every listing entry: one never read yet carries no manifest and is passed over.
        self.each_listing(
            "read listing manifests",
            listing_filters(bot, doc! { "$gte": 0_i64 }),
            doc! { f::LISTED: 1, f::LISTED_FP: 1, f::LISTED_FETCH: 1, f::LISTED_PASS: 1 },
            Some(MANIFESTS_PER_BATCH),
            |doc| {
                let Some(pass) = raw_integer(doc, f::LISTED_PASS).map(PassNumber::new) else {
                    return Ok(());
                };
                let listed = Ids::of(doc, f::LISTED);
                let fingerprints = raw_numbers(doc, f::LISTED_FP);
                let mut fetched = vec![false; listed.len()];
                for i in raw_numbers(doc, f::LISTED_FETCH) {
                    if let Some(slot) = usize::try_from(i).ok().and_then(|i| fetched.get_mut(i)) {
                        *slot = true;
                    }
                }
                let items: Vec<ListedItem> = listed
                    .keys()
                    .enumerate()
                    .map(|(i, key)| ListedItem {
                        key,
                        fingerprint: fingerprints.get(i).copied().unwrap_or(0),
                        fetch: fetched[i],
                    })
                    .collect();
                visit(pass, &items);
                Ok(())
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_kinds_are_exactly_those_the_listing_index_holds() {
        // The partial filter's bound: a kind is in the index when its name sorts after it.
        let partial = listing_partial();
        let bound = partial
            .get_document(f::KIND)
            .and_then(|b| b.get_str("$gt"))
            .expect("a `$gt` bound on the kind");
        for kind in [PageKind::Seed, PageKind::List, PageKind::Detail] {
            assert_eq!(kind.is_listing(), kind.as_str() > bound, "{kind:?}");
        }
        // Each listing filter names one listing kind, so it implies the partial filter.
        let bot = BotId::parse("b").unwrap();
        let kinds: Vec<String> = listing_filters(&bot, doc! { "$eq": 1 })
            .iter()
            .map(|filter| filter.get_str(f::KIND).unwrap().to_owned())
            .collect();
        assert_eq!(kinds, ["list", "seed"]);
    }
}
