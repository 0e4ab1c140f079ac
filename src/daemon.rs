//! One seedlock instance: connect, sync the server clock, run every configured bot's state
//! machine until shutdown (`run`) or until each bot is Ready (`run --once`), serve `/healthz` and
//! `/metrics`. Tests start instances through the same [`run`] the binary uses.

use crate::ids::{LockEpoch, PassNumber};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::clock::ServerClock;
use crate::config::{BotSettings, Settings, Transactions};
use crate::crawl::CrawlContext;
use crate::http_client::HttpClient;
use crate::ids::BotId;
use crate::lock::bot::{BotSpec, Observed};
use crate::metrics::Metrics;
use crate::runner::{BotRunner, Context, RunEnd, Until};
use crate::seeds::SeedReader;
use crate::store::startup::{server_clock, with_patience};
use crate::store::Store;

#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// Run every bot until shutdown.
    Daemon,
    /// Run each bot until it is Ready, then return; give up after `timeout`.
    Once { timeout: Duration },
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad configuration, unreachable database, busy port: exit code 2.
    #[error("{0}")]
    Startup(String),
    /// `run --once` did not see every bot Ready in time: exit code 1.
    #[error("timed out after {}: not ready: {}", humantime::format_duration(*.timeout), .pending.join(", "))]
    Timeout {
        timeout: Duration,
        pending: Vec<String>,
    },
    /// `run --once` was stopped by SIGINT/SIGTERM before every bot was Ready: exit code 1.
    #[error("interrupted before every bot was ready; not ready: {}", .pending.join(", "))]
    Interrupted { pending: Vec<String> },
    /// A bot's task died (a bug): the instance stops so its supervisor restarts it. Exit code 1.
    #[error("the task of bot {0} crashed; stopping this instance")]
    Crashed(String),
    /// `run --once`: a bot defined in the database was removed before it was done. Exit code 1.
    #[error("bot {0} was removed from the database before it was done")]
    Removed(String),
    /// Another process took this instance's id over (it looked dead for longer than ttl): this
    /// one stopped. Exit code 1.
    #[error("instance id {0} was taken over by another process; stopped")]
    IdTakenOver(String),
}

/// What `run --once` saw at the end, per bot.
#[derive(Debug)]
pub struct BotSummary {
    pub bot: BotId,
    pub epoch: LockEpoch,
    pub seeds: usize,
    /// SHA-256 of the seed list (in order), so several instances can show they agree.
    pub seeds_digest: String,
    /// The crawl pass the bot is on (0: the bot does not crawl).
    pub pass: PassNumber,
    /// The pages that pass failed, as its end recorded them (`None`: not recorded, or the pass
    /// has not ended): `run --once` reads the failures' reasons only when there are some.
    pub failed: Option<u64>,
}

/// With no `[[bots]]` in its file, an instance runs the bots defined in the database
/// ([`crate::runner::roster`]); `run --once` runs those defined when it starts.
fn require_bots(_settings: &Settings) -> Result<(), RunError> {
    Ok(())
}

/// `run --once` of an instance without `[[bots]]`: the bots the database defines now (matching
/// `[instance] bots`), each with its spec; a spec that does not parse is a start-up error.
async fn database_bots(
    settings: &Settings,
    store: &Store,
) -> Result<Vec<(BotSettings, BotSpec)>, RunError> {
    let docs = store
        .bots()
        .spec_documents()
        .await
        .map_err(|e| RunError::Startup(e.to_string()))?;
    let mut out = Vec::new();
    for raw in docs {
        let Some(id) = crate::store::document::bot_id(&raw) else {
            continue;
        };
        if !settings.runs(&id) {
            continue;
        }
        let spec = match crate::store::document::definition(&raw).spec {
            Some(Ok(spec)) => spec,
            Some(Err(e)) => return Err(RunError::Startup(format!("bot {id}: {e}"))),
            None => continue,
        };
        let bot = crate::config::bot_from_spec(&id, &spec.spec)
            .map_err(|e| RunError::Startup(format!("bot {id}: {e}")))?;
        out.push((bot, spec));
    }
    if out.is_empty() {
        return Err(RunError::Startup(
            "no [[bots]] in the config file and no bot defined in the database (seedlock bots apply FILE): nothing to run".into(),
        ));
    }
    Ok(out)
}

