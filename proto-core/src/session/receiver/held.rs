//! The destination blocks that live requests hold, per layer group. A registration naming a
//! block that another request still holds (registered, not yet quiesced) is refused. A double
//! allocation in the engine then cannot let one request's writes overwrite another's KV while
//! both report complete.

use std::collections::BTreeMap;

use crate::blocks::AnchoredRun;
use crate::ids::{BlockId, RequestId};

/// Per layer group, disjoint block-id ranges `start → (end, holder)` (ends exclusive), one for
/// each id run of a held registration. An entry stays until its holder is retired. An entry
/// whose holder no longer pins its blocks (quiesced) is dropped when a registration meets it.
#[derive(Debug, Default)]
pub(super) struct HeldBlocks {
    groups: Vec<BTreeMap<u64, (u64, RequestId)>>,
}

/// The id ranges of `run`, ends exclusive; an id run past `u32::MAX` wraps (as
/// [`AnchoredRun::iter`] does) and gives two.
fn id_ranges(run: &AnchoredRun) -> impl Iterator<Item = (u64, u64)> + '_ {
    const IDS: u64 = 1 << 32;
    run.runs.iter().filter(|r| r.len > 0).flat_map(|r| {
        let (start, end) = (
            u64::from(r.first.0),
            u64::from(r.first.0) + u64::from(r.len),
        );
        let wrapped = (end > IDS).then(|| (0, end - IDS));
        std::iter::once((start, end.min(IDS))).chain(wrapped)
    })
}

impl HeldBlocks {
    /// The first block of `groups` (group by group, in run order) held by a request that
    /// `pins` says still pins its blocks: its group, the block and the holder. Entries of
    /// holders that no longer pin are dropped on the way.
    pub(super) fn conflict(
        &mut self,
        groups: &[AnchoredRun],
        pins: impl Fn(RequestId) -> bool,
    ) -> Option<(usize, BlockId, RequestId)> {
        for (g, (run, held)) in groups.iter().zip(&mut self.groups).enumerate() {
            for (start, end) in id_ranges(run) {
                // The entries are disjoint: the last one starting before `end` is the only one
                // that can reach into `[start, end)` past the ones before it.
                while let Some((&at, &(until, holder))) = held.range(..end).next_back() {
                    if until <= start {
                        break;
                    }
                    if pins(holder) {
                        return Some((g, BlockId(start.max(at) as u32), holder));
                    }
                    held.remove(&at);
                }
            }
        }
        None
    }

    /// `request` holds `groups` (checked by [`conflict`](Self::conflict) first).
    pub(super) fn hold(&mut self, request: RequestId, groups: &[AnchoredRun]) {
        if self.groups.len() < groups.len() {
            self.groups.resize_with(groups.len(), BTreeMap::new);
        }
        for (run, held) in groups.iter().zip(&mut self.groups) {
            for (start, end) in id_ranges(run) {
                held.insert(start, (end, request));
            }
        }
    }

    /// `request`, retired, holds `groups` no more (entries another request took over stay).
    pub(super) fn release(&mut self, request: RequestId, groups: &[AnchoredRun]) {
        for (run, held) in groups.iter().zip(&mut self.groups) {
            for (start, _) in id_ranges(run) {
                if held
                    .get(&start)
                    .is_some_and(|&(_, holder)| holder == request)
                {
                    held.remove(&start);
                }
            }
        }
    }

    /// Id ranges held, over every group.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.groups.iter().map(BTreeMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ids: &[u32]) -> Vec<AnchoredRun> {
        vec![AnchoredRun::from_ids(
            0,
            &ids.iter().map(|&i| BlockId(i)).collect::<Vec<_>>(),
        )]
    }

    #[test]
    fn a_block_is_held_by_one_pinning_request_at_a_time() {
        let (a, b, c) = (RequestId(1), RequestId(2), RequestId(3));
        let mut held = HeldBlocks::default();
        let pins_all = |_| true;
        held.hold(a, &run(&[10, 11, 12, 30]));
        // Disjoint: taken. Overlapping a range at its start, inside it, or a later run.
        assert_eq!(held.conflict(&run(&[13, 14, 5]), pins_all), None);
        assert_eq!(
            held.conflict(&run(&[8, 9, 10]), pins_all),
            Some((0, BlockId(10), a))
        );
        assert_eq!(
            held.conflict(&run(&[11]), pins_all),
            Some((0, BlockId(11), a))
        );
        assert_eq!(
            held.conflict(&run(&[1, 2, 30]), pins_all),
            Some((0, BlockId(30), a))
        );
        // A holder that no longer pins is dropped, and its blocks are taken.
        assert_eq!(held.conflict(&run(&[12, 13]), |r| r != a), None);
        held.hold(b, &run(&[12, 13]));
        assert_eq!(
            held.conflict(&run(&[13]), pins_all),
            Some((0, BlockId(13), b))
        );
        // Retiring `a` leaves `b`'s entries alone.
        held.release(a, &run(&[10, 11, 12, 30]));
        assert_eq!(
            held.conflict(&run(&[12]), pins_all),
            Some((0, BlockId(12), b))
        );
        assert_eq!(held.conflict(&run(&[30]), pins_all), None);
        held.release(b, &run(&[12, 13]));
        assert_eq!(held.len(), 0);
        // A run that wraps past u32::MAX holds the low ids too.
        let wrapping = vec![AnchoredRun {
            first_ordinal: 0,
            runs: smallvec::smallvec![crate::blocks::IdRun {
                first: BlockId(u32::MAX),
                len: 3
            }],
        }];
        held.hold(c, &wrapping);
        assert_eq!(
            held.conflict(&run(&[1]), pins_all),
            Some((0, BlockId(1), c))
        );
        assert_eq!(
            held.conflict(&run(&[u32::MAX]), pins_all),
            Some((0, BlockId(u32::MAX), c))
        );
        assert_eq!(held.conflict(&run(&[2, 3]), pins_all), None);
    }
}
