//! # kvpipe-mem
//!
//! The in-process transport: the endpoints live in one process, frames travel through
//! in-memory queues (encoded and decoded by the wire codec, so the codec is exercised as on a
//! real link) and write batches are carried out as memory copies of the coalesced extents. It is
//! the zero-setup default and the home of the fault-injecting wrapper the conformance suite
//! uses.
//!
//! - [`region`]: registration of the engine's memory (KV pools, aux buffers). Host memory today;
//!   device memory is another [`RegionMemory`] variant behind a future `cuda` feature, and copies
//!   dispatch on the pair of kinds. Registrations stay held while a write batch may touch them.
//! - [`copy`]: write plans resolved against registrations (bounds-checked), copied on one or
//!   several threads.
//! - [`MemNetwork`]: the driver — several senders and receivers, each sender connected to each
//!   receiver; the core's run loop with real time ([`Clock`]), timers armed from
//!   `poll_timeout`, a copy worker thread, bounded waits everywhere. [`MemPair`] is its
//!   one-sender, one-receiver form.
//! - [`FaultConfig`]: dropped, duplicated, reordered and delayed frames, failed and stalled
//!   writes, all drawn from a seed; and [`MemNetwork::kill`] / [`MemPair::kill`] for a peer's
//!   death.
//!
//! The codec costs nothing measurable here: a transfer sends a few dozen frames of tens of
//! bytes against gigabytes of copies.
//!
//! ```
//! use kvpipe_core::session::LocalHello;
//! use kvpipe_core::wire::Topology;
//! use kvpipe_core::{InstanceId, ReceiverConfig, SenderConfig};
//! use kvpipe_mem::{MemPair, PairConfig};
//!
//! let hello = |i| LocalHello::new(InstanceId(i), Topology::default(), Vec::new());
//! let mut pair = MemPair::new(PairConfig::new(
//!     SenderConfig::new(hello(1)),
//!     ReceiverConfig::new(hello(2), 7),
//! ))
//! .unwrap();
//! pair.connect().unwrap();
//! pair.drive_until(std::time::Duration::from_secs(5), |p| {
//!     p.sender().is_peer_ready(kvpipe_mem::RECEIVER_PEER)
//!         && p.receiver().is_peer_ready(kvpipe_mem::SENDER_PEER)
//! })
//! .unwrap();
//! ```

pub mod clock;
pub mod copy;
mod faults;
mod network;
mod pair;
pub mod region;
mod worker;

pub use clock::Clock;
pub use copy::{split_even, Piece, ResolvedBatch, WriteError};
pub use faults::{FaultConfig, FaultCounts};
pub use network::{
    receiver_peer, sender_peer, BatchTiming, DriveError, MemNetwork, NetworkConfig, Node, PairStats,
};
pub use pair::{Endpoint, MemPair, PairConfig, RECEIVER_PEER, SENDER_PEER};
pub use region::{RegionKind, RegionMemory, RegionTable, RegionUse, RegistrationError};
