//! `kvpipe bench transfer`: bytes per second of a whole request's KV moved by a transport,
//! against plain `memcpy` of the same extents in the same run.
//!
//! One llama3-8b request (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token) of
//! 32768 tokens — 4 GiB of KV — is held in one sender pool and transferred into one receiver
//! pool, chunk by chunk, through the real sessions and the transport (frames encoded, write
//! batches copied on the transport's threads). The transport's time runs from the first chunk's
//! submission to the receiver's completion. The baseline copies the same coalesced extents
//! (planned by the same planner) with `copy_from_slice`, split over the same number of threads
//! the same way. Each run zeroes the destination first and verifies it after the transport's
//! copy; the transport and the baseline run back to back, in alternating order. Figures are
//! medians over the runs; `ratio` is the median of the runs' own ratios (each run's transport
//! and baseline ran back to back, so a change in the machine's load between runs cancels out),
//! `ratio_of_medians` is `gbps / baseline_gbps`. When the machine lacks memory for both pools the
//! prompt is shortened to what fits (reported as `tokens`, with `memory_limited: true`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::median;
use kvpipe_core::session::{LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    plan_group, AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Event,
    GroupIndex, InstanceId, LayerGroupLayout, PoolLayout, ReceiverConfig, RegionId, RequestId,
    SenderConfig, SenderInput, WritePlan,
};
use kvpipe_mem::{
    split_even, Endpoint, MemPair, PairConfig, RegionUse, RECEIVER_PEER, SENDER_PEER,
};
use serde::Serialize;

use crate::{preflight, CliError};

mod device;
mod pair;
mod peer;
mod tcp;
mod tcp_device;
mod verbs;

/// Arguments of `kvpipe bench transfer`.
#[derive(Debug, clap::Args)]
pub(crate) struct TransferBenchArgs {
    /// Transport to measure (mem, tcp or verbs).
    #[arg(long, default_value = "mem")]
    transport: String,
    /// With --transport verbs: the RDMA device (default: the first with an active port).
    #[arg(long)]
    device: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Tokens in the request (128 KiB of KV each).
    #[arg(long, default_value_t = 32_768)]
    tokens: u32,
    /// Tokens per prefill chunk (one write batch each), rounded down to whole blocks of
    /// --tokens-per-block (at least one block).
    #[arg(long, default_value_t = 4096)]
    chunk_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Timed runs (medians are reported).
    #[arg(long, default_value_t = 7)]
    runs: u32,
    /// Copy threads for the transport and the baseline (default: the transport's default,
    /// min(cores, 4)).
    #[arg(long)]
    threads: Option<usize>,
    /// Connections per peer (tcp; the tcp-raw baseline uses as many plain sockets; default 4).
    #[arg(long)]
    connections: Option<usize>,
    /// Most bytes per socket write of the transport (tcp; at least 4096; default:
    /// `TcpConfig`'s).
    #[arg(long)]
    socket_write_bytes: Option<usize>,
    /// Most payload bytes per socket read of the transport (tcp; at least 4096; default:
    /// `TcpConfig`'s).
    #[arg(long)]
    socket_read_bytes: Option<usize>,
    /// Where both sides' KV pools live: host, or device (GPU 0, against cuMemcpyDtoDAsync of
    /// the same extents; needs the `cuda` feature).
    #[arg(long, default_value = "host")]
    memory: String,
    /// With --memory device: wait for the transfer by polling the driver (poll, the default) or
    /// by sleeping on the copy worker's reports (block).
    #[arg(long)]
    driver_wait: Option<String>,
    /// With --transport tcp --memory device: bytes per pinned staging slot (default:
    /// `TcpConfig`'s).
    #[arg(long)]
    staging_slot_bytes: Option<usize>,
    /// With --transport tcp --memory device: staging slots per connection half (default:
    /// `TcpConfig`'s).
    #[arg(long)]
    staging_slots: Option<usize>,
    /// With --memory device: measure the peer-copy data path across two processes instead —
    /// this program started as `serve` with its pools on GPU N and as `demo --connect` on
    /// --gpu, the whole request as one write batch copied by CUDA IPC — against
    /// `cuda-memcpy-peer` of the same bytes in the transport's pieces.
    #[arg(long, value_name = "N")]
    peer_gpu: Option<usize>,
    /// With --peer-gpu: the prefill side's GPU (default 0).
    #[arg(long)]
    gpu: Option<usize>,
}

