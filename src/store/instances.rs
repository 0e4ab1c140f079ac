//! The `instances` collection: one document per running instance id (`_id`), holding the
//! process that uses it (host, pid, a random token) and a heartbeat. Two live processes must
//! never share an id — the second would take the first one's live locks as its own orphans — so
//! an instance registers its id before any lock work and refuses to start while a live process
//! holds it (the lock wing's `presence`). The token fences the heartbeat: a process whose id was
//! taken over (it looked dead) learns so on its next beat.
//!
//! A registration also names the server sessions of the process's commit transactions
//! (`txnSessions`, the newest 16), each before its first transaction: a process killed inside a
//! commit leaves its transaction open on the server, holding every document it wrote until the
//! server ends it (60 s on MongoDB), and whoever takes the id over ends it at once
//! (`killSessions`).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::ClientSession;

use super::{date, plus, Store};
use crate::error::{is_duplicate_key, Result};
use crate::ids::InstanceId;

pub(crate) const INSTANCES: &str = "instances";

/// How many sessions a registration names (the newest): a process's commit transactions use a
/// few pooled sessions, one per writer at a time.
const NAMED_SESSIONS: usize = 16;

/// The sessions this process's commit transactions use, once its registration names them.
#[derive(Debug, Default)]
pub(crate) struct TransactionSessions {
    owner: OnceLock<InstanceId>,
    /// Sessions already named (as their `lsid` printed).
    named: Mutex<HashSet<String>>,
}

/// The process behind an instance id.
#[derive(Clone, Debug, PartialEq)]
pub struct Presence {
    pub host: String,
    pub pid: u32,
    pub token: String,
    pub started_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
    /// The sessions its commit transactions used (`txnSessions`: server session ids).
    pub sessions: Vec<Document>,
}

impl Presence {
    fn document(
        &self,
        me: &InstanceId,
        now: DateTime<Utc>,
        ttl: Duration,
        indexes: Vec<Bson>,
    ) -> Document {
        doc! {
            "_id": me.as_str(),
            "host": self.host.as_str(),
            "pid": i64::from(self.pid),
            "token": self.token.as_str(),
            "startedAt": date(now),
            "heartbeatAt": date(now),
            "expiresAt": date(plus(now, ttl)),
            "version": env!("CARGO_PKG_VERSION"),
            // The index definitions this process uses: another version's start-up keeps them
            // while this registration lives.
            "indexes": indexes,
        }
    }

