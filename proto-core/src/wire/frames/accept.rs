//! `HelloAccept` (`0x02`, frozen layout, 10 bytes, then the data-path answer when there is
//! one): the handshake succeeded.
//!
//! ```text
//! version u16 | instance u64
//! [ | answer_len u32 | answer_len bytes ]   the data-path answer, only when there is one
//! ```
//!
//! A `HelloAccept` without an answer ([`HelloAccept::data_path_answer`], `data_path.rs`) encodes
//! exactly as before the answer existed.

use core::fmt;

use bytes::Bytes;
use zerocopy::little_endian::{U16, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::data_path::{self, MAX_DATA_PATH_LEN};
use crate::ids::InstanceId;
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError, Malformation};
use crate::wire::header::FrameKind;

/// The handshake succeeded; both sides use `version` from now on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct HelloAccept {
    /// The negotiated version (the highest both speak).
    pub version: u16,
    /// The accepting endpoint's instance.
    pub instance: InstanceId,
    /// The accepting endpoint's transport's answer to the data-path offer of the peer's
    /// [`Hello`](super::Hello) (opaque to the core, at most [`MAX_DATA_PATH_LEN`] bytes);
    /// `None` when that Hello offered nothing.
    #[cfg_attr(feature = "arbitrary", arbitrary(with = data_path::arbitrary))]
    pub data_path_answer: Option<Bytes>,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloAcceptWire {
    version: U16,
    instance: U64,
}

impl FrameBody for HelloAccept {
    const KIND: FrameKind = FrameKind::HelloAccept;
    const MAX_BODY_LEN: u32 = fixed_len::<HelloAcceptWire>() + 4 + MAX_DATA_PATH_LEN as u32;

    fn body_len(&self) -> usize {
        fixed_len::<HelloAcceptWire>() as usize
            + data_path::encoded_len(self.data_path_answer.as_ref())
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<HelloAcceptWire>("version")?;
        if w.version.get() == 0 {
            return Err(r.malformed("version", Malformation::ZeroVersion));
        }
        Ok(HelloAccept {
            version: w.version.get(),
            instance: InstanceId(w.instance.get()),
            data_path_answer: data_path::parse(r, "data_path_answer")?,
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
        )?;
        data_path::emit(self.data_path_answer.as_ref(), w, "data_path_answer")
    }
}

impl fmt::Display for HelloAccept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HelloAccept version {} {}", self.version, self.instance)?;
        match &self.data_path_answer {
            Some(answer) => write!(f, " data-path answer {} bytes", answer.len()),
            None => Ok(()),
        }
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
            data_path_answer: None,
        };
        let body = roundtrip(&accept);
        assert_eq!(body.len(), 10);
        assert_eq!(&body[..2], &[0x02, 0x01]);
        assert_eq!(&body[2..], &0x1122_3344_5566_7788u64.to_le_bytes());
        // An answer follows the instance; the first 10 bytes are unchanged.
        let answering = HelloAccept {
            data_path_answer: Some(Bytes::from_static(b"yes")),
            ..accept.clone()
        };
        let with = roundtrip(&answering);
        assert_eq!(&with[..10], &body[..]);
        assert_eq!(&with[10..], b"\x03\0\0\0yes");
        assert!(answering.to_string().ends_with(" data-path answer 3 bytes"));
        // The longest answer fits the kind's cap.
        let longest = HelloAccept {
            data_path_answer: Some(Bytes::from(vec![7; MAX_DATA_PATH_LEN])),
            ..accept
        };
        assert_eq!(
            roundtrip(&longest).len(),
            HelloAccept::MAX_BODY_LEN as usize
        );
    }

    #[test]
    fn version_zero_is_refused_both_ways() {
        let zero = HelloAccept {
            version: 0,
            instance: InstanceId(1),
            data_path_answer: None,
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