impl TransferBenchArgs {
    /// Connections per peer (`--connections`, default 4).
    pub(super) fn connections(&self) -> usize {
        self.connections.unwrap_or(4)
    }

    /// How the device runs wait (`--driver-wait`, default poll).
    pub(super) fn driver_wait(&self) -> &str {
        self.driver_wait.as_deref().unwrap_or("poll")
    }

    /// The prefill side's GPU of a peer-copy run (`--gpu`, default 0).
    #[cfg(feature = "cuda")]
    pub(super) fn gpu(&self) -> usize {
        self.gpu.unwrap_or(0)
    }
}

/// The figures `kvpipe bench transfer` prints.
#[derive(Debug, Serialize)]
struct TransferBenchReport {
    transport: String,
    bytes: u64,
    seconds: f64,
    gbps: f64,
    baseline: &'static str,
    baseline_seconds: f64,
    baseline_gbps: f64,
    /// Median over runs of each run's own ratio (baseline time / transport time): robust to
    /// the machine's load changing between runs.
    ratio: f64,
    /// `gbps / baseline_gbps`.
    ratio_of_medians: f64,
    verified: bool,
    model: &'static str,
    tokens: u32,
    chunk_tokens: u32,
    write_batches: u32,
    threads: usize,
    runs: u32,
    memory_limited: bool,
    /// Every run's seconds, transport then baseline.
    transport_runs_s: Vec<f64>,
    baseline_runs_s: Vec<f64>,
}

/// Registers `request` at the pair's decode side (its blocks `groups`, written by the prefill
/// side alone, which holds `expected_part` of them) and opens it at the prefill side, towards
/// the decode side; with `wait`, drives the pair until the prefill side has the registration.
pub(super) fn register_and_open(
    pair: &mut MemPair,
    request: RequestId,
    prompt_len: u32,
    groups: Vec<AnchoredRun>,
    expected_part: Option<Vec<kvpipe_core::session::GroupPart>>,
    wait: bool,
) -> Result<(), CliError> {
    let now = pair.now();
    pair.receiver_mut().register(
        now,
        Registration {
            request,
            prompt_len,
            groups,
            writers: std::iter::once(SENDER_PEER).collect(),
            aux_capacity: 64,
            expected_part,
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
    if !wait {
        return Ok(());
    }
    let mut registered = false;
    pair.drive_until(Duration::from_secs(10), |p| {
        registered |= p
            .take_events()
            .iter()
            .any(|(_, _, e)| matches!(e, Event::Registered { request: r, .. } if *r == request));
        registered
    })
    .map_err(|e| format!("registration: {e}").into())
}

/// A block source over one contiguous allocation: ordinal `o` lives in slot `o`.
pub(super) struct ContiguousSource {
    /// Blocks allocated.
    pub(super) blocks: u32,
}

impl BlockSource for ContiguousSource {
    fn block_run(
        &mut self,
        request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let _ = request;
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end > self.blocks {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: self.blocks,
            });
        }
        out.first_ordinal = begin;
        out.ids.clear();
        out.ids.extend((begin..end).map(BlockId));
        Ok(())
    }
}

fn layout(region: u32, tpb: u32) -> LayerGroupLayout {
    let mut l = LayerGroupLayout {
        layers: 32,
        kv_factor: 2,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        tokens_per_block: tpb,
        window: None,
        ..LayerGroupLayout::default()
    };
    let slot_bytes = l.layer_block_bytes().unwrap_or(0) * 32;
    l.pools.push(PoolLayout {
        region: RegionId(region),
        layer_begin: 0,
        layers: 32,
        slot_bytes,
    });
    l
}

