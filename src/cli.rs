//! The command line: parsing (clap), logging set-up, and one function per command. Errors end
//! here as one line on stderr and an exit code: 0 done, 1 the command failed, 2 bad usage, bad
//! config or unreachable database.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{LogFormat, Settings};
use crate::daemon::{self, Mode, RunError};
use crate::ids::BotId;
use crate::ids::PassNumber;
use crate::ops::bots::BotsCommand;
use crate::ops::{admin_name, bot_arg, fail, with_store, EXIT_FAILED, EXIT_USAGE};
use crate::store::Store;
use crate::store::UnlockOutcome;

#[derive(Debug, Parser)]
#[command(
    name = "seedlock",
    version,
    about = "Crawler bots that coordinate through MongoDB documents"
)]
pub struct Cli {
    /// The TOML config file.
    #[arg(
        long,
        short,
        env = "SEEDLOCK_CONFIG",
        default_value = "seedlock.toml",
        global = true
    )]
    pub config: PathBuf,
    /// Log format, overriding `log.format`.
    #[arg(long, value_enum, global = true)]
    pub log_format: Option<LogFormatArg>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormatArg {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run every configured bot's state machine (the daemon).
    Run {
        /// Run each bot until it is Ready, print a summary line per bot, and exit 0.
        #[arg(long)]
        once: bool,
        /// With --once: give up (exit 1) if not every bot is Ready by then.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Do not read or honour robots.txt (for crawling one's own sites; off by default).
        #[arg(long)]
        ignore_robots: bool,
    },
    /// Crawl one bot now, interactively: run it until its current pass is finished, with a
    /// progress bar (pages, rate, queue, ETA) on stderr, then print a summary.
    Crawl {
        bot: String,
        /// Give up (exit 1) if the pass is not finished by then.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Do not read or honour robots.txt (for crawling one's own sites).
        #[arg(long)]
        ignore_robots: bool,
    },
    /// Fetch one page as BOT's crawl would (its user agent, headers, robots.txt, redirects
    /// within scope) and print what the crawl would take from it: the listing's items, the links
    /// it would follow and those it would not (with why), or the record; every selector that
    /// matched nothing is named. Exit 0 when the page yields what its kind needs, 1 otherwise.
    Try {
        /// A bot of the config file, or of the database.
        bot: String,
        /// The page (with --file: the URL it was saved from).
        url: Option<String>,
        /// Read a saved page instead of fetching it (give its URL too: URL or --url).
        #[arg(long)]
        file: Option<PathBuf>,
        /// The URL a saved page came from.
        #[arg(long = "url", value_name = "URL")]
        from_url: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Do not read or honour robots.txt.
        #[arg(long)]
        ignore_robots: bool,
    },
    /// The fleet's summary, then each bot's state, holder, epoch, lock age, seeds, last refresh and
    /// last error, those that need a look first. Past a screenful of bots only those that need a
    /// look are listed.
    Status {
        #[arg(long)]
        json: bool,
        /// List every bot, however many.
        #[arg(long)]
        all: bool,
    },
    /// Print one bot's document and its history.
    Inspect { bot: String },
    /// Force-unlock a bot: clears its lock and raises its epoch so the old holder's writes fail.
    Unlock {
        bot: String,
        #[arg(long, default_value = "manual unlock")]
        reason: String,
    },
    /// Ask for a refresh of a bot's seeds at the next opportunity.
    Refresh { bot: String },
    /// Bot definitions kept in the database (for instances whose config has no [[bots]]).
    // The help text names the TOML table as an operator writes it, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    Bots {
        #[command(subcommand)]
        command: BotsCommand,
    },
    /// Pause a bot on every instance: no lock taken, no URL leased; in-flight pages finish.
    Pause {
        bot: String,
        #[arg(long, default_value = "paused by an operator")]
        reason: String,
    },
    /// Resume a paused bot: its pass continues where it stopped.
    Resume { bot: String },
    /// Stream a bot's records to stdout (constant memory).
    Export {
        bot: String,
        #[arg(long, value_enum, default_value = "jsonl")]
        format: crate::ops::export::Format,
        /// Only records whose content changed at or after this time (RFC 3339, e.g. 2026-12-01T00:00:00Z).
        #[arg(long, value_parser = rfc3339)]
        changed_since: Option<chrono::DateTime<chrono::Utc>>,
        /// Also the records marked removed.
        #[arg(long)]
        include_removed: bool,
        /// The change feed's released events instead of the records (needs --since-pass): JSON
        /// lines as `seedlock changes --json` prints them, or CSV with one row per changed field.
        #[arg(long, requires = "since_pass", conflicts_with_all = ["changed_since", "include_removed"])]
        delta: bool,
        /// With --delta: the events of this pass and every later released one.
        #[arg(long, requires = "delta")]
        since_pass: Option<i64>,
    },
    /// A bot's change feed: each released event (added, changed with each field's old and new
    /// value, removed, restored) with its sequence number, oldest first. Events of a pass appear
    /// once the pass is released.
    Changes {
        bot: String,
        /// Only events after this sequence number (the last one a reader saw).
        #[arg(long, conflicts_with = "since_pass")]
        since: Option<i64>,
        /// Only events of this pass and later ones.
        #[arg(long)]
        since_pass: Option<i64>,
        /// Then wait for each next release and print it, until interrupted.
        #[arg(long)]
        follow: bool,
        /// JSON lines (the event documents).
        #[arg(long)]
        json: bool,
    },
    /// Settle a pass the drift gate withheld (see `seedlock status`).
    Pass {
        #[command(subcommand)]
        command: PassCommand,
    },
    /// Serve the demo shop: listing and product pages, a seed source (/seeds.txt, /seeds.json,
    /// /sitemap.xml) and control endpoints (/__mutate, /__faults, /__stats, /__truth). Needs no config.
    DemoSite {
        /// Address to listen on (port 0 picks a free port; the bound address is printed).
        #[arg(long, default_value = "127.0.0.1:8000")]
        addr: String,
        /// Listing pages at the start.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        lists: u32,
        /// Products per listing page.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        per_list: u32,
        /// Seed of the catalogue and of every mutation (same seed, same site).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// SKUs are PREFIX-0000001…: give shops on different ports different prefixes.
        #[arg(long, default_value = "SKU", value_parser = sku_prefix)]
        sku_prefix: String,
        /// Product URLs per file of the gzipped sitemaps (/sitemaps/index.xml.gz).
        #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u32).range(1..=50_000))]
        sitemap_urls: u32,
        /// Serve a crawl trap: listing pages link to an endless calendar (/calendar/2026-01).
        #[arg(long)]
        calendar: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum PassCommand {
    /// Release a gated pass: its change events become visible and the removals it held back
    /// apply (while it is the bot's latest pass).
    Release { bot: String, pass: i64 },
    /// Discard a gated pass: its change events are deleted and nothing it held back is removed;
    /// its records keep the values it read.
    Discard { bot: String, pass: i64 },
}

fn rfc3339(raw: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("{raw:?} is not an RFC 3339 time such as 2026-12-01T00:00:00Z ({e})"))
}

