//! The prefill-side endpoint, split by concern: the [`Sender`] type with its own getters and
//! input dispatch here; the engine's submissions ([`submit`]), chunk intake ([`intake`]), layer
//! ranges ([`layers`]), issue and planning ([`issue`]), results ([`results`]) and stop/quiesce
//! ([`stop`], the sender's part of the shared session frame) in their own files, each an
//! `impl Sender` block over the state defined here. What both endpoints share is written once
//! in the parent module (`surface.rs`, `role.rs`, `table.rs`, `stop.rs`, `shell.rs`).

mod intake;
mod issue;
mod layers;
mod results;
mod session;
mod stop;
mod submit;

use std::collections::BTreeMap;

pub use submit::{ChunkQuery, Submitted};

use session::{
    BatchRef, PendingRegistrations, SendSession, Slice, SliceLayers, Target, TargetSlice,
};

use smallvec::SmallVec;

use super::config::SenderConfig;
use super::role::EndpointRole;
use super::shell::Shell;
use super::state::{SendEvent, SendPhase, TargetEvent, TargetPhase, Transition};
use super::stop::Stop;
use super::surface::{endpoint_surface, InputLog};
use super::table::{named_twice, CancelStep, HeldSession, SessionTable};
use super::timers::TimerKey;
use super::transport::{Admission, DataWriteHeaders, Endpoint, TransportInput, WriteRefusal};
use super::{
    check_registration_ordinals, frame_kind, oversized, BlockRunError, BlockRunFault, CancelOrigin,
    CloseReason, Counters, EngineFault, Event, Output, ProtocolError, RequestTimings, UsageError,
    Wait, WriteBatchId,
};
use crate::blocks::BlockRun;
use crate::config::{ConfigError, PipelineConfig};
use crate::geometry::{chunk_window, early_prefix_window, BlockWindow, ChunkSpec, GeometryError};
use crate::ids::{GroupIndex, PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::layers::{LayerOrder, LayerRange};
use crate::layout::LayerGroupLayout;
use crate::plan::{plan_rank_group, plan_rank_group_layers, DstCursor, RankGroup, WritePlan};
use crate::source::BlockSource;
use crate::time::Instant;
use crate::wire::{
    AuxData, AuxResult, Cancel, CancelReason, DataWrite, Frame, KvResult, RecvRegistration, Role,
    TransferStatus,
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
    /// One layer range of a prefill chunk ([`Sender::submit_chunk_layers`]; see
    /// [`crate::layers`]). The chunk's first range carries the block source's runs for the
    /// chunk's windows, as [`SenderInput::Chunk`] does; its later ranges carry none (they
    /// write the first range's blocks).
    ChunkLayers {
        /// Current time.
        now: Instant,
        /// The request.
        request: RequestId,
        /// The chunk (the same for every range of it).
        spec: ChunkSpec,
        /// The rank's layers this range covers.
        layers: LayerRange,
        /// The block source's runs (the first range), or none (a later range).
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
    /// The engine's aux data for `request` (first tokens, draft tokens, counts). At or after
    /// the request's aux deadline it is late: the deadline is applied first, as the input
    /// [`TransportInput::Timeout`] at `now` (recorded as such), and the aux data then finds the
    /// session ended (see [`Sender::submit_aux`]).
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

/// The prefill-side endpoint: one per prefill rank, holding a session per request.
///
/// # Contract
///
/// **Getters**: [`counters`](Self::counters), [`phase`](Self::phase),
/// [`session_count`](Self::session_count), [`peer_count`](Self::peer_count),
/// [`is_peer_ready`](Self::is_peer_ready), [`batches_in_flight`](Self::batches_in_flight),
/// [`pending_registration_count`](Self::pending_registration_count), [`config`](Self::config),
/// [`layer_count`](Self::layer_count), [`next_chunk_layer`](Self::next_chunk_layer).
/// A leak check at the end of a run expects no session, batch or pending registration.
///
/// **Inputs** (each carries `now`): [`handle_input`](Self::handle_input) with a
/// [`SenderInput`] — what the transport saw ([`TransportInput`], also through the
/// [`Endpoint`] trait), and the engine's open, chunk (whole, [`SenderInput::Chunk`], or one
/// layer range of it, [`SenderInput::ChunkLayers`]), aux data, cancel and retire. Every state
/// change is one of these inputs, so [`record_inputs`](Self::record_inputs) captures a run that
/// replays exactly into a fresh sender.
///
/// **Commands** (sugar for inputs): [`open_request`](Self::open_request) (before the first
/// chunk; names the receivers), [`submit_chunk`](Self::submit_chunk) (queries the engine's
/// [`BlockSource`] for the chunk's bounded block windows, then applies
/// [`SenderInput::Chunk`]), [`submit_chunk_layers`](Self::submit_chunk_layers) (one layer
/// range of a chunk, as the engine finishes those layers; [`SenderInput::ChunkLayers`]: only a
/// chunk's first range queries the source, see [`crate::layers`]),
/// [`submit_aux`](Self::submit_aux), [`cancel`](Self::cancel), [`retire`](Self::retire). A
/// driver that queries the engine's block source without holding the sender uses the pairs
/// [`chunk_query`](Self::chunk_query) → [`ChunkQuery::ask`] →
/// [`submit_chunk_runs`](Self::submit_chunk_runs) and
/// [`chunk_layers_query`](Self::chunk_layers_query) → [`ChunkQuery::ask`] →
/// [`submit_chunk_layers_runs`](Self::submit_chunk_layers_runs).
///
/// **Outputs**: after every input, call [`poll_output`](Self::poll_output) until it returns
/// `None`, then [`poll_timeout`](Self::poll_timeout) and arm a timer for it. Outputs come out in
/// the order they were produced, which is causal: per (request, receiver) the
/// [`Output::ExecuteWrites`] of slices leave in slice order; the [`KvResult`] of slice `k` leaves
/// only after the transport reported slice `k`'s writes complete and after the results of every
/// earlier slice; the `is_last` result is followed by the aux data.
///
/// **Errors**: a method returns [`UsageError`] for a caller bug and changes nothing (late aux
/// data is refused after its passed deadline was applied, as the timer input it is: see **Aux
/// deadline**). A peer's misbehaviour never returns an error: it fails the sessions involved
/// (an [`Event::Failed`] with [`TransferStatus::ProtocolError`]) or is reported as
/// [`Event::ProtocolViolation`].
///
/// **Aux deadline**: the engine's aux data must come before
/// [`Deadlines::aux_wait`](super::Deadlines) after the request's last chunk. At or after it —
/// even when no timer poll ran since — the request times out exactly as the timer would
/// ([`Event::TimedOut`] waiting for [`Wait::Aux`]; every receiver gets a failed terminal result
/// and never completes) and [`submit_aux`](Self::submit_aux) returns
/// [`UsageError::SessionEnded`]. Aux data in time goes out after each receiver's last result
/// and the request completes; a receiver takes it even when it arrives after the receiver's
/// own aux deadline, as long as the receiver's timer has not fired (see
/// [`Receiver`](super::Receiver)).
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
    sessions: SessionTable<SendSession, ()>,
    pending_registrations: PendingRegistrations,
    batches: BTreeMap<WriteBatchId, BatchRef>,
    /// Per receiver, when a write batch towards it last completed: a link that keeps
    /// completing batches is moving, so its queued batches' deadlines follow it.
    link_progress: BTreeMap<PeerId, Instant>,
    next_batch: u64,
    plan_buffer: WritePlan,
    recorded: InputLog<SenderInput>,
    /// The rank's layers (the sum of its groups'), which layer ranges index.
    layer_count: u32,
    /// Per group, the slots its smallest pool holds where the regions' lengths were given
    /// (`config.region_bytes`): what each chunk's window and block run are checked against,
    /// computed once instead of per chunk.
    pool_slots: Vec<Option<u64>>,
}

// The getters, outputs, recording, shared inputs and the `Endpoint` trait every endpoint has
// (see `surface.rs`).
endpoint_surface!(Sender, Role::Sender, SenderInput, SendPhase, SenderConfig);

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
        config.layer_order.check(&config.local.groups)?;
        config.deadlines.check()?;
        crate::check_topology(&config.local.topology, &config.local.groups)?;
        let hello = config.local.to_hello(Role::Sender);
        Ok(Sender {
            shell: Shell::new(
                hello,
                config.deadlines,
                config.max_remembered_cancels,
                config.peer_ids_reused,
            ),
            sessions: SessionTable::new(config.retired_horizon, config.max_retired),
            pending_registrations: PendingRegistrations::default(),
            batches: BTreeMap::new(),
            link_progress: BTreeMap::new(),
            next_batch: 0,
            plan_buffer: WritePlan::new(),
            recorded: InputLog::off(),
            layer_count: LayerOrder::layer_count(&config.local.groups),
            pool_slots: (config.local.groups.iter())
                .map(|g| g.slots_in(&config.region_bytes))
                .collect(),
            config,
        })
    }

    // ----- getters -----

    /// The phase of `peer` within `request`'s session (`None`: no such session or receiver).
    pub fn target_phase(&self, request: RequestId, peer: PeerId) -> Option<TargetPhase> {
        let session = self.sessions.live.get(&request)?;
        session
            .targets
            .iter()
            .find(|t| t.peer == peer)
            .map(|t| t.phase)
    }

    /// Write batches handed to the transport and not reported yet.
    pub fn batches_in_flight(&self) -> usize {
        self.batches.len()
    }

    /// The rank's layers (every group's, see [`LayerOrder`]): a chunk submitted in layer
    /// ranges is done when its ranges reach this.
    pub fn layer_count(&self) -> u32 {
        self.layer_count
    }

    /// Where the next layer range of `request`'s chunk submitted in ranges must start, while
    /// that chunk's last range has not come (`None`: no chunk is open; the next submission is
    /// a new chunk).
    pub fn next_chunk_layer(&self, request: RequestId) -> Option<u32> {
        let session = self.sessions.live.get(&request)?;
        session.open_chunk.map(|c| c.next_layer)
    }

    /// Registrations held for requests the engine has not opened yet.
    pub fn pending_registration_count(&self) -> usize {
        self.pending_registrations.len
    }

    // ----- commands -----

    /// Opens `req` before its first chunk (see [`SenderInput::Open`]). Registrations that
    /// arrived before are adopted now; a cancel that arrived before cancels it at once.
    pub fn open_request(&mut self, now: Instant, req: SendRequest) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Open { now, request: req })
    }

    /// Submits the request's aux data (see [`SenderInput::Aux`]).
    ///
    /// The aux data must come before the request's aux deadline
    /// ([`Deadlines::aux_wait`](super::Deadlines) after its last chunk). Data at or after the
    /// deadline is late even when no timer poll ran since: a deadline that has passed at `now`
    /// wins over an input at `now`. The session then times out exactly as the timer would
    /// ([`Event::TimedOut`] waiting for [`Wait::Aux`]; the receivers are told), and the call
    /// returns [`UsageError::SessionEnded`] — the answer it gets when the timer ran first. The
    /// data is never sent, so the receivers never complete a request this sender timed out.
    ///
    /// The data must fit every receiver's aux slot ([`AuxData::slot_len`] at most the
    /// registration's `aux_capacity`): data larger than the smallest slot registered so far is
    /// refused with [`UsageError::AuxOverSlot`], nothing changed. A receiver that registers
    /// after the data was taken, with a slot too small for it, fails the request on both sides
    /// as a protocol error ([`ProtocolError::AuxTooLarge`](super::ProtocolError)), so this
    /// side never completes a request whose receiver would refuse the aux.
    ///
    /// [`AuxData::slot_len`]: crate::wire::AuxData::slot_len
    pub fn submit_aux(
        &mut self,
        now: Instant,
        request: RequestId,
        data: AuxData,
    ) -> Result<(), UsageError> {
        self.handle_input(SenderInput::Aux { now, request, data })
    }

    // ----- inputs -----

    /// Applies one of the endpoint's own inputs (see [`handle_input`](Self::handle_input)).
    fn apply(&mut self, input: SenderInput) -> Result<(), UsageError> {
        match input {
            SenderInput::Transport { now, input } => self.on_transport(now, input),
            SenderInput::Open { now, request } => self.on_open(now, request),
            SenderInput::Chunk {
                now,
                request,
                spec,
                runs,
            } => self.on_chunk(now, request, spec, runs).map(|_| ()),
            SenderInput::ChunkLayers {
                now,
                request,
                spec,
                layers,
                runs,
            } => self
                .on_chunk_layers(now, request, spec, layers, runs)
                .map(|_| ()),
            // (An engine fault inside `on_chunk` is an outcome: it ended the session, and the
            // input was applied.)
            SenderInput::Prefix {
                now,
                request,
                prompt_len,
                prepopulated_len,
                runs,
            } => self
                .on_prefix(now, request, prompt_len, prepopulated_len, runs)
                .map(|_| ()),
            SenderInput::Aux { now, request, data } => {
                self.time_out_late_aux(now, request);
                self.on_aux_submitted(now, request, data)
            }
            SenderInput::Cancel { now, request } => self.on_cancel(now, request),
            SenderInput::Retire { now, request } => self.on_retire(now, request),
        }
    }

    /// A sender accepts no data writes: the answer is always a refusal, and a connected peer
    /// that sends one is closed.
    pub fn admit_write(&mut self, now: Instant, peer: PeerId, header: &DataWrite) -> Admission {
        let input = TransportInput::WriteArrived {
            peer,
            header: *header,
        };
        let _ = self.handle_transport(now, input);
        Admission::Refuse(WriteRefusal::NotAccepted)
    }

    // ----- internals -----

    fn on_transport(&mut self, now: Instant, input: TransportInput) -> Result<(), UsageError> {
        let Some(input) = self.on_shared_transport(now, input)? else {
            return Ok(());
        };
        match input {
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
            // The shared frame took these.
            TransportInput::PeerConnected { .. }
            | TransportInput::PeerConnectedWithOffer { .. }
            | TransportInput::DataPathAnswered { .. }
            | TransportInput::PeerDisconnected { .. }
            | TransportInput::FrameReceived { .. }
            | TransportInput::Timeout => Ok(()),
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
}

/// The cancel reason that carries `status` to a peer that has no registration to name.
fn status_reason(status: TransferStatus) -> CancelReason {
    match status {
        TransferStatus::Cancelled => CancelReason::Engine,
        TransferStatus::TimedOut | TransferStatus::InDoubt => CancelReason::Timeout,
        _ => CancelReason::Failure,
    }
}
