//! What every frame's body encoding is built from: the [`FrameBody`] contract each frame file
//! implements, the bounds-checked [`BodyReader`] and [`BodyWriter`] it reads and writes
//! through, and the [`wire_codes!`] enum-code table.
//!
//! Fixed body parts are zerocopy little-endian views (`#[repr(C)]` structs of `U16`/`U32`/`U64`
//! and `u8`, field order = wire order), declared next to the frame that owns them. The reader
//! checks every length against the bytes present before it builds anything, so decoding never
//! panics and never allocates more than the body's own size.

use zerocopy::{FromBytes, Immutable, KnownLayout, Unaligned};

use super::error::{DecodeError, EncodeError, Malformation};
use super::header::FrameKind;

/// One frame kind's body: what its file provides to the [`Frame`](super::Frame) dispatch.
///
/// `parse_body` validates everything the representation cannot express (enum codes, booleans,
/// canonical run lists, UTF-8) and `emit_body` applies the same rules, so nothing is emitted
/// that a peer would refuse and `parse_body` then `emit_body` reproduces the input exactly.
pub(super) trait FrameBody: Sized {
    /// The header's kind code for this body.
    const KIND: FrameKind;
    /// The largest body this kind may declare: the exact size of a fixed-size body,
    /// [`MAX_BODY_LEN`](super::MAX_BODY_LEN) or a field-imposed limit for a variable one.
    const MAX_BODY_LEN: u32;

    /// Bytes [`FrameBody::emit_body`] writes (what the header's `body_len` says).
    fn body_len(&self) -> usize;

    /// Reads the body from `r`; the caller rejects bytes left after it.
    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError>;

    /// Writes exactly [`FrameBody::body_len`] bytes to `w`, or refuses a value the wire cannot
    /// carry.
    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError>;
}

/// The size of a fixed body part.
pub(super) const fn fixed_len<T>() -> u32 {
    core::mem::size_of::<T>() as u32
}

/// A field that breaks a rule shared by decoding and encoding, and why.
pub(super) type Invalid = (&'static str, Malformation);

/// Implements `ALL`, `code` and `from_code` for a `#[repr(u8)]` enum carried as one byte.
macro_rules! wire_codes {
    ($ty:ident { $($variant:ident),+ $(,)? }) => {
        impl $ty {
            /// Every value, in code order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The wire code.
            pub fn code(self) -> u8 {
                self as u8
            }

            /// The value for a wire code, if this version defines it.
            pub fn from_code(code: u8) -> Option<$ty> {
                Self::ALL.iter().copied().find(|v| v.code() == code)
            }
        }
    };
}
pub(super) use wire_codes;

/// Reads one body front to back; every error names the frame kind and the field.
pub(super) struct BodyReader<'a> {
    kind: FrameKind,
    rest: &'a [u8],
}

impl<'a> BodyReader<'a> {
    /// A reader over the `body` of a `kind` frame.
    pub(super) fn new(kind: FrameKind, body: &'a [u8]) -> Self {
        BodyReader { kind, rest: body }
    }

    /// Bytes not read yet.
    pub(super) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// A [`DecodeError::Malformed`] for `field`.
    pub(super) fn malformed(&self, field: &'static str, reason: Malformation) -> DecodeError {
        DecodeError::Malformed {
            kind: self.kind,
            field,
            reason,
        }
    }

    /// The fixed part `T` at the read position.
    pub(super) fn fixed<T: FromBytes + KnownLayout + Immutable + Unaligned>(
        &mut self,
        field: &'static str,
    ) -> Result<&'a T, DecodeError> {
        match T::ref_from_prefix(self.rest) {
            Ok((value, rest)) => {
                self.rest = rest;
                Ok(value)
            }
            Err(_) => Err(self.short(field, core::mem::size_of::<T>())),
        }
    }

    /// `count` elements of `T`, checked against the remaining bytes before anything is built.
    pub(super) fn slice<T: FromBytes + KnownLayout + Immutable + Unaligned>(
        &mut self,
        field: &'static str,
        count: usize,
    ) -> Result<&'a [T], DecodeError> {
        match <[T]>::ref_from_prefix_with_elems(self.rest, count) {
            Ok((values, rest)) => {
                self.rest = rest;
                Ok(values)
            }
            Err(_) => Err(self.short(field, count.saturating_mul(core::mem::size_of::<T>()))),
        }
    }

    /// The next `len` bytes.
    pub(super) fn bytes(
        &mut self,
        field: &'static str,
        len: usize,
    ) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < len {
            return Err(self.short(field, len));
        }
        let (bytes, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(bytes)
    }

    /// `field` needs `needed` bytes but fewer are left.
    pub(super) fn short(&self, field: &'static str, needed: usize) -> DecodeError {
        self.malformed(
            field,
            Malformation::Short {
                needed,
                have: self.rest.len(),
            },
        )
    }

    /// A shared validation rule, as a decode error.
    pub(super) fn check(&self, rule: Result<(), Invalid>) -> Result<(), DecodeError> {
        rule.map_err(|(field, reason)| self.malformed(field, reason))
    }

    /// The enum value for a one-byte `code`.
    pub(super) fn code<T>(
        &self,
        field: &'static str,
        code: u8,
        from: impl Fn(u8) -> Option<T>,
    ) -> Result<T, DecodeError> {
        from(code).ok_or_else(|| self.malformed(field, Malformation::UnknownCode { code }))
    }

    /// A boolean byte: 0 or 1, nothing else.
    pub(super) fn bool(&self, field: &'static str, value: u8) -> Result<bool, DecodeError> {
        match value {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed(field, Malformation::NotBool { value })),
        }
    }

    /// Ends the body: no bytes may be left.
    pub(super) fn finish(self) -> Result<(), DecodeError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                kind: self.kind,
                extra: self.rest.len(),
            })
        }
    }
}

