//! The versioned wire format: every frame's representation and its encoding.
//!
//! - The validated representations ([`Frame`] and one struct per kind): what the state
//!   machines read and write. Each kind lives in its own file under `frames/` with its body
//!   encoding, its `Display` and its unit tests.
//! - The fixed 12-byte header ([`FrameHeader`], [`HEADER_LEN`], [`MAGIC`], [`FrameKind`]),
//!   read and written through zerocopy.
//! - [`Frame::parse`] / [`Frame::emit`] / [`Frame::encoded_len`]: decoding never panics, never
//!   allocates more than the frame's own size, and rejects every non-canonical encoding, so
//!   `parse` then `emit` reproduces the input byte for byte.
//! - Shared fields: [`VersionRange`], [`TransferStatus`], a `Hello`'s layer-group layouts and
//!   a registration's run-length encoded block runs.
//! - [`handshake`]: version negotiation and the compatibility check.
//! - [`samples`]: one frame of every kind and value (the golden encodings' sources).
//!
//! `docs/PROTOCOL.md` gives every layout byte by byte. The header and the three handshake
//! frames are frozen across versions; changing any golden encoding is a compatibility decision.
//!
//! ```
//! use kvpipe_core::wire::{Frame, Heartbeat};
//!
//! let frame = Frame::Heartbeat(Heartbeat { seq: 7 });
//! let mut buf = [0u8; 64];
//! let n = frame.emit(&mut buf).unwrap();
//! assert_eq!(n, frame.encoded_len());
//! assert_eq!(Frame::parse(&buf[..n]).unwrap(), (frame, n));
//! ```

mod block_runs;
mod body;
mod error;
mod frame;
mod frames;
mod group_layout;
pub mod handshake;
mod header;
pub mod samples;
mod status;
mod version;

pub use error::{DecodeError, EncodeError, Malformation};
pub use frame::Frame;
pub use frames::*;
pub use handshake::{compat_hash, negotiate};
pub use header::{FrameHeader, FrameKind, HEADER_LEN, MAGIC, MAX_BODY_LEN, MAX_HANDSHAKE_BODY_LEN};
pub use status::TransferStatus;
pub use version::{VersionRange, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
