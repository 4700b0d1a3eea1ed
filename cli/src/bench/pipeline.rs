//! `kvpipe bench pipeline`: how much of the transfer is left on the time-to-first-token path.
//!
//! One request of a model preset (`--model`, llama3-8b by default) is prefilled chunk by chunk
//! on the reference cache (each chunk's content written, then the rest of a simulated compute
//! time) and moved over the transport (`--transport mem`, or `tcp`: two nodes over loopback
//! sockets in this process) twice per run: pipelined (each chunk's blocks as soon as it is
//! computed; a sliding-window model's local layers from their stale boundary on) and monolithic
//! (everything after prefill), in alternation. The exposed tail is the time from the last
//! chunk's compute finishing to the receiver's completion. The pipelined tail should be about
//! the last chunk's own transfer (target `tail_over_last_chunk` ≤ 1.25: the tail over
//! `last_chunk_transfer_ms`, the last chunk's batch alone); the monolithic one is the whole
//! request's. The last chunk is the one compared because it is the one the tail waits for: a
//! prompt that is not a multiple of the chunk ends in a shorter chunk, and against the median
//! full chunk (`chunk_transfer_ms`, `tail_over_chunk`) its tail would read as a pass however
//! slowly that short chunk went out. Medians over the runs; every run verifies every destination
//! byte. Earlier batches are copied while the next chunk's content is being written, and share
//! the machine with it; the last one copies alone.
//!
//! `--layers-per-slice N` submits each chunk in ranges of N layers, each as soon as its share of
//! the chunk's compute is over (the compute is spread over the layers): the last chunk's
//! transfer then overlaps its own compute and the tail shrinks to about the last range's
//! transfer. `tail_over_last_chunk` compares it with the same run's last chunk's whole transfer
//! (its ranges' batches summed; target ≤ 0.25 for llama3-8b, ≤ 0.35 for gemma3-swa).
//!
//! `--timeline FILE.svg` draws the run whose pipelined tail is the median, beside its monolithic
//! twin; `--sweep-chunk-tokens A,B,… --plot FILE.svg` repeats the bench for each chunk size
//! (see [`sweep`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use kvpipe_conformance::suite::demo::{
    last_chunk_batches, median, run_demo, DemoConfig, DemoSummary, Model,
};
use kvpipe_conformance::suite::timeline::Timeline;
use kvpipe_conformance::suite::{MemHarness, RunReport, SuiteError, TcpHarness, TransferMode};
use serde::Serialize;

use crate::slice_fit::SliceFit;
use crate::{pictures, preflight, CliError};

mod sweep;

/// Arguments of `kvpipe bench pipeline`.
#[derive(Debug, clap::Args)]
pub(crate) struct PipelineBenchArgs {
    /// Transport to measure: mem, or tcp (two nodes over loopback sockets in this process).
    #[arg(long, default_value = "mem")]
    transport: String,
    /// Model whose KV cache is moved: llama3-8b, llama3-70b-tp8 or gemma3-swa.
    #[arg(long, default_value = "llama3-8b", value_parser = crate::demo::parse_model)]
    model: Model,
    /// With --transport tcp: connections per peer (default 2).
    #[arg(long)]
    connections: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Tokens in the prompt (default 8192; 32768 for gemma3-swa, whose 40 local layers keep
    /// a 1024-token window: a sliding-window model's prompts are long, and the final window's
    /// blocks are computed by the last chunk whatever the pipelining).
    #[arg(long)]
    prompt_tokens: Option<u32>,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 1024)]
    chunk_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Simulated compute time of one prefill chunk, in milliseconds.
    #[arg(long, default_value_t = 40)]
    prefill_ms_per_chunk: u64,
    /// Submit each chunk in layer ranges of N layers, each as soon as its layers are computed
    /// (the chunk's simulated compute spread over its layers): the exposed tail shrinks from
    /// the last chunk's transfer to about its last range's (target ≤ 0.25 × the last chunk's
    /// whole transfer for llama3-8b, ≤ 0.35 × for gemma3-swa).
    #[arg(long, value_name = "N")]
    layers_per_slice: Option<u16>,
    /// Runs of each mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// With FILE: draw the run whose pipelined tail is the median, beside its monolithic twin,
    /// as an SVG picture. Without: print each pipelined run's write batches to stderr, in ms
    /// from the last chunk's compute.
    #[arg(long, value_name = "FILE", conflicts_with = "sweep_chunk_tokens")]
    timeline: Option<Option<PathBuf>>,
    /// Repeat the bench for each of these chunk sizes (e.g. 256,512,1024,2048,4096), the
    /// compute scaled with the chunk (--prefill-ms-per-chunk is a --chunk-tokens chunk's), so
    /// every size prefills the prompt in the same time.
    #[arg(long, value_delimiter = ',', value_name = "TOKENS,…")]
    sweep_chunk_tokens: Vec<u32>,
    /// With --sweep-chunk-tokens: draw the exposed tail and the time moving bytes against the
    /// chunk size, pipelined and monolithic, as an SVG picture.
    #[arg(long, value_name = "FILE", requires = "sweep_chunk_tokens")]
    plot: Option<PathBuf>,
}

