//! The bot state machine as a pure function: [`decide`] maps (what was read, the server's time,
//! who I am, the bot's policy) to a typed [`Decision`]. It does no I/O; the coordinator executes
//! the decision and every write it makes is conditional on what was observed here.
//!
//! Branch names follow the first design's `waitSeedReady` (A-1 … E) so operators can map a history
//! entry back to the rule that produced it.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::RefreshSchedule;
use crate::ids::{InstanceId, LockEpoch};
use crate::lock::bot::{BotDoc, Observed};
use crate::lock::state::{BotState, Claim};

/// Which rule of `waitSeedReady` applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Branch {
    /// Ready but the seed list is empty.
    A1,
    /// Ready, and a refresh is due (date change, interval, or an admin's request).
    A2,
    /// Ready: use the seeds.
    A3,
    /// Editing, and the holder stopped heartbeating (`lockExpiresAt` passed).
    B1,
    /// Editing for longer than `max_refresh` and its grace, heartbeat or not.
    B2,
    /// Editing, and the holder is alive: wait.
    B3,
    /// Not ready, not editing (or no document yet): claim the lock.
    C,
    /// Ready and editing at once: contradictory.
    D,
    /// The document does not parse.
    E,
}

impl Branch {
    pub(crate) fn code(self) -> &'static str {
        match self {
            Branch::A1 => "A-1",
            Branch::A2 => "A-2",
            Branch::A3 => "A-3",
            Branch::B1 => "B-1",
            Branch::B2 => "B-2",
            Branch::B3 => "B-3",
            Branch::C => "C",
            Branch::D => "D",
            Branch::E => "E",
        }
    }
}

/// What to do next for one bot.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decision {
    /// Crawl on the stored seeds.
    Ready {
        branch: Branch,
        note: Option<String>,
    },
    /// No document yet: create the initial one (idempotent), then decide again.
    Initialize,
    /// Claim the edit lock, then refresh.
    Claim {
        expected: LockEpoch,
        claim: Claim,
        branch: Branch,
        reason: String,
    },
    /// Nothing to do before `until` (if known), or until the document changes.
    Wait {
        until: Option<DateTime<Utc>>,
        branch: Branch,
        reason: String,
    },
    /// Ready and editing at once: clear `isReady`, keeping the lock, fenced on the epoch.
    RepairContradiction { expected: LockEpoch },
    /// Rewrite a malformed document into a sane, not-ready one (fenced on its exact content).
    RepairMalformed { problems: Vec<String> },
}

impl Decision {
    /// The instance's state while it carries out this decision.
    pub(crate) fn state(&self) -> BotState {
        match self {
            Decision::Ready { .. } => BotState::Ready,
            Decision::Claim { .. } => BotState::Updating,
            Decision::Initialize => BotState::Waiting,
            Decision::Wait { reason, .. } if reason.starts_with(BACKOFF) => BotState::Error,
            Decision::Wait { .. } => BotState::Waiting,
            Decision::RepairContradiction { .. } | Decision::RepairMalformed { .. } => {
                BotState::Error
            }
        }
    }

    pub(crate) fn branch(&self) -> Branch {
        match self {
            Decision::Ready { branch, .. }
            | Decision::Claim { branch, .. }
            | Decision::Wait { branch, .. } => *branch,
            Decision::Initialize => Branch::C,
            Decision::RepairContradiction { .. } => Branch::D,
            Decision::RepairMalformed { .. } => Branch::E,
        }
    }
}

const BACKOFF: &str = "backing off";

/// What `decide` needs to know about the bot's configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    pub refresh: RefreshSchedule,
    pub max_refresh: Duration,
    /// B-2 takes a heartbeating refresh over only this long after `max_refresh`: its holder
    /// gives up at `max_refresh` and records the failure meanwhile.
    pub stuck_grace: Duration,
}

