//! A crawl pass as the bot document shows it: [`PassState`] is what the coordinator decides
//! from (not started, running, finished), [`Pass`] what a running pass's stages read.

use chrono::{DateTime, Utc};

use crate::ids::PassNumber;
use crate::urls::NormalizedUrl;

/// The pass a crawl works on, as the bot document shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pass {
    pub number: PassNumber,
    pub started_at: Option<DateTime<Utc>>,
    /// When the last completed pass started (`updated_at` mode reads from here − overlap).
    pub last_run_at: Option<DateTime<Utc>>,
    /// The hosts (`host:port`) of the bot's seeds: where the pass's work starts.
    pub seed_hosts: Vec<String>,
    /// The spec the pass started with (`crawlPassSpecVersion`, `crawlPassSpec`), for bots defined
    /// in the database: the pass ends on it whatever changes meanwhile.
    pub spec: Option<std::sync::Arc<crate::lock::bot::BotSpec>>,
    /// The pass started on another spec than the one before it (`crawlPassRefetch`): every
    /// detail page is fetched, unconditionally, so every record is extracted by the new rules.
    pub refetch: bool,
    /// The last pass whose deletion evaluation applied its removals (`crawlEvaluatedPass`): a
    /// listing page read then has that read as its baseline.
    pub evaluated: PassNumber,
    /// The last pass whose change events were staged: a record's write may drop its pending
    /// events of passes up to it.
    pub feed_staged: PassNumber,
}

/// A crawling bot's pass as its document shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum PassState {
    /// No pass has run yet (`crawlPass` unset or 0), or none since a repair.
    NotStarted {
        current: PassNumber,
        seeds: Vec<String>,
    },
    Running(Pass),
    Finished {
        number: PassNumber,
        /// A refresh succeeded while it ran: the next pass starts now, on the current seeds.
        next: Option<Vec<String>>,
        /// Its deletion evaluation is pending, claimed until then (see
        /// [`Passes::resume_evaluation`](crate::store::Passes::resume_evaluation)).
        evaluation_claimed_until: Option<DateTime<Utc>>,
    },
}

impl PassState {
    pub(crate) fn of(doc: &crate::lock::bot::BotDoc) -> PassState {
        if doc.crawl_pass == PassNumber::NONE || doc.crawl_pass_started_at.is_none() {
            PassState::NotStarted {
                current: doc.crawl_pass,
                seeds: doc.seeds.clone(),
            }
        } else if doc.crawl_pass_ended_at.is_some() {
            PassState::Finished {
                number: doc.crawl_pass,
                next: doc.crawl_next_pass_at.map(|_| doc.seeds.clone()),
                evaluation_claimed_until: doc
                    .crawl_evaluation_pending
                    .filter(|(pass, _)| *pass == doc.crawl_pass)
                    .map(|(_, until)| until),
            }
        } else {
            let mut seed_hosts: Vec<String> = doc
                .seeds
                .iter()
                .filter_map(|s| NormalizedUrl::parse(s).ok())
                .map(|u| u.host_port())
                .collect();
            seed_hosts.sort();
            seed_hosts.dedup();
            PassState::Running(Pass {
                number: doc.crawl_pass,
                started_at: doc.crawl_pass_started_at,
                last_run_at: doc.crawl_last_run_at,
                seed_hosts,
                spec: doc.crawl_pass_spec.clone(),
                refetch: doc.crawl_pass_refetch,
                evaluated: doc.crawl_evaluated_pass,
                feed_staged: doc.crawl_feed_staged,
            })
        }
    }
}
