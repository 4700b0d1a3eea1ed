//! `RecvComplete` (`0x16`, 8 bytes): the receiver completed a request, sent to each of its
//! writers. A writer's session completes only when it comes: until then the receiver may
//! still fail or cancel the request, and the writer would report a success the receiver never
//! had.
//!
//! ```text
//! request u64
//! ```

use core::fmt;

use zerocopy::little_endian::U64;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::RequestId;
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::FrameKind;

/// The receiver completed `request`: every writer's bytes and aux data arrived and were
/// checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct RecvComplete {
    /// The request.
    pub request: RequestId,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RecvCompleteWire {
    request: U64,
}

impl FrameBody for RecvComplete {
    const KIND: FrameKind = FrameKind::RecvComplete;
    const MAX_BODY_LEN: u32 = fixed_len::<RecvCompleteWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<RecvCompleteWire>("request")?;
        Ok(RecvComplete {
            request: RequestId(w.request.get()),
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.put(
            RecvCompleteWire {
                request: U64::new(self.request.0),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for RecvComplete {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecvComplete {}", self.request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::roundtrip;

    #[test]
    fn layout_is_the_request_id_little_endian() {
        let done = RecvComplete {
            request: RequestId(0x0102_0304_0506_0708),
        };
        assert_eq!(roundtrip(&done), [8, 7, 6, 5, 4, 3, 2, 1]);
        assert!(done.to_string().starts_with("RecvComplete "));
    }
}
