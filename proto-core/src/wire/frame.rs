//! Validated frame representations. Each struct is what one frame kind carries; the byte
//! layout of each is documented in `docs/PROTOCOL.md`.

use crate::blocks::AnchoredRun;
use crate::ids::{GrantId, InstanceId, ReceiverSliceId, RegionId, RequestId, SenderSliceId};
use crate::layout::LayerGroupLayout;

/// The newest wire protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// The oldest wire protocol version this build speaks.
pub const MIN_PROTOCOL_VERSION: u16 = 1;

/// An inclusive range of protocol versions an endpoint speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct VersionRange {
    /// Oldest version spoken.
    pub min: u16,
    /// Newest version spoken.
    pub max: u16,
}

/// Optional features an endpoint supports, as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Capabilities(pub u64);

/// Which side of a transfer an endpoint plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum Role {
    /// Prefill (context) side: writes KV.
    Sender = 1,
    /// Decode (generation) side: receives KV.
    Receiver = 2,
}

/// Parallel topology of one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Topology {
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// This endpoint's tensor-parallel rank.
    pub tp_rank: u16,
    /// Pipeline-parallel size.
    pub pp_size: u16,
    /// This endpoint's pipeline-parallel rank.
    pub pp_rank: u16,
    /// First model layer held by this rank.
    pub layer_begin: u16,
    /// One past the last model layer held by this rank.
    pub layer_end: u16,
}

/// First frame on every connection, from both sides.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Hello {
    /// Versions this endpoint speaks.
    pub versions: VersionRange,
    /// Optional features this endpoint supports.
    pub capabilities: Capabilities,
    /// Hash over model geometry, dtype, tokens per block and layout (see `docs/PROTOCOL.md`).
    pub compat_hash: u64,
    /// This endpoint's instance.
    pub instance: InstanceId,
    /// Sender or receiver.
    pub role: Role,
    /// Parallel topology.
    pub topology: Topology,
    /// Pool layout per layer group, in group order.
    pub groups: Vec<LayerGroupLayout>,
}

/// The handshake succeeded; both sides use `version` from now on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct HelloAccept {
    /// The negotiated version (the highest both speak).
    pub version: u16,
    /// The accepting endpoint's instance.
    pub instance: InstanceId,
}

/// Why a handshake was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum RejectReason {
    /// No protocol version in common.
    VersionMismatch = 1,
    /// The compatibility hashes differ (model geometry, dtype, tokens per block, layout).
    CompatibilityMismatch = 2,
    /// The pool layouts cannot be paired (group count, layers, heads, …).
    LayoutMismatch = 3,
    /// The parallel topologies cannot be paired.
    TopologyMismatch = 4,
    /// Both endpoints play the same role.
    RoleMismatch = 5,
}

/// The handshake was refused; the connection closes after this frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct HelloReject {
    /// Machine-readable reason.
    pub reason: RejectReason,
    /// Human-readable explanation naming what differs (both versions, both values).
    pub message: String,
}

/// The receiver's destination for one request, sent before (or while) prefill runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct RecvRegistration {
    /// The request.
    pub request: RequestId,
    /// The receiver's id for this registration.
    pub slice: ReceiverSliceId,
    /// The request's whole prompt length in tokens.
    pub prompt_len: u32,
    /// The memory grant data writes for this request must carry.
    pub grant: GrantId,
    /// Capacity of the receiver's aux slot in bytes (inline aux data larger than this is refused).
    pub aux_capacity: u32,
    /// The receiver's blocks, one anchored run per layer group, in group order.
    pub groups: Vec<AnchoredRun>,
}

/// Outcome of a slice or of a whole transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum TransferStatus {
    /// Every write of the slice completed.
    Success = 0,
    /// A write failed; the destination holds unknown bytes.
    WriteFailed = 1,
    /// The outcome is unknown (a deadline passed with writes outstanding).
    InDoubt = 2,
    /// Cancelled by the engine on either side.
    Cancelled = 3,
    /// A deadline passed.
    TimedOut = 4,
    /// A write fell outside the receiver's grant and was refused.
    GrantViolation = 5,
    /// The peer disconnected or stopped answering.
    PeerLost = 6,
    /// The peer broke a protocol rule.
    ProtocolError = 7,
    /// The sender's engine described the request's KV in a way that breaks the block-source
    /// contract (a run longer or shorter than asked, ending elsewhere, a changed prefix): the KV
    /// cannot be trusted.
    EngineError = 8,
}

/// Result of one slice (the reference design's KV_AGENT_RESULT).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct KvResult {
    /// The request.
    pub request: RequestId,
    /// The sender's id for the slice.
    pub sender_slice: SenderSliceId,
    /// The receiver's id for the registration the slice wrote into.
    pub receiver_slice: ReceiverSliceId,
    /// Whether this is the request's last slice from this sender.
    pub is_last: bool,
    /// How the slice ended.
    pub status: TransferStatus,
    /// Bytes the slice wrote.
    pub bytes_written: u64,
}

/// The small per-request data that travels inline after the KV.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct AuxData {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens the sender had cached (prefix reuse).
    pub cached_tokens: u32,
    /// The first generated token(s).
    pub first_tokens: Vec<u32>,
    /// Speculative draft tokens.
    pub draft_tokens: Vec<u32>,
}

/// Inline aux data for a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct AuxResult {
    /// The request.
    pub request: RequestId,
    /// Whether the aux data is valid.
    pub status: TransferStatus,
    /// The data.
    pub data: AuxData,
}

/// Why a request was cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum CancelReason {
    /// The engine cancelled the request (client gone, preempted, …).
    Engine = 1,
    /// A deadline passed on the cancelling side.
    Timeout = 2,
    /// The cancelling side failed the request (write failure, protocol error, …).
    Failure = 3,
    /// The cancelling endpoint is shutting down.
    Shutdown = 4,
}

/// Cancels a request on the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Cancel {
    /// The request.
    pub request: RequestId,
    /// Why.
    pub reason: CancelReason,
}

/// Liveness probe; either side sends it when idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Heartbeat {
    /// Sequence number, echoed by nothing; lets captures show gaps.
    pub seq: u64,
}

/// Header of one data write on a stream transport; `len` payload bytes follow the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct DataWrite {
    /// The request the bytes belong to.
    pub request: RequestId,
    /// The grant from the request's registration.
    pub grant: GrantId,
    /// Destination region on the receiver.
    pub region: RegionId,
    /// Destination offset inside the region.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u64,
}

/// Any frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Frame {
    /// Handshake offer.
    Hello(Hello),
    /// Handshake accepted.
    HelloAccept(HelloAccept),
    /// Handshake refused.
    HelloReject(HelloReject),
    /// Receiver's destination for a request.
    RecvRegistration(RecvRegistration),
    /// Result of a slice.
    KvResult(KvResult),
    /// Inline aux data.
    AuxResult(AuxResult),
    /// Cancel a request.
    Cancel(Cancel),
    /// Liveness.
    Heartbeat(Heartbeat),
    /// Data write header (stream transports).
    DataWrite(DataWrite),
}