pub async fn run(
    settings: Settings,
    mode: Mode,
    shutdown: CancellationToken,
) -> Result<Vec<BotSummary>, RunError> {
    require_bots(&settings)?;
    let store = Store::connect(&settings.mongo)
        .await
        .map_err(|e| RunError::Startup(e.to_string()))?;
    let result = run_with_store(settings, store.clone(), mode, shutdown).await;
    store.shutdown().await;
    result
}

/// [`run`] on a store its caller connected and keeps (its client is not shut down here): an
/// application embedding seedlock with a client of its own, `run --once` reading the passes'
/// failures afterwards on the same connections, or a test watching every command the driver
/// sends.
pub async fn run_with_store(
    settings: Settings,
    store: Store,
    mode: Mode,
    shutdown: CancellationToken,
) -> Result<Vec<BotSummary>, RunError> {
    require_bots(&settings)?;
    let ctx = context(&settings, &store).await?;
    let once_bots = match (&mode, settings.bots_from_database()) {
        (Mode::Once { .. }, true) => database_bots(&settings, &store).await?,
        _ => Vec::new(),
    };
    info!(instance = %ctx.me, bots = settings.bots.len(), database = %settings.mongo.database, "seedlock starting");

    let tracker = TaskTracker::new();
    let stop = shutdown.child_token();
    // The id first: a live process under the same id would take this one's locks as orphans.
    let registered =
        crate::runner::presence::register(&store, &ctx.me, &ctx.clock, settings.lock.ttl)
            .await
            .map_err(RunError::Startup)?;
    store.instances().name_transaction_sessions(&ctx.me);
    let id_lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let presence = tokio::spawn(crate::runner::presence::keep_alive(
        store.clone(),
        ctx.me.clone(),
        registered,
        ctx.clock.clone(),
        settings.lock.heartbeat,
        settings.lock.ttl,
        id_lost.clone(),
        stop.clone(),
    ));
    start_services(&settings, &ctx, &tracker, &stop).await?;
    let runs = start_bots(&settings, &ctx, once_bots, &mode, &tracker, &stop);
    let ready = match mode {
        Mode::Daemon => until_shutdown(runs, &stop).await,
        Mode::Once { timeout } => once(runs, timeout, &stop).await,
    };
    stop.cancel();
    let stopped = async {
        tracker.close();
        tracker.wait().await;
        ctx.hub.close().await;
        // The registration goes last: no lock work of this process outlives it.
        let _ = presence.await;
    };
    // The ready bots are read back for their summary lines while the instance stops.
    let read_back = async {
        match ready {
            Ok(bots) => Ok(summaries(&store, bots).await),
            Err(e) => Err(e),
        }
    };
    let (result, ()) = tokio::join!(read_back, stopped);
    let result = if id_lost.load(std::sync::atomic::Ordering::SeqCst) {
        Err(RunError::IdTakenOver(ctx.me.to_string()))
    } else {
        result
    };
    debug!(commands = ?ctx.store.command_counts(), waited_ms = ?ctx.store.command_waits(), "database commands sent");
    info!(instance = %ctx.me, "seedlock stopped");
    result
}

