//! Endpoint configuration: deadlines, bounds and the local handshake data.

use super::transport::DataPath;
use crate::config::{ConfigError, PipelineConfig};
use crate::ids::{InstanceId, RegionId};
use crate::layers::LayerOrder;
use crate::layout::LayerGroupLayout;
use crate::time::Duration;
use crate::wire::{
    Capabilities, Hello, Role, Topology, VersionRange, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

/// How long a retired id is remembered by default (see [`SenderConfig::retired_horizon`]).
pub const DEFAULT_RETIRED_HORIZON: Duration = Duration::from_secs(120);
/// The most retired ids remembered at once by default (see [`SenderConfig::max_retired`]).
pub const DEFAULT_MAX_RETIRED: usize = 1 << 18;

/// Every deadline an endpoint keeps. Nothing waits without one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Deadlines {
    /// From connection to a validated handshake.
    pub handshake: Duration,
    /// (Sender) from opening a request to every receiver's registration; and from a
    /// registration that arrived first to the request's opening (past it the registration is
    /// refused with a `Cancel`).
    pub registration: Duration,
    /// (Sender) from handing a write batch to the transport to its report.
    pub write_completion: Duration,
    /// (Receiver) the base of the overall cap on a request, from its registration to every
    /// writer's last result: `result_wait + prompt_len × result_per_token` (prefill queueing and
    /// compute grow with the prompt).
    pub result_wait: Duration,
    /// (Receiver) what the overall cap adds per prompt token.
    pub result_per_token: Duration,
    /// (Receiver) once a request made progress (a result, landed data or aux data arrived), it
    /// fails when no further progress comes for this long — a stalled transfer ends well before
    /// the cap, a slow one that keeps progressing is never cut off by it.
    pub result_idle: Duration,
    /// Sender: from the last chunk to the engine's aux data; aux data at or after that
    /// deadline times the request out even if no timer poll ran since. Receiver: from the last
    /// writer's last result to the aux data; it fires only from a timer poll, so aux data the
    /// sender sent in time is taken until then (see the `Sender` and `Receiver` docs, "Aux
    /// deadline"). Give the receiver at least the sender's wait: a receiver whose deadline
    /// passes first stops its writers, and an aux frame already on the way then completes the
    /// sender while the receiver has timed out.
    pub aux_wait: Duration,
    /// Send a heartbeat to a peer when nothing was sent to it for this long.
    pub heartbeat_interval: Duration,
    /// Consider a peer lost when nothing arrived from it for this long.
    pub liveness_timeout: Duration,
    /// From a session's failure to the confirmation that no write can still land; after it the
    /// endpoint asks the transport to close the peer ([`super::CloseReason::QuiesceFence`]).
    pub quiesce: Duration,
}

impl Deadlines {
    /// Whether every deadline can work: each one but `result_per_token` (which only adds to
    /// `result_wait`) must be positive — a zero heartbeat interval would make the endpoint
    /// send heartbeats in a loop, a zero handshake or liveness timeout drops each peer at once,
    /// and a zero wait elsewhere fails every request (or, for `quiesce`, closes the link on
    /// each failure) before anything could arrive. `liveness_timeout` must also be longer
    /// than `heartbeat_interval`, or a quiet but healthy peer is lost between two heartbeats.
    /// [`Sender::new`](super::Sender::new) and [`Receiver::new`](super::Receiver::new) call it.
    pub fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            ("handshake", self.handshake),
            ("registration", self.registration),
            ("write_completion", self.write_completion),
            ("result_wait", self.result_wait),
            ("result_idle", self.result_idle),
            ("aux_wait", self.aux_wait),
            ("heartbeat_interval", self.heartbeat_interval),
            ("liveness_timeout", self.liveness_timeout),
            ("quiesce", self.quiesce),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, d)| *d == Duration::ZERO) {
            return Err(ConfigError::ZeroDeadline(field));
        }
        if self.liveness_timeout <= self.heartbeat_interval {
            return Err(ConfigError::LivenessNotAboveHeartbeat {
                liveness_timeout: self.liveness_timeout,
                heartbeat_interval: self.heartbeat_interval,
            });
        }
        Ok(())
    }
}

