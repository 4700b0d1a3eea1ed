//! Sample frames: one of every kind and every status and reason value. Their encodings are the
//! golden snapshots in `proto-core/tests/snapshots/` and the fuzz seeds in `fuzz/seeds/decode/`;
//! transports and tests may use them as realistic inputs.

use bytes::Bytes;
use smallvec::smallvec;

use super::frame::Frame;
use super::frames::{
    AuxData, AuxResult, Cancel, CancelReason, Capabilities, DataWrite, Heartbeat, Hello,
    HelloAccept, HelloReject, KvResult, RecvComplete, RecvRegistration, RejectReason, Role,
    Topology,
};
use super::handshake::compat_hash;
use super::status::TransferStatus;
use super::version::{VersionRange, PROTOCOL_VERSION};
use crate::blocks::{AnchoredRun, IdRun};
use crate::ids::{
    BlockId, GrantId, InstanceId, ReceiverSliceId, RegionId, RequestId, SenderSliceId,
};
use crate::layout::{BlockLayout, GroupShard, LayerGroupLayout, PoolLayout};

/// A two-group model layout as tensor-parallel rank 1 of 2 holds it: 28 full-attention layers
/// split over two pools, and 4 layers with a 4096-token sliding window; of the model's 16 KV
/// heads the rank holds heads 8..16.
pub fn sample_groups() -> Vec<LayerGroupLayout> {
    vec![
        LayerGroupLayout {
            layers: 28,
            kv_factor: 2,
            kv_heads: 8,
            head_dim: 128,
            elem_bytes: 2,
            tokens_per_block: 32,
            window: None,
            block_layout: BlockLayout::LayerKvHeadTokenDim,
            pools: smallvec![
                PoolLayout {
                    region: RegionId(1),
                    layer_begin: 0,
                    layers: 14,
                    slot_bytes: 14 * 131_072,
                },
                PoolLayout {
                    region: RegionId(2),
                    layer_begin: 14,
                    layers: 14,
                    slot_bytes: 14 * 131_072 + 4096,
                },
            ],
            shard: GroupShard {
                model_layers: 28,
                first_layer: 0,
                model_kv_heads: 16,
                first_head: 8,
            },
        },
        LayerGroupLayout {
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
            shard: GroupShard {
                model_layers: 4,
                first_layer: 0,
                model_kv_heads: 16,
                first_head: 8,
            },
        },
    ]
}

/// A `Hello` for `role` over [`sample_groups`], speaking this build's versions.
pub fn sample_hello(role: Role) -> Hello {
    let groups = sample_groups();
    Hello {
        versions: VersionRange::SUPPORTED,
        capabilities: Capabilities(0),
        compat_hash: compat_hash(&groups),
        instance: InstanceId(match role {
            Role::Sender => 0x5e4d_0001,
            Role::Receiver => 0x7ec0_0002,
        }),
        role,
        topology: Topology {
            tp_size: 2,
            tp_rank: 1,
            pp_size: 1,
            pp_rank: 0,
            layer_begin: 0,
            layer_end: 32,
        },
        groups,
        data_path_offer: None,
    }
}

fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Every golden frame with its name (`hello`, `kv_result_in_doubt`, …): each kind at least
/// once, and each [`RejectReason`], [`TransferStatus`] and [`CancelReason`] value once.
pub fn golden_frames() -> Vec<(String, Frame)> {
    let mut out: Vec<(String, Frame)> = vec![
        ("hello".into(), Frame::Hello(sample_hello(Role::Sender))),
        (
            "hello_receiver_no_groups".into(),
            Frame::Hello(Hello {
                groups: Vec::new(),
                compat_hash: compat_hash(&[]),
                capabilities: Capabilities(0x8000_0000_0000_0001),
                versions: VersionRange { min: 1, max: 3 },
                ..sample_hello(Role::Receiver)
            }),
        ),
        (
            "hello_accept".into(),
            Frame::HelloAccept(HelloAccept {
                version: PROTOCOL_VERSION,
                instance: InstanceId(0x7ec0_0002),
                data_path_answer: None,
            }),
        ),
        (
            "hello_data_path_offer".into(),
            Frame::Hello(Hello {
                data_path_offer: Some(Bytes::from_static(b"transport offer")),
                ..sample_hello(Role::Sender)
            }),
        ),
        (
            "hello_accept_data_path_answer".into(),
            Frame::HelloAccept(HelloAccept {
                version: PROTOCOL_VERSION,
                instance: InstanceId(0x7ec0_0002),
                data_path_answer: Some(Bytes::from_static(b"answer")),
            }),
        ),
    ];
    for &reason in RejectReason::ALL {
        out.push((
            format!("hello_reject_{}", snake(&format!("{reason:?}"))),
            Frame::HelloReject(HelloReject {
                reason,
                message: format!("{reason} (sample)"),
            }),
        ));
    }
    out.push((
        "recv_registration".into(),
        Frame::RecvRegistration(RecvRegistration {
            request: RequestId(0x0123_4567_89ab_cdef),
            slice: ReceiverSliceId(3),
            prompt_len: 131_000,
            grant: GrantId(0xfeed_f00d_0000_0042),
            aux_capacity: 256,
            groups: vec![
                AnchoredRun {
                    first_ordinal: 0,
                    runs: smallvec![
                        IdRun {
                            first: BlockId(100),
                            len: 4096,
                        },
                        IdRun {
                            first: BlockId(7),
                            len: 1,
                        },
                    ],
                },
                AnchoredRun {
                    first_ordinal: 3967,
                    runs: smallvec![IdRun {
                        first: BlockId(9000),
                        len: 130,
                    }],
                },
            ],
        }),
    ));
    out.push((
        "recv_registration_empty".into(),
        Frame::RecvRegistration(RecvRegistration {
            request: RequestId(1),
            slice: ReceiverSliceId(0),
            prompt_len: 0,
            grant: GrantId(0),
            aux_capacity: 0,
            groups: vec![AnchoredRun::empty(5)],
        }),
    ));
    for (i, &status) in TransferStatus::ALL.iter().enumerate() {
        out.push((
            format!("kv_result_{}", snake(&format!("{status:?}"))),
            Frame::KvResult(KvResult {
                request: RequestId(0x0123_4567_89ab_cdef),
                sender_slice: SenderSliceId(10 + i as u32),
                receiver_slice: ReceiverSliceId(3),
                is_last: status == TransferStatus::Success,
                status,
                bytes_written: if status == TransferStatus::Success {
                    1 << 30
                } else {
                    4096 * i as u64
                },
            }),
        ));
    }
    out.push((
        "aux_result".into(),
        Frame::AuxResult(AuxResult {
            request: RequestId(0x0123_4567_89ab_cdef),
            status: TransferStatus::Success,
            data: AuxData {
                prompt_tokens: 131_000,
                cached_tokens: 4096,
                first_tokens: vec![151_643],
                draft_tokens: vec![11, 22, 33],
            },
        }),
    ));
    out.push((
        "aux_result_cancelled".into(),
        Frame::AuxResult(AuxResult {
            request: RequestId(2),
            status: TransferStatus::Cancelled,
            data: AuxData::default(),
        }),
    ));
    for &reason in CancelReason::ALL {
        out.push((
            format!("cancel_{}", snake(&format!("{reason:?}"))),
            Frame::Cancel(Cancel {
                request: RequestId(0x0123_4567_89ab_cdef),
                reason,
            }),
        ));
    }
    out.push((
        "heartbeat".into(),
        Frame::Heartbeat(Heartbeat {
            seq: 0x0102_0304_0506_0708,
        }),
    ));
    out.push((
        "data_write".into(),
        Frame::DataWrite(DataWrite {
            request: RequestId(0x0123_4567_89ab_cdef),
            grant: GrantId(0xfeed_f00d_0000_0042),
            region: RegionId(2),
            offset: 14 * 131_072 * 100,
            len: 14 * 131_072,
        }),
    ));
    out.push((
        "recv_complete".into(),
        Frame::RecvComplete(RecvComplete {
            request: RequestId(0x0123_4567_89ab_cdef),
        }),
    ));
    out
}
