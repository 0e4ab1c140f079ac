//! What this instance knows of a bot's listed items at the start of a pass, without a read per
//! item: every listing page's manifest ([`Manifest`]) folded into one sorted set of (item,
//! fingerprint hash) pairs, each pair one 64-bit hash, and a sorted list of the items' first 32
//! key bits — built once per pass, 12 bytes an item (12 MiB at a million items).
//!
//! An item is **known stored** with a fingerprint when some manifest lists it with that
//! fingerprint and the pass that read that manifest either decided the item needed no fetch (its
//! record was known stored with that fingerprint then) or enqueued it and its detail page ended
//! done in that pass (no page of the pass the manifest belongs to is left pending, waiting, leased
//! or failed with its id — one read per status and pass, a handful of entries after a complete
//! pass). Anything less certain — manifests that disagree about an item, an item fetched in a pass
//! too old to check or in the current one — is left out: the listing page that shows it reads
//! its frontier entry as before. An item known stored but listed now with another fingerprint
//! (changed) is told by its key bits: in `fingerprint` mode it is fetched without a read (an
//! upsert, which also inserts — so a new item that shares the 32 bits is fetched all the same);
//! the other modes read it. So an unchanged listing page costs no read per item, and where an
//! item sits in the pagination costs nothing: the set is not by page.
//!
//! [`Manifest`]: crate::store::frontier::Manifest

use crate::ids::PassNumber;
use std::collections::HashSet;

use crate::error::Result;
use crate::ids::BotId;
use crate::store::Store;

/// Fetches of passes older than this many before the current one are not checked: their items
/// count as unknown (read again).
const CHECKED_PASSES: i64 = 3;

/// The table key of a detail page's frontier id: its first 64 bits. Two ids that share them are
/// one key; if their fingerprints differ the key is unknown (read), so a collision costs a read,
/// never a missed change.
pub(crate) fn key(url_id: &str) -> u64 {
    crate::store::frontier::id_key(url_id)
}

/// The first 32 bits of a table key: what the table keeps of an item's key beside its pair.
fn key_bits(key: u64) -> u32 {
    (key >> 32) as u32
}

/// The one 64-bit value of an item (its table key, `key`) listed with a fingerprint hash `fp`.
/// For one item, two fingerprints never give the same value (`key ^ f(fp)` with `f` a
/// bijection): a change is never taken for its item's old pair. Two different items collide
/// only as two random 64-bit values do.
fn pair(key: u64, fp: i64) -> u64 {
    // splitmix64's finalizer: a bijection of the 64-bit values that mixes every bit.
    let mut z = (fp as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    key ^ z ^ (z >> 31)
}

/// The listed items of a bot known stored, with their fingerprint hashes, as of the start of
/// `pass`.
#[derive(Debug, Default)]
pub(crate) struct Known {
    pub pass: PassNumber,
    /// The [`pair`]s of the items known stored, sorted.
    pairs: Vec<u64>,
    /// The first 32 bits of their keys, sorted.
    keys: Vec<u32>,
}

/// What the table says of an item listed now with a fingerprint hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Known stored, listed last with this fingerprint.
    Stored,
    /// Known stored, listed last with another fingerprint — or a new item whose key shares the
    /// first 32 bits of a known one's (one in 4,000 at a million items): only a fetch may follow.
    Changed,
    /// New, or not known stored: read its frontier entry.
    Unknown,
}

impl Known {
    /// Reads every manifest of the bot's listing pages and the not-done entries of the passes
    /// that enqueued their unconfirmed fetches, for `pass`.
    pub(crate) async fn read(store: &Store, bot: &BotId, pass: PassNumber) -> Result<Known> {
        // The entries the last few passes did not finish, first: then each manifest's items are
        // decided as they stream by, and memory holds the table alone.
        let mut unfinished: HashSet<u64> = HashSet::new();
        let checked = PassNumber::new(pass.get() - CHECKED_PASSES).max(PassNumber::new(1))..pass;
        for p in (checked.start.get()..checked.end.get()).map(PassNumber::new) {
            for id in store.frontier().not_done_in(bot, p).await? {
                unfinished.insert(key(&id));
            }
        }
        // (key, fingerprint hash), 0 for "listed, but not known stored".
        let mut items: Vec<[u64; 2]> = Vec::new();
        store
            .frontier()
            .listing_manifests(bot, |read_in, listed| {
                for item in listed {
                    if item.fingerprint == 0 {
                        continue; // a plain link: nothing to decide from
                    }
                    let k = item.key;
                    // Enqueued to fetch in `read_in`: stored only if that pass finished it.
                    let stored =
                        !item.fetch || (checked.contains(&read_in) && !unfinished.contains(&k));
                    items.push([k, if stored { item.fingerprint as u64 } else { 0 }]);
                }
            })
            .await?;
        let (pairs, keys) = agreed(items);
        Ok(Known { pass, pairs, keys })
    }

