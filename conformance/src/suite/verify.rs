//! Comparing what a receiver's cache holds for a request with the sender's blocks, and the
//! one-byte corruption that shows the comparison catches a wrong byte.

use kvpipe_core::{BlockId, GroupIndex, RequestId};

use crate::cache::ReferenceCache;

/// Compares every block the receiver holds for `request` with the sender's block of the same
/// ordinal, layer by layer (the two sides may split layers into pools differently). Returns
/// the (group, ordinal) pairs that differ and the bytes compared.
pub fn verify_against_sender(
    sender: &ReferenceCache,
    receiver: &ReferenceCache,
    request: RequestId,
) -> (Vec<(GroupIndex, u32)>, u64) {
    let mut bad = Vec::new();
    let mut compared = 0;
    for g in 0..receiver.group_count() {
        let group = GroupIndex(g as u16);
        let (Some(sl), Some(rl)) = (sender.layout(group), receiver.layout(group)) else {
            continue;
        };
        let Some(layer_bytes) = sl.layer_block_bytes() else {
            continue;
        };
        let (Some(st), Some(rt)) = (sender.table(request, group), receiver.table(request, group))
        else {
            continue;
        };
        for (ordinal, entry) in rt.iter().enumerate() {
            // A block the sender no longer holds (evicted) is checked against the expected
            // content instead (`Workload::verify_content`).
            let (Some(dslot), Some(Some(sslot))) = (entry, st.get(ordinal)) else {
                continue;
            };
            let mut same = true;
            for layer in 0..sl.layers {
                let locate = |pools: &[kvpipe_core::PoolLayout], slot: BlockId| {
                    pools.iter().find_map(|p| {
                        (layer >= p.layer_begin && layer < p.layer_begin + p.layers).then(|| {
                            (
                                p.region,
                                u64::from(slot.0) * p.slot_bytes
                                    + u64::from(layer - p.layer_begin) * layer_bytes,
                            )
                        })
                    })
                };
                let (Some((sr, so)), Some((dr, doff))) =
                    (locate(&sl.pools, *sslot), locate(&rl.pools, *dslot))
                else {
                    same = false;
                    break;
                };
                let (Some(s), Some(d)) = (sender.region(sr), receiver.region(dr)) else {
                    same = false;
                    break;
                };
                let (so, doff, n) = (so as usize, doff as usize, layer_bytes as usize);
                compared += layer_bytes;
                if s.get(so..so + n) != d.get(doff..doff + n) {
                    same = false;
                }
            }
            if !same {
                bad.push((group, ordinal as u32));
            }
        }
    }
    (bad, compared)
}

/// Flips one byte in the middle of `request`'s last destination block of group 0.
pub(super) fn corrupt_one_byte(receiver: &mut ReferenceCache, request: RequestId) {
    let group = GroupIndex(0);
    let Some(slot) = receiver
        .table(request, group)
        .and_then(|t| t.iter().rev().flatten().next().copied())
    else {
        return;
    };
    let Some(pool) = receiver.layout(group).map(|l| l.pools[0]) else {
        return;
    };
    let at = (u64::from(slot.0) * pool.slot_bytes + pool.slot_bytes / 2) as usize;
    if let Some(b) = receiver.region_mut(pool.region).and_then(|r| r.get_mut(at)) {
        *b ^= 0x5a;
    }
}
