//! The verbs node: the one place that feeds the core's [`Sender`] / [`Receiver`] from the fabric
//! and carries out what they ask. Everything verbs-specific is in the [`Fabric`] below it;
//! this module maps its events onto the endpoints' inputs and their outputs onto fabric calls:
//!
//! | fabric → core | core → fabric |
//! |---|---|
//! | `Connected` → `PeerConnected` | `Transmit` → encode, [`Fabric::send`] |
//! | `Message` → decode → `FrameReceived` | `ExecuteWrites` → [`Fabric::post_writes`] |
//! | `WritesDone` → `WritesCompleted` / `WritesFailed` | `ClosePeer` → [`Fabric::close`] |
//! | `Disconnected` → `PeerDisconnected` | `Event` → the engine's queue |
//! | timer → `Timeout` at `poll_timeout()` | |
//!
//! A peer is a link: `PeerId(n)` is `LinkId(n)`. Nothing here holds a frame back or checks a
//! write: a result frame travels on the same queue pair after the writes it reports, and RC
//! places those writes first; a peer is reported disconnected only after its queue pair is
//! destroyed.
//!
//! The lock, the draining, the timer, the events and the engine's commands are
//! [`kvpipe_driver`]'s. The completion poller never waits for the engine: fabric events are
//! posted to the driver's inbox ([`Driver::post`]), applied at once if the node's lock is free,
//! else by whoever takes the lock next, so a frame that arrived while the engine held its
//! endpoint is seen before any deadline is checked. The poller retries the lock on every round
//! while the inbox is not empty.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use kvpipe_core::session::{CloseReason, DataPath, DataWriteHeaders, TransportInput, WriteBatchId};
use kvpipe_core::Endpoint as CoreEndpoint;
use kvpipe_core::{PeerId, Receiver, ReceiverConfig, Sender, SenderConfig, WritePlan};
use kvpipe_driver::{Arrival, Driven, Driver, Io, Posted, WallInstant};

use crate::device::VerbsDevice;
use crate::fabric::{
    Fabric, FabricConfig, FabricEvent, FabricHandler, LinkId, Posted as FabricPosted, WriteFailure,
};
use crate::memory::MemoryTable;

/// What the driver needs from a core endpoint: the transport contract's [`CoreEndpoint`],
/// owned by the node's threads.
pub(crate) trait Endpoint: CoreEndpoint + Send + 'static {}

impl<E: CoreEndpoint + Send + 'static> Endpoint for E {}

/// Configuration of a verbs node.
#[derive(Clone, Debug, Default)]
pub struct VerbsConfig {
    /// The fabric's sizes and timeouts.
    pub fabric: FabricConfig,
    /// The instant the node's clock counts from (default: when the node is made). Nodes that
    /// compare event times share one.
    pub origin: Option<std::time::Instant>,
}

fn link(peer: PeerId) -> LinkId {
    LinkId(peer.0)
}

/// The verbs side of a node, behind the driver's lock: the endpoint's outputs as fabric calls.
pub struct VerbsIo {
    fabric: Arc<OnceLock<Fabric>>,
}

impl Io for VerbsIo {
    fn transmit(&mut self, peer: PeerId, bytes: Bytes) {
        if let Some(fabric) = self.fabric.get() {
            // A link that is down reports its disconnect; nothing to do here.
            let _ = fabric.send(link(peer), bytes.to_vec());
        }
    }

    fn post_writes(
        &mut self,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &WritePlan,
        _headers: &DataWriteHeaders,
    ) -> Posted {
        let Some(fabric) = self.fabric.get() else {
            return Posted::NoPeer;
        };
        match fabric.post_writes(link(peer), batch.0, plan.extents()) {
            Ok(FabricPosted::Queued) => Posted::Queued { done: false },
            Ok(FabricPosted::Done) => Posted::Empty,
            Err(WriteFailure::LinkDown(_)) => Posted::NoPeer,
            Err(_) => Posted::Refused,
        }
    }

    fn close_peer(&mut self, peer: PeerId, reason: CloseReason) -> Option<WallInstant> {
        // After a refused handshake the peer should still read why.
        let graceful = matches!(
            reason,
            CloseReason::HandshakeRejected
                | CloseReason::RejectedByPeer
                | CloseReason::ProtocolViolation
        );
        if let Some(fabric) = self.fabric.get() {
            fabric.close(link(peer), graceful);
        }
        None
    }
}

/// The fabric's events, as the driver's arrivals.
struct Handler<E: Endpoint>(Arc<Driver<E, VerbsIo>>);

impl<E: Endpoint> FabricHandler for Handler<E> {
    fn handle(&self, event: FabricEvent) {
        let arrival = match event {
            FabricEvent::Connected { link } => Arrival::Input(TransportInput::PeerConnected {
                peer: PeerId(link.0),
            }),
            // The core decodes it at the negotiated version; bytes that are no frame fail the
            // peer's sessions and close it.
            FabricEvent::Message { link, bytes } => Arrival::Input(TransportInput::FrameReceived {
                peer: PeerId(link.0),
                bytes: bytes.into(),
            }),
            FabricEvent::WritesDone { token, result, .. } => Arrival::BatchDone {
                batch: WriteBatchId(token),
                ok: result.is_ok(),
            },
            FabricEvent::Disconnected { link, .. } => Arrival::PeerGone(PeerId(link.0)),
        };
        self.0.post(arrival);
    }

    fn idle(&self) {
        self.0.try_settle();
    }
}

