//! # kvpipe-netem
//!
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
//! Three drivers share it: the in-process transport's fault injection (`kvpipe-mem`'s
//! `MemNetwork`, real time, frames queued in a [`FrameQueue`] per direction), the deterministic
//! simulator (`kvpipe-sim`, virtual time, its own event queue) and the fuzz crate
//! (fuzzer-chosen configurations). Each configures the faults it
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

mod config;
mod emulator;
mod fate;
mod queue;
mod rng;

pub use config::{BatchFault, LossModel, NetemConfig, ScriptedBatch};
pub use emulator::{Netem, NetemCounters};
pub use fate::{BatchFate, DeathNotice, Direction, FrameFate, Link, PeerDeath};
pub use queue::FrameQueue;
pub use rng::SeededRng;
