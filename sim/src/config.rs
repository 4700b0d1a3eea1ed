//! What a simulation run is parameterised by: the seed, the endpoints' model and deadlines,
//! the faults and their rates (as the network emulation's configuration), and scripted
//! faults and planted bugs for tests.

use kvpipe_core::session::Deadlines;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Duration, RequestId};
use kvpipe_netem::{BatchFault, LossModel, NetemConfig, ScriptedBatch};

use super::faults::{FaultKind, FaultRates, FaultSet};
use super::SimRng;
use kvpipe_conformance::cache::{CacheSpec, GroupSpec, RankSplit};

/// Everything a simulation run is parameterised by.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Seed of every random choice (workload and faults).
    pub seed: u64,
    /// Sender ranks (separate instances that each write some requests, or the tensor-parallel
    /// ranks of one instance, which write each request together: see `split`).
    pub senders: usize,
    /// Faults switched on.
    pub faults: FaultSet,
    /// How often they strike.
    pub rates: FaultRates,
    /// Deadlines of both endpoints.
    pub deadlines: Deadlines,
    /// Requests in progress at once (later arrivals wait).
    pub max_active: usize,
    /// Longest prompt of a random workload.
    pub max_prompt: u32,
    /// Percentage of random requests the engine cancels.
    pub cancel_percent: u64,
    /// Prefill compute time per token of a random request, drawn from this range.
    pub prefill_per_token: (Duration, Duration),
    /// Tokens per block of the simulated model.
    pub tokens_per_block: u32,
    /// Sliding window of the model's second layer group, in tokens.
    pub window: u32,
    /// Leading tokens the senders keep resident in the windowed group.
    pub sink_tokens: u32,
    /// How the senders' pools split the first (full-attention) group's layers.
    pub sender_pool_split: Vec<u16>,
    /// How the receiver's pools split them (the planner pairs layer ranges across splits).
    pub receiver_pool_split: Vec<u16>,
    /// Padding bytes at the end of every receiver slot.
    pub receiver_slot_padding: u64,
    /// How the model is spread over the sender ranks and the receiver (random runs draw it).
    pub split: RankSplit,
    /// Layers per layer range each prefill chunk is submitted in, as the engine computes them
    /// (0: whole chunks, the default). The senders' layers are the full-attention group's
    /// (`sender_pool_split`) and the windowed group's one, stacked.
    pub layers_per_slice: u32,
    /// Record a readable trace of every step (scripted scenarios).
    pub trace: bool,
    /// A deliberate bug, to check that the simulator catches it (tests only).
    pub planted_bug: Option<PlantedBug>,
    /// Steps after which the run stops and unfinished requests count as hung (0: automatic).
    pub max_steps: u64,
    /// Virtual time past the last start after which unfinished requests count as hung.
    pub time_limit: Duration,
}

impl SimConfig {
    /// Two sender ranks, short deadlines, the given seed and faults. The model's block size,
    /// window and sink tokens are drawn from the seed too, so sweeps over seeds cover several.
    pub fn new(seed: u64, faults: FaultSet) -> Self {
        let mut rng = SimRng::new(seed).fork(3);
        let tokens_per_block = *rng.pick(&[4, 4, 8, 16, 1]).expect("non-empty");
        let window = *rng.pick(&[24, 12, 40, 64, 100]).expect("non-empty");
        let sink_tokens = *rng.pick(&[0, 4, 8]).expect("non-empty");
        let splits: [&[u16]; 4] = [&[1, 2], &[3], &[2, 1], &[1, 1, 1]];
        let sender_pool_split = rng.pick(&splits).expect("non-empty").to_vec();
        let receiver_pool_split = rng.pick(&splits).expect("non-empty").to_vec();
        let receiver_slot_padding = *rng.pick(&[0, 0, 8, 24]).expect("non-empty");
        SimConfig {
            seed,
            senders: 2,
            faults,
            rates: FaultRates::default(),
            deadlines: Deadlines {
                handshake: Duration::from_millis(100),
                registration: Duration::from_millis(1_000),
                write_completion: Duration::from_millis(200),
                result_wait: Duration::from_millis(5_000),
                result_per_token: Duration::ZERO,
                result_idle: Duration::from_millis(5_000),
                aux_wait: Duration::from_millis(300),
                heartbeat_interval: Duration::from_millis(50),
                liveness_timeout: Duration::from_millis(400),
                quiesce: Duration::from_millis(150),
            },
            max_active: 24,
            max_prompt: 160,
            cancel_percent: 5,
            prefill_per_token: (Duration::from_micros(2), Duration::from_micros(20)),
            tokens_per_block,
            window,
            sink_tokens,
            sender_pool_split,
            receiver_pool_split,
            receiver_slot_padding,
            split: RankSplit::WHOLE,
            layers_per_slice: 0,
            trace: false,
            planted_bug: None,
            max_steps: 0,
            time_limit: Duration::from_secs(120),
        }
    }

