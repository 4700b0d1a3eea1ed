//! Write plans: the byte extents a slice copies from sender memory to receiver memory, and
//! [`plan_group`], which pairs one chunk's source blocks with the receiver's blocks by ordinal
//! and turns the pairs into coalesced extents — whole layers when both ranks hold the same
//! part of the model, layer ranges and head slices when tensor or pipeline parallelism differs
//! between the sides ([`plan_rank_group`], [`shard`](crate::shard)).

use core::ops::Range;

use thiserror::Error;

use crate::blocks::{AnchoredRun, BlockRun};
use crate::ids::{BlockId, RegionId};
use crate::layout::{LayerGroupLayout, PoolLayout};
use crate::shard::writes_group;
use crate::wire::Topology;

/// One write: `len` bytes from `src_region + src_offset` (sender) to
/// `dst_region + dst_offset` (receiver).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WriteExtent {
    /// Sender region (a KV pool).
    pub src_region: RegionId,
    /// Byte offset in the sender region.
    pub src_offset: u64,
    /// Receiver region (a KV pool).
    pub dst_region: RegionId,
    /// Byte offset in the receiver region.
    pub dst_offset: u64,
    /// Bytes to write.
    pub len: u64,
}

/// The coalesced writes of one slice. The buffer is kept across chunks (`clear` keeps the
/// capacity), so steady-state planning allocates nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WritePlan {
    extents: Vec<WriteExtent>,
}

impl WritePlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the plan, keeping its buffer.
    pub fn clear(&mut self) {
        self.extents.clear();
    }

    /// The writes, in planning order.
    pub fn extents(&self) -> &[WriteExtent] {
        &self.extents
    }

    /// Total bytes the plan writes.
    pub fn total_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }

    /// Whether the plan writes nothing.
    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// Number of (coalesced) writes.
    pub fn len(&self) -> usize {
        self.extents.len()
    }

    /// Extents the plan can hold without allocating.
    pub fn capacity(&self) -> usize {
        self.extents.capacity()
    }

    /// Makes room for at least `additional` more extents, so later planning does not allocate.
    pub fn reserve(&mut self, additional: usize) {
        self.extents.reserve(additional);
    }

    /// Appends a write, merging it into the previous one when both sides are contiguous.
    pub fn push(&mut self, extent: WriteExtent) {
        if extent.len == 0 {
            return;
        }
        if let Some(last) = self.extents.last_mut() {
            if last.src_region == extent.src_region
                && last.dst_region == extent.dst_region
                && last.src_offset.checked_add(last.len) == Some(extent.src_offset)
                && last.dst_offset.checked_add(last.len) == Some(extent.dst_offset)
            {
                last.len += extent.len;
                return;
            }
        }
        self.extents.push(extent);
    }
}

/// Which side of a transfer a layout or block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill server's cache (source of the writes).
    Sender,
    /// The decode server's cache (destination of the writes).
    Receiver,
}

impl core::fmt::Display for Side {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Side::Sender => "sender",
            Side::Receiver => "receiver",
        })
    }
}

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

/// Where the previous [`plan_group_with_cursor`] call stopped in a receiver's
/// [`AnchoredRun`], so that planning successive chunks does not rescan the run's head: each call
/// then costs O(chunk blocks + id runs overlapping the chunk), however fragmented the receiver's
/// allocation is.
///
/// A cursor belongs to one anchored run. It remembers the run's anchor and number of id runs and
/// starts over when they change or when a chunk lies before it. Keep one per (request, group)
/// and reset it (`DstCursor::default()`) when the registration is replaced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DstCursor {
    /// Index of the id run the next search starts from.
    run: usize,
    /// Ordinal of the first block of `runs[run]`.
    ordinal: u64,
    /// Anchor of the run the cursor was built on.
    anchor: u32,
    /// Number of id runs of the run the cursor was built on.
    runs: usize,
}

