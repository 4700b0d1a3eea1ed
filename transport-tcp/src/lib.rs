//! # kvpipe-tcp
//!
//! The TCP transport: control frames and data writes over sockets, with payloads read from the
//! socket straight into the destination region, each admitted by the receiving core first.
//!
//! - [`TcpSender`] (prefill side) and [`TcpReceiver`] (decode side) drive the core's
//!   [`Sender`](kvpipe_core::Sender) / [`Receiver`](kvpipe_core::Receiver) over real sockets,
//!   through the transport contract only (`docs/TRANSPORT.md`, [`kvpipe_core::Endpoint`]): the
//!   node reports what its sockets saw and carries out what the endpoint asks. A node listens
//!   and/or connects; each peer is a bundle of [`TcpConfig::connections_per_peer`] connections
//!   opened by the connecting side, each starting with a 16-byte [`preamble`]. A peer starts
//!   (its connection halves run, the core hears of it) only once its whole bundle is attached.
//! - Accepting never waits on a peer: every accepted connection's preamble is read on a thread
//!   of its own under its own deadline ([`TcpConfig::preamble_timeout`]), a bundle's connections
//!   may arrive in any order, and the core's handshake deadline bounds the rest. Connections
//!   that have not completed the handshake are capped ([`TcpConfig::max_unauthenticated`],
//!   [`TcpConfig::max_unauthenticated_per_address`]; the oldest is dropped first), and until
//!   the handshake a connection's reader takes only handshake-sized bodies
//!   ([`kvpipe_core::Endpoint::frame_body_limit`]). Bytes that are no frame go to the core,
//!   which fails the peer with a protocol error.
//!   Control frames travel on the first connection exactly as the endpoint encoded them; a
//!   write batch is cut into `DataWrite` pieces (headers from the core's `DataWriteHeaders`)
//!   queued on the peer's backlog, from which each connection's writer takes the next pieces
//!   when its stream runs low (a connection the machine serves faster carries more), and
//!   written with vectored writes of header and source bytes.
//! - Each connection's reader runs the core's [`StreamReader`](kvpipe_core::stream::StreamReader):
//!   frames go to the endpoint as bytes, each data write is admitted by the receiver
//!   ([`Receiver::admit_write`](kvpipe_core::Receiver::admit_write): that request's grant, one
//!   of its writers, inside its blocks, overlapping no write in flight) and its payload is read
//!   from the socket straight into the destination region, then reported landed. A refused
//!   write is never applied and nothing more is read from its connection; the core fails the
//!   request towards the writer and asks to close the peer. Results held until their data
//!   landed, quiesce-before-free and late writes are the core's rules.
//! - Socket reads and writes — every payload byte — happen outside the node's lock; only the
//!   short endpoint calls (an admission, a landing, a frame, a written batch) take it.
//! - Liveness and every other deadline are the core's; the node delivers its timeouts. A peer
//!   whose connection fails is torn down as a whole: an admitted write cut short is reported
//!   not landed, and the peer is reported disconnected only after the last of its connection
//!   threads (or tasks) stopped.
//!
//! ## Closing
//!
//! [`TcpSender::close`] / [`TcpReceiver::close`] (and dropping a handle, bounded by
//! [`TcpConfig::close_grace`]) close every peer in order: each connection's writer first writes
//! out every frame and data write queued before the close, then shuts its sending side down
//! (FIN); its reader goes on reading — frames still reach the core, data writes are still
//! admitted and landed — until the peer ends its side. A node whose peer ends its stream closes
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
//! | `cuda` | GPU memory (`DeviceRegion`, `RegionTable::insert_device`) through pinned staging buffers, pipelined with the socket (see below). Builds without CUDA installed; loads the driver at run time. |
//!
//! Memory is registered as [`MemoryRegion`]s (owned buffers, or foreign memory through
//! [`MemoryRegion::from_raw_parts`]); see the [`memory`] module for the pinning contract.
//!
//! ## GPU memory (`cuda` feature)
//!
//! A region may be device memory (`DeviceRegion::from_raw_parts(ordinal, ptr, len)`, registered
//! with `RegionTable::insert_device`); a node may mix host and device regions. Sockets cannot
//! read or write GPU memory, so each connection half that meets device memory stages it through
//! a small ring of pinned host slots ([`TcpConfig::staging_slots`] ×
//! [`TcpConfig::staging_slot_bytes`], allocated once, with a copy stream of its own):
//!
//! - the writer copies device payloads into free slots ahead of the socket (device → pinned
//!   while the previous slot is on the socket) and writes a slot only once its copy completed;
//! - the reader reads an admitted payload into a slot and copies each full slot up (pinned →
//!   device while the socket fills the next); the write is reported landed
//!   (`WriteFinished { landed: true }`) only once the copies of its last bytes completed, so the
//!   receiver's results still wait for data that is in device memory.
//!
//! With [`TcpConfig::data_path`] `Auto` or `PeerCopy` a connecting sender negotiates **peer
//! copies** instead, inside the core's handshake (its offer in its `Hello`, the receiver's
//! answer in its `HelloAccept`; two processes on one host, both sides' regions device memory): the
//! sender's regions are opened by the receiver by CUDA IPC, each piece's header goes on the
//! socket with its source instead of the payload, and the receiver copies the bytes into its
//! own memory, waits for the copy and acknowledges the piece; the sender's batch completes on
//! the acknowledgements (see the `peer_copy` module doc and docs/TRANSPORT.md). Only the decode
//! process ever writes its memory, so a stopped or dying prefill process cannot land bytes in
//! blocks handed back. The async driver always uses the sockets.
//!
//! Admission is unchanged: a write is checked against the request's grant before a byte of it
//! is read, whatever memory it lands in. Without a CUDA driver a batch reading or writing device
//! memory fails its connection (and so the request, on both sides) instead of touching memory.

mod blocking;
mod config;
mod conn;
mod gpu;
mod handles;
pub mod memory;
mod node;
mod peer_copy;
mod placement;
pub mod preamble;
mod stats;
#[cfg(feature = "tokio")]
pub mod tokio_driver;

pub use config::{TcpConfig, TcpDataPath};
#[cfg(feature = "cuda")]
pub use gpu::DeviceRegion;
pub use handles::EndpointGuard;
pub use handles::{TcpNode, TcpReceiver, TcpSender};
pub use kvpipe_driver::{Driven, Driver};
pub use memory::{MemoryRegion, OutOfBounds, RegionTable};
pub use node::lifecycle::CloseError;
pub use node::TcpIo;
pub use stats::TcpStats;
