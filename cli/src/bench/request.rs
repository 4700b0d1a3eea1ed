//! `kvpipe bench request`: the fixed cost the protocol adds to one request's exposed tail, on the
//! in-process transport, against the bare copy of the same bytes measured in the same run.
//!
//! With layer-wise streaming the exposed tail is the last layer range's transfer plus what the
//! protocol does around it: the sender plans the range's writes and hands them out, the
//! transport admits them at the receiver and issues the copy, the copy's end is seen and
//! reported, the last result and the aux data reach the decode side, and it completes. This
//! bench makes the copy tiny, so that what is left is that fixed cost.
//!
//! Each request is one 256-token chunk (16 blocks of 16 tokens) of a 32-layer model, submitted
//! in 8 ranges of 4 layers. Everything before the last range is driven to rest first; then the
//! last range is timed from the engine's submit to the decode side's `Completed` (`total`), and,
//! before or after it (alternating), the **baseline**: the same 16 extents of 2 KiB copied
//! without the protocol, into a buffer of their own — `memcpy` for host memory; with
//! `--memory device`, one submit of the same extents to the GPU copy engine the transport uses
//! (`kvpipe_cuda::CopyEngine`, which issues them as one row-copy kernel) polled until its event
//! completes. `protocol_us` is the median over the requests of `total − baseline`, each request
//! against its own baseline. Printed too, the last range's parts (medians): `submit` (the core's
//! `submit_chunk_layers` and the aux data), `issue` (until the transport takes the batch: the
//! pump reaching it), `copy` (the batch taken → the sender's outcome: the receiver's admissions,
//! the copy's issue and the copy, its report and the receiver's write-finished inputs) and
//! `complete` (outcome → decode side complete).
//!
//! With device memory the GPU is kept computing by default (`--gpu busy`: a one-thread kernel on
//! a stream of its own, relaunched whenever it ends, as a serving engine's prefill keeps its GPU
//! busy); `--gpu idle` leaves it idle between copies. 100 untimed requests warm both paths up.
//! Every request's destination is zeroed first and compared with the source after.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::{median, percentile};
use kvpipe_core::session::LocalHello;
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, ChunkSpec, Event, InstanceId, LayerGroupLayout, LayerRange, PoolLayout,
    ReceiverConfig, RegionId, RequestId, SenderConfig,
};
use kvpipe_mem::{Endpoint, MemPair, PairConfig, RegionUse, RECEIVER_PEER, SENDER_PEER};
use serde::Serialize;

use super::transfer::{register_and_open, ContiguousSource};
use crate::CliError;

const LAYERS: u16 = 32;
const TOKENS_PER_BLOCK: u32 = 16;
const HEAD_DIM: u16 = 8;
const BLOCKS: u32 = 16;
const PROMPT: u32 = BLOCKS * TOKENS_PER_BLOCK;
const LAYERS_PER_RANGE: u16 = 4;
/// One layer of one block: K and V, one head, bf16.
const LAYER_BYTES: u64 = 2 * TOKENS_PER_BLOCK as u64 * HEAD_DIM as u64 * 2;
/// A block's slot, laid out `[layer][K|V][head][token][dim]`.
const SLOT: u64 = LAYERS as u64 * LAYER_BYTES;
const POOL: usize = (BLOCKS as u64 * SLOT) as usize;
/// Untimed requests before the measured ones.
const WARM_UP: u64 = 100;
/// The issue-30 target for the fixed cost per request (device memory, one H200).
const TARGET_US: f64 = 10.0;

/// Where both sides' pools live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PoolPlace {
    Host,
    Device,
}

/// What the GPU does while requests are measured (`--memory device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum GpuLoad {
    /// A kernel keeps it computing, as a serving engine's prefill does.
    Busy,
    /// Idle between copies.
    Idle,
}

/// Arguments of `kvpipe bench request`.
#[derive(Debug, clap::Args)]
pub(crate) struct RequestBenchArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Requests measured (after 100 untimed ones).
    #[arg(long, default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    requests: u64,
    /// Where both sides' pools live: host memory, or device memory of GPU 0 (needs kvpipe built
    /// with the `cuda` feature).
    #[arg(long, value_enum, default_value_t = PoolPlace::Host)]
    memory: PoolPlace,
    /// With --memory device: keep the GPU computing while requests are measured (busy, the
    /// default) or leave it idle between copies.
    #[arg(long, value_enum)]
    gpu: Option<GpuLoad>,
}

