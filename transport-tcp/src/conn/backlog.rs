//! A peer's data-write pieces that no connection writer has taken yet, shared by the writers of
//! all its connections.
//!
//! Pieces are not bound to a connection when a batch is queued: each writer takes the next ones
//! when its own stream runs low ([`Backlog::take`]). A connection that the machine serves
//! faster carries more pieces, so all connections finish a request together. Cutting a request
//! into equal shares up front leaves the slowest connection alone at the end; on a loaded
//! two-core machine one connection of four finished up to half a transfer before the last.
//!
//! Each piece carries its batch's [`BatchTally`]: the writer that writes out the batch's last
//! piece reports the batch, whichever connection it is.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvpipe_core::session::WriteBatchId;
use parking_lot::Mutex;

use super::pieces::Piece;

/// The pieces of one write batch not written out yet.
#[derive(Debug)]
pub(crate) struct BatchTally {
    batch: WriteBatchId,
    left: AtomicU64,
}

impl BatchTally {
    /// A tally of `count` pieces (the issuer adds one it holds while it queues them, so that
    /// the batch cannot be reported before every piece was counted).
    pub(crate) fn new(batch: WriteBatchId, count: u64) -> Arc<Self> {
        Arc::new(BatchTally {
            batch,
            left: AtomicU64::new(count),
        })
    }

    /// The batch.
    pub(crate) fn batch(&self) -> WriteBatchId {
        self.batch
    }

    /// `n` counted pieces are done (written out, or never queued); whether they were the last.
    pub(crate) fn done(&self, n: u64) -> bool {
        n > 0 && self.left.fetch_sub(n, Ordering::AcqRel) == n
    }
}

/// A piece with its batch's tally.
#[derive(Debug)]
pub(crate) struct TalliedPiece {
    pub(crate) piece: Piece,
    pub(crate) tally: Arc<BatchTally>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Pieces are accepted.
    Open,
    /// The peer is closing: nothing more is accepted; queued pieces are still taken.
    Closed,
    /// The peer is torn down: the queued pieces were dropped.
    Aborted,
}

/// A peer's pieces waiting for a writer (see the module doc).
pub(crate) struct Backlog {
    inner: Mutex<(VecDeque<TalliedPiece>, State)>,
}

impl Default for Backlog {
    fn default() -> Self {
        Backlog {
            inner: Mutex::new((VecDeque::new(), State::Open)),
        }
    }
}

impl Backlog {
    /// Queues `pieces` behind those already waiting; `false` (and nothing queued) once the peer
    /// is closing or torn down.
    pub(crate) fn push(&self, pieces: impl IntoIterator<Item = TalliedPiece>) -> bool {
        let mut q = self.inner.lock();
        if q.1 != State::Open {
            return false;
        }
        q.0.extend(pieces);
        true
    }

    /// Accepts nothing more; what is queued is still taken (an orderly close writes it out).
    pub(crate) fn close(&self) {
        let mut q = self.inner.lock();
        if q.1 == State::Open {
            q.1 = State::Closed;
        }
    }

    /// Drops every queued piece and accepts nothing more.
    pub(crate) fn abort(&self) {
        let mut q = self.inner.lock();
        q.1 = State::Aborted;
        q.0.clear();
    }

    /// Hands `out` the front pieces, in order, until they add up to at least `want` payload
    /// bytes or none is left. Returns the bytes handed.
    pub(crate) fn take(&self, want: u64, mut out: impl FnMut(TalliedPiece)) -> u64 {
        let mut taken = 0;
        let mut q = self.inner.lock();
        while taken < want {
            let Some(p) = q.0.pop_front() else {
                break;
            };
            taken += p.piece.len;
            out(p);
        }
        taken
    }

    /// Pieces waiting.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryRegion, Registered};

    fn pieces(tally: &Arc<BatchTally>, lens: &[u64]) -> Vec<TalliedPiece> {
        let src = Registered::Host(MemoryRegion::zeroed(1 << 10));
        lens.iter()
            .map(|&len| TalliedPiece {
                piece: Piece::new([0; kvpipe_core::wire::DATA_WRITE_FRAME_LEN], &src, 0, len)
                    .unwrap(),
                tally: tally.clone(),
            })
            .collect()
    }

    #[test]
    fn takes_front_pieces_until_the_wanted_bytes_are_reached() {
        let backlog = Backlog::default();
        let tally = BatchTally::new(WriteBatchId(1), 4);
        assert!(backlog.push(pieces(&tally, &[10, 20, 30, 40])));
        let mut got = Vec::new();
        assert_eq!(backlog.take(25, |p| got.push(p.piece.len)), 30);
        assert_eq!(got, [10, 20]);
        assert_eq!(backlog.take(0, |_| panic!("nothing wanted")), 0);
        assert_eq!(backlog.take(1000, |p| got.push(p.piece.len)), 70);
        assert_eq!(got, [10, 20, 30, 40]);
        assert_eq!(backlog.take(1, |_| panic!("empty")), 0);
    }

    #[test]
    fn a_closed_backlog_refuses_pieces_but_hands_out_those_queued() {
        let backlog = Backlog::default();
        let tally = BatchTally::new(WriteBatchId(1), 2);
        assert!(backlog.push(pieces(&tally, &[5])));
        backlog.close();
        assert!(!backlog.push(pieces(&tally, &[6])));
        assert_eq!(backlog.len(), 1);
        assert_eq!(backlog.take(u64::MAX, |_| {}), 5);
        backlog.abort();
        assert!(!backlog.push(pieces(&tally, &[7])));
    }

    #[test]
    fn an_abort_drops_the_queued_pieces() {
        let backlog = Backlog::default();
        let tally = BatchTally::new(WriteBatchId(1), 2);
        assert!(backlog.push(pieces(&tally, &[5, 6])));
        backlog.abort();
        assert_eq!(backlog.len(), 0);
        assert_eq!(backlog.take(u64::MAX, |_| panic!("dropped")), 0);
    }

    #[test]
    fn the_tally_reports_its_last_piece_once() {
        let tally = BatchTally::new(WriteBatchId(3), 3);
        assert!(!tally.done(1));
        assert!(!tally.done(0));
        assert!(tally.done(2));
        assert_eq!(tally.batch(), WriteBatchId(3));
    }
}
