//! The planner's entry points: [`plan_group`] and [`plan_group_with_cursor`] between ranks
//! holding the same part of the model, [`plan_rank_group`] and [`plan_rank_group_layers`]
//! between ranks split differently, and what a call paired ([`PairStats`]).

use core::ops::Range;

use super::cursor::{DstCursor, Overlaps};
use super::error::PlanError;
use super::extents::{plan_head_slices, plan_segment};
use super::pairing::{check_pairable, GroupPairing};
use super::segments::Segments;
use super::write_plan::WritePlan;
use crate::blocks::{AnchoredRun, BlockRun};
use crate::layout::LayerGroupLayout;
use crate::shard::writes_group;
use crate::wire::Topology;

/// What one [`plan_group`] call paired and wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PairStats {
    /// Ordinals present in both the source run and the receiver's run: blocks written.
    pub paired_blocks: u32,
    /// Source blocks the receiver does not take (its cached prefix, or outside its run).
    pub unpaired_src_blocks: u32,
    /// First paired ordinal (0 when nothing was paired).
    pub first_ordinal: u32,
    /// Extents the plan grew by (after coalescing with what it already held).
    pub extents_added: u32,
    /// Bytes the new writes copy.
    pub bytes: u64,
}

/// Pairs one chunk's source blocks with the receiver's blocks **by ordinal** and appends the
/// byte extents that copy them to `plan`, coalescing writes contiguous on both sides.
///
/// `src` is the chunk's run from the [`BlockSource`](crate::source::BlockSource); `dst` is the
/// receiver's registration for the same group. Only ordinals in both are written: the
/// receiver's cached prefix is not in its run, so it is not sent, and a chunk inside that prefix
/// plans nothing. Of each paired block only what both ranks hold is written: the layers both
/// hold (layer-range extents, one per layer range held by one sender pool and one receiver
/// pool) and, when the two ranks hold different KV heads (another tensor-parallel size), the
/// heads both hold (head-slice extents: one per block, layer and K/V plane, merged wherever
/// they are contiguous on both sides). Extents are emitted range by range, block by block, so
/// consecutive slots coalesce into one write.
///
/// Every head both ranks hold is written. When the sender's heads are replicated over several
/// ranks, use [`plan_rank_group`], which lets only one replica write each receiver.
///
/// Costs O(extents + receiver id runs before the chunk's end); use [`plan_group_with_cursor`]
/// to drop the second term across chunks. Allocates nothing when `plan` has room for the
/// extents (see [`WritePlan::reserve`]). On error `plan` is left as it was.
///
/// Both layouts must describe the same group of the same model (see [`check_pairable`]);
/// otherwise a [`PlanError`] says what differs.
pub fn plan_group(
    src_layout: &LayerGroupLayout,
    dst_layout: &LayerGroupLayout,
    src: &BlockRun,
    dst: &AnchoredRun,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    let mut cursor = DstCursor::default();
    plan_group_with_cursor(src_layout, dst_layout, src, dst, &mut cursor, plan)
}

/// [`plan_group`] that resumes its search of `dst` from `cursor` and leaves the cursor at the
/// chunk's last block, so that successive chunks of one request cost O(chunk) even when the
/// receiver's allocation is split into many id runs.
pub fn plan_group_with_cursor(
    src_layout: &LayerGroupLayout,
    dst_layout: &LayerGroupLayout,
    src: &BlockRun,
    dst: &AnchoredRun,
    cursor: &mut DstCursor,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    let pairing = check_pairable(src_layout, dst_layout)?;
    plan_pairing(
        &pairing, src_layout, dst_layout, src, dst, None, cursor, plan,
    )
}

/// One rank's side of a pairing: its parallel topology and its layout of one layer group.
#[derive(Clone, Copy, Debug)]
pub struct RankGroup<'a> {
    /// The rank's tensor- and pipeline-parallel position.
    pub topology: &'a Topology,
    /// Its layout of the group.
    pub layout: &'a LayerGroupLayout,
}

/// [`plan_group_with_cursor`] between two ranks that may be split differently (tensor and
/// pipeline parallelism, see [`shard`](crate::shard)): when this sender rank does not write the
/// group to this receiver rank ([`writes_group`]: no layer or head in common, or another
/// replica of its heads writes them), nothing is paired and the plan is left as it was.
pub fn plan_rank_group(
    src_rank: RankGroup<'_>,
    dst_rank: RankGroup<'_>,
    src: &BlockRun,
    dst: &AnchoredRun,
    cursor: &mut DstCursor,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    plan_rank_pairing(src_rank, dst_rank, src, dst, None, cursor, plan)
}

