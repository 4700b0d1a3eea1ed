//! Events as Python objects.

use kvpipe_core::session::CancelOrigin;
use kvpipe_core::wire::Role;
use kvpipe_core::Event as CoreEvent;
use pyo3::prelude::*;

/// Something a node tells its engine. ``kind`` is one of ``"peer_ready"``, ``"peer_rejected"``,
/// ``"protocol_violation"``, ``"registered"``, ``"completed"``, ``"failed"``, ``"timed_out"``,
/// ``"cancelled"``, ``"quiesced"``, ``"peer_lost"`` (a connection ended: every connection ends
/// with exactly one); the other attributes are set where they apply and are ``None`` otherwise.
/// Only after ``"quiesced"`` may a request's blocks be freed or reused.
#[pyclass(frozen, get_all, module = "kvpipe")]
#[derive(Clone, Debug, Default)]
pub(crate) struct Event {
    /// What happened.
    kind: &'static str,
    /// The request (request events).
    request: Option<u64>,
    /// The peer involved, as this node numbers it.
    peer: Option<u32>,
    /// (peer_ready) the peer's role: "prefill" or "decode".
    peer_role: Option<&'static str>,
    /// (peer_ready) the peer's instance id.
    instance: Option<u64>,
    /// (completed, failed, timed_out, cancelled) how the transfer ended, e.g. "success",
    /// "peer_lost", "engine_error".
    status: Option<String>,
    /// (timed_out) what was awaited, e.g. "results".
    waiting_for: Option<String>,
    /// (peer_rejected) why, e.g. "compatibility_mismatch"; (peer_lost) why this side closed
    /// the connection, e.g. "handshake_timeout", "liveness_timeout" (``None``: the peer or the
    /// network closed it).
    reason: Option<String>,
    /// (cancelled) whether the peer cancelled (else this engine).
    cancelled_by_peer: Option<bool>,
    /// (failed) the prefill side's slice id, when known.
    sender_slice: Option<u32>,
    /// (registered, failed) the decode side's registration id, when known.
    receiver_slice: Option<u32>,
    /// (completed) bytes written (prefill: by this node; decode: reported by every writer).
    bytes_written: Option<u64>,
    /// (completed, decode) the first generated token(s).
    first_tokens: Option<Vec<u32>>,
    /// (completed, decode) the draft tokens.
    draft_tokens: Option<Vec<u32>>,
    /// (completed, decode) the prompt length the prefill side reported.
    prompt_tokens: Option<u32>,
    /// (completed, decode) the prefix tokens the prefill side had cached.
    cached_tokens: Option<u32>,
    /// (completed) timings on this node's clock, nanoseconds: started, first byte, last byte,
    /// ended (None: did not happen).
    started_ns: Option<u64>,
    /// See ``started_ns``.
    first_byte_ns: Option<u64>,
    /// See ``started_ns``.
    last_byte_ns: Option<u64>,
    /// See ``started_ns``.
    ended_ns: Option<u64>,
    /// A readable line: a rejection's or violation's own message, else a description.
    message: String,
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        format!("<kvpipe.Event {}>", self.message)
    }
}

fn snake(debug: impl std::fmt::Debug) -> String {
    let name = format!("{debug:?}");
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

impl From<CoreEvent> for Event {
    fn from(event: CoreEvent) -> Self {
        let mut e = Event {
            message: format!("{event:?}"),
            ..Event::default()
        };
        match event {
            CoreEvent::PeerReady {
                peer,
                instance,
                role,
            } => {
                e.kind = "peer_ready";
                e.peer = Some(peer.0);
                e.instance = Some(instance.0);
                e.peer_role = Some(match role {
                    Role::Sender => "prefill",
                    Role::Receiver => "decode",
                });
            }
            CoreEvent::PeerRejected {
                peer,
                reason,
                message,
            } => {
                e.kind = "peer_rejected";
                e.peer = Some(peer.0);
                e.reason = Some(snake(reason));
                e.message = message;
            }
            CoreEvent::PeerLost { peer, reason } => {
                e.kind = "peer_lost";
                e.peer = Some(peer.0);
                e.status = Some("peer_lost".into());
                e.reason = reason.map(snake);
            }
            CoreEvent::ProtocolViolation { peer, error } => {
                e.kind = "protocol_violation";
                e.peer = Some(peer.0);
                e.message = error.to_string();
            }
            CoreEvent::Registered {
                request,
                peer,
                receiver_slice,
            } => {
                e.kind = "registered";
                e.request = Some(request.0);
                e.peer = Some(peer.0);
                e.receiver_slice = Some(receiver_slice.0);
            }
            CoreEvent::Completed {
                request,
                bytes_written,
                aux,
                timings,
            } => {
                e.kind = "completed";
                e.request = Some(request.0);
                e.status = Some("success".into());
                e.bytes_written = Some(bytes_written);
                e.started_ns = Some(timings.started.as_nanos());
                e.first_byte_ns = timings.first_byte.map(|t| t.as_nanos());
                e.last_byte_ns = timings.last_byte.map(|t| t.as_nanos());
                e.ended_ns = Some(timings.ended.as_nanos());
                if let Some(aux) = aux {
                    e.prompt_tokens = Some(aux.prompt_tokens);
                    e.cached_tokens = Some(aux.cached_tokens);
                    e.first_tokens = Some(aux.first_tokens);
                    e.draft_tokens = Some(aux.draft_tokens);
                }
            }
            CoreEvent::Failed {
                request,
                cause,
                peer,
                sender_slice,
                receiver_slice,
            } => {
                e.kind = "failed";
                e.request = Some(request.0);
                e.status = Some(snake(cause));
                e.peer = peer.map(|p| p.0);
                e.sender_slice = sender_slice.map(|s| s.0);
                e.receiver_slice = receiver_slice.map(|s| s.0);
            }
            CoreEvent::TimedOut {
                request,
                waiting_for,
            } => {
                e.kind = "timed_out";
                e.request = Some(request.0);
                e.status = Some("timed_out".into());
                e.waiting_for = Some(snake(waiting_for));
            }
            CoreEvent::Cancelled { request, origin } => {
                e.kind = "cancelled";
                e.request = Some(request.0);
                e.status = Some("cancelled".into());
                if let CancelOrigin::Peer(peer) = origin {
                    e.peer = Some(peer.0);
                }
                e.cancelled_by_peer = Some(matches!(origin, CancelOrigin::Peer(_)));
            }
            CoreEvent::Quiesced { request } => {
                e.kind = "quiesced";
                e.request = Some(request.0);
            }
        }
        e
    }
}
