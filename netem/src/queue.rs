//! Frames in flight, queued by their fates.

use std::collections::VecDeque;

use bytes::Bytes;
use kvpipe_core::Instant;

use crate::fate::FrameFate;

/// The frames in flight one way on one link, each with the time it is due, in delivery order.
#[derive(Clone, Debug, Default)]
pub struct FrameQueue {
    frames: VecDeque<(Instant, Bytes)>,
}

impl FrameQueue {
    /// Queues a frame by its fate ([`FrameFate::Deliver`]; the others queue nothing).
    pub fn push(&mut self, fate: FrameFate) {
        let FrameFate::Deliver {
            mut at,
            copies,
            overtake,
            bytes,
        } = fate
        else {
            return;
        };
        for _ in 0..copies {
            let mut i = self.frames.len();
            if overtake && i > 0 {
                i -= 1;
                at = self.frames[i].0;
            }
            self.frames.insert(i, (at, bytes.clone()));
        }
    }

    /// The next frame due at or before `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Bytes> {
        if self.frames.front()?.0 > now {
            return None;
        }
        self.frames.pop_front().map(|(_, b)| b)
    }

    /// When the next frame is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.frames.front().map(|(at, _)| *at)
    }

    /// Frames queued.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Forgets every frame (the connection is gone).
    pub fn clear(&mut self) {
        self.frames.clear();
    }

    /// Removes and returns the `i`-th queued frame (modulo the length), whatever its time.
    pub fn take(&mut self, i: usize) -> Option<Bytes> {
        if self.frames.is_empty() {
            return None;
        }
        let i = i % self.frames.len();
        self.frames.remove(i).map(|(_, b)| b)
    }
}
