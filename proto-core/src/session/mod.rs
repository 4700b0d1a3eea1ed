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

mod config;
mod coverage;
mod grants;
mod peers;
mod receiver;
mod remembered;
mod retired;
mod sender;
mod shell;
pub mod state;
mod timers;
mod transport;

use core::fmt;

use thiserror::Error;

pub use config::{
    Deadlines, LocalHello, ReceiverConfig, SenderConfig, DEFAULT_MAX_RETIRED,
    DEFAULT_RETIRED_HORIZON,
};
pub use coverage::{CoverFault, GroupPart};
pub use grants::GrantedExtents;

pub use receiver::{Receiver, ReceiverInput, Registration};
pub use sender::{ChunkQuery, SendRequest, Sender, SenderInput};
pub use transport::{
    is_data_write, Admission, DataPath, DataWriteHeaders, Endpoint, TransportInput, WriteRefusal,
    WriteTicket,
};

use crate::geometry::{BlockWindow, GeometryError};
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
    /// Receiver: the first admitted write landed (first byte landed; with
    /// [`DataPath::Ordered`], the first result arrived).
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
    /// prefill did not hide, as this side sees it (the last batch plus its result and the aux
    /// data going out).
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

/// A rule a peer broke. Inside a session it fails the session and travels on the wire as
/// [`TransferStatus::ProtocolError`]; outside one it is reported as
/// [`Event::ProtocolViolation`] and the frame is dropped.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProtocolError {
    /// A session frame arrived before the handshake finished.
    #[error("{kind} frame arrived before the handshake finished")]
    FrameBeforeHandshake {
        /// The frame kind.
        kind: &'static str,
    },
    /// This endpoint's role never receives that frame kind.
    #[error("{kind} frame is not accepted by a {role:?} endpoint")]
    UnexpectedFrame {
        /// The frame kind.
        kind: &'static str,
        /// This endpoint's role.
        role: Role,
    },
    /// A second, different handshake on one connection.
    #[error("a second, different Hello arrived on one connection")]
    SecondHello,
    /// A frame about a request the endpoint does not know.
    #[error("{kind} frame for {request}, which this endpoint does not know")]
    UnknownRequest {
        /// The frame kind.
        kind: &'static str,
        /// The request.
        request: RequestId,
    },
    /// A frame from a peer that is not part of the request.
    #[error("{kind} frame for {request} from a peer that is not part of it")]
    NotAParticipant {
        /// The frame kind.
        kind: &'static str,
        /// The request.
        request: RequestId,
    },
    /// A result named a receiver slice the request does not have.
    #[error("result for {request} names {got}, but the registration is {expected}")]
    UnknownSlice {
        /// The request.
        request: RequestId,
        /// The receiver slice of the registration.
        expected: ReceiverSliceId,
        /// The receiver slice named.
        got: ReceiverSliceId,
    },
    /// A result arrived after the writer's last one.
    #[error("result for {request} after the writer's last result")]
    ResultAfterLast {
        /// The request.
        request: RequestId,
    },
    /// A second, different registration for one request from one peer.
    #[error("a second, different registration for {request}")]
    DuplicateRegistration {
        /// The request.
        request: RequestId,
    },
    /// The registration's layer groups do not match the handshake's layout.
    #[error("registration for {request} has {got} layer groups, the layout has {expected}")]
    GroupCountMismatch {
        /// The request.
        request: RequestId,
        /// Groups in the layout.
        expected: usize,
        /// Groups in the registration.
        got: usize,
    },
    /// The two sides disagree on the prompt length.
    #[error(
        "{request}: the receiver registered {registered} prompt tokens, the sender has {local}"
    )]
    PromptLenMismatch {
        /// The request.
        request: RequestId,
        /// Prompt length in the registration.
        registered: u32,
        /// Prompt length of the local chunks.
        local: u32,
    },
    /// Aux data larger than the receiver's aux slot.
    #[error("aux data for {request} takes {len} bytes, the aux slot holds {capacity}")]
    AuxTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded size of the aux data.
        len: u64,
        /// The slot's capacity.
        capacity: u32,
    },
    /// Bytes from the peer that are no frame at the negotiated version.
    #[error("undecodable frame: {error}")]
    Undecodable {
        /// The decoder's error.
        error: DecodeError,
    },
    /// A data write from the peer was refused (see [`WriteRefusal`]).
    #[error("data write refused: {refusal}")]
    WriteRefused {
        /// Why.
        refusal: WriteRefusal,
    },
    /// A writer sent more frames than may wait for their data to land.
    #[error("{request}: more than {held} frames wait for data that has not landed")]
    TooManyHeldFrames {
        /// The request.
        request: RequestId,
        /// The bound.
        held: usize,
    },
    /// Every writer reported its last result, yet writes are still landing: bytes nobody
    /// reported.
    #[error("{request}: {writes} data write(s) still landing after every writer's last result")]
    UnreportedWrites {
        /// The request.
        request: RequestId,
        /// Writes still in flight.
        writes: u32,
    },
    /// A writer's bytes do not cover its share of the registration exactly.
    #[error(
        "{request}: the writer's share of the registration is {expected} bytes, it reported \
         {reported}{}",
        match landed { Some(l) => format!(" and {l} landed"), None => String::new() }
    )]
    BytesMismatch {
        /// The request.
        request: RequestId,
        /// Bytes of the writer's share of the registration.
        expected: u64,
        /// Bytes the writer's results reported.
        reported: u64,
        /// Bytes that landed (transports that report landings).
        landed: Option<u64>,
    },
    /// A registration ends a group before its prompt's last block: the tail would never be
    /// written, yet every writer would report its share and the request would complete.
    #[error(
        "registration of {request} {group} ends at block ordinal {end}, but a prompt of \
         {prompt_len} tokens has {blocks} blocks: register every block from the first one \
         the decode side does not hold to the last one"
    )]
    RegistrationShort {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// One past the last ordinal registered.
        end: u64,
        /// The prompt's length in tokens.
        prompt_len: u32,
        /// Blocks of the prompt.
        blocks: u32,
    },
    /// The registration's writers do not write every layer and head of the part the decode
    /// rank expects exactly once (one of them missing, two claiming the same part, or one
    /// writing outside it): the request would complete with KV never written.
    #[error("the writers of {request} do not cover {group} exactly once: {fault}")]
    WritersDoNotCover {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// What is missing, doubled or outside.
        fault: CoverFault,
    },
    /// A registration lists a writer that writes none of this rank's layers and heads (its
    /// layers or heads do not overlap, or another replica of its heads writes this rank): it
    /// would be waited for in vain.
    #[error(
        "the writers of {request} include {writer}, which writes none of this rank's layers and \
         heads: list exactly the prefill ranks that write this rank (`writes_to`)"
    )]
    WriterWritesNothing {
        /// The request.
        request: RequestId,
        /// The writer.
        writer: PeerId,
    },
    /// A registration names block ordinals past its prompt's blocks.
    #[error(
        "registration of {request} {group} reaches block ordinal {end}, but a prompt of \
         {prompt_len} tokens has {blocks} blocks"
    )]
    RegistrationPastPrompt {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// One past the last ordinal registered.
        end: u64,
        /// The prompt's length in tokens.
        prompt_len: u32,
        /// Blocks of the prompt.
        blocks: u32,
    },
    /// Two writers of one request sent different aux data.
    #[error("{request}: the writers' aux data differ (first tokens, draft tokens or counts)")]
    AuxMismatch {
        /// The request.
        request: RequestId,
    },
    /// The blocks of the registration cannot be paired with the local ones.
    #[error("{request}: cannot plan writes into the registration: {error}")]
    Unplannable {
        /// The request.
        request: RequestId,
        /// The planner's error.
        error: PlanError,
    },
}

