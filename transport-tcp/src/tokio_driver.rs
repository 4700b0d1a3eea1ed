//! The async driver (`tokio` feature): the same node — core endpoint, links, timer — with
//! each connection's reader and writer as tasks on a tokio runtime instead of threads. The
//! tasks are the same thin loops as the blocking driver's, over the same sans-IO halves, with
//! `.await`ed socket calls: payloads are read straight into the destination region and data
//! writes leave as vectored writes of header and source bytes.
//!
//! [`TcpSender`] and [`TcpReceiver`] dereference to the blocking handles for the engine's
//! commands (none of them waits on the network); connect and wait for events with the async
//! methods here. The node's timer and (when listening) accept loop run on one helper thread
//! each, as in the blocking driver. Dropping a node waits (bounded) for its connection tasks to
//! end: drop it where the runtime keeps running other tasks (a multi-threaded runtime, or
//! outside the runtime).

use std::io::{self, ErrorKind};
use std::net::SocketAddr;
use std::time::Duration;

use kvpipe_core::{
    ConfigError, Endpoint, Event, PeerId, Receiver, ReceiverConfig, Sender, SenderConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::runtime::Handle;

use crate::config::TcpConfig;
use crate::conn::{Inbound, Next, Outbound, Stop, WriteEnd};
use crate::memory::RegionTable;
use crate::node::lifecycle::{CloseError, Node};
use crate::node::Spawn;
use crate::preamble::Preamble;

/// Starts connection halves as tasks on a runtime.
struct Tasks {
    runtime: Handle,
    write_stall: Option<Duration>,
}

impl Spawn for Tasks {
    fn start(
        &self,
        _peer: PeerId,
        stream: std::net::TcpStream,
        inbound: Inbound,
        outbound: Outbound,
    ) -> u32 {
        let _entered = self.runtime.enter();
        let stream = stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(stream));
        let Ok(stream) = stream else {
            return 0;
        };
        let (read_half, write_half) = stream.into_split();
        self.runtime.spawn(read_task(inbound, read_half));
        self.runtime
            .spawn(write_task(outbound, write_half, self.write_stall));
        2
    }
}

async fn read_task(mut inbound: Inbound, mut stream: OwnedReadHalf) {
    let stop = loop {
        match stream.read(inbound.buffer()).await {
            Ok(0) => break Stop::Eof,
            Ok(n) => {
                if let Err(end) = inbound.consumed(n) {
                    break Stop::Ended(end);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break Stop::Io,
        }
    };
    inbound.finish(stop);
}

async fn write_task(mut outbound: Outbound, mut stream: OwnedWriteHalf, stall: Option<Duration>) {
    let end = loop {
        match outbound.next() {
            Next::Write => {
                let slices = outbound.slices();
                let write = stream.write_vectored(&slices);
                let written = match stall {
                    Some(limit) => tokio::time::timeout(limit, write)
                        .await
                        .unwrap_or_else(|_| Err(ErrorKind::TimedOut.into())),
                    None => write.await,
                };
                drop(slices);
                match written {
                    Ok(0) => break WriteEnd::Failed,
                    Ok(n) => outbound.written(n),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break WriteEnd::Failed,
                }
            }
            Next::Wait => outbound.queue().wait_async().await,
            Next::Close => match stream.shutdown().await {
                Ok(()) => break WriteEnd::Closed,
                Err(_) => break WriteEnd::Failed,
            },
            Next::Stop => break WriteEnd::Failed,
        }
    };
    outbound.finish(end);
}

/// Connects the connections of one bundle without blocking the runtime, then hands them to
/// the node.
async fn connect_bundle<E: Endpoint + Send + 'static>(
    node: &Node<E>,
    addr: SocketAddr,
) -> io::Result<PeerId> {
    let shared = &node.shared;
    let count = shared.config.connections_per_peer.clamp(1, 255);
    let token = shared.new_token();
    let mut streams = Vec::with_capacity(count);
    for index in 0..count {
        let mut s = tokio::time::timeout(
            shared.config.preamble_timeout,
            tokio::net::TcpStream::connect(addr),
        )
        .await
        .map_err(|_| io::Error::from(ErrorKind::TimedOut))??;
        let pre = Preamble {
            index: index as u8,
            count: count as u8,
            token,
            flags: 0,
        };
        s.write_all(&pre.encode()).await?;
        let s = s.into_std()?;
        shared.configure(&s)?;
        streams.push((pre, s));
    }
    // The async driver negotiates no peer copies: its data goes over the sockets.
    shared.adopt_bundle(streams, None).map(|(peer, _)| peer)
}

fn tasks(runtime: Handle, tcp: &TcpConfig) -> Box<dyn Spawn> {
    Box::new(Tasks {
        runtime,
        write_stall: tcp.write_stall_timeout,
    })
}

/// A core endpoint driven over TCP with its connections as tokio tasks (see the module doc):
/// a [`TcpSender`] or a [`TcpReceiver`]. Engine commands are the blocking handle's, through
/// `Deref`; connecting, waiting for events and closing are async here.
pub struct TcpNode<E: Endpoint + Send + 'static> {
    inner: crate::TcpNode<E>,
}

