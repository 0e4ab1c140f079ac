//! What this instance knows of a bot's listed items at the start of a pass, without a read per
//! item: every listing page's manifest ([`Manifest`]) folded into one sorted table of (item,
//! fingerprint hash) — built once per pass, a few bytes per item (16 MiB at a million items).
//!
//! An item is **known stored** with a fingerprint when some manifest lists it with that
//! fingerprint and the pass that read that manifest either decided the item needed no fetch (its
//! record was known stored with that fingerprint then) or enqueued it and its detail page ended
//! done in that pass (no page of the pass the manifest belongs to is left pending, waiting, leased
//! or failed with its id — one read per status and pass, a handful of entries after a complete
//! pass). Anything less certain — manifests that disagree about an item, an item fetched in a pass
//! too old to check or in the current one — leaves the item unknown, and the listing page that
//! shows it reads its frontier entry as before. So an unchanged listing page costs no read per
//! item, and where an item sits in the pagination costs nothing: the table is not by page.
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
pub fn key(url_id: &str) -> u64 {
    crate::store::frontier::id_key(url_id)
}

/// The listed items of a bot known stored, with their fingerprint hashes, as of the start of
/// `pass`.
#[derive(Debug, Default)]
pub struct Known {
    pub pass: PassNumber,
    /// Sorted by key; a fingerprint of 0 means "listed, but not known stored".
    items: Vec<(u64, i64)>,
}

/// What the table says of one listed item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listed {
    /// Stored, and listed last with this fingerprint hash.
    Stored(i64),
    /// Listed before, but not known stored (or listed with different fingerprints).
    Unsure,
    /// In no manifest.
    New,
}

impl Known {
    /// Reads every manifest of the bot's listing pages and the not-done entries of the passes
    /// that enqueued their unconfirmed fetches, for `pass`.
    pub async fn read(store: &Store, bot: &BotId, pass: PassNumber) -> Result<Known> {
        // The entries the last few passes did not finish, first: then each manifest's items are
        // decided as they stream by, and memory holds the table alone.
        let mut unfinished: HashSet<u64> = HashSet::new();
        let checked = PassNumber::new(pass.get() - CHECKED_PASSES).max(PassNumber::new(1))..pass;
        for p in (checked.start.get()..checked.end.get()).map(PassNumber::new) {
            for id in store.frontier().not_done_in(bot, p).await? {
                unfinished.insert(key(&id));
            }
        }
        let mut items: Vec<(u64, i64)> = Vec::new();
        store
            .frontier()
            .listing_manifests(bot, |read_in, listed| {
                for (k, fp, fetch) in listed {
                    if *fp == 0 {
                        continue; // a plain link: nothing to decide from
                    }
                    let k = *k;
                    // Enqueued to fetch in `read_in`: stored only if that pass finished it.
                    let stored = !fetch || (checked.contains(&read_in) && !unfinished.contains(&k));
                    items.push((k, if stored { *fp } else { 0 }));
                }
            })
            .await?;
        items.sort_unstable();
        // One entry per key: the fingerprint where every manifest agrees and all are stored.
        items.dedup_by(|later, first| {
            if later.0 != first.0 {
                return false;
            }
            if later.1 != first.1 {
                first.1 = 0;
            }
            true
        });
        items.shrink_to_fit();
        Ok(Known { pass, items })
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// What the table says of the detail page with frontier id `url_id`.
    pub fn get(&self, url_id: &str) -> Listed {
        let k = key(url_id);
        match self.items.binary_search_by_key(&k, |(key, _)| *key) {
            Ok(i) if self.items[i].1 != 0 => Listed::Stored(self.items[i].1),
            Ok(_) => Listed::Unsure,
            Err(_) => Listed::New,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(items: Vec<(u64, i64)>) -> Known {
        let mut k = Known {
            pass: PassNumber::new(2),
            items,
        };
        k.items.sort_unstable();
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
    fn an_item_is_stored_new_or_unsure() {
        let k = table(vec![
            (key("00000000000000aa"), 7),
            (key("00000000000000bb"), 0),
        ]);
        assert_eq!(k.get("00000000000000aa"), Listed::Stored(7));
        assert_eq!(k.get("00000000000000bb"), Listed::Unsure);
        assert_eq!(k.get("00000000000000cc"), Listed::New);
    }
}
