//! `seedlock changes BOT`: the bot's change feed, released events in order, from where the
//! reader stopped (`--since SEQ`) or from a pass (`--since-pass N`); `--follow` waits for the
//! next release. `seedlock pass release | discard BOT PASS` settles a gated pass.
//! `seedlock export BOT --delta --since-pass N` writes the same events to a file.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use bson::{Bson, Document};

use crate::config::Settings;
use crate::ids::PassNumber;
use crate::ops::admin::{iso, to_json};
use crate::ops::export::csv_cell;
use crate::ops::{bot_arg, fail, with_store, EXIT_FAILED};
use crate::store::changes::field as f;
use crate::store::release::Settle;

/// Where a reader starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Since {
    /// After this `seq` (0: from the first event kept).
    Seq(i64),
    /// From the first event of this pass.
    Pass(i64),
}

/// Events read per round trip.
const PAGE: usize = 500;

/// How often `--follow` looks again without a wake-up.
const POLL: Duration = Duration::from_secs(2);

/// One event as a person reads it: `#12 pass 3 changed SKU-42 price 10.99 → 12.49`.
pub(crate) fn event_line(event: &Document) -> String {
    let seq = event.get(f::SEQ).map(value_text).unwrap_or_default();
    let pass = event.get(f::PASS).map(value_text).unwrap_or_default();
    let kind = event.get_str(f::KIND).unwrap_or("?");
    let key = event.get_str(f::NATURAL_KEY).unwrap_or("?");
    let mut line = format!("#{seq} pass {pass} {kind} {key}");
    if let Ok(fields) = event.get_document(f::FIELDS) {
        let parts: Vec<String> = fields
            .iter()
            .filter_map(|(name, change)| {
                let change = change.as_document()?;
                let from = change.get("from").map(value_text).unwrap_or_default();
                let to = change.get("to").map(value_text).unwrap_or_default();
                Some(if kind == "added" {
                    format!("{name} {to}")
                } else {
                    format!("{name} {from} → {to}")
                })
            })
            .collect();
        if !parts.is_empty() {
            line.push(' ');
            line.push_str(&parts.join(", "));
        }
    }
    line
}

fn value_text(value: &Bson) -> String {
    match value {
        Bson::Null => "null".into(),
        Bson::String(s) => s.clone(),
        Bson::DateTime(t) => iso(t.to_chrono()),
        other => to_json(other).to_string(),
    }
}

/// One event as a JSON line: the document without its internal `_id`.
pub(crate) fn event_json(event: &Document) -> String {
    let mut event = event.clone();
    event.remove(f::ID);
    to_json(&Bson::Document(event)).to_string()
}

/// The CSV header of `export --delta --format csv`: one row per changed field.
pub(crate) const DELTA_CSV_HEADER: &str = "seq,pass,kind,naturalKey,recordId,field,from,to,at";

/// An event as CSV rows: one per field (one with an empty field for a removal or a restoration
/// that changed none).
pub(crate) fn event_csv(event: &Document) -> Vec<String> {
    let cell = |k: &str| csv_cell(&event.get(k).map(value_text).unwrap_or_default());
    let head = [
        cell(f::SEQ),
        cell(f::PASS),
        cell(f::KIND),
        cell(f::NATURAL_KEY),
        cell(f::RECORD),
    ]
    .join(",");
    let at = cell(f::AT);
    let fields: Vec<(String, String, String)> = event
        .get_document(f::FIELDS)
        .map(|d| {
            d.iter()
                .filter_map(|(name, change)| {
                    let change = change.as_document()?;
                    let side = |k: &str| match change.get(k) {
                        None | Some(Bson::Null) => String::new(),
                        Some(v) => value_text(v),
                    };
                    Some((name.clone(), side("from"), side("to")))
                })
                .collect()
        })
        .unwrap_or_default();
    if fields.is_empty() {
        return vec![format!("{head},,,,{at}")];
    }
    fields
        .into_iter()
        .map(|(name, from, to)| {
            format!(
                "{head},{},{},{},{at}",
                csv_cell(&name),
                csv_cell(&from),
                csv_cell(&to)
            )
        })
        .collect()
}

/// How events are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    Lines,
    Json,
    Csv,
}

/// Prints `events`; false when the reader went away (a closed pipe).
fn print(events: &[Document], shape: Shape, out: &mut impl Write) -> std::io::Result<()> {
    for event in events {
        match shape {
            Shape::Lines => writeln!(out, "{}", event_line(event))?,
            Shape::Json => writeln!(out, "{}", event_json(event))?,
            Shape::Csv => {
                for row in event_csv(event) {
                    writeln!(out, "{row}")?;
                }
            }
        }
    }
    out.flush()
}

