//! The engine-facing handles: [`TcpSender`] (prefill side) and [`TcpReceiver`] (decode side).

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use kvpipe_core::session::{Counters, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, Event, Instant, PeerId, Receiver, ReceiverConfig, ReceiverSliceId,
    RequestId, Sender, SenderConfig, SenderSliceId,
};

use super::node::{Backend, CloseError, EndpointGuard, Node};
use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::stats::TcpStats;
use kvpipe_core::session::Registration;

/// A prefill-side node: a core [`Sender`] driven over TCP with std threads.
///
/// Connect to (or accept) receivers, open requests naming their [`PeerId`]s, submit chunks as
/// prefill computes them, and read [`Event`]s with [`next_event`](Self::next_event). Source
/// bytes are read from the registered regions (the layout's pool regions) at send time, so a
/// request's blocks must not change until its `Quiesced` event.
pub struct TcpSender {
    node: Node<Sender>,
}

impl TcpSender {
    /// A node around a core sender, reading source bytes from `regions`.
    pub fn new(config: SenderConfig, tcp: TcpConfig, regions: RegionTable) -> Self {
        TcpSender {
            node: Node::new(
                Sender::new(config).expect("a supported configuration"),
                tcp,
                regions,
                Backend::Threads,
            ),
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn with_backend(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        backend: Backend,
    ) -> Self {
        TcpSender {
            node: Node::new(
                Sender::new(config).expect("a supported configuration"),
                tcp,
                regions,
                backend,
            ),
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn node(&self) -> &Node<Sender> {
        &self.node
    }

    /// Accepts connections on `addr` (each connecting receiver becomes a peer).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        self.node.listen(addr)
    }

    /// Connects to a receiver at `addr`; the handshake runs in the background
    /// ([`Event::PeerReady`] or [`Event::PeerRejected`] follows). A node numbers its peers
    /// from 0, in the order they connect or are accepted.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.node.connect(addr)
    }

    /// Opens a request (see [`Sender::open_request`]).
    pub fn open_request(&self, req: SendRequest) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.open_request(now, req))
    }

    /// Submits a computed chunk (see [`Sender::submit_chunk`]).
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Option<SenderSliceId>, UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.submit_chunk(now, request, spec, source))
    }

    /// Submits the request's aux data.
    pub fn submit_aux(&self, request: RequestId, data: AuxData) -> Result<(), UsageError> {
        self.node.shared.with(|st, now| {
            st.endpoint
                .handle_input(kvpipe_core::SenderInput::Aux { now, request, data })
        })
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event.
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.retire(now, request))
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
    pub fn endpoint(&self) -> EndpointGuard<Sender> {
        EndpointGuard::new(&self.node.shared)
    }

    /// The node's current time.
    pub fn now(&self) -> Instant {
        self.node.shared.now()
    }

    /// The peers connected now (handshaking, ready or closing).
    pub fn peers(&self) -> Vec<PeerId> {
        self.node.peers()
    }

    /// `(bytes, issued, written out)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.node.shared.lock().timings.iter().copied().collect()
    }

    /// Write batches handed to connections and not written out yet.
    pub fn writes_in_flight(&self) -> usize {
        self.node.writes_in_flight()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.node.shared.lock().endpoint.is_peer_ready(peer)
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.node.shared.lock().endpoint.counters()
    }

    /// The transport's counters.
    pub fn stats(&self) -> TcpStats {
        self.node.shared.stats.snapshot()
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.node.shared.lock().endpoint.session_count()
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

/// A decode-side node: a core [`Receiver`] driven over TCP with std threads.
///
/// Register a request's destination blocks with [`register`](Self::register): the node grants
/// the request exactly the bytes of those blocks in the pool regions, and every incoming data
/// write is checked against that grant before a byte is read into memory.
pub struct TcpReceiver {
    node: Node<Receiver>,
}

impl TcpReceiver {
    /// A node around a core receiver, landing payloads in `regions`.
    pub fn new(mut config: ReceiverConfig, tcp: TcpConfig, regions: RegionTable) -> Self {
        // This node still holds results until their data landed itself.
        config.data_path = kvpipe_core::DataPath::Ordered;
        TcpReceiver {
            node: Node::new(
                Receiver::new(config).expect("a supported configuration"),
                tcp,
                regions,
                Backend::Threads,
            ),
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn with_backend(
        mut config: ReceiverConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        backend: Backend,
    ) -> Self {
        config.data_path = kvpipe_core::DataPath::Ordered;
        TcpReceiver {
            node: Node::new(
                Receiver::new(config).expect("a supported configuration"),
                tcp,
                regions,
                backend,
            ),
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn node(&self) -> &Node<Receiver> {
        &self.node
    }

    /// Accepts connections on `addr` (each connecting sender becomes a peer).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        self.node.listen(addr)
    }

    /// Connects to a sender at `addr`.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.node.connect(addr)
    }

    /// Registers a request's destination and grants its writers exactly those blocks' bytes
    /// (see [`Receiver::register`]).
    pub fn register(&self, reg: Registration) -> Result<ReceiverSliceId, UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.register(now, reg))
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event; its grant is dropped (late writes for it
    /// are still recognised and drained for a while).
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.node
            .shared
            .with(|st, now| st.endpoint.retire(now, request))
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
    pub fn endpoint(&self) -> EndpointGuard<Receiver> {
        EndpointGuard::new(&self.node.shared)
    }

    /// The node's current time.
    pub fn now(&self) -> Instant {
        self.node.shared.now()
    }

    /// The peers connected now (handshaking, ready or closing).
    pub fn peers(&self) -> Vec<PeerId> {
        self.node.peers()
    }

    /// Write batches handed to connections and not written out yet.
    pub fn writes_in_flight(&self) -> usize {
        self.node.writes_in_flight()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.node.shared.lock().endpoint.is_peer_ready(peer)
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.node.shared.lock().endpoint.counters()
    }

    /// The transport's counters.
    pub fn stats(&self) -> TcpStats {
        self.node.shared.stats.snapshot()
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.node.shared.lock().endpoint.session_count()
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
