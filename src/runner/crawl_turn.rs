//! The crawl turn of a ready bot: start its first (or next) pass, crawl the running pass for a
//! slice, or take over a deletion evaluation whose claim ran out. A pass that started on another
//! spec than the runner's ends on the spec it recorded.

use super::*;
use crate::crawl::Pass;

/// A spec as a pass recorded it (`crawlPassSpecVersion`, `crawlPassSpec`).
pub(super) type RecordedSpec = Arc<BotSpec>;

/// Which pass a crawl turn starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Starting {
    /// The bot's first.
    First,
    /// The next, after a pass that is over.
    Next,
}

/// How one crawl turn of a ready bot ended.
pub(super) enum CrawlTurn {
    /// This instance started the bot's first pass (or lost that race): read the document again.
    Started,
    /// The pass is over (now or before).
    Finished,
    /// Nothing to lease here right now; others hold the rest of the pass.
    Idle,
    /// The slice ran out; read the document again (a refresh may be due).
    TimeUp,
    Shutdown,
}

impl BotRunner {
    /// What a pass started by this runner records of the spec it runs on — and, when the pass
    /// before ran on another spec, that this one fetches every page anew (an unchanged page
    /// answering 304, or an item whose listing did not change, would keep what the old rules
    /// extracted).
    pub(super) fn pass_spec(&self) -> PassSpec {
        let before = self.last_pass_spec.lock().expect("pass spec lock");
        pass_spec(self.spec.as_ref(), before.as_deref())
    }

    /// The crawler for `pass`: this runner's, or — when the pass started on another spec
    /// version — one built from the spec the pass recorded, so it ends on the rules it began with.
    pub(super) fn crawler_for(&self, pass: &Pass) -> Option<Arc<Crawler>> {
        let mine = self.crawler.clone()?;
        let (Some(_), Some(recorded)) = (&self.spec, &pass.spec) else {
            return Some(mine);
        };
        if self.spec.as_ref() == Some(&**recorded) {
            return Some(mine);
        }
        let mut cached = self.pass_crawler.lock().expect("pass crawler lock");
        if let Some((cached_spec, crawler)) = cached.as_ref() {
            if Arc::ptr_eq(cached_spec, recorded) || **cached_spec == **recorded {
                return Some(crawler.clone());
            }
        }
        let rules = crate::config::bot_from_spec(&self.bot.id, &recorded.spec)
            .ok()
            .and_then(|b| b.crawl);
        match (rules, &self.ctx.crawl) {
            (Some(rules), Some(crawl)) => {
                info!(bot = %self.bot.id, pass = pass.number.get(), spec_version = recorded.version, "this pass started on an earlier spec: crawling it on that one");
                let crawler = Crawler::new(self.bot.id.clone(), rules, crawl);
                *cached = Some((recorded.clone(), crawler.clone()));
                Some(crawler)
            }
            _ => Some(mine),
        }
    }

    /// Carries out what a crawl turn of a Ready bot (on `seeds` seeds at `epoch`) leaves the loop
    /// to do: end it (the pass finished for `run --once`, or shutdown), or pause as the turn asks
    /// before the next step. `Some` when the run ends.
    pub(super) async fn after_crawl_turn(
        &self,
        turn: CrawlTurn,
        until: Until,
        seeds: usize,
        epoch: LockEpoch,
        shutdown: &CancellationToken,
    ) -> Option<RunEnd> {
        let pause = match after_turn(&turn, until) {
            AfterTurn::End => {
                return Some(match turn {
                    CrawlTurn::Shutdown => RunEnd::Shutdown,
                    _ => RunEnd::Ready { seeds, epoch },
                });
            }
            AfterTurn::StepAgain => None,
            AfterTurn::LookAgainSoon => Some(jittered(self.ctx.lock.poll / 4, 0.2)),
            AfterTurn::Idle => Some(self.idle_for()),
        };
        if let Some(delay) = pause {
            if self.pause(delay, shutdown).await {
                return Some(RunEnd::Shutdown);
            }
        }
        None
    }