/// A caller bug: returned at once, with the endpoint's state unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum UsageError {
    /// The request was never opened (sender) or registered (receiver).
    #[error("{0} is not known to this endpoint")]
    UnknownRequest(RequestId),
    /// The request was retired; it is never re-created.
    #[error("{0} was retired and cannot be used again")]
    Retired(RequestId),
    /// The request is already open or registered.
    #[error("{0} is already open on this endpoint")]
    DuplicateRequest(RequestId),
    /// The request has no peers to exchange with.
    #[error("{0} names no peers")]
    NoPeers(RequestId),
    /// A peer is named twice for one request.
    #[error("{request} names {peer} twice")]
    DuplicatePeer {
        /// The request.
        request: RequestId,
        /// The peer named twice.
        peer: PeerId,
    },
    /// The registration's groups do not match the local layout.
    #[error("{request}: {got} layer groups given, the layout has {expected}")]
    GroupCountMismatch {
        /// The request.
        request: RequestId,
        /// Groups in the layout.
        expected: usize,
        /// Groups given.
        got: usize,
    },
    /// A chunk after the request's last chunk.
    #[error("chunk for {0} after its last chunk")]
    ChunkAfterLast(RequestId),
    /// Chunks must be submitted in token order without gaps.
    #[error("chunk for {request} starts at token {got}, expected {expected}")]
    ChunkOutOfOrder {
        /// The request.
        request: RequestId,
        /// Where the next chunk must start.
        expected: u32,
        /// Where it started.
        got: u32,
    },
    /// A chunk's prompt length differs from an earlier chunk's.
    #[error(
        "chunk for {request} says the prompt has {got} tokens, earlier chunks said {expected}"
    )]
    PromptLenChanged {
        /// The request.
        request: RequestId,
        /// Earlier prompt length.
        expected: u32,
        /// This chunk's prompt length.
        got: u32,
    },
    /// The chunk's geometry is invalid.
    #[error("invalid chunk for {request}: {error}")]
    Geometry {
        /// The request.
        request: RequestId,
        /// The geometry error.
        error: GeometryError,
    },
    /// The block source answered a chunk's query with a run that breaks its contract. Unlike
    /// every other usage error this one ends the request: the KV it described cannot be
    /// trusted, so the request is failed on both sides with [`TransferStatus::EngineError`].
    #[error("{0}; the request was failed on both sides")]
    BlockRun(BlockRunError),
    /// A chunk says another prefix was cached than the request's earlier chunks said. Like
    /// [`UsageError::BlockRun`] it ends the request ([`TransferStatus::EngineError`]): blocks
    /// would be sent twice or never.
    #[error(
        "chunk for {request} says {got} prefix tokens were cached, earlier chunks said \
         {expected}; the request was failed on both sides"
    )]
    PrefixChanged {
        /// The request.
        request: RequestId,
        /// Prefix length of earlier chunks.
        expected: u32,
        /// This chunk's prefix length.
        got: u32,
    },
    /// The block source could not answer a chunk's query.
    #[error("block source failed for {request}: {error}")]
    BlockSource {
        /// The request.
        request: RequestId,
        /// The block source's error.
        error: BlockSourceError,
    },
    /// The request already ended (failed, timed out, cancelled or completed).
    #[error("{0} already ended")]
    SessionEnded(RequestId),
    /// The request still has writes that may touch its blocks; retire it after
    /// [`Event::Quiesced`].
    #[error("{0} is not quiesced yet; retire it after the Quiesced event")]
    NotQuiesced(RequestId),
    /// Aux data was already submitted for the request.
    #[error("aux data for {0} was already submitted")]
    AuxAlreadySubmitted(RequestId),
    /// No write batch with that id was ever issued.
    #[error("{0} was never issued")]
    UnknownBatch(WriteBatchId),
    /// The peer is already connected.
    #[error("{0} is already connected")]
    PeerAlreadyConnected(PeerId),
    /// The peer is not connected.
    #[error("{0} is not connected")]
    UnknownPeer(PeerId),
    /// The input belongs to the other role's endpoint.
    #[error("{input} is not an input of a {role:?} endpoint")]
    WrongRole {
        /// What was given.
        input: &'static str,
        /// This endpoint's role.
        role: Role,
    },
    /// A chunk's block runs do not answer its block windows group by group.
    #[error("chunk for {request}: runs given for groups {given:?}, its windows need {expected:?}")]
    RunsDoNotMatchChunk {
        /// The request.
        request: RequestId,
        /// Groups whose windows are non-empty, in order.
        expected: Vec<GroupIndex>,
        /// Groups the runs were given for.
        given: Vec<GroupIndex>,
    },
    /// The aux data does not fit in one frame.
    #[error("aux data for {request} takes {len} bytes, a frame carries at most {max}")]
    AuxTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded body length.
        len: u64,
        /// The frame body cap.
        max: u64,
    },
    /// The registration does not fit in one frame.
    #[error("registration of {request} takes {len} bytes, a frame carries at most {max}")]
    RegistrationTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded body length.
        len: u64,
        /// The frame body cap.
        max: u64,
    },
    /// The registration cannot be encoded (for example a hand-built [`AnchoredRun`] that is
    /// not canonical: an empty id run, or one that continues the previous one — build runs
    /// with [`AnchoredRun::from_ids`] or [`AnchoredRun::push`]).
    ///
    /// [`AnchoredRun`]: crate::AnchoredRun
    /// [`AnchoredRun::from_ids`]: crate::AnchoredRun::from_ids
    /// [`AnchoredRun::push`]: crate::AnchoredRun::push
    #[error("registration of {request} cannot be sent: {error}")]
    RegistrationUnencodable {
        /// The request.
        request: RequestId,
        /// Why the wire cannot carry it.
        error: crate::wire::EncodeError,
    },
    /// A windowed group's registration starts below the group's stale boundary: blocks there
    /// (sink tokens among them) are never sent.
    #[error(
        "registration of {request} {group} starts at block {first}, below the window's stale \
         boundary {stale}: blocks below it (sink tokens among them) are never sent; register \
         from block {stale} and fill the blocks below it on the decode side"
    )]
    RegistrationBelowWindow {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// The registration's first ordinal.
        first: u32,
        /// The group's stale boundary for the prompt.
        stale: u32,
    },
    /// The registration's writers do not cover what it expects exactly once (see
    /// [`ProtocolError::WritersDoNotCover`]); checked at once when every writer's handshake is
    /// known, else when the last one completes (then the request fails).
    #[error(transparent)]
    WritersDoNotCover(ProtocolError),
    /// The registration's expected part is not one part per layer group inside what this rank
    /// holds.
    #[error(
        "registration of {request} expects {group}'s {part}, but this rank holds {held} \
         (give one part per layer group, inside what the rank holds)"
    )]
    ExpectedPartNotHeld {
        /// The request.
        request: RequestId,
        /// The group (the first one past the layout when the counts differ).
        group: GroupIndex,
        /// The part expected (empty when missing).
        part: GroupPart,
        /// What the rank holds of the group (empty past the layout).
        held: GroupPart,
    },
    /// No data write was ever admitted with that ticket.
    #[error("{0} was never issued")]
    UnknownTicket(WriteTicket),
    /// A chunk's `prefix_sent_early` disagrees with whether the prefix was sent early.
    #[error(
        "chunk for {request}: prefix_sent_early must be {sent_early}, as the prefix was \
         {}sent early with Sender::submit_prefix",
        if *sent_early { "" } else { "not " }
    )]
    EarlyPrefixMismatch {
        /// The request.
        request: RequestId,
        /// Whether the prefix was sent early.
        sent_early: bool,
    },
    /// The first chunk starts after the cached prefix: the tokens between would never be
    /// sent.
    #[error(
        "the first chunk of {request} starts at token {start}, but its cached prefix ends at \
         {prepopulated_len}: the first chunk starts where the prefix ends (tokens between would \
         never be sent)"
    )]
    FirstChunkAfterPrefix {
        /// The request.
        request: RequestId,
        /// The chunk's first token.
        start: u32,
        /// The prefix length it declared.
        prepopulated_len: u32,
    },
    /// The early prefix goes before the first chunk, once.
    #[error("the prefix of {0} can only be sent early once, before its first chunk")]
    PrefixAfterChunks(RequestId),
    /// The registration's block ordinals do not end at its prompt's last block (see
    /// [`ProtocolError::RegistrationPastPrompt`] and [`ProtocolError::RegistrationShort`]).
    #[error(transparent)]
    RegistrationOutsidePrompt(ProtocolError),
    /// A chunk's prompt length differs from what a receiver registered; the request was failed
    /// on both sides (the KV of the other tokens would never move).
    #[error(
        "chunk for {request} has a prompt of {local} tokens, the receiver registered \
         {registered}; the request was failed on both sides"
    )]
    PromptLenDiffersFromRegistration {
        /// The request.
        request: RequestId,
        /// Prompt length the receiver registered.
        registered: u32,
        /// Prompt length of the chunk.
        local: u32,
    },
    /// The request asks for something pipelined transfer cannot do.
    #[error("{request} cannot be transferred: {error}")]
    Unsupported {
        /// The request.
        request: RequestId,
        /// What is unsupported.
        error: crate::config::ConfigError,
    },
    /// A write failure was reported with [`TransferStatus::Success`].
    #[error("write failure for {0} reported with status Success")]
    FailureWithSuccessStatus(WriteBatchId),
}

