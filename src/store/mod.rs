//! The only module that talks to MongoDB. Every write that depends on a lock is conditional:
//! claims filter on the observed `lockEpoch` (and the expiry condition), holder writes filter on
//! the [`EditLock`]'s fence `{_id, isEditing: true, editingBy: me, lockEpoch: mine}`, and repairs
//! filter on exactly what was read — the admin's unlock too (on the epoch it read), which moves
//! the epoch past the old holder's so its late writes fail.
//!
//! [`Store`] is the connection and what every operation shares (the bound, the raw commands, the
//! counts); each collection is one small type reached through it, its `impl` in one file:
//! [`Store::bots`], [`Store::frontier`], [`Store::records`], [`Store::instances`],
//! [`Store::hosts`], and a bot's passes ([`Store::passes`], [`Store::deletions`]), which live in
//! its `bots` document and its frontier.
//!
//! The database's vocabulary lives here too: every document's field names. The bot document's
//! typed form and the lock's states and claims belong to the lock wing below; [`document`]
//! decodes a raw `bots` document into them and encodes their changes.
//!
//! # Sending a write again
//!
//! A write whose answer was lost may have been applied. Every statement the store writes is
//! fenced or conditional, so a second attempt matches nothing or the same thing:
//!
//! | statements | why a second attempt is harmless |
//! |---|---|
//! | heartbeats of the held locks | fenced on `_id`, holder and epoch; they set the same expiry again |
//! | enqueue inserts | `_id` is the URL's hash: the second attempt's duplicate is the first one's document; one leased with this command's token is recognised as ours |
//! | enqueue resets and listing upserts | filtered on `pass < current`: the first attempt moved the entry into the pass, so the second matches nothing (a duplicate for an upsert), and a link it leased carries this command's token |
//! | lease takes | filtered on `status: pending` (or the expired or predecessor's token): the second attempt matches nothing, and the read-back keeps every entry that carries this round's token |
//! | done, failed, retry marks | filtered on the lease token; which marks applied is read back by the settle nonce (`settledBy`) |
//! | record inserts and compare-and-swaps | an `_id` from the natural key and a filter on the version read: the second attempt is a duplicate or a missed swap, so the record is read again and found as written |
//! | removals, restores, cleared baselines | conditional on `removedAt` or the pass: applying them twice changes nothing |

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::options::{
    ClientOptions, CollectionOptions, DatabaseOptions, ReadConcern, WriteConcern,
};
use mongodb::{Client, Collection, Database};

use crate::clock::ServerClock;
use crate::config::MongoSettings;
use crate::error::{is_duplicate_key, Error, Result};
use crate::ids::BotId;

pub(crate) mod bots;
pub mod changes;
pub(crate) mod deletions;
pub mod document;
pub mod frontier;
pub mod hosts;
pub(crate) mod indexes;
pub(crate) mod instances;
pub mod passes;
pub mod records;
pub mod release;
pub(crate) mod reply;
pub(crate) mod startup;

pub(crate) use bots::{Applied, Bots, Pause};
pub use bots::{EditLock, NextPass, UnlockOutcome};
pub(crate) use deletions::Deletions;
pub(crate) use frontier::Frontier;
pub(crate) use hosts::Hosts;
pub(crate) use instances::Instances;
pub(crate) use passes::Passes;
pub(crate) use records::{ExportRecords, Records};

pub(crate) const BOTS: &str = "bots";

/// The primary, for every read that decides and every transaction, whatever the URI's
/// `readPreference` says.
pub(crate) fn primary() -> mongodb::options::SelectionCriteria {
    mongodb::options::SelectionCriteria::ReadPreference(mongodb::options::ReadPreference::Primary)
}

/// The write concern of every write: acknowledged by a majority of the replica set's voting
/// members and written to their journals, so a primary's failover cannot roll it back (a claim
/// rolled back would leave a bot with two holders; a done mark rolled back, a record without its
/// mark). Set here, overriding whatever default the server or the URI has. The wait for the
/// majority is bounded by [`MAJORITY_WAIT`] (`wtimeout`): a member lagging behind makes the write
/// answer `WriteConcernFailed` (applied, not yet replicated), which is sent again, instead of
/// holding the operation until `op_timeout`.
pub(crate) fn durable() -> WriteConcern {
    WriteConcern::builder()
        .w(mongodb::options::Acknowledgment::Majority)
        .journal(true)
        .w_timeout(MAJORITY_WAIT)
        .build()
}

/// The longest a write waits for a majority of the replica set to have it (`wtimeout`).
pub(crate) const MAJORITY_WAIT: Duration = Duration::from_secs(5);

/// [`durable`] as a command's `writeConcern` field, for the commands this module writes itself.
pub(crate) fn durable_field() -> Document {
    doc! { "w": "majority", "j": true, "wtimeout": MAJORITY_WAIT.as_millis() as i64 }
}

/// The commands that write: outside a transaction each carries [`durable_field`].
const WRITE_COMMANDS: [&str; 4] = ["insert", "update", "delete", "findAndModify"];

