//! The admin commands' views: `status` (a table or JSON), `inspect` (one document with its
//! history). Pure rendering over what the store read, so the output is testable without a server.

use crate::ids::LockEpoch;
use crate::ids::PassNumber;
use bson::{Bson, Document};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{json, Value};

use crate::config::RefreshSchedule;
use crate::ids::BotId;
use crate::lock::bot::Observed;
use crate::lock::state::state_of;
use crate::ops::progress::{Eta, PassSize};
use crate::store::document::bot_name;

/// One row of `seedlock status`.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct StatusRow {
    pub bot: String,
    pub state: String,
    /// Paused by an operator (`seedlock pause`): no instance locks or leases it.
    pub paused: bool,
    pub holder: Option<String>,
    pub epoch: Option<LockEpoch>,
    pub lock_age_seconds: Option<i64>,
    pub expires_in_seconds: Option<i64>,
    pub seeds: usize,
    pub last_refresh: Option<String>,
    pub failed_refreshes: i64,
    pub last_error: Option<String>,
    pub problems: Vec<String>,
    /// The last completed pass's deletion evaluation: how many records it removed and restored,
    /// or why it removed nothing (`crawlLastPass`).
    pub last_evaluation: Option<String>,
    /// URLs the crawl-trap bounds dropped in the bot's latest pass that dropped any:
    /// `pass 5: max_depth 12, max_pages_per_host 340` (`crawlPassDropped`).
    pub dropped: Option<String>,
    /// The current crawl pass, for bots that crawl (filled in by [`with_pass`]).
    pub crawl: Option<CrawlColumns>,
    /// Why the bot needs an operator's look, if it does (an error, a refresh past its time,
    /// paused): these rows come first in every view.
    pub attention: Option<String>,
}

/// A refresh this long past the moment its schedule (or an admin's request) made it due is
/// "past its time": a fleet working normally starts a due refresh within a poll or two.
pub(crate) const OVERDUE_AFTER: chrono::Duration = chrono::Duration::minutes(10);

/// Why a bot in `state` needs a look: its error, a refresh overdue, or a pause.
fn attention(
    state: &str,
    doc: Option<&crate::lock::bot::BotDoc>,
    schedule: Option<RefreshSchedule>,
    now: DateTime<Utc>,
) -> Option<String> {
    if state == "error" {
        return Some("error".into());
    }
    let doc = doc?;
    let due = match (doc.refresh_requested_at, doc.last_update_started_at) {
        (Some(requested), Some(started)) if requested > started => Some(requested),
        (Some(requested), None) => Some(requested),
        _ => schedule.and_then(|s| crate::lock::decide::scheduled_refresh(doc, s)),
    };
    let overdue = due
        .filter(|due| !doc.is_editing && now - *due > OVERDUE_AFTER)
        .map(|due| {
            let late = (now - due).to_std().unwrap_or_default();
            format!(
                "refresh overdue by {}",
                humantime::format_duration(std::time::Duration::from_secs(late.as_secs()))
            )
        });
    match (overdue, doc.paused) {
        (Some(overdue), true) => Some(format!("paused; {overdue}")),
        (None, true) => Some("paused".into()),
        (overdue, false) => overdue,
    }
}

/// `1000 bots: 997 ready · 1 waiting · 0 updating · 2 error · 3 need a look (1 paused)`.
pub(crate) fn counts_line(rows: &[StatusRow]) -> String {
    let states = ["ready", "waiting", "updating", "error"]
        .iter()
        .map(|s| format!("{} {s}", rows.iter().filter(|r| r.state == *s).count()))
        .collect::<Vec<_>>()
        .join(" · ");
    let missing = rows.iter().filter(|r| r.state == "missing").count();
    let paused = rows.iter().filter(|r| r.paused).count();
    let attention = rows.iter().filter(|r| r.attention.is_some()).count();
    let mut out = format!("{} bots: {states}", rows.len());
    if missing > 0 {
        out.push_str(&format!(" · {missing} missing"));
    }
    out.push_str(&format!(" · {attention} need a look ({paused} paused)"));
    out
}

/// A crawl pass as `status` shows it.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub(crate) struct CrawlColumns {
    pub pass: PassNumber,
    pub finished: bool,
    pub done: u64,
    pub pending: u64,
    pub leased: u64,
    pub failed: u64,
    /// Pages finished (done or failed) per second since the pass started.
    pub pages_per_second: f64,
    pub oldest_pending_seconds: Option<i64>,
    /// A refresh succeeded during the pass: the next one starts when it ends.
    pub next_pass_waiting: bool,
    /// The pass's expected size: the last completed pass's (or more, where this one has already
    /// discovered more); `None` while no pass has completed, when the total is still being
    /// discovered.
    pub expected_pages: Option<u64>,
    /// The URLs this pass has discovered so far (finished, open and failed).
    pub discovered_pages: u64,
    /// Seconds left at the pass's rate: over the expected pages left, or — while the total is
    /// still being discovered — a lower bound over the pages known (`eta_lower_bound`).
    pub eta_seconds: Option<u64>,
    pub eta_lower_bound: bool,
    /// The most common reason of the pass's failed pages: its count and one example URL.
    pub top_failure: Option<crate::store::frontier::FailureReason>,
}

