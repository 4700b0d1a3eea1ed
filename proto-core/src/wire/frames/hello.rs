//! `Hello` (`0x01`, frozen layout): the first frame on every connection, from both sides —
//! version range, capabilities, compatibility hash, instance, role, topology and the pool
//! layout of every layer group.
//!
//! ```text
//! versions.min u16 | versions.max u16 | capabilities u64 | compat_hash u64 | instance u64
//! | tp_size u16 | tp_rank u16 | pp_size u16 | pp_rank u16 | layer_begin u16 | layer_end u16
//! | group_count u16 | role u8 | group_count × group (see `wire::group_layout`)
//! [ | offer_len u32 | offer_len bytes ]   the data-path offer, only when there is one
//! ```
//!
//! The trailing data-path offer ([`Hello::data_path_offer`], `data_path.rs`) is absent from a
//! Hello that carries none, which then encodes exactly as before the offer existed.

use core::fmt;

use bytes::Bytes;
use zerocopy::little_endian::{U16, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::data_path;
use crate::ids::InstanceId;
use crate::layout::LayerGroupLayout;
use crate::wire::body::{fixed_len, wire_codes, BodyReader, BodyWriter, FrameBody, Invalid};
use crate::wire::error::{DecodeError, EncodeError, Malformation};
use crate::wire::group_layout::{self, GroupDisplay, GROUP_LEN};
use crate::wire::header::{FrameKind, MAX_BODY_LEN};
use crate::wire::version::VersionRange;

/// Optional features an endpoint supports, as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Capabilities(pub u64);

/// Which side of a transfer an endpoint plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum Role {
    /// Prefill (context) side: writes KV.
    Sender = 1,
    /// Decode (generation) side: receives KV.
    Receiver = 2,
}

wire_codes!(Role { Sender, Receiver });

/// Parallel topology of one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Topology {
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// This endpoint's tensor-parallel rank.
    pub tp_rank: u16,
    /// Pipeline-parallel size.
    pub pp_size: u16,
    /// This endpoint's pipeline-parallel rank.
    pub pp_rank: u16,
    /// First model layer held by this rank.
    pub layer_begin: u16,
    /// One past the last model layer held by this rank.
    pub layer_end: u16,
}

/// First frame on every connection, from both sides.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Hello {
    /// Versions this endpoint speaks.
    pub versions: VersionRange,
    /// Optional features this endpoint supports.
    pub capabilities: Capabilities,
    /// Hash over model geometry, dtype, tokens per block and layout (see `docs/PROTOCOL.md`).
    pub compat_hash: u64,
    /// This endpoint's instance.
    pub instance: InstanceId,
    /// Sender or receiver.
    pub role: Role,
    /// Parallel topology.
    pub topology: Topology,
    /// Pool layout per layer group, in group order.
    pub groups: Vec<LayerGroupLayout>,
    /// The transport's data-path offer (opaque to the core, at most
    /// [`MAX_DATA_PATH_LEN`](super::MAX_DATA_PATH_LEN) bytes): the receiving endpoint asks its
    /// transport to evaluate it and answers in its [`HelloAccept`](super::HelloAccept).
    /// `None` for a Hello that offers nothing.
    #[cfg_attr(feature = "arbitrary", arbitrary(with = data_path::arbitrary))]
    pub data_path_offer: Option<Bytes>,
}

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

impl FrameBody for Hello {
    const KIND: FrameKind = FrameKind::Hello;
    const MAX_BODY_LEN: u32 = MAX_BODY_LEN;

    fn body_len(&self) -> usize {
        fixed_len::<HelloWire>() as usize
            + self
                .groups
                .iter()
                .map(group_layout::encoded_len)
                .sum::<usize>()
            + data_path::encoded_len(self.data_path_offer.as_ref())
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<HelloWire>("versions")?;
        let versions = VersionRange {
            min: w.version_min.get(),
            max: w.version_max.get(),
        };
        r.check(check_version_range(versions))?;
        let role = r.code("role", w.role, Role::from_code)?;
        let group_count = usize::from(w.group_count.get());
        // Every group takes at least its fixed part: bound the allocation by the bytes present.
        if group_count > r.remaining() / GROUP_LEN {
            return Err(r.short("groups", group_count * GROUP_LEN));
        }
        let mut groups = Vec::with_capacity(group_count);
        for _ in 0..group_count {
            groups.push(group_layout::parse(r)?);
        }
        let data_path_offer = data_path::parse(r, "data_path_offer")?;
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
            data_path_offer,
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.check(check_version_range(self.versions))?;
        let group_count = w.count("groups", self.groups.len(), u16::MAX)?;
        let t = &self.topology;
        w.put(
            HelloWire {
                version_min: U16::new(self.versions.min),
                version_max: U16::new(self.versions.max),
                capabilities: U64::new(self.capabilities.0),
                compat_hash: U64::new(self.compat_hash),
                instance: U64::new(self.instance.0),
                tp_size: U16::new(t.tp_size),
                tp_rank: U16::new(t.tp_rank),
                pp_size: U16::new(t.pp_size),
                pp_rank: U16::new(t.pp_rank),
                layer_begin: U16::new(t.layer_begin),
                layer_end: U16::new(t.layer_end),
                group_count: U16::new(group_count),
                role: self.role.code(),
            }
            .as_bytes(),
        )?;
        self.groups
            .iter()
            .try_for_each(|g| group_layout::emit(g, w))?;
        data_path::emit(self.data_path_offer.as_ref(), w, "data_path_offer")
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        })
    }
}