/// A core endpoint driven over RDMA verbs: [`VerbsSender`] (prefill side) or
/// [`VerbsReceiver`] (decode side).
///
/// Make one with [`VerbsNode::sender`] / [`VerbsNode::receiver`] over an opened device and
/// the node's registered memory, then [`listen`](Self::listen) and/or
/// [`connect`](Self::connect); every link is a peer. Engine commands, events and counters are
/// the driver's ([`Driver`], which the node dereferences to: `submit_chunk`, `register`,
/// `next_event`, ...) or go through the [`endpoint`](Self::endpoint) guard.
#[allow(private_bounds)]
pub struct VerbsNode<E: Endpoint> {
    driver: Arc<Driver<E, VerbsIo>>,
    fabric: Arc<OnceLock<Fabric>>,
    timer: Option<JoinHandle<()>>,
}

/// A prefill-side node: a core [`Sender`] over verbs. Its regions are registered
/// [`Exposure::Local`](crate::Exposure::Local).
pub type VerbsSender = VerbsNode<Sender>;
/// A decode-side node: a core [`Receiver`] over verbs. Its regions are registered
/// [`Exposure::RemoteWrite`](crate::Exposure::RemoteWrite).
pub type VerbsReceiver = VerbsNode<Receiver>;

/// Exclusive access to a verbs node's core endpoint (see [`kvpipe_driver::EndpointGuard`]).
pub type EndpointGuard<E> = kvpipe_driver::EndpointGuard<E, VerbsIo>;

#[allow(private_bounds)]
impl<E: Endpoint> VerbsNode<E> {
    fn start(
        endpoint: E,
        device: VerbsDevice,
        memory: MemoryTable,
        config: VerbsConfig,
    ) -> io::Result<Self> {
        let fabric = Arc::new(OnceLock::new());
        let io = VerbsIo {
            fabric: fabric.clone(),
        };
        let origin = config.origin.unwrap_or_else(std::time::Instant::now);
        let driver = Driver::new(endpoint, io, "verbs", origin);
        let made = Fabric::new(
            device,
            memory,
            config.fabric,
            Arc::new(Handler(driver.clone())),
        )?;
        let _ = fabric.set(made);
        let timer = driver.spawn_timer("kvpipe-verbs-timer")?;
        Ok(VerbsNode {
            driver,
            fabric,
            timer: Some(timer),
        })
    }

    /// The fabric under the node (links, device, failure injection for tests).
    pub fn fabric(&self) -> &Fabric {
        self.fabric.get().expect("set at start")
    }

    /// Accepts connections on `addr`; each becomes a peer.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        self.fabric().listen(addr)
    }

    /// Connects to a node listening at `addr`; the handshake starts at once. Peers are numbered
    /// from 0 in the order links come up. Do not call it while holding an
    /// [`EndpointGuard`].
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.fabric().connect(addr).map(|l| PeerId(l.0))
    }

    /// Exclusive access to the core endpoint; outputs are carried out when the guard drops.
    pub fn endpoint(&self) -> EndpointGuard<E> {
        self.driver.guard()
    }

    /// The peers whose links are up or closing.
    pub fn peers(&self) -> Vec<PeerId> {
        self.fabric()
            .links()
            .into_iter()
            .map(|l| PeerId(l.0))
            .collect()
    }

    /// Closes every link, gracefully within `within` (queued frames and writes are sent and
    /// acknowledged first), then stops the node. Returns whether every link closed in order.
    pub fn close(mut self, within: StdDuration) -> bool {
        let clean = self.fabric().close_all(true, within);
        self.stop();
        clean
    }

    /// Closes every link at once and stops the node (what dropping it does).
    pub fn shutdown(&self) {
        self.fabric().shutdown();
    }

    fn stop(&mut self) {
        self.fabric().shutdown();
        self.driver.stop();
        if let Some(t) = self.timer.take() {
            let _ = t.join();
        }
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> std::ops::Deref for VerbsNode<E> {
    type Target = Driver<E, VerbsIo>;
    fn deref(&self) -> &Driver<E, VerbsIo> {
        &self.driver
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> Driven for VerbsNode<E> {
    type Endpoint = E;
    type Io = VerbsIo;
    fn driver(&self) -> &Arc<Driver<E, VerbsIo>> {
        &self.driver
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> Drop for VerbsNode<E> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl VerbsNode<Sender> {
    /// A prefill-side node on `device` reading sources from `memory`.
    pub fn sender(
        config: SenderConfig,
        device: VerbsDevice,
        memory: MemoryTable,
        verbs: VerbsConfig,
    ) -> io::Result<Self> {
        // Links are numbered upwards: a departed peer's id never comes back.
        let mut config = config;
        config.peer_ids_reused = false;
        let sender = Sender::new(config).map_err(io::Error::other)?;
        Self::start(sender, device, memory, verbs)
    }
}

impl VerbsNode<Receiver> {
    /// A decode-side node on `device` exposing `memory`'s remote-write regions to its peers.
    pub fn receiver(
        config: ReceiverConfig,
        device: VerbsDevice,
        memory: MemoryTable,
        verbs: VerbsConfig,
    ) -> io::Result<Self> {
        // RC places a writer's data before its later frames: results are trusted on arrival.
        let mut config = config;
        config.data_path = DataPath::Ordered;
        // Links are numbered upwards: a departed peer's id never comes back.
        config.peer_ids_reused = false;
        let receiver = Receiver::new(config).map_err(io::Error::other)?;
        Self::start(receiver, device, memory, verbs)
    }
}
