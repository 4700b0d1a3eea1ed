//! The engine-facing handles: [`TcpSender`] (prefill side) and [`TcpReceiver`] (decode side),
//! one generic [`TcpNode`] with each role's engine commands on top.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use kvpipe_core::session::{Counters, Registration, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, ConfigError, DataPath, Endpoint, Event, Instant, LayerRange, PeerId,
    Receiver, ReceiverConfig, ReceiverSliceId, RequestId, Sender, SenderConfig, Submitted,
};

use crate::blocking::Threads;
use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::node::guard::EndpointGuard;
use crate::node::lifecycle::{CloseError, Node};
use crate::node::Spawn;
use crate::stats::TcpStats;

/// A core endpoint driven over TCP with std threads: a [`TcpSender`] or a [`TcpReceiver`].
///
/// Connect to (or accept) peers, give the role's engine commands, and read [`Event`]s with
/// [`next_event`](Self::next_event).
pub struct TcpNode<E: Endpoint + Send + 'static> {
    node: Node<E>,
}

/// A prefill-side node: a core [`Sender`] driven over TCP with std threads.
///
/// Connect to (or accept) receivers, open requests naming their [`PeerId`]s, submit chunks as
/// prefill computes them, and read [`Event`]s with [`next_event`](TcpNode::next_event). Source
/// bytes are read from the registered regions (the layout's pool regions) at send time, so a
/// request's blocks must not change until its `Quiesced` event.
pub type TcpSender = TcpNode<Sender>;

/// A decode-side node: a core [`Receiver`] driven over TCP with std threads.
///
/// Register a request's destination blocks with [`register`](TcpNode::register): every
/// incoming data write is admitted by the core ([`Receiver::admit_write`]: that request's
/// grant, one of its writers, inside its blocks, overlapping no write in flight) before a byte
/// is read into memory.
pub type TcpReceiver = TcpNode<Receiver>;

impl<E: Endpoint + Send + 'static> TcpNode<E> {
    #[cfg(feature = "tokio")]
    pub(crate) fn node(&self) -> &Node<E> {
        &self.node
    }

    /// Accepts connections on `addr` (each connecting bundle becomes a peer).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        self.node.listen(addr)
    }

    /// Connects to a peer at `addr`; the handshake runs in the background
    /// ([`Event::PeerReady`] or [`Event::PeerRejected`] follows). A node numbers its peers
    /// from 0, in the order they connect or are accepted.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.node.connect(addr)
    }

    /// The next event, waiting up to `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        self.node.next_event(timeout).map(|(_, e)| e)
    }

    /// The next event and the node time it was reported at, waiting up to `timeout`.
    pub fn next_event_at(&self, timeout: Duration) -> Option<(Instant, Event)> {
        self.node.next_event(timeout)
    }

    /// Every queued event with its time, without waiting.
    pub fn take_events(&self) -> Vec<(Instant, Event)> {
        self.node.take_events()
    }

    /// Exclusive access to the core endpoint; outputs are carried out when the guard drops.
    pub fn endpoint(&self) -> EndpointGuard<E> {
        EndpointGuard::new(&self.node.shared)
    }

    /// The node's current time.
    pub fn now(&self) -> Instant {
        self.node.shared.now()
    }

    /// The peers now (assembling their connections, handshaking, ready or closing).
    pub fn peers(&self) -> Vec<PeerId> {
        self.node.peers()
    }

    /// Write batches handed to connections and not written out yet.
    pub fn writes_in_flight(&self) -> usize {
        self.node.writes_in_flight()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.node.shared.state.lock().endpoint.is_peer_ready(peer)
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.node.shared.state.lock().endpoint.counters()
    }

    /// The transport's counters.
    pub fn stats(&self) -> TcpStats {
        self.node.shared.stats.snapshot()
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.node.shared.state.lock().endpoint.session_count()
    }

    /// Closes every connection at once and stops the node's threads: frames and data still
    /// queued may be lost. Prefer [`close`](Self::close) to end a transfer.
    pub fn shutdown(&self) {
        self.node.shutdown();
    }

    /// Closes every peer in order, waiting at most `within`, then stops the node's threads
    /// (see *Closing* in the crate doc for what `Ok` guarantees). Dropping the handle does the
    /// same, bounded by [`TcpConfig::close_grace`].
    pub fn close(self, within: Duration) -> Result<(), CloseError> {
        self.node.close(within)
    }
}