    fn read(d: &Document) -> Presence {
        let when = |key: &str| match d.get(key) {
            Some(Bson::DateTime(t)) => Some(t.to_chrono()),
            _ => None,
        };
        Presence {
            host: d.get_str("host").unwrap_or("").to_owned(),
            pid: d
                .get("pid")
                .and_then(crate::store::document::integer)
                .and_then(|p| u32::try_from(p).ok())
                .unwrap_or(0),
            token: d.get_str("token").unwrap_or("").to_owned(),
            started_at: when("startedAt"),
            heartbeat_at: when("heartbeatAt"),
            expires_at: when("expiresAt"),
            sessions: d
                .get_array("txnSessions")
                .map(|all| {
                    all.iter()
                        .filter_map(|s| s.as_document().cloned())
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

/// What registering an instance id found.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Registration {
    /// The id was free; it is this process's now.
    Registered,
    /// Another process registered it (nothing was written).
    HeldBy(Presence),
    /// It was registered, and gone when read: try again.
    Vanished,
}

/// The `instances` collection, reached through [`Store::instances`].
#[derive(Clone, Copy, Debug)]
pub struct Instances<'a> {
    pub(super) store: &'a Store,
}

impl Instances<'_> {
    fn instances(self) -> mongodb::Collection<Document> {
        self.store.database().collection(INSTANCES)
    }

    /// Registers `me` for this process, if no other process has.
    pub(crate) async fn insert(
        self,
        me: &InstanceId,
        mine: &Presence,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<Registration> {
        match self
            .store
            .bounded(
                "register instance",
                self.instances().insert_one(mine.document(
                    me,
                    now,
                    ttl,
                    self.store.index_set().recorded(),
                )),
            )
            .await
        {
            Ok(_) => Ok(Registration::Registered),
            Err(crate::error::Error::Db(e)) if is_duplicate_key(&e) => {
                let held = self
                    .store
                    .bounded(
                        "read instance",
                        self.instances().find_one(doc! { "_id": me.as_str() }),
                    )
                    .await?;
                Ok(held.as_ref().map_or(Registration::Vanished, |d| {
                    Registration::HeldBy(Presence::read(d))
                }))
            }
            Err(e) => Err(e),
        }
    }

    /// Takes `me` over from a dead process whose registration is `theirs` — conditional on its
    /// token, so two processes replacing the same dead one cannot both win. True if it did.
    pub(crate) async fn replace(
        self,
        me: &InstanceId,
        theirs: &Presence,
        mine: &Presence,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<bool> {
        // A registration written by hand may lack a token: then that absence is the condition.
        let filter = if theirs.token.is_empty() {
            doc! { "_id": me.as_str(), "token": { "$exists": false } }
        } else {
            doc! { "_id": me.as_str(), "token": theirs.token.as_str() }
        };
        let result = self
            .store
            .bounded(
                "take over instance",
                self.instances().replace_one(
                    filter,
                    mine.document(me, now, ttl, self.store.index_set().recorded()),
                ),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// Renews this process's registration. False if the id is no longer this process's.
    pub(crate) async fn heartbeat(
        self,
        me: &InstanceId,
        token: &str,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<bool> {
        let result = self
            .store.bounded(
                "instance heartbeat",
                self.instances().update_one(
                    doc! { "_id": me.as_str(), "token": token },
                    doc! { "$set": { "heartbeatAt": date(now), "expiresAt": date(plus(now, ttl)) } },
                ),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// From now on, names each session of this process's commit transactions in `me`'s
    /// registration before its first transaction.
    pub fn name_transaction_sessions(self, me: &InstanceId) {
        let _ = self.store.sessions.owner.set(me.clone());
    }

    /// Names `session` in this process's registration, unless it already is (a session is
    /// named once; the driver reuses a few). Without a registration (tests, one-off commands)
    /// nothing is named.
    pub async fn name_session(self, session: &ClientSession) -> Result<()> {
        let Some(me) = self.store.sessions.owner.get() else {
            return Ok(());
        };
        let lsid = session.id().clone();
        let key = lsid.to_string();
        if names(&self.store.sessions).contains(&key) {
            return Ok(());
        }
        let pushed = self
            .store
            .bounded(
                "name transaction session",
                self.instances().update_one(
                    doc! { "_id": me.as_str() },
                    doc! { "$push": { "txnSessions": {
                        "$each": [lsid], "$slice": -(NAMED_SESSIONS as i32),
                    } } },
                ),
            )
            .await?;
        if pushed.matched_count == 0 {
            // No registration to name it in (the database lost it; the heartbeat writes it
            // again): named on a later transaction.
            return Ok(());
        }
        let mut named = names(&self.store.sessions);
        if named.len() >= NAMED_SESSIONS {
            // The registration keeps the newest only: name the next ones again.
            named.clear();
        }
        named.insert(key);
        Ok(())
    }

    /// Ends the transactions a dead process may have left open in its `sessions`. Best effort:
    /// the server ends them itself after its transaction lifetime. Returns whether it did.
    pub(crate) async fn end_sessions(self, sessions: &[Document]) -> bool {
        if sessions.is_empty() {
            return false;
        }
        let admin = self.store.database().client().database("admin");
        let command = doc! { "killSessions": sessions.to_vec() };
        match self
            .store
            .bounded("end a dead process's sessions", admin.run_command(command))
            .await
        {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "could not end the sessions of the process this instance id belonged to: a \
                     transaction it left open holds its documents until the server ends it"
                );
                false
            }
        }
    }

    /// The registrations of `ids` that exist (an id without one stopped cleanly, or never ran).
    pub(crate) async fn registrations(self, ids: &[&str]) -> Result<HashMap<String, Presence>> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let found = self
            .store
            .find_once(
                "read instances",
                INSTANCES,
                doc! { "_id": { "$in": ids } },
                doc! { "txnSessions": 0 },
                ids.len(),
                None,
            )
            .await?;
        Ok(found
            .iter()
            .filter_map(|d| Some((d.get_str("_id").ok()?.to_owned(), Presence::read(d))))
            .collect())
    }

    /// Ends this process's registration (at a clean stop).
    pub(crate) async fn remove(self, me: &InstanceId, token: &str) -> Result<()> {
        self.store
            .bounded(
                "remove instance",
                self.instances()
                    .delete_one(doc! { "_id": me.as_str(), "token": token }),
            )
            .await?;
        Ok(())
    }
}

fn names(sessions: &TransactionSessions) -> std::sync::MutexGuard<'_, HashSet<String>> {
    sessions.named.lock().unwrap_or_else(|p| p.into_inner())
}
