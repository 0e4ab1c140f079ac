//! The lock wing: the typed state machine over the bot documents (`bots` collection; the
//! document itself, its fields and its strict parse are the store's: [`crate::store::document`]).
//!
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
pub mod fleet;
pub mod hub;
pub mod presence;
pub mod seeds;