#[derive(Debug, thiserror::Error)]
#[error("cannot reach MongoDB at {uri}: {reason}")]
pub struct ConnectError {
    pub uri: String,
    pub reason: String,
}

/// The database round trips this process sent: by operation (each of the store's operations
/// names itself, `lease urls`, `read known pages`, …), and in all (the connection pool's
/// check-outs: one per command sent, whoever sent it). What the operations do not account for —
/// the further batches of a cursor, and the few commands the driver sends on its own
/// (`killCursors`, `endSessions`, a transaction's commit) — is reported as `getMore`. For
/// `seedlock_db_commands_total`, the logs and the benchmarks.
///
/// (The driver's command monitoring would name every command, but it copies and decodes every
/// command and reply into documents for its events: at 200,000 items a second pass spent a few
/// percent of its CPU and several MiB of peak memory on decoding manifests nobody read there.)
#[derive(Debug, Default)]
pub(crate) struct CommandCounts {
    sent: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// Time from sending to the answer, summed per operation (for `debug` logs).
    took: std::sync::Mutex<std::collections::BTreeMap<&'static str, Duration>>,
    /// Connections checked out of the pool (`None` when this store did not connect itself).
    checkouts: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

/// What [`CommandCounts`] reports round trips its operations did not account for as.
pub(crate) const FURTHER_BATCHES: &str = "getMore";

impl CommandCounts {
    fn add(&self, what: &'static str) {
        let mut counts = self.sent.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(what).or_default() += 1;
    }

    fn took(&self, what: &'static str, took: Duration) {
        let mut times = self.took.lock().unwrap_or_else(|p| p.into_inner());
        *times.entry(what).or_default() += took;
    }

    /// Round trips so far: every command sent, where the pool's check-outs are known.
    pub(crate) fn round_trips(&self) -> Option<u64> {
        self.checkouts
            .as_ref()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Round trips so far, by operation (and [`FURTHER_BATCHES`]).
    pub(crate) fn snapshot(&self) -> std::collections::BTreeMap<String, u64> {
        let mut out: std::collections::BTreeMap<String, u64> = self
            .sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(what, n)| ((*what).to_owned(), *n))
            .collect();
        if let Some(all) = self.round_trips() {
            let named: u64 = out.values().sum();
            out.insert(FURTHER_BATCHES.to_owned(), all.saturating_sub(named));
        }
        out
    }

    /// Milliseconds spent waiting for each operation's answers so far.
    pub(crate) fn waited_ms(&self) -> std::collections::BTreeMap<String, u64> {
        self.took
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(what, d)| ((*what).to_owned(), d.as_millis() as u64))
            .collect()
    }
}

#[derive(Clone, Debug)]
pub struct Store {
    /// Every read that decides (leases, a pass's end, coverage, deletions, lock state) goes to
    /// the primary, whatever the URI's `readPreference` says: a lagging secondary would end a
    /// pass early or mark live records removed.
    db: Database,
    /// The URI's read preference, for the reads where a stale answer is harmless: the status
    /// views' list of bots and `export`.
    views: Database,
    commands: std::sync::Arc<CommandCounts>,
    bots: Collection<Document>,
    /// Every operation is abandoned (as a transient failure) after this: a hung server must not
    /// hang a heartbeat or a shutdown.
    op_timeout: Duration,
    answers: std::sync::Arc<Answers>,
    /// The sessions of this process's commit transactions, as its instance registration names
    /// them (see [`Instances::name_transaction_sessions`]).
    sessions: std::sync::Arc<instances::TransactionSessions>,
    /// Time spent waiting for a pooled connection.
    pool_wait: std::sync::Arc<PoolWait>,
    /// Notified when the primary changes: the driver saw a server become primary, or a write
    /// was refused by a member that is no longer primary.
    primary_changes: std::sync::Arc<PrimaryChanges>,
    /// Whether the driver knows a writable server (false through an election), and how long an
    /// operation waits for one (`mongo.server_selection_timeout`).
    failover: std::sync::Arc<Failover>,
    /// The indexes this process uses, and the drops it put off for an instance of another
    /// version.
    indexes: std::sync::Arc<indexes::IndexSet>,
}

/// An election as the store sees it: while no writable server is known, an operation waits
/// past `op_timeout` for the new primary, up to `window`.
#[derive(Debug)]
struct Failover {
    writable: std::sync::atomic::AtomicBool,
    window: Duration,
    /// The wait for a primary was logged (until one is known again).
    said: std::sync::atomic::AtomicBool,
}

impl Default for Failover {
    fn default() -> Self {
        Failover {
            writable: std::sync::atomic::AtomicBool::new(true),
            window: DEFAULT_SERVER_SELECTION_TIMEOUT,
            said: Default::default(),
        }
    }
}

