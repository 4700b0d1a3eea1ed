//! The handle: one core endpoint over one transport, shared between threads.

use std::net::SocketAddr;
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use kvpipe_core::session::{Counters, Registration, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, Event, Instant, LayerGroupLayout, LayerRange, PeerId, Receiver,
    ReceiverSliceId, RequestId, Sender, Side, Submitted,
};
use kvpipe_tcp::{TcpConfig, TcpNode};

use crate::config::{check_regions, region_bytes, tcp_regions, NodeConfig, RawRegion};
use crate::mem::{self, MemSide};
use crate::role::Role;
use crate::stats::DataPathStats;
use crate::transport::Transport;
use crate::EmbedError;

/// A prefill-side handle: a core [`Sender`] over a transport.
pub type PrefillNode = Node<Sender>;
/// A decode-side handle: a core [`Receiver`] over a transport.
pub type DecodeNode = Node<Receiver>;

/// The longest single wait handed to a transport (longer timeouts wait in several slices).
const LONGEST_WAIT: Duration = Duration::from_millis(100);

pub(crate) enum Inner<E: Role> {
    Tcp(TcpNode<E>),
    Mem(MemSide),
    #[cfg(feature = "verbs")]
    Verbs(kvpipe_ibverbs::VerbsNode<E>),
}

/// One core endpoint driven by a transport, usable from several threads at once (`&self`
/// everywhere): a [`PrefillNode`] drives a core [`Sender`], a [`DecodeNode`] a core
/// [`Receiver`]. Made by [`PrefillNode::new`] / [`DecodeNode::new`] on the transport the
/// configuration names, or both at once in this process by [`mem_pair`].
///
/// Its methods, as the crate doc lays them out:
///
/// - **Getters**: [`transport`](Self::transport), [`is_peer_ready`](Self::is_peer_ready),
///   [`counters`](Self::counters), [`session_count`](Self::session_count).
/// - **Commands**: [`listen`](Self::listen) / [`connect`](Self::connect) (across processes);
///   prefill: [`open_request`](Self::open_request), [`submit_prefix`](Self::submit_prefix),
///   [`submit_chunk`](Self::submit_chunk) (or, layer range by layer range,
///   [`submit_chunk_layers`](Self::submit_chunk_layers)), [`submit_aux`](Self::submit_aux),
///   [`cancel`](Self::cancel), [`retire`](Self::retire); decode:
///   [`register`](Node::register), [`cancel`](Node::cancel), [`retire`](Node::retire); and
///   [`close`](Self::close). Each is applied to the endpoint at once (its error is the core's,
///   with the endpoint unchanged) and what it produced is handed to the transport before it
///   returns; [`command`](Self::command) runs any other endpoint call the same way.
/// - **Events**: [`next_event`](Self::next_event), one at a time in the order the endpoint
///   emitted them. Per request, every outcome (`Completed`, `Failed`, `TimedOut`,
///   `Cancelled`) is followed by `Quiesced`; only then may the engine reuse the request's
///   blocks and [`retire`](Self::retire) it.
///
/// Dropping a node closes it (bounded by the transport's close grace).
pub struct Node<E: Role> {
    inner: RwLock<Option<Inner<E>>>,
}

impl<E: Role> Node<E> {
    pub(crate) fn from_inner(inner: Inner<E>) -> Self {
        Node {
            inner: RwLock::new(Some(inner)),
        }
    }

    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&Inner<E>) -> Result<T, EmbedError>,
    ) -> Result<T, EmbedError> {
        let guard = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(inner) => f(inner),
            None => Err(EmbedError::Closed),
        }
    }

    fn read<T>(&self, f: impl FnOnce(&E) -> T) -> Result<T, EmbedError> {
        self.with(|inner| {
            Ok(match inner {
                Inner::Tcp(node) => f(&node.endpoint()),
                Inner::Mem(side) => side.read(|e: &mut E| f(e)),
                #[cfg(feature = "verbs")]
                Inner::Verbs(node) => f(&node.endpoint()),
            })
        })
    }
}

/// # Getters
impl<E: Role> Node<E> {
    /// The transport's name: `"tcp"`, `"mem"` or `"verbs"` (as [`Transport::name`]).
    pub fn transport(&self) -> Result<&'static str, EmbedError> {
        self.with(|inner| {
            Ok(match inner {
                Inner::Tcp(_) => "tcp",
                Inner::Mem(_) => "mem",
                #[cfg(feature = "verbs")]
                Inner::Verbs(_) => "verbs",
            })
        })
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> Result<bool, EmbedError> {
        self.read(|e| e.is_peer_ready(peer))
    }

