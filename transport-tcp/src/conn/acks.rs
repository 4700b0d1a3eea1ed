//! The sender's side of pulled writes ([`crate::peer_copy`]): pieces whose source went out on a
//! connection and that the receiver has not acknowledged yet, in stream order. The
//! connection's writer adds each piece before its bytes can reach the socket; the connection's
//! reader takes acknowledgements off the front and reports a batch once its last piece was
//! acknowledged (never when it was only written: until then the receiver may still read the
//! source blocks).

use std::collections::VecDeque;
use std::sync::Arc;

use kvpipe_core::session::WriteBatchId;
use parking_lot::Mutex;

use super::backlog::BatchTally;

/// What an acknowledgement completed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Acked {
    /// Batches whose last piece it acknowledged, in order.
    pub(crate) batches: Vec<WriteBatchId>,
    /// Payload bytes of the pieces it acknowledged.
    pub(crate) bytes: u64,
}

/// The receiver acknowledged more pieces than the connection carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{acked} pulled pieces acknowledged, {waiting} waiting")]
pub(crate) struct TooManyAcks {
    pub(crate) acked: u64,
    pub(crate) waiting: u64,
}

/// A connection's pulled pieces awaiting the receiver's acknowledgement (see the module doc).
#[derive(Default)]
pub(crate) struct PullAcks {
    inner: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    pieces: VecDeque<(Arc<BatchTally>, u64)>,
    bytes: u64,
}

impl PullAcks {
    /// A piece of `len` bytes of `tally`'s batch goes out next on the connection.
    pub(crate) fn expect(&self, tally: Arc<BatchTally>, len: u64) {
        let mut w = self.inner.lock();
        w.bytes += len;
        w.pieces.push_back((tally, len));
    }

    /// Payload bytes sent and not acknowledged yet.
    pub(crate) fn unacked_bytes(&self) -> u64 {
        self.inner.lock().bytes
    }

    /// The next `count` pieces were acknowledged. An acknowledgement of pieces that were never
    /// sent changes nothing and is an error (the peer broke the exchange).
    pub(crate) fn acked(&self, count: u32) -> Result<Acked, TooManyAcks> {
        let mut w = self.inner.lock();
        let waiting = w.pieces.len() as u64;
        if u64::from(count) > waiting {
            return Err(TooManyAcks {
                acked: count.into(),
                waiting,
            });
        }
        let mut out = Acked::default();
        for (tally, len) in w.pieces.drain(..count as usize) {
            out.bytes += len;
            if tally.done(1) {
                out.batches.push(tally.batch());
            }
        }
        w.bytes -= out.bytes;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_completes_on_its_last_acknowledgement_not_before() {
        let acks = PullAcks::default();
        let one = BatchTally::new(WriteBatchId(1), 2);
        let two = BatchTally::new(WriteBatchId(2), 1);
        acks.expect(one.clone(), 10);
        acks.expect(one, 20);
        acks.expect(two, 5);
        assert_eq!(acks.unacked_bytes(), 35);
        assert_eq!(
            acks.acked(1).unwrap(),
            Acked {
                batches: vec![],
                bytes: 10
            }
        );
        assert_eq!(
            acks.acked(2).unwrap(),
            Acked {
                batches: vec![WriteBatchId(1), WriteBatchId(2)],
                bytes: 25
            }
        );
        assert_eq!(acks.unacked_bytes(), 0);
    }

    #[test]
    fn acknowledging_pieces_never_sent_is_refused_and_changes_nothing() {
        let acks = PullAcks::default();
        acks.expect(BatchTally::new(WriteBatchId(1), 1), 8);
        assert_eq!(
            acks.acked(2),
            Err(TooManyAcks {
                acked: 2,
                waiting: 1
            })
        );
        assert_eq!(acks.unacked_bytes(), 8);
        assert_eq!(acks.acked(1).unwrap().batches, [WriteBatchId(1)]);
    }
}
