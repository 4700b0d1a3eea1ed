//! Seeded network emulation: what happens to each frame and each write batch on an emulated
//! link — latency and jitter, loss (dropped, or retransmitted until the connection resets),
//! duplication, reordering, delay spikes, corruption, failed and stalled writes, and peer death.
//!
//! A [`Netem`] is a pure decision maker: it reads no clock and moves no byte. The caller hands
//! it a frame (as the bytes an endpoint encoded) or a write batch with `now`, and gets a fate
//! back ([`FrameFate`], [`BatchFate`]); every choice is drawn from one [`SeededRng`], so the same
//! seed and the same calls give the same fates, and a failing run can be replayed. Its
//! [`NetemCounters`] say what it injected.
//!
//! Three drivers share it: the in-process transport's fault injection
//! ([`MemNetwork`](crate::MemNetwork), real time, frames queued in a [`FrameQueue`] per
//! direction), the conformance crate's deterministic simulator (virtual time, its own event
//! queue) and the fuzz crate (fuzzer-chosen configurations). Each configures the faults it
//! needs; [`NetemConfig::default`] injects nothing.
//!
//! What a fault means, in the order a frame's fate is drawn:
//!
//! 1. **Latency**: a [`Link`]'s base latency is drawn from [`NetemConfig::latency`] when the
//!    link is made; each frame adds a jitter of up to [`NetemConfig::jitter_percent`] of it,
//!    and a *skew* (up to `skew_per_base × base + skew`) that lets frames of different links
//!    overtake each other while each link stays in order.
//! 2. **Loss** ([`NetemConfig::loss`]): under [`LossModel::Drop`] the frame vanishes; under
//!    [`LossModel::Retransmit`] the reliable stream sends it again after a timeout (holding up
//!    the link), and too many losses in a row reset the connection ([`FrameFate::Reset`]).
//! 3. **Delay spikes** ([`NetemConfig::delay`]): the frame is held for a time drawn from
//!    [`NetemConfig::delay_range`]; later frames of the link wait behind it.
//! 4. Each link direction delivers in order: a frame is never due before the one sent before it.
//! 5. **Duplication**: the frame is delivered twice.
//! 6. **Reordering** ([`NetemConfig::reorder`]): the frame overtakes the one queued before it
//!    on its own link (this breaks the transport contract's ordering on purpose; the
//!    simulator's reordering keeps it and uses the skew instead).
//! 7. **Corruption** ([`NetemConfig::corrupt`]): one bit of the frame's header flips (its
//!    magic, version, flags or body length — never the kind byte), so decoding always catches
//!    it. Transports rely on their link's integrity check (TCP checksums, RDMA ICRC) for the
//!    body; a damaged frame that slipped past it is outside the contract, so none is made.
//!
//! Handshake frames can be spared ([`NetemConfig::spare_handshake`]) so connections still
//! establish. Write batches ([`Netem::batch`]) may fail (randomly or scripted by index), be
//! stalled (scripted), take a latency that grows with their size, and complete out of issue
//! order; [`Netem::landed_extents`] says how much of a failed or interrupted batch landed.
//! Peer death: [`Netem::peer_death`] decides whether (and when, and whether silently) one of a
//! request's connections dies, and [`Netem::death_notice`] how the two ends learn of it and
//! when the connection comes back.

use std::collections::VecDeque;

use bytes::Bytes;
use kvpipe_core::wire::{FrameHeader, FrameKind, TransferStatus, HEADER_LEN};
use kvpipe_core::{Duration, Instant};

/// A SplitMix64 generator: small, fast and reproducible (the same seed gives the same sequence
/// on every platform). Every choice a [`Netem`] makes is drawn from one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SeededRng { state: seed }
    }

    /// An independent generator derived from this one's seed and `stream` (for sub-systems that
    /// must not shift each other's sequences).
    pub fn fork(&self, stream: u64) -> Self {
        let mut r = SeededRng::new(self.state ^ stream.wrapping_mul(0xa076_1d64_78bd_642f));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`0` when `n == 0`, without drawing).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift: unbiased enough for emulation, no division.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A value in `lo..=hi` (`lo` when `hi <= lo`, without drawing).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// `true` with probability `p`; `p <= 0` and `p >= 1` decide without drawing.
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// A uniformly chosen element of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.below(items.len() as u64) as usize)
    }

    fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_nanos(self.range(lo.as_nanos(), hi.as_nanos()))
    }
}

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
    /// The writer (the index the driver passes to [`Netem::batch`]).
    pub writer: usize,
    /// Which of its batches.
    pub nth: u64,
    /// What happens to it.
    pub fault: BatchFault,
}

