//! A bounded queue between two pipeline stages, with a fast lane: items pushed `fast` (seeds and
//! listing pages, whose links are the pass's next work) are taken before the others. A push waits
//! for room; the room an item takes is held by its [`Slot`] until the slot (or its permit) is
//! dropped — so a stage decides whether its queue counts items only while they wait, or until
//! they are done.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// An item taken from a [`Queue`], with the room it holds.
#[derive(Debug)]
pub(crate) struct Slot<T> {
    pub item: T,
    pub room: OwnedSemaphorePermit,
}

#[derive(Debug)]
struct Lanes<T> {
    fast: VecDeque<Slot<T>>,
    slow: VecDeque<Slot<T>>,
    closed: bool,
}

#[derive(Debug)]
pub(crate) struct Queue<T> {
    lanes: Mutex<Lanes<T>>,
    room: Arc<Semaphore>,
    ready: Notify,
}

impl<T> Queue<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            lanes: Mutex::new(Lanes {
                fast: VecDeque::new(),
                slow: VecDeque::new(),
                closed: false,
            }),
            room: Arc::new(Semaphore::new(capacity.max(1))),
            ready: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lanes<T>> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for room, then queues `item` (in the fast lane if `fast`). `Err(item)` once the
    /// queue is closed.
    pub(crate) async fn push(&self, item: T, fast: bool) -> Result<(), T> {
        let Ok(room) = self.room.clone().acquire_owned().await else {
            return Err(item);
        };
        let mut lanes = self.lock();
        if lanes.closed {
            return Err(item);
        }
        let slot = Slot { item, room };
        if fast {
            lanes.fast.push_back(slot);
        } else {
            lanes.slow.push_back(slot);
        }
        drop(lanes);
        self.ready.notify_one();
        Ok(())
    }

    /// The next item (fast lane first); `None` once the queue is closed and empty.
    pub(crate) async fn pop(&self) -> Option<Slot<T>> {
        self.pop_up_to(1).await.pop()
    }

    /// What is waiting, up to `max` items (fast lane first), without lingering for more: waits
    /// only while nothing waits. Empty once the queue is closed and empty.
    pub(crate) async fn pop_up_to(&self, max: usize) -> Vec<Slot<T>> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut lanes = self.lock();
                let mut taken = Vec::new();
                while taken.len() < max.max(1) {
                    match lanes.fast.pop_front().or_else(|| lanes.slow.pop_front()) {
                        Some(slot) => taken.push(slot),
                        None => break,
                    }
                }
                let more = !lanes.fast.is_empty() || !lanes.slow.is_empty();
                let closed = lanes.closed;
                drop(lanes);
                if !taken.is_empty() {
                    if more {
                        // Another taker may take the rest.
                        self.ready.notify_one();
                    }
                    return taken;
                }
                if closed {
                    return taken;
                }
            }
            notified.await;
        }
    }

    /// No more pushes; takers drain what is queued, then get nothing.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.room.close();
        self.ready.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_fast_lane_is_taken_first_and_room_is_held_by_the_slot() {
        let queue = Queue::new(3);
        queue.push(1, false).await.unwrap();
        queue.push(2, false).await.unwrap();
        queue.push(3, true).await.unwrap();
        // Full: a fourth push waits until a slot is dropped.
        let fourth =
            tokio::time::timeout(std::time::Duration::from_millis(50), queue.push(4, false));
        assert!(fourth.await.is_err(), "a full queue makes a push wait");
        let first = queue.pop().await.unwrap();
        assert_eq!(first.item, 3, "the fast lane first");
        let fifth =
            tokio::time::timeout(std::time::Duration::from_millis(50), queue.push(5, false));
        assert!(
            fifth.await.is_err(),
            "the room is held while the slot lives"
        );
        drop(first);
        queue.push(5, false).await.unwrap();
        let batch = queue.pop_up_to(10).await;
        assert_eq!(
            batch.iter().map(|s| s.item).collect::<Vec<_>>(),
            vec![1, 2, 5]
        );
    }

    #[tokio::test]
    async fn a_closed_queue_drains_then_ends_and_refuses_pushes() {
        let queue = Arc::new(Queue::new(4));
        queue.push("a", false).await.unwrap();
        let taker = {
            let queue = queue.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(slot) = queue.pop().await {
                    got.push(slot.item);
                }
                got
            })
        };
        queue.push("b", true).await.unwrap();
        queue.close();
        assert_eq!(queue.push("c", false).await, Err("c"));
        let got = taker.await.unwrap();
        assert_eq!(got.len(), 2);
        assert!(got.contains(&"a") && got.contains(&"b"));
    }
}
