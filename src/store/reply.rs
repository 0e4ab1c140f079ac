//! Reading the reply of a write command sent with `run_command`, as the driver reads its own:
//! the write concern's verdict, the statements that failed and why, how many matched.

use bson::Document;

use crate::error::{Error, Result};
use crate::store::document::integer;

/// A command's reply as the store accepts it: a `writeConcernError` (the write was applied on the
/// primary but not acknowledged as the write concern asks — `w: "majority", j: true`) is an
/// error, whatever `ok` says.
pub(crate) fn checked(what: &'static str, reply: Document) -> Result<Document> {
    let Ok(wce) = reply.get_document("writeConcernError") else {
        return Ok(reply);
    };
    let labels: Vec<String> = reply
        .get_array("errorLabels")
        .map(|a| {
            a.iter()
                .filter_map(|l| l.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Err(Error::WriteConcern {
        what,
        code: wce.get("code").and_then(integer).unwrap_or(0) as i32,
        message: wce.get_str("errmsg").unwrap_or("").to_owned(),
        labels,
    })
}

/// The statements that failed on a duplicate key (their indexes in the command's list). Any other
/// write error is a [`Error::Protocol`] naming `what`.
pub(crate) fn duplicates(what: &'static str, reply: &Document) -> Result<Vec<usize>> {
    let mut duplicates = Vec::new();
    for error in write_errors(reply) {
        let code = error.get("code").and_then(integer);
        let index = error.get("index").and_then(integer);
        match (code, index) {
            (Some(11000), Some(i)) => duplicates.push(i as usize),
            _ => {
                return Err(Error::Protocol {
                    what,
                    detail: format!("{error:?}"),
                })
            }
        }
    }
    Ok(duplicates)
}

/// Whether the reply's write errors are all of statements that met a transaction's documents
/// (cut short by `maxTimeMS`, or a write conflict) — and there is at least one.
pub(crate) fn held_by_transaction(reply: &Document) -> bool {
    let mut errors = write_errors(reply).peekable();
    errors.peek().is_some()
        && errors.all(|e| matches!(e.get("code").and_then(integer), Some(50 | 112)))
}

/// The documents the command matched (`n`), 0 when the reply has none.
pub(crate) fn count(reply: &Document) -> usize {
    reply.get("n").and_then(integer).unwrap_or(0).max(0) as usize
}

/// The reply's `writeErrors`, each a document (an entry that is not one is read as empty, so it
/// fails every code check).
fn write_errors(reply: &Document) -> impl Iterator<Item = Document> + '_ {
    static EMPTY: Vec<bson::Bson> = Vec::new();
    reply
        .get_array("writeErrors")
        .unwrap_or(&EMPTY)
        .iter()
        .map(|e| e.as_document().cloned().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn duplicates_are_the_indexes_of_duplicate_key_errors_and_any_other_error_fails() {
        let reply = doc! { "n": 3, "writeErrors": [
            { "index": 1, "code": 11000, "errmsg": "dup" },
            { "index": 4_i64, "code": 11000.0, "errmsg": "dup" },
        ] };
        assert_eq!(duplicates("insert", &reply).unwrap(), [1, 4]);
        assert_eq!(count(&reply), 3);
        let other = doc! { "writeErrors": [ { "index": 0, "code": 121 } ] };
        assert!(matches!(
            duplicates("insert", &other),
            Err(Error::Protocol { what: "insert", .. })
        ));
        assert!(duplicates("insert", &doc! { "n": 0 }).unwrap().is_empty());
        assert_eq!(count(&doc! {}), 0);
    }

    #[test]
    fn held_by_transaction_needs_every_error_to_be_a_transactions_and_at_least_one() {
        let held =
            doc! { "writeErrors": [ { "index": 0, "code": 112 }, { "index": 1, "code": 50 } ] };
        assert!(held_by_transaction(&held));
        let mixed =
            doc! { "writeErrors": [ { "index": 0, "code": 112 }, { "index": 1, "code": 11000 } ] };
        assert!(!held_by_transaction(&mixed));
        assert!(!held_by_transaction(&doc! { "writeErrors": [] }));
        assert!(!held_by_transaction(&doc! { "n": 1 }));
    }

    #[test]
    fn a_write_concern_error_is_an_error_whatever_ok_says() {
        let reply = doc! { "ok": 1, "n": 1, "writeConcernError": { "code": 64, "errmsg": "waiting for replication timed out" }, "errorLabels": ["RetryableWriteError"] };
        match checked("settle", reply) {
            Err(Error::WriteConcern {
                what, code, labels, ..
            }) => {
                assert_eq!((what, code), ("settle", 64));
                assert_eq!(labels, ["RetryableWriteError"]);
            }
            other => panic!("{other:?}"),
        }
        assert!(checked("settle", doc! { "ok": 1, "n": 1 }).is_ok());
    }
}
