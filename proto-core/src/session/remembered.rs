//! A bounded set of request ids, forgetting the oldest first (remembered cancels, retired ids).

use std::collections::{BTreeMap, VecDeque};

use crate::ids::RequestId;

/// Insertion-ordered, bounded map from request id to a small value.
#[derive(Clone, Debug)]
pub(crate) struct Remembered<V> {
    capacity: usize,
    order: VecDeque<RequestId>,
    items: BTreeMap<RequestId, V>,
}

impl<V> Remembered<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Remembered {
            capacity,
            order: VecDeque::new(),
            items: BTreeMap::new(),
        }
    }

    /// Remembers `id`, forgetting the oldest entry when full. A capacity of 0 remembers nothing.
    /// An id already remembered keeps its first value: the first cause of a cancel is the one
    /// reported (a peer answering our own cancel must not turn it into the peer's).
    pub(crate) fn insert(&mut self, id: RequestId, value: V) {
        if self.capacity == 0 || self.items.contains_key(&id) {
            return;
        }
        self.items.insert(id, value);
        self.order.push_back(id);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.items.remove(&old);
            }
        }
    }

    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.items.contains_key(&id)
    }

    /// Forgets `id` and returns its value. O(len) for the order queue, which is bounded.
    pub(crate) fn take(&mut self, id: RequestId) -> Option<V> {
        let value = self.items.remove(&id)?;
        if let Some(pos) = self.order.iter().position(|&o| o == id) {
            self.order.remove(pos);
        }
        Some(value)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgets_oldest_first() {
        let mut r = Remembered::new(2);
        r.insert(RequestId(1), ());
        r.insert(RequestId(2), ());
        r.insert(RequestId(3), ());
        assert!(!r.contains(RequestId(1)));
        assert!(r.contains(RequestId(2)) && r.contains(RequestId(3)));
        assert_eq!(r.take(RequestId(2)), Some(()));
        let mut first = Remembered::new(2);
        first.insert(RequestId(1), 'a');
        first.insert(RequestId(1), 'b');
        assert_eq!(first.take(RequestId(1)), Some('a'));
        assert_eq!(r.len(), 1);
        let mut zero = Remembered::new(0);
        zero.insert(RequestId(1), ());
        assert!(!zero.contains(RequestId(1)));
    }
}