/// The figures `kvpipe bench pipeline` prints.
#[derive(Debug, Serialize)]
struct PipelineBenchReport {
    transport: String,
    chunks: u64,
    chunk_transfer_ms: f64,
    /// Median copy time of the last chunk's batch alone (earlier batches share the machine
    /// with the next chunk's compute); with layer slices, its ranges' batches summed: the last
    /// chunk's whole transfer.
    last_chunk_transfer_ms: f64,
    /// Median copy time of the last write batch alone (with layer slices: the last range's).
    last_batch_transfer_ms: f64,
    /// Median over runs of the last chunk's whole transfer at the speed of its last batch,
    /// which moves with no compute beside it: `last_batch_transfer_ms` × the last chunk's bytes
    /// / the last batch's (equal to `last_chunk_transfer_ms` without layer slices). With layer
    /// slices the earlier ranges' copies share the cores with the next ranges' compute, so
    /// their summed copy times (`last_chunk_transfer_ms`) overstate the chunk's transfer.
    last_chunk_alone_ms: f64,
    /// `exposed_tail_ms / last_chunk_alone_ms` (with layer slices: target ≤ 0.25 for
    /// llama3-8b, ≤ 0.35 for gemma3-swa).
    tail_over_last_chunk_alone: f64,
    /// Layers per slice (`null`: whole chunks).
    layers_per_slice: Option<u16>,
    /// With layer slices: the last range's layers, and whether `layers_per_slice` was more
    /// than the model has (absent without).
    #[serde(flatten)]
    slice_fit: Option<SliceFit>,
    exposed_tail_ms: f64,
    monolithic_tail_ms: f64,
    tail_ratio: f64,
    /// `exposed_tail_ms / chunk_transfer_ms`: against the median write batch, which a short
    /// last chunk (a prompt that is not a multiple of the chunk) makes flattering; not the
    /// target's figure.
    tail_over_chunk: f64,
    /// `exposed_tail_ms / last_chunk_transfer_ms`: against the transfer the tail waits for
    /// (whole chunks: target ≤ 1.25).
    tail_over_last_chunk: f64,
    verified: bool,
    /// `monolithic_tail_ms / exposed_tail_ms` (how much of the tail pipelining removes).
    monolithic_over_pipelined: f64,
    /// Median over runs of the write batches' copy times summed (pipelined).
    transfer_ms: f64,
    /// The same, monolithic.
    monolithic_transfer_ms: f64,
    model: &'static str,
    prompt_tokens: u32,
    chunk_tokens: u32,
    prefill_ms_per_chunk: u64,
    bytes: u64,
    runs: u32,
}

