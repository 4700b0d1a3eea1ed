//! The per-request session states of both endpoints, as explicit enums with checked
//! transitions. The endpoints change a session's phase only through [`SendPhase::on`] and
//! [`RecvPhase::on`]; [`transition_table`] renders every event applied to every state (its insta
//! snapshot makes any behaviour change a reviewed diff).

use core::fmt::{self, Write as _};

/// Phase of one request on the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendPhase {
    /// Accepting chunks; slices are written to every registered receiver.
    Streaming,
    /// The last chunk was submitted; waiting for its writes, results and the aux data.
    Finishing,
    /// Every receiver got its last result and the aux data; nothing is in flight.
    Completed,
    /// Failed, timed out or cancelled; waiting until no write is in flight.
    Stopping,
    /// Ended and no write can touch the blocks: the engine may free them.
    Quiesced,
    /// Retired by the engine; the id is never used again.
    Retired,
}

/// Something that moves a sender session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendEvent {
    /// A chunk that is not the last one.
    Chunk,
    /// The last chunk.
    LastChunk,
    /// Every receiver got its last result, and the aux data went out.
    Finished,
    /// A slice failed, a deadline passed, a peer was lost or the request was cancelled.
    Stop,
    /// No write batch of the request is in flight any more.
    Drained,
    /// The engine retires the request.
    Retire,
}

/// Phase of one request on the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecvPhase {
    /// Registered; counting the writers' results and waiting for the aux data.
    Receiving,
    /// One successful last result from every writer and the aux data arrived.
    Completed,
    /// Failed, timed out or cancelled; waiting until every writer confirmed it stopped.
    Stopping,
    /// Ended and no write can land any more: the engine may free the blocks.
    Quiesced,
    /// Retired by the engine; the id is never used again.
    Retired,
}

/// Something that moves a receiver session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecvEvent {
    /// A result or the aux data arrived, and something is still missing.
    Progress,
    /// The last missing result or the aux data arrived.
    Finished,
    /// A result failed, a deadline passed, a writer was lost or the request was cancelled.
    Stop,
    /// Every writer confirmed it stopped (or was disconnected).
    Drained,
    /// The engine retires the request.
    Retire,
}

/// The outcome of applying an event to a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transition<P> {
    /// The session moves to (or stays in) this phase.
    To(P),
    /// The event does not apply in this phase and changes nothing (a late or duplicate event).
    Ignored,
    /// The event is a caller bug in this phase; it is refused with a usage error.
    Refused,
}

impl<P> Transition<P> {
    /// Moves `phase` when the event applies (`To`); returns whether it did. An ignored or
    /// refused event leaves `phase` as it was.
    pub(crate) fn advance(self, phase: &mut P) -> bool {
        match self {
            Transition::To(p) => {
                *phase = p;
                true
            }
            Transition::Ignored | Transition::Refused => false,
        }
    }
}

/// What both endpoints ask of a session phase, whatever the role.
pub(crate) trait SessionPhase: Copy {
    /// The phase reported for a retired (and still remembered) request.
    const RETIRED: Self;
    /// Whether the session still transfers (not ended).
    fn is_active(self) -> bool;
    /// Whether the engine may retire the session now (it completed or quiesced).
    fn may_retire(self) -> bool;
    /// The phase a stop moves an active session to (`None`: it ended already).
    fn stopped(self) -> Option<Self>;
}

impl SessionPhase for SendPhase {
    const RETIRED: Self = SendPhase::Retired;
    fn is_active(self) -> bool {
        SendPhase::is_active(self)
    }
    fn may_retire(self) -> bool {
        matches!(self.on(SendEvent::Retire), Transition::To(_))
    }
    fn stopped(mut self) -> Option<Self> {
        self.on(SendEvent::Stop).advance(&mut self).then_some(self)
    }
}

impl SessionPhase for RecvPhase {
    const RETIRED: Self = RecvPhase::Retired;
    fn is_active(self) -> bool {
        RecvPhase::is_active(self)
    }
    fn may_retire(self) -> bool {
        matches!(self.on(RecvEvent::Retire), Transition::To(_))
    }
    fn stopped(mut self) -> Option<Self> {
        self.on(RecvEvent::Stop).advance(&mut self).then_some(self)
    }
}

impl SendPhase {
    /// Every phase, in table order.
    pub const ALL: [SendPhase; 6] = [
        SendPhase::Streaming,
        SendPhase::Finishing,
        SendPhase::Completed,
        SendPhase::Stopping,
        SendPhase::Quiesced,
        SendPhase::Retired,
    ];

