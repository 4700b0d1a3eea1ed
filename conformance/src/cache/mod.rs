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

mod content;
#[cfg(feature = "cuda")]
mod device;
mod planner;
mod split;

use std::collections::HashMap;

use kvpipe_core::{
    stale_boundary, AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, GeometryError,
    GroupIndex, GroupShard, LayerGroupLayout, PoolLayout, RegionId, RequestId, StaleBoundary,
    WritePlan,
};
use thiserror::Error;

pub use content::{content_byte, fill_content, fill_filler, filler_byte};
#[cfg(feature = "cuda")]
pub use device::DevicePool;
pub use planner::{ChunkPlanError, ChunkPlanner, GroupChunkPlan};
pub use split::{pipeline_layers, split_rank, writers_of, RankShape, RankSplit};

/// One layer group of a [`CacheSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Layers in the group.
    pub layers: u16,
    /// 2 for K and V planes, 1 for MLA.
    pub kv_factor: u8,
    /// KV heads.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Bytes per element.
    pub elem_bytes: u8,
    /// Sliding window in tokens; `None` for full attention.
    pub window: Option<u32>,
    /// Leading tokens a windowed group keeps resident while the window slides past them.
    pub sink_tokens: u32,
    /// Layers held by each pool, in layer order (sums to `layers`).
    pub pool_split: Vec<u16>,
    /// Extra bytes at the end of every slot (padding: consecutive slots then never coalesce).
    pub slot_padding: u64,
}

impl GroupSpec {
    /// A full-attention group of `layers` layers with a small head geometry, held in pools of
    /// `pool_split` layers each.
    pub fn full(layers: u16, pool_split: &[u16]) -> Self {
        GroupSpec {
            layers,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 2,
            elem_bytes: 1,
            window: None,
            sink_tokens: 0,
            pool_split: pool_split.to_vec(),
            slot_padding: 0,
        }
    }

    /// The same group with a sliding window of `window` tokens and `sink_tokens` sink tokens.
    pub fn windowed(mut self, window: u32, sink_tokens: u32) -> Self {
        self.window = Some(window);
        self.sink_tokens = sink_tokens;
        self
    }
}

/// The shape of a [`ReferenceCache`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// Tokens per block (every group).
    pub tokens_per_block: u32,
    /// The layer groups.
    pub groups: Vec<GroupSpec>,
    /// Block slots per group (every pool of a group has this many).
    pub slots_per_group: u32,
    /// Region id of the first pool; pools are numbered consecutively from it, group by group.
    pub first_region: u32,
    /// `None`: slots are handed out in order (contiguous ids); `Some(seed)`: in a seeded
    /// shuffled order, so block tables are fragmented.
    pub slot_order_seed: Option<u64>,
    /// Whether pools have memory. Without it the cache only keeps block tables (benches).
    pub materialize: bool,
}

/// Bytes of bookkeeping per slot of each group (free list, owner, touched flag, and a request
/// table entry for the block the slot holds), rounded up.
const TABLE_BYTES_PER_SLOT: u64 = 64;

impl GroupSpec {
    /// Bytes of one block over all the group's pools (`None`: it does not fit in a `u64`).
    pub fn block_bytes(&self, tokens_per_block: u32) -> Option<u64> {
        let per_layer = u64::from(self.kv_factor)
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(tokens_per_block))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.elem_bytes))?;
        per_layer.checked_mul(u64::from(self.layers))?.checked_add(
            self.slot_padding
                .checked_mul(self.pool_split.len() as u64)?,
        )
    }
}

impl CacheSpec {
    /// Bytes every pool reserves (every slot of every pool; `None`: past `u64`). A windowed
    /// pool's memory is committed only as its slots are first used; see
    /// [`CacheSpec::footprint`].
    pub fn pool_bytes(&self) -> Option<u64> {
        if !self.materialize {
            return Some(0);
        }
        self.groups.iter().try_fold(0u64, |sum, g| {
            g.block_bytes(self.tokens_per_block)?
                .checked_mul(u64::from(self.slots_per_group))?
                .checked_add(sum)
        })
    }

    /// An upper bound on the memory a cache built from this spec holds while it serves
    /// `requests` requests at once prefilled in chunks of `chunk_tokens` (`None`: past `u64`):
    /// its block tables, its full-attention pools (committed whole when built) and, of each
    /// windowed pool, the slots its window, the chunk being computed and the sink tokens can
    /// hold at once for every request. Computed without allocating, so a caller
    /// can refuse a spec that does not fit before building it.
    pub fn footprint(&self, requests: u32, chunk_tokens: u32) -> Option<u64> {
        let tpb = u64::from(self.tokens_per_block.max(1));
        let slots = u64::from(self.slots_per_group);
        self.groups.iter().try_fold(0u64, |sum, g| {
            let tables = slots.checked_mul(TABLE_BYTES_PER_SLOT)?;
            let used = match g.window {
                Some(w) if self.materialize => {
                    let per_request = u64::from(w).div_ceil(tpb)
                        + u64::from(chunk_tokens).div_ceil(tpb)
                        + u64::from(g.sink_tokens).div_ceil(tpb)
                        + 2;
                    per_request.checked_mul(u64::from(requests))?.min(slots)
                }
                _ if self.materialize => slots,
                _ => 0,
            };
            g.block_bytes(self.tokens_per_block)?
                .checked_mul(used)?
                .checked_add(tables)?
                .checked_add(sum)
        })
    }
}

