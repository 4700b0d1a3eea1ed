//! [`Observer`]: one endpoint's outputs, batch reports and counters turned into spans, events
//! and metrics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::FxHashMap as HashMap;

use kvpipe_core::session::{
    CancelOrigin, Counters, Event, Output, TransportInput, Wait, WriteBatchId,
};
use kvpipe_core::wire::{Frame, Role, TransferStatus};
use kvpipe_core::{Duration, Endpoint, Instant, PeerId, RequestId, SenderSliceId};
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use tracing::{debug, info, trace, warn, Span};

use crate::names;
use crate::TARGET;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns every [`Observer`] in the process on or off (on by default). Off, an observer records
/// nothing and opens no span; gauges keep the values they had.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether observers record (see [`set_enabled`]).
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Requests whose span is kept at most (an endpoint that never quiesces its requests cannot
/// grow the map without bound; past it, the oldest are closed).
const MAX_SPANS: usize = 1 << 16;

/// Entries of the opening order kept beyond twice the open spans before the order is compacted
/// (the entries of closed spans dropped).
const ORDER_SLACK: usize = 64;

/// An open span, with the number it was opened under (its entry in the opening order).
struct Opened {
    seq: u64,
    span: Span,
}

/// A write batch between its `ExecuteWrites` and its report.
struct Issued {
    request: RequestId,
    slice: SenderSliceId,
    peer: PeerId,
    bytes: u64,
    extents: usize,
    at: Instant,
}

/// Metric handles of one endpoint, fetched once from the recorder installed when the observer
/// was made.
struct Handles {
    /// Sender: bytes sent; receiver: bytes received.
    bytes: Counter,
    write_batches: Counter,
    writes_refused: Counter,
    protocol_errors: Counter,
    open_sessions: Gauge,
    pinned_blocks: Gauge,
    batch_seconds: Histogram,
    tail_seconds: Histogram,
    transfer_seconds: Histogram,
}

/// Observes one endpoint for its driver.
///
/// The driver makes one per endpoint and calls it where it drains the endpoint:
/// [`output`](Self::output) with each output before carrying it out,
/// [`input`](Self::input) with the transport inputs it feeds that the outputs do not show
/// (peers connected and lost, write batches reported), and [`counters`](Self::counters) after
/// draining. Every call is cheap when no subscriber or recorder listens, and a no-op while
/// [`set_enabled`]`(false)`.
///
/// Metric handles are taken from the recorder installed when the observer is made: install
/// the recorder first.
pub struct Observer {
    role: Role,
    transport: &'static str,
    spans: HashMap<RequestId, Opened>,
    /// Order in which spans were opened, for the bound on `spans`: `(request, seq)`, current
    /// while `spans[request].seq == seq`. Entries of closed spans are dropped whenever they
    /// outnumber the open ones, so the order stays within twice the open spans (plus a
    /// constant) however many requests were served.
    opened: VecDeque<(RequestId, u64)>,
    /// Number of the next span opened.
    next_seq: u64,
    batches: HashMap<WriteBatchId, Issued>,
    last: Counters,
    /// What this observer added to the gauges (taken back when it is dropped).
    sessions: f64,
    pinned: f64,
    handles: Handles,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("role", &self.role)
            .field("transport", &self.transport)
            .field("requests", &self.spans.len())
            .field("batches", &self.batches.len())
            .finish()
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Sender => "sender",
        Role::Receiver => "receiver",
    }
}

/// A transfer status as a metric label.
pub(crate) fn status_label(status: TransferStatus) -> &'static str {
    match status {
        TransferStatus::Success => "success",
        TransferStatus::WriteFailed => "write_failed",
        TransferStatus::InDoubt => "in_doubt",
        TransferStatus::Cancelled => "cancelled",
        TransferStatus::TimedOut => "timed_out",
        TransferStatus::GrantViolation => "grant_violation",
        TransferStatus::PeerLost => "peer_lost",
        TransferStatus::ProtocolError => "protocol_error",
        TransferStatus::EngineError => "engine_error",
    }
}

