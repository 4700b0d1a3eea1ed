//! `HelloReject` (`0x03`, frozen layout, 3 + n bytes): the handshake was refused, with a
//! machine-readable reason and a message naming what differs.
//!
//! ```text
//! reason u8 | message_len u16 = n | n bytes of UTF-8
//! ```

use core::fmt;

use zerocopy::little_endian::U16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::wire::body::{fixed_len, wire_codes, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError, Malformation};
use crate::wire::header::FrameKind;

/// Longest [`HelloReject::message`] in bytes.
pub const MAX_REJECT_MESSAGE: usize = u16::MAX as usize;

/// Why a handshake was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum RejectReason {
    /// No protocol version in common.
    VersionMismatch = 1,
    /// The compatibility hashes differ (model geometry, dtype, tokens per block, layout).
    CompatibilityMismatch = 2,
    /// The pool layouts cannot be paired (group count, layers, heads, …).
    LayoutMismatch = 3,
    /// The parallel topologies cannot be paired.
    TopologyMismatch = 4,
    /// Both endpoints play the same role.
    RoleMismatch = 5,
}

wire_codes!(RejectReason {
    VersionMismatch,
    CompatibilityMismatch,
    LayoutMismatch,
    TopologyMismatch,
    RoleMismatch,
});

/// The handshake was refused; the connection closes after this frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct HelloReject {
    /// Machine-readable reason.
    pub reason: RejectReason,
    /// Human-readable explanation naming what differs (both versions, both values).
    pub message: String,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloRejectWire {
    reason: u8,
    message_len: U16,
}

impl FrameBody for HelloReject {
    const KIND: FrameKind = FrameKind::HelloReject;
    const MAX_BODY_LEN: u32 = fixed_len::<HelloRejectWire>() + u16::MAX as u32;

    fn body_len(&self) -> usize {
        fixed_len::<HelloRejectWire>() as usize + self.message.len()
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<HelloRejectWire>("reason")?;
        let reason = r.code("reason", w.reason, RejectReason::from_code)?;
        let bytes = r.bytes("message", usize::from(w.message_len.get()))?;
        let message = core::str::from_utf8(bytes)
            .map_err(|_| r.malformed("message", Malformation::InvalidUtf8))?;
        Ok(HelloReject {
            reason,
            message: message.to_owned(),
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        let len = w.count("message", self.message.len(), u16::MAX)?;
        w.put(
            HelloRejectWire {
                reason: self.reason.code(),
                message_len: U16::new(len),
            }
            .as_bytes(),
        )?;
        w.put(self.message.as_bytes())
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::VersionMismatch => "version mismatch",
            RejectReason::CompatibilityMismatch => "compatibility mismatch",
            RejectReason::LayoutMismatch => "layout mismatch",
            RejectReason::TopologyMismatch => "topology mismatch",
            RejectReason::RoleMismatch => "role mismatch",
        })
    }
}

impl fmt::Display for HelloReject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HelloReject ({}): {:?}", self.reason, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::{emit, parse, roundtrip};

    fn malformed(field: &'static str, reason: Malformation) -> Result<HelloReject, DecodeError> {
        Err(DecodeError::Malformed {
            kind: FrameKind::HelloReject,
            field,
            reason,
        })
    }

    #[test]
    fn layout_is_reason_length_then_message() {
        let reject = HelloReject {
            reason: RejectReason::RoleMismatch,
            message: "both are senders".into(),
        };
        let body = roundtrip(&reject);
        assert_eq!(&body[..3], &[5, 16, 0]);
        assert_eq!(&body[3..], b"both are senders");
        assert_eq!(
            reject.to_string(),
            "HelloReject (role mismatch): \"both are senders\""
        );
    }

    #[test]
    fn the_longest_message_fits_its_cap_and_a_longer_one_is_refused() {
        let longest = HelloReject {
            reason: RejectReason::VersionMismatch,
            message: "x".repeat(MAX_REJECT_MESSAGE),
        };
        assert_eq!(
            roundtrip(&longest).len(),
            HelloReject::MAX_BODY_LEN as usize
        );
        let longer = HelloReject {
            message: "x".repeat(MAX_REJECT_MESSAGE + 1),
            ..longest
        };
        assert!(matches!(
            emit(&longer),
            Err(EncodeError::Invalid {
                field: "message",
                reason: Malformation::TooLong { .. },
                ..
            })
        ));
    }

    #[test]
    fn bad_reason_short_message_and_invalid_utf8_are_named() {
        let unknown = Malformation::UnknownCode { code: 0 };
        assert_eq!(parse(&[0, 0, 0]), malformed("reason", unknown));
        let short = Malformation::Short { needed: 4, have: 2 };
        assert_eq!(parse(&[1, 4, 0, b'a', b'b']), malformed("message", short));
        assert_eq!(
            parse(&[1, 2, 0, 0xc3, 0x28]),
            malformed("message", Malformation::InvalidUtf8)
        );
    }
}