impl CrawlColumns {
    /// The pass's expected size, as the progress displays work with it.
    pub(crate) fn size(&self) -> PassSize {
        match self.expected_pages {
            Some(n) => PassSize::Expected(n),
            None => PassSize::Discovering(self.discovered_pages),
        }
    }

    /// `"25s (~525 pages)"`, `"≥1s (300+ pages so far)"`, `"done"`, or `"?"` without a rate.
    pub(crate) fn eta_text(&self) -> String {
        match (self.finished, self.eta_seconds) {
            (true, _) => "done".into(),
            (false, None) => "?".into(),
            (false, Some(s)) => {
                let took = humantime::format_duration(std::time::Duration::from_secs(s));
                if self.eta_lower_bound {
                    format!("≥{took} ({} pages so far)", self.size().label())
                } else {
                    format!("{took} ({} pages)", self.size().label())
                }
            }
        }
    }
}

/// Adds a pass report to its bot's row; `last_pass_pages`: the last completed pass's size.
pub(crate) fn with_pass(
    row: &mut StatusRow,
    report: &crate::store::passes::PassReport,
    last_pass_pages: Option<u64>,
    now: DateTime<Utc>,
) {
    if report.pass == PassNumber::NONE {
        return;
    }
    let p = report.progress;
    let elapsed = report
        .started_at
        .map(|s| (report.ended_at.unwrap_or(now) - s).num_milliseconds())
        .unwrap_or(0);
    let finished_pages = (p.done + p.failed) as f64;
    let rate = if elapsed > 0 {
        finished_pages * 1000.0 / elapsed as f64
    } else {
        0.0
    };
    let size = PassSize::of(&p, last_pass_pages);
    let eta = if report.ended_at.is_some() {
        Eta::Done
    } else {
        Eta::of(&p, size, rate)
    };
    row.crawl = Some(CrawlColumns {
        pass: report.pass,
        finished: report.ended_at.is_some(),
        done: p.done,
        pending: p.pending + p.waiting,
        leased: p.leased,
        failed: p.failed,
        pages_per_second: (rate * 10.0).round() / 10.0,
        oldest_pending_seconds: report
            .oldest_pending
            .map(|t| (now - t).num_seconds().max(0)),
        next_pass_waiting: false,
        expected_pages: match size {
            PassSize::Expected(n) => Some(n),
            PassSize::Discovering(_) => None,
        },
        discovered_pages: p.done + p.failed + p.pending + p.waiting + p.leased,
        eta_seconds: eta.seconds(),
        eta_lower_bound: matches!(eta, Eta::AtLeast(_)),
        top_failure: report.top_failure.clone(),
    });
}

/// What the last completed pass's deletion evaluation did, in a few words: `pass 4: 2 removed,
/// 1 restored`, `pass 4: nothing removed (listing coverage 80.0% is under 95.0%), 0 restored`,
/// `pass 4: evaluating`.
pub(crate) fn evaluation_text(raw: &Document) -> Option<String> {
    let text = last_evaluation_text(raw);
    match gate_text(raw) {
        Some(gate) => Some(match text {
            Some(text) => format!("{gate}; {text}"),
            None => gate,
        }),
        None => text,
    }
}

/// The pass the drift gate withholds, and why: `pass 5 gated: field price filled 3% (last
/// pass 99%)`.
pub(crate) fn gate_text(raw: &Document) -> Option<String> {
    let gate = raw
        .get_document(crate::store::release::FEED)
        .ok()?
        .get_document(crate::store::release::feed::GATE)
        .ok()?;
    let pass = gate.get("pass").and_then(crate::store::document::integer)?;
    let reasons: Vec<&str> = gate
        .get_array("reasons")
        .map(|a| a.iter().filter_map(Bson::as_str).collect())
        .unwrap_or_default();
    Some(format!("pass {pass} gated: {}", reasons.join("; ")))
}

fn last_evaluation_text(raw: &Document) -> Option<String> {
    let last = crate::store::document::last_evaluation(raw)?;
    let pass = last.pass;
    Some(match last.evaluation.as_deref() {
        Some("pending") => format!("pass {pass}: evaluating"),
        Some(_) => match last.deletion.strip_prefix("skipped: ") {
            Some(why) => format!(
                "pass {pass}: nothing removed ({why}), {} restored",
                last.restored
            ),
            None => format!(
                "pass {pass}: {} removed, {} restored",
                last.removed, last.restored
            ),
        },
        // A pass ended by a version without manifests.
        None => format!("pass {pass}: deletion {}", last.deletion),
    })
}