/// How the sender allocates a request's full-attention blocks (a windowed group always
/// allocates a block when the chunk that computes it runs: its pool holds only live blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllocationStyle {
    /// Every block of the prompt when prefill begins.
    FullPrompt,
    /// The blocks each chunk needs, when it is computed.
    Incremental,
}

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
    /// Slots whose host bytes were written since the last upload, while the pools are in
    /// device memory (`None` otherwise).
    dirty: Option<Vec<u32>>,
}

impl GroupState {
    /// Hands out a free slot for `(request, ordinal)`; writes filler over it the first time.
    fn take(&mut self, request: RequestId, ordinal: u32) -> Option<BlockId> {
        let slot = self.free.pop()?;
        let s = slot as usize;
        self.owner[s] = Some((request, ordinal));
        if !self.touched[s] {
            self.touched[s] = true;
            for (pool, bytes) in self.layout.pools.iter().zip(&mut self.memory) {
                if bytes.is_empty() {
                    continue;
                }
                let at = u64::from(slot) * pool.slot_bytes;
                let range = at as usize..(at + pool.slot_bytes) as usize;
                fill_filler(pool.region, at, &mut bytes[range]);
            }
            self.mark_dirty(slot);
        }
        self.held += 1;
        self.peak = self.peak.max(self.held);
        Some(BlockId(slot))
    }

    /// Notes that the host bytes of `slot` changed (uploaded by the next flush when the pools
    /// are in device memory).
    fn mark_dirty(&mut self, slot: u32) {
        if let Some(dirty) = &mut self.dirty {
            dirty.push(slot);
        }
    }

    /// Gives `slot` back (it is handed out again before any slot never used).
    fn give_back(&mut self, slot: BlockId) {
        self.owner[slot.0 as usize] = None;
        self.free.push(slot.0);
        self.held -= 1;
    }

    /// Whether a request of `prompt_len` tokens keeps only a window of this group's blocks.
    fn windowed_for(&self, prompt_len: u32) -> bool {
        self.layout.is_windowed_for(prompt_len)
    }

    /// The first ordinal of a windowed group still live once `tokens` tokens are computed (its
    /// sink blocks aside); 0 for a group that keeps every block.
    fn live_from(&self, prompt_len: u32, tokens: u32) -> u32 {
        match self.layout.window {
            Some(w) if self.windowed_for(prompt_len) => {
                stale_boundary(tokens, w, self.layout.tokens_per_block).unwrap_or(0)
            }
            _ => 0,
        }
    }
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

/// Where a byte of a region lies in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotLocation {
    /// The group owning the region.
    pub group: GroupIndex,
    /// Index of the pool in the group.
    pub pool: usize,
    /// The slot.
    pub slot: BlockId,
    /// Byte offset inside the slot.
    pub offset_in_slot: u64,
}

/// A block whose bytes differ from the expected content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockMismatch {
    /// The request.
    pub request: RequestId,
    /// The group.
    pub group: GroupIndex,
    /// The block's ordinal.
    pub ordinal: u32,
    /// Its slot.
    pub slot: BlockId,
    /// The pool where the first difference is.
    pub pool: usize,
    /// Offset of the first differing byte inside the slot.
    pub offset_in_slot: u64,
}

/// The reference paged KV cache (see the module doc). Implements [`BlockSource`] with the
/// bounded contract.
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

impl ReferenceCache {
    /// Builds an empty cache holding the whole model: all slots free, memory (if materialised)
    /// filled with [`filler_byte`] (windowed pools: as slots are first handed out).
    pub fn new(spec: &CacheSpec) -> Result<Self, CacheError> {
        Self::with_shards(spec, &[])
    }

