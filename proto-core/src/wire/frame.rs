//! [`Frame`]: any frame, and the one place that dispatches on the kind — the header check
//! against each kind's cap, [`Frame::parse`] and [`Frame::emit`] around the frame files' body
//! encodings, and `Display`.
//!
//! Decoding follows `docs/PROTOCOL.md`'s numbered rules: the header first (magic, version,
//! kind, flags, the body-length cap — decided before any body byte is read), then the body,
//! which must be used up exactly. Encoding checks the same rules before writing, so nothing is
//! emitted that a peer would refuse.

use core::fmt;

use bytes::BytesMut;
use zerocopy::{FromBytes, IntoBytes};

use super::body::{BodyReader, BodyWriter, FrameBody};
use super::error::{DecodeError, EncodeError};
use super::frames::{
    AuxResult, Cancel, DataWrite, Heartbeat, Hello, HelloAccept, HelloReject, KvResult,
    RecvComplete, RecvRegistration,
};
use super::header::{FrameHeader, FrameKind, HEADER_LEN, MAGIC};
use super::version::{VersionRange, PROTOCOL_VERSION};

/// Any frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Frame {
    /// Handshake offer.
    Hello(Hello),
    /// Handshake accepted.
    HelloAccept(HelloAccept),
    /// Handshake refused.
    HelloReject(HelloReject),
    /// Receiver's destination for a request.
    RecvRegistration(RecvRegistration),
    /// Result of a slice.
    KvResult(KvResult),
    /// Inline aux data.
    AuxResult(AuxResult),
    /// Cancel a request.
    Cancel(Cancel),
    /// Liveness.
    Heartbeat(Heartbeat),
    /// Data write header (stream transports).
    DataWrite(DataWrite),
    /// The receiver completed a request.
    RecvComplete(RecvComplete),
}

impl FrameKind {
    /// The largest body this kind may declare: the exact size for fixed-size frames,
    /// [`MAX_BODY_LEN`](super::MAX_BODY_LEN) or the field-imposed limit for variable ones.
    pub fn max_body_len(self) -> u32 {
        match self {
            FrameKind::Hello => Hello::MAX_BODY_LEN,
            FrameKind::HelloAccept => HelloAccept::MAX_BODY_LEN,
            FrameKind::HelloReject => HelloReject::MAX_BODY_LEN,
            FrameKind::RecvRegistration => RecvRegistration::MAX_BODY_LEN,
            FrameKind::KvResult => KvResult::MAX_BODY_LEN,
            FrameKind::AuxResult => AuxResult::MAX_BODY_LEN,
            FrameKind::Cancel => Cancel::MAX_BODY_LEN,
            FrameKind::Heartbeat => Heartbeat::MAX_BODY_LEN,
            FrameKind::DataWrite => DataWrite::MAX_BODY_LEN,
            FrameKind::RecvComplete => RecvComplete::MAX_BODY_LEN,
        }
    }
}