/// What every bot of this instance shares: the server's clock, the bots and hosts indexes, the
/// seed fetcher, the metrics (the store's command counts among them), the crawl's context when
/// any bot crawls, and the lock hub.
async fn context(settings: &Settings, store: &Store) -> Result<Arc<Context>, RunError> {
    let patience = settings.mongo.connect_timeout;
    let crawls = settings.bots_from_database() || settings.bots.iter().any(|b| b.crawl.is_some());
    // The clock's samples and every collection's indexes side by side: a database across a
    // network is paid a round trip at a time here, before anything else can start.
    let clock = async {
        server_clock(store, patience)
            .await
            .map_err(RunError::Startup)
    };
    let (clock, ()) = tokio::try_join!(
        clock,
        ensure_indexes(store, patience, crawls, settings.changes_ttl)
    )?;
    let fetcher = SeedReader::new(settings.refresh.clone()).map_err(RunError::Startup)?;
    let metrics = Arc::new(Metrics::new());
    {
        let store = store.clone();
        metrics.add_source(Box::new(move |m| {
            m.observe_db_commands(&store.command_counts());
            let (waited, checkouts) = store.pool_wait();
            m.observe_pool_wait(waited, checkouts);
            true
        }));
    }
    let started_at = clock.now();
    let crawl = if crawls {
        Some(crawl_context(settings, store, &clock, started_at, &metrics).await?)
    } else {
        None
    };
    Ok(Arc::new(Context {
        store: store.clone(),
        clock: clock.clone(),
        me: settings.instance_id.clone(),
        started_at,
        lock: settings.lock,
        fetcher,
        metrics,
        refresh_backoff: (settings.refresh.backoff_base, settings.refresh.backoff_max),
        crawl,
        hub: crate::runner::hub::Hub::new(
            store.clone(),
            clock,
            settings.lock,
            settings.refresh.concurrency,
        ),
        reads: tokio::sync::Semaphore::new(settings.mongo.max_pool_size.max(1) as usize),
    }))
}

/// The instance's own tasks beside its bots: the status page and `/metrics` (when
/// `http.listen` is set), the clock's resync, and — when it crawls — the throttling hosts
/// published.
async fn start_services(
    settings: &Settings,
    ctx: &Arc<Context>,
    tracker: &TaskTracker,
    stop: &CancellationToken,
) -> Result<(), RunError> {
    {
        // Every bot's catalogue figures, as the hub's last read of the documents found them.
        let ctx = Arc::downgrade(ctx);
        let metrics = ctx.upgrade().map(|c| c.metrics.clone());
        if let Some(metrics) = metrics {
            metrics.add_source(Box::new(move |m| match ctx.upgrade() {
                Some(ctx) => {
                    m.observe_catalogues(&ctx.hub.catalogues());
                    true
                }
                None => false,
            }));
        }
    }
    if let Some(listen) = &settings.http_listen {
        let stale_after = (settings.lock.poll * 3).max(settings.lock.ttl);
        let status = crate::ops::server::StatusSource {
            store: ctx.store.clone(),
            clock: ctx.clock.clone(),
            configured: settings
                .bots
                .iter()
                .map(|b| (b.id.clone(), b.refresh))
                .collect(),
            me: ctx.me.clone(),
            started: std::time::Instant::now(),
            cache: Default::default(),
        };
        let (addr, server) = crate::ops::server::bind(
            listen,
            ctx.metrics.clone(),
            stale_after,
            status,
            stop.clone(),
        )
        .await
        .map_err(RunError::Startup)?;
        info!(%addr, "serving the status page (/), /status.json, /healthz and /metrics");
        tracker.spawn(server);
    }
    tracker.spawn(resync_clock(
        ctx.store.clone(),
        ctx.clock.clone(),
        stop.clone(),
    ));
    if let Some(crawl) = &ctx.crawl {
        tracker.spawn(publish_hosts(
            ctx.store.clone(),
            crawl.flow.clone(),
            ctx.me.clone(),
            ctx.clock.clone(),
            stop.clone(),
        ));
    }
    Ok(())
}