    /// Builds an empty cache of one rank of a tensor/pipeline split: `spec`'s groups are what
    /// the rank holds (its layers and KV heads) and `shards[g]` where they sit in the whole
    /// model's group `g` (a missing entry: the whole group). The content it computes and
    /// verifies is the whole model's ([`content_byte`] of the model layer and of the byte's
    /// place in the model's `[K|V][head][token][dim]` layer), so ranks split differently on
    /// the two sides hold equal bytes for equal model coordinates.
    pub fn with_shards(spec: &CacheSpec, shards: &[GroupShard]) -> Result<Self, CacheError> {
        if spec.tokens_per_block == 0 {
            return Err(CacheError::InvalidSpec {
                group: 0,
                reason: "tokens_per_block is 0",
            });
        }
        let mut groups = Vec::with_capacity(spec.groups.len());
        let mut regions = Vec::new();
        let mut next_region = spec.first_region;
        for (g, gs) in spec.groups.iter().enumerate() {
            let invalid = |reason| CacheError::InvalidSpec {
                group: g as u16,
                reason,
            };
            if gs.pool_split.iter().map(|&l| u32::from(l)).sum::<u32>() != u32::from(gs.layers)
                || gs.pool_split.contains(&0)
            {
                return Err(invalid(
                    "pool_split must hold non-empty layer counts summing to layers",
                ));
            }
            if gs.window == Some(0) {
                return Err(invalid("a window must hold at least one token"));
            }
            let mut layout = LayerGroupLayout {
                layers: gs.layers,
                kv_factor: gs.kv_factor,
                kv_heads: gs.kv_heads,
                head_dim: gs.head_dim,
                elem_bytes: gs.elem_bytes,
                tokens_per_block: spec.tokens_per_block,
                window: gs.window,
                shard: shards.get(g).copied().unwrap_or_default(),
                ..LayerGroupLayout::default()
            };
            if layout.layer_range().end > u32::from(layout.model_layers())
                || layout.head_range().end > u32::from(layout.model_kv_heads())
            {
                return Err(invalid(
                    "the shard's layers and heads must lie inside the model's",
                ));
            }
            let layer_bytes = layout
                .layer_block_bytes()
                .ok_or(invalid("block bytes overflow"))?;
            let mut memory = Vec::new();
            let mut layer_begin = 0u16;
            for (p, &layers) in gs.pool_split.iter().enumerate() {
                let region = RegionId(next_region);
                next_region += 1;
                regions.push((g, p));
                let slot_bytes = u64::from(layers) * layer_bytes + gs.slot_padding;
                layout.pools.push(PoolLayout {
                    region,
                    layer_begin,
                    layers,
                    slot_bytes,
                });
                layer_begin += layers;
                let bytes = if spec.materialize {
                    let len = slot_bytes * u64::from(spec.slots_per_group);
                    let mut bytes = vec![0u8; len as usize];
                    // A full-attention pool keeps every block of its requests: it gets its
                    // filler now, before any transfer runs. A windowed pool stays zeroed memory
                    // the OS commits page by page as slots are first handed out (each gets its
                    // filler then): it holds only a window of blocks.
                    if gs.window.is_none() {
                        fill_filler(region, 0, &mut bytes);
                    }
                    bytes
                } else {
                    Vec::new()
                };
                memory.push(bytes);
            }
            let mut free: Vec<u32> = (0..spec.slots_per_group).rev().collect();
            if let Some(seed) = spec.slot_order_seed {
                shuffle(&mut free, seed ^ ((g as u64) << 32));
            }
            let block_bytes = layout.pools.iter().map(|p| p.slot_bytes).sum();
            groups.push(GroupState {
                layout,
                sink_tokens: gs.sink_tokens,
                free,
                owner: vec![None; spec.slots_per_group as usize],
                touched: vec![gs.window.is_none(); spec.slots_per_group as usize],
                held: 0,
                peak: 0,
                block_bytes,
                memory,
                dirty: None,
            });
        }
        Ok(ReferenceCache {
            tpb: spec.tokens_per_block,
            groups,
            first_region: spec.first_region,
            regions,
            requests: HashMap::new(),
            lookups: 0,
            materialized: spec.materialize,
            #[cfg(feature = "cuda")]
            device: device::DeviceMirror::default(),
        })
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u32 {
        self.tpb
    }

    /// Number of layer groups.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// The layout of `group` as the core sees it.
    pub fn layout(&self, group: GroupIndex) -> Option<&LayerGroupLayout> {
        self.groups.get(usize::from(group.0)).map(|g| &g.layout)
    }

    /// Every group's layout, in group order.
    pub fn layouts(&self) -> Vec<LayerGroupLayout> {
        self.groups.iter().map(|g| g.layout.clone()).collect()
    }

    /// Free slots left in `group`.
    pub fn free_slots(&self, group: GroupIndex) -> usize {
        self.groups
            .get(usize::from(group.0))
            .map_or(0, |g| g.free.len())
    }

    /// The most slots `group` held at once since the cache was built. Slots are reused
    /// last-freed first, so this is also how many distinct slots were ever used: for a
    /// windowed group, the part of its memory the OS committed.
    pub fn peak_slots(&self, group: GroupIndex) -> u32 {
        self.groups.get(usize::from(group.0)).map_or(0, |g| g.peak)
    }

    /// Bytes of the blocks held now, over every group and pool.
    pub fn resident_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.held) * g.block_bytes)
            .sum()
    }

    /// The most bytes each group held at once, summed over the groups: each group's
    /// [`ReferenceCache::peak_slots`] times its block bytes (its pools' slot bytes). It is the
    /// live KV the cache holds at its peak; a windowed pool's memory in RAM is exactly its part
    /// (a full-attention pool is committed whole, and its requests use it whole).
    pub fn peak_resident_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.peak) * g.block_bytes)
            .sum()
    }

    /// Table entries read by [`BlockSource::block_run`] since the cache was built: the bounded
    /// contract's cost, checked by tests.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// The bytes of a region (empty when the cache is not materialised).
    pub fn region(&self, id: RegionId) -> Option<&[u8]> {
        let &(g, p) = self
            .regions
            .get(id.0.checked_sub(self.first_region)? as usize)?;
        Some(&self.groups[g].memory[p])
    }

    /// The bytes of a region, writable (transports copy into it).
    pub fn region_mut(&mut self, id: RegionId) -> Option<&mut [u8]> {
        let &(g, p) = self
            .regions
            .get(id.0.checked_sub(self.first_region)? as usize)?;
        Some(&mut self.groups[g].memory[p])
    }

    /// Every region id of the cache.
    pub fn region_ids(&self) -> impl Iterator<Item = RegionId> + '_ {
        (0..self.regions.len() as u32).map(|i| RegionId(self.first_region + i))
    }

    /// Where byte `offset` of `region` lies.
    pub fn locate(&self, region: RegionId, offset: u64) -> Option<SlotLocation> {
        let &(g, p) = self
            .regions
            .get(region.0.checked_sub(self.first_region)? as usize)?;
        let slot_bytes = self.groups[g].layout.pools[p].slot_bytes;
        let slot = offset / slot_bytes;
        (slot < self.groups[g].owner.len() as u64).then_some(SlotLocation {
            group: GroupIndex(g as u16),
            pool: p,
            slot: BlockId(slot as u32),
            offset_in_slot: offset % slot_bytes,
        })
    }

    /// The (request, ordinal) a slot of `group` holds now.
    pub fn owner(&self, group: GroupIndex, slot: BlockId) -> Option<(RequestId, u32)> {
        *self
            .groups
            .get(usize::from(group.0))?
            .owner
            .get(slot.0 as usize)?
    }

    /// The block table of `request` in `group`: ordinal → slot (`None`: not resident).
    pub fn table(&self, request: RequestId, group: GroupIndex) -> Option<&[Option<BlockId>]> {
        Some(
            &self
                .requests
                .get(&request)?
                .tables
                .get(usize::from(group.0))?[..],
        )
    }

    /// The naive whole-list query the bounded contract replaces: walks every block of the
    /// request from ordinal 0 and returns a fresh list of the resident run ending at the
    /// allocation's end (restarting after each gap). O(request) and allocating; kept only as
    /// the baseline of `kvpipe bench plan` and as a monolithic transfer in tests.
    pub fn whole_block_list(
        &self,
        request: RequestId,
        group: GroupIndex,
    ) -> Result<BlockRun, BlockSourceError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(BlockSourceError::UnknownRequest(request))?;
        let table = req
            .tables
            .get(usize::from(group.0))
            .ok_or(BlockSourceError::UnknownGroup(group))?;
        let mut run = BlockRun::default();
        for (ordinal, entry) in table.iter().enumerate() {
            match entry {
                Some(id) => run.ids.push(*id),
                None => {
                    run.ids.clear();
                    run.first_ordinal = ordinal as u32 + 1;
                }
            }
        }
        Ok(run)
    }

    /// Tokens of `request` whose KV the cache holds.
    pub fn computed_tokens(&self, request: RequestId) -> Option<u32> {
        self.requests.get(&request).map(|r| r.computed)
    }

    /// Sender side: starts prefill of `request`, with its first `prefix_tokens` tokens already
    /// cached (reused prefix, content written now). Allocates every block of the prompt
    /// ([`AllocationStyle::FullPrompt`]) or only the prefix's ([`AllocationStyle::Incremental`]).
    pub fn begin_prefill(
        &mut self,
        request: RequestId,
        prompt_len: u32,
        prefix_tokens: u32,
        style: AllocationStyle,
    ) -> Result<(), CacheError> {
        if self.requests.contains_key(&request) {
            return Err(CacheError::DuplicateRequest(request));
        }
        if prefix_tokens > prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end: prefix_tokens,
                prompt_len,
            });
        }
        let groups = self.groups.len();
        self.requests.insert(
            request,
            RequestState {
                prompt_len,
                computed: 0,
                tables: vec![Vec::new(); groups],
                evict_from: vec![0; groups],
            },
        );
        let allocate_to = match style {
            AllocationStyle::FullPrompt => prompt_len,
            AllocationStyle::Incremental => prefix_tokens,
        };
        // The reused prefix is already cached: a windowed group holds only its live part.
        let result = self
            .allocate_to(
                request,
                allocate_to.div_ceil(self.tpb),
                prefix_tokens.div_ceil(self.tpb),
                prefix_tokens,
            )
            .and_then(|()| self.compute(request, 0, prefix_tokens, None, true));
        if result.is_err() {
            self.release(request);
        }
        result.and_then(|()| self.flush_device())
    }

    /// Sender side: prefill computed tokens `[start, end)` of `request`: allocates their blocks
    /// if needed, writes their content, then evicts windowed blocks that left the window.
    /// Chunks must be computed in order (`start` = tokens computed so far).
    pub fn compute_chunk(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
    ) -> Result<(), CacheError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        if start != req.computed || end < start {
            return Err(CacheError::ChunkOutOfOrder {
                start,
                end,
                computed: req.computed,
            });
        }
        if end > req.prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end,
                prompt_len: req.prompt_len,
            });
        }
        let blocks = end.div_ceil(self.tpb);
        self.allocate_to(request, blocks, blocks, start)?;
        self.compute(request, start, end, None, true)?;
        self.flush_device()
    }

    /// Sender side, one range of a chunk's layers at a time, as an engine computes them:
    /// [`compute_chunk`](Self::compute_chunk) writing only layers `layers[g]` of each group
    /// `g` (counted from the rank's first layer of the group, as pools' `layer_begin`; a group
    /// without an entry writes nothing). The chunk's blocks are allocated by its first call;
    /// its `last` call (the chunk's last range) evicts what left the window and marks the
    /// chunk computed, so every call of one chunk passes the same `start` and `end`.
    pub fn compute_chunk_layers(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
        layers: &[std::ops::Range<u16>],
        last: bool,
    ) -> Result<(), CacheError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        if start != req.computed || end < start {
            return Err(CacheError::ChunkOutOfOrder {
                start,
                end,
                computed: req.computed,
            });
        }
        if end > req.prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end,
                prompt_len: req.prompt_len,
            });
        }
        let blocks = end.div_ceil(self.tpb);
        self.allocate_to(request, blocks, blocks, start)?;
        self.compute(request, start, end, Some(layers), last)?;
        self.flush_device()
    }

    /// Writes the content of tokens `[start, end)` (and, when `end` completes the prompt, of
    /// the last block's padding tokens) of every layer, or of `layers[g]` in each group `g`;
    /// with `finish`, then evicts and marks the tokens computed.
    fn compute(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
        layers: Option<&[std::ops::Range<u16>]>,
        finish: bool,
    ) -> Result<(), CacheError> {
        let tpb = self.tpb;
        let req = self
            .requests
            .get_mut(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        let prompt_len = req.prompt_len;
        let token_end = if end == prompt_len {
            prompt_len.div_ceil(tpb) * tpb
        } else {
            end
        };
        for (g, group) in self.groups.iter_mut().enumerate() {
            let table = &req.tables[g];
            if self.materialized {
                let first_block = start / tpb;
                let end_block = token_end.div_ceil(tpb);
                let windowed = group.windowed_for(prompt_len);
                for ordinal in first_block..end_block {
                    let slot = match table[ordinal as usize] {
                        Some(slot) => slot,
                        // A windowed group never allocated what had left its window before the
                        // computation began (a reused prefix's head): nothing to write there.
                        None if windowed => continue,
                        None => {
                            return Err(CacheError::NotAllocated {
                                group: GroupIndex(g as u16),
                                ordinal,
                            })
                        }
                    };
                    let lo = start.max(ordinal * tpb) - ordinal * tpb;
                    let hi = token_end.min((ordinal + 1) * tpb) - ordinal * tpb;
                    let only = layers.map(|l| l.get(g).cloned().unwrap_or(0..0));
                    write_content(group, request, g, ordinal, slot, lo..hi, tpb, only);
                }
            }
            if !finish {
                continue;
            }
            // Evict what left the window (the cache's own policy; sinks stay resident).
            if let Some(w) = group.layout.window {
                if group.layout.is_windowed_for(prompt_len) {
                    let stale = stale_boundary(end, w, tpb).unwrap_or(0);
                    let sinks = group.sink_tokens.div_ceil(tpb);
                    let from = req.evict_from[g].max(sinks);
                    let table = &mut req.tables[g];
                    for ordinal in from..stale.min(table.len() as u32) {
                        if let Some(slot) = table[ordinal as usize].take() {
                            group.give_back(slot);
                        }
                    }
                    req.evict_from[g] = req.evict_from[g].max(stale);
                }
            }
        }
        if finish {
            req.computed = end;
        }
        Ok(())
    }

    /// Grows the tables of `request` to `blocks` ordinals (a windowed group's to
    /// `windowed_blocks`: only what is being computed), taking free slots. A windowed group
    /// leaves the ordinals that were out of its window before token `from_token` unallocated
    /// (its sink blocks aside).
    fn allocate_to(
        &mut self,
        request: RequestId,
        blocks: u32,
        windowed_blocks: u32,
        from_token: u32,
    ) -> Result<(), CacheError> {
        let req = self
            .requests
            .get_mut(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        let prompt_len = req.prompt_len;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let table = &mut req.tables[g];
            let (blocks, live_from) = if group.windowed_for(prompt_len) {
                (windowed_blocks, group.live_from(prompt_len, from_token))
            } else {
                (blocks, 0)
            };
            let sinks = group.sink_tokens.div_ceil(self.tpb);
            while (table.len() as u32) < blocks {
                let ordinal = table.len() as u32;
                if ordinal >= sinks && ordinal < live_from {
                    table.push(None);
                    continue;
                }
                let slot = group.take(request, ordinal).ok_or(CacheError::OutOfSlots {
                    group: GroupIndex(g as u16),
                })?;
                table.push(Some(slot));
            }
        }
        Ok(())
    }

    /// Receiver side: allocates `request`'s destination blocks for a prompt of `prompt_len`
    /// tokens, of which the first `cached_prefix_tokens` are already cached here (their full
    /// blocks get their content now), and returns each group's [`AnchoredRun`]: the blocks the
    /// receiver lacks — from the cached prefix's end (and, for a windowed group, from the stale
    /// boundary) to the prompt's last block.
    pub fn register_destination(
        &mut self,
        request: RequestId,
        prompt_len: u32,
        cached_prefix_tokens: u32,
    ) -> Result<Vec<AnchoredRun>, CacheError> {
        if self.requests.contains_key(&request) {
            return Err(CacheError::DuplicateRequest(request));
        }
        if cached_prefix_tokens > prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end: cached_prefix_tokens,
                prompt_len,
            });
        }
        let tpb = self.tpb;
        let total = prompt_len.div_ceil(tpb);
        let prefix_blocks = cached_prefix_tokens / tpb;
        let mut state = RequestState {
            prompt_len,
            computed: prompt_len,
            tables: Vec::with_capacity(self.groups.len()),
            evict_from: vec![0; self.groups.len()],
        };
        let mut runs = Vec::with_capacity(self.groups.len());
        let mut failed = None;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let stale = StaleBoundary::for_group(prompt_len, &group.layout)
                .map_or(0, StaleBoundary::ordinal);
            let mut table = vec![None; total as usize];
            let mut run = AnchoredRun::empty(stale.max(prefix_blocks).min(total));
            for ordinal in stale..total {
                let Some(slot) = group.take(request, ordinal) else {
                    failed = Some(CacheError::OutOfSlots {
                        group: GroupIndex(g as u16),
                    });
                    break;
                };
                table[ordinal as usize] = Some(slot);
                if ordinal < prefix_blocks {
                    if self.materialized {
                        write_content(group, request, g, ordinal, slot, 0..tpb, tpb, None);
                    }
                } else {
                    run.push(slot);
                }
            }
            state.tables.push(table);
            runs.push(run);
            if failed.is_some() {
                break;
            }
        }
        self.requests.insert(request, state);
        if let Some(err) = failed {
            self.release(request);
            return Err(err);
        }
        self.flush_device()?;
        Ok(runs)
    }

    /// Brings the pools' bytes back from device memory into the host buffers the checks read
    /// ([`ReferenceCache::verify`], [`ReferenceCache::snapshot`], [`ReferenceCache::region`]);
    /// a no-op for a cache whose pools are host memory. Call it when no transfer touches the
    /// pools (every request quiesced).
    pub fn sync_from_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.download_all();
        }
        Ok(())
    }

    /// [`ReferenceCache::sync_from_device`] for the slots requests hold only (every slot a
    /// check of a request reads): the host bytes of other slots stay as they were, and
    /// uncommitted. Without a device it does nothing.
    pub fn sync_held_from_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.download_held();
        }
        Ok(())
    }

    /// Whether the pools live in device memory (`cuda` feature:
    /// `ReferenceCache::place_on_device`).
    pub fn is_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.device.is_placed();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Uploads the slots the host wrote since the last upload (pools in device memory only).
    fn flush_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.upload_dirty();
        }
        Ok(())
    }

    /// Frees every slot of `request` (its memory keeps its bytes, as a real cache's would).
    pub fn release(&mut self, request: RequestId) {
        if let Some(req) = self.requests.remove(&request) {
            for (g, table) in req.tables.into_iter().enumerate() {
                for slot in table.into_iter().flatten() {
                    self.groups[g].give_back(slot);
                }
            }
        }
    }

    /// Checks every resident block of `request` in `group` with ordinal in `ordinals` against
    /// the expected content of the tokens the cache holds; returns the blocks that differ.
    /// Bytes of tokens not computed yet are not checked.
    pub fn verify_blocks(
        &self,
        request: RequestId,
        group: GroupIndex,
        ordinals: std::ops::Range<u32>,
    ) -> Vec<BlockMismatch> {
        let mut out = Vec::new();
        let (Some(req), Some(gs)) = (
            self.requests.get(&request),
            self.groups.get(usize::from(group.0)),
        ) else {
            return out;
        };
        if !self.materialized {
            return out;
        }
        let tpb = self.tpb;
        let valid_tokens = if req.computed == req.prompt_len {
            req.prompt_len.div_ceil(tpb) * tpb
        } else {
            req.computed
        };
        let table = &req.tables[usize::from(group.0)];
        for ordinal in ordinals {
            let Some(Some(slot)) = table.get(ordinal as usize).copied() else {
                continue;
            };
            let hi = valid_tokens
                .min((ordinal + 1) * tpb)
                .saturating_sub(ordinal * tpb);
            if let Some((pool, offset_in_slot)) =
                first_difference(gs, request, group, ordinal, slot, 0..hi, tpb)
            {
                out.push(BlockMismatch {
                    request,
                    group,
                    ordinal,
                    slot,
                    pool,
                    offset_in_slot,
                });
            }
        }
        out
    }

    /// [`ReferenceCache::verify_blocks`] over every group and ordinal of `request`.
    pub fn verify(&self, request: RequestId) -> Vec<BlockMismatch> {
        let Some(req) = self.requests.get(&request) else {
            return Vec::new();
        };
        (0..self.groups.len())
            .flat_map(|g| {
                let blocks = req.tables[g].len() as u32;
                self.verify_blocks(request, GroupIndex(g as u16), 0..blocks)
            })
            .collect()
    }

    /// [`ReferenceCache::verify_blocks`] over the blocks of `request` a sender sends when it
    /// keeps a window of `sender_windows[g]` tokens in group `g` (`None`, or no entry: full
    /// attention): from its stale boundary to the end of the prompt. A receiver may keep a
    /// larger window than the sender; the older blocks are never written.
    pub fn verify_sent(
        &self,
        request: RequestId,
        sender_windows: &[Option<u32>],
    ) -> Result<Vec<BlockMismatch>, GeometryError> {
        let Some(req) = self.requests.get(&request) else {
            return Ok(Vec::new());
        };
        let (prompt, tpb) = (req.prompt_len, self.tpb);
        let mut out = Vec::new();
        for g in 0..self.groups.len() {
            let first = match sender_windows.get(g).copied().flatten() {
                Some(w) => StaleBoundary::new(prompt, w, tpb)?.ordinal(),
                None => 0,
            };
            out.extend(self.verify_blocks(
                request,
                GroupIndex(g as u16),
                first..prompt.div_ceil(tpb),
            ));
        }
        Ok(out)
    }

    /// A copy of every region's bytes, in [`ReferenceCache::region_ids`] order.
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        self.region_ids()
            .map(|id| self.region(id).unwrap_or_default().to_vec())
            .collect()
    }

    /// The (group, pool, slot) triples whose bytes differ from `before` (a
    /// [`ReferenceCache::snapshot`]).
    pub fn changed_slots(&self, before: &[Vec<u8>]) -> Vec<(GroupIndex, usize, BlockId)> {
        let mut out = Vec::new();
        for (i, id) in self.region_ids().enumerate() {
            let (g, p) = self.regions[i];
            let now = self.region(id).unwrap_or_default();
            let slot_bytes = self.groups[g].layout.pools[p].slot_bytes as usize;
            let Some(old) = before.get(i) else { continue };
            for (s, (a, b)) in now
                .chunks(slot_bytes)
                .zip(old.chunks(slot_bytes))
                .enumerate()
            {
                if a != b {
                    out.push((GroupIndex(g as u16), p, BlockId(s as u32)));
                }
            }
        }
        out
    }
}

