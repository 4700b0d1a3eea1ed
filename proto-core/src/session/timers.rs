//! Deadline queue. Entries may be stale (the entity's deadline moved): a stale entry fires a
//! timeout early, which every handler treats as a harmless no-op, then re-arms the entity's real
//! next deadline.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use crate::ids::{PeerId, RequestId};
use crate::time::Instant;

/// What a deadline belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TimerKey {
    Peer(PeerId),
    Request(RequestId),
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, TimerKey)>>,
}

impl Timers {
    pub(crate) fn arm(&mut self, at: Instant, key: TimerKey) {
        if at != Instant::MAX {
            self.heap.push(Reverse((at, key)));
        }
    }

    pub(crate) fn arm_opt(&mut self, at: Option<Instant>, key: TimerKey) {
        if let Some(at) = at {
            self.arm(at, key);
        }
    }

    pub(crate) fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Removes and returns every key due at `now`, deduplicated, in deadline order.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<TimerKey> {
        let mut keys = Vec::new();
        let mut seen = BTreeSet::new();
        while let Some(Reverse((at, key))) = self.heap.peek().copied() {
            if at > now {
                break;
            }
            self.heap.pop();
            if seen.insert(key) {
                keys.push(key);
            }
        }
        keys
    }
}
