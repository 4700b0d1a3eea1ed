//! What both endpoints hold around their sessions: the peers (handshake, codec, liveness), the
//! timers, the output queue, the counters and the remembered cancels — and the reports both
//! roles make alike (a stop, a completion, a quiesce). `role.rs` handles the transport inputs
//! that do not depend on the role over it.

use std::collections::VecDeque;

use bytes::Bytes;

use super::config::Deadlines;
use super::peers::{PeerExpiry, PeerTable, Route};
use super::remembered::Remembered;
use super::stop::Stop;
use super::timers::{TimerKey, Timers};
use super::{
    CancelOrigin, CloseReason, Counters, Event, Output, ProtocolError, RequestTimings, UsageError,
};
use crate::ids::{PeerId, ReceiverSliceId, RequestId};
use crate::time::Instant;
use crate::wire::{AuxData, Frame, Hello, RecvComplete};

/// A deadline that passed and concerns the role's sessions.
pub(crate) enum Due {
    /// The peer's handshake did not finish in time (it is being closed).
    Handshake(PeerId),
    /// Nothing arrived from the peer for the liveness timeout: fail the sessions that need it.
    Liveness(PeerId),
    /// One of the request's deadlines may have passed.
    Request(RequestId),
}

#[derive(Debug)]
pub(crate) struct Shell {
    pub(crate) peers: PeerTable,
    pub(crate) timers: Timers,
    pub(crate) outputs: VecDeque<Output>,
    pub(crate) counters: Counters,
    /// Cancels for requests not opened or registered yet (oldest forgotten first).
    pub(crate) remembered_cancels: Remembered<CancelOrigin>,
}

impl Shell {
    pub(crate) fn new(
        local: Hello,
        deadlines: Deadlines,
        max_remembered_cancels: usize,
        peer_ids_reused: bool,
    ) -> Self {
        Shell {
            peers: PeerTable::new(local, deadlines, peer_ids_reused),
            timers: Timers::default(),
            outputs: VecDeque::new(),
            counters: Counters::default(),
            remembered_cancels: Remembered::new(max_remembered_cancels),
        }
    }

    /// Queues `frame` for `peer` (encoded at its version). Returns false if it could not be
    /// encoded; the caller fails what depended on it.
    pub(crate) fn send(&mut self, now: Instant, peer: PeerId, frame: Frame) -> bool {
        self.peers
            .transmit(now, peer, frame, &mut self.outputs, &mut self.counters)
    }

    pub(crate) fn event(&mut self, event: Event) {
        if let Event::Quiesced { request } = event {
            // A quiesced request is completed, or stopped with nothing in flight: none of its
            // deadlines can matter any more (each would fire as a no-op), so they go now
            // instead of staying queued for up to the longest deadline after it is retired.
            self.timers.disarm(TimerKey::Request(request));
        }
        self.outputs.push_back(Output::Event(event));
    }

    pub(crate) fn violation(&mut self, peer: PeerId, error: ProtocolError) {
        self.counters.protocol_errors += 1;
        self.event(Event::ProtocolViolation { peer, error });
    }

    /// Reports that `request` stopped: counts the stop, tells the engine (a failure names
    /// `receiver_slice`) and arms the quiesce deadline `quiesce_at`.
    pub(crate) fn stopped(
        &mut self,
        request: RequestId,
        why: Stop,
        receiver_slice: Option<ReceiverSliceId>,
        quiesce_at: Instant,
    ) {
        self.counters.failures.bump(why.status());
        match why {
            Stop::TimedOut(_) => self.counters.timeouts += 1,
            Stop::Cancelled(_) => self.counters.cancellations += 1,
            Stop::Failed { .. } => {}
        }
        self.event(why.event(request, receiver_slice));
        self.timers.arm(quiesce_at, TimerKey::Request(request));
    }