/// Median and 90th percentile (nearest rank) of one figure, in µs.
#[derive(Debug, Serialize)]
struct Spread {
    p50: f64,
    p90: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Spread {
        Spread {
            p50: median(v.to_vec()),
            p90: percentile(v, 90.0),
        }
    }
}

/// The figures `kvpipe bench request` prints.
#[derive(Debug, Serialize)]
struct RequestReport {
    memory: &'static str,
    /// `busy` or `idle` with device memory, `none` with host memory.
    gpu: &'static str,
    requests: u64,
    /// Bytes of the last range (its 16 extents).
    range_bytes: u64,
    /// The last range's submit → decode side complete.
    total_us: Spread,
    /// The same extents copied without the protocol (memcpy, or the GPU copy engine).
    baseline: &'static str,
    baseline_us: Spread,
    /// Per request, `total − baseline`: what the protocol adds to the tail.
    protocol_us: Spread,
    /// `median(total) / median(baseline)`.
    ratio: f64,
    target_protocol_us: f64,
    /// The last range's parts (µs, medians).
    submit_us: f64,
    issue_us: f64,
    copy_us: f64,
    complete_us: f64,
    verified: bool,
}

/// Both pools and the baseline's destination, and how to copy the range without the protocol.
trait Pools {
    /// Registers the source with the sender and the destination with the receiver.
    ///
    /// # Safety
    /// `self` must outlive `pair`.
    unsafe fn register(&mut self, pair: &mut MemPair) -> Result<(), CliError>;
    /// Zeroes both destinations.
    fn clear(&mut self) -> Result<(), CliError>;
    /// Copies the extents `(offset, len)` from the source to the baseline's destination and
    /// waits until they landed.
    fn baseline(&mut self, extents: &[(u64, u64)]) -> Result<(), CliError>;
    /// Whether the destination equals the source (and the baseline's copied the extents).
    fn verify(&self, extents: &[(u64, u64)]) -> Result<bool, CliError>;
    /// Lets the GPU work meanwhile, as `--gpu` says (nothing for host memory).
    fn keep_busy(&mut self) -> Result<(), CliError>;
}

/// Host pools.
struct HostPools {
    src: Vec<u8>,
    dst: Vec<u8>,
    copy: Vec<u8>,
}

impl Pools for HostPools {
    unsafe fn register(&mut self, pair: &mut MemPair) -> Result<(), CliError> {
        // SAFETY: the caller keeps `self` alive past `pair`; the buffers are not moved (no
        // push) and are touched here only while no request holds their blocks.
        unsafe {
            pair.register_host(
                Endpoint::Sender,
                RegionId(1),
                RegionUse::KvPool,
                self.src.as_mut_ptr(),
                POOL,
            )?;
            pair.register_host(
                Endpoint::Receiver,
                RegionId(2),
                RegionUse::KvPool,
                self.dst.as_mut_ptr(),
                POOL,
            )?;
        }
        Ok(())
    }

    fn clear(&mut self) -> Result<(), CliError> {
        self.dst.fill(0);
        self.copy.fill(0);
        Ok(())
    }

    fn baseline(&mut self, extents: &[(u64, u64)]) -> Result<(), CliError> {
        for &(offset, len) in extents {
            let r = offset as usize..(offset + len) as usize;
            self.copy[r.clone()].copy_from_slice(&self.src[r]);
        }
        Ok(())
    }

    fn verify(&self, extents: &[(u64, u64)]) -> Result<bool, CliError> {
        Ok(self.dst == self.src
            && extents.iter().all(|&(o, l)| {
                let r = o as usize..(o + l) as usize;
                self.copy[r.clone()] == self.src[r]
            }))
    }

