//! `Cancel` (`0x13`, 9 bytes): cancels a request on the other side.
//!
//! ```text
//! request u64 | reason u8
//! ```

use core::fmt;

use zerocopy::little_endian::U64;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::RequestId;
use crate::wire::body::{fixed_len, wire_codes, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::FrameKind;

/// Why a request was cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum CancelReason {
    /// The engine cancelled the request (client gone, preempted, …).
    Engine = 1,
    /// A deadline passed on the cancelling side.
    Timeout = 2,
    /// The cancelling side failed the request (write failure, protocol error, …).
    Failure = 3,
    /// The cancelling endpoint is shutting down.
    Shutdown = 4,
}

wire_codes!(CancelReason {
    Engine,
    Timeout,
    Failure,
    Shutdown
});

/// Cancels a request on the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Cancel {
    /// The request.
    pub request: RequestId,
    /// Why.
    pub reason: CancelReason,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct CancelWire {
    request: U64,
    reason: u8,
}

impl FrameBody for Cancel {
    const KIND: FrameKind = FrameKind::Cancel;
    const MAX_BODY_LEN: u32 = fixed_len::<CancelWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<CancelWire>("request")?;
        Ok(Cancel {
            request: RequestId(w.request.get()),
            reason: r.code("reason", w.reason, CancelReason::from_code)?,
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.put(
            CancelWire {
                request: U64::new(self.request.0),
                reason: self.reason.code(),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for CancelReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CancelReason::Engine => "engine",
            CancelReason::Timeout => "timeout",
            CancelReason::Failure => "failure",
            CancelReason::Shutdown => "shutdown",
        })
    }
}

impl fmt::Display for Cancel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cancel {} ({})", self.request, self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::{parse, roundtrip};
    use crate::wire::error::Malformation;

    #[test]
    fn layout_is_request_then_reason() {
        for (i, &reason) in CancelReason::ALL.iter().enumerate() {
            let cancel = Cancel {
                request: RequestId(0x0102),
                reason,
            };
            let body = roundtrip(&cancel);
            assert_eq!(body, [2, 1, 0, 0, 0, 0, 0, 0, i as u8 + 1]);
        }
    }

    #[test]
    fn reason_zero_and_short_bodies_are_refused() {
        assert_eq!(
            parse::<Cancel>(&[0; 9]),
            Err(DecodeError::Malformed {
                kind: FrameKind::Cancel,
                field: "reason",
                reason: Malformation::UnknownCode { code: 0 },
            })
        );
        assert_eq!(
            parse::<Cancel>(&[0; 8]),
            Err(DecodeError::Malformed {
                kind: FrameKind::Cancel,
                field: "request",
                reason: Malformation::Short { needed: 9, have: 8 },
            })
        );
    }
}
