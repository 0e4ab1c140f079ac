//! `seedlock bots apply --check FILE`: a new spec tried on pages the bot already knows, before a
//! pass runs on it. For each bot whose spec FILE changes, a sample of its stored records' detail
//! pages is fetched (one request at a time, at least 100 ms apart (or `crawl.politeness`), robots.txt honoured)
//! and read with the new spec; each field of the new record is compared with the stored one:
//! the same, different, or now missing (stored with a value, read without one). Nothing is
//! written. Exit 1 when a field would go missing on more than the bot's `drift.max_fill_drop` of
//! the sample — the selector typo the drift gate would otherwise catch a pass later.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use bson::{Bson, Document};

use crate::config::{BotSpec, Settings};
use crate::crawl::probe;
use crate::flow::robots::RobotsCache;
use crate::http_client::HttpClient;
use crate::ops::{admin_name, fail, with_store, EXIT_FAILED, EXIT_USAGE};
use crate::store::records::field as rf;
use crate::store::Applied;
use crate::urls::NormalizedUrl;

/// Stored detail pages fetched per bot, at most.
pub(crate) const SAMPLE: usize = 20;

/// One field's comparison over the sample.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct FieldCount {
    pub same: usize,
    pub different: usize,
    /// Stored with a value, read without one.
    pub missing: usize,
}

/// A bot's comparison: per field, and the pages that gave no record (with the first reason).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Comparison {
    pub pages: usize,
    pub fields: BTreeMap<String, FieldCount>,
    pub no_record: usize,
    pub first_error: Option<String>,
}

impl Comparison {
    /// Adds one page: the stored data, and what the new spec read (or why it read nothing).
    pub(crate) fn add(&mut self, stored: &Document, read: Result<&Document, &str>) {
        self.pages += 1;
        let read = match read {
            Ok(read) => read,
            Err(why) => {
                self.no_record += 1;
                self.first_error.get_or_insert_with(|| why.to_owned());
                // No record: every field it held is missing.
                for (name, value) in stored {
                    let count = self.fields.entry(name.clone()).or_default();
                    if !matches!(value, Bson::Null) {
                        count.missing += 1;
                    } else {
                        count.same += 1;
                    }
                }
                return;
            }
        };
        let mut names: Vec<&String> = stored.keys().chain(read.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let before = stored.get(name).unwrap_or(&Bson::Null);
            let after = read.get(name).unwrap_or(&Bson::Null);
            let count = self.fields.entry(name.clone()).or_default();
            if before == after {
                count.same += 1;
            } else if matches!(after, Bson::Null) {
                count.missing += 1;
            } else {
                count.different += 1;
            }
        }
    }

    /// The fields that would go missing on more than `share` of the sample.
    pub(crate) fn failing(&self, share: f64) -> Vec<&str> {
        self.fields
            .iter()
            .filter(|(_, c)| c.missing as f64 > share * self.pages.max(1) as f64)
            .map(|(name, _)| name.as_str())
            .collect()
    }

    /// The table, one line per field.
    pub(crate) fn table(&self) -> String {
        let width = self
            .fields
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(5)
            .max(5);
        let mut out = format!(
            "  {:width$}  {:>4}  {:>9}  {:>11}\n",
            "field", "same", "different", "now missing"
        );
        for (name, c) in &self.fields {
            out.push_str(&format!(
                "  {name:width$}  {:>4}  {:>9}  {:>11}\n",
                c.same, c.different, c.missing
            ));
        }
        out
    }
}

