//! The sender and receiver endpoints: sans-IO state machines holding many per-request
//! sessions each.
//!
//! - [`Sender`] runs on a prefill rank: the engine opens a request naming its receivers, then
//!   submits prefill chunks; the sender plans the writes into each receiver's registered blocks,
//!   asks the transport to execute them, and reports each slice's result to the receiver in
//!   slice order, followed by the aux data.
//! - [`Receiver`] runs on a decode rank: the engine registers the destination blocks of a
//!   request and its writers; the receiver sends the registration to every writer and counts
//!   their results.
//!
//! Both are driven the same way: feed an input (with `now`), then drain
//! [`poll_output`](Sender::poll_output) until it returns `None`, then arm a timer for
//! [`poll_timeout`](Sender::poll_timeout) and deliver [`TransportInput::Timeout`] when it
//! fires. See the crate documentation for a full run loop.
//!
//! # The rules, as the endpoints keep them (DESIGN §5)
//!
//! - **Ordering.** Per (request, receiver), write batches leave in slice order; the result of
//!   slice `k` leaves only after the transport reported slice `k`'s batch complete and after the
//!   results of every earlier slice, so the `is_last` result implies every write landed. A
//!   receiver whose registration arrives late gets every queued slice, in order, once, planned
//!   from the block runs the sender kept since the chunk was submitted.
//! - **Completion.** A sender session completes when every receiver got its `is_last` result
//!   and the aux data (every writer sends it). A receiver
//!   completes on one successful `is_last` result and one aux data frame from each writer; the
//!   writers' aux data must agree.
//! - **Failure.** A failed slice (or timeout, cancel, lost peer, protocol error) ends the request
//!   at once on the side that saw it, and the other side is told in the same step: the sender
//!   sends a `KvResult` with the failure status naming its slice and the receiver's slice (or a
//!   `Cancel` to a receiver whose registration it never got); the receiver sends a `Cancel`.
//! - **Quiesce before free.** An ended request keeps its blocks until [`Event::Quiesced`]. The
//!   sender quiesces when no write batch of the request is unreported (or its peer was reported
//!   disconnected). A writer confirms it stopped with its **terminal frame**: a `KvResult` with
//!   `is_last` set (any status), sent only when none of its batches for that receiver is in
//!   flight, or a `Cancel`, which a sender only sends when it has nothing in flight for the
//!   request. The receiver quiesces once every writer that got the registration confirmed or
//!   was reported disconnected. Past [`Deadlines::quiesce`] the endpoint asks the transport to
//!   close the unconfirmed peers ([`CloseReason::QuiesceFence`]) and quiesces on the disconnect.
//! - **Deadlines.** Handshake, registration, each write batch, the receiver's results, the aux
//!   data (both sides), liveness (heartbeats when idle) and quiesce each have one. The one wait
//!   without a deadline is the sender's wait for its own engine's next chunk (prefill runs at
//!   the engine's pace); the receiver's result deadline bounds the whole transfer.
//! - **Cancel** works in every phase from either side; a cancel for a request not seen yet is
//!   remembered (bounded, oldest forgotten first) and applied when it is opened or registered.
//!   A sender answers a peer's cancel for a request it does not hold with a `Cancel` at once.
//! - **Retirement.** [`Sender::retire`] / [`Receiver::retire`] are accepted after the request
//!   quiesced (or completed); a retired id is refused with [`UsageError::Retired`] and frames
//!   about it never re-create it. Ids may be any `u64`s in any order (engines hash string
//!   ids): a retired id is remembered for [`SenderConfig::retired_horizon`] (longer than every
//!   deadline, so no frame about it can arrive later), then forgotten; memory holds one
//!   horizon's retirements, at most `max_retired`. A fresh id is never refused.
//! - **Disconnects** end exactly the active sessions that still needed that peer, with
//!   [`TransferStatus::PeerLost`]. The transport promises that after it reports a disconnect no
//!   write of that connection touches memory on either side.
//!
//! Phases and their checked transitions are in [`state`].
//!
//! The two endpoints share one session frame, written once: the table of sessions and retired
//! ids (`table.rs`), the peers, timers, outputs and counters (`shell.rs`), why a session stops
//! (`stop.rs`), the handling of every input that does not depend on the role over what each
//! role adds (`role.rs`), and the public surface both have (`surface.rs`). The `sender` and
//! `receiver` modules keep only what is their own.

mod config;
mod counters;
mod coverage;
mod error;
mod grants;
mod peers;
mod receiver;
mod remembered;
mod retired;
mod role;
mod sender;
mod shell;
pub mod state;
mod stop;
mod surface;
mod table;
mod timers;
mod transport;

