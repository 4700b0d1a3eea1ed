//! `kvpipe bench fragments`: what planning and posting many small head-slice writes costs next
//! to moving their bytes, on the in-process transport.
//!
//! Heterogeneous tensor parallelism is where writes get small: a sender rank holding one KV
//! head of each layer writes a receiver rank holding two, and every (block, layer, K/V plane)
//! is one 8 KiB slice (32 tokens × head dim 128 × bf16) that is contiguous on neither side
//! beyond itself. The bench moves 100 000 such fragments (a 2-KV-head, 80-layer group; the
//! sender is tensor rank 0 of 2, the receiver holds both heads) chunk by chunk through the real
//! sessions and `kvpipe-mem`, one write batch per chunk, and times, per chunk:
//! - planning: the sender's `submit_chunk` (chunk window, block query, pairing, head-slice
//!   extents, handing the plan out), on the engine's thread;
//! - the transfer: the transport's copy of the batch, as its copy worker measured it;
//! - posting: what the transport does per extent to take a batch, `ResolvedBatch::resolve` of
//!   the same extents against the same registrations (each checked and tied to its region),
//!   timed on the engine's thread right after the chunk's copy — not the wall time until the
//!   copy worker wakes up, which on a loaded machine is the scheduler's, not the transport's.
//!
//! Each copy finishes before the next chunk is submitted, so the three never compete for the
//! cores. With `--layers-per-slice N` each chunk goes out in ranges of N layers
//! (`submit_chunk_layers`), one write batch per range: the same extents in more, smaller
//! batches, so the ratio shows what layer-wise streaming adds per batch (the first range plans
//! the chunk's blocks; `overhead_us_per_batch` is planning + posting per batch). `overhead_ratio` is (planning + posting) / transfer time over a run; the median over
//! the runs is reported (target ≤ 0.05). Every run zeroes the destination and checks every
//! fragment afterwards.

use std::ops::Range;
use std::process::ExitCode;
use std::time::Duration;

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::median;
use kvpipe_core::session::{GroupPart, LocalHello};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    chunk_window, plan_rank_group, plan_rank_group_layers, AnchoredRun, BlockId, BlockRun,
    DstCursor, Event, GroupShard, InstanceId, LayerGroupLayout, LayerRange, PoolLayout, RankGroup,
    ReceiverConfig, RegionId, RequestId, SenderConfig, SenderInput, WritePlan,
};
use kvpipe_mem::{
    Endpoint, MemPair, PairConfig, RegionUse, ResolvedBatch, RECEIVER_PEER, SENDER_PEER,
};
use serde::Serialize;

use super::transfer::{chunks, register_and_open, ContiguousSource};
use crate::slice_fit::SliceFit;
use crate::{preflight, CliError};

/// Layers of the benchmarked group.
const LAYERS: u16 = 80;
/// Tokens per block.
const TPB: u32 = 32;
/// Fragments per block: one per layer and K/V plane.
const PER_BLOCK: u32 = 2 * LAYERS as u32;

/// Arguments of `kvpipe bench fragments`.
#[derive(Debug, clap::Args)]
pub(crate) struct FragmentsBenchArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Fragments of 8 KiB to move (rounded up to whole blocks of 160).
    #[arg(long, default_value_t = 100_000)]
    fragments: u32,
    /// Tokens per prefill chunk (one write batch each).
    #[arg(long, default_value_t = 2048)]
    chunk_tokens: u32,
    /// Runs (medians are reported).
    #[arg(long, default_value_t = 5)]
    runs: u32,
    /// Copy threads of the transport (default: its own, min(cores, 4)).
    #[arg(long)]
    threads: Option<usize>,
    /// Submit each chunk in layer ranges of N layers (one write batch per range) instead of
    /// whole: the per-batch cost of layer-wise streaming, next to the same bytes' transfer.
    #[arg(long, value_name = "N")]
    layers_per_slice: Option<u16>,
}