/// What the crawl-trap bounds dropped in the latest pass that dropped anything, in a few words:
/// `pass 5: max_depth 12, max_pages_per_host 340`.
pub(crate) fn dropped_text(raw: &Document) -> Option<String> {
    let dropped = raw
        .get_document(crate::store::document::field::CRAWL_PASS_DROPPED)
        .ok()?;
    let pass = dropped
        .get("pass")
        .and_then(crate::store::document::integer)?;
    let counts: Vec<String> = dropped
        .iter()
        .filter(|(k, _)| k.as_str() != "pass")
        .filter_map(|(k, v)| Some(format!("{k} {}", crate::store::document::integer(v)?)))
        .collect();
    (!counts.is_empty()).then(|| format!("pass {pass}: {}", counts.join(", ")))
}

/// Builds rows for every document read, plus configured bots (with their refresh schedules)
/// that have no document yet, in that order ([`problems_first`] orders them for the views).
pub(crate) fn status_rows(
    docs: Vec<Document>,
    configured: &[(BotId, RefreshSchedule)],
    now: DateTime<Utc>,
) -> Vec<StatusRow> {
    let mut rows = Vec::new();
    for raw in docs {
        rows.push(document_row(raw, configured, now));
    }
    let known: std::collections::HashSet<String> = rows.iter().map(|r| r.bot.clone()).collect();
    for (bot, _) in configured {
        if !known.contains(bot.as_str()) {
            rows.push(missing_row(bot));
        }
    }
    rows
}

/// The refresh schedule of the bot a document holds: the bot's spec's, else its config file
/// entry's (none when neither says).
fn schedule_of(raw: &Document, configured: &[(BotId, RefreshSchedule)]) -> Option<RefreshSchedule> {
    let spec = crate::store::document::definition(raw)
        .spec
        .and_then(Result::ok);
    spec.as_ref()
        .and_then(|spec| spec.refresh())
        .and_then(|text| RefreshSchedule::parse(text).ok())
        .or_else(|| {
            let id = crate::store::document::bot_id(raw)?;
            configured
                .iter()
                .find(|(bot, _)| *bot == id)
                .map(|(_, schedule)| *schedule)
        })
}

/// The row for one document read: a valid one's lock and refresh columns, or a malformed one's
/// problems.
fn document_row(
    raw: Document,
    configured: &[(BotId, RefreshSchedule)],
    now: DateTime<Utc>,
) -> StatusRow {
    let schedule = schedule_of(&raw, configured);
    let name = bot_name(&raw);
    let last_evaluation = evaluation_text(&raw);
    let gated = gate_text(&raw).is_some();
    let dropped = dropped_text(&raw);
    let observed = crate::store::document::observe(Some(raw));
    let state = state_of(&observed).as_str().to_owned();
    match observed {
        Observed::Valid(doc) => {
            let attention = attention(&state, Some(&doc), schedule, now)
                .or_else(|| gated.then(|| "pass gated".to_owned()));
            StatusRow {
                dropped,
                ..valid_row(name, state, doc, attention, last_evaluation, now)
            }
        }
        Observed::Malformed { problems, .. } => StatusRow {
            attention: attention(&state, None, None, now),
            last_error: Some(format!("malformed: {}", problems.join("; "))),
            problems,
            last_evaluation,
            ..bare_row(name, state)
        },
        Observed::Missing => unreachable!("built from a document"),
    }
}

/// The row for a valid document: the holder, lock age and expiry only while it is being edited.
fn valid_row(
    name: String,
    state: String,
    doc: crate::lock::bot::BotDoc,
    attention: Option<String>,
    last_evaluation: Option<String>,
    now: DateTime<Utc>,
) -> StatusRow {
    let editing = doc.is_editing;
    StatusRow {
        attention,
        bot: name,
        state,
        paused: doc.paused,
        holder: doc.editing_by.filter(|_| editing),
        epoch: Some(doc.lock_epoch),
        lock_age_seconds: doc
            .last_update_started_at
            .filter(|_| editing)
            .map(|t| (now - t).num_seconds()),
        expires_in_seconds: doc
            .lock_expires_at
            .filter(|_| editing)
            .map(|t| (t - now).num_seconds()),
        seeds: doc.seeds.len(),
        last_refresh: doc.last_seed_updated_at.map(iso),
        failed_refreshes: doc.failed_refreshes,
        last_error: doc.last_error,
        problems: Vec::new(),
        last_evaluation,
        dropped: None,
        crawl: None,
    }
}