use core::fmt;

pub use config::{
    Deadlines, LocalHello, ReceiverConfig, SenderConfig, DEFAULT_MAX_RETIRED,
    DEFAULT_RETIRED_HORIZON,
};
pub use counters::{Counters, StatusCounts};
pub use coverage::{CoverFault, GroupPart};
pub use error::{BlockRunError, BlockRunFault, EngineFault, ProtocolError, UsageError};
pub use grants::GrantedExtents;

pub use receiver::{Receiver, ReceiverInput, Registration};
pub use sender::{ChunkQuery, SendRequest, Sender, SenderInput, Submitted};
pub use transport::{
    is_data_write, Admission, DataPath, DataPathNegotiation, DataWriteHeaders, Endpoint,
    TransportInput, WriteRefusal, WriteTicket,
};

use crate::geometry::{BlockWindow, ChunkSpec, ChunkSpecField, GeometryError};
use crate::layers::LayerRange;
use bytes::Bytes;

use crate::ids::{
    GrantId, GroupIndex, InstanceId, PeerId, ReceiverSliceId, RequestId, SenderSliceId,
};
use crate::plan::{PlanError, WritePlan};
use crate::source::BlockSourceError;
use crate::time::{Duration, Instant};
use crate::wire::{AuxData, DecodeError, Frame, RejectReason, Role, TransferStatus};

/// Identifies one write batch handed to the transport by [`Output::ExecuteWrites`]; the transport
/// reports the batch's outcome with this id. Unique per [`Sender`] endpoint, never reused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct WriteBatchId(pub u64);

impl fmt::Display for WriteBatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch#{}", self.0)
    }
}

/// Something an endpoint asks its driver to do. Drained with `poll_output`, in the order the
/// endpoint produced them (which is causal: a slice's [`Output::ExecuteWrites`] always comes out
/// before the frame reporting its result).
#[must_use = "outputs carry frames to send, writes to execute and events for the engine"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Send `bytes` to `peer` on its control channel, after every frame sent to it before
    /// (frames to one peer keep their order).
    Transmit {
        /// Destination peer.
        peer: PeerId,
        /// The frame, for inspection (tracing, tests); `bytes` is what goes on the wire.
        frame: Frame,
        /// The frame encoded at the version negotiated with `peer`.
        bytes: Bytes,
    },
    /// Execute the writes of one slice towards `peer` (sender only), then report the outcome with
    /// [`TransportInput::WritesCompleted`] or [`TransportInput::WritesFailed`] naming `batch`.
    /// Until it does (or the peer is reported disconnected), the sender keeps the source blocks
    /// pinned.
    ExecuteWrites {
        /// The receiver the bytes go to.
        peer: PeerId,
        /// Id to report the outcome with.
        batch: WriteBatchId,
        /// The request the slice belongs to.
        request: RequestId,
        /// The sender's slice id.
        slice: SenderSliceId,
        /// The receiver's grant for the request (stream transports put it on every data write).
        grant: GrantId,
        /// The coalesced writes (source offsets in local regions, destination offsets in the
        /// receiver's regions).
        plan: WritePlan,
        /// Encodes the `DataWrite` header of each piece (stream transports).
        headers: DataWriteHeaders,
    },
    /// Tear the connection to `peer` down — after flushing the frames output before this, for
    /// at most the transport's close grace — then report [`TransportInput::PeerDisconnected`].
    /// After that report no write of that connection may still touch memory on either side.
    ClosePeer {
        /// The peer to disconnect.
        peer: PeerId,
        /// Why.
        reason: CloseReason,
    },
    /// Something the engine must learn about.
    Event(Event),
    /// The data-path negotiation, for the transport (see [`DataPathNegotiation`]).
    DataPath(DataPathNegotiation),
}

/// Why an endpoint asks for a connection to be torn down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// This side refused the peer's handshake.
    HandshakeRejected,
    /// The peer refused this side's handshake.
    RejectedByPeer,
    /// The handshake did not finish before its deadline.
    HandshakeTimeout,
    /// Nothing arrived from the peer for longer than the liveness timeout.
    LivenessTimeout,
    /// The peer broke a connection-level protocol rule (a session frame before the handshake,
    /// bytes that are no frame).
    ProtocolViolation,
    /// A data write from the peer was refused: it is not trusted any more.
    GrantViolation,
    /// A session could not confirm before its quiesce deadline that the peer's writes stopped:
    /// the connection is fenced so memory can be handed back safely.
    QuiesceFence,
}