    /// Applies `event`.
    pub fn on(self, event: SendEvent) -> Transition<SendPhase> {
        use SendEvent as E;
        use SendPhase as P;
        use Transition::{Ignored, Refused, To};
        match (self, event) {
            (P::Streaming, E::Chunk) => To(P::Streaming),
            (P::Streaming, E::LastChunk) => To(P::Finishing),
            (P::Streaming, E::Finished) => Ignored,
            (P::Streaming | P::Finishing, E::Stop) => To(P::Stopping),
            (P::Streaming | P::Finishing, E::Drained) => Ignored,
            (P::Streaming | P::Finishing | P::Stopping, E::Retire) => Refused,
            (P::Finishing, E::Chunk | E::LastChunk) => Refused,
            (P::Finishing, E::Finished) => To(P::Completed),
            (P::Completed | P::Stopping | P::Quiesced, E::Chunk | E::LastChunk) => Refused,
            (P::Completed | P::Stopping | P::Quiesced, E::Finished | E::Stop) => Ignored,
            (P::Completed | P::Quiesced, E::Drained) => Ignored,
            (P::Completed | P::Quiesced, E::Retire) => To(P::Retired),
            (P::Stopping, E::Drained) => To(P::Quiesced),
            (P::Retired, _) => Refused,
        }
    }

    /// Whether the session still transfers (not ended).
    pub fn is_active(self) -> bool {
        matches!(self, SendPhase::Streaming | SendPhase::Finishing)
    }
}

impl SendEvent {
    /// Every event, in table order.
    pub const ALL: [SendEvent; 6] = [
        SendEvent::Chunk,
        SendEvent::LastChunk,
        SendEvent::Finished,
        SendEvent::Stop,
        SendEvent::Drained,
        SendEvent::Retire,
    ];
}

impl RecvPhase {
    /// Every phase, in table order.
    pub const ALL: [RecvPhase; 5] = [
        RecvPhase::Receiving,
        RecvPhase::Completed,
        RecvPhase::Stopping,
        RecvPhase::Quiesced,
        RecvPhase::Retired,
    ];

    /// Applies `event`.
    pub fn on(self, event: RecvEvent) -> Transition<RecvPhase> {
        use RecvEvent as E;
        use RecvPhase as P;
        use Transition::{Ignored, Refused, To};
        match (self, event) {
            (P::Receiving, E::Progress) => To(P::Receiving),
            (P::Receiving, E::Finished) => To(P::Completed),
            (P::Receiving, E::Stop) => To(P::Stopping),
            (P::Receiving, E::Drained) => Ignored,
            (P::Receiving | P::Stopping, E::Retire) => Refused,
            (P::Completed | P::Stopping | P::Quiesced, E::Progress | E::Finished | E::Stop) => {
                Ignored
            }
            (P::Completed | P::Quiesced, E::Drained) => Ignored,
            (P::Completed | P::Quiesced, E::Retire) => To(P::Retired),
            (P::Stopping, E::Drained) => To(P::Quiesced),
            (P::Retired, _) => Refused,
        }
    }

    /// Whether the session still transfers (not ended).
    pub fn is_active(self) -> bool {
        matches!(self, RecvPhase::Receiving)
    }
}

impl RecvEvent {
    /// Every event, in table order.
    pub const ALL: [RecvEvent; 5] = [
        RecvEvent::Progress,
        RecvEvent::Finished,
        RecvEvent::Stop,
        RecvEvent::Drained,
        RecvEvent::Retire,
    ];
}

/// Phase of one connected peer, on either endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerPhase {
    /// Connected; the Hellos are being exchanged.
    Handshaking,
    /// The handshake succeeded: session frames flow.
    Ready,
    /// The handshake was refused (by either side); waiting for the transport's disconnect.
    Rejected,
    /// This endpoint asked the transport to close the peer; nothing from it is accepted.
    Closing,
}

/// Something that moves a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerEvent {
    /// The peer's Hello was accepted.
    HelloAccepted,
    /// The handshake was refused by either side.
    Rejected,
    /// The endpoint asks the transport to close the peer.
    Close,
}

impl PeerPhase {
    /// Every phase, in table order.
    pub const ALL: [PeerPhase; 4] = [
        PeerPhase::Handshaking,
        PeerPhase::Ready,
        PeerPhase::Rejected,
        PeerPhase::Closing,
    ];

    /// Applies `event`.
    pub fn on(self, event: PeerEvent) -> Transition<PeerPhase> {
        use PeerEvent as E;
        use PeerPhase as P;
        use Transition::{Ignored, To};
        match (self, event) {
            (P::Handshaking, E::HelloAccepted) => To(P::Ready),
            (P::Handshaking | P::Ready, E::Rejected) => To(P::Rejected),
            (P::Handshaking | P::Ready, E::Close) => To(P::Closing),
            (P::Ready, E::HelloAccepted) => Ignored,
            (P::Rejected | P::Closing, _) => Ignored,
        }
    }
}

