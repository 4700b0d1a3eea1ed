//! The conformance suite: scenarios every transport must pass, generic over a [`Harness`] that
//! makes a connected sender/receiver pair over the transport.
//!
//! A scenario builds two [reference caches](crate::cache) (the prefill engine's and the decode
//! engine's), registers their memory with the transport, runs one or more requests through the
//! real [`Sender`] and [`Receiver`] endpoints (chunk by chunk, as prefill would), and checks:
//!
//! - the outcome on both sides (completed, or failed/cancelled/timed out as the scenario wants),
//!   and that every request ends [`Event::Quiesced`] on every living side;
//! - every destination byte of a completed request against the sender's bytes, and against the
//!   deterministic content the cache computed;
//! - that nothing outside the blocks the receiver granted changed (failed requests included),
//!   and that the sender's blocks still hold what prefill computed;
//! - that nothing is left behind: no session, no write in flight.
//!
//! Transports run the suite with [`conformance_tests!`](crate::conformance_tests), which makes one
//! `#[test]` per scenario. The built-in transports' harnesses are features: `MemHarness` (`mem`,
//! over `kvpipe-mem`), `TcpHarness` (`tcp`) and `VerbsHarness` (`verbs`); a transport of its own
//! implements [`Harness`] and [`Link`].
//!
//! The files: the engine model every scenario runs — `workload.rs` (what a run does:
//! [`Workload`]), `engine.rs` (running it over a [`Link`]: [`run_workload`]), `report.rs` (what
//! it did: [`RunReport`]), `verify.rs` (the receiver's bytes compared with the sender's); the
//! scenarios (`scenarios.rs`, and `parallel.rs` for heterogeneous parallelism); the demo and its
//! timeline (`demo.rs`, `timeline.rs`); the built-in transports' harnesses (`mem.rs`, `tcp.rs`,
//! `verbs.rs`, and `threaded.rs` shared by the last two).

mod compute;
mod content;
pub mod demo;
mod engine;
#[cfg(feature = "mem")]
mod mem;
pub mod parallel;
mod report;
mod scenarios;
#[cfg(feature = "tcp")]
mod tcp;
#[cfg(any(feature = "tcp", feature = "verbs"))]
mod threaded;
pub mod timeline;
#[cfg(feature = "verbs")]
mod verbs;
mod verify;
mod workload;

use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::wire::Role;
use kvpipe_core::{Event, Instant, PeerId, Receiver, Sender};
use thiserror::Error;

use crate::cache::ReferenceCache;

pub use compute::SimulatedCompute;
pub use engine::{run_workload, run_workload_with};
#[cfg(feature = "mem")]
pub use mem::MemHarness;
pub use report::{Outcome, RequestReport, RunReport};
pub use scenarios::{check_clean, scenario, scenarios, Scenario};
#[cfg(feature = "tcp")]
pub use tcp::{TcpHarness, TcpLink};
#[cfg(any(feature = "tcp", feature = "verbs"))]
pub use threaded::ThreadedLink;
#[cfg(feature = "verbs")]
pub use verbs::{VerbsHarness, VerbsLink};
pub use verify::verify_against_sender;
pub use workload::{layer_slices, Interrupt, RequestPlan, TransferMode, Workload};

/// Where a harness puts both caches' pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PoolMemory {
    /// Host memory: the caches' own buffers are registered.
    #[default]
    Host,
    /// GPU memory of CUDA device `ordinal` (`cuda` feature): the harness places both caches
    /// there ([`ReferenceCache::place_on_device`]) and registers the device pools; the suite's
    /// checks read them back ([`ReferenceCache::sync_from_device`]).
    #[cfg(feature = "cuda")]
    Device {
        /// The GPU.
        ordinal: usize,
    },
}

impl PoolMemory {
    /// "host" or "device".
    pub fn name(self) -> &'static str {
        match self {
            PoolMemory::Host => "host",
            #[cfg(feature = "cuda")]
            PoolMemory::Device { .. } => "device",
        }
    }

    /// Puts `cache`'s pools where `self` says (nothing to do for host memory).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn place(self, cache: &mut ReferenceCache) -> Result<(), LinkError> {
        match self {
            PoolMemory::Host => Ok(()),
            #[cfg(feature = "cuda")]
            PoolMemory::Device { ordinal } => {
                let device = kvpipe_cuda::Device::open(ordinal)
                    .map_err(|e| LinkError::Transport(e.to_string()))?;
                cache
                    .place_on_device(&device)
                    .map_err(|e| LinkError::Transport(e.to_string()))
            }
        }
    }
}

