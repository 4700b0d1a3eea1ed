//! The engine-facing handles: [`TcpSender`] (prefill side) and [`TcpReceiver`] (decode side),
//! one generic [`TcpNode`] with each role's engine commands on top.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use kvpipe_core::{
    ConfigError, DataPath, Endpoint, PeerId, Receiver, ReceiverConfig, Sender, SenderConfig,
};
use kvpipe_driver::{Driven, Driver};

use crate::blocking::Threads;
use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::node::lifecycle::{CloseError, Node};
use crate::node::{Spawn, TcpIo};
use crate::stats::TcpStats;

/// A core endpoint driven over TCP with std threads: a [`TcpSender`] or a [`TcpReceiver`].
///
/// Connect to (or accept) peers, give the role's engine commands, and read [`Event`](kvpipe_core::Event)s with
/// [`next_event`](Driver::next_event).
pub struct TcpNode<E: Endpoint + Send + 'static> {
    node: Node<E>,
}

/// A prefill-side node: a core [`Sender`] driven over TCP with std threads.
///
/// Connect to (or accept) receivers, open requests naming their [`PeerId`]s, submit chunks as
/// prefill computes them, and read [`Event`](kvpipe_core::Event)s with [`next_event`](Driver::next_event). Source
/// bytes are read from the registered regions (the layout's pool regions) at send time, so a
/// request's blocks must not change until its `Quiesced` event.
pub type TcpSender = TcpNode<Sender>;

/// A decode-side node: a core [`Receiver`] driven over TCP with std threads.
///
/// Register a request's destination blocks with [`register`](Driver::register): every
/// incoming data write is admitted by the core ([`Receiver::admit_write`]: that request's
/// grant, one of its writers, inside its blocks, overlapping no write in flight) before a byte
/// is read into memory.
pub type TcpReceiver = TcpNode<Receiver>;

/// Exclusive access to a TCP node's core endpoint (see [`kvpipe_driver::EndpointGuard`]).
pub type EndpointGuard<E> = kvpipe_driver::EndpointGuard<E, TcpIo>;

/// The engine's commands, events and counters are the driver's: `submit_chunk`, `register`,
/// `cancel`, `retire`, `next_event`, `counters`, ... (see [`Driver`]).
impl<E: Endpoint + Send + 'static> std::ops::Deref for TcpNode<E> {
    type Target = Driver<E, TcpIo>;
    fn deref(&self) -> &Driver<E, TcpIo> {
        &self.node.shared.driver
    }
}

impl<E: Endpoint + Send + 'static> Driven for TcpNode<E> {
    type Endpoint = E;
    type Io = TcpIo;
    fn driver(&self) -> &Arc<Driver<E, TcpIo>> {
        &self.node.shared.driver
    }
}

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
    /// ([`Event::PeerReady`](kvpipe_core::Event::PeerReady) or
    /// [`Event::PeerRejected`](kvpipe_core::Event::PeerRejected) follows), except that a sender
    /// offering peer copies ([`TcpConfig::data_path`](crate::TcpConfig::data_path) `Auto` or
    /// `PeerCopy`) returns only once the handshake decided the peer's data path, bounded by
    /// [`TcpConfig::preamble_timeout`](crate::TcpConfig::preamble_timeout): on `PeerCopy` an
    /// offer declined, or no answer in time, is the error (on `Auto` only the latter). A node
    /// numbers its peers from 0, in the order they connect or are accepted.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.node.connect(addr)
    }

    /// Exclusive access to the core endpoint; outputs are carried out when the guard drops.
    pub fn endpoint(&self) -> EndpointGuard<E> {
        self.node.shared.driver.guard()
    }

    /// The peers now (assembling their connections, handshaking, ready or closing).
    pub fn peers(&self) -> Vec<PeerId> {
        self.node.peers()
    }

    /// The transport's counters.
    pub fn stats(&self) -> TcpStats {
        self.node.shared.stats.snapshot()
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
    /// the core cannot run pipelined transfer with `config`. TCP never reuses a peer id, so
    /// the sender runs with [`SenderConfig::peer_ids_reused`] `false`.
    pub fn new(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
    ) -> Result<Self, ConfigError> {
        Self::with_spawn(config, tcp, regions, Box::new(Threads))
    }

    /// A node whose connection halves run where `spawn` starts them.
    pub(crate) fn with_spawn(
        mut config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        spawn: Box<dyn Spawn>,
    ) -> Result<Self, ConfigError> {
        // Connections are numbered upwards: a departed peer's id never comes back.
        config.peer_ids_reused = false;
        Ok(TcpNode {
            node: Node::new(Sender::new(config)?, tcp, regions, spawn),
        })
    }
}

impl TcpNode<Receiver> {
    /// A node around a core receiver, landing payloads in `regions`; or the first reason the
    /// core cannot run pipelined transfer with `config`.
    ///
    /// TCP applies every data write itself, so the receiver runs with
    /// [`DataPath::Landed`] whatever `config.data_path` says, and with
    /// [`ReceiverConfig::peer_ids_reused`] `false` (a peer id is never reused).
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
        // Connections are numbered upwards: a departed peer's id never comes back.
        config.peer_ids_reused = false;
        Ok(TcpNode {
            node: Node::new(Receiver::new(config)?, tcp, regions, spawn),
        })
    }
}