/// How a block run broke the block-source contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockRunFault {
    /// More blocks than asked for.
    TooLong,
    /// The run does not end at the asked end (shifted, or holes dropped at the wrong place).
    WrongEnd,
    /// Fewer blocks than asked for in a group that keeps every block (full attention).
    TooShort,
}

/// A block run the engine's block source returned that breaks its contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[error(
    "block source broke its contract for {request} {group}: asked for ordinals [{}, {}), got \
     [{}, {}) ({})",
    asked.begin, asked.end, returned.begin, returned.end,
    match fault {
        BlockRunFault::TooLong => "longer than asked",
        BlockRunFault::WrongEnd => "does not end at the asked end",
        BlockRunFault::TooShort => "short in a full-attention group",
    }
)]
pub struct BlockRunError {
    /// The request.
    pub request: RequestId,
    /// The layer group.
    pub group: GroupIndex,
    /// The ordinals asked for.
    pub asked: BlockWindow,
    /// The ordinals the run covers.
    pub returned: BlockWindow,
    /// What is wrong.
    pub fault: BlockRunFault,
}

/// Counts of transfer outcomes, one per [`TransferStatus`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StatusCounts {
    /// [`TransferStatus::Success`].
    pub success: u64,
    /// [`TransferStatus::WriteFailed`].
    pub write_failed: u64,
    /// [`TransferStatus::InDoubt`].
    pub in_doubt: u64,
    /// [`TransferStatus::Cancelled`].
    pub cancelled: u64,
    /// [`TransferStatus::TimedOut`].
    pub timed_out: u64,
    /// [`TransferStatus::GrantViolation`].
    pub grant_violation: u64,
    /// [`TransferStatus::PeerLost`].
    pub peer_lost: u64,
    /// [`TransferStatus::ProtocolError`].
    pub protocol_error: u64,
    /// [`TransferStatus::EngineError`].
    pub engine_error: u64,
}

