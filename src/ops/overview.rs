//! The fleet as the database shows it — every bot's row with its pass, and the hosts pushing
//! back — read once for `seedlock status`, `/status.json` and the status page, so the three
//! never disagree. Any instance (or none: `status` runs without one) shows the whole fleet.

use chrono::{DateTime, Utc};

use crate::config::RefreshSchedule;
use crate::error::Result;
use crate::ids::BotId;
use crate::ids::PassNumber;
use crate::lock::bot::BotDoc;
use crate::ops::admin::{problems_first, status_rows, with_pass, StatusRow};
use crate::store::hosts::HostRow;
use crate::store::Store;

/// How far back the hosts section looks for an instance's published row: instances publish every
/// 5 s, so older rows belong to instances that stopped.
pub(crate) const HOSTS_FRESH_FOR: chrono::Duration = chrono::Duration::seconds(30);

/// Everything the status views show, read at `now`.
#[derive(Debug, Clone)]
pub(crate) struct Overview {
    pub now: DateTime<Utc>,
    pub rows: Vec<StatusRow>,
    /// Rows published lately; the views show those throttled in the last minute or paused.
    pub hosts: Vec<HostRow>,
}

/// Reads every bot document (and `configured` bots that have none yet, as `missing`), each
/// crawling bot's current pass, and the hosts rows published since `now − HOSTS_FRESH_FOR`; the
/// rows that need a look come first.
pub(crate) async fn read(
    store: &Store,
    configured: &[(BotId, RefreshSchedule)],
    now: DateTime<Utc>,
) -> Result<Overview> {
    let docs = store.bots().load_all().await?;
    let crawling: Vec<BotDoc> = docs
        .iter()
        .filter_map(|raw| crate::store::document::parse_bot(raw).ok())
        .filter(|doc| doc.crawl_pass > PassNumber::NONE)
        .collect();
    let mut rows = status_rows(docs, configured, now);
    for doc in crawling {
        let report = store.passes().report(&doc).await?;
        if let Some(row) = rows.iter_mut().find(|r| r.bot == doc.id.as_str()) {
            with_pass(row, &report, doc.crawl_last_pass_pages, now);
            if let Some(crawl) = row.crawl.as_mut() {
                crawl.next_pass_waiting = doc.crawl_next_pass_at.is_some();
            }
        }
    }
    problems_first(&mut rows);
    let hosts = store.hosts().recent(now - HOSTS_FRESH_FOR).await?;
    Ok(Overview { now, rows, hosts })
}
