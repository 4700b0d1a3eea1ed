//! `kvpipe bench …`: benchmarks that report their figures against a baseline measured in the
//! same run.

use std::process::ExitCode;

use super::CliError;

mod fragments;
mod pipeline;
mod plan;
mod request;
mod transfer;

/// Arguments of `kvpipe bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    bench: Bench,
}

/// The benchmarks.
#[derive(Debug, clap::Subcommand)]
enum Bench {
    /// Per-chunk planning cost (bounded query + pairing + coalescing), first vs last chunk of
    /// a long prompt, against the whole-list baseline, and allocations per chunk.
    Plan(plan::PlanBenchArgs),
    /// Bytes per second of a 4 GiB llama3-8b request over a transport, against memcpy of the
    /// same extents.
    Transfer(transfer::TransferBenchArgs),
    /// Exposed tail of a pipelined transfer (last chunk computed → decode side complete)
    /// against sending everything after prefill.
    Pipeline(pipeline::PipelineBenchArgs),
    /// Planning + posting 100 000 head-slice writes of 8 KiB (heterogeneous tensor
    /// parallelism) against their transfer time on the in-process transport.
    Fragments(fragments::FragmentsBenchArgs),
    /// The fixed cost the protocol adds to one request's exposed tail (its last layer range,
    /// submit → decode side complete), against the bare copy of the same extents.
    Request(request::RequestBenchArgs),
}

pub(crate) fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    match args.bench {
        Bench::Plan(a) => plan::run(a),
        Bench::Transfer(a) => transfer::run(a),
        Bench::Pipeline(a) => pipeline::run(a),
        Bench::Fragments(a) => fragments::run(a),
        Bench::Request(a) => request::run(a),
    }
}
