//! Settling leased URLs: done, failed, waiting or given back, every mark fenced on the entry's
//! lease token, many marks to a statement; a listing page's done mark carries its manifest.

use super::*;

/// Failed URLs of a pass that share a reason ([`Frontier::failure_reasons`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FailureReason {
    pub reason: String,
    pub count: u64,
    /// One of them (the smallest URL, so that the example is stable).
    pub example: String,
}

/// How a leased URL ends its lease.
#[derive(Clone, Debug, PartialEq)]
pub enum Mark {
    /// Done: its validators, listing fingerprint (`listFingerprint` → `fingerprint`) and the
    /// record it produced (if any; else the one it had) are kept for the next pass; a listing
    /// or seed page's done mark carries its [`Manifest`].
    Done {
        validators: Validators,
        record_id: Option<String>,
        manifest: Option<std::sync::Arc<Manifest>>,
    },
    /// Failed for good, with the reason.
    Failed { reason: String },
    /// Another attempt no earlier than `not_before` (the attempt counts).
    Retry {
        not_before: DateTime<Utc>,
        reason: String,
    },
    /// Given back unfetched or uncounted (shutdown, a paused host, a slice's end): the attempt
    /// does not count.
    Release {
        not_before: DateTime<Utc>,
        reason: String,
    },
    /// Deferred by load shedding (counted in `sheds`, not in `attempts`).
    Shed { not_before: DateTime<Utc> },
}

impl Mark {
    fn group(&self) -> u8 {
        match self {
            Mark::Done { manifest: None, .. } => 0,
            Mark::Done {
                manifest: Some(_), ..
            } => 5,
            Mark::Failed { .. } => 1,
            Mark::Retry { .. } => 2,
            Mark::Release { .. } => 3,
            Mark::Shed { .. } => 4,
        }
    }
}

impl Frontier<'_> {
    /// Settles leased URLs: each one's [`Mark`], **only while its lease is this worker's** (the
    /// filter holds its `_id` and its token). One `update` command: a statement per kind of mark
    /// and lease token, per-URL values picked by `_id` in an update pipeline. Returns, per mark,
    /// whether it was applied (false: the lease went to another worker, whose result wins).
    pub async fn settle_urls(
        self,
        marks: &[(&UrlLease, Mark)],
        now: DateTime<Utc>,
    ) -> Result<Vec<bool>> {
        if marks.is_empty() {
            return Ok(Vec::new());
        }
        let mut matched = 0;
        let nonce = new_token();
        // Moved into their commands, never copied (a listing page's statement carries its
        // manifest: 1.6 MB for a sitemap file of 50,000 pages).
        let mut statements = settle_statements(marks, now, &nonce).into_iter().peekable();
        while statements.peek().is_some() {
            let chunk: Vec<Document> = statements.by_ref().take(CHUNK).collect();
            let reply = self
                .store
                .command(
                    "settle urls",
                    doc! { "update": FRONTIER, "updates": chunk, "ordered": false },
                    None,
                )
                .await?;
            reply::duplicates("settle urls", &reply)?;
            matched += reply::count(&reply);
        }
        self.applied_marks(marks, matched, &nonce, None).await
    }

    /// Which of `marks` were applied, given that `matched` entries matched their statements: all,
    /// or (when some leases were lost) those whose entry carries the mark's lease token now.
    pub(in crate::store) async fn applied_marks(
        self,
        marks: &[(&UrlLease, Mark)],
        matched: usize,
        nonce: &str,
        session: Option<&mut mongodb::ClientSession>,
    ) -> Result<Vec<bool>> {
        if matched == marks.len() {
            return Ok(vec![true; marks.len()]);
        }
        let ids: Vec<&str> = marks.iter().map(|(l, _)| l.id.as_str()).collect();
        let bot = &marks[0].0.bot;
        let docs = self
            .store
            .find_once(
                "read settled urls",
                FRONTIER,
                doc! { f::ID: { "$in": ids }, f::BOT: bot.as_str() },
                doc! { f::LAST_LEASE_TOKEN: 1, f::SETTLED_BY: 1 },
                marks.len(),
                session,
            )
            .await?;
        let settled: HashMap<&str, (Option<&str>, Option<&str>)> = docs
            .iter()
            .filter_map(|d| {
                Some((
                    d.get_str(f::ID).ok()?,
                    (
                        d.get_str(f::LAST_LEASE_TOKEN).ok(),
                        d.get_str(f::SETTLED_BY).ok(),
                    ),
                ))
            })
            .collect();
        Ok(marks
            .iter()
            .map(|(lease, _)| {
                settled.get(lease.id.as_str()).is_some_and(|(token, by)| {
                    *token == Some(lease.token.as_str()) && *by == Some(nonce)
                })
            })
            .collect())
    }
}

