//! The lock wing: the edit lock's vocabulary and its pure state machine over the bot documents.
//! It sits below the store, so it cannot do I/O: the store decodes a `bots` document into these
//! types and encodes their changes; the runner above carries the decisions out.
//!
//! - [`bot`]: the bot document typed ([`bot::BotDoc`], [`bot::Observed`], [`bot::BotSpec`]);
//! - [`state`]: [`state::BotState`], the lock's [`state::Claim`] conditions, [`state::state_of`];
//! - [`decide`]: the state machine, a pure function of (document, server time, me, policy).

pub mod bot;
pub(crate) mod decide;
pub mod state;