impl PeerEvent {
    /// Every event, in table order.
    pub const ALL: [PeerEvent; 3] = [
        PeerEvent::HelloAccepted,
        PeerEvent::Rejected,
        PeerEvent::Close,
    ];
}

/// Phase of one receiver within a sender session (the sender's view of a target).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetPhase {
    /// The receiver's registration has not arrived; slices queue for it.
    AwaitingRegistration,
    /// Registered: slices are written and their results sent in order.
    Streaming,
    /// The last successful result went out; the aux data is still to be sent.
    AwaitingAux,
    /// Everything went out (the last result, then the aux data); the receiver's
    /// `RecvComplete` is awaited. Until it comes the receiver may still fail or cancel the
    /// request, and the loss of the peer fails the session.
    Confirming,
    /// The receiver completed the request (its `RecvComplete` came).
    Finished,
    /// The session stopped; the terminal frame waits until no batch towards the receiver is in
    /// flight.
    Draining,
    /// The terminal frame (a failed last result or a cancel) went out.
    Stopped,
    /// Still draining after the quiesce deadline: the transport was asked to close the peer.
    Fencing,
    /// The peer was reported disconnected.
    Gone,
}

/// Something that moves a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetEvent {
    /// The receiver's registration arrived.
    Registered,
    /// The last slice's successful result went out; the aux data follows.
    LastResultSent,
    /// The aux data went out after the last successful result.
    AuxSent,
    /// The receiver said it completed the request (`RecvComplete`).
    Confirmed,
    /// The session stopped (failure, timeout, cancel).
    SessionStopped,
    /// The terminal frame went out.
    TerminalSent,
    /// The quiesce deadline passed with batches in flight; the peer is being closed.
    FenceRequested,
    /// The transport reported the peer disconnected.
    Disconnected,
}

impl TargetPhase {
    /// Every phase, in table order.
    pub const ALL: [TargetPhase; 9] = [
        TargetPhase::AwaitingRegistration,
        TargetPhase::Streaming,
        TargetPhase::AwaitingAux,
        TargetPhase::Confirming,
        TargetPhase::Finished,
        TargetPhase::Draining,
        TargetPhase::Stopped,
        TargetPhase::Fencing,
        TargetPhase::Gone,
    ];

    /// Applies `event`.
    pub fn on(self, event: TargetEvent) -> Transition<TargetPhase> {
        use TargetEvent as E;
        use TargetPhase as P;
        use Transition::{Ignored, Refused, To};
        match (self, event) {
            (_, E::Disconnected) => To(P::Gone),
            (P::Gone, _) => Ignored,
            (P::AwaitingRegistration, E::Registered) => To(P::Streaming),
            (_, E::Registered) => Refused,
            (P::Streaming, E::LastResultSent) => To(P::AwaitingAux),
            (P::AwaitingAux, E::AuxSent) => To(P::Confirming),
            (_, E::LastResultSent | E::AuxSent) => Refused,
            (P::Confirming, E::Confirmed) => To(P::Finished),
            // A receiver's completion heard when it is not awaited changes nothing.
            (_, E::Confirmed) => Ignored,
            (P::AwaitingRegistration | P::Streaming | P::AwaitingAux, E::SessionStopped) => {
                To(P::Draining)
            }
            // Everything went to a confirming receiver and nothing of it is in flight: there
            // is nothing to stop there (it may still complete on its side).
            (
                P::Confirming | P::Finished | P::Draining | P::Stopped | P::Fencing,
                E::SessionStopped,
            ) => Ignored,
            (P::Draining | P::Fencing, E::TerminalSent) => To(P::Stopped),
            // A receiver registering after the session ended hears of it at once.
            (P::AwaitingRegistration, E::TerminalSent) => To(P::Stopped),
            (_, E::TerminalSent) => Refused,
            (P::Draining, E::FenceRequested) => To(P::Fencing),
            (_, E::FenceRequested) => Ignored,
        }
    }

    /// Whether this receiver got everything the session had for it (a later loss of the peer
    /// does not fail the session).
    pub fn is_finished(self) -> bool {
        self == TargetPhase::Finished
    }

    /// Whether nothing more goes to this receiver for the request.
    pub fn is_done(self) -> bool {
        matches!(
            self,
            TargetPhase::Confirming
                | TargetPhase::Finished
                | TargetPhase::Stopped
                | TargetPhase::Gone
        )
    }
}

impl TargetEvent {
    /// Every event, in table order.
    pub const ALL: [TargetEvent; 8] = [
        TargetEvent::Registered,
        TargetEvent::LastResultSent,
        TargetEvent::AuxSent,
        TargetEvent::Confirmed,
        TargetEvent::SessionStopped,
        TargetEvent::TerminalSent,
        TargetEvent::FenceRequested,
        TargetEvent::Disconnected,
    ];
}

