//! `kvpipe demo`: the main job, a realistic pipelined prefill→decode transfer over a chosen
//! transport, every byte verified.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvpipe_conformance::cache::{CacheSpec, ReferenceCache};
use kvpipe_conformance::suite::demo::{run_demo, DemoConfig, DemoSummary, Model};
use kvpipe_conformance::suite::{
    MemHarness, Outcome, PoolMemory, RunReport, SimulatedCompute, TcpHarness, TransferMode,
    VerbsHarness,
};
use serde::Serialize;

use super::slice_fit::SliceFit;
use super::{preflight, CliError};

mod baseline;
mod parallel;
mod prefill;

/// Arguments of `kvpipe demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Model whose KV cache is moved: llama3-8b, llama3-70b-tp8 (one of 8 TP ranks) or
    /// gemma3-swa (8 global + 40 local layers, window 1024).
    #[arg(long, default_value = "llama3-8b", value_parser = parse_model)]
    model: Model,
    /// Tokens in each request's prompt (default 4096; 1024 with --transport verbs, so that both
    /// sides' caches fit the 2 GiB Soft-RoCE test guest).
    #[arg(
        long,
        default_value_t = 4096,
        default_value_if("transport", "verbs", "1024")
    )]
    prompt_tokens: u32,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 512)]
    chunk_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Sliding window in tokens for the model's local layers (on a model without local layers:
    /// for every layer).
    #[arg(long)]
    window: Option<u32>,
    /// Tokens of the prompt the prefill side has cached already (prefix reuse).
    #[arg(long, default_value_t = 0)]
    sender_prefix: u32,
    /// Tokens of the prompt the decode side has cached already (prefix reuse).
    #[arg(long, default_value_t = 0)]
    receiver_prefix: u32,
    /// Concurrent requests (per rank).
    #[arg(long, default_value_t = 2)]
    requests: u32,
    /// Tensor-parallel ranks run side by side, each with its own prefill and decode endpoint
    /// and caches (e.g. 8 with llama3-70b-tp8 for the whole model).
    #[arg(long, default_value_t = 1)]
    ranks: u32,
    /// Tensor-parallel ranks of the prefill side: with --receiver-tp/--receiver-pp, the whole
    /// model's KV moves between two sides split differently, every rank side by side (mem
    /// transport), and each decode rank's bytes are checked against the whole model.
    #[arg(long)]
    sender_tp: Option<u16>,
    /// Tensor-parallel ranks of the decode side (see --sender-tp).
    #[arg(long)]
    receiver_tp: Option<u16>,
    /// Pipeline-parallel ranks of the decode side (see --sender-tp).
    #[arg(long)]
    receiver_pp: Option<u16>,
    /// Simulated compute time of one prefill chunk, in milliseconds.
    #[arg(long, default_value_t = 20)]
    prefill_ms_per_chunk: u64,
    /// Send everything after prefill instead of chunk by chunk (the baseline).
    #[arg(long)]
    monolithic: bool,
    /// Submit each chunk in layer ranges of N layers, each range as soon as its layers are
    /// computed (the chunk's simulated compute is spread over its layers), so the last chunk's
    /// transfer overlaps its own compute.
    #[arg(long, value_name = "N", conflicts_with = "monolithic")]
    layers_per_slice: Option<u16>,
    /// Skip the baseline: by default the same requests are also sent after prefill
    /// (monolithic) in this run, and the table shows that tail beside the pipelined one
    /// (with --connect there is no baseline either way).
    #[arg(long)]
    no_baseline: bool,
    /// Draw the run as an SVG picture in FILE: one lane per request (and rank), each chunk's
    /// compute and write batch, the exposed tail; the monolithic baseline beside it.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// Transport: mem (in-process), tcp (two nodes over loopback sockets in this process, or
    /// with --connect the prefill side only) or verbs (two RDMA nodes on --device in this
    /// process, or with --connect the prefill side only).
    #[arg(long, default_value = "mem")]
    transport: String,
    /// With --transport tcp or verbs: run only the prefill side, against `kvpipe serve`
    /// listening at this address (give both the same workload flags; --receiver-prefix goes to
    /// `serve`, and --monolithic, --ranks, --sender-tp/--receiver-tp/--receiver-pp,
    /// --layers-per-slice, --compute and --timeline are refused).
    #[arg(long)]
    connect: Option<String>,
    /// With --transport verbs: the RDMA device (default: the first with an active port).
    #[arg(long)]
    device: Option<String>,
    /// With --transport tcp: connections per peer (default 2).
    #[arg(long)]
    connections: Option<usize>,
    /// Where both sides' KV pools live: host, or device (GPU --gpu; needs the `cuda` feature):
    /// the mem transport copies with the GPU's copy engines, tcp stages through pinned host
    /// memory (or, with --connect, copies into the decode side's pools by CUDA IPC: see
    /// --data-path), and verification copies every pool back to the host.
    #[arg(long, default_value = "host")]
    memory: String,
    /// With --memory device: the GPU (default 0; with --connect: this prefill side's GPU).
    #[arg(long)]
    gpu: Option<usize>,
    /// With --connect over tcp: how data reaches the decode side's pools — auto (peer copies
    /// when both sides' pools are device memory and the decode side opens this side's CUDA IPC
    /// handles, i.e. it runs on the same host: it then pulls every write itself; else the
    /// sockets; the default), peer-copy (fail the connect rather than fall back) or socket.
    #[arg(long, value_parser = super::nodes::parse_data_path)]
    data_path: Option<kvpipe_tcp::TcpDataPath>,
    /// How the simulated prefill compute passes: gpu (a kernel keeps GPU --gpu busy for each
    /// chunk's or layer range's compute time, and the engine's thread waits for it as a
    /// serving engine's thread waits for its forward pass; the default with --memory device),
    /// gpu-fenced (each chunk's or range's content is put in place, then its kernel runs and
    /// the range is handed over at once, as vLLM's save_kv_layer is called while the layer's
    /// kernels are queued; over mem its copies wait for the kernel on the GPU behind a fence,
    /// other transports wait for it on the host; a batch's copy time then includes that wait) or
    /// sleep (the engine's thread sleeps through it and the GPU idles; the default with host
    /// memory).
    #[arg(long)]
    compute: Option<String>,
    /// Print one JSON object instead of the progress bar and table.
    #[arg(long)]
    json: bool,
    /// Flip one destination byte before verifying (shows that verification catches it).
    #[arg(long, hide = true)]
    corrupt_one_byte: bool,
}