/// The figures `kvpipe bench fragments` prints.
#[derive(Debug, Serialize)]
struct FragmentsBenchReport {
    /// (planning + posting) / transfer time, median over the runs (target ≤ 0.05).
    overhead_ratio: f64,
    fragments: u64,
    fragment_bytes: u64,
    /// Extents the transport was given (after coalescing) per run.
    extents: u64,
    write_batches: u32,
    /// Layers per write batch (`null`: whole chunks).
    layers_per_slice: Option<u16>,
    /// With layer slices: the last range's layers, and whether `layers_per_slice` was more
    /// than the group has (absent without).
    #[serde(flatten)]
    slice_fit: Option<SliceFit>,
    /// Microseconds of planning + posting per write batch (median run).
    overhead_us_per_batch: f64,
    /// Median over the runs of each run's total, in milliseconds.
    plan_ms: f64,
    post_ms: f64,
    transfer_ms: f64,
    /// Nanoseconds of planning + posting per extent (median run).
    overhead_ns_per_extent: f64,
    verified: bool,
    threads: usize,
    runs: u32,
    /// Every run's ratio.
    run_ratios: Vec<f64>,
}

/// The group as a rank holding `heads` of the model's 2 KV heads from `first_head` holds it, in
/// one pool `region`.
fn layout(region: u32, first_head: u16, heads: u16) -> LayerGroupLayout {
    let mut l = LayerGroupLayout {
        layers: LAYERS,
        kv_factor: 2,
        kv_heads: heads,
        head_dim: 128,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        shard: GroupShard {
            model_layers: LAYERS,
            first_layer: 0,
            model_kv_heads: 2,
            first_head,
        },
        ..LayerGroupLayout::default()
    };
    let slot_bytes = l.layer_block_bytes().unwrap_or(0) * u64::from(LAYERS);
    l.pools.push(PoolLayout {
        region: RegionId(region),
        layer_begin: 0,
        layers: LAYERS,
        slot_bytes,
    });
    l
}

