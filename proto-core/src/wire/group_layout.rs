//! The encoding of one [`LayerGroupLayout`] in a [`Hello`](super::Hello): the group's
//! geometry and shard (27 bytes), then its pools (16 bytes each).
//!
//! ```text
//! layers u16 | kv_heads u16 | head_dim u16 | kv_factor u8 | elem_bytes u8
//! | tokens_per_block u32 | window u32 (0 = full attention) | block_layout u8
//! | model_layers u16 | first_layer u16 | model_kv_heads u16 | first_head u16
//! | pool_count u16 | pool_count × (region u32 | layer_begin u16 | layers u16 | slot_bytes u64)
//! ```
//!
//! Full attention is encoded as window 0, so a window of 0 tokens cannot be encoded.

use core::fmt;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::body::{fixed_len, BodyReader, BodyWriter};
use super::error::{DecodeError, EncodeError, Malformation};
use crate::ids::RegionId;
use crate::layout::{BlockLayout, GroupShard, LayerGroupLayout, PoolLayout};

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
    model_layers: U16,
    first_layer: U16,
    model_kv_heads: U16,
    first_head: U16,
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

/// Bytes a group with no pools takes (the least any takes).
pub(super) const GROUP_LEN: usize = fixed_len::<GroupWire>() as usize;
const POOL_LEN: usize = fixed_len::<PoolWire>() as usize;

/// Bytes `group` takes on the wire.
pub(super) fn encoded_len(group: &LayerGroupLayout) -> usize {
    GROUP_LEN + group.pools.len() * POOL_LEN
}

fn block_layout_from_code(code: u8) -> Option<BlockLayout> {
    [BlockLayout::LayerKvHeadTokenDim]
        .into_iter()
        .find(|l| *l as u8 == code)
}

/// Reads one group of a `Hello`; its pools are checked against the bytes present before any
/// is built.
pub(super) fn parse(r: &mut BodyReader<'_>) -> Result<LayerGroupLayout, DecodeError> {
    let g = r.fixed::<GroupWire>("groups[]")?;
    let block_layout = r.code(
        "groups[].block_layout",
        g.block_layout,
        block_layout_from_code,
    )?;
    let pools = r.slice::<PoolWire>("groups[].pools", usize::from(g.pool_count.get()))?;
    Ok(LayerGroupLayout {
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
        shard: GroupShard {
            model_layers: g.model_layers.get(),
            first_layer: g.first_layer.get(),
            model_kv_heads: g.model_kv_heads.get(),
            first_head: g.first_head.get(),
        },
    })
}

/// Writes one group of a `Hello`, refusing a zero-token window.
pub(super) fn emit(g: &LayerGroupLayout, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
    let window = match g.window {
        None => 0,
        Some(0) => return Err(w.invalid("groups[].window", Malformation::ZeroWindow)),
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
            model_layers: U16::new(g.shard.model_layers),
            first_layer: U16::new(g.shard.first_layer),
            model_kv_heads: U16::new(g.shard.model_kv_heads),
            first_head: U16::new(g.shard.first_head),
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
    Ok(())
}

/// `32L 2x8h x128d 2B tpb32 full [region#1 L0+32 slot 2097152 B]`.
pub(super) struct GroupDisplay<'a>(pub(super) &'a LayerGroupLayout);

impl fmt::Display for GroupDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.0;
        write!(
            f,
            "{}L {}x{}h x{}d {}B tpb{} ",
            g.layers, g.kv_factor, g.kv_heads, g.head_dim, g.elem_bytes, g.tokens_per_block
        )?;
        match g.window {
            None => f.write_str("full")?,
            Some(w) => write!(f, "window {w}")?,
        }
        match g.block_layout {
            BlockLayout::LayerKvHeadTokenDim => {}
        }
        if g.shard != GroupShard::default() {
            let s = &g.shard;
            write!(
                f,
                " of model L{}+{}/{} h{}+{}/{}",
                s.first_layer, g.layers, s.model_layers, s.first_head, g.kv_heads, s.model_kv_heads
            )?;
        }
        f.write_str(" [")?;
        for (i, p) in g.pools.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "{} L{}+{} slot {} B",
                p.region, p.layer_begin, p.layers, p.slot_bytes
            )?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use smallvec::smallvec;

    use super::*;
    use crate::wire::header::FrameKind;

    fn group(window: Option<u32>) -> LayerGroupLayout {
        LayerGroupLayout {
            layers: 14,
            kv_factor: 2,
            kv_heads: 8,
            head_dim: 128,
            elem_bytes: 2,
            tokens_per_block: 32,
            window,
            block_layout: BlockLayout::LayerKvHeadTokenDim,
            pools: smallvec![PoolLayout {
                region: RegionId(2),
                layer_begin: 0,
                layers: 14,
                slot_bytes: 14 * 131_072,
            }],
            shard: GroupShard {
                model_layers: 28,
                first_layer: 14,
                model_kv_heads: 16,
                first_head: 8,
            },
        }
    }

    fn encode(g: &LayerGroupLayout) -> Result<Vec<u8>, EncodeError> {
        let mut out = vec![0; encoded_len(g)];
        let mut w = BodyWriter::new(FrameKind::Hello, &mut out);
        emit(g, &mut w)?;
        assert_eq!(w.position(), out.len());
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<LayerGroupLayout, DecodeError> {
        let mut r = BodyReader::new(FrameKind::Hello, bytes);
        let g = parse(&mut r)?;
        r.finish()?;
        Ok(g)
    }

    #[test]
    fn layout_is_27_bytes_then_16_per_pool() {
        let g = group(Some(4096));
        let bytes = encode(&g).unwrap();
        assert_eq!(bytes.len(), 27 + 16);
        assert_eq!(&bytes[12..16], &4096u32.to_le_bytes(), "window");
        assert_eq!(bytes[16], 0, "block_layout");
        assert_eq!(&bytes[17..25], &[28, 0, 14, 0, 16, 0, 8, 0], "shard");
        assert_eq!(&bytes[25..27], &[1, 0], "pool_count");
        assert_eq!(&bytes[27..31], &2u32.to_le_bytes(), "pool region");
        assert_eq!(decode(&bytes), Ok(g.clone()));
        assert_eq!(
            GroupDisplay(&g).to_string(),
            "14L 2x8h x128d 2B tpb32 window 4096 of model L14+14/28 h8+8/16 \
             [region#2 L0+14 slot 1835008 B]"
        );
    }

    #[test]
    fn full_attention_is_window_zero_and_a_zero_window_is_refused() {
        let bytes = encode(&group(None)).unwrap();
        assert_eq!(&bytes[12..16], &[0; 4]);
        assert_eq!(decode(&bytes), Ok(group(None)));
        assert_eq!(
            encode(&group(Some(0))),
            Err(EncodeError::Invalid {
                kind: FrameKind::Hello,
                field: "groups[].window",
                reason: Malformation::ZeroWindow,
            })
        );
    }

    #[test]
    fn an_unknown_block_layout_and_missing_pools_are_named() {
        let good = encode(&group(None)).unwrap();
        let mut b = good.clone();
        b[16] = 1;
        assert_eq!(
            decode(&b),
            Err(DecodeError::Malformed {
                kind: FrameKind::Hello,
                field: "groups[].block_layout",
                reason: Malformation::UnknownCode { code: 1 },
            })
        );
        let mut b = good;
        b[25..27].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(
            decode(&b),
            Err(DecodeError::Malformed {
                kind: FrameKind::Hello,
                field: "groups[].pools",
                reason: Malformation::Short {
                    needed: 32,
                    have: 16
                },
            })
        );
    }
}