impl DstCursor {
    /// Moves to the id run that holds `ordinal` (or the first one after it).
    fn seek(&mut self, dst: &AnchoredRun, ordinal: u64) {
        if self.anchor != dst.first_ordinal
            || self.runs != dst.runs.len()
            || self.run > dst.runs.len()
            || self.ordinal > ordinal
            || (self.run == 0 && self.ordinal != u64::from(dst.first_ordinal))
        {
            *self = DstCursor {
                run: 0,
                ordinal: u64::from(dst.first_ordinal),
                anchor: dst.first_ordinal,
                runs: dst.runs.len(),
            };
        }
        while let Some(run) = dst.runs.get(self.run) {
            let end = self.ordinal + u64::from(run.len);
            if end > ordinal {
                break;
            }
            self.ordinal = end;
            self.run += 1;
        }
    }
}

/// One stretch of ordinals held by both sides: `len` blocks from `ordinal`, the source's at
/// `src.ids[src_index..]`, the receiver's consecutive from `dst_first`.
#[derive(Clone, Copy, Debug)]
struct Overlap {
    ordinal: u64,
    src_index: usize,
    dst_first: u64,
    len: u64,
}

/// Iterates the overlaps of a source ordinal range with a receiver run, from a cursor position.
struct Overlaps<'a> {
    dst: &'a AnchoredRun,
    run: usize,
    run_ordinal: u64,
    src_begin: u64,
    src_end: u64,
}

impl Iterator for Overlaps<'_> {
    type Item = Overlap;

    fn next(&mut self) -> Option<Overlap> {
        loop {
            let run = self.dst.runs.get(self.run)?;
            let run_begin = self.run_ordinal;
            let run_end = run_begin + u64::from(run.len);
            if run_begin >= self.src_end {
                return None;
            }
            self.run += 1;
            self.run_ordinal = run_end;
            let begin = run_begin.max(self.src_begin);
            let end = run_end.min(self.src_end);
            if begin < end {
                return Some(Overlap {
                    ordinal: begin,
                    // `begin - src_begin < src.ids.len()`, which fits in usize.
                    src_index: (begin - self.src_begin) as usize,
                    dst_first: u64::from(run.first.0) + (begin - run_begin),
                    len: end - begin,
                });
            }
        }
    }
}

/// One side of a [`Segment`]: where the segment's bytes sit inside a slot of a pool.
#[derive(Clone, Copy, Debug)]
struct SegmentSide {
    region: RegionId,
    slot_bytes: u64,
    /// Byte offset of the segment's first layer inside the slot.
    base: u64,
}

impl SegmentSide {
    /// Offset of the segment in slot `first`, checking that the segment's `len` bytes in each
    /// of the `n` slots from `first` on are addressable.
    fn offset(&self, side: Side, first: u64, n: u64, len: u64) -> Result<u64, PlanError> {
        let at = |id: u64| {
            id.checked_mul(self.slot_bytes)
                .and_then(|o| o.checked_add(self.base))
        };
        let last = first + (n - 1);
        match (at(first), at(last).and_then(|o| o.checked_add(len))) {
            (Some(start), Some(_)) => Ok(start),
            _ => Err(PlanError::OffsetOverflow {
                side,
                block: last,
                slot_bytes: self.slot_bytes,
            }),
        }
    }
}

/// A range of model layers held by one sender pool and one receiver pool, both ranks holding
/// them: `layers` consecutive layers from the segment's base on each side.
#[derive(Clone, Copy, Debug)]
struct Segment {
    src: SegmentSide,
    dst: SegmentSide,
    /// First model layer of the segment.
    model_begin: u32,
    layers: u64,
}

impl Segment {
    /// The part of the segment inside model layers `keep` (`None` when nothing is): each side's
    /// base moves to the first kept layer.
    fn clip(&self, keep: &Range<u32>, src_layer_bytes: u64, dst_layer_bytes: u64) -> Option<Self> {
        let end = self.model_begin + self.layers as u32;
        let lo = self.model_begin.max(keep.start);
        let hi = end.min(keep.end);
        if lo >= hi {
            return None;
        }
        let skip = u64::from(lo - self.model_begin);
        let mut s = *self;
        s.src.base += skip * src_layer_bytes;
        s.dst.base += skip * dst_layer_bytes;
        s.model_begin = lo;
        s.layers = u64::from(hi - lo);
        Some(s)
    }
}

