//! Subcommands of the `kvpipe` program, one module each.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod demo;
mod nodes;
pub(crate) mod observe;
mod outcome;
mod pictures;
mod plan;
mod preflight;
mod serve;
mod sim;

/// Streams an LLM request's KV cache from prefill to decode while prefill runs.
#[derive(Debug, Parser)]
#[command(name = "kvpipe", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a pipelined prefill→decode transfer and verify every byte.
    Demo(demo::DemoArgs),
    /// Show, per prefill chunk and layer group, the block window and the coalesced writes.
    Plan(plan::PlanArgs),
    /// Decode side of a two-process transfer over TCP or RDMA verbs: listen, receive, verify.
    Serve(serve::ServeArgs),
    /// Run a benchmark and report its figures against a same-run baseline.
    Bench(bench::BenchArgs),
    /// Simulate many requests over a seeded, faulty virtual network and check every outcome.
    Sim(sim::SimArgs),
}

/// A command's failure, printed as `kvpipe: <message>` with a non-zero exit status.
pub(crate) type CliError = Box<dyn std::error::Error + Send + Sync>;

/// What `--memory device` answers in a kvpipe built without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) const NEEDS_CUDA: &str = "--memory device needs kvpipe built with the `cuda` feature \
     (cargo build --release -p kvpipe-conformance --features cuda)";

impl Cli {
    pub(crate) fn run(self) -> Result<ExitCode, CliError> {
        match self.command {
            Command::Demo(args) => demo::run(args),
            Command::Plan(args) => plan::run(args),
            Command::Bench(args) => bench::run(args),
            Command::Serve(args) => serve::run(args),
            Command::Sim(args) => sim::run(args),
        }
    }
}