/// Fisher–Yates with a xorshift64* generator: a reproducible slot order.
fn shuffle(v: &mut [u32], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
}

/// Calls `f(pool, slot_byte_offset, layer, byte_in_layer, len)` for every row (one head's
/// elements of one token) of tokens `tokens` of block `slot` in every pool of `group`. `layer`
/// is the model's layer of the group and `byte_in_layer` the row's place in the model's layer
/// (`[K|V][head][token][dim]` over all the model's KV heads), so a rank holding part of the
/// model sees the same coordinates as one holding all of it.
fn for_each_row(
    group: &GroupState,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
    mut f: impl FnMut(usize, u64, u16, u64, u64),
) {
    let layout = &group.layout;
    let row = u64::from(layout.head_dim) * u64::from(layout.elem_bytes);
    let tpb = u64::from(tpb);
    let heads = u64::from(layout.kv_heads);
    let model_heads = u64::from(layout.model_kv_heads());
    let first_head = u64::from(layout.shard.first_head);
    let rows = u64::from(layout.kv_factor) * heads * tpb;
    let layer_bytes = rows * row;
    for (p, pool) in layout.pools.iter().enumerate() {
        let base = u64::from(slot.0) * pool.slot_bytes;
        for i in 0..pool.layers {
            let layer = layout.shard.first_layer + pool.layer_begin + i;
            let layer_base = base + u64::from(i) * layer_bytes;
            for r in 0..rows {
                let token = (r % tpb) as u32;
                if tokens.contains(&token) {
                    let (kv, head) = (r / (heads * tpb), (r / tpb) % heads);
                    let model_row = (kv * model_heads + first_head + head) * tpb + r % tpb;
                    f(p, layer_base + r * row, layer, model_row * row, row);
                }
            }
        }
    }
}