pub(crate) fn run(args: PipelineBenchArgs) -> Result<ExitCode, CliError> {
    if args.transport != "mem" && args.transport != "tcp" {
        return Err(format!(
            "transport {:?} has no pipeline bench; use --transport mem or tcp",
            args.transport
        )
        .into());
    }
    let prompt_tokens = args.prompt_tokens.unwrap_or(match args.model {
        Model::Gemma3Swa => 32_768,
        _ => 8192,
    });
    let workload = preflight::Workload {
        model: args.model,
        window: None,
        prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        requests: 1,
    };
    workload.check_ranges(&[])?;
    preflight::at_most(
        "--prefill-ms-per-chunk",
        args.prefill_ms_per_chunk,
        preflight::MAX_PREFILL_MS,
        "one minute of simulated compute per chunk",
    )?;
    preflight::refuse_misplaced(
        &[(
            args.connections.is_some(),
            args.transport == "tcp",
            "--connections",
            "--transport tcp",
        )],
        &format!("--transport {}", args.transport),
    )?;
    let connections = args.connections.unwrap_or(2);
    preflight::at_least("--connections", connections as u64, 1)?;
    preflight::at_least("--runs", args.runs.into(), 1)?;
    if let Some(n) = args.layers_per_slice {
        preflight::at_least("--layers-per-slice", n.into(), 1)?;
    }
    preflight::at_most("--connections", connections as u64, 255, "a bundle's size")?;
    if let Some(Some(path)) = &args.timeline {
        preflight::output_file("--timeline", path)?;
    }
    if let Some(path) = &args.plot {
        preflight::output_file("--plot", path)?;
    }
    workload
        .in_process(1, "--prompt-tokens or --tokens-per-block")
        .check()?;
    let base = DemoConfig {
        model: args.model,
        prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        window: None,
        sender_prefix: 0,
        receiver_prefix: 0,
        requests: 1,
        ranks: 1,
        prefill_per_chunk: Duration::from_millis(args.prefill_ms_per_chunk),
        mode: args
            .layers_per_slice
            .map_or(TransferMode::Pipelined, TransferMode::LayerSlices),
        corrupt_one_byte: false,
        ..DemoConfig::default()
    };
    if !args.sweep_chunk_tokens.is_empty() {
        return sweep::run(&args, &base);
    }
    let m = measure(&args, &base)?;
    let (chunk_transfer_ms, exposed_tail_ms) = (m.chunk_transfer_ms, m.exposed_tail_ms);
    let (last_chunk_transfer_ms, monolithic_tail_ms) =
        (m.last_chunk_transfer_ms, m.monolithic_tail_ms);
    let (chunks, bytes, verified) = (m.chunks, m.bytes, m.verified);
    if let Some(Some(path)) = &args.timeline {
        let title = pictures::workload_title("kvpipe bench pipeline", &args.transport, &base);
        let (pipelined, monolithic) = &m.median_run;
        pictures::write_timeline(path, &title, base.mode, pipelined, Some(monolithic))?;
    }
    let report = PipelineBenchReport {
        transport: args.transport,
        chunks,
        chunk_transfer_ms,
        last_chunk_transfer_ms,
        last_batch_transfer_ms: m.last_batch_transfer_ms,
        last_chunk_alone_ms: m.last_chunk_alone_ms,
        tail_over_last_chunk_alone: exposed_tail_ms / m.last_chunk_alone_ms,
        layers_per_slice: args.layers_per_slice,
        slice_fit: SliceFit::of_demo(&base),
        exposed_tail_ms,
        monolithic_tail_ms,
        tail_ratio: exposed_tail_ms / monolithic_tail_ms,
        tail_over_chunk: exposed_tail_ms / chunk_transfer_ms,
        tail_over_last_chunk: exposed_tail_ms / last_chunk_transfer_ms,
        verified,
        monolithic_over_pipelined: monolithic_tail_ms / exposed_tail_ms,
        transfer_ms: m.transfer_ms,
        monolithic_transfer_ms: m.monolithic_transfer_ms,
        model: args.model.name(),
        prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        prefill_ms_per_chunk: args.prefill_ms_per_chunk,
        bytes,
        runs: args.runs.max(1),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} tokens of {} in {} chunks over {} ({} bytes), {} ms compute per chunk",
            report.prompt_tokens,
            report.model,
            chunks,
            report.transport,
            bytes,
            report.prefill_ms_per_chunk
        );
        println!("chunk transfer     {chunk_transfer_ms:.2} ms (median write batch)");
        match args.layers_per_slice {
            // The JSON's `last_chunk_alone_ms` is the figure of the "last range alone" row
            // below; this one is `last_chunk_transfer_ms`.
            Some(_) => println!(
                "last chunk summed  {last_chunk_transfer_ms:.2} ms (its ranges' copy times)"
            ),
            None => println!("last chunk alone   {last_chunk_transfer_ms:.2} ms"),
        }
        match args.layers_per_slice {
            None => println!(
                "exposed tail       {exposed_tail_ms:.2} ms pipelined = {:.2} × the last chunk's transfer (target ≤ 1.25; {:.2} × the median write batch)",
                report.tail_over_last_chunk, report.tail_over_chunk
            ),
            Some(n) => {
                let last_range = report.slice_fit.map_or(String::new(), |f| f.note());
                println!(
                    "last range alone   {:.2} ms ({last_range}); the last chunk at that speed {:.2} ms",
                    report.last_batch_transfer_ms, report.last_chunk_alone_ms
                );
                println!(
                    "exposed tail       {exposed_tail_ms:.2} ms in layer slices of {n} = {:.2} × the last chunk's transfer at the last range's speed ({:.2} × its ranges' copy times summed)",
                    report.tail_over_last_chunk_alone, report.tail_over_last_chunk
                );
            }
        }
        println!(
            "monolithic tail    {monolithic_tail_ms:.2} ms (ratio {:.3})",
            report.tail_ratio
        );
        println!("verified           {verified}");
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The medians of `args.runs` runs of each mode, in alternation.
struct Measured {
    chunk_transfer_ms: f64,
    last_chunk_transfer_ms: f64,
    last_batch_transfer_ms: f64,
    last_chunk_alone_ms: f64,
    exposed_tail_ms: f64,
    monolithic_tail_ms: f64,
    /// The write batches' copy times summed, per run (pipelined, monolithic).
    transfer_ms: f64,
    monolithic_transfer_ms: f64,
    chunks: u64,
    bytes: u64,
    verified: bool,
    /// The timelines of the run whose pipelined tail is the median, and of its monolithic twin.
    median_run: (Timeline, Timeline),
}

