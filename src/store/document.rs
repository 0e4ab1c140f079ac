//! The bot document as stored in `bots`: its field names, and the strict decoding of raw BSON into
//! the lock wing's typed [`BotDoc`]. A document that does not parse is [`Observed::Malformed`]
//! with the reasons, which the state machine repairs instead of trusting.

use crate::ids::PassNumber;
use bson::{Bson, Document};
use chrono::{DateTime, Utc};

use crate::ids::{BotId, LockEpoch};
use crate::lock::bot::{BotDoc, BotSpec, Observed, PassSpec, RecordedCounts};

/// The fields that record the spec a pass starts on (`crawlPassSpecVersion`, `crawlPassSpec`,
/// `crawlPassRefetch`), set in the write that starts the pass.
pub(crate) fn pass_spec_fields(pass: &PassSpec) -> Document {
    match &pass.spec {
        Some(spec) => bson::doc! {
            field::CRAWL_PASS_SPEC_VERSION: spec.version,
            field::CRAWL_PASS_SPEC: spec.spec.clone(),
            field::CRAWL_PASS_REFETCH: pass.refetch,
        },
        None => bson::doc! {
            field::CRAWL_PASS_SPEC_VERSION: Bson::Null,
            field::CRAWL_PASS_SPEC: Bson::Null,
            field::CRAWL_PASS_REFETCH: false,
        },
    }
}

/// The bot's name as a document spells its `_id` (`?` when it has none).
pub(crate) fn bot_name(raw: &Document) -> String {
    match raw.get(field::ID) {
        Some(Bson::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => "?".into(),
    }
}

/// The bot a document defines, when its `_id` is a valid bot id.
pub(crate) fn bot_id(raw: &Document) -> Option<BotId> {
    BotId::parse(raw.get_str(field::ID).ok()?).ok()
}

/// A bot document's definition, decoded leniently for the views and the roster: what its `spec`
/// holds and the fields an operator lists beside it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Definition {
    /// `None`: the document has no `spec` (its instances run it from their config file); an
    /// error: `spec` is not a document.
    pub spec: Option<Result<BotSpec, String>>,
    /// `specVersion`, when it reads as an integer.
    pub version: Option<i64>,
    /// `specError`: why the instances cannot run the spec.
    pub spec_error: Option<String>,
    /// `specBy`: the seedlock version that wrote the spec.
    pub spec_by: Option<String>,
    pub spec_updated_at: Option<DateTime<Utc>>,
    pub paused: bool,
    /// `crawlPass` (0: none yet).
    pub crawl_pass: i64,
}

/// Decodes what a bot document says of its definition.
pub(crate) fn definition(raw: &Document) -> Definition {
    let version = raw.get(field::SPEC_VERSION).and_then(integer);
    let spec = raw.get(field::SPEC).map(|spec| match spec {
        Bson::Document(spec) => Ok(BotSpec {
            version: version.unwrap_or(0),
            spec: spec.clone(),
        }),
        other => Err(format!(
            "key `spec`: must be a document, found {:?}",
            other.element_type()
        )),
    });
    Definition {
        spec,
        version,
        spec_error: raw.get_str(field::SPEC_ERROR).ok().map(str::to_owned),
        spec_by: raw.get_str(field::SPEC_BY).ok().map(str::to_owned),
        spec_updated_at: raw
            .get_datetime(field::SPEC_UPDATED_AT)
            .ok()
            .map(|t| t.to_chrono()),
        paused: is_true(raw, field::PAUSED),
        crawl_pass: raw.get(field::CRAWL_PASS).and_then(integer).unwrap_or(0),
    }
}

