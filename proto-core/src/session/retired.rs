//! Retired request ids: never re-created while a late frame can still name them, in bounded
//! memory, whatever the ids are.
//!
//! Engines name requests by strings and hash them, so ids are arbitrary `u64`s in any order;
//! nothing about an id's value says whether it was used. So a retired id is remembered for a
//! **horizon** after its retirement ([`SenderConfig::retired_horizon`], longer than any
//! deadline): a frame that names it within the horizon finds it retired and never re-creates
//! it. Past the horizon no frame about it can still arrive (a link that delivers nothing for
//! `liveness_timeout` is closed, and every wait has a deadline), so the id is forgotten. Memory
//! is therefore bounded by the retirements of one horizon, and at most `capacity` ids
//! (`max_retired`) are kept: past that the oldest retirement is forgotten early and counted
//! ([`Counters::retired_forgotten_early`]). A fresh id is never refused.
//!
//! Forgetting is in retirement order, which is time order: a queue, O(1) per retirement.
//!
//! [`SenderConfig::retired_horizon`]: super::SenderConfig::retired_horizon
//! [`Counters::retired_forgotten_early`]: super::Counters::retired_forgotten_early

use std::collections::{BTreeMap, VecDeque};

use crate::ids::RequestId;
use crate::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub(crate) struct Retired<V> {
    horizon: Duration,
    capacity: usize,
    items: BTreeMap<RequestId, V>,
    /// Ids in retirement order, each with the instant it may be forgotten (non-decreasing).
    order: VecDeque<(Instant, RequestId)>,
    /// Ids forgotten before their horizon passed because `capacity` was reached.
    forgotten_early: u64,
}

impl<V> Retired<V> {
    pub(crate) fn new(horizon: Duration, capacity: usize) -> Self {
        Retired {
            horizon,
            capacity,
            items: BTreeMap::new(),
            order: VecDeque::new(),
            forgotten_early: 0,
        }
    }

    /// Records `id` as retired at `now`, first forgetting the ids whose horizon passed, then,
    /// past `capacity`, the oldest retirements.
    pub(crate) fn insert(&mut self, now: Instant, id: RequestId, value: V) {
        self.forget_expired(now);
        if self.items.insert(id, value).is_none() {
            // Inputs may carry a `now` earlier than a previous one (a replay, fuzz): keep the
            // queue sorted so the front is always the first to forget.
            let at = now.saturating_add(self.horizon);
            let at = self.order.back().map_or(at, |&(last, _)| at.max(last));
            self.order.push_back((at, id));
        }
        while self.items.len() > self.capacity {
            let Some((_, oldest)) = self.order.pop_front() else {
                break;
            };
            if self.items.remove(&oldest).is_some() {
                self.forgotten_early += 1;
            }
        }
    }

    /// Forgets every id whose horizon passed by `now`.
    pub(crate) fn forget_expired(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.order.front() {
            if at > now {
                break;
            }
            self.order.pop_front();
            self.items.remove(&id);
        }
    }

    /// Whether `id` was retired and is still remembered.
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.items.contains_key(&id)
    }

    /// What is remembered of `id`.
    pub(crate) fn get(&self, id: RequestId) -> Option<&V> {
        self.items.get(&id)
    }

    /// Ids remembered now.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    /// Ids forgotten before their horizon passed, because `capacity` was reached.
    pub(crate) fn forgotten_early(&self) -> u64 {
        self.forgotten_early
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Instant {
        Instant::from_nanos(secs * 1_000_000_000)
    }

    #[test]
    fn ids_are_remembered_for_the_horizon_in_any_order() {
        let mut r = Retired::new(Duration::from_secs(10), 100);
        for (t, id) in [(0, 900), (1, 5), (2, u64::MAX), (3, 0)] {
            r.insert(at(t), RequestId(id), id);
        }
        for id in [900, 5, u64::MAX, 0] {
            assert!(r.contains(RequestId(id)), "{id} retired and remembered");
        }
        assert_eq!(r.get(RequestId(5)), Some(&5));
        // Ids never retired are fresh, whatever their value relative to the retired ones.
        for id in [1, 4, 6, 899, 901, u64::MAX - 1] {
            assert!(!r.contains(RequestId(id)), "{id} was never retired");
        }
        r.forget_expired(at(11));
        assert!(!r.contains(RequestId(900)) && !r.contains(RequestId(5)));
        assert!(r.contains(RequestId(u64::MAX)) && r.contains(RequestId(0)));
        r.forget_expired(at(13));
        assert_eq!(r.len(), 0);
        assert_eq!(r.forgotten_early(), 0);
    }

    #[test]
    fn capacity_forgets_the_oldest_retirement_first_and_counts_it() {
        let mut r = Retired::new(Duration::from_secs(100), 2);
        r.insert(at(0), RequestId(7), ());
        r.insert(at(1), RequestId(3), ());
        r.insert(at(2), RequestId(9), ());
        assert!(
            !r.contains(RequestId(7)),
            "the oldest retirement goes first"
        );
        assert!(r.contains(RequestId(3)) && r.contains(RequestId(9)));
        assert_eq!(r.forgotten_early(), 1);
        let mut none = Retired::new(Duration::from_secs(100), 0);
        none.insert(at(0), RequestId(8), ());
        assert!(!none.contains(RequestId(8)) && none.forgotten_early() == 1);
    }

    #[test]
    fn a_clock_that_steps_back_keeps_the_queue_in_order() {
        let mut r = Retired::new(Duration::from_secs(10), 100);
        r.insert(at(50), RequestId(1), ());
        r.insert(at(5), RequestId(2), ());
        r.forget_expired(at(59));
        assert!(r.contains(RequestId(1)) && r.contains(RequestId(2)));
        r.forget_expired(at(60));
        assert_eq!(r.len(), 0);
    }

    /// `n` random 64-bit ids, retired at a steady rate of 100,000 per second of virtual time
    /// with a 2 s horizon: none is ever refused as retired before its own retirement, and
    /// memory stays at one horizon's retirements.
    fn random_ids_are_never_refused_and_memory_stays_bounded(n: u64) {
        let horizon = Duration::from_secs(2);
        let per_request = Duration::from_micros(10);
        let mut r = Retired::new(horizon, usize::MAX);
        let mut state = 0x5eed_u64;
        let mut next = || {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let mut refused = 0u64;
        let mut most = 0usize;
        for i in 0..n {
            let now = Instant::from_nanos(i * per_request.as_nanos());
            let id = RequestId(next());
            refused += u64::from(r.contains(id));
            r.insert(now, id, ());
            most = most.max(r.len());
        }
        assert_eq!(refused, 0, "a fresh id was taken for a retired one");
        let per_horizon = (horizon.as_nanos() / per_request.as_nanos()) as usize;
        assert!(
            most <= per_horizon + 1,
            "{most} ids remembered, more than one horizon's {per_horizon}"
        );
        assert_eq!(r.forgotten_early(), 0);
    }

    #[test]
    fn a_million_random_ids_are_never_refused_and_memory_stays_bounded() {
        random_ids_are_never_refused_and_memory_stays_bounded(1_000_000);
    }

    /// The ten-million run (under 20 s in release on a busy 2-core machine:
    /// `cargo test --release -p kvpipe-core --lib retired -- --ignored`).
    #[test]
    #[ignore = "ten million ids: run in release"]
    fn ten_million_random_ids_are_never_refused_and_memory_stays_bounded() {
        random_ids_are_never_refused_and_memory_stays_bounded(10_000_000);
    }
}
