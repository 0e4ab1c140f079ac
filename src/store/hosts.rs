//! The `hosts` collection: each crawling instance publishes the hosts that throttled it lately
//! or are paused (one document per instance and host, refreshed every few seconds), so
//! `seedlock status` and mongosh show which sites push back. Advisory only: no decision reads it.

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::options::UpdateOptions;

use super::Store;
use crate::error::Result;
use crate::ids::InstanceId;

pub(crate) const HOSTS: &str = "hosts";

/// One instance's view of one host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostRow {
    pub host: String,
    pub instance: String,
    pub limit: f64,
    pub in_flight: i64,
    pub throttles: i64,
    pub last_throttle_at: Option<DateTime<Utc>>,
    pub paused_until: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
}

fn date(at: Option<DateTime<Utc>>) -> Bson {
    at.map_or(Bson::Null, super::date)
}

fn read_date(d: &Document, key: &str) -> Option<DateTime<Utc>> {
    match d.get(key) {
        Some(Bson::DateTime(t)) => Some(t.to_chrono()),
        _ => None,
    }
}

/// How long a host row outlives its last refresh before the server deletes it (a TTL index on
/// `updatedAt`): rows of instances that stopped, or of ids never seen again, do not pile up.
pub const HOSTS_EXPIRE_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// The `hosts` collection, reached through [`Store::hosts`].
#[derive(Clone, Copy, Debug)]
pub struct Hosts<'a> {
    pub(super) store: &'a Store,
}

impl Hosts<'_> {
    /// The `hosts` TTL index on `updatedAt` (idempotent; rebuilt if its definition changed); it
    /// also serves "published lately".
    pub async fn ensure_indexes(self) -> Result<()> {
        let ttl = super::indexes::IndexDef {
            expire_after: Some(HOSTS_EXPIRE_AFTER),
            ..super::indexes::IndexDef::new("updated_at_ttl", doc! { "updatedAt": 1 })
        };
        super::indexes::ensure(self.store, HOSTS, &[ttl], &[]).await
    }

    /// Upserts this instance's rows (one write per host).
    pub(crate) async fn publish(self, me: &InstanceId, rows: &[HostRow]) -> Result<()> {
        let hosts = self.store.database().collection::<Document>(HOSTS);
        for row in rows {
            let update = doc! { "$set": {
                "host": row.host.as_str(), "instance": me.as_str(), "limit": row.limit,
                "inFlight": row.in_flight, "throttles": row.throttles,
                "lastThrottleAt": date(row.last_throttle_at), "pausedUntil": date(row.paused_until),
                "updatedAt": date(Some(row.updated_at)),
            } };
            self.store
                .bounded(
                    "publish host",
                    hosts
                        .update_one(
                            doc! { "_id": format!("{} {}", me.as_str(), row.host) },
                            update,
                        )
                        .with_options(UpdateOptions::builder().upsert(true).build()),
                )
                .await?;
        }
        Ok(())
    }

    /// Rows refreshed since `since` (older ones belong to instances that stopped publishing).
    pub async fn recent(self, since: DateTime<Utc>) -> Result<Vec<HostRow>> {
        use futures_util::TryStreamExt;
        let docs: Vec<Document> = self
            .store
            .bounded("read hosts", async {
                self.store
                    .database()
                    .collection::<Document>(HOSTS)
                    .find(doc! { "updatedAt": { "$gte": date(Some(since)) } })
                    .await?
                    .try_collect()
                    .await
            })
            .await?;
        let mut rows: Vec<HostRow> = docs
            .iter()
            .filter_map(|d| {
                Some(HostRow {
                    host: d.get_str("host").ok()?.to_owned(),
                    instance: d.get_str("instance").ok()?.to_owned(),
                    limit: d.get_f64("limit").unwrap_or(0.0),
                    in_flight: d
                        .get("inFlight")
                        .and_then(crate::store::document::integer)
                        .unwrap_or(0),
                    throttles: d
                        .get("throttles")
                        .and_then(crate::store::document::integer)
                        .unwrap_or(0),
                    last_throttle_at: read_date(d, "lastThrottleAt"),
                    paused_until: read_date(d, "pausedUntil"),
                    updated_at: read_date(d, "updatedAt")?,
                })
            })
            .collect();
        rows.sort_by(|a, b| (&a.host, &a.instance).cmp(&(&b.host, &b.instance)));
        Ok(rows)
    }
}
