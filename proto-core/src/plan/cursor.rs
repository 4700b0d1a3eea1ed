//! The search of a receiver's [`AnchoredRun`]: [`DstCursor`], where the previous chunk stopped,
//! and the overlaps of a chunk's ordinals with the receiver's id runs.

use crate::blocks::AnchoredRun;

/// Where the previous [`plan_group_with_cursor`] call stopped in a receiver's
/// [`AnchoredRun`], so that planning successive chunks does not rescan the run's head: each call
/// then costs O(chunk blocks + id runs overlapping the chunk), however fragmented the receiver's
/// allocation is.
///
/// A cursor belongs to one anchored run. It remembers the run's anchor and number of id runs and
/// starts over when they change or when a chunk lies before it. Keep one per (request, group)
/// and reset it (`DstCursor::default()`) when the registration is replaced.
///
/// [`plan_group_with_cursor`]: super::plan_group_with_cursor
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DstCursor {
    /// Index of the id run the next search starts from.
    pub(super) run: usize,
    /// Ordinal of the first block of `runs[run]`.
    pub(super) ordinal: u64,
    /// Anchor of the run the cursor was built on.
    anchor: u32,
    /// Number of id runs of the run the cursor was built on.
    runs: usize,
}

impl DstCursor {
    /// Moves to the id run that holds `ordinal` (or the first one after it).
    pub(super) fn seek(&mut self, dst: &AnchoredRun, ordinal: u64) {
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
pub(super) struct Overlap {
    pub(super) ordinal: u64,
    pub(super) src_index: usize,
    pub(super) dst_first: u64,
    pub(super) len: u64,
}

/// Iterates the overlaps of a source ordinal range with a receiver run, from a cursor position.
pub(super) struct Overlaps<'a> {
    pub(super) dst: &'a AnchoredRun,
    pub(super) run: usize,
    pub(super) run_ordinal: u64,
    pub(super) src_begin: u64,
    pub(super) src_end: u64,
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
