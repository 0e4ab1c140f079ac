//! `seedlock crawl BOT`'s display: a progress line (bar, pages, rate, queue, ETA) redrawn on a
//! terminal, or a plain line every few seconds when stderr is not one; and the summary printed
//! when the pass is over. Everything shown is read from the database, so the figures cover every
//! instance working on the pass, not only this one.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::ids::BotId;
use crate::store::frontier::PassProgress;
use crate::store::Store;

/// One progress line. `rate` in pages per second (finished pages: done or failed).
pub fn line(p: &PassProgress, rate: f64, width: usize) -> String {
    let finished = p.done + p.failed;
    let total = finished + p.pending + p.waiting + p.leased;
    let filled = if total == 0 {
        0
    } else {
        (finished as usize * width) / total as usize
    };
    let queue = p.pending + p.waiting;
    let eta = if p.pending + p.waiting + p.leased == 0 {
        "0s".to_owned()
    } else if rate > 0.0 {
        let secs = ((queue + p.leased) as f64 / rate).ceil() as u64;
        humantime::format_duration(Duration::from_secs(secs)).to_string()
    } else {
        "?".to_owned()
    };
    format!(
        "[{}{}] {finished}/{total} pages  {rate:.1}/s  queue {queue}  in flight {}  failed {}  ETA {eta}",
        "#".repeat(filled),
        "-".repeat(width - filled),
        p.leased,
        p.failed,
    )
}

/// Shows the bot's current pass until `done`.
pub async fn show(store: Store, bot: BotId, done: CancellationToken) {
    let tty = std::io::stderr().is_terminal();
    let every = if tty {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    // Rate over a sliding window of recent samples.
    let mut samples: std::collections::VecDeque<(std::time::Instant, u64)> = Default::default();
    loop {
        tokio::select! {
            _ = done.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
        let Ok(crate::lock::document::Observed::Valid(doc)) = store.load(&bot).await else {
            continue;
        };
        if doc.crawl_pass == 0 {
            continue;
        }
        let Ok(p) = store.pass_progress(&bot, doc.crawl_pass).await else {
            continue;
        };
        let now = std::time::Instant::now();
        samples.push_back((now, p.done + p.failed));
        while samples.len() > 2 && now - samples[0].0 > Duration::from_secs(10) {
            samples.pop_front();
        }
        let rate = match (samples.front(), samples.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                n1.saturating_sub(*n0) as f64 / (*t1 - *t0).as_secs_f64()
            }
            _ => 0.0,
        };
        let text = line(&p, rate, 30);
        let mut err = std::io::stderr().lock();
        let _ = if tty {
            write!(err, "\r{bot} pass {} {text}\x1b[K", doc.crawl_pass)
        } else {
            writeln!(err, "{bot} pass {} {text}", doc.crawl_pass)
        };
        let _ = err.flush();
    }
    if tty {
        eprintln!();
    }
}

/// The closing summary: the pass's pages by outcome, wall time and rate, and the first failures.
pub async fn summary(store: &Store, bot: &BotId, pass: i64, took: Duration) -> Result<String> {
    let p = store.pass_progress(bot, pass).await?;
    let finished = p.done + p.failed;
    let mut text = format!(
        "{bot} pass={pass} finished: {finished} pages ({} done, {} failed) in {:.1} s, {:.1} pages/s",
        p.done,
        p.failed,
        took.as_secs_f64(),
        finished as f64 / took.as_secs_f64().max(1e-3),
    );
    for (url, reason) in store.failed_urls(bot, pass, 5).await? {
        text.push_str(&format!("\n  failed: {url} — {reason}"));
    }
    if p.failed > 5 {
        text.push_str(&format!("\n  … and {} more failed", p.failed - 5));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_shows_progress_rate_queue_and_eta() {
        let p = PassProgress {
            pending: 40,
            waiting: 10,
            leased: 10,
            done: 35,
            failed: 5,
        };
        let text = line(&p, 20.0, 10);
        assert_eq!(
            text,
            "[####------] 40/100 pages  20.0/s  queue 50  in flight 10  failed 5  ETA 3s"
        );
        let finished = PassProgress {
            done: 7,
            ..Default::default()
        };
        assert!(line(&finished, 0.0, 4).starts_with("[####] 7/7 pages"));
        assert!(line(&finished, 0.0, 4).ends_with("ETA 0s"));
        let stalled = PassProgress {
            pending: 1,
            ..Default::default()
        };
        assert!(line(&stalled, 0.0, 4).ends_with("ETA ?"));
    }
}