/// A runner per bot — the config file's, then `once_bots` from the database — and, for a daemon
/// whose bots the database defines, the fleet's follower (which starts and stops runners as
/// the bot specs change).
fn start_bots(
    settings: &Settings,
    ctx: &Arc<Context>,
    once_bots: Vec<(BotSettings, BotSpec)>,
    mode: &Mode,
    tracker: &TaskTracker,
    stop: &CancellationToken,
) -> Vec<(BotId, tokio::task::JoinHandle<RunEnd>)> {
    let until = match mode {
        Mode::Daemon => Until::Shutdown,
        Mode::Once { .. } => Until::Done,
    };
    let mut runs = Vec::new();
    let mut start = |id: BotId, runner: BotRunner| {
        let stop = stop.clone();
        runs.push((
            id,
            tracker.spawn(async move { runner.run(until, &stop).await }),
        ));
    };
    for bot in &settings.bots {
        start(bot.id.clone(), BotRunner::new(bot.clone(), ctx.clone()));
    }
    for (bot, spec) in once_bots {
        let id = bot.id.clone();
        start(id, BotRunner::from_spec(bot, spec, ctx.clone()));
    }
    if settings.bots_from_database() && matches!(mode, Mode::Daemon) {
        info!("no [[bots]] in the config file: running the bots defined in the database");
        let fleet = tracker.spawn(crate::runner::roster::follow(
            settings.clone(),
            ctx.clone(),
            stop.clone(),
        ));
        runs.push((
            BotId::parse("fleet").expect("a valid id"),
            tracker.spawn(async move {
                let _ = fleet.await;
                RunEnd::Shutdown
            }),
        ));
    }
    runs
}

/// A daemon's runners until shutdown. Every runner ends at shutdown; one that ends otherwise
/// crashed, and a half-running instance is worse than a restarted one: the others are stopped.
async fn until_shutdown(
    runs: Vec<(BotId, tokio::task::JoinHandle<RunEnd>)>,
    stop: &CancellationToken,
) -> Result<Vec<BotId>, RunError> {
    let mut crashed = None;
    let mut pending: futures_util::stream::FuturesUnordered<_> = runs
        .into_iter()
        .map(|(bot, handle)| async move { (bot, handle.await) })
        .collect();
    while let Some((bot, end)) = futures_util::StreamExt::next(&mut pending).await {
        if let Err(e) = end {
            tracing::error!(%bot, error = %e, "bot task crashed");
            crashed.get_or_insert(bot.to_string());
            stop.cancel();
        }
    }
    crashed.map_or(Ok(Vec::new()), |bot| Err(RunError::Crashed(bot)))
}

/// The summary line of each bot in `ready`, read back from its document (a bot that cannot be
/// read is left out, with a warning).
async fn summaries(store: &Store, ready: Vec<BotId>) -> Vec<BotSummary> {
    let mut out = Vec::new();
    for bot in ready {
        // Read back what the bot is ready on, for the summary line.
        match store.bots().load(&bot).await {
            Ok(Observed::Valid(doc)) => out.push(BotSummary {
                seeds_digest: digest(&doc.seeds),
                seeds: doc.seeds.len(),
                epoch: doc.lock_epoch,
                pass: doc.crawl_pass,
                failed: doc
                    .crawl_pass_recorded
                    .filter(|_| doc.crawl_pass_ended_at.is_some())
                    .map(|r| r.failed),
                bot,
            }),
            Ok(_) | Err(_) => warn!(%bot, "could not read the bot back for the summary"),
        }
    }
    out
}

/// Every few seconds, the hosts that throttled this instance within the last minute or are
/// paused go to the `hosts` collection (for `status` and mongosh). Failures are only logged.
async fn publish_hosts(
    store: Store,
    flow: Arc<crate::flow::Flow>,
    me: crate::ids::InstanceId,
    clock: Arc<ServerClock>,
    stop: CancellationToken,
) {
    const EVERY: Duration = Duration::from_secs(5);
    const RECENT: Duration = Duration::from_secs(60);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        let now = clock.now();
        let rows: Vec<crate::store::hosts::HostRow> = flow
            .snapshot(tokio::time::Instant::now())
            .into_iter()
            .filter(|h| h.paused_for.is_some() || h.last_throttle.is_some_and(|ago| ago < RECENT))
            .map(|h| crate::store::hosts::HostRow {
                paused_until: h.paused_for.map(|d| crate::store::plus(now, d)),
                last_throttle_at: h
                    .last_throttle
                    .and_then(|ago| chrono::Duration::from_std(ago).ok())
                    .map(|ago| now - ago),
                host: h.host,
                instance: me.to_string(),
                limit: h.limit,
                in_flight: i64::from(h.in_flight),
                throttles: i64::try_from(h.throttles).unwrap_or(i64::MAX),
                updated_at: now,
            })
            .collect();
        if let Err(e) = store.hosts().publish(&me, &rows).await {
            tracing::debug!(error = %e, "could not publish throttled hosts");
        }
    }
}

