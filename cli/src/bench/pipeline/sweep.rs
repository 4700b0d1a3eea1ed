//! `kvpipe bench pipeline --sweep-chunk-tokens A,B,… [--plot FILE.svg]`: the bench once per
//! chunk size. Prefill compute grows with the chunk (`--prefill-ms-per-chunk` is the compute of
//! a `--chunk-tokens` chunk), so every size prefills the prompt in the same time and only the
//! granularity of the pipelining changes: the exposed tail should follow the last chunk's
//! transfer down as chunks shrink, while the monolithic tail stays the whole request's and the
//! time spent moving bytes stays about the same for both. With `--layers-per-slice N` every
//! pipelined run submits its chunks in ranges of N layers: the header, the tail's column, the
//! plot's title and the JSON (`layers_per_slice`) say so.

use std::process::ExitCode;
use std::time::Duration;

use crate::picture::SweepPoint;
use kvpipe_conformance::suite::demo::DemoConfig;
use serde::Serialize;

use super::{measure, PipelineBenchArgs};
use crate::slice_fit::SliceFit;
use crate::{pictures, CliError};

/// One chunk size's figures in `--json`.
#[derive(Debug, Serialize)]
struct SweepRow {
    #[serde(flatten)]
    point: SweepPoint,
    chunks: u64,
    prefill_ms_per_chunk: f64,
    verified: bool,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct SweepReport {
    transport: String,
    model: &'static str,
    prompt_tokens: u32,
    /// Compute of the whole prompt, the same for every chunk size.
    prefill_ms: f64,
    /// Layers per slice every pipelined run submitted its chunks in (`null`: whole chunks).
    layers_per_slice: Option<u16>,
    /// With layer slices: the last range's layers, and whether `layers_per_slice` was more
    /// than the model has (absent without).
    #[serde(flatten)]
    slice_fit: Option<SliceFit>,
    bytes: u64,
    runs: u32,
    verified: bool,
    sweep: Vec<SweepRow>,
}

pub(super) fn run(args: &PipelineBenchArgs, base: &DemoConfig) -> Result<ExitCode, CliError> {
    if args.sweep_chunk_tokens.contains(&0) || args.chunk_tokens == 0 {
        return Err("chunk sizes must be positive".into());
    }
    let ms_per_token = args.prefill_ms_per_chunk as f64 / f64::from(args.chunk_tokens);
    let mut rows = Vec::new();
    let mut bytes = 0;
    for &chunk_tokens in &args.sweep_chunk_tokens {
        let per_chunk_ms = ms_per_token * f64::from(chunk_tokens);
        let config = DemoConfig {
            chunk_tokens,
            prefill_per_chunk: Duration::from_secs_f64(per_chunk_ms / 1e3),
            ..base.clone()
        };
        let m = measure(args, &config)?;
        bytes = m.bytes;
        rows.push(SweepRow {
            point: SweepPoint {
                chunk_tokens,
                exposed_tail_ms: m.exposed_tail_ms,
                monolithic_tail_ms: m.monolithic_tail_ms,
                transfer_ms: m.transfer_ms,
                monolithic_transfer_ms: m.monolithic_transfer_ms,
            },
            chunks: m.chunks,
            prefill_ms_per_chunk: per_chunk_ms,
            verified: m.verified,
        });
    }
    let verified = rows.iter().all(|r| r.verified);
    let prefill_ms = ms_per_token * f64::from(base.prompt_tokens);
    let slice_fit = SliceFit::of_demo(base);
    // How the pipelined runs submitted their chunks, for the title, the header and the column.
    let (sliced, tail_column) = match (args.layers_per_slice, slice_fit) {
        (Some(n), Some(fit)) => (
            format!(
                ", pipelined in layer slices of {n} (last range: {})",
                fit.note()
            ),
            format!("tail, {n}-layer slices"),
        ),
        _ => (String::new(), "exposed tail".to_string()),
    };
    if let Some(path) = &args.plot {
        let points: Vec<SweepPoint> = rows.iter().map(|r| r.point).collect();
        let title = format!(
            "kvpipe bench pipeline: {} over {}, {} tokens, {prefill_ms:.0} ms of prefill compute \
             at every chunk size{sliced}",
            base.model.name(),
            args.transport,
            base.prompt_tokens
        );
        pictures::write_sweep(path, &title, &points)?;
    }
    let report = SweepReport {
        transport: args.transport.clone(),
        model: base.model.name(),
        prompt_tokens: base.prompt_tokens,
        prefill_ms,
        layers_per_slice: args.layers_per_slice,
        slice_fit,
        bytes,
        runs: args.runs.max(1),
        verified,
        sweep: rows,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} tokens of {} over {} ({} bytes), {prefill_ms:.0} ms of prefill compute at every \
             chunk size{sliced}; {} run(s) of each mode, medians",
            report.prompt_tokens, report.model, report.transport, bytes, report.runs
        );
        let tail_width = tail_column.chars().count().max(12);
        println!(
            "{:>12}  {:>6}  {tail_column:>tail_width$}  {:>15}  {:>12}  {:>23}",
            "chunk tokens", "chunks", "monolithic tail", "moving bytes", "monolithic moving bytes"
        );
        for r in &report.sweep {
            let p = &r.point;
            println!(
                "{:>12}  {:>6}  {:>w$.2} ms  {:>12.2} ms  {:>9.2} ms  {:>20.2} ms",
                p.chunk_tokens,
                r.chunks,
                p.exposed_tail_ms,
                p.monolithic_tail_ms,
                p.transfer_ms,
                p.monolithic_transfer_ms,
                w = tail_width - 3
            );
        }
        println!("verified     {verified}");
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
