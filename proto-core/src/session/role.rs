//! The session frame both endpoints share, written once over what each role adds to it
//! ([`EndpointRole`]): the transport inputs that do not depend on the role (a peer connecting,
//! leaving, sending a frame; a timer firing), a lost or silent peer failing exactly the
//! sessions that still needed it, a peer's protocol error, and a participant's cancel.

use bytes::Bytes;

use super::peers::Route;
use super::shell::{Due, Shell};
use super::state::SessionPhase;
use super::stop::Stop;
use super::table::{HeldSession, SessionTable};
use super::{CancelOrigin, Event, Output, ProtocolError, TransportInput, UsageError, Wait};
use crate::ids::{PeerId, RequestId, SenderSliceId};
use crate::time::Instant;
use crate::wire::Frame;

/// What one role (sender or receiver) adds to the shared session frame: its sessions, and its
/// own reaction to each thing the frame handles for both.
pub(crate) trait EndpointRole {
    /// The role's per-request session.
    type Session: HeldSession;
    /// What the role remembers of a retired request.
    type Kept;

    /// The peers, timers, outputs and counters.
    fn shell(&mut self) -> &mut Shell;

    /// The sessions and retired ids.
    fn sessions(&self) -> &SessionTable<Self::Session, Self::Kept>;

    /// Forgets what the role holds of a disconnected `peer` outside its sessions.
    fn forget_peer(&mut self, peer: PeerId);

    /// Marks disconnected `peer` gone from `request`'s session (it takes part in it); returns
    /// whether the peer had finished its part, so its loss does not fail the session.
    fn participant_gone(&mut self, request: RequestId, peer: PeerId) -> bool;

    /// `peer`, a participant of `request`, cancelled it: nothing of its is in flight for the
    /// request any more (a writer sends `Cancel` only then; a receiver writes nothing).
    fn participant_stopped(&mut self, request: RequestId, peer: PeerId);

    /// `peer` completed its handshake.
    fn on_peer_ready(&mut self, now: Instant, peer: PeerId);

