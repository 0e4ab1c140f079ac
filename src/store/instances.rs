//! The `instances` collection: one document per running instance id (`_id`), holding the
//! process that uses it (host, pid, a random token) and a heartbeat. Two live processes must
//! never share an id — the second would take the first one's live locks as its own orphans — so
//! an instance registers its id before any lock work and refuses to start while a live process
//! holds it (see `crate::lock::presence`). The token fences the heartbeat: a process whose id was
//! taken over (it looked dead) learns so on its next beat.

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use std::time::Duration;

use super::{date, plus, Store};
use crate::error::{is_duplicate_key, Result};
use crate::ids::InstanceId;

pub const INSTANCES: &str = "instances";

/// The process behind an instance id.
#[derive(Clone, Debug, PartialEq)]
pub struct Presence {
    pub host: String,
    pub pid: u32,
    pub token: String,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
}

impl Presence {
    fn document(&self, me: &InstanceId, now: DateTime<Utc>, ttl: Duration) -> Document {
        doc! {
            "_id": me.as_str(),
            "host": self.host.as_str(),
            "pid": i64::from(self.pid),
            "token": self.token.as_str(),
            "startedAt": date(now),
            "heartbeatAt": date(now),
            "expiresAt": date(plus(now, ttl)),
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
                .and_then(crate::lock::document::integer)
                .and_then(|p| u32::try_from(p).ok())
                .unwrap_or(0),
            token: d.get_str("token").unwrap_or("").to_owned(),
            heartbeat_at: when("heartbeatAt"),
            expires_at: when("expiresAt"),
        }
    }
}

/// What registering an instance id found.
#[derive(Clone, Debug, PartialEq)]
pub enum Registration {
    /// The id was free; it is this process's now.
    Registered,
    /// Another process registered it (nothing was written).
    HeldBy(Presence),
    /// It was registered, and gone when read: try again.
    Vanished,
}

impl Store {
    fn instances(&self) -> mongodb::Collection<Document> {
        self.database().collection(INSTANCES)
    }

    /// Registers `me` for this process, if no other process has.
    pub async fn insert_instance(
        &self,
        me: &InstanceId,
        mine: &Presence,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<Registration> {
        match self
            .bounded(
                "register instance",
                self.instances().insert_one(mine.document(me, now, ttl)),
            )
            .await
        {
            Ok(_) => Ok(Registration::Registered),
            Err(crate::error::Error::Db(e)) if is_duplicate_key(&e) => {
                let held = self
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
    pub async fn replace_instance(
        &self,
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
            .bounded(
                "take over instance",
                self.instances()
                    .replace_one(filter, mine.document(me, now, ttl)),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// Renews this process's registration. False if the id is no longer this process's.
    pub async fn instance_heartbeat(
        &self,
        me: &InstanceId,
        token: &str,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<bool> {
        let result = self
            .bounded(
                "instance heartbeat",
                self.instances().update_one(
                    doc! { "_id": me.as_str(), "token": token },
                    doc! { "$set": { "heartbeatAt": date(now), "expiresAt": date(plus(now, ttl)) } },
                ),
            )
            .await?;
        Ok(result.matched_count == 1)
    }

    /// Ends this process's registration (at a clean stop).
    pub async fn remove_instance(&self, me: &InstanceId, token: &str) -> Result<()> {
        self.bounded(
            "remove instance",
            self.instances()
                .delete_one(doc! { "_id": me.as_str(), "token": token }),
        )
        .await?;
        Ok(())
    }
}
