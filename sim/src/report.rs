//! What a simulation run reports: one outcome per request and the totals.

use kvpipe_core::{Duration, RequestId};
use serde::Serialize;

/// How one side's session of a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Terminal {
    /// `Event::Completed`.
    Completed,
    /// `Event::Failed`.
    Failed,
    /// `Event::TimedOut`.
    TimedOut,
    /// `Event::Cancelled`.
    Cancelled,
}

/// The outcome of one request, over every side (its writer ranks and the receiver).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Outcome {
    /// Every side completed and the receiver's bytes are exactly the sender's.
    Completed,
    /// Not completed everywhere, ended (quiesced and retired) everywhere, no engine cancel.
    Failed,
    /// As `Failed`, for a request the engine cancelled.
    Cancelled,
    /// Some side did not finish within the run's bounds (a bug: livelock or a missing
    /// deadline).
    Hung,
    /// A write touched a block that was not the request's (freed, reused, or outside the grant),
    /// or the receiver completed with bytes that differ (a bug).
    Corrupted,
    /// Finished, but a session, block, or write batch was left behind (a bug).
    Leaked,
}

/// One request's outcome and how each side ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutcome {
    /// The request.
    pub request: RequestId,
    /// Its outcome.
    pub outcome: Outcome,
    /// A fatal fault hit a writer while its session was active, yet that writer or the
    /// receiver completed (a bug: a fatal fault must fail both sides).
    pub one_sided: bool,
    /// A fatal fault (a failed write batch, a dead connection) hit an active writer session.
    pub fatal: bool,
    /// A fault touched it (a connection it used died, or one of its write batches failed).
    pub exposed: bool,
    /// How the receiver's session ended.
    pub receiver: Option<Terminal>,
    /// How each writer's session ended, in writer order.
    pub senders: Vec<Option<Terminal>>,
    /// What was left behind.
    pub leaks: Vec<String>,
    /// From the start to the last side's retirement.
    pub duration: Option<Duration>,
}

/// Totals of a run. The first eight fields are the `kvpipe sim --json` contract; the others
/// follow.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SimReport {
    /// Requests simulated.
    pub requests: u64,
    /// Completed on every side with verified bytes.
    pub completed: u64,
    /// Ended (quiesced and retired) everywhere, not completed everywhere, no engine cancel.
    /// Includes the `split` requests that completed on some side only.
    pub failed: u64,
    /// As `failed`, for requests an engine cancelled.
    pub cancelled: u64,
    /// Not finished within the bounds (bug).
    pub hung: u64,
    /// Wrong bytes or a write outside the request's blocks (bug).
    pub corrupted: u64,
    /// Something left behind (bug).
    pub leaked: u64,
    /// Virtual time at the end of the run, in milliseconds.
    pub virtual_ms: u64,
    /// Requests a fatal fault hit while a writer session was active.
    pub fatal: u64,
    /// Of those, requests where that writer or the receiver still completed (bug).
    pub one_sided: u64,
    /// Requests the receiver completed although their data was wrong: corrupted bytes, or an
    /// engine mistake that should have failed them (bug).
    pub undetected: u64,
    /// Mistaken chunks the engines handed their senders (the `engine` fault).
    pub engine_faults: u64,
    /// Mistaken registrations the decode engine handed the receiver (the `decode` fault).
    pub decode_faults: u64,
    /// Requests the receiver timed out waiting for results before the overall cap while
    /// their writes were still landing within the idle deadline (bug: a deadline that does
    /// not follow progress).
    pub timed_out_progressing: u64,
    /// Requests completed on some sides only without a fatal fault: the receiver completed,
    /// and a writer lost its `RecvComplete` (a connection lost or a deadline passed after it
    /// had handed everything over).
    pub split: u64,
    /// Requests the receiver ended with `Failed` (a writer's failure, a lost peer, a protocol
    /// error).
    pub receiver_failed: u64,
    /// Requests the receiver ended with `TimedOut`.
    pub receiver_timed_out: u64,
    /// Requests the receiver ended with `Cancelled` (by either engine).
    pub receiver_cancelled: u64,
    /// Writes that touched a block not owned by their request (bug; the request counts as
    /// corrupted).
    pub stray_writes: u64,
    /// Writes the receiver's admission refused (never applied): a writer behind a connection
    /// being closed, or a write outside its grant.
    pub refused_writes: u64,
    /// Usage errors and surprises the engine met (bug).
    pub anomalies: u64,
    /// Steps taken.
    pub steps: u64,
    /// Frames sent.
    pub frames: u64,
    /// Write batches executed.
    pub write_batches: u64,
    /// Write batches failed by fault injection.
    pub write_failures: u64,
    /// Connections killed by fault injection.
    pub link_deaths: u64,
    /// The first anomalies, as text.
    pub first_anomalies: Vec<String>,
    /// The first requests found hung, corrupted, leaked or one-sided (ids).
    pub first_bugs: Vec<u64>,
    /// What the endpoint-wide leak check found.
    pub leak_details: Vec<String>,
    /// Every request's outcome.
    #[serde(skip)]
    pub outcomes: Vec<RequestOutcome>,
}

impl SimReport {
    /// Whether the run found a bug: a hung, corrupted, leaked, one-sided or undetected request,
    /// a stray write, or an anomaly.
    pub fn has_bugs(&self) -> bool {
        self.hung
            + self.corrupted
            + self.leaked
            + self.one_sided
            + self.undetected
            + self.timed_out_progressing
            + self.stray_writes
            + self.anomalies
            > 0
    }
}