/// The `update` statements that settle `marks`: one per kind of mark and lease token (each
/// filtered on the entries' `_id`s, `status: leased` and that token), per-URL values picked by
/// `_id` in an update pipeline (a statement of one URL: its values as literals).
pub(in crate::store) fn settle_statements(
    marks: &[(&UrlLease, Mark)],
    now: DateTime<Utc>,
    nonce: &str,
) -> Vec<Document> {
    let mut groups: Vec<((u8, &str), Vec<usize>)> = Vec::new();
    for (i, (lease, mark)) in marks.iter().enumerate() {
        let key = (mark.group(), lease.token.as_str());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    let mut statements = Vec::new();
    for ((group, token), members) in &groups {
        // A listing page's done mark carries its manifest (a hundred ids or so): one statement
        // per page, so that no document's update reads every other page's list (a statement's
        // per-URL columns are literal arrays, evaluated for each document it matches: a shared
        // statement of k pages costs each of them k lists).
        let per_statement = if *group == 5 { 1 } else { IN_CHUNK };
        for chunk in members.chunks(per_statement) {
            let ids: Vec<Bson> = chunk
                .iter()
                .map(|i| Bson::String(marks[*i].0.id.clone()))
                .collect();
            let bot = &marks[chunk[0]].0.bot;
            // One URL: its values as literals (picking by `_id` would cost the server two
            // array scans per field for nothing).
            let column = |value: &dyn Fn(&Mark) -> Bson| match chunk {
                [only] => literal(value(&marks[*only].1)),
                _ => pick(&ids, chunk.iter().map(|i| value(&marks[*i].1)).collect()),
            };
            let mut set = doc! {
                f::LEASE_OWNER: Bson::Null, f::LEASE_TOKEN: Bson::Null,
                f::LEASE_EXPIRES_AT: Bson::Null, f::LAST_LEASE_TOKEN: literal(*token),
                f::SETTLED_BY: literal(nonce),
            };
            // The main `$set`, then the stages after it (a listing page's baseline).
            let after = mark_fields(*group, &mut set, &column, now);
            let mut stages = vec![doc! { "$set": set }];
            stages.extend(after);
            statements.push(doc! {
                "q": {
                    f::ID: { "$in": &ids }, f::BOT: bot.as_str(),
                    f::STATUS: UrlStatus::Leased.as_str(), f::LEASE_TOKEN: *token,
                },
                "u": stages,
                "multi": true,
            });
        }
    }
    statements
}

/// What a settle statement of marks of `group` ([`Mark::group`]) sets, per URL through
/// `column`, into `set`; returns the update stages that go after that `$set`.
pub(super) fn mark_fields(
    group: u8,
    set: &mut Document,
    column: Column<'_>,
    now: DateTime<Utc>,
) -> Vec<Document> {
    let mut after = Vec::new();
    match group {
        0 | 5 => {
            done_fields(set, column, now);
            if group == 5 {
                manifest_stages(set, &mut after, column);
            }
        }
        1 => {
            set.insert(f::STATUS, UrlStatus::Failed.as_str());
            set.insert(f::DONE_AT, date(now));
            set.insert(
                f::LAST_ERROR,
                column(&|m| match m {
                    Mark::Failed { reason } => Bson::String(reason.clone()),
                    _ => Bson::Null,
                }),
            );
        }
        2 => give_back_fields(set, column, now),
        3 => {
            give_back_fields(set, column, now);
            set.insert(
                f::ATTEMPTS,
                doc! { "$subtract": [format!("${}", f::ATTEMPTS), 1_i64] },
            );
        }
        _ => {
            give_back_fields(set, column, now);
            set.insert(
                f::ATTEMPTS,
                doc! { "$subtract": [format!("${}", f::ATTEMPTS), 1_i64] },
            );
            set.insert(f::SHEDS, doc! { "$add": [format!("${}", f::SHEDS), 1_i64] });
        }
    }
    after
}

/// A done mark's fields: the page's validators and record id (an earlier one kept when the
/// page has none), and the fingerprint it was stored with.
pub(super) fn done_fields(set: &mut Document, column: Column<'_>, now: DateTime<Utc>) {
    set.insert(f::STATUS, UrlStatus::Done.as_str());
    set.insert(f::DONE_AT, date(now));
    set.insert(f::LAST_ERROR, Bson::Null);
    set.insert(
        f::FINGERPRINT,
        doc! { "$ifNull": [format!("${}", f::LIST_FINGERPRINT), Bson::Null] },
    );
    set.insert(
        f::ETAG,
        column(&|m| match m {
            Mark::Done { validators, .. } => text(validators.etag.as_deref()),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::LAST_MODIFIED,
        column(&|m| match m {
            Mark::Done { validators, .. } => text(validators.last_modified.as_deref()),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::RECORD_ID,
        doc! { "$ifNull": [
            column(&|m| match m {
                Mark::Done { record_id, .. } => text(record_id.as_deref()),
                _ => Bson::Null,
            }),
            format!("${}", f::RECORD_ID),
        ] },
    );
}

/// A URL given back to the frontier: pending again at `not_before` (waiting until then, if that
/// is later than `now`), with the reason.
pub(super) fn give_back_fields(set: &mut Document, column: Column<'_>, now: DateTime<Utc>) {
    set.insert(
        f::STATUS,
        column(&|m| match m {
            Mark::Retry { not_before, .. }
            | Mark::Release { not_before, .. }
            | Mark::Shed { not_before } => Bson::String(
                if *not_before <= now {
                    UrlStatus::Pending
                } else {
                    UrlStatus::Waiting
                }
                .as_str()
                .into(),
            ),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::NOT_BEFORE,
        column(&|m| match m {
            Mark::Retry { not_before, .. }
            | Mark::Release { not_before, .. }
            | Mark::Shed { not_before } => date(*not_before),
            _ => Bson::Null,
        }),
    );
    set.insert(
        f::LAST_ERROR,
        column(&|m| match m {
            Mark::Retry { reason, .. } | Mark::Release { reason, .. } => {
                Bson::String(reason.clone())
            }
            Mark::Shed { .. } => Bson::String("shed: its host is throttling".into()),
            _ => Bson::Null,
        }),
    );
}

/// A settle statement's per-URL column: one value per mark, picked by `_id` (see [`pick`]); a
/// statement of one mark has its value as a literal.
pub(super) type Column<'a> = &'a dyn Fn(&dyn Fn(&Mark) -> Bson) -> Bson;

/// A listing page's done mark, in the same `$set` as its other fields (every expression there
/// still sees the previous read's `listed` and `listedPass`): the manifest's fields, and what the
/// page listed since the last evaluation — that baseline (the previous read, if it was the
/// evaluated pass's; else what it held) with this list added. Then, in one more stage, whether
/// the baseline holds pages this list lacks.
pub(super) fn manifest_stages(set: &mut Document, stages: &mut Vec<Document>, column: Column<'_>) {
    fn of<T>(m: &Mark, value: impl Fn(&Manifest) -> T) -> Option<T> {
        match m {
            Mark::Done {
                manifest: Some(manifest),
                ..
            } => Some(value(manifest)),
            _ => None,
        }
    }
    let this_list = column(&|m| of(m, |x| x.listed.to_bson()).unwrap_or(Bson::Null));
    let listed = format!("${}", f::LISTED);
    let since = format!("${}", f::LISTED_SINCE);
    let evaluated = column(&|m| of(m, |x| Bson::from(x.evaluated)).unwrap_or(Bson::Null));
    // The previous read's list as a list of lists (none for a page never read); null in
    // `listedSince` means the same as that list.
    let previous = doc! { "$cond": [ { "$ifNull": [&listed, false] }, [&listed], [] ] };
    let baseline = doc! { "$cond": [
        { "$eq": [ format!("${}", f::LISTED_PASS), evaluated ] },
        previous.clone(),
        { "$ifNull": [&since, previous] },
    ] };
    // Lists compare as whole values: a list seen again adds nothing.
    set.insert(
        f::LISTED_SINCE,
        doc! { "$setUnion": [baseline, [this_list.clone()]] },
    );
    set.insert(f::LISTED, this_list);
    set.insert(
        f::LISTED_FP,
        column(&|m| of(m, |x| pack_numbers(&x.fingerprints)).unwrap_or(Bson::Null)),
    );
    // Packed as the fingerprints are (every reader reads both; an array of 50,000 numbers costs
    // ten times its bytes in each copy of the statement); none fetched: null.
    set.insert(
        f::LISTED_FETCH,
        column(&|m| {
            of(m, |x| {
                (!x.fetched.is_empty()).then(|| {
                    pack_numbers(&x.fetched.iter().map(|&i| i64::from(i)).collect::<Vec<_>>())
                })
            })
            .flatten()
            .unwrap_or(Bson::Null)
        }),
    );
    set.insert(
        f::LISTED_HASH,
        column(&|m| of(m, |x| Bson::String(x.hash())).unwrap_or(Bson::Null)),
    );
    set.insert(f::LISTED_PASS, format!("${}", f::PASS));
    // Whether the baseline holds another list; if it does not, it is stored as null (the same
    // as `listed`), so an unchanged page carries its list once.
    let more = doc! { "$gt": [ { "$size": &since }, 1 ] };
    stages.push(doc! { "$set": {
        f::LISTED_SINCE_MORE: more.clone(),
        f::LISTED_SINCE: { "$cond": [ more, &since, Bson::Null ] },
    } });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_done_mark_is_one_statement_of_literals_in_two_stages() {
        let bot = BotId::parse("b").unwrap();
        let now = Utc::now();
        let taking = Taking::new(&bot, PassNumber::new(3), None, now);
        let (one, two) = (listing_link("list/1"), listing_link("list/2"));
        let (lease_one, lease_two) = (taking.lease(&one, "1", None), taking.lease(&two, "2", None));
        let listing = |ids: &[&str]| Mark::Done {
            validators: Default::default(),
            record_id: None,
            manifest: Some(std::sync::Arc::new(Manifest {
                listed: ids.iter().map(|id| id.repeat(32)).collect(),
                fingerprints: vec![7; ids.len()],
                fetched: vec![],
                evaluated: PassNumber::new(2),
                ..Manifest::default()
            })),
        };
        let marks = [
            (&lease_one, listing(&["a", "b"])),
            (&lease_two, listing(&["c"])),
        ];
        let statements = settle_statements(&marks, now, "nonce");
        assert_eq!(statements.len(), 2, "a statement per listing page");
        for (statement, (lease, _)) in statements.iter().zip(&marks) {
            let filter = statement.get_document("q").unwrap();
            assert_eq!(
                filter.get_document(f::ID).unwrap(),
                &doc! { "$in": [lease.id.as_str()] }
            );
            let stages = statement.get_array("u").expect("a pipeline");
            assert_eq!(stages.len(), 2, "the marks, then whether the baseline grew");
            let text = format!("{stages:?}");
            assert!(
                !text.contains("$indexOfArray"),
                "one page's values are literals, not picked by _id: {text}"
            );
            let set = stages[0]
                .as_document()
                .unwrap()
                .get_document("$set")
                .unwrap();
            let this_list = set.get_document(f::LISTED).unwrap().get("$literal");
            assert!(
                matches!(this_list, Some(Bson::Binary(_))),
                "the manifest's list, packed, as a literal: {this_list:?}"
            );
            assert_eq!(
                this_list,
                set.get_document(f::LISTED_SINCE)
                    .unwrap()
                    .get_array("$setUnion")
                    .unwrap()[1]
                    .as_array()
                    .unwrap()[0]
                    .as_document()
                    .unwrap()
                    .get("$literal"),
                "the baseline gains this very list"
            );
        }
    }
}
