//! Webhook delivery of a bot's change feed (`[bots.crawl.notify]`): each released pass's
//! events, POSTed in batches of one pass as JSON — `{"botId", "pass", "events": [...]}`, each
//! event with its `key` (`botId:pass:seq`) and the request's `Idempotency-Key` the key of its
//! first event. One instance delivers a bot's events at a time (a claim in `notifiers` that
//! another takes over once it runs out); the position is stored after each 2xx answer, so a
//! restart resumes where the last delivery ended. A failure (an error, a timeout, a non-2xx
//! answer) is retried with backoff, the same batch again: at-least-once, with keys that make
//! it exactly-once for a receiver that remembers them.

use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, Document};
use tokio_util::sync::CancellationToken;

use super::Context;
use crate::config::NotifySettings;
use crate::ids::BotId;

/// How long a claim on a bot's deliveries holds without renewal.
const HOLD: Duration = Duration::from_secs(30);

/// How often an idle notifier (nothing to deliver, or another instance delivering) looks again.
const IDLE: Duration = Duration::from_secs(2);

/// The key of an event: `botId:pass:seq`.
fn key_of(bot: &BotId, event: &Document) -> String {
    let n = |k: &str| {
        event
            .get(k)
            .and_then(crate::store::document::integer)
            .unwrap_or(0)
    };
    format!("{}:{}:{}", bot.as_str(), n("pass"), n("seq"))
}

/// The request body of one delivery.
fn body(bot: &BotId, events: &[Document]) -> serde_json::Value {
    let pass = events
        .first()
        .and_then(|e| e.get("pass"))
        .and_then(crate::store::document::integer);
    let events: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.remove("_id");
            e.insert("key", key_of(bot, &e));
            Bson::Document(e).into_relaxed_extjson()
        })
        .collect();
    serde_json::json!({ "botId": bot.as_str(), "pass": pass, "events": events })
}

/// Delivers `bot`'s released events to its webhook until `stop`.
pub(super) async fn deliver(
    ctx: Arc<Context>,
    bot: BotId,
    settings: NotifySettings,
    stop: CancellationToken,
) {
    let client = match reqwest::Client::builder()
        .timeout(settings.timeout)
        .redirect(reqwest::redirect::Policy::none())
        .default_headers(settings.headers.header_map())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(%bot, error = %e, "the webhook client does not build; no deliveries");
            return;
        }
    };
    let me = ctx.me.as_str().to_owned();
    let changes = ctx.store.changes();
    let mut failures: u32 = 0;
    let mut claimed = false;
    while !stop.is_cancelled() {
        let wait = match round(&ctx, &bot, &settings, &client, &me).await {
            Ok(Round::Delivered) => {
                claimed = true;
                failures = 0;
                Duration::ZERO
            }
            Ok(Round::Idle { holds }) => {
                claimed = holds;
                failures = 0;
                IDLE
            }
            Ok(Round::Failed(error)) => {
                claimed = true;
                failures += 1;
                tracing::warn!(%bot, failures, error = %error, "webhook delivery failed; the same batch goes again");
                crate::backoff::full_jitter(
                    Duration::from_millis(200),
                    Duration::from_secs(60),
                    failures,
                )
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(%bot, error = %e, "webhook delivery: the database did not answer");
                crate::backoff::full_jitter(
                    Duration::from_millis(200),
                    Duration::from_secs(60),
                    failures,
                )
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => {}
        }
    }
    if claimed {
        let _ = changes.release_notifier(&bot, &me).await;
    }
}

/// What one round came to.
enum Round {
    /// A batch went out and its position is stored.
    Delivered,
    /// Nothing to deliver now (`holds`: this instance holds the claim).
    Idle { holds: bool },
    /// The batch did not go through: why.
    Failed(String),
}

/// One round: claim, read the next batch, POST it, store the position.
async fn round(
    ctx: &Context,
    bot: &BotId,
    settings: &NotifySettings,
    client: &reqwest::Client,
    me: &str,
) -> crate::error::Result<Round> {
    let changes = ctx.store.changes();
    let now = ctx.clock.now();
    let Some(notifier) = changes.claim_notifier(bot, me, now, HOLD).await? else {
        return Ok(Round::Idle { holds: false });
    };
    let Some((upto, _)) = changes.watermark(bot).await? else {
        return Ok(Round::Idle { holds: true });
    };
    let lag = upto - notifier.seq;
    let events = changes
        .next_delivery(bot, notifier.seq, upto, settings.batch)
        .await?;
    let Some(last) = events.last().and_then(|e| e.get_i64("seq").ok()) else {
        ctx.metrics.webhook_delivered(bot, 0, 0);
        return Ok(Round::Idle { holds: true });
    };
    let key = key_of(bot, &events[0]);
    let sent = client
        .post(settings.url.clone())
        .header("Idempotency-Key", &key)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body(bot, &events).to_string())
        .send()
        .await;
    let failure = match sent {
        Ok(answer) if answer.status().is_success() => None,
        Ok(answer) => Some(format!("{} answered {}", settings.url, answer.status())),
        Err(e) => Some(format!(
            "{}: {}",
            settings.url,
            crate::seeds::describe_reqwest(&e)
        )),
    };
    if let Some(error) = failure {
        ctx.metrics.webhook_failed(bot, lag);
        changes.delivery_failed(bot, me, &error).await?;
        return Ok(Round::Failed(error));
    }
    if changes
        .delivered(bot, me, notifier.seq, last, ctx.clock.now())
        .await?
    {
        ctx.metrics
            .webhook_delivered(bot, events.len() as u64, upto - last);
        tracing::debug!(%bot, key, events = events.len(), "webhook delivery");
    }
    Ok(Round::Delivered)
}
