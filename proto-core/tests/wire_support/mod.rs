//! Shared helpers of the wire tests: a hex dump for golden snapshots and proptest strategies
//! that build valid (canonical) frames.
#![allow(dead_code)]

use std::fmt::Write as _;

use kvpipe_core::wire::*;
use kvpipe_core::{
    AnchoredRun, BlockId, BlockLayout, GrantId, GroupShard, IdRun, InstanceId, LayerGroupLayout,
    PoolLayout, ReceiverSliceId, RegionId, RequestId, SenderSliceId,
};
use proptest::prelude::*;

/// The frame's display line, then its header and body as an offset/hex/ASCII dump.
pub(crate) fn golden_dump(frame: &Frame, bytes: &[u8]) -> String {
    let mut out = String::new();
    writeln!(out, "{frame}").unwrap();
    writeln!(
        out,
        "kind {} (0x{:02x}), {} header + {} body = {} bytes",
        frame.kind(),
        frame.kind().code(),
        HEADER_LEN,
        bytes.len() - HEADER_LEN,
        bytes.len()
    )
    .unwrap();
    out.push_str("header:\n");
    hex_lines(&mut out, &bytes[..HEADER_LEN]);
    out.push_str("body:\n");
    hex_lines(&mut out, &bytes[HEADER_LEN..]);
    out
}

fn hex_lines(out: &mut String, bytes: &[u8]) {
    for (i, line) in bytes.chunks(16).enumerate() {
        write!(out, "{:04x} ", i * 16).unwrap();
        for j in 0..16 {
            if j == 8 {
                out.push(' ');
            }
            match line.get(j) {
                Some(b) => write!(out, " {b:02x}").unwrap(),
                None => out.push_str("   "),
            }
        }
        out.push_str("  |");
        for &b in line {
            out.push(if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            });
        }
        out.push_str("|\n");
    }
}

pub(crate) fn arb_version_range() -> impl Strategy<Value = VersionRange> {
    (1u16..=u16::MAX, 1u16..=u16::MAX).prop_map(|(a, b)| VersionRange {
        min: a.min(b),
        max: a.max(b),
    })
}

pub(crate) fn arb_role() -> impl Strategy<Value = Role> {
    prop::sample::select(Role::ALL)
}

pub(crate) fn arb_status() -> impl Strategy<Value = TransferStatus> {
    prop::sample::select(TransferStatus::ALL)
}

pub(crate) fn arb_pool() -> impl Strategy<Value = PoolLayout> {
    (any::<u32>(), any::<u16>(), any::<u16>(), any::<u64>()).prop_map(
        |(region, layer_begin, layers, slot_bytes)| PoolLayout {
            region: RegionId(region),
            layer_begin,
            layers,
            slot_bytes,
        },
    )
}

pub(crate) fn arb_group() -> impl Strategy<Value = LayerGroupLayout> {
    (
        (
            any::<u16>(),
            any::<u8>(),
            any::<u16>(),
            any::<u16>(),
            any::<u8>(),
        ),
        any::<u32>(),
        prop::option::of(1u32..),
        prop::collection::vec(arb_pool(), 0..4),
        prop::array::uniform4(any::<u16>()),
    )
        .prop_map(
            |((layers, kv_factor, kv_heads, head_dim, elem_bytes), tpb, window, pools, shard)| {
                LayerGroupLayout {
                    layers,
                    kv_factor,
                    kv_heads,
                    head_dim,
                    elem_bytes,
                    tokens_per_block: tpb,
                    window,
                    block_layout: BlockLayout::LayerKvHeadTokenDim,
                    pools: pools.into_iter().collect(),
                    shard: GroupShard {
                        model_layers: shard[0],
                        first_layer: shard[1],
                        model_kv_heads: shard[2],
                        first_head: shard[3],
                    },
                }
            },
        )
}

