//! The crawl pipeline's stages as an operator sees them: how many items each holds and how long
//! the oldest has been there. An item holds a [`Ticket`] for the stage it is in; moving on means
//! taking the next stage's ticket, and dropping a ticket (the item settled or was given back)
//! takes it off the count.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Default)]
pub(crate) struct Stage {
    items: Mutex<BTreeMap<u64, Instant>>,
    next: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Ticket {
    stage: Arc<Stage>,
    id: u64,
}

impl Stage {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Instant>> {
        self.items.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn enter(self: &Arc<Self>) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Instant::now());
        Ticket {
            stage: self.clone(),
            id,
        }
    }

    pub(crate) fn depth(&self) -> usize {
        self.lock().len()
    }

    /// How long the item that entered first (of those still here) has been here.
    pub(crate) fn oldest(&self) -> Option<Duration> {
        self.lock().values().min().map(|t| t.elapsed())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.stage.lock().remove(&self.id);
    }
}

/// One bot's crawl pipeline on this instance: leased URLs waiting for their host, fetches in
/// flight, fetched pages waiting for or in a parser, parsed pages waiting for or in a writer.
#[derive(Debug, Default)]
pub(crate) struct Stages {
    pub host_queue: Arc<Stage>,
    pub fetch: Arc<Stage>,
    pub parse: Arc<Stage>,
    pub store: Arc<Stage>,
}

impl Stages {
    pub(crate) fn all(&self) -> [(&'static str, &Arc<Stage>); 4] {
        [
            ("host_queue", &self.host_queue),
            ("fetch", &self.fetch),
            ("parse", &self.parse),
            ("store", &self.store),
        ]
    }

    /// Items leased and not yet settled, in every stage.
    pub(crate) fn in_pipeline(&self) -> usize {
        self.all().iter().map(|(_, s)| s.depth()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_stage_counts_its_tickets_and_ages_the_oldest() {
        let stages = Stages::default();
        let first = stages.fetch.enter();
        tokio::time::advance(Duration::from_secs(3)).await;
        let second = stages.fetch.enter();
        assert_eq!(stages.fetch.depth(), 2);
        assert_eq!(stages.fetch.oldest(), Some(Duration::from_secs(3)));
        drop(first);
        assert_eq!(stages.fetch.oldest(), Some(Duration::ZERO));
        let moved = stages.parse.enter();
        drop(second);
        assert_eq!(stages.fetch.depth(), 0);
        assert_eq!(stages.in_pipeline(), 1);
        drop(moved);
        assert_eq!(stages.parse.oldest(), None);
    }
}