/// The model-layer ranges where the sender's and the receiver's pools overlap, in layer order:
/// a merge of the two pool lists, each pool placed at its rank's first layer (both lists tile
/// their rank's layers, see [`check_pairable`]). Layers only one rank holds yield nothing.
struct Segments<'a> {
    src: &'a [PoolLayout],
    dst: &'a [PoolLayout],
    /// Model layer of each side's pool layer 0 (the rank's first layer).
    src_first: u32,
    dst_first: u32,
    src_layer_bytes: u64,
    dst_layer_bytes: u64,
}

impl Iterator for Segments<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        loop {
            let (a, b) = (self.src.first()?, self.dst.first()?);
            let a_begin = self.src_first + u32::from(a.layer_begin);
            let b_begin = self.dst_first + u32::from(b.layer_begin);
            let a_end = a_begin + u32::from(a.layers);
            let b_end = b_begin + u32::from(b.layers);
            let lo = a_begin.max(b_begin);
            let hi = a_end.min(b_end);
            if a_end <= b_end {
                self.src = &self.src[1..];
            }
            if b_end <= a_end {
                self.dst = &self.dst[1..];
            }
            if lo < hi {
                // Layer counts and byte sizes were checked for overflow in `check_pairable`.
                let side = |p: &PoolLayout, begin: u32, layer_bytes: u64| SegmentSide {
                    region: p.region,
                    slot_bytes: p.slot_bytes,
                    base: u64::from(lo - begin) * layer_bytes,
                };
                return Some(Segment {
                    src: side(a, a_begin, self.src_layer_bytes),
                    dst: side(b, b_begin, self.dst_layer_bytes),
                    model_begin: lo,
                    layers: u64::from(hi - lo),
                });
            }
        }
    }
}

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
    for (side, layout) in [(Side::Sender, src), (Side::Receiver, dst)] {
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
    }
    let head_bytes = src
        .head_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    let src_layer_bytes = src
        .layer_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    let dst_layer_bytes = dst
        .layer_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    for (side, layout, layer_bytes) in [
        (Side::Sender, src, src_layer_bytes),
        (Side::Receiver, dst, dst_layer_bytes),
    ] {
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
    }
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

/// Appends one segment's extents for every overlap when both ranks hold the same heads (whole
/// layers); returns the bytes. When the segment fills whole slots on both sides, runs of
/// consecutive source slots (the receiver's are consecutive inside an overlap) become one
/// extent each; otherwise one extent per block, which [`WritePlan::push`] coalesces when both
/// sides happen to be contiguous.
fn plan_segment(
    segment: &Segment,
    pairing: &GroupPairing,
    src_ids: &[BlockId],
    overlaps: Overlaps<'_>,
    plan: &mut WritePlan,
) -> Result<u64, PlanError> {
    // The same heads on both sides: a layer has the same bytes on both.
    let len = segment.layers * pairing.src_layer_bytes;
    let whole_slots = len == segment.src.slot_bytes && len == segment.dst.slot_bytes;
    let mut bytes = 0;
    for o in overlaps {
        let ids = &src_ids[o.src_index..o.src_index + o.len as usize];
        let mut k = 0;
        while k < ids.len() {
            let first = u64::from(ids[k].0);
            let mut n = 1;
            if whole_slots {
                while k + n < ids.len() && u64::from(ids[k + n].0) == first + n as u64 {
                    n += 1;
                }
            }
            let blocks = n as u64;
            let src_offset = segment.src.offset(Side::Sender, first, blocks, len)?;
            let dst_first = o.dst_first + k as u64;
            let dst_offset = segment.dst.offset(Side::Receiver, dst_first, blocks, len)?;
            // Both ends were checked addressable, so the length fits too.
            let run_len = len * blocks;
            plan.push(WriteExtent {
                src_region: segment.src.region,
                src_offset,
                dst_region: segment.dst.region,
                dst_offset,
                len: run_len,
            });
            bytes += run_len;
            k += n;
        }
    }
    Ok(bytes)
}