/// The row for a configured bot that has no document yet.
fn missing_row(bot: &BotId) -> StatusRow {
    bare_row(bot.to_string(), "missing".into())
}

/// A row that knows only the bot's name and state: no lock, no seeds, no error.
fn bare_row(bot: String, state: String) -> StatusRow {
    StatusRow {
        attention: None,
        bot,
        state,
        paused: false,
        holder: None,
        epoch: None,
        lock_age_seconds: None,
        expires_in_seconds: None,
        seeds: 0,
        last_refresh: None,
        failed_refreshes: 0,
        last_error: None,
        problems: Vec::new(),
        last_evaluation: None,
        dropped: None,
        crawl: None,
    }
}

/// The rows that need a look first; each group keeps its order (a stable sort).
pub(crate) fn problems_first(rows: &mut [StatusRow]) {
    rows.sort_by_key(|r| r.attention.is_none());
}

/// The hosts worth an operator's look: throttled an instance within the last minute, or paused.
pub(crate) fn troubled_hosts(
    rows: &[crate::store::hosts::HostRow],
    now: DateTime<Utc>,
) -> Vec<&crate::store::hosts::HostRow> {
    rows.iter()
        .filter(|r| {
            r.paused_until.is_some_and(|u| u > now)
                || r.last_throttle_at
                    .is_some_and(|t| now - t < chrono::Duration::seconds(60))
        })
        .collect()
}