/// The seed URLs a bot document stores (strings only; anything else is skipped).
pub(crate) fn seeds(raw: &Document) -> Vec<String> {
    raw.get_array(field::SEEDS)
        .map(|seeds| {
            seeds
                .iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// What the last completed pass's deletion evaluation did, as `crawlLastPass` records it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LastEvaluation {
    pub pass: i64,
    /// `applied`, or `skipped: why`.
    pub deletion: String,
    /// `pending`, `done`, or `None` for a pass ended by a version without manifests.
    pub evaluation: Option<String>,
    pub removed: i64,
    pub restored: i64,
}

/// The last completed pass's evaluation (`None` before any pass completed).
pub(crate) fn last_evaluation(raw: &Document) -> Option<LastEvaluation> {
    let last = raw.get_document(field::CRAWL_LAST_PASS).ok()?;
    let count = |name: &str| last.get(name).and_then(integer).unwrap_or(0);
    Some(LastEvaluation {
        pass: last.get("pass").and_then(integer)?,
        deletion: last.get_str("deletion").unwrap_or("applied").to_owned(),
        evaluation: last.get_str("evaluation").ok().map(str::to_owned),
        removed: count("removed"),
        restored: count("restored"),
    })
}

/// A bot document split for `inspect`: the document without its history, and the history.
pub(crate) fn without_history(raw: &Document) -> (Document, Option<Bson>) {
    let mut body = raw.clone();
    let history = body.remove(field::HISTORY);
    (body, history)
}

/// Field names, camelCase as an admin sees them in mongosh.
pub(crate) mod field {
    pub(crate) const ID: &str = "_id";
    pub(crate) const IS_READY: &str = "isReady";
    pub(crate) const IS_EDITING: &str = "isEditing";
    pub(crate) const SEEDS: &str = "seeds";
    pub(crate) const LAST_UPDATE_STARTED_AT: &str = "lastUpdateStartedAt";
    pub(crate) const LAST_SEED_UPDATED_AT: &str = "lastSeedUpdatedAt";
    pub(crate) const EDITING_BY: &str = "editingBy";
    pub(crate) const LOCK_EPOCH: &str = "lockEpoch";
    pub(crate) const HEARTBEAT_AT: &str = "heartbeatAt";
    pub(crate) const LOCK_EXPIRES_AT: &str = "lockExpiresAt";
    pub(crate) const LAST_ERROR: &str = "lastError";
    pub(crate) const FAILED_REFRESHES: &str = "failedRefreshes";
    pub(crate) const REFRESH_REQUESTED_AT: &str = "refreshRequestedAt";
    pub(crate) const RETRY_AFTER: &str = "retryRefreshAfter";
    pub(crate) const HISTORY: &str = "history";
    pub(crate) const CRAWL_PASS: &str = "crawlPass";
    pub(crate) const CRAWL_PASS_STARTED_AT: &str = "crawlPassStartedAt";
    pub(crate) const CRAWL_PASS_ENDED_AT: &str = "crawlPassEndedAt";
    pub(crate) const CRAWL_LAST_RUN_AT: &str = "crawlLastRunAt";
    pub(crate) const CRAWL_LAST_PASS: &str = "crawlLastPass";
    /// URLs the crawl-trap bounds dropped in a pass: `{pass, max_depth: n, …}`, one count per
    /// bound that dropped any (written only when one does).
    pub(crate) const CRAWL_PASS_DROPPED: &str = "crawlPassDropped";
    /// A refresh succeeded while the pass ran: the next pass starts when it ends.
    pub(crate) const CRAWL_NEXT_PASS_AT: &str = "crawlNextPassAt";
    /// The bot's definition (a `[[bots]]` entry, every default filled in), for instances that
    /// take their bots from the database; `specVersion` rises on every change.
    pub(crate) const SPEC: &str = "spec";
    pub(crate) const SPEC_VERSION: &str = "specVersion";
    pub(crate) const SPEC_UPDATED_AT: &str = "specUpdatedAt";
    /// Why the instances cannot run `spec` (the key named), until it is fixed.
    pub(crate) const SPEC_ERROR: &str = "specError";
    /// The seedlock version whose `bots apply` wrote the spec.
    pub(crate) const SPEC_BY: &str = "specBy";
    /// The spec the current pass started with: the pass ends on it whatever changes meanwhile.
    pub(crate) const CRAWL_PASS_SPEC: &str = "crawlPassSpec";
    pub(crate) const CRAWL_PASS_SPEC_VERSION: &str = "crawlPassSpecVersion";
    /// The pass started on another spec than the pass before it: it fetches every page anew.
    pub(crate) const CRAWL_PASS_REFETCH: &str = "crawlPassRefetch";
    pub(crate) const CRAWL_EVALUATED_PASS: &str = "crawlEvaluatedPass";
    /// When the last complete pass (one trusted to remove: its coverage and error rate passed
    /// the deletion gate) was evaluated.
    pub(crate) const CRAWL_LAST_COMPLETE_PASS_AT: &str = "crawlLastCompletePassAt";
    /// Records marked removed by every evaluation so far, kept at each pass end.
    pub(crate) const CRAWL_REMOVED_TOTAL: &str = "crawlRemovedTotal";
    /// Paused by an operator: no instance takes the lock or leases a URL.
    pub(crate) const PAUSED: &str = "paused";
    pub(crate) const PAUSED_BY: &str = "pausedBy";
    pub(crate) const PAUSED_AT: &str = "pausedAt";
    pub(crate) const PAUSE_REASON: &str = "pauseReason";
}

/// How many transitions `history` keeps.
pub(crate) const HISTORY_LEN: i32 = 50;

/// What one read of a bot's document found: missing, malformed (with the reasons) or valid.
pub(crate) fn observe(raw: Option<Document>) -> Observed {
    {
        match raw {
            None => Observed::Missing,
            Some(raw) => match parse_bot(&raw) {
                Ok(doc) => Observed::Valid(doc),
                Err(problems) => Observed::Malformed { raw, problems },
            },
        }
    }
}

/// Parses a bot document strictly: wrong types and missing required fields are listed, not
/// guessed at.
pub fn parse_bot(raw: &Document) -> Result<BotDoc, Vec<String>> {
    {
        let mut problems = Vec::new();
        let id = id_of(raw, &mut problems);
        let is_ready = required_bool(raw, field::IS_READY, &mut problems);
        let is_editing = required_bool(raw, field::IS_EDITING, &mut problems);
        let seeds = seeds_of(raw, &mut problems);
        let lock_epoch = lock_epoch_of(raw, &mut problems);
        let failed_refreshes = failed_refreshes_of(raw, &mut problems);
        let last_error = optional_string(raw, field::LAST_ERROR, &mut problems);
        let editing_by = optional_string(raw, field::EDITING_BY, &mut problems);
        let mut date = |name: &str| optional_date(raw, name, &mut problems);
        let last_update_started_at = date(field::LAST_UPDATE_STARTED_AT);
        let last_seed_updated_at = date(field::LAST_SEED_UPDATED_AT);
        let heartbeat_at = date(field::HEARTBEAT_AT);
        let lock_expires_at = date(field::LOCK_EXPIRES_AT);
        let refresh_requested_at = date(field::REFRESH_REQUESTED_AT);
        let retry_refresh_after = date(field::RETRY_AFTER);
        let crawl_pass_started_at = date(field::CRAWL_PASS_STARTED_AT);
        let crawl_pass_ended_at = date(field::CRAWL_PASS_ENDED_AT);
        let crawl_last_run_at = date(field::CRAWL_LAST_RUN_AT);
        let crawl_next_pass_at = date(field::CRAWL_NEXT_PASS_AT);
        let crawl_pass = crawl_pass_of(raw, &mut problems);
        if is_editing == Some(true) {
            let holder = [
                (editing_by.is_none(), "editingBy names no holder"),
                (lock_expires_at.is_none(), "lockExpiresAt is not set"),
                (
                    last_update_started_at.is_none(),
                    "lastUpdateStartedAt is not set",
                ),
            ];
            problems.extend(
                holder
                    .iter()
                    .filter(|(missing, _)| *missing)
                    .map(|(_, problem)| format!("isEditing is true but {problem}")),
            );
        }
        match (id, is_ready, is_editing, lock_epoch) {
            (Some(id), Some(is_ready), Some(is_editing), Some(lock_epoch))
                if problems.is_empty() =>
            {
                Ok(BotDoc {
                    id,
                    is_ready,
                    is_editing,
                    seeds,
                    last_update_started_at,
                    last_seed_updated_at,
                    editing_by,
                    lock_epoch,
                    heartbeat_at,
                    lock_expires_at,
                    last_error,
                    failed_refreshes,
                    refresh_requested_at,
                    retry_refresh_after,
                    crawl_pass,
                    crawl_pass_started_at,
                    crawl_pass_ended_at,
                    crawl_last_run_at,
                    crawl_next_pass_at,
                    crawl_last_pass_pages: last_pass_pages(raw),
                    crawl_pass_recorded: recorded_counts(raw, crawl_pass),
                    crawl_evaluation_pending: evaluation_pending(raw),
                    paused: is_true(raw, field::PAUSED),
                    crawl_pass_spec: pass_spec(raw),
                    spec_error: raw.get_str(field::SPEC_ERROR).ok().map(str::to_owned),
                    crawl_pass_refetch: is_true(raw, field::CRAWL_PASS_REFETCH),
                    crawl_evaluated_pass: raw
                        .get(field::CRAWL_EVALUATED_PASS)
                        .and_then(integer)
                        .map_or(PassNumber::NONE, PassNumber::new),
                    crawl_feed_staged: raw
                        .get_document(super::release::FEED)
                        .ok()
                        .and_then(|f| f.get(super::release::feed::STAGED))
                        .and_then(integer)
                        .map_or(PassNumber::NONE, PassNumber::new),
                })
            }
            _ => Err(problems),
        }
    }
}

/// `_id`: a string that is a valid bot id.
fn id_of(raw: &Document, problems: &mut Vec<String>) -> Option<BotId> {
    match raw.get(field::ID) {
        Some(Bson::String(s)) => BotId::parse(s).map_err(|e| problems.push(e)).ok(),
        other => {
            problems.push(format!("_id must be a string, found {}", describe(other)));
            None
        }
    }
}

/// `lockEpoch`: an integer that is a valid epoch.
fn lock_epoch_of(raw: &Document, problems: &mut Vec<String>) -> Option<LockEpoch> {
    match raw.get(field::LOCK_EPOCH).and_then(integer) {
        Some(n) => LockEpoch::new(n).map_err(|e| problems.push(e)).ok(),
        None => {
            problems.push(format!(
                "lockEpoch must be an integer, found {}",
                describe(raw.get(field::LOCK_EPOCH))
            ));
            None
        }
    }
}

/// `failedRefreshes`: an integer, 0 when missing or null.
fn failed_refreshes_of(raw: &Document, problems: &mut Vec<String>) -> i64 {
    match raw.get(field::FAILED_REFRESHES) {
        None | Some(Bson::Null) => 0,
        Some(v) => integer(v).unwrap_or_else(|| {
            problems.push(format!(
                "failedRefreshes must be an integer, found {}",
                describe(Some(v))
            ));
            0
        }),
    }
}

/// `seeds`: an array of strings (the first item that is not one is the problem).
fn seeds_of(raw: &Document, problems: &mut Vec<String>) -> Vec<String> {
    match raw.get(field::SEEDS) {
        Some(Bson::Array(items)) => {
            let mut seeds = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Bson::String(s) => seeds.push(s.clone()),
                    other => {
                        problems.push(format!(
                            "seeds must hold strings, found {}",
                            describe(Some(other))
                        ));
                        break;
                    }
                }
            }
            seeds
        }
        other => {
            problems.push(format!("seeds must be an array, found {}", describe(other)));
            Vec::new()
        }
    }
}

