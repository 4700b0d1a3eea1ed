//! The handles' error: the core's own errors, the transports', and the few of this layer.

use kvpipe_core::session::UsageError;
use kvpipe_core::{ConfigError, RegionId};

use crate::gpu::GpuUnavailable;

/// Why a node could not be made or a command was refused. Each message is the underlying
/// crate's, which names the values involved and says what to change.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The caller's bug, refused by the core with its state unchanged (or, for a block source
    /// that broke its contract, the request failed on both sides: see the message).
    #[error(transparent)]
    Usage(#[from] UsageError),
    /// The configuration cannot run pipelined transfer.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A socket or device operation failed: listen, connect, address resolution; over RDMA
    /// verbs also opening the device (none found, none active), registering memory with it, or
    /// closing every link in order before the deadline. The message says which.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The TCP node could not close every peer in order before the deadline.
    #[error(transparent)]
    Close(#[from] kvpipe_tcp::CloseError),
    /// The in-process transport refused a region.
    #[error(transparent)]
    Registration(#[from] kvpipe_mem::RegistrationError),
    /// The in-process transport stopped driving its endpoints.
    #[error(transparent)]
    Drive(#[from] kvpipe_mem::DriveError),
    /// Two regions were given the same id.
    #[error("{0} is given twice; every region needs its own id")]
    DuplicateRegion(RegionId),
    /// A pool of the layout names a region that was not given.
    #[error("layer group {group} has a pool in {region}, but no memory was given for {region}")]
    MissingRegion {
        /// The group, counted from 0.
        group: usize,
        /// The region its pool names.
        region: RegionId,
    },
    /// A region's address is null while its length is not zero.
    #[error("{0} has a null address")]
    NullRegion(RegionId),
    /// Two of a decode node's regions share memory: a write admitted into one would land in
    /// blocks of the other, which the core checks separately.
    #[error(
        "{a} and {b} share memory; a decode node's regions must not overlap (a write to one \
         would land in blocks of the other)"
    )]
    OverlappingRegions {
        /// The region that starts first.
        a: RegionId,
        /// The region that starts inside it.
        b: RegionId,
    },
    /// A region is GPU memory, which this build or this machine cannot serve.
    #[error("{region} is memory on GPU {ordinal}, {reason}; give host memory")]
    DeviceRegion {
        /// The region.
        region: RegionId,
        /// The GPU's ordinal.
        ordinal: u32,
        /// What is missing.
        reason: GpuUnavailable,
    },
    /// The operation does not exist on this transport (listening on an in-process node, or
    /// making one in-process node alone: [`mem_pair`](crate::mem_pair) makes both).
    #[error("{operation} is not available on the {transport} transport")]
    Unsupported {
        /// What was asked.
        operation: &'static str,
        /// The node's transport.
        transport: &'static str,
    },
    /// The node was closed.
    #[error("the node is closed")]
    Closed,
    /// A submission's fence could not be made or waited for: the GPU work before it failed, or
    /// did not pass in time where the submission waits for it
    /// ([`PrefillNode::submit_chunk_layers_after`]); nothing was submitted. Made only with the
    /// `cuda` feature; the variant is there in every build so that matches on this enum do not
    /// depend on features.
    ///
    /// [`PrefillNode::submit_chunk_layers_after`]: crate::PrefillNode::submit_chunk_layers_after
    #[error("the submission's fence: {0}")]
    Fence(String),
}
