//! The completion poller's idle policy: spin for a bounded time after the last piece of work,
//! then sleep in growing steps up to a ceiling. Anything that hands the poller new work wakes
//! it early (`Thread::unpark`), so the ceiling bounds only how late an unannounced event (a
//! completion, a peer's message) is noticed.

use std::time::{Duration, Instant};

/// How the completion poller waits when there is nothing to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdlePolicy {
    /// Busy-poll this long after the last piece of work before sleeping.
    pub spin: Duration,
    /// First sleep after spinning.
    pub min_sleep: Duration,
    /// Longest sleep (each idle sleep doubles, up to this).
    pub max_sleep: Duration,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy {
            spin: Duration::from_micros(50),
            min_sleep: Duration::from_micros(20),
            max_sleep: Duration::from_millis(1),
        }
    }
}

/// What the poller does after a round that found nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleStep {
    /// Poll again at once.
    Spin,
    /// Sleep this long (or until woken).
    Sleep(Duration),
}

/// The poller's idle state under an [`IdlePolicy`].
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    policy: IdlePolicy,
    idle_since: Option<Instant>,
    sleep: Duration,
}

impl Backoff {
    /// A poller that just did work.
    pub fn new(policy: IdlePolicy) -> Self {
        Backoff {
            policy,
            idle_since: None,
            sleep: policy.min_sleep,
        }
    }

    /// The last round found work: spin again from now on.
    pub fn worked(&mut self) {
        self.idle_since = None;
        self.sleep = self.policy.min_sleep;
    }

    /// The last round found nothing, at `now`: spin or sleep?
    pub fn idle(&mut self, now: Instant) -> IdleStep {
        let since = *self.idle_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.policy.spin {
            return IdleStep::Spin;
        }
        let sleep = self.sleep;
        self.sleep = (self.sleep * 2).min(self.policy.max_sleep);
        IdleStep::Sleep(sleep.min(self.policy.max_sleep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_sleeps_longer_up_to_the_ceiling_and_resets_on_work() {
        let policy = IdlePolicy {
            spin: Duration::from_micros(100),
            min_sleep: Duration::from_micros(10),
            max_sleep: Duration::from_micros(50),
        };
        let t0 = Instant::now();
        let mut b = Backoff::new(policy);
        assert_eq!(b.idle(t0), IdleStep::Spin);
        assert_eq!(b.idle(t0 + Duration::from_micros(99)), IdleStep::Spin);
        let later = t0 + Duration::from_micros(100);
        let steps: Vec<IdleStep> = (0..5).map(|_| b.idle(later)).collect();
        let us = |n| IdleStep::Sleep(Duration::from_micros(n));
        assert_eq!(steps, [us(10), us(20), us(40), us(50), us(50)]);
        b.worked();
        assert_eq!(b.idle(later), IdleStep::Spin);
    }
}
