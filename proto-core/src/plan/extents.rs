//! One layer range's extents for every paired block: whole layers when both ranks hold the same
//! heads, head slices when they hold different ones.

use super::cursor::Overlaps;
use super::error::{PlanError, Side};
use super::pairing::GroupPairing;
use super::segments::Segment;
use super::write_plan::{WriteExtent, WritePlan};
use crate::ids::BlockId;

/// Appends one segment's extents for every overlap when both ranks hold the same heads (whole
/// layers); returns the bytes. When the segment fills whole slots on both sides, runs of
/// consecutive source slots (the receiver's are consecutive inside an overlap) become one
/// extent each; otherwise one extent per block, which [`WritePlan::push`] coalesces when both
/// sides happen to be contiguous.
pub(super) fn plan_segment(
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
pub(super) fn plan_head_slices(
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
