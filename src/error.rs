//! The library's error type. `anyhow` is used only by the CLI; everything below it returns
//! [`Error`], whose variants say what the caller can do about them.

use mongodb::error::{ErrorKind, WriteFailure};

use crate::ids::{BotId, LockEpoch};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A fenced write matched nothing: another instance (or an admin) now owns the bot. The holder
    /// must stop and write nothing more.
    #[error("edit lock lost: bot {bot} is no longer held at epoch {epoch} by this instance")]
    EditLockLost { bot: BotId, epoch: LockEpoch },
    /// A fenced frontier write matched nothing: the URL's lease expired and went to another
    /// worker, whose result wins.
    #[error("url lease lost: {url} is no longer leased by this worker")]
    UrlLeaseLost { url: String },
    /// The bot's `lockEpoch` is at the Int64 maximum: no further lock, takeover, repair or
    /// unlock can be fenced with a new epoch, and wrapping around would hand old epochs out again.
    #[error(
        "bot {bot}: lockEpoch is {}, the Int64 maximum: no new lock can be fenced. Stop every \
         instance of this bot, then reset it in mongosh: db.bots.updateOne({{_id: \"{bot}\"}}, \
         {{$set: {{lockEpoch: NumberLong(0), isEditing: false, editingBy: null}}}})",
        i64::MAX
    )]
    EpochExhausted { bot: String },
    #[error("database: {0}")]
    Db(#[from] mongodb::error::Error),
    /// A request the database state refuses (a concurrent change, a missing bot): say why.
    #[error("{0}")]
    Invalid(String),
    #[error("the server's answer to {what} was not understood: {detail}")]
    Protocol { what: &'static str, detail: String },
    /// A task of this process failed (it panicked or was cancelled): a bug, not the server's.
    #[error("{what} failed: {detail}")]
    Task { what: &'static str, detail: String },
    /// The server applied a write but did not acknowledge it as the write concern asks (a
    /// `writeConcernError` in an `ok: 1` reply).
    #[error("database: {what}: the write concern was not satisfied (code {code}): {message}")]
    WriteConcern {
        what: &'static str,
        code: i32,
        message: String,
        labels: Vec<String>,
    },
    /// An index of seedlock's could not be built: the collection, the index and the server's
    /// message, on one line.
    #[error("index {index} on {collection}: {message}")]
    Index {
        collection: String,
        index: String,
        message: String,
    },
    /// The operation did not finish within `mongo.op_timeout`.
    #[error("database: {what} did not finish within {}", humantime::format_duration(*.after))]
    Timeout {
        what: &'static str,
        after: std::time::Duration,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Server error codes that mean "try again": the node is stepping down, restarting or unreachable.
const TRANSIENT_CODES: &[i32] = &[
    6,     // HostUnreachable
    7,     // HostNotFound
    89,    // NetworkTimeout
    91,    // ShutdownInProgress
    189,   // PrimarySteppedDown
    262,   // ExceededTimeLimit
    9001,  // SocketException
    10107, // NotWritablePrimary
    11600, // InterruptedAtShutdown
    11602, // InterruptedDueToReplStateChange
    13435, // NotPrimaryNoSecondaryOk
    13436, // NotPrimaryOrSecondary
];

impl Error {
    /// True when the same operation may succeed later (network trouble, a restarting server):
    /// callers back off and retry instead of giving up.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            Error::Db(e) => is_transient_db(e),
            Error::Timeout { .. } => true,
            // 64 and 50: the write was applied and its majority wait ran out; sending it
            // again (every write is fenced or conditional) waits for the majority again.
            Error::WriteConcern { code, labels, .. } => {
                TRANSIENT_CODES.contains(code)
                    || matches!(code, 50 | 64)
                    || labels
                        .iter()
                        .any(|l| l == "RetryableWriteError" || l == "TransientTransactionError")
            }
            Error::EditLockLost { .. }
            | Error::EpochExhausted { .. }
            | Error::UrlLeaseLost { .. }
            | Error::Protocol { .. }
            | Error::Task { .. }
            | Error::Index { .. }
            | Error::Invalid(_) => false,
        }
    }
}

/// Server error codes that mean the member that answered is not, or no longer, the primary, or
/// is shutting down: an election is under way (or about to be).
const FAILOVER_CODES: &[i32] = &[
    91,    // ShutdownInProgress
    189,   // PrimarySteppedDown
    10107, // NotWritablePrimary
    11600, // InterruptedAtShutdown
    11602, // InterruptedDueToReplStateChange
    13435, // NotPrimaryNoSecondaryOk
    13436, // NotPrimaryOrSecondary
];

impl Error {
    /// True when the error is what a replica set answers through a failover — a member no longer
    /// primary, a primary shutting down, no primary to select, a connection closed by the old
    /// primary: the operation waits for the new primary (up to `mongo.server_selection_timeout`)
    /// instead of failing its step.
    pub(crate) fn is_failover(&self) -> bool {
        match self {
            Error::Db(e) => match e.kind.as_ref() {
                ErrorKind::Io(_)
                | ErrorKind::ConnectionPoolCleared { .. }
                | ErrorKind::ServerSelection { .. } => true,
                ErrorKind::Command(c) => FAILOVER_CODES.contains(&c.code),
                ErrorKind::Write(WriteFailure::WriteConcernError(w)) => {
                    FAILOVER_CODES.contains(&w.code)
                }
                _ => false,
            },
            Error::WriteConcern { code, .. } => FAILOVER_CODES.contains(code),
            _ => false,
        }
    }
}

impl Error {
    /// True when the driver found no server to send to within `mongo.server_selection_timeout`:
    /// the operation already waited out an election's length.
    pub(crate) fn is_selection_timeout(&self) -> bool {
        matches!(self, Error::Db(e) if matches!(e.kind.as_ref(), ErrorKind::ServerSelection { .. }))
    }
}

pub(crate) fn is_transient_db(e: &mongodb::error::Error) -> bool {
    if e.contains_label("RetryableWriteError")
        || e.contains_label("TransientTransactionError")
        || e.contains_label("ResumableChangeStreamError")
    {
        return true;
    }
    match e.kind.as_ref() {
        ErrorKind::Io(_)
        | ErrorKind::ConnectionPoolCleared { .. }
        | ErrorKind::ServerSelection { .. }
        | ErrorKind::DnsResolve { .. } => true,
        ErrorKind::Command(c) => TRANSIENT_CODES.contains(&c.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => {
            TRANSIENT_CODES.contains(&w.code) || matches!(w.code, 50 | 64)
        }
        _ => false,
    }
}

/// WriteConflict (112): the document is being written by another transaction — for instance one
/// a killed process left open, which the server ends at its transaction lifetime limit.
pub(crate) fn is_write_conflict(e: &Error) -> bool {
    match e {
        Error::Db(e) => match e.kind.as_ref() {
            ErrorKind::Command(c) => c.code == 112,
            ErrorKind::Write(WriteFailure::WriteError(w)) => w.code == 112,
            _ => e.contains_label("TransientTransactionError"),
        },
        _ => false,
    }
}

/// MaxTimeMSExpired (50): the command ran past its `maxTimeMS` — for a write, one that waited
/// for documents an open transaction holds.
pub(crate) fn is_max_time_expired(e: &Error) -> bool {
    match e {
        Error::Db(e) => matches!(e.kind.as_ref(), ErrorKind::Command(c) if c.code == 50),
        _ => false,
    }
}

/// E11000: two instances upserted the same `_id` at once; the loser's write is a no-op by design.
pub(crate) fn is_duplicate_key(e: &mongodb::error::Error) -> bool {
    match e.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(w)) => w.code == 11000,
        ErrorKind::Command(c) => c.code == 11000,
        _ => false,
    }
}
