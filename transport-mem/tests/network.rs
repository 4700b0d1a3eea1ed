//! `MemNetwork`: one prefill sender serving two decode receivers; losing one decode process
//! fails exactly the requests that involve it, and the other's transfers complete.

use std::time::Duration;

use kvpipe_core::session::{LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Topology, TransferStatus};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Event, GroupIndex,
    InstanceId, LayerGroupLayout, PoolLayout, ReceiverConfig, RegionId, RequestId, SenderConfig,
    SenderInput,
};
use kvpipe_mem::{receiver_peer, sender_peer, MemNetwork, NetworkConfig, Node, RegionUse};

const TPB: u32 = 4;
const SLOT: u64 = 64;
const PROMPT: u32 = 40;
const BLOCKS: u32 = PROMPT / TPB;

fn layout(region: u32) -> Vec<LayerGroupLayout> {
    let mut l = LayerGroupLayout {
        layers: 1,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 8,
        elem_bytes: 1,
        tokens_per_block: TPB,
        window: None,
        ..LayerGroupLayout::default()
    };
    l.pools.push(PoolLayout {
        region: RegionId(region),
        layer_begin: 0,
        layers: 1,
        slot_bytes: SLOT,
    });
    vec![l]
}

/// Request `r` lives in sender slots `(r - 1) * BLOCKS ..`.
struct Source;

impl BlockSource for Source {
    fn block_run(
        &mut self,
        request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        if end > BLOCKS || begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        let base = (request.0 as u32 - 1) * BLOCKS;
        out.first_ordinal = begin;
        out.ids = (begin..end).map(|o| BlockId(base + o)).collect();
        Ok(())
    }
}

#[test]
fn losing_one_decode_process_fails_only_its_requests() {
    let hello = |i, region| LocalHello::new(InstanceId(i), Topology::default(), layout(region));
    let mut net = MemNetwork::new(NetworkConfig::new(
        vec![SenderConfig::new(hello(1, 1))],
        vec![
            ReceiverConfig::new(hello(2, 2), 5),
            ReceiverConfig::new(hello(3, 2), 6),
        ],
    ))
    .unwrap();
    let mut src: Vec<u8> = (0..2 * u64::from(BLOCKS) * SLOT)
        .map(|i| (i * 31 + 7) as u8)
        .collect();
    let mut dst = [
        vec![0u8; (u64::from(BLOCKS) * SLOT) as usize],
        vec![0u8; (u64::from(BLOCKS) * SLOT) as usize],
    ];
    // SAFETY: the buffers outlive `net` (it is dropped at the end of the test, before them).
    unsafe {
        net.register_host(
            Node::Sender(0),
            RegionId(1),
            RegionUse::KvPool,
            src.as_mut_ptr(),
            src.len(),
        )
        .unwrap();
        for (j, d) in dst.iter_mut().enumerate() {
            net.register_host(
                Node::Receiver(j),
                RegionId(2),
                RegionUse::KvPool,
                d.as_mut_ptr(),
                d.len(),
            )
            .unwrap();
        }
    }
    net.connect_all().unwrap();
    net.drive_until(Duration::from_secs(5), |n| {
        (0..2).all(|j| {
            n.sender(0).is_peer_ready(receiver_peer(j))
                && n.receiver(j).is_peer_ready(sender_peer(0))
        })
    })
    .unwrap();

    // Request j + 1 goes to receiver j.
    for j in 0..2 {
        let request = RequestId(j as u64 + 1);
        let now = net.now();
        let ids: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
        net.receiver_mut(j)
            .register(
                now,
                Registration {
                    request,
                    prompt_len: PROMPT,
                    groups: vec![AnchoredRun::from_ids(0, &ids)],
                    writers: std::iter::once(sender_peer(0)).collect(),
                    aux_capacity: 64,
                    expected_part: None,
                },
            )
            .unwrap();
        net.sender_mut(0)
            .open_request(
                now,
                SendRequest {
                    request,
                    receivers: std::iter::once(receiver_peer(j)).collect(),
                    beam_width: 1,
                },
            )
            .unwrap();
    }
    net.pump().unwrap();
    let mut source = Source;
    let mut start = 0;
    while start < PROMPT {
        let end = (start + 8).min(PROMPT);
        for request in [RequestId(1), RequestId(2)] {
            if !net.is_alive(Node::Receiver(1)) && request == RequestId(2) {
                continue;
            }
            let spec = ChunkSpec {
                start,
                end,
                prompt_len: PROMPT,
                prepopulated_len: 0,
                is_last: end == PROMPT,
                prefix_sent_early: false,
            };
            let now = net.now();
            net.sender_mut(0)
                .submit_chunk(now, request, spec, &mut source)
                .unwrap();
            if end == PROMPT {
                net.sender_mut(0)
                    .handle_input(SenderInput::Aux {
                        now,
                        request,
                        data: AuxData::default(),
                    })
                    .unwrap();
            }
            net.pump().unwrap();
        }
        if start == 8 {
            net.kill(Node::Receiver(1)).unwrap();
        }
        start = end;
    }
    let mut events = Vec::new();
    net.drive_until(Duration::from_secs(10), |n| {
        events.extend(n.take_events());
        let quiesced = |node, r| {
            events.iter().any(|(s, _, e)| {
                *s == node
                    && *e
                        == Event::Quiesced {
                            request: RequestId(r),
                        }
            })
        };
        quiesced(Node::Sender(0), 1)
            && quiesced(Node::Sender(0), 2)
            && quiesced(Node::Receiver(0), 1)
    })
    .unwrap();
    let completed = |node, r: u64| {
        events.iter().any(|(s, _, e)| {
            *s == node && matches!(e, Event::Completed { request, .. } if *request == RequestId(r))
        })
    };
    assert!(completed(Node::Receiver(0), 1), "{events:?}");
    assert!(completed(Node::Sender(0), 1), "{events:?}");
    assert!(events.iter().any(|(s, _, e)| *s == Node::Sender(0)
        && matches!(
            e,
            Event::Failed {
                request: RequestId(2),
                cause: TransferStatus::PeerLost,
                ..
            }
        )));
    assert!(net.is_connected(0, 0) && !net.is_connected(0, 1));
    assert_eq!(net.writes_in_flight(), 0);
    drop(net);
    // Request 1 lives in sender slots 0..BLOCKS: receiver 0 holds exactly those bytes.
    assert_eq!(dst[0][..], src[..dst[0].len()]);
}
