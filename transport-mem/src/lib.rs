//! # kvpipe-mem
//!
//! The in-process transport: the endpoints live in one process, frames travel through
//! in-memory queues (encoded and decoded by the wire codec, so the codec is exercised as on a
//! real link) and write batches are carried out as memory copies of the coalesced extents. It is
//! the zero-setup default and the home of the fault-injecting wrapper the conformance suite
//! uses.
//!
//! - [`region`]: registration of the engine's memory (KV pools, aux buffers): host memory, and
//!   with the `cuda` feature device memory (`RegionTable::register_device`; reach a
//!   [`MemPair`]'s tables through [`MemPair::network`] and [`MemNetwork::regions_mut`]). Copies
//!   dispatch on the pair of kinds. Registrations stay held while a write batch may touch them.
//! - [`copy`]: write plans resolved against registrations (bounds-checked), copied on one or
//!   several threads — or, for batches touching device memory, submitted to the GPU's copy
//!   engines (`kvpipe-cuda`: contiguous extents merged, async copies on the engine's streams,
//!   completion through CUDA events); the copy worker keeps taking batches while the GPU copies
//!   and reports them in issue order.
//! - [`MemNetwork`]: the driver — several senders and receivers, each sender connected to each
//!   receiver; the core's run loop with real time ([`Clock`]), timers armed from
//!   `poll_timeout`, a copy worker thread, bounded waits everywhere. [`MemPair`] is its
//!   one-sender, one-receiver form. While a batch whose segments all touch device memory is in
//!   flight (the driver starts and watches those itself), a wait polls the batch's CUDA events
//!   on the calling thread: for its first 150 µs without a system call, then yielding the core
//!   between polls until 1 ms, then in sleeps of 20 µs (a layer range's or a chunk's copy ends
//!   within tens of microseconds, sooner than a sleeping thread wakes). A batch mixing host and
//!   device segments goes to the copy worker, and a wait polls its report the same way for
//!   1 ms, then blocks on the worker's channel.
//! - Fault injection: `kvpipe-netem`'s seeded network emulation decides which frames are
//!   dropped, duplicated, reordered, delayed and corrupted and which writes fail or stall
//!   ([`PairConfig::faults`], [`NetworkConfig::faults`]; the simulator and the fuzz crate use
//!   the same crate); and [`MemNetwork::kill`] / [`MemPair::kill`] for a peer's death.
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

pub mod clock {
    //! Real time as the core's `Instant`: kvpipe-driver's clock, which every driver here reads.
    pub use kvpipe_driver::Clock;
}
pub mod copy;
mod network;
mod pair;
pub mod region;
mod worker;

#[cfg(feature = "cuda")]
pub use copy::InFlight;
pub use copy::{split_even, CopyError, Piece, ResolvedBatch, WriteError};
pub use kvpipe_driver::Clock;
pub use network::{
    receiver_peer, sender_peer, BatchTiming, DriveError, MemNetwork, NetworkConfig, Node,
    PairStats, MAX_BATCH_TIMINGS,
};
pub use pair::{Endpoint, MemPair, PairConfig, RECEIVER_PEER, SENDER_PEER};
#[cfg(feature = "cuda")]
pub use region::DeviceRegion;
pub use region::{RegionKind, RegionMemory, RegionTable, RegionUse, RegistrationError};
