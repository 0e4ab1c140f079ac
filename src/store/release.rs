//! A pass's release into the change feed, and the drift gate (`crawlFeed` in the bot document).
//!
//! At a pass's end, after its deletion evaluation, the evaluating instance stages the pass's
//! events (`store::changes`) and judges it: a field whose fill rate — the share of the records
//! the pass wrote that hold a value for it — fell by more than `max_fill_drop` against the last
//! released pass, or removals held back for being more than `max_removed` of the live records,
//! **gate** the pass (`crawlFeed.gate`: its pass, `state: "gated"`, the reasons, its last `seq`
//! and fill). Otherwise the write that records the evaluation also **releases** it: the
//! watermark `crawlFeed.seq` moves past its events, `crawlFeed.fill` takes its fill rates.
//!
//! A gated pass is settled by `seedlock pass release` or `seedlock pass discard`, or — discarded
//! — at the end of the next pass, before that pass is staged. Settling claims the gate first
//! (`state: "releasing"` or `"discarding"`, conditional on `"gated"` or on the same claim, so a
//! settlement cut short is finished by whoever settles next, and a release and a discard never
//! both run), then does its work, then removes the gate in one conditional write.

use std::collections::BTreeMap;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};

use super::changes::Staged;
use super::date;
use super::passes::Passes;
use crate::config::DriftRules;
use crate::error::Result;
use crate::ids::{BotId, PassNumber};
use crate::store::document::{field, integer};

/// The bot document's feed state.
pub(crate) const FEED: &str = "crawlFeed";

/// `crawlFeed` field names.
pub(crate) mod feed {
    /// The released watermark: readers see events up to this `seq`.
    pub(crate) const SEQ: &str = "seq";
    /// The last released pass.
    pub(crate) const PASS: &str = "pass";
    /// The last released pass's fill rates, by field (fields it did not measure keep earlier ones).
    pub(crate) const FILL: &str = "fill";
    pub(crate) const RELEASED_AT: &str = "releasedAt";
    /// Events released so far, in all.
    pub(crate) const EVENTS: &str = "events";
    /// The gated pass, while there is one.
    pub(crate) const GATE: &str = "gate";
    /// The last pass staged: the next staging takes the pending events of the passes after it.
    pub(crate) const STAGED: &str = "staged";
}

/// How an operator settles a gated pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Its events become visible and its held removals apply.
    Release,
    /// Its events are deleted; its records keep their values.
    Discard,
}

impl Settle {
    fn state(self) -> &'static str {
        match self {
            Settle::Release => "releasing",
            Settle::Discard => "discarding",
        }
    }
}

/// What settling a gated pass did.
#[derive(Clone, Debug, PartialEq)]
pub struct Settled {
    pub pass: PassNumber,
    pub how: Settle,
    /// Records the release removed (the removals the gate held back).
    pub removed: u64,
}

/// What a pass's end did to the feed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Judged {
    pub staged: Staged,
    /// Why the pass is gated; empty when it was released.
    pub gated: Vec<String>,
}

/// A fill rate as a person reads it.
fn percent(rate: f64) -> String {
    format!("{:.0}%", rate * 100.0)
}

/// Why a pass is gated (empty: it is released). `last_fill`: the last released pass's fill
/// rates; `held`, `live`: removals held back and the live records they were judged against.
pub(crate) fn gate_reasons(
    staged: &Staged,
    last_fill: &BTreeMap<String, f64>,
    held: u64,
    live: Option<u64>,
    rules: &DriftRules,
) -> Vec<String> {
    let mut reasons = Vec::new();
    if staged.written >= rules.min_records {
        let now = staged.fill();
        for (name, last) in last_fill {
            let rate = now.get(name).copied().unwrap_or(0.0);
            if last - rate > rules.max_fill_drop + 1e-9 {
                reasons.push(format!(
                    "field {name} filled {} (last pass {})",
                    percent(rate),
                    percent(*last)
                ));
            }
        }
    }
    if held > 0 {
        let live = live.unwrap_or(0);
        reasons.push(format!(
            "would remove {held} of {live} records ({:.1}%, more than {:.1}%)",
            held as f64 * 100.0 / live.max(1) as f64,
            rules.max_removed * 100.0
        ));
    }
    reasons
}

/// A fill map as stored.
fn fill_doc(fill: &BTreeMap<String, f64>) -> Document {
    fill.iter()
        .map(|(k, v)| (k.clone(), Bson::Double(*v)))
        .collect()
}

/// A stored fill map.
fn fill_of(doc: Option<&Document>) -> BTreeMap<String, f64> {
    doc.map(|d| {
        d.iter()
            .filter_map(|(k, v)| match v {
                Bson::Double(x) => Some((k.clone(), *x)),
                other => integer(other).map(|n| (k.clone(), n as f64)),
            })
            .collect()
    })
    .unwrap_or_default()
}

