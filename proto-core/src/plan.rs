//! Write plans: the byte extents a slice copies from sender memory to receiver memory, and
//! [`plan_group`], which pairs one chunk's source blocks with the receiver's blocks by ordinal
//! and turns the pairs into coalesced extents.

use thiserror::Error;

use crate::blocks::{AnchoredRun, BlockRun};
use crate::ids::{BlockId, RegionId};
use crate::layout::{LayerGroupLayout, PoolLayout};

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
    /// Byte offset of the segment inside the slot.
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

/// A layer range held by one sender pool and one receiver pool: `len` bytes per block.
#[derive(Clone, Copy, Debug)]
struct Segment {
    src: SegmentSide,
    dst: SegmentSide,
    len: u64,
}

/// The layer ranges where the sender's and the receiver's pools overlap, in layer order
/// (a merge of the two pool lists; both tile the group's layers, see [`check_pairable`]).
struct Segments<'a> {
    src: &'a [PoolLayout],
    dst: &'a [PoolLayout],
    layer_bytes: u64,
}

impl Iterator for Segments<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        loop {
            let (a, b) = (self.src.first()?, self.dst.first()?);
            let a_end = u32::from(a.layer_begin) + u32::from(a.layers);
            let b_end = u32::from(b.layer_begin) + u32::from(b.layers);
            let lo = a.layer_begin.max(b.layer_begin);
            let hi = a_end.min(b_end);
            if a_end <= b_end {
                self.src = &self.src[1..];
            }
            if b_end <= a_end {
                self.dst = &self.dst[1..];
            }
            if u32::from(lo) < hi {
                // Layer counts and byte sizes were checked for overflow in `check_pairable`.
                let side = |p: &PoolLayout| SegmentSide {
                    region: p.region,
                    slot_bytes: p.slot_bytes,
                    base: u64::from(lo - p.layer_begin) * self.layer_bytes,
                };
                return Some(Segment {
                    src: side(a),
                    dst: side(b),
                    len: (u64::from(hi) - u64::from(lo)) * self.layer_bytes,
                });
            }
        }
    }
}

/// Checks that the two sides describe the same group geometry and that each side's pools tile
/// the group's layers in order with slots large enough; returns the bytes one layer adds to a
/// block.
pub fn check_pairable(src: &LayerGroupLayout, dst: &LayerGroupLayout) -> Result<u64, PlanError> {
    let fields: [(&'static str, u64, u64); 7] = [
        ("layers", src.layers.into(), dst.layers.into()),
        ("kv_factor", src.kv_factor.into(), dst.kv_factor.into()),
        ("kv_heads", src.kv_heads.into(), dst.kv_heads.into()),
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
    if src.window != dst.window {
        return Err(PlanError::WindowMismatch {
            sender: src.window,
            receiver: dst.window,
        });
    }
    let layer_bytes = src
        .layer_block_bytes()
        .ok_or(PlanError::BlockBytesOverflow)?;
    for (side, layout) in [(Side::Sender, src), (Side::Receiver, dst)] {
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
    Ok(layer_bytes)
}

/// Pairs one chunk's source blocks with the receiver's blocks **by ordinal** and appends the
/// byte extents that copy them to `plan`, coalescing writes contiguous on both sides.
///
/// `src` is the chunk's run from the [`BlockSource`](crate::source::BlockSource); `dst` is the
/// receiver's registration for the same group. Only ordinals in both are written: the
/// receiver's cached prefix is not in its run, so it is not sent, and a chunk inside that prefix
/// plans nothing. Each paired block becomes one extent per layer range held by one sender pool
/// and one receiver pool (one per pool when both sides split the group alike). Extents are
/// emitted range by range, block by block, so consecutive slots coalesce into one write.
///
/// Costs O(paired blocks × pools + receiver id runs before the chunk's end); use
/// [`plan_group_with_cursor`] to drop the second term across chunks. Allocates nothing when
/// `plan` has room for the extents (see [`WritePlan::reserve`]). On error `plan` is left as it
/// was.
///
/// Both layouts must describe the same group geometry (see [`check_pairable`]); otherwise a
/// [`PlanError`] says what differs. A different number of KV heads on the two sides
/// (heterogeneous tensor parallelism) is rejected for now: it maps onto the same plan type as
/// head-slice extents inside each layer, i.e. a further split of each segment.
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
    let layer_bytes = check_pairable(src_layout, dst_layout)?;
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
    for (i, o) in overlaps().enumerate() {
        if i == 0 {
            stats.first_ordinal = u32::try_from(o.ordinal).unwrap_or(u32::MAX);
        }
        paired += o.len;
    }
    stats.paired_blocks = u32::try_from(paired).unwrap_or(u32::MAX);
    stats.unpaired_src_blocks = u32::try_from(src.ids.len() as u64 - paired).unwrap_or(u32::MAX);

    let before = plan.len();
    let last_before = plan.extents.last().copied();
    let segments = Segments {
        src: &src_layout.pools,
        dst: &dst_layout.pools,
        layer_bytes,
    };
    let mut bytes = 0u64;
    let mut result = Ok(());
    for segment in segments {
        match plan_segment(&segment, &src.ids, overlaps(), plan) {
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

/// Appends one segment's extents for every overlap; returns the bytes. When the segment fills
/// whole slots on both sides, runs of consecutive source slots (the receiver's are consecutive
/// inside an overlap) become one extent each; otherwise one extent per block, which
/// [`WritePlan::push`] coalesces when both sides happen to be contiguous.
fn plan_segment(
    segment: &Segment,
    src_ids: &[BlockId],
    overlaps: Overlaps<'_>,
    plan: &mut WritePlan,
) -> Result<u64, PlanError> {
    let whole_slots =
        segment.len == segment.src.slot_bytes && segment.len == segment.dst.slot_bytes;
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
            let src_offset = segment
                .src
                .offset(Side::Sender, first, blocks, segment.len)?;
            let dst_first = o.dst_first + k as u64;
            let dst_offset = segment
                .dst
                .offset(Side::Receiver, dst_first, blocks, segment.len)?;
            // Both ends were checked addressable, so the length fits too.
            let len = segment.len * blocks;
            plan.push(WriteExtent {
                src_region: segment.src.region,
                src_offset,
                dst_region: segment.dst.region,
                dst_offset,
                len,
            });
            bytes += len;
            k += n;
        }
    }
    Ok(bytes)
}

/// Two layer-group layouts that cannot be paired, or a block whose bytes cannot be addressed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A geometry field differs between the two sides.
    #[error(
        "layer groups cannot be paired: {field} is {sender} on the sender and {receiver} on the \
         receiver; both sides must use the same model geometry and block size (different \
         kv_heads, i.e. heterogeneous tensor parallelism, is not supported yet)"
    )]
    LayoutMismatch {
        /// The differing field of [`LayerGroupLayout`].
        field: &'static str,
        /// Its value on the sender.
        sender: u64,
        /// Its value on the receiver.
        receiver: u64,
    },
    /// The sliding window differs between the two sides.
    #[error(
        "layer groups cannot be paired: the sender's window is {sender:?} tokens and the \
         receiver's {receiver:?}; both sides must run the same model"
    )]
    WindowMismatch {
        /// Sender's window (`None`: full attention).
        sender: Option<u32>,
        /// Receiver's window (`None`: full attention).
        receiver: Option<u32>,
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
                field: "kv_heads",
                sender: 1,
                receiver: 2
            }
        );
        assert!(err
            .to_string()
            .contains("kv_heads is 1 on the sender and 2"));
        let mut d = layout(&[2, 2], 3);
        d.window = Some(8);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::WindowMismatch { .. })
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