pub(crate) fn arb_hello() -> impl Strategy<Value = Hello> {
    (
        arb_version_range(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        arb_role(),
        prop::array::uniform6(any::<u16>()),
        prop::collection::vec(arb_group(), 0..4),
        arb_data_path(),
    )
        .prop_map(
            |(versions, caps, hash, inst, role, t, groups, offer)| Hello {
                versions,
                capabilities: Capabilities(caps),
                compat_hash: hash,
                instance: InstanceId(inst),
                role,
                topology: Topology {
                    tp_size: t[0],
                    tp_rank: t[1],
                    pp_size: t[2],
                    pp_rank: t[3],
                    layer_begin: t[4],
                    layer_end: t[5],
                },
                groups,
                data_path_offer: offer,
            },
        )
}

/// An optional data-path offer or answer (opaque bytes, usually absent).
pub(crate) fn arb_data_path() -> impl Strategy<Value = Option<bytes::Bytes>> {
    prop::option::weighted(0.3, prop::collection::vec(any::<u8>(), 0..48))
        .prop_map(|b| b.map(bytes::Bytes::from))
}

/// A canonical anchored run: non-empty id runs, adjacent runs merged, ids and ordinals in
/// range.
pub(crate) fn arb_anchored_run() -> impl Strategy<Value = AnchoredRun> {
    (
        0u32..(u32::MAX - (1 << 24)),
        prop::collection::vec((0u32..(u32::MAX - (1 << 20)), 1u32..(1 << 18)), 0..12),
    )
        .prop_map(|(first_ordinal, raw)| {
            let mut run = AnchoredRun::empty(first_ordinal);
            for (first, len) in raw {
                match run.runs.last_mut() {
                    Some(prev)
                        if u64::from(prev.first.0) + u64::from(prev.len) == u64::from(first) =>
                    {
                        prev.len += len;
                    }
                    _ => run.runs.push(IdRun {
                        first: BlockId(first),
                        len,
                    }),
                }
            }
            run
        })
}

pub(crate) fn arb_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        arb_hello().prop_map(Frame::Hello),
        (1u16.., any::<u64>(), arb_data_path()).prop_map(|(version, inst, answer)| {
            Frame::HelloAccept(HelloAccept {
                version,
                instance: InstanceId(inst),
                data_path_answer: answer,
            })
        }),
        (prop::sample::select(RejectReason::ALL), "\\PC{0,40}")
            .prop_map(|(reason, message)| { Frame::HelloReject(HelloReject { reason, message }) }),
        (
            (
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u32>()
            ),
            prop::collection::vec(arb_anchored_run(), 0..4),
        )
            .prop_map(|((request, slice, prompt_len, grant, aux), groups)| {
                Frame::RecvRegistration(RecvRegistration {
                    request: RequestId(request),
                    slice: ReceiverSliceId(slice),
                    prompt_len,
                    grant: GrantId(grant),
                    aux_capacity: aux,
                    groups,
                })
            }),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
            arb_status(),
            any::<u64>()
        )
            .prop_map(|(request, s, r, is_last, status, bytes)| Frame::KvResult(
                KvResult {
                    request: RequestId(request),
                    sender_slice: SenderSliceId(s),
                    receiver_slice: ReceiverSliceId(r),
                    is_last,
                    status,
                    bytes_written: bytes,
                }
            )),
        (
            any::<u64>(),
            arb_status(),
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(any::<u32>(), 0..8),
            prop::collection::vec(any::<u32>(), 0..8),
        )
            .prop_map(|(request, status, p, c, first, draft)| Frame::AuxResult(
                AuxResult {
                    request: RequestId(request),
                    status,
                    data: AuxData {
                        prompt_tokens: p,
                        cached_tokens: c,
                        first_tokens: first,
                        draft_tokens: draft,
                    },
                }
            )),
        (any::<u64>(), prop::sample::select(CancelReason::ALL)).prop_map(|(request, reason)| {
            Frame::Cancel(Cancel {
                request: RequestId(request),
                reason,
            })
        }),
        any::<u64>().prop_map(|seq| Frame::Heartbeat(Heartbeat { seq })),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(request, grant, region, offset, len)| Frame::DataWrite(
                DataWrite {
                    request: RequestId(request),
                    grant: GrantId(grant),
                    region: RegionId(region),
                    offset,
                    len,
                }
            )),
    ]
}