pub(crate) fn run(args: FragmentsBenchArgs) -> Result<ExitCode, CliError> {
    preflight::at_least("--fragments", args.fragments.into(), 1)?;
    preflight::at_least("--chunk-tokens", args.chunk_tokens.into(), 1)?;
    preflight::at_least("--runs", args.runs.into(), 1)?;
    if let Some(n) = args.layers_per_slice {
        preflight::at_least("--layers-per-slice", n.into(), 1)?;
    }
    if let Some(t) = args.threads {
        preflight::at_least("--threads", t as u64, 1)?;
        preflight::at_most(
            "--threads",
            t as u64,
            preflight::MAX_THREADS,
            "copy threads",
        )?;
    }
    let blocks = args.fragments.max(1).div_ceil(PER_BLOCK);
    let slot_bytes = |heads| layout(1, 0, heads).pools[0].slot_bytes;
    preflight::MemoryNeed::new("--fragments")
        .add(
            format!("both pools of {blocks} block(s)"),
            (slot_bytes(1) + slot_bytes(2)).checked_mul(u64::from(blocks)),
        )
        .check()?;
    let tokens = blocks * TPB;
    let chunk_tokens = (args.chunk_tokens.max(TPB) / TPB) * TPB;
    let (s_topo, r_topo) = (
        Topology {
            tp_size: 2,
            tp_rank: 0,
            ..Topology::default()
        },
        Topology {
            tp_size: 1,
            ..Topology::default()
        },
    );
    let src_layout = layout(1, 0, 1);
    let dst_layout = layout(2, 0, 2);
    let mut src = vec![0u8; (u64::from(blocks) * src_layout.pools[0].slot_bytes) as usize];
    fill_filler(RegionId(1), 0, &mut src);
    let mut dst = vec![0u8; (u64::from(blocks) * dst_layout.pools[0].slot_bytes) as usize];
    // Touch every destination page now, so page faults stay out of the timed copies.
    dst.fill(1);

    let mut s_config = SenderConfig::new(LocalHello::new(
        InstanceId(1),
        s_topo,
        vec![src_layout.clone()],
    ));
    let mut r_config = ReceiverConfig::new(
        LocalHello::new(InstanceId(2), r_topo, vec![dst_layout.clone()]),
        5,
    );
    for d in [&mut s_config.deadlines, &mut r_config.deadlines] {
        d.write_completion = kvpipe_core::Duration::from_secs(60);
        d.result_wait = kvpipe_core::Duration::from_secs(120);
    }
    let mut config = PairConfig::new(s_config, r_config);
    if let Some(t) = args.threads {
        config.copy_threads = t.max(1);
    }
    let threads = config.copy_threads;
    let mut pair = MemPair::new(config)?;
    // SAFETY: `src` and `dst` outlive `pair` (dropped first, below), are never resized, and
    // are only touched here while no write batch is in flight (zeroing before a run, checking
    // after the receiver completed).
    unsafe {
        pair.register_host(
            Endpoint::Sender,
            RegionId(1),
            RegionUse::KvPool,
            src.as_mut_ptr(),
            src.len(),
        )?;
        pair.register_host(
            Endpoint::Receiver,
            RegionId(2),
            RegionUse::KvPool,
            dst.as_mut_ptr(),
            dst.len(),
        )?;
    }
    pair.connect()?;
    pair.drive_until(Duration::from_secs(10), |p| {
        p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
    })
    .map_err(|e| format!("handshake: {e}"))?;

    let mut anchored = AnchoredRun::empty(0);
    for b in 0..blocks {
        anchored.push(BlockId(b));
    }
    // The plan the sender makes, to check every fragment after each run.
    let mut expected = WritePlan::new();
    plan_rank_group(
        RankGroup {
            topology: &s_topo,
            layout: &src_layout,
        },
        RankGroup {
            topology: &r_topo,
            layout: &dst_layout,
        },
        &BlockRun {
            first_ordinal: 0,
            ids: (0..blocks).map(BlockId).collect(),
        },
        &anchored,
        &mut DstCursor::default(),
        &mut expected,
    )?;
    let fragment_bytes = 2 * 128 * u64::from(TPB);
    let fragments = u64::from(blocks) * u64::from(PER_BLOCK);

    let specs = chunks(tokens, chunk_tokens);
    // The layer ranges each chunk is submitted in (one: the whole chunk).
    let ranges: Vec<Range<u16>> = match args.layers_per_slice {
        Some(n) => (0..LAYERS)
            .step_by(usize::from(n.max(1)))
            .map(|b| b..b.saturating_add(n.max(1)).min(LAYERS))
            .collect(),
        None => std::iter::once(0..LAYERS).collect(),
    };
    // Each chunk's plan, as the sender makes it, for timing the transport's posting.
    let mut chunk_plans = Vec::with_capacity(specs.len());
    for spec in &specs {
        // One plan per layer range, as the sender plans each range's slice (the whole chunk's
        // pairing kept to the range's layers).
        let mut range_plans = Vec::with_capacity(ranges.len());
        for layers in &ranges {
            let mut plan = WritePlan::new();
            if let Some(w) = chunk_window(spec, &src_layout)? {
                plan_rank_group_layers(
                    RankGroup {
                        topology: &s_topo,
                        layout: &src_layout,
                    },
                    RankGroup {
                        topology: &r_topo,
                        layout: &dst_layout,
                    },
                    &BlockRun {
                        first_ordinal: w.begin,
                        ids: (w.begin..w.end).map(BlockId).collect(),
                    },
                    &anchored,
                    layers.clone(),
                    &mut DstCursor::default(),
                    &mut plan,
                )?;
            }
            range_plans.push(plan);
        }
        chunk_plans.push(range_plans);
    }
    let mut source = ContiguousSource { blocks };
    let (mut plan_ms, mut post_ms, mut copy_ms, mut ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut verified = true;
    for run in 0..args.runs.max(1) {
        let request = RequestId(u64::from(run) + 1);
        dst.fill(0);
        // One endpoint per writer: this pair receives the sender's heads only.
        let part = GroupPart::written_by(&s_topo, &src_layout, &r_topo, &dst_layout);
        register_and_open(
            &mut pair,
            request,
            tokens,
            vec![anchored.clone()],
            Some(vec![part]),
            true,
        )?;
        // Only this request's batches are timed below.
        drop(pair.take_batch_timings());
        let (mut plan_s, mut post_s) = (0.0, 0.0);
        let secs = |d: kvpipe_core::Duration| d.as_nanos() as f64 / 1e9;
        for (spec, plans) in specs.iter().zip(&chunk_plans) {
            for (layers, plan) in ranges.iter().zip(plans) {
                let t0 = pair.now();
                match args.layers_per_slice {
                    Some(_) => pair.sender_mut().submit_chunk_layers(
                        t0,
                        request,
                        *spec,
                        LayerRange::new(layers.start.into(), layers.end.into()),
                        &mut source,
                    )?,
                    None => pair
                        .sender_mut()
                        .submit_chunk(t0, request, *spec, &mut source)?,
                };
                plan_s += secs(pair.now() - t0);
                pair.pump()?;
                // Let the copy finish before the next batch: nothing else runs during it.
                pair.drive_until(Duration::from_secs(60), |p| p.writes_in_flight() == 0)
                    .map_err(|e| format!("copy: {e}"))?;
                let t2 = pair.now();
                let resolved = ResolvedBatch::resolve(
                    plan,
                    pair.regions(Endpoint::Sender),
                    pair.regions(Endpoint::Receiver),
                )?;
                post_s += secs(pair.now() - t2);
                drop(resolved);
            }
        }
        let now = pair.now();
        pair.sender_mut().handle_input(SenderInput::Aux {
            now,
            request,
            data: AuxData {
                prompt_tokens: tokens,
                ..AuxData::default()
            },
        })?;
        let mut completed = false;
        let mut quiesced = 0;
        pair.drive_until(Duration::from_secs(60), |p| {
            for (side, _, e) in p.take_events() {
                match e {
                    Event::Completed { .. } if side == Endpoint::Receiver => completed = true,
                    Event::Quiesced { .. } => quiesced += 1,
                    _ => {}
                }
            }
            completed && quiesced >= 2
        })
        .map_err(|e| format!("transfer: {e}"))?;
        let timings = &pair.take_batch_timings();
        let copy_s: f64 = timings
            .iter()
            .map(|t| (t.copy_finished - t.copy_started).as_nanos() as f64 / 1e9)
            .sum();
        let now = pair.now();
        pair.sender_mut().retire(now, request)?;
        pair.receiver_mut().retire(now, request)?;
        verified &= expected.extents().iter().all(|e| {
            let (s, d, n) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
            src[s..s + n] == dst[d..d + n]
        });
        plan_ms.push(plan_s * 1e3);
        post_ms.push(post_s * 1e3);
        copy_ms.push(copy_s * 1e3);
        ratios.push((plan_s + post_s) / copy_s);
    }
    drop(pair);
    let extents = expected.len() as u64;
    let overhead_ratio = median(ratios.clone());
    let plan = median(plan_ms);
    let post = median(post_ms);
    let transfer = median(copy_ms);
    let report = FragmentsBenchReport {
        overhead_ratio,
        fragments,
        fragment_bytes,
        extents,
        write_batches: (specs.len() * ranges.len()) as u32,
        layers_per_slice: args.layers_per_slice,
        slice_fit: args
            .layers_per_slice
            .map(|n| SliceFit::of(n, ranges.iter().map(|r| u32::from(r.end - r.start)))),
        overhead_us_per_batch: (plan + post) * 1e3 / (specs.len() * ranges.len()) as f64,
        plan_ms: plan,
        post_ms: post,
        transfer_ms: transfer,
        overhead_ns_per_extent: (plan + post) * 1e6 / extents as f64,
        verified,
        threads,
        runs: args.runs.max(1),
        run_ratios: ratios,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{fragments} fragments of {fragment_bytes} B ({extents} extents after coalescing) in {} batches{} over mem, {threads} copy thread(s)",
            report.write_batches,
            match (args.layers_per_slice, report.slice_fit) {
                (Some(n), Some(fit)) => format!(" of {n} layers (last range: {})", fit.note()),
                _ => String::new(),
            }
        );
        println!("planning   {plan:.2} ms");
        println!("posting    {post:.2} ms");
        println!("transfer   {transfer:.2} ms");
        println!(
            "overhead   {:.3} of the transfer time (target ≤ 0.05), {:.1} ns per extent; verified: {verified}",
            overhead_ratio, report.overhead_ns_per_extent
        );
        println!(
            "per batch  {:.1} µs of planning + posting",
            report.overhead_us_per_batch
        );
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
