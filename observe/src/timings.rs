//! One request's milestones from both endpoints, when they share a clock.

use kvpipe_core::session::RequestTimings;
use kvpipe_core::{Duration, Instant};

/// A request's sender and receiver [`RequestTimings`] side by side. Meaningful only when both
/// endpoints' clocks have the same origin (one process: `kvpipe-mem`, or TCP / verbs nodes
/// given the same `origin`); across processes each side has only its own view
/// ([`RequestTimings::tail`], [`RequestTimings::receiver_tail`], [`RequestTimings::transfer`]).
///
/// | milestone | from | meaning |
/// |---|---|---|
/// | [`first_chunk_submitted`](Self::first_chunk_submitted) | sender `first_chunk` | prefill's first chunk was handed to the sender |
/// | [`first_byte_sent`](Self::first_byte_sent) | sender `first_byte` | the first write batch was handed to the transport |
/// | [`last_chunk_computed`](Self::last_chunk_computed) | sender `last_chunk` | prefill's last chunk was handed to the sender (prefill finished) |
/// | [`last_byte_landed`](Self::last_byte_landed) | receiver `last_byte` | the last data write landed in decode memory |
/// | [`receiver_complete`](Self::receiver_complete) | receiver `ended` | the receiver completed: every result and the aux data arrived |
///
/// | interval | from → to |
/// |---|---|
/// | [`exposed_tail`](Self::exposed_tail) | last chunk computed → receiver complete: the part of the transfer prefill did not hide |
/// | [`transfer_time`](Self::transfer_time) | first byte sent → last byte landed |
/// | [`bytes`](Self::bytes) | bytes the receiver was reported written |
/// | [`write_batches`](Self::write_batches) | write batches the sender handed to the transport |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferTimings {
    /// The sender's timings (from its `Completed` event).
    pub sender: RequestTimings,
    /// The receiver's timings (from its `Completed` event).
    pub receiver: RequestTimings,
    /// Bytes the receiver's `Completed` event reported.
    pub bytes: u64,
}

impl TransferTimings {
    /// The two sides of one completed request.
    pub fn new(sender: RequestTimings, receiver: RequestTimings, bytes: u64) -> Self {
        TransferTimings {
            sender,
            receiver,
            bytes,
        }
    }

    /// Prefill's first chunk was handed to the sender.
    pub fn first_chunk_submitted(&self) -> Option<Instant> {
        self.sender.first_chunk
    }

    /// The first write batch was handed to the transport.
    pub fn first_byte_sent(&self) -> Option<Instant> {
        self.sender.first_byte
    }

    /// Prefill's last chunk was handed to the sender.
    pub fn last_chunk_computed(&self) -> Option<Instant> {
        self.sender.last_chunk
    }

    /// The last data write landed on the receiver.
    pub fn last_byte_landed(&self) -> Option<Instant> {
        self.receiver.last_byte
    }

    /// The receiver completed.
    pub fn receiver_complete(&self) -> Instant {
        self.receiver.ended
    }

    /// Last chunk computed → receiver complete: what prefill did not hide.
    pub fn exposed_tail(&self) -> Option<Duration> {
        Some(self.receiver_complete() - self.last_chunk_computed()?)
    }

    /// First byte sent → last byte landed.
    pub fn transfer_time(&self) -> Option<Duration> {
        Some(self.last_byte_landed()? - self.first_byte_sent()?)
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Write batches the sender handed to the transport.
    pub fn write_batches(&self) -> u64 {
        self.sender.writes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_span_the_two_sides() {
        let at = Instant::from_millis;
        let sender = RequestTimings {
            started: at(1),
            first_chunk: Some(at(2)),
            first_byte: Some(at(3)),
            last_chunk: Some(at(10)),
            last_byte: Some(at(12)),
            ended: at(13),
            writes: 4,
            ..RequestTimings::default()
        };
        let receiver = RequestTimings {
            started: at(0),
            first_byte: Some(at(4)),
            last_byte: Some(at(12)),
            last_burst: Some(at(10)),
            ended: at(14),
            writes: 9,
            ..RequestTimings::default()
        };
        let t = TransferTimings::new(sender, receiver, 100);
        assert_eq!(t.exposed_tail(), Some(Duration::from_millis(4)));
        assert_eq!(t.transfer_time(), Some(Duration::from_millis(9)));
        assert_eq!(t.write_batches(), 4);
        assert_eq!(t.bytes(), 100);
        let unsent = TransferTimings::new(RequestTimings::default(), receiver, 0);
        assert_eq!(unsent.exposed_tail(), None);
        assert_eq!(unsent.transfer_time(), None);
    }
}
