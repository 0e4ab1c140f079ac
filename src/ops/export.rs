//! `seedlock export BOT`: the bot's records on stdout, one at a time off a database cursor (its
//! memory does not grow with the collection), as JSON lines (every field of each record, dates
//! in ISO form) or CSV (natural key, URL, the spec's fields in order, first seen, last changed,
//! removed at).

use std::io::Write;

use bson::{Bson, Document};

use crate::ops::admin::{iso, to_json};
use crate::store::records::{export_cells, export_header};
use crate::store::ExportRecords;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Jsonl,
    Csv,
}

/// One CSV cell: quoted when it holds a comma, a quote or a line break (quotes doubled).
pub(crate) fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

fn text_of(value: Option<&Bson>) -> String {
    match value {
        None | Some(Bson::Null) => String::new(),
        Some(Bson::String(s)) => s.clone(),
        Some(Bson::DateTime(t)) => iso(t.to_chrono()),
        Some(other) => to_json(other).to_string(),
    }
}

/// The CSV header for a spec whose record has `fields`.
pub(crate) fn csv_header(fields: &[String]) -> String {
    let cells: Vec<String> = export_header(fields).into_iter().map(csv_cell).collect();
    cells.join(",")
}

/// One record as a CSV row.
pub fn csv_row(record: &Document, fields: &[String]) -> String {
    let cells: Vec<String> = export_cells(record, fields)
        .into_iter()
        .map(|value| csv_cell(&text_of(value)))
        .collect();
    cells.join(",")
}

/// One record as a JSON line.
pub(crate) fn json_line(record: &Document) -> String {
    to_json(&Bson::Document(record.clone())).to_string()
}

/// Streams `records` to `out`; the number of records written. A closed pipe (`| head`) ends it
/// early without an error.
pub(crate) async fn write(
    mut records: ExportRecords,
    format: Format,
    fields: &[String],
    out: &mut impl Write,
) -> Result<u64, String> {
    let mut n = 0u64;
    let broken = |e: &std::io::Error| e.kind() == std::io::ErrorKind::BrokenPipe;
    let header = match format {
        Format::Csv => writeln!(out, "{}", csv_header(fields)),
        Format::Jsonl => Ok(()),
    };
    match header {
        Err(e) if broken(&e) => return Ok(0),
        Err(e) => return Err(format!("cannot write: {e}")),
        Ok(()) => {}
    }
    while let Some(record) = records.next().await.map_err(|e| format!("database: {e}"))? {
        let line = match format {
            Format::Jsonl => json_line(&record),
            Format::Csv => csv_row(&record, fields),
        };
        match writeln!(out, "{line}") {
            Err(e) if broken(&e) => return Ok(n),
            Err(e) => return Err(format!("cannot write: {e}")),
            Ok(()) => n += 1,
        }
    }
    match out.flush() {
        Err(e) if !broken(&e) => Err(format!("cannot write: {e}")),
        _ => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn csv_rows_quote_what_needs_quoting_and_follow_the_spec_fields() {
        let at = bson::DateTime::from_millis(0);
        let record = doc! {
            "naturalKey": "SKU-1", "url": "http://x/p/1",
            "data": {"title": "a \"big\", red\nthing", "price": "9.99"},
            "firstSeen": at, "lastChanged": at, "removedAt": null,
        };
        let fields = vec!["price".to_owned(), "title".to_owned(), "missing".to_owned()];
        assert_eq!(
            csv_header(&fields),
            "naturalKey,url,price,title,missing,firstSeen,lastChanged,removedAt"
        );
        assert_eq!(
            csv_row(&record, &fields),
            "SKU-1,http://x/p/1,9.99,\"a \"\"big\"\", red\nthing\",,1970-01-01T00:00:00Z,1970-01-01T00:00:00Z,"
        );
    }
}