/// Writes the expected content of tokens `tokens` (relative to the block) of `ordinal`: of
/// every layer, or of the rank's layers `only` of the group (counted from its first).
#[allow(clippy::too_many_arguments)]
fn write_content(
    group: &mut GroupState,
    request: RequestId,
    g: usize,
    ordinal: u32,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
    only: Option<std::ops::Range<u16>>,
) {
    let first = group.layout.shard.first_layer;
    let mut writes = Vec::new();
    for_each_row(group, slot, tokens, tpb, |p, at, layer, byte, len| {
        if only.as_ref().is_none_or(|l| l.contains(&(layer - first))) {
            writes.push((p, at, layer, byte, len));
        }
    });
    for (p, at, layer, byte, len) in writes {
        let row = &mut group.memory[p][at as usize..(at + len) as usize];
        fill_content(request, GroupIndex(g as u16), ordinal, layer, byte, row);
    }
    group.mark_dirty(slot.0);
}

/// The first byte of tokens `tokens` of `ordinal` that differs from the expected content, as
/// (pool, offset in slot).
fn first_difference(
    group: &GroupState,
    request: RequestId,
    g: GroupIndex,
    ordinal: u32,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
) -> Option<(usize, u64)> {
    let mut found = None;
    let mut expected = Vec::new();
    for_each_row(group, slot, tokens, tpb, |p, at, layer, byte, len| {
        if found.is_some() {
            return;
        }
        let mem = &group.memory[p][at as usize..(at + len) as usize];
        let slot_base = u64::from(slot.0) * group.layout.pools[p].slot_bytes;
        expected.resize(len as usize, 0);
        fill_content(request, g, ordinal, layer, byte, &mut expected);
        if let Some(k) = mem.iter().zip(&expected).position(|(a, b)| a != b) {
            found = Some((p, at + k as u64 - slot_base));
        }
    });
    found
}