pub fn main(cli: Cli) -> ExitCode {
    if let Command::DemoSite {
        addr,
        lists,
        per_list,
        seed,
        sku_prefix,
        sitemap_urls,
        calendar,
    } = &cli.command
    {
        init_tracing(LogFormat::Text, "info");
        let options = crate::demo_site::SiteOptions {
            lists: *lists,
            per_list: *per_list,
            seed: *seed,
            sku_prefix: sku_prefix.clone(),
            sitemap_urls: *sitemap_urls,
            calendar: *calendar,
        };
        return demo_site(addr, options);
    }
    let settings = match Settings::load(&cli.config) {
        Ok(s) => s,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let format = match cli.log_format {
        Some(LogFormatArg::Json) => LogFormat::Json,
        Some(LogFormatArg::Text) => LogFormat::Text,
        None => settings.log.format,
    };
    init_tracing(format, &settings.log.level);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(EXIT_FAILED, format!("cannot start the runtime: {e}")),
    };
    runtime.block_on(dispatch(cli.command, settings))
}

fn init_tracing(format: LogFormat, level: &str) {
    use tracing_subscriber::EnvFilter;
    let spec = std::env::var("SEEDLOCK_LOG")
        .ok()
        .filter(|v| EnvFilter::try_new(v).is_ok())
        .unwrap_or_else(|| level.to_owned());
    use std::io::IsTerminal;
    // Cookie values are secrets: the cookie jar's library logs each cookie it stores at
    // `debug`, so its records never pass, whatever the filter asks.
    let mut filter = EnvFilter::new(&spec);
    if let Ok(silenced) = "cookie_store=off".parse() {
        filter = filter.add_directive(silenced);
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::ops::progress::log_writer)
        .with_ansi(std::io::stderr().is_terminal());
    let initialized = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    if initialized.is_ok() {
        // The `log` records of the libraries (the HTML parser logs each token at `debug`) are
        // bridged into the filter, which the bridge sizes by the most verbose directive, ours
        // included: `seedlock::crawl=debug` would make every token of every page ask the filter.
        // Seedlock logs only through `tracing`, so its own directives do not open the bridge.
        log::set_max_level(log::max_level().min(bridged_log_level(&spec)));
    }
}

