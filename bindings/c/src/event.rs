//! Events as C sees them: one flat struct, its strings and token lists kept by the handle
//! until its next poll.

use std::ffi::{c_char, CString};
use std::ptr;

use kvpipe_core::session::{CancelOrigin, CloseReason, Wait};
use kvpipe_core::wire::{RejectReason, Role, TransferStatus};
use kvpipe_core::{Event, Instant};

/// What happened.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_event_kind {
    /// The handshake with `peer` succeeded (`peer_role`, `instance`).
    KVPIPE_EVENT_PEER_READY = 1,
    /// The handshake with `peer` was refused by either side (`reject_reason`, `message`
    /// naming both values); the connection is closing.
    KVPIPE_EVENT_PEER_REJECTED = 2,
    /// `peer` broke a protocol rule (its frame was dropped), or disagrees with this side about
    /// a request (a registration whose prompt length differs from the chunks'); `message` says
    /// which, naming the request when the rule was a request's (`request` stays 0), and that
    /// request's `KVPIPE_EVENT_FAILED` follows.
    KVPIPE_EVENT_PROTOCOL_VIOLATION = 3,
    /// (Prefill) `peer` registered `request` (`receiver_slice`); queued chunks go out now.
    KVPIPE_EVENT_REGISTERED = 4,
    /// `request` completed (`bytes_written`, timings; on the decode side the aux data). The
    /// prefill side completes only once the decode side did (its word comes back over the
    /// connection). `KVPIPE_EVENT_QUIESCED` follows.
    KVPIPE_EVENT_COMPLETED = 5,
    /// `request` failed (`status`, `peer`, slices); both sides learn at once. Its blocks stay
    /// pinned until `KVPIPE_EVENT_QUIESCED`.
    KVPIPE_EVENT_FAILED = 6,
    /// A deadline of `request` passed (`waiting_for`); blocks pinned until quiesced.
    KVPIPE_EVENT_TIMED_OUT = 7,
    /// `request` was cancelled (`cancelled_by_peer`, `peer`); blocks pinned until quiesced.
    KVPIPE_EVENT_CANCELLED = 8,
    /// No write of `request` can touch its blocks any more: free or reuse them, then retire it.
    KVPIPE_EVENT_QUIESCED = 9,
    /// The connection to `peer` ended (`status` `KVPIPE_TRANSFER_PEER_LOST`; `message` says
    /// why). Every connection ends with exactly one, handshake done or not; `waiting_for` is
    /// `KVPIPE_WAIT_HANDSHAKE` when its handshake did not finish in time and
    /// `KVPIPE_WAIT_LIVENESS` when it fell silent (this side closed it), else
    /// `KVPIPE_WAIT_NONE`. The peer's requests that still needed it fail too (after it, or
    /// before it when this side closed the connection for a deadline).
    KVPIPE_EVENT_PEER_LOST = 10,
}

/// How a transfer ended (the wire's status).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_transfer_status {
    /// Every write completed.
    KVPIPE_TRANSFER_SUCCESS = 0,
    /// A write failed.
    KVPIPE_TRANSFER_WRITE_FAILED = 1,
    /// The outcome is unknown (a deadline passed with writes outstanding).
    KVPIPE_TRANSFER_IN_DOUBT = 2,
    /// Cancelled on either side.
    KVPIPE_TRANSFER_CANCELLED = 3,
    /// A deadline passed.
    KVPIPE_TRANSFER_TIMED_OUT = 4,
    /// A write fell outside the decode side's grant.
    KVPIPE_TRANSFER_GRANT_VIOLATION = 5,
    /// The peer disconnected or stopped answering.
    KVPIPE_TRANSFER_PEER_LOST = 6,
    /// The peer broke a protocol rule.
    KVPIPE_TRANSFER_PROTOCOL_ERROR = 7,
    /// The prefill engine's block source broke its contract.
    KVPIPE_TRANSFER_ENGINE_ERROR = 8,
}