impl Failover {
    fn writable(&self) -> bool {
        self.writable.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An operation waits past `op_timeout` for a primary: said once until a writable server is
    /// known again.
    fn waiting(&self, what: &'static str) {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.said.swap(true, Relaxed) {
            tracing::warn!(
                what,
                wait = %humantime::format_duration(self.window),
                "database unavailable: no writable primary; operations wait for one (mongo.server_selection_timeout)"
            );
        }
    }

    fn set_writable(&self, writable: bool) {
        self.writable
            .store(writable, std::sync::atomic::Ordering::Relaxed);
        if writable {
            self.answered();
        }
    }

    /// A primary answers (or is known) again: says so once, if the wait for one was said.
    fn answered(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.said.load(Relaxed) && self.said.swap(false, Relaxed) {
            tracing::info!("database reachable again: a writable primary answers");
        }
    }
}

/// The changes of primary a store has seen, and the wake-up of whoever waits for the next.
#[derive(Debug, Default)]
struct PrimaryChanges {
    notify: std::sync::Arc<tokio::sync::Notify>,
    seen: std::sync::atomic::AtomicU64,
}

impl PrimaryChanges {
    fn signal(&self) {
        self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.notify.notify_one();
    }
}

/// Time the driver's check-outs waited for a connection (`seedlock_db_pool_wait_seconds`).
#[derive(Debug, Default)]
struct PoolWait {
    micros: std::sync::atomic::AtomicU64,
    count: std::sync::atomic::AtomicU64,
}

impl PoolWait {
    fn add(&self, waited: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.micros.fetch_add(
            u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
            Relaxed,
        );
        self.count.fetch_add(1, Relaxed);
    }

    fn total(&self) -> (Duration, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            Duration::from_micros(self.micros.load(Relaxed)),
            self.count.load(Relaxed),
        )
    }
}

/// Whether the server answers: operations in flight and when the last answer came. A partition
/// that swallows packets (no reset, no refusal) shows only as silence; the crawl stops
/// fetching when the server has been silent too long ([`Store::unanswered_for`]).
#[derive(Debug)]
struct Answers {
    origin: std::time::Instant,
    in_flight: std::sync::atomic::AtomicUsize,
    /// Milliseconds since `origin`: the last answer, or the start of an operation sent while
    /// none was in flight and the last one had been answered (silence counts from there).
    last_ms: std::sync::atomic::AtomicU64,
    /// The last operation to end went unanswered (timed out, or a network error).
    silent: std::sync::atomic::AtomicBool,
}

impl Default for Answers {
    fn default() -> Self {
        Answers {
            origin: std::time::Instant::now(),
            in_flight: Default::default(),
            last_ms: Default::default(),
            silent: Default::default(),
        }
    }
}

impl Answers {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn sent(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if self.in_flight.fetch_add(1, SeqCst) == 0 && !self.silent.load(SeqCst) {
            self.last_ms.fetch_max(self.now_ms(), SeqCst);
        }
    }

    fn done(&self, answered: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        if answered {
            self.last_ms.fetch_max(self.now_ms(), SeqCst);
        }
        self.silent.store(!answered, SeqCst);
        self.in_flight.fetch_sub(1, SeqCst);
    }

    fn unanswered_for(&self) -> Duration {
        use std::sync::atomic::Ordering::SeqCst;
        if self.in_flight.load(SeqCst) == 0 && !self.silent.load(SeqCst) {
            return Duration::ZERO;
        }
        Duration::from_millis(self.now_ms().saturating_sub(self.last_ms.load(SeqCst)))
    }
}

/// Decrements the in-flight count when an operation ends, or is dropped unfinished.
struct InFlight<'a> {
    answers: &'a Answers,
    answered: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.answers.done(self.answered);
    }
}

/// The default for `mongo.op_timeout`.
pub(crate) const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(10);

/// The default for `mongo.server_selection_timeout` (the driver's own default): longer than a
/// replica set's election.
pub(crate) const DEFAULT_SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// A time as BSON (every date this crate writes goes through here).
pub fn date(at: DateTime<Utc>) -> Bson {
    Bson::DateTime(bson::DateTime::from_chrono(at))
}