/// Which faults a [`Netem`] injects, and how often. The default injects nothing: no latency, no
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

/// What a [`Netem`] injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetemCounters {
    /// Frames handed to it.
    pub frames: u64,
    /// Frames dropped for good ([`LossModel::Drop`]).
    pub dropped: u64,
    /// Losses followed by a retransmission or a reset ([`LossModel::Retransmit`]), counting
    /// every lost copy.
    pub lost: u64,
    /// Connections reset after too many losses in a row.
    pub resets: u64,
    /// Frames held for a delay spike.
    pub delayed: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Frames that overtook the one before them.
    pub reordered: u64,
    /// Frames whose header was damaged.
    pub corrupted: u64,
    /// Write batches handed to it.
    pub batches: u64,
    /// Write batches failed.
    pub failed_writes: u64,
    /// Write batch reports held back.
    pub stalled_writes: u64,
    /// Connection deaths scheduled.
    pub peer_deaths: u64,
}

/// One direction of a [`Link`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the sender to the receiver.
    ToReceiver,
    /// From the receiver to the sender.
    ToSender,
}

/// An emulated connection: its base latency and what keeps it in order. Made by
/// [`Netem::link`]; the driver keeps one per connection and passes it with every frame and
/// batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    base: Duration,
    /// When the last frame each way is due (a link delivers in order).
    last: [Instant; 2],
    /// When the last write batch completes (in order unless `write_reorder`).
    last_write: Instant,
}

impl Link {
    /// The link's base latency.
    pub fn base_latency(&self) -> Duration {
        self.base
    }

    /// The connection (re)starts at `now`: nothing sent before is still on it.
    pub fn restart(&mut self, now: Instant) {
        self.last = [now; 2];
        self.last_write = now;
    }
}

/// What happens to one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameFate {
    /// Deliver `copies` copies of `bytes` at `at` (after any frame of the link due before).
    Deliver {
        /// When it is due.
        at: Instant,
        /// 1, or 2 when duplicated.
        copies: u8,
        /// It overtakes the frame queued before it on its link (which is then due at the same
        /// time as this one, see [`FrameQueue::push`]).
        overtake: bool,
        /// The bytes as they arrive (damaged when corrupted).
        bytes: Bytes,
    },
    /// The frame is gone.
    Dropped,
    /// The stream lost it too many times in a row: the connection resets at `at`.
    Reset {
        /// When the connection gives up.
        at: Instant,
    },
}

/// What happens to one write batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchFate {
    /// The batch fails with this status (`None`: it completes).
    pub fail: Option<TransferStatus>,
    /// Its report is held back this long after it is done.
    pub stall: Option<Duration>,
    /// When it is done (emulated transfer time; a driver that really copies ignores it).
    pub done_at: Instant,
}

/// A connection death [`Netem::peer_death`] scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerDeath<T> {
    /// Whose connection dies.
    pub victim: T,
    /// When, from now.
    pub after: Duration,
    /// Nobody is told: frames vanish and writes stall until an endpoint's deadline closes it.
    pub silent: bool,
}

/// How the two ends of a dead connection learn of it, and when it comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeathNotice {
    /// The receiver's end learns first (at once); otherwise the sender's.
    pub receiver_first: bool,
    /// When the other end learns, from the death.
    pub other_after: Duration,
    /// When the connection is back, from the death.
    pub reconnect_after: Duration,
}

/// The seeded decision maker (see the module doc).
#[derive(Clone, Debug)]
pub struct Netem {
    config: NetemConfig,
    rng: SeededRng,
    /// Batches issued per writer.
    issued: Vec<u64>,
    counters: NetemCounters,
}

