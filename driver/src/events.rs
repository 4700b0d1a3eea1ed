//! The engine's event queue, with its own lock (an engine waiting for events never holds the
//! node's lock).

use std::collections::VecDeque;
use std::time::Duration as StdDuration;

use kvpipe_core::{Event, Instant};
use parking_lot::{Condvar, Mutex};

use crate::clock::deadline_after;

/// Events the endpoint reported, with the node time of the report.
#[derive(Default)]
pub struct EventQueue {
    queue: Mutex<VecDeque<(Instant, Event)>>,
    ready: Condvar,
    /// Wakes async waiters.
    #[cfg(feature = "tokio")]
    notify: tokio::sync::Notify,
}

impl EventQueue {
    /// Queues `event`, reported at `at`, and wakes every waiter.
    pub fn push(&self, at: Instant, event: Event) {
        self.queue.lock().push_back((at, event));
        self.ready.notify_all();
        #[cfg(feature = "tokio")]
        self.notify.notify_waiters();
    }

    /// The next event, waiting up to `timeout`.
    pub fn next(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        let deadline = deadline_after(timeout);
        let mut q = self.queue.lock();
        loop {
            if let Some(e) = q.pop_front() {
                return Some(e);
            }
            if self.ready.wait_until(&mut q, deadline).timed_out() {
                return q.pop_front();
            }
        }
    }

    /// Every queued event.
    pub fn take_all(&self) -> Vec<(Instant, Event)> {
        self.queue.lock().drain(..).collect()
    }

    /// The next event, waiting up to `timeout` without blocking the runtime.
    #[cfg(feature = "tokio")]
    pub async fn next_async(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        let now = tokio::time::Instant::now();
        let deadline = now.checked_add(timeout).unwrap_or(now + crate::clock::FAR);
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a push between the check and the wait wakes it.
            notified.as_mut().enable();
            if let Some(e) = self.queue.lock().pop_front() {
                return Some(e);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.queue.lock().pop_front();
            }
        }
    }
}
