//! `kvpipe demo`: the main job, a realistic pipelined transfer over a chosen transport.

use std::process::ExitCode;

use super::CliError;

/// Arguments of `kvpipe demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {}

pub(crate) fn run(_args: DemoArgs) -> Result<ExitCode, CliError> {
    Err(
        "the demo is not built yet: it needs the session state machines and the in-process \
         transport"
            .into(),
    )
}