impl Default for Deadlines {
    /// Generous defaults for a data-centre deployment.
    fn default() -> Self {
        Deadlines {
            handshake: Duration::from_secs(5),
            registration: Duration::from_secs(60),
            write_completion: Duration::from_secs(10),
            result_wait: Duration::from_secs(120),
            result_per_token: Duration::from_millis(2),
            result_idle: Duration::from_secs(30),
            aux_wait: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(1),
            liveness_timeout: Duration::from_secs(10),
            quiesce: Duration::from_secs(10),
        }
    }
}

/// What this endpoint says about itself in its handshake.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LocalHello {
    /// This process's instance.
    pub instance: InstanceId,
    /// Protocol versions spoken.
    pub versions: VersionRange,
    /// Optional features supported.
    pub capabilities: Capabilities,
    /// Hash over model geometry, dtype, tokens per block and layout; both sides must agree.
    pub compat_hash: u64,
    /// Parallel topology of this rank.
    pub topology: Topology,
    /// Pool layout per layer group, in group order.
    pub groups: Vec<LayerGroupLayout>,
}

impl LocalHello {
    /// Handshake data speaking every version this build supports, with the compatibility hash
    /// computed from `groups`.
    pub fn new(instance: InstanceId, topology: Topology, groups: Vec<LayerGroupLayout>) -> Self {
        let compat_hash = crate::wire::compat_hash(&groups);
        LocalHello {
            instance,
            versions: VersionRange {
                min: MIN_PROTOCOL_VERSION,
                max: PROTOCOL_VERSION,
            },
            capabilities: Capabilities::default(),
            compat_hash,
            topology,
            groups,
        }
    }

    /// The Hello frame this endpoint sends in `role` (offering no data path: a transport that
    /// offers one connects with [`TransportInput::PeerConnectedWithOffer`]).
    ///
    /// [`TransportInput::PeerConnectedWithOffer`]: super::TransportInput::PeerConnectedWithOffer
    pub fn to_hello(&self, role: Role) -> Hello {
        Hello {
            versions: self.versions,
            capabilities: self.capabilities,
            compat_hash: self.compat_hash,
            instance: self.instance,
            role,
            topology: self.topology,
            groups: self.groups.clone(),
            data_path_offer: None,
        }
    }
}

/// Configuration of a [`super::Sender`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SenderConfig {
    /// Handshake data.
    pub local: LocalHello,
    /// Deadlines.
    pub deadlines: Deadlines,
    /// How many cancels for not-yet-opened requests are remembered (oldest forgotten first).
    pub max_remembered_cancels: usize,
    /// How long a retired request id is remembered after its retirement: a frame naming it
    /// within this horizon never re-creates the request, and the engine cannot reuse the id.
    /// Past it the id is forgotten (no frame about it can still arrive: keep it longer than
    /// every deadline, `liveness_timeout` above all). Default: 2 minutes.
    pub retired_horizon: Duration,
    /// The most retired ids remembered at once (memory bound); past it the oldest retirement
    /// is forgotten before its horizon and counted in
    /// [`Counters::retired_forgotten_early`](super::Counters::retired_forgotten_early).
    /// Default 262,144: two minutes of retirements at over 2,000 requests per second.
    pub max_retired: usize,
    /// How many registrations for not-yet-opened requests are held (newer ones are refused
    /// with a `Cancel`).
    pub max_pending_registrations: usize,
    /// The engine settings pipelined transfer depends on; [`Sender::new`](super::Sender::new)
    /// refuses an unsupported one.
    pub pipeline: PipelineConfig,
    /// The order in which the engine computes the rank's layers, which
    /// [`LayerRange`](crate::LayerRange)s of layered chunk submissions index
    /// ([`Sender::submit_chunk_layers`](super::Sender::submit_chunk_layers)). Default: the
    /// groups stacked in group order; a model whose groups interleave lists its layers' groups.
    /// [`Sender::new`](super::Sender::new) refuses an order that does not list every layer of
    /// the rank once.
    pub layer_order: LayerOrder,
    /// The byte length of each local region the layout's pools name, where the engine gives
    /// it: a chunk whose block source names a block whose slot lies past its pool's region is
    /// the engine's fault ([`EngineFault::BlockPastPool`](super::EngineFault::BlockPastPool)),
    /// caught before any write is planned. Empty (the default): not checked here, and such a
    /// write fails at the transport instead.
    pub region_bytes: Vec<(RegionId, u64)>,
    /// Whether the transport may give a new connection the id of one that ended (the default,
    /// `true`, as the transport contract allows): a request opened or registered towards a
    /// peer whose connection ended then waits for it to connect again, within the request's
    /// deadlines. A transport that never reuses an id (TCP and verbs number their connections
    /// upwards) sets it `false`: such a request fails at once with
    /// [`TransferStatus::PeerLost`](crate::wire::TransferStatus::PeerLost), as the connection's
    /// end failed the requests open then, instead of waiting out a deadline for a peer that
    /// is gone.
    pub peer_ids_reused: bool,
}

