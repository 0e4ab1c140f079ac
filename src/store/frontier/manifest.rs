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
    pub listed: ListedIds,
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
    pub(crate) fn push(&mut self, id: &str, fingerprint: i64, fetched: bool) -> bool {
        if self.keys.len() < self.listed.len() {
            self.keys = (0..self.listed.len()).map(|i| self.listed.key(i)).collect();
        }
        if !self.keys.insert(id_key(id)) && self.listed.contains(id) {
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
        let mut ids: Vec<String> = (0..self.listed.len()).map(|i| self.listed.id(i)).collect();
        ids.sort_unstable();
        ids.dedup();
        let joined = ids.join("\n");
        crate::ids::sha256_hex(&[joined.as_bytes()], 16)
    }
}

/// A manifest's frontier ids as a listing page's follow step gathers them: 16 bytes an id while
/// every id is 32 hex digits (every `url_id` is; the bytes are the stored binary itself), else
/// the ids as strings (the stored array of strings).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListedIds {
    Packed(Vec<u8>),
    Strings(Vec<String>),
}

impl Default for ListedIds {
    fn default() -> Self {
        ListedIds::Packed(Vec::new())
    }
}

impl ListedIds {
    pub fn len(&self) -> usize {
        match self {
            ListedIds::Packed(bytes) => bytes.len() / ID_BYTES,
            ListedIds::Strings(ids) => ids.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds `id` at the end.
    pub fn push(&mut self, id: &str) {
        if let ListedIds::Packed(bytes) = self {
            if let Some(packed) = packed_id(id) {
                bytes.extend_from_slice(&packed);
                return;
            }
            let ids = (0..self.len()).map(|i| self.id(i)).collect();
            *self = ListedIds::Strings(ids);
        }
        if let ListedIds::Strings(ids) = self {
            ids.push(id.to_owned());
        }
    }

    /// Id `i` in full, as the frontier's `_id` spells it.
    pub fn id(&self, i: usize) -> String {
        match self {
            ListedIds::Packed(bytes) => Ids::Packed(bytes).id(i),
            ListedIds::Strings(ids) => ids[i].clone(),
        }
    }

    /// The key ([`id_key`]) of id `i`.
    fn key(&self, i: usize) -> u64 {
        match self {
            ListedIds::Packed(bytes) => Ids::Packed(bytes).key(i),
            ListedIds::Strings(ids) => id_key(&ids[i]),
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        match self {
            ListedIds::Packed(bytes) => packed_id(id).is_some_and(|packed| {
                bytes
                    .chunks_exact(ID_BYTES)
                    .any(|one| one == packed.as_slice())
            }),
            ListedIds::Strings(ids) => ids.iter().any(|one| one == id),
        }
    }

    /// The ids as they are stored: one binary value, or an array of strings.
    pub(super) fn to_bson(&self) -> Bson {
        match self {
            ListedIds::Packed(bytes) => Bson::Binary(bson::Binary {
                subtype: bson::spec::BinarySubtype::Generic,
                bytes: bytes.clone(),
            }),
            ListedIds::Strings(ids) => Bson::from(ids.clone()),
        }
    }
}

impl<S: AsRef<str>> FromIterator<S> for ListedIds {
    fn from_iter<I: IntoIterator<Item = S>>(ids: I) -> Self {
        let mut listed = ListedIds::default();
        for id in ids {
            listed.push(id.as_ref());
        }
        listed
    }
}

/// The 16 bytes of an id of 32 hex digits (lower case, as every `url_id` is spelt: its bytes
/// give the id back exactly).
pub(crate) fn packed_id(id: &str) -> Option<[u8; ID_BYTES]> {
    let hex = id.as_bytes();
    let lower_hex = |c: &u8| c.is_ascii_digit() || (b'a'..=b'f').contains(c);
    if hex.len() != 2 * ID_BYTES || !hex.iter().all(lower_hex) {
        return None;
    }
    let mut packed = [0u8; ID_BYTES];
    for (byte, pair) in packed.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(packed)
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

/// About how many bytes of manifests one cursor reply carries when they are streamed: a batch
/// of a hundred HTML listing pages (a few KiB each) is far below it; one sitemap file's page
/// (50,000 items: 1-3 MB with its baseline) is a batch of its own.
const MANIFEST_REPLY_BYTES: usize = 2 * 1024 * 1024;

/// Entries per batch for manifests of about `bytes` each: at most `at_most`, at least one.
fn batch_for(bytes: usize, at_most: u32) -> u32 {
    u32::try_from(MANIFEST_REPLY_BYTES / bytes.max(1))
        .unwrap_or(u32::MAX)
        .clamp(1, at_most.max(1))
}

/// How [`Frontier::each_listing`] reads one listing kind's entries.
#[derive(Clone, Copy)]
enum Read {
    /// Weighed and found to have none: not read.
    Empty,
    /// Streamed in batches of this many entries.
    Batched(u32),
    /// Streamed in the driver's batches (not weighed).
    Whole,
}

impl Frontier<'_> {
    /// Streams the seed and listing entries that `filters` (from [`listing_filters`], one per
    /// listing kind) read to `visit`, raw, with `projection`, at most `batch` entries to a batch
    /// — fewer when the first entries of the kind are large (sized by what they weigh, so a
    /// reply of sitemap manifests does not hold megabytes per entry times the batch). The kinds
    /// are weighed side by side (one round trip for all) and a kind with no entry is not read
    /// again; the entries are then streamed one kind after another (one reply held at a time).
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
        let reads: Vec<Read> = match batch {
            Some(n) => {
                futures_util::future::try_join_all(
                    filters
                        .iter()
                        .map(|filter| self.listing_batch(what, filter, &projection, n)),
                )
                .await?
            }
            None => vec![Read::Whole; filters.len()],
        };
        // Every filter's first batch side by side (a small pass is read in one round trip),
        // then each cursor to its end.
        let cursors = futures_util::future::try_join_all(
            filters
                .into_iter()
                .zip(reads)
                .filter_map(|(filter, read)| {
                    let find = frontier.find(filter).projection(projection.clone());
                    match read {
                        Read::Empty => None,
                        Read::Batched(n) => Some(find.batch_size(n)),
                        Read::Whole => Some(find),
                    }
                })
                .map(|find| self.store.bounded(what, find)),
        )
        .await?;
        for cursor in cursors {
            self.store.drain_raw(what, cursor, &mut visit).await?;
        }
        Ok(())
    }

    /// The batch for streaming what `filter` reads: at most `at_most` entries, fewer when the
    /// first two it reads (one round trip) weigh more than [`MANIFEST_REPLY_BYTES`] a batch;
    /// [`Read::Empty`] when it reads none.
    async fn listing_batch(
        self,
        what: &'static str,
        filter: &Document,
        projection: &Document,
        at_most: u32,
    ) -> Result<Read> {
        let first = self
            .store
            .find_once(what, FRONTIER, filter.clone(), projection.clone(), 1, None)
            .await?;
        if first.is_empty() {
            return Ok(Read::Empty);
        }
        let bytes = first
            .iter()
            .filter_map(|d| bson::to_vec(d).ok().map(|b| b.len()))
            .max()
            .unwrap_or(0);
        Ok(Read::Batched(batch_for(bytes, at_most)))
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

    #[test]
    fn a_batch_of_manifests_is_sized_by_what_they_weigh() {
        assert_eq!(
            batch_for(4 * 1024, 100),
            100,
            "HTML listings: the batch as asked"
        );
        assert_eq!(batch_for(100 * 1024, 100), 20);
        assert_eq!(
            batch_for(2_400_000, 100),
            1,
            "a sitemap file's page: one a batch"
        );
        assert_eq!(batch_for(0, 25), 25, "none read: the batch as asked");
    }

    #[test]
    fn listed_ids_are_held_packed_and_read_back_exactly_as_stored() {
        let (a, b) = ("00ff".repeat(8), "0123456789abcdef".repeat(2));
        let listed: ListedIds = [&a, &b].into_iter().collect();
        assert!(matches!(&listed, ListedIds::Packed(bytes) if bytes.len() == 32));
        assert_eq!((listed.id(0), listed.id(1)), (a.clone(), b.clone()));
        assert!(listed.contains(&b) && !listed.contains(&"1".repeat(32)));
        let Bson::Binary(stored) = listed.to_bson() else {
            panic!("packed ids are stored as one binary");
        };
        let ids = Ids::Packed(&stored.bytes);
        assert_eq!((ids.len(), ids.id(0), ids.id(1)), (2, a.clone(), b.clone()));
        assert_eq!(ids.key(1), id_key(&b), "keys agree with the stored form's");
    }

    #[test]
    fn an_id_that_is_not_lower_case_hex_keeps_every_id_as_a_string() {
        let a = "ab".repeat(16);
        let signed = format!("+{}", "a".repeat(31));
        for odd in ["not-hex", "AB".repeat(16).as_str(), "abc", signed.as_str()] {
            let listed: ListedIds = [a.as_str(), odd].into_iter().collect();
            assert_eq!(
                listed,
                ListedIds::Strings(vec![a.clone(), odd.to_owned()]),
                "{odd}"
            );
            assert!(listed.contains(odd) && listed.contains(&a));
            assert_eq!(
                listed.to_bson(),
                Bson::from(vec![a.clone(), odd.to_owned()])
            );
        }
    }

    #[test]
    fn a_manifest_lists_each_id_once_with_its_fingerprint_and_fetch() {
        let mut manifest = Manifest::default();
        let (a, b) = ("a".repeat(32), "b".repeat(32));
        assert!(manifest.push(&a, 7, true));
        assert!(manifest.push(&b, 8, false));
        assert!(!manifest.push(&a, 9, true), "listed twice, listed once");
        assert_eq!(manifest.listed.len(), 2);
        assert_eq!(manifest.fingerprints, [7, 8]);
        assert_eq!(manifest.fetched, [0]);
        let mut swapped = Manifest::default();
        swapped.push(&b, 1, false);
        swapped.push(&a, 2, false);
        assert_eq!(manifest.hash(), swapped.hash(), "the hash is of the set");
    }
}