pub(crate) fn iso(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

pub(crate) fn seconds(s: Option<i64>) -> String {
    match s {
        None => "-".into(),
        Some(s) if s < 0 => format!("{}s ago", -s),
        Some(s) => format!("{s}s"),
    }
}

/// The hosts section of `status`: hosts that throttled an instance within the last minute or are
/// paused, from the rows instances publish (empty when there are none).
pub fn render_hosts(rows: &[crate::store::hosts::HostRow], now: DateTime<Utc>) -> String {
    let troubled = troubled_hosts(rows, now);
    if troubled.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nHosts throttled in the last minute or paused:\n");
    let header = [
        "HOST",
        "INSTANCE",
        "LIMIT",
        "IN FLIGHT",
        "THROTTLES",
        "LAST THROTTLE",
        "PAUSED FOR",
    ];
    let cells: Vec<Vec<String>> = troubled
        .iter()
        .map(|r| {
            vec![
                r.host.clone(),
                r.instance.clone(),
                format!("{:.1}", r.limit),
                r.in_flight.to_string(),
                r.throttles.to_string(),
                seconds(r.last_throttle_at.map(|t| (t - now).num_seconds())),
                seconds(
                    r.paused_until
                        .filter(|u| *u > now)
                        .map(|u| (u - now).num_seconds().max(1)),
                ),
            ]
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&cells) {
        let text: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `seedlock status` as a table: a header, one line per row, then the counts.
/// How many bot rows `status` prints before it shows only those that need a look.
pub(crate) const SCREENFUL: usize = 40;

/// The fleet's table for a terminal: the summary line first (as the status page has it), then
/// the rows, those that need a look first. Past a [`SCREENFUL`] of bots, and unless `all`, only
/// the first screenful of those that need a look is shown, and a last line says what was left
/// out and how to see it.
pub(crate) fn render_table(rows: &[StatusRow], all: bool) -> String {
    let header = [
        "BOT",
        "STATE",
        "HOLDER",
        "EPOCH",
        "LOCK AGE",
        "EXPIRES IN",
        "SEEDS",
        "LAST REFRESH",
        "PASS",
        "DONE/PENDING/LEASED/FAILED",
        "PAGES/S",
        "ETA",
        "OLDEST PENDING",
        "TOP FAILURE",
        "LAST EVALUATION",
        "NEEDS A LOOK",
        "LAST ERROR",
    ];
    let shown: Vec<&StatusRow> = if all || rows.len() <= SCREENFUL {
        rows.iter().collect()
    } else {
        rows.iter()
            .filter(|r| r.attention.is_some())
            .take(SCREENFUL)
            .collect()
    };
    let cells: Vec<Vec<String>> = shown.iter().map(|r| table_cells(r)).collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    // The counts open the table: with a thousand bots they are what one reads first.
    let mut out = counts_line(rows) + "\n";
    if shown.is_empty() && !rows.is_empty() {
        out.push_str("none of them needs a look; --all shows every bot\n");
        return out;
    }
    out.push_str(&table_line(
        &header.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
        &widths,
    ));
    for row in &cells {
        out.push_str(&table_line(row, &widths));
    }
    if shown.len() < rows.len() {
        let looks = rows.iter().filter(|r| r.attention.is_some()).count();
        out.push_str(&format!(
            "{} of {} bots shown ({looks} need a look); --all shows every bot\n",
            shown.len(),
            rows.len()
        ));
    }
    out
}

/// One table line: each cell padded to its column's width, the last one as is.
fn table_line(row: &[String], widths: &[usize]) -> String {
    let mut out = String::new();
    for (i, (c, w)) in row.iter().zip(widths).enumerate() {
        if i + 1 == row.len() {
            out.push_str(c);
        } else {
            out.push_str(&format!("{c:<w$}  "));
        }
    }
    out.trim_end().to_owned() + "\n"
}

/// A row's cells in the table's column order: the bot and its lock, its crawl pass, then what
/// needs a look.
fn table_cells(r: &StatusRow) -> Vec<String> {
    let mut cells = vec![
        r.bot.clone(),
        if r.paused {
            format!("{} (paused)", r.state)
        } else {
            r.state.clone()
        },
        r.holder.clone().unwrap_or_else(|| "-".into()),
        r.epoch.map_or("-".into(), |e| e.to_string()),
        seconds(r.lock_age_seconds),
        seconds(r.expires_in_seconds),
        r.seeds.to_string(),
        r.last_refresh.clone().unwrap_or_else(|| "-".into()),
    ];
    cells.extend(crawl_cells(r.crawl.as_ref()));
    cells.push(match (&r.last_evaluation, &r.dropped) {
        (Some(evaluation), Some(dropped)) => format!("{evaluation}; dropped {dropped}"),
        (None, Some(dropped)) => format!("dropped {dropped}"),
        (Some(evaluation), None) => evaluation.clone(),
        (None, None) => "-".into(),
    });
    cells.push(r.attention.clone().unwrap_or_else(|| "-".into()));
    cells.push(last_error_cell(r));
    cells
}

/// The crawl pass's cells (pass, counts, rate, ETA, oldest pending, top failure); dashes for a
/// bot without a pass.
fn crawl_cells(crawl: Option<&CrawlColumns>) -> [String; 6] {
    [
        crawl.map_or("-".into(), |c| {
            format!(
                "{}{}{}",
                c.pass,
                if c.finished { " (done)" } else { "" },
                if c.next_pass_waiting {
                    " (next waiting)"
                } else {
                    ""
                }
            )
        }),
        crawl.map_or("-".into(), |c| {
            format!("{}/{}/{}/{}", c.done, c.pending, c.leased, c.failed)
        }),
        crawl.map_or("-".into(), |c| format!("{:.1}", c.pages_per_second)),
        crawl.map_or("-".into(), CrawlColumns::eta_text),
        seconds(crawl.and_then(|c| c.oldest_pending_seconds.map(|s| -s))),
        crawl
            .and_then(|c| c.top_failure.as_ref())
            .map_or("-".into(), |f| one_line(&failure_text(f), 80)),
    ]
}

/// The last error on one line, after how many refreshes in a row failed (`-` without one).
fn last_error_cell(r: &StatusRow) -> String {
    r.last_error
        .as_deref()
        .map(|e| one_line(e, 80))
        .map(|e| {
            if r.failed_refreshes > 0 {
                format!("({}x) {e}", r.failed_refreshes)
            } else {
                e
            }
        })
        .unwrap_or_else(|| "-".into())
}

/// A failure reason in a few words: `12× HTTP 500 (e.g. http://shop/product/7)`.
pub(crate) fn failure_text(f: &crate::store::frontier::FailureReason) -> String {
    format!("{}× {} (e.g. {})", f.count, f.reason, f.example)
}

pub(crate) fn render_json(rows: &[StatusRow]) -> String {
    serde_json::to_string_pretty(rows).expect("rows serialize") + "\n"
}

pub(crate) fn one_line(text: &str, max: usize) -> String {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.chars().count() > max {
        format!("{}…", text.chars().take(max).collect::<String>())
    } else {
        text
    }
}

/// `seedlock inspect`: the document (without history) as JSON, then the history oldest first.
pub(crate) fn render_inspect(raw: &Document) -> String {
    let (body, history) = crate::store::document::without_history(raw);
    let mut out =
        serde_json::to_string_pretty(&to_json(&Bson::Document(body))).expect("json") + "\n";
    let observed = crate::store::document::observe(Some(raw.clone()));
    out.push_str(&format!("state: {}\n", state_of(&observed).as_str()));
    if let Observed::Malformed { problems, .. } = &observed {
        for p in problems {
            out.push_str(&format!("problem: {p}\n"));
        }
    }
    out.push_str("history (oldest first):\n");
    match history {
        Some(Bson::Array(entries)) if !entries.is_empty() => {
            for entry in entries {
                let get = |k: &str| match &entry {
                    Bson::Document(d) => d.get(k).map(|v| match v {
                        Bson::DateTime(t) => iso(t.to_chrono()),
                        Bson::String(s) => s.clone(),
                        other => other.to_string(),
                    }),
                    _ => None,
                };
                out.push_str(&format!(
                    "  {}  {:<17} epoch {:<4} by {}  {}\n",
                    get("at").unwrap_or_else(|| "?".into()),
                    get("event").unwrap_or_else(|| "?".into()),
                    get("epoch").unwrap_or_else(|| "?".into()),
                    get("by").unwrap_or_else(|| "?".into()),
                    get("reason").unwrap_or_default(),
                ));
            }
        }
        _ => out.push_str("  (none)\n"),
    }
    out
}

/// BSON to plain JSON an admin can read: dates as ISO strings, numbers as numbers.
pub fn to_json(value: &Bson) -> Value {
    match value {
        Bson::Document(d) => {
            Value::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
        }
        Bson::Array(items) => Value::Array(items.iter().map(to_json).collect()),
        Bson::DateTime(t) => json!(iso(t.to_chrono())),
        Bson::String(s) => json!(s),
        Bson::Boolean(b) => json!(b),
        Bson::Int32(n) => json!(n),
        Bson::Int64(n) => json!(n),
        Bson::Double(f) => json!(f),
        Bson::Null => Value::Null,
        other => json!(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;
    use chrono::TimeZone;

    #[test]
    fn status_lists_only_hosts_throttled_lately_or_paused() {
        use crate::store::hosts::HostRow;
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let row = |host: &str, throttled_ago: Option<i64>, paused_for: Option<i64>| HostRow {
            host: host.into(),
            instance: "a".into(),
            limit: 2.5,
            in_flight: 2,
            throttles: 7,
            last_throttle_at: throttled_ago.map(|s| now - chrono::Duration::seconds(s)),
            paused_until: paused_for.map(|s| now + chrono::Duration::seconds(s)),
            updated_at: now,
        };
        let rows = [
            row("slow:80", Some(3), None),
            row("paused:80", None, Some(20)),
            row("calm:80", Some(120), Some(-5)),
        ];
        let text = render_hosts(&rows, now);
        assert!(
            text.contains("slow:80    a         2.5    2          7          3s ago         -"),
            "{text}"
        );
        assert!(text.contains("paused:80") && text.contains("20s"), "{text}");
        assert!(!text.contains("calm:80"), "{text}");
        assert_eq!(render_hosts(&rows[2..], now), "");
    }

    #[test]
    fn status_shows_holders_ages_and_missing_bots() {
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let started = bson::DateTime::from_chrono(now - chrono::Duration::seconds(12));
        let expires = bson::DateTime::from_chrono(now + chrono::Duration::seconds(18));
        let docs = vec![
            doc! {"_id": "a", "isReady": false, "isEditing": true, "seeds": [], "lockEpoch": 7_i64,
            "editingBy": "host:1:x", "lastUpdateStartedAt": started, "lockExpiresAt": expires},
            doc! {"_id": "b", "isReady": "true", "isEditing": false, "seeds": [], "lockEpoch": 1_i64},
        ];
        let configured = [
            (BotId::parse("a").unwrap(), RefreshSchedule::Daily),
            (BotId::parse("c").unwrap(), RefreshSchedule::Daily),
        ];
        let rows = status_rows(docs, &configured, now);
        assert_eq!(rows.len(), 3);
        assert_eq!(
            (rows[0].state.as_str(), rows[0].holder.as_deref()),
            ("updating", Some("host:1:x"))
        );
        assert_eq!(
            (rows[0].lock_age_seconds, rows[0].expires_in_seconds),
            (Some(12), Some(18))
        );
        assert_eq!(rows[1].state, "error");
        assert!(rows[1]
            .last_error
            .as_deref()
            .unwrap()
            .contains("isReady must be a boolean"));
        assert_eq!(
            (rows[2].bot.as_str(), rows[2].state.as_str()),
            ("c", "missing")
        );
        let table = render_table(&rows, false);
        assert!(
            table.lines().nth(2).unwrap().contains("host:1:x"),
            "{table}"
        );
        let json: serde_json::Value = serde_json::from_str(&render_json(&rows)).unwrap();
        assert_eq!(json[0]["epoch"], 7);
    }

    #[test]
    fn status_shows_a_crawling_bots_pass_rate_and_oldest_pending() {
        use crate::store::frontier::PassProgress;
        use crate::store::passes::PassReport;
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let docs = vec![
            doc! {"_id": "shop", "isReady": true, "isEditing": false, "seeds": ["http://x/"], "lockEpoch": 3_i64},
        ];
        let mut rows = status_rows(docs, &[], now);
        let report = PassReport {
            pass: PassNumber::new(4),
            progress: PassProgress {
                pending: 30,
                waiting: 2,
                leased: 4,
                done: 150,
                failed: 50,
            },
            started_at: Some(now - chrono::Duration::seconds(100)),
            ended_at: None,
            oldest_pending: Some(now - chrono::Duration::seconds(42)),
            top_failure: Some(crate::store::frontier::FailureReason {
                reason: "HTTP 500".into(),
                count: 40,
                example: "http://x/product/9".into(),
            }),
        };
        with_pass(&mut rows[0], &report, Some(300), now);
        let crawl = rows[0].crawl.clone().expect("pass columns");
        assert_eq!(
            (crawl.pass, crawl.finished, crawl.pending, crawl.leased),
            (PassNumber::new(4), false, 32, 4),
            "waiting retries count as pending"
        );
        assert_eq!(crawl.pages_per_second, 2.0, "200 pages finished in 100 s");
        assert_eq!(crawl.oldest_pending_seconds, Some(42));
        // The last pass had 300 pages: 100 left at 2 pages/s.
        assert_eq!(
            (
                crawl.expected_pages,
                crawl.eta_seconds,
                crawl.eta_lower_bound
            ),
            (Some(300), Some(50), false)
        );
        let table = render_table(&rows, false);
        let line = table.lines().nth(2).unwrap();
        assert!(
            line.contains("150/32/4/50")
                && line.contains("42s ago")
                && line.contains("50s (~300 pages)")
                && line.contains("40× HTTP 500 (e.g. http://x/product/9)"),
            "{table}"
        );
        let json: serde_json::Value = serde_json::from_str(&render_json(&rows)).unwrap();
        assert_eq!(json[0]["crawl"]["top_failure"]["reason"], "HTTP 500");
        assert_eq!(json[0]["crawl"]["top_failure"]["count"], 40);
        // Without a completed pass the total is still being discovered: a lower bound only.
        with_pass(&mut rows[0], &report, None, now);
        let crawl = rows[0].crawl.clone().expect("pass columns");
        assert_eq!(
            (
                crawl.expected_pages,
                crawl.discovered_pages,
                crawl.eta_seconds,
                crawl.eta_lower_bound
            ),
            (None, 236, Some(18), true),
            "36 open pages at 2 pages/s"
        );
        assert_eq!(crawl.eta_text(), "≥18s (236+ pages so far)");
        let json: serde_json::Value = serde_json::from_str(&render_json(&rows)).unwrap();
        assert_eq!(json[0]["crawl"]["pass"], 4);
        // A bot without a pass shows dashes.
        let mut plain = status_rows(
            vec![
                doc! {"_id": "p", "isReady": true, "isEditing": false, "seeds": [], "lockEpoch": 1_i64},
            ],
            &[],
            now,
        );
        with_pass(&mut plain[0], &PassReport::default(), None, now);
        assert!(plain[0].crawl.is_none());
    }

    #[test]
    fn inspect_lists_history_oldest_first() {
        let at = bson::DateTime::from_millis(0);
        let raw = doc! {"_id": "a", "isReady": true, "isEditing": false, "seeds": ["http://x/"], "lockEpoch": 2_i64,
        "history": [
            {"at": at, "event": "acquired", "by": "i1", "epoch": 1_i64, "reason": "C"},
            {"at": at, "event": "refreshed", "by": "i1", "epoch": 1_i64, "reason": "1 seeds"},
        ]};
        let text = render_inspect(&raw);
        let acquired = text.find("acquired").unwrap();
        assert!(acquired < text.find("refreshed").unwrap());
        assert!(text.contains("state: ready"));
        assert!(text.contains("\"lockEpoch\": 2"));
    }

    #[test]
    fn the_last_evaluation_says_what_it_removed_or_why_it_removed_nothing() {
        let of = |last: Document| evaluation_text(&doc! {"_id": "a", "crawlLastPass": last});
        assert_eq!(
            of(
                doc! {"pass": 4_i64, "deletion": "applied", "evaluation": "done", "removed": 2_i64, "restored": 1_i64}
            ),
            Some("pass 4: 2 removed, 1 restored".into())
        );
        assert_eq!(
            of(
                doc! {"pass": 4_i64, "deletion": "skipped: listing coverage 80.0% is under 95.0%", "evaluation": "done", "restored": 0_i64}
            ),
            Some(
                "pass 4: nothing removed (listing coverage 80.0% is under 95.0%), 0 restored"
                    .into()
            )
        );
        assert_eq!(
            of(doc! {"pass": 4_i64, "deletion": "applied", "evaluation": "pending"}),
            Some("pass 4: evaluating".into())
        );
        assert_eq!(
            of(doc! {"pass": 3_i64, "deletion": "applied"}),
            Some("pass 3: deletion applied".into()),
            "a pass ended by an earlier version"
        );
        assert_eq!(evaluation_text(&doc! {"_id": "a"}), None);
    }

    #[test]
    fn the_summary_opens_the_table_and_rows_that_need_a_look_come_first() {
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let at = |h: i64| bson::DateTime::from_chrono(now - chrono::Duration::hours(h));
        let docs = vec![
            doc! {"_id": "fresh", "isReady": true, "isEditing": false, "seeds": ["x"], "lockEpoch": 1_i64,
            "lastSeedUpdatedAt": at(1), "lastUpdateStartedAt": at(1)},
            doc! {"_id": "paused", "isReady": true, "isEditing": false, "seeds": ["x"], "lockEpoch": 1_i64,
            "lastSeedUpdatedAt": at(1), "lastUpdateStartedAt": at(1), "paused": true},
            // An interval of 1 h, last refreshed 3 h ago: due for 2 h.
            doc! {"_id": "late", "isReady": true, "isEditing": false, "seeds": ["x"], "lockEpoch": 1_i64,
            "lastSeedUpdatedAt": at(3), "lastUpdateStartedAt": at(3), "spec": {"refresh": "1h"}},
            doc! {"_id": "broken", "isReady": false, "isEditing": false, "seeds": [], "lockEpoch": 1_i64,
            "lastError": "refresh failed: 500"},
        ];
        let mut rows = status_rows(docs, &[], now);
        problems_first(&mut rows);
        let order: Vec<(&str, Option<&str>)> = rows
            .iter()
            .map(|r| (r.bot.as_str(), r.attention.as_deref()))
            .collect();
        assert_eq!(
            order,
            [
                ("paused", Some("paused")),
                ("late", Some("refresh overdue by 2h")),
                ("broken", Some("error")),
                ("fresh", None),
            ]
        );
        let table = render_table(&rows, false);
        assert_eq!(
            table.lines().next(),
            Some("4 bots: 3 ready · 0 waiting · 0 updating · 1 error · 3 need a look (1 paused)"),
            "{table}"
        );
        assert!(
            table.lines().nth(2).unwrap().starts_with("paused "),
            "{table}"
        );
    }

    #[test]
    fn past_a_screenful_status_shows_the_bots_that_need_a_look_unless_all() {
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let at = bson::DateTime::from_chrono(now - chrono::Duration::hours(1));
        let fleet = |broken: usize, fine: usize| {
            let mut docs: Vec<Document> = (0..fine)
                .map(|i| doc! {"_id": format!("fine{i:03}"), "isReady": true, "isEditing": false,
                "seeds": ["x"], "lockEpoch": 1_i64, "lastSeedUpdatedAt": at, "lastUpdateStartedAt": at})
                .collect();
            docs.extend((0..broken).map(|i| doc! {"_id": format!("broken{i:03}"), "isReady": false,
            "isEditing": false, "seeds": [], "lockEpoch": 1_i64, "lastError": "refresh failed: 500"}));
            let mut rows = status_rows(docs, &[], now);
            problems_first(&mut rows);
            rows
        };
        let bot_lines = |table: &str| {
            table
                .lines()
                .filter(|l| l.starts_with("fine") || l.starts_with("broken"))
                .count()
        };
        // A screenful is shown whole.
        let rows = fleet(1, SCREENFUL - 1);
        assert_eq!(bot_lines(&render_table(&rows, false)), SCREENFUL);
        // Past it: the summary, then the bots that need a look, then what was left out.
        let rows = fleet(3, 500);
        let table = render_table(&rows, false);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("503 bots: 500 ready"), "{table}");
        assert_eq!(bot_lines(&table), 3, "{table}");
        assert!(
            lines[2..5].iter().all(|l| l.starts_with("broken")),
            "{table}"
        );
        assert_eq!(
            lines.last(),
            Some(&"3 of 503 bots shown (3 need a look); --all shows every bot")
        );
        assert_eq!(bot_lines(&render_table(&rows, true)), 503);
        // More bots that need a look than a screenful: the first screenful of them.
        let rows = fleet(SCREENFUL + 10, 100);
        let table = render_table(&rows, false);
        assert_eq!(bot_lines(&table), SCREENFUL, "{table}");
        assert!(table.ends_with(&format!(
            "{SCREENFUL} of {} bots shown ({} need a look); --all shows every bot\n",
            SCREENFUL + 110,
            SCREENFUL + 10
        )));
        // Nothing needs a look.
        let table = render_table(&fleet(0, 100), false);
        assert_eq!(
            table.lines().collect::<Vec<_>>(),
            [
                "100 bots: 100 ready · 0 waiting · 0 updating · 0 error · 0 need a look (0 paused)",
                "none of them needs a look; --all shows every bot"
            ]
        );
    }
}