/// Appends one segment's head-slice extents for every overlap when the ranks hold different
/// heads: per block, layer and K/V plane, the heads both hold (contiguous inside a plane on
/// each side: `[K|V][head][token][dim]`). [`WritePlan::push`] merges consecutive slices that
/// are contiguous on both sides (e.g. a receiver that holds exactly the sender's heads of a
/// plane, in consecutive slots); returns the bytes.
fn plan_head_slices(
    segment: &Segment,
    pairing: &GroupPairing,
    src_ids: &[BlockId],
    overlaps: Overlaps<'_>,
    plan: &mut WritePlan,
) -> Result<u64, PlanError> {
    let slice = pairing.slice_bytes();
    let src_len = segment.layers * pairing.src_layer_bytes;
    let dst_len = segment.layers * pairing.dst_layer_bytes;
    let hb = pairing.head_bytes;
    // Where the common heads start inside a plane, and how far apart the planes are.
    let src_head = u64::from(pairing.head_begin - pairing.src_first_head) * hb;
    let dst_head = u64::from(pairing.head_begin - pairing.dst_first_head) * hb;
    let src_plane = u64::from(pairing.src_heads) * hb;
    let dst_plane = u64::from(pairing.dst_heads) * hb;
    let planes = u64::from(pairing.kv_factor) * segment.layers;
    let mut bytes = 0;
    for o in overlaps {
        let ids = &src_ids[o.src_index..o.src_index + o.len as usize];
        for (k, id) in ids.iter().enumerate() {
            let src_at = segment
                .src
                .offset(Side::Sender, u64::from(id.0), 1, src_len)?
                + src_head;
            let dst_at = segment
                .dst
                .offset(Side::Receiver, o.dst_first + k as u64, 1, dst_len)?
                + dst_head;
            // Planes are consecutive inside a layer and layers inside the segment, so plane
            // `p` of the segment is at `p * plane` on each side (all inside the slots checked
            // above).
            for p in 0..planes {
                plan.push(WriteExtent {
                    src_region: segment.src.region,
                    src_offset: src_at + p * src_plane,
                    dst_region: segment.dst.region,
                    dst_offset: dst_at + p * dst_plane,
                    len: slice,
                });
            }
            bytes += slice * planes;
        }
    }
    Ok(bytes)
}

