//! The node's clock: the core's [`Instant`] counted from an origin, and the wall-clock instant of
//! a core deadline.

use std::time::Duration as StdDuration;

use kvpipe_core::Instant;

/// A wall-clock instant (what threads wait until).
pub type WallInstant = std::time::Instant;

/// How far away a deadline is when the caller's timeout does not fit in an instant (e.g.
/// `Duration::MAX`, meaning "no hurry"): thirty years, as tokio's own far future.
pub(crate) const FAR: StdDuration = StdDuration::from_secs(30 * 365 * 86_400);

/// `at + d`, or thirty years after `at` where that overflows.
pub fn later(at: WallInstant, d: StdDuration) -> WallInstant {
    at.checked_add(d).unwrap_or(at + FAR)
}

/// The instant `timeout` from now (see [`later`]).
pub fn deadline_after(timeout: StdDuration) -> WallInstant {
    later(WallInstant::now(), timeout)
}

/// The core's notion of now for one node: nanoseconds since `origin`. Nodes that compare event
/// times share one origin.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: WallInstant,
}

impl Clock {
    /// A clock counting from `origin`.
    pub fn new(origin: WallInstant) -> Self {
        Clock { origin }
    }

    /// The core's now.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall-clock instant of the core's `at` (`None`: too far to matter).
    pub fn wall(&self, at: Instant) -> Option<WallInstant> {
        self.origin
            .checked_add(StdDuration::from_nanos(at.as_nanos()))
    }
}
