//! The shape of a KV cache as the core sees it: layer groups, their pools and the byte layout
//! of one block slot, and where a rank's part of each group sits in the whole model
//! ([`GroupShard`]). The core computes byte extents from this; it never touches the memory.

use core::ops::Range;

use smallvec::SmallVec;

use crate::ids::RegionId;

/// How the bytes of one block slot are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum BlockLayout {
    /// `[layer][K|V][head][token][dim]` (one K/V plane for MLA, `kv_factor == 1`).
    #[default]
    LayerKvHeadTokenDim = 0,
}

/// One pool of a layer group: a registered region holding a contiguous range of the rank's
/// layers of the group for every block slot. Block `b` of the group occupies, in this pool, the
/// bytes `[b * slot_bytes, (b + 1) * slot_bytes)` of `region`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PoolLayout {
    /// The region that holds this pool.
    pub region: RegionId,
    /// First layer held in this pool, counted from the first layer of the group this rank
    /// holds ([`GroupShard::first_layer`]; 0 for the rank's first layer).
    pub layer_begin: u16,
    /// Number of consecutive layers held in this pool.
    pub layers: u16,
    /// Bytes per block slot (at least `layers * layer_block_bytes`; may include padding).
    pub slot_bytes: u64,
}

/// Where one rank's part of a layer group sits in the whole model's group: which of the
/// group's layers it holds (pipeline parallelism: a layer range) and which of its KV heads
/// (tensor parallelism: a head range; with fewer KV heads than ranks, several ranks hold the
/// same head).
///
/// The default (every field 0) means the rank holds the whole group: `model_layers` 0 stands
/// for the rank's own `layers` and `model_kv_heads` 0 for its own `kv_heads`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct GroupShard {
    /// Layers of the group in the whole model (0: the rank's `layers`, i.e. all of them).
    pub model_layers: u16,
    /// The first of the group's layers this rank holds; its `layers` layers follow.
    pub first_layer: u16,
    /// KV heads of the group in the whole model (0: the rank's `kv_heads`, i.e. all of them).
    pub model_kv_heads: u16,
    /// The first of the model's KV heads this rank holds; its `kv_heads` heads follow.
    pub first_head: u16,
}

/// A layer group: layers that share one block table per request, and optionally a sliding
/// attention window.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct LayerGroupLayout {
    /// Layers in this group on this rank.
    pub layers: u16,
    /// 2 for separate K and V planes, 1 for MLA's joint latent.
    pub kv_factor: u8,
    /// KV heads held by this rank (`[K|V][head]` planes of a layer hold these heads, in order).
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8).
    pub elem_bytes: u8,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Sliding attention window in tokens; `None` for full attention.
    pub window: Option<u32>,
    /// Byte order inside a slot.
    pub block_layout: BlockLayout,
    /// The pools that hold this rank's layers of the group, in layer order.
    pub pools: SmallVec<[PoolLayout; 2]>,
    /// Where this rank's layers and heads sit in the whole model's group.
    pub shard: GroupShard,
}

impl LayerGroupLayout {
    /// Bytes one layer contributes to one block (`kv_factor * kv_heads * tpb * head_dim * elem`),
    /// or `None` on overflow.
    pub fn layer_block_bytes(&self) -> Option<u64> {
        u64::from(self.kv_factor)
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(self.tokens_per_block))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.elem_bytes))
    }

    /// The slots every pool of the group holds, given the byte length of the regions its
    /// pools name (`region_bytes`, as [`SenderConfig::region_bytes`](crate::SenderConfig::region_bytes)):
    /// the smallest `length / slot_bytes` over the pools whose region is listed, or `None`
    /// when none is.
    pub fn slots_in(&self, region_bytes: &[(RegionId, u64)]) -> Option<u64> {
        self.pools
            .iter()
            .filter_map(|p| {
                let (_, len) = region_bytes.iter().find(|(r, _)| *r == p.region)?;
                Some(len.checked_div(p.slot_bytes).unwrap_or(u64::MAX))
            })
            .min()
    }

    /// Whether the group is windowed for a prompt of `prompt_len` tokens: only when the window
    /// is shorter than the prompt. A window of at least the prompt behaves as full attention.
    pub fn is_windowed_for(&self, prompt_len: u32) -> bool {
        matches!(self.window, Some(w) if w < prompt_len)
    }

    /// Layers of the group in the whole model.
    pub fn model_layers(&self) -> u16 {
        match self.shard.model_layers {
            0 => self.layers,
            n => n,
        }
    }

    /// KV heads of the group in the whole model.
    pub fn model_kv_heads(&self) -> u16 {
        match self.shard.model_kv_heads {
            0 => self.kv_heads,
            n => n,
        }
    }

    /// The group's layers (in the whole model) this rank holds.
    pub fn layer_range(&self) -> Range<u32> {
        let first = u32::from(self.shard.first_layer);
        first..first + u32::from(self.layers)
    }

    /// The model's KV heads this rank holds.
    pub fn head_range(&self) -> Range<u32> {
        let first = u32::from(self.shard.first_head);
        first..first + u32::from(self.kv_heads)
    }

    /// Bytes of one head's part of one K or V plane of one block (`tpb * head_dim * elem`), or
    /// `None` on overflow.
    pub fn head_block_bytes(&self) -> Option<u64> {
        u64::from(self.tokens_per_block)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.elem_bytes))
    }

    /// Whether this rank holds the whole group (every layer and every KV head).
    pub fn is_whole(&self) -> bool {
        self.layer_range() == (0..u32::from(self.model_layers()))
            && self.head_range() == (0..u32::from(self.model_kv_heads()))
    }
}
