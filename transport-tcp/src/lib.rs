//! # kvpipe-tcp
//!
//! The TCP transport: control frames and data writes over sockets, with payloads read from the
//! socket straight into the destination region and every write checked against the receiver's
//! grant.
//!
//! - [`TcpSender`] (prefill side) and [`TcpReceiver`] (decode side) drive the core's
//!   [`Sender`](kvpipe_core::Sender) / [`Receiver`](kvpipe_core::Receiver) over real sockets. A
//!   node listens and/or connects; each peer is a bundle of
//!   [`TcpConfig::connections_per_peer`] connections opened by the connecting side, each
//!   starting with a 16-byte [`preamble`]. A peer starts (its threads run, the core hears of
//!   it) only once its whole bundle is attached. Control frames (the core's handshake first) travel on
//!   the first connection; a write batch is cut into `DataWrite` pieces spread over all of them,
//!   each sent with one vectored write of header and source bytes.
//! - The receiver checks each `DataWrite` against the request's grant ([`GrantedExtents`]:
//!   registered request, matching grant, one of its writers, destination inside the granted
//!   blocks, registered memory) and then reads the payload from the socket directly into the
//!   destination region. Anything else is refused, counted ([`TcpStats::writes_refused`]),
//!   never applied; the request is failed towards the sender and the peer is disconnected.
//! - A result frame is handed to the core only once the data it reports has landed (data and
//!   results travel on different connections). `Quiesced` reaches the engine only once no
//!   reader is still copying into the request's memory.
//! - Liveness and every other deadline are the core's; the node delivers its timeouts. A peer
//!   whose connection fails is torn down as a whole, and reported disconnected only after its
//!   last connection thread exited.
//!
//! ## Closing
//!
//! [`TcpSender::close`] / [`TcpReceiver::close`] (and dropping a handle, bounded by
//! [`TcpConfig::close_grace`]) close every peer in order: each connection's writer first writes
//! out every frame and data write queued before the close, then shuts its sending side down
//! (FIN); its reader goes on reading — frames still reach the core, data writes are still
//! checked and landed — until the peer ends its side. A node whose peer ends its stream closes
//! that peer the same way (flush, FIN, read until the peer's end of stream, bounded by
//! `close_grace`), so a receiver keeps landing the data still in flight on the other
//! connections of a sender that closed. Reading every connection to its end before the socket
//! is released means no socket is closed with unread bytes, so the kernel never answers with a
//! reset that would discard data the peer has not read yet.
//!
//! `close` returns `Ok` once every peer's connections have all written out their queues, sent
//! their FIN and seen the peer's: everything the node had queued is then in the kernel ahead of
//! an orderly end of stream, which the peer's transport has read to its end — the process may
//! exit. It is delivery to the peer's transport, not an acknowledgement from its engine (that is
//! the protocol's `Completed` on the receiving side). At the deadline, or when a connection
//! fails on the way, the remaining sockets are shut down at once and `close` returns
//! [`CloseError::Unflushed`]: what was still queued may be lost. [`TcpSender::shutdown`] skips
//! the orderly part.
//!
//! ## Feature flags
//!
//! | feature | what it enables |
//! |---|---|
//! | *(default)* | the blocking driver ([`TcpSender`], [`TcpReceiver`]): std sockets and threads. |
//! | `tokio` | the async driver (`tokio_driver::{TcpSender, TcpReceiver}`): the same node with each connection's reader and writer as tasks on a tokio runtime. |
//!
//! Memory is registered as [`MemoryRegion`]s (owned buffers, or foreign memory through
//! [`MemoryRegion::from_raw_parts`]); see the [`memory`] module for the pinning contract.

mod blocking;
mod config;
mod endpoint;
pub mod grant;
pub mod memory;
mod pieces;
pub mod preamble;
mod stats;
#[cfg(feature = "tokio")]
pub mod tokio_driver;

pub use blocking::{CloseError, EndpointGuard, TcpReceiver, TcpSender};
pub use config::TcpConfig;
pub use grant::{GrantedExtents, WriteRefusal};
pub use memory::{MemoryRegion, OutOfBounds, RegionTable};
pub use stats::TcpStats;
