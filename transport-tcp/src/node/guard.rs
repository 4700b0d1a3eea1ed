//! Exclusive access to a node's endpoint for engine commands the handles do not wrap.

use std::sync::Arc;

use kvpipe_core::{Endpoint, Instant};

use super::{Shared, State};

/// Exclusive access to a node's core endpoint, for engine commands the handles do not wrap.
/// While it lives the node's threads wait; when it is dropped, every output the commands
/// produced is carried out.
pub struct EndpointGuard<E: Endpoint + Send + 'static> {
    guard: Option<parking_lot::ArcMutexGuard<parking_lot::RawMutex, State<E>>>,
    shared: Arc<Shared<E>>,
}

impl<E: Endpoint + Send + 'static> EndpointGuard<E> {
    pub(crate) fn new(shared: &Arc<Shared<E>>) -> Self {
        EndpointGuard {
            guard: Some(shared.state.lock_arc()),
            shared: shared.clone(),
        }
    }

    /// The node's current time (what the endpoint's inputs take as `now`).
    pub fn now(&self) -> Instant {
        self.shared.now()
    }

    /// Write batches handed to connections and not written out yet.
    pub fn writes_in_flight(&self) -> usize {
        self.guard.as_ref().map_or(0, |st| st.batches.in_flight())
    }

    /// `(bytes, issued, written out)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.guard
            .as_ref()
            .map_or_else(Vec::new, |st| st.batches.timings())
    }
}

impl<E: Endpoint + Send + 'static> std::ops::Deref for EndpointGuard<E> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.guard.as_ref().expect("held until drop").endpoint
    }
}

impl<E: Endpoint + Send + 'static> std::ops::DerefMut for EndpointGuard<E> {
    fn deref_mut(&mut self) -> &mut E {
        &mut self.guard.as_mut().expect("held until drop").endpoint
    }
}

impl<E: Endpoint + Send + 'static> Drop for EndpointGuard<E> {
    fn drop(&mut self) {
        if let Some(mut st) = self.guard.take() {
            let now = self.shared.now();
            self.shared.drain(&mut st, now);
        }
    }
}