impl StatusCounts {
    /// The count for `status`.
    pub fn get(&self, status: TransferStatus) -> u64 {
        match status {
            TransferStatus::Success => self.success,
            TransferStatus::WriteFailed => self.write_failed,
            TransferStatus::InDoubt => self.in_doubt,
            TransferStatus::Cancelled => self.cancelled,
            TransferStatus::TimedOut => self.timed_out,
            TransferStatus::GrantViolation => self.grant_violation,
            TransferStatus::PeerLost => self.peer_lost,
            TransferStatus::ProtocolError => self.protocol_error,
            TransferStatus::EngineError => self.engine_error,
        }
    }

    /// Sum over all statuses.
    pub fn total(&self) -> u64 {
        self.success
            + self.write_failed
            + self.in_doubt
            + self.cancelled
            + self.timed_out
            + self.grant_violation
            + self.peer_lost
            + self.protocol_error
            + self.engine_error
    }

    pub(crate) fn bump(&mut self, status: TransferStatus) {
        let slot = match status {
            TransferStatus::Success => &mut self.success,
            TransferStatus::WriteFailed => &mut self.write_failed,
            TransferStatus::InDoubt => &mut self.in_doubt,
            TransferStatus::Cancelled => &mut self.cancelled,
            TransferStatus::TimedOut => &mut self.timed_out,
            TransferStatus::GrantViolation => &mut self.grant_violation,
            TransferStatus::PeerLost => &mut self.peer_lost,
            TransferStatus::ProtocolError => &mut self.protocol_error,
            TransferStatus::EngineError => &mut self.engine_error,
        };
        *slot += 1;
    }
}