fn wait_label(wait: Wait) -> &'static str {
    match wait {
        Wait::Handshake => "handshake",
        Wait::Registration => "registration",
        Wait::Writes => "writes",
        Wait::Results => "results",
        Wait::Aux => "aux",
        Wait::Completion => "completion",
        Wait::Liveness => "liveness",
    }
}

fn ms(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}

fn secs(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e9
}

impl Observer {
    /// An observer of an endpoint of `role` driven by `transport` (`"mem"`, `"tcp"`,
    /// `"verbs"`: the `transport` label and span field).
    pub fn new(role: Role, transport: &'static str) -> Self {
        let r = role_name(role);
        let view = r;
        let handles = Handles {
            bytes: match role {
                Role::Sender => counter!(names::BYTES_SENT, "role" => r, "transport" => transport),
                Role::Receiver => {
                    counter!(names::BYTES_RECEIVED, "role" => r, "transport" => transport)
                }
            },
            write_batches: counter!(names::WRITE_BATCHES, "role" => r, "transport" => transport),
            writes_refused: counter!(names::WRITES_REFUSED, "role" => r, "transport" => transport),
            protocol_errors: counter!(
                names::PROTOCOL_ERRORS, "role" => r, "transport" => transport
            ),
            open_sessions: gauge!(names::OPEN_SESSIONS, "role" => r, "transport" => transport),
            pinned_blocks: gauge!(names::PINNED_BLOCKS, "role" => r, "transport" => transport),
            batch_seconds: histogram!(names::WRITE_BATCH_SECONDS, "transport" => transport),
            tail_seconds: histogram!(
                names::EXPOSED_TAIL_SECONDS, "view" => view, "transport" => transport
            ),
            transfer_seconds: histogram!(
                names::TRANSFER_SECONDS, "view" => view, "transport" => transport
            ),
        };
        Observer {
            role,
            transport,
            spans: HashMap::default(),
            opened: VecDeque::new(),
            next_seq: 0,
            batches: HashMap::default(),
            last: Counters::default(),
            sessions: 0.0,
            pinned: 0.0,
            handles,
        }
    }

    /// The endpoint's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Requests with an open span (not quiesced yet).
    pub fn open_spans(&self) -> usize {
        self.spans.len()
    }

