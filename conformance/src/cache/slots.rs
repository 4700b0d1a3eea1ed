//! A group's block slots: handing them out (last freed first, filler on first use), giving
//! them back, which of a request's blocks a windowed group keeps live, and the seeded slot order.

use kvpipe_core::{stale_boundary, BlockId, RequestId};

use super::content::fill_filler;
use super::{Dirty, GroupState};

impl GroupState {
    /// Hands out a free slot for `(request, ordinal)`; writes filler over it the first time.
    pub(super) fn take(&mut self, request: RequestId, ordinal: u32) -> Option<BlockId> {
        let slot = self.free.pop()?;
        let s = slot as usize;
        self.owner[s] = Some((request, ordinal));
        if !self.touched[s] {
            self.touched[s] = true;
            for (pool, bytes) in self.layout.pools.iter().zip(&mut self.memory) {
                if bytes.is_empty() {
                    continue;
                }
                let at = u64::from(slot) * pool.slot_bytes;
                let range = at as usize..(at + pool.slot_bytes) as usize;
                fill_filler(pool.region, at, &mut bytes[range]);
            }
            self.mark_dirty(slot);
        }
        self.held += 1;
        self.peak = self.peak.max(self.held);
        Some(BlockId(slot))
    }

    /// Notes that the host bytes of `slot` changed (uploaded by the next flush when the pools
    /// are in device memory).
    pub(super) fn mark_dirty(&mut self, slot: u32) {
        if let Some(dirty) = &mut self.dirty {
            dirty.push(Dirty { slot, layers: None });
        }
    }

    /// Notes that the host bytes of the group's layers `layers` (counted from its first, as
    /// pools' `layer_begin`) of `slot` changed.
    pub(super) fn mark_dirty_layers(&mut self, slot: u32, layers: std::ops::Range<u16>) {
        if let Some(dirty) = &mut self.dirty {
            dirty.push(Dirty {
                slot,
                layers: Some((layers.start, layers.end)),
            });
        }
    }

    /// Gives `slot` back (it is handed out again before any slot never used).
    pub(super) fn give_back(&mut self, slot: BlockId) {
        self.owner[slot.0 as usize] = None;
        self.free.push(slot.0);
        self.held -= 1;
    }

    /// Whether a request of `prompt_len` tokens keeps only a window of this group's blocks.
    pub(super) fn windowed_for(&self, prompt_len: u32) -> bool {
        self.layout.is_windowed_for(prompt_len)
    }

    /// The first ordinal of a windowed group still live once `tokens` tokens are computed (its
    /// sink blocks aside); 0 for a group that keeps every block.
    pub(super) fn live_from(&self, prompt_len: u32, tokens: u32) -> u32 {
        match self.layout.window {
            Some(w) if self.windowed_for(prompt_len) => {
                stale_boundary(tokens, w, self.layout.tokens_per_block).unwrap_or(0)
            }
            _ => 0,
        }
    }
}

/// Fisher–Yates with a xorshift64* generator: a reproducible slot order.
pub(super) fn shuffle(v: &mut [u32], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
}