/// The most verbose level a log filter (`EnvFilter` directives) lets through for targets other
/// than seedlock's own: what the `log` records of the libraries may need.
fn bridged_log_level(spec: &str) -> log::LevelFilter {
    use std::str::FromStr;
    use tracing_subscriber::filter::LevelFilter;
    let as_log = |level: LevelFilter| match level.into_level() {
        None => log::LevelFilter::Off,
        Some(tracing::Level::ERROR) => log::LevelFilter::Error,
        Some(tracing::Level::WARN) => log::LevelFilter::Warn,
        Some(tracing::Level::INFO) => log::LevelFilter::Info,
        Some(tracing::Level::DEBUG) => log::LevelFilter::Debug,
        Some(tracing::Level::TRACE) => log::LevelFilter::Trace,
    };
    let mut most = log::LevelFilter::Off;
    for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (target, level) = match directive.rsplit_once('=') {
            // `target[span{field=value}]` with no level of its own is a target: everything.
            Some((target, level)) if !level.contains(']') => (Some(target), level),
            _ => match LevelFilter::from_str(directive) {
                Ok(_) => (None, directive),
                Err(_) => (Some(directive), "trace"),
            },
        };
        let ours = target.is_some_and(|t| t == "seedlock" || t.starts_with("seedlock::"));
        if !ours {
            most = most.max(as_log(
                LevelFilter::from_str(level).unwrap_or(LevelFilter::TRACE),
            ));
        }
    }
    most
}

fn sku_prefix(raw: &str) -> Result<String, String> {
    if !raw.is_empty() && raw.len() <= 16 && raw.chars().all(|c| c.is_ascii_alphanumeric()) {
        Ok(raw.to_owned())
    } else {
        Err("letters and digits, at most 16".into())
    }
}

