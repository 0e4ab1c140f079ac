//! The only module that talks to MongoDB. Every write that depends on a lock is conditional:
//! claims filter on the observed `lockEpoch` (and the expiry condition), holder writes filter on
//! the [`EditLock`]'s fence `{_id, isEditing: true, editingBy: me, lockEpoch: mine}`, and repairs
//! filter on exactly what was read. No write here is unconditional except the admin's `unlock`,
//! which bumps the epoch so the old holder's writes fail.
//!
//! The database's vocabulary lives here too, below every wing that reads it: the bot document
//! ([`document`]: its field names, the strict parse, `BotState`, `Claim`).

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use mongodb::options::{
    ClientOptions, CollectionOptions, DatabaseOptions, ReadConcern, ReturnDocument, WriteConcern,
};
use mongodb::{Client, Collection, Database};

use crate::clock::ServerClock;
use crate::config::MongoSettings;
use crate::error::{is_duplicate_key, Error, Result};
use crate::ids::{BotId, InstanceId, LockEpoch};
use crate::store::document::{field, integer, BotDoc, Claim, Observed, HISTORY_LEN};

pub mod deletions;
pub mod document;
pub mod frontier;
pub mod hosts;
pub mod indexes;
pub mod instances;
pub mod passes;
pub mod records;
pub mod reply;
pub mod specs;
pub mod startup;

pub const BOTS: &str = "bots";

/// The write concern of every write: acknowledged by a majority of the replica set's voting
/// members and written to their journals, so a primary's failover cannot roll it back (a claim
/// rolled back would leave a bot with two holders; a done mark rolled back, a record without its
/// mark). Set here, overriding whatever default the server or the URI has.
pub fn durable() -> WriteConcern {
    WriteConcern::builder()
        .w(mongodb::options::Acknowledgment::Majority)
        .journal(true)
        .build()
}

/// [`durable`] as a command's `writeConcern` field, for the commands this module writes itself.
pub(crate) fn durable_field() -> Document {
    doc! { "w": "majority", "j": true }
}

/// The commands that write: outside a transaction each carries [`durable_field`].
const WRITE_COMMANDS: [&str; 4] = ["insert", "update", "delete", "findAndModify"];

/// A lock this process holds: the fence for every write it makes while refreshing.
#[derive(Clone, Debug)]
pub struct EditLock {
    pub bot: BotId,
    pub me: InstanceId,
    pub epoch: LockEpoch,
    /// `lastUpdateStartedAt` as the server set it: `max_refresh` counts from here.
    pub started_at: DateTime<Utc>,
    /// The seeds before this refresh (kept on failure with `keep_previous`).
    pub previous_seeds: Vec<String>,
    /// Consecutive failed refreshes before this one (sizes the shared backoff on failure).
    pub failed_refreshes: i64,
    /// The bot's crawl pass when the lock was taken: a successful refresh starts the next one.
    pub crawl_pass: i64,
    /// When that pass started, if it was still running (its end not recorded).
    pub crawl_pass_running_since: Option<DateTime<Utc>>,
}

impl EditLock {
    fn fence(&self) -> Document {
        doc! {
            field::ID: self.bot.as_str(),
            field::IS_EDITING: true,
            field::EDITING_BY: self.me.as_str(),
            field::LOCK_EPOCH: self.epoch.get(),
        }
    }
}

/// What a successful refresh does to a crawling bot's passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextPass {
    /// Not a crawling bot.
    None,
    /// Start this pass now (its seeds are enqueued).
    Start(i64),
    /// The current pass runs: the next starts when it ends, on the seeds stored now.
    AfterCurrent,
}

