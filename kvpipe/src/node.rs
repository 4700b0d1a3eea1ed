//! The handle: one core endpoint over one transport, shared between threads.

use std::net::SocketAddr;
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use kvpipe_core::session::{Counters, Registration, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, Event, Instant, PeerId, Receiver, ReceiverSliceId, RequestId, Sender,
    SenderSliceId,
};
use kvpipe_tcp::{TcpNode, TcpReceiver, TcpSender};

use crate::config::{check_regions, tcp_regions, NodeConfig, RawRegion};
use crate::mem::{self, MemSide};
use crate::role::Role;
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
}

/// One core endpoint driven by a transport, usable from several threads at once: engine
/// commands (each applied at once and carried out by the transport), a blocking
/// [`next_event`](Self::next_event), and [`close`](Self::close). Made by
/// [`PrefillNode::tcp`], [`DecodeNode::tcp`] or [`mem_pair`](crate::mem_pair).
pub struct Node<E: Role> {
    inner: RwLock<Option<Inner<E>>>,
}

impl<E: Role> Node<E> {
    pub(crate) fn from_inner(inner: Inner<E>) -> Self {
        Node {
            inner: RwLock::new(Some(inner)),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&Inner<E>) -> Result<T, EmbedError>) -> Result<T, EmbedError> {
        let guard = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(inner) => f(inner),
            None => Err(EmbedError::Closed),
        }
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
        })
    }

    fn read<T>(&self, f: impl FnOnce(&E) -> T) -> Result<T, EmbedError> {
        self.with(|inner| {
            Ok(match inner {
                Inner::Tcp(node) => f(&node.endpoint()),
                Inner::Mem(side) => side.read(|e: &mut E| f(e)),
            })
        })
    }

    /// The transport's name: `"tcp"` or `"mem"`.
    pub fn transport(&self) -> Result<&'static str, EmbedError> {
        self.with(|inner| {
            Ok(match inner {
                Inner::Tcp(_) => "tcp",
                Inner::Mem(_) => "mem",
            })
        })
    }

    /// Accepts peers on `addr` (TCP; port 0 picks a free one) and returns the bound address.
    pub fn listen(&self, addr: &str) -> Result<SocketAddr, EmbedError> {
        self.with(|inner| match inner {
            Inner::Tcp(node) => Ok(node.listen(addr)?),
            Inner::Mem(_) => Err(unsupported("listen")),
        })
    }

    /// Connects to a peer listening at `addr` (TCP) and returns the id this node gives it; the
    /// handshake goes on in the background ([`Event::PeerReady`] or [`Event::PeerRejected`]).
    pub fn connect(&self, addr: &str) -> Result<PeerId, EmbedError> {
        self.with(|inner| match inner {
            Inner::Tcp(node) => Ok(node.connect(addr)?),
            Inner::Mem(_) => Err(unsupported("connect")),
        })
    }

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
            })?;
            if event.is_some() || (deadline.is_some() && wait == left) {
                return Ok(event);
            }
        }
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

    /// Closes the node: over TCP every peer is closed in order (what was queued reaches it
    /// first), bounded by `within`; an in-process handle lets go of its side of the pair. A
    /// `next_event` waiting on another thread returns [`EmbedError::Closed`] within 100 ms.
    /// Every later call returns [`EmbedError::Closed`]. Dropping the node closes it too, bounded
    /// by the TCP close grace.
    pub fn close(&self, within: Duration) -> Result<(), EmbedError> {
        let taken = self
            .inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match taken {
            Some(Inner::Tcp(node)) => Ok(node.close(within)?),
            Some(Inner::Mem(_)) => Ok(()),
            None => Err(EmbedError::Closed),
        }
    }
}

fn unsupported(operation: &'static str) -> EmbedError {
    EmbedError::Unsupported {
        operation,
        transport: "mem",
    }
}

impl Node<Sender> {
    /// A prefill node over TCP reading source bytes from `regions`, or the first reason the
    /// configuration cannot run pipelined transfer.
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn tcp(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        check_regions(config, regions)?;
        // SAFETY: forwarded from the caller.
        let table = unsafe { tcp_regions(regions) };
        let node = TcpSender::new(config.sender_config(), config.tcp.clone(), table)?;
        Ok(Node::from_inner(Inner::Tcp(node)))
    }

    /// Opens a request before its first chunk (see [`Sender::open_request`]).
    pub fn open_request(&self, request: SendRequest) -> Result<(), EmbedError> {
        self.command(|s, now| s.open_request(now, request))
    }

    /// Submits a computed prefill chunk; `source` answers the core's bounded block queries
    /// (see [`Sender::submit_chunk`]) while the node is locked, so it must not call into this
    /// node. `None`: the chunk completes no block and sends nothing.
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Option<SenderSliceId>, EmbedError> {
        self.command(|s, now| s.submit_chunk(now, request, spec, source))
    }

    /// Sends the request's cached prefix before its first chunk (see
    /// [`Sender::submit_prefix`]).
    pub fn submit_prefix(
        &self,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        source: &mut impl BlockSource,
    ) -> Result<Option<SenderSliceId>, EmbedError> {
        self.command(|s, now| s.submit_prefix(now, request, prompt_len, prepopulated_len, source))
    }

    /// Submits the request's aux data (first generated tokens, draft tokens, counts).
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

impl Node<Receiver> {
    /// A decode node over TCP landing admitted writes in `regions`, or the first reason the
    /// configuration cannot run pipelined transfer.
    ///
    /// # Safety
    /// Every region follows [`RawRegion`]'s contract until the node is dropped.
    pub unsafe fn tcp(config: &NodeConfig, regions: &[RawRegion]) -> Result<Self, EmbedError> {
        check_regions(config, regions)?;
        // SAFETY: forwarded from the caller.
        let table = unsafe { tcp_regions(regions) };
        let node = TcpReceiver::new(config.receiver_config(), config.tcp.clone(), table)?;
        Ok(Node::from_inner(Inner::Tcp(node)))
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

/// A prefill and a decode handle connected in this process (`kvpipe-mem`): write batches are
/// memory copies on the transport's copy threads; frames go through the wire codec. Each side's
/// regions are registered, the connection is made, and the handshake completes as the handles
/// are polled ([`Event::PeerReady`] on each side). The prefill side names the decode side
/// [`MEM_RECEIVER_PEER`](crate::MEM_RECEIVER_PEER); the decode side names it [`MEM_SENDER_PEER`](crate::MEM_SENDER_PEER).
///
/// # Safety
/// Every region follows [`RawRegion`]'s contract until both handles are dropped.
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