/// The indexes of the bots and hosts collections, and of the frontier and records when any bot
/// crawls: each collection's at once.
async fn ensure_indexes(
    store: &Store,
    patience: Duration,
    crawls: bool,
    changes_ttl: Duration,
) -> Result<(), RunError> {
    let lock = with_patience("create the bots and hosts indexes", patience, || async {
        tokio::try_join!(
            store.bots().ensure_indexes(),
            store.hosts().ensure_indexes()
        )
        .map(|_| ())
    });
    let crawl = async {
        if !crawls {
            return Ok(());
        }
        info!("ensuring the frontier and records indexes (building one on a large collection takes a while)");
        tokio::try_join!(
            with_patience("create the frontier indexes", patience, || {
                store.frontier().ensure_indexes()
            }),
            with_patience("create the records index", patience, || {
                store.records().ensure_indexes()
            }),
            with_patience("create the change feed's indexes", patience, || {
                store.changes().ensure_indexes(changes_ttl)
            }),
        )
        .map(|_| ())
    };
    tokio::try_join!(lock, crawl)
        .map(|_| ())
        .map_err(|e| RunError::Startup(e.to_string()))
}

/// What crawling bots share: the page fetcher, and `crawl.transactions` resolved against what
/// the server supports.
async fn crawl_context(
    settings: &Settings,
    store: &Store,
    clock: &Arc<ServerClock>,
    started_at: chrono::DateTime<chrono::Utc>,
    metrics: &Arc<Metrics>,
) -> Result<CrawlContext, RunError> {
    let limits = settings.crawl.clone();
    let fetcher = HttpClient::new(&limits.user_agent, limits.timeout, limits.max_page_bytes)
        .map_err(RunError::Startup)?;
    let startup = |e: crate::error::Error| RunError::Startup(e.to_string());
    let patience = settings.mongo.connect_timeout;
    let supports_transactions = || {
        with_patience("ask whether the server runs transactions", patience, || {
            store.records().supports_transactions()
        })
    };
    let transactions = match limits.transactions {
        Transactions::Off => false,
        Transactions::Auto => supports_transactions().await.map_err(startup)?,
        Transactions::On => {
            if !supports_transactions().await.map_err(startup)? {
                return Err(RunError::Startup(
                    "key `crawl.transactions`: \"on\", but this server does not run transactions (a replica set or sharded cluster does); use \"auto\" or \"off\"".into(),
                ));
            }
            true
        }
    };
    info!(
        transactions,
        workers = limits.workers,
        max_writers = limits.writers,
        max_uncommitted = limits.max_uncommitted,
        robots = limits.robots,
        "crawl settings"
    );
    let flow = crate::flow::Flow::new(limits.flow.clone());
    {
        let flow = Arc::downgrade(&flow);
        metrics.add_source(Box::new(move |m| match flow.upgrade() {
            Some(flow) => {
                m.observe_hosts(&flow.snapshot(tokio::time::Instant::now()));
                true
            }
            None => false,
        }));
    }
    let robots = Arc::new(crate::flow::robots::RobotsCache::new(
        &limits.user_agent,
        limits.robots_ttl,
        limits.robots,
    ));
    Ok(CrawlContext {
        cut_off_after: settings.lock.ttl,
        flow,
        robots,
        store: store.clone(),
        clock: clock.clone(),
        me: settings.instance_id.clone(),
        started_at,
        limits,
        fetcher,
        transactions,
        metrics: metrics.clone(),
    })
}

