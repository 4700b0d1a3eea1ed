//! # kvpipe-core
//!
//! The sans-IO protocol core of kvpipe: it streams an LLM request's KV cache from a prefill
//! server to a decode server while prefill is still running. This crate holds the wire frames,
//! the chunk geometry, write planning and the sender/receiver state machines. It does no I/O,
//! reads no clock, spawns no threads and contains no `unsafe`; transports drive it.
#![forbid(unsafe_code)]

pub mod blocks;
pub mod config;
pub mod geometry;
pub mod ids;
pub mod layout;
pub mod plan;
pub mod session;
pub mod source;
pub mod time;
pub mod wire;

pub use blocks::{AnchoredRun, BlockRun, IdRun};
pub use config::{ConfigError, PipelineConfig, SchedulingPolicy};
pub use geometry::{
    chunk_window, early_prefix_window, stale_boundary, total_blocks, BlockWindow, ChunkSpec,
    GeometryError, StaleBoundary,
};
pub use ids::{
    BlockId, GrantId, GroupIndex, InstanceId, PeerId, ReceiverSliceId, RegionId, RequestId,
    SenderSliceId,
};
pub use layout::{BlockLayout, LayerGroupLayout, PoolLayout};
pub use plan::{
    check_pairable, plan_group, plan_group_with_cursor, DstCursor, PairStats, PlanError, Side,
    WriteExtent, WritePlan,
};
pub use session::{
    Event, Output, Receiver, ReceiverConfig, ReceiverInput, Sender, SenderConfig, SenderInput,
};
pub use source::{BlockSource, BlockSourceError};
pub use time::{Duration, Instant};
