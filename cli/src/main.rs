//! `kvpipe`: run the demo, the benchmarks and the diagnostic tools. One module per subcommand;
//! `picture` draws the SVG pictures they write.

mod bench;
mod demo;
mod nodes;
mod observe;
mod outcome;
mod picture;
mod pictures;
mod plan;
mod preflight;
mod serve;
mod sim;
mod slice_fit;

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::{Parser, Subcommand};

/// The system allocator, counting allocations so benches can show that steady-state planning
/// allocates nothing. One relaxed atomic increment per allocation.
struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// has no effect on the memory returned.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as is; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above; `ptr` was allocated by this allocator, i.e. by `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

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
     (cargo build --release -p kvpipe-cli --features cuda)";

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

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Allocations (including reallocations) made by the process so far.
pub(crate) fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    observe::init();
    match cli.run() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kvpipe: {err}");
            ExitCode::FAILURE
        }
    }
}