/// Two layer-group layouts that cannot be paired, or a block whose bytes cannot be addressed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A whole-model geometry field differs between the two sides.
    #[error(
        "layer groups cannot be paired: {field} is {sender} on the sender and {receiver} on the \
         receiver; both sides must run the same model with the same block size"
    )]
    LayoutMismatch {
        /// The differing field of [`LayerGroupLayout`].
        field: &'static str,
        /// Its value on the sender.
        sender: u64,
        /// Its value on the receiver.
        receiver: u64,
    },
    /// The receiver keeps a smaller window than the sender.
    #[error(
        "layer groups cannot be paired: the sender's window is {sender:?} tokens and the \
         receiver's {receiver:?} (None: full attention); a receiver keeps at least the sender's \
         window"
    )]
    WindowMismatch {
        /// Sender's window (`None`: full attention).
        sender: Option<u32>,
        /// Receiver's window (`None`: full attention).
        receiver: Option<u32>,
    },
    /// A side's layers or heads lie outside the model's.
    #[error(
        "the {side} holds layers {first_layer}..+{layers} of {model_layers} and KV heads \
         {first_head}..+{kv_heads} of {model_kv_heads}: a rank's part must lie inside the model"
    )]
    ShardPastModel {
        /// Which side's layout is wrong.
        side: Side,
        /// First model layer it holds.
        first_layer: u16,
        /// Layers it holds.
        layers: u16,
        /// The group's layers in the model.
        model_layers: u16,
        /// First model KV head it holds.
        first_head: u16,
        /// KV heads it holds.
        kv_heads: u16,
        /// The model's KV heads.
        model_kv_heads: u16,
    },
    /// The bytes of one block overflow `u64`.
    #[error(
        "the bytes of one block overflow a 64-bit size: the layer group's geometry is invalid"
    )]
    BlockBytesOverflow,
    /// A pool does not start where the previous one ended, or holds no layer.
    #[error(
        "{side} pool {pool} holds layers {layer_begin}..+{layers}, but pools must hold \
         consecutive non-empty layer ranges: this one must start at layer {expected_begin}"
    )]
    PoolsDoNotTile {
        /// Which side's layout is wrong.
        side: Side,
        /// Index of the pool in the group.
        pool: usize,
        /// First layer the pool claims.
        layer_begin: u16,
        /// Layers the pool claims.
        layers: u16,
        /// Where it should start.
        expected_begin: u32,
    },
    /// The pools together hold more or fewer layers than the group.
    #[error("{side} pools hold {covered} layers, but the layer group has {layers}")]
    PoolsCoverWrongLayers {
        /// Which side's layout is wrong.
        side: Side,
        /// Layers the pools hold.
        covered: u32,
        /// Layers of the group.
        layers: u16,
    },
    /// A pool's slot is smaller than the layers it holds.
    #[error("{side} pool {pool} has {slot_bytes}-byte slots but its layers need {needed} bytes")]
    SlotTooSmall {
        /// Which side's layout is wrong.
        side: Side,
        /// Index of the pool in the group.
        pool: usize,
        /// Bytes per slot.
        slot_bytes: u64,
        /// Bytes its layers need per block.
        needed: u64,
    },
    /// A block's byte offset overflows `u64`.
    #[error(
        "{side} block {block} at {slot_bytes} bytes per slot lies past the 64-bit address range"
    )]
    OffsetOverflow {
        /// Which side's block.
        side: Side,
        /// The block id.
        block: u64,
        /// Bytes per slot of its pool.
        slot_bytes: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(src: u64, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(1),
            src_offset: src,
            dst_region: RegionId(2),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn push_coalesces_only_when_both_sides_are_contiguous() {
        let mut plan = WritePlan::new();
        plan.push(ext(0, 100, 10));
        plan.push(ext(10, 110, 10)); // contiguous on both sides
        plan.push(ext(20, 200, 10)); // contiguous at the source only
        plan.push(ext(40, 210, 10)); // contiguous at the destination only
        plan.push(ext(50, 220, 0)); // empty: dropped
        assert_eq!(
            plan.extents(),
            &[ext(0, 100, 20), ext(20, 200, 10), ext(40, 210, 10)]
        );
        assert_eq!(plan.total_bytes(), 40);
        plan.clear();
        assert!(plan.is_empty());
    }
}

#[cfg(test)]
mod plan_group_tests {
    use smallvec::smallvec;

    use super::*;
    use crate::ids::BlockId;

    /// A group of 4 layers, 8 bytes per layer per block, split into pools of the given sizes.
    fn layout(split: &[u16], first_region: u32) -> LayerGroupLayout {
        let mut pools = smallvec![];
        let mut begin = 0;
        for (i, &layers) in split.iter().enumerate() {
            pools.push(PoolLayout {
                region: RegionId(first_region + i as u32),
                layer_begin: begin,
                layers,
                slot_bytes: u64::from(layers) * 8,
            });
            begin += layers;
        }
        LayerGroupLayout {
            layers: 4,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 2,
            elem_bytes: 1,
            tokens_per_block: 2,
            window: None,
            pools,
            ..LayerGroupLayout::default()
        }
    }

    fn run(first: u32, ids: &[u32]) -> BlockRun {
        BlockRun {
            first_ordinal: first,
            ids: ids.iter().copied().map(BlockId).collect(),
        }
    }

    fn ext(src_region: u32, src: u64, dst_region: u32, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(src_region),
            src_offset: src,
            dst_region: RegionId(dst_region),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn contiguous_blocks_coalesce_into_one_extent_per_pool() {
        let (s, d) = (layout(&[2, 2], 10), layout(&[2, 2], 20));
        let dst = AnchoredRun::from_ids(0, &[100, 101, 102, 103].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(1, &[5, 6, 7]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                ext(10, 5 * 16, 20, 101 * 16, 48),
                ext(11, 5 * 16, 21, 101 * 16, 48)
            ]
        );
        assert_eq!(
            stats,
            PairStats {
                paired_blocks: 3,
                unpaired_src_blocks: 0,
                first_ordinal: 1,
                extents_added: 2,
                bytes: 96,
            }
        );
    }

    #[test]
    fn receiver_prefix_is_not_sent_and_ordinals_pair_exactly() {
        let (s, d) = (layout(&[4], 1), layout(&[4], 2));
        // The receiver holds ordinals 0..2 already: its run starts at 2, in two id runs.
        let dst = AnchoredRun::from_ids(2, &[40, 41, 9].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[0, 1, 2, 3, 4]), &dst, &mut plan).unwrap();
        assert_eq!(stats.paired_blocks, 3);
        assert_eq!(stats.unpaired_src_blocks, 2);
        assert_eq!(stats.first_ordinal, 2);
        assert_eq!(
            plan.extents(),
            &[
                ext(1, 2 * 32, 2, 40 * 32, 64),
                ext(1, 4 * 32, 2, 9 * 32, 32)
            ]
        );
        // A chunk entirely inside the receiver's prefix plans nothing.
        plan.clear();
        let stats = plan_group(&s, &d, &run(0, &[0, 1]), &dst, &mut plan).unwrap();
        assert_eq!(stats.paired_blocks, 0);
        assert!(plan.is_empty());
    }

    #[test]
    fn different_pool_splits_follow_the_finer_split() {
        let (s, d) = (layout(&[1, 3], 10), layout(&[3, 1], 20));
        let dst = AnchoredRun::from_ids(0, &[7].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[2]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                // layer 0: src pool 0, dst pool 0
                ext(10, 2 * 8, 20, 7 * 24, 8),
                // layers 1..3: src pool 1 (from its start), dst pool 0 (from layer 1)
                ext(11, 2 * 24, 20, 7 * 24 + 8, 16),
                // layer 3: src pool 1 (layer 2 of it), dst pool 1
                ext(11, 2 * 24 + 16, 21, 7 * 8, 8),
            ]
        );
        assert_eq!(plan.total_bytes(), 32);
    }

    #[test]
    fn cursor_resumes_and_gives_the_same_plan() {
        let (s, d) = (layout(&[4], 1), layout(&[4], 2));
        let ids: Vec<BlockId> = (0..64).map(|i| BlockId(i * 3)).collect(); // 64 id runs
        let dst = AnchoredRun::from_ids(0, &ids);
        let src: Vec<u32> = (0..64).collect();
        let mut cursor = DstCursor::default();
        for (a, b) in [(0, 10), (10, 11), (11, 40), (40, 64), (5, 9)] {
            let chunk = run(a, &src[a as usize..b as usize]);
            let (mut p1, mut p2) = (WritePlan::new(), WritePlan::new());
            plan_group(&s, &d, &chunk, &dst, &mut p1).unwrap();
            plan_group_with_cursor(&s, &d, &chunk, &dst, &mut cursor, &mut p2).unwrap();
            assert_eq!(p1, p2);
            assert_eq!(p1.len() as u32, b - a);
        }
    }

    #[test]
    fn unpairable_layouts_are_named() {
        let s = layout(&[2, 2], 1);
        let mut d = layout(&[2, 2], 3);
        d.kv_heads = 2;
        let err = check_pairable(&s, &d).unwrap_err();
        assert_eq!(
            err,
            PlanError::LayoutMismatch {
                field: "model_kv_heads",
                sender: 1,
                receiver: 2
            }
        );
        assert!(err
            .to_string()
            .contains("model_kv_heads is 1 on the sender and 2"));
        let mut d = layout(&[2, 2], 3);
        d.window = Some(8);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::WindowMismatch { .. })
        ));
        // A receiver may keep a larger window than the sender.
        let mut s = layout(&[2, 2], 1);
        s.window = Some(8);
        for w in [Some(8), Some(9), None] {
            d.window = w;
            assert!(check_pairable(&s, &d).is_ok(), "{w:?}");
        }
        d.window = Some(7);
        assert!(check_pairable(&s, &d).is_err());
        let s = layout(&[2, 2], 1);
        let mut d = layout(&[2, 2], 3);
        d.shard.model_layers = 4;
        d.shard.first_layer = 1;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::ShardPastModel {
                side: Side::Receiver,
                ..
            })
        ));
        let mut d = layout(&[2, 2], 3);
        d.pools[1].layer_begin = 3;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::PoolsDoNotTile {
                side: Side::Receiver,
                pool: 1,
                ..
            })
        ));
        let d = layout(&[2, 1], 3);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::PoolsCoverWrongLayers { covered: 3, .. })
        ));
        let mut d = layout(&[2, 2], 3);
        d.pools[0].slot_bytes = 15;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::SlotTooSmall { needed: 16, .. })
        ));
    }

    #[test]
    fn offset_overflow_leaves_the_plan_unchanged() {
        let mut s = layout(&[4], 1);
        s.pools[0].slot_bytes = u64::MAX / 2;
        let d = layout(&[4], 2);
        let dst = AnchoredRun::from_ids(0, &[0, 1, 2].map(BlockId));
        let mut plan = WritePlan::new();
        plan.push(ext(1, 0, 2, 0, 32));
        let before = plan.clone();
        let err = plan_group(&s, &d, &run(0, &[1, 2, 3]), &dst, &mut plan).unwrap_err();
        assert!(matches!(
            err,
            PlanError::OffsetOverflow {
                side: Side::Sender,
                block: 2,
                ..
            }
        ));
        assert_eq!(plan, before);
    }
}