async fn dispatch(command: Command, mut settings: Settings) -> ExitCode {
    match command {
        Command::Run {
            once,
            timeout,
            ignore_robots,
        } => {
            if ignore_robots {
                settings.crawl.robots = false;
            }
            run(settings, once, timeout).await
        }
        Command::Crawl {
            bot,
            timeout,
            ignore_robots,
        } => {
            if ignore_robots {
                settings.crawl.robots = false;
            }
            crawl(settings, &bot, timeout).await
        }
        Command::Try {
            bot,
            url,
            file,
            from_url,
            json,
            ignore_robots,
        } => {
            let request = crate::ops::try_page::Request {
                bot,
                url: url.or(from_url),
                file,
                json,
                ignore_robots,
            };
            crate::ops::try_page::command(settings, request).await
        }
        Command::Status { json, all } => status(settings, json, all).await,
        Command::Inspect { bot } => inspect(settings, &bot).await,
        Command::Unlock { bot, reason } => unlock(settings, &bot, &reason).await,
        Command::Refresh { bot } => refresh(settings, &bot).await,
        Command::Bots { command } => crate::ops::bots::command(settings, command).await,
        Command::Pause { bot, reason } => {
            crate::ops::bots::pause(settings, &bot, Some(&reason)).await
        }
        Command::Resume { bot } => crate::ops::bots::pause(settings, &bot, None).await,
        Command::Export {
            bot,
            format,
            delta: true,
            since_pass,
            ..
        } => {
            let shape = match format {
                crate::ops::export::Format::Jsonl => crate::ops::changes::Shape::Json,
                crate::ops::export::Format::Csv => crate::ops::changes::Shape::Csv,
            };
            let since = crate::ops::changes::Since::Pass(since_pass.unwrap_or(0));
            crate::ops::changes::command(settings, &bot, since, false, shape).await
        }
        Command::Export {
            bot,
            format,
            changed_since,
            include_removed,
            ..
        } => crate::ops::bots::export(settings, &bot, format, changed_since, include_removed).await,
        Command::Changes {
            bot,
            since,
            since_pass,
            follow,
            json,
        } => {
            let from = match since_pass {
                Some(pass) => crate::ops::changes::Since::Pass(pass),
                None => crate::ops::changes::Since::Seq(since.unwrap_or(0)),
            };
            let shape = if json {
                crate::ops::changes::Shape::Json
            } else {
                crate::ops::changes::Shape::Lines
            };
            crate::ops::changes::command(settings, &bot, from, follow, shape).await
        }
        Command::Pass { command } => {
            let (bot, pass, how) = match command {
                PassCommand::Release { bot, pass } => {
                    (bot, pass, crate::store::release::Settle::Release)
                }
                PassCommand::Discard { bot, pass } => {
                    (bot, pass, crate::store::release::Settle::Discard)
                }
            };
            crate::ops::changes::settle(settings, &bot, pass, how).await
        }
        Command::DemoSite { .. } => unreachable!("handled before the config is read"),
    }
}