    /// One crawl turn of a ready bot: start its first pass, or crawl its current pass for a
    /// slice (bounded, so a due refresh is noticed), or see it finished.
    pub(super) async fn crawl_turn(
        &self,
        pass: PassState,
        until: Until,
        shutdown: &CancellationToken,
    ) -> Result<CrawlTurn> {
        let Some(crawler) = &self.crawler else {
            return Ok(CrawlTurn::Finished);
        };
        match plan_turn(pass, until, self.ctx.clock.now()) {
            TurnPlan::Start {
                which,
                after,
                seeds,
            } => {
                self.start_pass(crawler, which, after, &seeds).await?;
                Ok(CrawlTurn::Started)
            }
            TurnPlan::ResumeEvaluation {
                pass,
                claimed_until,
            } => {
                self.resume_evaluation(crawler, pass, claimed_until).await?;
                Ok(CrawlTurn::Finished)
            }
            TurnPlan::Finished => Ok(CrawlTurn::Finished),
            TurnPlan::Crawl(pass) => {
                let crawler = self.crawler_for(&pass).unwrap_or_else(|| crawler.clone());
                self.crawl_slice(&crawler, &pass, shutdown).await
            }
        }
    }

    /// Starts a pass on the stored `seeds` unless another instance started it first: the bot's
    /// first (`after`: its pass number, 0 when it has none yet), or the next after `after`,
    /// which is over, on the seeds a refresh stored while it ran.
    pub(super) async fn start_pass(
        &self,
        crawler: &Crawler,
        which: Starting,
        after: PassNumber,
        seeds: &[String],
    ) -> Result<()> {
        let ctx = &self.ctx;
        let seeds = crawler.pass_sources(seeds).await;
        let (bot, passes) = (crawler.bot(), ctx.store.passes());
        let (now, spec) = (ctx.clock.now(), self.pass_spec());
        let started = match which {
            Starting::First => passes.start(bot, after, &seeds, now, &spec).await?,
            Starting::Next => passes.start_next(bot, after, &seeds, now, &spec).await?,
        };
        match (started, which) {
            (None, _) => {}
            (Some(pass), Starting::First) => {
                info!(%bot, pass = pass.get(), seeds = seeds.len(), "started the first crawl pass");
            }
            (Some(pass), Starting::Next) => {
                info!(%bot, pass = pass.get(), seeds = seeds.len(), "the pass is over; started the next, on the latest seeds");
            }
        }
        Ok(())
    }

    /// Takes over the deletion evaluation of pass `number`, whose claim ran out at
    /// `claimed_until`: the instance that ended the pass stopped before its evaluation did.
    pub(super) async fn resume_evaluation(
        &self,
        crawler: &Crawler,
        number: PassNumber,
        claimed_until: DateTime<Utc>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        ctx.store
            .passes()
            .resume_evaluation(
                crawler.bot(),
                number,
                claimed_until,
                &ctx.me,
                ctx.clock.now(),
            )
            .await?;
        Ok(())
    }

    /// Crawls the running `pass` for one slice of 10 × `poll` (5–60 s), ended early by
    /// shutdown, or — as shutdown would, without ending the runner — by the bot's pause or
    /// removal.
    pub(super) async fn crawl_slice(
        &self,
        crawler: &Arc<Crawler>,
        pass: &Pass,
        shutdown: &CancellationToken,
    ) -> Result<CrawlTurn> {
        let ctx = &self.ctx;
        ctx.metrics.crawling(crawler.bot(), pass.number);
        let slice = (ctx.lock.poll * 10).clamp(Duration::from_secs(5), Duration::from_secs(60));
        // A pause (or the bot's removal) ends the slice as shutdown would — in-flight
        // pages settle and commit, unfetched leases go back — without ending the runner.
        let stop_slice = shutdown.child_token();
        let watch = tokio::spawn(watch_for_pause(
            ctx.store.clone(),
            self.bot.id.clone(),
            ctx.lock.poll,
            stop_slice.clone(),
        ));
        let end = crawler.crawl_for(pass, slice, &stop_slice).await;
        watch.abort();
        Ok(match end? {
            SliceEnd::Finished(_) => CrawlTurn::Finished,
            SliceEnd::Idle => CrawlTurn::Idle,
            SliceEnd::TimeUp => CrawlTurn::TimeUp,
            SliceEnd::Shutdown if shutdown.is_cancelled() => CrawlTurn::Shutdown,
            SliceEnd::Shutdown => CrawlTurn::TimeUp,
        })
    }
}

