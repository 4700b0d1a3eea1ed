//! Checking the cache's bytes: blocks against their expected content ([`BlockMismatch`]), and
//! snapshots to find the slots a transfer changed.

use kvpipe_core::{BlockId, GeometryError, GroupIndex, RequestId, StaleBoundary};

use super::rows::first_difference;
use super::ReferenceCache;

/// A block whose bytes differ from the expected content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockMismatch {
    /// The request.
    pub request: RequestId,
    /// The group.
    pub group: GroupIndex,
    /// The block's ordinal.
    pub ordinal: u32,
    /// Its slot.
    pub slot: BlockId,
    /// The pool where the first difference is.
    pub pool: usize,
    /// Offset of the first differing byte inside the slot.
    pub offset_in_slot: u64,
}

impl ReferenceCache {
    /// Checks every resident block of `request` in `group` with ordinal in `ordinals` against
    /// the expected content of the tokens the cache holds; returns the blocks that differ.
    /// Bytes of tokens not computed yet are not checked.
    pub fn verify_blocks(
        &self,
        request: RequestId,
        group: GroupIndex,
        ordinals: std::ops::Range<u32>,
    ) -> Vec<BlockMismatch> {
        let mut out = Vec::new();
        let (Some(req), Some(gs)) = (
            self.requests.get(&request),
            self.groups.get(usize::from(group.0)),
        ) else {
            return out;
        };
        if !self.materialized {
            return out;
        }
        let tpb = self.tpb;
        let valid_tokens = if req.computed == req.prompt_len {
            req.prompt_len.div_ceil(tpb) * tpb
        } else {
            req.computed
        };
        let table = &req.tables[usize::from(group.0)];
        for ordinal in ordinals {
            let Some(Some(slot)) = table.get(ordinal as usize).copied() else {
                continue;
            };
            let hi = valid_tokens
                .min((ordinal + 1) * tpb)
                .saturating_sub(ordinal * tpb);
            if let Some((pool, offset_in_slot)) =
                first_difference(gs, request, group, ordinal, slot, 0..hi, tpb)
            {
                out.push(BlockMismatch {
                    request,
                    group,
                    ordinal,
                    slot,
                    pool,
                    offset_in_slot,
                });
            }
        }
        out
    }

    /// [`ReferenceCache::verify_blocks`] over every group and ordinal of `request`.
    pub fn verify(&self, request: RequestId) -> Vec<BlockMismatch> {
        let Some(req) = self.requests.get(&request) else {
            return Vec::new();
        };
        (0..self.groups.len())
            .flat_map(|g| {
                let blocks = req.tables[g].len() as u32;
                self.verify_blocks(request, GroupIndex(g as u16), 0..blocks)
            })
            .collect()
    }

    /// [`ReferenceCache::verify_blocks`] over the blocks of `request` a sender sends when it
    /// keeps a window of `sender_windows[g]` tokens in group `g` (`None`, or no entry: full
    /// attention): from its stale boundary to the end of the prompt. A receiver may keep a
    /// larger window than the sender; the older blocks are never written.
    pub fn verify_sent(
        &self,
        request: RequestId,
        sender_windows: &[Option<u32>],
    ) -> Result<Vec<BlockMismatch>, GeometryError> {
        let Some(req) = self.requests.get(&request) else {
            return Ok(Vec::new());
        };
        let (prompt, tpb) = (req.prompt_len, self.tpb);
        let mut out = Vec::new();
        for g in 0..self.groups.len() {
            let first = match sender_windows.get(g).copied().flatten() {
                Some(w) => StaleBoundary::new(prompt, w, tpb)?.ordinal(),
                None => 0,
            };
            out.extend(self.verify_blocks(
                request,
                GroupIndex(g as u16),
                first..prompt.div_ceil(tpb),
            ));
        }
        Ok(out)
    }

    /// A copy of every region's bytes, in [`ReferenceCache::region_ids`] order.
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        self.region_ids()
            .map(|id| self.region(id).unwrap_or_default().to_vec())
            .collect()
    }

    /// The (group, pool, slot) triples whose bytes differ from `before` (a
    /// [`ReferenceCache::snapshot`]).
    pub fn changed_slots(&self, before: &[Vec<u8>]) -> Vec<(GroupIndex, usize, BlockId)> {
        let mut out = Vec::new();
        for (i, id) in self.region_ids().enumerate() {
            let (g, p) = self.regions[i];
            let now = self.region(id).unwrap_or_default();
            let slot_bytes = self.groups[g].layout.pools[p].slot_bytes as usize;
            let Some(old) = before.get(i) else { continue };
            for (s, (a, b)) in now
                .chunks(slot_bytes)
                .zip(old.chunks(slot_bytes))
                .enumerate()
            {
                if a != b {
                    out.push((GroupIndex(g as u16), p, BlockId(s as u32)));
                }
            }
        }
        out
    }
}
