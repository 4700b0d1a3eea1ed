//! Everything device-specific in the TCP transport, in one place; the rest of the crate calls
//! this API and has no `cfg(feature = "cuda")` of its own.
//!
//! Sockets cannot read or write GPU memory, so device memory reaches the network one of two
//! ways (the crate doc says when each is used):
//!
//! - **Pinned staging, pipelined with the socket** ([`SendStaging`], [`RecvStaging`]): each
//!   connection half that meets device memory copies it through a small ring of pinned host
//!   slots with a copy stream of its own — the writer copies device payloads into slots ahead of
//!   the socket and writes a slot once its copy completed; the reader reads an admitted payload
//!   into a slot and copies each full slot up while the socket fills the next, reporting the
//!   write landed only once its last bytes are in device memory.
//! - **Peer copies pulled by the receiver** ([`export`], [`import`], [`PullCopies`]): two
//!   processes on one host; the sender exports its regions as CUDA IPC handles, the receiver
//!   opens them and copies each admitted write device → device into its own memory, waiting for
//!   the copy before it reports the write landed (`crate::peer_copy` has the negotiation and
//!   the fence).
//!
//! Device regions themselves are [`DeviceRegion`]s, registered with
//! `RegionTable::insert_device`.
//!
//! This module sits below the region table and the peer-copy negotiation: it takes plain device
//! regions and offer entries, and knows neither.
//!
//! The module exists in both builds, with one API. With the `cuda` feature it is the real
//! thing, over `kvpipe-cuda` (`cuda/`). Without it (`absent.rs`) every type is a stand-in:
//! `DeviceRegion` has no values, so no registration is ever device memory and the staging calls
//! the reader and writer make have nothing to do, while whatever would need a GPU (exporting,
//! opening, pulling, staging) refuses with "kvpipe-tcp was built without the `cuda` feature".

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(feature = "cuda")]
mod cuda;

#[cfg(not(feature = "cuda"))]
use absent as imp;
#[cfg(feature = "cuda")]
use cuda as imp;

#[cfg(not(feature = "cuda"))]
pub(crate) use imp::DeviceRegion;
#[cfg(feature = "cuda")]
pub use imp::DeviceRegion;

/// A GPU fake for the staging and pulling tests (`cuda` feature).
#[cfg(all(test, feature = "cuda"))]
pub(crate) use imp::fake;

pub(crate) use imp::{
    export, import, supported, GpuError, IpcMappings, PullCopies, RecvStaging, SendStaging,
    StagingSpec,
};

use kvpipe_core::RegionId;

/// Bytes of an encoded IPC handle (`kvpipe_cuda::IPC_HANDLE_LEN`).
pub(crate) const HANDLE_LEN: usize = 80;

/// One exported region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OfferEntry {
    pub(crate) region: RegionId,
    /// The exporter's GPU (informational).
    pub(crate) ordinal: u32,
    pub(crate) handle: [u8; HANDLE_LEN],
}

/// A region of the peer, opened in this process: the device address of its first byte on
/// GPU `ordinal`, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlacedRegion {
    pub(crate) ordinal: usize,
    pub(crate) ptr: u64,
    pub(crate) len: u64,
}