/// `bots apply --check FILE`.
pub(crate) async fn check(settings: Settings, file: &std::path::Path) -> ExitCode {
    let specs = match crate::config::specs_from_file(file) {
        Ok(s) => s,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let limits = settings.crawl.clone();
    let fetcher = match HttpClient::new(&limits.user_agent, limits.timeout, limits.max_page_bytes) {
        Ok(f) => f,
        Err(e) => return fail(EXIT_FAILED, e),
    };
    let robots = RobotsCache::new(&limits.user_agent, limits.robots_ttl, limits.robots);
    let spacing = limits.flow.min_delay.max(Duration::from_millis(100));
    with_store(&settings, |store, clock| async move {
        let mut failing = 0usize;
        for bot in &specs {
            let id = &bot.settings.id;
            match store
                .bots()
                .apply_spec(id, &bot.spec, &admin_name(), clock.now(), true)
                .await
            {
                Ok(Applied::Unchanged) => {
                    println!("{id}: unchanged");
                    continue;
                }
                Ok(Applied::Created) => println!("{id}: new in the database"),
                Ok(Applied::Changed(keys)) => println!("{id}: changed ({})", keys.join(", ")),
                Err(e) => return fail(EXIT_FAILED, format!("{id}: {e}")),
            }
            match compare(&store, bot, &fetcher, &robots, spacing).await {
                Ok(None) => println!("  no stored records to compare with (`seedlock try {id} URL` reads a page with it)"),
                Ok(Some(comparison)) => {
                    let rules = bot.settings.crawl.as_ref().map(|c| c.drift).unwrap_or_default();
                    print!("  {} stored pages read with the new spec", comparison.pages);
                    if comparison.no_record > 0 {
                        print!(
                            "; {} gave no record ({})",
                            comparison.no_record,
                            comparison.first_error.as_deref().unwrap_or("?")
                        );
                    }
                    println!();
                    print!("{}", comparison.table());
                    let bad = comparison.failing(rules.max_fill_drop);
                    if !bad.is_empty() {
                        failing += 1;
                        println!(
                            "  would go missing on more than {:.0}% of the sample: {}",
                            rules.max_fill_drop * 100.0,
                            bad.join(", ")
                        );
                    }
                }
                Err(e) => return fail(EXIT_FAILED, format!("{id}: {e}")),
            }
        }
        if failing > 0 {
            return fail(
                EXIT_FAILED,
                format!("{failing} bot(s) would lose fields with this file; nothing written"),
            );
        }
        ExitCode::SUCCESS
    })
    .await
}

/// Reads up to [`SAMPLE`] of the bot's stored detail pages with its new spec; `None` when it
/// has no stored record (or no record rules).
async fn compare(
    store: &crate::store::Store,
    bot: &BotSpec,
    fetcher: &HttpClient,
    robots: &RobotsCache,
    spacing: Duration,
) -> crate::error::Result<Option<Comparison>> {
    let Some(rules) = bot.settings.crawl.as_ref().filter(|c| c.record.is_some()) else {
        return Ok(None);
    };
    let sample = store
        .records()
        .sample_live(&bot.settings.id, SAMPLE)
        .await?;
    if sample.is_empty() {
        return Ok(None);
    }
    let fetcher = fetcher.for_bot(&rules.headers, &rules.http, &rules.links.scope);
    let mut comparison = Comparison::default();
    for (i, record) in sample.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(spacing).await;
        }
        let empty = Document::new();
        let stored = record.get_document(rf::DATA).unwrap_or(&empty);
        let Some(url) = record
            .get_str(rf::URL)
            .ok()
            .and_then(|u| NormalizedUrl::parse(u).ok())
        else {
            continue;
        };
        let (_, page) = probe::fetch(&fetcher, robots, rules, &url).await;
        let read = page.and_then(|page| probe::record_of(rules, &page));
        match &read {
            Ok((_, fields)) => comparison.add(stored, Ok(fields)),
            Err(why) => comparison.add(stored, Err(&format!("{url}: {why}"))),
        }
    }
    Ok(Some(comparison))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn a_field_read_as_null_is_missing_and_fails_past_the_share() {
        let mut c = Comparison::default();
        let stored = doc! { "price": "$1", "title": "a" };
        c.add(&stored, Ok(&doc! { "price": Bson::Null, "title": "a" }));
        c.add(&stored, Ok(&doc! { "price": "$2", "title": "a" }));
        c.add(&stored, Err("no natural key"));
        assert_eq!(
            c.fields["price"],
            FieldCount {
                same: 0,
                different: 1,
                missing: 2
            }
        );
        assert_eq!(
            c.fields["title"],
            FieldCount {
                same: 2,
                different: 0,
                missing: 1
            }
        );
        assert_eq!(c.failing(0.2), vec!["price", "title"]);
        assert_eq!(c.failing(0.5), vec!["price"]);
        assert!(c.table().contains("now missing"));
    }
}
