//! The decode-side endpoint.

use std::collections::{BTreeMap, VecDeque};

use smallvec::SmallVec;

use super::config::ReceiverConfig;
use super::peers::{PeerExpiry, PeerTable, Route};
use super::remembered::Remembered;
use super::state::{RecvEvent, RecvPhase, Transition};
use super::timers::{TimerKey, Timers};
use super::{
    frame_kind, CancelOrigin, CloseReason, Counters, Event, Output, ProtocolError, UsageError, Wait,
};
use crate::blocks::AnchoredRun;
use crate::ids::{GrantId, PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::time::Instant;
use crate::wire::{
    AuxData, AuxResult, Cancel, CancelReason, Frame, KvResult, RecvRegistration, Role,
    TransferStatus,
};

/// One input to a [`Receiver`]. Every input carries `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum ReceiverInput {
    /// The transport connected `peer`; the receiver starts the handshake.
    PeerConnected {
        /// Current time.
        now: Instant,
        /// The new peer.
        peer: PeerId,
    },
    /// The transport lost or closed `peer`; no write from it can still land.
    PeerDisconnected {
        /// Current time.
        now: Instant,
        /// The peer.
        peer: PeerId,
    },
    /// A frame arrived from `peer`.
    FrameReceived {
        /// Current time.
        now: Instant,
        /// The sending peer.
        peer: PeerId,
        /// The decoded frame.
        frame: Frame,
    },
    /// The engine cancels `request` (remembered if it is not registered yet).
    Cancel {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
    },
    /// The engine is done with `request` (after [`Event::Quiesced`]); its id is never reused.
    Retire {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
    },
    /// The deadline from [`Receiver::poll_timeout`] passed (early delivery is harmless).
    Timeout {
        /// Current time.
        now: Instant,
    },
}

/// The destination of one request, registered by the decode engine before (or while) prefill
/// runs.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Registration {
    /// The request.
    pub request: RequestId,
    /// The whole prompt's length in tokens.
    pub prompt_len: u32,
    /// The destination blocks, one anchored run per layer group, in group order.
    pub groups: Vec<AnchoredRun>,
    /// The sender ranks that write this request; each must send a successful last result.
    pub writers: SmallVec<[PeerId; 2]>,
    /// Capacity of the aux slot in bytes.
    pub aux_capacity: u32,
}

#[derive(Clone, Debug)]
struct Writer {
    peer: PeerId,
    registration_sent: bool,
    /// The highest (slice, is_last) seen, to drop duplicates.
    last_seen: Option<(SenderSliceId, bool)>,
    /// A successful last result arrived.
    done: bool,
    /// The writer confirmed no write is in flight (terminal result or cancel), or it is gone.
    stopped: bool,
    fence_requested: bool,
}

#[derive(Clone, Debug)]
struct RecvSession {
    phase: RecvPhase,
    frame: RecvRegistration,
    writers: SmallVec<[Writer; 2]>,
    aux: Option<AuxData>,
    result_deadline: Instant,
    aux_deadline: Option<Instant>,
    quiesce_deadline: Option<Instant>,
    bytes_written: u64,
}

#[derive(Clone, Copy, Debug)]
enum Stop {
    Failed {
        cause: TransferStatus,
        peer: Option<PeerId>,
        slice: Option<SenderSliceId>,
    },
    TimedOut(Wait),
    Cancelled(CancelOrigin),
}

