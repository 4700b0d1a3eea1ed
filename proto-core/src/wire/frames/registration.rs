//! `RecvRegistration` (`0x10`, 30 + groups bytes): the receiver's destination for one request —
//! request, receiver slice, prompt length, memory grant, aux slot and one run-length encoded
//! anchored block run per layer group.
//!
//! ```text
//! request u64 | grant u64 | slice u32 | prompt_len u32 | aux_capacity u32 | group_count u16
//! | group_count × anchored run (see `wire::block_runs`)
//! ```

use core::fmt;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::blocks::AnchoredRun;
use crate::ids::{GrantId, ReceiverSliceId, RequestId};
use crate::wire::block_runs::{self, RunDisplay, ANCHORED_RUN_LEN};
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::{FrameKind, MAX_BODY_LEN};

/// The receiver's destination for one request, sent before (or while) prefill runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct RecvRegistration {
    /// The request.
    pub request: RequestId,
    /// The receiver's id for this registration.
    pub slice: ReceiverSliceId,
    /// The request's whole prompt length in tokens.
    pub prompt_len: u32,
    /// The memory grant data writes for this request must carry.
    pub grant: GrantId,
    /// Capacity of the receiver's aux slot in bytes (inline aux data larger than this is refused).
    pub aux_capacity: u32,
    /// The receiver's blocks, one anchored run per layer group, in group order.
    pub groups: Vec<AnchoredRun>,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RegistrationWire {
    request: U64,
    grant: U64,
    slice: U32,
    prompt_len: U32,
    aux_capacity: U32,
    group_count: U16,
}

impl FrameBody for RecvRegistration {
    const KIND: FrameKind = FrameKind::RecvRegistration;
    const MAX_BODY_LEN: u32 = MAX_BODY_LEN;

    fn body_len(&self) -> usize {
        fixed_len::<RegistrationWire>() as usize
            + self
                .groups
                .iter()
                .map(block_runs::encoded_len)
                .sum::<usize>()
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<RegistrationWire>("request")?;
        let group_count = usize::from(w.group_count.get());
        // Every group takes at least its fixed part: bound the allocation by the bytes present.
        if group_count > r.remaining() / ANCHORED_RUN_LEN as usize {
            return Err(r.short("groups", group_count * ANCHORED_RUN_LEN as usize));
        }
        let mut groups = Vec::with_capacity(group_count);
        for _ in 0..group_count {
            groups.push(block_runs::parse(r)?);
        }
        Ok(RecvRegistration {
            request: RequestId(w.request.get()),
            slice: ReceiverSliceId(w.slice.get()),
            prompt_len: w.prompt_len.get(),
            grant: GrantId(w.grant.get()),
            aux_capacity: w.aux_capacity.get(),
            groups,
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        let group_count = w.count("groups", self.groups.len(), u16::MAX)?;
        w.put(
            RegistrationWire {
                request: U64::new(self.request.0),
                grant: U64::new(self.grant.0),
                slice: U32::new(self.slice.0),
                prompt_len: U32::new(self.prompt_len),
                aux_capacity: U32::new(self.aux_capacity),
                group_count: U16::new(group_count),
            }
            .as_bytes(),
        )?;
        self.groups.iter().try_for_each(|g| block_runs::emit(g, w))
    }
}

impl fmt::Display for RecvRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RecvRegistration {} {} prompt {} tokens {} aux {} B groups [",
            self.request, self.slice, self.prompt_len, self.grant, self.aux_capacity
        )?;
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}", RunDisplay(g))?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::IdRun;
    use crate::ids::BlockId;
    use crate::wire::body::testing::{emit, parse, roundtrip};
    use crate::wire::error::Malformation;

    fn registration(runs: &[(u32, u32)]) -> RecvRegistration {
        RecvRegistration {
            request: RequestId(0x0102_0304_0506_0708),
            slice: ReceiverSliceId(3),
            prompt_len: 131_000,
            grant: GrantId(42),
            aux_capacity: 256,
            groups: vec![
                AnchoredRun {
                    first_ordinal: 7,
                    runs: runs
                        .iter()
                        .map(|&(first, len)| IdRun {
                            first: BlockId(first),
                            len,
                        })
                        .collect(),
                },
                AnchoredRun::empty(0),
            ],
        }
    }

    #[test]
    fn layout_is_30_fixed_bytes_then_8_per_group_and_8_per_run() {
        let body = roundtrip(&registration(&[(100, 4096), (9, 1)]));
        assert_eq!(body.len(), 30 + 2 * 8 + 2 * 8);
        assert_eq!(&body[28..30], &[2, 0], "group_count");
        assert_eq!(
            &body[30..38],
            &[7, 0, 0, 0, 2, 0, 0, 0],
            "anchor, run_count"
        );
        assert_eq!(&body[38..42], &100u32.to_le_bytes());
        assert_eq!(&body[42..46], &4096u32.to_le_bytes());
        assert_eq!(
            registration(&[(100, 4096)]).to_string(),
            "RecvRegistration req#72623859790382856 rslice#3 prompt 131000 tokens grant#42 \
             aux 256 B groups [@7: blk#100+4096; @0: none]"
        );
    }

    #[test]
    fn unmerged_runs_are_refused_both_ways() {
        let unmerged = registration(&[(100, 4), (104, 1)]);
        let reason = Malformation::UnmergedRun;
        assert_eq!(
            emit(&unmerged),
            Err(EncodeError::Invalid {
                kind: FrameKind::RecvRegistration,
                field: "groups[].runs[]",
                reason,
            })
        );
        let mut body = roundtrip(&registration(&[(100, 4), (105, 1)]));
        body[46..50].copy_from_slice(&104u32.to_le_bytes());
        assert_eq!(
            parse::<RecvRegistration>(&body),
            Err(DecodeError::Malformed {
                kind: FrameKind::RecvRegistration,
                field: "groups[].runs[]",
                reason,
            })
        );
    }

    #[test]
    fn counts_are_bounded_by_the_bytes_present() {
        let mut body = roundtrip(&registration(&[(1, 1)]));
        body[28..30].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            parse::<RecvRegistration>(&body),
            Err(DecodeError::Malformed {
                field: "groups",
                ..
            })
        ));
        let mut body = roundtrip(&registration(&[(1, 1)]));
        body[34..38].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse::<RecvRegistration>(&body),
            Err(DecodeError::Malformed {
                field: "groups[].runs",
                ..
            })
        ));
    }
}
