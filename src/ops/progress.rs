//! The progress of a running pass: its expected size and ETA (shared by `seedlock crawl`,
//! `status` and the status page), `crawl`'s display — one `indicatif` bar per bot on a terminal
//! (also `run --once`'s), a plain line every few seconds when stderr is not one — and the summary
//! printed when the pass is over. Everything shown is read from the database, so the figures
//! cover every instance working on the pass, not only this one.

use crate::ids::PassNumber;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::ids::BotId;
use crate::lock::bot::Observed;
use crate::store::frontier::PassProgress;
use crate::store::Store;

/// How many pages a running pass will have, as far as anyone can tell: a pass discovers its pages
/// as it reads them, so the frontier's count alone is always too small until the very end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PassSize {
    /// Expected from the last completed pass (`crawlLastPass.pages`), or what this pass has
    /// discovered so far where that is already more.
    Expected(u64),
    /// No pass has completed yet: the pages discovered so far; more may come.
    Discovering(u64),
}

impl PassSize {
    pub(crate) fn of(p: &PassProgress, last_pass_pages: Option<u64>) -> PassSize {
        let so_far = p.done + p.failed + p.pending + p.waiting + p.leased;
        match last_pass_pages {
            Some(last) if last > 0 => PassSize::Expected(last.max(so_far)),
            _ => PassSize::Discovering(so_far),
        }
    }

    pub(crate) fn pages(self) -> u64 {
        match self {
            PassSize::Expected(n) | PassSize::Discovering(n) => n,
        }
    }

    /// `"~525"` (expected) or `"200+"` (still being discovered).
    pub(crate) fn label(self) -> String {
        match self {
            PassSize::Expected(n) => format!("~{n}"),
            PassSize::Discovering(n) => format!("{n}+"),
        }
    }
}

/// When a running pass will end, at `rate` finished pages per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eta {
    /// Nothing pending, waiting or leased by anyone: the pass is over.
    Done,
    /// The expected pages left, at the current rate.
    In(Duration),
    /// The pages discovered so far, at the current rate: the total is still being discovered.
    AtLeast(Duration),
    /// Nothing finished lately: no rate to go by.
    Unknown,
}

impl Eta {
    pub(crate) fn of(p: &PassProgress, size: PassSize, rate: f64) -> Eta {
        if p.is_finished() {
            return Eta::Done;
        }
        let finished = p.done + p.failed;
        let open = p.pending + p.waiting + p.leased;
        if rate <= 0.0 || !rate.is_finite() {
            return Eta::Unknown;
        }
        let secs = |pages: u64| Duration::from_secs((pages as f64 / rate).ceil() as u64);
        match size {
            PassSize::Expected(total) => Eta::In(secs(total.saturating_sub(finished).max(open))),
            PassSize::Discovering(_) => Eta::AtLeast(secs(open)),
        }
    }

    /// Seconds, for `status --json` (`None` when unknown); a lower bound for [`Eta::AtLeast`].
    pub(crate) fn seconds(self) -> Option<u64> {
        match self {
            Eta::Done => Some(0),
            Eta::In(d) | Eta::AtLeast(d) => Some(d.as_secs()),
            Eta::Unknown => None,
        }
    }
}

impl std::fmt::Display for Eta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let human = |d: &Duration| humantime::format_duration(*d).to_string();
        match self {
            Eta::Done => f.write_str("0s"),
            Eta::In(d) => f.write_str(&human(d)),
            Eta::AtLeast(d) => write!(f, "≥{} (total still being discovered)", human(d)),
            Eta::Unknown => f.write_str("?"),
        }
    }
}

/// What a progress display shows of one bot's pass, besides its bar.
fn figures(p: &PassProgress, size: PassSize, rate: f64) -> String {
    format!(
        "{rate:.1}/s  queue {}  in flight {}  failed {}  ETA {}",
        p.pending + p.waiting,
        p.leased,
        p.failed,
        Eta::of(p, size, rate),
    )
}

