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
                "  {:<10} + {:<9} {}",
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
    out
}