/// Waits for every runner to finish before `timeout`: the bots that became ready, or why not.
async fn once(
    runs: Vec<(BotId, tokio::task::JoinHandle<RunEnd>)>,
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<Vec<BotId>, RunError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut ready = Vec::new();
    let mut pending = Vec::new();
    for (bot, mut handle) in runs {
        // `Some` when the runner finished (a handle must not be polled again after that).
        let finished = tokio::select! {
            end = &mut handle => Some(end.ok()),
            _ = tokio::time::sleep_until(deadline) => None,
        };
        match finished {
            Some(Some(RunEnd::Ready { .. })) => ready.push(bot),
            Some(Some(RunEnd::Removed)) => {
                stop.cancel();
                return Err(RunError::Removed(bot.to_string()));
            }
            Some(_) => {
                stop.cancel();
                pending.push(bot.to_string());
            }
            None => {
                stop.cancel();
                let _ = handle.await;
                pending.push(bot.to_string());
            }
        }
    }
    if !pending.is_empty() {
        if tokio::time::Instant::now() < deadline {
            // The runners stopped early: a signal, not the deadline.
            return Err(RunError::Interrupted { pending });
        }
        return Err(RunError::Timeout { timeout, pending });
    }
    Ok(ready)
}

pub(crate) fn digest(seeds: &[String]) -> String {
    let mut chunks: Vec<&[u8]> = Vec::with_capacity(seeds.len() * 2);
    for seed in seeds {
        chunks.push(seed.as_bytes());
        chunks.push(b"\n");
    }
    crate::ids::sha256_hex(&chunks, 8)
}

/// Samples the server's clock twice more at once, one after the other (the start took one: the
/// shortest of the three round trips sets the offset), then every 30 s (drift, and a better
/// round trip now and then), and at once when the primary changes: the new primary's clock may
/// differ from the old one's, and its first sample replaces the best.
async fn resync_clock(store: Store, clock: Arc<ServerClock>, stop: CancellationToken) {
    let primary_changes = store.primary_changes();
    for _ in 0..2 {
        tokio::select! {
            _ = stop.cancelled() => return,
            synced = store.sync_clock(&clock) => if let Err(e) = synced {
                tracing::debug!(error = %e, "clock sync failed; keeping the last offset");
            }
        }
    }
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(30)) => {}
            _ = primary_changes.notified() => {
                tracing::debug!("the primary changed: sampling its clock");
                clock.primary_changed();
            }
        }
        if let Err(e) = store.sync_clock(&clock).await {
            tracing::debug!(error = %e, "clock sync failed; keeping the last offset");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn transient() -> Error {
        Error::Timeout {
            what: "ping",
            after: Duration::from_secs(1),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn start_up_work_is_retried_while_the_database_is_transiently_away() {
        let calls = AtomicU32::new(0);
        let got = with_patience("ping", Duration::from_secs(20), || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(transient()),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(got.unwrap(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn start_up_work_gives_up_when_patience_runs_out_or_the_error_is_not_transient() {
        let started = tokio::time::Instant::now();
        let always = with_patience("ping", Duration::from_secs(5), || async {
            Err::<(), _>(transient())
        })
        .await;
        assert!(matches!(always, Err(Error::Timeout { .. })));
        let waited = started.elapsed();
        assert!(
            waited <= Duration::from_secs(5),
            "gave up within the patience: {waited:?}"
        );
        assert!(waited >= Duration::from_secs(2), "it did retry: {waited:?}");

        let calls = AtomicU32::new(0);
        let fatal = with_patience("ping", Duration::from_secs(5), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(Error::Protocol {
                what: "ping",
                detail: "not a database".into(),
            })
        })
        .await;
        assert!(matches!(fatal, Err(Error::Protocol { .. })));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "no retry of a permanent error"
        );
    }
}
