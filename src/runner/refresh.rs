//! The refresh turn: take a refresh permit, claim the edit lock (one conditional write fenced on
//! the epoch read), fetch the seeds while the hub heartbeats the lock, stop all work when the
//! lock is lost, `max_refresh` passes or shutdown arrives, then make exactly one fenced last
//! write: the new seeds (and the next crawl pass), the failure and its backoff, or the release.

use super::*;

/// How a refresh under the lock ended, before its last write.
pub(super) enum End {
    Fetched(std::result::Result<Seeds, SeedError>),
    Abandoned,
    Lost,
    Shutdown,
}

/// Seeds may take at most this much of the 16 MiB document (the rest is history and fields).
pub(crate) const MAX_SEED_BYTES: usize = 8 * 1024 * 1024;

/// The holder's last write.
pub(super) enum Finish {
    Complete(Vec<String>),
    Fail(String),
    Release,
}

/// The claim a step's decision asks for: the epoch it is fenced on, how the lock is taken, why,
/// and when the document was read.
pub(super) struct ClaimRequest {
    pub(super) expected: LockEpoch,
    pub(super) claim: Claim,
    pub(super) reason: String,
    pub(super) now: DateTime<Utc>,
}

impl BotRunner {
    /// Takes a refresh permit (the one the loop `reserved`, or a free one), claims the edit lock
    /// and refreshes under it; the permit is given back after the refresh's last write. `Busy`
    /// when no permit is free, `LostRace` when another instance claimed first (or shutdown
    /// arrived while this instance left others a moment to claim).
    pub(super) async fn claim_and_refresh(
        &self,
        request: ClaimRequest,
        reserved: Option<Permit>,
        shutdown: &CancellationToken,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let ClaimRequest {
            expected,
            claim,
            reason,
            now,
        } = request;
        // A permit first: a bot this instance cannot refresh now is not locked.
        let Some(permit) = reserved.or_else(|| ctx.hub.try_permit()) else {
            debug!(bot = %id, "every refresh permit is in use; waiting for one");
            return Ok(StepOutcome::Busy);
        };
        // An instance that holds locks leaves a moment for those that hold fewer.
        let delay = ctx.hub.claim_delay();
        if !delay.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(StepOutcome::LostRace),
                _ = tokio::time::sleep(delay) => {}
            }
        }
        let now = if delay.is_zero() {
            now
        } else {
            ctx.clock.now()
        };
        let held = ctx
            .store
            .bots()
            .claim(id, &ctx.me, expected, claim, now, ctx.lock.ttl, &reason)
            .await?;
        let Some(held) = held else {
            debug!(bot = %id, epoch = expected.get(), "another instance claimed the lock first");
            return Ok(StepOutcome::LostRace);
        };
        let takeover = takeover_kind(claim);
        ctx.metrics.acquired(id, takeover);
        ctx.metrics.saw_epoch(id, held.epoch);
        info!(bot = %id, epoch = held.epoch.get(), %reason, takeover = takeover.unwrap_or("no"), "won the edit lock");
        let outcome = self.refresh(held, shutdown).await;
        drop(permit);
        outcome
    }

    /// Refreshes under `held`: fetch the seeds while heartbeating; stop the work when the lock is
    /// lost, `max_refresh` passes or shutdown arrives; then make exactly one fenced last write.
    pub(super) async fn refresh(
        &self,
        held: EditLock,
        shutdown: &CancellationToken,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let timer = Instant::now();
        let max_refresh =
            chrono::Duration::from_std(ctx.lock.max_refresh).unwrap_or(chrono::Duration::MAX);
        let deadline = held.started_at + max_refresh;
        let mut confirmed_until =
            ctx.clock.now() + chrono::Duration::from_std(ctx.lock.ttl).unwrap_or_default();
        let work = CancellationToken::new();
        let end = {
            let fetch = ctx.fetcher.fetch(&self.bot.seeds, &work);
            tokio::pin!(fetch);
            // Renewed with every other lock this instance holds, one round trip a tick.
            let mut heartbeats = ctx.hub.heartbeats(&held);
            // The holder gives up at `max_refresh` exactly (others wait out a grace on top), so
            // its failure and backoff land before anyone may take the lock over as stuck.
            let give_up = Instant::now()
                + (deadline - ctx.clock.now())
                    .to_std()
                    .unwrap_or(Duration::ZERO);
            loop {
                // Raced against the lock's confirmed end: a database that swallows the
                // heartbeats (a partition) must not keep this holder refreshing past it.
                let runs_out = Instant::now()
                    + (confirmed_until - ctx.clock.now())
                        .to_std()
                        .unwrap_or(Duration::ZERO);
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break End::Shutdown,
                    result = &mut fetch => {
                        break End::Fetched(result)
                    }
                    _ = tokio::time::sleep_until(give_up) => break End::Abandoned,
                    _ = tokio::time::sleep_until(runs_out) => break End::Lost,
                    changed = heartbeats.beats.changed() => {
                        if changed.is_err() {
                            break End::Lost;
                        }
                        let beat = heartbeats.beats.borrow_and_update().clone();
                        match beat {
                            Beat::Taken => {}
                            Beat::Renewed(expires) => {
                                ctx.metrics.db_ok();
                                confirmed_until = expires;
                            }
                            Beat::Lost => break End::Lost,
                            Beat::Failed(error) => {
                                ctx.metrics.db_error();
                                warn!(bot = %id, epoch = held.epoch.get(), %error, "heartbeat failed");
                            }
                        }
                    }
                }
            }
            // `fetch` is dropped here: the HTTP request (and any retry sleep) stops before any
            // last write is attempted — and so are the heartbeats.
        };
        work.cancel();
        let finish = match end {
            End::Fetched(Ok(seeds)) => self.checked_seeds(seeds),
            End::Fetched(Err(SeedError::Cancelled)) | End::Shutdown => Finish::Release,
            End::Fetched(Err(e)) => Finish::Fail(format!("refresh failed: {e}")),
            End::Abandoned => Finish::Fail(format!(
                "refresh abandoned: it ran longer than max_refresh ({})",
                humantime::format_duration(ctx.lock.max_refresh)
            )),
            End::Lost => {
                return Ok(self.lost(
                    &held,
                    timer,
                    "a heartbeat matched nothing or could not be confirmed",
                ));
            }
        };
        self.finish(held, finish, confirmed_until, timer).await
    }

    /// Turns fetched seeds into the last write: the new list, or a failure when it cannot fit in
    /// one document.
    pub(super) fn checked_seeds(&self, seeds: Seeds) -> Finish {
        let id = &self.bot.id;
        if seeds.truncated {
            warn!(bot = %id, kept = seeds.urls.len(), "the seed source has more URLs than refresh.max_seeds; the rest were dropped");
        }
        if seeds.rejected > 0 {
            info!(bot = %id, rejected = seeds.rejected, "seed entries rejected (not http(s) URLs)");
        }
        seeds_to_store(seeds)
    }

    pub(super) fn lost(&self, held: &EditLock, timer: Instant, why: &str) -> StepOutcome {
        let id = &self.bot.id;
        warn!(bot = %id, epoch = held.epoch.get(), %why, "edit lock lost; stopped without writing");
        self.ctx.metrics.edit_lock_lost(id);
        self.ctx
            .metrics
            .refresh_finished(id, "lost", timer.elapsed());
        StepOutcome::EditLockLost
    }

    /// The holder's one last write, retried on transient errors while the lock is still ours.
    pub(super) async fn finish(
        &self,
        held: EditLock,
        mut finish: Finish,
        confirmed_until: DateTime<Utc>,
        timer: Instant,
    ) -> Result<StepOutcome> {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        let mut attempt = 0;
        // A crawling bot's refresh starts its next pass: seeds enqueued first, then the same
        // fenced write that stores them records the pass.
        let mut new_pass = None;
        loop {
            let now = ctx.clock.now();
            // Each attempt races the lock's confirmed end: past it, another instance may hold
            // the lock, and a write still unanswered then (a partition) may land late — the
            // fence rejects it, and this holder has stopped.
            let runs_out =
                Instant::now() + (confirmed_until - now).to_std().unwrap_or(Duration::ZERO);
            let attempt_result = tokio::time::timeout_at(
                runs_out,
                self.last_write(&held, &finish, now, &mut new_pass),
            )
            .await;
            let Ok(result) = attempt_result else {
                return Ok(self.lost(
                    &held,
                    timer,
                    "the last write was not answered before the lock ran out",
                ));
            };
            match result {
                Ok(()) => break,
                Err(Error::EditLockLost { .. }) => {
                    return Ok(self.lost(&held, timer, "the last write matched nothing"))
                }
                // The server refused the new seeds for good (a document too large, say): record
                // that as the refresh's failure rather than leave the lock to expire.
                Err(e) if !e.is_transient() && matches!(finish, Finish::Complete(_)) => {
                    finish = Finish::Fail(format!(
                        "refresh failed: the seeds could not be stored: {e}"
                    ));
                }
                Err(e) if e.is_transient() && ctx.clock.now() < confirmed_until => {
                    ctx.metrics.db_error();
                    attempt += 1;
                    warn!(bot = %id, epoch = held.epoch.get(), error = %e, attempt, "last write failed; retrying");
                    tokio::time::sleep(full_jitter(
                        Duration::from_millis(100),
                        ctx.lock.heartbeat,
                        attempt,
                    ))
                    .await;
                }
                Err(e) => return Err(e),
            }
        }
        ctx.metrics.db_ok();
        Ok(self.finished(held.epoch, finish, new_pass, timer))
    }

    /// One attempt at the holder's last write, at `now`: the new seeds (with the next pass of a
    /// crawling bot), the failure and when to try again, or the lock's release at shutdown.
    pub(super) async fn last_write(
        &self,
        held: &EditLock,
        finish: &Finish,
        now: DateTime<Utc>,
        new_pass: &mut Option<PassNumber>,
    ) -> Result<()> {
        match finish {
            Finish::Complete(seeds) => self.write_complete(held, seeds, now, new_pass).await,
            Finish::Fail(error) => self.write_failure(held, error, now).await,
            Finish::Release => {
                self.ctx
                    .store
                    .bots()
                    .release(held, now, "shutdown: work stopped, lock released")
                    .await
            }
        }
    }

    /// The last write of a successful refresh: stores `seeds` and marks the bot ready. For a
    /// crawling bot it also starts the next pass — its seeds enqueued first, once: the pass's
    /// number is kept in `new_pass` for a retry — or, while a young pass runs, marks the next one
    /// to start when that pass ends.
    pub(super) async fn write_complete(
        &self,
        held: &EditLock,
        seeds: &[String],
        now: DateTime<Utc>,
        new_pass: &mut Option<PassNumber>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        let young = self.pass_is_young(held, now);
        let next = match (&self.crawler, *new_pass) {
            (None, _) => Ok(NextPass::None),
            (Some(_), _) if young => Ok(NextPass::AfterCurrent),
            (Some(_), Some(pass)) => Ok(NextPass::Start(pass)),
            (Some(crawler), None) => ctx
                .store
                .passes()
                .prepare(
                    &self.bot.id,
                    held.crawl_pass,
                    &crawler.pass_sources(seeds).await,
                    now,
                )
                .await
                .map(NextPass::Start),
        };
        match next {
            Ok(next) => {
                if let NextPass::Start(pass) = next {
                    *new_pass = Some(pass);
                }
                let written = ctx
                    .store
                    .bots()
                    .complete_with(held, seeds, now, next, Some(&self.pass_spec()))
                    .await?;
                *self.written.lock().expect("written lock") = Some(written);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the pass that ran when the lock was taken is, at `now`, younger than
    /// `crawl.max_pass`: a refresh lets such a pass go on to its end (the next one starts then,
    /// on the new seeds); an older one is cut short.
    pub(super) fn pass_is_young(&self, held: &EditLock, now: DateTime<Utc>) -> bool {
        let max_pass = self
            .ctx
            .crawl
            .as_ref()
            .map_or(Duration::MAX, |c| c.limits.max_pass);
        is_young(held.crawl_pass_running_since, now, max_pass)
    }

    /// The last write of a failed refresh: records `error` and when to try again (the refresh
    /// backoff, grown with the failures before this one); the bot stays Ready on its previous
    /// seeds when `on_refresh_failure` keeps them and there are any.
    pub(super) async fn write_failure(
        &self,
        held: &EditLock,
        error: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        let (base, cap) = ctx.refresh_backoff;
        let backoff = jittered(refresh_backoff(held.failed_refreshes, base, cap), 0.2);
        let retry_after = now + chrono::Duration::from_std(backoff).unwrap_or_default();
        let stay_ready = self.bot.on_refresh_failure == OnRefreshFailure::KeepPrevious
            && !held.previous_seeds.is_empty();
        ctx.store
            .bots()
            .fail(held, now, error, retry_after, stay_ready)
            .await
    }

    /// The outcome of a refresh whose last write (`finish`) landed at `epoch`, logged and counted.
    pub(super) fn finished(
        &self,
        epoch: LockEpoch,
        finish: Finish,
        new_pass: Option<PassNumber>,
        timer: Instant,
    ) -> StepOutcome {
        let ctx = &self.ctx;
        let id = &self.bot.id;
        match finish {
            Finish::Complete(seeds) => {
                info!(bot = %id, epoch = epoch.get(), seeds = seeds.len(), pass = new_pass.map(PassNumber::get), "seeds refreshed; bot is ready");
                ctx.metrics.refresh_finished(id, "ok", timer.elapsed());
                StepOutcome::Refreshed {
                    seeds: seeds.len(),
                    epoch,
                }
            }
            Finish::Fail(error) => {
                warn!(bot = %id, epoch = epoch.get(), %error, "refresh failed; recorded and released");
                ctx.metrics.refresh_finished(id, "failed", timer.elapsed());
                StepOutcome::RefreshFailed { error }
            }
            Finish::Release => {
                info!(bot = %id, epoch = epoch.get(), "shutdown mid-refresh: work stopped, lock released");
                ctx.metrics
                    .refresh_finished(id, "released", timer.elapsed());
                StepOutcome::Released
            }
        }
    }
}

/// What taking the lock by `claim` is called in the metrics and the log: `None` for a free
/// lock, else the kind of takeover.
pub(super) fn takeover_kind(claim: Claim) -> Option<&'static str> {
    match claim {
        Claim::Free => None,
        Claim::Expired { .. } => Some("expired"),
        Claim::Stuck { .. } => Some("stuck"),
        Claim::Orphaned => Some("orphaned"),
    }
}

/// The last write that stores fetched `seeds`: the list, or a failure when it cannot fit in one
/// document.
pub(super) fn seeds_to_store(seeds: Seeds) -> Finish {
    let list: Vec<String> = seeds
        .urls
        .into_iter()
        .map(|u| u.as_str().to_owned())
        .collect();
    // Each array element costs its bytes plus about 16 bytes of BSON framing.
    let bytes: usize = list.iter().map(|s| s.len() + 16).sum();
    if bytes > MAX_SEED_BYTES {
        return Finish::Fail(format!(
            "refresh failed: {} seeds take {bytes} bytes, over the {MAX_SEED_BYTES}-byte share of one document; lower refresh.max_seeds",
            list.len()
        ));
    }
    Finish::Complete(list)
}

/// Whether a pass running since `since` is, at `now`, younger than `max_pass` (no pass: no).
pub(super) fn is_young(
    since: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    max_pass: Duration,
) -> bool {
    since.is_some_and(|since| (now - since).to_std().unwrap_or_default() < max_pass)
}

/// The wait before the next refresh after a failed one, before jitter: `base` doubled for each
/// failure before this one, at most `cap`.
pub(super) fn refresh_backoff(failed_before: i64, base: Duration, cap: Duration) -> Duration {
    let exponent = u32::try_from(failed_before.clamp(0, 20)).unwrap_or(20);
    base.saturating_mul(1 << exponent).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::urls::NormalizedUrl;
    use chrono::TimeZone;

    fn seeds(urls: &[&str]) -> Seeds {
        Seeds {
            urls: urls
                .iter()
                .map(|u| NormalizedUrl::parse(u).unwrap())
                .collect(),
            truncated: false,
            rejected: 0,
        }
    }

    #[test]
    fn fetched_seeds_are_stored_as_their_normalized_strings() {
        let Finish::Complete(list) = seeds_to_store(seeds(&["http://a.test/x", "http://b.test/"]))
        else {
            panic!("a short list is stored");
        };
        assert_eq!(list, ["http://a.test/x", "http://b.test/"]);
    }

    #[test]
    fn seeds_over_their_share_of_one_document_fail_the_refresh_with_a_reason() {
        let long = format!("http://a.test/{}", "x".repeat(1000));
        let many: Vec<&str> =
            std::iter::repeat_n(long.as_str(), MAX_SEED_BYTES / 1000 + 1).collect();
        match seeds_to_store(seeds(&many)) {
            Finish::Fail(reason) => assert!(reason.contains("lower refresh.max_seeds"), "{reason}"),
            _ => panic!("a list over the share fails"),
        }
    }

    #[test]
    fn a_pass_is_young_until_max_pass_and_no_pass_is_never_young() {
        let since = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let hour = Duration::from_secs(3600);
        assert!(is_young(
            Some(since),
            since + chrono::Duration::minutes(59),
            hour
        ));
        assert!(!is_young(
            Some(since),
            since + chrono::Duration::minutes(60),
            hour
        ));
        assert!(!is_young(None, since, hour));
    }

    #[test]
    fn the_refresh_backoff_doubles_per_failure_up_to_its_cap() {
        let (base, cap) = (Duration::from_secs(10), Duration::from_secs(300));
        assert_eq!(refresh_backoff(0, base, cap), base);
        assert_eq!(refresh_backoff(3, base, cap), Duration::from_secs(80));
        assert_eq!(refresh_backoff(10, base, cap), cap);
        assert_eq!(refresh_backoff(i64::MAX, base, cap), cap, "no overflow");
        assert_eq!(
            refresh_backoff(-1, base, cap),
            base,
            "a corrupt count counts as none"
        );
    }

    #[test]
    fn only_a_taken_over_lock_is_named_in_the_metrics() {
        let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        assert_eq!(takeover_kind(Claim::Free), None);
        assert_eq!(takeover_kind(Claim::Expired { now }), Some("expired"));
        assert_eq!(
            takeover_kind(Claim::Stuck {
                started_before: now
            }),
            Some("stuck")
        );
        assert_eq!(takeover_kind(Claim::Orphaned), Some("orphaned"));
    }
}
