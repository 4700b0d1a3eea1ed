//! `kvpipe`: run the demo, the benchmarks and the diagnostic tools.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.run() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kvpipe: {err}");
            ExitCode::FAILURE
        }
    }
}
