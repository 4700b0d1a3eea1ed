//! The prefill-side endpoint.

use std::collections::BTreeMap;

use smallvec::SmallVec;

use super::config::SenderConfig;
use super::peers::Route;
use super::retired::Retired;
use super::shell::{Due, Shell};
use super::state::{SendEvent, SendPhase, TargetEvent, TargetPhase, Transition};
use super::timers::TimerKey;
use super::transport::{Admission, DataWriteHeaders, Endpoint, TransportInput, WriteRefusal};
use super::{
    frame_kind, BlockRunError, BlockRunFault, CancelOrigin, CloseReason, Counters, Event, Output,
    ProtocolError, RequestTimings, UsageError, Wait, WriteBatchId,
};
use crate::blocks::BlockRun;
use crate::config::{ConfigError, PipelineConfig};
use crate::geometry::{chunk_window, early_prefix_window, BlockWindow, ChunkSpec};
use crate::ids::{GroupIndex, PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::plan::{plan_rank_group, DstCursor, RankGroup, WritePlan};
use crate::source::BlockSource;
use crate::time::Instant;
use crate::wire::{
    AuxData, AuxResult, Cancel, CancelReason, Frame, KvResult, RecvRegistration, Role,
    TransferStatus, MAX_BODY_LEN,
};

/// One input to a [`Sender`]: everything that can change its state, as data, so a recorded list
/// of inputs replays into a fresh sender with the same outputs. Every input carries `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum SenderInput {
    /// What the transport saw (see [`TransportInput`]).
    Transport {
        /// Current time.
        now: Instant,
        /// The report.
        input: TransportInput,
    },
    /// The engine opens a request before its first chunk ([`Sender::open_request`]).
    Open {
        /// Current time.
        now: Instant,
        /// The request and its receivers.
        request: SendRequest,
    },
    /// The engine computed a prefill chunk; `runs` are the block source's answers for the
    /// chunk's block windows, one per group that sends something, in group order
    /// ([`Sender::submit_chunk`] queries the source and builds this input).
    Chunk {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
        /// The chunk.
        spec: ChunkSpec,
        /// The block source's runs.
        runs: Vec<(GroupIndex, BlockRun)>,
    },
    /// Before the first chunk: the engine sends the request's cached prefix early
    /// ([`Sender::submit_prefix`] queries the source and builds this input). Chunks then carry
    /// `prefix_sent_early` and skip those blocks.
    Prefix {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
        /// Tokens in the whole prompt.
        prompt_len: u32,
        /// Prefix tokens cached on the sender.
        prepopulated_len: u32,
        /// The block source's runs for the prefix's block windows, one per group that sends
        /// something, in group order.
        runs: Vec<(GroupIndex, BlockRun)>,
    },
    /// The engine's aux data for `request` (first tokens, draft tokens, counts).
    Aux {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
        /// The data.
        data: AuxData,
    },
    /// The engine cancels `request` (remembered if the request is not open yet).
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

/// A request the engine opens on the sender before submitting its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct SendRequest {
    /// The request.
    pub request: RequestId,
    /// The receivers (decode ranks) this rank writes the request to; each must send a
    /// registration.
    pub receivers: SmallVec<[PeerId; 2]>,
    /// Beams of the request; pipelined transfer needs 1 (checked when the request is opened).
    pub beam_width: u32,
}

impl SendRequest {
    /// A request written to `receivers`, with one beam.
    pub fn new(request: RequestId, receivers: impl IntoIterator<Item = PeerId>) -> Self {
        SendRequest {
            request,
            receivers: receivers.into_iter().collect(),
            beam_width: 1,
        }
    }
}

#[derive(Clone, Debug)]
struct Slice {
    id: SenderSliceId,
    is_last: bool,
    /// The chunk's block runs, kept until every receiver's registration planned them.
    runs: Vec<(GroupIndex, BlockRun)>,
    planned_by: usize,
}

#[derive(Clone, Copy, Debug, Default)]
struct TargetSlice {
    done: bool,
    bytes: u64,
    deadline: Option<Instant>,
}

/// One receiver of a request: its registration, where planning stopped, and its slices.
#[derive(Clone, Debug)]
struct Target {
    peer: PeerId,
    phase: TargetPhase,
    registration: Option<RecvRegistration>,
    /// Where planning stopped in each group's anchored run (successive chunks cost O(chunk)).
    cursors: SmallVec<[DstCursor; 2]>,
    slices: Vec<TargetSlice>,
    results_sent: usize,
    /// Write batches towards the receiver not reported yet.
    inflight: u32,
}

impl Target {
    fn new(peer: PeerId) -> Self {
        Target {
            peer,
            phase: TargetPhase::AwaitingRegistration,
            registration: None,
            cursors: SmallVec::new(),
            slices: Vec::new(),
            results_sent: 0,
            inflight: 0,
        }
    }

    fn receiver_slice(&self) -> Option<ReceiverSliceId> {
        self.registration.as_ref().map(|r| r.slice)
    }

    /// Moves the target's phase; an event its phase does not take changes nothing.
    fn on(&mut self, event: TargetEvent) -> bool {
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
struct SendSession {
    phase: SendPhase,
    targets: SmallVec<[Target; 2]>,
    slices: Vec<Slice>,
    next_start: Option<u32>,
    prompt_len: Option<u32>,
    /// The prefix length the first chunk (or the early prefix) declared; later chunks agree.
    prepopulated_len: Option<u32>,
    /// The cached prefix was sent before the first chunk.
    prefix_sent_early: bool,
    aux: Option<AuxData>,
    registration_deadline: Instant,
    aux_deadline: Option<Instant>,
    quiesce_deadline: Option<Instant>,
    /// Status carried by the terminal frames after a stop.
    stop_status: TransferStatus,
    stop_slice: Option<SenderSliceId>,
    bytes_written: u64,
    timings: RequestTimings,
    /// Blocks of the block runs of every slice, released (counted) when the session quiesces.
    blocks_pinned: u64,
}

/// Registrations that arrived before the engine opened their request, by request.
/// Registrations held for one request, from the peers that sent them, in arrival order.
type Held = SmallVec<[(PeerId, RecvRegistration); 1]>;

#[derive(Clone, Debug, Default)]
struct PendingRegistrations {
    /// Per request: when its first registration arrived, and the registrations.
    by_request: BTreeMap<RequestId, (Instant, Held)>,
    len: usize,
}

impl PendingRegistrations {
    /// Holds `reg`; returns true for the request's first registration (its deadline starts).
    fn push(&mut self, now: Instant, peer: PeerId, reg: RecvRegistration) -> bool {
        let mut first = false;
        let (_, list) = self.by_request.entry(reg.request).or_insert_with(|| {
            first = true;
            (now, SmallVec::new())
        });
        list.push((peer, reg));
        self.len += 1;
        first
    }

    /// Removes and returns the request's registrations, in arrival order.
    fn take(&mut self, request: RequestId) -> Held {
        let taken = self
            .by_request
            .remove(&request)
            .map(|(_, list)| list)
            .unwrap_or_default();
        self.len -= taken.len();
        taken
    }

    /// When the request's first held registration arrived.
    fn since(&self, request: RequestId) -> Option<Instant> {
        self.by_request.get(&request).map(|(at, _)| *at)
    }

    fn remove(&mut self, request: RequestId, peer: PeerId) {
        if let Some((_, list)) = self.by_request.get_mut(&request) {
            let before = list.len();
            list.retain(|(p, _)| *p != peer);
            self.len -= before - list.len();
            if list.is_empty() {
                self.by_request.remove(&request);
            }
        }
    }

    fn remove_peer(&mut self, peer: PeerId) {
        let mut removed = 0;
        self.by_request.retain(|_, (_, list)| {
            let before = list.len();
            list.retain(|(p, _)| *p != peer);
            removed += before - list.len();
            !list.is_empty()
        });
        self.len -= removed;
    }
}

#[derive(Clone, Copy, Debug)]
struct BatchRef {
    request: RequestId,
    target: usize,
    slice: usize,
}

/// When a write batch towards `peer` issued with deadline `issued_deadline` (issue time +
/// `write_completion`) is due: never before `write_completion` has passed with no batch towards
/// `peer` completing (`progress`: when one last did), so batches queued behind others on a slow
/// but moving link (a late registration's replay, a long prompt) are not failed while their
/// link works. A link that stops completing fails them `write_completion` after its last
/// completion.
fn write_deadline(
    progress: &BTreeMap<PeerId, Instant>,
    write_completion: crate::time::Duration,
    peer: PeerId,
    issued_deadline: Option<Instant>,
) -> Option<Instant> {
    let at = issued_deadline?;
    Some(match progress.get(&peer) {
        Some(&last) => at.max(last + write_completion),
        None => at,
    })
}

/// Why a session stops.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Failed {
        cause: TransferStatus,
        peer: Option<PeerId>,
        slice: Option<SenderSliceId>,
        receiver_slice: Option<ReceiverSliceId>,
    },
    TimedOut(Wait),
    Cancelled(CancelOrigin),
}

