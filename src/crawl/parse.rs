//! The parse stage: a fetched page's HTML or JSON is read on the blocking pool, off the
//! runtime's workers (CSS selectors with `scraper`, JSONPath; see `extract`). Everything else
//! a fetch can come to passes through unchanged ([`Parser::step`]).

use std::sync::Arc;

use super::fetch::Fetched;
use crate::config::CrawlSettings;
use crate::error::{Error, Result};
use crate::extract::{extract, PageData};
use crate::http_client::{FetchOutcome, SitemapPermit, Validators};

/// What the settle stage receives: an extracted page, or any other answer as it came.
#[derive(Debug)]
pub(crate) enum Parsed {
    Page {
        data: Box<PageData>,
        validators: Validators,
        /// A sitemap file's permit, held until its items are followed: a bot's next file is
        /// read only then, so one file's items are in memory at a time.
        held: SitemapPermit,
    },
    Other(Fetched),
}

/// The parse stage: the bot's rules for reading a page.
pub(crate) struct Parser {
    rules: Arc<CrawlSettings>,
}

impl Parser {
    pub(crate) fn new(rules: Arc<CrawlSettings>) -> Self {
        Self { rules }
    }

    /// The parse step for one fetched URL.
    pub(crate) async fn step(&self, fetched: Fetched) -> Result<Parsed> {
        let Fetched::Outcome(FetchOutcome::Ok(page)) = fetched else {
            return Ok(Parsed::Other(fetched));
        };
        let validators = Validators {
            etag: page.etag.clone(),
            last_modified: page.last_modified.clone(),
        };
        let rules = self.rules.clone();
        let page_url = page.url.to_url();
        let sitemap = page.sitemap.is_some();
        let (data, held) = tokio::task::spawn_blocking(move || match page.sitemap {
            // A sitemap file was read as it arrived; its entries become links or items here.
            Some((sitemap, held)) => (
                crate::extract::sitemap::page_data(
                    &page_url,
                    *sitemap,
                    &rules.links,
                    rules.record.as_ref(),
                ),
                held,
            ),
            None => (
                extract(
                    &page_url,
                    &page.body,
                    page.format,
                    &rules.links,
                    rules.list.as_ref(),
                    rules.record.as_ref(),
                ),
                SitemapPermit::default(),
            ),
        })
        .await
        .map_err(|e| Error::Task {
            what: "extract",
            detail: format!("the extraction task failed: {e}"),
        })?;
        if data.dropped > 0 && !sitemap {
            tracing::warn!(
                url = %page.url,
                kept = self.rules.links.max,
                dropped = data.dropped,
                "the page has more links or listing items than bots.crawl.max_links; followed the first"
            );
        }
        if data.dropped > 0 && sitemap {
            tracing::warn!(
                url = %page.url,
                kept = crate::extract::sitemap::MAX_URLS,
                dropped = data.dropped,
                "the sitemap lists more URLs than the protocol's limit; read the first"
            );
        }
        Ok(Parsed::Page {
            data: Box::new(data),
            validators,
            held,
        })
    }
}