/// A field that is a string, null or absent.
fn optional_string(raw: &Document, name: &str, problems: &mut Vec<String>) -> Option<String> {
    match raw.get(name) {
        None | Some(Bson::Null) => None,
        Some(Bson::String(s)) => Some(s.clone()),
        other => {
            problems.push(format!(
                "{name} must be a string or null, found {}",
                describe(other)
            ));
            None
        }
    }
}

/// `crawlPass`: a non-negative integer, 0 when absent or null.
fn crawl_pass_of(raw: &Document, problems: &mut Vec<String>) -> PassNumber {
    match raw.get(field::CRAWL_PASS) {
        None | Some(Bson::Null) => PassNumber::NONE,
        Some(v) => match integer(v) {
            Some(n) if n >= 0 => PassNumber::new(n),
            _ => {
                problems.push(format!(
                    "crawlPass must be a non-negative integer, found {}",
                    describe(Some(v))
                ));
                PassNumber::NONE
            }
        },
    }
}

/// `crawlLastPass.pages`, when it reads as a count.
fn last_pass_pages(raw: &Document) -> Option<u64> {
    raw.get_document(field::CRAWL_LAST_PASS)
        .ok()
        .and_then(|last| count(last, "pages"))
}

/// Pass `pass`'s counts as its end recorded them in `crawlLastPass` — `None` if that reports
/// another pass, or its counts do not read as counts.
pub(crate) fn recorded_counts(raw: &Document, pass: PassNumber) -> Option<RecordedCounts> {
    let last = raw.get_document(field::CRAWL_LAST_PASS).ok()?;
    (last.get("pass").and_then(integer) == Some(pass.get())).then_some(())?;
    Some(RecordedCounts {
        done: count(last, "done")?,
        failed: count(last, "failed")?,
    })
}