    /// The span of `request`, opened if it has none (`peer`: the peer that made it known).
    fn span(&mut self, request: RequestId, peer: Option<PeerId>) -> &Span {
        if !self.spans.contains_key(&request) {
            if self.spans.len() >= MAX_SPANS {
                while let Some((old, seq)) = self.opened.pop_front() {
                    if self.spans.get(&old).is_some_and(|o| o.seq == seq) {
                        self.spans.remove(&old);
                        break;
                    }
                }
            }
            let span = tracing::info_span!(
                target: TARGET,
                "request",
                request = request.0,
                role = role_name(self.role),
                peer = tracing::field::Empty,
                transport = self.transport,
            );
            if let Some(peer) = peer {
                span.record("peer", tracing::field::display(peer));
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            self.opened.push_back((request, seq));
            self.spans.insert(request, Opened { seq, span });
        }
        &self.spans[&request].span
    }

    /// Closes `request`'s span (if open), and drops the opening order's entries of closed
    /// spans once they outnumber the open ones (amortized O(1) per span).
    fn close_span(&mut self, request: RequestId) -> Option<Span> {
        let closed = self.spans.remove(&request)?;
        if self.opened.len() > 2 * self.spans.len() + ORDER_SLACK {
            let spans = &self.spans;
            self.opened
                .retain(|(id, seq)| spans.get(id).is_some_and(|o| o.seq == *seq));
        }
        Some(closed.span)
    }

    /// The open span of `request`, if any.
    fn span_of(&self, request: RequestId) -> Option<&Span> {
        self.spans.get(&request).map(|o| &o.span)
    }

    /// Observes one output of the endpoint, before the driver carries it out.
    pub fn output(&mut self, now: Instant, output: &Output) {
        if !is_enabled() {
            return;
        }
        match output {
            Output::Transmit { peer, frame, .. } => self.transmit(*peer, frame),
            Output::ExecuteWrites {
                peer,
                batch,
                request,
                slice,
                plan,
                ..
            } => {
                let bytes = plan.total_bytes();
                let extents = plan.len();
                let span = self.span(*request, Some(*peer));
                trace!(
                    target: TARGET, parent: span, batch = batch.0, slice = slice.0, %peer, bytes,
                    extents, "write batch issued"
                );
                self.batches.insert(
                    *batch,
                    Issued {
                        request: *request,
                        slice: *slice,
                        peer: *peer,
                        bytes,
                        extents,
                        at: now,
                    },
                );
            }
            Output::ClosePeer { peer, reason } => {
                info!(target: TARGET, %peer, ?reason, "closing the connection to the peer");
            }
            Output::Event(event) => self.event(event),
            Output::DataPath(negotiation) => {
                debug!(target: TARGET, ?negotiation, "data-path negotiation");
            }
        }
    }

    fn transmit(&mut self, peer: PeerId, frame: &Frame) {
        match frame {
            Frame::RecvRegistration(r) => {
                let blocks: u64 = r.groups.iter().map(|g| g.block_count()).sum();
                let span = self.span(r.request, Some(peer));
                debug!(
                    target: TARGET, parent: span, %peer, receiver_slice = r.slice.0,
                    prompt_len = r.prompt_len, blocks, "registration sent"
                );
            }
            Frame::KvResult(r) => {
                if let Some(span) = self.span_of(r.request) {
                    debug!(
                        target: TARGET, parent: span, %peer, sender_slice = r.sender_slice.0,
                        receiver_slice = r.receiver_slice.0, is_last = r.is_last,
                        status = %r.status, bytes = r.bytes_written, "result sent"
                    );
                }
            }
            Frame::AuxResult(a) => {
                if let Some(span) = self.span_of(a.request) {
                    debug!(target: TARGET, parent: span, %peer, status = %a.status, "aux data sent");
                }
            }
            Frame::Cancel(c) => {
                if let Some(span) = self.span_of(c.request) {
                    debug!(target: TARGET, parent: span, %peer, reason = ?c.reason, "cancel sent");
                } else {
                    debug!(
                        target: TARGET, %peer, request = c.request.0, reason = ?c.reason,
                        "cancel sent for a request this side does not hold"
                    );
                }
            }
            Frame::RecvComplete(c) => {
                if let Some(span) = self.span_of(c.request) {
                    debug!(target: TARGET, parent: span, %peer, "completion sent to the writer");
                }
            }
            Frame::Hello(_) | Frame::HelloAccept(_) | Frame::HelloReject(_) => {
                debug!(target: TARGET, %peer, frame = %frame, "handshake frame sent");
            }
            Frame::Heartbeat(_) | Frame::DataWrite(_) => {}
        }
    }

    fn event(&mut self, event: &Event) {
        let r = role_name(self.role);
        let t = self.transport;
        match event {
            Event::PeerReady {
                peer,
                instance,
                role,
            } => {
                info!(
                    target: TARGET, %peer, instance = instance.0, peer_role = role_name(*role),
                    transport = t, "handshake complete"
                );
            }
            Event::PeerRejected {
                peer,
                reason,
                message,
            } => {
                counter!(names::HANDSHAKES_REFUSED, "role" => r, "transport" => t).increment(1);
                warn!(target: TARGET, %peer, ?reason, transport = t, "handshake refused: {message}");
            }
            Event::PeerLost { peer, reason } => match reason {
                None => info!(target: TARGET, %peer, transport = t, "connection ended"),
                Some(reason) => {
                    warn!(target: TARGET, %peer, ?reason, transport = t, "connection closed")
                }
            },
            Event::ProtocolViolation { peer, error } => {
                warn!(target: TARGET, %peer, transport = t, "protocol violation: {error}");
            }
            Event::Registered {
                request,
                peer,
                receiver_slice,
            } => {
                let span = self.span(*request, Some(*peer));
                debug!(
                    target: TARGET, parent: span, %peer, receiver_slice = receiver_slice.0,
                    "registration received"
                );
            }
            Event::Completed {
                request,
                bytes_written,
                timings,
                ..
            } => {
                let tail = match self.role {
                    Role::Sender => timings.tail(),
                    Role::Receiver => timings.receiver_tail(),
                };
                let transfer = timings.transfer();
                if let Some(d) = tail {
                    self.handles.tail_seconds.record(secs(d));
                }
                if let Some(d) = transfer {
                    self.handles.transfer_seconds.record(secs(d));
                }
                counter!(
                    names::REQUESTS, "role" => r, "transport" => t, "outcome" => "completed",
                    "cause" => "none"
                )
                .increment(1);
                let span = self.span(*request, None);
                info!(
                    target: TARGET, parent: span, bytes = bytes_written, writes = timings.writes,
                    transfer_ms = transfer.map(ms), tail_ms = tail.map(ms),
                    total_ms = ms(timings.ended - timings.started), "completed"
                );
            }
            Event::Failed {
                request,
                cause,
                peer,
                sender_slice,
                receiver_slice,
            } => {
                counter!(
                    names::REQUESTS, "role" => r, "transport" => t, "outcome" => "failed",
                    "cause" => status_label(*cause)
                )
                .increment(1);
                let span = self.span(*request, *peer);
                warn!(
                    target: TARGET, parent: span, %cause, peer = peer.map(|p| p.0),
                    sender_slice = sender_slice.map(|s| s.0),
                    receiver_slice = receiver_slice.map(|s| s.0), "failed"
                );
            }
            Event::TimedOut {
                request,
                waiting_for,
            } => {
                counter!(
                    names::REQUESTS, "role" => r, "transport" => t, "outcome" => "timed_out",
                    "cause" => wait_label(*waiting_for)
                )
                .increment(1);
                let span = self.span(*request, None);
                warn!(
                    target: TARGET, parent: span, waiting_for = wait_label(*waiting_for),
                    "timed out"
                );
            }
            Event::Cancelled { request, origin } => {
                let by = match origin {
                    CancelOrigin::Local => "local",
                    CancelOrigin::Peer(_) => "peer",
                };
                counter!(
                    names::REQUESTS, "role" => r, "transport" => t, "outcome" => "cancelled",
                    "cause" => by
                )
                .increment(1);
                let span = self.span(*request, None);
                info!(target: TARGET, parent: span, by, "cancelled");
            }
            Event::Quiesced { request } => {
                if let Some(span) = self.close_span(*request) {
                    debug!(target: TARGET, parent: &span, "quiesced: its blocks may be reused");
                }
                // A batch never reported (its peer was lost) is over now too.
                self.batches.retain(|_, b| b.request != *request);
            }
        }
    }

    /// Observes a transport input the driver feeds the endpoint: peers connected and lost, and
    /// write batches reported done (their duration and size). Other inputs are ignored (call
    /// it with them or not).
    pub fn input(&mut self, now: Instant, input: &TransportInput) {
        if !is_enabled() {
            return;
        }
        let (batch, status) = match input {
            TransportInput::WritesCompleted { batch } => (*batch, TransferStatus::Success),
            TransportInput::WritesFailed { batch, status } => (*batch, *status),
            TransportInput::PeerConnected { peer } => {
                debug!(target: TARGET, %peer, transport = self.transport, "peer connected");
                return;
            }
            TransportInput::PeerDisconnected { peer } => {
                info!(target: TARGET, %peer, transport = self.transport, "peer disconnected");
                return;
            }
            _ => return,
        };
        let Some(issued) = self.batches.remove(&batch) else {
            return;
        };
        let took = now - issued.at;
        self.handles.batch_seconds.record(secs(took));
        if let Some(span) = self.span_of(issued.request) {
            if status == TransferStatus::Success {
                debug!(
                    target: TARGET, parent: span, batch = batch.0, slice = issued.slice.0,
                    peer = %issued.peer, bytes = issued.bytes, extents = issued.extents,
                    duration_ms = ms(took), "write batch done"
                );
            } else {
                warn!(
                    target: TARGET, parent: span, batch = batch.0, slice = issued.slice.0,
                    peer = %issued.peer, bytes = issued.bytes, extents = issued.extents,
                    duration_ms = ms(took), %status, "write batch failed"
                );
            }
        }
    }

    /// Brings the metrics up to date with the endpoint's counters and session count (call
    /// after draining it).
    pub fn counters<E: Endpoint + ?Sized>(&mut self, endpoint: &E) {
        if !is_enabled() {
            return;
        }
        let c = endpoint.counters();
        let last = &self.last;
        if c != last {
            let delta = |now: u64, then: u64| now.saturating_sub(then);
            let h = &self.handles;
            h.bytes
                .increment(delta(c.bytes_written, last.bytes_written));
            h.write_batches
                .increment(delta(c.write_batches, last.write_batches));
            h.writes_refused
                .increment(delta(c.writes_refused, last.writes_refused));
            h.protocol_errors
                .increment(delta(c.protocol_errors, last.protocol_errors));
            let pinned = c.blocks_pinned.saturating_sub(c.blocks_released) as f64;
            if pinned != self.pinned {
                h.pinned_blocks.increment(pinned - self.pinned);
                self.pinned = pinned;
            }
            self.last = *c;
        }
        let sessions = endpoint.session_count() as f64;
        if sessions != self.sessions {
            self.handles
                .open_sessions
                .increment(sessions - self.sessions);
            self.sessions = sessions;
        }
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        // Several endpoints add to one gauge: take back what this one added.
        self.handles.open_sessions.decrement(self.sessions);
        self.handles.pinned_blocks.decrement(self.pinned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spans of quiesced requests leave no trace: what the observer keeps is bounded by the
    /// requests open at once, not by the requests served.
    #[test]
    fn memory_does_not_grow_with_requests_served() {
        let mut obs = Observer::new(Role::Receiver, "mem");
        let peer = PeerId(1);
        let mut most = 0;
        for wave in 0..2_000u64 {
            let ids: Vec<RequestId> = (0..8).map(|i| RequestId(wave * 8 + i)).collect();
            for &request in &ids {
                let registered = Event::Registered {
                    request,
                    peer,
                    receiver_slice: kvpipe_core::ReceiverSliceId(0),
                };
                obs.output(Instant::ZERO, &Output::Event(registered));
            }
            for &request in &ids {
                obs.output(Instant::ZERO, &Output::Event(Event::Quiesced { request }));
            }
            most = most.max(obs.opened.len());
        }
        assert_eq!(obs.open_spans(), 0);
        assert!(
            most <= 2 * 8 + ORDER_SLACK + 1,
            "the opening order grew to {most} entries for 8 open spans"
        );
        // A span reopened after it closed is current under its new entry only.
        let r = RequestId(1);
        for _ in 0..3 {
            let _ = obs.span(r, None);
            obs.close_span(r);
        }
        let _ = obs.span(r, None);
        let current = obs.spans[&r].seq;
        assert_eq!(obs.opened.back(), Some(&(r, current)));
        assert_eq!(obs.open_spans(), 1);
    }
}