impl TcpNode<Sender> {
    /// A node around a core sender, reading source bytes from `regions`; or the first reason
    /// the core cannot run pipelined transfer with `config`.
    pub fn new(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
    ) -> Result<Self, ConfigError> {
        Self::with_spawn(config, tcp, regions, Box::new(Threads))
    }

    /// A node whose connection halves run where `spawn` starts them.
    pub(crate) fn with_spawn(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        spawn: Box<dyn Spawn>,
    ) -> Result<Self, ConfigError> {
        Ok(TcpNode {
            node: Node::new(Sender::new(config)?, tcp, regions, spawn),
        })
    }

    /// Opens a request (see [`Sender::open_request`]).
    pub fn open_request(&self, req: SendRequest) -> Result<(), UsageError> {
        self.node.shared.with(|ep, now| ep.open_request(now, req))
    }

    /// Submits a computed chunk (see [`Sender::submit_chunk`]).
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        // The engine's block source runs with the node unlocked, so every connection's
        // admissions and reports go on meanwhile; the sender checks the chunk again when the
        // answers are applied.
        let query = self
            .node
            .shared
            .with(|ep, _| ep.chunk_query(request, &spec))?;
        let runs = query.ask(source)?;
        self.node
            .shared
            .with(|ep, now| ep.submit_chunk_runs(now, request, spec, runs))
    }

    /// Submits layers `layers` of a computed chunk, as the engine finishes them (see
    /// [`Sender::submit_chunk_layers`]). Only a chunk's first range asks `source` for blocks,
    /// with the node unlocked as [`submit_chunk`](Self::submit_chunk) does.
    pub fn submit_chunk_layers(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        let query = self
            .node
            .shared
            .with(|ep, _| ep.chunk_layers_query(request, &spec, layers))?;
        let runs = query.ask(source)?;
        self.node
            .shared
            .with(|ep, now| ep.submit_chunk_layers_runs(now, request, spec, layers, runs))
    }

    /// Submits the request's aux data.
    pub fn submit_aux(&self, request: RequestId, data: AuxData) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|ep, now| ep.submit_aux(now, request, data))
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.node.shared.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event.
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.node.shared.with(|ep, now| ep.retire(now, request))
    }

    /// `(bytes, issued, written out)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.node.batch_timings()
    }
}

impl TcpNode<Receiver> {
    /// A node around a core receiver, landing payloads in `regions`; or the first reason the
    /// core cannot run pipelined transfer with `config`.
    ///
    /// TCP applies every data write itself, so the receiver runs with
    /// [`DataPath::Landed`] whatever `config.data_path` says.
    pub fn new(
        config: ReceiverConfig,
        tcp: TcpConfig,
        regions: RegionTable,
    ) -> Result<Self, ConfigError> {
        Self::with_spawn(config, tcp, regions, Box::new(Threads))
    }

    /// A node whose connection halves run where `spawn` starts them.
    pub(crate) fn with_spawn(
        mut config: ReceiverConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        spawn: Box<dyn Spawn>,
    ) -> Result<Self, ConfigError> {
        config.data_path = DataPath::Landed;
        Ok(TcpNode {
            node: Node::new(Receiver::new(config)?, tcp, regions, spawn),
        })
    }

    /// Registers a request's destination: the core admits data writes of its writers into
    /// exactly those blocks' bytes (see [`Receiver::register`]).
    pub fn register(&self, reg: Registration) -> Result<ReceiverSliceId, UsageError> {
        self.node.shared.with(|ep, now| ep.register(now, reg))
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.node.shared.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event (the core still recognises and drops late
    /// writes for it for a while).
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.node.shared.with(|ep, now| ep.retire(now, request))
    }
}
