//! The lock wing: one document per bot (`bots` collection) and the typed state machine over it.
//!
//! - [`document`]: the document's fields and its strict parse;
//! - [`decide`]: the state machine, a pure function of (document, server time, me);
//! - [`coordinator`]: one bot's loop — read, decide, carry out — refreshing under the edit lock;
//! - [`seeds`]: fetching and parsing seed sources;
//! - [`hub`]: what an instance does once for all its bots — one change stream, one poll, one
//!   heartbeat round trip per tick, the refresh permits;
//! - [`fleet`]: the bots defined in the database, followed at runtime;
//! - [`presence`]: one live process per instance id (the orphan rule trusts ids).
//!
//! The writes themselves live in [`crate::store`].

pub mod coordinator;
pub mod decide;
pub mod document;
pub mod fleet;
pub mod hub;
pub mod presence;
pub mod seeds;