pub(crate) fn parse_model(s: &str) -> Result<Model, String> {
    Model::ALL
        .iter()
        .find(|(n, _)| *n == s)
        .map(|(_, m)| *m)
        .ok_or_else(|| {
            let names: Vec<&str> = Model::ALL.iter().map(|(n, _)| *n).collect();
            format!("unknown model {s:?}; choose one of {}", names.join(", "))
        })
}

pub(crate) fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    if !["mem", "tcp", "verbs"].contains(&args.transport.as_str()) {
        return Err(format!(
            "transport {:?} is not available to the demo; use --transport mem, tcp or verbs",
            args.transport
        )
        .into());
    }
    let workload = preflight::Workload {
        model: args.model,
        window: args.window,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        requests: args.requests,
    };
    workload.check_ranges(&[
        ("--sender-prefix", args.sender_prefix),
        ("--receiver-prefix", args.receiver_prefix),
    ])?;
    preflight::at_least("--ranks", args.ranks.into(), 1)?;
    preflight::at_most(
        "--ranks",
        args.ranks.into(),
        preflight::MAX_RANKS,
        "each rank runs its own endpoints, caches and threads",
    )?;
    preflight::at_most(
        "--prefill-ms-per-chunk",
        args.prefill_ms_per_chunk,
        preflight::MAX_PREFILL_MS,
        "one minute of simulated compute per chunk",
    )?;
    refuse_outside_their_mode(&args)?;
    preflight::at_most(
        "--connections",
        args.connections() as u64,
        255,
        "a bundle's size",
    )?;
    preflight::at_least("--connections", args.connections() as u64, 1)?;
    if let Some(n) = args.layers_per_slice {
        preflight::at_least("--layers-per-slice", n.into(), 1)?;
    }
    let memory = pool_memory(&args)?;
    let compute = simulated_compute(args.compute.as_deref(), memory)?;
    let split =
        args.sender_tp.is_some() || args.receiver_tp.is_some() || args.receiver_pp.is_some();
    refuse_outside_the_engine_model(&args, split)?;
    if let Some(path) = &args.timeline {
        preflight::output_file("--timeline", path)?;
    }
    if let Some(addr) = &args.connect {
        if args.transport == "mem" {
            return Err("--connect needs --transport tcp or verbs".into());
        }
        refuse_with_connect(&args, split)?;
        preflight::connect_address("--connect", addr)?;
        workload
            .one_side("--prompt-tokens, --requests or --tokens-per-block")
            .check()?;
        return prefill::run(&args, addr, memory);
    }
    if split {
        let (stp, rtp, rpp) = (
            args.sender_tp.unwrap_or(1),
            args.receiver_tp.unwrap_or(1),
            args.receiver_pp.unwrap_or(1),
        );
        for (flag, v) in [
            ("--sender-tp", stp),
            ("--receiver-tp", rtp),
            ("--receiver-pp", rpp),
        ] {
            preflight::at_least(flag, v.into(), 1)?;
            preflight::at_most(
                flag,
                v.into(),
                preflight::MAX_RANKS,
                "ranks run side by side",
            )?;
        }
        preflight::at_most(
            "--receiver-tp × --receiver-pp",
            u64::from(rtp) * u64::from(rpp),
            preflight::MAX_RANKS,
            "ranks run side by side",
        )?;
        let whole = parallel::whole_model(args.model, args.window);
        // Pipeline rank r holds layers of every group with more than r layers (an even split,
        // the first ranks taking the remainder): past the largest group's layers a rank would
        // hold none, and no prefill rank would write it.
        let most_layers = whole.iter().map(|g| g.layers).max().unwrap_or(0);
        preflight::at_most(
            "--receiver-pp",
            rpp.into(),
            most_layers.into(),
            &format!(
                "{} has {most_layers} layers in its largest layer group, and every pipeline \
                 rank needs at least one",
                args.model.name()
            ),
        )?;
        workload
            .split(
                &whole,
                stp,
                (rtp, rpp),
                "--prompt-tokens, --requests or the rank counts",
            )?
            .check()?;
        return parallel::run(&args, stp, rtp, rpp, memory);
    }
    workload
        .in_process(
            args.ranks,
            "--prompt-tokens, --requests, --tokens-per-block or --ranks",
        )
        .check()?;
    let config = DemoConfig {
        model: args.model,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        window: args.window,
        sender_prefix: args.sender_prefix,
        receiver_prefix: args.receiver_prefix,
        requests: args.requests,
        ranks: args.ranks,
        prefill_per_chunk: Duration::from_millis(args.prefill_ms_per_chunk),
        mode: match (args.monolithic, args.layers_per_slice) {
            (true, _) => TransferMode::Monolithic,
            (false, Some(n)) => TransferMode::LayerSlices(n),
            (false, None) => TransferMode::Pipelined,
        },
        corrupt_one_byte: args.corrupt_one_byte,
        compute,
    };
    let show = !args.json && std::io::stderr().is_terminal();
    let bar = ProgressBar::with_draw_target(
        None,
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{spinner} prefill chunks {bar:30} {pos}/{len} {msg}")
            .map_err(|e| e.to_string())?,
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message(format!(
        "{} × {} tokens of {} over {}",
        config.requests * config.ranks,
        config.prompt_tokens,
        config.model.name(),
        args.transport
    ));
    // Ranks share the machine's cores: give each rank's copies its share.
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let harness = MemHarness {
        copy_threads: (args.ranks > 1).then(|| (cores / args.ranks as usize).max(1)),
        memory,
    };
    let progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let tcp = TcpHarness {
        memory,
        ..TcpHarness::blocking(args.connections().clamp(1, 255))
    };
    if args.transport == "verbs" {
        // Checked here, to say what is missing and what to do, not as the first connect's error.
        crate::nodes::open_device(args.device.as_deref())?;
    }
    let verbs = VerbsHarness {
        device: args.device.clone(),
    };
    let demo = |config: &DemoConfig| match args.transport.as_str() {
        "tcp" => run_demo(&tcp, config, progress),
        "verbs" => run_demo(&verbs, config, progress),
        _ => run_demo(&harness, config, progress),
    };
    let (summary, report) = demo(&config)?;
    let monolithic = if args.no_baseline || config.mode == TransferMode::Monolithic {
        None
    } else {
        bar.set_message("baseline: the same requests sent after prefill");
        Some(demo(&DemoConfig {
            mode: TransferMode::Monolithic,
            ..config.clone()
        })?)
    };
    bar.finish_and_clear();
    let baseline = monolithic
        .as_ref()
        .map(|(mono, _)| baseline::Baseline::new(&summary, mono));
    if let Some(path) = &args.timeline {
        let title = super::pictures::workload_title("kvpipe demo", &args.transport, &config);
        let mono = monolithic.as_ref().map(|(_, r)| &r.timeline);
        super::pictures::write_timeline(path, &title, config.mode, &report.timeline, mono)?;
    }
    let memory = Memory {
        memory: memory.name(),
        compute: compute_name(config.compute),
        live_kv_bytes: live_kv_bytes(&config)? * u64::from(config.ranks),
        peak_rss_bytes: parallel::peak_rss_bytes(),
    };
    let slice_fit = SliceFit::of_demo(&config);
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&WithMemory {
                summary: &summary,
                slice_fit,
                memory: &memory,
                baseline: baseline.as_ref(),
            })?
        );
    } else {
        print_table(&summary, slice_fit, &memory, baseline.as_ref());
    }
    if !summary.verified {
        for cause in failure_causes(&report) {
            eprintln!("kvpipe demo: {cause}");
        }
    }
    Ok(
        if summary.verified && baseline.as_ref().is_none_or(|b| b.monolithic_verified) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

impl DemoArgs {
    /// TCP connections per peer (`--connections`, default 2).
    pub(crate) fn connections(&self) -> usize {
        self.connections.unwrap_or(2)
    }
}

/// Flags of another transport, memory or mode than this run's are refused, naming what they
/// apply to, rather than ignored.
fn refuse_outside_their_mode(args: &DemoArgs) -> Result<(), CliError> {
    let (transport, memory) = (args.transport.as_str(), args.memory.as_str());
    let tcp = transport == "tcp";
    let with = if args.connect.is_some() {
        " with --connect"
    } else {
        ""
    };
    preflight::refuse_outside_mode(
        (transport, memory, with),
        (args.device.is_some(), args.gpu.is_some()),
        &[
            (
                args.connections.is_some(),
                tcp,
                "--connections",
                "--transport tcp",
            ),
            (
                args.data_path.is_some(),
                tcp && args.connect.is_some(),
                "--data-path",
                "--connect over --transport tcp",
            ),
        ],
    )
}

/// The flags only the demo of one prefill and one decode endpoint per rank honours (the
/// suite's engine model, `run_demo`), refused with the two demos that drive their endpoints in
/// a loop of their own — the prefill side of `--connect` (`prefill`) and the heterogeneous
/// split (`parallel`) — with what that loop lacks.
fn refuse_outside_the_engine_model(args: &DemoArgs, split: bool) -> Result<(), CliError> {
    let (with, runner) = if args.connect.is_some() {
        ("--connect", "the prefill side of --connect")
    } else if split {
        (
            "--sender-tp/--receiver-tp/--receiver-pp",
            "the heterogeneous split",
        )
    } else {
        return Ok(());
    };
    let refused = [
        (
            args.compute.is_some(),
            "--compute",
            "waits out each chunk's compute on its own thread, with no GPU kernel to run",
        ),
        (
            args.layers_per_slice.is_some(),
            "--layers-per-slice",
            "submits each chunk whole, never in layer ranges",
        ),
        (
            args.timeline.is_some(),
            "--timeline",
            "records no timeline to draw",
        ),
    ];
    match refused.into_iter().find(|(given, _, _)| *given) {
        Some((_, flag, lacks)) => {
            Err(format!("{flag} is not available with {with}: {runner} {lacks}").into())
        }
        None => Ok(()),
    }
}

/// The flags the prefill side of a two-process demo (`--connect`) cannot honour, refused
/// before anything is allocated or connected rather than silently ignored.
fn refuse_with_connect(args: &DemoArgs, split: bool) -> Result<(), CliError> {
    if args.monolithic {
        return Err(
            "--monolithic is not supported with --connect: the prefill side sends \
                    each chunk as soon as it is computed"
                .into(),
        );
    }
    if args.ranks != 1 {
        return Err(format!(
            "--ranks {} is not supported with --connect: one prefill side talks to one \
             `kvpipe serve`; run one pair per rank",
            args.ranks
        )
        .into());
    }
    if split {
        return Err(
            "--sender-tp/--receiver-tp/--receiver-pp are not supported with \
                    --connect: the heterogeneous split runs every rank of both sides in \
                    this process (--transport mem)"
                .into(),
        );
    }
    if args.receiver_prefix != 0 {
        return Err(format!(
            "--receiver-prefix {} is the decode side's: give it to `kvpipe serve`, not to \
             `kvpipe demo --connect`",
            args.receiver_prefix
        )
        .into());
    }
    Ok(())
}

/// Why requests did not complete, grouped by what each side saw: one line per distinct pair
/// of outcomes, with how many requests (over all ranks) ended that way.
fn failure_causes(report: &RunReport) -> Vec<String> {
    let side = |o: &Outcome| match o {
        Outcome::Pending => "never ended".to_string(),
        Outcome::Completed { .. } => "completed".to_string(),
        Outcome::Failed(status) => format!("failed ({status})"),
        Outcome::TimedOut(wait) => format!("timed out waiting for {wait:?}"),
        Outcome::Cancelled => "cancelled".to_string(),
    };
    let mut causes: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &report.requests {
        let cause = if r.sender.is_completed() && r.receiver.is_completed() {
            if r.mismatched_blocks == 0 && r.source_blocks_changed == 0 {
                continue;
            }
            format!(
                "completed, but {} destination block(s) differ and {} source block(s) changed",
                r.mismatched_blocks, r.source_blocks_changed
            )
        } else {
            format!(
                "prefill side {}, decode side {}",
                side(&r.sender),
                side(&r.receiver)
            )
        };
        *causes.entry(cause).or_default() += 1;
    }
    let mut lines: Vec<String> = causes
        .into_iter()
        .map(|(cause, n)| format!("{n} request(s): {cause}"))
        .collect();
    if !report.stray_writes.is_empty() {
        lines.push(format!(
            "{} destination block(s) outside every grant changed",
            report.stray_writes.len()
        ));
    }
    lines
}

/// Where the pools lived (`--memory`), checked before anything runs: device memory needs the
/// `cuda` feature and a CUDA driver ("no CUDA driver" otherwise), and a transport that can move
/// it (mem or tcp, both sides in this process).
fn pool_memory(args: &DemoArgs) -> Result<PoolMemory, CliError> {
    match args.memory.as_str() {
        "host" => Ok(PoolMemory::Host),
        "device" => {
            if args.transport == "verbs" {
                return Err("--memory device runs over --transport mem or tcp".into());
            }
            if (args.sender_tp.is_some()
                || args.receiver_tp.is_some()
                || args.receiver_pp.is_some())
                && args.transport != "mem"
            {
                return Err(
                    "--memory device with --sender-tp/--receiver-tp/--receiver-pp runs \
                            over --transport mem (every rank of both sides in this process, \
                            all ranks' pools on the one GPU --gpu)"
                        .into(),
                );
            }
            device_memory(args.gpu.unwrap_or(0))
        }
        other => Err(format!("--memory {other:?}: use host or device").into()),
    }
}

#[cfg(feature = "cuda")]
fn device_memory(gpu: usize) -> Result<PoolMemory, CliError> {
    kvpipe_cuda::check_driver()?;
    kvpipe_cuda::Device::open(gpu)?;
    Ok(PoolMemory::Device { ordinal: gpu })
}

#[cfg(not(feature = "cuda"))]
fn device_memory(_gpu: usize) -> Result<PoolMemory, CliError> {
    Err(crate::NEEDS_CUDA.into())
}

/// How the simulated compute passes (`--compute`): by default a GPU kernel where the pools
/// are device memory, the engine's thread asleep where they are host memory.
fn simulated_compute(
    compute: Option<&str>,
    memory: PoolMemory,
) -> Result<SimulatedCompute, CliError> {
    match (compute, memory) {
        (Some("sleep"), _) | (None, PoolMemory::Host) => Ok(SimulatedCompute::Sleep),
        #[cfg(feature = "cuda")]
        (Some("gpu") | None, PoolMemory::Device { ordinal }) => Ok(SimulatedCompute::Gpu {
            ordinal,
            fenced: false,
        }),
        #[cfg(feature = "cuda")]
        (Some("gpu-fenced"), PoolMemory::Device { ordinal }) => Ok(SimulatedCompute::Gpu {
            ordinal,
            fenced: true,
        }),
        (Some(gpu @ ("gpu" | "gpu-fenced")), PoolMemory::Host) => Err(format!(
            "--compute {gpu} keeps the pools' GPU busy: it needs --memory device"
        )
        .into()),
        (Some(other), _) => {
            Err(format!("--compute {other:?}: use sleep, gpu or gpu-fenced").into())
        }
    }
}

/// The simulated compute's name in the JSON and the table.
fn compute_name(compute: SimulatedCompute) -> &'static str {
    match compute {
        SimulatedCompute::Sleep => "sleep",
        #[cfg(feature = "cuda")]
        SimulatedCompute::Gpu { fenced: false, .. } => "gpu",
        #[cfg(feature = "cuda")]
        SimulatedCompute::Gpu { fenced: true, .. } => "gpu-fenced",
    }
}

