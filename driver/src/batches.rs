//! Write batches handed to the transport and not reported yet, and the issue and completion
//! times of recent ones.

use std::collections::{HashMap, VecDeque};

use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Instant, PeerId, TransportInput};

/// Completed batch timings kept (the most recent ones).
const MAX_TIMINGS: usize = 1 << 16;

struct Flight {
    peer: PeerId,
    bytes: u64,
    issued: Instant,
}

/// The batches in flight.
#[derive(Default)]
pub struct Batches {
    flights: HashMap<WriteBatchId, Flight>,
    /// `(bytes, issued, done)` of recent batches, in completion order.
    timings: VecDeque<(u64, Instant, Instant)>,
}

impl Batches {
    /// `batch` of `bytes` went out to `peer` at `now`.
    pub fn issue(&mut self, batch: WriteBatchId, peer: PeerId, bytes: u64, now: Instant) {
        let flight = Flight {
            peer,
            bytes,
            issued: now,
        };
        self.flights.insert(batch, flight);
    }

    /// The transport finished `batch` (`ok`: every byte of it placed): the batch's report for
    /// the endpoint, `None` for a batch not in flight (its peer was forgotten).
    pub fn finish(
        &mut self,
        batch: WriteBatchId,
        ok: bool,
        now: Instant,
    ) -> Option<TransportInput> {
        let flight = self.flights.remove(&batch)?;
        if !ok {
            return Some(TransportInput::WritesFailed {
                batch,
                status: TransferStatus::WriteFailed,
            });
        }
        if self.timings.len() >= MAX_TIMINGS {
            self.timings.pop_front();
        }
        self.timings.push_back((flight.bytes, flight.issued, now));
        Some(TransportInput::WritesCompleted { batch })
    }

    /// `peer` is gone: its batches are no longer reported (the core drops them on the
    /// disconnect).
    pub fn forget_peer(&mut self, peer: PeerId) {
        self.flights.retain(|_, f| f.peer != peer);
    }

    /// Batches in flight.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// `(bytes, issued, done)` of recent batches, in completion order.
    pub fn timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.timings.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_batch_fails_and_a_forgotten_one_is_not_reported() {
        let mut b = Batches::default();
        let t = Instant::from_nanos(5);
        b.issue(WriteBatchId(1), PeerId(0), 10, t);
        b.issue(WriteBatchId(2), PeerId(0), 10, t);
        b.issue(WriteBatchId(3), PeerId(1), 10, t);
        assert_eq!(b.in_flight(), 3);
        assert!(matches!(
            b.finish(WriteBatchId(1), true, t),
            Some(TransportInput::WritesCompleted { .. })
        ));
        // Not every byte placed: the batch fails, and its timing is not kept.
        assert!(matches!(
            b.finish(WriteBatchId(2), false, t),
            Some(TransportInput::WritesFailed { .. })
        ));
        b.forget_peer(PeerId(1));
        assert!(b.finish(WriteBatchId(3), true, t).is_none());
        assert_eq!(b.timings(), vec![(10, t, t)]);
    }
}
