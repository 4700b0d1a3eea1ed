//! Virtual time and the event queue: what is scheduled when, popped earliest first (ties in
//! the order they were scheduled), and the bounds that stop a run that does not settle.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use kvpipe_core::Instant;

/// Outputs one step may produce before the run counts as a livelock.
const MAX_OUTPUTS_PER_STEP: u64 = 1_000_000;

#[derive(Debug)]
struct Scheduled<A> {
    at: Instant,
    seq: u64,
    action: A,
}

impl<A> PartialEq for Scheduled<A> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<A> Eq for Scheduled<A> {}
impl<A> PartialOrd for Scheduled<A> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<A> Ord for Scheduled<A> {
    /// Reversed, so the max-heap pops the earliest (then first scheduled) action.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// The virtual clock, the queue of scheduled actions, and the step bounds.
#[derive(Debug)]
pub(crate) struct Scheduler<A> {
    now: Instant,
    seq: u64,
    queue: BinaryHeap<Scheduled<A>>,
    steps: u64,
    max_steps: u64,
    outputs_this_step: u64,
    livelocked: bool,
}

impl<A> Scheduler<A> {
    /// At time zero, nothing scheduled; a run stops after `max_steps` steps.
    pub(crate) fn new(max_steps: u64) -> Self {
        Scheduler {
            now: Instant::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            steps: 0,
            max_steps,
            outputs_this_step: 0,
            livelocked: false,
        }
    }

    /// Current virtual time.
    pub(crate) fn now(&self) -> Instant {
        self.now
    }

    /// Steps taken.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// Whether the run must stop: the step cap is reached or a step never ran dry.
    pub(crate) fn exhausted(&self) -> bool {
        self.steps >= self.max_steps || self.livelocked
    }

    /// Schedules `action` at `at`.
    pub(crate) fn schedule(&mut self, at: Instant, action: A) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            action,
        });
    }

    /// When the earliest scheduled action is due.
    pub(crate) fn next_at(&self) -> Option<Instant> {
        self.queue.peek().map(|s| s.at)
    }

    /// Starts a step at `at` (time never goes back).
    pub(crate) fn begin_step(&mut self, at: Instant) {
        self.now = self.now.max(at);
        self.steps += 1;
        self.outputs_this_step = 0;
    }

    /// Takes the earliest scheduled action.
    pub(crate) fn pop(&mut self) -> Option<A> {
        self.queue.pop().map(|s| s.action)
    }

    /// Counts one output of this step. Returns `Some(first)` once the step produced too many
    /// (a livelock; `first` is whether this is the first time the run noticed).
    pub(crate) fn count_output(&mut self) -> Option<bool> {
        self.outputs_this_step += 1;
        if self.outputs_this_step <= MAX_OUTPUTS_PER_STEP {
            return None;
        }
        let first = !self.livelocked;
        self.livelocked = true;
        Some(first)
    }
}
