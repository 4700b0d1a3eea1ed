//! Write batches handed to connection writers, and the issue and completion times of recent
//! ones.

use std::collections::{HashMap, VecDeque};

use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Instant, PeerId, TransportInput};

/// Completed batch timings kept (the most recent ones).
const MAX_TIMINGS: usize = 1 << 16;

struct Flight {
    peer: PeerId,
    /// Some pieces could not be queued (their connection was closing): the batch fails once
    /// the others are written out.
    failed: bool,
    bytes: u64,
    issued: Instant,
}

/// The batches in flight.
#[derive(Default)]
pub(crate) struct Batches {
    flights: HashMap<WriteBatchId, Flight>,
    /// `(bytes, issued, written out)` of recent batches, in completion order.
    timings: VecDeque<(u64, Instant, Instant)>,
}

impl Batches {
    /// `batch` went out to `peer`.
    pub(crate) fn issue(
        &mut self,
        batch: WriteBatchId,
        peer: PeerId,
        failed: bool,
        bytes: u64,
        now: Instant,
    ) {
        let flight = Flight {
            peer,
            failed,
            bytes,
            issued: now,
        };
        self.flights.insert(batch, flight);
    }

    /// Every queued piece of `batch` was written out: the batch's report.
    pub(crate) fn written(&mut self, batch: WriteBatchId, now: Instant) -> Option<TransportInput> {
        let flight = self.flights.remove(&batch)?;
        if flight.failed {
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
    pub(crate) fn forget_peer(&mut self, peer: PeerId) {
        self.flights.retain(|_, f| f.peer != peer);
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.flights.len()
    }

    pub(crate) fn timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.timings.iter().copied().collect()
    }
}
