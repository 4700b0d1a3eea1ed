//! The fixed frame header, its view type and the frame kind codes.
//!
//! The header layout, the magic and the kind codes of the handshake frames are frozen: every
//! future protocol version keeps them, so two builds on different versions can always read each
//! other's handshake and refuse with a message instead of hanging.

use core::fmt;

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The four bytes every frame starts with (`"KVPF"`, kvpipe frame).
pub const MAGIC: [u8; 4] = *b"KVPF";

/// Length of the fixed header in bytes.
pub const HEADER_LEN: usize = core::mem::size_of::<FrameHeader>();

/// Largest body any frame may declare, in bytes (16 MiB). Fixed-size frames have a smaller,
/// exact cap (see [`FrameKind::max_body_len`]).
pub const MAX_BODY_LEN: u32 = 1 << 24;

/// Largest body a peer may send before its handshake completed (256 KiB): a [`Hello`] of
/// thousands of pools, or a [`HelloReject`] with the longest message, fits. A peer that has not
/// said who it is cannot make an endpoint decode, or a stream transport buffer, more than this
/// ([`Endpoint::frame_body_limit`](crate::session::Endpoint::frame_body_limit)); a local Hello
/// larger than this is refused by its peers.
///
/// [`Hello`]: super::Hello
/// [`HelloReject`]: super::HelloReject
pub const MAX_HANDSHAKE_BODY_LEN: u32 = 1 << 18;

/// The fixed little-endian header in front of every frame body (12 bytes, no alignment).
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 4 | `magic` = `b"KVPF"` |
/// | 4 | 2 | `version` (u16 LE) |
/// | 6 | 1 | `kind` (frame kind code) |
/// | 7 | 1 | `flags` (reserved, must be 0) |
/// | 8 | 4 | `body_len` (u32 LE, bytes following the header) |
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct FrameHeader {
    /// Always [`MAGIC`].
    pub magic: [u8; 4],
    /// Protocol version the body is encoded in.
    pub version: U16,
    /// The frame kind code ([`FrameKind::code`]).
    pub kind: u8,
    /// Reserved; every version so far requires 0.
    pub flags: u8,
    /// Number of body bytes following the header.
    pub body_len: U32,
}

impl FrameHeader {
    /// A header for `kind` at `version` with a body of `body_len` bytes.
    pub fn new(kind: FrameKind, version: u16, body_len: u32) -> Self {
        FrameHeader {
            magic: MAGIC,
            version: U16::new(version),
            kind: kind.code(),
            flags: 0,
            body_len: U32::new(body_len),
        }
    }

    /// A view of the header at the start of `buf`, unchecked beyond its length; `None` when
    /// `buf` is shorter than [`HEADER_LEN`]. [`Frame::parse`](super::Frame::parse) validates it.
    pub fn view(buf: &[u8]) -> Option<&FrameHeader> {
        FrameHeader::ref_from_prefix(buf).ok().map(|(h, _)| h)
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0; HEADER_LEN];
        out.copy_from_slice(self.as_bytes());
        out
    }

    /// Total frame length this header announces (header plus body).
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len.get() as usize
    }
}

/// What a frame is, as coded in the header's `kind` byte.
///
/// Handshake kinds (`0x01..=0x0f`) are frozen across versions; session kinds (`0x10..`) are
/// parsed only at a version this build speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum FrameKind {
    /// [`Hello`](super::Hello).
    Hello = 0x01,
    /// [`HelloAccept`](super::HelloAccept).
    HelloAccept = 0x02,
    /// [`HelloReject`](super::HelloReject).
    HelloReject = 0x03,
    /// [`RecvRegistration`](super::RecvRegistration).
    RecvRegistration = 0x10,
    /// [`KvResult`](super::KvResult).
    KvResult = 0x11,
    /// [`AuxResult`](super::AuxResult).
    AuxResult = 0x12,
    /// [`Cancel`](super::Cancel).
    Cancel = 0x13,
    /// [`Heartbeat`](super::Heartbeat).
    Heartbeat = 0x14,
    /// [`DataWrite`](super::DataWrite).
    DataWrite = 0x15,
    /// [`RecvComplete`](super::RecvComplete) (since version 2).
    RecvComplete = 0x16,
}

impl FrameKind {
    /// Every kind, in code order.
    pub const ALL: [FrameKind; 10] = [
        FrameKind::Hello,
        FrameKind::HelloAccept,
        FrameKind::HelloReject,
        FrameKind::RecvRegistration,
        FrameKind::KvResult,
        FrameKind::AuxResult,
        FrameKind::Cancel,
        FrameKind::Heartbeat,
        FrameKind::DataWrite,
        FrameKind::RecvComplete,
    ];

    /// The header code.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The kind for a header code, if known.
    pub fn from_code(code: u8) -> Option<FrameKind> {
        FrameKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Whether this is a handshake frame (frozen layout, decodable at every version).
    pub fn is_handshake(self) -> bool {
        matches!(
            self,
            FrameKind::Hello | FrameKind::HelloAccept | FrameKind::HelloReject
        )
    }

    /// The kind's name as used in messages and `docs/PROTOCOL.md`.
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Hello => "Hello",
            FrameKind::HelloAccept => "HelloAccept",
            FrameKind::HelloReject => "HelloReject",
            FrameKind::RecvRegistration => "RecvRegistration",
            FrameKind::KvResult => "KvResult",
            FrameKind::AuxResult => "AuxResult",
            FrameKind::Cancel => "Cancel",
            FrameKind::Heartbeat => "Heartbeat",
            FrameKind::DataWrite => "DataWrite",
            FrameKind::RecvComplete => "RecvComplete",
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
