//! Carrying out the endpoint's outputs, in the order it produced them, under the node's lock:
//! nothing here blocks or touches a socket. Frames and data-write pieces go to the connection
//! writers' queues, close requests to the peer's link, events to the engine's queue.

use kvpipe_core::session::{CloseReason, DataWriteHeaders, WriteBatchId};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Endpoint, Event, Instant, Output, PeerId, TransportInput, WritePlan};

use super::{Shared, State};
use crate::conn::{cut_plan, BatchTally, TalliedPiece};
use crate::stats::bump;

impl<E: Endpoint + Send + 'static> Shared<E> {
    /// Runs `f` on the endpoint under the lock, then carries out its outputs.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut E, Instant) -> R) -> R {
        let mut st = self.state.lock();
        let now = self.now();
        let r = f(&mut st.endpoint, now);
        self.drain(&mut st, now);
        r
    }

    /// Carries out every pending output of the endpoint.
    pub(crate) fn drain(&self, st: &mut State<E>, now: Instant) {
        let mut reports = Vec::new();
        loop {
            while let Some(output) = st.endpoint.poll_output() {
                st.observer.output(now, &output);
                match output {
                    Output::Transmit { peer, bytes, .. } => {
                        if let Some(link) = st.links.get(peer) {
                            link.transmit(bytes);
                        }
                    }
                    Output::ExecuteWrites {
                        peer,
                        batch,
                        plan,
                        headers,
                        ..
                    } => reports.extend(self.execute(st, now, peer, batch, &plan, &headers)),
                    Output::ClosePeer { peer, reason } => self.close_peer(st, peer, reason),
                    Output::Event(event) => {
                        if let Event::PeerReady { peer, .. } = &event {
                            // Proven: it no longer counts against the caps on unauthenticated
                            // connections.
                            if let Some(link) = st.links.get_mut(*peer) {
                                link.authenticated = true;
                            }
                        }
                        self.events.push(now, event);
                    }
                }
            }
            if reports.is_empty() {
                break;
            }
            for report in reports.drain(..) {
                st.feed(now, report);
            }
        }
        st.observer.counters(&st.endpoint);
        if let Some(at) = st.endpoint.poll_timeout().and_then(|at| self.wall(at)) {
            self.wake_timer_by(st, at);
        }
    }

    /// Cuts a write batch into pieces and queues them to the peer's connections
    /// ([`PeerLink::queue_pieces`](super::link::PeerLink::queue_pieces)). Returns the batch's
    /// report when it is known at once.
    fn execute(
        &self,
        st: &mut State<E>,
        now: Instant,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &WritePlan,
        headers: &DataWriteHeaders,
    ) -> Option<TransportInput> {
        // A peer without a link was reported disconnected: the endpoint emits nothing for it.
        let link = st.links.get(peer)?;
        let failed = TransportInput::WritesFailed {
            batch,
            status: TransferStatus::WriteFailed,
        };
        let Ok(pieces) = cut_plan(
            plan,
            |region, offset, len| headers.encode(region, offset, len),
            link.conns.len(),
            (self.config.min_piece_bytes, self.config.max_piece_bytes),
            &self.regions,
            matches!(link.placement, crate::peer_copy::Placement::Source),
        ) else {
            // A source extent outside registered memory: nothing is sent.
            return Some(failed);
        };
        if pieces.is_empty() {
            return Some(TransportInput::WritesCompleted { batch });
        }
        let count = pieces.len() as u64;
        // One more than the pieces: the hold released below, once the pieces refused are known,
        // so that no writer reports the batch before.
        let tally = BatchTally::new(batch, count + 1);
        let refused = link.queue_pieces(
            pieces
                .into_iter()
                .map(|piece| TalliedPiece {
                    piece,
                    tally: tally.clone(),
                })
                .collect(),
        );
        if refused == count {
            return Some(failed);
        }
        st.batches
            .issue(batch, peer, refused > 0, plan.total_bytes(), now);
        if tally.done(refused + 1) {
            // Every queued piece was written out already.
            return st.batches.written(batch, now);
        }
        None
    }

    /// The endpoint asked to close `peer`. A peer that stopped answering (or is fenced) is
    /// aborted at once; otherwise what was queued to it is flushed first, bounded by the close
    /// grace, so it learns why (a rejection, a refused write).
    fn close_peer(&self, st: &mut State<E>, peer: PeerId, reason: CloseReason) {
        let Some(link) = st.links.get_mut(peer) else {
            return;
        };
        let until = super::events::deadline_after(self.config.close_grace);
        let started = match reason {
            CloseReason::LivenessTimeout
            | CloseReason::HandshakeTimeout
            | CloseReason::QuiesceFence => link.abort(),
            CloseReason::HandshakeRejected
            | CloseReason::RejectedByPeer
            | CloseReason::ProtocolViolation
            | CloseReason::GrantViolation => link.close_orderly(until),
        };
        if started {
            tracing::debug!(target: "kvpipe::tcp", %peer, ?reason, "closing the peer's connections");
            bump(&self.stats.peers_closed, 1);
            self.wake_timer_by(st, until);
        }
    }
}