/// The fill rates a release records: the pass's own, where it wrote enough records to measure
/// them, over the earlier ones.
fn merged_fill(
    before: &BTreeMap<String, f64>,
    staged: &Staged,
    rules: &DriftRules,
) -> BTreeMap<String, f64> {
    let mut fill = before.clone();
    if staged.written >= rules.min_records {
        for name in before.keys() {
            fill.insert(name.clone(), 0.0);
        }
        fill.extend(staged.fill());
    }
    fill
}

/// A bot's feed state as its document keeps it.
#[derive(Clone, Debug, Default)]
pub(crate) struct FeedState {
    pub seq: i64,
    pub staged: PassNumber,
    pub fill: BTreeMap<String, f64>,
    pub gate: Option<Document>,
}

impl FeedState {
    fn of(bot_doc: Option<&Document>) -> FeedState {
        let Some(feed) = bot_doc.and_then(|d| d.get_document(FEED).ok()) else {
            return FeedState::default();
        };
        FeedState {
            seq: feed.get(feed::SEQ).and_then(integer).unwrap_or(0),
            staged: feed
                .get(feed::STAGED)
                .and_then(integer)
                .map_or(PassNumber::NONE, PassNumber::new),
            fill: fill_of(feed.get_document(feed::FILL).ok()),
            gate: feed.get_document(feed::GATE).ok().cloned(),
        }
    }
}

/// The pass a gate names.
fn gate_pass(gate: &Document) -> Option<PassNumber> {
    gate.get("pass").and_then(integer).map(PassNumber::new)
}