/// Cancels `stop` once the bot is paused or its document is gone (its flag read every `poll`).
pub(super) async fn watch_for_pause(
    store: Store,
    bot: BotId,
    poll: Duration,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
        // Only the flag: the document's seeds and history are not read every poll of a slice.
        match store.bots().paused(&bot).await {
            Ok(Some(true)) => {
                info!(%bot, "paused: the in-flight pages settle, nothing more is leased");
                stop.cancel();
                return;
            }
            Ok(None) => {
                stop.cancel();
                return;
            }
            _ => {}
        }
    }
}

/// What a pass started on `spec` records of it: the spec, and whether the pass re-extracts every
/// record because the pass `before` it ran on another spec (an unchanged page answering 304, or
/// an item whose listing did not change, would keep what the old rules extracted). A bot from a
/// config file has no spec, and keeps nothing of an earlier pass's.
pub(super) fn pass_spec(spec: Option<&BotSpec>, before: Option<&BotSpec>) -> PassSpec {
    PassSpec {
        spec: spec.cloned(),
        refetch: spec.is_some_and(|spec| before.is_some_and(|before| before != spec)),
    }
}

/// What a crawl turn does with the pass the document shows.
#[derive(Debug, PartialEq)]
pub(super) enum TurnPlan {
    /// Start a pass on `seeds`: the bot's first (`after` its pass number, 0 when it has none),
    /// or the next after `after`, which is over.
    Start {
        which: Starting,
        after: PassNumber,
        seeds: Vec<String>,
    },
    /// Take over the deletion evaluation of `pass`, whose claim ran out at `claimed_until`.
    ResumeEvaluation {
        pass: PassNumber,
        claimed_until: DateTime<Utc>,
    },
    /// Nothing to crawl: the pass is over.
    Finished,
    /// Crawl the running pass for a slice.
    Crawl(Pass),
}

/// The crawl turn for `pass` at `now` (server time), for a run that lasts `until`.
pub(super) fn plan_turn(pass: PassState, until: Until, now: DateTime<Utc>) -> TurnPlan {
    match pass {
        // A refresh came while the pass ran: the next pass starts now that it is over (not for
        // `run --once`, whose pass is the one that just finished).
        PassState::Finished {
            number,
            next: Some(seeds),
            ..
        } if until == Until::Shutdown => TurnPlan::Start {
            which: Starting::Next,
            after: number,
            seeds,
        },
        // The instance that ended the pass stopped before its evaluation did.
        PassState::Finished {
            number,
            evaluation_claimed_until: Some(claimed_until),
            ..
        } if claimed_until <= now => TurnPlan::ResumeEvaluation {
            pass: number,
            claimed_until,
        },
        PassState::Finished { .. } => TurnPlan::Finished,
        PassState::NotStarted { seeds, current } => TurnPlan::Start {
            which: Starting::First,
            after: current,
            seeds,
        },
        PassState::Running(pass) => TurnPlan::Crawl(pass),
    }
}

/// What the loop does after a crawl turn.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum AfterTurn {
    /// The run ends: shutdown, or the pass finished for `run --once`.
    End,
    /// Read the document again at once (a pass started, or the slice ran out).
    StepAgain,
    /// Others hold the rest of the pass: look again soon.
    LookAgainSoon,
    /// Nothing to do until the document changes or a refresh is due.
    Idle,
}