impl BlockSource for ReferenceCache {
    /// The bounded query: walks back from `end` over resident blocks only, never past `begin`,
    /// so it reads at most `end - begin` table entries.
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(BlockSourceError::UnknownRequest(request))?;
        let table = req
            .tables
            .get(usize::from(group.0))
            .ok_or(BlockSourceError::UnknownGroup(group))?;
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end as usize > table.len() {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: table.len() as u32,
            });
        }
        out.ids.clear();
        let mut first = end;
        while first > begin {
            self.lookups += 1;
            match table[first as usize - 1] {
                Some(id) => out.ids.push(id),
                None => break,
            }
            first -= 1;
        }
        out.ids.reverse();
        out.first_ordinal = first;
        Ok(())
    }
}

/// Carries out `plan` by memcpy from `src`'s regions to `dst`'s; returns the bytes copied.
/// Every extent is bounds-checked first, so a bad plan changes nothing.
pub fn apply_plan(
    src: &ReferenceCache,
    dst: &mut ReferenceCache,
    plan: &WritePlan,
) -> Result<u64, ApplyError> {
    for e in plan.extents() {
        let s = src.region(e.src_region).ok_or(ApplyError::UnknownRegion {
            side: "sender",
            region: e.src_region,
        })?;
        let d = dst.region(e.dst_region).ok_or(ApplyError::UnknownRegion {
            side: "receiver",
            region: e.dst_region,
        })?;
        for (side, region, offset, size) in [
            ("sender", e.src_region, e.src_offset, s.len()),
            ("receiver", e.dst_region, e.dst_offset, d.len()),
        ] {
            if offset
                .checked_add(e.len)
                .is_none_or(|end| end > size as u64)
            {
                return Err(ApplyError::OutOfBounds {
                    side,
                    region,
                    offset,
                    len: e.len,
                    size: size as u64,
                });
            }
        }
    }
    let mut copied = 0;
    for e in plan.extents() {
        let (so, doff, len) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
        let s = &src.region(e.src_region).unwrap_or_default()[so..so + len];
        dst.region_mut(e.dst_region).unwrap_or_default()[doff..doff + len].copy_from_slice(s);
        copied += e.len;
    }
    Ok(copied)
}