/// The prefill-side endpoint: one per prefill rank, holding a session per request.
///
/// # Contract
///
/// **Getters**: [`counters`](Self::counters), [`phase`](Self::phase),
/// [`session_count`](Self::session_count), [`peer_count`](Self::peer_count),
/// [`is_peer_ready`](Self::is_peer_ready), [`batches_in_flight`](Self::batches_in_flight),
/// [`pending_registration_count`](Self::pending_registration_count), [`config`](Self::config).
/// A leak check at the end of a run expects no session, batch or pending registration.
///
/// **Inputs** (each carries `now`): [`handle_input`](Self::handle_input) with a
/// [`SenderInput`] — what the transport saw ([`TransportInput`], also through the
/// [`Endpoint`] trait), and the engine's open, chunk, aux data, cancel and retire. Every state
/// change is one of these inputs, so [`record_inputs`](Self::record_inputs) captures a run that
/// replays exactly into a fresh sender.
///
/// **Commands** (sugar for inputs): [`open_request`](Self::open_request) (before the first
/// chunk; names the receivers), [`submit_chunk`](Self::submit_chunk) (queries the engine's
/// [`BlockSource`] for the chunk's bounded block windows, then applies
/// [`SenderInput::Chunk`]), [`submit_aux`](Self::submit_aux), [`cancel`](Self::cancel),
/// [`retire`](Self::retire).
///
/// **Outputs**: after every input, call [`poll_output`](Self::poll_output) until it returns
/// `None`, then [`poll_timeout`](Self::poll_timeout) and arm a timer for it. Outputs come out in
/// the order they were produced, which is causal: per (request, receiver) the
/// [`Output::ExecuteWrites`] of slices leave in slice order; the [`KvResult`] of slice `k` leaves
/// only after the transport reported slice `k`'s writes complete and after the results of every
/// earlier slice; the `is_last` result is followed by the aux data.
///
/// **Errors**: a method returns [`UsageError`] for a caller bug and changes nothing. A peer's
/// misbehaviour never returns an error: it fails the sessions involved (an
/// [`Event::Failed`] with [`TransferStatus::ProtocolError`]) or is reported as
/// [`Event::ProtocolViolation`].
///
/// **Memory**: a session pins the engine's blocks from [`open_request`](Self::open_request) to
/// [`Event::Quiesced`], which follows [`Event::Completed`] at once, and follows a failure,
/// timeout or cancel only once no write batch of the request is unreported (or its peer was
/// reported disconnected). If that takes longer than [`Deadlines::quiesce`](super::Deadlines),
/// the sender asks the transport to close the peer ([`Output::ClosePeer`]).
#[derive(Debug)]
pub struct Sender {
    config: SenderConfig,
    shell: Shell,
    sessions: BTreeMap<RequestId, SendSession>,
    pending_registrations: PendingRegistrations,
    retired: Retired<()>,
    batches: BTreeMap<WriteBatchId, BatchRef>,
    /// Per receiver, when a write batch towards it last completed: a link that keeps
    /// completing batches is moving, so its queued batches' deadlines follow it.
    link_progress: BTreeMap<PeerId, Instant>,
    next_batch: u64,
    plan_buffer: WritePlan,
    recorded: Option<Vec<SenderInput>>,
}

impl Sender {
    /// A sender with no peers and no sessions, or the first reason its configuration cannot
    /// run pipelined transfer.
    pub fn new(config: SenderConfig) -> Result<Self, ConfigError> {
        // The rank's own topology says how the prefill side is split by pipeline parallelism:
        // a setting of 1 does not override a topology of several stages.
        let stages = u32::from(config.local.topology.pp_size.max(1));
        PipelineConfig {
            sender_pp_size: config.pipeline.sender_pp_size.max(stages),
            ..config.pipeline
        }
        .validate()?;
        let hello = config.local.to_hello(Role::Sender);
        Ok(Sender {
            shell: Shell::new(hello, config.deadlines, config.max_remembered_cancels),
            sessions: BTreeMap::new(),
            pending_registrations: PendingRegistrations::default(),
            retired: Retired::new(config.retired_horizon, config.max_retired),
            batches: BTreeMap::new(),
            link_progress: BTreeMap::new(),
            next_batch: 0,
            plan_buffer: WritePlan::new(),
            recorded: None,
            config,
        })
    }

    // ----- getters -----

    /// The configuration.
    pub fn config(&self) -> &SenderConfig {
        &self.config
    }

    /// What the sender has done so far.
    pub fn counters(&self) -> &Counters {
        &self.shell.counters
    }

    /// The phase of `request`'s session: `None` if unknown, [`SendPhase::Retired`] if retired
    /// (and still remembered).
    pub fn phase(&self, request: RequestId) -> Option<SendPhase> {
        if let Some(s) = self.sessions.get(&request) {
            Some(s.phase)
        } else if self.retired.contains(request) {
            Some(SendPhase::Retired)
        } else {
            None
        }
    }

