//! Bot runners in the test's own process: lock and refresh settings, a bot, the shared context.

use super::*;

pub fn lock(ttl_ms: u64, max_refresh_ms: u64, poll_ms: u64) -> LockSettings {
    LockSettings {
        ttl: Duration::from_millis(ttl_ms),
        heartbeat: Duration::from_millis(ttl_ms / 3),
        max_refresh: Duration::from_millis(max_refresh_ms),
        stuck_grace: Duration::from_millis(ttl_ms),
        poll: Duration::from_millis(poll_ms),
    }
}

pub fn limits() -> RefreshLimits {
    RefreshLimits {
        timeout: Duration::from_secs(30),
        max_bytes: 1 << 20,
        max_seeds: 1000,
        attempts: 1,
        // Long enough that a test's next step always lands inside the backoff after a failure.
        backoff_base: Duration::from_secs(2),
        backoff_max: Duration::from_secs(5),
        sitemap_depth: 2,
        user_agent: "seedlock-test".into(),
        concurrency: seedlock::config::DEFAULT_REFRESH_CONCURRENCY,
    }
}

pub fn bot(
    id: &str,
    source_url: &str,
    refresh: RefreshSchedule,
    on_failure: OnRefreshFailure,
) -> BotSettings {
    BotSettings {
        id: BotId::parse(id).unwrap(),
        seeds: SeedSource::Url {
            url: NormalizedUrl::parse(source_url).unwrap(),
            format: SeedFormat::Lines,
        },
        refresh,
        on_refresh_failure: on_failure,
        crawl: None,
    }
}

/// An instance's context in this process, with its clock synced to the server.
pub async fn context(db: &TestDb, me: &str, lock: LockSettings, local: LocalClock) -> Arc<Context> {
    context_with_permits(
        db,
        me,
        lock,
        local,
        seedlock::config::DEFAULT_REFRESH_CONCURRENCY,
    )
    .await
}

/// [`context`] with `permits` refreshes at once (`refresh.concurrency`).
pub async fn context_with_permits(
    db: &TestDb,
    me: &str,
    lock: LockSettings,
    local: LocalClock,
    permits: usize,
) -> Arc<Context> {
    let store = db.store();
    let clock = Arc::new(ServerClock::new(local));
    for _ in 0..3 {
        store
            .sync_clock(&clock)
            .await
            .expect("hello answers with localTime");
    }
    Arc::new(Context {
        store: store.clone(),
        clock: clock.clone(),
        me: InstanceId::parse(me).unwrap(),
        started_at: clock.now(),
        lock,
        fetcher: SeedReader::new(limits()).unwrap(),
        metrics: Arc::new(Metrics::new()),
        refresh_backoff: (limits().backoff_base, limits().backoff_max),
        crawl: None,
        hub: Hub::new(store, clock.clone(), lock, permits),
        reads: tokio::sync::Semaphore::new(32),
    })
}

pub fn runner(bot: BotSettings, ctx: Arc<Context>) -> BotRunner {
    BotRunner::new(bot, ctx)
}

// ---- real processes --------------------------------------------------------------------------

/// Claims `bot`'s free lock (epoch 0) for `me`, for 30 s.
pub async fn claim_free(
    store: &Store,
    bot: &BotId,
    me: &InstanceId,
    now: chrono::DateTime<chrono::Utc>,
) -> seedlock::store::EditLock {
    store
        .bots()
        .claim(
            bot,
            me,
            seedlock::ids::LockEpoch::ZERO,
            seedlock::lock::state::Claim::Free,
            now,
            Duration::from_secs(30),
            "t",
        )
        .await
        .unwrap()
        .expect("claimed")
}