impl fmt::Display for Hello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.topology;
        write!(
            f,
            "Hello {} {} {} caps 0x{:x} compat 0x{:016x} tp {}/{} pp {}/{} layers {}..{} groups [",
            self.role,
            self.versions,
            self.instance,
            self.capabilities.0,
            self.compat_hash,
            t.tp_rank,
            t.tp_size,
            t.pp_rank,
            t.pp_size,
            t.layer_begin,
            t.layer_end
        )?;
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}", GroupDisplay(g))?;
        }
        f.write_str("]")?;
        match &self.data_path_offer {
            Some(offer) => write!(f, " data-path offer {} bytes", offer.len()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use smallvec::smallvec;

    use super::*;
    use crate::ids::RegionId;
    use crate::layout::{BlockLayout, GroupShard, PoolLayout};
    use crate::wire::body::testing::{parse, roundtrip};

    fn hello(groups: usize) -> Hello {
        let group = LayerGroupLayout {
            layers: 4,
            kv_factor: 2,
            kv_heads: 8,
            head_dim: 128,
            elem_bytes: 2,
            tokens_per_block: 32,
            window: Some(4096),
            block_layout: BlockLayout::LayerKvHeadTokenDim,
            pools: smallvec![PoolLayout {
                region: RegionId(3),
                layer_begin: 0,
                layers: 4,
                slot_bytes: 4 * 131_072,
            }],
            shard: GroupShard::default(),
        };
        Hello {
            versions: VersionRange { min: 1, max: 2 },
            capabilities: Capabilities(0x10),
            compat_hash: 0x1122_3344_5566_7788,
            instance: InstanceId(9),
            role: Role::Receiver,
            topology: Topology {
                tp_size: 2,
                tp_rank: 1,
                pp_size: 1,
                pp_rank: 0,
                layer_begin: 0,
                layer_end: 4,
            },
            groups: vec![group; groups],
            data_path_offer: None,
        }
    }

    fn malformed(field: &'static str, reason: Malformation) -> Result<Hello, DecodeError> {
        Err(DecodeError::Malformed {
            kind: FrameKind::Hello,
            field,
            reason,
        })
    }

    #[test]
    fn layout_is_43_fixed_bytes_then_the_groups() {
        let body = roundtrip(&hello(2));
        assert_eq!(body.len(), 43 + 2 * (27 + 16));
        assert_eq!(&body[..4], &[1, 0, 2, 0], "versions");
        assert_eq!(&body[4..12], &0x10u64.to_le_bytes(), "capabilities");
        assert_eq!(&body[12..20], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&body[28..32], &[2, 0, 1, 0], "tp_size, tp_rank");
        assert_eq!(&body[40..43], &[2, 0, 2], "group_count, then role receiver");
        assert_eq!(roundtrip(&hello(0)).len(), 43);
    }

    #[test]
    fn a_data_path_offer_follows_the_groups() {
        let plain = roundtrip(&hello(1));
        let offering = Hello {
            data_path_offer: Some(Bytes::from_static(b"offer")),
            ..hello(1)
        };
        let body = roundtrip(&offering);
        assert_eq!(&body[..plain.len()], &plain[..], "the rest is unchanged");
        assert_eq!(&body[plain.len()..], b"\x05\0\0\0offer");
        assert!(offering.to_string().ends_with(" data-path offer 5 bytes"));
        // An offer past the cap is refused both ways.
        let long = Hello {
            data_path_offer: Some(Bytes::from(vec![0; super::super::MAX_DATA_PATH_LEN + 1])),
            ..hello(1)
        };
        assert!(crate::wire::body::testing::emit(&long).is_err());
        let mut b = plain.clone();
        b.extend(((super::super::MAX_DATA_PATH_LEN + 1) as u32).to_le_bytes());
        assert_eq!(
            parse(&b),
            malformed(
                "data_path_offer",
                Malformation::TooLong {
                    len: super::super::MAX_DATA_PATH_LEN + 1,
                    max: super::super::MAX_DATA_PATH_LEN
                }
            )
        );
    }

    #[test]
    fn bad_versions_and_roles_are_named() {
        let good = roundtrip(&hello(1));
        let mut b = good.clone();
        b[0..2].copy_from_slice(&[0, 0]);
        assert_eq!(
            parse(&b),
            malformed("versions.min", Malformation::ZeroVersion)
        );
        let mut b = good.clone();
        b[0..2].copy_from_slice(&[3, 0]);
        let inverted = Malformation::InvertedRange { min: 3, max: 2 };
        assert_eq!(parse(&b), malformed("versions", inverted));
        let mut b = good;
        b[42] = 3;
        let role = Malformation::UnknownCode { code: 3 };
        assert_eq!(parse(&b), malformed("role", role));
    }

    #[test]
    fn the_group_count_is_bounded_by_the_bytes_present() {
        let mut b = roundtrip(&hello(1));
        b[40..42].copy_from_slice(&u16::MAX.to_le_bytes());
        let short = Malformation::Short {
            needed: usize::from(u16::MAX) * 27,
            have: 27 + 16,
        };
        assert_eq!(parse(&b), malformed("groups", short));
    }
}
