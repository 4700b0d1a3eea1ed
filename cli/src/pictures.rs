//! The pictures the commands write: `kvpipe demo --timeline`, `kvpipe bench pipeline --timeline`
//! and `--plot` (drawn by [`crate::picture`]).

use std::path::Path;

use crate::picture::{sweep_svg, timeline_svg, SweepPoint, TimelinePanel};
use kvpipe_conformance::suite::demo::DemoConfig;
use kvpipe_conformance::suite::timeline::Timeline;
use kvpipe_conformance::suite::TransferMode;

use super::CliError;

/// A run's workload in a few words, for a picture's title.
pub(crate) fn workload_title(command: &str, transport: &str, config: &DemoConfig) -> String {
    let requests = if config.ranks > 1 {
        format!("{} requests × {} ranks", config.requests, config.ranks)
    } else if config.requests == 1 {
        "1 request".to_string()
    } else {
        format!("{} requests", config.requests)
    };
    format!(
        "{command}: {} over {transport}, {requests} of {} tokens in chunks of {}, {} ms compute per chunk",
        config.model.name(),
        config.prompt_tokens,
        config.chunk_tokens,
        config.prefill_per_chunk.as_millis()
    )
}

/// Writes the timeline of a run (`mode`), with the monolithic baseline's beside it when given.
pub(crate) fn write_timeline(
    path: &Path,
    title: &str,
    mode: TransferMode,
    run: &Timeline,
    baseline: Option<&Timeline>,
) -> Result<(), CliError> {
    let sliced = match mode {
        TransferMode::LayerSlices(n) => format!(
            "each chunk's blocks sent in layer ranges of {n}, each as soon as its layers are \
             computed"
        ),
        _ => String::new(),
    };
    let panel = |mode, timeline| match mode {
        TransferMode::Pipelined => TimelinePanel {
            name: "pipelined",
            description: "each chunk's blocks sent as soon as it is computed",
            timeline,
        },
        TransferMode::LayerSlices(_) => TimelinePanel {
            name: "pipelined",
            description: &sliced,
            timeline,
        },
        TransferMode::Monolithic => TimelinePanel {
            name: "monolithic",
            description: "everything sent after prefill",
            timeline,
        },
    };
    let mut panels = vec![panel(mode, run)];
    panels.extend(baseline.map(|b| panel(TransferMode::Monolithic, b)));
    write(path, &timeline_svg(title, &panels)?)
}

/// Writes the chunk-size sweep.
pub(crate) fn write_sweep(path: &Path, title: &str, points: &[SweepPoint]) -> Result<(), CliError> {
    write(path, &sweep_svg(title, points)?)
}

fn write(path: &Path, svg: &str) -> Result<(), CliError> {
    std::fs::write(path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()).into())
}
