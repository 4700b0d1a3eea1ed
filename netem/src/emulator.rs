//! The seeded decision maker.

use bytes::Bytes;
use kvpipe_core::wire::{FrameHeader, FrameKind, TransferStatus, HEADER_LEN};
use kvpipe_core::{Duration, Instant};

use crate::config::{BatchFault, LossModel, NetemConfig, ScriptedBatch};
use crate::fate::{BatchFate, DeathNotice, Direction, FrameFate, Link, PeerDeath};
use crate::rng::SeededRng;

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

/// The seeded decision maker (see the crate doc).
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

    /// A new connection, its base latency drawn from [`NetemConfig::latency`](crate::NetemConfig::latency).
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
    FrameHeader::view(bytes)
        .and_then(|h| FrameKind::from_code(h.kind))
        .is_some_and(FrameKind::is_handshake)
}
