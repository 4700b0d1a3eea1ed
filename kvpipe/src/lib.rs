//! # kvpipe
//!
//! What an engine embeds, as one API whatever the transport: a [`PrefillNode`] (a core
//! [`Sender`](kvpipe_core::Sender) driven by a transport) and a [`DecodeNode`] (a core
//! [`Receiver`](kvpipe_core::Receiver)), each shareable between threads, with the role's engine
//! commands and a blocking [`next_event`](PrefillNode::next_event) with a timeout. It is the
//! layer under kvpipe's C ABI (`bindings/c`) and Python package (`bindings/python`), so both
//! bind the same thing.
//!
//! - Transports: TCP ([`PrefillNode::tcp`], [`DecodeNode::tcp`]: `kvpipe-tcp`'s blocking
//!   driver) and in-process ([`mem_pair`]: a connected `kvpipe-mem` pair, pumped by whichever
//!   handle is polled).
//! - Memory: regions are the engine's own memory given by address ([`RawRegion`]) when the node
//!   is made; the node reads source bytes from them (prefill) or lands admitted writes in them
//!   (decode) on its own threads. The engine keeps a request's blocks untouched until its
//!   [`Event::Quiesced`](kvpipe_core::Event::Quiesced).
//! - Block source: anything implementing [`BlockSource`](kvpipe_core::BlockSource); for
//!   engines that keep a block table per request, [`BlockTables`] answers the core's bounded
//!   queries from it.
//!
//! Every command returns the core's own error ([`EmbedError::Usage`], whose message says what
//! to change); nothing here holds a protocol rule.

mod config;
mod error;
mod gpu;
mod mem;
mod node;
mod role;
mod tables;
mod transport;
#[cfg(feature = "verbs")]
mod verbs;

pub use config::{instance_id, NodeConfig, RawRegion};
pub use error::EmbedError;
pub use gpu::GpuUnavailable;
#[cfg(feature = "verbs")]
pub use kvpipe_ibverbs::{DeviceSpec, FabricConfig};
pub use kvpipe_tcp::{TcpConfig, TcpDataPath};
pub use mem::{MEM_RECEIVER_PEER, MEM_SENDER_PEER};
pub use node::{mem_pair, DecodeNode, Node, PrefillNode};
pub use role::Role;
pub use tables::BlockTables;
pub use transport::Transport;
#[cfg(feature = "verbs")]
pub use transport::VerbsConfig;

/// The protocol core this crate drives, for what the re-exports below leave out.
pub use kvpipe_core;
pub use kvpipe_core::session::{Counters, Deadlines, Registration, SendRequest, UsageError};
pub use kvpipe_core::wire::{AuxData, Topology};
pub use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, ConfigError, Event,
    GroupIndex, InstanceId, LayerGroupLayout, PeerId, PoolLayout, ReceiverSliceId, RegionId,
    RequestId, SenderSliceId,
};