    /// The core endpoint's counters.
    pub fn counters(&self) -> Result<Counters, EmbedError> {
        self.read(|e| *e.counters())
    }

    /// Sessions the endpoint still holds (not retired).
    pub fn session_count(&self) -> Result<usize, EmbedError> {
        self.read(|e| e.session_count())
    }

    /// The path this node's KV takes and what its transport counted on it.
    pub fn data_path(&self) -> Result<DataPathStats, EmbedError> {
        self.with(|inner| {
            Ok(match inner {
                Inner::Tcp(node) => {
                    let stats = node.stats();
                    DataPathStats {
                        path: if stats.peer_copy_peers > 0 {
                            "peer-copy"
                        } else {
                            "socket"
                        },
                        bytes_placed: stats.bytes_placed,
                        writes_placed: stats.writes_placed,
                        writes_refused: stats.writes_refused,
                    }
                }
                Inner::Mem(_) => DataPathStats {
                    path: "mem",
                    ..DataPathStats::default()
                },
                #[cfg(feature = "verbs")]
                Inner::Verbs(_) => DataPathStats {
                    path: "rdma",
                    ..DataPathStats::default()
                },
            })
        })
    }
}

/// # Commands of both roles
///
/// The role's own commands are on [`PrefillNode`] (open, submit, cancel, retire) and
/// [`DecodeNode`] (register, cancel, retire).
impl<E: Role> Node<E> {
    /// Connects to a peer listening at `addr` (TCP, or the verbs side channel) and returns the
    /// id this node gives it; the handshake goes on in the background ([`Event::PeerReady`] or
    /// [`Event::PeerRejected`]). One exception: a prefill node over TCP whose
    /// [`TcpConfig::data_path`] is [`Auto`](crate::TcpDataPath::Auto) or
    /// [`PeerCopy`](crate::TcpDataPath::PeerCopy) offers peer copies in its handshake, and
    /// `connect` returns only once the decode side answered and the peer's data path is
    /// decided, bounded by [`TcpConfig::preamble_timeout`]. A declined offer leaves the peer on
    /// the sockets (`Auto`) or is the error, saying why (`PeerCopy`); no answer in time is an
    /// error on both. An error closes the peer.
    pub fn connect(&self, addr: &str) -> Result<PeerId, EmbedError> {
        self.with(|inner| match inner {
            Inner::Tcp(node) => node
                .connect(addr)
                .map_err(|e| naming(e, "connect to", addr)),
            Inner::Mem(_) => Err(unsupported("connect")),
            #[cfg(feature = "verbs")]
            Inner::Verbs(node) => node
                .connect(addr)
                .map_err(|e| naming(e, "connect to", addr)),
        })
    }

    /// Accepts peers on `addr` (TCP, or the verbs transport's TCP side channel; port 0 picks
    /// a free one) and returns the bound address.
    pub fn listen(&self, addr: &str) -> Result<SocketAddr, EmbedError> {
        self.with(|inner| match inner {
            Inner::Tcp(node) => node.listen(addr).map_err(|e| naming(e, "listen on", addr)),
            Inner::Mem(_) => Err(unsupported("listen")),
            #[cfg(feature = "verbs")]
            Inner::Verbs(node) => node.listen(addr).map_err(|e| naming(e, "listen on", addr)),
        })
    }

    /// Runs one engine command on the endpoint with the transport's `now`; the transport
    /// carries out what it produced before this returns.
    pub fn command<T>(
        &self,
        f: impl FnOnce(&mut E, Instant) -> Result<T, UsageError>,
    ) -> Result<T, EmbedError> {
        self.with(|inner| match inner {
            Inner::Tcp(node) => {
                let mut endpoint = node.endpoint();
                let now = endpoint.now();
                Ok(f(&mut endpoint, now)?)
            }
            Inner::Mem(side) => side.command(f),
            #[cfg(feature = "verbs")]
            Inner::Verbs(node) => {
                let mut endpoint = node.endpoint();
                let now = endpoint.now();
                Ok(f(&mut endpoint, now)?)
            }
        })
    }