/// Whether field `name` is `true` (absent or anything else: false).
fn is_true(raw: &Document, name: &str) -> bool {
    matches!(raw.get(name), Some(Bson::Boolean(true)))
}

/// `key` of `doc` as a count (a non-negative integer).
fn count(doc: &Document, key: &str) -> Option<u64> {
    doc.get(key)
        .and_then(integer)
        .and_then(|n| u64::try_from(n).ok())
}

/// The last pass's deletion evaluation, while it is pending: its pass and until when its
/// evaluator holds it.
fn evaluation_pending(raw: &Document) -> Option<(PassNumber, DateTime<Utc>)> {
    raw.get_document(field::CRAWL_LAST_PASS)
        .ok()
        .filter(|last| last.get_str("evaluation").ok() == Some("pending"))
        .and_then(|last| {
            let pass = PassNumber::new(last.get("pass").and_then(integer)?);
            match last.get("evaluatingUntil") {
                Some(Bson::DateTime(t)) => Some((pass, t.to_chrono())),
                _ => None,
            }
        })
}

/// The spec the running pass crawls by, with its version (both present, or none).
fn pass_spec(raw: &Document) -> Option<std::sync::Arc<BotSpec>> {
    match (
        raw.get(field::CRAWL_PASS_SPEC_VERSION).and_then(integer),
        raw.get_document(field::CRAWL_PASS_SPEC),
    ) {
        (Some(version), Ok(spec)) => Some(std::sync::Arc::new(BotSpec {
            version,
            spec: spec.clone(),
        })),
        _ => None,
    }
}

