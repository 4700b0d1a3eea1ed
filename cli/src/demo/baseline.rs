//! The demo's baseline: the same requests sent after prefill (monolithic), measured in the same
//! run, so the table shows what pipelining saves.

use kvpipe_conformance::suite::demo::DemoSummary;
use serde::Serialize;

/// The monolithic run's figures against the pipelined one's.
#[derive(Debug, Serialize)]
pub(super) struct Baseline {
    /// Median exposed tail of the monolithic run (last chunk computed → decode side complete).
    pub monolithic_tail_ms: f64,
    /// `monolithic_tail_ms` over the pipelined run's median exposed tail.
    pub monolithic_over_pipelined: f64,
    /// Whether the monolithic run completed every request with every byte right.
    pub monolithic_verified: bool,
}

impl Baseline {
    pub(super) fn new(pipelined: &DemoSummary, monolithic: &DemoSummary) -> Self {
        Baseline {
            monolithic_tail_ms: monolithic.exposed_tail_ms,
            monolithic_over_pipelined: monolithic.exposed_tail_ms / pipelined.exposed_tail_ms,
            monolithic_verified: monolithic.verified,
        }
    }

    /// The table's row.
    pub(super) fn row(&self) -> (&'static str, String) {
        (
            "monolithic tail",
            format!(
                "{:.2} ms median, everything sent after prefill in this run ({:.1}× the \
                 pipelined tail{})",
                self.monolithic_tail_ms,
                self.monolithic_over_pipelined,
                if self.monolithic_verified {
                    ""
                } else {
                    "; FAILED verification"
                }
            ),
        )
    }
}