    /// Closes the node: over TCP every peer is closed in order (what was queued reaches it
    /// first), over verbs every link (queued frames and writes are sent and acknowledged
    /// first), both bounded by `within`; an in-process handle lets go of its side of the pair
    /// once no write batch in flight can still touch its regions (bounded by the pair's drain
    /// limit, not `within`), and the other side loses it at once (its requests with this node
    /// fail with `PeerLost`, as over TCP).
    /// A `next_event` waiting on another thread returns [`EmbedError::Closed`] within 100 ms.
    /// Every later call returns [`EmbedError::Closed`]. Dropping the node closes it too, bounded
    /// by the transport's close grace (verbs: at once).
    pub fn close(&self, within: Duration) -> Result<(), EmbedError> {
        let taken = self
            .inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match taken {
            Some(Inner::Tcp(node)) => Ok(node.close(within)?),
            Some(Inner::Mem(side)) => side.close(),
            #[cfg(feature = "verbs")]
            Some(Inner::Verbs(node)) => crate::verbs::closed(node.close(within)),
            None => Err(EmbedError::Closed),
        }
    }
}

/// # Events
impl<E: Role> Node<E> {
    /// The endpoint's next event, waiting up to `timeout` (`Ok(None)`: none came in time; a
    /// timeout too long to add to the clock waits until an event comes).
    pub fn next_event(&self, timeout: Duration) -> Result<Option<Event>, EmbedError> {
        let deadline = std::time::Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(LONGEST_WAIT, |d| {
                d.saturating_duration_since(std::time::Instant::now())
            });
            let wait = left.min(LONGEST_WAIT);
            // The node is held for one slice at a time, so a `close` from another thread waits
            // for at most one slice.
            let event = self.with(|inner| match inner {
                Inner::Tcp(node) => Ok(node.next_event(wait)),
                Inner::Mem(side) => side.next_event(wait),
                #[cfg(feature = "verbs")]
                Inner::Verbs(node) => Ok(node.next_event(wait)),
            })?;
            if event.is_some() || (deadline.is_some() && wait == left) {
                return Ok(event);
            }
        }
    }
}

/// `config` over TCP with its `tcp` settings.
fn over_tcp(config: &NodeConfig) -> NodeConfig {
    let tcp: TcpConfig = config.tcp.clone();
    config.clone().with_transport(Transport::Tcp(tcp))
}

/// The refusal of a lone in-process node.
fn mem_alone() -> EmbedError {
    EmbedError::Unsupported {
        operation: "making one node alone (mem_pair makes both sides of a pair in this process)",
        transport: "mem",
    }
}

/// A socket error of `what` (`connect to`, `listen on`) `addr`, saying so: the transport's own
/// message ("connection timed out") names neither.
fn naming(error: std::io::Error, what: &str, addr: &str) -> EmbedError {
    EmbedError::Io(std::io::Error::new(
        error.kind(),
        format!("{what} {addr}: {error}"),
    ))
}

fn unsupported(operation: &'static str) -> EmbedError {
    EmbedError::Unsupported {
        operation,
        transport: "mem",
    }
}

/// # Prefill: construction and commands
impl Node<Sender> {
    /// A prefill node over `config.transport` reading source bytes from `regions`, or the
    /// first reason it cannot be made: a region refused (duplicate id, null address, GPU memory
    /// this build or machine cannot serve, a pool without memory), a configuration that cannot
    /// run pipelined transfer, no RDMA device (verbs), or [`Transport::Mem`], whose two sides
    /// [`mem_pair`] makes together.
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn new(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        check_regions(config, regions, Side::Sender)?;
        let mut core = config.sender_config();
        core.region_bytes = region_bytes(regions);
        let inner = match &config.transport {
            Transport::Mem => return Err(mem_alone()),
            Transport::Tcp(tcp) => {
                // SAFETY: forwarded from the caller.
                let table = unsafe { tcp_regions(regions)? };
                Inner::Tcp(kvpipe_tcp::TcpSender::new(core, tcp.clone(), table)?)
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(verbs) => {
                // The configuration's errors before the device's, as on the other transports.
                core.pipeline.validate()?;
                // SAFETY: forwarded from the caller.
                let (device, table) =
                    unsafe { crate::verbs::open(verbs, regions, kvpipe_ibverbs::Exposure::Local)? };
                Inner::Verbs(kvpipe_ibverbs::VerbsSender::sender(
                    core,
                    device,
                    table,
                    crate::verbs::node_config(verbs),
                )?)
            }
        };
        Ok(Node::from_inner(inner))
    }

    /// A prefill node over TCP with `config.tcp`'s settings (whatever `config.transport` says):
    /// [`new`](Self::new) with [`Transport::Tcp`].
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn tcp(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::new(&over_tcp(config), regions) }
    }

