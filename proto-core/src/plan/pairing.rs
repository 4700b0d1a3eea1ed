//! [`check_pairable`]: whether a sender's and a receiver's layout of one layer group describe
//! the same group of the same model, and what the two ranks hold in common ([`GroupPairing`]).

use super::error::{PlanError, Side};
use crate::layout::LayerGroupLayout;

/// How one layer group of a sender rank maps onto a receiver rank, from [`check_pairable`]: the
/// model layers and KV heads both hold, and the byte sizes the extents are built from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupPairing {
    /// First model layer of the group both ranks hold.
    pub layer_begin: u32,
    /// One past the last one (`layer_begin` when they hold no layer in common).
    pub layer_end: u32,
    /// First model KV head both ranks hold.
    pub head_begin: u32,
    /// One past the last one (`head_begin` when they hold no head in common).
    pub head_end: u32,
    /// Bytes one layer adds to a sender block (`kv_factor * kv_heads * head bytes`).
    pub src_layer_bytes: u64,
    /// Bytes one layer adds to a receiver block.
    pub dst_layer_bytes: u64,
    /// Bytes of one head's part of one K or V plane of a block (`tpb * head_dim * elem`).
    pub head_bytes: u64,
    /// K and V planes per layer (1 for MLA).
    pub kv_factor: u32,
    /// First model head the sender holds.
    pub src_first_head: u32,
    /// KV heads the sender holds.
    pub src_heads: u32,
    /// First model head the receiver holds.
    pub dst_first_head: u32,
    /// KV heads the receiver holds.
    pub dst_heads: u32,
}

impl GroupPairing {
    /// Whether the two ranks hold no byte of the group in common.
    pub fn is_empty(&self) -> bool {
        self.layer_begin >= self.layer_end || self.head_begin >= self.head_end
    }

    /// Whether both ranks hold exactly the same heads, so whole layers are copied; otherwise
    /// each (block, layer, K/V plane) is a head slice.
    pub fn whole_layers(&self) -> bool {
        self.src_first_head == self.dst_first_head && self.src_heads == self.dst_heads
    }

    /// Bytes of one head slice: the common heads of one K or V plane of one layer of a block.
    pub fn slice_bytes(&self) -> u64 {
        u64::from(self.head_end - self.head_begin) * self.head_bytes
    }
}

/// Checks that the two sides describe the same group of the same model (whole-model layers and
/// KV heads, K/V planes, head size, element size, tokens per block, byte layout), each within
/// the model, that the receiver's window is at least the sender's, and that each side's pools
/// tile its rank's layers in order with slots large enough; returns what the two ranks hold in
/// common ([`GroupPairing`]).
pub fn check_pairable(
    src: &LayerGroupLayout,
    dst: &LayerGroupLayout,
) -> Result<GroupPairing, PlanError> {
    let fields: [(&'static str, u64, u64); 7] = [
        (
            "model_layers",
            src.model_layers().into(),
            dst.model_layers().into(),
        ),
        ("kv_factor", src.kv_factor.into(), dst.kv_factor.into()),
        (
            "model_kv_heads",
            src.model_kv_heads().into(),
            dst.model_kv_heads().into(),
        ),
        ("head_dim", src.head_dim.into(), dst.head_dim.into()),
        ("elem_bytes", src.elem_bytes.into(), dst.elem_bytes.into()),
        (
            "tokens_per_block",
            src.tokens_per_block.into(),
            dst.tokens_per_block.into(),
        ),
        (
            "block_layout",
            src.block_layout as u64,
            dst.block_layout as u64,
        ),
    ];
    for (field, sender, receiver) in fields {
        if sender != receiver {
            return Err(PlanError::LayoutMismatch {
                field,
                sender,
                receiver,
            });
        }
    }
    let smaller_window = match (src.window, dst.window) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(s), Some(d)) => d < s,
    };
    if smaller_window {
        return Err(PlanError::WindowMismatch {
            sender: src.window,
            receiver: dst.window,
        });
    }
    let head_bytes = src
        .head_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    let src_layer_bytes = check_layout(Side::Sender, src)?;
    let dst_layer_bytes = check_layout(Side::Receiver, dst)?;
    let (sl, dl) = (src.layer_range(), dst.layer_range());
    let (sh, dh) = (src.head_range(), dst.head_range());
    let layer_begin = sl.start.max(dl.start);
    let head_begin = sh.start.max(dh.start);
    Ok(GroupPairing {
        layer_begin,
        layer_end: sl.end.min(dl.end).max(layer_begin),
        head_begin,
        head_end: sh.end.min(dh.end).max(head_begin),
        src_layer_bytes,
        dst_layer_bytes,
        head_bytes,
        kv_factor: u32::from(src.kv_factor),
        src_first_head: sh.start,
        src_heads: u32::from(src.kv_heads),
        dst_first_head: dh.start,
        dst_heads: u32::from(dst.kv_heads),
    })
}