/// [`plan_rank_group`] restricted to the sender rank's layers `layers` of the group (counted
/// from the rank's first layer of the group, as [`PoolLayout::layer_begin`]): a layer slice of
/// a chunk ([`crate::layers`]). The blocks are paired exactly as for the whole chunk and each
/// paired block writes only the range's layers, so the slices of a chunk's layer ranges
/// together write exactly what the whole chunk writes, each byte once. In a slot laid out
/// `[layer][K|V][head][token][dim]`, a range's layers of one block held in one pool are one
/// extent (with the same heads on both sides; head slices otherwise); a range covering a
/// pool's every layer coalesces consecutive slots as the whole chunk does. An empty range
/// plans nothing (the cursor still moves as for the whole chunk). Costs and errors as
/// [`plan_rank_group`].
///
/// [`PoolLayout::layer_begin`]: crate::layout::PoolLayout::layer_begin
pub fn plan_rank_group_layers(
    src_rank: RankGroup<'_>,
    dst_rank: RankGroup<'_>,
    src: &BlockRun,
    dst: &AnchoredRun,
    layers: Range<u16>,
    cursor: &mut DstCursor,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    let first = src_rank.layout.layer_range().start;
    let keep = first + u32::from(layers.start)..first + u32::from(layers.end);
    plan_rank_pairing(src_rank, dst_rank, src, dst, Some(keep), cursor, plan)
}

/// [`plan_rank_group`] keeping only the model layers `keep` when given.
fn plan_rank_pairing(
    src_rank: RankGroup<'_>,
    dst_rank: RankGroup<'_>,
    src: &BlockRun,
    dst: &AnchoredRun,
    keep: Option<Range<u32>>,
    cursor: &mut DstCursor,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    let pairing = check_pairable(src_rank.layout, dst_rank.layout)?;
    if !writes_group(
        src_rank.topology,
        src_rank.layout,
        dst_rank.topology,
        dst_rank.layout,
    ) {
        return Ok(PairStats {
            unpaired_src_blocks: u32::try_from(src.ids.len()).unwrap_or(u32::MAX),
            ..PairStats::default()
        });
    }
    plan_pairing(
        &pairing,
        src_rank.layout,
        dst_rank.layout,
        src,
        dst,
        keep,
        cursor,
        plan,
    )
}

/// Pairs and plans one group; with `keep`, only the segments' model layers inside it.
#[allow(clippy::too_many_arguments)]
fn plan_pairing(
    pairing: &GroupPairing,
    src_layout: &LayerGroupLayout,
    dst_layout: &LayerGroupLayout,
    src: &BlockRun,
    dst: &AnchoredRun,
    keep: Option<Range<u32>>,
    cursor: &mut DstCursor,
    plan: &mut WritePlan,
) -> Result<PairStats, PlanError> {
    let src_begin = u64::from(src.first_ordinal);
    let src_end = src_begin + src.ids.len() as u64;
    cursor.seek(dst, src_begin);
    let start = *cursor;
    let overlaps = || Overlaps {
        dst,
        run: start.run,
        run_ordinal: start.ordinal,
        src_begin,
        src_end,
    };

    let mut stats = PairStats::default();
    let mut paired = 0u64;
    if !pairing.is_empty() {
        for (i, o) in overlaps().enumerate() {
            if i == 0 {
                stats.first_ordinal = u32::try_from(o.ordinal).unwrap_or(u32::MAX);
            }
            paired += o.len;
        }
    }
    stats.paired_blocks = u32::try_from(paired).unwrap_or(u32::MAX);
    stats.unpaired_src_blocks = u32::try_from(src.ids.len() as u64 - paired).unwrap_or(u32::MAX);

    let before = plan.len();
    let last_before = plan.extents.last().copied();
    let mut segments = Segments {
        src: &src_layout.pools,
        dst: &dst_layout.pools,
        src_first: src_layout.layer_range().start,
        dst_first: dst_layout.layer_range().start,
        src_layer_bytes: pairing.src_layer_bytes,
        dst_layer_bytes: pairing.dst_layer_bytes,
    };
    if pairing.is_empty() {
        segments.src = &[];
    }
    let mut bytes = 0u64;
    let mut result = Ok(());
    for segment in segments {
        let segment = match &keep {
            None => segment,
            Some(keep) => {
                match segment.clip(keep, pairing.src_layer_bytes, pairing.dst_layer_bytes) {
                    Some(s) => s,
                    None => continue,
                }
            }
        };
        let planned = if pairing.whole_layers() {
            plan_segment(&segment, pairing, &src.ids, overlaps(), plan)
        } else {
            plan_head_slices(&segment, pairing, &src.ids, overlaps(), plan)
        };
        match planned {
            Ok(b) => bytes += b,
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if let Err(e) = result {
        // Leave the plan as it was: drop what was appended, undo a merge into its last write.
        plan.extents.truncate(before);
        if let (Some(last), Some(orig)) = (plan.extents.last_mut(), last_before) {
            *last = orig;
        }
        return Err(e);
    }
    if src_end > src_begin {
        cursor.seek(dst, src_end - 1);
    }
    stats.extents_added = u32::try_from(plan.len() - before).unwrap_or(u32::MAX);
    stats.bytes = bytes;
    Ok(stats)
}
