//! Retired request ids: never re-created, in bounded memory.
//!
//! The most recent `capacity` retired ids are remembered exactly (with what the endpoint keeps
//! about them); when one more retires, the smallest remembered id is forgotten and the
//! **floor** rises to it: every id at or below the floor counts as retired from then on. An id
//! is therefore never re-created — at worst a fresh id below the floor is refused loudly. With
//! request ids that increase (a counter, as serving engines use), nothing but retired ids is
//! ever below the floor.

use std::collections::BTreeMap;

use crate::ids::RequestId;

#[derive(Clone, Debug)]
pub(crate) struct Retired<V> {
    capacity: usize,
    floor: Option<RequestId>,
    items: BTreeMap<RequestId, V>,
}

impl<V> Retired<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Retired {
            capacity,
            floor: None,
            items: BTreeMap::new(),
        }
    }

    /// Records `id` as retired, forgetting the smallest remembered id (and raising the floor
    /// to it) when more than `capacity` are remembered.
    pub(crate) fn insert(&mut self, id: RequestId, value: V) {
        if self.below_floor(id) {
            return;
        }
        self.items.insert(id, value);
        while self.items.len() > self.capacity {
            let Some((smallest, _)) = self.items.pop_first() else {
                break;
            };
            self.floor = Some(self.floor.map_or(smallest, |f| f.max(smallest)));
        }
    }

    fn below_floor(&self, id: RequestId) -> bool {
        self.floor.is_some_and(|f| id <= f)
    }

    /// Whether `id` was retired (remembered exactly, or at or below the floor).
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.below_floor(id) || self.items.contains_key(&id)
    }

    /// What is remembered of `id`, if it is still remembered exactly.
    pub(crate) fn get(&self, id: RequestId) -> Option<&V> {
        self.items.get(&id)
    }

    /// Every id at or below this counts as retired.
    #[cfg(test)]
    pub(crate) fn floor(&self) -> Option<RequestId> {
        self.floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgotten_ids_stay_retired_under_the_floor() {
        let mut r = Retired::new(2);
        for id in [5, 7, 9] {
            r.insert(RequestId(id), id);
        }
        assert_eq!(r.floor(), Some(RequestId(5)));
        assert!(r.contains(RequestId(5)) && r.get(RequestId(5)).is_none());
        assert!(r.contains(RequestId(3)), "below the floor");
        assert!(!r.contains(RequestId(6)) && !r.contains(RequestId(10)));
        assert_eq!(r.get(RequestId(9)), Some(&9));
        r.insert(RequestId(4), 4);
        assert_eq!(r.items.len(), 2, "an id below the floor adds nothing");
        let mut zero = Retired::new(0);
        zero.insert(RequestId(8), ());
        assert!(zero.contains(RequestId(8)) && zero.contains(RequestId(1)));
        assert!(!zero.contains(RequestId(9)));
    }
}