    /// Opens a request before its first chunk (see [`Sender::open_request`]).
    pub fn open_request(&self, request: SendRequest) -> Result<(), EmbedError> {
        self.command(|s, now| s.open_request(now, request))
    }

    /// Submits a computed prefill chunk; `source` answers the core's bounded block queries
    /// (see [`Sender::submit_chunk`]). The queries run with the node unlocked, so the
    /// transport's connections go on meanwhile (`source` may even call into this node); the
    /// chunk is checked again when the answers are applied. The outcome: the slice sent,
    /// nothing (the chunk completes no block), or the engine's fault (the request failed on
    /// both sides; see [`Submitted`]).
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, EmbedError> {
        kvpipe_driver::submit_chunk(&SenderCommands(self), request, spec, source)
    }

    /// Submits layers `layers` of a computed prefill chunk, as the engine finishes them (see
    /// [`Sender::submit_chunk_layers`] for the rules): the chunk's first range (from layer 0)
    /// asks `source` for its blocks, with the node unlocked as in
    /// [`submit_chunk`](Self::submit_chunk); each later range (the same `spec`, from where the
    /// previous one ended, up to the rank's layer count) writes its layers of those blocks
    /// and asks nothing. Layers are counted in the order the engine computes them
    /// ([`NodeConfig::layer_order`](crate::NodeConfig::layer_order)). Each range that writes
    /// something is a slice of its own, so the last chunk's transfer overlaps its own compute
    /// (vLLM's `save_kv_layer`, TensorRT-LLM's `KVSlice::layer_range`). `None`: the range
    /// writes nothing.
    pub fn submit_chunk_layers(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, EmbedError> {
        kvpipe_driver::submit_chunk_layers(&SenderCommands(self), request, spec, layers, source)
    }

    /// The layers of this node's rank (every layer group's): a chunk submitted in layer ranges
    /// ([`submit_chunk_layers`](Self::submit_chunk_layers)) ends with the range that reaches
    /// it.
    pub fn layer_count(&self) -> Result<u32, EmbedError> {
        self.read(|s| s.layer_count())
    }

    /// Sends the request's cached prefix before its first chunk (see
    /// [`Sender::submit_prefix`]); `source` is asked with the node unlocked, as
    /// [`submit_chunk`](Self::submit_chunk) asks it.
    pub fn submit_prefix(
        &self,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, EmbedError> {
        kvpipe_driver::submit_prefix(
            &SenderCommands(self),
            request,
            prompt_len,
            prepopulated_len,
            source,
        )
    }

    /// Submits the request's aux data (first generated tokens, draft tokens, counts). Aux data
    /// at or after the request's aux deadline times the request out ([`Event::TimedOut`]) and
    /// returns [`UsageError::SessionEnded`] (see [`kvpipe_core::Sender::submit_aux`]).
    pub fn submit_aux(&self, request: RequestId, aux: AuxData) -> Result<(), EmbedError> {
        self.command(|s, now| s.submit_aux(now, request, aux))
    }

    /// Cancels a request (see [`Sender::cancel`]).
    pub fn cancel(&self, request: RequestId) -> Result<(), EmbedError> {
        self.command(|s, now| s.cancel(now, request))
    }

    /// Retires a request after its [`Event::Quiesced`] (see [`Sender::retire`]).
    pub fn retire(&self, request: RequestId) -> Result<(), EmbedError> {
        self.command(|s, now| s.retire(now, request))
    }
}

/// A prefill node's commands, as the driver's submission in two steps takes them
/// ([`kvpipe_driver::submit_chunk`]): every transport's, the in-process pair's too (kept out of
/// the node's public API).
struct SenderCommands<'a>(&'a Node<Sender>);

impl kvpipe_driver::SenderLock for SenderCommands<'_> {
    type Error = EmbedError;

    fn with_sender<R>(
        &self,
        f: impl FnOnce(&mut Sender, Instant) -> Result<R, UsageError>,
    ) -> Result<R, EmbedError> {
        self.0.command(f)
    }
}