/// How much memory the run took against the KV its caches held.
#[derive(Debug, Serialize)]
struct Memory {
    /// Where the KV pools lived: "host" or "device".
    memory: &'static str,
    /// How the simulated compute passed (`--compute`): "sleep", "gpu" or "gpu-fenced".
    compute: &'static str,
    /// The most KV both sides' caches held at once (each cache's peak, summed; all ranks).
    live_kv_bytes: u64,
    /// This process's peak resident memory (Linux `VmHWM`), when known.
    peak_rss_bytes: Option<u64>,
}

/// The demo's JSON: its summary and the memory figures.
#[derive(Serialize)]
struct WithMemory<'a> {
    #[serde(flatten)]
    summary: &'a DemoSummary,
    /// With layer slices: the last range's layers, and whether `--layers-per-slice` was more
    /// than the model has (absent without).
    #[serde(flatten)]
    slice_fit: Option<SliceFit>,
    #[serde(flatten)]
    memory: &'a Memory,
    #[serde(flatten)]
    baseline: Option<&'a baseline::Baseline>,
}

/// The most KV the demo's two caches (of one rank) hold at once: the run's allocations
/// replayed on table-only caches — every request begun and registered up front, then the
/// chunks in the engine's order (round-robin when pipelined, request by request when
/// monolithic) — and each cache's peak summed.
fn live_kv_bytes(config: &DemoConfig) -> Result<u64, CliError> {
    let w = config.workload();
    let blocks: u32 = w
        .requests
        .iter()
        .map(|r| r.prompt.div_ceil(w.tokens_per_block))
        .sum();
    let spec = |receiver: bool| CacheSpec {
        tokens_per_block: w.tokens_per_block,
        groups: w.groups.clone(),
        slots_per_group: blocks + w.spare_slots,
        first_region: if receiver { 1000 } else { 1 },
        slot_order_seed: None,
        materialize: false,
    };
    let mut sender = ReferenceCache::new(&spec(false))?;
    let mut receiver = ReferenceCache::new(&spec(true))?;
    for r in &w.requests {
        sender.begin_prefill(r.id, r.prompt, r.sender_prefix, w.allocation)?;
        receiver.register_destination(r.id, r.prompt, r.receiver_prefix)?;
    }
    let chunks: Vec<_> = w.requests.iter().map(|r| r.chunks()).collect();
    let order: Vec<(usize, usize)> = match w.mode {
        TransferMode::Pipelined | TransferMode::LayerSlices(_) => {
            let most = chunks.iter().map(Vec::len).max().unwrap_or(0);
            (0..most)
                .flat_map(|k| (0..chunks.len()).map(move |i| (i, k)))
                .filter(|&(i, k)| k < chunks[i].len())
                .collect()
        }
        TransferMode::Monolithic => (0..chunks.len())
            .flat_map(|i| (0..chunks[i].len()).map(move |k| (i, k)))
            .collect(),
    };
    for (i, k) in order {
        let (start, end) = chunks[i][k];
        sender.compute_chunk(w.requests[i].id, start, end)?;
    }
    Ok(sender.peak_resident_bytes() + receiver.peak_resident_bytes())
}