/// Bytes of memory the kernel says are available.
pub(super) fn mem_available() -> Option<u64> {
    preflight::mem_available()
}

/// The smallest socket write or read `--socket-write-bytes`/`--socket-read-bytes` take: a page.
const MIN_SOCKET_CALL_BYTES: u64 = 4096;
/// The largest: 1 GiB (a larger call is cut to what the kernel takes anyway).
const MAX_SOCKET_CALL_BYTES: u64 = 1 << 30;

/// Flags of another transport or memory than this run's are refused, naming what they apply
/// to, rather than ignored.
fn refuse_outside_their_mode(args: &TransferBenchArgs) -> Result<(), CliError> {
    let (transport, memory) = (args.transport.as_str(), args.memory.as_str());
    let (tcp, device) = (transport == "tcp", memory == "device");
    let socket = "--transport tcp";
    preflight::refuse_misplaced(
        &[
            (args.connections.is_some(), tcp, "--connections", socket),
            (
                args.socket_write_bytes.is_some(),
                tcp,
                "--socket-write-bytes",
                socket,
            ),
            (
                args.socket_read_bytes.is_some(),
                tcp,
                "--socket-read-bytes",
                socket,
            ),
            (
                args.device.is_some(),
                transport == "verbs",
                "--device",
                "--transport verbs",
            ),
            (
                args.driver_wait.is_some(),
                device,
                "--driver-wait",
                "--memory device",
            ),
            (
                args.staging_slot_bytes.is_some(),
                tcp && device,
                "--staging-slot-bytes",
                "--transport tcp --memory device",
            ),
            (
                args.staging_slots.is_some(),
                tcp && device,
                "--staging-slots",
                "--transport tcp --memory device",
            ),
            (
                args.gpu.is_some(),
                args.peer_gpu.is_some(),
                "--gpu",
                "--peer-gpu",
            ),
        ],
        &format!(
            "--transport {transport} and --memory {memory}{}",
            if args.peer_gpu.is_some() {
                " with --peer-gpu"
            } else {
                ""
            }
        ),
    )
}

/// Ranges, and the smallest run (one chunk, or the whole request if shorter) in host memory:
/// the transports' runs shorten the request to what fits, never below that.
fn preflight_transfer(args: &TransferBenchArgs) -> Result<(), CliError> {
    preflight::at_least("--tokens", args.tokens.into(), 1)?;
    preflight::at_least("--chunk-tokens", args.chunk_tokens.into(), 1)?;
    preflight::at_least("--tokens-per-block", args.tokens_per_block.into(), 1)?;
    preflight::at_least("--runs", args.runs.into(), 1)?;
    // Smaller socket calls make the transfer crawl (a syscall per few bytes) until the
    // liveness deadlines fail it: they measure nothing.
    for (flag, bytes) in [
        ("--socket-write-bytes", args.socket_write_bytes),
        ("--socket-read-bytes", args.socket_read_bytes),
    ] {
        if let Some(b) = bytes {
            preflight::at_least(flag, b as u64, MIN_SOCKET_CALL_BYTES)?;
            preflight::at_most(flag, b as u64, MAX_SOCKET_CALL_BYTES, "one socket call")?;
        }
    }
    if !matches!(args.driver_wait(), "poll" | "block") {
        return Err(format!(
            "--driver-wait must be poll or block (got {:?})",
            args.driver_wait()
        )
        .into());
    }
    refuse_outside_their_mode(args)?;
    if let Some(t) = args.threads {
        preflight::at_least("--threads", t as u64, 1)?;
        preflight::at_most(
            "--threads",
            t as u64,
            preflight::MAX_THREADS,
            "copy threads",
        )?;
    }
    preflight::at_least("--connections", args.connections() as u64, 1)?;
    preflight::at_most(
        "--connections",
        args.connections() as u64,
        255,
        "a bundle's size",
    )?;
    if args.memory != "host" {
        return Ok(());
    }
    let tpb = args.tokens_per_block;
    let slot_bytes = layout(1, tpb)
        .layer_block_bytes()
        .and_then(|b| b.checked_mul(32));
    let chunk = args.chunk_tokens.max(tpb) / tpb * tpb;
    let blocks = args.tokens.min(chunk).div_ceil(tpb);
    preflight::MemoryNeed::new("--tokens-per-block or --chunk-tokens")
        .add(
            format!("both pools of at least {blocks} block(s)"),
            slot_bytes.and_then(|s| s.checked_mul(u64::from(blocks))?.checked_mul(2)),
        )
        .check()
}

