//! The fault-injecting part of the transport: frames dropped, duplicated, reordered or delayed,
//! write batches failed, peers killed — all from a seed, so a failing run can be replayed.

use kvpipe_core::Duration;

/// Which faults to inject, with what probability. The default injects nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultConfig {
    /// Seed of the fault generator.
    pub seed: u64,
    /// Probability that a frame is dropped.
    pub drop: f64,
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a frame overtakes the one queued before it.
    pub reorder: f64,
    /// Probability that a frame is delayed by up to [`FaultConfig::max_delay`].
    pub delay: f64,
    /// Longest extra delay of a delayed frame.
    pub max_delay: Duration,
    /// Probability that a write batch fails (half its bytes are copied, then it reports
    /// `WriteFailed`).
    pub fail_writes: f64,
    /// Write batches (counted from 0 in issue order) that fail for sure.
    pub fail_batches: Vec<u64>,
    /// Write batches (counted from 0 in issue order) whose completion is reported only after
    /// [`FaultConfig::stall`] (a stuck NIC or DMA engine; the bytes land at once).
    pub stall_batches: Vec<u64>,
    /// How long a stalled batch's report is held back.
    pub stall: Duration,
    /// Leave handshake frames alone, so connections still establish.
    pub spare_handshake: bool,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            seed: 0,
            drop: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            delay: 0.0,
            max_delay: Duration::from_millis(5),
            fail_writes: 0.0,
            fail_batches: Vec::new(),
            stall_batches: Vec::new(),
            stall: Duration::from_millis(500),
            spare_handshake: true,
        }
    }
}

impl FaultConfig {
    /// Whether any fault is configured.
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

/// What to do with one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameFate {
    pub(crate) drop: bool,
    pub(crate) duplicate: bool,
    pub(crate) reorder: bool,
    pub(crate) delay: Duration,
}

/// Counts of injected faults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Frames dropped.
    pub dropped: u64,
    /// Frames duplicated.
    pub duplicated: u64,
    /// Frames reordered.
    pub reordered: u64,
    /// Frames delayed.
    pub delayed: u64,
    /// Write batches failed.
    pub failed_writes: u64,
    /// Write batch reports held back.
    pub stalled_writes: u64,
}

/// Draws the faults from the seed (xorshift64*).
#[derive(Clone, Debug)]
pub(crate) struct FaultInjector {
    config: FaultConfig,
    state: u64,
    batches: u64,
    pub(crate) counts: FaultCounts,
}

impl FaultInjector {
    pub(crate) fn new(config: FaultConfig) -> Self {
        FaultInjector {
            state: config.seed ^ 0x9e37_79b9_7f4a_7c15 | 1,
            config,
            batches: 0,
            counts: FaultCounts::default(),
        }
    }

    fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    pub(crate) fn frame(&mut self, handshake: bool) -> FrameFate {
        let mut fate = FrameFate {
            drop: false,
            duplicate: false,
            reorder: false,
            delay: Duration::ZERO,
        };
        if handshake && self.config.spare_handshake {
            return fate;
        }
        if self.chance(self.config.drop) {
            fate.drop = true;
            self.counts.dropped += 1;
            return fate;
        }
        if self.chance(self.config.duplicate) {
            fate.duplicate = true;
            self.counts.duplicated += 1;
        }
        if self.chance(self.config.reorder) {
            fate.reorder = true;
            self.counts.reordered += 1;
        }
        if self.chance(self.config.delay) {
            let max = self.config.max_delay.as_nanos().max(1);
            fate.delay = Duration::from_nanos(self.next() % max);
            self.counts.delayed += 1;
        }
        fate
    }

    /// What happens to the next write batch: whether it fails, and how long its report is held.
    pub(crate) fn batch(&mut self) -> (bool, Option<Duration>) {
        let n = self.batches;
        self.batches += 1;
        let fail = self.config.fail_batches.contains(&n) || self.chance(self.config.fail_writes);
        if fail {
            self.counts.failed_writes += 1;
        }
        let stall = self
            .config
            .stall_batches
            .contains(&n)
            .then_some(self.config.stall);
        if stall.is_some() {
            self.counts.stalled_writes += 1;
        }
        (fail, stall)
    }
}
