//! Configuration: the TOML file, the environment overrides, and the validated [`Settings`] the
//! rest of the daemon runs on. Every check happens here, at start-up, so a bad value is one clear
//! line naming its key, never a failure later in a loop.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::ids::{BotId, InstanceId};
use crate::urls::NormalizedUrl;

mod bots;
mod crawl;
mod lock;
mod mongo;
mod refresh;
mod selectors;
#[cfg(test)]
mod tests;

pub use bots::*;
pub use crawl::*;
pub use lock::*;
pub use mongo::*;
pub use refresh::*;

/// Environment variables that override the file (the names are part of the user-facing contract).
pub(crate) const ENV_URI: &str = "MONGODB_URI";
pub(crate) const ENV_DATABASE: &str = "SEEDLOCK_DATABASE";
pub(crate) const ENV_INSTANCE_ID: &str = "SEEDLOCK_INSTANCE_ID";
pub(crate) const ENV_HTTP_LISTEN: &str = "SEEDLOCK_HTTP_LISTEN";

#[derive(Debug, thiserror::Error)]
#[error("config {path}: {message}")]
pub(crate) struct ConfigError {
    path: String,
    message: String,
}

/// Validated settings: everything the daemon and the admin commands need.
#[derive(Clone, Debug)]
pub struct Settings {
    pub mongo: MongoSettings,
    pub instance_id: InstanceId,
    pub lock: LockSettings,
    pub refresh: RefreshLimits,
    pub crawl: CrawlLimits,
    /// How long the change feed keeps an event (`changes.ttl`).
    pub changes_ttl: Duration,
    pub http_listen: Option<String>,
    pub log: LogSettings,
    /// The file's `[[bots]]`; empty: the instance runs the bots defined in the database.
    pub bots: Vec<BotSettings>,
    /// `[instance] bots`: which of the database's bots to run (globs; empty: all).
    pub bot_filter: Vec<String>,
}

impl Settings {
    /// True when the bots come from the database (the file has no `[[bots]]`).
    pub(crate) fn bots_from_database(&self) -> bool {
        self.bots.is_empty()
    }

    /// Whether this instance runs the database's bot `id` (`[instance] bots`).
    pub(crate) fn runs(&self, id: &BotId) -> bool {
        self.bot_filter.is_empty() || self.bot_filter.iter().any(|g| glob_match(g, id.as_str()))
    }
}

/// `*` matches any run of characters, `?` one character; everything else itself.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug)]
pub struct LogSettings {
    pub format: LogFormat,
    pub level: String,
}

// ---- the file's shape -------------------------------------------------------------------------

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    mongo: RawMongo,
    #[serde(default)]
    instance: RawInstance,
    #[serde(default)]
    lock: RawLock,
    #[serde(default)]
    refresh: RawRefresh,
    #[serde(default)]
    crawl: RawCrawlLimits,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    changes: RawChanges,
    #[serde(default)]
    bots: Vec<RawBot>,
}

/// `[changes]`: the change feed.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawChanges {
    ttl: String,
}

impl Default for RawChanges {
    fn default() -> Self {
        Self { ttl: "30d".into() }
    }
}