/// The decode-side endpoint: one per decode rank, holding a session per request.
///
/// # Contract
///
/// **Getters**: [`counters`](Self::counters), [`phase`](Self::phase),
/// [`grant`](Self::grant), [`session_count`](Self::session_count),
/// [`peer_count`](Self::peer_count), [`is_peer_ready`](Self::is_peer_ready),
/// [`config`](Self::config).
///
/// **Inputs** (each carries `now`): [`handle_input`](Self::handle_input) with a
/// [`ReceiverInput`] — peer connected/disconnected, frame received, cancel, retire, timeout.
///
/// **Commands**: [`register`](Self::register) (the destination blocks of a request and its
/// writers; sends a `RecvRegistration` to each writer once its handshake is done),
/// [`cancel`](Self::cancel), [`retire`](Self::retire).
///
/// **Outputs**: after every input, call [`poll_output`](Self::poll_output) until it returns
/// `None`, then [`poll_timeout`](Self::poll_timeout) and arm a timer for it. Outputs come out in
/// the order they were produced. A request ends with exactly one of [`Event::Completed`] (one
/// successful last result from every writer, plus the aux data), [`Event::Failed`],
/// [`Event::TimedOut`] or [`Event::Cancelled`], and then [`Event::Quiesced`].
///
/// **Memory**: the destination blocks stay pinned until [`Event::Quiesced`]: after a failure,
/// timeout or cancel that is when every writer confirmed it stopped (its terminal `KvResult`
/// or a `Cancel`) or was reported disconnected. A writer that does not confirm before the
/// quiesce deadline is fenced with [`Output::ClosePeer`]; the blocks are handed back only once
/// the transport reports the disconnect, so no remote write can land in reused memory.
///
/// **Errors**: [`UsageError`] for caller bugs (nothing changed); peer misbehaviour fails the
/// session ([`TransferStatus::ProtocolError`]) or is reported as [`Event::ProtocolViolation`].
#[derive(Debug)]
pub struct Receiver {
    config: ReceiverConfig,
    peers: PeerTable,
    sessions: BTreeMap<RequestId, RecvSession>,
    remembered_cancels: Remembered<CancelOrigin>,
    retired: Remembered<()>,
    next_slice: u32,
    grant_state: u64,
    outputs: VecDeque<Output>,
    timers: Timers,
    counters: Counters,
}

impl Receiver {
    /// A receiver with no peers and no sessions.
    pub fn new(config: ReceiverConfig) -> Self {
        let hello = config.local.to_hello(Role::Receiver);
        Receiver {
            peers: PeerTable::new(hello, config.deadlines),
            sessions: BTreeMap::new(),
            remembered_cancels: Remembered::new(config.max_remembered_cancels),
            retired: Remembered::new(config.max_retired),
            next_slice: 0,
            grant_state: config.grant_seed,
            outputs: VecDeque::new(),
            timers: Timers::default(),
            counters: Counters::default(),
            config,
        }
    }

    // ----- getters -----

    /// The configuration.
    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    /// What the receiver has done so far.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The phase of `request`'s session: `None` if unknown, [`RecvPhase::Retired`] if retired
    /// (and still remembered).
    pub fn phase(&self, request: RequestId) -> Option<RecvPhase> {
        if let Some(s) = self.sessions.get(&request) {
            Some(s.phase)
        } else if self.retired.contains(request) {
            Some(RecvPhase::Retired)
        } else {
            None
        }
    }

    /// The memory grant of `request`'s registration (transports check data writes against it).
    pub fn grant(&self, request: RequestId) -> Option<GrantId> {
        self.sessions.get(&request).map(|s| s.frame.grant)
    }

