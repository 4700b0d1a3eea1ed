//! The run-length encoding of an [`AnchoredRun`]: the first ordinal, then `(first id, len)`
//! runs, so a contiguous allocation of 4096 blocks takes 16 bytes.
//!
//! ```text
//! first_ordinal u32 | run_count u32 | run_count × (first u32 | len u32)
//! ```
//!
//! Only the canonical form is valid, in both directions: every run is non-empty, stays inside
//! the block-id space, does not continue its predecessor (those are merged), and the ordinals
//! stay in `u32`.

use core::fmt;

use smallvec::SmallVec;
use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::body::{fixed_len, BodyReader, BodyWriter, Invalid};
use super::error::{DecodeError, EncodeError, Malformation};
use crate::blocks::{AnchoredRun, IdRun};
use crate::ids::BlockId;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct AnchoredRunWire {
    first_ordinal: U32,
    run_count: U32,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct IdRunWire {
    first: U32,
    len: U32,
}

/// Bytes an anchored run with no id runs takes (the least any takes).
pub(super) const ANCHORED_RUN_LEN: u32 = fixed_len::<AnchoredRunWire>();
const ID_RUN_LEN: u32 = fixed_len::<IdRunWire>();

/// Bytes `run` takes on the wire.
pub(super) fn encoded_len(run: &AnchoredRun) -> usize {
    ANCHORED_RUN_LEN as usize + run.runs.len() * ID_RUN_LEN as usize
}

/// The canonical-form rule (see the module doc), for a run in a registration's `groups`.
fn check(run: &AnchoredRun) -> Result<(), Invalid> {
    const FIELD: &str = "groups[].runs[]";
    let mut end_ordinal = u64::from(run.first_ordinal);
    let mut prev: Option<IdRun> = None;
    for r in &run.runs {
        if r.len == 0 {
            return Err((FIELD, Malformation::ZeroLengthRun));
        }
        let end_id = u64::from(r.first.0) + u64::from(r.len);
        if end_id > 1 << 32 {
            return Err((FIELD, Malformation::BlockIdOverflow));
        }
        if let Some(p) = prev {
            if p.len < u32::MAX && u64::from(p.first.0) + u64::from(p.len) == u64::from(r.first.0) {
                return Err((FIELD, Malformation::UnmergedRun));
            }
        }
        end_ordinal += u64::from(r.len);
        if end_ordinal > 1 << 32 {
            return Err((FIELD, Malformation::OrdinalOverflow));
        }
        prev = Some(*r);
    }
    Ok(())
}

/// Reads one anchored run of a registration's `groups`; its id runs are checked against the
/// bytes present before any is built.
pub(super) fn parse(r: &mut BodyReader<'_>) -> Result<AnchoredRun, DecodeError> {
    let a = r.fixed::<AnchoredRunWire>("groups[]")?;
    let runs = r.slice::<IdRunWire>("groups[].runs", a.run_count.get() as usize)?;
    let run = AnchoredRun {
        first_ordinal: a.first_ordinal.get(),
        runs: runs
            .iter()
            .map(|x| IdRun {
                first: BlockId(x.first.get()),
                len: x.len.get(),
            })
            .collect::<SmallVec<_>>(),
    };
    r.check(check(&run))?;
    Ok(run)
}

/// Writes one anchored run of a registration's `groups`, refusing a non-canonical one.
pub(super) fn emit(run: &AnchoredRun, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
    w.check(check(run))?;
    let run_count = w.count("groups[].runs", run.runs.len(), u32::MAX)?;
    w.put(
        AnchoredRunWire {
            first_ordinal: U32::new(run.first_ordinal),
            run_count: U32::new(run_count),
        }
        .as_bytes(),
    )?;
    for id_run in &run.runs {
        w.put(
            IdRunWire {
                first: U32::new(id_run.first.0),
                len: U32::new(id_run.len),
            }
            .as_bytes(),
        )?;
    }
    Ok(())
}

/// `@7: blk#100+4096 blk#9+1`.
pub(super) struct RunDisplay<'a>(pub(super) &'a AnchoredRun);

impl fmt::Display for RunDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}:", self.0.first_ordinal)?;
        if self.0.runs.is_empty() {
            return f.write_str(" none");
        }
        for r in &self.0.runs {
            write!(f, " {}+{}", r.first, r.len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use smallvec::smallvec;

    use super::*;

    fn run(first_ordinal: u32, runs: &[(u32, u32)]) -> AnchoredRun {
        AnchoredRun {
            first_ordinal,
            runs: runs
                .iter()
                .map(|&(first, len)| IdRun {
                    first: BlockId(first),
                    len,
                })
                .collect(),
        }
    }

    #[test]
    fn a_contiguous_allocation_of_4096_blocks_is_16_bytes() {
        let r = run(7, &[(100, 4096)]);
        assert_eq!(encoded_len(&r), 16);
        assert_eq!(check(&r), Ok(()));
        assert_eq!(RunDisplay(&r).to_string(), "@7: blk#100+4096");
        assert_eq!(RunDisplay(&AnchoredRun::empty(5)).to_string(), "@5: none");
    }

    #[test]
    fn non_canonical_runs_are_refused() {
        let field = "groups[].runs[]";
        let cases = [
            (run(0, &[(1, 0)]), Malformation::ZeroLengthRun),
            (run(0, &[(1, 2), (3, 1)]), Malformation::UnmergedRun),
            (run(0, &[(u32::MAX, 2)]), Malformation::BlockIdOverflow),
            (run(u32::MAX, &[(0, 2)]), Malformation::OrdinalOverflow),
        ];
        for (r, why) in cases {
            assert_eq!(check(&r), Err((field, why)), "{r:?}");
        }
        // Runs that touch in the id space but not in order are fine; so is ending exactly at
        // the top of both spaces.
        assert_eq!(check(&run(0, &[(3, 1), (1, 2)])), Ok(()));
        assert_eq!(check(&run(u32::MAX - 1, &[(u32::MAX, 1)])), Ok(()));
        let top = AnchoredRun {
            first_ordinal: 0,
            runs: smallvec![IdRun {
                first: BlockId(0),
                len: u32::MAX,
            }],
        };
        assert_eq!(check(&top), Ok(()));
    }
}