/// `at + d`, saturating instead of panicking on absurd durations.
pub(crate) fn plus(at: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The longest an index build at start-up may take.
const INDEX_BUILD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The longest a read of a whole pass or of all a bot's records may take (the count that ends a
/// pass): the test server reads about 150,000 entries a second, so a pass of a million took 7
/// s quiet and over 10 s (the default `op_timeout`) on a busy machine — and a pass whose end
/// count never fits in `op_timeout` would never end.
const SCAN_TIMEOUT: Duration = Duration::from_secs(120);

impl Store {
    /// Connects and checks the server answers within `connect_timeout`. The error never carries
    /// the URI's password.
    pub async fn connect(settings: &MongoSettings) -> std::result::Result<Store, ConnectError> {
        let shown = crate::redact::redact_uri(&settings.uri);
        let fail = |reason: String| ConnectError {
            uri: shown.clone(),
            reason: one_line(&crate::redact::scrub(&reason, &settings.uri)),
        };
        let mut options = ClientOptions::parse(&settings.uri)
            .await
            .map_err(|e| fail(format!("invalid URI: {e}")))?;
        options.app_name = Some("seedlock".into());
        // Round trips are counted from the pool's check-outs: cheap events, no command bodies;
        // the time each check-out waited for a connection is summed beside them.
        let checkouts = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let pool_wait = std::sync::Arc::new(PoolWait::default());
        {
            let (checkouts, pool_wait) = (checkouts.clone(), pool_wait.clone());
            options.cmap_event_handler =
                Some(mongodb::event::EventHandler::callback(move |event| {
                    if let mongodb::event::cmap::CmapEvent::ConnectionCheckedOut(out) = event {
                        checkouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        pool_wait.add(out.duration);
                    }
                }));
        }
        // Sized on purpose (`mongo.max_pool_size`); an operation waiting for a connection is
        // still bounded by `op_timeout`, which covers the wait.
        options.max_pool_size = Some(settings.max_pool_size);
        // A server marked unknown (a primary that stepped down, a dropped connection) is checked
        // again within 2 s, not at the driver's default 10 s: a write sent again within
        // `op_timeout` finds the new primary.
        options.heartbeat_freq = Some(Duration::from_secs(2));
        let primary_changes = std::sync::Arc::new(PrimaryChanges::default());
        let failover = std::sync::Arc::new(Failover {
            window: settings.server_selection_timeout,
            ..Failover::default()
        });
        {
            let (primary_changes, failover) = (primary_changes.clone(), failover.clone());
            // Only another member becoming primary: the first discovery, or the same primary
            // back after a network error, keeps the clock's best sample.
            let last_primary = std::sync::Mutex::new(None::<mongodb::options::ServerAddress>);
            options.sdam_event_handler =
                Some(mongodb::event::EventHandler::callback(move |event| {
                    use mongodb::{event::sdam::SdamEvent, ServerType};
                    if let SdamEvent::TopologyDescriptionChanged(changed) = &event {
                        failover.set_writable(changed.new_description.has_writable_server());
                    }
                    if let SdamEvent::ServerDescriptionChanged(changed) = event {
                        if changed.new_description.server_type() == ServerType::RsPrimary {
                            let mut last = last_primary.lock().unwrap_or_else(|p| p.into_inner());
                            if last.as_ref().is_some_and(|a| *a != changed.address) {
                                primary_changes.signal();
                            }
                            *last = Some(changed.address.clone());
                        }
                    }
                }));
        }
        // An operation meeting an election waits for the new primary (the driver's server
        // selection) instead of failing; connecting at start-up is bounded by `connect_timeout`.
        options.server_selection_timeout = Some(settings.server_selection_timeout);
        options.connect_timeout = Some(settings.connect_timeout);
        let client = Client::with_options(options).map_err(|e| fail(e.to_string()))?;
        let db = client.database(&settings.database);
        let unanswered = || {
            fail(format!(
                "no server answered within {}",
                humantime::format_duration(settings.connect_timeout),
            ))
        };
        let ping = db.run_command(doc! { "ping": 1 }).selection_criteria(
            mongodb::options::SelectionCriteria::Predicate(std::sync::Arc::new(|_| true)),
        );
        match tokio::time::timeout(settings.connect_timeout, ping).await {
            Err(_) => return Err(unanswered()),
            Ok(Err(e)) => {
                return Err(match e.kind.as_ref() {
                    mongodb::error::ErrorKind::ServerSelection { .. } => {
                        fail(format!("{} ({e})", unanswered().reason))
                    }
                    _ => fail(e.to_string()),
                })
            }
            Ok(Ok(_)) => {}
        }
        let mut store = Store::new(db).with_op_timeout(settings.op_timeout);
        store.commands = std::sync::Arc::new(CommandCounts {
            checkouts: Some(checkouts),
            ..CommandCounts::default()
        });
        store.pool_wait = pool_wait;
        store.primary_changes = primary_changes;
        store.failover = failover;
        Ok(store)
    }

    /// How long this store's operations waited for a pooled connection, in all, and how many
    /// check-outs there were (zero for a store made from its caller's database handle).
    pub(crate) fn pool_wait(&self) -> (Duration, u64) {
        self.pool_wait.total()
    }

    /// The round trips this store sent, by operation; with [`FURTHER_BATCHES`] for a store that
    /// connected itself ([`Store::connect`]), which also knows every round trip of its client.
    pub fn command_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.commands.snapshot()
    }

    /// Every round trip this store's client sent (`None` for a store made from a database handle
    /// of its caller's, [`Store::new`]).
    pub fn round_trips(&self) -> Option<u64> {
        self.commands.round_trips()
    }

    /// Milliseconds this store waited for each operation's answers.
    pub(crate) fn command_waits(&self) -> std::collections::BTreeMap<String, u64> {
        self.commands.waited_ms()
    }

    /// A store over `db`. Every write through it is [`durable`]; the bot documents — which the
    /// lock decisions read — are read with read concern `majority`, so no decision rests on a
    /// write that a failover could roll back.
    pub fn new(db: Database) -> Store {
        let views = db.client().database_with_options(
            db.name(),
            DatabaseOptions::builder().write_concern(durable()).build(),
        );
        let db = db.client().database_with_options(
            db.name(),
            DatabaseOptions::builder()
                .write_concern(durable())
                .selection_criteria(primary())
                .build(),
        );
        let bots = db.collection_with_options::<Document>(
            BOTS,
            CollectionOptions::builder()
                .read_concern(ReadConcern::majority())
                .build(),
        );
        Store {
            db,
            views,
            bots,
            commands: Default::default(),
            op_timeout: DEFAULT_OP_TIMEOUT,
            answers: Default::default(),
            sessions: Default::default(),
            pool_wait: Default::default(),
            primary_changes: Default::default(),
            failover: Default::default(),
            indexes: Default::default(),
        }
    }

    pub(crate) fn index_set(&self) -> &indexes::IndexSet {
        &self.indexes
    }

    /// Does the index drops put off for a live instance of another version, once it has
    /// stopped (see [`indexes`]); the instance heartbeat calls this while any wait.
    pub(crate) async fn finish_index_changes(&self) -> Result<()> {
        if self.indexes.has_deferred() {
            indexes::finish_deferred(self).await?;
        }
        Ok(())
    }

    /// Notified when the primary changes (see the field): the server clock is re-sampled then,
    /// not only on its timer.
    pub fn primary_changes(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.primary_changes.notify.clone()
    }

    /// How many changes of primary this store has seen (a server becoming primary, a write
    /// refused by a member that is no longer primary).
    pub fn primary_changes_seen(&self) -> u64 {
        self.primary_changes
            .seen
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long an operation waits for a writable primary through an election
    /// (`mongo.server_selection_timeout`).
    pub(crate) fn failover_window(&self) -> Duration {
        self.failover.window
    }

    pub fn with_op_timeout(mut self, op_timeout: Duration) -> Store {
        self.op_timeout = op_timeout;
        self
    }

    /// The `bots` collection.
    pub fn bots(&self) -> Bots<'_> {
        Bots { store: self }
    }

    /// The `frontier` collection.
    pub fn frontier(&self) -> Frontier<'_> {
        Frontier { store: self }
    }

    /// The `records` collection.
    pub fn records(&self) -> Records<'_> {
        Records { store: self }
    }

    /// A bot's passes: their start, progress, end and evaluation (in its `bots` document and
    /// its frontier).
    pub fn passes(&self) -> Passes<'_> {
        Passes { store: self }
    }

    /// Deletion detection at a pass's end, from the listing manifests.
    pub fn deletions(&self) -> Deletions<'_> {
        Deletions { store: self }
    }

    /// The change feed (`changes`), staged and released at passes' ends.
    pub fn changes(&self) -> changes::Changes<'_> {
        changes::Changes { store: self }
    }

    /// The `instances` collection.
    pub fn instances(&self) -> Instances<'_> {
        Instances { store: self }
    }

    /// The `hosts` collection.
    pub fn hosts(&self) -> Hosts<'_> {
        Hosts { store: self }
    }

    /// Deletes the bot's frontier and records; returns how many of each.
    pub(crate) async fn purge_bot(&self, bot: &BotId) -> Result<(u64, u64)> {
        let frontier = self
            .bounded(
                "purge frontier",
                self.frontier()
                    .collection()
                    .delete_many(doc! { frontier::field::BOT: bot.as_str() }),
            )
            .await?
            .deleted_count;
        let records = self
            .bounded(
                "purge records",
                self.records()
                    .collection()
                    .delete_many(doc! { records::field::BOT: bot.as_str() }),
            )
            .await?
            .deleted_count;
        Ok((frontier, records))
    }

    /// Runs one driver operation under the store's operation timeout.
    async fn bounded<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.bounded_for(what, self.op_timeout, op).await
    }

    /// As [`Store::bounded`], within `limit`.
    async fn bounded_for<T, F>(&self, what: &'static str, limit: Duration, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.commands.add(what);
        let sent = std::time::Instant::now();
        let result = self.unaccounted_for(what, limit, op, true).await;
        self.commands.took(what, sent.elapsed());
        tracing::trace!(what, took = ?sent.elapsed(), "database command");
        result
    }

    /// As [`Store::bounded`], for a read of a whole pass or of all a bot's records: within
    /// [`SCAN_TIMEOUT`] (or `op_timeout`, if longer).
    pub(crate) async fn bounded_scan<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.bounded_for(what, SCAN_TIMEOUT.max(self.op_timeout), op)
            .await
    }

    /// As [`Store::bounded`] for a status view's read: within `op_timeout` even while no primary
    /// is known (a view says the database cannot be read rather than wait out an election).
    async fn bounded_view<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.commands.add(what);
        let sent = std::time::Instant::now();
        let result = self.unaccounted_for(what, self.op_timeout, op, false).await;
        self.commands.took(what, sent.elapsed());
        result
    }

    /// As [`Store::bounded`], for a driver operation `make` builds afresh for each attempt: one
    /// refused by a member that is no longer primary, or lost with its connection, is sent again
    /// (with backoff) until a primary takes it, within `op_timeout` of the first attempt —
    /// `mongo.server_selection_timeout` through an election. Only for writes that are fenced or
    /// conditional (a second attempt matches nothing or the same thing); the flag says whether
    /// an earlier attempt may have been applied although its answer was lost, for the caller to
    /// read the outcome back where "matched nothing" would not tell.
    pub(crate) async fn resend<T, F, M>(&self, what: &'static str, mut make: M) -> Result<(T, bool)>
    where
        M: FnMut() -> F,
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.retrying(what, self.op_timeout, |left| {
            self.bounded_for(what, left, make())
        })
        .await
    }

    /// Runs `attempt` (given the time left) until it succeeds or fails for good: a failure that
    /// may pass on another attempt ([`retryable`]) is tried again with backoff within `limit` of
    /// the first attempt — `mongo.server_selection_timeout` once one says the primary is
    /// changing. The flag says whether a failed attempt may have been applied.
    async fn retrying<T, Fut>(
        &self,
        what: &'static str,
        limit: Duration,
        mut attempt: impl FnMut(Duration) -> Fut,
    ) -> Result<(T, bool)>
    where
        Fut: std::future::Future<Output = Result<T>>,
    {
        let started = std::time::Instant::now();
        let mut deadline = started + limit;
        let mut maybe_applied = false;
        let mut attempts: u32 = 0;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match attempt(left).await {
                Ok(value) => return Ok((value, maybe_applied)),
                Err(e) if retryable(&e) => {
                    if not_primary(&e) {
                        self.primary_changes.signal();
                    }
                    // An election: sent again until a new primary takes it, within
                    // `mongo.server_selection_timeout` of the first attempt.
                    if e.is_failover() {
                        self.failover.waiting(what);
                        deadline = deadline.max(started + self.failover.window);
                    }
                    maybe_applied |= may_have_applied(&e);
                    attempts += 1;
                    let pause = crate::backoff::full_jitter(
                        Duration::from_millis(50),
                        Duration::from_secs(1),
                        attempts,
                    );
                    if std::time::Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::debug!(what, error = %e, attempt = attempts, "a write was not taken; sending it again");
                    tokio::time::sleep(pause).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// As [`Store::bounded`], for a step that is no operation of its own (a cursor's next
    /// document: its further batches count as [`FURTHER_BATCHES`]).
    async fn unaccounted<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.unaccounted_for(what, self.op_timeout, op, true).await
    }

    /// Runs `op` within `limit`; with `wait_for_primary`, past it while no writable server is
    /// known (an election), up to `mongo.server_selection_timeout`.
    async fn unaccounted_for<T, F>(
        &self,
        what: &'static str,
        limit: Duration,
        op: F,
        wait_for_primary: bool,
    ) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.answers.sent();
        let mut flight = InFlight {
            answers: &self.answers,
            answered: false,
        };
        let started = tokio::time::Instant::now();
        let op = op.into_future();
        tokio::pin!(op);
        let mut until = started + limit;
        let outcome = loop {
            match tokio::time::timeout_at(until, &mut op).await {
                // Through an election the driver waits in server selection for the new primary
                // (up to `mongo.server_selection_timeout`): so does the operation.
                Err(_)
                    if wait_for_primary
                        && !self.failover.writable()
                        && until < started + self.failover.window =>
                {
                    self.failover.waiting(what);
                    until = started + self.failover.window;
                }
                other => break other,
            }
        };
        match outcome {
            Ok(result) => {
                if result.is_ok() {
                    self.failover.answered();
                }
                // An error from the server is an answer too; one from the network is not.
                flight.answered = match &result {
                    Ok(_) => true,
                    Err(e) => !matches!(
                        e.kind.as_ref(),
                        mongodb::error::ErrorKind::Io(_)
                            | mongodb::error::ErrorKind::ServerSelection { .. }
                            | mongodb::error::ErrorKind::ConnectionPoolCleared { .. }
                            | mongodb::error::ErrorKind::DnsResolve { .. }
                    ),
                };
                Ok(result?)
            }
            Err(_) => Err(Error::Timeout {
                what,
                after: started.elapsed(),
            }),
        }
    }

    /// Reads what `find` finds as a stream, each cursor batch under the operation timeout, and
    /// hands every document to `visit`: memory stays one batch, however many documents match.
    pub(crate) async fn each_doc<F, V>(
        &self,
        what: &'static str,
        find: F,
        mut visit: V,
    ) -> Result<()>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<mongodb::Cursor<Document>>>,
        V: FnMut(Document) -> Result<()>,
    {
        use futures_util::TryStreamExt;
        let mut cursor = self.bounded(what, find).await?;
        while let Some(doc) = self.unaccounted(what, cursor.try_next()).await? {
            visit(doc)?;
        }
        Ok(())
    }

    /// As [`Store::each_doc`], on raw documents: each is handed to `visit` as it lies in the
    /// cursor's batch, nothing decoded that `visit` does not read.
    pub(crate) async fn each_raw<F, V>(&self, what: &'static str, find: F, visit: V) -> Result<()>
    where
        F: std::future::IntoFuture<
            Output = mongodb::error::Result<mongodb::Cursor<bson::RawDocumentBuf>>,
        >,
        V: FnMut(&bson::RawDocument) -> Result<()>,
    {
        let cursor = self.bounded(what, find).await?;
        self.drain_raw(what, cursor, visit).await
    }

    /// Visits what is left of `cursor`, document by document (its further batches each a
    /// round trip counted as such), without holding more than one batch.
    pub(crate) async fn drain_raw<V>(
        &self,
        what: &'static str,
        mut cursor: mongodb::Cursor<bson::RawDocumentBuf>,
        mut visit: V,
    ) -> Result<()>
    where
        V: FnMut(&bson::RawDocument) -> Result<()>,
    {
        while self.unaccounted(what, cursor.advance()).await? {
            visit(cursor.current())?;
        }
        Ok(())
    }

    /// Runs one database command — the store's own writes and reads, sent with `run_command` —
    /// under the operation timeout, inside `session` when there is one (a transaction). Its
    /// reply is checked as the driver checks its own writes': a `writeConcernError` in an
    /// `ok: 1` reply is an error ([`Error::WriteConcern`]), not a success. Outside a transaction
    /// a failure that may pass on another attempt ([`retryable`]: the `RetryableWriteError`
    /// label, a primary stepping down or shutting down, a network error, a majority wait that
    /// ran out after the write was applied) is sent again, with
    /// backoff, until it succeeds or `op_timeout` — counted from the first attempt — runs out.
    /// That is safe because every statement the store writes is fenced or conditional, so an
    /// attempt that was applied before its answer was lost makes the next one match nothing or
    /// the same thing (the module's "Sending a write again": why, for each kind); inside a transaction
    /// the whole transaction is retried instead.
    pub(crate) async fn command(
        &self,
        what: &'static str,
        command: Document,
        session: Option<&mut mongodb::ClientSession>,
    ) -> Result<Document> {
        self.command_within(what, command, session, self.op_timeout)
            .await
    }

    /// As [`Store::command`], with `limit` in place of `op_timeout` (never longer).
    pub(crate) async fn command_within(
        &self,
        what: &'static str,
        mut command: Document,
        session: Option<&mut mongodb::ClientSession>,
        limit: Duration,
    ) -> Result<Document> {
        let limit = limit.min(self.op_timeout);
        // Inside a transaction the commit carries the write concern, and no statement may.
        let writes = command
            .keys()
            .next()
            .is_some_and(|name| WRITE_COMMANDS.contains(&name.as_str()));
        if writes && session.is_none() && !command.contains_key("writeConcern") {
            command.insert("writeConcern", durable_field());
        }
        if let Some(session) = session {
            let reply = self
                .bounded_for(what, limit, self.db.run_command(command).session(session))
                .await?;
            return reply::checked(what, reply);
        }
        // Encoded once: each attempt sends a copy of the bytes (a settle command carries the
        // manifests of its listing pages, a deep clone of which cost more than its bytes).
        let command =
            bson::RawDocumentBuf::from_document(&command).map_err(|e| Error::Protocol {
                what,
                detail: format!("the command does not encode: {e}"),
            })?;
        let (reply, _) = self
            .retrying(what, limit, |left| {
                let send = self.bounded_for(what, left, self.db.run_raw_command(command.clone()));
                async move { send.await.and_then(|reply| reply::checked(what, reply)) }
            })
            .await?;
        Ok(reply)
    }

    /// A `find` sent with `run_command` that returns every document it matches in its one
    /// reply: `singleBatch` (the server closes the cursor after it) and a batch of one more than
    /// `at_most` (a batch the answer fills exactly leaves the cursor open on the test server).
    /// No cursor is left open on the server.
    pub(crate) async fn find_once(
        &self,
        what: &'static str,
        collection: &str,
        filter: Document,
        projection: Document,
        at_most: usize,
        session: Option<&mut mongodb::ClientSession>,
    ) -> Result<Vec<Document>> {
        let find = doc! {
            "find": collection,
            "filter": filter,
            "projection": projection,
            "batchSize": i64::try_from(at_most.saturating_add(1)).unwrap_or(i64::MAX),
            "singleBatch": true,
        };
        let reply = self.command(what, find, session).await?;
        Ok(reply
            .get_document("cursor")
            .and_then(|c| c.get_array("firstBatch"))
            .map(|a| a.iter().filter_map(|d| d.as_document().cloned()).collect())
            .unwrap_or_default())
    }

    /// As `bounded`, for an index build: it reads the whole collection, which on a large one
    /// (an upgrade adding an index to a frontier of millions) takes far longer than an operation.
    pub(crate) async fn index_build<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        let limit = INDEX_BUILD_TIMEOUT.max(self.op_timeout);
        self.commands.add(what);
        match tokio::time::timeout(limit, op.into_future()).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(Error::Timeout { what, after: limit }),
        }
    }

    /// Ends the client cleanly: waits (bounded) for operations in flight, then closes the pools,
    /// so no driver task is still running when the runtime stops.
    pub(crate) async fn shutdown(&self) {
        let client = self.db.client().clone();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
    }

    pub(crate) fn database(&self) -> &Database {
        &self.db
    }

    /// How long the server has left this store unanswered: zero while nothing is in flight and
    /// the last operation was answered, else the time since the last answer (or since the
    /// first operation sent after an answered quiet spell).
    pub(crate) fn unanswered_for(&self) -> Duration {
        self.answers.unanswered_for()
    }

    /// One `hello` round trip, recorded into `clock` (server time with round-trip correction).
    pub async fn sync_clock(&self, clock: &ServerClock) -> Result<()> {
        let sent = std::time::Instant::now();
        let reply = self
            .bounded("hello", self.db.run_command(doc! { "hello": 1 }))
            .await?;
        let received = std::time::Instant::now();
        let server = match reply.get("localTime") {
            Some(Bson::DateTime(d)) => d.to_chrono(),
            other => {
                return Err(Error::Protocol {
                    what: "hello",
                    detail: format!("localTime is {other:?}, expected a date"),
                })
            }
        };
        clock.record(sent, server, received);
        Ok(())
    }
}