    /// The phase of `peer` within `request`'s session (`None`: no such session or receiver).
    pub fn target_phase(&self, request: RequestId, peer: PeerId) -> Option<TargetPhase> {
        let session = self.sessions.get(&request)?;
        session
            .targets
            .iter()
            .find(|t| t.peer == peer)
            .map(|t| t.phase)
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

    /// Write batches handed to the transport and not reported yet.
    pub fn batches_in_flight(&self) -> usize {
        self.batches.len()
    }

    /// Retired request ids remembered now (at most one horizon's retirements, see
    /// [`SenderConfig::retired_horizon`]).
    pub fn retired_count(&self) -> usize {
        self.retired.len()
    }

    /// Registrations held for requests the engine has not opened yet.
    pub fn pending_registration_count(&self) -> usize {
        self.pending_registrations.len
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
    pub fn take_recorded_inputs(&mut self) -> Vec<SenderInput> {
        self.recorded
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    // ----- commands -----

    /// Opens `req` before its first chunk (see [`SenderInput::Open`]). Registrations that
    /// arrived before are adopted now; a cancel that arrived before cancels it at once.
    pub fn open_request(&mut self, now: Instant, req: SendRequest) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Open { now, request: req })
    }

    /// Submits one computed prefill chunk of `request`. The sender asks `source` for the chunk's
    /// bounded block windows (only those) and applies [`SenderInput::Chunk`] with its answers:
    /// a slice is created and written to every receiver that has registered (the others get
    /// it, in order, when their registration arrives).
    ///
    /// Returns the slice's id, or `None` when the chunk completes no block (it sends nothing).
    pub fn submit_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Option<SenderSliceId>, UsageError> {
        // The checks and the block windows are computed once, here: the engine's answers are
        // applied without computing them again.
        let next_phase = self.check_chunk(request, &spec)?;
        let windows = self.chunk_windows(request, &spec)?;
        let mut runs = Vec::with_capacity(windows.len());
        for &(group, w) in &windows {
            let mut run = BlockRun::default();
            source
                .block_run(request, group, w.begin, w.end, &mut run)
                .map_err(|error| UsageError::BlockSource { request, error })?;
            runs.push((group, run));
        }
        let outcome = self.apply_chunk(now, request, spec, next_phase, &windows, runs.clone())?;
        self.record(SenderInput::Chunk {
            now,
            request,
            spec,
            runs,
        });
        outcome
    }

    /// Sends the request's cached prefix before its first chunk (see [`SenderInput::Prefix`]):
    /// the fully cached blocks `[0, prepopulated_len / tpb)` (from the stale boundary in a
    /// windowed group), so only the computed part waits for prefill. The request's chunks must
    /// then set [`ChunkSpec::prefix_sent_early`]. Returns the slice's id, or `None` when the
    /// prefix fills no whole block.
    pub fn submit_prefix(
        &mut self,
        now: Instant,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        source: &mut impl BlockSource,
    ) -> Result<Option<SenderSliceId>, UsageError> {
        let windows = self.check_prefix(request, prompt_len, prepopulated_len)?;
        let mut runs = Vec::with_capacity(windows.len());
        for (group, w) in windows {
            let mut run = BlockRun::default();
            source
                .block_run(request, group, w.begin, w.end, &mut run)
                .map_err(|error| UsageError::BlockSource { request, error })?;
            runs.push((group, run));
        }
        let outcome = self.on_prefix(now, request, prompt_len, prepopulated_len, runs.clone())?;
        self.record(SenderInput::Prefix {
            now,
            request,
            prompt_len,
            prepopulated_len,
            runs,
        });
        outcome
    }

    /// Submits the request's aux data (see [`SenderInput::Aux`]).
    pub fn submit_aux(
        &mut self,
        now: Instant,
        request: RequestId,
        data: AuxData,
    ) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Aux { now, request, data })
    }

    /// Cancels `request` (see [`SenderInput::Cancel`]).
    pub fn cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Cancel { now, request })
    }

    /// Retires `request` (see [`SenderInput::Retire`]).
    pub fn retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Retire { now, request })
    }

    // ----- inputs -----

    /// Applies one input. Returns a usage error, with nothing changed, for a caller bug.
    pub fn handle_input(&mut self, input: SenderInput) -> Result<(), UsageError> {
        let recorded = self.recorded.is_some().then(|| input.clone());
        match input {
            SenderInput::Transport { now, input } => self.on_transport(now, input),
            SenderInput::Open { now, request } => self.on_open(now, request),
            SenderInput::Chunk {
                now,
                request,
                spec,
                runs,
            } => self.on_chunk(now, request, spec, runs).map(|_| ()),
            // (An engine error inside `on_chunk` ended the session: the input was applied.)
            SenderInput::Prefix {
                now,
                request,
                prompt_len,
                prepopulated_len,
                runs,
            } => self
                .on_prefix(now, request, prompt_len, prepopulated_len, runs)
                .map(|_| ()),
            SenderInput::Aux { now, request, data } => self.on_aux_submitted(now, request, data),
            SenderInput::Cancel { now, request } => self.on_cancel(now, request),
            SenderInput::Retire { now, request } => self.on_retire(now, request),
        }?;
        if let Some(input) = recorded {
            self.record(input);
        }
        Ok(())
    }

    /// Applies what the transport saw (see [`SenderInput::Transport`]).
    pub fn handle_transport(
        &mut self,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Transport { now, input })
    }

    /// A sender accepts no data writes: the answer is always a refusal, and a connected peer
    /// that sends one is closed.
    pub fn admit_write(&mut self, now: Instant, peer: PeerId, header: &[u8]) -> Admission {
        let input = TransportInput::WriteArrived {
            peer,
            header: bytes::Bytes::copy_from_slice(header),
        };
        let _ = self.handle_transport(now, input);
        Admission::Refuse(WriteRefusal::NotAccepted)
    }

    // ----- internals -----

    fn record(&mut self, input: SenderInput) {
        if let Some(log) = &mut self.recorded {
            log.push(input);
        }
    }

    fn on_transport(&mut self, now: Instant, input: TransportInput) -> Result<(), UsageError> {
        match input {
            TransportInput::PeerConnected { peer } => self.shell.connected(now, peer),
            TransportInput::PeerDisconnected { peer } => self.on_disconnected(now, peer),
            TransportInput::FrameReceived { peer, bytes } => {
                match self.shell.frame(now, peer, &bytes)? {
                    Route::Session(frame) => self.on_session_frame(now, peer, frame),
                    Route::Malformed => self.fail_peer_sessions(
                        now,
                        peer,
                        Stop::Failed {
                            cause: TransferStatus::ProtocolError,
                            peer: Some(peer),
                            slice: None,
                            receiver_slice: None,
                        },
                    ),
                    Route::Done | Route::BecameReady => {}
                }
                Ok(())
            }
            TransportInput::WritesCompleted { batch } => {
                self.on_batch_report(now, batch, TransferStatus::Success)
            }
            TransportInput::WritesFailed { batch, status } => {
                if status == TransferStatus::Success {
                    return Err(UsageError::FailureWithSuccessStatus(batch));
                }
                self.on_batch_report(now, batch, status)
            }
            TransportInput::WriteArrived { peer, .. } => {
                self.refuse_write(peer);
                Ok(())
            }
            TransportInput::WriteFinished { .. } => Err(UsageError::WrongRole {
                input: "WriteFinished",
                role: Role::Sender,
            }),
            TransportInput::DataArriving { .. } => Err(UsageError::WrongRole {
                input: "DataArriving",
                role: Role::Sender,
            }),
            TransportInput::Timeout => {
                for due in self.shell.due(now) {
                    match due {
                        Due::Liveness(peer) => {
                            self.fail_peer_sessions(now, peer, Stop::TimedOut(Wait::Liveness))
                        }
                        Due::Request(request) => self.on_request_timeout(now, request),
                        // A session waits for its receiver's registration under its own
                        // deadline.
                        Due::Handshake(_) => {}
                    }
                }
                Ok(())
            }
        }
    }

    /// A data write towards a sender: a receiver never writes, so the peer is not trusted any
    /// more.
    fn refuse_write(&mut self, peer: PeerId) {
        if self.shell.peers.phase(peer).is_some() {
            self.shell.violation(
                peer,
                ProtocolError::UnexpectedFrame {
                    kind: "DataWrite",
                    role: Role::Sender,
                },
            );
            self.shell.close(peer, CloseReason::ProtocolViolation);
        }
    }

    fn on_open(&mut self, now: Instant, req: SendRequest) -> Result<(), UsageError> {
        let request = req.request;
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        if self.sessions.contains_key(&request) {
            return Err(UsageError::DuplicateRequest(request));
        }
        if req.receivers.is_empty() {
            return Err(UsageError::NoPeers(request));
        }
        let settings = PipelineConfig {
            beam_width: req.beam_width,
            ..self.config.pipeline
        };
        if let Err(error) = settings.validate() {
            return Err(UsageError::Unsupported { request, error });
        }
        for (i, p) in req.receivers.iter().enumerate() {
            if req.receivers[..i].contains(p) {
                return Err(UsageError::DuplicatePeer { request, peer: *p });
            }
        }
        let registration_deadline = now + self.config.deadlines.registration;
        self.sessions.insert(
            request,
            SendSession {
                phase: SendPhase::Streaming,
                targets: req.receivers.iter().map(|&p| Target::new(p)).collect(),
                slices: Vec::new(),
                next_start: None,
                prompt_len: None,
                prepopulated_len: None,
                prefix_sent_early: false,
                aux: None,
                registration_deadline,
                aux_deadline: None,
                quiesce_deadline: None,
                stop_status: TransferStatus::Success,
                stop_slice: None,
                bytes_written: 0,
                timings: RequestTimings {
                    started: now,
                    ended: now,
                    ..RequestTimings::default()
                },
                blocks_pinned: 0,
            },
        );
        self.shell
            .timers
            .arm(registration_deadline, TimerKey::Request(request));
        if let Some(origin) = self.shell.remembered_cancels.take(request) {
            self.pending_registrations.take(request);
            self.stop(now, request, Stop::Cancelled(origin));
            return Ok(());
        }
        for (peer, reg) in self.pending_registrations.take(request) {
            self.on_registration(now, peer, reg);
        }
        Ok(())
    }

    /// The checks on a chunk that need no block run; the state is not changed.
    fn check_chunk(&self, request: RequestId, spec: &ChunkSpec) -> Result<SendPhase, UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        let session = self
            .sessions
            .get(&request)
            .ok_or(UsageError::UnknownRequest(request))?;
        let event = if spec.is_last {
            SendEvent::LastChunk
        } else {
            SendEvent::Chunk
        };
        let next_phase = match session.phase.on(event) {
            Transition::To(p) => p,
            Transition::Ignored | Transition::Refused => {
                return Err(if session.phase == SendPhase::Finishing {
                    UsageError::ChunkAfterLast(request)
                } else {
                    UsageError::SessionEnded(request)
                });
            }
        };
        match session.next_start {
            Some(expected) if spec.start != expected => {
                return Err(UsageError::ChunkOutOfOrder {
                    request,
                    expected,
                    got: spec.start,
                });
            }
            // The first chunk starts where the cached prefix ends: one that starts later
            // leaves tokens no chunk sends, and the request would complete without them.
            None if spec.start > spec.prepopulated_len => {
                return Err(UsageError::FirstChunkAfterPrefix {
                    request,
                    start: spec.start,
                    prepopulated_len: spec.prepopulated_len,
                });
            }
            _ => {}
        }
        if let Some(expected) = session.prompt_len {
            if spec.prompt_len != expected {
                return Err(UsageError::PromptLenChanged {
                    request,
                    expected,
                    got: spec.prompt_len,
                });
            }
        }
        if spec.prefix_sent_early != session.prefix_sent_early {
            return Err(UsageError::EarlyPrefixMismatch {
                request,
                sent_early: session.prefix_sent_early,
            });
        }
        spec.validate()
            .map_err(|error| UsageError::Geometry { request, error })?;
        Ok(next_phase)
    }

    /// The checks on an early prefix that need no block run, and its block windows.
    fn check_prefix(
        &self,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
    ) -> Result<Vec<(GroupIndex, BlockWindow)>, UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        let session = self
            .sessions
            .get(&request)
            .ok_or(UsageError::UnknownRequest(request))?;
        if !session.phase.is_active() {
            return Err(UsageError::SessionEnded(request));
        }
        if session.next_start.is_some() || session.prefix_sent_early {
            return Err(UsageError::PrefixAfterChunks(request));
        }
        let mut windows = Vec::new();
        for (g, layout) in self.config.local.groups.iter().enumerate() {
            let window = early_prefix_window(prompt_len, prepopulated_len, layout)
                .map_err(|error| UsageError::Geometry { request, error })?;
            if let Some(w) = window {
                windows.push((GroupIndex(g as u16), w));
            }
        }
        Ok(windows)
    }

    /// Applies an early prefix (errors as in [`Self::on_chunk`]).
    fn on_prefix(
        &mut self,
        now: Instant,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Result<Option<SenderSliceId>, UsageError>, UsageError> {
        let windows = self.check_prefix(request, prompt_len, prepopulated_len)?;
        let given: Vec<GroupIndex> = runs.iter().map(|(g, _)| *g).collect();
        if given.len() != windows.len() || given.iter().zip(&windows).any(|(a, (b, _))| a != b) {
            return Err(UsageError::RunsDoNotMatchChunk {
                request,
                expected: windows.iter().map(|(g, _)| *g).collect(),
                given,
            });
        }
        for ((group, run), (_, asked)) in runs.iter().zip(&windows) {
            let layout = &self.config.local.groups[usize::from(group.0)];
            if let Some(error) = check_run(request, *group, *asked, run, layout, prompt_len) {
                self.fail_engine(now, request);
                return Ok(Err(UsageError::BlockRun(error)));
            }
        }
        let session = self.sessions.get_mut(&request).expect("checked above");
        session.prefix_sent_early = true;
        session.prompt_len = Some(prompt_len);
        session.prepopulated_len = Some(prepopulated_len);
        if runs.is_empty() {
            return Ok(Ok(None));
        }
        Ok(Ok(Some(self.add_slice(now, request, false, runs))))
    }

    /// Applies a chunk. The outer error is a usage error (nothing changed); the inner one an
    /// engine error that failed the session (the input was applied).
    fn on_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Result<Option<SenderSliceId>, UsageError>, UsageError> {
        let next_phase = self.check_chunk(request, &spec)?;
        let windows = self.chunk_windows(request, &spec)?;
        self.apply_chunk(now, request, spec, next_phase, &windows, runs)
    }

    /// The chunk's block window in each group that sends something, in group order.
    fn chunk_windows(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
    ) -> Result<SmallVec<[(GroupIndex, BlockWindow); 4]>, UsageError> {
        let mut windows = SmallVec::new();
        for (g, layout) in self.config.local.groups.iter().enumerate() {
            let window = chunk_window(spec, layout)
                .map_err(|error| UsageError::Geometry { request, error })?;
            if let Some(w) = window {
                windows.push((GroupIndex(g as u16), w));
            }
        }
        Ok(windows)
    }

    /// Applies a checked chunk whose block windows are `windows`: `runs` must answer exactly
    /// those, group by group (errors as in [`Self::on_chunk`]).
    fn apply_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        next_phase: SendPhase,
        windows: &[(GroupIndex, BlockWindow)],
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Result<Option<SenderSliceId>, UsageError>, UsageError> {
        let given: Vec<GroupIndex> = runs.iter().map(|(g, _)| *g).collect();
        if given.len() != windows.len() || given.iter().zip(windows).any(|(a, (b, _))| a != b) {
            return Err(UsageError::RunsDoNotMatchChunk {
                request,
                expected: windows.iter().map(|(g, _)| *g).collect(),
                given,
            });
        }
        // From here on the input is applied: an engine error fails the session.
        let session = self.sessions.get_mut(&request).expect("checked above");
        let mismatch = session.targets.iter().find_map(|t| {
            t.registration
                .as_ref()
                .filter(|reg| reg.prompt_len != spec.prompt_len)
                .map(|reg| (t.peer, reg.prompt_len))
        });
        if let Some((peer, registered)) = mismatch {
            self.shell.counters.protocol_errors += 1;
            self.stop_protocol(
                now,
                request,
                peer,
                ProtocolError::PromptLenMismatch {
                    request,
                    registered,
                    local: spec.prompt_len,
                },
            );
            return Ok(Err(UsageError::PromptLenDiffersFromRegistration {
                request,
                registered,
                local: spec.prompt_len,
            }));
        }
        let session = self.sessions.get_mut(&request).expect("checked above");
        if let Some(expected) = session.prepopulated_len {
            if spec.prepopulated_len != expected {
                self.fail_engine(now, request);
                return Ok(Err(UsageError::PrefixChanged {
                    request,
                    expected,
                    got: spec.prepopulated_len,
                }));
            }
        }
        for ((group, run), (_, asked)) in runs.iter().zip(windows) {
            let layout = &self.config.local.groups[usize::from(group.0)];
            if let Some(error) = check_run(request, *group, *asked, run, layout, spec.prompt_len) {
                self.fail_engine(now, request);
                return Ok(Err(UsageError::BlockRun(error)));
            }
        }
        let session = self.sessions.get_mut(&request).expect("checked above");
        session.next_start = Some(spec.end);
        session.prompt_len = Some(spec.prompt_len);
        session.prepopulated_len = Some(spec.prepopulated_len);
        session.timings.first_chunk.get_or_insert(now);
        if spec.is_last {
            session.timings.last_chunk = Some(now);
        }
        if runs.is_empty() && !spec.is_last {
            return Ok(Ok(None));
        }
        session.phase = next_phase;
        Ok(Ok(Some(self.add_slice(now, request, spec.is_last, runs))))
    }

    /// Creates a slice of the request from its block runs and writes it to every receiver that
    /// has registered.
    fn add_slice(
        &mut self,
        now: Instant,
        request: RequestId,
        is_last: bool,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> SenderSliceId {
        let session = self.sessions.get_mut(&request).expect("the caller checked");
        let id = SenderSliceId(session.slices.len() as u32);
        let blocks: u64 = runs.iter().map(|(_, run)| run.ids.len() as u64).sum();
        session.blocks_pinned += blocks;
        self.shell.counters.blocks_pinned += blocks;
        session.slices.push(Slice {
            id,
            is_last,
            runs,
            planned_by: 0,
        });
        self.shell.counters.slices += 1;
        if is_last && session.aux.is_none() {
            let at = now + self.config.deadlines.aux_wait;
            session.aux_deadline = Some(at);
            self.shell.timers.arm(at, TimerKey::Request(request));
        }
        for t in 0..session.targets.len() {
            self.issue_pending(now, request, t);
        }
        self.progress(now, request);
        id
    }

    /// The engine broke its contract for `request`: the KV cannot be trusted, so the request
    /// fails on both sides.
    fn fail_engine(&mut self, now: Instant, request: RequestId) {
        self.stop(
            now,
            request,
            Stop::Failed {
                cause: TransferStatus::EngineError,
                peer: None,
                slice: None,
                receiver_slice: None,
            },
        );
    }

    fn on_cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        match self.sessions.get(&request) {
            None => {
                self.shell
                    .remembered_cancels
                    .insert(request, CancelOrigin::Local);
                // Receivers that already registered learn at once.
                let waiting = self.pending_registrations.take(request);
                for (peer, _) in waiting {
                    let frame = Frame::Cancel(Cancel {
                        request,
                        reason: CancelReason::Engine,
                    });
                    self.shell.send(now, peer, frame);
                }
            }
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
        match s.phase.on(SendEvent::Retire) {
            Transition::To(_) => {
                self.sessions.remove(&request);
                self.retired.insert(now, request, ());
                self.shell.counters.retirements += 1;
                self.shell.counters.retired_forgotten_early = self.retired.forgotten_early();
                Ok(())
            }
            _ => Err(UsageError::NotQuiesced(request)),
        }
    }

    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        match frame {
            Frame::RecvRegistration(reg) => self.on_registration(now, peer, reg),
            Frame::Cancel(cancel) => self.on_peer_cancel(now, peer, cancel),
            other => self.shell.violation(
                peer,
                ProtocolError::UnexpectedFrame {
                    kind: frame_kind(&other),
                    role: Role::Sender,
                },
            ),
        }
    }

    fn on_registration(&mut self, now: Instant, peer: PeerId, reg: RecvRegistration) {
        let request = reg.request;
        let refuse = Frame::Cancel(Cancel {
            request,
            reason: CancelReason::Failure,
        });
        if self.retired.contains(request) {
            self.shell.send(now, peer, refuse);
            return;
        }
        let Some(session) = self.sessions.get_mut(&request) else {
            if self.shell.remembered_cancels.contains(request) {
                let frame = Frame::Cancel(Cancel {
                    request,
                    reason: CancelReason::Engine,
                });
                self.shell.send(now, peer, frame);
            } else if self.pending_registrations.len < self.config.max_pending_registrations {
                if self.pending_registrations.push(now, peer, reg) {
                    let at = now + self.config.deadlines.registration;
                    self.shell.timers.arm(at, TimerKey::Request(request));
                }
            } else {
                self.shell.send(now, peer, refuse);
            }
            return;
        };
        let Some(t) = session.targets.iter().position(|t| t.peer == peer) else {
            self.shell.send(now, peer, refuse);
            self.shell.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "RecvRegistration",
                    request,
                },
            );
            return;
        };
        if let Some(known) = &session.targets[t].registration {
            if *known == reg {
                self.shell.counters.duplicates += 1;
            } else {
                self.shell.counters.protocol_errors += 1;
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::DuplicateRegistration { request },
                );
            }
            return;
        }
        if !session.phase.is_active() {
            // The session ended before this receiver registered: nothing was or will be written.
            let target = &mut session.targets[t];
            if target.on(TargetEvent::TerminalSent) {
                let frame = Frame::Cancel(Cancel {
                    request,
                    reason: status_reason(session.stop_status),
                });
                self.shell.send(now, peer, frame);
            }
            return;
        }
        let expected = self.config.local.groups.len();
        if reg.groups.len() != expected {
            let got = reg.groups.len();
            self.adopt_registration(request, t, reg);
            self.shell.counters.protocol_errors += 1;
            self.stop_protocol(
                now,
                request,
                peer,
                ProtocolError::GroupCountMismatch {
                    request,
                    expected,
                    got,
                },
            );
            return;
        }
        if let Err(error) = super::check_registration_ordinals(
            request,
            reg.prompt_len,
            &reg.groups,
            &self.config.local.groups,
        ) {
            self.adopt_registration(request, t, reg);
            self.shell.counters.protocol_errors += 1;
            self.stop_protocol(now, request, peer, error);
            return;
        }
        let session = self.sessions.get_mut(&request).expect("checked above");
        if let Some(local) = session.prompt_len {
            if local != reg.prompt_len {
                let registered = reg.prompt_len;
                self.adopt_registration(request, t, reg);
                self.shell.counters.protocol_errors += 1;
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::PromptLenMismatch {
                        request,
                        registered,
                        local,
                    },
                );
                return;
            }
        }
        let receiver_slice = reg.slice;
        self.adopt_registration(request, t, reg);
        self.shell.event(Event::Registered {
            request,
            peer,
            receiver_slice,
        });
        self.issue_pending(now, request, t);
        self.progress(now, request);
    }

    fn adopt_registration(&mut self, request: RequestId, t: usize, reg: RecvRegistration) {
        if let Some(target) = self
            .sessions
            .get_mut(&request)
            .and_then(|s| s.targets.get_mut(t))
        {
            target.registration = Some(reg);
            target.on(TargetEvent::Registered);
        }
    }

    /// Plans and hands to the transport every slice target `t` has not been given yet, in order.
    fn issue_pending(&mut self, now: Instant, request: RequestId, t: usize) {
        loop {
            let Some(session) = self.sessions.get_mut(&request) else {
                return;
            };
            if !session.phase.is_active() {
                return;
            }
            let target = &mut session.targets[t];
            let Some(reg) = &target.registration else {
                return;
            };
            let k = target.slices.len();
            if k >= session.slices.len() {
                return;
            }
            let peer = target.peer;
            let (Some(remote), Some(version)) = (
                self.shell.peers.remote(peer),
                self.shell.peers.version(peer),
            ) else {
                return;
            };
            let slice = &session.slices[k];
            let plan = &mut self.plan_buffer;
            plan.clear();
            let mut error = None;
            let groups = self.config.local.groups.len();
            target.cursors.resize(groups, DstCursor::default());
            for (group, run) in &slice.runs {
                let g = usize::from(group.0);
                // Group counts were checked against the layout at the handshake and at the
                // registration; a miss here is reported, never indexed.
                let (Some(src), Some(dst), Some(dst_run), Some(cursor)) = (
                    self.config.local.groups.get(g),
                    remote.groups.get(g),
                    reg.groups.get(g),
                    target.cursors.get_mut(g),
                ) else {
                    error = Some(ProtocolError::GroupCountMismatch {
                        request,
                        expected: groups,
                        got: reg.groups.len().min(remote.groups.len()),
                    });
                    break;
                };
                let src = RankGroup {
                    topology: &self.config.local.topology,
                    layout: src,
                };
                let dst = RankGroup {
                    topology: &remote.topology,
                    layout: dst,
                };
                if let Err(e) = plan_rank_group(src, dst, run, dst_run, cursor, plan) {
                    error = Some(ProtocolError::Unplannable { request, error: e });
                    break;
                }
            }
            if let Some(error) = error {
                self.shell.counters.protocol_errors += 1;
                // Attributed to the slice being planned, on both sides.
                let slice = self
                    .sessions
                    .get(&request)
                    .and_then(|s| s.slices.get(k))
                    .map(|s| s.id);
                self.stop_protocol_at(now, request, peer, error, slice);
                return;
            }
            let slice_id = slice.id;
            let grant = reg.grant;
            let bytes = plan.total_bytes();
            let session = self.sessions.get_mut(&request).expect("present");
            let slice = &mut session.slices[k];
            slice.planned_by += 1;
            if slice.planned_by >= session.targets.len() {
                // Every receiver has its plan: the block runs are no longer needed.
                slice.runs = Vec::new();
            }
            let target = &mut session.targets[t];
            if self.plan_buffer.is_empty() {
                target.slices.push(TargetSlice {
                    done: true,
                    bytes: 0,
                    deadline: None,
                });
                continue;
            }
            let batch = WriteBatchId(self.next_batch);
            self.next_batch += 1;
            let deadline = now + self.config.deadlines.write_completion;
            target.slices.push(TargetSlice {
                done: false,
                bytes,
                deadline: Some(deadline),
            });
            target.inflight += 1;
            session.timings.first_byte.get_or_insert(now);
            session.timings.writes += 1;
            self.batches.insert(
                batch,
                BatchRef {
                    request,
                    target: t,
                    slice: k,
                },
            );
            self.shell.counters.bytes_planned += bytes;
            self.shell.counters.write_batches += 1;
            self.shell.timers.arm(deadline, TimerKey::Request(request));
            self.shell.outputs.push_back(Output::ExecuteWrites {
                peer,
                batch,
                request,
                slice: slice_id,
                grant,
                plan: self.plan_buffer.clone(),
                headers: DataWriteHeaders {
                    version,
                    request,
                    grant,
                },
            });
        }
    }

    /// Sends every result that may leave now, in slice order, then the aux data; completes the
    /// session when everything went out.
    fn progress(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if !session.phase.is_active() {
            return;
        }
        let mut frames: Vec<(PeerId, Frame)> = Vec::new();
        for target in session.targets.iter_mut() {
            if !matches!(
                target.phase,
                TargetPhase::Streaming | TargetPhase::AwaitingAux
            ) {
                continue;
            }
            let Some(reg) = &target.registration else {
                continue;
            };
            let receiver_slice = reg.slice;
            while target.results_sent < target.slices.len()
                && target.slices[target.results_sent].done
            {
                let k = target.results_sent;
                let slice = &session.slices[k];
                let ts = target.slices[k];
                frames.push((
                    target.peer,
                    Frame::KvResult(KvResult {
                        request,
                        sender_slice: slice.id,
                        receiver_slice,
                        is_last: slice.is_last,
                        status: TransferStatus::Success,
                        bytes_written: ts.bytes,
                    }),
                ));
                target.results_sent += 1;
                if slice.is_last {
                    target.on(TargetEvent::LastResultSent);
                }
            }
            if target.phase == TargetPhase::AwaitingAux {
                if let Some(aux) = &session.aux {
                    frames.push((
                        target.peer,
                        Frame::AuxResult(AuxResult {
                            request,
                            status: TransferStatus::Success,
                            data: aux.clone(),
                        }),
                    ));
                    target.on(TargetEvent::Finished);
                }
            }
        }
        let finished = session.targets.iter().all(|t| t.phase.is_finished());
        let bytes = session.bytes_written;
        session.timings.ended = now;
        let timings = session.timings;
        let blocks_pinned = session.blocks_pinned;
        let mut transition = None;
        if finished {
            if let Transition::To(p) = session.phase.on(SendEvent::Finished) {
                session.phase = p;
                transition = Some(p);
            }
        }
        self.send_frames(now, frames);
        if transition == Some(SendPhase::Completed) {
            self.shell.counters.completions += 1;
            self.shell.counters.quiesced += 1;
            self.shell.counters.blocks_released += blocks_pinned;
            self.shell.event(Event::Completed {
                request,
                bytes_written: bytes,
                aux: None,
                timings,
            });
            self.shell.event(Event::Quiesced { request });
        }
    }

    fn send_frames(&mut self, now: Instant, frames: Vec<(PeerId, Frame)>) {
        for (peer, frame) in frames {
            if let Frame::KvResult(r) = &frame {
                self.shell.counters.results.bump(r.status);
            }
            self.shell.send(now, peer, frame);
        }
    }

    fn on_batch_report(
        &mut self,
        now: Instant,
        batch: WriteBatchId,
        status: TransferStatus,
    ) -> Result<(), UsageError> {
        let Some(r) = self.batches.remove(&batch) else {
            if batch.0 < self.next_batch {
                // Issued, and forgotten when its peer disconnected: a late report is harmless.
                return Ok(());
            }
            return Err(UsageError::UnknownBatch(batch));
        };
        let Some(session) = self.sessions.get_mut(&r.request) else {
            return Ok(());
        };
        let target = &mut session.targets[r.target];
        target.inflight = target.inflight.saturating_sub(1);
        let peer = target.peer;
        let receiver_slice = target.receiver_slice();
        let ts = &mut target.slices[r.slice];
        ts.deadline = None;
        if status == TransferStatus::Success {
            let last = self.link_progress.entry(peer).or_insert(now);
            *last = (*last).max(now);
            ts.done = true;
            let bytes = ts.bytes;
            session.bytes_written += bytes;
            session.timings.last_byte = Some(now);
            self.shell.counters.bytes_written += bytes;
            if session.phase.is_active() {
                self.progress(now, r.request);
            } else {
                self.check_drained(now, r.request);
            }
        } else if session.phase.is_active() {
            let slice = session.slices[r.slice].id;
            self.stop(
                now,
                r.request,
                Stop::Failed {
                    cause: status,
                    peer: Some(peer),
                    slice: Some(slice),
                    receiver_slice,
                },
            );
        } else {
            self.check_drained(now, r.request);
        }
        Ok(())
    }

    fn on_aux_submitted(
        &mut self,
        now: Instant,
        request: RequestId,
        data: AuxData,
    ) -> Result<(), UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        let session = self
            .sessions
            .get_mut(&request)
            .ok_or(UsageError::UnknownRequest(request))?;
        if session.aux.is_some() {
            return Err(UsageError::AuxAlreadySubmitted(request));
        }
        if !session.phase.is_active() {
            return Err(UsageError::SessionEnded(request));
        }
        let frame = Frame::AuxResult(AuxResult {
            request,
            status: TransferStatus::Success,
            data,
        });
        let len = frame.body_len() as u64;
        if len > u64::from(MAX_BODY_LEN) {
            return Err(UsageError::AuxTooLarge {
                request,
                len,
                max: u64::from(MAX_BODY_LEN),
            });
        }
        let Frame::AuxResult(AuxResult { data, .. }) = frame else {
            unreachable!("built above")
        };
        session.aux = Some(data);
        session.aux_deadline = None;
        self.progress(now, request);
        Ok(())
    }

    fn on_peer_cancel(&mut self, now: Instant, peer: PeerId, cancel: Cancel) {
        let request = cancel.request;
        let confirm = Frame::Cancel(Cancel {
            request,
            reason: cancel.reason,
        });
        if self.retired.contains(request) {
            // Nothing of a retired request is in flight: confirm at once.
            self.shell.send(now, peer, confirm);
            return;
        }
        let Some(session) = self.sessions.get_mut(&request) else {
            // Not opened yet: nothing is in flight. Confirm, and cancel it when it opens.
            self.shell
                .remembered_cancels
                .insert(request, CancelOrigin::Peer(peer));
            self.pending_registrations.remove(request, peer);
            self.shell.send(now, peer, confirm);
            return;
        };
        if !session.targets.iter().any(|t| t.peer == peer) {
            self.shell.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "Cancel",
                    request,
                },
            );
            return;
        }
        if session.phase.is_active() {
            self.stop(now, request, Stop::Cancelled(CancelOrigin::Peer(peer)));
        } else {
            self.check_drained(now, request);
        }
    }

    fn on_disconnected(&mut self, now: Instant, peer: PeerId) -> Result<(), UsageError> {
        self.shell.peers.disconnected(peer)?;
        self.pending_registrations.remove_peer(peer);
        self.link_progress.remove(&peer);
        // Batches towards the peer can no longer touch memory.
        let sessions = &self.sessions;
        self.batches.retain(|_, r| {
            sessions
                .get(&r.request)
                .is_none_or(|s| s.targets[r.target].peer != peer)
        });
        let involved: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.targets.iter().any(|t| t.peer == peer))
            .map(|(r, _)| *r)
            .collect();
        for request in involved {
            let session = self.sessions.get_mut(&request).expect("listed");
            let target = session
                .targets
                .iter_mut()
                .find(|t| t.peer == peer)
                .expect("listed");
            let finished_here = target.phase.is_finished();
            target.on(TargetEvent::Disconnected);
            target.inflight = 0;
            for ts in &mut target.slices {
                ts.deadline = None;
            }
            let receiver_slice = target.receiver_slice();
            if session.phase.is_active() && !finished_here {
                self.stop(
                    now,
                    request,
                    Stop::Failed {
                        cause: TransferStatus::PeerLost,
                        peer: Some(peer),
                        slice: None,
                        receiver_slice,
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
                s.phase.is_active()
                    && s.targets
                        .iter()
                        .any(|t| t.peer == peer && !t.phase.is_finished())
            })
            .map(|(r, _)| *r)
            .collect();
        for request in involved {
            let why = match why {
                Stop::Failed {
                    cause,
                    peer,
                    slice,
                    receiver_slice: None,
                } => Stop::Failed {
                    cause,
                    peer,
                    slice,
                    receiver_slice: self.sessions.get(&request).and_then(|s| {
                        s.targets
                            .iter()
                            .find(|t| Some(t.peer) == peer)
                            .and_then(Target::receiver_slice)
                    }),
                },
                other => other,
            };
            self.stop(now, request, why);
        }
    }

    fn on_request_timeout(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            // Registrations held for a request the engine never opened: after the registration
            // deadline nobody will write them; their receivers learn at once.
            let expired = self
                .pending_registrations
                .since(request)
                .is_some_and(|at| at + self.config.deadlines.registration <= now);
            if expired {
                for (peer, _) in self.pending_registrations.take(request) {
                    let frame = Frame::Cancel(Cancel {
                        request,
                        reason: CancelReason::Timeout,
                    });
                    self.shell.send(now, peer, frame);
                }
            }
            return;
        };
        if session.phase.is_active() {
            let (progress, wc) = (&self.link_progress, self.config.deadlines.write_completion);
            let write_due = session.targets.iter().any(|t| {
                t.slices.iter().any(|ts| {
                    write_deadline(progress, wc, t.peer, ts.deadline).is_some_and(|at| at <= now)
                })
            });
            if write_due {
                self.stop(now, request, Stop::TimedOut(Wait::Writes));
                return;
            }
            let unregistered = session
                .targets
                .iter()
                .any(|t| t.phase == TargetPhase::AwaitingRegistration);
            if unregistered && session.registration_deadline <= now {
                self.stop(now, request, Stop::TimedOut(Wait::Registration));
                return;
            }
            if session.aux_deadline.is_some_and(|at| at <= now) {
                self.stop(now, request, Stop::TimedOut(Wait::Aux));
                return;
            }
        } else if session.phase == SendPhase::Stopping
            && session.quiesce_deadline.is_some_and(|at| at <= now)
        {
            let fence: Vec<PeerId> = session
                .targets
                .iter_mut()
                .filter(|t| t.inflight > 0)
                .filter_map(|t| t.on(TargetEvent::FenceRequested).then_some(t.peer))
                .collect();
            for peer in fence {
                self.shell.close(peer, CloseReason::QuiesceFence);
            }
            return;
        }
        self.rearm(request);
    }

    /// Arms the session's earliest pending deadline.
    fn rearm(&mut self, request: RequestId) {
        let Some(session) = self.sessions.get(&request) else {
            return;
        };
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n: Instant| n.min(at)));
            }
        };
        if session.phase.is_active() {
            for t in &session.targets {
                for ts in &t.slices {
                    consider(write_deadline(
                        &self.link_progress,
                        self.config.deadlines.write_completion,
                        t.peer,
                        ts.deadline,
                    ));
                }
            }
            if session
                .targets
                .iter()
                .any(|t| t.phase == TargetPhase::AwaitingRegistration)
            {
                consider(Some(session.registration_deadline));
            }
            consider(session.aux_deadline);
        } else if session.phase == SendPhase::Stopping {
            consider(session.quiesce_deadline);
        }
        self.shell.timers.arm_opt(next, TimerKey::Request(request));
    }

    fn stop_protocol(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
        error: ProtocolError,
    ) {
        self.stop_protocol_at(now, request, peer, error, None);
    }

    /// Fails the session for a peer's protocol error, attributed to `slice` when one is known.
    fn stop_protocol_at(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
        error: ProtocolError,
        slice: Option<SenderSliceId>,
    ) {
        let receiver_slice = self.sessions.get(&request).and_then(|s| {
            s.targets
                .iter()
                .find(|t| t.peer == peer)
                .and_then(Target::receiver_slice)
        });
        self.shell.event(Event::ProtocolViolation { peer, error });
        self.stop(
            now,
            request,
            Stop::Failed {
                cause: TransferStatus::ProtocolError,
                peer: Some(peer),
                slice,
                receiver_slice,
            },
        );
    }

    /// Ends an active session: reports it, tells every receiver at once, and waits for the
    /// in-flight writes before [`Event::Quiesced`].
    fn stop(&mut self, now: Instant, request: RequestId, why: Stop) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        let Transition::To(phase) = session.phase.on(SendEvent::Stop) else {
            return;
        };
        session.phase = phase;
        let (status, event) = match why {
            Stop::Failed {
                cause,
                peer,
                slice,
                receiver_slice,
            } => {
                session.stop_slice = slice;
                (
                    cause,
                    Event::Failed {
                        request,
                        cause,
                        peer,
                        sender_slice: slice,
                        receiver_slice,
                    },
                )
            }
            Stop::TimedOut(wait) => (
                if wait == Wait::Writes {
                    TransferStatus::InDoubt
                } else {
                    TransferStatus::TimedOut
                },
                Event::TimedOut {
                    request,
                    waiting_for: wait,
                },
            ),
            Stop::Cancelled(origin) => (
                TransferStatus::Cancelled,
                Event::Cancelled { request, origin },
            ),
        };
        session.stop_status = status;
        // The slice the failure is attributed to, named the same on both sides (none when the
        // failure is not a slice's).
        let failed_slice = session.stop_slice.unwrap_or(SenderSliceId::NONE);
        let quiesce_at = now + self.config.deadlines.quiesce;
        session.quiesce_deadline = Some(quiesce_at);
        let mut frames = Vec::new();
        for target in session.targets.iter_mut() {
            for ts in &mut target.slices {
                ts.deadline = None;
            }
            if !target.on(TargetEvent::SessionStopped) {
                continue;
            }
            match target.receiver_slice() {
                Some(receiver_slice) => {
                    let is_last = target.inflight == 0;
                    if is_last {
                        target.on(TargetEvent::TerminalSent);
                    }
                    frames.push((
                        target.peer,
                        Frame::KvResult(KvResult {
                            request,
                            sender_slice: failed_slice,
                            receiver_slice,
                            is_last,
                            status,
                            bytes_written: 0,
                        }),
                    ));
                }
                None => {
                    target.on(TargetEvent::TerminalSent);
                    frames.push((
                        target.peer,
                        Frame::Cancel(Cancel {
                            request,
                            reason: status_reason(status),
                        }),
                    ));
                }
            }
        }
        self.shell.counters.failures.bump(status);
        match why {
            Stop::TimedOut(_) => self.shell.counters.timeouts += 1,
            Stop::Cancelled(_) => self.shell.counters.cancellations += 1,
            Stop::Failed { .. } => {}
        }
        self.shell.event(event);
        self.send_frames(now, frames);
        self.shell
            .timers
            .arm(quiesce_at, TimerKey::Request(request));
        self.check_drained(now, request);
    }

    /// In a stopping session: sends each receiver's terminal result once its writes drained, and
    /// quiesces the session once no write is in flight.
    fn check_drained(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.get_mut(&request) else {
            return;
        };
        if session.phase != SendPhase::Stopping {
            return;
        }
        let status = session.stop_status;
        // The slice the failure is attributed to, named the same on both sides (none when the
        // failure is not a slice's).
        let failed_slice = session.stop_slice.unwrap_or(SenderSliceId::NONE);
        let mut frames = Vec::new();
        for target in session.targets.iter_mut() {
            if target.inflight > 0
                || !matches!(target.phase, TargetPhase::Draining | TargetPhase::Fencing)
            {
                continue;
            }
            target.on(TargetEvent::TerminalSent);
            let frame = match target.receiver_slice() {
                Some(receiver_slice) => Frame::KvResult(KvResult {
                    request,
                    sender_slice: failed_slice,
                    receiver_slice,
                    is_last: true,
                    status,
                    bytes_written: 0,
                }),
                None => Frame::Cancel(Cancel {
                    request,
                    reason: status_reason(status),
                }),
            };
            frames.push((target.peer, frame));
        }
        let drained = session.targets.iter().all(|t| t.inflight == 0);
        let blocks_pinned = session.blocks_pinned;
        let mut quiesced = false;
        if drained {
            if let Transition::To(p) = session.phase.on(SendEvent::Drained) {
                session.phase = p;
                session.quiesce_deadline = None;
                quiesced = true;
            }
        }
        self.send_frames(now, frames);
        if quiesced {
            self.shell.counters.quiesced += 1;
            self.shell.counters.blocks_released += blocks_pinned;
            self.shell.event(Event::Quiesced { request });
        }
    }
}

