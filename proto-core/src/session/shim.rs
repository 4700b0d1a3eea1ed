//! Chunk geometry, pairing and handshake negotiation as the sessions use them.
//!
//! These are minimal local versions written against the shapes of the geometry, planning and
//! handshake modules, so the sessions build before those modules land; each function is replaced
//! by a re-export of the full implementation when it does.

use thiserror::Error;

use crate::blocks::{AnchoredRun, BlockRun};
use crate::layout::LayerGroupLayout;
use crate::plan::{WriteExtent, WritePlan};
use crate::wire::{Hello, HelloAccept, HelloReject, RejectReason};

/// One prefill chunk of a request, as the engine computed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct ChunkSpec {
    /// First token of the chunk.
    pub start: u32,
    /// One past the last token of the chunk.
    pub end: u32,
    /// The whole prompt's length in tokens.
    pub prompt_len: u32,
    /// Tokens already cached on the sender (reused prefix).
    pub prepopulated_len: u32,
    /// Whether this is the request's last chunk.
    pub is_last: bool,
    /// Whether the reused prefix was already sent before the first chunk.
    pub prefix_sent_early: bool,
}

/// The blocks one chunk sends for one layer group: ordinals `[begin, end)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct BlockWindow {
    pub(crate) begin: u32,
    pub(crate) end: u32,
}

/// A chunk whose geometry is impossible.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GeometryError {
    /// The layout has zero tokens per block.
    #[error("layer group has zero tokens per block")]
    ZeroTokensPerBlock,
    /// The chunk's range is reversed or runs past the prompt.
    #[error("chunk [{start}, {end}) is not inside the prompt of {prompt_len} tokens")]
    ChunkOutsidePrompt {
        /// First token.
        start: u32,
        /// One past the last token.
        end: u32,
        /// Prompt length.
        prompt_len: u32,
    },
    /// The last chunk must end at the prompt's end.
    #[error("last chunk ends at token {end}, the prompt has {prompt_len}")]
    LastChunkShort {
        /// One past the last token.
        end: u32,
        /// Prompt length.
        prompt_len: u32,
    },
}

/// The block window one chunk sends for one group (DESIGN §3), or `None` when it sends nothing.
pub(crate) fn chunk_window(
    spec: &ChunkSpec,
    layout: &LayerGroupLayout,
) -> Result<Option<BlockWindow>, GeometryError> {
    let tpb = layout.tokens_per_block;
    if tpb == 0 {
        return Err(GeometryError::ZeroTokensPerBlock);
    }
    if spec.start > spec.end || spec.end > spec.prompt_len {
        return Err(GeometryError::ChunkOutsidePrompt {
            start: spec.start,
            end: spec.end,
            prompt_len: spec.prompt_len,
        });
    }
    if spec.is_last && spec.end != spec.prompt_len {
        return Err(GeometryError::LastChunkShort {
            end: spec.end,
            prompt_len: spec.prompt_len,
        });
    }
    let total = spec.prompt_len.div_ceil(tpb);
    let first = spec.start == spec.prepopulated_len && !spec.prefix_sent_early;
    let window = if let (true, Some(w)) = (layout.is_windowed_for(spec.prompt_len), layout.window) {
        if !spec.is_last {
            return Ok(None);
        }
        let stale = (u64::from(spec.prompt_len) + 1).saturating_sub(u64::from(w)) / u64::from(tpb);
        BlockWindow {
            begin: u32::try_from(stale).unwrap_or(u32::MAX),
            end: total,
        }
    } else {
        BlockWindow {
            begin: if first { 0 } else { spec.start / tpb },
            end: if spec.is_last { total } else { spec.end / tpb },
        }
    };
    Ok((window.begin < window.end).then_some(window))
}

/// Counts of one group's pairing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PairStats {
    pub(crate) pairs: u64,
}

/// Pairs `src` with `dst` by ordinal and appends the byte extents to `plan` (same pool
/// structure on both sides).
pub(crate) fn plan_group(
    src_layout: &LayerGroupLayout,
    dst_layout: &LayerGroupLayout,
    src: &BlockRun,
    dst: &AnchoredRun,
    plan: &mut WritePlan,
) -> Result<PairStats, String> {
    if src_layout.pools.len() != dst_layout.pools.len() {
        return Err(format!(
            "the sender has {} pools, the receiver {}",
            src_layout.pools.len(),
            dst_layout.pools.len()
        ));
    }
    let layer_bytes = src_layout
        .layer_block_bytes()
        .ok_or_else(|| "block size overflows".to_string())?;
    let mut stats = PairStats::default();
    for (i, &id) in src.ids.iter().enumerate() {
        let ordinal = src.first_ordinal.saturating_add(i as u32);
        let Some(dst_id) = dst.id_at(ordinal) else {
            continue;
        };
        stats.pairs += 1;
        for (sp, dp) in src_layout.pools.iter().zip(dst_layout.pools.iter()) {
            let len = u64::from(sp.layers) * layer_bytes;
            plan.push(WriteExtent {
                src_region: sp.region,
                src_offset: u64::from(id.0) * sp.slot_bytes,
                dst_region: dp.region,
                dst_offset: u64::from(dst_id.0) * dp.slot_bytes,
                len,
            });
        }
    }
    Ok(stats)
}

/// Hash over what both sides must agree on: per group the tokens per block, window, K/V factor,
/// head size, element size and slot layout.
pub(crate) fn compat_hash(groups: &[LayerGroupLayout]) -> u64 {
    const PRIME: u64 = 0x0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    eat(groups.len() as u64);
    for g in groups {
        eat(u64::from(g.tokens_per_block));
        eat(g.window.map_or(u64::MAX, u64::from));
        eat(u64::from(g.kv_factor));
        eat(u64::from(g.head_dim));
        eat(u64::from(g.elem_bytes));
        eat(g.block_layout as u64);
    }
    h
}

/// Decides a handshake: the same decision on both sides for the same pair of Hellos.
pub(crate) fn negotiate(local: &Hello, remote: &Hello) -> Result<HelloAccept, HelloReject> {
    if local.role == remote.role {
        return Err(HelloReject {
            reason: RejectReason::RoleMismatch,
            message: format!("both endpoints are {:?}s", local.role),
        });
    }
    let low = local.versions.min.max(remote.versions.min);
    let high = local.versions.max.min(remote.versions.max);
    if low > high {
        return Err(HelloReject {
            reason: RejectReason::VersionMismatch,
            message: format!(
                "no common protocol version: local speaks {}..={}, remote speaks {}..={}",
                local.versions.min, local.versions.max, remote.versions.min, remote.versions.max
            ),
        });
    }
    if local.compat_hash != remote.compat_hash {
        return Err(HelloReject {
            reason: RejectReason::CompatibilityMismatch,
            message: format!(
                "compatibility hashes differ: local {:#018x}, remote {:#018x}",
                local.compat_hash, remote.compat_hash
            ),
        });
    }
    if local.groups.len() != remote.groups.len() {
        return Err(HelloReject {
            reason: RejectReason::LayoutMismatch,
            message: format!(
                "layer group counts differ: local {}, remote {}",
                local.groups.len(),
                remote.groups.len()
            ),
        });
    }
    Ok(HelloAccept {
        version: high,
        instance: local.instance,
    })
}
