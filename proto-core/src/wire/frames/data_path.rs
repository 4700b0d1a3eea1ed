//! The optional data-path section that may end a `Hello` (the sender's **offer**) and a
//! `HelloAccept` (the receiver's **answer**): bytes of the transport's own format that the core
//! carries and never interprets (see `docs/PROTOCOL.md`, "Data-path offers").
//!
//! ```text
//! [ len u32 | len bytes ]      absent when the frame ends before it
//! ```
//!
//! A frame without the section encodes exactly as it did before the section existed.

use bytes::Bytes;
use zerocopy::little_endian::U32;

use crate::wire::body::{BodyReader, BodyWriter};
use crate::wire::error::{DecodeError, EncodeError, Malformation};

/// The most bytes of a data-path offer or answer: a `Hello` that carries one still fits the
/// handshake's body limit ([`MAX_HANDSHAKE_BODY_LEN`](crate::wire::MAX_HANDSHAKE_BODY_LEN))
/// with room for its layer groups.
pub const MAX_DATA_PATH_LEN: usize = 1 << 17;

/// Bytes of the length field.
const LEN_BYTES: usize = 4;

/// Encoded length of the section (0 when absent).
pub(super) fn encoded_len(section: Option<&Bytes>) -> usize {
    section.map_or(0, |b| LEN_BYTES + b.len())
}

/// Reads the section, if the body goes on: its length is checked against
/// [`MAX_DATA_PATH_LEN`] and the bytes present before anything is copied.
pub(super) fn parse(
    r: &mut BodyReader<'_>,
    field: &'static str,
) -> Result<Option<Bytes>, DecodeError> {
    if r.remaining() == 0 {
        return Ok(None);
    }
    let len = r.fixed::<U32>(field)?.get() as usize;
    if len > MAX_DATA_PATH_LEN {
        return Err(r.malformed(
            field,
            Malformation::TooLong {
                len,
                max: MAX_DATA_PATH_LEN,
            },
        ));
    }
    Ok(Some(Bytes::copy_from_slice(r.bytes(field, len)?)))
}

/// Writes the section, if present; one longer than [`MAX_DATA_PATH_LEN`] is refused.
pub(super) fn emit(
    section: Option<&Bytes>,
    w: &mut BodyWriter<'_>,
    field: &'static str,
) -> Result<(), EncodeError> {
    let Some(bytes) = section else {
        return Ok(());
    };
    check(section).map_err(|reason| w.invalid(field, reason))?;
    w.put(&(bytes.len() as u32).to_le_bytes())?;
    w.put(bytes)
}

/// The section's length rule.
fn check(section: Option<&Bytes>) -> Result<(), Malformation> {
    match section {
        Some(b) if b.len() > MAX_DATA_PATH_LEN => Err(Malformation::TooLong {
            len: b.len(),
            max: MAX_DATA_PATH_LEN,
        }),
        _ => Ok(()),
    }
}

/// An arbitrary optional section (fuzzing), within the cap most of the time.
#[cfg(feature = "arbitrary")]
pub(super) fn arbitrary(u: &mut arbitrary::Unstructured<'_>) -> arbitrary::Result<Option<Bytes>> {
    let section: Option<Vec<u8>> = arbitrary::Arbitrary::arbitrary(u)?;
    Ok(section.map(Bytes::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::header::FrameKind;

    fn parse_all(body: &[u8]) -> Result<Option<Bytes>, DecodeError> {
        let mut r = BodyReader::new(FrameKind::Hello, body);
        let section = parse(&mut r, "data_path_offer")?;
        r.finish()?;
        Ok(section)
    }

    #[test]
    fn absent_empty_and_present_sections_decode() {
        assert_eq!(parse_all(&[]), Ok(None));
        assert_eq!(parse_all(&[0, 0, 0, 0]), Ok(Some(Bytes::new())));
        assert_eq!(
            parse_all(&[2, 0, 0, 0, b'o', b'k']),
            Ok(Some(Bytes::from_static(b"ok")))
        );
    }

    #[test]
    fn lengths_are_never_trusted() {
        let malformed = |reason| {
            Err(DecodeError::Malformed {
                kind: FrameKind::Hello,
                field: "data_path_offer",
                reason,
            })
        };
        // Part of a length.
        assert_eq!(
            parse_all(&[1, 0]),
            malformed(Malformation::Short { needed: 4, have: 2 })
        );
        // More than the bytes present.
        assert_eq!(
            parse_all(&[9, 0, 0, 0, 1]),
            malformed(Malformation::Short { needed: 9, have: 1 })
        );
        // Past the cap, refused before the bytes are looked at.
        let over = (MAX_DATA_PATH_LEN as u32 + 1).to_le_bytes();
        assert_eq!(
            parse_all(&over),
            malformed(Malformation::TooLong {
                len: MAX_DATA_PATH_LEN + 1,
                max: MAX_DATA_PATH_LEN
            })
        );
        assert!(parse_all(&u32::MAX.to_le_bytes()).is_err());
        assert!(check(Some(&Bytes::from(vec![0; MAX_DATA_PATH_LEN]))).is_ok());
        assert!(check(Some(&Bytes::from(vec![0; MAX_DATA_PATH_LEN + 1]))).is_err());
    }
}