/// What an endpoint was waiting for when a deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wait {
    /// A peer's handshake.
    Handshake,
    /// The receiver's registration (sender side).
    Registration,
    /// The transport's report of a write batch (sender side).
    Writes,
    /// The writers' results (receiver side).
    Results,
    /// The aux data (sender: from the engine; receiver: from a writer).
    Aux,
    /// The receiver's word that it completed the request, after everything went to it
    /// (sender side).
    Completion,
    /// Any frame from a peer (heartbeats keep idle connections alive).
    Liveness,
}

/// Who cancelled a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CancelOrigin {
    /// The local engine.
    Local,
    /// The remote endpoint.
    Peer(PeerId),
}

/// What an endpoint tells its engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The handshake with `peer` succeeded.
    PeerReady {
        /// The peer.
        peer: PeerId,
        /// The peer's instance.
        instance: InstanceId,
        /// The peer's role.
        role: Role,
    },
    /// The handshake with `peer` was refused, by this side or by the peer; the connection is
    /// being closed.
    PeerRejected {
        /// The peer.
        peer: PeerId,
        /// Machine-readable reason.
        reason: RejectReason,
        /// What differs (names both versions or both values).
        message: String,
    },
    /// The connection to `peer` ended: the transport reported it gone. Every connection the
    /// transport reported ([`TransportInput::PeerConnected`]) ends with exactly one of these,
    /// whether its handshake completed ([`Event::PeerReady`]), was refused
    /// ([`Event::PeerRejected`]) or never finished. The peer's requests that still needed it
    /// fail too: right after, with [`TransferStatus::PeerLost`](crate::wire::TransferStatus),
    /// when the peer or the network closed it; just before, timed out, when this side closed
    /// it for a handshake or liveness deadline. A transport gives a peer that connects again a
    /// new id.
    PeerLost {
        /// The peer.
        peer: PeerId,
        /// Why this side closed the connection — its handshake did not finish in time
        /// ([`CloseReason::HandshakeTimeout`]), it fell silent ([`CloseReason::LivenessTimeout`]),
        /// it broke a rule, it was refused — or `None` when the peer or the network closed it.
        reason: Option<CloseReason>,
    },
    /// A peer broke a protocol rule outside any session it could fail (the frame was dropped).
    ProtocolViolation {
        /// The peer.
        peer: PeerId,
        /// The rule broken.
        error: ProtocolError,
    },
    /// (Sender) a receiver's registration for `request` was accepted; queued slices are being
    /// written to it.
    Registered {
        /// The request.
        request: RequestId,
        /// The receiver.
        peer: PeerId,
        /// The receiver's slice id.
        receiver_slice: ReceiverSliceId,
    },
    /// The transfer finished successfully: every slice was written and confirmed, and the aux data
    /// went through. Followed at once by [`Event::Quiesced`].
    Completed {
        /// The request.
        request: RequestId,
        /// Bytes written (sender: by this endpoint; receiver: reported by all writers).
        bytes_written: u64,
        /// (Receiver) the aux data received; `None` on the sender.
        aux: Option<AuxData>,
        /// When the request's milestones happened on this endpoint.
        timings: RequestTimings,
    },
    /// The transfer failed. Both sides learn at once; the blocks stay pinned until
    /// [`Event::Quiesced`].
    Failed {
        /// The request.
        request: RequestId,
        /// The cause.
        cause: TransferStatus,
        /// The peer involved, if one.
        peer: Option<PeerId>,
        /// The sender's id of the failed slice, when known.
        sender_slice: Option<SenderSliceId>,
        /// The receiver's id of the registration, when known.
        receiver_slice: Option<ReceiverSliceId>,
    },
    /// A deadline passed; the blocks stay pinned until [`Event::Quiesced`].
    TimedOut {
        /// The request.
        request: RequestId,
        /// What was awaited.
        waiting_for: Wait,
    },
    /// The request was cancelled; the blocks stay pinned until [`Event::Quiesced`].
    Cancelled {
        /// The request.
        request: RequestId,
        /// Who cancelled.
        origin: CancelOrigin,
    },
    /// No write of the request can still touch its blocks: the engine may free or reuse them,
    /// and should [retire](Sender::retire) the request.
    Quiesced {
        /// The request.
        request: RequestId,
    },
}

