//! Exclusive access to a node's endpoint for engine commands the node does not wrap.

use std::sync::Arc;

use kvpipe_core::{Endpoint, Instant};
use parking_lot::{ArcMutexGuard, RawMutex};

use crate::node::{Driver, Io, Locked};

/// Exclusive access to a node's core endpoint, for engine commands the node does not wrap.
/// While it lives the node's threads wait; when it is dropped, every output the commands
/// produced is carried out.
pub struct EndpointGuard<E: Endpoint + Send + 'static, T: Io> {
    guard: Option<ArcMutexGuard<RawMutex, Locked<E, T>>>,
    driver: Arc<Driver<E, T>>,
}

impl<E: Endpoint + Send + 'static, T: Io> EndpointGuard<E, T> {
    pub(crate) fn new(
        guard: ArcMutexGuard<RawMutex, Locked<E, T>>,
        driver: Arc<Driver<E, T>>,
    ) -> Self {
        EndpointGuard {
            guard: Some(guard),
            driver,
        }
    }

    /// The node's current time (what the endpoint's inputs take as `now`).
    pub fn now(&self) -> Instant {
        self.driver.now()
    }

    /// Write batches handed to the transport and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.guard.as_ref().map_or(0, |st| st.batches.in_flight())
    }

    /// `(bytes, issued, done)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.guard
            .as_ref()
            .map_or_else(Vec::new, |st| st.batches.timings())
    }
}

impl<E: Endpoint + Send + 'static, T: Io> std::ops::Deref for EndpointGuard<E, T> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.guard.as_ref().expect("held until drop").endpoint
    }
}

impl<E: Endpoint + Send + 'static, T: Io> std::ops::DerefMut for EndpointGuard<E, T> {
    fn deref_mut(&mut self) -> &mut E {
        &mut self.guard.as_mut().expect("held until drop").endpoint
    }
}

impl<E: Endpoint + Send + 'static, T: Io> Drop for EndpointGuard<E, T> {
    fn drop(&mut self) {
        if let Some(mut st) = self.guard.take() {
            // What arrived while the engine held the endpoint is applied before it is let go.
            self.driver.settle(&mut st);
            let now = self.driver.now();
            self.driver.drain(&mut st, now);
        }
    }
}
