//! Which faults an emulator injects, and how often.

use kvpipe_core::wire::TransferStatus;
use kvpipe_core::Duration;

/// What happens to a lost frame.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossModel {
    /// It vanishes (a datagram link; breaks the transport contract on purpose).
    Drop,
    /// The reliable stream sends it again after `timeout` (holding up the link behind it);
    /// each retransmission is lost again with probability `retry`, and after `reset_after`
    /// losses in a row the connection resets.
    Retransmit {
        /// Probability that a retransmission is lost again.
        retry: f64,
        /// Time from a loss to the retransmission.
        timeout: Duration,
        /// Losses in a row after which the connection resets.
        reset_after: u32,
    },
}

/// A scripted fault of one write batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchFault {
    /// The batch fails with this status (part of it may have landed).
    Fail(TransferStatus),
    /// The batch's report is held back this long (a stuck NIC or DMA engine; its bytes land).
    Stall(Duration),
}

/// A fault for the `nth` write batch (counted from 0) that writer `writer` issues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScriptedBatch {
    /// The writer (the index the driver passes to [`Netem::batch`](crate::Netem::batch)).
    pub writer: usize,
    /// Which of its batches.
    pub nth: u64,
    /// What happens to it.
    pub fault: BatchFault,
}

/// Which faults a [`Netem`](crate::Netem) injects, and how often. The default injects nothing: no latency, no
/// loss, every frame delivered once, in order, unchanged; every batch completes at once.
#[derive(Clone, Debug, PartialEq)]
pub struct NetemConfig {
    /// Seed of the generator.
    pub seed: u64,
    /// Range a link's base latency is drawn from when the link is made (inclusive; equal
    /// bounds draw nothing).
    pub latency: (Duration, Duration),
    /// Per-frame jitter, uniform up to this percentage of the link's base latency (0: none).
    pub jitter_percent: u64,
    /// Per-frame skew between links: an extra delay uniform below
    /// `skew_per_base × base + skew`, so frames of different links overtake each other
    /// (each link stays in order). Both 0: none.
    pub skew_per_base: u64,
    /// See [`skew_per_base`](Self::skew_per_base).
    pub skew: Duration,
    /// Probability that a frame is lost.
    pub loss: f64,
    /// What a loss does.
    pub loss_model: LossModel,
    /// Probability that a frame is held for a delay spike.
    pub delay: f64,
    /// Range of a delay spike (inclusive).
    pub delay_range: (Duration, Duration),
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a frame overtakes the one queued before it on its link.
    pub reorder: f64,
    /// Probability that one bit of a frame's header flips (decoding catches it).
    pub corrupt: f64,
    /// Leave handshake frames alone, so connections still establish.
    pub spare_handshake: bool,
    /// Probability that a write batch fails.
    pub write_failure: f64,
    /// Of the failed batches, the share reported as `GrantViolation` (the rest `WriteFailed`).
    pub grant_violation_share: f64,
    /// Scripted faults of given batches (applied before the random ones).
    pub scripted_batches: Vec<ScriptedBatch>,
    /// Fixed latency of a write batch.
    pub write_latency: Duration,
    /// Bytes a write batch moves per nanosecond (its size adds `bytes / rate`; 0: nothing).
    pub write_bytes_per_ns: u64,
    /// Extra latency uniform below this; with it, batches complete out of issue order (without
    /// it, a link's batches complete in issue order).
    pub write_reorder: Duration,
    /// Probability that a request's start schedules the death of one of its connections.
    pub peer_death: f64,
    /// Probability that such a death is silent (nobody is told; frames vanish, writes stall).
    pub silent_death: f64,
    /// After a death, one end learns at once, the other within this.
    pub death_notice_spread: Duration,
    /// A dead connection comes back after a time in this range (inclusive), after both ends
    /// learned of the death.
    pub reconnect_after: (Duration, Duration),
}

impl Default for NetemConfig {
    fn default() -> Self {
        NetemConfig {
            seed: 0,
            latency: (Duration::ZERO, Duration::ZERO),
            jitter_percent: 0,
            skew_per_base: 0,
            skew: Duration::ZERO,
            loss: 0.0,
            loss_model: LossModel::Drop,
            delay: 0.0,
            delay_range: (Duration::ZERO, Duration::from_millis(5)),
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            spare_handshake: true,
            write_failure: 0.0,
            grant_violation_share: 0.0,
            scripted_batches: Vec::new(),
            write_latency: Duration::ZERO,
            write_bytes_per_ns: 0,
            write_reorder: Duration::ZERO,
            peer_death: 0.0,
            silent_death: 0.0,
            death_notice_spread: Duration::ZERO,
            reconnect_after: (Duration::ZERO, Duration::ZERO),
        }
    }
}

impl NetemConfig {
    /// Whether any fault (not only latency) is configured.
    pub fn is_active(&self) -> bool {
        self.loss > 0.0
            || self.delay > 0.0
            || self.duplicate > 0.0
            || self.reorder > 0.0
            || self.corrupt > 0.0
            || self.write_failure > 0.0
            || !self.scripted_batches.is_empty()
            || self.peer_death > 0.0
    }
}