/// When the milestones of one request happened, on the endpoint's own clock (the `now` of its
/// inputs). Each side records what it can see; the two clocks are not comparable unless the
/// transport gives both endpoints the same origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestTimings {
    /// Sender: the request was opened. Receiver: it was registered.
    pub started: Instant,
    /// Sender: the first chunk was submitted (prefill's first output). Receiver: `None`.
    pub first_chunk: Option<Instant>,
    /// Sender: the first write batch was handed to the transport (first byte sent).
    /// Receiver: the first write was admitted (its bytes began to arrive; with
    /// [`DataPath::Ordered`], where writes land unseen, the first result arrived).
    pub first_byte: Option<Instant>,
    /// Sender: the last chunk was submitted (prefill finished). Receiver: `None`.
    pub last_chunk: Option<Instant>,
    /// Sender: the last write batch was reported complete. Receiver: the last admitted write
    /// landed (with [`DataPath::Ordered`], the last result arrived).
    pub last_byte: Option<Instant>,
    /// Receiver ([`DataPath::Landed`]): when data last began to arrive after the request's
    /// pipeline had drained — a write admitted while none of the request's writes was in
    /// flight and every byte landed so far had been reported by a writer's result. While
    /// prefill hides the transfer (each slice's result arrives before the next chunk is
    /// computed) that is the arrival of the last slice's first write, about one one-way trip
    /// after the last chunk was computed. When the transfer falls behind prefill, slices
    /// overlap and it is the start of the earliest slice still moving (the backlog is part
    /// of the tail). Sender, and [`DataPath::Ordered`]: `None`.
    pub last_burst: Option<Instant>,
    /// The request completed.
    pub ended: Instant,
    /// Write batches handed to the transport (sender) or data writes admitted (receiver).
    pub writes: u64,
}

impl RequestTimings {
    /// From the first byte to the last (`None` if nothing moved).
    pub fn transfer(&self) -> Option<Duration> {
        Some(self.last_byte? - self.first_byte?)
    }

    /// (Sender) from the last chunk computed to the completion: the part of the transfer
    /// prefill did not hide, as this side sees it (the last batch, its result and the aux data
    /// going out, and the receiver's `RecvComplete` coming back: one one-way trip more than
    /// the exposed tail).
    pub fn tail(&self) -> Option<Duration> {
        Some(self.ended - self.last_chunk?)
    }

    /// (Receiver) from [`last_burst`](Self::last_burst) to the completion: the exposed tail as
    /// the decode side sees it, without the sender's clock (short of one one-way trip while
    /// prefill hides the transfer).
    pub fn receiver_tail(&self) -> Option<Duration> {
        Some(self.ended - self.last_burst?)
    }
}

/// The kind of a frame, for messages.
pub(crate) fn frame_kind(frame: &Frame) -> &'static str {
    match frame {
        Frame::Hello(_) => "Hello",
        Frame::HelloAccept(_) => "HelloAccept",
        Frame::HelloReject(_) => "HelloReject",
        Frame::RecvRegistration(_) => "RecvRegistration",
        Frame::KvResult(_) => "KvResult",
        Frame::AuxResult(_) => "AuxResult",
        Frame::Cancel(_) => "Cancel",
        Frame::Heartbeat(_) => "Heartbeat",
        Frame::DataWrite(_) => "DataWrite",
        Frame::RecvComplete(_) => "RecvComplete",
    }
}

/// The body length of `frame` and the most a frame may carry, when the frame is too large to
/// send: the engine's input that built it is refused.
pub(crate) fn oversized(frame: &Frame) -> Option<(u64, u64)> {
    let len = frame.body_len() as u64;
    let max = u64::from(crate::wire::MAX_BODY_LEN);
    (len > max).then_some((len, max))
}

/// Checks that every group's registered ordinals end exactly at the prompt's last block: never
/// past it, and never short of it (the receiver's cached prefix is left out at the front; an
/// empty run anchored at the last block means every block is cached already).
pub(crate) fn check_registration_ordinals(
    request: RequestId,
    prompt_len: u32,
    groups: &[crate::blocks::AnchoredRun],
    layout: &[crate::layout::LayerGroupLayout],
) -> Result<(), ProtocolError> {
    for (g, (run, l)) in groups.iter().zip(layout).enumerate() {
        let blocks = crate::geometry::total_blocks(prompt_len, l.tokens_per_block).unwrap_or(0);
        let end = run.end_ordinal();
        if end > u64::from(blocks) {
            return Err(ProtocolError::RegistrationPastPrompt {
                request,
                group: GroupIndex(g as u16),
                end,
                prompt_len,
                blocks,
            });
        }
        if end < u64::from(blocks) {
            return Err(ProtocolError::RegistrationShort {
                request,
                group: GroupIndex(g as u16),
                end,
                prompt_len,
                blocks,
            });
        }
    }
    Ok(())
}