    pub(crate) fn len(&self) -> usize {
        self.pairs.len()
    }

    /// What the table says of the detail page with frontier id `url_id`, listed now with the
    /// fingerprint hash `fp`.
    pub(crate) fn get(&self, url_id: &str, fp: i64) -> Listed {
        let k = key(url_id);
        if self.pairs.binary_search(&pair(k, fp)).is_ok() {
            Listed::Stored
        } else if self.keys.binary_search(&key_bits(k)).is_ok() {
            Listed::Changed
        } else {
            Listed::Unknown
        }
    }
}

/// The sorted [`pair`]s and key bits of the items every manifest agrees on and all know stored;
/// the pairs made in the memory of `items` (20 bytes an item at the peak, 12 after).
fn agreed(mut items: Vec<[u64; 2]>) -> (Vec<u64>, Vec<u32>) {
    items.sort_unstable();
    // One entry per key: the fingerprint where every manifest agrees and all are stored, else 0.
    items.dedup_by(|later, first| {
        if later[0] != first[0] {
            return false;
        }
        if later[1] != first[1] {
            first[1] = 0;
        }
        true
    });
    // Sorted by key, so their first bits are too.
    let keys: Vec<u32> = items
        .iter()
        .filter(|[_, fp]| *fp != 0)
        .map(|[k, _]| key_bits(*k))
        .collect();
    let mut flat = items.into_flattened();
    let mut kept = 0;
    for i in 0..flat.len() / 2 {
        let (k, fp) = (flat[2 * i], flat[2 * i + 1] as i64);
        if fp != 0 {
            // i ≤ 2i: written behind what is still to read.
            flat[kept] = pair(k, fp);
            kept += 1;
        }
    }
    flat.truncate(kept);
    flat.sort_unstable();
    flat.shrink_to_fit();
    (flat, keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(items: Vec<(u64, i64)>) -> Known {
        let mut k = Known {
            pass: PassNumber::new(2),
            ..Known::default()
        };
        (k.pairs, k.keys) = agreed(items.into_iter().map(|(k, fp)| [k, fp as u64]).collect());
        k
    }

    #[test]
    fn a_key_is_the_ids_first_64_bits() {
        assert_eq!(key("00000000000000ff0123"), 255);
        assert_eq!(key("ffffffffffffffffabcd"), u64::MAX);
        // Not hex (a hand-written id): hashed instead, never a panic.
        assert_ne!(key("not an id"), key("not an id either"));
    }

    #[test]
    fn an_item_is_known_stored_only_with_the_fingerprint_every_manifest_gives_it() {
        let (a, b, c, d) = (
            "aa00000000000000",
            "bb00000000000000",
            "cc00000000000000",
            "dd00000000000000",
        );
        let k = table(vec![
            (key(a), 7),
            (key(b), 0),
            (key(d), 5),
            (key(d), 6),
            (key(a), 7),
        ]);
        assert_eq!(k.get(a, 7), Listed::Stored);
        assert_eq!(k.get(a, 8), Listed::Changed);
        assert_eq!(k.get(b, 7), Listed::Unknown, "listed, not known stored");
        assert_eq!(k.get(c, 7), Listed::Unknown, "in no manifest");
        assert_eq!(k.get(d, 5), Listed::Unknown, "manifests disagree");
        assert_eq!(k.get(d, 6), Listed::Unknown, "manifests disagree");
        assert_eq!(k.len(), 1);
        // A new item whose key shares the first 32 bits of a known one's: only a fetch follows.
        assert_eq!(k.get("aa000000ffffffff", 7), Listed::Changed);
    }

    #[test]
    fn no_other_fingerprint_of_an_item_gives_its_pair() {
        let k = key("0123456789abcdef");
        let fps: HashSet<u64> = (1..100_000_i64).map(|fp| pair(k, fp)).collect();
        assert_eq!(fps.len(), 99_999);
    }
}
