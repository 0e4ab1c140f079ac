//! The lock's states and claims: the state an instance is in for one bot, and the condition
//! under which it may take the edit lock. The store turns a [`Claim`] into an update's filter.

use chrono::{DateTime, Utc};

use crate::lock::bot::Observed;

/// The state an instance is in for one bot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BotState {
    /// Seeds are usable: crawl.
    Ready,
    /// Another instance is refreshing (or a refresh is backing off): wait.
    Waiting,
    /// This instance holds (or is claiming) the edit lock and refreshes the seeds.
    Updating,
    /// The document is broken or the last refresh failed; the machine is repairing or retrying.
    Error,
}

impl BotState {
    pub(crate) const ALL: [BotState; 4] = [
        BotState::Ready,
        BotState::Waiting,
        BotState::Updating,
        BotState::Error,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BotState::Ready => "ready",
            BotState::Waiting => "waiting",
            BotState::Updating => "updating",
            BotState::Error => "error",
        }
    }
}

/// The condition under which a lock may be claimed; the store turns it into the update's filter,
/// together with the observed epoch, so the claim fails if anything changed since the read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Nobody holds the lock (`isEditing: false`).
    Free,
    /// The holder's `lockExpiresAt` is before `now` (server time).
    Expired { now: DateTime<Utc> },
    /// The refresh started before `started_before` (server time minus `max_refresh`).
    Stuck { started_before: DateTime<Utc> },
    /// The holder is this very instance id, but this process does not hold the lock: a previous run of
    /// this instance died holding it. Safe to claim, since the epoch fences the old run.
    Orphaned,
}

impl Claim {
    pub(crate) fn is_takeover(self) -> bool {
        !matches!(self, Claim::Free)
    }
}

/// The state an admin sees for a document (status, metrics), independent of any instance.
pub(crate) fn state_of(observed: &Observed) -> BotState {
    match observed {
        Observed::Missing => BotState::Waiting,
        Observed::Malformed { .. } => BotState::Error,
        // A spec the instances cannot run: the bot is stopped until it is fixed.
        Observed::Valid(doc) if doc.spec_error.is_some() => BotState::Error,
        Observed::Valid(doc) => match (doc.is_ready, doc.is_editing) {
            (true, false) => BotState::Ready,
            (false, true) => BotState::Updating,
            (true, true) => BotState::Error,
            (false, false) if doc.last_error.is_some() => BotState::Error,
            (false, false) => BotState::Waiting,
        },
    }
}
