//! `kvpipe bench pipeline`: how much of the transfer is left on the time-to-first-token path.
//!
//! One llama3-8b request is prefilled chunk by chunk on the reference cache (each chunk's
//! content written, then the rest of a simulated compute time) and moved over the transport
//! twice per run: pipelined (each chunk's blocks as soon as it is computed) and monolithic
//! (everything after prefill), in alternation. The exposed tail is the time from the last
//! chunk's compute finishing to the receiver's completion. The pipelined tail should be about
//! one chunk's transfer (target ≤ 1.25 × `chunk_transfer_ms`, the median time the transport
//! took to move one chunk's write batch); the monolithic one is the whole request's. Medians
//! over the runs; every run verifies every destination byte. `last_chunk_transfer_ms` is the
//! last chunk's batch alone: earlier batches are copied while the next chunk's content is being
//! written, and share the machine with it.

use std::process::ExitCode;
use std::time::Duration;

use kvpipe_conformance::suite::demo::{median, run_demo, DemoConfig, Model};
use kvpipe_conformance::suite::{MemHarness, RunReport, TransferMode};
use serde::Serialize;

use crate::cli::CliError;

/// Arguments of `kvpipe bench pipeline`.
#[derive(Debug, clap::Args)]
pub(crate) struct PipelineBenchArgs {
    /// Transport to measure (mem).
    #[arg(long, default_value = "mem")]
    transport: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Tokens in the prompt.
    #[arg(long, default_value_t = 8192)]
    prompt_tokens: u32,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 1024)]
    chunk_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Simulated compute time of one prefill chunk, in milliseconds.
    #[arg(long, default_value_t = 40)]
    prefill_ms_per_chunk: u64,
    /// Runs of each mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Print each pipelined run's write batches to stderr, in ms from the last chunk's compute.
    #[arg(long)]
    timeline: bool,
}

/// The figures `kvpipe bench pipeline` prints.
#[derive(Debug, Serialize)]
struct PipelineBenchReport {
    transport: String,
    chunks: u64,
    chunk_transfer_ms: f64,
    /// Median copy time of the last chunk's batch alone (earlier batches share the machine
    /// with the next chunk's compute).
    last_chunk_transfer_ms: f64,
    exposed_tail_ms: f64,
    monolithic_tail_ms: f64,
    tail_ratio: f64,
    /// `exposed_tail_ms / chunk_transfer_ms` (target ≤ 1.25).
    tail_over_chunk: f64,
    /// `exposed_tail_ms / last_chunk_transfer_ms`.
    tail_over_last_chunk: f64,
    verified: bool,
    model: &'static str,
    prompt_tokens: u32,
    chunk_tokens: u32,
    prefill_ms_per_chunk: u64,
    bytes: u64,
    runs: u32,
}

pub(crate) fn run(args: PipelineBenchArgs) -> Result<ExitCode, CliError> {
    if args.transport != "mem" {
        return Err(format!(
            "transport {:?} has no pipeline bench yet; use --transport mem",
            args.transport
        )
        .into());
    }
    let base = DemoConfig {
        model: Model::Llama3_8b,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        window: None,
        sender_prefix: 0,
        receiver_prefix: 0,
        requests: 1,
        ranks: 1,
        prefill_per_chunk: Duration::from_millis(args.prefill_ms_per_chunk),
        mode: TransferMode::Pipelined,
        corrupt_one_byte: false,
    };
    let harness = MemHarness::default();
    let (mut chunk_ms, mut tails, mut mono_tails) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_ms = Vec::new();
    let mut verified = true;
    let (mut chunks, mut bytes) = (0, 0);
    for _ in 0..args.runs.max(1) {
        let (pipelined, rep) = run_demo(&harness, &base, |_, _| {})?;
        if args.timeline {
            print_timeline(&rep);
        }
        let mono_config = DemoConfig {
            mode: TransferMode::Monolithic,
            ..base.clone()
        };
        let (mono, _) = run_demo(&harness, &mono_config, |_, _| {})?;
        verified &= pipelined.verified && mono.verified;
        chunk_ms.push(pipelined.chunk_transfer_ms);
        last_ms.push(pipelined.last_chunk_transfer_ms);
        tails.push(pipelined.exposed_tail_ms);
        mono_tails.push(mono.exposed_tail_ms);
        chunks = pipelined.chunks;
        bytes = pipelined.bytes;
    }
    let chunk_transfer_ms = median(chunk_ms);
    let exposed_tail_ms = median(tails);
    let last_chunk_transfer_ms = median(last_ms);
    let monolithic_tail_ms = median(mono_tails);
    let report = PipelineBenchReport {
        transport: args.transport,
        chunks,
        chunk_transfer_ms,
        last_chunk_transfer_ms,
        exposed_tail_ms,
        monolithic_tail_ms,
        tail_ratio: exposed_tail_ms / monolithic_tail_ms,
        tail_over_chunk: exposed_tail_ms / chunk_transfer_ms,
        tail_over_last_chunk: exposed_tail_ms / last_chunk_transfer_ms,
        verified,
        model: "llama3-8b",
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        prefill_ms_per_chunk: args.prefill_ms_per_chunk,
        bytes,
        runs: args.runs.max(1),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} tokens of llama3-8b in {} chunks over {} ({} bytes), {} ms compute per chunk",
            report.prompt_tokens, chunks, report.transport, bytes, report.prefill_ms_per_chunk
        );
        println!("chunk transfer     {chunk_transfer_ms:.2} ms (median write batch)");
        println!("last chunk alone   {last_chunk_transfer_ms:.2} ms");
        println!(
            "exposed tail       {exposed_tail_ms:.2} ms pipelined = {:.2} × chunk transfer (target ≤ 1.25)",
            report.tail_over_chunk
        );
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
