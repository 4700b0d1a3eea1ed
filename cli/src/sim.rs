//! `kvpipe sim`: runs the deterministic simulator — many requests between sender ranks and a
//! receiver over a seeded, faulty virtual network — and reports the outcomes.

use std::process::ExitCode;
use std::time::Instant as WallClock;

use kvpipe_sim::{FaultSet, SimConfig, SimReport, Simulation};

use super::{preflight, CliError};

/// Arguments of `kvpipe sim`.
#[derive(Debug, clap::Args)]
pub(crate) struct SimArgs {
    /// Requests to simulate.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Seed of every random choice: the same seed gives the same run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Faults to inject: `none`, `all`, or a comma list of latency, loss, duplication,
    /// reordering, delay, write-failure, peer-death, engine, decode, random-ids.
    #[arg(long, default_value = "none")]
    faults: FaultSet,
    /// Sender ranks (some requests are written by two of them, as under tensor parallelism).
    #[arg(long, default_value_t = 2)]
    senders: usize,
    /// A long-context workload: prefill 15–30× slower per token, far past `result_wait`, with
    /// deadlines that follow progress; requests must still complete.
    #[arg(long)]
    slow_prefill: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Print the trace lines that contain this text (e.g. `req#42 ` or `link`) to stderr.
    #[arg(long, value_name = "TEXT")]
    trace: Vec<String>,
}

pub(crate) fn run(args: SimArgs) -> Result<ExitCode, CliError> {
    // No request checks nothing, and would pass.
    preflight::at_least("--requests", args.requests as u64, 1)?;
    preflight::at_least("--senders", args.senders as u64, 1)?;
    preflight::at_most(
        "--senders",
        args.senders as u64,
        preflight::MAX_SIM_SENDERS,
        "each simulated rank has its own cache, endpoint and link",
    )?;
    preflight::simulation(args.requests as u64, args.senders as u64).check()?;
    let mut config = SimConfig::new(args.seed, args.faults);
    if args.slow_prefill {
        config = config.slow_prefill();
    }
    config.senders = args.senders;
    config.trace = !args.trace.is_empty();
    let started = WallClock::now();
    let model = format!(
        "{} tokens per block, window {} ({} sink tokens), pools: senders {:?}, receiver {:?}",
        config.tokens_per_block,
        config.window,
        config.sink_tokens,
        config.sender_pool_split,
        config.receiver_pool_split
    );
    let mut sim = Simulation::random(config, args.requests);
    let report = sim.run();
    let wall = started.elapsed();
    for line in sim.trace() {
        if args.trace.iter().any(|t| line.contains(t.as_str())) {
            eprintln!("{line}");
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report, args.seed, args.faults);
        println!("  model: {model}");
    }
    eprintln!(
        "kvpipe sim: {} requests in {:.2}s wall time",
        report.requests,
        wall.as_secs_f64()
    );
    Ok(if report.has_bugs() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn print_table(r: &SimReport, seed: u64, faults: FaultSet) {
    println!(
        "seed {seed}, faults {faults}, {} ms of virtual time, {} steps",
        r.virtual_ms, r.steps
    );
    let rows: [(&str, u64); 19] = [
        ("requests", r.requests),
        ("completed", r.completed),
        ("failed", r.failed),
        ("cancelled", r.cancelled),
        ("hung", r.hung),
        ("corrupted", r.corrupted),
        ("leaked", r.leaked),
        ("R failed", r.receiver_failed),
        ("R timed out", r.receiver_timed_out),
        ("  progressing", r.timed_out_progressing),
        ("R cancelled", r.receiver_cancelled),
        ("fatal faults", r.fatal),
        ("one-sided", r.one_sided),
        ("engine faults", r.engine_faults),
        ("decode faults", r.decode_faults),
        ("undetected", r.undetected),
        ("split", r.split),
        ("stray writes", r.stray_writes),
        ("anomalies", r.anomalies),
    ];
    for (name, value) in rows {
        println!("  {name:<14} {value:>8}");
    }
    for a in &r.first_anomalies {
        println!("  anomaly: {a}");
    }
    for l in &r.leak_details {
        println!("  leak: {l}");
    }
}
