//! The fleet commands over bots defined in the database: `bots apply | list | remove`, `pause`,
//! `resume` and `export`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use futures_util::StreamExt;
use serde_json::json;

use crate::config::Settings;
use crate::lock::state::state_of;
use crate::ops::admin::iso;
use crate::ops::{admin_name, bot_arg, fail, with_store, EXIT_FAILED, EXIT_USAGE};
use crate::store::document;
use crate::store::{Applied, Pause};

/// How many bots `bots apply` writes at once.
const APPLY_IN_FLIGHT: usize = 32;

/// `seedlock bots …`.
#[derive(Debug, Subcommand)]
pub enum BotsCommand {
    /// Write the [[bots]] of FILE into the database (validated as at start-up; nothing is written
    /// if one is bad). Prints per bot: created, changed (with the keys), unchanged, removed.
    // The help text names the TOML table as an operator writes it, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    Apply {
        file: PathBuf,
        /// Also remove the database's bots that FILE does not define.
        #[arg(long)]
        prune: bool,
        /// Print what would change; write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Write nothing; read a sample of each changed bot's stored detail pages with its new
        /// spec and compare each field with what is stored (same, different, now missing). Exit 1
        /// when a field would go missing on more than the bot's `drift.max_fill_drop` of them.
        #[arg(long, conflicts_with_all = ["prune", "dry_run"])]
        check: bool,
    },
    /// The bots in the database: id, spec version, state, paused, pass, last change.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a bot: it stops on every instance within one poll.
    Remove {
        bot: String,
        /// Also delete its frontier and records (once no lease of it is live).
        #[arg(long)]
        purge: bool,
    },
}

pub(crate) async fn command(settings: Settings, command: BotsCommand) -> ExitCode {
    match command {
        BotsCommand::Apply {
            file, check: true, ..
        } => crate::ops::check::check(settings, &file).await,
        BotsCommand::Apply {
            file,
            prune,
            dry_run,
            ..
        } => apply(settings, &file, prune, dry_run).await,
        BotsCommand::List { json } => list(settings, json).await,
        BotsCommand::Remove { bot, purge } => remove(settings, &bot, purge).await,
    }
}

