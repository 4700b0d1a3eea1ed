//! # kvpipe-core
//!
//! The sans-IO protocol core of kvpipe: it streams an LLM request's KV cache from a prefill
//! server to a decode server while prefill is still running. This crate holds the wire frames,
//! the chunk geometry, write planning and the sender/receiver state machines. It does no I/O,
//! reads no clock, spawns no threads and contains no `unsafe`; transports drive it.
#![forbid(unsafe_code)]

pub mod blocks;
pub mod ids;
pub mod layout;
pub mod plan;
pub mod session;
pub mod source;
pub mod time;
pub mod wire;

pub use blocks::{AnchoredRun, BlockRun, IdRun};
pub use ids::{
    BlockId, GrantId, GroupIndex, InstanceId, PeerId, ReceiverSliceId, RegionId, RequestId,
    SenderSliceId,
};
pub use layout::{BlockLayout, LayerGroupLayout, PoolLayout};
pub use plan::{WriteExtent, WritePlan};
pub use session::{
    Event, Output, Receiver, ReceiverConfig, ReceiverInput, Sender, SenderConfig, SenderInput,
};
pub use source::{BlockSource, BlockSourceError};
pub use time::{Duration, Instant};