/// What a request was waiting for when its deadline passed.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_wait {
    /// Not a timeout.
    KVPIPE_WAIT_NONE = 0,
    /// A peer's handshake.
    KVPIPE_WAIT_HANDSHAKE = 1,
    /// (Prefill) the decode side's registration.
    KVPIPE_WAIT_REGISTRATION = 2,
    /// (Prefill) the transport's report of a write batch.
    KVPIPE_WAIT_WRITES = 3,
    /// (Decode) the writers' results.
    KVPIPE_WAIT_RESULTS = 4,
    /// The aux data.
    KVPIPE_WAIT_AUX = 5,
    /// Any frame from the peer.
    KVPIPE_WAIT_LIVENESS = 6,
    /// (Prefill) the decode side's word that it completed the request, after everything
    /// went to it.
    KVPIPE_WAIT_COMPLETION = 7,
}

/// Why a handshake was refused.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_reject_reason {
    /// Not a rejection.
    KVPIPE_REJECT_NONE = 0,
    /// No protocol version in common.
    KVPIPE_REJECT_VERSION_MISMATCH = 1,
    /// The compatibility hashes differ (model geometry, dtype, tokens per block, layout).
    KVPIPE_REJECT_COMPATIBILITY_MISMATCH = 2,
    /// The pool layouts cannot be paired.
    KVPIPE_REJECT_LAYOUT_MISMATCH = 3,
    /// The parallel topologies cannot be paired.
    KVPIPE_REJECT_TOPOLOGY_MISMATCH = 4,
    /// Both sides play the same role.
    KVPIPE_REJECT_ROLE_MISMATCH = 5,
}

/// "No slice" in a slice field.
pub const KVPIPE_NO_SLICE: u32 = u32::MAX;
/// "No peer" in a peer field.
pub const KVPIPE_NO_PEER: u32 = u32::MAX;

/// One event. Fields that do not apply to its kind are zero (`KVPIPE_NO_PEER`,
/// `KVPIPE_NO_SLICE` for ids). Its pointers (`message`, `first_tokens`, `draft_tokens`) stay
/// valid until the next poll on the same handle, from any thread: where several threads poll
/// one handle, copy what an event points to before another poll can run (or poll from one
/// thread and hand the events on).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_event {
    /// What happened.
    pub kind: kvpipe_event_kind,
    /// The request (0 for peer events).
    pub request: u64,
    /// The peer involved, or `KVPIPE_NO_PEER`.
    pub peer: u32,
    /// (Peer ready) the peer's role: 1 prefill, 2 decode.
    pub peer_role: u32,
    /// (Peer ready) the peer's instance id.
    pub instance: u64,
    /// (Completed, failed, timed out, cancelled) how the transfer ended: the status the wire
    /// carries (`KVPIPE_TRANSFER_TIMED_OUT` or `KVPIPE_TRANSFER_IN_DOUBT` for a timeout,
    /// `KVPIPE_TRANSFER_CANCELLED` for a cancel); (peer lost) `KVPIPE_TRANSFER_PEER_LOST`.
    pub status: kvpipe_transfer_status,
    /// (Timed out) what was awaited.
    pub waiting_for: kvpipe_wait,
    /// (Peer rejected) why.
    pub reject_reason: kvpipe_reject_reason,
    /// (Cancelled) whether the peer cancelled (else the local engine).
    pub cancelled_by_peer: bool,
    /// (Failed) the prefill side's slice id, or `KVPIPE_NO_SLICE`.
    pub sender_slice: u32,
    /// (Registered, failed) the decode side's registration id, or `KVPIPE_NO_SLICE`.
    pub receiver_slice: u32,
    /// (Completed) bytes written (prefill: by this node; decode: reported by every writer).
    pub bytes_written: u64,
    /// (Completed) request timings on this node's clock, in nanoseconds (0: did not happen):
    /// started (prefill: opened; decode: registered).
    pub started_ns: u64,
    /// First byte sent (prefill) or arriving: the first write admitted (decode).
    pub first_byte_ns: u64,
    /// Last byte reported written (prefill) or landed (decode).
    pub last_byte_ns: u64,
    /// Completion.
    pub ended_ns: u64,
    /// Write batches (prefill) or data writes admitted (decode).
    pub writes: u64,
    /// (Completed, decode) whether aux data came with it.
    pub has_aux: bool,
    /// (Aux) prompt length in tokens.
    pub prompt_tokens: u32,
    /// (Aux) tokens the prefill side had cached.
    pub cached_tokens: u32,
    /// (Aux) the first generated token(s).
    pub first_tokens: *const u32,
    /// Entries of `first_tokens`.
    pub first_token_count: usize,
    /// (Aux) draft tokens.
    pub draft_tokens: *const u32,
    /// Entries of `draft_tokens`.
    pub draft_token_count: usize,
    /// A readable line: the rejection's or violation's own message, else a description of
    /// the event. Never null.
    pub message: *const c_char,
}