impl Passes<'_> {
    /// The bot's feed state (one read of its document).
    pub(crate) async fn feed_state(self, bot: &BotId) -> Result<FeedState> {
        let read = self
            .store
            .bots
            .find_one(doc! { field::ID: bot.as_str() })
            .projection(doc! { FEED: 1, field::CRAWL_PASS: 1 });
        let doc = self.store.bounded("read the feed", read).await?;
        Ok(FeedState::of(doc.as_ref()))
    }

    /// At the end of pass `pass`: a gated pass before it is settled first — a release begun is
    /// finished, anything else discarded (this pass is compared with the last released one).
    pub(super) async fn settle_earlier(
        self,
        bot: &BotId,
        pass: PassNumber,
        state: &FeedState,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let Some(gate) = &state.gate else {
            return Ok(());
        };
        let Some(gated) = gate_pass(gate).filter(|g| *g < pass) else {
            return Ok(());
        };
        let how = if gate.get_str("state").ok() == Some("releasing") {
            Settle::Release
        } else {
            Settle::Discard
        };
        if self.settle(bot, gated, how, now).await?.is_some() {
            tracing::warn!(%bot, pass = gated.get(), settled = ?how, "a gated pass was left unsettled until the next pass ended");
        }
        Ok(())
    }

    /// Stages pass `pass`'s events and judges it (see the module comment): the parts of the
    /// evaluation's record write that release it or gate it, and what it came to.
    pub(super) async fn stage_and_judge(
        self,
        bot: &BotId,
        pass: PassNumber,
        state: &FeedState,
        evaluation: &super::deletions::Evaluation,
        rules: &DriftRules,
        now: DateTime<Utc>,
    ) -> Result<(Document, Judged)> {
        let staged = self.store.changes().stage(bot, state.staged, pass).await?;
        let gated = gate_reasons(
            &staged,
            &state.fill,
            evaluation.held,
            evaluation.live_before,
            rules,
        );
        let set = if gated.is_empty() {
            doc! {
                format!("{FEED}.{}", feed::PASS): pass,
                format!("{FEED}.{}", feed::FILL): fill_doc(&merged_fill(&state.fill, &staged, rules)),
                format!("{FEED}.{}", feed::RELEASED_AT): date(now),
                format!("{FEED}.{}", feed::SEQ): staged.last_seq.max(state.seq),
            }
        } else {
            doc! {
                format!("{FEED}.{}", feed::GATE): {
                    "pass": pass, "state": "gated", "reasons": &gated,
                    "seq": staged.last_seq, "fill": fill_doc(&merged_fill(&state.fill, &staged, rules)),
                    "held": evaluation.held as i64, "events": staged.events() as i64,
                    "at": date(now),
                },
            }
        };
        Ok((set, Judged { staged, gated }))
    }

    /// Settles the bot's gated pass `pass` (`None`: it is not gated — never was, or already
    /// settled). Safe to repeat and to race: see the module comment.
    pub async fn settle(
        self,
        bot: &BotId,
        pass: PassNumber,
        how: Settle,
        now: DateTime<Utc>,
    ) -> Result<Option<Settled>> {
        let gate_path = format!("{FEED}.{}", feed::GATE);
        let claim = self.store.bots.find_one_and_update(
            doc! {
                field::ID: bot.as_str(),
                format!("{gate_path}.pass"): pass,
                format!("{gate_path}.state"): { "$in": ["gated", how.state()] },
            },
            doc! { "$set": { format!("{gate_path}.state"): how.state() } },
        );
        let Some(doc) = self.store.bounded("claim a gated pass", claim).await? else {
            return Ok(None);
        };
        let state = FeedState::of(Some(&doc));
        let gate = state.gate.clone().unwrap_or_default();
        let changes = self.store.changes();
        let mut removed = 0;
        let finish = match how {
            Settle::Release => {
                if gate.get("held").and_then(integer).unwrap_or(0) > 0 {
                    let held = changes.removed_in(bot, pass).await?;
                    let latest = doc.get(field::CRAWL_PASS).and_then(integer) == Some(pass.get());
                    if latest {
                        let (n, kept) = self
                            .store
                            .deletions()
                            .apply_held(bot, pass, &held, now)
                            .await?;
                        removed = n;
                        changes.delete_removals(bot, pass, &kept).await?;
                    } else {
                        // A later pass has started: it evaluates the removals itself.
                        changes.delete_removals(bot, pass, &held).await?;
                    }
                }
                let seq = gate
                    .get("seq")
                    .and_then(integer)
                    .unwrap_or(0)
                    .max(state.seq);
                let events = gate.get("events").and_then(integer).unwrap_or(0);
                let mut finish = doc! {
                    "$set": {
                        format!("{FEED}.{}", feed::SEQ): seq,
                        format!("{FEED}.{}", feed::PASS): pass,
                        format!("{FEED}.{}", feed::FILL): gate.get_document("fill").cloned().unwrap_or_default(),
                        format!("{FEED}.{}", feed::RELEASED_AT): date(now),
                    },
                    "$inc": {
                        field::CRAWL_REMOVED_TOTAL: removed as i64,
                        format!("{FEED}.{}", feed::EVENTS): events,
                    },
                    "$unset": { &gate_path: "" },
                };
                if removed > 0 {
                    // Its removals applied (it is the bot's latest pass): the pass counts as
                    // complete, and its live records drop by them (the stale-catalogue alerts).
                    finish.insert(
                        "$max",
                        doc! { field::CRAWL_LAST_COMPLETE_PASS_AT: date(now) },
                    );
                    if let Ok(inc) = finish.get_document_mut("$inc") {
                        inc.insert(
                            format!("{}.liveRecords", field::CRAWL_LAST_PASS),
                            -(removed as i64),
                        );
                    }
                }
                finish
            }
            Settle::Discard => {
                changes.delete_pass(bot, pass).await?;
                doc! { "$unset": { &gate_path: "" } }
            }
        };
        let write = self.store.bots.update_one(
            doc! {
                field::ID: bot.as_str(),
                format!("{gate_path}.pass"): pass,
                format!("{gate_path}.state"): how.state(),
            },
            finish,
        );
        self.store.bounded("settle a gated pass", write).await?;
        tracing::info!(%bot, pass = pass.get(), settled = ?how, removed, "gated pass settled");
        Ok(Some(Settled { pass, how, removed }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(written: u64, filled: &[(&str, u64)]) -> Staged {
        Staged {
            written,
            filled: filled.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect(),
            ..Staged::default()
        }
    }

    #[test]
    fn a_field_whose_fill_fell_past_the_threshold_gates_the_pass_and_names_both_rates() {
        let rules = DriftRules::default();
        let last = BTreeMap::from([("price".to_owned(), 0.99), ("name".to_owned(), 1.0)]);
        let reasons = gate_reasons(
            &staged(100, &[("price", 3), ("name", 100)]),
            &last,
            0,
            None,
            &rules,
        );
        assert_eq!(
            reasons,
            vec!["field price filled 3% (last pass 99%)".to_owned()]
        );
        // A drop within the threshold, a field gone from every record, and too few records.
        assert!(gate_reasons(
            &staged(100, &[("price", 80), ("name", 100)]),
            &last,
            0,
            None,
            &rules
        )
        .is_empty());
        assert_eq!(
            gate_reasons(&staged(100, &[("name", 100)]), &last, 0, None, &rules).len(),
            1
        );
        assert!(gate_reasons(&staged(5, &[("name", 5)]), &last, 0, None, &rules).is_empty());
    }

    #[test]
    fn held_removals_gate_the_pass_with_their_share() {
        let rules = DriftRules::default();
        let reasons = gate_reasons(&staged(0, &[]), &BTreeMap::new(), 450, Some(1000), &rules);
        assert_eq!(
            reasons,
            vec!["would remove 450 of 1000 records (45.0%, more than 10.0%)".to_owned()]
        );
    }

    #[test]
    fn a_release_keeps_the_fill_of_fields_the_pass_could_not_measure() {
        let rules = DriftRules::default();
        let before = BTreeMap::from([("price".to_owned(), 0.9)]);
        assert_eq!(
            merged_fill(&before, &staged(3, &[("price", 0)]), &rules),
            before
        );
        let after = merged_fill(&before, &staged(40, &[("name", 40)]), &rules);
        assert_eq!(after.get("price"), Some(&0.0));
        assert_eq!(after.get("name"), Some(&1.0));
    }
}