    /// A long-context workload: prefill is 15–30× slower per token than by default, so most
    /// requests' prefill outlasts `result_wait` many times over, while the deadlines follow
    /// progress (`result_per_token` covers the slowest prefill, `result_idle` the longest
    /// chunk). Every request that is not cancelled or hit by a fault must still complete.
    pub fn slow_prefill(mut self) -> Self {
        self.prefill_per_token = (Duration::from_micros(300), Duration::from_micros(600));
        self.deadlines.result_wait = Duration::from_millis(20);
        self.deadlines.result_per_token = Duration::from_millis(1);
        self.deadlines.result_idle = Duration::from_millis(1_000);
        self
    }

    /// The reference cache of sender rank `rank` (`None`: the receiver's) for a workload whose
    /// longest prompt is `max_prompt` tokens.
    pub fn cache_spec(&self, rank: Option<usize>, max_prompt: u32) -> CacheSpec {
        let blocks = max_prompt.div_ceil(self.tokens_per_block) + 1;
        let split = if rank.is_some() {
            &self.sender_pool_split
        } else {
            &self.receiver_pool_split
        };
        let mut full = GroupSpec::full(split.iter().sum(), split);
        full.kv_heads = 2;
        if rank.is_none() {
            full.slot_padding = self.receiver_slot_padding;
        }
        let windowed = GroupSpec::full(1, &[1]).windowed(self.window, self.sink_tokens);
        CacheSpec {
            tokens_per_block: self.tokens_per_block,
            groups: vec![full, windowed],
            slots_per_group: blocks * self.max_active as u32 + 8,
            first_region: rank.map_or(1000, |r| 100 * (r as u32 + 1)),
            slot_order_seed: Some(self.seed ^ rank.map_or(0xdec0, |r| r as u64 + 1)),
            materialize: true,
        }
    }
}

/// A deliberate mistake of the simulated engine or transport, for tests that show the
/// simulator's checks catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlantedBug {
    /// The sender engine never frees this request's blocks.
    KeepBlocks(RequestId),
    /// The transport flips one byte of every write of this request.
    FlipByte(RequestId),
}

/// A fault a scripted scenario injects at an exact point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScriptedFault {
    /// The `nth` write batch (from 0) sender rank `sender` issues fails with `status`.
    FailBatch {
        /// The sender rank.
        sender: usize,
        /// Which of its batches.
        nth: u64,
        /// The failure reported.
        status: TransferStatus,
    },
    /// The connection of sender rank `sender` dies at `at` (from the origin); both sides are
    /// told.
    KillLink {
        /// The sender rank.
        sender: usize,
        /// When.
        at: Duration,
    },
    /// The connection of sender rank `sender` dies silently at `at`: nobody is told, frames
    /// vanish and writes stall until an endpoint's deadline closes it.
    BreakLink {
        /// The sender rank.
        sender: usize,
        /// When.
        at: Duration,
    },
}

impl SimConfig {
    /// The network emulation of this configuration: the fault kinds switched on, at their
    /// rates, with the scripted batch failures of `script`.
    pub fn netem_config(&self, script: &[ScriptedFault]) -> NetemConfig {
        let on = |kind| self.faults.contains(kind);
        let rate = |kind, p: f64| if on(kind) { p } else { 0.0 };
        let r = &self.rates;
        let us = Duration::from_micros;
        let ms = Duration::from_millis;
        NetemConfig {
            seed: self.seed,
            // Off: every frame takes a fixed few microseconds.
            latency: if on(FaultKind::Latency) {
                (us(20), ms(2))
            } else {
                (us(5), us(5))
            },
            jitter_percent: if on(FaultKind::Latency) { 50 } else { 0 },
            // Connections overtake each other: a skew larger than the base latency.
            skew_per_base: if on(FaultKind::Reordering) { 3 } else { 0 },
            skew: if on(FaultKind::Reordering) {
                us(200)
            } else {
                Duration::ZERO
            },
            loss: rate(FaultKind::Loss, r.loss),
            loss_model: LossModel::Retransmit {
                retry: r.loss_retry,
                timeout: ms(3),
                reset_after: r.loss_reset_after,
            },
            delay: rate(FaultKind::Delay, r.delay),
            delay_range: (ms(10), ms(450)),
            duplicate: rate(FaultKind::Duplication, r.duplication),
            reorder: 0.0,
            corrupt: r.corruption,
            spare_handshake: false,
            write_failure: rate(FaultKind::WriteFailure, r.write_failure),
            grant_violation_share: 0.2,
            scripted_batches: script
                .iter()
                .filter_map(|f| match *f {
                    ScriptedFault::FailBatch {
                        sender,
                        nth,
                        status,
                    } => Some(ScriptedBatch {
                        writer: sender,
                        nth,
                        fault: BatchFault::Fail(status),
                    }),
                    _ => None,
                })
                .collect(),
            write_latency: us(20),
            write_bytes_per_ns: 10,
            // Write batches complete out of issue order.
            write_reorder: if on(FaultKind::Reordering) {
                us(500)
            } else {
                Duration::ZERO
            },
            peer_death: rate(FaultKind::PeerDeath, r.peer_death),
            silent_death: 0.5,
            death_notice_spread: ms(2),
            reconnect_after: (ms(5), ms(50)),
        }
    }
}