impl Netem {
    /// A network emulator drawing from `SeededRng::new(config.seed)`.
    pub fn new(config: NetemConfig) -> Self {
        let rng = SeededRng::new(config.seed);
        Netem::with_rng(config, rng)
    }

    /// A network emulator drawing from `rng` (for a caller that derives it from a larger
    /// seed); `config.seed` is not used.
    pub fn with_rng(config: NetemConfig, rng: SeededRng) -> Self {
        Netem {
            config,
            rng,
            issued: Vec::new(),
            counters: NetemCounters::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &NetemConfig {
        &self.config
    }

    /// What it injected so far.
    pub fn counters(&self) -> &NetemCounters {
        &self.counters
    }

    /// A new connection, its base latency drawn from [`NetemConfig::latency`].
    pub fn link(&mut self) -> Link {
        let (lo, hi) = self.config.latency;
        Link {
            base: self.rng.duration(lo, hi),
            last: [Instant::ZERO; 2],
            last_write: Instant::ZERO,
        }
    }

    /// The fate of `bytes`, one encoded frame sent on `link` towards `direction` at `now`.
    pub fn frame(
        &mut self,
        now: Instant,
        link: &mut Link,
        direction: Direction,
        bytes: Bytes,
    ) -> FrameFate {
        self.counters.frames += 1;
        let slot = direction as usize;
        if self.config.spare_handshake && is_handshake(&bytes) {
            let at = (now + link.base).max(link.last[slot]);
            link.last[slot] = at;
            return FrameFate::Deliver {
                at,
                copies: 1,
                overtake: false,
                bytes,
            };
        }
        let c = &self.config;
        let base = link.base.as_nanos();
        let mut delay = base;
        if c.jitter_percent > 0 {
            delay += self.rng.below(base * c.jitter_percent / 100 + 1);
        }
        if c.skew_per_base > 0 || c.skew > Duration::ZERO {
            delay += self.rng.below(c.skew_per_base * base + c.skew.as_nanos());
        }
        let mut at = now + Duration::from_nanos(delay);
        if self.rng.chance(c.loss) {
            match c.loss_model {
                LossModel::Drop => {
                    self.counters.dropped += 1;
                    return FrameFate::Dropped;
                }
                LossModel::Retransmit {
                    retry,
                    timeout,
                    reset_after,
                } => {
                    let mut losses = 0;
                    loop {
                        losses += 1;
                        self.counters.lost += 1;
                        at += timeout;
                        if losses >= reset_after {
                            self.counters.resets += 1;
                            return FrameFate::Reset { at };
                        }
                        if !self.rng.chance(retry) {
                            break;
                        }
                    }
                }
            }
        }
        if self.rng.chance(c.delay) {
            self.counters.delayed += 1;
            at += self.rng.duration(c.delay_range.0, c.delay_range.1);
        }
        at = at.max(link.last[slot]);
        link.last[slot] = at;
        let copies = if self.rng.chance(c.duplicate) {
            self.counters.duplicated += 1;
            2
        } else {
            1
        };
        let overtake = self.rng.chance(c.reorder);
        self.counters.reordered += u64::from(overtake);
        let bytes = if self.rng.chance(c.corrupt) {
            self.counters.corrupted += 1;
            self.damage_header(bytes)
        } else {
            bytes
        };
        FrameFate::Deliver {
            at,
            copies,
            overtake,
            bytes,
        }
    }

    /// Flips one bit of the header's magic, version, flags or body length.
    fn damage_header(&mut self, bytes: Bytes) -> Bytes {
        // Header offsets: magic 0..4, version 4..6, kind 6, flags 7, body length 8..12.
        const DAMAGEABLE: [usize; 11] = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11];
        let mut out = bytes.to_vec();
        if out.len() < HEADER_LEN {
            out.clear();
            return Bytes::from(out);
        }
        let at = *self.rng.pick(&DAMAGEABLE).unwrap_or(&0);
        out[at] ^= 1 << self.rng.below(8);
        Bytes::from(out)
    }

    /// The fate of the next write batch `writer` issues on `link` at `now`, moving `bytes`.
    pub fn batch(&mut self, now: Instant, link: &mut Link, writer: usize, bytes: u64) -> BatchFate {
        if self.issued.len() <= writer {
            self.issued.resize(writer + 1, 0);
        }
        let nth = self.issued[writer];
        self.issued[writer] += 1;
        self.counters.batches += 1;
        let c = &self.config;
        let scripted = |f: &ScriptedBatch| f.writer == writer && f.nth == nth;
        let mut fail = c
            .scripted_batches
            .iter()
            .filter(|f| scripted(f))
            .find_map(|f| match f.fault {
                BatchFault::Fail(status) => Some(status),
                BatchFault::Stall(_) => None,
            });
        let stall = c
            .scripted_batches
            .iter()
            .filter(|f| scripted(f))
            .find_map(|f| match f.fault {
                BatchFault::Stall(d) => Some(d),
                BatchFault::Fail(_) => None,
            });
        if fail.is_none() && self.rng.chance(c.write_failure) {
            fail = Some(if self.rng.chance(1.0 - c.grant_violation_share) {
                TransferStatus::WriteFailed
            } else {
                TransferStatus::GrantViolation
            });
        }
        let mut latency = c.write_latency.as_nanos();
        latency += bytes.checked_div(c.write_bytes_per_ns).unwrap_or(0);
        let done_at = if c.write_reorder > Duration::ZERO {
            latency += self.rng.below(c.write_reorder.as_nanos());
            now + Duration::from_nanos(latency)
        } else {
            (now + Duration::from_nanos(latency)).max(link.last_write)
        };
        link.last_write = link.last_write.max(done_at);
        self.counters.failed_writes += u64::from(fail.is_some());
        self.counters.stalled_writes += u64::from(stall.is_some());
        BatchFate {
            fail,
            stall,
            done_at,
        }
    }

    /// How many of the `extents` extents of a batch that failed or was cut off landed (a
    /// prefix, possibly none or all).
    pub fn landed_extents(&mut self, extents: usize) -> usize {
        self.rng.below(extents as u64 + 1) as usize
    }

    /// Whether a request that starts now loses one of its connections (those of `candidates`)
    /// within `within`, and how.
    pub fn peer_death<T: Copy>(
        &mut self,
        candidates: &[T],
        within: Duration,
    ) -> Option<PeerDeath<T>> {
        if candidates.is_empty() || !self.rng.chance(self.config.peer_death) {
            return None;
        }
        let victim = *self.rng.pick(candidates)?;
        let after = Duration::from_nanos(self.rng.below(within.as_nanos()));
        let silent = self.rng.chance(self.config.silent_death);
        self.counters.peer_deaths += 1;
        Some(PeerDeath {
            victim,
            after,
            silent,
        })
    }

    /// How the ends of a connection that just died learn of it, and when it comes back.
    pub fn death_notice(&mut self) -> DeathNotice {
        let receiver_first = self.rng.chance(0.5);
        let other_after =
            Duration::from_nanos(self.rng.below(self.config.death_notice_spread.as_nanos()));
        let (lo, hi) = self.config.reconnect_after;
        let reconnect_after = other_after + self.rng.duration(lo, hi);
        DeathNotice {
            receiver_first,
            other_after,
            reconnect_after,
        }
    }
}

/// Whether `bytes` is a handshake frame (hello, accept, reject).
fn is_handshake(bytes: &[u8]) -> bool {
    FrameHeader::view(bytes).is_some_and(|h| {
        [
            FrameKind::Hello,
            FrameKind::HelloAccept,
            FrameKind::HelloReject,
        ]
        .iter()
        .any(|k| k.code() == h.kind)
    })
}

/// The frames in flight one way on one link, each with the time it is due, in delivery order.
#[derive(Clone, Debug, Default)]
pub struct FrameQueue {
    frames: VecDeque<(Instant, Bytes)>,
}

impl FrameQueue {
    /// Queues a frame by its fate ([`FrameFate::Deliver`]; the others queue nothing).
    pub fn push(&mut self, fate: FrameFate) {
        let FrameFate::Deliver {
            mut at,
            copies,
            overtake,
            bytes,
        } = fate
        else {
            return;
        };
        for _ in 0..copies {
            let mut i = self.frames.len();
            if overtake && i > 0 {
                i -= 1;
                at = self.frames[i].0;
            }
            self.frames.insert(i, (at, bytes.clone()));
        }
    }