async fn run(settings: Settings, once: bool, timeout: Duration) -> ExitCode {
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let mode = if once {
        Mode::Once { timeout }
    } else {
        Mode::Daemon
    };
    // One client for the run, its progress display and its summary: a database across a
    // network is not connected to again at the end.
    let store = match Store::connect(&settings.mongo).await {
        Ok(store) => store,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let display = ProgressDisplay::start(&settings, &store, once).await;
    let max_error_rate = settings.crawl.max_error_rate;
    let result = daemon::run_with_store(settings, store.clone(), mode, shutdown).await;
    if let Some(display) = display {
        display.stop().await;
    }
    let code = match result {
        Ok(summaries) => report_summaries(summaries, &store, max_error_rate).await,
        Err(e @ RunError::Startup(_)) => fail(EXIT_USAGE, e),
        Err(
            e @ (RunError::Timeout { .. }
            | RunError::Interrupted { .. }
            | RunError::Crashed(_)
            | RunError::Removed(_)
            | RunError::IdTakenOver(_)),
        ) => fail(EXIT_FAILED, e),
    };
    store.shutdown().await;
    code
}

/// `run --once`'s progress display: one bar per crawling bot on stderr, until stopped.
struct ProgressDisplay {
    done: CancellationToken,
    shown: tokio::task::JoinHandle<()>,
}

impl ProgressDisplay {
    /// Starts the display for `run --once` on a terminal when it may run crawling bots (its
    /// config's, or the database's), reading through `store`; `None` otherwise.
    async fn start(settings: &Settings, store: &Store, once: bool) -> Option<Self> {
        // `run --once` on a terminal draws one bar per crawling bot (a daemon's stderr is its log).
        let mut crawling: Vec<BotId> = settings
            .bots
            .iter()
            .filter(|b| b.crawl.is_some())
            .map(|b| b.id.clone())
            .collect();
        let from_database = settings.bots_from_database();
        if !(once && (from_database || !crawling.is_empty()) && std::io::stderr().is_terminal()) {
            return None;
        }
        if from_database {
            crawling.extend(database_crawling_bots(store, settings).await);
        }
        let done = CancellationToken::new();
        let shown = tokio::spawn(crate::ops::progress::show(
            store.clone(),
            crawling,
            done.clone(),
        ));
        Some(Self { done, shown })
    }

    /// Stops the display and waits for it to finish drawing.
    async fn stop(self) {
        self.done.cancel();
        let _ = self.shown.await;
    }
}

/// The database's crawling bots this instance runs, in the order their specs are read (none
/// when the specs cannot be read).
async fn database_crawling_bots(store: &Store, settings: &Settings) -> Vec<BotId> {
    let mut crawling = Vec::new();
    for raw in store.bots().spec_documents().await.unwrap_or_default() {
        let id = crate::store::document::bot_id(&raw);
        let crawls = matches!(
            crate::store::document::definition(&raw).spec,
            Some(Ok(spec)) if spec.crawls()
        );
        if let Some(id) = id.filter(|id| crawls && settings.runs(id)) {
            crawling.push(id);
        }
    }
    crawling
}

/// `run --once`'s end: a line per bot, each finished pass's failures grouped by reason (read
/// from the database through `store`); exit 1 when a pass failed more pages than
/// `max_error_rate` allows or its failures cannot be read.
async fn report_summaries(
    summaries: Vec<daemon::BotSummary>,
    store: &Store,
    max_error_rate: f64,
) -> ExitCode {
    let mut too_many = Vec::new();
    for s in summaries {
        let pass = if s.pass > PassNumber::NONE {
            format!(" pass={} finished", s.pass)
        } else {
            String::new()
        };
        println!(
            "{} ready epoch={} seeds={} digest={}{pass}",
            s.bot, s.epoch, s.seeds, s.seeds_digest
        );
        // A pass its end recorded with no failure has none to show (no read).
        if s.pass == PassNumber::NONE || s.failed == Some(0) {
            continue;
        }
        match crate::ops::progress::failures(store, &s.bot, s.pass).await {
            Ok(failures) => {
                let lines = failures.lines();
                if !lines.is_empty() {
                    println!("{}", lines.trim_start_matches('\n'));
                }
                too_many.extend(failures.too_many(max_error_rate));
            }
            Err(e) => too_many.push(format!("bot {}: cannot read its failures: {e}", s.bot)),
        }
    }
    match too_many.as_slice() {
        [] => ExitCode::SUCCESS,
        lines => {
            for line in &lines[..lines.len() - 1] {
                eprintln!("seedlock: {line}");
            }
            fail(EXIT_FAILED, &lines[lines.len() - 1])
        }
    }
}

/// `seedlock crawl BOT`: `run --once` for one bot, with a progress display.
async fn crawl(mut settings: Settings, bot: &str, timeout: Duration) -> ExitCode {
    let id = match bot_arg(bot) {
        Ok(id) => id,
        Err(code) => return code,
    };
    match settings.bots.iter().find(|b| b.id == id) {
        None => return fail(EXIT_USAGE, format!("no bot \"{id}\" in the config")),
        Some(b) if b.crawl.is_none() => {
            return fail(
                EXIT_USAGE,
                format!("bot \"{id}\" has no [bots.crawl] section: there is nothing to crawl"),
            )
        }
        Some(_) => {}
    }
    settings.bots.retain(|b| b.id == id);
    let max_error_rate = settings.crawl.max_error_rate;
    // One client for the crawl, its progress bar and its summary.
    let store = match Store::connect(&settings.mongo).await {
        Ok(store) => store,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let code = async {
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        let started = std::time::Instant::now();
        let done = CancellationToken::new();
        let display = tokio::spawn(crate::ops::progress::show(
            store.clone(),
            vec![id.clone()],
            done.clone(),
        ));
        let result =
            daemon::run_with_store(settings, store.clone(), Mode::Once { timeout }, shutdown).await;
        done.cancel();
        let _ = display.await;
        let summary = match result {
            Ok(mut s) => s.pop(),
            Err(e @ RunError::Startup(_)) => return fail(EXIT_USAGE, e),
            Err(e) => return fail(EXIT_FAILED, e),
        };
        let pass = summary.map_or(PassNumber::NONE, |s| s.pass);
        match crate::ops::progress::summary(&store, &id, pass, started.elapsed()).await {
            Ok((text, failures)) => {
                println!("{text}");
                match failures.too_many(max_error_rate) {
                    Some(line) => fail(EXIT_FAILED, line),
                    None => ExitCode::SUCCESS,
                }
            }
            Err(e) => fail(EXIT_FAILED, e),
        }
    }
    .await;
    store.shutdown().await;
    code
}

/// SIGINT or SIGTERM: cancel everything; the bots stop their work, release fenced, then exit.
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(
        signal = name,
        "shutting down: stopping work, then releasing locks"
    );
    shutdown.cancel();
}

async fn status(settings: Settings, json: bool, all: bool) -> ExitCode {
    let configured: Vec<_> = settings
        .bots
        .iter()
        .map(|b| (b.id.clone(), b.refresh))
        .collect();
    with_store(&settings, |store, clock| async move {
        match crate::ops::overview::read(&store, &configured, clock.now()).await {
            Err(e) => fail(EXIT_FAILED, e),
            Ok(fleet) if json => {
                print!("{}", crate::ops::admin::render_json(&fleet.rows));
                ExitCode::SUCCESS
            }
            Ok(fleet) => {
                print!("{}", crate::ops::admin::render_table(&fleet.rows, all));
                print!(
                    "{}",
                    crate::ops::admin::render_hosts(&fleet.hosts, fleet.now)
                );
                ExitCode::SUCCESS
            }
        }
    })
    .await
}

async fn inspect(settings: Settings, bot: &str) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    with_store(&settings, |store, _| async move {
        match store.bots().load_raw(&bot).await {
            Ok(Some(raw)) => {
                print!("{}", crate::ops::admin::render_inspect(&raw));
                ExitCode::SUCCESS
            }
            Ok(None) => fail(EXIT_FAILED, format!("no bot {bot} in the database")),
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

async fn unlock(settings: Settings, bot: &str, reason: &str) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    with_store(&settings, |store, clock| async move {
        match store
            .bots()
            .admin_unlock(&bot, &admin_name(), reason, clock.now())
            .await
        {
            Ok(UnlockOutcome::Unlocked { holder, old_epoch }) => {
                println!(
                    "unlocked {bot}: was held by {} at epoch {}; its writes now fail",
                    holder.as_deref().unwrap_or("?"),
                    old_epoch.map_or("?".into(), |e| e.to_string())
                );
                ExitCode::SUCCESS
            }
            Ok(UnlockOutcome::NotLocked) => {
                println!("{bot} is not locked; nothing to do");
                ExitCode::SUCCESS
            }
            Ok(UnlockOutcome::NoSuchBot) => {
                fail(EXIT_FAILED, format!("no bot {bot} in the database"))
            }
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

async fn refresh(settings: Settings, bot: &str) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    with_store(&settings, |store, clock| async move {
        match store
            .bots()
            .request_refresh(&bot, &admin_name(), clock.now())
            .await
        {
            Ok(true) => {
                println!("refresh of {bot} requested; the next instance to look will refresh it");
                ExitCode::SUCCESS
            }
            Ok(false) => fail(EXIT_FAILED, format!("no bot {bot} in the database")),
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

fn demo_site(addr: &str, options: crate::demo_site::SiteOptions) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(EXIT_FAILED, format!("cannot start the runtime: {e}")),
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => return fail(EXIT_USAGE, format!("cannot listen on {addr}: {e}")),
        };
        match listener.local_addr() {
            Ok(local) => println!("demo site listening on http://{local}"),
            Err(e) => return fail(EXIT_FAILED, e),
        }
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        match crate::demo_site::serve(listener, options, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(EXIT_FAILED, format!("demo site failed: {e}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::bridged_log_level;
    use log::LevelFilter;

    #[test]
    fn the_libraries_log_records_are_let_through_only_as_far_as_a_directive_not_ours_asks() {
        for (spec, level) in [
            ("info", LevelFilter::Info),
            ("info,seedlock::daemon=debug", LevelFilter::Info),
            ("warn,seedlock=trace", LevelFilter::Warn),
            ("seedlock::crawl=debug", LevelFilter::Off),
            ("debug", LevelFilter::Debug),
            ("info,html5ever=trace", LevelFilter::Trace),
            ("info,reqwest", LevelFilter::Trace),
            ("INFO, seedlockish=debug", LevelFilter::Debug),
            ("error,hyper[conn{peer=x}]=debug", LevelFilter::Debug),
            ("off", LevelFilter::Off),
        ] {
            assert_eq!(bridged_log_level(spec), level, "{spec}");
        }
    }
}