/// What a handle keeps for the event it returned last (the targets of its pointers).
#[derive(Debug, Default)]
pub(crate) struct EventStorage {
    message: CString,
    first_tokens: Vec<u32>,
    draft_tokens: Vec<u32>,
}

fn ns(at: Option<Instant>) -> u64 {
    at.map_or(0, Instant::as_nanos)
}

fn status(s: TransferStatus) -> kvpipe_transfer_status {
    use kvpipe_transfer_status::*;
    match s {
        TransferStatus::Success => KVPIPE_TRANSFER_SUCCESS,
        TransferStatus::WriteFailed => KVPIPE_TRANSFER_WRITE_FAILED,
        TransferStatus::InDoubt => KVPIPE_TRANSFER_IN_DOUBT,
        TransferStatus::Cancelled => KVPIPE_TRANSFER_CANCELLED,
        TransferStatus::TimedOut => KVPIPE_TRANSFER_TIMED_OUT,
        TransferStatus::GrantViolation => KVPIPE_TRANSFER_GRANT_VIOLATION,
        TransferStatus::PeerLost => KVPIPE_TRANSFER_PEER_LOST,
        TransferStatus::ProtocolError => KVPIPE_TRANSFER_PROTOCOL_ERROR,
        TransferStatus::EngineError => KVPIPE_TRANSFER_ENGINE_ERROR,
    }
}

fn wait(w: Wait) -> kvpipe_wait {
    use kvpipe_wait::*;
    match w {
        Wait::Handshake => KVPIPE_WAIT_HANDSHAKE,
        Wait::Registration => KVPIPE_WAIT_REGISTRATION,
        Wait::Writes => KVPIPE_WAIT_WRITES,
        Wait::Results => KVPIPE_WAIT_RESULTS,
        Wait::Aux => KVPIPE_WAIT_AUX,
        Wait::Completion => KVPIPE_WAIT_COMPLETION,
        Wait::Liveness => KVPIPE_WAIT_LIVENESS,
    }
}

fn reject(r: RejectReason) -> kvpipe_reject_reason {
    use kvpipe_reject_reason::*;
    match r {
        RejectReason::VersionMismatch => KVPIPE_REJECT_VERSION_MISMATCH,
        RejectReason::CompatibilityMismatch => KVPIPE_REJECT_COMPATIBILITY_MISMATCH,
        RejectReason::LayoutMismatch => KVPIPE_REJECT_LAYOUT_MISMATCH,
        RejectReason::TopologyMismatch => KVPIPE_REJECT_TOPOLOGY_MISMATCH,
        RejectReason::RoleMismatch => KVPIPE_REJECT_ROLE_MISMATCH,
    }
}