impl FrameHeader {
    /// Validates the header for a connection where `negotiated` is the agreed version (`None`
    /// before the handshake completes): magic, version, kind, flags and the body-length cap.
    ///
    /// Handshake kinds are accepted at every version except 0 (their layout is frozen);
    /// session kinds only at a version this build speaks (and, once negotiated, only at that
    /// one).
    pub fn check(&self, negotiated: Option<u16>) -> Result<FrameKind, DecodeError> {
        if self.magic != MAGIC {
            return Err(DecodeError::BadMagic { found: self.magic });
        }
        let version = self.version.get();
        let unsupported = DecodeError::UnsupportedVersion {
            version,
            supported: VersionRange::SUPPORTED,
        };
        if version == 0 {
            return Err(unsupported);
        }
        let kind = match FrameKind::from_code(self.kind) {
            Some(kind) => kind,
            None if !VersionRange::SUPPORTED.contains(version) => return Err(unsupported),
            None => return Err(DecodeError::UnknownKind { code: self.kind }),
        };
        if !kind.is_handshake() {
            if !VersionRange::SUPPORTED.contains(version) {
                return Err(unsupported);
            }
            if let Some(negotiated) = negotiated {
                if version != negotiated {
                    return Err(DecodeError::VersionNotNegotiated {
                        version,
                        negotiated,
                    });
                }
            }
        }
        if self.flags != 0 {
            return Err(DecodeError::ReservedFlags {
                kind,
                flags: self.flags,
            });
        }
        let len = self.body_len.get();
        let max = kind.max_body_len();
        if len > max {
            return Err(DecodeError::BodyTooLong { kind, len, max });
        }
        Ok(kind)
    }
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => Hello::KIND,
            Frame::HelloAccept(_) => HelloAccept::KIND,
            Frame::HelloReject(_) => HelloReject::KIND,
            Frame::RecvRegistration(_) => RecvRegistration::KIND,
            Frame::KvResult(_) => KvResult::KIND,
            Frame::AuxResult(_) => AuxResult::KIND,
            Frame::Cancel(_) => Cancel::KIND,
            Frame::Heartbeat(_) => Heartbeat::KIND,
            Frame::DataWrite(_) => DataWrite::KIND,
            Frame::RecvComplete(_) => RecvComplete::KIND,
        }
    }

    /// Length of the body in bytes (what the header's `body_len` will say).
    pub fn body_len(&self) -> usize {
        match self {
            Frame::Hello(x) => x.body_len(),
            Frame::HelloAccept(x) => x.body_len(),
            Frame::HelloReject(x) => x.body_len(),
            Frame::RecvRegistration(x) => x.body_len(),
            Frame::KvResult(x) => x.body_len(),
            Frame::AuxResult(x) => x.body_len(),
            Frame::Cancel(x) => x.body_len(),
            Frame::Heartbeat(x) => x.body_len(),
            Frame::DataWrite(x) => x.body_len(),
            Frame::RecvComplete(x) => x.body_len(),
        }
    }

    /// Bytes [`Frame::emit`] writes: header plus body (a [`DataWrite`]'s payload not included).
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }

    /// Decodes one frame from the start of `buf`, returning it and the bytes it took (header
    /// plus body; a [`DataWrite`]'s payload follows and is not counted).
    ///
    /// Session frames are accepted at any version this build speaks; use
    /// [`Frame::parse_negotiated`] once the handshake has fixed the version. On
    /// [`DecodeError::Truncated`] read more and retry; every other error is final.
    pub fn parse(buf: &[u8]) -> Result<(Frame, usize), DecodeError> {
        Frame::parse_checked(buf, None)
    }

    /// Like [`Frame::parse`], but session frames must carry the `negotiated` version.
    pub fn parse_negotiated(buf: &[u8], negotiated: u16) -> Result<(Frame, usize), DecodeError> {
        Frame::parse_checked(buf, Some(negotiated))
    }

    /// The header at the start of `buf` and the frame's version, checked as in
    /// [`Frame::parse`] but without reading the body (for stream readers that need the length
    /// first).
    pub fn peek_header(buf: &[u8]) -> Result<(FrameKind, u16, usize), DecodeError> {
        let header = FrameHeader::view(buf).ok_or(DecodeError::Truncated {
            needed: HEADER_LEN,
            have: buf.len(),
        })?;
        let kind = header.check(None)?;
        Ok((kind, header.version.get(), header.frame_len()))
    }

    fn parse_checked(buf: &[u8], negotiated: Option<u16>) -> Result<(Frame, usize), DecodeError> {
        let Ok((header, rest)) = FrameHeader::ref_from_prefix(buf) else {
            return Err(DecodeError::Truncated {
                needed: HEADER_LEN,
                have: buf.len(),
            });
        };
        let kind = header.check(negotiated)?;
        let body_len = header.body_len.get() as usize;
        let Some(body) = rest.get(..body_len) else {
            return Err(DecodeError::Truncated {
                needed: HEADER_LEN + body_len,
                have: buf.len(),
            });
        };
        let mut r = BodyReader::new(kind, body);
        let frame = match kind {
            FrameKind::Hello => Frame::Hello(Hello::parse_body(&mut r)?),
            FrameKind::HelloAccept => Frame::HelloAccept(HelloAccept::parse_body(&mut r)?),
            FrameKind::HelloReject => Frame::HelloReject(HelloReject::parse_body(&mut r)?),
            FrameKind::RecvRegistration => {
                Frame::RecvRegistration(RecvRegistration::parse_body(&mut r)?)
            }
            FrameKind::KvResult => Frame::KvResult(KvResult::parse_body(&mut r)?),
            FrameKind::AuxResult => Frame::AuxResult(AuxResult::parse_body(&mut r)?),
            FrameKind::Cancel => Frame::Cancel(Cancel::parse_body(&mut r)?),
            FrameKind::Heartbeat => Frame::Heartbeat(Heartbeat::parse_body(&mut r)?),
            FrameKind::DataWrite => Frame::DataWrite(DataWrite::parse_body(&mut r)?),
            FrameKind::RecvComplete => Frame::RecvComplete(RecvComplete::parse_body(&mut r)?),
        };
        r.finish()?;
        Ok((frame, HEADER_LEN + body_len))
    }

    /// Encodes the frame at the start of `out` in this build's newest version
    /// ([`PROTOCOL_VERSION`]) and returns the bytes written. Use it for the handshake; after
    /// it, use [`Frame::emit_versioned`] with the negotiated version.
    pub fn emit(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        self.emit_versioned(PROTOCOL_VERSION, out)
    }

    /// Encodes the frame at the start of `out` with `version` in its header and returns the
    /// bytes written. Session frames need a version this build speaks; handshake frames take
    /// any nonzero version (their layout is frozen). On error the buffer's content is
    /// unspecified.
    pub fn emit_versioned(&self, version: u16, out: &mut [u8]) -> Result<usize, EncodeError> {
        let kind = self.kind();
        let version_ok = if kind.is_handshake() {
            version != 0
        } else {
            VersionRange::SUPPORTED.contains(version)
        };
        if !version_ok {
            return Err(EncodeError::UnsupportedVersion {
                kind,
                version,
                supported: VersionRange::SUPPORTED,
            });
        }
        let body_len = self.body_len();
        let max = kind.max_body_len();
        if body_len > max as usize {
            return Err(EncodeError::BodyTooLong {
                kind,
                len: body_len,
                max,
            });
        }
        let total = HEADER_LEN + body_len;
        let have = out.len();
        let Some(out) = out.get_mut(..total) else {
            return Err(EncodeError::BufferTooSmall {
                needed: total,
                have,
            });
        };
        let mut w = BodyWriter::new(kind, out);
        w.put(FrameHeader::new(kind, version, body_len as u32).as_bytes())?;
        match self {
            Frame::Hello(x) => x.emit_body(&mut w),
            Frame::HelloAccept(x) => x.emit_body(&mut w),
            Frame::HelloReject(x) => x.emit_body(&mut w),
            Frame::RecvRegistration(x) => x.emit_body(&mut w),
            Frame::KvResult(x) => x.emit_body(&mut w),
            Frame::AuxResult(x) => x.emit_body(&mut w),
            Frame::Cancel(x) => x.emit_body(&mut w),
            Frame::Heartbeat(x) => x.emit_body(&mut w),
            Frame::DataWrite(x) => x.emit_body(&mut w),
            Frame::RecvComplete(x) => x.emit_body(&mut w),
        }?;
        debug_assert_eq!(w.position(), total, "body_len disagrees with the encoder");
        Ok(total)
    }

    /// Appends the frame, encoded with `version`, to `out`; returns the bytes appended. On
    /// error `out` is left as it was.
    pub fn encode_to(&self, version: u16, out: &mut BytesMut) -> Result<usize, EncodeError> {
        let start = out.len();
        out.resize(start + self.encoded_len(), 0);
        match self.emit_versioned(version, &mut out[start..]) {
            Ok(n) => Ok(n),
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// The frame encoded in [`PROTOCOL_VERSION`], in a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = vec![0; self.encoded_len()];
        self.emit(&mut out)?;
        Ok(out)
    }

    /// The frame encoded in this build's newest version, as shared bytes (what a peer on this
    /// build's version receives before the handshake, and tests feed to endpoints).
    pub fn to_bytes(&self) -> Result<bytes::Bytes, EncodeError> {
        self.to_vec().map(bytes::Bytes::from)
    }
}

impl fmt::Display for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frame::Hello(x) => x.fmt(f),
            Frame::HelloAccept(x) => x.fmt(f),
            Frame::HelloReject(x) => x.fmt(f),
            Frame::RecvRegistration(x) => x.fmt(f),
            Frame::KvResult(x) => x.fmt(f),
            Frame::AuxResult(x) => x.fmt(f),
            Frame::Cancel(x) => x.fmt(f),
            Frame::Heartbeat(x) => x.fmt(f),
            Frame::DataWrite(x) => x.fmt(f),
            Frame::RecvComplete(x) => x.fmt(f),
        }
    }
}