impl SenderConfig {
    /// Default deadlines and bounds around `local`.
    pub fn new(local: LocalHello) -> Self {
        SenderConfig {
            local,
            deadlines: Deadlines::default(),
            max_remembered_cancels: 4096,
            retired_horizon: DEFAULT_RETIRED_HORIZON,
            max_retired: DEFAULT_MAX_RETIRED,
            max_pending_registrations: 4096,
            pipeline: PipelineConfig::default(),
            layer_order: LayerOrder::stacked(),
            region_bytes: Vec::new(),
            peer_ids_reused: true,
        }
    }
}

/// Configuration of a [`super::Receiver`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiverConfig {
    /// Handshake data.
    pub local: LocalHello,
    /// Deadlines.
    pub deadlines: Deadlines,
    /// Seed of the generator of memory grants (the core never reads OS randomness); give each
    /// process a different seed.
    pub grant_seed: u64,
    /// How many cancels for not-yet-registered requests are remembered (oldest forgotten first).
    pub max_remembered_cancels: usize,
    /// How long a retired request id is remembered after its retirement: a frame naming it
    /// within this horizon never re-creates the request, and the engine cannot reuse the id.
    /// Past it the id is forgotten (no frame about it can still arrive: keep it longer than
    /// every deadline, `liveness_timeout` above all). Default: 2 minutes.
    pub retired_horizon: Duration,
    /// The most retired ids remembered at once (memory bound); past it the oldest retirement
    /// is forgotten before its horizon and counted in
    /// [`Counters::retired_forgotten_early`](super::Counters::retired_forgotten_early).
    /// Default 262,144: two minutes of retirements at over 2,000 requests per second.
    pub max_retired: usize,
    /// Where the transport's data writes land, which decides when a result is trusted
    /// ([`DataPath::Landed`] unless the transport's fabric orders data before frames).
    pub data_path: DataPath,
    /// The engine settings pipelined transfer depends on;
    /// [`Receiver::new`](super::Receiver::new) refuses an unsupported one.
    pub pipeline: PipelineConfig,
    /// The byte length of each local region the layout's pools name, where the engine gives
    /// it: a registration naming a block whose slot lies past its pool's region is refused
    /// ([`UsageError::BlockPastPool`](super::UsageError::BlockPastPool)). Empty (the
    /// default): not checked here, and a write to such a block fails at the transport instead.
    pub region_bytes: Vec<(RegionId, u64)>,
    /// Whether the transport may give a new connection the id of one that ended (the default,
    /// `true`, as the transport contract allows): a request opened or registered towards a
    /// peer whose connection ended then waits for it to connect again, within the request's
    /// deadlines. A transport that never reuses an id (TCP and verbs number their connections
    /// upwards) sets it `false`: such a request fails at once with
    /// [`TransferStatus::PeerLost`](crate::wire::TransferStatus::PeerLost), as the connection's
    /// end failed the requests open then, instead of waiting out a deadline for a peer that
    /// is gone.
    pub peer_ids_reused: bool,
}

impl ReceiverConfig {
    /// Default deadlines and bounds around `local`, with grants drawn from `grant_seed`.
    pub fn new(local: LocalHello, grant_seed: u64) -> Self {
        ReceiverConfig {
            local,
            deadlines: Deadlines::default(),
            grant_seed,
            max_remembered_cancels: 4096,
            retired_horizon: DEFAULT_RETIRED_HORIZON,
            max_retired: DEFAULT_MAX_RETIRED,
            data_path: DataPath::Landed,
            pipeline: PipelineConfig::default(),
            region_bytes: Vec::new(),
            peer_ids_reused: true,
        }
    }
}