    /// The next frame due at or before `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Bytes> {
        if self.frames.front()?.0 > now {
            return None;
        }
        self.frames.pop_front().map(|(_, b)| b)
    }

    /// When the next frame is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.frames.front().map(|(at, _)| *at)
    }

    /// Frames queued.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Forgets every frame (the connection is gone).
    pub fn clear(&mut self) {
        self.frames.clear();
    }

    /// Removes and returns the `i`-th queued frame (modulo the length), whatever its time.
    pub fn take(&mut self, i: usize) -> Option<Bytes> {
        if self.frames.is_empty() {
            return None;
        }
        let i = i % self.frames.len();
        self.frames.remove(i).map(|(_, b)| b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpipe_core::wire::{Frame, Heartbeat};

    fn heartbeat(seq: u64) -> Bytes {
        Bytes::from(Frame::Heartbeat(Heartbeat { seq }).to_vec().unwrap())
    }

    #[test]
    fn same_seed_same_sequence_and_ranges_hold() {
        let mut a = SeededRng::new(7);
        let mut b = SeededRng::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let v = a.range(3, 9);
            assert!((3..=9).contains(&v));
            assert_eq!(v, b.range(3, 9));
        }
        assert_ne!(SeededRng::new(1).next_u64(), SeededRng::new(2).next_u64());
        let hits = (0..10_000).filter(|_| a.chance(0.25)).count();
        assert!((2_000..3_000).contains(&hits), "{hits}");
    }

    #[test]
    fn the_default_injects_nothing_and_keeps_order() {
        let mut net = Netem::new(NetemConfig::default());
        let mut link = net.link();
        let mut q = FrameQueue::default();
        let now = Instant::from_millis(1);
        for seq in 0..50 {
            let fate = net.frame(now, &mut link, Direction::ToReceiver, heartbeat(seq));
            assert!(matches!(
                fate,
                FrameFate::Deliver {
                    copies: 1,
                    overtake: false,
                    at,
                    ..
                } if at == now
            ));
            q.push(fate);
        }
        for seq in 0..50 {
            assert_eq!(q.pop_due(now), Some(heartbeat(seq)));
        }
        let fate = net.batch(now, &mut link, 0, 1 << 20);
        assert_eq!((fate.fail, fate.stall, fate.done_at), (None, None, now));
        assert_eq!(net.counters().frames, 50);
        assert!(!NetemConfig::default().is_active());
    }

    #[test]
    fn the_same_seed_gives_the_same_fates() {
        let config = NetemConfig {
            seed: 9,
            latency: (Duration::from_micros(20), Duration::from_millis(2)),
            jitter_percent: 50,
            loss: 0.1,
            loss_model: LossModel::Retransmit {
                retry: 0.3,
                timeout: Duration::from_millis(3),
                reset_after: 3,
            },
            delay: 0.1,
            duplicate: 0.1,
            reorder: 0.1,
            corrupt: 0.1,
            write_failure: 0.2,
            grant_violation_share: 0.5,
            ..NetemConfig::default()
        };
        let run = || {
            let mut net = Netem::new(config.clone());
            let mut link = net.link();
            let fates: Vec<_> = (0..200)
                .map(|s| {
                    let at = Instant::from_millis(s);
                    (
                        net.frame(at, &mut link, Direction::ToSender, heartbeat(s)),
                        net.batch(at, &mut link, 0, 100),
                    )
                })
                .collect();
            (fates, *net.counters())
        };
        let (a, counts) = run();
        assert_eq!(a, run().0);
        assert!(counts.lost > 0 && counts.delayed > 0 && counts.duplicated > 0);
        assert!(counts.reordered > 0 && counts.corrupted > 0 && counts.failed_writes > 0);
    }

    #[test]
    fn a_link_delivers_in_order_unless_a_frame_overtakes() {
        let config = NetemConfig {
            seed: 3,
            delay: 0.5,
            delay_range: (Duration::ZERO, Duration::from_millis(5)),
            ..NetemConfig::default()
        };
        let mut net = Netem::new(config);
        let mut link = net.link();
        let mut last = Instant::ZERO;
        for s in 0..200 {
            let FrameFate::Deliver { at, .. } = net.frame(
                Instant::ZERO + Duration::from_micros(s * 10),
                &mut link,
                Direction::ToReceiver,
                heartbeat(s),
            ) else {
                panic!("nothing is lost");
            };
            assert!(at >= last);
            last = at;
        }
        // An overtaking frame goes before the last queued one, at its time.
        let mut q = FrameQueue::default();
        let at = |ms| Instant::from_millis(ms);
        for (seq, overtake) in [(1, false), (2, false), (3, true)] {
            q.push(FrameFate::Deliver {
                at: at(seq),
                copies: 1,
                overtake,
                bytes: heartbeat(seq),
            });
        }
        assert_eq!(q.next_due(), Some(at(1)));
        assert_eq!(q.pop_due(at(5)), Some(heartbeat(1)));
        assert_eq!(q.pop_due(at(1)), None);
        assert_eq!(q.pop_due(at(2)), Some(heartbeat(3)));
        assert_eq!(q.pop_due(at(2)), Some(heartbeat(2)));
        assert!(q.is_empty());
    }

    #[test]
    fn a_corrupted_frame_never_decodes() {
        let config = NetemConfig {
            seed: 5,
            corrupt: 1.0,
            ..NetemConfig::default()
        };
        let mut net = Netem::new(config);
        let mut link = net.link();
        for s in 0..500 {
            let FrameFate::Deliver { bytes, .. } = net.frame(
                Instant::ZERO,
                &mut link,
                Direction::ToReceiver,
                heartbeat(s),
            ) else {
                panic!("nothing is lost");
            };
            assert_ne!(bytes, heartbeat(s));
            assert_eq!(bytes.len(), heartbeat(s).len());
            assert!(Frame::parse(&bytes).is_err(), "{bytes:?} decodes");
        }
        assert_eq!(net.counters().corrupted, 500);
    }

    #[test]
    fn retransmissions_hold_a_frame_back_and_too_many_reset_the_link() {
        let config = NetemConfig {
            seed: 1,
            loss: 1.0,
            loss_model: LossModel::Retransmit {
                retry: 1.0,
                timeout: Duration::from_millis(3),
                reset_after: 4,
            },
            ..NetemConfig::default()
        };
        let mut net = Netem::new(config);
        let mut link = net.link();
        let fate = net.frame(
            Instant::ZERO,
            &mut link,
            Direction::ToReceiver,
            heartbeat(1),
        );
        assert_eq!(
            fate,
            FrameFate::Reset {
                at: Instant::from_millis(12)
            }
        );
        assert_eq!((net.counters().lost, net.counters().resets), (4, 1));
    }

    #[test]
    fn scripted_batches_fail_or_stall_exactly() {
        let config = NetemConfig {
            scripted_batches: vec![
                ScriptedBatch {
                    writer: 1,
                    nth: 1,
                    fault: BatchFault::Fail(TransferStatus::GrantViolation),
                },
                ScriptedBatch {
                    writer: 0,
                    nth: 2,
                    fault: BatchFault::Stall(Duration::from_millis(7)),
                },
            ],
            write_latency: Duration::from_micros(20),
            write_bytes_per_ns: 10,
            ..NetemConfig::default()
        };
        let mut net = Netem::new(config);
        let mut link = net.link();
        let now = Instant::from_millis(1);
        let fates: Vec<_> = (0..3)
            .flat_map(|_| [0, 1].map(|w| net.batch(now, &mut link, w, 1000)))
            .collect();
        let failed: Vec<usize> = (0..6).filter(|&i| fates[i].fail.is_some()).collect();
        assert_eq!(failed, vec![3]);
        assert_eq!(fates[3].fail, Some(TransferStatus::GrantViolation));
        let stalled: Vec<usize> = (0..6).filter(|&i| fates[i].stall.is_some()).collect();
        assert_eq!(stalled, vec![4]);
        assert_eq!(fates[0].done_at, now + Duration::from_nanos(20_100));
    }
}