/// `seedlock changes` and `export --delta`: the released events of `bot` from `since`, printed
/// as `shape`; with `follow`, then every later release as it comes, until interrupted.
pub(crate) async fn command(
    settings: Settings,
    bot: &str,
    since: Since,
    follow: bool,
    shape: Shape,
) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    with_store(&settings, |store, _| async move {
        let changes = store.changes();
        let Some((mut upto, _)) = (match changes.watermark(&bot).await {
            Ok(w) => w,
            Err(e) => return fail(EXIT_FAILED, e),
        }) else {
            return fail(EXIT_FAILED, format!("no bot {bot} in the database"));
        };
        let mut after = match since {
            Since::Seq(seq) => seq,
            Since::Pass(pass) => {
                match changes
                    .seq_before_pass(&bot, PassNumber::new(pass.max(0)))
                    .await
                {
                    Ok(seq) => seq.min(upto),
                    Err(e) => return fail(EXIT_FAILED, e),
                }
            }
        };
        let mut out = std::io::stdout().lock();
        if shape == Shape::Csv {
            if let Err(e) = writeln!(out, "{DELTA_CSV_HEADER}") {
                return closed_or_failed(&e);
            }
        }
        let mut wakeups = None;
        loop {
            loop {
                let events = match changes.read(&bot, after, upto, PAGE).await {
                    Ok(events) => events,
                    Err(e) => return fail(EXIT_FAILED, e),
                };
                let Some(last) = events.last().and_then(|e| e.get_i64(f::SEQ).ok()) else {
                    break;
                };
                if let Err(e) = print(&events, shape, &mut out) {
                    return closed_or_failed(&e);
                }
                after = last;
            }
            if !follow {
                return ExitCode::SUCCESS;
            }
            // Where to resume after an interruption, on stderr: the events are on stdout.
            tracing::debug!(bot = %bot, after, "waiting for the next release");
            if wakeups.is_none() {
                wakeups = Some(changes.wakeups(&bot).await);
            }
            loop {
                let shutdown = tokio::signal::ctrl_c();
                let wake = async {
                    if let Some(w) = wakeups.as_mut() {
                        w.next(POLL).await;
                    }
                };
                tokio::select! {
                    _ = shutdown => return ExitCode::SUCCESS,
                    () = wake => {}
                }
                match changes.watermark(&bot).await {
                    Ok(Some((seq, _))) if seq > upto => {
                        upto = seq;
                        break;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => return fail(EXIT_FAILED, format!("bot {bot} was removed")),
                    // A database restart: keep waiting; the next look may answer.
                    Err(e) => tracing::warn!(error = %e, "could not read the feed; trying again"),
                }
            }
        }
    })
    .await
}

fn closed_or_failed(e: &std::io::Error) -> ExitCode {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        ExitCode::SUCCESS
    } else {
        fail(EXIT_FAILED, format!("cannot write: {e}"))
    }
}

/// `seedlock pass release | discard BOT PASS`.
pub(crate) async fn settle(settings: Settings, bot: &str, pass: i64, how: Settle) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let pass = PassNumber::new(pass.max(0));
    with_store(&settings, |store, clock| async move {
        match store.passes().settle(&bot, pass, how, clock.now()).await {
            Ok(Some(settled)) => {
                match how {
                    Settle::Release => println!(
                        "bot {bot}: pass {} released ({} held removals applied)",
                        settled.pass.get(),
                        settled.removed
                    ),
                    Settle::Discard => println!(
                        "bot {bot}: pass {} discarded (its records keep their values; its events are gone)",
                        settled.pass.get()
                    ),
                }
                ExitCode::SUCCESS
            }
            Ok(None) => {
                let gate = match store.passes().feed_state(&bot).await {
                    Ok(state) => state.gate,
                    Err(e) => return fail(EXIT_FAILED, e),
                };
                let gated = gate
                    .as_ref()
                    .and_then(|g| g.get("pass").and_then(crate::store::document::integer));
                let state = gate
                    .as_ref()
                    .and_then(|g| g.get_str("state").ok())
                    .unwrap_or("gated");
                let message = match gated {
                    // Another settlement of this pass began and did not finish.
                    Some(p) if p == pass.get() && state != "gated" => format!(
                        "bot {bot}: pass {p} is {state}; `seedlock pass {} {bot} {p}` finishes it",
                        if state == "releasing" { "release" } else { "discard" }
                    ),
                    Some(p) => format!(
                        "bot {bot}: pass {} is not gated (pass {p} is gated now)",
                        pass.get()
                    ),
                    None => format!(
                        "bot {bot}: pass {} is not gated (no pass is gated now)",
                        pass.get()
                    ),
                };
                fail(EXIT_FAILED, message)
            }
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn an_event_reads_as_one_line_and_as_one_csv_row_per_field() {
        let event = doc! {
            "_id": "x", "seq": 12_i64, "pass": 3_i64, "kind": "changed", "naturalKey": "SKU-42",
            "recordId": "r1", "fields": { "price": { "from": "10.99", "to": "12.49" }, "stock": { "from": 3, "to": Bson::Null } },
            "at": bson::DateTime::from_millis(0),
        };
        assert_eq!(
            event_line(&event),
            "#12 pass 3 changed SKU-42 price 10.99 → 12.49, stock 3 → null"
        );
        assert_eq!(
            event_csv(&event),
            vec![
                "12,3,changed,SKU-42,r1,price,10.99,12.49,1970-01-01T00:00:00Z".to_owned(),
                "12,3,changed,SKU-42,r1,stock,3,,1970-01-01T00:00:00Z".to_owned(),
            ]
        );
        assert!(!event_json(&event).contains("\"_id\""));
        let removed = doc! { "seq": 13_i64, "pass": 3_i64, "kind": "removed", "naturalKey": "SKU-7", "recordId": "r2", "fields": {} };
        assert_eq!(
            event_csv(&removed),
            vec!["13,3,removed,SKU-7,r2,,,,".to_owned()]
        );
    }
}