/// Writes one frame into the caller's buffer, sized beforehand from [`FrameBody::body_len`].
pub(super) struct BodyWriter<'a> {
    kind: FrameKind,
    out: &'a mut [u8],
    pos: usize,
}

impl<'a> BodyWriter<'a> {
    /// A writer for a `kind` frame at the start of `out`.
    pub(super) fn new(kind: FrameKind, out: &'a mut [u8]) -> Self {
        BodyWriter { kind, out, pos: 0 }
    }

    /// Bytes written so far.
    pub(super) fn position(&self) -> usize {
        self.pos
    }

    /// Appends `bytes`.
    pub(super) fn put(&mut self, bytes: &[u8]) -> Result<(), EncodeError> {
        let end = self.pos + bytes.len();
        let Some(dst) = self.out.get_mut(self.pos..end) else {
            // Unreachable when `body_len` is right; reported rather than panicking.
            return Err(EncodeError::BufferTooSmall {
                needed: end,
                have: self.out.len(),
            });
        };
        dst.copy_from_slice(bytes);
        self.pos = end;
        Ok(())
    }

    /// A shared validation rule, as an encode error.
    pub(super) fn check(&self, rule: Result<(), Invalid>) -> Result<(), EncodeError> {
        rule.map_err(|(field, reason)| self.invalid(field, reason))
    }

    /// An [`EncodeError::Invalid`] for `field`.
    pub(super) fn invalid(&self, field: &'static str, reason: Malformation) -> EncodeError {
        EncodeError::Invalid {
            kind: self.kind,
            field,
            reason,
        }
    }

    /// A collection's length as the count field type `T`, refused when it does not fit.
    pub(super) fn count<T>(&self, field: &'static str, len: usize, max: T) -> Result<T, EncodeError>
    where
        T: TryFrom<usize> + Copy + Into<u64>,
    {
        T::try_from(len).map_err(|_| {
            self.invalid(
                field,
                Malformation::TooLong {
                    len,
                    max: max.into() as usize,
                },
            )
        })
    }
}

/// Body-level helpers for the frame files' unit tests.
#[cfg(test)]
pub(super) mod testing {
    use core::fmt::Debug;

    use super::{BodyReader, BodyWriter, FrameBody};
    use crate::wire::error::{DecodeError, EncodeError};

    /// `value`'s body bytes.
    pub(in crate::wire) fn emit<T: FrameBody>(value: &T) -> Result<Vec<u8>, EncodeError> {
        let mut out = vec![0; value.body_len()];
        let mut w = BodyWriter::new(T::KIND, &mut out);
        value.emit_body(&mut w)?;
        assert_eq!(
            w.position(),
            value.body_len(),
            "body_len disagrees with emit_body"
        );
        Ok(out)
    }

    /// Decodes a whole body of `T`.
    pub(in crate::wire) fn parse<T: FrameBody>(body: &[u8]) -> Result<T, DecodeError> {
        let mut r = BodyReader::new(T::KIND, body);
        let value = T::parse_body(&mut r)?;
        r.finish()?;
        Ok(value)
    }

    /// Emits `value`, checks that parsing gives it back, and returns the body bytes.
    pub(in crate::wire) fn roundtrip<T: FrameBody + PartialEq + Debug>(value: &T) -> Vec<u8> {
        let body = emit(value).expect("a valid value encodes");
        assert!(body.len() <= T::MAX_BODY_LEN as usize, "body over its cap");
        assert_eq!(&parse::<T>(&body).expect("its encoding decodes"), value);
        body
    }
}