/// Faults a scenario asks the transport to inject (transport-neutral; a harness maps it onto
/// its transport's fault wrapper).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Seed of the fault generator.
    pub seed: u64,
    /// Probability that a session frame is dropped.
    pub drop: f64,
    /// Probability that a session frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a session frame overtakes the one before it.
    pub reorder: f64,
    /// Probability that a session frame is delayed.
    pub delay: f64,
    /// Longest delay, in milliseconds.
    pub max_delay_ms: u64,
    /// Probability that a write batch fails.
    pub fail_writes: f64,
    /// Write batches (from 0, in issue order) that fail for sure.
    pub fail_batches: Vec<u64>,
    /// Write batches (from 0, in issue order) whose completion is reported late.
    pub stall_batches: Vec<u64>,
    /// How late, in milliseconds.
    pub stall_ms: u64,
}

impl FaultPlan {
    /// Whether the plan injects anything.
    pub fn is_active(&self) -> bool {
        self.drop > 0.0
            || self.duplicate > 0.0
            || self.reorder > 0.0
            || self.delay > 0.0
            || self.fail_writes > 0.0
            || !self.fail_batches.is_empty()
            || !self.stall_batches.is_empty()
    }
}

/// A kind of fault a harness may or may not be able to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// Drop, duplicate, reorder or delay control frames.
    Frames,
    /// Fail write batches.
    Writes,
    /// Kill one endpoint.
    PeerDeath,
}

/// A transport's failure while carrying a scenario.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LinkError {
    /// The transport reported an error.
    #[error("transport error: {0}")]
    Transport(String),
    /// The transport cannot inject a fault the scenario needs.
    #[error("the transport cannot inject {0:?} faults")]
    Unsupported(FaultKind),
}

/// A failed scenario.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SuiteError {
    /// The transport failed.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The engine model (reference cache) refused an operation: a scenario bug.
    #[error("reference cache: {0}")]
    Cache(String),
    /// An endpoint refused an engine command.
    #[error("{side:?} endpoint refused a command: {message}")]
    Usage {
        /// The side.
        side: Role,
        /// The error.
        message: String,
    },
    /// Requests did not end (or quiesce) in time.
    #[error("requests did not settle within {limit_ms} ms: {pending}")]
    Stalled {
        /// The limit.
        limit_ms: u64,
        /// What was still pending.
        pending: String,
    },
    /// A check failed.
    #[error("check failed: {0}")]
    Check(String),
}

/// How the suite reaches a transport: makes a connected pair with both caches' memory
/// registered.
pub trait Harness {
    /// The connected pair.
    type Link: Link;

    /// The transport's name (for messages).
    fn name(&self) -> &'static str;

    /// Whether the transport can inject faults of `kind`.
    fn supports(&self, kind: FaultKind) -> bool;

    /// Builds the pair: a sender with `sender` config whose memory is `sender_cache`'s regions,
    /// a receiver with `receiver` config over `receiver_cache`'s regions, faults as `faults`
    /// says; and connects them (the handshake starts; the suite drives it).
    ///
    /// # Safety
    ///
    /// The transport registers the caches' memory by address: both caches must outlive the
    /// returned link, and must not be moved or resized while it lives (the reference cache
    /// never reallocates a region).
    unsafe fn connect(
        &self,
        sender: SenderConfig,
        receiver: ReceiverConfig,
        sender_cache: &mut ReferenceCache,
        receiver_cache: &mut ReferenceCache,
        faults: &FaultPlan,
    ) -> Result<Self::Link, LinkError>;
}

/// One write batch's issue and report times (transports that record them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchTiming {
    /// Bytes in the batch.
    pub bytes: u64,
    /// When the sender asked for it.
    pub issued: Instant,
    /// How long the bytes took to move (the transport's own measure; `reported - issued` if
    /// it has none).
    pub transfer: kvpipe_core::Duration,
    /// When the transport saw the bytes moved (`reported` if it does not record it).
    pub copied: Instant,
    /// When its outcome reached the sender.
    pub reported: Instant,
}

