//! What the emulator hands back (the fate of a frame, of a write batch, a connection's death)
//! and the per-connection state it keeps ([`Link`]).

use bytes::Bytes;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Duration, Instant};

/// One direction of a [`Link`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the sender to the receiver.
    ToReceiver,
    /// From the receiver to the sender.
    ToSender,
}

/// An emulated connection: its base latency and what keeps it in order. Made by
/// [`Netem::link`](crate::Netem::link); the driver keeps one per connection and passes it with every frame and
/// batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub(crate) base: Duration,
    /// When the last frame each way is due (a link delivers in order).
    pub(crate) last: [Instant; 2],
    /// When the last write batch completes (in order unless `write_reorder`).
    pub(crate) last_write: Instant,
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
        /// time as this one, see [`FrameQueue::push`](crate::FrameQueue::push)).
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

/// A connection death [`Netem::peer_death`](crate::Netem::peer_death) scheduled.
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