fn print_table(
    s: &DemoSummary,
    slice_fit: Option<SliceFit>,
    memory: &Memory,
    baseline: Option<&baseline::Baseline>,
) {
    let rows = table_rows(s, slice_fit, memory, baseline);
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}

/// The table's rows, name and text: its "p50"s are the summary's `*_p50_ms`, the medians the
/// JSON reports.
fn table_rows(
    s: &DemoSummary,
    slice_fit: Option<SliceFit>,
    memory: &Memory,
    baseline: Option<&baseline::Baseline>,
) -> Vec<(&'static str, String)> {
    let gib = s.bytes as f64 / f64::from(1u32 << 30);
    let mut rows = vec![
        ("transport", s.transport.clone()),
        (
            "kv pools",
            match memory.memory {
                "device" => "device memory (GPU 0), copied back to the host to verify".into(),
                other => format!("{other} memory"),
            },
        ),
        ("model", s.model.clone()),
        (
            "mode",
            match slice_fit {
                Some(fit) => format!("{} (last range: {})", s.mode, fit.note()),
                None => s.mode.clone(),
            },
        ),
        (
            "requests",
            if s.ranks == 1 {
                format!("{} ({} completed)", s.requests, s.completed)
            } else {
                format!(
                    "{} per rank × {} ranks ({} completed)",
                    s.requests, s.ranks, s.completed
                )
            },
        ),
        (
            "prompt",
            format!("{} tokens, chunks of {}", s.prompt_tokens, s.chunk_tokens),
        ),
        ("bytes", format!("{} ({gib:.2} GiB)", s.bytes)),
        (
            "chunks",
            format!("{} ({} write batches)", s.chunks, s.write_batches),
        ),
        ("wall time", format!("{:.2} s", s.seconds)),
        (
            "throughput",
            format!(
                "{:.2} GB/s while copying{}",
                s.transfer_gbps,
                if s.ranks > 1 { " (per rank)" } else { "" }
            ),
        ),
        (
            "chunk transfer",
            format!("{:.2} ms (median write batch)", s.chunk_transfer_ms),
        ),
        (
            "exposed tail",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (last chunk computed → decode side \
                 complete)",
                s.exposed_tail_p50_ms, s.exposed_tail_p99_ms, s.max_exposed_tail_ms
            ),
        ),
        (
            "transfer time",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms (first byte sent → last byte landed, per request)",
                s.transfer_p50_ms, s.transfer_p99_ms
            ),
        ),
        (
            "last tail",
            s.last_tail_parts.map_or("—".into(), |t| {
                format!(
                    "{:.1} µs submit + {:.1} µs copy + {:.1} µs report + {:.1} µs complete",
                    t.submit_us, t.copy_us, t.report_us, t.complete_us
                )
            }),
        ),
        (
            "memory",
            format!(
                "{:.2} GiB live KV on both sides at most, peak RSS {}",
                memory.live_kv_bytes as f64 / f64::from(1u32 << 30),
                memory
                    .peak_rss_bytes
                    .map_or("unknown".to_string(), |b| format!(
                        "{:.2} GiB",
                        b as f64 / f64::from(1u32 << 30)
                    ))
            ),
        ),
        (
            "verification",
            if s.verified {
                format!(
                    "OK: {} bytes equal to the sender's{}",
                    s.bytes_verified,
                    if s.thorough_checks {
                        ", content and untouched blocks checked"
                    } else {
                        ""
                    }
                )
            } else {
                format!(
                    "FAILED: {} block(s) differ, {} of {} request(s) completed",
                    s.mismatched_blocks,
                    s.completed,
                    s.requests * s.ranks
                )
            },
        ),
    ];
    if let Some(b) = baseline {
        let at = rows.iter().position(|(k, _)| *k == "exposed tail");
        rows.insert(at.map_or(rows.len(), |i| i + 1), b.row());
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With two requests (an even count) the table's p50 is the JSON's median, not the
    /// nearest-rank 50th percentile (the smaller of the two).
    #[test]
    fn the_tables_p50_is_the_jsons_median_for_an_even_request_count() {
        let config = DemoConfig {
            prompt_tokens: 256,
            chunk_tokens: 128,
            requests: 2,
            prefill_per_chunk: Duration::from_millis(1),
            ..DemoConfig::default()
        };
        let (summary, _) = run_demo(&MemHarness::default(), &config, |_, _| {}).unwrap();
        assert!(summary.verified);
        let memory = Memory {
            memory: "host",
            compute: "sleep",
            live_kv_bytes: 0,
            peak_rss_bytes: None,
        };
        let json = serde_json::to_value(WithMemory {
            summary: &summary,
            slice_fit: None,
            memory: &memory,
            baseline: None,
        })
        .unwrap();
        let median = json["exposed_tail_ms"].as_f64().unwrap();
        assert_eq!(json["exposed_tail_p50_ms"].as_f64(), Some(median), "{json}");
        let rows = table_rows(&summary, None, &memory, None);
        let tail = &rows.iter().find(|(k, _)| *k == "exposed tail").unwrap().1;
        assert!(
            tail.starts_with(&format!("p50 {median:.2} ms,")),
            "{tail} against {json}"
        );
    }
}