/// Blocks `0..blocks` in slots `0..blocks`: the bench's registration on either side.
pub(super) fn slots(blocks: u32) -> AnchoredRun {
    let mut run = AnchoredRun::empty(0);
    for b in 0..blocks {
        run.push(BlockId(b));
    }
    run
}

/// The write plans the sender makes for `specs` (chunks of one request whose `blocks` blocks
/// of `tpb` tokens sit in slots `0..blocks` on both sides): what the baselines copy and the
/// checks compare.
pub(super) fn sender_plans(
    src_layout: &LayerGroupLayout,
    dst_layout: &LayerGroupLayout,
    specs: &[ChunkSpec],
    blocks: u32,
    tpb: u32,
) -> Result<Vec<WritePlan>, CliError> {
    let anchored = slots(blocks);
    let mut plans = Vec::with_capacity(specs.len());
    let mut prev_end = 0;
    for spec in specs {
        let end = if spec.is_last { blocks } else { spec.end / tpb };
        let run = BlockRun {
            first_ordinal: prev_end,
            ids: (prev_end..end).map(BlockId).collect(),
        };
        prev_end = end;
        let mut plan = WritePlan::new();
        plan_group(src_layout, dst_layout, &run, &anchored, &mut plan)?;
        plans.push(plan);
    }
    Ok(plans)
}

/// The chunks of a prompt of `tokens` tokens in chunks of `chunk`, no prefix.
pub(super) fn chunks(tokens: u32, chunk: u32) -> Vec<ChunkSpec> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < tokens {
        let end = start.saturating_add(chunk).min(tokens);
        out.push(ChunkSpec {
            start,
            end,
            prompt_len: tokens,
            prepopulated_len: 0,
            is_last: end == tokens,
            prefix_sent_early: false,
        });
        start = end;
    }
    out
}

