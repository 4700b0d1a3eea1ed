//! The decode-side endpoint, split by concern: the [`Receiver`] type with its own getters,
//! commands and input dispatch here; registration ([`registration`]), admission of data writes
//! ([`admission`]), held results ([`results`]), aux data ([`aux`]) and stop/quiesce ([`stop`],
//! the receiver's part of the shared session frame) in their own files, each an
//! `impl Receiver` block over the state defined here. What both endpoints share is written once
//! in the parent module (`surface.rs`, `role.rs`, `table.rs`, `stop.rs`, `shell.rs`).

mod admission;
mod aux;
mod held;
mod registration;
mod results;
mod session;
mod stop;

use std::collections::{BTreeSet, VecDeque};

use session::{RecvSession, RetiredGrant, Writer, MAX_HELD_FRAMES};

use smallvec::SmallVec;

use super::config::ReceiverConfig;
use super::coverage::{check_group_cover, GroupPart};
use super::grants::{Flight, GrantedExtents, LandedExtents, WritesInFlight};
use super::role::EndpointRole;
use super::shell::Shell;
use super::state::{RecvEvent, RecvPhase, Transition, WriterEvent, WriterPhase};
use super::stop::Stop;
use super::surface::{endpoint_surface, InputLog};
use super::table::{named_twice, CancelStep, HeldSession, SessionTable};
use super::timers::TimerKey;
use super::transport::{Admission, DataPath, Endpoint, TransportInput, WriteRefusal, WriteTicket};
use super::{
    frame_kind, oversized, CancelOrigin, CloseReason, Counters, Output, ProtocolError,
    RequestTimings, UsageError, Wait,
};
// The events are named by the docs; the shell reports them.
#[cfg(doc)]
use super::Event;
use crate::blocks::AnchoredRun;
use crate::geometry::{stale_boundary, total_blocks};
use crate::ids::{GrantId, GroupIndex, PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::shard::writes_group;
use crate::time::Instant;
use crate::wire::{
    AuxData, AuxResult, Cancel, CancelReason, DataWrite, Frame, KvResult, RecvRegistration, Role,
    TransferStatus,
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
/// request and its writers; sends a `RecvRegistration` to the writers once every writer's
/// handshake is known and their cover proved), [`cancel`](Self::cancel), [`retire`](Self::retire).
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
/// **Aux deadline** (one rule for both sides: the aux deadline is judged once, where the aux
/// data enters, against the sender's deadline): a writer's successful `AuxResult` is its word
/// that the engine's aux data came in time and that its session for this receiver finished
/// ([`Event::Completed`] there). The receiver takes it while the session is active, even at or
/// after its own aux deadline when no timer poll ran since: timing out then would contradict a
/// writer that already completed. The receiver's own deadline
/// ([`Deadlines::aux_wait`](super::Deadlines) after the last writer's last result) guards
/// against a writer that says nothing: when its timer fires the receiver reports
/// [`Event::TimedOut`] waiting for [`Wait::Aux`](super::Wait::Aux) and sends every writer a
/// `Cancel`, which stops a writer still waiting for its aux data. A writer late on the
/// sender's side never sends the aux data; it sends a failed terminal result, and the
/// receiver reports [`Event::Failed`] with [`TransferStatus::TimedOut`] (or its own
/// [`Event::TimedOut`], when its timer fired first).
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
    sessions: SessionTable<RecvSession, RetiredGrant>,
    writes: WritesInFlight,
    /// The destination blocks live requests hold.
    held: held::HeldBlocks,
    next_slice: u32,
    grant_state: u64,
    recorded: InputLog<ReceiverInput>,
}

// The getters, outputs, recording, shared inputs and the `Endpoint` trait every endpoint has
// (see `surface.rs`).
endpoint_surface!(
    Receiver,
    Role::Receiver,
    ReceiverInput,
    RecvPhase,
    ReceiverConfig
);

impl Receiver {
    /// A receiver with no peers and no sessions, or the first reason its configuration cannot
    /// run pipelined transfer.
    pub fn new(config: ReceiverConfig) -> Result<Self, crate::config::ConfigError> {
        config.pipeline.validate()?;
        config.deadlines.check()?;
        crate::check_topology(&config.local.topology, &config.local.groups)?;
        let hello = config.local.to_hello(Role::Receiver);
        Ok(Receiver {
            shell: Shell::new(
                hello,
                config.deadlines,
                config.max_remembered_cancels,
                config.peer_ids_reused,
            ),
            sessions: SessionTable::new(config.retired_horizon, config.max_retired),
            writes: WritesInFlight::default(),
            held: held::HeldBlocks::default(),
            next_slice: 0,
            grant_state: config.grant_seed,
            recorded: InputLog::off(),
            config,
        })
    }

    // ----- getters -----

    /// The phase of writer `peer` within `request`'s session.
    pub fn writer_phase(&self, request: RequestId, peer: PeerId) -> Option<WriterPhase> {
        let session = self.sessions.live.get(&request)?;
        session
            .writers
            .iter()
            .find(|w| w.peer == peer)
            .map(|w| w.phase)
    }

    /// The memory grant of `request`'s registration.
    pub fn grant(&self, request: RequestId) -> Option<GrantId> {
        self.sessions.live.get(&request).map(|s| s.frame.grant)
    }

    /// The destination bytes granted to `request`.
    pub fn granted_extents(&self, request: RequestId) -> Option<&GrantedExtents> {
        self.sessions.live.get(&request).map(|s| &s.extents)
    }

    /// The layer groups `peer` described in its handshake (its windows among them: a sender
    /// keeping a smaller window than this side's never writes the blocks before its own stale
    /// boundary), once its `Hello` arrived.
    pub fn peer_groups(&self, peer: PeerId) -> Option<&[crate::layout::LayerGroupLayout]> {
        self.shell.peers.remote(peer).map(|h| h.groups.as_slice())
    }

    /// Admitted data writes not reported finished yet.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    // ----- commands -----

    /// Registers the destination of a request (see [`ReceiverInput::Register`]). Once every
    /// writer's handshake is known (now, or when the last one completes) and the writers are
    /// proved to cover what the registration expects exactly once
    /// ([`Registration::expected_part`]), it is sent to every writer whose handshake is done
    /// (the others get it when theirs completes); until then no writer can start. Returns the
    /// receiver's slice id for it.
    ///
    /// Refused with nothing changed: a registration that does not end at the prompt's last
    /// block, starts a windowed group below its stale boundary, cannot be encoded, or whose
    /// writers (all known) do not cover it exactly once.
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
            .live
            .get(&request)
            .map(|s| s.frame.slice)
            .expect("registered above"))
    }

    // ----- inputs -----

    /// Applies one of the endpoint's own inputs (see [`handle_input`](Self::handle_input)).
    fn apply(&mut self, input: ReceiverInput) -> Result<(), UsageError> {
        match input {
            ReceiverInput::Transport { now, input } => self.on_transport(now, input).map(|_| ()),
            ReceiverInput::Register { now, registration } => self.on_register(now, registration),
            ReceiverInput::Cancel { now, request } => self.on_cancel(now, request),
            ReceiverInput::Retire { now, request } => self.on_retire(now, request),
        }
    }

    /// Asks whether the data write whose decoded header is `header` may be applied (see
    /// [`Admission`]); recorded as [`TransportInput::WriteArrived`]. A refusal has already
    /// failed the request it named (when `peer` is one of its writers) and asked to close the
    /// peer.
    pub fn admit_write(&mut self, now: Instant, peer: PeerId, header: &DataWrite) -> Admission {
        let input = TransportInput::WriteArrived {
            peer,
            header: *header,
        };
        let recorded = self.recorded.is_on().then(|| ReceiverInput::Transport {
            now,
            input: input.clone(),
        });
        match self.on_transport(now, input) {
            Ok(Some(admission)) => {
                self.recorded.push_copy(recorded);
                admission
            }
            Ok(None) | Err(_) => Admission::Refuse(WriteRefusal::PeerNotReady(peer)),
        }
    }

    /// Asks, in order, whether each data write of `writes` from `peer` may be applied, and
    /// pushes the answers to `out`: exactly what [`admit_write`](Self::admit_write) of each in
    /// turn answers, changes and records, at less cost per write, up to the first refusal. A
    /// refusal is the last answer pushed: the writes after it are not asked about (the peer is
    /// being closed and none of them would be admitted). A transport that applies a batch of
    /// writes at once asks for the batch here: a run of writes to one request looks the peer,
    /// the session and its writer up once.
    pub fn admit_writes(
        &mut self,
        now: Instant,
        peer: PeerId,
        writes: &[DataWrite],
        out: &mut Vec<Admission>,
    ) {
        let mut rest = writes;
        while let Some(first) = rest.first() {
            // A recording receiver records every write as its own input.
            let admitted = if self.recorded.is_on() {
                0
            } else {
                self.admit_run(now, peer, rest, out)
            };
            if admitted == 0 {
                // The full path: a refusal, a discard, another request's session.
                let admission = self.admit_write(now, peer, first);
                let refused = matches!(admission, Admission::Refuse(_));
                out.push(admission);
                if refused {
                    return;
                }
                rest = &rest[1..];
            } else {
                rest = &rest[admitted..];
            }
        }
    }

    /// Reports admitted writes finished, in order, as [`TransportInput::WriteFinished`] of
    /// each ticket with `landed` in turn would (and recorded as such), at less cost per write.
    /// Stops at the first ticket that input refuses, with its usage error: the tickets before
    /// it are applied, it and the ones after are not.
    pub fn writes_finished(
        &mut self,
        now: Instant,
        tickets: &[WriteTicket],
        landed: bool,
    ) -> Result<(), UsageError> {
        for &ticket in tickets {
            if self.recorded.is_on() {
                self.handle_transport(now, TransportInput::WriteFinished { ticket, landed })?;
            } else {
                self.on_write_finished(now, ticket, landed)?;
            }
        }
        Ok(())
    }

    // ----- internals -----

    /// Applies a transport input; for [`TransportInput::WriteArrived`] returns the admission.
    fn on_transport(
        &mut self,
        now: Instant,
        input: TransportInput,
    ) -> Result<Option<Admission>, UsageError> {
        let Some(input) = self.on_shared_transport(now, input)? else {
            return Ok(None);
        };
        match input {
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
            // The shared frame took these.
            TransportInput::PeerConnected { .. }
            | TransportInput::PeerConnectedWithOffer { .. }
            | TransportInput::DataPathAnswered { .. }
            | TransportInput::PeerDisconnected { .. }
            | TransportInput::FrameReceived { .. }
            | TransportInput::Timeout => {}
        }
        Ok(None)
    }
}