/// Runs `base` pipelined and monolithic `args.runs` times each, in alternation.
fn measure(args: &PipelineBenchArgs, base: &DemoConfig) -> Result<Measured, CliError> {
    let tcp = TcpHarness::blocking(args.connections.unwrap_or(2).clamp(1, 255));
    let demo = |config: &DemoConfig| -> Result<(DemoSummary, RunReport), SuiteError> {
        if args.transport == "tcp" {
            run_demo(&tcp, config, |_, _| {})
        } else {
            run_demo(&MemHarness::default(), config, |_, _| {})
        }
    };
    let copy_ms = |r: &RunReport| -> f64 {
        r.batch_timings
            .iter()
            .map(|t| t.transfer.as_nanos() as f64 / 1e6)
            .sum()
    };
    let (mut chunk_ms, mut tails, mut mono_tails) = (Vec::new(), Vec::new(), Vec::new());
    let (mut last_ms, mut transfer, mut mono_transfer) = (Vec::new(), Vec::new(), Vec::new());
    let (mut last_batch_ms, mut last_alone_ms) = (Vec::new(), Vec::new());
    let mut runs: Vec<(f64, Timeline, Timeline)> = Vec::new();
    let mut verified = true;
    let (mut chunks, mut bytes) = (0, 0);
    for _ in 0..args.runs.max(1) {
        let (pipelined, rep) = demo(base)?;
        if args.timeline == Some(None) {
            print_timeline(&rep);
        }
        let mono_config = DemoConfig {
            mode: TransferMode::Monolithic,
            ..base.clone()
        };
        let (mono, mono_rep) = demo(&mono_config)?;
        verified &= pipelined.verified && mono.verified;
        chunk_ms.push(pipelined.chunk_transfer_ms);
        last_ms.push(pipelined.last_chunk_transfer_ms);
        last_batch_ms.push(pipelined.last_batch_transfer_ms);
        if let Some(batches) = last_chunk_batches(&rep) {
            let bytes: u64 = batches.iter().map(|b| b.bytes).sum();
            let last = batches.iter().max_by_key(|b| b.issued);
            if let Some(last) = last.filter(|l| l.bytes > 0) {
                let ms = last.transfer.as_nanos() as f64 / 1e6;
                last_alone_ms.push(ms * bytes as f64 / last.bytes as f64);
            }
        }
        tails.push(pipelined.exposed_tail_ms);
        mono_tails.push(mono.exposed_tail_ms);
        transfer.push(copy_ms(&rep));
        mono_transfer.push(copy_ms(&mono_rep));
        chunks = pipelined.chunks;
        bytes = pipelined.bytes;
        runs.push((pipelined.exposed_tail_ms, rep.timeline, mono_rep.timeline));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (_, pipelined, monolithic) = runs.swap_remove(runs.len() / 2);
    Ok(Measured {
        chunk_transfer_ms: median(chunk_ms),
        last_chunk_transfer_ms: median(last_ms),
        last_batch_transfer_ms: median(last_batch_ms),
        last_chunk_alone_ms: median(last_alone_ms),
        exposed_tail_ms: median(tails),
        monolithic_tail_ms: median(mono_tails),
        transfer_ms: median(transfer),
        monolithic_transfer_ms: median(mono_transfer),
        chunks,
        bytes,
        verified,
        median_run: (pipelined, monolithic),
    })
}

/// Prints the write batches of a run relative to the end of the last chunk's compute.
fn print_timeline(report: &RunReport) {
    let Some(t0) = report.requests.first().and_then(|r| r.last_compute_done) else {
        return;
    };
    let rel = |at: kvpipe_core::Instant| (at.as_nanos() as f64 - t0.as_nanos() as f64) / 1e6;
    for t in &report.batch_timings {
        eprintln!(
            "batch of {} bytes: issued {:+.2} ms, copied in {:.2} ms, reported {:+.2} ms",
            t.bytes,
            rel(t.issued),
            t.transfer.as_nanos() as f64 / 1e6,
            rel(t.reported)
        );
    }
    if let Some(done) = report.requests[0].receiver_completed_at {
        eprintln!("receiver completed {:+.2} ms", rel(done));
    }
}