/// Phase of one writer within a receiver session (the receiver's view of a sender rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriterPhase {
    /// The registration has not been sent to the writer yet (its handshake is pending).
    Unregistered,
    /// The writer has the registration; results are counted.
    Registered,
    /// A successful last result arrived (the writer stopped writing).
    Done,
    /// The writer confirmed it stopped without finishing (a failed last result or a cancel),
    /// never got the registration before the session ended, or is gone.
    Stopped,
    /// The quiesce deadline passed before the writer confirmed; the peer is being closed.
    Fencing,
}

/// Something that moves a writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriterEvent {
    /// The registration was sent to the writer.
    RegistrationSent,
    /// A successful last result arrived.
    LastResult,
    /// A failed last result or a cancel arrived: the writer stopped.
    Confirmed,
    /// The session stopped.
    SessionStopped,
    /// The quiesce deadline passed before the writer confirmed.
    FenceRequested,
    /// The transport reported the writer disconnected.
    Disconnected,
}

impl WriterPhase {
    /// Every phase, in table order.
    pub const ALL: [WriterPhase; 5] = [
        WriterPhase::Unregistered,
        WriterPhase::Registered,
        WriterPhase::Done,
        WriterPhase::Stopped,
        WriterPhase::Fencing,
    ];

    /// Applies `event`.
    pub fn on(self, event: WriterEvent) -> Transition<WriterPhase> {
        use Transition::{Ignored, Refused, To};
        use WriterEvent as E;
        use WriterPhase as P;
        match (self, event) {
            (P::Unregistered, E::RegistrationSent) => To(P::Registered),
            (_, E::RegistrationSent) => Refused,
            (P::Registered, E::LastResult) => To(P::Done),
            (_, E::LastResult) => Ignored,
            (P::Registered | P::Fencing, E::Confirmed) => To(P::Stopped),
            (P::Unregistered | P::Done | P::Stopped, E::Confirmed) => Ignored,
            // A writer that never got the registration cannot write: nothing to wait for.
            (P::Unregistered, E::SessionStopped) => To(P::Stopped),
            (_, E::SessionStopped) => Ignored,
            (P::Registered, E::FenceRequested) => To(P::Fencing),
            (_, E::FenceRequested) => Ignored,
            (P::Done, E::Disconnected) => Ignored,
            (_, E::Disconnected) => To(P::Stopped),
        }
    }

    /// Whether the writer can no longer write into the request's memory.
    pub fn has_stopped(self) -> bool {
        matches!(self, WriterPhase::Done | WriterPhase::Stopped)
    }
}

impl WriterEvent {
    /// Every event, in table order.
    pub const ALL: [WriterEvent; 6] = [
        WriterEvent::RegistrationSent,
        WriterEvent::LastResult,
        WriterEvent::Confirmed,
        WriterEvent::SessionStopped,
        WriterEvent::FenceRequested,
        WriterEvent::Disconnected,
    ];
}

impl<P: fmt::Debug> fmt::Display for Transition<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transition::To(p) => write!(f, "-> {p:?}"),
            Transition::Ignored => f.write_str("ignored"),
            Transition::Refused => f.write_str("REFUSED"),
        }
    }
}

fn table<P: Copy + fmt::Debug, E: Copy + fmt::Debug>(
    out: &mut String,
    title: &str,
    phases: &[P],
    events: &[E],
    on: impl Fn(P, E) -> String,
) {
    let _ = writeln!(out, "{title}");
    for &p in phases {
        for &e in events {
            let _ = writeln!(
                out,
                "  {:<20} + {:<16} {}",
                format!("{p:?}"),
                format!("{e:?}"),
                on(p, e)
            );
        }
    }
}

/// Every event applied to every phase, for both endpoints, one line per pair.
pub fn transition_table() -> String {
    let mut out = String::new();
    table(
        &mut out,
        "sender",
        &SendPhase::ALL,
        &SendEvent::ALL,
        |p, e| p.on(e).to_string(),
    );
    table(
        &mut out,
        "receiver",
        &RecvPhase::ALL,
        &RecvEvent::ALL,
        |p, e| p.on(e).to_string(),
    );
    table(
        &mut out,
        "peer (either endpoint)",
        &PeerPhase::ALL,
        &PeerEvent::ALL,
        |p, e| p.on(e).to_string(),
    );
    table(
        &mut out,
        "sender target (one receiver of a request)",
        &TargetPhase::ALL,
        &TargetEvent::ALL,
        |p, e| p.on(e).to_string(),
    );
    table(
        &mut out,
        "receiver writer (one sender rank of a request)",
        &WriterPhase::ALL,
        &WriterEvent::ALL,
        |p, e| p.on(e).to_string(),
    );
    out
}