/// What an endpoint has done so far; read with `counters()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    /// Bytes in write plans handed to the transport (sender).
    pub bytes_planned: u64,
    /// Bytes the transport reported written (sender) or writers reported written (receiver).
    pub bytes_written: u64,
    /// Slices created (sender: chunks that sent something).
    pub slices: u64,
    /// Write batches handed to the transport (sender).
    pub write_batches: u64,
    /// Slice results sent (sender) or received (receiver), by status.
    pub results: StatusCounts,
    /// Requests that failed, by cause (timeouts and cancels included).
    pub failures: StatusCounts,
    /// Deadlines that passed (each fails one request, except handshake and liveness).
    pub timeouts: u64,
    /// Requests cancelled (from either side).
    pub cancellations: u64,
    /// Requests completed.
    pub completions: u64,
    /// Requests quiesced.
    pub quiesced: u64,
    /// Requests retired.
    pub retirements: u64,
    /// Retired ids forgotten before their horizon passed because `max_retired` were remembered
    /// (a late frame naming one is then treated as one for an unknown request).
    pub retired_forgotten_early: u64,
    /// Protocol errors seen from peers.
    pub protocol_errors: u64,
    /// Duplicate frames ignored.
    pub duplicates: u64,
    /// Connections the endpoint asked to close.
    pub peers_closed: u64,
    /// Handshakes refused (by either side).
    pub peers_rejected: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Frames the codec refused to encode (not sent).
    pub encode_errors: u64,
    /// Frames from peers that did not decode.
    pub decode_errors: u64,
    /// Data writes refused by admission (receiver).
    pub writes_refused: u64,
    /// Data writes discarded because their request had ended (receiver).
    pub late_writes: u64,
    /// Payload bytes of admitted writes reported landed (receiver).
    pub bytes_landed: u64,
    /// Blocks the sessions pinned so far: the blocks of every chunk's (and early prefix's)
    /// block runs (sender), the registered blocks of every request (receiver). A session holds
    /// them until [`Event::Quiesced`].
    pub blocks_pinned: u64,
    /// Of [`blocks_pinned`](Self::blocks_pinned), those whose session quiesced: the engine may
    /// reuse them. `blocks_pinned - blocks_released` blocks are pinned now.
    pub blocks_released: u64,
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
    }
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