async fn apply(settings: Settings, file: &std::path::Path, prune: bool, dry_run: bool) -> ExitCode {
    // Every bot is validated before anything is written.
    let specs = match crate::config::specs_from_file(file) {
        Ok(s) => s,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    with_store(&settings, |store, clock| async move {
        let by = admin_name();
        let note = if dry_run {
            " (dry run: nothing written)"
        } else {
            ""
        };
        // Several bots in flight at once (each is a read and a conditional write), printed in
        // the file's order: 10,000 bots one after another would take half a minute of round trips.
        let mut applied = futures_util::stream::iter(specs.iter().map(|bot| {
            let (store, by, clock) = (&store, &by, &clock);
            async move {
                let id = &bot.settings.id;
                let result = store
                    .bots()
                    .apply_spec(id, &bot.spec, by, clock.now(), dry_run)
                    .await;
                (id, result)
            }
        }))
        .buffered(APPLY_IN_FLIGHT);
        // A bot that cannot be written is reported and the rest are still applied: every write
        // is idempotent, so running the same file again finishes the job.
        let mut failed = 0usize;
        while let Some((id, result)) = applied.next().await {
            match result {
                Ok(Applied::Created) => println!("{id}: created{note}"),
                Ok(Applied::Changed(keys)) => {
                    println!("{id}: changed ({}){note}", keys.join(", "))
                }
                Ok(Applied::Unchanged) => println!("{id}: unchanged"),
                Err(e) => {
                    failed += 1;
                    eprintln!("seedlock: {id}: {e}");
                }
            }
        }
        drop(applied);
        if failed > 0 {
            let pruning = if prune { "; nothing pruned" } else { "" };
            return fail(
                EXIT_FAILED,
                format!(
                    "{failed} of {} bots were not applied{pruning}; run the same apply again",
                    specs.len()
                ),
            );
        }
        if prune {
            let docs = match store.bots().spec_documents().await {
                Ok(d) => d,
                Err(e) => return fail(EXIT_FAILED, e),
            };
            for raw in docs {
                let Some(id) = document::bot_id(&raw) else {
                    continue;
                };
                if specs.iter().any(|b| b.settings.id == id) {
                    continue;
                }
                if !dry_run {
                    if let Err(e) = store.bots().remove(&id).await {
                        return fail(EXIT_FAILED, format!("{id}: {e}"));
                    }
                }
                println!("{id}: removed{note}");
            }
        }
        ExitCode::SUCCESS
    })
    .await
}

async fn list(settings: Settings, json: bool) -> ExitCode {
    with_store(&settings, |store, clock| async move {
        let docs = match store.bots().load_all().await {
            Ok(d) => d,
            Err(e) => return fail(EXIT_FAILED, e),
        };
        // The status views' judgement of each bot: those that need a look come first.
        let mut status = crate::ops::admin::status_rows(docs.clone(), &[], clock.now());
        let attention: std::collections::HashMap<String, Option<String>> = status
            .iter()
            .map(|r| (r.bot.clone(), r.attention.clone()))
            .collect();
        crate::ops::admin::problems_first(&mut status);
        let order: std::collections::HashMap<String, usize> = status
            .iter()
            .enumerate()
            .map(|(i, r)| (r.bot.clone(), i))
            .collect();
        let mut docs = docs;
        docs.sort_by_key(|raw| {
            order
                .get(&document::bot_name(raw))
                .copied()
                .unwrap_or(usize::MAX)
        });
        let rows: Vec<serde_json::Value> = docs
            .into_iter()
            .map(|raw| {
                let id = document::bot_name(&raw);
                let definition = document::definition(&raw);
                let version = definition.version;
                let paused = definition.paused;
                let pass = definition.crawl_pass;
                let changed = definition.spec_updated_at.map(iso);
                let spec_error = definition.spec_error;
                let state = state_of(&crate::store::document::observe(Some(raw))).as_str();
                let attention = attention.get(&id).cloned().flatten();
                json!({
                    "bot": id, "spec_version": version, "state": state, "paused": paused,
                    "pass": pass, "spec_updated_at": changed, "spec_error": spec_error,
                    "attention": attention,
                })
            })
            .collect();
        if json {
            println!("{}", serde_json::to_string_pretty(&rows).expect("json"));
            return ExitCode::SUCCESS;
        }
        println!("{}", crate::ops::admin::counts_line(&status));
        println!(
            "{:<24} {:>5} {:<9} {:<6} {:>6}  LAST CHANGE",
            "BOT", "SPEC", "STATE", "PAUSED", "PASS"
        );
        for r in rows {
            let spec = r["spec_version"]
                .as_i64()
                .map_or("file".to_owned(), |v| v.to_string());
            let mut last = r["spec_updated_at"].as_str().unwrap_or("-").to_owned();
            if let Some(e) = r["spec_error"].as_str() {
                last.push_str(&format!("  {e}"));
            } else if let Some(why) = r["attention"].as_str() {
                last.push_str(&format!("  ({why})"));
            }
            println!(
                "{:<24} {:>5} {:<9} {:<6} {:>6}  {last}",
                r["bot"].as_str().unwrap_or("?"),
                spec,
                r["state"].as_str().unwrap_or("?"),
                if r["paused"] == true { "yes" } else { "no" },
                r["pass"],
            );
        }
        ExitCode::SUCCESS
    })
    .await
}

async fn remove(settings: Settings, bot: &str, purge: bool) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let lease_for = settings.crawl.url_lease;
    let poll = settings.lock.poll;
    with_store(&settings, |store, clock| async move {
        match store.bots().remove(&bot).await {
            Ok(true) => println!("{bot}: removed; every instance stops it within one poll"),
            Ok(false) if purge => println!("{bot}: no document (purging what is left of it)"),
            Ok(false) => return fail(EXIT_FAILED, format!("no bot {bot} in the database")),
            Err(e) => return fail(EXIT_FAILED, e),
        }
        if !purge {
            return ExitCode::SUCCESS;
        }
        // The instances stop the bot within a poll: their in-flight pages settle and their leases
        // go back (or run out). Purging before that would let a late commit write a record back:
        // so two polls pass and no lease is live before the purge, and a second purge a poll
        // later takes what a straggler wrote meanwhile.
        let removed_at = tokio::time::Instant::now();
        let deadline = removed_at + lease_for + std::time::Duration::from_secs(5);
        loop {
            match store.frontier().live_leases(&bot, clock.now()).await {
                Ok(0) if removed_at.elapsed() >= poll * 2 => break,
                Ok(0) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
                Ok(n) if tokio::time::Instant::now() > deadline => {
                    return fail(
                        EXIT_FAILED,
                        format!(
                            "{bot}: {n} leases still live after {}; not purged",
                            humantime::format_duration(lease_for)
                        ),
                    )
                }
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
                Err(e) => return fail(EXIT_FAILED, e),
            }
        }
        let first = match store.purge_bot(&bot).await {
            Ok(counts) => counts,
            Err(e) => return fail(EXIT_FAILED, e),
        };
        tokio::time::sleep(poll).await;
        match store.purge_bot(&bot).await {
            Ok(late) => {
                println!(
                    "{bot}: purged {} frontier entries and {} records",
                    first.0 + late.0,
                    first.1 + late.1
                );
                ExitCode::SUCCESS
            }
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

/// `pause BOT --reason` (with `Some`) and `resume BOT`.
pub(crate) async fn pause(settings: Settings, bot: &str, reason: Option<&str>) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    with_store(&settings, |store, clock| async move {
        let by = admin_name();
        let pause = reason.map(|reason| Pause { by: &by, reason });
        let pausing = pause.is_some();
        match store.bots().set_paused(&bot, pause, &by, clock.now()).await {
            Ok(true) if pausing => {
                println!(
                    "{bot}: paused; in-flight pages finish, then no instance leases or locks it"
                );
                ExitCode::SUCCESS
            }
            Ok(true) => {
                println!("{bot}: resumed");
                ExitCode::SUCCESS
            }
            Ok(false) => fail(EXIT_FAILED, format!("no bot {bot} in the database")),
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

pub(crate) async fn export(
    settings: Settings,
    bot: &str,
    format: crate::ops::export::Format,
    changed_since: Option<chrono::DateTime<chrono::Utc>>,
    include_removed: bool,
) -> ExitCode {
    let bot = match bot_arg(bot) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let file_fields = settings
        .bots
        .iter()
        .find(|b| b.id == bot)
        .map(record_fields);
    with_store(&settings, |store, _| async move {
        let doc = match store.bots().load_raw(&bot).await {
            Ok(d) => d,
            Err(e) => return fail(EXIT_FAILED, e),
        };
        if doc.is_none() && file_fields.is_none() {
            return fail(EXIT_FAILED, format!("no bot {bot} in the database or the config"));
        }
        let spec_fields = doc
            .as_ref()
            .and_then(|d| document::definition(d).spec)
            .and_then(Result::ok)
            .and_then(|spec| crate::config::bot_from_spec(&bot, &spec.spec).ok())
            .map(|b| record_fields(&b));
        let fields = match (spec_fields.or(file_fields), format) {
            (Some(f), _) => f,
            (None, crate::ops::export::Format::Jsonl) => Vec::new(),
            (None, crate::ops::export::Format::Csv) => {
                return fail(
                    EXIT_USAGE,
                    format!("bot {bot}: no spec in the database or the config names its record fields; use --format jsonl"),
                )
            }
        };
        let records = match store.records().export_records(&bot, changed_since, include_removed).await {
            Ok(c) => c,
            Err(e) => return fail(EXIT_FAILED, e),
        };
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
        match crate::ops::export::write(records, format, &fields, &mut out).await {
            Ok(n) => {
                drop(out);
                eprintln!("{bot}: exported {n} records");
                ExitCode::SUCCESS
            }
            Err(e) => fail(EXIT_FAILED, e),
        }
    })
    .await
}

fn record_fields(bot: &crate::config::BotSettings) -> Vec<String> {
    bot.crawl
        .as_ref()
        .and_then(|c| c.record.as_ref())
        .map(|r| r.fields.keys().cloned().collect())
        .unwrap_or_default()
}
