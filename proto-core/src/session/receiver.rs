//! The decode-side endpoint.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use smallvec::SmallVec;

use super::config::ReceiverConfig;
use super::coverage::{check_group_cover, GroupPart};
use super::grants::{Flight, GrantedExtents, LandedExtents, WritesInFlight};
use super::peers::Route;
use super::retired::Retired;
use super::shell::{Due, Shell};
use super::state::{RecvEvent, RecvPhase, Transition, WriterEvent, WriterPhase};
use super::timers::TimerKey;
use super::transport::{Admission, DataPath, Endpoint, TransportInput, WriteRefusal};
use super::{
    frame_kind, CancelOrigin, CloseReason, Counters, Event, Output, ProtocolError, RequestTimings,
    UsageError, Wait,
};
use crate::blocks::AnchoredRun;
use crate::geometry::{stale_boundary, total_blocks};
use crate::ids::{GrantId, GroupIndex, PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::shard::writes_group;
use crate::time::Instant;
use crate::wire::{
    AuxData, AuxResult, Cancel, CancelReason, DataWrite, Frame, KvResult, RecvRegistration, Role,
    TransferStatus, MAX_BODY_LEN,
};

/// One input to a [`Receiver`]: everything that can change its state, as data, so a recorded
/// list of inputs replays into a fresh receiver with the same outputs. Every input carries
/// `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum ReceiverInput {
    /// What the transport saw (see [`TransportInput`]).
    Transport {
        /// Current time.
        now: Instant,
        /// The report.
        input: TransportInput,
    },
    /// The engine registers the destination of a request ([`Receiver::register`]).
    Register {
        /// Current time.
        now: Instant,
        /// The destination blocks and the writers.
        registration: Registration,
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
    /// What the writers together write, per layer group, in group order: `None` (the usual
    /// case) expects every layer and head this rank holds. An engine that deliberately spreads
    /// one rank's writers over several receivers (one endpoint per writer) declares here the
    /// part this registration receives, and must itself wait for every part. The writers must
    /// cover the expected part exactly once ([`UsageError::WritersDoNotCover`]).
    pub expected_part: Option<Vec<GroupPart>>,
}

/// Most frames held per writer while they wait for the data they report to land.
const MAX_HELD_FRAMES: usize = 1024;

/// One sender rank of a request, as the receiver tracks it.
#[derive(Clone, Debug)]
struct Writer {
    peer: PeerId,
    phase: WriterPhase,
    /// The slices whose successful result was taken (a duplicate is dropped, never counted).
    seen: BTreeSet<SenderSliceId>,
    /// The writer's last slice, once its `is_last` result was taken: the writer is done when
    /// every slice up to it was seen.
    last: Option<SenderSliceId>,
    /// The slices whose successful result arrived (held ones included), so a duplicate never
    /// counts as reported bytes.
    arrived: BTreeSet<SenderSliceId>,
    /// Payload bytes of this writer's admitted writes that landed.
    landed: u64,
    /// Bytes this writer's successful results reported (held ones included).
    reported: u64,
    /// Frames that arrived before the data they report landed, each with the landed count it
    /// needs ([`DataPath::Landed`]).
    held: VecDeque<(u64, Frame)>,
    /// The writer's aux data arrived.
    aux: bool,
    /// Bytes the writer's taken successful results reported.
    result_bytes: u64,
}

impl Writer {
    /// Everything of this writer arrived: its successful last result and its aux data.
    fn finished(&self) -> bool {
        self.phase == WriterPhase::Done && self.aux
    }

    fn on(&mut self, event: WriterEvent) -> bool {
        match self.phase.on(event) {
            Transition::To(p) => {
                self.phase = p;
                true
            }
            Transition::Ignored | Transition::Refused => false,
        }
    }
}

#[derive(Clone, Debug)]
struct RecvSession {
    phase: RecvPhase,
    frame: RecvRegistration,
    extents: GrantedExtents,
    writers: SmallVec<[Writer; 2]>,
    /// Admitted writes of the request still being applied.
    writes_in_flight: u32,
    aux: Option<AuxData>,
    timings: RequestTimings,
    /// The overall cap: registration + `result_wait` + prompt × `result_per_token`.
    result_cap: Instant,
    /// When a result, landed data or aux data last arrived.
    last_progress: Option<Instant>,
    /// The earliest timer armed for the result deadline and not fired yet (progress arms a
    /// timer only when it brings the deadline before it, so the queue stays small).
    result_armed: Option<Instant>,
    aux_deadline: Option<Instant>,
    quiesce_deadline: Option<Instant>,
    bytes_written: u64,
    /// Blocks of the registration, released (counted) when the session quiesces.
    blocks_pinned: u64,
    /// The bytes that landed; a write overlapping them is refused (no byte lands twice).
    landed: LandedExtents,
    /// The part the writers must cover (`None`: all the rank holds).
    expected_part: Option<Vec<GroupPart>>,
    /// The writers' cover was proved (every writer's handshake was known).
    cover_proved: bool,
}

impl RecvSession {
    /// When the results are due: the overall cap, and once progress was made, the idle
    /// deadline after the last progress, whichever comes first.
    fn result_deadline(&self, idle: crate::time::Duration) -> Instant {
        match self.last_progress {
            Some(at) => self.result_cap.min(at + idle),
            None => self.result_cap,
        }
    }
}

/// What the receiver remembers of a retired request: late writes carrying its grant from one
/// of its writers are discarded, anything else naming it is refused.
#[derive(Clone, Debug)]
struct RetiredGrant {
    grant: GrantId,
    writers: SmallVec<[PeerId; 2]>,
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
/// [`writer_phase`](Self::writer_phase), [`grant`](Self::grant),
/// [`granted_extents`](Self::granted_extents), [`session_count`](Self::session_count),
/// [`peer_count`](Self::peer_count), [`is_peer_ready`](Self::is_peer_ready),
/// [`writes_in_flight`](Self::writes_in_flight), [`config`](Self::config).
///
/// **Inputs** (each carries `now`): [`handle_input`](Self::handle_input) with a
/// [`ReceiverInput`] — what the transport saw ([`TransportInput`], also through the
/// [`Endpoint`] trait, including the admission of data writes), and the engine's register,
/// cancel and retire. [`record_inputs`](Self::record_inputs) captures a run that replays
/// exactly into a fresh receiver.
///
/// **Commands** (sugar for inputs): [`register`](Self::register) (the destination blocks of a
/// request and its writers; sends a `RecvRegistration` to each writer once its handshake is
/// done), [`cancel`](Self::cancel), [`retire`](Self::retire).
///
/// **Admission** ([`DataPath::Landed`] transports): before applying a data write the transport
/// asks [`Endpoint::admit_write`]; the receiver admits it only for a registered request, with
/// its grant, from one of its writers, inside the granted extents and overlapping no write in
/// flight, and holds each writer's results until the bytes they report have landed.
///
/// **Outputs**: after every input, call [`poll_output`](Self::poll_output) until it returns
/// `None`, then [`poll_timeout`](Self::poll_timeout) and arm a timer for it. Outputs come out in
/// the order they were produced. A request ends with exactly one of [`Event::Completed`] (one
/// successful last result from every writer, plus the aux data), [`Event::Failed`],
/// [`Event::TimedOut`] or [`Event::Cancelled`], and then [`Event::Quiesced`].
///
/// **Memory**: the destination blocks stay pinned until [`Event::Quiesced`]: after a failure,
/// timeout or cancel that is when every writer confirmed it stopped (its terminal `KvResult`
/// or a `Cancel`) or was reported disconnected, and no admitted write is still being applied.
/// A writer that does not confirm before the quiesce deadline is fenced with
/// [`Output::ClosePeer`]; the blocks are handed back only once the transport reports the
/// disconnect, so no remote write can land in reused memory.
///
/// **Errors**: [`UsageError`] for caller bugs (nothing changed); peer misbehaviour fails the
/// session ([`TransferStatus::ProtocolError`]) or is reported as [`Event::ProtocolViolation`].
#[derive(Debug)]
pub struct Receiver {
    config: ReceiverConfig,
    shell: Shell,
    sessions: BTreeMap<RequestId, RecvSession>,
    retired: Retired<RetiredGrant>,
    writes: WritesInFlight,
    next_slice: u32,
    grant_state: u64,
    recorded: Option<Vec<ReceiverInput>>,
}

impl Receiver {
    /// A receiver with no peers and no sessions, or the first reason its configuration cannot
    /// run pipelined transfer.
    pub fn new(config: ReceiverConfig) -> Result<Self, crate::config::ConfigError> {
        config.pipeline.validate()?;
        let hello = config.local.to_hello(Role::Receiver);
        Ok(Receiver {
            shell: Shell::new(hello, config.deadlines, config.max_remembered_cancels),
            sessions: BTreeMap::new(),
            retired: Retired::new(config.retired_horizon, config.max_retired),
            writes: WritesInFlight::default(),
            next_slice: 0,
            grant_state: config.grant_seed,
            recorded: None,
            config,
        })
    }

    // ----- getters -----

    /// The configuration.
    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    /// What the receiver has done so far.
    pub fn counters(&self) -> &Counters {
        &self.shell.counters
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

    /// The phase of writer `peer` within `request`'s session.
    pub fn writer_phase(&self, request: RequestId, peer: PeerId) -> Option<WriterPhase> {
        let session = self.sessions.get(&request)?;
        session
            .writers
            .iter()
            .find(|w| w.peer == peer)
            .map(|w| w.phase)
    }

    /// The memory grant of `request`'s registration.
    pub fn grant(&self, request: RequestId) -> Option<GrantId> {
        self.sessions.get(&request).map(|s| s.frame.grant)
    }

    /// The destination bytes granted to `request`.
    pub fn granted_extents(&self, request: RequestId) -> Option<&GrantedExtents> {
        self.sessions.get(&request).map(|s| &s.extents)
    }

    /// Sessions held (not yet retired).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Connected peers (handshaking, ready or closing).
    pub fn peer_count(&self) -> usize {
        self.shell.peers.len()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.shell.peers.is_ready(peer)
    }

    /// The layer groups `peer` described in its handshake (its windows among them: a sender
    /// keeping a smaller window than this side's never writes the blocks before its own stale
    /// boundary), once its `Hello` arrived.
    pub fn peer_groups(&self, peer: PeerId) -> Option<&[crate::layout::LayerGroupLayout]> {
        self.shell.peers.remote(peer).map(|h| h.groups.as_slice())
    }

    /// Retired request ids remembered now (at most one horizon's retirements, see
    /// [`ReceiverConfig::retired_horizon`](super::ReceiverConfig::retired_horizon)).
    pub fn retired_count(&self) -> usize {
        self.retired.len()
    }

    /// Admitted data writes not reported finished yet.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    // ----- outputs -----

    /// The next output, or `None` when there is nothing to do until the next input.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.shell.outputs.pop_front()
    }

    /// When to deliver [`TransportInput::Timeout`] next (`None`: no deadline pending).
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.shell.timers.next()
    }

    // ----- recording -----

    /// Starts (or stops, with `false`) recording every input applied, for
    /// [`take_recorded_inputs`](Self::take_recorded_inputs). Inputs refused with a usage error
    /// are not recorded (they changed nothing).
    pub fn record_inputs(&mut self, on: bool) {
        self.recorded = on.then(Vec::new);
    }

    /// The inputs applied since recording started (recording goes on).
    pub fn take_recorded_inputs(&mut self) -> Vec<ReceiverInput> {
        self.recorded
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    // ----- commands -----

    /// Registers the destination of a request (see [`ReceiverInput::Register`]) and sends it to
    /// every writer whose handshake is done (the others get it when theirs completes). Returns
    /// the receiver's slice id for it.
    ///
    /// A cancel that arrived before (from the engine or a writer) cancels it at once.
    pub fn register(
        &mut self,
        now: Instant,
        reg: Registration,
    ) -> Result<ReceiverSliceId, UsageError> {
        let request = reg.request;
        self.handle_input(ReceiverInput::Register {
            now,
            registration: reg,
        })?;
        Ok(self
            .sessions
            .get(&request)
            .map(|s| s.frame.slice)
            .expect("registered above"))
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
        let recorded = self.recorded.is_some().then(|| input.clone());
        match input {
            ReceiverInput::Transport { now, input } => self.on_transport(now, input).map(|_| ()),
            ReceiverInput::Register { now, registration } => self.on_register(now, registration),
            ReceiverInput::Cancel { now, request } => self.on_cancel(now, request),
            ReceiverInput::Retire { now, request } => self.on_retire(now, request),
        }?;
        if let (Some(log), Some(input)) = (&mut self.recorded, recorded) {
            log.push(input);
        }
        Ok(())
    }

    /// Applies what the transport saw (see [`ReceiverInput::Transport`]).
    pub fn handle_transport(
        &mut self,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), UsageError> {
        self.handle_input(ReceiverInput::Transport { now, input })
    }

    /// Asks whether the data write whose encoded `DataWrite` frame is `header` may be applied
    /// (see [`Admission`]); recorded as [`TransportInput::WriteArrived`]. A refusal has already
    /// failed the request it named (when `peer` is one of its writers) and asked to close the
    /// peer.
    pub fn admit_write(&mut self, now: Instant, peer: PeerId, header: &[u8]) -> Admission {
        let input = TransportInput::WriteArrived {
            peer,
            header: Bytes::copy_from_slice(header),
        };
        let recorded = self.recorded.is_some().then(|| ReceiverInput::Transport {
            now,
            input: input.clone(),
        });
        match self.on_transport(now, input) {
            Ok(Some(admission)) => {
                if let (Some(log), Some(input)) = (&mut self.recorded, recorded) {
                    log.push(input);
                }
                admission
            }
            Ok(None) | Err(_) => Admission::Refuse(WriteRefusal::PeerNotReady(peer)),
        }
    }

    // ----- internals -----

    /// Applies a transport input; for [`TransportInput::WriteArrived`] returns the admission.
    fn on_transport(
        &mut self,
        now: Instant,
        input: TransportInput,
    ) -> Result<Option<Admission>, UsageError> {
        match input {
            TransportInput::PeerConnected { peer } => self.shell.connected(now, peer)?,
            TransportInput::PeerDisconnected { peer } => self.on_disconnected(now, peer)?,
            TransportInput::FrameReceived { peer, bytes } => {
                match self.shell.frame(now, peer, &bytes)? {
                    Route::Done => {}
                    Route::BecameReady => self.on_peer_ready(now, peer),
                    Route::Session(frame) => self.on_session_frame(now, peer, frame),
                    Route::Malformed => self.fail_peer_sessions(
                        now,
                        peer,
                        Stop::Failed {
                            cause: TransferStatus::ProtocolError,
                            peer: Some(peer),
                            slice: None,
                        },
                    ),
                }
            }
            TransportInput::WritesCompleted { .. } | TransportInput::WritesFailed { .. } => {
                return Err(UsageError::WrongRole {
                    input: "a write batch report",
                    role: Role::Receiver,
                });
            }
            TransportInput::WriteArrived { peer, header } => {
                return Ok(Some(self.on_write_arrived(now, peer, &header)?));
            }
            TransportInput::WriteFinished { ticket, landed } => {
                self.on_write_finished(now, ticket, landed)?
            }
            TransportInput::DataArriving { peer } => self.shell.peers.alive(now, peer)?,
            TransportInput::Timeout => {
                for due in self.shell.due(now) {
                    match due {
                        Due::Handshake(peer) => {
                            self.fail_peer_sessions(now, peer, Stop::TimedOut(Wait::Handshake))
                        }
                        Due::Liveness(peer) => {
                            self.fail_peer_sessions(now, peer, Stop::TimedOut(Wait::Liveness))
                        }
                        Due::Request(request) => self.on_request_timeout(now, request),
                    }
                }
            }
        }
        Ok(None)
    }

    fn on_register(&mut self, now: Instant, reg: Registration) -> Result<(), UsageError> {
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
        super::check_registration_ordinals(
            request,
            reg.prompt_len,
            &reg.groups,
            &self.config.local.groups,
        )
        .map_err(UsageError::RegistrationOutsidePrompt)?;
        self.check_registration_window(request, reg.prompt_len, &reg.groups)?;
        if let Some(parts) = &reg.expected_part {
            self.check_expected_part(request, parts)?;
        }
        let cover_proved =
            match self.prove_cover(request, &reg.writers, reg.expected_part.as_deref()) {
                Some(Err(error)) => return Err(UsageError::WritersDoNotCover(error)),
                Some(Ok(())) => true,
                None => false,
            };
        let slice = ReceiverSliceId(self.next_slice);
        let frame = RecvRegistration {
            request,
            slice,
            prompt_len: reg.prompt_len,
            grant: GrantId(0),
            aux_capacity: reg.aux_capacity,
            groups: reg.groups,
        };
        let frame = Frame::RecvRegistration(frame);
        let len = frame.body_len() as u64;
        if len > u64::from(MAX_BODY_LEN) {
            return Err(UsageError::RegistrationTooLarge {
                request,
                len,
                max: u64::from(MAX_BODY_LEN),
            });
        }
        // A registration the wire cannot carry (a hand-built run that is not canonical) would
        // never reach a writer and the request would wait out its deadline: refuse it now.
        if let Err(error) = frame.to_vec() {
            return Err(UsageError::RegistrationUnencodable { request, error });
        }
        let Frame::RecvRegistration(mut frame) = frame else {
            unreachable!("built above")
        };
        // Validated: from here on the state changes.
        self.next_slice = self.next_slice.wrapping_add(1);
        frame.grant = GrantId(self.next_grant());
        let extents = GrantedExtents::compute(&self.config.local.groups, &frame.groups);
        let blocks_pinned: u64 = frame.groups.iter().map(|g| g.block_count()).sum();
        let d = self.config.deadlines;
        let per_token = d.result_per_token.as_nanos();
        let result_cap = now
            + d.result_wait
            + crate::time::Duration::from_nanos(
                per_token.saturating_mul(u64::from(frame.prompt_len)),
            );
        self.sessions.insert(
            request,
            RecvSession {
                phase: RecvPhase::Receiving,
                frame,
                extents,
                writers: reg
                    .writers
                    .iter()
                    .map(|&peer| Writer {
                        peer,
                        phase: WriterPhase::Unregistered,
                        seen: BTreeSet::new(),
                        last: None,
                        arrived: BTreeSet::new(),
                        landed: 0,
                        reported: 0,
                        held: VecDeque::new(),
                        aux: false,
                        result_bytes: 0,
                    })
                    .collect(),
                writes_in_flight: 0,
                aux: None,
                timings: RequestTimings {
                    started: now,
                    ended: now,
                    ..RequestTimings::default()
                },
                result_cap,
                last_progress: None,
                result_armed: Some(result_cap),
                aux_deadline: None,
                quiesce_deadline: None,
                bytes_written: 0,
                blocks_pinned,
                landed: LandedExtents::default(),
                expected_part: reg.expected_part,
                cover_proved,
            },
        );
        self.shell.counters.blocks_pinned += blocks_pinned;
        self.shell
            .timers
            .arm(result_cap, TimerKey::Request(request));
        if let Some(origin) = self.shell.remembered_cancels.take(request) {
            self.stop(now, request, Stop::Cancelled(origin));
            return Ok(());
        }
        for peer in reg.writers {
            if self.shell.peers.is_ready(peer) {
                self.send_registration(now, request, peer);
            }
        }
        Ok(())
    }

    fn on_cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        match self.sessions.get(&request) {
            None => self
                .shell
                .remembered_cancels
                .insert(request, CancelOrigin::Local),
            Some(s) if s.phase.is_active() => {
                self.stop(now, request, Stop::Cancelled(CancelOrigin::Local))
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn on_retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        let s = self
            .sessions
            .get(&request)
            .ok_or(UsageError::UnknownRequest(request))?;
        match s.phase.on(RecvEvent::Retire) {
            Transition::To(_) => {
                let s = self.sessions.remove(&request).expect("present");
                self.retired.insert(
                    now,
                    request,
                    RetiredGrant {
                        grant: s.frame.grant,
                        writers: s.writers.iter().map(|w| w.peer).collect(),
                    },
                );
                self.shell.counters.retirements += 1;
                self.shell.counters.retired_forgotten_early = self.retired.forgotten_early();
                Ok(())
            }
            _ => Err(UsageError::NotQuiesced(request)),
        }
    }

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

    fn send_registration(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if !session.phase.is_active() {
            return;
        }
        let Some(w) = session.writers.iter_mut().find(|w| w.peer == peer) else {
            return;
        };
        if !w.on(WriterEvent::RegistrationSent) {
            return;
        }
        let frame = Frame::RecvRegistration(session.frame.clone());
        self.shell.send(now, peer, frame);
    }

    fn on_peer_ready(&mut self, now: Instant, peer: PeerId) {
        let waiting: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.phase.is_active()
                    && s.writers
                        .iter()
                        .any(|w| w.peer == peer && w.phase == WriterPhase::Unregistered)
            })
            .map(|(r, _)| *r)
            .collect();
        for request in waiting {
            self.send_registration(now, request, peer);
            self.prove_session_cover(now, request, peer);
        }
    }

    /// Once every writer of `request` completed its handshake (the last one, `peer`, just did),
    /// proves that they cover what the registration expects; fails the request if not.
    fn prove_session_cover(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        let Some(session) = self.sessions.get(&request) else {
            return;
        };
        if session.cover_proved || !session.phase.is_active() {
            return;
        }
        let writers: SmallVec<[PeerId; 2]> = session.writers.iter().map(|w| w.peer).collect();
        match self.prove_cover(request, &writers, session.expected_part.as_deref()) {
            None => {}
            Some(Ok(())) => {
                if let Some(s) = self.sessions.get_mut(&request) {
                    s.cover_proved = true;
                }
            }
            Some(Err(error)) => self.stop_protocol(now, request, peer, error),
        }
    }

    /// What this rank holds of each layer group.
    fn held_parts(&self) -> impl Iterator<Item = GroupPart> + '_ {
        self.config.local.groups.iter().map(GroupPart::held)
    }

    /// Refuses a windowed group's blocks below its stale boundary: they are never sent (sink
    /// tokens among them), so the request would complete without them. The decode engine fills
    /// such blocks itself (see docs/PROTOCOL.md, "Sink tokens").
    fn check_registration_window(
        &self,
        request: RequestId,
        prompt_len: u32,
        groups: &[AnchoredRun],
    ) -> Result<(), UsageError> {
        for (g, (run, layout)) in groups.iter().zip(&self.config.local.groups).enumerate() {
            let Some(window) = layout.window else {
                continue;
            };
            let stale = stale_boundary(prompt_len, window, layout.tokens_per_block).unwrap_or(0);
            if run.block_count() > 0 && run.first_ordinal < stale {
                return Err(UsageError::RegistrationBelowWindow {
                    request,
                    group: GroupIndex(g as u16),
                    first: run.first_ordinal,
                    stale,
                });
            }
        }
        Ok(())
    }

    /// Refuses an expected part that is not one part per group inside what the rank holds.
    fn check_expected_part(
        &self,
        request: RequestId,
        parts: &[GroupPart],
    ) -> Result<(), UsageError> {
        let held: Vec<GroupPart> = self.held_parts().collect();
        for g in 0..held.len().max(parts.len()) {
            let part = parts.get(g).cloned().unwrap_or_default();
            let within = held.get(g).cloned().unwrap_or_default();
            if g >= held.len() || g >= parts.len() || !within.contains(&part) {
                return Err(UsageError::ExpectedPartNotHeld {
                    request,
                    group: GroupIndex(g as u16),
                    part,
                    held: within,
                });
            }
        }
        Ok(())
    }

    /// Whether `writers` (every one's handshake known) write each group's expected part exactly
    /// once; `None` while a writer's handshake is not known yet.
    fn prove_cover(
        &self,
        request: RequestId,
        writers: &[PeerId],
        expected: Option<&[GroupPart]>,
    ) -> Option<Result<(), ProtocolError>> {
        let local = &self.config.local;
        let hellos: Vec<(PeerId, &crate::wire::Hello)> = writers
            .iter()
            .map(|&w| self.shell.peers.remote(w).map(|h| (w, h)))
            .collect::<Option<_>>()?;
        for (g, (dst, held)) in local.groups.iter().zip(self.held_parts()).enumerate() {
            let expected = expected.and_then(|e| e.get(g)).unwrap_or(&held);
            let parts: SmallVec<[(PeerId, GroupPart); 4]> = hellos
                .iter()
                .map(|&(w, hello)| {
                    let part = hello.groups.get(g).map_or_else(GroupPart::default, |src| {
                        GroupPart::written_by(&hello.topology, src, &local.topology, dst)
                    });
                    (w, part)
                })
                .collect();
            if let Err(fault) = check_group_cover(expected, &parts) {
                return Some(Err(ProtocolError::WritersDoNotCover {
                    request,
                    group: GroupIndex(g as u16),
                    fault,
                }));
            }
        }
        Some(Ok(()))
    }

    // ----- admission -----

    fn on_write_arrived(
        &mut self,
        now: Instant,
        peer: PeerId,
        header: &Bytes,
    ) -> Result<Admission, UsageError> {
        let Some(phase) = self.shell.peers.phase(peer) else {
            return Err(UsageError::UnknownPeer(peer));
        };
        let refusal = match self.config.data_path {
            DataPath::Ordered => Err(WriteRefusal::NotAccepted),
            DataPath::Landed => self.check_write(now, peer, header),
        };
        match refusal {
            Ok(admission) => Ok(admission),
            Err(refusal) => {
                self.shell.counters.writes_refused += 1;
                if matches!(
                    phase,
                    super::state::PeerPhase::Handshaking | super::state::PeerPhase::Ready
                ) {
                    self.refuse(now, peer, refusal);
                }
                Ok(Admission::Refuse(refusal))
            }
        }
    }

    /// Decides on a data write; admits it (recording the flight) or says why not.
    fn check_write(
        &mut self,
        now: Instant,
        peer: PeerId,
        header: &[u8],
    ) -> Result<Admission, WriteRefusal> {
        let version = match self.shell.peers.version(peer) {
            Some(v) if self.shell.peers.is_ready(peer) => v,
            _ => return Err(WriteRefusal::PeerNotReady(peer)),
        };
        let w: DataWrite = match Frame::parse_negotiated(header, version) {
            Ok((Frame::DataWrite(w), n)) if n == header.len() => w,
            _ => return Err(WriteRefusal::Malformed),
        };
        let request = w.request;
        let Some(session) = self.sessions.get_mut(&request) else {
            return match self.retired.get(request) {
                Some(r) if r.grant == w.grant && r.writers.contains(&peer) => {
                    self.shell.counters.late_writes += 1;
                    Ok(Admission::Discard { len: w.len })
                }
                _ => Err(WriteRefusal::UnknownRequest(request)),
            };
        };
        if session.frame.grant != w.grant {
            return Err(WriteRefusal::WrongGrant {
                request,
                got: w.grant,
            });
        }
        if !session
            .writers
            .iter()
            .any(|x| x.peer == peer && x.phase != WriterPhase::Unregistered)
        {
            return Err(WriteRefusal::NotAWriter { request, peer });
        }
        if !session.extents.contains(w.region, w.offset, w.len) {
            return Err(WriteRefusal::OutsideGrant {
                request,
                region: w.region,
                offset: w.offset,
                len: w.len,
            });
        }
        if !session.phase.is_active() {
            self.shell.counters.late_writes += 1;
            return Ok(Admission::Discard { len: w.len });
        }
        let end = w.offset + w.len; // `contains` checked it does not overflow
        if self.writes.overlaps(w.region, w.offset, end)
            || session.landed.overlaps(w.region, w.offset, end)
        {
            return Err(WriteRefusal::Overlap {
                request,
                region: w.region,
                offset: w.offset,
                len: w.len,
            });
        }
        // Data begins to move again after the request's pipeline drained: every write landed
        // and every byte landed was reported by a result (see `RequestTimings::last_burst`).
        if session.writes_in_flight == 0 && session.writers.iter().all(|x| x.landed == x.reported) {
            session.timings.last_burst = Some(now);
        }
        session.writes_in_flight += 1;
        session.timings.writes += 1;
        let ticket = self.writes.admit(Flight {
            request,
            peer,
            region: w.region,
            offset: w.offset,
            len: w.len,
        });
        Ok(Admission::Apply {
            ticket,
            region: w.region,
            offset: w.offset,
            len: w.len,
        })
    }

    /// A refused write: the peer is not trusted any more. The request it named fails on both
    /// sides (when the peer is one of its writers), then the peer is closed.
    fn refuse(&mut self, now: Instant, peer: PeerId, refusal: WriteRefusal) {
        let named = match refusal {
            WriteRefusal::WrongGrant { request, .. }
            | WriteRefusal::OutsideGrant { request, .. }
            | WriteRefusal::Overlap { request, .. } => Some(request),
            _ => None,
        };
        if let Some(request) = named {
            let writer = self
                .sessions
                .get(&request)
                .is_some_and(|s| s.phase.is_active() && s.writers.iter().any(|w| w.peer == peer));
            if writer {
                self.stop(
                    now,
                    request,
                    Stop::Failed {
                        cause: TransferStatus::GrantViolation,
                        peer: Some(peer),
                        slice: None,
                    },
                );
            }
        }
        self.shell
            .violation(peer, ProtocolError::WriteRefused { refusal });
        self.shell.close(peer, CloseReason::GrantViolation);
    }

    fn on_write_finished(
        &mut self,
        now: Instant,
        ticket: super::transport::WriteTicket,
        landed: bool,
    ) -> Result<(), UsageError> {
        let Some(flight) = self.writes.finish(ticket) else {
            if self.writes.issued(ticket) {
                // Forgotten when its peer disconnected: a late report is harmless.
                return Ok(());
            }
            return Err(UsageError::UnknownTicket(ticket));
        };
        let request = flight.request;
        let Some(session) = self.sessions.get_mut(&request) else {
            return Ok(());
        };
        session.writes_in_flight = session.writes_in_flight.saturating_sub(1);
        if landed {
            session.timings.first_byte.get_or_insert(now);
            session.timings.last_byte = Some(now);
            self.note_progress(now, request);
            let session = self.sessions.get_mut(&request).expect("present");
            session
                .landed
                .insert(flight.region, flight.offset, flight.offset + flight.len);
            self.shell.counters.bytes_landed += flight.len;
            if let Some(w) = session.writers.iter_mut().find(|w| w.peer == flight.peer) {
                w.landed = w.landed.saturating_add(flight.len);
            }
            self.release_held(now, request, flight.peer);
        }
        if self
            .sessions
            .get(&request)
            .is_some_and(|s| s.phase == RecvPhase::Stopping)
        {
            self.check_drained(now, request);
        }
        Ok(())
    }

    // ----- session frames -----

    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        let request = match &frame {
            Frame::KvResult(r) => r.request,
            Frame::AuxResult(a) => a.request,
            Frame::Cancel(c) => c.request,
            other => {
                self.shell.violation(
                    peer,
                    ProtocolError::UnexpectedFrame {
                        kind: frame_kind(other),
                        role: Role::Receiver,
                    },
                );
                return;
            }
        };
        if self.config.data_path == DataPath::Landed {
            // Data and frames may travel on different connections: while the session is
            // active, a frame waits until the bytes its writer reported so far have landed.
            // A stopped session discards late data, so its frames (the writers' confirmations)
            // are taken at once.
            if let Some(w) = self
                .sessions
                .get_mut(&request)
                .filter(|s| s.phase.is_active())
                .and_then(|s| s.writers.iter_mut().find(|w| w.peer == peer))
            {
                let need = match &frame {
                    Frame::KvResult(r) if r.status == TransferStatus::Success => {
                        if !w.arrived.insert(r.sender_slice) {
                            self.shell.counters.duplicates += 1;
                            return;
                        }
                        w.reported.saturating_add(r.bytes_written)
                    }
                    _ => w.reported,
                };
                if !w.held.is_empty() || w.landed < need {
                    if w.held.len() >= MAX_HELD_FRAMES {
                        self.stop_protocol(
                            now,
                            request,
                            peer,
                            ProtocolError::TooManyHeldFrames {
                                request,
                                held: MAX_HELD_FRAMES,
                            },
                        );
                        return;
                    }
                    w.reported = need;
                    w.held.push_back((need, frame));
                    return;
                }
                w.reported = need;
            }
        }
        self.process_frame(now, peer, frame);
    }

    /// Processes the held frames of (`request`, `peer`) whose data has landed.
    fn release_held(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        loop {
            let Some(w) = self
                .sessions
                .get_mut(&request)
                .and_then(|s| s.writers.iter_mut().find(|w| w.peer == peer))
            else {
                return;
            };
            match w.held.front() {
                Some((need, _)) if *need <= w.landed => {}
                _ => return,
            }
            let (_, frame) = w.held.pop_front().expect("checked");
            self.process_frame(now, peer, frame);
        }
    }

    fn process_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        match frame {
            Frame::KvResult(result) => self.on_result(now, peer, result),
            Frame::AuxResult(aux) => self.on_aux(now, peer, aux),
            Frame::Cancel(cancel) => self.on_peer_cancel(now, peer, cancel),
            _ => {}
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
            self.shell.counters.duplicates += 1;
            self.shell.send(now, peer, stop);
            return None;
        }
        let Some(session) = self.sessions.get(&request) else {
            self.shell
                .violation(peer, ProtocolError::UnknownRequest { kind, request });
            self.shell.send(now, peer, stop);
            return None;
        };
        let Some(w) = session.writers.iter().position(|w| w.peer == peer) else {
            self.shell
                .violation(peer, ProtocolError::NotAParticipant { kind, request });
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
            self.shell.violation(
                peer,
                ProtocolError::UnknownSlice {
                    request,
                    expected,
                    got: r.receiver_slice,
                },
            );
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: TransferStatus::ProtocolError,
                    peer: Some(peer),
                    slice: r.sender_slice.get(),
                },
            );
            return;
        }
        let writer = &mut session.writers[w];
        // A failure is never a duplicate: it may follow the writer's successful last result
        // (the aux data failed), and a stopping session needs its terminal confirmation.
        if r.status == TransferStatus::Success && writer.seen.contains(&r.sender_slice) {
            self.shell.counters.duplicates += 1;
            return;
        }
        self.shell.counters.results.bump(r.status);
        if !session.phase.is_active() {
            // Stopping: a terminal result is the writer's confirmation that it stopped.
            if r.is_last {
                writer.on(WriterEvent::Confirmed);
            }
            self.check_drained(now, request);
            return;
        }
        if r.status != TransferStatus::Success {
            if r.is_last {
                writer.on(WriterEvent::Confirmed);
            }
            let why = if r.status == TransferStatus::Cancelled {
                // The writer's engine cancelled: a cancel, not a failure of the transfer.
                Stop::Cancelled(CancelOrigin::Peer(peer))
            } else {
                Stop::Failed {
                    cause: r.status,
                    peer: Some(peer),
                    slice: r.sender_slice.get(),
                }
            };
            self.stop(now, request, why);
            return;
        }
        // A successful result names a real slice, never one after the writer's last, and a
        // writer has one last slice.
        let after_last = r.sender_slice.get().is_none()
            || writer.last.is_some_and(|last| r.sender_slice > last)
            || (r.is_last && writer.last.is_some())
            || (r.is_last && writer.seen.last().is_some_and(|&max| max > r.sender_slice));
        if after_last {
            self.shell
                .violation(peer, ProtocolError::ResultAfterLast { request });
            self.stop(
                now,
                request,
                Stop::Failed {
                    cause: TransferStatus::ProtocolError,
                    peer: Some(peer),
                    slice: r.sender_slice.get(),
                },
            );
            return;
        }
        writer.seen.insert(r.sender_slice);
        if r.is_last {
            writer.last = Some(r.sender_slice);
        }
        writer.result_bytes = writer.result_bytes.saturating_add(r.bytes_written);
        // Done once the last result and every slice before it arrived (results may be
        // reordered by a transport that reorders frames).
        let done = writer
            .last
            .is_some_and(|last| writer.seen.len() as u64 == u64::from(last.0) + 1);
        let (reported, landed) = (writer.result_bytes, writer.landed);
        session.bytes_written += r.bytes_written;
        if done {
            // The writer is done: it must have written exactly its share of the registration,
            // landed (a transport that reports landings) and reported.
            let expected = self.writer_share(request, peer);
            let landed = (self.config.data_path == DataPath::Landed).then_some(landed);
            if reported != expected || landed.is_some_and(|l| l != expected) {
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::BytesMismatch {
                        request,
                        expected,
                        reported,
                        landed,
                    },
                );
                return;
            }
            let session = self.sessions.get_mut(&request).expect("located");
            session.writers[w].on(WriterEvent::LastResult);
        }
        let session = self.sessions.get_mut(&request).expect("located");
        if self.config.data_path == DataPath::Ordered {
            // No landing reports: a result is the moment its bytes are known to be placed.
            session.timings.first_byte.get_or_insert(now);
            session.timings.last_byte = Some(now);
        }
        self.shell.counters.bytes_written += r.bytes_written;
        self.note_progress(now, request);
        self.progress(now, request);
    }

    fn on_aux(&mut self, now: Instant, peer: PeerId, aux: AuxResult) {
        let request = aux.request;
        let Some(w) = self.locate(now, peer, request, "AuxResult") else {
            return;
        };
        let session = self.sessions.get_mut(&request).expect("located");
        if !session.phase.is_active() || session.writers[w].aux {
            self.shell.counters.duplicates += 1;
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
            self.stop_protocol(
                now,
                request,
                peer,
                ProtocolError::AuxTooLarge {
                    request,
                    len,
                    capacity,
                },
            );
            return;
        }
        if session.aux.as_ref().is_some_and(|known| *known != aux.data) {
            self.stop_protocol(now, request, peer, ProtocolError::AuxMismatch { request });
            return;
        }
        session.writers[w].aux = true;
        session.aux.get_or_insert(aux.data);
        self.note_progress(now, request);
        self.progress(now, request);
    }

    fn on_peer_cancel(&mut self, now: Instant, peer: PeerId, cancel: Cancel) {
        let request = cancel.request;
        if self.retired.contains(request) {
            self.shell.counters.duplicates += 1;
            return;
        }
        let Some(session) = self.sessions.get_mut(&request) else {
            // Not registered yet: remember it and cancel the registration when it comes.
            self.shell
                .remembered_cancels
                .insert(request, CancelOrigin::Peer(peer));
            return;
        };
        let Some(w) = session.writers.iter_mut().find(|w| w.peer == peer) else {
            self.shell.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "Cancel",
                    request,
                },
            );
            return;
        };
        // A sender sends Cancel only when none of its writes for the request is in flight.
        w.on(WriterEvent::Confirmed);
        if session.phase.is_active() {
            self.stop(now, request, Stop::Cancelled(CancelOrigin::Peer(peer)));
        } else {
            self.check_drained(now, request);
        }
    }

    fn on_disconnected(&mut self, now: Instant, peer: PeerId) -> Result<(), UsageError> {
        self.shell.peers.disconnected(peer)?;
        // The transport promises none of the peer's admitted writes still applies.
        for flight in self.writes.remove_peer(peer) {
            if let Some(s) = self.sessions.get_mut(&flight.request) {
                s.writes_in_flight = s.writes_in_flight.saturating_sub(1);
            }
        }
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
            let done = w.finished();
            w.on(WriterEvent::Disconnected);
            w.held.clear();
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

    fn fail_peer_sessions(&mut self, now: Instant, peer: PeerId, why: Stop) {
        let involved: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.phase.is_active() && s.writers.iter().any(|w| w.peer == peer && !w.finished())
            })
            .map(|(r, _)| *r)
            .collect();
        for request in involved {
            self.stop(now, request, why);
        }
    }

    /// The bytes writer `peer` must write into `request`'s registration: for every group it
    /// writes (its layers and heads overlap this rank's, and it is the replica this rank takes
    /// them from), the overlap's bytes for each registered block it sends (in a windowed
    /// group, those at or above the stale boundary of its window).
    fn writer_share(&self, request: RequestId, peer: PeerId) -> u64 {
        let (Some(session), Some(hello)) =
            (self.sessions.get(&request), self.shell.peers.remote(peer))
        else {
            return 0;
        };
        let local = &self.config.local;
        let prompt = session.frame.prompt_len;
        let mut total = 0u64;
        for (g, (run, dst)) in session.frame.groups.iter().zip(&local.groups).enumerate() {
            let Some(src) = hello.groups.get(g) else {
                continue;
            };
            if !writes_group(&hello.topology, src, &local.topology, dst) {
                continue;
            }
            let tpb = dst.tokens_per_block;
            let blocks = u64::from(total_blocks(prompt, tpb).unwrap_or(0));
            let stale = match src.window {
                Some(win) if win < prompt => {
                    u64::from(stale_boundary(prompt, win, tpb).unwrap_or(0))
                }
                _ => 0,
            };
            let first = u64::from(run.first_ordinal);
            let sent = (first + run.block_count())
                .min(blocks)
                .saturating_sub(first.max(stale));
            let overlap = |a: core::ops::Range<u32>, b: core::ops::Range<u32>| {
                u64::from(a.end.min(b.end).saturating_sub(a.start.max(b.start)))
            };
            let per_block = u64::from(dst.kv_factor)
                .saturating_mul(u64::from(tpb))
                .saturating_mul(u64::from(dst.head_dim))
                .saturating_mul(u64::from(dst.elem_bytes))
                .saturating_mul(overlap(src.layer_range(), dst.layer_range()))
                .saturating_mul(overlap(src.head_range(), dst.head_range()));
            total = total.saturating_add(sent.saturating_mul(per_block));
        }
        total
    }

    /// Something of the request arrived: the idle deadline restarts from `now`.
    fn note_progress(&mut self, now: Instant, request: RequestId) {
        let idle = self.config.deadlines.result_idle;
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        session.last_progress = Some(now);
        let due = session.result_deadline(idle);
        if session.result_armed.is_none_or(|armed| due < armed) {
            session.result_armed = Some(due);
            self.shell.timers.arm(due, TimerKey::Request(request));
        }
    }

    /// Completes the session when every writer's last result and the aux data arrived.
    fn progress(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        let all_done = session.writers.iter().all(|w| w.phase == WriterPhase::Done);
        if all_done && session.writes_in_flight > 0 {
            // Every writer reported its last result, yet bytes are still landing: they were
            // never reported.
            let writes = session.writes_in_flight;
            let peer = session.writers.first().map(|w| w.peer);
            if let Some(peer) = peer {
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::UnreportedWrites { request, writes },
                );
            }
            return;
        }
        let all_aux = session.writers.iter().all(|w| w.aux);
        let event = if all_done && all_aux {
            RecvEvent::Finished
        } else {
            RecvEvent::Progress
        };
        if all_done && !all_aux && session.aux_deadline.is_none() {
            let at = now + self.config.deadlines.aux_wait;
            session.aux_deadline = Some(at);
            self.shell.timers.arm(at, TimerKey::Request(request));
        }
        if let Transition::To(p) = session.phase.on(event) {
            session.phase = p;
            if p == RecvPhase::Completed {
                let bytes = session.bytes_written;
                let aux = session.aux.clone();
                session.timings.ended = now;
                let timings = session.timings;
                self.shell.counters.completions += 1;
                self.shell.counters.quiesced += 1;
                self.shell.counters.blocks_released += session.blocks_pinned;
                self.shell.event(Event::Completed {
                    request,
                    bytes_written: bytes,
                    aux,
                    timings,
                });
                self.shell.event(Event::Quiesced { request });
            }
        }
    }

    fn on_request_timeout(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if session.phase.is_active() {
            let all_done = session.writers.iter().all(|w| w.phase == WriterPhase::Done);
            let result_deadline = session.result_deadline(self.config.deadlines.result_idle);
            if !all_done && result_deadline <= now {
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
                session.result_armed = Some(result_deadline);
                Some(result_deadline)
            };
            self.shell.timers.arm_opt(next, TimerKey::Request(request));
        } else if session.phase == RecvPhase::Stopping {
            if session.quiesce_deadline.is_some_and(|at| at <= now) {
                let fence: Vec<PeerId> = session
                    .writers
                    .iter_mut()
                    .filter_map(|w| w.on(WriterEvent::FenceRequested).then_some(w.peer))
                    .collect();
                // Writes still landing from writers that did confirm are fenced too.
                let landing: Vec<PeerId> = if session.writes_in_flight > 0 {
                    session.writers.iter().map(|w| w.peer).collect()
                } else {
                    Vec::new()
                };
                for peer in fence.into_iter().chain(landing) {
                    self.shell.close(peer, CloseReason::QuiesceFence);
                }
            } else {
                self.shell
                    .timers
                    .arm_opt(session.quiesce_deadline, TimerKey::Request(request));
            }
        }
    }

    fn stop_protocol(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
        error: ProtocolError,
    ) {
        self.shell.violation(peer, error);
        self.stop(
            now,
            request,
            Stop::Failed {
                cause: TransferStatus::ProtocolError,
                peer: Some(peer),
                slice: None,
            },
        );
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
        let mut held = Vec::new();
        for w in session.writers.iter_mut() {
            held.extend(w.held.drain(..).map(|(_, frame)| (w.peer, frame)));
            if w.phase == WriterPhase::Unregistered {
                // The writer never got the grant: nothing of it can land, so it is not waited
                // for. It is still told (when connected), so that it stops computing and
                // pinning the request instead of waiting out its registration deadline.
                w.on(WriterEvent::SessionStopped);
                if self.shell.peers.is_ready(w.peer) {
                    notify.push(w.peer);
                }
            } else {
                // Every writer that got the registration hears of it, even one that already
                // sent its last result (it may still be waiting to send the aux data); only
                // those that have not stopped are waited for.
                notify.push(w.peer);
            }
        }
        self.shell.counters.failures.bump(status);
        match why {
            Stop::TimedOut(_) => self.shell.counters.timeouts += 1,
            Stop::Cancelled(_) => self.shell.counters.cancellations += 1,
            Stop::Failed { .. } => {}
        }
        self.shell.event(event);
        for peer in notify {
            self.shell
                .send(now, peer, Frame::Cancel(Cancel { request, reason }));
        }
        self.shell
            .timers
            .arm(quiesce_at, TimerKey::Request(request));
        // Frames that waited for data are the writers' word now (a terminal result confirms a
        // writer stopped); late data is discarded.
        for (peer, frame) in held {
            self.process_frame(now, peer, frame);
        }
        self.check_drained(now, request);
    }

    fn check_drained(&mut self, _now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if session.phase != RecvPhase::Stopping
            || session.writes_in_flight > 0
            || !session.writers.iter().all(|w| w.phase.has_stopped())
        {
            return;
        }
        if let Transition::To(p) = session.phase.on(RecvEvent::Drained) {
            session.phase = p;
            session.quiesce_deadline = None;
            self.shell.counters.quiesced += 1;
            self.shell.counters.blocks_released += session.blocks_pinned;
            self.shell.event(Event::Quiesced { request });
        }
    }
}

