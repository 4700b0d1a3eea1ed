//! The reference paged KV cache: a small, fully checked model of an engine's block cache, used
//! as the sender's [`BlockSource`] and as the receiver's destination by tests, benches and the
//! `kvpipe` program.
//!
//! It has several layer groups, each with its own block table per request and one or more pools
//! (one [`RegionId`] each, plain `Vec<u8>` memory). Full-attention groups keep every block;
//! windowed groups evict blocks that leave the window as prefill advances, except the blocks
//! holding the first `sink_tokens` tokens, which stay resident (leaving a gap). Either side may
//! start from a reused prefix; the sender allocates a request's full-attention blocks for the
//! whole prompt up front or chunk by chunk ([`AllocationStyle`]).
//!
//! **Windowed pools hold only live blocks**, as an engine's do: a windowed group allocates a
//! block only when the chunk that computes it runs (whatever the [`AllocationStyle`]), never
//! allocates the blocks of a reused prefix that already left the window, and frees a block's
//! slot as soon as the window slides past it. Free slots are reused last-freed first, so a
//! slot id is recycled — possibly for another request — right after its eviction. A windowed
//! pool's memory is allocated zeroed and each slot is written for the first time when it is
//! first handed out, so the operating system commits only the slots ever used: with
//! last-freed-first reuse, that is the most blocks the group ever held at once
//! ([`ReferenceCache::peak_slots`]). (A full-attention pool is written whole when the cache is
//! built, before any transfer: its requests keep every block.) A demo's memory is thus about
//! the live KV both sides hold.
//!
//! Memory holds deterministic content ([`content_byte`]) written token by token as chunks are
//! computed, and [`filler_byte`] in a slot's bytes no request wrote since the slot was first
//! handed out, so a block sent before it was complete, a byte written to the wrong slot or a
//! stray write are all detectable ([`ReferenceCache::verify`],
//! [`ReferenceCache::changed_slots`]). [`apply_plan`] carries out a [`WritePlan`] by memcpy.
//!
//! This file holds the shared state only ([`ReferenceCache`], its groups and requests); each
//! concern's file adds its part:
//!
//! - `spec.rs`: the cache's shape ([`CacheSpec`], [`GroupSpec`], [`AllocationStyle`]);
//! - `construct.rs`: building a cache from a spec, for the whole model or one rank's part;
//! - `slots.rs`: a group's block slots, handed out and given back;
//! - `requests.rs`: a request's blocks over its life (sender prefill, receiver destination,
//!   release);
//! - `rows.rs`: a block's rows in model coordinates, its expected content written and compared;
//! - `content.rs`: the content and filler bytes themselves;
//! - `getters.rs`: what the cache holds, read without changing it;
//! - `verify.rs`: blocks checked against their content, snapshots and changed slots;
//! - `source.rs`: the cache as the sender's [`BlockSource`];
//! - `apply.rs`: [`apply_plan`], a write plan carried out by memcpy;
//! - `sync.rs` and `device.rs` (`cuda` feature): the pools in device memory, kept in step with
//!   the host buffers;
//! - `planner.rs`: a chunk's write plans between two caches ([`ChunkPlanner`]);
//! - `split.rs`: one rank's part of a model split by tensor and pipeline parallelism;
//! - `error.rs`: [`CacheError`].
//!
//! [`BlockSource`]: kvpipe_core::BlockSource
//! [`RegionId`]: kvpipe_core::RegionId
//! [`WritePlan`]: kvpipe_core::WritePlan

mod apply;
mod construct;
mod content;
#[cfg(feature = "cuda")]
mod device;
mod error;
mod getters;
mod planner;
mod requests;
mod rows;
mod slots;
mod source;
mod spec;
mod split;
mod sync;
mod verify;

use std::collections::HashMap;

use kvpipe_core::{BlockId, LayerGroupLayout, RequestId};

pub use apply::{apply_plan, ApplyError};
pub use content::{content_byte, fill_content, fill_filler, filler_byte};
#[cfg(feature = "cuda")]
pub use device::DevicePool;
pub use error::CacheError;
pub use getters::SlotLocation;
pub use planner::{ChunkPlanError, ChunkPlanner, GroupChunkPlan};
pub use spec::{AllocationStyle, CacheSpec, GroupSpec};
pub use split::{pipeline_layers, split_rank, writers_of, RankShape, RankSplit};
pub use verify::BlockMismatch;

/// One layer group's state: its layout, free slots, slot owners and pool memory.
#[derive(Clone, Debug)]
struct GroupState {
    layout: LayerGroupLayout,
    sink_tokens: u32,
    /// Free slots, used as a stack: the last freed is handed out first, so slots never used
    /// stay at the bottom and are taken only when every used one is held.
    free: Vec<u32>,
    /// slot → (request, ordinal) it currently holds.
    owner: Vec<Option<(RequestId, u32)>>,
    /// slot → whether it was ever handed out (its memory then holds filler or content).
    touched: Vec<bool>,
    /// Slots held now.
    held: u32,
    /// The most slots held at once.
    peak: u32,
    /// Bytes of one block over all pools of the group.
    block_bytes: u64,
    /// One memory buffer per pool (empty when not materialised).
    memory: Vec<Vec<u8>>,
    /// What of the slots' host bytes was written since the last upload, while the pools are in
    /// device memory (`None` otherwise).
    dirty: Option<Vec<Dirty>>,
}

/// Host bytes of a slot written since the last upload: all of it, or only the group's layers
/// `layers` (`[begin, end)`, counted from the rank's first layer of the group, as pools'
/// `layer_begin`): a chunk computed in layer ranges uploads each range's layers, not its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Dirty {
    slot: u32,
    layers: Option<(u16, u16)>,
}

/// One request's block tables.
#[derive(Clone, Debug)]
struct RequestState {
    prompt_len: u32,
    /// Tokens whose KV has been written (the receiver: the whole prompt).
    computed: u32,
    /// Per group: ordinal → slot (`None`: evicted, or below the receiver's window).
    tables: Vec<Vec<Option<BlockId>>>,
    /// Per group: first ordinal not yet considered for eviction.
    evict_from: Vec<u32>,
}

/// The reference paged KV cache (see the module doc). Implements [`BlockSource`] with the
/// bounded contract.
///
/// [`BlockSource`]: kvpipe_core::BlockSource
#[derive(Clone, Debug)]
pub struct ReferenceCache {
    tpb: u32,
    groups: Vec<GroupState>,
    first_region: u32,
    /// region id − first_region → (group, pool).
    regions: Vec<(usize, usize)>,
    requests: HashMap<RequestId, RequestState>,
    lookups: u64,
    materialized: bool,
    /// The pools' device memory, once placed there (`cuda` feature).
    #[cfg(feature = "cuda")]
    device: device::DeviceMirror,
}