/// A prefill-side node whose connections run as tokio tasks.
pub type TcpSender = TcpNode<Sender>;

/// A decode-side node whose connections run as tokio tasks.
pub type TcpReceiver = TcpNode<Receiver>;

impl TcpNode<Sender> {
    /// A node around a core sender, its connection tasks on `runtime`; or the first reason
    /// the core cannot run pipelined transfer with `config`.
    pub fn new(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        runtime: Handle,
    ) -> Result<Self, ConfigError> {
        let spawn = tasks(runtime, &tcp);
        let inner = crate::TcpSender::with_spawn(config, tcp, regions, spawn)?;
        Ok(TcpNode { inner })
    }
}

impl TcpNode<Receiver> {
    /// A node around a core receiver, its connection tasks on `runtime`; or the first reason
    /// the core cannot run pipelined transfer with `config`.
    pub fn new(
        config: ReceiverConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        runtime: Handle,
    ) -> Result<Self, ConfigError> {
        let spawn = tasks(runtime, &tcp);
        let inner = crate::TcpReceiver::with_spawn(config, tcp, regions, spawn)?;
        Ok(TcpNode { inner })
    }
}

impl<E: Endpoint + Send + 'static> TcpNode<E> {
    /// Connects to a peer at `addr` without blocking the runtime; the handshake runs in the
    /// background.
    pub async fn connect(&self, addr: SocketAddr) -> io::Result<PeerId> {
        connect_bundle(self.inner.node(), addr).await
    }

    /// The next event, waiting up to `timeout` without blocking the runtime.
    pub async fn next_event(&self, timeout: Duration) -> Option<Event> {
        let events = self.inner.node().shared.driver.events();
        events.next_async(timeout).await.map(|(_, e)| e)
    }

    /// Closes every peer in order, waiting at most `within` (see *Closing* in the crate doc),
    /// on a blocking thread so the runtime keeps driving the connections.
    pub async fn close(self, within: Duration) -> Result<(), CloseError> {
        let inner = self.inner;
        tokio::task::spawn_blocking(move || inner.close(within))
            .await
            .unwrap_or(Err(CloseError::Interrupted))
    }

    /// The handle with the blocking event methods (its connections stay on the runtime).
    pub fn into_inner(self) -> crate::TcpNode<E> {
        self.inner
    }
}

impl<E: Endpoint + Send + 'static> std::ops::Deref for TcpNode<E> {
    type Target = crate::TcpNode<E>;
    fn deref(&self) -> &crate::TcpNode<E> {
        &self.inner
    }
}

// The handles are used from async code on any worker.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TcpSender>();
    send_sync::<TcpReceiver>();
};