#[cfg(test)]
mod heterogeneous_tests {
    use smallvec::smallvec;

    use super::*;
    use crate::ids::BlockId;
    use crate::layout::GroupShard;

    /// A rank of a 4-layer, 4-head group (head dim 2, 1-byte elements, 2 tokens per block: a
    /// head's plane of a block is 4 bytes): `layers` layers from `first_layer`, `heads` heads
    /// from `first_head`, one pool.
    fn rank(
        first_layer: u16,
        layers: u16,
        first_head: u16,
        heads: u16,
        region: u32,
    ) -> LayerGroupLayout {
        LayerGroupLayout {
            layers,
            kv_factor: 2,
            kv_heads: heads,
            head_dim: 2,
            elem_bytes: 1,
            tokens_per_block: 2,
            window: None,
            pools: smallvec![PoolLayout {
                region: RegionId(region),
                layer_begin: 0,
                layers,
                slot_bytes: u64::from(layers) * 2 * u64::from(heads) * 4,
            }],
            shard: GroupShard {
                model_layers: 4,
                first_layer,
                model_kv_heads: 4,
                first_head,
            },
            ..LayerGroupLayout::default()
        }
    }

    fn run(first: u32, ids: &[u32]) -> BlockRun {
        BlockRun {
            first_ordinal: first,
            ids: ids.iter().copied().map(BlockId).collect(),
        }
    }