    fn keep_busy(&mut self) -> Result<(), CliError> {
        Ok(())
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The last range's extents: each block's layers of the range, `(offset, len)` in its pool.
fn range_extents(range: LayerRange) -> Vec<(u64, u64)> {
    let len = u64::from(range.len()) * LAYER_BYTES;
    (0..u64::from(BLOCKS))
        .map(|b| (b * SLOT + u64::from(range.begin) * LAYER_BYTES, len))
        .collect()
}

fn layout(region: u32) -> Vec<LayerGroupLayout> {
    let mut l = LayerGroupLayout {
        layers: LAYERS,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: HEAD_DIM,
        elem_bytes: 2,
        tokens_per_block: TOKENS_PER_BLOCK,
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

pub(super) fn run(args: RequestBenchArgs) -> Result<ExitCode, CliError> {
    let mut src = vec![0u8; POOL];
    fill_filler(RegionId(1), 0, &mut src);
    match (args.memory, args.gpu) {
        (PoolPlace::Host, Some(_)) => {
            Err("--gpu applies to --memory device (host memory leaves the GPU out)".into())
        }
        (PoolPlace::Host, None) => {
            let pools = HostPools {
                src,
                dst: vec![0; POOL],
                copy: vec![0; POOL],
            };
            measure(&args, pools, "host", "none", "memcpy")
        }
        (PoolPlace::Device, load) => device::run(&args, src, load.unwrap_or(GpuLoad::Busy)),
    }
}

/// Runs the requests over `pools` and prints the report.
fn measure(
    args: &RequestBenchArgs,
    mut pools: impl Pools,
    memory: &'static str,
    gpu: &'static str,
    baseline_name: &'static str,
) -> Result<ExitCode, CliError> {
    let hello = |i, region| LocalHello::new(InstanceId(i), Topology::default(), layout(region));
    let mut pair = MemPair::new(PairConfig::new(
        SenderConfig::new(hello(1, 1)),
        ReceiverConfig::new(hello(2, 2), 7),
    ))?;
    // SAFETY: `pools` outlives `pair` (declared before it, so dropped after it).
    unsafe { pools.register(&mut pair)? };
    pair.connect()?;
    pair.drive_until(Duration::from_secs(10), |p| {
        p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
    })
    .map_err(|e| format!("handshake: {e}"))?;
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
    let last_range = LayerRange::new(u32::from(LAYERS - LAYERS_PER_RANGE), u32::from(LAYERS));
    let extents = range_extents(last_range);
    let range_bytes = extents.iter().map(|&(_, l)| l).sum();
    let mut source = ContiguousSource { blocks: BLOCKS };
    let limit = Duration::from_secs(10);
    let (mut total, mut baseline, mut protocol) = (Vec::new(), Vec::new(), Vec::new());
    let (mut submit, mut issue, mut copy, mut complete) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut verified = true;
    for r in 0..WARM_UP + args.requests {
        let request = RequestId(r + 1);
        pools.clear()?;
        let groups = vec![AnchoredRun::from_ids(0, &ids)];
        register_and_open(&mut pair, request, PROMPT, groups, None, false)?;
        for begin in (0..last_range.begin).step_by(usize::from(LAYERS_PER_RANGE)) {
            let now = pair.now();
            let range = LayerRange::new(begin, begin + u32::from(LAYERS_PER_RANGE));
            pair.sender_mut()
                .submit_chunk_layers(now, request, spec, range, &mut source)?;
            // Everything before the last range is driven to rest first.
            pair.drive_until(limit, |p| p.writes_in_flight() == 0)
                .map_err(|e| format!("request {}: {e}", request.0))?;
        }
        pools.keep_busy()?;
        let baseline_first = r % 2 == 0;
        let mut copy_alone = Duration::ZERO;
        let mut run_baseline = |pools: &mut dyn Pools| -> Result<(), CliError> {
            let t = Instant::now();
            pools.baseline(&extents)?;
            copy_alone = t.elapsed();
            Ok(())
        };
        if baseline_first {
            run_baseline(&mut pools)?;
        }
        pair.take_batch_timings();
        let t0 = Instant::now();
        let now = pair.now();
        pair.sender_mut()
            .submit_chunk_layers(now, request, spec, last_range, &mut source)?;
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
        let t1 = Instant::now();
        let mut done_at = None;
        let mut failed = None;
        let mut quiesced = 0;
        pair.drive_until(limit, |p| {
            for (side, at, e) in p.take_events() {
                match e {
                    // When the decode side reported it (an engine's event queue has it then),
                    // not when this loop looked: the same pump carries the decode side's word
                    // back to the prefill side before the loop runs.
                    Event::Completed { .. } if side == Endpoint::Receiver => {
                        done_at = Some(p.clock().to_std(at));
                    }
                    Event::Quiesced { .. } => quiesced += 1,
                    Event::Failed { cause, .. } => failed = Some(format!("{side:?}: {cause:?}")),
                    Event::TimedOut { waiting_for, .. } => {
                        failed = Some(format!("{side:?}: timed out waiting for {waiting_for:?}"));
                    }
                    Event::Cancelled { origin, .. } => {
                        failed = Some(format!("{side:?}: cancelled ({origin:?})"));
                    }
                    _ => {}
                }
            }
            done_at.is_some() || failed.is_some()
        })
        .map_err(|e| format!("request {}: {e}", request.0))?;
        if let Some(why) = failed {
            return Err(format!("request {} failed ({why})", request.0).into());
        }
        let done = done_at.ok_or("no completion")?;
        if !baseline_first {
            run_baseline(&mut pools)?;
        }
        let timing = pair
            .take_batch_timings()
            .pop()
            .ok_or("the last range issued no write batch")?;
        // Both sides quiesce before the blocks are handed back.
        pair.drive_until(limit, |p| {
            quiesced += p
                .take_events()
                .iter()
                .filter(|(_, _, e)| matches!(e, Event::Quiesced { .. }))
                .count();
            quiesced == 2
        })
        .map_err(|e| format!("request {}: {e}", request.0))?;
        let now = pair.now();
        pair.sender_mut().retire(now, request)?;
        pair.receiver_mut().retire(now, request)?;
        verified &= pools.verify(&extents)?;
        if r < WARM_UP {
            continue;
        }
        let clock = pair.clock();
        let at = |i: kvpipe_core::Instant| clock.to_std(i);
        let t = us(done - t0);
        total.push(t);
        baseline.push(us(copy_alone));
        protocol.push(t - us(copy_alone));
        submit.push(us(t1 - t0));
        issue.push(us(at(timing.issued).saturating_duration_since(t1)));
        copy.push(us(
            at(timing.reported).saturating_duration_since(at(timing.issued))
        ));
        complete.push(us(done.saturating_duration_since(at(timing.reported))));
    }
    drop(pair);
    let report = RequestReport {
        memory,
        gpu,
        requests: args.requests,
        range_bytes,
        ratio: median(total.clone()) / median(baseline.clone()).max(f64::MIN_POSITIVE),
        total_us: Spread::of(&total),
        baseline: baseline_name,
        baseline_us: Spread::of(&baseline),
        protocol_us: Spread::of(&protocol),
        target_protocol_us: TARGET_US,
        submit_us: median(submit),
        issue_us: median(issue),
        copy_us: median(copy),
        complete_us: median(complete),
        verified,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(if report.verified {
        ExitCode::SUCCESS
    } else {
        eprintln!("kvpipe bench request: a destination differed from its source");
        ExitCode::FAILURE
    })
}

fn print_table(r: &RequestReport) {
    println!(
        "bench request: {} requests, {} memory{}, last range of {} bytes in 16 extents",
        r.requests,
        r.memory,
        match r.gpu {
            "none" => String::new(),
            load => format!(" (GPU {load})"),
        },
        r.range_bytes
    );
    let row = |name: &str, s: &Spread| {
        println!("  {name:<26} p50 {:8.2} µs   p90 {:8.2} µs", s.p50, s.p90);
    };
    row("last range → complete", &r.total_us);
    row(&format!("baseline ({})", r.baseline), &r.baseline_us);
    row("protocol (total − base)", &r.protocol_us);
    println!(
        "  parts (p50, µs): submit {:.2}, issue {:.2}, copy {:.2}, complete {:.2}",
        r.submit_us, r.issue_us, r.copy_us, r.complete_us
    );
    println!(
        "  total / baseline {:.2}×; protocol p50 {:.2} µs (target ≤ {} µs with device memory); {}",
        r.ratio,
        r.protocol_us.p50,
        r.target_protocol_us,
        if r.verified {
            "every byte verified"
        } else {
            "NOT VERIFIED"
        }
    );
}

#[cfg(not(feature = "cuda"))]
mod device {
    use super::*;

    pub(super) fn run(
        _args: &RequestBenchArgs,
        _src: Vec<u8>,
        _load: GpuLoad,
    ) -> Result<ExitCode, CliError> {
        Err(crate::NEEDS_CUDA.into())
    }
}

#[cfg(feature = "cuda")]
mod device {
    use kvpipe_cuda::{BusyKernel, CopyEngine, CopyExtent, Device, DeviceBuffer, Memory};

    use super::*;

    /// How long each launch of the busy kernel computes.
    const BUSY_SHARE: Duration = Duration::from_millis(50);

    /// Device pools on GPU 0.
    struct DevicePools {
        device: Device,
        src: DeviceBuffer,
        dst: DeviceBuffer,
        copy: DeviceBuffer,
        host_src: Vec<u8>,
        engine: CopyEngine,
        busy: Option<BusyKernel>,
    }

    impl Pools for DevicePools {
        unsafe fn register(&mut self, pair: &mut MemPair) -> Result<(), CliError> {
            let (kv, ordinal) = (RegionUse::KvPool, self.device.ordinal());
            // SAFETY: the caller keeps `self` (and so the buffers) alive past `pair`; they are
            // touched here only while no request holds their blocks.
            unsafe {
                let (src, dst) = (self.src.ptr(), self.dst.ptr());
                pair.register_device(Endpoint::Sender, RegionId(1), kv, ordinal, src, POOL)?;
                pair.register_device(Endpoint::Receiver, RegionId(2), kv, ordinal, dst, POOL)?;
            }
            Ok(())
        }

        fn clear(&mut self) -> Result<(), CliError> {
            self.dst.fill(0)?;
            self.copy.fill(0)?;
            Ok(())
        }

        fn baseline(&mut self, extents: &[(u64, u64)]) -> Result<(), CliError> {
            let ordinal = self.device.ordinal();
            let copies: Vec<CopyExtent> = extents
                .iter()
                .map(|&(offset, len)| CopyExtent {
                    src: Memory::Device {
                        ordinal,
                        addr: self.src.ptr(),
                    },
                    src_offset: offset,
                    dst: Memory::Device {
                        ordinal,
                        addr: self.copy.ptr(),
                    },
                    dst_offset: offset,
                    len,
                })
                .collect();
            // SAFETY: both buffers are this value's, live, and `offset + len` stays inside them
            // (the extents are the range's, inside one pool); nothing else uses `copy`.
            let ticket = unsafe { self.engine.submit(&copies) }?;
            // Polled as the transport polls its batches.
            while !ticket.is_complete()? {
                std::hint::spin_loop();
            }
            Ok(())
        }

        fn verify(&self, extents: &[(u64, u64)]) -> Result<bool, CliError> {
            let mut dst = vec![0u8; POOL];
            self.dst.download(0, &mut dst)?;
            let mut copy = vec![0u8; POOL];
            self.copy.download(0, &mut copy)?;
            Ok(dst == self.host_src
                && extents.iter().all(|&(o, l)| {
                    let r = o as usize..(o + l) as usize;
                    copy[r.clone()] == self.host_src[r]
                }))
        }

        fn keep_busy(&mut self) -> Result<(), CliError> {
            if let Some(busy) = &mut self.busy {
                if busy.is_done()? {
                    busy.launch(BUSY_SHARE)?;
                }
            }
            Ok(())
        }
    }

    pub(super) fn run(
        args: &RequestBenchArgs,
        host_src: Vec<u8>,
        load: GpuLoad,
    ) -> Result<ExitCode, CliError> {
        kvpipe_cuda::check_driver()?;
        let device = Device::open(0)?;
        let mut src = DeviceBuffer::new(&device, POOL)?;
        src.upload(0, &host_src)?;
        let pools = DevicePools {
            dst: DeviceBuffer::new(&device, POOL)?,
            copy: DeviceBuffer::new(&device, POOL)?,
            src,
            host_src,
            engine: CopyEngine::new(1)?,
            busy: match load {
                GpuLoad::Busy => Some(BusyKernel::new(&device)?),
                GpuLoad::Idle => None,
            },
            device,
        };
        let gpu = match load {
            GpuLoad::Busy => "busy",
            GpuLoad::Idle => "idle",
        };
        measure(args, pools, "device", gpu, "copy-engine")
    }
}
