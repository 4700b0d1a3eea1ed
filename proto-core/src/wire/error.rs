//! Decode and encode errors.

use core::fmt;

use super::header::{FrameKind, HEADER_LEN, MAGIC};
use super::version::VersionRange;

/// Why bytes from a peer are not a valid frame. Decoding never panics; every rejection is one
/// of these.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ends before the frame does; read at least `needed` bytes and retry.
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame (or the header, when `needed == HEADER_LEN`) takes.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not [`MAGIC`].
    #[error(
        "bad magic {found:02x?}: expected {:02x?} (\"KVPF\"); not a kvpipe peer?",
        MAGIC
    )]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The frame is encoded in a version this build does not speak.
    #[error(
        "unsupported protocol version {version} in a frame header: this build speaks {supported}"
    )]
    UnsupportedVersion {
        /// The version the frame carries.
        version: u16,
        /// The versions this build speaks.
        supported: VersionRange,
    },
    /// A session frame carries another version than the one negotiated on the connection.
    #[error("frame encoded in protocol version {version}, but the connection negotiated version {negotiated}")]
    VersionNotNegotiated {
        /// The version the frame carries.
        version: u16,
        /// The version negotiated at the handshake.
        negotiated: u16,
    },
    /// The kind code is not one this version defines.
    #[error("unknown frame kind code 0x{code:02x}")]
    UnknownKind {
        /// The code found.
        code: u8,
    },
    /// Reserved header flags are set.
    #[error("reserved flags 0x{flags:02x} set in a {kind} frame header (must be 0)")]
    ReservedFlags {
        /// The frame kind.
        kind: FrameKind,
        /// The flags found.
        flags: u8,
    },
    /// The declared body length exceeds the kind's cap.
    #[error("{kind} body length {len} exceeds its cap of {max} bytes")]
    BodyTooLong {
        /// The frame kind.
        kind: FrameKind,
        /// The declared body length.
        len: u32,
        /// The kind's cap ([`FrameKind::max_body_len`]), or before the handshake
        /// [`MAX_HANDSHAKE_BODY_LEN`](super::MAX_HANDSHAKE_BODY_LEN).
        max: u32,
    },
    /// A body field is invalid.
    #[error("malformed {kind} body: field `{field}` {reason}")]
    Malformed {
        /// The frame kind.
        kind: FrameKind,
        /// The field, as a path (`groups[].runs[].len`).
        field: &'static str,
        /// What is wrong with it.
        reason: Malformation,
    },
    /// The body has bytes left after its last field.
    #[error("{extra} trailing bytes inside a {kind} body")]
    TrailingBytes {
        /// The frame kind.
        kind: FrameKind,
        /// Bytes left over.
        extra: usize,
    },
}

impl DecodeError {
    /// Whether more input may turn this into a success (the only recoverable decode error).
    pub fn is_truncated(&self) -> bool {
        matches!(self, DecodeError::Truncated { .. })
    }

    /// The input needed to make progress when truncated: at least a header, then the whole frame.
    pub fn needed(&self) -> Option<usize> {
        match self {
            DecodeError::Truncated { needed, .. } => Some((*needed).max(HEADER_LEN)),
            _ => None,
        }
    }
}

/// What is wrong with one body field (shared by decode and encode errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformation {
    /// The body ends inside the field.
    Short {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the body.
        have: usize,
    },
    /// An enum code this version does not define.
    UnknownCode {
        /// The code found.
        code: u8,
    },
    /// A boolean byte other than 0 or 1.
    NotBool {
        /// The byte found.
        value: u8,
    },
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// A block-id run of length 0.
    ZeroLengthRun,
    /// A block-id run that continues the previous one (the canonical form merges them).
    UnmergedRun,
    /// A block-id run that runs past block id `u32::MAX`.
    BlockIdOverflow,
    /// Block ordinals that run past `u32::MAX`.
    OrdinalOverflow,
    /// A version range whose `min` exceeds its `max`.
    InvertedRange {
        /// The range's `min`.
        min: u16,
        /// The range's `max`.
        max: u16,
    },
    /// Version 0, which is never valid.
    ZeroVersion,
    /// `Some(0)` for a window (0 encodes full attention; a zero-token window is meaningless).
    ZeroWindow,
    /// A variable-length field longer than its limit.
    TooLong {
        /// The field's length.
        len: usize,
        /// Its limit.
        max: usize,
    },
}

impl fmt::Display for Malformation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Malformation::Short { needed, have } => {
                write!(f, "needs {needed} bytes but the body has {have} left")
            }
            Malformation::UnknownCode { code } => write!(f, "has unknown code {code}"),
            Malformation::NotBool { value } => write!(f, "is {value}, not a boolean 0 or 1"),
            Malformation::InvalidUtf8 => f.write_str("is not valid UTF-8"),
            Malformation::ZeroLengthRun => f.write_str("is a block-id run of length 0"),
            Malformation::UnmergedRun => {
                f.write_str("continues the previous block-id run (runs must be merged)")
            }
            Malformation::BlockIdOverflow => f.write_str("runs past block id 4294967295"),
            Malformation::OrdinalOverflow => f.write_str("runs past block ordinal 4294967295"),
            Malformation::InvertedRange { min, max } => {
                write!(f, "is an inverted range (min {min} > max {max})")
            }
            Malformation::ZeroVersion => f.write_str("is version 0, which is never valid"),
            Malformation::ZeroWindow => {
                f.write_str("is a window of 0 tokens (full attention is encoded as no window)")
            }
            Malformation::TooLong { len, max } => write!(f, "is {len} long, over its limit {max}"),
        }
    }
}

/// Why a frame could not be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The caller's buffer is too small; retry with at least `needed` bytes.
    #[error("output buffer too small: frame needs {needed} bytes, buffer has {have}")]
    BufferTooSmall {
        /// Bytes the frame takes ([`Frame::encoded_len`](super::Frame::encoded_len)).
        needed: usize,
        /// Bytes the buffer has.
        have: usize,
    },
    /// The frame holds a value the wire cannot carry (the peer would reject it).
    #[error("cannot encode {kind}: field `{field}` {reason}")]
    Invalid {
        /// The frame kind.
        kind: FrameKind,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: Malformation,
    },
    /// The body would exceed the kind's cap.
    #[error("{kind} body of {len} bytes exceeds its cap of {max} bytes")]
    BodyTooLong {
        /// The frame kind.
        kind: FrameKind,
        /// The body length.
        len: usize,
        /// The kind's cap.
        max: u32,
    },
    /// A session frame was asked to be encoded in a version this build does not speak.
    #[error(
        "cannot encode a {kind} frame in protocol version {version}: this build speaks {supported}"
    )]
    UnsupportedVersion {
        /// The frame kind.
        kind: FrameKind,
        /// The version asked for.
        version: u16,
        /// The versions this build speaks.
        supported: VersionRange,
    },
}
