//! Building a cache from a [`CacheSpec`]: its groups' layouts, pools, memory and free lists,
//! for the whole model or for one rank's part of it.

use std::collections::HashMap;

use kvpipe_core::{GroupShard, LayerGroupLayout, PoolLayout, RegionId};

use super::content::fill_filler;
#[cfg(feature = "cuda")]
use super::device;
use super::error::CacheError;
use super::slots::shuffle;
use super::spec::CacheSpec;
use super::{GroupState, ReferenceCache};

impl ReferenceCache {
    /// Builds an empty cache holding the whole model: all slots free, memory (if materialised)
    /// filled with [`filler_byte`] (windowed pools: as slots are first handed out).
    ///
    /// [`filler_byte`]: super::filler_byte
    pub fn new(spec: &CacheSpec) -> Result<Self, CacheError> {
        Self::with_shards(spec, &[])
    }

    /// Builds an empty cache of one rank of a tensor/pipeline split: `spec`'s groups are what
    /// the rank holds (its layers and KV heads) and `shards[g]` where they sit in the whole
    /// model's group `g` (a missing entry: the whole group). The content it computes and
    /// verifies is the whole model's ([`content_byte`] of the model layer and of the byte's
    /// place in the model's `[K|V][head][token][dim]` layer), so ranks split differently on
    /// the two sides hold equal bytes for equal model coordinates.
    ///
    /// [`content_byte`]: super::content_byte
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
}