    /// A session frame from ready `peer`.
    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame);

    /// `peer`'s handshake did not finish in time (the shell is closing it).
    fn on_handshake_timeout(&mut self, now: Instant, peer: PeerId);

    /// One of `request`'s deadlines may have passed.
    fn on_request_timeout(&mut self, now: Instant, request: RequestId);

    /// Ends `request`'s active session for `why`: reports it, tells the peers, and waits
    /// for quiesce. A session that ended already is left as it is.
    fn stop(&mut self, now: Instant, request: RequestId, why: Stop);

    /// In a stopping session: quiesces it once nothing of it can still be written.
    fn check_drained(&mut self, now: Instant, request: RequestId);

    /// Applies the transport inputs both roles handle alike (a peer connected, disconnected or
    /// sent a frame; a timer fired). Hands any other input back, untouched, for the role.
    fn on_shared_transport(
        &mut self,
        now: Instant,
        input: TransportInput,
    ) -> Result<Option<TransportInput>, UsageError> {
        match input {
            TransportInput::PeerConnected { peer } => self.shell().connected(now, peer, None)?,
            TransportInput::PeerConnectedWithOffer { peer, offer } => {
                self.shell().connected(now, peer, Some(offer))?
            }
            TransportInput::DataPathAnswered { peer, answer } => {
                if let Route::BecameReady = self.shell().data_path_answered(now, peer, answer)? {
                    self.on_peer_ready(now, peer);
                }
            }
            TransportInput::PeerDisconnected { peer } => self.on_disconnected(now, peer)?,
            TransportInput::FrameReceived { peer, bytes } => self.on_frame(now, peer, &bytes)?,
            TransportInput::Timeout => {
                for due in self.shell().due(now) {
                    match due {
                        Due::Handshake(peer) => self.on_handshake_timeout(now, peer),
                        Due::Liveness(peer) => {
                            self.fail_peer_sessions(now, peer, Stop::TimedOut(Wait::Liveness))
                        }
                        Due::Request(request) => self.on_request_timeout(now, request),
                    }
                }
            }
            other => return Ok(Some(other)),
        }
        Ok(None)
    }

    /// Decodes one frame from `peer` and routes what the connection layer does not consume.
    fn on_frame(&mut self, now: Instant, peer: PeerId, bytes: &Bytes) -> Result<(), UsageError> {
        match self.shell().frame(now, peer, bytes)? {
            Route::Done => {}
            Route::BecameReady => self.on_peer_ready(now, peer),
            Route::Session(frame) => self.on_session_frame(now, peer, frame),
            Route::Malformed => self.fail_peer_sessions(now, peer, Stop::protocol(peer, None)),
        }
        Ok(())
    }

    /// The transport reported `peer` gone: none of its writes can touch memory any more. Every
    /// active session that still needed it fails ([`Stop::lost`]); the others may quiesce now.
    fn on_disconnected(&mut self, now: Instant, peer: PeerId) -> Result<(), UsageError> {
        let reason = self.shell().peers.disconnected(peer)?.closed_for();
        // The connection's end, first: its requests' failures follow.
        (self.shell().outputs).push_back(Output::Event(Event::PeerLost { peer, reason }));
        self.forget_peer(peer);
        for request in self.sessions().involving(peer) {
            let finished = self.participant_gone(request, peer);
            if self.is_active(request) && !finished {
                self.stop(now, request, Stop::lost(peer));
            } else {
                self.check_drained(now, request);
            }
        }
        Ok(())
    }

    /// `request` was just opened (or registered) towards `peers`: one whose connection ended
    /// fails it at once, as that end failed the requests open then ([`Stop::lost`]), instead of
    /// leaving it to wait out its deadline for a peer that is gone.
    fn meet_departed(&mut self, now: Instant, request: RequestId, peers: &[PeerId]) {
        for &peer in peers {
            if !self.shell().peers.has_departed(peer)
                || !self.sessions().live.contains_key(&request)
            {
                continue;
            }
            let finished = self.participant_gone(request, peer);
            if self.is_active(request) && !finished {
                self.stop(now, request, Stop::lost(peer));
            } else {
                self.check_drained(now, request);
            }
        }
    }

    /// Stops, for `why`, every active session that still needs `peer`.
    fn fail_peer_sessions(&mut self, now: Instant, peer: PeerId, why: Stop) {
        let involved = self
            .sessions()
            .requests_where(|s| s.phase().is_active() && s.awaits(peer));
        for request in involved {
            self.stop(now, request, why);
        }
    }

    /// Fails `request` for `peer`'s protocol error (reported to the engine too).
    fn stop_protocol(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
        error: ProtocolError,
    ) {
        self.stop_protocol_at(now, request, peer, error, None);
    }

    /// Fails `request` for `peer`'s protocol error, attributed to `slice` when one is known.
    fn stop_protocol_at(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
        error: ProtocolError,
        slice: Option<SenderSliceId>,
    ) {
        self.shell().violation(peer, error);
        self.stop(now, request, Stop::protocol(peer, slice));
    }

    /// `peer` cancelled `request`, which this side holds: an active session stops, an ended
    /// one may quiesce now. A peer that takes no part in the request broke a rule.
    fn on_participant_cancel(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        if !self
            .sessions()
            .live
            .get(&request)
            .is_some_and(|s| s.involves(peer))
        {
            let error = ProtocolError::NotAParticipant {
                kind: "Cancel",
                request,
            };
            self.shell().violation(peer, error);
            return;
        }
        self.participant_stopped(request, peer);
        if self.is_active(request) {
            self.stop(now, request, Stop::Cancelled(CancelOrigin::Peer(peer)));
        } else {
            self.check_drained(now, request);
        }
    }

    /// Whether `request`'s session is held and still transfers.
    fn is_active(&self, request: RequestId) -> bool {
        (self.sessions().live.get(&request)).is_some_and(|s| s.phase().is_active())
    }
}
