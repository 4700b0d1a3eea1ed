//! Deadline queue. Entries may be stale (the entity's deadline moved): a stale entry fires a
//! timeout early, which every handler treats as a harmless no-op, then re-arms the entity's real
//! next deadline.
//!
//! **Memory**: an entry lives until it fires or its key is [disarmed](Timers::disarm). The
//! endpoints disarm a request when it quiesces (nothing of it waits any more), so the queue
//! holds the deadlines of the requests in progress — not one entry per deadline of every
//! request served in the last deadline's length (a two-minute result cap at 20,000 requests a
//! second was millions of entries).

use std::collections::BTreeSet;

use crate::ids::{PeerId, RequestId};
use crate::time::Instant;

/// What a deadline belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TimerKey {
    Peer(PeerId),
    Request(RequestId),
}

/// The armed deadlines, ordered by time and, for disarming, by key. An entry armed twice is
/// held once (it fires once either way: [`Timers::due`] yields each key once).
#[derive(Clone, Debug, Default)]
pub(crate) struct Timers {
    by_time: BTreeSet<(Instant, TimerKey)>,
    by_key: BTreeSet<(TimerKey, Instant)>,
}

impl Timers {
    pub(crate) fn arm(&mut self, at: Instant, key: TimerKey) {
        if at != Instant::MAX && self.by_time.insert((at, key)) {
            self.by_key.insert((key, at));
        }
    }

    pub(crate) fn arm_opt(&mut self, at: Option<Instant>, key: TimerKey) {
        if let Some(at) = at {
            self.arm(at, key);
        }
    }

    /// Drops every deadline of `key` (nothing of it waits any more). O(its entries × log n).
    pub(crate) fn disarm(&mut self, key: TimerKey) {
        while let Some(&(k, at)) = self
            .by_key
            .range((key, Instant::ZERO)..=(key, Instant::MAX))
            .next()
        {
            self.by_key.remove(&(k, at));
            self.by_time.remove(&(at, k));
        }
    }

    /// The earliest deadline armed for `key`. O(log n).
    pub(crate) fn earliest(&self, key: TimerKey) -> Option<Instant> {
        self.by_key
            .range((key, Instant::ZERO)..=(key, Instant::MAX))
            .next()
            .map(|(_, at)| *at)
    }

    pub(crate) fn next(&self) -> Option<Instant> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Deadlines armed and not fired or disarmed yet.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_time.len()
    }

    /// Removes and returns every key due at `now`, deduplicated, in deadline order.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<TimerKey> {
        let mut keys = Vec::new();
        let mut seen = BTreeSet::new();
        while let Some(&(at, key)) = self.by_time.first() {
            if at > now {
                break;
            }
            self.by_time.pop_first();
            self.by_key.remove(&(key, at));
            if seen.insert(key) {
                keys.push(key);
            }
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_in_deadline_order_once_per_key_and_forgets_disarmed_keys() {
        let at = Instant::from_millis;
        let (a, b, p) = (
            TimerKey::Request(RequestId(1)),
            TimerKey::Request(RequestId(2)),
            TimerKey::Peer(PeerId(1)),
        );
        let mut t = Timers::default();
        t.arm(at(30), a);
        t.arm(at(10), a);
        t.arm(at(10), a);
        t.arm(at(20), b);
        t.arm(at(5), p);
        t.arm(Instant::MAX, p);
        t.arm_opt(None, b);
        assert_eq!((t.len(), t.next()), (4, Some(at(5))));
        assert_eq!(t.due(at(20)), vec![p, a, b]);
        assert_eq!((t.len(), t.next()), (1, Some(at(30))));
        t.arm(at(40), b);
        t.arm(at(50), a);
        t.disarm(a);
        assert_eq!((t.len(), t.next()), (1, Some(at(40))));
        assert_eq!(t.by_key.len(), 1);
        t.disarm(a);
        assert_eq!(t.earliest(a), None);
        assert_eq!(t.earliest(b), Some(at(40)));
        assert_eq!(t.due(at(100)), vec![b]);
        assert_eq!((t.len(), t.next(), t.by_key.len()), (0, None, 0));
    }
}
