//! `AuxResult` (`0x12`, 25 + 4 × (f + d) bytes): the small per-request data that travels
//! inline after the KV (token counts, first generated tokens, draft tokens).
//!
//! ```text
//! request u64 | prompt_tokens u32 | cached_tokens u32 | first_count u32 = f
//! | draft_count u32 = d | status u8 | f × u32 first_tokens | d × u32 draft_tokens
//! ```

use core::fmt;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::RequestId;
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::{FrameKind, MAX_BODY_LEN};
use crate::wire::status::TransferStatus;

/// The small per-request data that travels inline after the KV.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct AuxData {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens the sender had cached (prefix reuse).
    pub cached_tokens: u32,
    /// The first generated token(s).
    pub first_tokens: Vec<u32>,
    /// Speculative draft tokens.
    pub draft_tokens: Vec<u32>,
}

impl AuxData {
    /// Bytes any aux data takes in a slot: its two counts and two lengths, no token.
    pub const SLOT_MIN: u64 = 16;

    /// Bytes the data takes in a receiver's aux slot (two counts, two lengths and the tokens),
    /// which a registration's `aux_capacity` bounds.
    pub fn slot_len(&self) -> u64 {
        Self::SLOT_MIN + 4 * (self.first_tokens.len() as u64 + self.draft_tokens.len() as u64)
    }
}

/// Inline aux data for a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct AuxResult {
    /// The request.
    pub request: RequestId,
    /// Whether the aux data is valid.
    pub status: TransferStatus,
    /// The data.
    pub data: AuxData,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct AuxResultWire {
    request: U64,
    prompt_tokens: U32,
    cached_tokens: U32,
    first_count: U32,
    draft_count: U32,
    status: u8,
}

impl FrameBody for AuxResult {
    const KIND: FrameKind = FrameKind::AuxResult;
    const MAX_BODY_LEN: u32 = MAX_BODY_LEN;

    fn body_len(&self) -> usize {
        fixed_len::<AuxResultWire>() as usize
            + 4 * (self.data.first_tokens.len() + self.data.draft_tokens.len())
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<AuxResultWire>("request")?;
        let status = r.code("status", w.status, TransferStatus::from_code)?;
        // Both lists are checked against the bytes present before either is built.
        let first = r.slice::<U32>("first_tokens", w.first_count.get() as usize)?;
        let draft = r.slice::<U32>("draft_tokens", w.draft_count.get() as usize)?;
        Ok(AuxResult {
            request: RequestId(w.request.get()),
            status,
            data: AuxData {
                prompt_tokens: w.prompt_tokens.get(),
                cached_tokens: w.cached_tokens.get(),
                first_tokens: first.iter().map(|t| t.get()).collect(),
                draft_tokens: draft.iter().map(|t| t.get()).collect(),
            },
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        let d = &self.data;
        let first_count = w.count("first_tokens", d.first_tokens.len(), u32::MAX)?;
        let draft_count = w.count("draft_tokens", d.draft_tokens.len(), u32::MAX)?;
        w.put(
            AuxResultWire {
                request: U64::new(self.request.0),
                prompt_tokens: U32::new(d.prompt_tokens),
                cached_tokens: U32::new(d.cached_tokens),
                first_count: U32::new(first_count),
                draft_count: U32::new(draft_count),
                status: self.status.code(),
            }
            .as_bytes(),
        )?;
        for t in d.first_tokens.iter().chain(&d.draft_tokens) {
            w.put(&t.to_le_bytes())?;
        }
        Ok(())
    }
}

impl fmt::Display for AuxResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.data;
        write!(
            f,
            "AuxResult {} {} prompt {} cached {} first {:?} draft {:?}",
            self.request,
            self.status,
            d.prompt_tokens,
            d.cached_tokens,
            d.first_tokens,
            d.draft_tokens
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::{parse, roundtrip};
    use crate::wire::error::Malformation;

    fn aux() -> AuxResult {
        AuxResult {
            request: RequestId(5),
            status: TransferStatus::Success,
            data: AuxData {
                prompt_tokens: 100,
                cached_tokens: 32,
                first_tokens: vec![7],
                draft_tokens: vec![8, 9],
            },
        }
    }

    #[test]
    fn layout_is_25_fixed_bytes_then_first_then_draft_tokens() {
        let body = roundtrip(&aux());
        assert_eq!(body.len(), 25 + 4 * 3);
        assert_eq!(
            &body[16..25],
            &[1, 0, 0, 0, 2, 0, 0, 0, 0],
            "counts, status"
        );
        assert_eq!(&body[25..], &[7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0]);
    }

    #[test]
    fn token_counts_are_bounded_by_the_bytes_present() {
        let mut b = roundtrip(&aux());
        b[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        let short = Malformation::Short {
            needed: u32::MAX as usize * 4,
            have: 8,
        };
        assert_eq!(
            parse::<AuxResult>(&b),
            Err(DecodeError::Malformed {
                kind: FrameKind::AuxResult,
                field: "draft_tokens",
                reason: short,
            })
        );
        let mut b = roundtrip(&aux());
        b[16..20].copy_from_slice(&1u32.to_le_bytes());
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            parse::<AuxResult>(&b),
            Err(DecodeError::TrailingBytes {
                kind: FrameKind::AuxResult,
                extra: 4,
            })
        );
    }
}
