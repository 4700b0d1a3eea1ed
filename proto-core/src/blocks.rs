//! Block lists: what the sender's cache returns for a chunk ([`BlockRun`]) and what the
//! receiver registers for a request ([`AnchoredRun`]).
//!
//! Both carry an explicit first ordinal. Ordinals are never inferred from a list's length.

use smallvec::SmallVec;

use crate::ids::BlockId;

/// A contiguous run of resident blocks returned by a block source: the block at ordinal
/// `first_ordinal + i` is in slot `ids[i]`.
///
/// The buffer is owned by the caller and reused from chunk to chunk, so steady-state planning
/// does not allocate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct BlockRun {
    /// Ordinal of `ids[0]` in the request.
    pub first_ordinal: u32,
    /// Pool slots of consecutive ordinals, without holes.
    pub ids: Vec<BlockId>,
}

impl BlockRun {
    /// Ordinal one past the last block of the run.
    pub fn end_ordinal(&self) -> u32 {
        self.first_ordinal.saturating_add(self.ids.len() as u32)
    }

    /// Empties the run, keeping its buffer.
    pub fn clear(&mut self) {
        self.first_ordinal = 0;
        self.ids.clear();
    }
}

/// A run of consecutive block ids: `first, first + 1, …, first + len - 1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct IdRun {
    /// The first block id of the run.
    pub first: BlockId,
    /// How many consecutive ids the run covers.
    pub len: u32,
}

/// The receiver's blocks for one layer group of one request: consecutive ordinals starting at
/// `first_ordinal`, stored run-length encoded so a contiguous allocation of thousands of blocks
/// costs a few bytes on the wire and in memory.
///
/// Blocks the receiver already holds (its cached prefix, or blocks outside a window) are simply
/// not in the run, so nothing is sent for them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct AnchoredRun {
    /// Ordinal of the first block of the first run.
    pub first_ordinal: u32,
    /// Id runs covering consecutive ordinals.
    pub runs: SmallVec<[IdRun; 2]>,
}

impl AnchoredRun {
    /// An empty run anchored at `first_ordinal`.
    pub fn empty(first_ordinal: u32) -> Self {
        AnchoredRun {
            first_ordinal,
            runs: SmallVec::new(),
        }
    }

    /// Builds the run-length encoding of `ids`, anchored at `first_ordinal`.
    pub fn from_ids(first_ordinal: u32, ids: &[BlockId]) -> Self {
        let mut run = AnchoredRun::empty(first_ordinal);
        for &id in ids {
            run.push(id);
        }
        run
    }

    /// Appends the block for the next ordinal, extending the last id run when `id` follows it.
    pub fn push(&mut self, id: BlockId) {
        if let Some(last) = self.runs.last_mut() {
            if last.len < u32::MAX
                && u64::from(last.first.0) + u64::from(last.len) == u64::from(id.0)
            {
                last.len += 1;
                return;
            }
        }
        self.runs.push(IdRun { first: id, len: 1 });
    }

    /// Number of blocks covered (saturating at `u64::MAX`, which no valid run reaches).
    pub fn block_count(&self) -> u64 {
        self.runs.iter().map(|r| u64::from(r.len)).sum()
    }

    /// Ordinal one past the last block (as `u64`, so a hostile run cannot overflow it).
    pub fn end_ordinal(&self) -> u64 {
        u64::from(self.first_ordinal) + self.block_count()
    }

    /// The block id at `ordinal`, if the run covers it. O(number of id runs).
    pub fn id_at(&self, ordinal: u32) -> Option<BlockId> {
        let mut offset = u64::from(ordinal).checked_sub(u64::from(self.first_ordinal))?;
        for run in &self.runs {
            if offset < u64::from(run.len) {
                return u32::try_from(u64::from(run.first.0) + offset)
                    .ok()
                    .map(BlockId);
            }
            offset -= u64::from(run.len);
        }
        None
    }

    /// The first id, in ordinal order, that is `bound` or more: a block past a pool of
    /// `bound` slots. O(number of id runs). (An id range past `u32::MAX` wraps to ids below
    /// its first, which are below `bound` whenever its first is.)
    pub fn first_id_from(&self, bound: u64) -> Option<BlockId> {
        if bound > u64::from(u32::MAX) {
            return None;
        }
        self.runs.iter().filter(|r| r.len > 0).find_map(|run| {
            let start = u64::from(run.first.0);
            if start >= bound {
                Some(run.first)
            } else if start + u64::from(run.len) > bound {
                Some(BlockId(bound as u32))
            } else {
                None
            }
        })
    }

    /// A block id the run names for two ordinals (the smallest such id), or `None` when every
    /// id is distinct. O(r log r) in the number `r` of id runs, never in the number of blocks:
    /// it sorts a copy of the runs' id ranges (an id range past `u32::MAX` wraps, as
    /// [`iter`](Self::iter) does, and is split in two) and looks for two that overlap.
    pub fn repeated_id(&self) -> Option<BlockId> {
        const IDS: u64 = 1 << 32;
        let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(self.runs.len() + 1);
        for run in self.runs.iter().filter(|r| r.len > 0) {
            let start = u64::from(run.first.0);
            let end = start + u64::from(run.len);
            if end > IDS {
                ranges.push((start, IDS));
                ranges.push((0, end - IDS));
            } else {
                ranges.push((start, end));
            }
        }
        ranges.sort_unstable();
        let mut covered_to = 0u64;
        let mut repeated: Option<u64> = None;
        for (i, &(start, end)) in ranges.iter().enumerate() {
            if i > 0 && start < covered_to {
                // Sorted by start: `start` lies in an earlier range, and is the smallest id
                // this range shares with the ones before it.
                repeated = Some(repeated.map_or(start, |r| r.min(start)));
            }
            covered_to = covered_to.max(end);
        }
        repeated.map(|id| BlockId(id as u32))
    }

