//! What a run of the engine model did: each request's outcome on both sides ([`Outcome`],
//! [`RequestReport`]) and the run's totals, leftovers and timeline ([`RunReport`]).

use kvpipe_core::session::{RequestTimings, Wait};
use kvpipe_core::wire::{AuxData, Role, TransferStatus};
use kvpipe_core::{BlockId, Duration, Event, GroupIndex, Instant, RequestId};
use kvpipe_observe::TransferTimings;

/// How a request ended on one side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not ended (or the side died first).
    Pending,
    /// Completed.
    Completed {
        /// Bytes written.
        bytes: u64,
        /// (Receiver) the aux data received.
        aux: Option<AuxData>,
    },
    /// Failed.
    Failed(TransferStatus),
    /// A deadline passed.
    TimedOut(Wait),
    /// Cancelled.
    Cancelled,
}

impl Outcome {
    /// Whether the request ended.
    pub fn is_end(&self) -> bool {
        !matches!(self, Outcome::Pending)
    }

    /// Whether it completed.
    pub fn is_completed(&self) -> bool {
        matches!(self, Outcome::Completed { .. })
    }
}

/// What happened to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestReport {
    /// The request.
    pub id: RequestId,
    /// The sender's outcome.
    pub sender: Outcome,
    /// The receiver's outcome.
    pub receiver: Outcome,
    /// Whether the sender reported `Quiesced`.
    pub sender_quiesced: bool,
    /// Whether the receiver reported `Quiesced`.
    pub receiver_quiesced: bool,
    /// Chunks submitted.
    pub chunks: u32,
    /// When the last chunk's compute finished.
    pub last_compute_done: Option<Instant>,
    /// When the receiver completed.
    pub receiver_completed_at: Option<Instant>,
    /// Destination blocks whose bytes differ from the sender's or from the expected content.
    pub mismatched_blocks: usize,
    /// Bytes the destination holds for this request that were compared.
    pub bytes_verified: u64,
    /// Sender blocks whose bytes no longer match what prefill computed (checked with
    /// [`Workload::verify_content`]).
    ///
    /// [`Workload::verify_content`]: super::Workload::verify_content
    pub source_blocks_changed: usize,
    /// The sender's timings, from its `Completed` event.
    pub sender_timings: Option<RequestTimings>,
    /// The receiver's timings, from its `Completed` event.
    pub receiver_timings: Option<RequestTimings>,
}

impl RequestReport {
    /// The time from the last chunk's compute to the receiver's completion.
    pub fn exposed_tail(&self) -> Option<Duration> {
        Some(self.receiver_completed_at? - self.last_compute_done?)
    }

    /// Both sides' timings of a request that completed on both (the harnesses give both
    /// endpoints one clock, so they compare). The sender's `last_chunk` is the later of the
    /// core's record (the last chunk's submission) and the engine's [`last_compute_done`]: a
    /// range handed over behind a fence is submitted while its compute still runs, and the
    /// exposed tail runs from the compute's end.
    ///
    /// [`last_compute_done`]: Self::last_compute_done
    pub fn transfer_timings(&self) -> Option<TransferTimings> {
        let bytes = match &self.receiver {
            Outcome::Completed { bytes, .. } => *bytes,
            _ => 0,
        };
        let mut sender = self.sender_timings?;
        sender.last_chunk = sender.last_chunk.max(self.last_compute_done);
        Some(TransferTimings::new(sender, self.receiver_timings?, bytes))
    }
}

/// What a run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunReport {
    /// Per request, in plan order.
    pub requests: Vec<RequestReport>,
    /// Events of both endpoints, in order.
    pub events: Vec<(Role, Instant, Event)>,
    /// Receiver slots that changed but were never granted: (group, pool, slot).
    pub stray_writes: Vec<(GroupIndex, usize, BlockId)>,
    /// Bytes the receiver reported written, over all requests.
    pub bytes: u64,
    /// Chunks submitted, over all requests.
    pub chunks: u64,
    /// When the first chunk's compute began.
    pub started: Instant,
    /// When every request had settled.
    pub finished: Instant,
    /// Write batches' issue and report times.
    pub batch_timings: Vec<super::BatchTiming>,
    /// Sessions (and registrations held for unopened requests) left on the living endpoints
    /// after retiring every quiesced request.
    pub leftover_sessions: usize,
    /// Write batches still in flight at the end.
    pub leftover_writes: usize,
    /// When each chunk was computed and its write batch moved, per request.
    pub timeline: super::timeline::Timeline,
}

impl RunReport {
    /// Whether every request completed on both sides with every byte right and nothing stray.
    pub fn verified(&self) -> bool {
        self.stray_writes.is_empty()
            && self.requests.iter().all(|r| {
                r.sender.is_completed()
                    && r.receiver.is_completed()
                    && r.mismatched_blocks == 0
                    && r.source_blocks_changed == 0
            })
    }

    /// Whether the run wrote nothing outside granted blocks, corrupted nothing it completed, and
    /// left nothing behind (also true for runs where requests failed).
    pub fn clean(&self) -> bool {
        self.stray_writes.is_empty()
            && self.leftover_sessions == 0
            && self.leftover_writes == 0
            && self
                .requests
                .iter()
                .all(|r| r.mismatched_blocks == 0 && r.source_blocks_changed == 0)
    }

    /// The report of `id`.
    pub fn request(&self, id: RequestId) -> Option<&RequestReport> {
        self.requests.iter().find(|r| r.id == id)
    }
}
