//! Real time as the core's [`Instant`]: nanoseconds since the driver's origin.

use kvpipe_core::Instant;

/// Converts `std::time::Instant` readings to the core's [`Instant`], counting from the moment
/// the clock was made.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: std::time::Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Clock {
            origin: std::time::Instant::now(),
        }
    }

    /// The current time.
    pub fn now(&self) -> Instant {
        self.from_std(std::time::Instant::now())
    }

    /// A reading of the standard clock as the core's time (before the origin: zero).
    pub fn from_std(&self, at: std::time::Instant) -> Instant {
        let nanos = at.saturating_duration_since(self.origin).as_nanos();
        Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// The core's time as a reading of the standard clock.
    pub fn to_std(&self, at: Instant) -> std::time::Instant {
        self.origin + std::time::Duration::from_nanos(at.as_nanos())
    }

    /// How long from now until `at` (zero if it passed).
    pub fn until(&self, at: Instant) -> std::time::Duration {
        std::time::Duration::from_nanos(at.saturating_duration_since(self.now()).as_nanos())
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
