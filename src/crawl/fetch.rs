//! The fetch stage: one task per admitted URL reads its host's robots.txt (once per host),
//! then the page ([`Fetcher::step`]); a redirect is followed hop by hop, each hop judged as a
//! link is (`fetch::next_hop`) and sent through its own host's robots.txt and flow control.
//! The host's limiter learns from every answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::shared::Shared;
use crate::flow::robots::{RobotsCache, Verdict};
use crate::flow::{Admission, Busy, HostPermit, Signal};
use crate::http_client::{next_hop, FetchOutcome, HttpClient, Validators};
use crate::store::frontier::{PageKind, UrlLease};
use crate::urls::NormalizedUrl;

/// A fetch stage's answer for one leased URL.
#[derive(Debug)]
pub(crate) enum Fetched {
    Outcome(FetchOutcome),
    /// robots.txt disallows the URL.
    Disallowed,
    /// robots.txt could not be read: the host is paused and the URL goes back without an
    /// attempt counted.
    HostPaused {
        wait: Duration,
        reason: String,
    },
    /// Shutdown came first: the URL goes back.
    Released,
}

/// The fetch stage: the page client with the bot's headers, robots.txt, and how many requests
/// it sent.
pub(crate) struct Fetcher {
    shared: Arc<Shared>,
    client: HttpClient,
    robots: Arc<RobotsCache>,
    /// Page requests sent (requests per stored record is seed 000's health signal).
    requests: AtomicU64,
}

impl Fetcher {
    pub(crate) fn new(shared: Arc<Shared>, client: HttpClient, robots: Arc<RobotsCache>) -> Self {
        Self {
            shared,
            client,
            robots,
            requests: AtomicU64::new(0),
        }
    }

    /// Page requests sent so far.
    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// The sitemaps `origin`'s robots.txt names, asked with the bot's client.
    pub(crate) async fn robots_sitemaps(&self, origin: &str) -> Result<Vec<String>, String> {
        self.robots.sitemaps(&self.client, origin).await
    }

    /// The fetch stage for one admitted URL: robots.txt, then the page (raced against
    /// shutdown); the host's limiter learns from the answer. A redirect is followed hop by hop,
    /// each hop judged before it is requested: out of the bot's scope (or its allow/deny
    /// patterns) the page fails (`redirect out of scope: HOST`) and that host hears nothing; an
    /// in-scope hop goes through its host's robots.txt and flow control like any page.
    pub(crate) async fn step(
        &self,
        lease: &UrlLease,
        permit: HostPermit,
        shutdown: &CancellationToken,
    ) -> Fetched {
        // A new pass starts with a fresh cookie jar (when the bot keeps cookies).
        self.client.enter_pass(lease.pass.get());
        let mut url = lease.url.clone();
        let mut permit = permit;
        // Listing pages are read every pass (their items are the pass's evidence of what
        // exists); only detail pages are fetched conditionally — and only at the first hop.
        let mut validators = match lease.kind {
            PageKind::Detail => lease.validators.clone(),
            PageKind::List | PageKind::Seed => Validators::default(),
        };
        for hop in 0.. {
            let outcome = match self.fetch_hop(&url, permit, &validators, shutdown).await {
                Ok(outcome) => outcome,
                Err(other) => return other,
            };
            let FetchOutcome::Redirect { status, to } = outcome else {
                return Fetched::Outcome(outcome);
            };
            if let Err(reason) = next_hop(&self.shared.rules.links, hop, &to) {
                debug!(bot = %self.shared.bot, from = %url, %to, status, %reason, "redirect not followed");
                return Fetched::Outcome(FetchOutcome::Permanent { reason });
            }
            debug!(bot = %self.shared.bot, from = %url, %to, status, "following a redirect");
            permit = match self.admit(&to.host_port(), lease, shutdown).await {
                Some(permit) => permit,
                None => return Fetched::Released,
            };
            url = to;
            validators = Validators::default();
        }
        unreachable!("every hop returns or goes on")
    }

    /// One request of a fetch, on `url`'s host, whose `permit` it holds: robots.txt, then the
    /// page. `Err` ends the fetch as it says (disallowed, the host paused, shutdown).
    async fn fetch_hop(
        &self,
        url: &NormalizedUrl,
        permit: HostPermit,
        validators: &Validators,
        shutdown: &CancellationToken,
    ) -> std::result::Result<FetchOutcome, Fetched> {
        let host = permit.host().to_owned();
        match self.robots.check(&self.client, url).await {
            Verdict::Allowed { crawl_delay } => {
                if let Some(delay) = crawl_delay {
                    self.shared.flow.set_crawl_delay(&host, delay);
                }
            }
            Verdict::Disallowed => {
                permit.finish(Signal::Neutral);
                return Err(Fetched::Disallowed);
            }
            Verdict::Unavailable { reason } => {
                let wait = self.shared.limits.robots_retry;
                self.shared.flow.pause(&host, Instant::now() + wait);
                permit.finish(Signal::Neutral);
                warn!(bot = %self.shared.bot, %host, %reason, ?wait, "host paused");
                return Err(Fetched::HostPaused { wait, reason });
            }
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.shared.metrics.page_requested(&self.shared.bot);
        let started = Instant::now();
        self.shared.flow.sending(&host, started);
        let outcome = tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                permit.finish(Signal::Neutral);
                return Err(Fetched::Released);
            }
            outcome = self.client.fetch_one(url, validators) => outcome,
        };
        permit.finish(match &outcome {
            FetchOutcome::Throttled { retry_after, .. } => Signal::Throttled {
                retry_after: *retry_after,
            },
            FetchOutcome::Timeout => Signal::Timeout,
            // A connection refused or reset says nothing about how much the host can take.
            FetchOutcome::Transient { reason } if !reason.starts_with("HTTP ") => Signal::Neutral,
            _ => Signal::Answered {
                latency: started.elapsed(),
            },
        });
        Ok(outcome)
    }

    /// Waits until `host`'s limiter admits one more request for a redirect of `lease` (as a
    /// retry would be: it is the same page's fetch going on). `None` at shutdown, while the host
    /// is paused, or once the lease has run out (no fetch starts on an expired lease).
    async fn admit(
        &self,
        host: &str,
        lease: &UrlLease,
        shutdown: &CancellationToken,
    ) -> Option<HostPermit> {
        loop {
            if self.shared.clock.now() >= lease.expires_at {
                return None;
            }
            let share = self
                .shared
                .flow
                .fair_share(self.shared.limits.workers, [host]);
            let wait = match self
                .shared
                .flow
                .try_admit(host, false, Instant::now(), share)
            {
                Admission::Admitted(permit) => return Some(permit),
                Admission::Wait {
                    why: Busy::Paused, ..
                } => return None,
                Admission::Wait { until, .. } => until
                    .map(|u| u.saturating_duration_since(Instant::now()))
                    .unwrap_or(Duration::from_millis(20))
                    .clamp(Duration::from_millis(5), Duration::from_secs(1)),
            };
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}
