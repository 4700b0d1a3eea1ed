//! `kvpipe bench …`: benchmarks that report their figures against a baseline measured in the
//! same run.

use std::process::ExitCode;

use super::CliError;

mod plan;

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
}

pub(crate) fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    match args.bench {
        Bench::Plan(a) => plan::run(a),
    }
}