/// Who is deciding: this instance's id, and when this process started (server time). A lock held
/// under this id but claimed before `since` was left by a previous run of this instance; one
/// claimed after it belongs to another live process that (wrongly) shares the id, and is treated
/// like any other holder.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Me<'a> {
    pub id: &'a InstanceId,
    pub since: DateTime<Utc>,
}

/// The state machine. `now` is the database server's time (see `clock`), never the local clock.
pub(crate) fn decide(
    observed: &Observed,
    now: DateTime<Utc>,
    me: Me<'_>,
    policy: &Policy,
) -> Decision {
    let doc = match observed {
        Observed::Missing => return Decision::Initialize,
        Observed::Malformed { problems, .. } => {
            return Decision::RepairMalformed {
                problems: problems.clone(),
            }
        }
        Observed::Valid(doc) => doc,
    };
    match (doc.is_ready, doc.is_editing) {
        (true, false) => decide_ready(doc, now, policy),
        (false, true) => decide_editing(doc, now, me, policy),
        (false, false) => decide_idle(doc, now),
        (true, true) => Decision::RepairContradiction {
            expected: doc.lock_epoch,
        },
    }
}

fn claim_free(doc: &BotDoc, branch: Branch, reason: String) -> Decision {
    Decision::Claim {
        expected: doc.lock_epoch,
        claim: Claim::Free,
        branch,
        reason,
    }
}

/// A failed refresh set a shared backoff; an admin's explicit request overrides it.
fn backing_off(doc: &BotDoc, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    doc.retry_refresh_after
        .filter(|until| *until > now && !refresh_requested(doc))
}