/// # Decode: construction and commands
impl Node<Receiver> {
    /// A decode node over `config.transport` landing admitted writes in `regions`, or the
    /// first reason it cannot be made (as [`PrefillNode::new`], and two regions that share
    /// memory: [`EmbedError::OverlappingRegions`]).
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn new(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        check_regions(config, regions, Side::Receiver)?;
        let mut core = config.receiver_config();
        core.region_bytes = region_bytes(regions);
        let inner = match &config.transport {
            Transport::Mem => return Err(mem_alone()),
            Transport::Tcp(tcp) => {
                // SAFETY: forwarded from the caller.
                let table = unsafe { tcp_regions(regions)? };
                Inner::Tcp(kvpipe_tcp::TcpReceiver::new(core, tcp.clone(), table)?)
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(verbs) => {
                core.pipeline.validate()?;
                // SAFETY: forwarded from the caller.
                let (device, table) = unsafe {
                    crate::verbs::open(verbs, regions, kvpipe_ibverbs::Exposure::RemoteWrite)?
                };
                Inner::Verbs(kvpipe_ibverbs::VerbsReceiver::receiver(
                    core,
                    device,
                    table,
                    crate::verbs::node_config(verbs),
                )?)
            }
        };
        Ok(Node::from_inner(inner))
    }

    /// The layer groups `peer` declared in its handshake (its layout: windows, heads, layers),
    /// or `None` before the handshake completed or once the peer is gone.
    pub fn peer_groups(&self, peer: PeerId) -> Result<Option<Vec<LayerGroupLayout>>, EmbedError> {
        self.read(|e: &Receiver| e.peer_groups(peer).map(<[_]>::to_vec))
    }

    /// A decode node over TCP with `config.tcp`'s settings (whatever `config.transport` says):
    /// [`new`](Self::new) with [`Transport::Tcp`].
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn tcp(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::new(&over_tcp(config), regions) }
    }

    /// Registers a request's destination blocks and its writers (see [`Receiver::register`]).
    pub fn register(&self, registration: Registration) -> Result<ReceiverSliceId, EmbedError> {
        self.command(|r, now| r.register(now, registration))
    }

    /// Cancels a request (see [`Receiver::cancel`]).
    pub fn cancel(&self, request: RequestId) -> Result<(), EmbedError> {
        self.command(|r, now| r.cancel(now, request))
    }

    /// Retires a request after its [`Event::Quiesced`] (see [`Receiver::retire`]).
    pub fn retire(&self, request: RequestId) -> Result<(), EmbedError> {
        self.command(|r, now| r.retire(now, request))
    }
}

/// A prefill and a decode handle connected in this process (`kvpipe-mem`), whatever the
/// configurations' `transport`: write batches are memory copies on the transport's copy threads
/// (`memcpy` between host regions; the GPU's copy engines where a region is GPU memory, `cuda`
/// feature); frames go through the wire codec. Each side's regions are checked and registered
/// (as [`PrefillNode::new`] checks them), the connection is made, and the handshake completes
/// as the handles are polled ([`Event::PeerReady`] on each side). The prefill side names the
/// decode side [`MEM_RECEIVER_PEER`](crate::MEM_RECEIVER_PEER); the decode side names it
/// [`MEM_SENDER_PEER`](crate::MEM_SENDER_PEER).
///
/// Closing or dropping one handle loses it for the other at once, as a TCP peer's close does:
/// once no write batch in flight can touch the closed side's regions, the other side's
/// requests with it fail with [`TransferStatus::PeerLost`](kvpipe_core::wire::TransferStatus)
/// and [`is_peer_ready`](Node::is_peer_ready) turns false; no later write reaches the closed
/// side.
///
/// # Safety
/// Every region follows [`RawRegion`]'s contract until both handles are dropped, or, for one
/// side's regions, until that side's [`close`](Node::close) returned `Ok`.
pub unsafe fn mem_pair(
    sender: &NodeConfig,
    sender_regions: &[RawRegion],
    receiver: &NodeConfig,
    receiver_regions: &[RawRegion],
) -> Result<(Node<Sender>, Node<Receiver>), EmbedError> {
    // SAFETY: forwarded from the caller.
    let (tx, rx) = unsafe { mem::sides(sender, sender_regions, receiver, receiver_regions)? };
    Ok((
        Node::from_inner(Inner::Mem(tx)),
        Node::from_inner(Inner::Mem(rx)),
    ))
}
