//! The shape of a KV cache as the core sees it: layer groups, their pools and the byte layout
//! of one block slot. The core computes byte extents from this; it never touches the memory.

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

/// One pool of a layer group: a registered region holding a contiguous range of the group's
/// layers for every block slot. Block `b` of the group occupies, in this pool, the bytes
/// `[b * slot_bytes, (b + 1) * slot_bytes)` of `region`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PoolLayout {
    /// The region that holds this pool.
    pub region: RegionId,
    /// First layer of the group held in this pool (relative to the group).
    pub layer_begin: u16,
    /// Number of consecutive layers held in this pool.
    pub layers: u16,
    /// Bytes per block slot (at least `layers * layer_block_bytes`; may include padding).
    pub slot_bytes: u64,
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
    /// KV heads held by this rank.
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
    /// The pools that hold this group's layers, in layer order.
    pub pools: SmallVec<[PoolLayout; 2]>,
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

    /// Whether the group is windowed for a prompt of `prompt_len` tokens: only when the window
    /// is shorter than the prompt. A window of at least the prompt behaves as full attention.
    pub fn is_windowed_for(&self, prompt_len: u32) -> bool {
        matches!(self.window, Some(w) if w < prompt_len)
    }
}
