//! Encoding and decoding of frame bodies: `Frame::parse`, `Frame::emit` and the fixed body
//! parts, each read and written through a zerocopy little-endian view.
//!
//! Decoding validates everything a representation cannot express (enum codes, booleans,
//! canonical run lists, UTF-8) and rejects every non-canonical encoding, so a successful
//! `parse` followed by `emit` at the same version reproduces the input byte for byte. Encoding
//! applies the same rules, so nothing is ever emitted that a peer would refuse.

use bytes::BytesMut;
use smallvec::SmallVec;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::error::{DecodeError, EncodeError, Malformation};
use super::frame::*;
use super::header::{FrameHeader, FrameKind, HEADER_LEN, MAGIC, MAX_BODY_LEN};
use crate::blocks::{AnchoredRun, IdRun};
use crate::ids::{
    BlockId, GrantId, InstanceId, ReceiverSliceId, RegionId, RequestId, SenderSliceId,
};
use crate::layout::{BlockLayout, LayerGroupLayout, PoolLayout};

// ---------------------------------------------------------------------------------------------
// Fixed body parts. Field order is the wire order; every field is little-endian and unaligned.

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloWire {
    version_min: U16,
    version_max: U16,
    capabilities: U64,
    compat_hash: U64,
    instance: U64,
    tp_size: U16,
    tp_rank: U16,
    pp_size: U16,
    pp_rank: U16,
    layer_begin: U16,
    layer_end: U16,
    group_count: U16,
    role: u8,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct GroupWire {
    layers: U16,
    kv_heads: U16,
    head_dim: U16,
    kv_factor: u8,
    elem_bytes: u8,
    tokens_per_block: U32,
    window: U32,
    block_layout: u8,
    pool_count: U16,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct PoolWire {
    region: U32,
    layer_begin: U16,
    layers: U16,
    slot_bytes: U64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloAcceptWire {
    version: U16,
    instance: U64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HelloRejectWire {
    reason: u8,
    message_len: U16,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RegistrationWire {
    request: U64,
    grant: U64,
    slice: U32,
    prompt_len: U32,
    aux_capacity: U32,
    group_count: U16,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct AnchoredRunWire {
    first_ordinal: U32,
    run_count: U32,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct IdRunWire {
    first: U32,
    len: U32,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct KvResultWire {
    request: U64,
    sender_slice: U32,
    receiver_slice: U32,
    bytes_written: U64,
    is_last: u8,
    status: u8,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct AuxResultWire {
    request: U64,
    prompt_tokens: U32,
    cached_tokens: U32,
    first_count: U32,
    draft_count: U32,
    status: u8,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct CancelWire {
    request: U64,
    reason: u8,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HeartbeatWire {
    seq: U64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct DataWriteWire {
    request: U64,
    grant: U64,
    offset: U64,
    len: U64,
    region: U32,
}

/// Sizes of the fixed body parts (documented in `docs/PROTOCOL.md`).
pub(crate) mod fixed_len {
    use core::mem::size_of;

    const fn len<T>() -> u32 {
        size_of::<T>() as u32
    }

    pub(crate) const HELLO: u32 = len::<super::HelloWire>();
    pub(crate) const GROUP: u32 = len::<super::GroupWire>();
    pub(crate) const POOL: u32 = len::<super::PoolWire>();
    pub(crate) const HELLO_ACCEPT: u32 = len::<super::HelloAcceptWire>();
    pub(crate) const HELLO_REJECT: u32 = len::<super::HelloRejectWire>();
    pub(crate) const REGISTRATION: u32 = len::<super::RegistrationWire>();
    pub(crate) const ANCHORED_RUN: u32 = len::<super::AnchoredRunWire>();
    pub(crate) const ID_RUN: u32 = len::<super::IdRunWire>();
    pub(crate) const KV_RESULT: u32 = len::<super::KvResultWire>();
    pub(crate) const AUX_RESULT: u32 = len::<super::AuxResultWire>();
    pub(crate) const CANCEL: u32 = len::<super::CancelWire>();
    pub(crate) const HEARTBEAT: u32 = len::<super::HeartbeatWire>();
    pub(crate) const DATA_WRITE: u32 = len::<super::DataWriteWire>();
}

impl FrameKind {
    /// The largest body this kind may declare: the exact size for fixed-size frames,
    /// [`MAX_BODY_LEN`] or the field-imposed limit for variable ones.
    pub fn max_body_len(self) -> u32 {
        match self {
            FrameKind::Hello | FrameKind::RecvRegistration | FrameKind::AuxResult => MAX_BODY_LEN,
            FrameKind::HelloReject => fixed_len::HELLO_REJECT + u32::from(u16::MAX),
            FrameKind::HelloAccept => fixed_len::HELLO_ACCEPT,
            FrameKind::KvResult => fixed_len::KV_RESULT,
            FrameKind::Cancel => fixed_len::CANCEL,
            FrameKind::Heartbeat => fixed_len::HEARTBEAT,
            FrameKind::DataWrite => fixed_len::DATA_WRITE,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Enum codes.

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

wire_codes!(Role { Sender, Receiver });
wire_codes!(RejectReason {
    VersionMismatch,
    CompatibilityMismatch,
    LayoutMismatch,
    TopologyMismatch,
    RoleMismatch,
});
wire_codes!(TransferStatus {
    Success,
    WriteFailed,
    InDoubt,
    Cancelled,
    TimedOut,
    GrantViolation,
    PeerLost,
    ProtocolError,
    EngineError,
});
wire_codes!(CancelReason {
    Engine,
    Timeout,
    Failure,
    Shutdown
});

fn block_layout_from_code(code: u8) -> Option<BlockLayout> {
    [BlockLayout::LayerKvHeadTokenDim]
        .into_iter()
        .find(|l| *l as u8 == code)
}

impl VersionRange {
    /// The versions this build speaks.
    pub const SUPPORTED: VersionRange = VersionRange {
        min: MIN_PROTOCOL_VERSION,
        max: PROTOCOL_VERSION,
    };

    /// Whether `version` is in the range.
    pub fn contains(self, version: u16) -> bool {
        self.min <= version && version <= self.max
    }
}

/// Encoded length of a [`DataWrite`] frame, header and body (the payload follows it).
pub const DATA_WRITE_FRAME_LEN: usize = HEADER_LEN + fixed_len::DATA_WRITE as usize;

/// Longest [`HelloReject::message`] in bytes.
pub const MAX_REJECT_MESSAGE: usize = u16::MAX as usize;

// ---------------------------------------------------------------------------------------------
// Validation rules shared by decode and encode.

type Invalid = (&'static str, Malformation);

fn check_version_range(r: VersionRange) -> Result<(), Invalid> {
    if r.min == 0 {
        return Err(("versions.min", Malformation::ZeroVersion));
    }
    if r.min > r.max {
        return Err((
            "versions",
            Malformation::InvertedRange {
                min: r.min,
                max: r.max,
            },
        ));
    }
    Ok(())
}

/// The canonical form of an anchored run: every id run is non-empty, stays inside the block-id
/// space, does not continue its predecessor (those are merged), and the ordinals stay in `u32`.
fn check_anchored_run(run: &AnchoredRun) -> Result<(), Invalid> {
    const FIELD: &str = "groups[].runs[]";
    let mut end_ordinal = u64::from(run.first_ordinal);
    let mut prev: Option<IdRun> = None;
    for r in &run.runs {
        if r.len == 0 {
            return Err((FIELD, Malformation::ZeroLengthRun));
        }
        let end_id = u64::from(r.first.0) + u64::from(r.len);
        if end_id > 1 << 32 {
            return Err((FIELD, Malformation::BlockIdOverflow));
        }
        if let Some(p) = prev {
            if p.len < u32::MAX && u64::from(p.first.0) + u64::from(p.len) == u64::from(r.first.0) {
                return Err((FIELD, Malformation::UnmergedRun));
            }
        }
        end_ordinal += u64::from(r.len);
        if end_ordinal > 1 << 32 {
            return Err((FIELD, Malformation::OrdinalOverflow));
        }
        prev = Some(*r);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Decoding.

struct BodyReader<'a> {
    kind: FrameKind,
    rest: &'a [u8],
}

impl<'a> BodyReader<'a> {
    fn malformed(&self, field: &'static str, reason: Malformation) -> DecodeError {
        DecodeError::Malformed {
            kind: self.kind,
            field,
            reason,
        }
    }

    fn fixed<T: FromBytes + KnownLayout + Immutable + Unaligned>(
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
    fn slice<T: FromBytes + KnownLayout + Immutable + Unaligned>(
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

    fn bytes(&mut self, field: &'static str, len: usize) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < len {
            return Err(self.short(field, len));
        }
        let (bytes, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(bytes)
    }

    fn short(&self, field: &'static str, needed: usize) -> DecodeError {
        self.malformed(
            field,
            Malformation::Short {
                needed,
                have: self.rest.len(),
            },
        )
    }

    fn check(&self, rule: Result<(), Invalid>) -> Result<(), DecodeError> {
        rule.map_err(|(field, reason)| self.malformed(field, reason))
    }

    fn code<T>(
        &self,
        field: &'static str,
        code: u8,
        from: impl Fn(u8) -> Option<T>,
    ) -> Result<T, DecodeError> {
        from(code).ok_or_else(|| self.malformed(field, Malformation::UnknownCode { code }))
    }

    fn bool(&self, field: &'static str, value: u8) -> Result<bool, DecodeError> {
        match value {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed(field, Malformation::NotBool { value })),
        }
    }

    fn finish(self) -> Result<(), DecodeError> {
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
    /// Decodes one frame from the start of `buf`, returning it and the bytes it took (header
    /// plus body; a [`DataWrite`]'s payload follows and is not counted).
    ///
    /// Session frames are accepted at any version this build speaks; use
    /// [`Frame::parse_negotiated`] once the handshake has fixed the version. On
    /// [`DecodeError::Truncated`] read more and retry; every other error is final.
    pub fn parse(buf: &[u8]) -> Result<(Frame, usize), DecodeError> {
        parse_frame(buf, None)
    }

    /// Like [`Frame::parse`], but session frames must carry the `negotiated` version.
    pub fn parse_negotiated(buf: &[u8], negotiated: u16) -> Result<(Frame, usize), DecodeError> {
        parse_frame(buf, Some(negotiated))
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
}

fn parse_frame(buf: &[u8], negotiated: Option<u16>) -> Result<(Frame, usize), DecodeError> {
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
    let mut r = BodyReader { kind, rest: body };
    let frame = match kind {
        FrameKind::Hello => Frame::Hello(decode_hello(&mut r)?),
        FrameKind::HelloAccept => {
            let w = r.fixed::<HelloAcceptWire>("version")?;
            if w.version.get() == 0 {
                return Err(r.malformed("version", Malformation::ZeroVersion));
            }
            Frame::HelloAccept(HelloAccept {
                version: w.version.get(),
                instance: InstanceId(w.instance.get()),
            })
        }
        FrameKind::HelloReject => {
            let w = r.fixed::<HelloRejectWire>("reason")?;
            let reason = r.code("reason", w.reason, RejectReason::from_code)?;
            let bytes = r.bytes("message", usize::from(w.message_len.get()))?;
            let message = core::str::from_utf8(bytes)
                .map_err(|_| r.malformed("message", Malformation::InvalidUtf8))?;
            Frame::HelloReject(HelloReject {
                reason,
                message: message.to_owned(),
            })
        }
        FrameKind::RecvRegistration => Frame::RecvRegistration(decode_registration(&mut r)?),
        FrameKind::KvResult => {
            let w = r.fixed::<KvResultWire>("request")?;
            Frame::KvResult(KvResult {
                request: RequestId(w.request.get()),
                sender_slice: SenderSliceId(w.sender_slice.get()),
                receiver_slice: ReceiverSliceId(w.receiver_slice.get()),
                is_last: r.bool("is_last", w.is_last)?,
                status: r.code("status", w.status, TransferStatus::from_code)?,
                bytes_written: w.bytes_written.get(),
            })
        }
        FrameKind::AuxResult => {
            let w = r.fixed::<AuxResultWire>("request")?;
            let status = r.code("status", w.status, TransferStatus::from_code)?;
            let first = r.slice::<U32>("first_tokens", w.first_count.get() as usize)?;
            let draft = r.slice::<U32>("draft_tokens", w.draft_count.get() as usize)?;
            Frame::AuxResult(AuxResult {
                request: RequestId(w.request.get()),
                status,
                data: AuxData {
                    prompt_tokens: w.prompt_tokens.get(),
                    cached_tokens: w.cached_tokens.get(),
                    first_tokens: first.iter().map(|t| t.get()).collect(),
                    draft_tokens: draft.iter().map(|t| t.get()).collect(),
                },
            })
        }
        FrameKind::Cancel => {
            let w = r.fixed::<CancelWire>("request")?;
            Frame::Cancel(Cancel {
                request: RequestId(w.request.get()),
                reason: r.code("reason", w.reason, CancelReason::from_code)?,
            })
        }
        FrameKind::Heartbeat => {
            let w = r.fixed::<HeartbeatWire>("seq")?;
            Frame::Heartbeat(Heartbeat { seq: w.seq.get() })
        }
        FrameKind::DataWrite => {
            let w = r.fixed::<DataWriteWire>("request")?;
            Frame::DataWrite(DataWrite {
                request: RequestId(w.request.get()),
                grant: GrantId(w.grant.get()),
                region: RegionId(w.region.get()),
                offset: w.offset.get(),
                len: w.len.get(),
            })
        }
    };
    r.finish()?;
    Ok((frame, HEADER_LEN + body_len))
}

fn decode_hello(r: &mut BodyReader<'_>) -> Result<Hello, DecodeError> {
    let w = r.fixed::<HelloWire>("versions")?;
    let versions = VersionRange {
        min: w.version_min.get(),
        max: w.version_max.get(),
    };
    r.check(check_version_range(versions))?;
    let role = r.code("role", w.role, Role::from_code)?;
    let group_count = usize::from(w.group_count.get());
    // Every group takes at least its fixed part: bound the allocation by the bytes present.
    if group_count > r.rest.len() / fixed_len::GROUP as usize {
        return Err(r.short("groups", group_count * fixed_len::GROUP as usize));
    }
    let mut groups = Vec::with_capacity(group_count);
    for _ in 0..group_count {
        let g = r.fixed::<GroupWire>("groups[]")?;
        let block_layout = r.code(
            "groups[].block_layout",
            g.block_layout,
            block_layout_from_code,
        )?;
        let pools = r.slice::<PoolWire>("groups[].pools", usize::from(g.pool_count.get()))?;
        groups.push(LayerGroupLayout {
            layers: g.layers.get(),
            kv_factor: g.kv_factor,
            kv_heads: g.kv_heads.get(),
            head_dim: g.head_dim.get(),
            elem_bytes: g.elem_bytes,
            tokens_per_block: g.tokens_per_block.get(),
            window: match g.window.get() {
                0 => None,
                w => Some(w),
            },
            block_layout,
            pools: pools
                .iter()
                .map(|p| PoolLayout {
                    region: RegionId(p.region.get()),
                    layer_begin: p.layer_begin.get(),
                    layers: p.layers.get(),
                    slot_bytes: p.slot_bytes.get(),
                })
                .collect(),
        });
    }
    Ok(Hello {
        versions,
        capabilities: Capabilities(w.capabilities.get()),
        compat_hash: w.compat_hash.get(),
        instance: InstanceId(w.instance.get()),
        role,
        topology: Topology {
            tp_size: w.tp_size.get(),
            tp_rank: w.tp_rank.get(),
            pp_size: w.pp_size.get(),
            pp_rank: w.pp_rank.get(),
            layer_begin: w.layer_begin.get(),
            layer_end: w.layer_end.get(),
        },
        groups,
    })
}

fn decode_registration(r: &mut BodyReader<'_>) -> Result<RecvRegistration, DecodeError> {
    let w = r.fixed::<RegistrationWire>("request")?;
    let group_count = usize::from(w.group_count.get());
    if group_count > r.rest.len() / fixed_len::ANCHORED_RUN as usize {
        return Err(r.short("groups", group_count * fixed_len::ANCHORED_RUN as usize));
    }
    let mut groups = Vec::with_capacity(group_count);
    for _ in 0..group_count {
        let a = r.fixed::<AnchoredRunWire>("groups[]")?;
        let runs = r.slice::<IdRunWire>("groups[].runs", a.run_count.get() as usize)?;
        let run = AnchoredRun {
            first_ordinal: a.first_ordinal.get(),
            runs: runs
                .iter()
                .map(|x| IdRun {
                    first: BlockId(x.first.get()),
                    len: x.len.get(),
                })
                .collect::<SmallVec<_>>(),
        };
        r.check(check_anchored_run(&run))?;
        groups.push(run);
    }
    Ok(RecvRegistration {
        request: RequestId(w.request.get()),
        slice: ReceiverSliceId(w.slice.get()),
        prompt_len: w.prompt_len.get(),
        grant: GrantId(w.grant.get()),
        aux_capacity: w.aux_capacity.get(),
        groups,
    })
}

// ---------------------------------------------------------------------------------------------
// Encoding.

struct BodyWriter<'a> {
    kind: FrameKind,
    out: &'a mut [u8],
    pos: usize,
}

impl BodyWriter<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), EncodeError> {
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

    fn check(&self, rule: Result<(), Invalid>) -> Result<(), EncodeError> {
        rule.map_err(|(field, reason)| self.invalid(field, reason))
    }

    fn invalid(&self, field: &'static str, reason: Malformation) -> EncodeError {
        EncodeError::Invalid {
            kind: self.kind,
            field,
            reason,
        }
    }

    fn count<T>(&self, field: &'static str, len: usize, max: T) -> Result<T, EncodeError>
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

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::HelloAccept(_) => FrameKind::HelloAccept,
            Frame::HelloReject(_) => FrameKind::HelloReject,
            Frame::RecvRegistration(_) => FrameKind::RecvRegistration,
            Frame::KvResult(_) => FrameKind::KvResult,
            Frame::AuxResult(_) => FrameKind::AuxResult,
            Frame::Cancel(_) => FrameKind::Cancel,
            Frame::Heartbeat(_) => FrameKind::Heartbeat,
            Frame::DataWrite(_) => FrameKind::DataWrite,
        }
    }

    /// Length of the body in bytes (what the header's `body_len` will say).
    pub fn body_len(&self) -> usize {
        let n = |x: u32| x as usize;
        match self {
            Frame::Hello(h) => {
                n(fixed_len::HELLO)
                    + h.groups
                        .iter()
                        .map(|g| n(fixed_len::GROUP) + g.pools.len() * n(fixed_len::POOL))
                        .sum::<usize>()
            }
            Frame::HelloAccept(_) => n(fixed_len::HELLO_ACCEPT),
            Frame::HelloReject(r) => n(fixed_len::HELLO_REJECT) + r.message.len(),
            Frame::RecvRegistration(r) => {
                n(fixed_len::REGISTRATION)
                    + r.groups
                        .iter()
                        .map(|g| n(fixed_len::ANCHORED_RUN) + g.runs.len() * n(fixed_len::ID_RUN))
                        .sum::<usize>()
            }
            Frame::KvResult(_) => n(fixed_len::KV_RESULT),
            Frame::AuxResult(a) => {
                n(fixed_len::AUX_RESULT)
                    + 4 * (a.data.first_tokens.len() + a.data.draft_tokens.len())
            }
            Frame::Cancel(_) => n(fixed_len::CANCEL),
            Frame::Heartbeat(_) => n(fixed_len::HEARTBEAT),
            Frame::DataWrite(_) => n(fixed_len::DATA_WRITE),
        }
    }

    /// Bytes [`Frame::emit`] writes: header plus body (a [`DataWrite`]'s payload not included).
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len()
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
        let mut w = BodyWriter { kind, out, pos: 0 };
        w.put(FrameHeader::new(kind, version, body_len as u32).as_bytes())?;
        self.emit_body(&mut w)?;
        debug_assert_eq!(w.pos, total, "body_len disagrees with the encoder");
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

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        match self {
            Frame::Hello(h) => {
                w.check(check_version_range(h.versions))?;
                let group_count = w.count("groups", h.groups.len(), u16::MAX)?;
                w.put(
                    HelloWire {
                        version_min: U16::new(h.versions.min),
                        version_max: U16::new(h.versions.max),
                        capabilities: U64::new(h.capabilities.0),
                        compat_hash: U64::new(h.compat_hash),
                        instance: U64::new(h.instance.0),
                        tp_size: U16::new(h.topology.tp_size),
                        tp_rank: U16::new(h.topology.tp_rank),
                        pp_size: U16::new(h.topology.pp_size),
                        pp_rank: U16::new(h.topology.pp_rank),
                        layer_begin: U16::new(h.topology.layer_begin),
                        layer_end: U16::new(h.topology.layer_end),
                        group_count: U16::new(group_count),
                        role: h.role.code(),
                    }
                    .as_bytes(),
                )?;
                for g in &h.groups {
                    let window = match g.window {
                        None => 0,
                        Some(0) => {
                            return Err(w.invalid("groups[].window", Malformation::ZeroWindow))
                        }
                        Some(x) => x,
                    };
                    let pool_count = w.count("groups[].pools", g.pools.len(), u16::MAX)?;
                    w.put(
                        GroupWire {
                            layers: U16::new(g.layers),
                            kv_heads: U16::new(g.kv_heads),
                            head_dim: U16::new(g.head_dim),
                            kv_factor: g.kv_factor,
                            elem_bytes: g.elem_bytes,
                            tokens_per_block: U32::new(g.tokens_per_block),
                            window: U32::new(window),
                            block_layout: g.block_layout as u8,
                            pool_count: U16::new(pool_count),
                        }
                        .as_bytes(),
                    )?;
                    for p in &g.pools {
                        w.put(
                            PoolWire {
                                region: U32::new(p.region.0),
                                layer_begin: U16::new(p.layer_begin),
                                layers: U16::new(p.layers),
                                slot_bytes: U64::new(p.slot_bytes),
                            }
                            .as_bytes(),
                        )?;
                    }
                }
            }
            Frame::HelloAccept(a) => {
                if a.version == 0 {
                    return Err(w.invalid("version", Malformation::ZeroVersion));
                }
                w.put(
                    HelloAcceptWire {
                        version: U16::new(a.version),
                        instance: U64::new(a.instance.0),
                    }
                    .as_bytes(),
                )?;
            }
            Frame::HelloReject(r) => {
                let len = w.count("message", r.message.len(), u16::MAX)?;
                w.put(
                    HelloRejectWire {
                        reason: r.reason.code(),
                        message_len: U16::new(len),
                    }
                    .as_bytes(),
                )?;
                w.put(r.message.as_bytes())?;
            }
            Frame::RecvRegistration(r) => {
                let group_count = w.count("groups", r.groups.len(), u16::MAX)?;
                w.put(
                    RegistrationWire {
                        request: U64::new(r.request.0),
                        grant: U64::new(r.grant.0),
                        slice: U32::new(r.slice.0),
                        prompt_len: U32::new(r.prompt_len),
                        aux_capacity: U32::new(r.aux_capacity),
                        group_count: U16::new(group_count),
                    }
                    .as_bytes(),
                )?;
                for g in &r.groups {
                    w.check(check_anchored_run(g))?;
                    let run_count = w.count("groups[].runs", g.runs.len(), u32::MAX)?;
                    w.put(
                        AnchoredRunWire {
                            first_ordinal: U32::new(g.first_ordinal),
                            run_count: U32::new(run_count),
                        }
                        .as_bytes(),
                    )?;
                    for run in &g.runs {
                        w.put(
                            IdRunWire {
                                first: U32::new(run.first.0),
                                len: U32::new(run.len),
                            }
                            .as_bytes(),
                        )?;
                    }
                }
            }
            Frame::KvResult(k) => w.put(
                KvResultWire {
                    request: U64::new(k.request.0),
                    sender_slice: U32::new(k.sender_slice.0),
                    receiver_slice: U32::new(k.receiver_slice.0),
                    bytes_written: U64::new(k.bytes_written),
                    is_last: u8::from(k.is_last),
                    status: k.status.code(),
                }
                .as_bytes(),
            )?,
            Frame::AuxResult(a) => {
                let first_count = w.count("first_tokens", a.data.first_tokens.len(), u32::MAX)?;
                let draft_count = w.count("draft_tokens", a.data.draft_tokens.len(), u32::MAX)?;
                w.put(
                    AuxResultWire {
                        request: U64::new(a.request.0),
                        prompt_tokens: U32::new(a.data.prompt_tokens),
                        cached_tokens: U32::new(a.data.cached_tokens),
                        first_count: U32::new(first_count),
                        draft_count: U32::new(draft_count),
                        status: a.status.code(),
                    }
                    .as_bytes(),
                )?;
                for t in a.data.first_tokens.iter().chain(&a.data.draft_tokens) {
                    w.put(&t.to_le_bytes())?;
                }
            }
            Frame::Cancel(c) => w.put(
                CancelWire {
                    request: U64::new(c.request.0),
                    reason: c.reason.code(),
                }
                .as_bytes(),
            )?,
            Frame::Heartbeat(h) => w.put(
                HeartbeatWire {
                    seq: U64::new(h.seq),
                }
                .as_bytes(),
            )?,
            Frame::DataWrite(d) => w.put(
                DataWriteWire {
                    request: U64::new(d.request.0),
                    grant: U64::new(d.grant.0),
                    offset: U64::new(d.offset),
                    len: U64::new(d.len),
                    region: U32::new(d.region.0),
                }
                .as_bytes(),
            )?,
        }
        Ok(())
    }
}
