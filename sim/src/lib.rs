//! # kvpipe-sim
//!
//! The deterministic simulator: sender ranks and a receiver, their reference caches, a seeded
//! sans-IO network between them and an engine that drives requests, all on a virtual clock.
//!
//! In the style of quinn's `Pair`, str0m's `netem` and smoltcp's `netsim`:
//!
//! - **Virtual time.** [`Simulation::step`] advances whoever has the earliest deadline: a frame
//!   delivery, a write batch's completion, a prefill chunk's compute, an engine action (open,
//!   register, aux data, cancel), an endpoint's timer, or the next request's arrival.
//! - **Seeded network.** One connection per sender rank to the receiver, each ordered (the
//!   transport contract), with latency, loss (retransmitted, or a reset after too many),
//!   duplication, reordering (write completions out of order, connections overtaking each other),
//!   delay spikes and connection death — each a [`FaultKind`] switched on separately — and,
//!   off by default, damaged frame headers ([`FaultRates::corruption`]). Every fault is decided
//!   by the network emulation shared with the in-process transport and the fuzz crate
//!   ([`kvpipe_netem`], configured by [`SimConfig::netem_config`]); the engines draw their
//!   own choices from a separate [`SimRng`] stream.
//!
//! The parts, each importing only those below it: `stage` (what every part acts on: the
//! configuration, the `scheduler`'s virtual time, event queue and step bounds, the endpoints
//! with their caches, the trace), `oracle` (what must hold, judged per request), `network`
//! (links over the emulation, batches in flight, writes landed through the receiver's
//! admission), `engine` (the workload's engine actions, one endpoint call at a time), and
//! `world`, which owns them all, drains the endpoints after every call and routes each output
//! to the part it concerns: the [`Simulation`].
//! - **Real memory.** Write batches are executed against the [`ReferenceCache`]s' bytes after a
//!   latency (or fail part-way by fault injection); every write checks that its source and
//!   destination blocks still belong to its request and that the grant is live, so a write after
//!   a block was handed back, or a misplaced byte, is caught. The receiver's bytes are verified
//!   when it completes.
//! - **The engine** opens requests on the writer ranks, computes prefill chunks at a simulated
//!   pace and submits them, registers on the receiver (usually first, sometimes late), submits
//!   the aux data, sometimes cancels from either side, and frees a request's blocks and retires
//!   it only on `Quiesced`.
//! - **Bounded driving and a leak check.** A run stops at a step cap or virtual time cap; what did
//!   not finish is [`Outcome::Hung`]. At the end no session, write batch or block may remain.
//! - **Connections end once.** Every disconnect an endpoint is told of must give exactly one
//!   `Event::PeerLost` for that peer; a run where one did not counts an anomaly.
//!
//! **Outcomes.** Each request is [`Outcome::Completed`] (every side, bytes verified),
//! [`Outcome::Failed`] or [`Outcome::Cancelled`] (ended everywhere, not completed everywhere), or
//! a bug: [`Outcome::Hung`], [`Outcome::Corrupted`], [`Outcome::Leaked`]. A fault is *fatal* for
//! a writer when it hits the writer's session while it is still active: a write batch reported
//! failed, a connection death the writer learns of, or a silent death that strands one of its
//! write batches. Such a writer and the receiver must then both end without completing; if one
//! completes the request counts as `one_sided` (a bug). A writer completes only on its
//! receiver's `RecvComplete`, so the one split left is the other way round: a receiver that
//! completed while the fault cost the writer that last frame (a connection that died, or a
//! deadline racing with it) leaves the writer failed. That counts as `split`: the inherent race
//! of the last frame, in the safe direction (the receiver's KV is whole), reported but not a
//! bug.
//!
//! [`ReferenceCache`]: kvpipe_conformance::cache::ReferenceCache

mod action;
mod config;
mod engine;
mod faults;
mod mistake;
mod network;
mod oracle;
mod report;
mod scheduler;
mod stage;
mod summary;
mod workload;
mod world;

pub use action::RECEIVER_PEER;
pub use config::{PlantedBug, ScriptedFault, SimConfig};
pub use faults::{FaultKind, FaultParseError, FaultRates, FaultSet};
/// The simulator's seeded generator (the network emulation's).
pub use kvpipe_netem::SeededRng as SimRng;
pub use network::NetCounters;
pub use report::{Outcome, RequestOutcome, SimReport, Terminal};
pub use summary::{event_summary, frame_summary};
pub use workload::{random_workload, CancelSide, RequestPlan, WorkloadShape};
pub use world::Simulation;

/// Runs `requests` random requests with `seed` under `faults` and reports.
pub fn run(requests: usize, seed: u64, faults: FaultSet) -> SimReport {
    Simulation::random(SimConfig::new(seed, faults), requests).run()
}
