//! `HelloAccept` (`0x02`, frozen layout, 10 bytes): the handshake succeeded.
//!
//! ```text
//! version u16 | instance u64
//! ```

use core::fmt;

use zerocopy::little_endian::{U16, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::InstanceId;
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError, Malformation};
use crate::wire::header::FrameKind;

/// The handshake succeeded; both sides use `version` from now on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct HelloAccept {
    /// The negotiated version (the highest both speak).
    pub version: u16,
    /// The accepting endpoint's instance.
    pub instance: InstanceId,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloAcceptWire {
    version: U16,
    instance: U64,
}

impl FrameBody for HelloAccept {
    const KIND: FrameKind = FrameKind::HelloAccept;
    const MAX_BODY_LEN: u32 = fixed_len::<HelloAcceptWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<HelloAcceptWire>("version")?;
        if w.version.get() == 0 {
            return Err(r.malformed("version", Malformation::ZeroVersion));
        }
        Ok(HelloAccept {
            version: w.version.get(),
            instance: InstanceId(w.instance.get()),
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        if self.version == 0 {
            return Err(w.invalid("version", Malformation::ZeroVersion));
        }
        w.put(
            HelloAcceptWire {
                version: U16::new(self.version),
                instance: U64::new(self.instance.0),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for HelloAccept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HelloAccept version {} {}", self.version, self.instance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::{emit, parse, roundtrip};

    #[test]
    fn layout_is_version_then_instance() {
        let accept = HelloAccept {
            version: 0x0102,
            instance: InstanceId(0x1122_3344_5566_7788),
        };
        let body = roundtrip(&accept);
        assert_eq!(body.len(), 10);
        assert_eq!(&body[..2], &[0x02, 0x01]);
        assert_eq!(&body[2..], &0x1122_3344_5566_7788u64.to_le_bytes());
    }

    #[test]
    fn version_zero_is_refused_both_ways() {
        let zero = HelloAccept {
            version: 0,
            instance: InstanceId(1),
        };
        assert!(matches!(
            emit(&zero),
            Err(EncodeError::Invalid {
                field: "version",
                reason: Malformation::ZeroVersion,
                ..
            })
        ));
        assert_eq!(
            parse::<HelloAccept>(&[0; 10]),
            Err(DecodeError::Malformed {
                kind: FrameKind::HelloAccept,
                field: "version",
                reason: Malformation::ZeroVersion,
            })
        );
    }
}