/// A connected sender/receiver pair over some transport, driven by the suite.
pub trait Link {
    /// The transport's current time.
    fn now(&self) -> Instant;
    /// The sender endpoint (engine commands; call [`Link::pump`] afterwards).
    fn sender(&mut self) -> &mut Sender;
    /// The receiver endpoint (engine commands; call [`Link::pump`] afterwards).
    fn receiver(&mut self) -> &mut Receiver;
    /// How the receiver names the sender.
    fn sender_peer(&self) -> PeerId;
    /// How the sender names the receiver.
    fn receiver_peer(&self) -> PeerId;
    /// Does everything possible now without blocking.
    fn pump(&mut self) -> Result<(), LinkError>;
    /// Blocks until something may be ready, for at most `max`.
    fn wait(&mut self, max: std::time::Duration);
    /// Events both endpoints reported since the last call, in order, with their times.
    fn take_events(&mut self) -> Vec<(Role, Instant, Event)>;
    /// Kills one endpoint as if its process died.
    fn kill(&mut self, side: Role) -> Result<(), LinkError>;
    /// Whether `side` is alive.
    fn is_alive(&self, side: Role) -> bool;
    /// Write batches not reported yet.
    fn writes_in_flight(&self) -> usize;
    /// Issue and report times of the write batches so far (empty if not recorded).
    fn batch_timings(&self) -> Vec<BatchTiming> {
        Vec::new()
    }
    /// Whether [`gate_slice`](Link::gate_slice) makes a slice's copies wait for a fence on the
    /// GPU (the in-process transport); elsewhere the engine waits for the fence itself before
    /// it submits.
    #[cfg(feature = "cuda")]
    fn gates_slices(&self) -> bool {
        false
    }
    /// Makes `slice`'s writes start only once `fence` passed; call it after the submission
    /// that returned the slice, before the next [`pump`](Link::pump).
    #[cfg(feature = "cuda")]
    fn gate_slice(
        &mut self,
        _request: kvpipe_core::RequestId,
        _slice: kvpipe_core::SenderSliceId,
        _fence: std::sync::Arc<kvpipe_cuda::Fence>,
    ) -> Result<(), LinkError> {
        Err(LinkError::Transport(
            "this transport cannot gate a slice's writes behind a fence".into(),
        ))
    }
}

/// Makes one `#[test]` per conformance scenario, running it over the harness `$harness`
/// (an expression). Use it in a transport's `tests/conformance.rs`:
///
/// ```ignore
/// kvpipe_conformance::conformance_tests!(kvpipe_conformance::suite::MemHarness::default());
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr) => {
        $crate::conformance_tests!(@each $harness;
            geometry_single_chunk, geometry_ragged_chunks, geometry_chunks_without_blocks,
            geometry_prompt_shorter_than_block, geometry_fragmented_slots, geometry_mla,
            geometry_empty_prompt, sender_prefix_sent_early,
            sender_prefix_reuse, receiver_prefix_reuse, both_prefixes,
            windows_with_sinks, several_layer_groups, concurrent_requests,
            incremental_allocation, late_registration, cancel_mid_prefill_sender,
            cancel_mid_prefill_receiver, cancel_before_registration, sender_death,
            receiver_death, registration_timeout, write_failure, write_timeout, duplicated_frames, delayed_frames, reordered_frames,
            chaos, version_mismatch, monolithic_transfer, layer_slices_full_attention,
            layer_slices_windowed, layer_slices_sinks_and_prefixes, layer_slices_late_registration,
            layer_slices_write_failure
        );
        $crate::conformance_tests!(@parallel $harness;
            parallel_fewer_prefill_ranks, parallel_more_prefill_ranks, parallel_duplicated_heads,
            parallel_decode_pipeline, parallel_tensor_and_pipeline, parallel_larger_decode_window,
            parallel_layer_slices_tensor, parallel_layer_slices_pipeline
        );
    };
    (@parallel $harness:expr; $($name:ident),* $(,)?) => {
        /// Every heterogeneous scenario of the suite has a test here.
        #[test]
        fn conformance_covers_every_parallel_scenario() {
            let tested = [$(stringify!($name)),*];
            let all = $crate::suite::parallel::parallel_scenarios();
            for s in &all {
                assert!(tested.contains(&s.name), "scenario {} has no test", s.name);
            }
            assert_eq!(tested.len(), all.len());
        }
        $(
            #[test]
            fn $name() {
                let harness = $harness;
                if let Err(e) = $crate::suite::parallel::run_parallel(&harness, stringify!($name)) {
                    panic!("{} over {}: {e}", stringify!($name), $crate::suite::Harness::name(&harness));
                }
            }
        )*
    };
    (@each $harness:expr; $($name:ident),* $(,)?) => {
        /// Every scenario of the suite has a test here.
        #[test]
        fn conformance_covers_every_scenario() {
            let tested = [$(stringify!($name)),*];
            for s in $crate::suite::scenarios() {
                assert!(tested.contains(&s.name), "scenario {} has no test", s.name);
            }
            assert_eq!(tested.len(), $crate::suite::scenarios().len());
        }
        $(
            #[test]
            fn $name() {
                let harness = $harness;
                let scenario = $crate::suite::scenario(stringify!($name))
                    .expect("a scenario of that name exists");
                if let Err(e) = scenario.run(&harness) {
                    panic!("{} over {}: {e}", stringify!($name), $crate::suite::Harness::name(&harness));
                }
            }
        )*
    };
}