pub(crate) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
    preflight_transfer(&args)?;
    if let Some(n) = args.peer_gpu {
        if args.memory != "device" {
            return Err("--peer-gpu needs --memory device".into());
        }
        return peer::run(args, n);
    }
    match args.memory.as_str() {
        "host" => {}
        "device" if args.transport == "tcp" => return tcp_device::run(args),
        "device" => return device::run(args),
        other => return Err(format!("--memory {other:?}: use host or device").into()),
    }
    if args.transport == "tcp" {
        return tcp::run(args);
    }
    if args.transport == "verbs" {
        return verbs::run(args);
    }
    if args.transport != "mem" {
        return Err(format!(
            "transport {:?} has no transfer bench yet; use --transport mem, tcp or verbs",
            args.transport
        )
        .into());
    }
    let tpb = args.tokens_per_block.max(1);
    let chunk_tokens = args.chunk_tokens.max(tpb) / tpb * tpb;
    let src_layout = layout(1, tpb);
    let dst_layout = layout(2, tpb);
    let slot_bytes = src_layout.pools[0].slot_bytes;
    let per_token = slot_bytes / u64::from(tpb);
    // Fit both pools (plus a margin) into the memory available.
    let mut tokens = args.tokens.max(1);
    let mut memory_limited = false;
    if let Some(avail) = mem_available() {
        let budget = avail.saturating_sub(1 << 30) / 2;
        if u64::from(tokens) * per_token > budget {
            tokens = ((budget / per_token) as u32 / chunk_tokens * chunk_tokens).max(chunk_tokens);
            memory_limited = true;
        }
    }
    let blocks = tokens.div_ceil(tpb);
    let pool_bytes = (u64::from(blocks) * slot_bytes) as usize;
    let mut src = vec![0u8; pool_bytes];
    fill_filler(RegionId(1), 0, &mut src);
    let mut dst = vec![0u8; pool_bytes];
    // Touch every destination page now: first-touch page faults would otherwise land in the
    // first timed run (and stall the connection's heartbeats while the pages are mapped).
    dst.fill(1);

    let hello = |i, l: &LayerGroupLayout| {
        LocalHello::new(InstanceId(i), Topology::default(), vec![l.clone()])
    };
    let mut config = PairConfig::new(
        SenderConfig::new(hello(1, &src_layout)),
        ReceiverConfig::new(hello(2, &dst_layout), 11),
    );
    if let Some(t) = args.threads {
        config.copy_threads = t.max(1);
    }
    let threads = config.copy_threads;
    let threshold = config.parallel_threshold;
    let mut pair = MemPair::new(config)?;
    // SAFETY: `src` and `dst` outlive `pair` (dropped before them at the end of this
    // function), are never resized, and are only touched here between transfers (zeroing and
    // verification happen after the receiver completed, when no write batch is in flight).
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

    // The plans the sender makes, for the baseline.
    let specs = chunks(tokens, chunk_tokens);
    let plans = sender_plans(&src_layout, &dst_layout, &specs, blocks, tpb)?;
    let anchored = slots(blocks);
    let bytes: u64 = plans.iter().map(WritePlan::total_bytes).sum();

    let mut source = ContiguousSource { blocks };
    let mut t_transport = Vec::new();
    let mut t_baseline = Vec::new();
    let mut verified = true;
    for run in 0..args.runs.max(1) {
        let request = RequestId(u64::from(run) + 1);
        // Alternate which goes first, so a drift in the machine's load hits both alike.
        if run % 2 == 1 {
            t_baseline.push(baseline_run(&src, &mut dst, &plans, threads, threshold));
        }
        dst.fill(0);
        // Set up: the receiver registers and the sender has the registration before timing.
        register_and_open(
            &mut pair,
            request,
            tokens,
            vec![anchored.clone()],
            None,
            true,
        )?;
        // Timed: every chunk submitted, until the receiver completes.
        let t0 = Instant::now();
        for spec in &specs {
            let now = pair.now();
            pair.sender_mut()
                .submit_chunk(now, request, *spec, &mut source)?;
            pair.pump()?;
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
        pair.drive_until(Duration::from_secs(600), |p| {
            for (side, _, e) in p.take_events() {
                match e {
                    Event::Completed { .. } if side == Endpoint::Receiver => completed = true,
                    Event::Quiesced { .. } => quiesced += 1,
                    _ => {}
                }
            }
            completed
        })
        .map_err(|e| format!("transfer: {e}"))?;
        t_transport.push(t0.elapsed().as_secs_f64());
        pair.drive_until(Duration::from_secs(10), |p| {
            quiesced += p
                .take_events()
                .iter()
                .filter(|(_, _, e)| matches!(e, Event::Quiesced { .. }))
                .count();
            quiesced >= 2
        })
        .map_err(|e| format!("quiesce: {e}"))?;
        let now = pair.now();
        pair.sender_mut().retire(now, request)?;
        pair.receiver_mut().retire(now, request)?;
        verified &= plans.iter().flat_map(|p| p.extents()).all(|e| {
            let (s, d, n) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
            src[s..s + n] == dst[d..d + n]
        });

        if run % 2 == 0 {
            t_baseline.push(baseline_run(&src, &mut dst, &plans, threads, threshold));
        }
    }
    drop(pair);
    // Each run's transport and baseline ran back to back: the median of the runs' own ratios
    // is the figure of merit; the ratio of the medians is reported beside it.
    let paired_ratio = median(
        t_transport
            .iter()
            .zip(&t_baseline)
            .map(|(t, b)| b / t)
            .collect(),
    );

    let seconds = median(t_transport.clone());
    let baseline_seconds = median(t_baseline.clone());
    let gbps = bytes as f64 / seconds / 1e9;
    let baseline_gbps = bytes as f64 / baseline_seconds / 1e9;
    let report = TransferBenchReport {
        transport: args.transport,
        bytes,
        seconds,
        gbps,
        baseline: "memcpy",
        baseline_seconds,
        baseline_gbps,
        ratio: paired_ratio,
        ratio_of_medians: gbps / baseline_gbps,
        verified,
        model: "llama3-8b",
        tokens,
        chunk_tokens,
        write_batches: plans.len() as u32,
        threads,
        runs: args.runs.max(1),
        memory_limited,
        transport_runs_s: t_transport,
        baseline_runs_s: t_baseline,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "transfer over {}: {} bytes ({} tokens of llama3-8b KV, {} batches) in {:.3} s = {:.2} GB/s",
            report.transport, bytes, tokens, report.write_batches, seconds, gbps
        );
        println!(
            "baseline memcpy of the same extents on {threads} thread(s): {baseline_seconds:.3} s = {baseline_gbps:.2} GB/s"
        );
        println!(
            "ratio {:.3} (target ≥ 0.9), verified: {verified}{}",
            report.ratio,
            if memory_limited {
                " (prompt shortened to fit memory)"
            } else {
                ""
            }
        );
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The baseline: zeroes `dst`, then copies every plan with `memcpy_plan`; returns the seconds
/// the copies took.
fn baseline_run(
    src: &[u8],
    dst: &mut [u8],
    plans: &[WritePlan],
    threads: usize,
    threshold: u64,
) -> f64 {
    dst.fill(0);
    let t0 = Instant::now();
    for plan in plans {
        memcpy_plan(src, dst, plan, threads, threshold);
    }
    t0.elapsed().as_secs_f64()
}

/// Copies `plan`'s extents from `src` to `dst` with `copy_from_slice`, split over `threads`
/// threads exactly as the transport splits a batch.
fn memcpy_plan(src: &[u8], dst: &mut [u8], plan: &WritePlan, threads: usize, threshold: u64) {
    let extents = plan.extents();
    if threads <= 1 || plan.total_bytes() < threshold {
        for e in extents {
            let (s, d, n) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
        return;
    }
    let lens: Vec<usize> = extents.iter().map(|e| e.len as usize).collect();
    let shares = split_even(&lens, threads);
    let dst_len = dst.len();
    let dst_addr = dst.as_mut_ptr() as usize;
    std::thread::scope(|scope| {
        let work = move |share: Vec<kvpipe_mem::Piece>| {
            for p in share {
                let e = &extents[p.index];
                let s = e.src_offset as usize + p.offset;
                let d = e.dst_offset as usize + p.offset;
                assert!(d + p.len <= dst_len);
                // SAFETY: `split_even` hands out disjoint pieces and the plan's destination
                // extents do not overlap, so no two threads write the same byte; the range is
                // inside `dst` (checked above), which outlives the scope.
                let out =
                    unsafe { std::slice::from_raw_parts_mut((dst_addr as *mut u8).add(d), p.len) };
                out.copy_from_slice(&src[s..s + p.len]);
            }
        };
        let mut shares = shares.into_iter();
        let first = shares.next().unwrap_or_default();
        for share in shares {
            scope.spawn(move || work(share));
        }
        work(first);
    });
}