impl Endpoint for Receiver {
    fn role(&self) -> Role {
        Role::Receiver
    }

    fn handle_transport(&mut self, now: Instant, input: TransportInput) -> Result<(), UsageError> {
        Receiver::handle_transport(self, now, input)
    }

    fn admit_write(&mut self, now: Instant, peer: PeerId, header: &[u8]) -> Admission {
        Receiver::admit_write(self, now, peer, header)
    }

    fn poll_output(&mut self) -> Option<Output> {
        Receiver::poll_output(self)
    }

    fn poll_timeout(&mut self) -> Option<Instant> {
        Receiver::poll_timeout(self)
    }

    fn counters(&self) -> &Counters {
        Receiver::counters(self)
    }

    fn is_peer_ready(&self, peer: PeerId) -> bool {
        Receiver::is_peer_ready(self, peer)
    }

    fn frame_body_limit(&self, peer: PeerId) -> u32 {
        self.shell.peers.body_limit(peer)
    }

    fn peer_count(&self) -> usize {
        Receiver::peer_count(self)
    }

    fn session_count(&self) -> usize {
        Receiver::session_count(self)
    }
}

/// Bytes the aux data takes in the receiver's aux slot: two counts, two lengths and the tokens.
fn aux_encoded_len(data: &AuxData) -> u64 {
    16 + 4 * (data.first_tokens.len() as u64 + data.draft_tokens.len() as u64)
}
