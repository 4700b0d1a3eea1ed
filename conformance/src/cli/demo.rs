//! `kvpipe demo`: the main job, a realistic pipelined prefill→decode transfer over a chosen
//! transport, every byte verified.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvpipe_conformance::cache::{CacheSpec, ReferenceCache};
use kvpipe_conformance::suite::demo::{run_demo, DemoConfig, DemoSummary, Model};
use kvpipe_conformance::suite::{MemHarness, TcpHarness, TransferMode, VerbsHarness};
use serde::Serialize;

use super::CliError;

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
    /// Skip the baseline: by default the same requests are also sent after prefill
    /// (monolithic) in this run, and the table shows that tail beside the pipelined one.
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
    /// listening at this address (give both the same workload flags).
    #[arg(long)]
    connect: Option<String>,
    /// With --transport verbs: the RDMA device (default: the first with an active port).
    #[arg(long)]
    device: Option<String>,
    /// With --transport tcp: connections per peer.
    #[arg(long, default_value_t = 2)]
    connections: usize,
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
    if args.prompt_tokens == 0 || args.chunk_tokens == 0 || args.tokens_per_block == 0 {
        return Err(
            "--prompt-tokens, --chunk-tokens and --tokens-per-block must be positive".into(),
        );
    }
    if args.requests == 0 || args.ranks == 0 {
        return Err("--requests and --ranks must be at least 1".into());
    }
    if args.window == Some(0) {
        return Err("--window must hold at least one token".into());
    }
    for (flag, prefix) in [
        ("--sender-prefix", args.sender_prefix),
        ("--receiver-prefix", args.receiver_prefix),
    ] {
        if prefix > args.prompt_tokens {
            return Err(format!(
                "{flag} {prefix} is longer than the prompt ({} tokens)",
                args.prompt_tokens
            )
            .into());
        }
    }
    let split =
        args.sender_tp.is_some() || args.receiver_tp.is_some() || args.receiver_pp.is_some();
    if args.timeline.is_some() && (args.connect.is_some() || split) {
        return Err(
            "--timeline draws this process's own runs; it is not available with \
             --connect or --sender-tp/--receiver-tp/--receiver-pp"
                .into(),
        );
    }
    if let Some(addr) = &args.connect {
        if args.transport == "mem" {
            return Err("--connect needs --transport tcp or verbs".into());
        }
        return prefill::run(&args, addr);
    }
    if split {
        return parallel::run(
            &args,
            args.sender_tp.unwrap_or(1),
            args.receiver_tp.unwrap_or(1),
            args.receiver_pp.unwrap_or(1),
        );
    }
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
        mode: if args.monolithic {
            TransferMode::Monolithic
        } else {
            TransferMode::Pipelined
        },
        corrupt_one_byte: args.corrupt_one_byte,
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
    };
    let progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let tcp = TcpHarness::blocking(args.connections.clamp(1, 255));
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
        live_kv_bytes: live_kv_bytes(&config)? * u64::from(config.ranks),
        peak_rss_bytes: parallel::peak_rss_bytes(),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&WithMemory {
                summary: &summary,
                memory: &memory,
                baseline: baseline.as_ref(),
            })?
        );
    } else {
        print_table(&summary, &memory, baseline.as_ref());
    }
    Ok(
        if summary.verified && baseline.as_ref().is_none_or(|b| b.monolithic_verified) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

/// How much memory the run took against the KV its caches held.
#[derive(Debug, Serialize)]
struct Memory {
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
        TransferMode::Pipelined => {
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

fn print_table(s: &DemoSummary, memory: &Memory, baseline: Option<&baseline::Baseline>) {
    let gib = s.bytes as f64 / f64::from(1u32 << 30);
    let mut rows = vec![
        ("transport", s.transport.clone()),
        ("model", s.model.clone()),
        ("mode", s.mode.clone()),
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
                "{:.2} ms median, {:.2} ms max (last chunk computed → decode side complete)",
                s.exposed_tail_ms, s.max_exposed_tail_ms
            ),
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
                    s.mismatched_blocks, s.completed, s.requests
                )
            },
        ),
    ];
    if let Some(b) = baseline {
        let at = rows.iter().position(|(k, _)| *k == "exposed tail");
        rows.insert(at.map_or(rows.len(), |i| i + 1), b.row());
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}
