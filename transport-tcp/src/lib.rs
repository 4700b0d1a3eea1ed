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
//!   starting with a 16-byte [`preamble`]. Control frames (the core's handshake first) travel on
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

pub use blocking::{EndpointGuard, TcpReceiver, TcpSender};
pub use config::TcpConfig;
pub use grant::{GrantedExtents, WriteRefusal};
pub use memory::{MemoryRegion, OutOfBounds, RegionTable};
pub use stats::TcpStats;