/// Whether a failed command may be sent again as it is: the server labelled it retryable, the
/// primary stepped down or is shutting down (or this node is not the primary), the network
/// dropped it, or its write concern failed for one of those reasons.
pub(crate) fn retryable(e: &Error) -> bool {
    const CODES: &[i32] = &[
        6,     // HostUnreachable
        7,     // HostNotFound
        89,    // NetworkTimeout
        91,    // ShutdownInProgress
        189,   // PrimarySteppedDown
        9001,  // SocketException
        10107, // NotWritablePrimary
        11600, // InterruptedAtShutdown
        11602, // InterruptedDueToReplStateChange
        13435, // NotPrimaryNoSecondaryOk
        13436, // NotPrimaryOrSecondary
    ];
    match e {
        Error::Db(e) => {
            e.contains_label("RetryableWriteError")
                || match e.kind.as_ref() {
                    mongodb::error::ErrorKind::Io(_)
                    | mongodb::error::ErrorKind::ConnectionPoolCleared { .. } => true,
                    mongodb::error::ErrorKind::Command(c) => CODES.contains(&c.code),
                    mongodb::error::ErrorKind::Write(
                        mongodb::error::WriteFailure::WriteConcernError(w),
                    ) => CODES.contains(&w.code) || matches!(w.code, 50 | 64),
                    _ => false,
                }
        }
        // The write was applied on the primary and its majority wait ran out: its `wtimeout`
        // (`WriteConcernFailed`), or the `maxTimeMS` that also bounds the wait on MongoDB
        // (`MaxTimeMSExpired`). Every statement the store writes is fenced or conditional, so
        // the second attempt matches nothing or the same thing, and waits for the majority again.
        Error::WriteConcern { code, labels, .. } => {
            CODES.contains(code)
                || matches!(code, 50 | 64)
                || labels.iter().any(|l| l == "RetryableWriteError")
        }
        _ => false,
    }
}

