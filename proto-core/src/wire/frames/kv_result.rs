//! `KvResult` (`0x11`, 26 bytes): the result of one slice (the reference design's
//! KV_AGENT_RESULT), naming both the sender's and the receiver's slice.
//!
//! ```text
//! request u64 | sender_slice u32 | receiver_slice u32 | bytes_written u64 | is_last bool
//! | status u8
//! ```

use core::fmt;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::{ReceiverSliceId, RequestId, SenderSliceId};
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::FrameKind;
use crate::wire::status::TransferStatus;

/// Result of one slice (the reference design's KV_AGENT_RESULT).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct KvResult {
    /// The request.
    pub request: RequestId,
    /// The sender's id for the slice.
    pub sender_slice: SenderSliceId,
    /// The receiver's id for the registration the slice wrote into.
    pub receiver_slice: ReceiverSliceId,
    /// Whether this is the request's last slice from this sender.
    pub is_last: bool,
    /// How the slice ended.
    pub status: TransferStatus,
    /// Bytes the slice wrote.
    pub bytes_written: u64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct KvResultWire {
    request: U64,
    sender_slice: U32,
    receiver_slice: U32,
    bytes_written: U64,
    is_last: u8,
    status: u8,
}

impl FrameBody for KvResult {
    const KIND: FrameKind = FrameKind::KvResult;
    const MAX_BODY_LEN: u32 = fixed_len::<KvResultWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<KvResultWire>("request")?;
        Ok(KvResult {
            request: RequestId(w.request.get()),
            sender_slice: SenderSliceId(w.sender_slice.get()),
            receiver_slice: ReceiverSliceId(w.receiver_slice.get()),
            is_last: r.bool("is_last", w.is_last)?,
            status: r.code("status", w.status, TransferStatus::from_code)?,
            bytes_written: w.bytes_written.get(),
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.put(
            KvResultWire {
                request: U64::new(self.request.0),
                sender_slice: U32::new(self.sender_slice.0),
                receiver_slice: U32::new(self.receiver_slice.0),
                bytes_written: U64::new(self.bytes_written),
                is_last: u8::from(self.is_last),
                status: self.status.code(),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for KvResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KvResult {} {} -> {} {} {} B{}",
            self.request,
            self.sender_slice,
            self.receiver_slice,
            self.status,
            self.bytes_written,
            if self.is_last { " (last)" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::{parse, roundtrip};
    use crate::wire::error::Malformation;

    fn result(status: TransferStatus) -> KvResult {
        KvResult {
            request: RequestId(1),
            sender_slice: SenderSliceId(2),
            receiver_slice: ReceiverSliceId(3),
            is_last: true,
            status,
            bytes_written: 4096,
        }
    }

    #[test]
    fn layout_puts_is_last_and_status_at_the_end() {
        let body = roundtrip(&result(TransferStatus::InDoubt));
        assert_eq!(body.len(), 26);
        assert_eq!(&body[8..12], &[2, 0, 0, 0], "sender_slice");
        assert_eq!(&body[12..16], &[3, 0, 0, 0], "receiver_slice");
        assert_eq!(&body[16..24], &4096u64.to_le_bytes(), "bytes_written");
        assert_eq!(&body[24..], &[1, 2], "is_last, status");
        for &status in TransferStatus::ALL {
            roundtrip(&result(status));
        }
    }

    #[test]
    fn a_bool_other_than_0_or_1_and_an_unknown_status_are_refused() {
        let good = roundtrip(&result(TransferStatus::Success));
        let mut b = good.clone();
        b[24] = 2;
        assert_eq!(
            parse::<KvResult>(&b),
            Err(DecodeError::Malformed {
                kind: FrameKind::KvResult,
                field: "is_last",
                reason: Malformation::NotBool { value: 2 },
            })
        );
        let mut b = good;
        b[25] = 9;
        assert_eq!(
            parse::<KvResult>(&b),
            Err(DecodeError::Malformed {
                kind: FrameKind::KvResult,
                field: "status",
                reason: Malformation::UnknownCode { code: 9 },
            })
        );
    }
}