/// What the loop does after `turn`, for a run that lasts `until`.
pub(super) fn after_turn(turn: &CrawlTurn, until: Until) -> AfterTurn {
    match turn {
        CrawlTurn::Finished if until == Until::Done => AfterTurn::End,
        CrawlTurn::Shutdown => AfterTurn::End,
        CrawlTurn::Started | CrawlTurn::TimeUp => AfterTurn::StepAgain,
        CrawlTurn::Idle => AfterTurn::LookAgainSoon,
        CrawlTurn::Finished => AfterTurn::Idle,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(minute: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, minute, 0).unwrap()
    }

    fn finished(next: Option<Vec<String>>, claimed_until: Option<DateTime<Utc>>) -> PassState {
        PassState::Finished {
            number: PassNumber::new(4),
            next,
            evaluation_claimed_until: claimed_until,
        }
    }

    fn spec(version: i64, refresh: &str) -> BotSpec {
        BotSpec {
            version,
            spec: bson::doc! { "refresh": refresh },
        }
    }

    #[test]
    fn a_pass_that_ended_with_a_refresh_waiting_starts_the_next_except_for_run_once() {
        let seeds = vec!["http://a.test/".to_owned()];
        let pass = finished(Some(seeds.clone()), None);
        assert_eq!(
            plan_turn(pass.clone(), Until::Shutdown, at(0)),
            TurnPlan::Start {
                which: Starting::Next,
                after: PassNumber::new(4),
                seeds
            }
        );
        assert_eq!(plan_turn(pass, Until::Done, at(0)), TurnPlan::Finished);
    }

    #[test]
    fn an_evaluation_is_taken_over_only_once_its_claim_ran_out() {
        let pass = finished(None, Some(at(10)));
        assert_eq!(
            plan_turn(pass.clone(), Until::Shutdown, at(9)),
            TurnPlan::Finished
        );
        assert_eq!(
            plan_turn(pass, Until::Shutdown, at(10)),
            TurnPlan::ResumeEvaluation {
                pass: PassNumber::new(4),
                claimed_until: at(10)
            }
        );
    }

    #[test]
    fn a_bot_without_a_pass_starts_its_first_and_a_running_pass_is_crawled() {
        let seeds = vec!["http://a.test/".to_owned()];
        let first = PassState::NotStarted {
            current: PassNumber::NONE,
            seeds: seeds.clone(),
        };
        assert_eq!(
            plan_turn(first, Until::Done, at(0)),
            TurnPlan::Start {
                which: Starting::First,
                after: PassNumber::NONE,
                seeds
            }
        );
        let running = Pass {
            number: PassNumber::new(2),
            started_at: Some(at(0)),
            last_run_at: None,
            seed_hosts: vec!["a.test:80".into()],
            spec: None,
            refetch: false,
            evaluated: PassNumber::NONE,
            feed_staged: PassNumber::NONE,
        };
        assert_eq!(
            plan_turn(PassState::Running(running.clone()), Until::Done, at(1)),
            TurnPlan::Crawl(running)
        );
    }

    #[test]
    fn after_a_turn_the_loop_ends_steps_again_or_waits() {
        assert_eq!(
            after_turn(&CrawlTurn::Finished, Until::Done),
            AfterTurn::End
        );
        assert_eq!(
            after_turn(&CrawlTurn::Finished, Until::Shutdown),
            AfterTurn::Idle
        );
        assert_eq!(
            after_turn(&CrawlTurn::Shutdown, Until::Shutdown),
            AfterTurn::End
        );
        assert_eq!(
            after_turn(&CrawlTurn::Started, Until::Done),
            AfterTurn::StepAgain
        );
        assert_eq!(
            after_turn(&CrawlTurn::TimeUp, Until::Shutdown),
            AfterTurn::StepAgain
        );
        assert_eq!(
            after_turn(&CrawlTurn::Idle, Until::Shutdown),
            AfterTurn::LookAgainSoon
        );
    }

    #[test]
    fn a_pass_refetches_only_when_the_spec_changed_since_the_pass_before() {
        let (one, two) = (spec(1, "daily"), spec(2, "hourly"));
        assert!(pass_spec(Some(&two), Some(&one)).refetch);
        assert!(!pass_spec(Some(&one), Some(&one)).refetch);
        assert!(
            !pass_spec(Some(&one), None).refetch,
            "a first pass has nothing to redo"
        );
        let from_file = pass_spec(None, Some(&one));
        assert_eq!((from_file.spec, from_file.refetch), (None, false));
    }
}
