//! # kvpipe-ibverbs
//!
//! The RDMA verbs transport: reliable-connected (RC) queue pairs set up over a TCP side
//! channel, control frames over SEND/RECV, and a slice's coalesced write plan executed as
//! one-sided RDMA WRITEs with scatter/gather lists, from memory registered once per KV pool
//! (host memory; device memory through dma-buf). Built on the `sideway` rdma-core bindings.
//!
//! Two layers, kept apart so the session API can change without touching the verbs code:
//!
//! - the **fabric** ([`Fabric`], [`device`], [`memory`], [`bootstrap`], [`flow`], [`writes`],
//!   [`idle`]): devices, registrations, links, the credit-based control channel, write posting,
//!   the completion poller and failure handling. It knows nothing of sessions: it moves
//!   opaque messages and executes write plans, and reports [`FabricEvent`]s;
//! - the **driver** ([`VerbsSender`], [`VerbsReceiver`]): one module that feeds the core's
//!   `Sender` / `Receiver` from those events and carries out their outputs.
//!
//! ## Setting a link up
//!
//! The connecting node opens a TCP connection to the listening one; each side creates a queue
//! pair, posts its receive buffers, and sends a [`ConnectInfo`]: queue pair number, first
//! packet sequence number, GID, MTU, control-channel geometry, and the descriptors of the
//! regions it exposes (region id → address, length, remote key). Both move their queue pairs
//! to ready-to-send and exchange a ready byte; the link is then up, and the core's own
//! handshake (`Hello`) runs over it. The TCP socket stays open as the link's liveness signal:
//! a peer process that dies closes it, and the other side tears its link down at once.
//!
//! ## Result after data, by the fabric's ordering
//!
//! The core emits a slice's result frame only after the transport reported the slice's write
//! batch complete, and the driver reports a batch complete only when the last (signaled) RDMA
//! WRITE of it completed — RC completes a send queue in order, so every write of the batch
//! was acknowledged by the peer's adapter. The result then travels as a SEND on the **same**
//! queue pair, and RC places every RDMA WRITE posted before a SEND in the peer's memory before
//! the SEND is delivered. So when the receiver's core sees a result, the data it reports has
//! landed: the transport holds no frame back and counts no bytes (unlike the TCP transport,
//! whose data and results travel on different connections). A link that fails is reported
//! disconnected only after its queue pair is destroyed, so no write of it can still read the
//! sender's memory or land in the receiver's after the core hears of it.
//!
//! ## What protects the receiver's memory
//!
//! A receiver registers its KV pools for remote write and announces them to every peer it
//! accepts; a sender registers its pools for local use only. The adapter checks every
//! incoming RDMA WRITE against the registration its remote key names:
//!
//! - **protected**: memory outside the registered pools (a write past a pool's registered
//!   length, or with an unknown key, is refused by the adapter with a remote access error —
//!   nothing of it lands — and the writer's queue pair fails, taking down exactly that link and
//!   its sessions on both sides); other processes' memory; keys of another protection domain;
//! - **not protected**: the placement of writes *inside* a registered pool. Any peer holding
//!   the pool's key can write any block of the pool at any time its link is up, including
//!   blocks of other requests and blocks the core did not grant; the TCP transport's
//!   per-request grant check has no counterpart here. The core plans writes only into granted
//!   blocks, so this matters for buggy or hostile peers, not for correct ones: accept links
//!   only from trusted prefill nodes. Memory windows (type 2), bound per request to its
//!   granted extents and invalidated when it ends, would narrow this; the transport does not
//!   use them yet (rxe reports support for them; see [`VerbsDevice::max_memory_windows`]).
//!
//! ## Failures
//!
//! A work request that completes with an error (remote access error, retries exceeded, a
//! queue pair moved to the error state and its work flushed), a receive that cannot be
//! reassembled, or the end of the peer's bootstrap socket fails the link: its queue pair goes
//! to the error state, the bootstrap socket is shut down (so the peer tears down too), the
//! flushes are reaped, the queue pair is destroyed, and the link is reported disconnected.
//! The core then fails exactly the sessions on that peer, on both sides, and quiesces them;
//! other links carry on. A failed write batch is reported as failed first, so the sender
//! names the failed slice.
//!
//! ## Memory registration of GPU memory
//!
//! [`MemoryTable::register_dmabuf`] registers device memory exported as a dma-buf. With the
//! `cuda` feature, `MemoryTable::register_device(device, region, ordinal, ptr, len, exposure)`
//! exports a range of GPU memory itself (`export_device_memory`: `cuMemGetHandleForAddressRange`
//! through `kvpipe-cuda`, whole host pages around the range, the range's offset inside them)
//! and registers it with the device address as iova: write plans, SGEs and the descriptors
//! announced to peers then name GPU memory by the addresses the engine allocated, and the
//! adapter reads and writes it directly (GPUDirect RDMA), with no staging copy. What is tested
//! where: the export (fd, offset, length, iova) on a GPU machine (`tests/gpu.rs`), and its
//! failure without a driver everywhere; the registration itself needs an adapter with
//! dma-buf support next to a GPU, which none of the test machines has (Soft-RoCE registers
//! host memory only).

pub mod bootstrap;
pub mod device;
mod driver;
pub mod fabric;
pub mod flow;
pub mod idle;
mod link;
pub mod memory;
pub mod writes;

pub use bootstrap::{ConnectInfo, RegionDescriptor};
pub use device::{device_names, DeviceError, DeviceSpec, VerbsDevice};
pub use driver::{EndpointGuard, VerbsConfig, VerbsIo, VerbsNode, VerbsReceiver, VerbsSender};
pub use fabric::{
    Fabric, FabricConfig, FabricEvent, FabricHandler, LinkFailure, LinkId, Posted, WriteFailure,
};
pub use idle::IdlePolicy;
pub use kvpipe_driver::{Driven, Driver};
#[cfg(feature = "cuda")]
pub use memory::{export_device_memory, ExportedDeviceMemory};
pub use memory::{Dmabuf, Exposure, MemoryTable, RegisterError};