    /// Sessions held (not yet retired).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Connected peers (handshaking, ready or closing).
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.peers.is_ready(peer)
    }

    // ----- outputs -----

    /// The next output, or `None` when there is nothing to do until the next input.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When to deliver [`ReceiverInput::Timeout`] next (`None`: no deadline pending).
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.timers.next()
    }

    // ----- commands -----

    /// Registers the destination of a request and sends it to every writer whose handshake is
    /// done (the others get it when theirs completes). Returns the receiver's slice id for it.
    ///
    /// A cancel that arrived before (from the engine or a writer) cancels it at once.
    pub fn register(
        &mut self,
        now: Instant,
        reg: Registration,
    ) -> Result<ReceiverSliceId, UsageError> {
        let request = reg.request;
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        if self.sessions.contains_key(&request) {
            return Err(UsageError::DuplicateRequest(request));
        }
        if reg.writers.is_empty() {
            return Err(UsageError::NoPeers(request));
        }
        for (i, p) in reg.writers.iter().enumerate() {
            if reg.writers[..i].contains(p) {
                return Err(UsageError::DuplicatePeer { request, peer: *p });
            }
        }
        let expected = self.config.local.groups.len();
        if reg.groups.len() != expected {
            return Err(UsageError::GroupCountMismatch {
                request,
                expected,
                got: reg.groups.len(),
            });
        }
        let slice = ReceiverSliceId(self.next_slice);
        self.next_slice = self.next_slice.wrapping_add(1);
        let grant = GrantId(self.next_grant());
        let result_deadline = now + self.config.deadlines.result_wait;
        let frame = RecvRegistration {
            request,
            slice,
            prompt_len: reg.prompt_len,
            grant,
            aux_capacity: reg.aux_capacity,
            groups: reg.groups,
        };
        self.sessions.insert(
            request,
            RecvSession {
                phase: RecvPhase::Receiving,
                frame,
                writers: reg
                    .writers
                    .iter()
                    .map(|&peer| Writer {
                        peer,
                        registration_sent: false,
                        last_seen: None,
                        done: false,
                        stopped: false,
                        fence_requested: false,
                    })
                    .collect(),
                aux: None,
                result_deadline,
                aux_deadline: None,
                quiesce_deadline: None,
                bytes_written: 0,
            },
        );
        self.timers.arm(result_deadline, TimerKey::Request(request));
        if let Some(origin) = self.remembered_cancels.take(request) {
            self.stop(now, request, Stop::Cancelled(origin));
            return Ok(slice);
        }
        let writers: Vec<PeerId> = reg.writers.to_vec();
        for peer in writers {
            if self.peers.is_ready(peer) {
                self.send_registration(now, request, peer);
            }
        }
        Ok(slice)
    }

    /// Cancels `request` (see [`ReceiverInput::Cancel`]).
    pub fn cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        self.handle_input(ReceiverInput::Cancel { now, request })
    }

    /// Retires `request` (see [`ReceiverInput::Retire`]).
    pub fn retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        self.handle_input(ReceiverInput::Retire { now, request })
    }

    // ----- inputs -----

    /// Applies one input. Returns a usage error, with nothing changed, for a caller bug.
    pub fn handle_input(&mut self, input: ReceiverInput) -> Result<(), UsageError> {
        match input {
            ReceiverInput::PeerConnected { now, peer } => {
                self.peers
                    .connected(now, peer, &mut self.outputs, &mut self.timers)
            }
            ReceiverInput::PeerDisconnected { now, peer } => self.on_disconnected(now, peer),
            ReceiverInput::FrameReceived { now, peer, frame } => {
                let route = self.peers.on_frame(
                    now,
                    peer,
                    frame,
                    &mut self.outputs,
                    &mut self.counters,
                    &mut self.timers,
                )?;
                match route {
                    Route::Done => {}
                    Route::BecameReady => self.on_peer_ready(now, peer),
                    Route::Session(frame) => self.on_session_frame(now, peer, frame),
                }
                Ok(())
            }
            ReceiverInput::Cancel { now, request } => {
                if self.retired.contains(request) {
                    return Err(UsageError::Retired(request));
                }
                match self.sessions.get(&request) {
                    None => self.remembered_cancels.insert(request, CancelOrigin::Local),
                    Some(s) if s.phase.is_active() => {
                        self.stop(now, request, Stop::Cancelled(CancelOrigin::Local))
                    }
                    Some(_) => {}
                }
                Ok(())
            }
            ReceiverInput::Retire { now: _, request } => {
                if self.retired.contains(request) {
                    return Err(UsageError::Retired(request));
                }
                let s = self
                    .sessions
                    .get(&request)
                    .ok_or(UsageError::UnknownRequest(request))?;
                match s.phase.on(RecvEvent::Retire) {
                    Transition::To(_) => {
                        self.sessions.remove(&request);
                        self.retired.insert(request, ());
                        self.counters.retirements += 1;
                        Ok(())
                    }
                    _ => Err(UsageError::NotQuiesced(request)),
                }
            }
            ReceiverInput::Timeout { now } => {
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
                                PeerExpiry::Handshake => {
                                    self.fail_peer_sessions(now, peer, Wait::Handshake)
                                }
                                PeerExpiry::Liveness => {
                                    self.fail_peer_sessions(now, peer, Wait::Liveness)
                                }
                            }
                        }
                        TimerKey::Request(request) => self.on_request_timeout(now, request),
                    }
                }
                Ok(())
            }
        }
    }

    // ----- internals -----

    /// splitmix64: a seeded, well-mixed sequence; never zero.
    fn next_grant(&mut self) -> u64 {
        loop {
            self.grant_state = self.grant_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.grant_state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return z;
            }
        }
    }

    fn send(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        self.peers.transmit(now, peer, frame, &mut self.outputs);
    }

    fn event(&mut self, event: Event) {
        self.outputs.push_back(Output::Event(event));
    }

    fn violation(&mut self, peer: PeerId, error: ProtocolError) {
        self.counters.protocol_errors += 1;
        self.event(Event::ProtocolViolation { peer, error });
    }

    fn send_registration(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        let Some(w) = session.writers.iter_mut().find(|w| w.peer == peer) else {
            return;
        };
        if w.registration_sent || !session.phase.is_active() {
            return;
        }
        w.registration_sent = true;
        let frame = Frame::RecvRegistration(session.frame.clone());
        self.send(now, peer, frame);
    }

    fn on_peer_ready(&mut self, now: Instant, peer: PeerId) {
        let waiting: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.phase.is_active()
                    && s.writers
                        .iter()
                        .any(|w| w.peer == peer && !w.registration_sent)
            })
            .map(|(r, _)| *r)
            .collect();
        for request in waiting {
            self.send_registration(now, request, peer);
        }
    }

    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        match frame {
            Frame::KvResult(result) => self.on_result(now, peer, result),
            Frame::AuxResult(aux) => self.on_aux(now, peer, aux),
            Frame::Cancel(cancel) => self.on_peer_cancel(now, peer, cancel),
            other => self.violation(
                peer,
                ProtocolError::UnexpectedFrame {
                    kind: frame_kind(&other),
                    role: Role::Receiver,
                },
            ),
        }
    }

    /// Finds the session and writer a frame from `peer` is about; reports a violation if none.
    ///
    /// A result for a request this receiver does not hold (retired, or never registered) is
    /// answered with a `Cancel`: whatever the sender still does for it has no destination here.
    fn locate(
        &mut self,
        now: Instant,
        peer: PeerId,
        request: RequestId,
        kind: &'static str,
    ) -> Option<usize> {
        let stop = Frame::Cancel(Cancel {
            request,
            reason: CancelReason::Failure,
        });
        if self.retired.contains(request) {
            self.counters.duplicates += 1;
            self.send(now, peer, stop);
            return None;
        }
        let Some(session) = self.sessions.get(&request) else {
            self.violation(peer, ProtocolError::UnknownRequest { kind, request });
            self.send(now, peer, stop);
            return None;
        };
        let Some(w) = session.writers.iter().position(|w| w.peer == peer) else {
            self.violation(peer, ProtocolError::NotAParticipant { kind, request });
            return None;
        };
        Some(w)
    }

    fn on_result(&mut self, now: Instant, peer: PeerId, r: KvResult) {
        let request = r.request;
        let Some(w) = self.locate(now, peer, request, "KvResult") else {
            return;
        };
        let session = self.sessions.get_mut(&request).expect("located");
        let expected = session.frame.slice;
        if r.receiver_slice != expected {
            self.counters.protocol_errors += 1;
            self.event(Event::ProtocolViolation {
                peer,
                error: ProtocolError::UnknownSlice {
                    request,
                    expected,
                    got: r.receiver_slice,
                },
            });
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: TransferStatus::ProtocolError,
                    peer: Some(peer),
                    slice: Some(r.sender_slice),
                },
            );
            return;
        }
        let writer = &mut session.writers[w];
        let key = (r.sender_slice, r.is_last);
        // A failure is never a duplicate: it may follow the writer's successful last result
        // (the aux data failed), and a stopping session needs its terminal confirmation.
        if r.status == TransferStatus::Success && writer.last_seen.is_some_and(|seen| key <= seen) {
            self.counters.duplicates += 1;
            return;
        }
        let after_last = writer.last_seen.is_some_and(|(_, last)| last);
        writer.last_seen = Some(writer.last_seen.map_or(key, |seen| seen.max(key)));
        self.counters.results.bump(r.status);
        if r.is_last {
            writer.stopped = true;
        }
        if !session.phase.is_active() {
            // Stopping: a terminal result is the writer's confirmation that it stopped.
            self.check_drained(now, request);
            return;
        }
        if r.status != TransferStatus::Success {
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: r.status,
                    peer: Some(peer),
                    slice: Some(r.sender_slice),
                },
            );
            return;
        }
        if after_last {
            self.counters.protocol_errors += 1;
            self.event(Event::ProtocolViolation {
                peer,
                error: ProtocolError::ResultAfterLast { request },
            });
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: TransferStatus::ProtocolError,
                    peer: Some(peer),
                    slice: Some(r.sender_slice),
                },
            );
            return;
        }
        session.bytes_written += r.bytes_written;
        self.counters.bytes_written += r.bytes_written;
        if r.is_last {
            session.writers[w].done = true;
        }
        self.progress(now, request);
    }

    fn on_aux(&mut self, now: Instant, peer: PeerId, aux: AuxResult) {
        let request = aux.request;
        let Some(_) = self.locate(now, peer, request, "AuxResult") else {
            return;
        };
        let session = self.sessions.get_mut(&request).expect("located");
        if !session.phase.is_active() || session.aux.is_some() {
            self.counters.duplicates += 1;
            return;
        }
        if aux.status != TransferStatus::Success {
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: aux.status,
                    peer: Some(peer),
                    slice: None,
                },
            );
            return;
        }
        let len = aux_encoded_len(&aux.data);
        let capacity = session.frame.aux_capacity;
        if len > u64::from(capacity) {
            self.counters.protocol_errors += 1;
            self.event(Event::ProtocolViolation {
                peer,
                error: ProtocolError::AuxTooLarge {
                    request,
                    len,
                    capacity,
                },
            });
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: TransferStatus::ProtocolError,
                    peer: Some(peer),
                    slice: None,
                },
            );
            return;
        }
        session.aux = Some(aux.data);
        session.aux_deadline = None;
        self.progress(now, request);
    }

    fn on_peer_cancel(&mut self, now: Instant, peer: PeerId, cancel: Cancel) {
        let request = cancel.request;
        if self.retired.contains(request) {
            self.counters.duplicates += 1;
            return;
        }
        let Some(session) = self.sessions.get_mut(&request) else {
            // Not registered yet: remember it and cancel the registration when it comes.
            self.remembered_cancels
                .insert(request, CancelOrigin::Peer(peer));
            return;
        };
        let Some(w) = session.writers.iter().position(|w| w.peer == peer) else {
            self.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "Cancel",
                    request,
                },
            );
            return;
        };
        // A sender sends Cancel only when none of its writes for the request is in flight.
        session.writers[w].stopped = true;
        if session.phase.is_active() {
            self.stop(now, request, Stop::Cancelled(CancelOrigin::Peer(peer)));
        } else {
            self.check_drained(now, request);
        }
    }

    fn on_disconnected(&mut self, now: Instant, peer: PeerId) -> Result<(), UsageError> {
        self.peers.disconnected(peer)?;
        let involved: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.writers.iter().any(|w| w.peer == peer))
            .map(|(r, _)| *r)
            .collect();
        for request in involved {
            let session = self.sessions.get_mut(&request).expect("listed");
            let w = session
                .writers
                .iter_mut()
                .find(|w| w.peer == peer)
                .expect("listed");
            w.stopped = true;
            let done = w.done;
            if session.phase.is_active() && !done {
                self.stop(
                    now,
                    request,
                    Stop::Failed {
                        cause: TransferStatus::PeerLost,
                        peer: Some(peer),
                        slice: None,
                    },
                );
            } else {
                self.check_drained(now, request);
            }
        }
        Ok(())
    }

    fn fail_peer_sessions(&mut self, now: Instant, peer: PeerId, wait: Wait) {
        let involved: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.phase.is_active() && s.writers.iter().any(|w| w.peer == peer && !w.done)
            })
            .map(|(r, _)| *r)
            .collect();
        for request in involved {
            self.stop(now, request, Stop::TimedOut(wait));
        }
    }

    /// Completes the session when every writer's last result and the aux data arrived.
    fn progress(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        let all_done = session.writers.iter().all(|w| w.done);
        let event = if all_done && session.aux.is_some() {
            RecvEvent::Finished
        } else {
            RecvEvent::Progress
        };
        if all_done && session.aux.is_none() && session.aux_deadline.is_none() {
            let at = now + self.config.deadlines.aux_wait;
            session.aux_deadline = Some(at);
            self.timers.arm(at, TimerKey::Request(request));
        }
        if let Transition::To(p) = session.phase.on(event) {
            session.phase = p;
            if p == RecvPhase::Completed {
                let bytes = session.bytes_written;
                let aux = session.aux.clone();
                self.counters.completions += 1;
                self.counters.quiesced += 1;
                self.event(Event::Completed {
                    request,
                    bytes_written: bytes,
                    aux,
                });
                self.event(Event::Quiesced { request });
            }
        }
    }

    fn on_request_timeout(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if session.phase.is_active() {
            let all_done = session.writers.iter().all(|w| w.done);
            if !all_done && session.result_deadline <= now {
                self.stop(now, request, Stop::TimedOut(Wait::Results));
                return;
            }
            if session.aux_deadline.is_some_and(|at| at <= now) {
                self.stop(now, request, Stop::TimedOut(Wait::Aux));
                return;
            }
            let next = if all_done {
                session.aux_deadline
            } else {
                Some(session.result_deadline)
            };
            self.timers.arm_opt(next, TimerKey::Request(request));
        } else if session.phase == RecvPhase::Stopping {
            if session.quiesce_deadline.is_some_and(|at| at <= now) {
                let fence: Vec<PeerId> = session
                    .writers
                    .iter_mut()
                    .filter(|w| !w.stopped && !w.fence_requested)
                    .map(|w| {
                        w.fence_requested = true;
                        w.peer
                    })
                    .collect();
                for peer in fence {
                    self.peers.close(
                        peer,
                        CloseReason::QuiesceFence,
                        &mut self.outputs,
                        &mut self.counters,
                    );
                }
            } else {
                self.timers
                    .arm_opt(session.quiesce_deadline, TimerKey::Request(request));
            }
        }
    }

    /// Ends an active session: reports it, tells every writer that has not stopped, and waits
    /// for their confirmation before [`Event::Quiesced`].
    fn stop(&mut self, now: Instant, request: RequestId, why: Stop) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        let Transition::To(phase) = session.phase.on(RecvEvent::Stop) else {
            return;
        };
        session.phase = phase;
        let receiver_slice = session.frame.slice;
        let (status, reason, event) = match why {
            Stop::Failed { cause, peer, slice } => (
                cause,
                CancelReason::Failure,
                Event::Failed {
                    request,
                    cause,
                    peer,
                    sender_slice: slice,
                    receiver_slice: Some(receiver_slice),
                },
            ),
            Stop::TimedOut(wait) => (
                TransferStatus::TimedOut,
                CancelReason::Timeout,
                Event::TimedOut {
                    request,
                    waiting_for: wait,
                },
            ),
            Stop::Cancelled(origin) => (
                TransferStatus::Cancelled,
                CancelReason::Engine,
                Event::Cancelled { request, origin },
            ),
        };
        let quiesce_at = now + self.config.deadlines.quiesce;
        session.quiesce_deadline = Some(quiesce_at);
        let mut notify = Vec::new();
        for w in session.writers.iter_mut() {
            if !w.registration_sent {
                // The writer never got the grant: nothing of it can land, so it is not waited
                // for. It is still told (when connected), so that it stops computing and
                // pinning the request instead of waiting out its registration deadline.
                w.stopped = true;
                if self.peers.is_ready(w.peer) {
                    notify.push(w.peer);
                }
            } else {
                // Every writer that got the registration hears of it, even one that already
                // sent its last result (it may still be waiting to send the aux data); only
                // those that have not stopped are waited for.
                notify.push(w.peer);
            }
        }
        self.counters.failures.bump(status);
        match why {
            Stop::TimedOut(_) => self.counters.timeouts += 1,
            Stop::Cancelled(_) => self.counters.cancellations += 1,
            Stop::Failed { .. } => {}
        }
        self.event(event);
        for peer in notify {
            self.send(now, peer, Frame::Cancel(Cancel { request, reason }));
        }
        self.timers.arm(quiesce_at, TimerKey::Request(request));
        self.check_drained(now, request);
    }

    fn check_drained(&mut self, _now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if session.phase != RecvPhase::Stopping || !session.writers.iter().all(|w| w.stopped) {
            return;
        }
        if let Transition::To(p) = session.phase.on(RecvEvent::Drained) {
            session.phase = p;
            session.quiesce_deadline = None;
            self.counters.quiesced += 1;
            self.event(Event::Quiesced { request });
        }
    }
}

/// Bytes the aux data takes in the receiver's aux slot: two counts, two lengths and the tokens.
fn aux_encoded_len(data: &AuxData) -> u64 {
    16 + 4 * (data.first_tokens.len() as u64 + data.draft_tokens.len() as u64)
}
