//! The node's clock: the core's [`Instant`] counted from an origin, and back to the standard
//! clock for waiting. Every driver of this repository reads time through it (the threaded
//! nodes here, `kvpipe-mem`'s run loop).

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

/// Converts standard-clock readings to the core's [`Instant`]: nanoseconds since the clock's
/// origin. Nodes that compare event times share one origin.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: WallInstant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Clock::starting_at(WallInstant::now())
    }

    /// A clock counting from `origin`.
    pub fn starting_at(origin: WallInstant) -> Self {
        Clock { origin }
    }

    /// The current time.
    pub fn now(&self) -> Instant {
        self.from_std(WallInstant::now())
    }

    /// A reading of the standard clock as the core's time (before the origin: zero).
    pub fn from_std(&self, at: WallInstant) -> Instant {
        let nanos = at.saturating_duration_since(self.origin).as_nanos();
        Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// The core's time as a reading of the standard clock.
    pub fn to_std(&self, at: Instant) -> WallInstant {
        self.origin + StdDuration::from_nanos(at.as_nanos())
    }

    /// The wall-clock instant of the core's `at` (`None`: too far to matter).
    pub fn wall(&self, at: Instant) -> Option<WallInstant> {
        self.origin
            .checked_add(StdDuration::from_nanos(at.as_nanos()))
    }

    /// How long from now until `at` (zero if it passed).
    pub fn until(&self, at: Instant) -> StdDuration {
        StdDuration::from_nanos(at.saturating_duration_since(self.now()).as_nanos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_is_monotonic() {
        let clock = Clock::new();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
        let later = Instant::from_nanos(a.as_nanos() + 5_000_000);
        assert_eq!(clock.from_std(clock.to_std(later)), later);
        assert!(clock.until(later) <= std::time::Duration::from_millis(5));
        assert_eq!(clock.until(Instant::ZERO), std::time::Duration::ZERO);
    }
}