    /// Reports `request` completed, then quiesced (nothing is in flight), telling each of
    /// `writers` (a receiver's writers; none on a sender) with `RecvComplete` between the two
    /// events: after `Completed`, which the decode engine waits for (the frame costs its tail
    /// nothing), and before `Quiesced`, after which nothing of the request leaves.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn completed(
        &mut self,
        now: Instant,
        request: RequestId,
        bytes_written: u64,
        aux: Option<AuxData>,
        timings: RequestTimings,
        blocks_pinned: u64,
        writers: &[PeerId],
    ) {
        self.counters.completions += 1;
        self.event(Event::Completed {
            request,
            bytes_written,
            aux,
            timings,
        });
        for &peer in writers {
            self.send(now, peer, Frame::RecvComplete(RecvComplete { request }));
        }
        self.quiesced(request, blocks_pinned);
    }

    /// Reports that no write of `request` can touch its `blocks_pinned` blocks any more.
    pub(crate) fn quiesced(&mut self, request: RequestId, blocks_pinned: u64) {
        self.counters.quiesced += 1;
        self.counters.blocks_released += blocks_pinned;
        self.event(Event::Quiesced { request });
    }

    pub(crate) fn close(&mut self, peer: PeerId, reason: CloseReason) {
        self.peers
            .close(peer, reason, &mut self.outputs, &mut self.counters);
    }

    /// `peer` connected; this side's Hello to it carries `offer`, if any.
    pub(crate) fn connected(
        &mut self,
        now: Instant,
        peer: PeerId,
        offer: Option<Bytes>,
    ) -> Result<(), UsageError> {
        self.peers.connected(
            now,
            (peer, offer),
            &mut self.outputs,
            &mut self.counters,
            &mut self.timers,
        )
    }

    /// The transport answered `peer`'s data-path offer.
    pub(crate) fn data_path_answered(
        &mut self,
        now: Instant,
        peer: PeerId,
        answer: Bytes,
    ) -> Result<Route, UsageError> {
        self.peers.answered(
            now,
            (peer, answer),
            &mut self.outputs,
            &mut self.counters,
            &mut self.timers,
        )
    }

    /// Decodes one frame from `peer` and handles what the connection layer owns.
    pub(crate) fn frame(
        &mut self,
        now: Instant,
        peer: PeerId,
        bytes: &Bytes,
    ) -> Result<Route, UsageError> {
        self.peers.on_bytes(
            now,
            peer,
            bytes,
            &mut self.outputs,
            &mut self.counters,
            &mut self.timers,
        )
    }

    /// Fires the due timers: peers' deadlines here, request deadlines for the role.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<Due> {
        let mut out = Vec::new();
        for key in self.timers.due(now) {
            match key {
                TimerKey::Peer(peer) => {
                    let expiry = self.peers.on_timeout(
                        now,
                        peer,
                        &mut self.outputs,
                        &mut self.counters,
                        &mut self.timers,
                    );
                    match expiry {
                        PeerExpiry::None => {}
                        PeerExpiry::Handshake => out.push(Due::Handshake(peer)),
                        PeerExpiry::Liveness => out.push(Due::Liveness(peer)),
                    }
                }
                TimerKey::Request(request) => out.push(Due::Request(request)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::InstanceId;
    use crate::session::config::LocalHello;
    use crate::wire::{Role, Topology};

    #[test]
    fn a_quiesced_request_leaves_no_deadline_behind() {
        let hello = LocalHello::new(InstanceId(1), Topology::default(), Vec::new());
        let mut shell = Shell::new(hello.to_hello(Role::Sender), Deadlines::default(), 0, true);
        let at = Instant::from_millis;
        let (a, b) = (RequestId(1), RequestId(2));
        shell.timers.arm(at(10), TimerKey::Request(a));
        shell.timers.arm(at(20), TimerKey::Request(a));
        shell.timers.arm(at(30), TimerKey::Request(b));
        shell.timers.arm(at(5), TimerKey::Peer(PeerId(7)));
        // Other events of a request keep its deadlines (a stopped request still waits for its
        // writes).
        shell.event(Event::Cancelled {
            request: a,
            origin: CancelOrigin::Local,
        });
        assert_eq!(shell.timers.len(), 4);
        shell.event(Event::Quiesced { request: a });
        assert_eq!(shell.timers.len(), 2);
        let due = shell.timers.due(at(100));
        assert_eq!(
            due,
            vec![TimerKey::Peer(PeerId(7)), TimerKey::Request(b)],
            "the quiesced request's deadlines never fire"
        );
        assert_eq!(shell.outputs.len(), 2, "both events are still reported");
    }
}