impl Endpoint for Sender {
    fn role(&self) -> Role {
        Role::Sender
    }

    fn handle_transport(&mut self, now: Instant, input: TransportInput) -> Result<(), UsageError> {
        Sender::handle_transport(self, now, input)
    }

    fn admit_write(&mut self, now: Instant, peer: PeerId, header: &[u8]) -> Admission {
        Sender::admit_write(self, now, peer, header)
    }

    fn poll_output(&mut self) -> Option<Output> {
        Sender::poll_output(self)
    }

    fn poll_timeout(&mut self) -> Option<Instant> {
        Sender::poll_timeout(self)
    }

    fn counters(&self) -> &Counters {
        Sender::counters(self)
    }

    fn is_peer_ready(&self, peer: PeerId) -> bool {
        Sender::is_peer_ready(self, peer)
    }

    fn frame_body_limit(&self, peer: PeerId) -> u32 {
        self.shell.peers.body_limit(peer)
    }

    fn peer_count(&self) -> usize {
        Sender::peer_count(self)
    }

    fn session_count(&self) -> usize {
        Sender::session_count(self)
    }
}

/// Checks one group's block run against the bounded block-source contract: it ends exactly at
/// the asked end, is never longer than asked, and is shorter only in a windowed group (whose
/// evicted head the contract allows).
fn check_run(
    request: RequestId,
    group: GroupIndex,
    asked: BlockWindow,
    run: &BlockRun,
    layout: &crate::layout::LayerGroupLayout,
    prompt_len: u32,
) -> Option<BlockRunError> {
    let len = u32::try_from(run.ids.len()).unwrap_or(u32::MAX);
    let returned = BlockWindow {
        begin: run.first_ordinal,
        end: run.first_ordinal.saturating_add(len),
    };
    let fault = if len > asked.len() {
        BlockRunFault::TooLong
    } else if returned.end != asked.end || run.first_ordinal.checked_add(len).is_none() {
        BlockRunFault::WrongEnd
    } else if len < asked.len() && !layout.is_windowed_for(prompt_len) {
        BlockRunFault::TooShort
    } else {
        return None;
    };
    Some(BlockRunError {
        request,
        group,
        asked,
        returned,
        fault,
    })
}

/// The cancel reason that carries `status` to a peer that has no registration to name.
fn status_reason(status: TransferStatus) -> CancelReason {
    match status {
        TransferStatus::Cancelled => CancelReason::Engine,
        TransferStatus::TimedOut | TransferStatus::InDoubt => CancelReason::Timeout,
        _ => CancelReason::Failure,
    }
}