/// The rules one side's layout of a group keeps on its own, whatever the other side's: every
/// size of a block at least one (`kv_factor` 1 or 2, a window at least one token), its
/// shard inside the model, and pools that tile the rank's layers in order, each of at least
/// one layer, with slots that hold their layers. Returns the bytes one layer contributes to a
/// block. [`check_pairable`] checks both sides with it; a node checks its own layout with it
/// when it is made.
pub fn check_layout(side: Side, layout: &LayerGroupLayout) -> Result<u64, PlanError> {
    // `layers` may be 0: a pipeline-parallel rank can hold none of a group's layers (its
    // pools are then empty).
    let sizes: [(&'static str, u64); 4] = [
        ("kv_heads", layout.kv_heads.into()),
        ("head_dim", layout.head_dim.into()),
        ("elem_bytes", layout.elem_bytes.into()),
        ("tokens_per_block", layout.tokens_per_block.into()),
    ];
    if let Some((field, _)) = sizes.into_iter().find(|&(_, v)| v == 0) {
        return Err(PlanError::FieldOutOfRange {
            side,
            field,
            value: 0,
            accepted: "at least 1",
        });
    }
    if !matches!(layout.kv_factor, 1 | 2) {
        return Err(PlanError::FieldOutOfRange {
            side,
            field: "kv_factor",
            value: layout.kv_factor.into(),
            accepted: "1 (K only) or 2 (K and V)",
        });
    }
    if layout.window == Some(0) {
        return Err(PlanError::FieldOutOfRange {
            side,
            field: "window",
            value: 0,
            accepted: "at least 1 token, or none (full attention)",
        });
    }
    let (layers, heads) = (layout.layer_range(), layout.head_range());
    if layers.end > u32::from(layout.model_layers())
        || heads.end > u32::from(layout.model_kv_heads())
    {
        return Err(PlanError::ShardPastModel {
            side,
            first_layer: layout.shard.first_layer,
            layers: layout.layers,
            model_layers: layout.model_layers(),
            first_head: layout.shard.first_head,
            kv_heads: layout.kv_heads,
            model_kv_heads: layout.model_kv_heads(),
        });
    }
    let layer_bytes = layout
        .layer_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    let mut next = 0u32;
    for (pool, p) in layout.pools.iter().enumerate() {
        if u32::from(p.layer_begin) != next || p.layers == 0 {
            return Err(PlanError::PoolsDoNotTile {
                side,
                pool,
                layer_begin: p.layer_begin,
                layers: p.layers,
                expected_begin: next,
            });
        }
        next += u32::from(p.layers);
        let needed = u64::from(p.layers)
            .checked_mul(layer_bytes)
            .ok_or(PlanError::BlockBytesOverflow)?;
        if p.slot_bytes < needed {
            return Err(PlanError::SlotTooSmall {
                side,
                pool,
                slot_bytes: p.slot_bytes,
                needed,
            });
        }
    }
    if next != u32::from(layout.layers) {
        return Err(PlanError::PoolsCoverWrongLayers {
            side,
            covered: next,
            layers: layout.layers,
        });
    }
    Ok(layer_bytes)
}