/// One plain progress line (stderr not a terminal). `rate` in pages per second (finished pages:
/// done or failed).
pub(crate) fn line(p: &PassProgress, size: PassSize, rate: f64, width: usize) -> String {
    let finished = p.done + p.failed;
    let total = size.pages();
    let filled = if total == 0 {
        0
    } else {
        ((finished.min(total) as usize) * width) / total as usize
    };
    format!(
        "[{}{}] {finished}/{} pages  {}",
        "#".repeat(filled),
        "-".repeat(width - filled),
        size.label(),
        figures(p, size, rate),
    )
}

/// Finished pages per second over a sliding window of recent samples.
#[derive(Default)]
struct Rate {
    samples: std::collections::VecDeque<(Instant, u64)>,
}

impl Rate {
    fn add(&mut self, at: Instant, finished: u64) -> f64 {
        self.samples.push_back((at, finished));
        while self.samples.len() > 2 && at - self.samples[0].0 > Duration::from_secs(10) {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                n1.saturating_sub(*n0) as f64 / (*t1 - *t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

static BARS: std::sync::OnceLock<MultiProgress> = std::sync::OnceLock::new();

/// The terminal's progress bars (drawn on stderr).
fn bars() -> &'static MultiProgress {
    BARS.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// The log's stderr writer: one event per writer, written above the progress bars (hidden for
/// the write and redrawn after it) while there are any, so the two never garble each other.
pub(crate) fn log_writer() -> LogLine {
    LogLine(Vec::new())
}

pub(crate) struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let line = std::mem::take(&mut self.0);
        let write = || {
            let _ = std::io::stderr().lock().write_all(&line);
        };
        match BARS.get() {
            Some(bars) => bars.suspend(write),
            None => write(),
        }
    }
}

/// Shows each bot's current pass until `done`: on a terminal one `indicatif` bar per bot (fitted
/// to the terminal's width, redrawn in place); otherwise a plain line per bot every 5 s.
/// Everything shown is read from the database, so it covers every instance on the pass.
pub(crate) async fn show(store: Store, bots: Vec<BotId>, done: CancellationToken) {
    let tty = std::io::stderr().is_terminal();
    let every = if tty {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    let style = ProgressStyle::with_template("{prefix} [{bar:24}] {pos}/{msg}")
        .expect("a valid template")
        .progress_chars("#>-");
    let mut shown: Vec<(BotId, Rate, Option<ProgressBar>)> = bots
        .into_iter()
        .map(|b| (b, Rate::default(), None))
        .collect();
    loop {
        // After `done`, one last draw: the bars end on the pass's final figures.
        let last = tokio::select! {
            _ = done.cancelled() => true,
            _ = tokio::time::sleep(every) => false,
        };
        for (bot, rate, bar) in &mut shown {
            if last && bar.is_none() {
                continue;
            }
            let Ok(Observed::Valid(doc)) = store.bots().load(bot).await else {
                continue;
            };
            if doc.crawl_pass == PassNumber::NONE {
                continue;
            }
            let Ok(p) = store.frontier().pass_progress(bot, doc.crawl_pass).await else {
                continue;
            };
            let rate = rate.add(Instant::now(), p.done + p.failed);
            let size = PassSize::of(&p, doc.crawl_last_pass_pages);
            if tty {
                let bar = bar.get_or_insert_with(|| {
                    let bar = bars().add(ProgressBar::no_length());
                    bar.set_style(style.clone());
                    bar
                });
                bar.set_prefix(format!("{bot} pass {}", doc.crawl_pass));
                bar.set_length(size.pages().max(p.done + p.failed));
                bar.set_position(p.done + p.failed);
                bar.set_message(format!(
                    "{} pages  {}",
                    size.label(),
                    figures(&p, size, rate)
                ));
            } else {
                let mut err = std::io::stderr().lock();
                let _ = writeln!(
                    err,
                    "{bot} pass {} {}",
                    doc.crawl_pass,
                    line(&p, size, rate, 30)
                );
                let _ = err.flush();
            }
        }
        if last {
            break;
        }
    }
    for (_, _, bar) in shown {
        if let Some(bar) = bar {
            bar.abandon();
        }
    }
}

/// The summary line of a finished pass, then its failures grouped by reason; and the failures,
/// for the caller to judge ([`Failures::too_many`]).
pub(crate) async fn summary(
    store: &Store,
    bot: &BotId,
    pass: PassNumber,
    took: Duration,
) -> Result<(String, Failures)> {
    let p = store.frontier().pass_progress(bot, pass).await?;
    let finished = p.done + p.failed;
    let mut text = format!(
        "{bot} pass={pass} finished: {finished} pages ({} done, {} failed) in {:.1} s, {:.1} pages/s",
        p.done,
        p.failed,
        took.as_secs_f64(),
        finished as f64 / took.as_secs_f64().max(1e-3),
    );
    let failures = failures(store, bot, pass).await?;
    text.push_str(&failures.lines());
    Ok((text, failures))
}

/// Reasons shown per pass; the rest are counted.
const REASONS_SHOWN: i64 = 5;

/// A pass's failed pages, grouped by reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Failures {
    pub bot: BotId,
    pub pass: PassNumber,
    /// Every URL of the pass (the error rate's denominator, as the deletion gate counts it).
    pub pages: u64,
    pub failed: u64,
    /// The most common reasons first (at most `REASONS_SHOWN`).
    pub reasons: Vec<crate::store::frontier::FailureReason>,
}

/// Reads pass `pass`'s failures: its counts as its end recorded them (else counted on the
/// frontier), the reasons in one aggregation of its failed entries.
pub async fn failures(store: &Store, bot: &BotId, pass: PassNumber) -> Result<Failures> {
    let p = match store.passes().recorded_progress(bot, pass).await? {
        Some(recorded) => recorded,
        None => store.frontier().pass_progress(bot, pass).await?,
    };
    let reasons = if p.failed > 0 {
        store
            .frontier()
            .failure_reasons(bot, pass, REASONS_SHOWN)
            .await?
    } else {
        Vec::new()
    };
    Ok(Failures {
        bot: bot.clone(),
        pass,
        pages: p.pending + p.waiting + p.leased + p.done + p.failed,
        failed: p.failed,
        reasons,
    })
}

impl Failures {
    /// One line per reason: `  failed: 12 × HTTP 500 — e.g. http://shop/product/7`, then how
    /// many failed for other reasons.
    pub(crate) fn lines(&self) -> String {
        let mut out = String::new();
        for r in &self.reasons {
            out.push_str(&format!(
                "\n  failed: {} × {} — e.g. {}",
                r.count, r.reason, r.example
            ));
        }
        let shown: u64 = self.reasons.iter().map(|r| r.count).sum();
        if self.failed > shown {
            out.push_str(&format!(
                "\n  … and {} more failed for other reasons",
                self.failed - shown
            ));
        }
        out
    }

    /// The share of the pass's pages that failed.
    pub(crate) fn error_rate(&self) -> f64 {
        if self.pages == 0 {
            0.0
        } else {
            self.failed as f64 / self.pages as f64
        }
    }

    /// One line when the error rate is over `max_error_rate` (`crawl.max_error_rate`, the
    /// deletion gate's threshold), naming the most common reason; `None` otherwise.
    pub(crate) fn too_many(&self, max_error_rate: f64) -> Option<String> {
        let rate = self.error_rate();
        if rate <= max_error_rate {
            return None;
        }
        let common = self.reasons.first().map_or(String::new(), |r| {
            format!(
                "; most common: {} ({} pages, e.g. {})",
                r.reason, r.count, r.example
            )
        });
        Some(format!(
            "bot {}: pass {} failed {} of {} pages ({:.1}%, over crawl.max_error_rate {:.1}%){common}",
            self.bot,
            self.pass,
            self.failed,
            self.pages,
            rate * 100.0,
            max_error_rate * 100.0
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(pending: u64, waiting: u64, leased: u64, done: u64, failed: u64) -> PassProgress {
        PassProgress {
            pending,
            waiting,
            leased,
            done,
            failed,
        }
    }

    #[test]
    fn failures_are_grouped_and_too_many_names_the_most_common_reason() {
        use crate::store::frontier::FailureReason;
        let reason = |reason: &str, count, example: &str| FailureReason {
            reason: reason.into(),
            count,
            example: example.into(),
        };
        let f = Failures {
            bot: BotId::parse("shop").unwrap(),
            pass: PassNumber::new(3),
            pages: 105,
            failed: 101,
            reasons: vec![reason(
                "no natural key (.skuu) on the page",
                100,
                "http://s/product/1",
            )],
        };
        assert_eq!(
            f.lines(),
            "\n  failed: 100 × no natural key (.skuu) on the page — e.g. http://s/product/1\n  … and 1 more failed for other reasons"
        );
        assert_eq!(
            f.too_many(0.1).as_deref(),
            Some("bot shop: pass 3 failed 101 of 105 pages (96.2%, over crawl.max_error_rate 10.0%); most common: no natural key (.skuu) on the page (100 pages, e.g. http://s/product/1)")
        );
        assert_eq!(f.too_many(0.97), None, "under the threshold: not too many");
        let clean = Failures {
            failed: 0,
            reasons: vec![],
            ..f
        };
        assert_eq!((clean.lines(), clean.too_many(0.0)), (String::new(), None));
    }

    #[test]
    fn a_pass_after_a_completed_one_expects_the_last_pass_size_and_counts_down_to_it() {
        // 40 finished of a shop whose last pass had 525 pages; 60 discovered and open so far.
        let p = progress(40, 10, 10, 35, 5);
        let size = PassSize::of(&p, Some(525));
        assert_eq!(size, PassSize::Expected(525));
        assert_eq!(Eta::of(&p, size, 20.0), Eta::In(Duration::from_secs(25)));
        assert_eq!(
            line(&p, size, 20.0, 10),
            "[----------] 40/~525 pages  20.0/s  queue 50  in flight 10  failed 5  ETA 25s"
        );
        // Discovering more than the last pass had: what is known now is the better estimate.
        let bigger = progress(600, 0, 0, 100, 0);
        assert_eq!(PassSize::of(&bigger, Some(525)), PassSize::Expected(700));
        assert_eq!(
            Eta::of(&bigger, PassSize::of(&bigger, Some(525)), 100.0),
            Eta::In(Duration::from_secs(6))
        );
    }

    #[test]
    fn a_first_pass_says_its_total_is_still_being_discovered_and_gives_only_a_lower_bound() {
        // The 3,060-page shop at 4 s: 300 found, 200 finished. The old display said "ETA 1s".
        let p = progress(90, 0, 10, 200, 0);
        let size = PassSize::of(&p, None);
        assert_eq!(size, PassSize::Discovering(300));
        let eta = Eta::of(&p, size, 130.0);
        assert_eq!(eta, Eta::AtLeast(Duration::from_secs(1)));
        assert_eq!(eta.to_string(), "≥1s (total still being discovered)");
        assert_eq!(
            line(&p, size, 130.0, 10),
            "[######----] 200/300+ pages  130.0/s  queue 90  in flight 10  failed 0  ETA ≥1s (total still being discovered)"
        );
        // A last pass recorded as 0 pages tells nothing either.
        assert_eq!(PassSize::of(&p, Some(0)), PassSize::Discovering(300));
    }

    #[test]
    fn an_eta_is_done_when_nothing_is_open_and_unknown_without_a_rate() {
        let finished = progress(0, 0, 0, 7, 0);
        assert_eq!(
            Eta::of(&finished, PassSize::of(&finished, Some(9)), 0.0),
            Eta::Done
        );
        assert!(
            line(&finished, PassSize::of(&finished, None), 0.0, 4).starts_with("[####] 7/7+ pages")
        );
        let stalled = progress(1, 0, 0, 0, 0);
        assert_eq!(
            Eta::of(&stalled, PassSize::of(&stalled, Some(9)), 0.0),
            Eta::Unknown
        );
        assert_eq!(Eta::Unknown.seconds(), None);
        assert_eq!(Eta::AtLeast(Duration::from_secs(4)).seconds(), Some(4));
    }
}