fn refresh_requested(doc: &BotDoc) -> bool {
    match (doc.refresh_requested_at, doc.last_update_started_at) {
        (Some(requested), Some(started)) => requested > started,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Why a refresh is due, if it is.
fn refresh_due(doc: &BotDoc, now: DateTime<Utc>, schedule: RefreshSchedule) -> Option<String> {
    if refresh_requested(doc) {
        return Some("an admin requested a refresh".into());
    }
    let Some(last) = doc.last_seed_updated_at else {
        return Some("the seeds have no refresh date".into());
    };
    match schedule {
        RefreshSchedule::Daily if last.date_naive() != now.date_naive() => Some(format!(
            "daily refresh: the UTC date changed from {} to {}",
            last.date_naive(),
            now.date_naive()
        )),
        RefreshSchedule::Every(every)
            if now
                .signed_duration_since(last)
                .to_std()
                .is_ok_and(|age| age >= every) =>
        {
            Some(format!(
                "interval refresh: the seeds are older than {}",
                humantime::format_duration(every)
            ))
        }
        _ => None,
    }
}

fn decide_ready(doc: &BotDoc, now: DateTime<Utc>, policy: &Policy) -> Decision {
    if doc.seeds.is_empty() {
        if let Some(until) = backing_off(doc, now) {
            return Decision::Wait {
                until: Some(until),
                branch: Branch::A1,
                reason: format!("{BACKOFF}: ready with no seeds after a failed refresh"),
            };
        }
        return claim_free(
            doc,
            Branch::A1,
            "A-1: ready but the seed list is empty".into(),
        );
    }
    match refresh_due(doc, now, policy.refresh) {
        Some(why) => match backing_off(doc, now) {
            // keep_previous: crawl on the old seeds until the shared backoff passes.
            Some(until) => Decision::Ready {
                branch: Branch::A2,
                note: Some(format!(
                    "refresh due ({why}) but {BACKOFF} until {until} after a failure"
                )),
            },
            None => claim_free(doc, Branch::A2, format!("A-2: {why}")),
        },
        None => Decision::Ready {
            branch: Branch::A3,
            note: None,
        },
    }
}

fn decide_editing(doc: &BotDoc, now: DateTime<Utc>, me: Me<'_>, policy: &Policy) -> Decision {
    let expected = doc.lock_epoch;
    let holder = doc.editing_by.as_deref().unwrap_or("?");
    // Both are set on every editing document (`BotDoc::parse` rejects one without them).
    let expires = doc.lock_expires_at.unwrap_or(now);
    let started = doc.last_update_started_at.unwrap_or(now);
    if holder == me.id.as_str() && started < me.since {
        return Decision::Claim {
            expected,
            claim: Claim::Orphaned,
            branch: Branch::B1,
            reason: format!("B-1: epoch {expected} was claimed by a previous run of this instance"),
        };
    }
    // The holder gives up at `max_refresh`; others wait out the grace on top, so that its
    // failure (and backoff) lands instead of a takeover — unless it is hung.
    let stuck_after = chrono::Duration::from_std(policy.max_refresh + policy.stuck_grace)
        .unwrap_or(chrono::Duration::MAX);
    let stuck_at = started
        .checked_add_signed(stuck_after)
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    if expires <= now {
        return Decision::Claim {
            expected,
            claim: Claim::Expired { now },
            branch: Branch::B1,
            reason: format!("B-1: {holder} stopped heartbeating; its lock expired at {expires}"),
        };
    }
    if stuck_at <= now {
        return Decision::Claim {
            expected,
            claim: Claim::Stuck {
                started_before: now - stuck_after,
            },
            branch: Branch::B2,
            reason: format!(
                "B-2: {holder}'s refresh started at {started}, longer ago than max_refresh ({}) and its grace ({})",
                humantime::format_duration(policy.max_refresh),
                humantime::format_duration(policy.stuck_grace)
            ),
        };
    }
    Decision::Wait {
        until: Some(expires.min(stuck_at)),
        branch: Branch::B3,
        reason: format!("B-3: {holder} is refreshing (epoch {expected})"),
    }
}

fn decide_idle(doc: &BotDoc, now: DateTime<Utc>) -> Decision {
    if let Some(until) = backing_off(doc, now) {
        return Decision::Wait {
            until: Some(until),
            branch: Branch::C,
            reason: format!(
                "{BACKOFF} after {} failed refresh(es): {}",
                doc.failed_refreshes,
                doc.last_error.as_deref().unwrap_or("unknown error")
            ),
        };
    }
    claim_free(
        doc,
        Branch::C,
        "C: not ready and nobody is refreshing".into(),
    )
}

/// For a Ready bot (the decision was to use its seeds): the first moment its decision can
/// change without its document changing — its refresh falling due (`daily`: the next UTC
/// midnight after the last refresh; an interval: the last refresh plus the interval), or, while
/// a due refresh backs off after a failure, the backoff's end. `None`: nothing but a change of
/// the document will change it.
pub(crate) fn ready_until(
    doc: &BotDoc,
    now: DateTime<Utc>,
    policy: &Policy,
) -> Option<DateTime<Utc>> {
    if refresh_due(doc, now, policy.refresh).is_some() {
        return backing_off(doc, now);
    }
    scheduled_refresh(doc, policy.refresh)
}

/// When the schedule makes the bot's next refresh due (from its last refresh); `None` for a bot
/// never refreshed (due at once).
pub(crate) fn scheduled_refresh(doc: &BotDoc, schedule: RefreshSchedule) -> Option<DateTime<Utc>> {
    let last = doc.last_seed_updated_at?;
    match schedule {
        RefreshSchedule::Daily => last
            .date_naive()
            .succ_opt()
            .and_then(|d| d.and_hms_opt(0, 0, 0))
            .map(|t| t.and_utc()),
        RefreshSchedule::Every(every) => chrono::Duration::from_std(every)
            .ok()
            .and_then(|d| last.checked_add_signed(d)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::state::state_of;
    use bson::doc;
    use chrono::TimeZone;

    fn me_id() -> InstanceId {
        InstanceId::parse("me").unwrap()
    }

    /// This process started at 00:30.
    fn me(id: &InstanceId) -> Me<'_> {
        Me {
            id,
            since: at(0, 30),
        }
    }

    fn at(h: u32, m: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap()
    }

    fn ready(seeds: &[&str], updated: DateTime<Utc>) -> BotDoc {
        BotDoc {
            id: crate::ids::BotId::parse("shop").unwrap(),
            is_ready: true,
            is_editing: false,
            seeds: seeds.iter().map(|s| s.to_string()).collect(),
            last_update_started_at: Some(updated),
            last_seed_updated_at: Some(updated),
            editing_by: None,
            lock_epoch: LockEpoch::new(4).unwrap(),
            heartbeat_at: None,
            lock_expires_at: None,
            last_error: None,
            failed_refreshes: 0,
            refresh_requested_at: None,
            retry_refresh_after: None,
            crawl_pass: crate::ids::PassNumber::NONE,
            crawl_pass_started_at: None,
            crawl_pass_ended_at: None,
            crawl_last_run_at: None,
            crawl_next_pass_at: None,
            crawl_last_pass_pages: None,
            crawl_pass_recorded: None,
            crawl_evaluation_pending: None,
            crawl_evaluated_pass: crate::ids::PassNumber::NONE,
            crawl_feed_staged: crate::ids::PassNumber::NONE,
            paused: false,
            crawl_pass_spec: None,
            spec_error: None,
            crawl_pass_refetch: false,
        }
    }

    fn editing(by: &str, started: DateTime<Utc>, expires: DateTime<Utc>) -> BotDoc {
        BotDoc {
            is_ready: false,
            is_editing: true,
            editing_by: Some(by.into()),
            last_update_started_at: Some(started),
            lock_expires_at: Some(expires),
            ..ready(&["http://a/"], at(0, 0))
        }
    }

    fn daily() -> Policy {
        Policy {
            refresh: RefreshSchedule::Daily,
            max_refresh: Duration::from_secs(600),
            stuck_grace: Duration::from_secs(120),
        }
    }

    fn hourly() -> Policy {
        Policy {
            refresh: RefreshSchedule::Every(Duration::from_secs(3600)),
            max_refresh: Duration::from_secs(600),
            stuck_grace: Duration::from_secs(120),
        }
    }

    /// One row: a document, the server's time, the policy, and the expected (state, branch, claim).
    struct Row {
        name: &'static str,
        observed: Observed,
        now: DateTime<Utc>,
        policy: Policy,
        state: BotState,
        branch: Branch,
        claim: Option<Claim>,
    }

    fn rows() -> Vec<Row> {
        let valid = Observed::Valid;
        let yesterday = at(1, 0) - chrono::Duration::days(1);
        vec![
            Row {
                name: "A-1 ready with no seeds claims the free lock",
                observed: valid(ready(&[], at(1, 0))),
                now: at(2, 0),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::A1,
                claim: Some(Claim::Free),
            },
            Row {
                name: "A-2 the UTC date changed since the last refresh",
                observed: valid(ready(&["http://a/"], yesterday)),
                now: at(0, 1),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::A2,
                claim: Some(Claim::Free),
            },
            Row {
                name: "A-2 the interval passed",
                observed: valid(ready(&["http://a/"], at(1, 0))),
                now: at(2, 0),
                policy: hourly(),
                state: BotState::Updating,
                branch: Branch::A2,
                claim: Some(Claim::Free),
            },
            Row {
                name: "A-2 an admin asked for a refresh after the last one started",
                observed: valid(BotDoc {
                    refresh_requested_at: Some(at(1, 30)),
                    ..ready(&["http://a/"], at(1, 0))
                }),
                now: at(1, 31),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::A2,
                claim: Some(Claim::Free),
            },
            Row {
                name: "A-2 a request served by a later refresh is not due again",
                observed: valid(BotDoc {
                    refresh_requested_at: Some(at(0, 30)),
                    ..ready(&["http://a/"], at(1, 0))
                }),
                now: at(1, 31),
                policy: daily(),
                state: BotState::Ready,
                branch: Branch::A3,
                claim: None,
            },
            Row {
                name: "A-2 due but backing off after a failure keeps the previous seeds",
                observed: valid(BotDoc {
                    retry_refresh_after: Some(at(2, 5)),
                    last_error: Some("boom".into()),
                    ..ready(&["http://a/"], yesterday)
                }),
                now: at(2, 0),
                policy: daily(),
                state: BotState::Ready,
                branch: Branch::A2,
                claim: None,
            },
            Row {
                name: "A-2 an admin's request overrides the backoff",
                observed: valid(BotDoc {
                    retry_refresh_after: Some(at(2, 5)),
                    refresh_requested_at: Some(at(1, 59)),
                    ..ready(&["http://a/"], at(1, 0))
                }),
                now: at(2, 0),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::A2,
                claim: Some(Claim::Free),
            },
            Row {
                name: "A-3 ready, same day, within the interval",
                observed: valid(ready(&["http://a/"], at(1, 0))),
                now: at(1, 59),
                policy: hourly(),
                state: BotState::Ready,
                branch: Branch::A3,
                claim: None,
            },
            Row {
                name: "B-1 the holder's lock expired",
                observed: valid(editing("other", at(1, 0), at(1, 1))),
                now: at(1, 2),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::B1,
                claim: Some(Claim::Expired { now: at(1, 2) }),
            },
            Row {
                name: "B-1 a lock left by a previous run of this instance id is reclaimed",
                observed: valid(editing("me", at(0, 10), at(1, 5))),
                now: at(1, 2),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::B1,
                claim: Some(Claim::Orphaned),
            },
            Row {
                name: "B-3 a lock under this id claimed after this process started is another process's",
                observed: valid(editing("me", at(1, 0), at(1, 5))),
                now: at(1, 2),
                policy: daily(),
                state: BotState::Waiting,
                branch: Branch::B3,
                claim: None,
            },
            Row {
                name: "B-3 heartbeating past max_refresh but within the grace: its holder is recording the failure",
                observed: valid(editing("other", at(1, 0), at(1, 12))),
                now: at(1, 11),
                policy: daily(),
                state: BotState::Waiting,
                branch: Branch::B3,
                claim: None,
            },
            Row {
                name: "B-2 heartbeating for longer than max_refresh and its grace",
                observed: valid(editing("other", at(1, 0), at(1, 13))),
                now: at(1, 12),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::B2,
                claim: Some(Claim::Stuck {
                    started_before: at(1, 0),
                }),
            },
            Row {
                name: "B-3 a live holder within max_refresh: wait",
                observed: valid(editing("other", at(1, 0), at(1, 5))),
                now: at(1, 4),
                policy: daily(),
                state: BotState::Waiting,
                branch: Branch::B3,
                claim: None,
            },
            Row {
                name: "C a missing document is initialized",
                observed: Observed::Missing,
                now: at(1, 0),
                policy: daily(),
                state: BotState::Waiting,
                branch: Branch::C,
                claim: None,
            },
            Row {
                name: "C not ready and not editing claims the lock",
                observed: valid(BotDoc {
                    is_ready: false,
                    ..ready(&[], at(1, 0))
                }),
                now: at(1, 0),
                policy: daily(),
                state: BotState::Updating,
                branch: Branch::C,
                claim: Some(Claim::Free),
            },
            Row {
                name: "C after a failure waits out the shared backoff",
                observed: valid(BotDoc {
                    is_ready: false,
                    retry_refresh_after: Some(at(1, 1)),
                    last_error: Some("503".into()),
                    failed_refreshes: 2,
                    ..ready(&[], at(0, 0))
                }),
                now: at(1, 0),
                policy: daily(),
                state: BotState::Error,
                branch: Branch::C,
                claim: None,
            },
            Row {
                name: "D ready and editing is repaired, not force-unlocked",
                observed: valid(BotDoc {
                    is_ready: true,
                    ..editing("other", at(1, 0), at(1, 5))
                }),
                now: at(1, 1),
                policy: daily(),
                state: BotState::Error,
                branch: Branch::D,
                claim: None,
            },
            Row {
                name: "E a malformed document is repaired",
                observed: Observed::Malformed {
                    raw: doc! {"_id": "shop", "isReady": "true"},
                    problems: vec!["isReady must be a boolean".into()],
                },
                now: at(1, 0),
                policy: daily(),
                state: BotState::Error,
                branch: Branch::E,
                claim: None,
            },
        ]
    }

    #[test]
    fn every_branch_of_wait_seed_ready() {
        for row in rows() {
            let decision = decide(&row.observed, row.now, me(&me_id()), &row.policy);
            assert_eq!(decision.state(), row.state, "{}: {decision:?}", row.name);
            assert_eq!(decision.branch(), row.branch, "{}: {decision:?}", row.name);
            let claim = match &decision {
                Decision::Claim {
                    claim, expected, ..
                } => {
                    assert_eq!(
                        expected.get(),
                        4,
                        "{}: claims are fenced on the observed epoch",
                        row.name
                    );
                    Some(*claim)
                }
                _ => None,
            };
            assert_eq!(claim, row.claim, "{}", row.name);
        }
    }

    #[test]
    fn waits_end_when_the_lock_could_change() {
        let doc = editing("other", at(1, 0), at(1, 5));
        match decide(&Observed::Valid(doc), at(1, 4), me(&me_id()), &daily()) {
            Decision::Wait { until, .. } => assert_eq!(until, Some(at(1, 5))),
            other => panic!("expected a wait, got {other:?}"),
        }
        // A heartbeating holder: the wait ends at max_refresh and its grace, not at the
        // (renewed) expiry.
        let doc = editing("other", at(1, 0), at(1, 30));
        match decide(&Observed::Valid(doc), at(1, 4), me(&me_id()), &daily()) {
            Decision::Wait { until, .. } => assert_eq!(until, Some(at(1, 12))),
            other => panic!("expected a wait, got {other:?}"),
        }
    }

    #[test]
    fn states_seen_by_an_admin() {
        assert_eq!(
            state_of(&Observed::Valid(ready(&["x"], at(1, 0)))),
            BotState::Ready
        );
        assert_eq!(
            state_of(&Observed::Valid(editing("o", at(1, 0), at(1, 1)))),
            BotState::Updating
        );
        let failed = BotDoc {
            is_ready: false,
            last_error: Some("x".into()),
            ..ready(&[], at(1, 0))
        };
        assert_eq!(state_of(&Observed::Valid(failed)), BotState::Error);
        assert_eq!(state_of(&Observed::Missing), BotState::Waiting);
    }

    #[test]
    fn a_ready_bot_knows_when_its_decision_changes_without_a_change_of_its_document() {
        // Daily: the next UTC midnight after the last refresh; until then, it uses its seeds.
        let doc = ready(&["x"], at(9, 0));
        let midnight = Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap();
        assert_eq!(ready_until(&doc, at(10, 0), &daily()), Some(midnight));
        assert!(matches!(
            decide(
                &Observed::Valid(doc.clone()),
                midnight - chrono::Duration::seconds(1),
                me(&me_id()),
                &daily()
            ),
            Decision::Ready { .. }
        ));
        assert!(matches!(
            decide(&Observed::Valid(doc), midnight, me(&me_id()), &daily()),
            Decision::Claim { .. }
        ));
        // An interval: the last refresh plus the interval.
        let doc = ready(&["x"], at(9, 0));
        assert_eq!(ready_until(&doc, at(9, 30), &hourly()), Some(at(10, 0)));
        // Due but backing off after a failure (keep_previous): the backoff's end.
        let backing_off = BotDoc {
            retry_refresh_after: Some(at(11, 0)),
            ..ready(&["x"], at(9, 0))
        };
        assert_eq!(
            ready_until(&backing_off, at(10, 30), &hourly()),
            Some(at(11, 0))
        );
        // Never refreshed: nothing to wait for (it is due at once).
        let never = BotDoc {
            last_seed_updated_at: None,
            ..ready(&["x"], at(9, 0))
        };
        assert_eq!(scheduled_refresh(&never, RefreshSchedule::Daily), None);
    }
}
