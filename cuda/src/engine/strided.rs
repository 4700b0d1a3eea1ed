//! Strided runs: consecutive device → device copies of one length whose sources and
//! destinations advance by constant pitches, issued as one 2D copy.

use super::copies::{CopyOp, Direction, Memory};

/// The largest pitch a 2D copy is given (the driver's limit is at least 2^31 - 1 on every
/// device it supports).
const MAX_PITCH: u64 = (1 << 31) - 1;

/// A run of `rows` copies of one direction and length whose sources advance by `src_pitch`
/// and destinations by `dst_pitch` bytes from `first`'s (one copy when `rows` is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct StridedRun {
    /// The first copy (its length is each row's).
    pub(super) first: CopyOp,
    /// Copies in the run.
    pub(super) rows: u64,
    /// Bytes from one row's source to the next's.
    pub(super) src_pitch: u64,
    /// Bytes from one row's destination to the next's.
    pub(super) dst_pitch: u64,
}

impl StridedRun {
    /// Bytes the run copies.
    pub(super) fn bytes(&self) -> u64 {
        self.first.len * self.rows
    }

    /// Row `k` as a copy of its own.
    pub(super) fn row(&self, k: u64) -> CopyOp {
        CopyOp {
            src: self.first.src + k * self.src_pitch,
            dst: self.first.dst + k * self.dst_pitch,
            ..self.first
        }
    }
}

/// Groups `copies` (as [`coalesce_in`](super::copies::coalesce_in) leaves them, with their
/// `memories`) into runs, in order: consecutive device → device copies of one device, one
/// length and the same memory on each side (a 2D copy's span, gaps included, must lie in one
/// allocation) whose sources and destinations advance by constant pitches, each at least the
/// length (rows never overlap) and at most [`MAX_PITCH`], form one run; every other copy is a
/// run of one.
pub(super) fn strided_runs(
    copies: &[CopyOp],
    memories: &[(Memory, Memory)],
    out: &mut Vec<StridedRun>,
) {
    out.clear();
    let mut i = 0;
    while i < copies.len() {
        let first = copies[i];
        let mut run = StridedRun {
            first,
            rows: 1,
            src_pitch: 0,
            dst_pitch: 0,
        };
        if let (Direction::DeviceToDevice { .. }, Some(next)) = (first.direction, copies.get(i + 1))
        {
            let pitch = |a: u64, b: u64| {
                b.checked_sub(a)
                    .filter(|&p| p >= first.len && p <= MAX_PITCH)
            };
            if let (true, Some(sp), Some(dp)) = (
                next.direction == first.direction
                    && next.len == first.len
                    && memories.get(i + 1) == memories.get(i),
                pitch(first.src, next.src),
                pitch(first.dst, next.dst),
            ) {
                run.src_pitch = sp;
                run.dst_pitch = dp;
                while let Some(c) = copies.get(i + run.rows as usize) {
                    if memories.get(i + run.rows as usize) != memories.get(i) {
                        break;
                    }
                    let at = |base: u64, p: u64| {
                        p.checked_mul(run.rows).and_then(|o| base.checked_add(o))
                    };
                    if c.direction != first.direction
                        || c.len != first.len
                        || Some(c.src) != at(first.src, sp)
                        || Some(c.dst) != at(first.dst, dp)
                    {
                        break;
                    }
                    run.rows += 1;
                }
            }
        }
        i += run.rows as usize;
        out.push(run);
    }
}