/// Whether a write that failed with `e` may nevertheless have been applied: its connection
/// closed before the answer came, or the server applied it and its write concern failed.
fn may_have_applied(e: &Error) -> bool {
    match e {
        Error::Db(e) => matches!(
            e.kind.as_ref(),
            mongodb::error::ErrorKind::Io(_)
                | mongodb::error::ErrorKind::ConnectionPoolCleared { .. }
                | mongodb::error::ErrorKind::Write(
                    mongodb::error::WriteFailure::WriteConcernError(_)
                )
        ),
        Error::WriteConcern { .. } | Error::Timeout { .. } => true,
        _ => false,
    }
}

/// Whether `e` says the member that answered is not (or no longer) the primary.
fn not_primary(e: &Error) -> bool {
    const CODES: &[i32] = &[
        189,   // PrimarySteppedDown
        10107, // NotWritablePrimary
        11602, // InterruptedDueToReplStateChange
        13435, // NotPrimaryNoSecondaryOk
        13436, // NotPrimaryOrSecondary
    ];
    match e {
        Error::Db(e) => {
            matches!(e.kind.as_ref(), mongodb::error::ErrorKind::Command(c) if CODES.contains(&c.code))
        }
        Error::WriteConcern { code, .. } => CODES.contains(code),
        _ => false,
    }
}

pub(crate) fn one_line(text: &str) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() > 400 {
        format!("{}…", line.chars().take(400).collect::<String>())
    } else {
        line
    }
}