    /// Iterates `(ordinal, id)` pairs in ordinal order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        let mut ordinal = u64::from(self.first_ordinal);
        self.runs.iter().flat_map(move |run| {
            let start = ordinal;
            ordinal += u64::from(run.len);
            (0..run.len).map(move |i| (start + u64::from(i), BlockId(run.first.0.wrapping_add(i))))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_id_is_found_in_any_run_shape() {
        let ids = |v: &[u32]| {
            AnchoredRun::from_ids(0, &v.iter().map(|&i| BlockId(i)).collect::<Vec<_>>())
        };
        assert_eq!(ids(&[]).repeated_id(), None);
        assert_eq!(ids(&[5, 6, 7, 1, 2]).repeated_id(), None);
        assert_eq!(ids(&[20, 20]).repeated_id(), Some(BlockId(20)));
        // A later run that starts inside an earlier, longer one.
        assert_eq!(
            ids(&[10, 11, 12, 13, 4, 12]).repeated_id(),
            Some(BlockId(12))
        );
        assert_eq!(
            ids(&[3, 4, 5, 6, 7, 8, 9, 1, 5, 6]).repeated_id(),
            Some(BlockId(5))
        );
        // A run whose ids wrap past u32::MAX aliases the low ids.
        let wrapping = AnchoredRun {
            first_ordinal: 0,
            runs: smallvec::smallvec![
                IdRun {
                    first: BlockId(1),
                    len: 1
                },
                IdRun {
                    first: BlockId(u32::MAX),
                    len: 3
                },
            ],
        };
        assert_eq!(wrapping.repeated_id(), Some(BlockId(1)));
        // Thousands of blocks in one run cost one range.
        let long = AnchoredRun {
            first_ordinal: 0,
            runs: smallvec::smallvec![IdRun {
                first: BlockId(0),
                len: u32::MAX
            }],
        };
        assert_eq!(long.repeated_id(), None);
    }

    #[test]
    fn contiguous_ids_encode_as_one_run() {
        let ids: Vec<BlockId> = (100..4196).map(BlockId).collect();
        let run = AnchoredRun::from_ids(7, &ids);
        assert_eq!(run.runs.len(), 1);
        assert_eq!(run.block_count(), 4096);
        assert_eq!(run.end_ordinal(), 7 + 4096);
        assert_eq!(run.id_at(7), Some(BlockId(100)));
        assert_eq!(run.id_at(6), None);
        assert_eq!(run.id_at(7 + 4095), Some(BlockId(4195)));
        assert_eq!(run.id_at(7 + 4096), None);
    }

    #[test]
    fn iter_matches_id_at() {
        let ids = [5, 6, 9, 2, 3, 4].map(BlockId);
        let run = AnchoredRun::from_ids(3, &ids);
        assert_eq!(run.runs.len(), 3);
        let pairs: Vec<_> = run.iter().collect();
        assert_eq!(pairs.len(), ids.len());
        for (i, (ordinal, id)) in pairs.into_iter().enumerate() {
            assert_eq!(ordinal, 3 + i as u64);
            assert_eq!(id, ids[i]);
            assert_eq!(run.id_at(ordinal as u32), Some(id));
        }
    }

    #[test]
    fn the_first_id_past_a_bound_is_found_in_ordinal_order() {
        let ids = |v: &[u32]| {
            AnchoredRun::from_ids(0, &v.iter().map(|&i| BlockId(i)).collect::<Vec<_>>())
        };
        let naive = |v: &[u32], bound: u64| v.iter().find(|&&i| u64::from(i) >= bound).copied();
        let shapes: [&[u32]; 5] = [&[], &[0, 1, 2, 3], &[9, 10, 11, 2, 3], &[5, 1, 7, 8], &[7]];
        for v in shapes {
            for bound in 0..13 {
                assert_eq!(
                    ids(v).first_id_from(bound).map(|b| b.0),
                    naive(v, bound),
                    "{v:?} from {bound}"
                );
            }
        }
        // No id reaches a bound past u32::MAX; a run that wraps is past any bound above its
        // first id, at the bound.
        assert_eq!(ids(&[u32::MAX]).first_id_from(1 << 32), None);
        let wrapping = AnchoredRun {
            first_ordinal: 0,
            runs: smallvec::smallvec![IdRun {
                first: BlockId(u32::MAX - 1),
                len: 4
            }],
        };
        assert_eq!(wrapping.first_id_from(10), Some(BlockId(u32::MAX - 1)));
        assert_eq!(
            wrapping.first_id_from(u64::from(u32::MAX)),
            Some(BlockId(u32::MAX))
        );
    }
}
