//! The fixed cost of one request's last layer range on the in-process transport, host memory:
//! the time from the engine's submit of the last range to the decode side's completion, with
//! copies so small (16 extents of 2 KiB) that what is measured is the protocol and the driver.
//!
//! ```text
//! cargo run --release -p kvpipe-mem --example request_cost [-- REQUESTS]
//! ```
//!
//! Each request is one 256-token chunk (16 blocks of 16 tokens) of a 32-layer model, submitted
//! in 8 ranges of 4 layers; everything before the last range is driven to rest first, so the
//! figures are the last range's alone. Printed: the median and p90 over the requests of each
//! part (µs): submit (the core's `submit_chunk_layers` and the aux data), to the batch issued
//! (the pump up to the copy's hand-off: admissions included), to the sender's outcome (the copy,
//! its report and the receiver's write-finished inputs) and to the decode side's completion.

use std::time::{Duration, Instant as StdInstant};

use kvpipe_core::session::{LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Event, GroupIndex,
    InstanceId, LayerGroupLayout, LayerRange, PoolLayout, ReceiverConfig, RegionId, RequestId,
    SenderConfig,
};
use kvpipe_mem::{MemPair, PairConfig, RegionUse, RECEIVER_PEER, SENDER_PEER};

const LAYERS: u16 = 32;
const TPB: u32 = 16;
const HEAD_DIM: u16 = 8;
const BLOCKS: u32 = 16;
const PROMPT: u32 = BLOCKS * TPB;
const LAYERS_PER_RANGE: u16 = 4;
/// K and V, one head, bf16.
const SLOT: u64 = LAYERS as u64 * 2 * TPB as u64 * HEAD_DIM as u64 * 2;

fn layout(region: u32) -> Vec<LayerGroupLayout> {
    let mut l = LayerGroupLayout {
        layers: LAYERS,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: HEAD_DIM,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        ..LayerGroupLayout::default()
    };
    l.pools.push(PoolLayout {
        region: RegionId(region),
        layer_begin: 0,
        layers: LAYERS,
        slot_bytes: SLOT,
    });
    vec![l]
}

/// Every request's blocks are slots `0..BLOCKS` (one request at a time).
struct Source;

impl BlockSource for Source {
    fn block_run(
        &mut self,
        _request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        if begin > end || end > BLOCKS {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        out.first_ordinal = begin;
        out.ids = (begin..end).map(BlockId).collect();
        Ok(())
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let requests: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(2000);
    let hello = |i, region| LocalHello::new(InstanceId(i), Topology::default(), layout(region));
    let mut pair = MemPair::new(PairConfig::new(
        SenderConfig::new(hello(1, 1)),
        ReceiverConfig::new(hello(2, 2), 7),
    ))?;
    let mut src: Vec<u8> = (0..u64::from(BLOCKS) * SLOT).map(|i| i as u8).collect();
    let mut dst = vec![0u8; src.len()];
    // SAFETY: both buffers outlive `pair` (dropped before them), and nothing else touches them
    // while a request holds their blocks.
    unsafe {
        let n = pair.network();
        n.register_host(
            kvpipe_mem::Node::Sender(0),
            RegionId(1),
            RegionUse::KvPool,
            src.as_mut_ptr(),
            src.len(),
        )?;
        n.register_host(
            kvpipe_mem::Node::Receiver(0),
            RegionId(2),
            RegionUse::KvPool,
            dst.as_mut_ptr(),
            dst.len(),
        )?;
    }
    pair.connect()?;
    pair.drive_until(Duration::from_secs(5), |p| {
        p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
    })?;
    pair.take_events();

    let ids: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let spec = ChunkSpec {
        start: 0,
        end: PROMPT,
        prompt_len: PROMPT,
        prepopulated_len: 0,
        is_last: true,
        prefix_sent_early: false,
    };
    let (mut submit, mut issued, mut outcome, mut complete) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..requests {
        let request = RequestId(r + 1);
        let now = pair.now();
        pair.receiver_mut().register(
            now,
            Registration {
                request,
                prompt_len: PROMPT,
                groups: vec![AnchoredRun::from_ids(0, &ids)],
                writers: std::iter::once(SENDER_PEER).collect(),
                aux_capacity: 64,
                expected_part: None,
            },
        )?;
        pair.sender_mut().open_request(
            now,
            SendRequest {
                request,
                receivers: std::iter::once(RECEIVER_PEER).collect(),
                beam_width: 1,
            },
        )?;
        let mut begin = 0;
        while begin < LAYERS {
            let end = begin + LAYERS_PER_RANGE;
            let last = end == LAYERS;
            if last {
                pair.take_batch_timings();
            }
            let t0 = StdInstant::now();
            let now = pair.now();
            pair.sender_mut().submit_chunk_layers(
                now,
                request,
                spec,
                LayerRange::new(begin.into(), end.into()),
                &mut Source,
            )?;
            if !last {
                // Everything before the last range is driven to rest first.
                pair.drive_until(Duration::from_secs(5), |p| p.writes_in_flight() == 0)?;
                begin = end;
                continue;
            }
            let now = pair.now();
            pair.sender_mut().submit_aux(
                now,
                request,
                AuxData {
                    prompt_tokens: PROMPT,
                    cached_tokens: 0,
                    first_tokens: vec![1],
                    draft_tokens: vec![],
                },
            )?;
            let t1 = StdInstant::now();
            let mut done_at = None;
            let mut quiesced = 0;
            pair.drive_until(Duration::from_secs(5), |p| {
                for (side, _, e) in p.take_events() {
                    match e {
                        Event::Completed { .. } if side == kvpipe_mem::Endpoint::Receiver => {
                            done_at = Some(StdInstant::now());
                        }
                        Event::Quiesced { .. } => quiesced += 1,
                        _ => {}
                    }
                }
                done_at.is_some()
            })?;
            let t3 = done_at.expect("completed");
            let timing = pair.take_batch_timings().pop().expect("the last batch");
            let clock = pair.clock();
            let at = |i: kvpipe_core::Instant| clock.to_std(i);
            submit.push(us(t1 - t0));
            issued.push(us(at(timing.issued).saturating_duration_since(t1)));
            outcome.push(us(
                at(timing.reported).saturating_duration_since(at(timing.issued))
            ));
            complete.push(us(t3.saturating_duration_since(at(timing.reported))));
            pair.drive_until(Duration::from_secs(5), |p| {
                for (_, _, e) in p.take_events() {
                    if matches!(e, Event::Quiesced { .. }) {
                        quiesced += 1;
                    }
                }
                quiesced == 2
            })?;
            begin = end;
        }
        let now = pair.now();
        pair.sender_mut().retire(now, request)?;
        pair.receiver_mut().retire(now, request)?;
    }
    assert_eq!(dst, src, "every byte landed");
    let total: Vec<f64> = (0..submit.len())
        .map(|i| submit[i] + issued[i] + outcome[i] + complete[i])
        .collect();
    for (name, mut v) in [
        ("submit", submit),
        ("to issued", issued),
        ("to outcome", outcome),
        ("to complete", complete),
        ("total", total),
    ] {
        let (p50, p90) = (quantile(&mut v, 0.5), quantile(&mut v, 0.9));
        println!("{name:>12}: p50 {p50:7.2} µs  p90 {p90:7.2} µs");
    }
    Ok(())
}