    fn ext(src: u64, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(1),
            src_offset: src,
            dst_region: RegionId(2),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn a_receiver_with_fewer_heads_gets_one_slice_per_layer_and_plane() {
        // Sender: all 4 heads (32 bytes a layer); receiver: heads 2..3 of tensor rank 2 of 4
        // (8 bytes a layer), all layers.
        let (s, d) = (rank(0, 4, 0, 4, 1), rank(0, 4, 2, 1, 2));
        let pairing = check_pairable(&s, &d).unwrap();
        assert_eq!((pairing.head_begin, pairing.head_end), (2, 3));
        assert!(!pairing.whole_layers());
        let dst = AnchoredRun::from_ids(0, &[10].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[3]), &dst, &mut plan).unwrap();
        // The receiver's block is contiguous; the sender's slices are 16 bytes apart (a
        // plane of 4 heads): one 4-byte slice per (layer, plane), nothing merges.
        let expected: Vec<WriteExtent> = (0..8)
            .map(|p| ext(3 * 128 + 2 * 4 + p * 16, 10 * 32 + p * 4, 4))
            .collect();
        assert_eq!(plan.extents(), &expected[..]);
        assert_eq!(stats.bytes, 32);
        assert_eq!(stats.paired_blocks, 1);
    }

    #[test]
    fn extents_merge_only_where_both_sides_are_contiguous() {
        // The same single head on both sides (another tensor rank of the same size): whole
        // layers, and consecutive slots merge into one extent.
        let (s, d) = (rank(0, 4, 1, 1, 1), rank(0, 4, 1, 1, 2));
        assert!(check_pairable(&s, &d).unwrap().whole_layers());
        let dst = AnchoredRun::from_ids(0, &[20, 21, 22].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[5, 6, 7]), &dst, &mut plan).unwrap();
        assert_eq!(plan.extents(), &[ext(5 * 32, 20 * 32, 96)]);
        // A sender holding heads 0..2, a receiver holding all 4 (single plane): the slices are
        // contiguous at the source but 8 bytes apart at the destination (its other heads):
        // one extent per layer.
        let mut s = rank(0, 4, 0, 2, 1);
        let mut d = rank(0, 4, 0, 4, 2);
        s.kv_factor = 1;
        d.kv_factor = 1;
        s.pools[0].slot_bytes = 4 * 8;
        d.pools[0].slot_bytes = 4 * 16;
        let dst = AnchoredRun::from_ids(0, &[1].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[0]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                ext(0, 64, 8),
                ext(8, 80, 8),
                ext(16, 96, 8),
                ext(24, 112, 8)
            ]
        );
    }

    #[test]
    fn a_pipeline_rank_receives_its_layer_range() {
        // Receiver: layers 2..4 (pipeline rank 1 of 2), all heads: one whole-layer extent
        // from the sender's layer 2 on.
        let (s, d) = (rank(0, 4, 0, 4, 1), rank(2, 2, 0, 4, 2));
        let dst = AnchoredRun::from_ids(0, &[0, 1].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[4, 5]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[ext(4 * 128 + 64, 0, 64), ext(5 * 128 + 64, 64, 64)]
        );
        assert_eq!(stats.bytes, 128);
        // Layers the receiver does not hold plan nothing.
        let d = rank(2, 2, 0, 4, 2);
        let s = rank(0, 2, 0, 4, 1);
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[4]), &dst, &mut plan).unwrap();
        assert!(plan.is_empty());
        assert_eq!((stats.paired_blocks, stats.unpaired_src_blocks), (0, 1));
    }

    #[test]
    fn only_the_chosen_replica_writes_duplicated_heads() {
        // 1 KV head over 4 sender ranks (4 replicas); the receiver is rank 3 of 4 (replica 3
        // of the same head): only sender rank 3 writes it.
        let one_head = |region| {
            let mut l = rank(0, 4, 0, 1, region);
            l.shard.model_kv_heads = 1;
            l
        };
        let topo = |tp_size, tp_rank| Topology {
            tp_size,
            tp_rank,
            ..Topology::default()
        };
        let (s, d) = (one_head(1), one_head(2));
        let dst = AnchoredRun::from_ids(0, &[0].map(BlockId));
        let dt = topo(4, 3);
        for r in 0..4 {
            let st = topo(4, r);
            let mut plan = WritePlan::new();
            let stats = plan_rank_group(
                RankGroup {
                    topology: &st,
                    layout: &s,
                },
                RankGroup {
                    topology: &dt,
                    layout: &d,
                },
                &run(0, &[0]),
                &dst,
                &mut DstCursor::default(),
                &mut plan,
            )
            .unwrap();
            assert_eq!(plan.is_empty(), r != 3, "sender rank {r}");
            assert_eq!(stats.paired_blocks, u32::from(r == 3));
        }
    }
}