/// Why the reference cache refused an operation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CacheError {
    /// The spec is inconsistent.
    #[error("invalid cache spec for group {group}: {reason}")]
    InvalidSpec {
        /// The group concerned.
        group: u16,
        /// What is wrong.
        reason: &'static str,
    },
    /// A group has no free slot left.
    #[error("{group} has no free block slot left: make the cache larger")]
    OutOfSlots {
        /// The exhausted group.
        group: GroupIndex,
    },
    /// The request already exists.
    #[error("the cache already holds {0}")]
    DuplicateRequest(RequestId),
    /// The request does not exist.
    #[error("the cache holds no {0}")]
    UnknownRequest(RequestId),
    /// A chunk does not start where prefill stands.
    #[error("chunk {start}..{end} is out of order: {computed} tokens are computed")]
    ChunkOutOfOrder {
        /// First token of the chunk.
        start: u32,
        /// One past its last token.
        end: u32,
        /// Tokens computed so far.
        computed: u32,
    },
    /// Tokens past the prompt.
    #[error("token {end} is past the prompt's {prompt_len} tokens")]
    TokensPastPrompt {
        /// The offending token bound.
        end: u32,
        /// Tokens in the prompt.
        prompt_len: u32,
    },
    /// A block to write is not resident.
    #[error("{group} block {ordinal} is not allocated")]
    NotAllocated {
        /// The group.
        group: GroupIndex,
        /// The ordinal.
        ordinal: u32,
    },
    /// The pools' device memory could not be allocated, written or read (`cuda` feature).
    #[cfg(feature = "cuda")]
    #[error("device memory: {0}")]
    Device(#[from] kvpipe_cuda::CudaError),
}

/// Why a write plan could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ApplyError {
    /// The plan names a region the cache does not have.
    #[error("the {side} cache has no {region}")]
    UnknownRegion {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
    },
    /// An extent runs past its region.
    #[error("{side} extent {offset}+{len} runs past {region}'s {size} bytes")]
    OutOfBounds {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
        /// Start of the extent.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's size.
        size: u64,
    },
}