impl EventStorage {
    /// `event` as C sees it, its strings and lists now held here.
    pub(crate) fn fill(&mut self, event: &Event) -> kvpipe_event {
        use kvpipe_event_kind::*;
        let mut out = kvpipe_event {
            kind: KVPIPE_EVENT_PEER_READY,
            request: 0,
            peer: KVPIPE_NO_PEER,
            peer_role: 0,
            instance: 0,
            status: kvpipe_transfer_status::KVPIPE_TRANSFER_SUCCESS,
            waiting_for: kvpipe_wait::KVPIPE_WAIT_NONE,
            reject_reason: kvpipe_reject_reason::KVPIPE_REJECT_NONE,
            cancelled_by_peer: false,
            sender_slice: KVPIPE_NO_SLICE,
            receiver_slice: KVPIPE_NO_SLICE,
            bytes_written: 0,
            started_ns: 0,
            first_byte_ns: 0,
            last_byte_ns: 0,
            ended_ns: 0,
            writes: 0,
            has_aux: false,
            prompt_tokens: 0,
            cached_tokens: 0,
            first_tokens: ptr::null(),
            first_token_count: 0,
            draft_tokens: ptr::null(),
            draft_token_count: 0,
            message: ptr::null(),
        };
        self.first_tokens.clear();
        self.draft_tokens.clear();
        let mut message = format!("{event:?}");
        match event {
            Event::PeerReady {
                peer,
                instance,
                role,
            } => {
                out.peer = peer.0;
                out.instance = instance.0;
                out.peer_role = match role {
                    Role::Sender => 1,
                    Role::Receiver => 2,
                };
            }
            Event::PeerRejected {
                peer,
                reason,
                message: text,
            } => {
                out.kind = KVPIPE_EVENT_PEER_REJECTED;
                out.peer = peer.0;
                out.reject_reason = reject(*reason);
                message = text.clone();
            }
            Event::PeerLost { peer, reason } => {
                out.kind = KVPIPE_EVENT_PEER_LOST;
                out.peer = peer.0;
                out.status = kvpipe_transfer_status::KVPIPE_TRANSFER_PEER_LOST;
                out.waiting_for = match reason {
                    Some(CloseReason::HandshakeTimeout) => kvpipe_wait::KVPIPE_WAIT_HANDSHAKE,
                    Some(CloseReason::LivenessTimeout) => kvpipe_wait::KVPIPE_WAIT_LIVENESS,
                    _ => kvpipe_wait::KVPIPE_WAIT_NONE,
                };
                message = match reason {
                    None => "the connection ended (closed by the peer or the network)".into(),
                    Some(r) => format!("this side closed the connection: {r:?}"),
                };
            }
            Event::ProtocolViolation { peer, error } => {
                out.kind = KVPIPE_EVENT_PROTOCOL_VIOLATION;
                out.peer = peer.0;
                message = error.to_string();
            }
            Event::Registered {
                request,
                peer,
                receiver_slice,
            } => {
                out.kind = KVPIPE_EVENT_REGISTERED;
                out.request = request.0;
                out.peer = peer.0;
                out.receiver_slice = receiver_slice.0;
            }
            Event::Completed {
                request,
                bytes_written,
                aux,
                timings,
            } => {
                out.kind = KVPIPE_EVENT_COMPLETED;
                out.request = request.0;
                out.bytes_written = *bytes_written;
                out.started_ns = timings.started.as_nanos();
                out.first_byte_ns = ns(timings.first_byte);
                out.last_byte_ns = ns(timings.last_byte);
                out.ended_ns = timings.ended.as_nanos();
                out.writes = timings.writes;
                if let Some(aux) = aux {
                    out.has_aux = true;
                    out.prompt_tokens = aux.prompt_tokens;
                    out.cached_tokens = aux.cached_tokens;
                    self.first_tokens.extend_from_slice(&aux.first_tokens);
                    self.draft_tokens.extend_from_slice(&aux.draft_tokens);
                }
            }
            Event::Failed {
                request,
                cause,
                peer,
                sender_slice,
                receiver_slice,
            } => {
                out.kind = KVPIPE_EVENT_FAILED;
                out.request = request.0;
                out.status = status(*cause);
                out.peer = peer.map_or(KVPIPE_NO_PEER, |p| p.0);
                out.sender_slice = sender_slice.map_or(KVPIPE_NO_SLICE, |s| s.0);
                out.receiver_slice = receiver_slice.map_or(KVPIPE_NO_SLICE, |s| s.0);
            }
            Event::TimedOut {
                request,
                waiting_for,
            } => {
                out.kind = KVPIPE_EVENT_TIMED_OUT;
                out.request = request.0;
                out.status = kvpipe_transfer_status::KVPIPE_TRANSFER_TIMED_OUT;
                out.waiting_for = wait(*waiting_for);
            }
            Event::Cancelled { request, origin } => {
                out.kind = KVPIPE_EVENT_CANCELLED;
                out.request = request.0;
                out.status = kvpipe_transfer_status::KVPIPE_TRANSFER_CANCELLED;
                if let CancelOrigin::Peer(peer) = origin {
                    out.cancelled_by_peer = true;
                    out.peer = peer.0;
                }
            }
            Event::Quiesced { request } => {
                out.kind = KVPIPE_EVENT_QUIESCED;
                out.request = request.0;
            }
        }
        let bytes: Vec<u8> = message.bytes().filter(|&b| b != 0).collect();
        self.message = CString::new(bytes).unwrap_or_default();
        out.message = self.message.as_ptr();
        if !self.first_tokens.is_empty() {
            out.first_tokens = self.first_tokens.as_ptr();
            out.first_token_count = self.first_tokens.len();
        }
        if !self.draft_tokens.is_empty() {
            out.draft_tokens = self.draft_tokens.as_ptr();
            out.draft_token_count = self.draft_tokens.len();
        }
        out
    }
}