fn required_bool(raw: &Document, name: &str, problems: &mut Vec<String>) -> Option<bool> {
    match raw.get(name) {
        Some(Bson::Boolean(b)) => Some(*b),
        other => {
            problems.push(format!(
                "{name} must be a boolean, found {}",
                describe(other)
            ));
            None
        }
    }
}

fn optional_date(raw: &Document, name: &str, problems: &mut Vec<String>) -> Option<DateTime<Utc>> {
    match raw.get(name) {
        None | Some(Bson::Null) => None,
        Some(Bson::DateTime(d)) => Some(d.to_chrono()),
        other => {
            problems.push(format!(
                "{name} must be a date or null, found {}",
                describe(other)
            ));
            None
        }
    }
}

/// Integers as an admin may write them in mongosh: Int32, Int64, or a whole Double.
pub fn integer(value: &Bson) -> Option<i64> {
    match value {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        Bson::Double(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Some(*f as i64),
        _ => None,
    }
}

fn describe(value: Option<&Bson>) -> String {
    match value {
        None => "nothing (the field is missing)".into(),
        Some(Bson::String(s)) => format!("the string {:?}", truncate(s, 40)),
        Some(Bson::Null) => "null".into(),
        Some(other) => format!("{:?} ({other})", other.element_type())
            .chars()
            .take(80)
            .collect(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    fn good() -> Document {
        doc! {
            "_id": "shop", "isReady": true, "isEditing": false, "seeds": ["http://a/"],
            "lockEpoch": 3_i64, "failedRefreshes": 0, "lastError": Bson::Null,
            "lastSeedUpdatedAt": bson::DateTime::from_millis(1_700_000_000_000),
        }
    }

    #[test]
    fn a_well_formed_document_parses() {
        let doc = parse_bot(&good()).unwrap();
        assert!(doc.is_ready && !doc.is_editing);
        assert_eq!(doc.lock_epoch.get(), 3);
        assert_eq!(doc.seeds, vec!["http://a/"]);
        assert!(doc.last_seed_updated_at.is_some());
    }

    #[test]
    fn admin_written_numbers_are_accepted() {
        let mut raw = good();
        raw.insert("lockEpoch", 7.0_f64);
        raw.insert("failedRefreshes", 2_i32);
        let doc = parse_bot(&raw).unwrap();
        assert_eq!((doc.lock_epoch.get(), doc.failed_refreshes), (7, 2));
    }

    #[test]
    fn each_malformation_is_named() {
        let cases: Vec<(&str, Bson, &str)> = vec![
            (
                "isReady",
                Bson::String("true".into()),
                "isReady must be a boolean",
            ),
            ("isEditing", Bson::Int32(1), "isEditing must be a boolean"),
            (
                "seeds",
                Bson::String("http://a/".into()),
                "seeds must be an array",
            ),
            (
                "seeds",
                Bson::Array(vec![Bson::Int32(1)]),
                "seeds must hold strings",
            ),
            (
                "lockEpoch",
                Bson::String("1".into()),
                "lockEpoch must be an integer",
            ),
            ("lockEpoch", Bson::Int64(-1), "negative"),
            (
                "lastSeedUpdatedAt",
                Bson::String("2024-01-01".into()),
                "lastSeedUpdatedAt must be a date",
            ),
            ("lastError", Bson::Int32(5), "lastError must be a string"),
        ];
        for (name, value, expected) in cases {
            let mut raw = good();
            raw.insert(name, value);
            let problems = parse_bot(&raw).expect_err(name);
            assert!(
                problems.iter().any(|p| p.contains(expected)),
                "{name}: {problems:?}"
            );
        }
        let mut raw = good();
        raw.remove("isReady");
        let problems = parse_bot(&raw).unwrap_err();
        assert!(problems[0].contains("missing"), "{problems:?}");
    }

    #[test]
    fn editing_without_a_holder_or_expiry_is_malformed() {
        let mut raw = good();
        raw.insert("isEditing", true);
        raw.insert("isReady", false);
        let problems = parse_bot(&raw).unwrap_err();
        assert!(
            problems.iter().any(|p| p.contains("editingBy")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("lockExpiresAt")),
            "{problems:?}"
        );
    }

    #[test]
    fn observed_distinguishes_missing_malformed_and_valid() {
        assert_eq!(observe(None), Observed::Missing);
        assert!(matches!(observe(Some(good())), Observed::Valid(_)));
        assert!(matches!(
            observe(Some(doc! {"_id": "x"})),
            Observed::Malformed { .. }
        ));
    }
}

/// What a bot's document says of its catalogue's freshness, kept at each pass end: for the
/// stale-catalogue metrics (`seedlock_last_complete_pass_timestamp_seconds` and the rest).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct CatalogueStats {
    /// When the last complete pass was evaluated.
    pub last_complete_pass: Option<DateTime<Utc>>,
    /// The last finished pass's listing coverage (0..1).
    pub coverage: Option<f64>,
    /// Records marked removed by every evaluation so far.
    pub removed_total: i64,
    /// Live records after the last evaluation.
    pub live_records: Option<i64>,
    /// A pass is gated: its change events wait for an operator.
    pub gated: bool,
    /// Change events released so far, in all.
    pub events_released: i64,
}

/// The [`CatalogueStats`] of a raw bot document (none for a bot that never ended a pass).
pub(crate) fn catalogue_stats(raw: &bson::RawDocument) -> Option<CatalogueStats> {
    use bson::RawBsonRef as R;
    let number = |v: Option<R<'_>>| match v {
        Some(R::Int32(n)) => Some(f64::from(n)),
        Some(R::Int64(n)) => Some(n as f64),
        Some(R::Double(n)) => Some(n),
        _ => None,
    };
    let last = raw.get_document(field::CRAWL_LAST_PASS).ok()?;
    let feed = raw.get_document(super::release::FEED).ok();
    Some(CatalogueStats {
        last_complete_pass: match raw.get(field::CRAWL_LAST_COMPLETE_PASS_AT) {
            Ok(Some(R::DateTime(d))) => Some(d.to_chrono()),
            _ => None,
        },
        coverage: number(last.get("listCoverage").ok().flatten()),
        removed_total: number(raw.get(field::CRAWL_REMOVED_TOTAL).ok().flatten())
            .map_or(0, |n| n as i64),
        live_records: number(last.get("liveRecords").ok().flatten()).map(|n| n as i64),
        gated: feed.is_some_and(|f| matches!(f.get(super::release::feed::GATE), Ok(Some(_)))),
        events_released: feed
            .and_then(|f| number(f.get(super::release::feed::EVENTS).ok().flatten()))
            .map_or(0, |n| n as i64),
    })
}