/// What `seedlock unlock` found.
#[derive(Debug, PartialEq)]
pub enum UnlockOutcome {
    Unlocked {
        holder: Option<String>,
        old_epoch: Option<i64>,
    },
    NotLocked,
    NoSuchBot,
}

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
pub struct CommandCounts {
    sent: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// Time from sending to the answer, summed per operation (for `debug` logs).
    took: std::sync::Mutex<std::collections::BTreeMap<&'static str, Duration>>,
    /// Connections checked out of the pool (`None` when this store did not connect itself).
    checkouts: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

/// What [`CommandCounts`] reports round trips its operations did not account for as.
pub const FURTHER_BATCHES: &str = "getMore";

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
    pub fn round_trips(&self) -> Option<u64> {
        self.checkouts
            .as_ref()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Round trips so far, by operation (and [`FURTHER_BATCHES`]).
    pub fn snapshot(&self) -> std::collections::BTreeMap<String, u64> {
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
    pub fn waited_ms(&self) -> std::collections::BTreeMap<String, u64> {
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
    db: Database,
    commands: std::sync::Arc<CommandCounts>,
    bots: Collection<Document>,
    /// Every operation is abandoned (as a transient failure) after this: a hung server must not
    /// hang a heartbeat or a shutdown.
    op_timeout: Duration,
    answers: std::sync::Arc<Answers>,
    /// The sessions of this process's commit transactions, as its instance registration names
    /// them (see [`Store::name_transaction_sessions`]).
    sessions: std::sync::Arc<instances::TransactionSessions>,
    /// Time spent waiting for a pooled connection.
    pool_wait: std::sync::Arc<PoolWait>,
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
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(10);

/// A new bot document's fields (its lock free, not ready, no seeds), created by `by` for `why`.
fn initial_fields(now: DateTime<Utc>, by: &str, why: &str) -> Document {
    doc! {
        field::IS_READY: false,
        field::IS_EDITING: false,
        field::SEEDS: [],
        field::LAST_UPDATE_STARTED_AT: Bson::Null,
        field::LAST_SEED_UPDATED_AT: Bson::Null,
        field::EDITING_BY: Bson::Null,
        field::LOCK_EPOCH: 0_i64,
        field::HEARTBEAT_AT: Bson::Null,
        field::LOCK_EXPIRES_AT: Bson::Null,
        field::LAST_ERROR: Bson::Null,
        field::FAILED_REFRESHES: 0_i32,
        field::REFRESH_REQUESTED_AT: Bson::Null,
        field::RETRY_AFTER: Bson::Null,
        field::HISTORY: [history_entry(now, "created", by, LockEpoch::ZERO, why)],
    }
}

fn history_entry(
    now: DateTime<Utc>,
    event: &str,
    by: &str,
    epoch: LockEpoch,
    reason: &str,
) -> Document {
    doc! {
        "at": bson::DateTime::from_chrono(now),
        "event": event,
        "by": by,
        "epoch": epoch.get(),
        "reason": reason,
    }
}

fn push_history(entry: Document) -> Document {
    doc! { field::HISTORY: { "$each": [entry], "$slice": -HISTORY_LEN } }
}

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
        options.server_selection_timeout = Some(settings.connect_timeout);
        options.connect_timeout = Some(settings.connect_timeout);
        let client = Client::with_options(options).map_err(|e| fail(e.to_string()))?;
        let db = client.database(&settings.database);
        db.run_command(doc! { "ping": 1 })
            .await
            .map_err(|e| match e.kind.as_ref() {
                mongodb::error::ErrorKind::ServerSelection { .. } => fail(format!(
                    "no server answered within {} ({})",
                    humantime::format_duration(settings.connect_timeout),
                    e
                )),
                _ => fail(e.to_string()),
            })?;
        let mut store = Store::new(db).with_op_timeout(settings.op_timeout);
        store.commands = std::sync::Arc::new(CommandCounts {
            checkouts: Some(checkouts),
            ..CommandCounts::default()
        });
        store.pool_wait = pool_wait;
        Ok(store)
    }

    /// How long this store's operations waited for a pooled connection, in all, and how many
    /// check-outs there were (zero for a store made from its caller's database handle).
    pub fn pool_wait(&self) -> (Duration, u64) {
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
    pub fn command_waits(&self) -> std::collections::BTreeMap<String, u64> {
        self.commands.waited_ms()
    }

    /// A store over `db`. Every write through it is [`durable`]; the bot documents — which the
    /// lock decisions read — are read with read concern `majority`, so no decision rests on a
    /// write that a failover could roll back.
    pub fn new(db: Database) -> Store {
        let db = db.client().database_with_options(
            db.name(),
            DatabaseOptions::builder().write_concern(durable()).build(),
        );
        let bots = db.collection_with_options::<Document>(
            BOTS,
            CollectionOptions::builder()
                .read_concern(ReadConcern::majority())
                .build(),
        );
        Store {
            db,
            bots,
            commands: Default::default(),
            op_timeout: DEFAULT_OP_TIMEOUT,
            answers: Default::default(),
            sessions: Default::default(),
            pool_wait: Default::default(),
        }
    }

    pub fn with_op_timeout(mut self, op_timeout: Duration) -> Store {
        self.op_timeout = op_timeout;
        self
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
        let result = self.unaccounted_for(what, limit, op).await;
        self.commands.took(what, sent.elapsed());
        result
    }

    /// As [`Store::bounded`], for a step that is no operation of its own (a cursor's next
    /// document: its further batches count as [`FURTHER_BATCHES`]).
    async fn unaccounted<T, F>(&self, what: &'static str, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.unaccounted_for(what, self.op_timeout, op).await
    }

    async fn unaccounted_for<T, F>(&self, what: &'static str, limit: Duration, op: F) -> Result<T>
    where
        F: std::future::IntoFuture<Output = mongodb::error::Result<T>>,
    {
        self.answers.sent();
        let mut flight = InFlight {
            answers: &self.answers,
            answered: false,
        };
        match tokio::time::timeout(limit, op.into_future()).await {
            Ok(result) => {
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
                after: self.op_timeout,
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
    pub(crate) async fn each_raw<F, V>(
        &self,
        what: &'static str,
        find: F,
        mut visit: V,
    ) -> Result<()>
    where
        F: std::future::IntoFuture<
            Output = mongodb::error::Result<mongodb::Cursor<bson::RawDocumentBuf>>,
        >,
        V: FnMut(&bson::RawDocument) -> Result<()>,
    {
        let mut cursor = self.bounded(what, find).await?;
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
    /// label, a primary stepping down or shutting down, a network error) is sent again, with
    /// backoff, until it succeeds or `op_timeout` — counted from the first attempt — runs out.
    /// That is safe because every statement the store writes is fenced or conditional, so an
    /// attempt that was applied before its answer was lost makes the next one match nothing or
    /// the same thing (ARCHITECTURE.md, "Durability": why, for each kind); inside a transaction
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
        let deadline = std::time::Instant::now() + limit;
        let mut attempt: u32 = 0;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let result = self
                .bounded_for(what, left, self.db.run_command(command.clone()))
                .await
                .and_then(|reply| reply::checked(what, reply));
            match result {
                Err(e) if retryable(&e) => {
                    attempt += 1;
                    let pause = crate::backoff::full_jitter(
                        Duration::from_millis(50),
                        Duration::from_secs(1),
                        attempt,
                    );
                    if std::time::Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::debug!(what, error = %e, attempt, "a write was not acknowledged; sending it again");
                    tokio::time::sleep(pause).await;
                }
                other => return other,
            }
        }
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
    pub async fn shutdown(&self) {
        let client = self.db.client().clone();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    /// How long the server has left this store unanswered: zero while nothing is in flight and
    /// the last operation was answered, else the time since the last answer (or since the
    /// first operation sent after an answered quiet spell).
    pub fn unanswered_for(&self) -> Duration {
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

    pub async fn load(&self, bot: &BotId) -> Result<Observed> {
        Ok(Observed::from_raw(self.load_raw(bot).await?))
    }

    pub async fn load_raw(&self, bot: &BotId) -> Result<Option<Document>> {
        self.bounded(
            "find bot",
            self.bots.find_one(doc! { field::ID: bot.as_str() }),
        )
        .await
    }

    /// The bots' state index (idempotent; rebuilt if its definition changed): an operator's
    /// reads of bots by state — ready, locked, failing, stuck (the README's mongosh recipes) —
    /// select on `isEditing` and `isReady`.
    pub async fn ensure_bot_indexes(&self) -> Result<()> {
        let state = indexes::Wanted::new(
            "editing_ready",
            doc! { field::IS_EDITING: 1, field::IS_READY: 1 },
        );
        self.ensure_indexes(BOTS, &[state], &[]).await
    }

    /// Whether the bot is paused (`paused: true`), read alone — not its seeds and history;
    /// `None` when it has no document.
    pub async fn paused(&self, bot: &BotId) -> Result<Option<bool>> {
        let found = self
            .bounded(
                "find bot pause",
                self.bots
                    .find_one(doc! { field::ID: bot.as_str() })
                    .projection(doc! { field::PAUSED: 1 }),
            )
            .await?;
        Ok(found.map(|d| matches!(d.get(field::PAUSED), Some(Bson::Boolean(true)))))
    }

    /// Every bot document without its history and the spec its pass recorded, sorted by id (for
    /// `status` and `bots list`: at a thousand bots the histories alone are megabytes).
    pub async fn load_all(&self) -> Result<Vec<Document>> {
        use futures_util::TryStreamExt;
        let all = async {
            let cursor = self
                .bots
                .find(doc! {})
                .projection(doc! { field::HISTORY: 0, field::CRAWL_PASS_SPEC: 0 })
                .sort(doc! { field::ID: 1 })
                .await?;
            cursor.try_collect().await
        };
        self.bounded("list bots", all).await
    }

    /// Creates the initial document if there is none. Idempotent: concurrent callers all succeed
    /// and exactly one document exists afterwards.
    pub async fn initialize(&self, bot: &BotId, me: &InstanceId, now: DateTime<Utc>) -> Result<()> {
        let initial = initial_fields(now, me.as_str(), "C: no document yet");
        let upsert = self
            .bots
            .update_one(
                doc! { field::ID: bot.as_str() },
                doc! { "$setOnInsert": initial },
            )
            .upsert(true);
        match self.bounded("initialize", upsert).await {
            Ok(_) => Ok(()),
            // Another instance inserted it between our filter and our insert: the goal is met.
            Err(Error::Db(e)) if is_duplicate_key(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Claims the edit lock in ONE `find_one_and_update`: `isEditing=true` and `isReady=false`
    /// together, the epoch incremented, start and heartbeat stamped by the server. The filter holds
    /// the observed epoch and the claim's condition, so at most one claimant per epoch wins.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim(
        &self,
        bot: &BotId,
        me: &InstanceId,
        expected: LockEpoch,
        claim: Claim,
        now: DateTime<Utc>,
        ttl: Duration,
        reason: &str,
    ) -> Result<Option<EditLock>> {
        let mut filter = doc! { field::ID: bot.as_str(), field::LOCK_EPOCH: expected.get() };
        match claim {
            Claim::Free => {
                filter.insert(field::IS_EDITING, false);
            }
            Claim::Expired { now: cutoff } => {
                filter.insert(field::IS_EDITING, true);
                filter.insert(field::LOCK_EXPIRES_AT, doc! { "$lte": date(cutoff) });
            }
            Claim::Stuck { started_before } => {
                filter.insert(field::IS_EDITING, true);
                filter.insert(
                    field::LAST_UPDATE_STARTED_AT,
                    doc! { "$lte": date(started_before) },
                );
            }
            Claim::Orphaned => {
                filter.insert(field::IS_EDITING, true);
                filter.insert(field::EDITING_BY, me.as_str());
            }
        }
        let epoch = expected.next().ok_or_else(|| Error::EpochExhausted {
            bot: bot.to_string(),
        })?;
        let event = if claim.is_takeover() {
            "took_over"
        } else {
            "acquired"
        };
        let update = doc! {
            "$set": {
                field::IS_EDITING: true,
                field::IS_READY: false,
                field::EDITING_BY: me.as_str(),
                field::LOCK_EXPIRES_AT: date(plus(now, ttl)),
            },
            "$inc": { field::LOCK_EPOCH: 1_i64 },
            "$currentDate": { field::LAST_UPDATE_STARTED_AT: true, field::HEARTBEAT_AT: true },
            "$push": push_history(history_entry(now, event, me.as_str(), epoch, reason)),
        };
        let after = self
            .bounded(
                "claim",
                self.bots
                    .find_one_and_update(filter, update)
                    .return_document(ReturnDocument::After),
            )
            .await?;
        let Some(raw) = after else { return Ok(None) };
        let doc = BotDoc::parse(&raw).map_err(|problems| Error::Protocol {
            what: "claim",
            detail: problems.join("; "),
        })?;
        if doc.lock_epoch != epoch || doc.editing_by.as_deref() != Some(me.as_str()) {
            return Err(Error::Protocol {
                what: "claim",
                detail: format!(
                    "expected epoch {epoch} held by {me}, read {} by {:?}",
                    doc.lock_epoch, doc.editing_by
                ),
            });
        }
        Ok(Some(EditLock {
            bot: bot.clone(),
            me: me.clone(),
            epoch,
            started_at: doc.last_update_started_at.unwrap_or(now),
            previous_seeds: doc.seeds,
            failed_refreshes: doc.failed_refreshes,
            crawl_pass: doc.crawl_pass,
            crawl_pass_running_since: doc
                .crawl_pass_started_at
                .filter(|_| doc.crawl_pass > 0 && doc.crawl_pass_ended_at.is_none()),
        }))
    }

    async fn fenced(&self, held: &EditLock, update: Document) -> Result<()> {
        let result = self
            .bounded("fenced write", self.bots.update_one(held.fence(), update))
            .await?;
        if result.matched_count == 1 {
            Ok(())
        } else {
            Err(Error::EditLockLost {
                bot: held.bot.clone(),
                epoch: held.epoch,
            })
        }
    }

    /// Renews the edit lock until `now + ttl`. `EditLockLost` if it is no longer ours.
    pub async fn heartbeat(
        &self,
        held: &EditLock,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<DateTime<Utc>> {
        let expires = plus(now, ttl);
        self.fenced(
            held,
            doc! {
                "$set": { field::LOCK_EXPIRES_AT: date(expires) },
                "$currentDate": { field::HEARTBEAT_AT: true },
            },
        )
        .await?;
        Ok(expires)
    }

    /// Renews every lock in `held` until `now + ttl` in one round trip: one statement per lock,
    /// each fenced on its own lock. Returns the new expiry and, per lock, whether it is still
    /// this instance's — when fewer statements matched than were sent, one read of the locks'
    /// documents tells which (a fence once broken never holds again: epochs only rise).
    pub async fn heartbeat_all(
        &self,
        held: &[&EditLock],
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<(DateTime<Utc>, Vec<bool>)> {
        let expires = plus(now, ttl);
        if held.is_empty() {
            return Ok((expires, Vec::new()));
        }
        let statements: Vec<Document> = held
            .iter()
            .map(|lock| {
                doc! {
                    "q": lock.fence(),
                    "u": {
                        "$set": { field::LOCK_EXPIRES_AT: date(expires) },
                        "$currentDate": { field::HEARTBEAT_AT: true },
                    },
                }
            })
            .collect();
        let reply = self
            .command(
                "heartbeat locks",
                doc! { "update": BOTS, "updates": statements, "ordered": false },
                None,
            )
            .await?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            if let Some(first) = errors.first() {
                return Err(Error::Protocol {
                    what: "heartbeat locks",
                    detail: format!("{first}"),
                });
            }
        }
        let matched = reply.get("n").and_then(integer).unwrap_or(0);
        if usize::try_from(matched).is_ok_and(|n| n == held.len()) {
            return Ok((expires, vec![true; held.len()]));
        }
        let ids: Vec<&str> = held.iter().map(|l| l.bot.as_str()).collect();
        let mut found: std::collections::HashMap<String, Document> = Default::default();
        let read = self
            .bots
            .find(doc! { field::ID: { "$in": &ids } })
            .projection(doc! {
                field::IS_EDITING: 1, field::EDITING_BY: 1, field::LOCK_EPOCH: 1,
            });
        self.each_doc("read held locks", read, |d| {
            if let Ok(id) = d.get_str(field::ID) {
                found.insert(id.to_owned(), d.clone());
            }
            Ok(())
        })
        .await?;
        let alive = held
            .iter()
            .map(|lock| {
                found.get(lock.bot.as_str()).is_some_and(|d| {
                    d.get_bool(field::IS_EDITING).ok() == Some(true)
                        && d.get_str(field::EDITING_BY).ok() == Some(lock.me.as_str())
                        && d.get(field::LOCK_EPOCH).and_then(integer) == Some(lock.epoch.get())
                })
            })
            .collect();
        Ok((expires, alive))
    }

    /// Every bot document's digest (see [`BotDigest`]), in one read.
    pub async fn bot_digests(&self) -> Result<Vec<BotDigest>> {
        use std::hash::{Hash, Hasher};
        // Read concern `majority`, as every read of the bots: a wake-up never rests on a write
        // a failover could roll back.
        let bots = self.bots.clone_with_type::<bson::RawDocumentBuf>();
        // One reply for any fleet up to 10,000 bots (the driver's first batch is 101).
        let find = bots
            .find(doc! {})
            .projection(doc! {
                field::SEEDS: 0, field::HISTORY: 0, field::SPEC: 0, field::CRAWL_PASS_SPEC: 0,
                field::HEARTBEAT_AT: 0, field::LOCK_EXPIRES_AT: 0,
            })
            .batch_size(10_000);
        let mut out = Vec::new();
        self.each_raw("read bot digests", find, |raw| {
            let Ok(id) = raw.get_str(field::ID) else {
                return Ok(());
            };
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            raw.as_bytes().hash(&mut hasher);
            let spec_version = match raw.get(field::SPEC_VERSION) {
                Ok(Some(bson::RawBsonRef::Int64(v))) => Some(v),
                Ok(Some(bson::RawBsonRef::Int32(v))) => Some(i64::from(v)),
                _ => None,
            };
            out.push(BotDigest {
                id: id.to_owned(),
                digest: hasher.finish(),
                spec_version,
            });
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Replaces the seeds and marks the bot ready, releasing the lock — fenced. For a crawling
    /// bot, the same write starts the next pass (whose seeds the caller already enqueued), or —
    /// while the current pass runs — marks it to start when that one ends (`crawlNextPassAt`).
    pub async fn complete(
        &self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        pass: NextPass,
    ) -> Result<()> {
        self.complete_with(held, seeds, now, pass, Document::new())
            .await
    }

    /// [`complete`](Self::complete), also setting `pass_fields` when it starts a pass (the spec
    /// the pass runs on, for bots defined in the database).
    pub async fn complete_with(
        &self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        pass: NextPass,
        pass_fields: Document,
    ) -> Result<()> {
        let mut reason = format!("{} seeds", seeds.len());
        let mut set = doc! {
            field::SEEDS: seeds,
            field::IS_READY: true,
            field::IS_EDITING: false,
            field::EDITING_BY: Bson::Null,
            field::LOCK_EXPIRES_AT: Bson::Null,
            field::LAST_ERROR: Bson::Null,
            field::FAILED_REFRESHES: 0_i32,
            field::RETRY_AFTER: Bson::Null,
        };
        let mut current = doc! { field::LAST_SEED_UPDATED_AT: true, field::HEARTBEAT_AT: true };
        match pass {
            NextPass::None => {}
            NextPass::Start(pass) => {
                set.extend(pass_fields);
                set.insert(field::CRAWL_PASS, pass);
                set.insert(field::CRAWL_PASS_ENDED_AT, Bson::Null);
                set.insert(field::CRAWL_NEXT_PASS_AT, Bson::Null);
                current.insert(field::CRAWL_PASS_STARTED_AT, true);
                reason.push_str(&format!("; crawl pass {pass}"));
            }
            NextPass::AfterCurrent => {
                current.insert(field::CRAWL_NEXT_PASS_AT, true);
                reason.push_str(&format!(
                    "; the next crawl pass starts when pass {} ends",
                    held.crawl_pass
                ));
            }
        }
        self.fenced(
            held,
            doc! {
                "$set": set,
                "$currentDate": current,
                "$push": push_history(history_entry(now, "refreshed", held.me.as_str(), held.epoch, &reason)),
            },
        )
        .await
    }

    /// Records a failed refresh and releases the lock — fenced. `stay_ready` returns the bot to
    /// Ready on its previous seeds (`keep_previous`); nobody retries before `retry_after`.
    pub async fn fail(
        &self,
        held: &EditLock,
        now: DateTime<Utc>,
        error: &str,
        retry_after: DateTime<Utc>,
        stay_ready: bool,
    ) -> Result<()> {
        self.fenced(
            held,
            doc! {
                "$set": {
                    field::IS_READY: stay_ready,
                    field::IS_EDITING: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                    field::LAST_ERROR: error,
                    field::RETRY_AFTER: date(retry_after),
                },
                "$inc": { field::FAILED_REFRESHES: 1_i32 },
                "$push": push_history(history_entry(now, "refresh_failed", held.me.as_str(), held.epoch, error)),
            },
        )
        .await
    }

    /// Gives the lock back without a result (shutdown) — fenced. The bot is left not ready, so the
    /// next instance claims it at once (rule C).
    pub async fn release(&self, held: &EditLock, now: DateTime<Utc>, reason: &str) -> Result<()> {
        self.fenced(
            held,
            doc! {
                "$set": {
                    field::IS_READY: false,
                    field::IS_EDITING: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                },
                "$push": push_history(history_entry(now, "released", held.me.as_str(), held.epoch, reason)),
            },
        )
        .await
    }

    /// Rule D: ready and editing at once. Clears `isReady` only, keeping the lock and its epoch, so a
    /// live holder is not disturbed and an expired one is then taken over by rule B.
    pub async fn repair_contradiction(
        &self,
        bot: &BotId,
        expected: LockEpoch,
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let filter = doc! {
            field::ID: bot.as_str(),
            field::IS_READY: true,
            field::IS_EDITING: true,
            field::LOCK_EPOCH: expected.get(),
        };
        let reason = "D: ready and editing at once; cleared isReady, kept the lock";
        let update = doc! {
            "$set": { field::IS_READY: false },
            "$push": push_history(history_entry(now, "repaired", me.as_str(), expected, reason)),
        };
        Ok(self
            .bounded("repair", self.bots.update_one(filter, update))
            .await?
            .modified_count
            == 1)
    }

    /// Rule E: rewrites a malformed document into a not-ready one, keeping whatever can be
    /// salvaged (valid seeds, dates, history) and raising the epoch above any it held. The filter is
    /// the exact document that was read, so a concurrent change makes this a no-op.
    pub async fn repair_malformed(
        &self,
        raw: &Document,
        problems: &[String],
        me: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let Some(id) = raw.get(field::ID).cloned() else {
            return Ok(false);
        };
        // Equality on every field that can be queried by equality: a key with a '.' or a leading
        // '$' cannot be, so it is left out (the rest still pins the document down).
        let mut filter = Document::new();
        for (key, value) in raw {
            if !key.contains('.') && !key.starts_with('$') {
                filter.insert(key.clone(), value.clone());
            }
        }
        for name in [
            field::IS_READY,
            field::IS_EDITING,
            field::SEEDS,
            field::LOCK_EPOCH,
        ] {
            if !raw.contains_key(name) {
                filter.insert(name, doc! { "$exists": false });
            }
        }
        let seeds: Vec<Bson> = match raw.get(field::SEEDS) {
            Some(Bson::Array(items)) if items.iter().all(|s| matches!(s, Bson::String(_))) => {
                items.clone()
            }
            _ => Vec::new(),
        };
        let epoch = highest_epoch(raw)
            .next()
            .ok_or_else(|| Error::EpochExhausted {
                bot: id.as_str().map_or_else(|| id.to_string(), str::to_owned),
            })?;
        let salvage_date = |name: &str| match raw.get(name) {
            Some(Bson::DateTime(d)) => Bson::DateTime(*d),
            _ => Bson::Null,
        };
        let reason = format!("E: malformed document repaired: {}", problems.join("; "));
        let mut history: Vec<Bson> = match raw.get(field::HISTORY) {
            Some(Bson::Array(items)) => items
                .iter()
                .filter(|h| matches!(h, Bson::Document(_)))
                .cloned()
                .collect(),
            _ => Vec::new(),
        };
        history.push(Bson::Document(history_entry(
            now,
            "repaired",
            me.as_str(),
            epoch,
            &reason,
        )));
        let keep = history.len().saturating_sub(HISTORY_LEN as usize);
        let history: Vec<Bson> = history.into_iter().skip(keep).collect();
        let replacement = doc! {
            field::ID: id,
            field::IS_READY: false,
            field::IS_EDITING: false,
            field::SEEDS: seeds,
            field::LAST_UPDATE_STARTED_AT: salvage_date(field::LAST_UPDATE_STARTED_AT),
            field::LAST_SEED_UPDATED_AT: salvage_date(field::LAST_SEED_UPDATED_AT),
            field::EDITING_BY: Bson::Null,
            field::LOCK_EPOCH: epoch.get(),
            field::HEARTBEAT_AT: Bson::Null,
            field::LOCK_EXPIRES_AT: Bson::Null,
            field::LAST_ERROR: reason,
            field::FAILED_REFRESHES: 0_i32,
            field::REFRESH_REQUESTED_AT: Bson::Null,
            field::RETRY_AFTER: Bson::Null,
            field::HISTORY: history,
        };
        let mut replacement = replacement;
        // The crawl's pass number survives a repair when it is readable (a new pass must not
        // reuse an old number); `start_pass` also looks at the frontier for the highest one.
        if let Some(pass) = raw
            .get(field::CRAWL_PASS)
            .and_then(integer)
            .filter(|p| *p >= 0)
        {
            replacement.insert(field::CRAWL_PASS, pass);
            for name in [
                field::CRAWL_PASS_STARTED_AT,
                field::CRAWL_PASS_ENDED_AT,
                field::CRAWL_LAST_RUN_AT,
            ] {
                replacement.insert(name, salvage_date(name));
            }
        }
        Ok(self
            .bounded("repair", self.bots.replace_one(filter, replacement))
            .await?
            .modified_count
            == 1)
    }

    /// `seedlock unlock`: the admin's override. Clears the lock of an editing bot and raises its
    /// epoch, so the old holder's fenced writes fail from now on. Conditional on the epoch it read
    /// (retried if the document changed in between), so the history names the right epoch.
    pub async fn admin_unlock(
        &self,
        bot: &BotId,
        by: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<UnlockOutcome> {
        let note = format!("unlocked by admin: {reason}");
        for _ in 0..10 {
            let Some(raw) = self.load_raw(bot).await? else {
                return Ok(UnlockOutcome::NoSuchBot);
            };
            if raw.get(field::IS_EDITING) != Some(&Bson::Boolean(true)) {
                return Ok(UnlockOutcome::NotLocked);
            }
            let observed_epoch = raw.get(field::LOCK_EPOCH).cloned().unwrap_or(Bson::Null);
            let old_epoch = integer(&observed_epoch);
            let epoch = highest_epoch(&raw)
                .next()
                .ok_or_else(|| Error::EpochExhausted {
                    bot: bot.to_string(),
                })?;
            let filter = doc! { field::ID: bot.as_str(), field::IS_EDITING: true, field::LOCK_EPOCH: observed_epoch };
            let update = doc! {
                "$set": {
                    field::IS_EDITING: false,
                    field::IS_READY: false,
                    field::EDITING_BY: Bson::Null,
                    field::LOCK_EXPIRES_AT: Bson::Null,
                    field::RETRY_AFTER: Bson::Null,
                    field::LAST_ERROR: note.as_str(),
                    field::LOCK_EPOCH: epoch.get(),
                },
                "$push": push_history(history_entry(now, "unlocked", by, epoch, &note)),
            };
            if self
                .bounded("unlock", self.bots.update_one(filter, update))
                .await?
                .matched_count
                == 1
            {
                return Ok(UnlockOutcome::Unlocked {
                    holder: raw.get_str(field::EDITING_BY).ok().map(str::to_owned),
                    old_epoch,
                });
            }
        }
        Err(Error::Protocol {
            what: "unlock",
            detail: "the document kept changing; try again".into(),
        })
    }

    /// `seedlock refresh`: asks for a refresh at the next opportunity. False if there is no such bot.
    pub async fn request_refresh(&self, bot: &BotId, by: &str, now: DateTime<Utc>) -> Result<bool> {
        let Some(raw) = self.load_raw(bot).await? else {
            return Ok(false);
        };
        let epoch = highest_epoch(&raw);
        let update = self.bots.update_one(
            doc! { field::ID: bot.as_str() },
            doc! {
                "$currentDate": { field::REFRESH_REQUESTED_AT: true },
                "$push": push_history(history_entry(now, "refresh_requested", by, epoch, "requested by admin")),
            },
        );
        let result = self.bounded("request refresh", update).await?;
        Ok(result.matched_count == 1)
    }

    /// The one change stream on the `bots` collection an instance keeps open (the lock wing's hub):
    /// each event names the bot it concerns and whether the fleet loop should look (a bot added,
    /// removed or replaced, or its `specVersion` changed). Only those fields travel — not the
    /// seeds a refresh wrote. Its events only prompt reads, so it uses the server's default read
    /// concern (the test server delivers no events on a stream opened with `majority`).
    pub async fn watch_bots(&self) -> Result<BotChanges> {
        let bots = self.db.collection::<Document>(BOTS);
        let spec_version = format!("updateDescription.updatedFields.{}", field::SPEC_VERSION);
        let watch = bots.watch().pipeline([doc! { "$project": {
            "operationType": 1, "documentKey": 1, &spec_version: 1,
        } }]);
        let stream = self.bounded("watch bots", watch).await?;
        // Events as plain documents: the projection leaves out what the driver's typed event
        // requires (`ns`, `removedFields`).
        Ok(BotChanges {
            stream: stream.with_type::<Document>(),
        })
    }
}

/// A bot document as [`Store::bot_digests`] reads it: its `_id`, a digest of every field that can
/// change what an instance does (not the seeds, history, specs, or the holder's heartbeat —
/// waiters wake at the lock's expiry anyway), and its `specVersion`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BotDigest {
    pub id: String,
    pub digest: u64,
    pub spec_version: Option<i64>,
}

/// One event of [`Store::watch_bots`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BotChange {
    /// The bot's `_id` (when it is a string).
    pub id: Option<String>,
    /// A bot added, removed or replaced, or its spec changed.
    pub concerns_fleet: bool,
}

/// The stream of [`BotChange`]s.
pub struct BotChanges {
    stream: mongodb::change_stream::ChangeStream<Document>,
}

impl futures_util::Stream for BotChanges {
    type Item = Result<BotChange>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.stream)
            .poll_next(cx)
            .map(|event| {
                event.map(|event| {
                    let event = event?;
                    let id = event
                        .get_document("documentKey")
                        .ok()
                        .and_then(|k| k.get_str(field::ID).ok())
                        .map(str::to_owned);
                    let concerns_fleet = match event.get_str("operationType") {
                        Ok("insert" | "delete" | "replace") => true,
                        Ok("update") => event
                            .get_document("updateDescription")
                            .ok()
                            .and_then(|u| u.get_document("updatedFields").ok())
                            .is_some_and(|f| f.contains_key(field::SPEC_VERSION)),
                        _ => false,
                    };
                    Ok(BotChange { id, concerns_fleet })
                })
            })
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
                    _ => false,
                }
        }
        Error::WriteConcern { code, labels, .. } => {
            CODES.contains(code) || labels.iter().any(|l| l == "RetryableWriteError")
        }
        _ => false,
    }
}

/// The highest epoch a (possibly malformed) document shows, in `lockEpoch` or in its history: a
/// repair or an unlock moves past it, so no epoch is ever handed out twice.
fn highest_epoch(raw: &Document) -> LockEpoch {
    let in_field = raw.get(field::LOCK_EPOCH).and_then(integer);
    let in_history = match raw.get(field::HISTORY) {
        Some(Bson::Array(entries)) => entries
            .iter()
            .filter_map(|e| {
                e.as_document()
                    .and_then(|d| d.get("epoch"))
                    .and_then(integer)
            })
            .max(),
        _ => None,
    };
    let highest = in_field.into_iter().chain(in_history).max().unwrap_or(0);
    LockEpoch::new(highest.max(0)).unwrap_or(LockEpoch::ZERO)
}

fn one_line(text: &str) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() > 400 {
        format!("{}…", line.chars().take(400).collect::<String>())
    } else {
        line
    }
}
