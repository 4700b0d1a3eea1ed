//! Layer ranges: the model layers one sender pool and one receiver pool both hold
//! ([`Segments`]), where they sit in a slot, and the part of one inside a layer slice.

use core::ops::Range;

use super::error::{PlanError, Side};
use crate::ids::RegionId;
use crate::layout::PoolLayout;

/// One side of a [`Segment`]: where the segment's bytes sit inside a slot of a pool.
#[derive(Clone, Copy, Debug)]
pub(super) struct SegmentSide {
    pub(super) region: RegionId,
    pub(super) slot_bytes: u64,
    /// Byte offset of the segment's first layer inside the slot.
    pub(super) base: u64,
}

impl SegmentSide {
    /// Offset of the segment in slot `first`, checking that the segment's `len` bytes in each
    /// of the `n` slots from `first` on are addressable.
    pub(super) fn offset(
        &self,
        side: Side,
        first: u64,
        n: u64,
        len: u64,
    ) -> Result<u64, PlanError> {
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
pub(super) struct Segment {
    pub(super) src: SegmentSide,
    pub(super) dst: SegmentSide,
    /// First model layer of the segment.
    pub(super) model_begin: u32,
    pub(super) layers: u64,
}

impl Segment {
    /// The part of the segment inside model layers `keep` (`None` when nothing is): each side's
    /// base moves to the first kept layer.
    pub(super) fn clip(
        &self,
        keep: &Range<u32>,
        src_layer_bytes: u64,
        dst_layer_bytes: u64,
    ) -> Option<Self> {
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
/// their rank's layers, see [`check_pairable`](super::check_pairable)). Layers only one rank
/// holds yield nothing.
pub(super) struct Segments<'a> {
    pub(super) src: &'a [PoolLayout],
    pub(super) dst: &'a [PoolLayout],
    /// Model layer of each side's pool layer 0 (the rank's first layer).
    pub(super) src_first: u32,
    pub(super) dst_first: u32,
    pub(super) src_layer_bytes: u64,
    pub(super) dst_layer_bytes: u64,
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
