//! `[mongo]`: the connection — URI, database, pool size and the deadline of each operation.

use super::*;

#[derive(Clone, Debug)]
pub struct MongoSettings {
    pub uri: String,
    pub database: String,
    pub connect_timeout: Duration,
    /// How long an operation waits for a writable primary (`mongo.server_selection_timeout`):
    /// an election takes 10-12 s on a replica set, and an operation meeting one waits it out
    /// instead of failing.
    pub server_selection_timeout: Duration,
    /// Longest any one database operation may take before it counts as failed (transient);
    /// the wait for a pooled connection counts toward it.
    pub op_timeout: Duration,
    /// The driver's connection pool, at most (`mongo.max_pool_size`).
    pub max_pool_size: u32,
}

/// The default of `mongo.max_pool_size`: connections one instance opens, at most. Every bot's
/// crawl keeps a few operations in flight (a lease round, group commits, enqueues) and the hub
/// one change stream; 32 leave room for a handful of crawling bots and a burst of refreshes
/// without opening a connection per bot (the driver's default is 10).
pub const DEFAULT_MAX_POOL_SIZE: u32 = 32;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawMongo {
    pub(super) uri: String,
    pub(super) database: String,
    pub(super) connect_timeout: String,
    pub(super) server_selection_timeout: String,
    pub(super) op_timeout: String,
    pub(super) max_pool_size: u32,
}

impl Default for RawMongo {
    fn default() -> Self {
        Self {
            uri: "mongodb://127.0.0.1:27017".into(),
            database: "seedlock".into(),
            connect_timeout: "5s".into(),
            server_selection_timeout: "30s".into(),
            op_timeout: "10s".into(),
            max_pool_size: DEFAULT_MAX_POOL_SIZE,
        }
    }
}

impl RawMongo {
    pub(super) fn validate(self) -> Result<MongoSettings, String> {
        let mongo = MongoSettings {
            uri: self.uri.trim().to_owned(),
            database: validate_database(&self.database)?,
            connect_timeout: positive("mongo.connect_timeout", &self.connect_timeout)?,
            server_selection_timeout: positive(
                "mongo.server_selection_timeout",
                &self.server_selection_timeout,
            )?,
            op_timeout: positive("mongo.op_timeout", &self.op_timeout)?,
            max_pool_size: match self.max_pool_size {
                n @ 1..=1000 => n,
                n => {
                    return Err(format!(
                        "key `mongo.max_pool_size`: {n} must be between 1 and 1000"
                    ))
                }
            },
        };
        if !(mongo.uri.starts_with("mongodb://") || mongo.uri.starts_with("mongodb+srv://")) {
            return Err(format!(
                "key `mongo.uri`: {} must start with mongodb:// or mongodb+srv://",
                crate::redact::redact_uri(&mongo.uri)
            ));
        }
        Ok(mongo)
    }
}

fn validate_database(raw: &str) -> Result<String, String> {
    let name = raw.trim();
    if name.is_empty()
        || name.len() > 63
        || name
            .chars()
            .any(|c| "/\\. \"$".contains(c) || c.is_control())
    {
        return Err(format!(
            "key `mongo.database`: {raw:?} is not a database name (1-63 characters, none of / \\ . \" $ or space)"
        ));
    }
    Ok(name.to_owned())
}