/// The longest `changes.ttl`: ten years.
const MAX_CHANGES_TTL: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawInstance {
    id: String,
    /// With no `[[bots]]` in the file: run only the database's bots whose id matches one of these
    /// globs (`*`, `?`); empty runs them all.
    bots: Vec<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawHttp {
    listen: String,
}

impl Default for RawHttp {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawLog {
    format: LogFormat,
    level: String,
}

impl Default for RawLog {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

// ---- loading ----------------------------------------------------------------------------------

impl Settings {
    /// Reads `path`, applies the environment overrides (`MONGODB_URI`, `SEEDLOCK_DATABASE`,
    /// `SEEDLOCK_INSTANCE_ID`, `SEEDLOCK_HTTP_LISTEN`) and validates everything.
    pub(crate) fn load(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            message: format!("cannot read the file: {e}"),
        })?;
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Self::from_toml(&text, env).map_err(|message| ConfigError {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses a config from its TOML text, with `env` standing in for the process environment.
    pub fn from_toml(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig {
            mongo: RawMongo::default(),
            instance: RawInstance::default(),
            lock: RawLock::default(),
            refresh: RawRefresh::default(),
            crawl: RawCrawlLimits::default(),
            http: RawHttp::default(),
            log: RawLog::default(),
            changes: RawChanges::default(),
            bots: Vec::new(),
        }))
        .merge(Toml::string(text));
        for (var, key) in [
            (ENV_URI, "mongo.uri"),
            (ENV_DATABASE, "mongo.database"),
            (ENV_INSTANCE_ID, "instance.id"),
            (ENV_HTTP_LISTEN, "http.listen"),
        ] {
            if let Some(value) = env(var) {
                figment = figment.merge((key, value));
            }
        }
        let raw: RawConfig = figment.extract().map_err(describe_figment_error)?;
        // Errors from parsers (regex, CSS) can span lines; the contract is one line.
        raw.validate()
            .map_err(|e| e.split_whitespace().collect::<Vec<_>>().join(" "))
    }
}

fn describe_figment_error(err: figment::Error) -> String {
    // One line: the first error, with its key path; figment lists the rest on further lines.
    let first = err.into_iter().next();
    match first {
        Some(e) if !e.path.is_empty() => format!("key `{}`: {}", e.path.join("."), e.kind),
        Some(e) => e.kind.to_string().replace('\n', " "),
        None => "invalid configuration".into(),
    }
}

fn duration(key: &str, raw: &str) -> Result<Duration, String> {
    humantime::parse_duration(raw.trim()).map_err(|e| {
        format!("key `{key}`: {raw:?} is not a duration such as \"30s\" or \"10m\" ({e})")
    })
}

/// Longest duration any setting accepts: a week. Longer values are typos, and bounding them
/// keeps every timestamp computation far from overflow.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// A duration that may be zero, at most [`MAX_DURATION`].
fn bounded(key: &str, raw: &str) -> Result<Duration, String> {
    let d = duration(key, raw)?;
    if d > MAX_DURATION {
        return Err(format!(
            "key `{key}`: {raw:?} is longer than the 7-day maximum"
        ));
    }
    Ok(d)
}

fn positive(key: &str, raw: &str) -> Result<Duration, String> {
    let d = duration(key, raw)?;
    if d.is_zero() {
        return Err(format!("key `{key}`: must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(format!(
            "key `{key}`: {raw:?} is longer than the 7-day maximum"
        ));
    }
    Ok(d)
}

impl RawConfig {
    fn validate(self) -> Result<Settings, String> {
        let mongo = self.mongo.validate()?;
        let instance_id = if self.instance.id.trim().is_empty() {
            InstanceId::generate()
        } else {
            InstanceId::parse(&self.instance.id).map_err(|e| format!("key `instance.id`: {e}"))?
        };
        let lock = self.lock.validate()?;
        let refresh = self.refresh.validate()?;
        let crawl = self.crawl.validate(&refresh.user_agent)?;
        let changes_ttl = duration("changes.ttl", &self.changes.ttl)?;
        if changes_ttl < Duration::from_secs(3600) || changes_ttl > MAX_CHANGES_TTL {
            return Err(format!(
                "key `changes.ttl`: {:?} is not between 1h and 10 years",
                self.changes.ttl
            ));
        }
        let listen = self.http.listen.trim();
        let http_listen = if listen.is_empty() || listen == "off" {
            None
        } else {
            listen.parse::<std::net::SocketAddr>().map_err(|_| {
                format!("key `http.listen`: {listen:?} is not an address such as \"127.0.0.1:9464\" (or \"off\")")
            })?;
            Some(listen.to_owned())
        };
        let level = self.log.level.trim().to_owned();
        tracing_subscriber::EnvFilter::try_new(&level)
            .map_err(|e| format!("key `log.level`: {level:?} is not a log filter ({e})"))?;
        let mut seen = HashSet::new();
        let mut bots = Vec::with_capacity(self.bots.len());
        for (i, bot) in self.bots.into_iter().enumerate() {
            let bot = bot.validate(&format!("bots[{i}]"))?;
            if !seen.insert(bot.id.clone()) {
                return Err(format!(
                    "key `bots[{i}].id`: bot {:?} is configured twice",
                    bot.id.as_str()
                ));
            }
            bots.push(bot);
        }
        Ok(Settings {
            mongo,
            instance_id,
            lock,
            refresh,
            crawl,
            changes_ttl,
            http_listen,
            log: LogSettings {
                format: self.log.format,
                level,
            },
            bots,
            bot_filter: validate_globs(&self.instance.bots)?,
        })
    }
}

fn validate_globs(globs: &[String]) -> Result<Vec<String>, String> {
    globs
        .iter()
        .map(|g| {
            let g = g.trim();
            let id = g.replace(['*', '?'], "a");
            BotId::parse(&id)
                .map(|_| g.to_owned())
                .map_err(|e| format!("key `instance.bots`: {g:?} is not a bot id glob ({e})"))
        })
        .collect()
}
