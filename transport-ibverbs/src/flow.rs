//! The control channel's flow control and framing, independent of the verbs calls that carry
//! them (so they are tested without a device).
//!
//! - **Credits.** A side may have at most `peer_depth` control messages outstanding at the
//!   peer: one per receive buffer the peer keeps posted. The peer counts the buffers it has
//!   consumed and posted again and RDMA-writes that count into this side's credit word (no
//!   receive buffer is spent on it, so credit returns can never deadlock against messages).
//!   [`Credits::available`] is `peer_depth - (sent - returned)`.
//! - **Returns.** [`CreditReturn`] says when the receiving side writes its count back: once
//!   a quarter of its buffers were reposted since the last write. A peer blocked on credits has
//!   all `depth` of its messages consumed here, so the count due then is at least a quarter of
//!   the depth and is always written: no deadlock, at most one credit write per quarter depth.
//! - **Fragments.** A control message longer than a receive buffer travels as several SENDs;
//!   each starts with one byte, [`FRAG_MORE`] or [`FRAG_LAST`]. RC delivers them in order, so
//!   [`Reassembler`] only concatenates, refusing messages past its limit.

use thiserror::Error;

/// First byte of a fragment that is followed by more of the same message.
pub const FRAG_MORE: u8 = 1;
/// First byte of a message's last (or only) fragment.
pub const FRAG_LAST: u8 = 0;
/// Bytes of fragment header before the payload.
pub const FRAG_HEADER: usize = 1;

/// Send credits towards one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credits {
    peer_depth: u64,
    sent: u64,
}

impl Credits {
    /// Credits for a peer that keeps `peer_depth` receive buffers posted.
    pub fn new(peer_depth: u32) -> Self {
        Credits {
            peer_depth: u64::from(peer_depth),
            sent: 0,
        }
    }

    /// Messages that may be sent now, given the peer's latest count of reposted buffers (a
    /// count larger than the messages sent is treated as the messages sent: a peer cannot
    /// return what it never got).
    pub fn available(&self, returned: u64) -> u64 {
        let returned = returned.min(self.sent);
        self.peer_depth - (self.sent - returned).min(self.peer_depth)
    }

    /// Spends one credit (the caller checked [`Credits::available`]).
    pub fn spend(&mut self) {
        self.sent += 1;
    }

    /// Messages sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }
}

/// When the receiving side writes its count of reposted buffers back to the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreditReturn {
    threshold: u64,
    reposted: u64,
    written: u64,
}

impl CreditReturn {
    /// For a side with `depth` receive buffers.
    pub fn new(depth: u32) -> Self {
        CreditReturn {
            threshold: u64::from(depth / 4).max(1),
            reposted: 0,
            written: 0,
        }
    }

    /// One receive buffer was consumed and posted again.
    pub fn reposted(&mut self) {
        self.reposted += 1;
    }

    /// The count to write to the peer now, if one is due; the caller writes it (and calls
    /// [`CreditReturn::written`]) or retries later.
    pub fn due(&self) -> Option<u64> {
        (self.reposted - self.written >= self.threshold).then_some(self.reposted)
    }

    /// The count `value` was handed to the queue pair.
    pub fn written(&mut self, value: u64) {
        self.written = self.written.max(value);
    }
}

/// A control message that cannot be reassembled.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FragmentError {
    /// A fragment without its header byte, or with an unknown one.
    #[error("control fragment with header {0:?} (expected 0 or 1)")]
    BadHeader(Option<u8>),
    /// The message grew past the limit.
    #[error("control message longer than {limit} bytes")]
    TooLong {
        /// The limit.
        limit: usize,
    },
}

/// Splits `message` into fragments of at most `buf_len` bytes (header included), calling
/// `emit(header, payload)` for each in order.
pub fn fragments(message: &[u8], buf_len: usize) -> impl Iterator<Item = (u8, &[u8])> {
    let payload = buf_len.saturating_sub(FRAG_HEADER).max(1);
    let count = message.len().div_ceil(payload).max(1);
    (0..count).map(move |i| {
        let start = i * payload;
        let end = (start + payload).min(message.len());
        let header = if i + 1 == count { FRAG_LAST } else { FRAG_MORE };
        (header, &message[start..end])
    })
}

/// Joins a peer's fragments back into messages.
#[derive(Debug)]
pub struct Reassembler {
    limit: usize,
    partial: Vec<u8>,
}

impl Reassembler {
    /// Accepts messages of at most `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Reassembler {
            limit,
            partial: Vec::new(),
        }
    }

    /// Adds one received fragment; returns the message it completes, if it does.
    pub fn push(&mut self, fragment: &[u8]) -> Result<Option<Vec<u8>>, FragmentError> {
        let (&header, payload) = fragment
            .split_first()
            .ok_or(FragmentError::BadHeader(None))?;
        if header != FRAG_MORE && header != FRAG_LAST {
            return Err(FragmentError::BadHeader(Some(header)));
        }
        if self.partial.len() + payload.len() > self.limit {
            self.partial = Vec::new();
            return Err(FragmentError::TooLong { limit: self.limit });
        }
        self.partial.extend_from_slice(payload);
        Ok((header == FRAG_LAST).then(|| std::mem::take(&mut self.partial)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credits_follow_the_peers_returns() {
        let mut c = Credits::new(4);
        assert_eq!(c.available(0), 4);
        for _ in 0..4 {
            c.spend();
        }
        assert_eq!(c.available(0), 0);
        assert_eq!(c.available(3), 3);
        // A peer claiming more than it got is capped at what was sent.
        assert_eq!(c.available(1000), 4);
    }

    #[test]
    fn credit_returns_are_batched_and_always_due_when_the_peer_is_blocked() {
        let depth = 16;
        let mut peer = Credits::new(depth);
        let mut ret = CreditReturn::new(depth);
        let mut returned = 0;
        // The peer sends until blocked; this side consumes and reposts every message.
        for _ in 0..1000 {
            if peer.available(returned) == 0 {
                // Blocked: a return must be due now, or the peer would wait forever.
                let due = ret.due().expect("a return is due when the peer is blocked");
                ret.written(due);
                returned = due;
                continue;
            }
            peer.spend();
            ret.reposted();
            if let Some(due) = ret.due() {
                assert!(due - returned >= u64::from(depth / 4));
                ret.written(due);
                returned = due;
            }
        }
        assert!(peer.sent() > 900);
    }

    #[test]
    fn fragments_reassemble_in_order() {
        let msg: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let mut r = Reassembler::new(4096);
        let mut out = None;
        let frags: Vec<_> = fragments(&msg, 100).collect();
        assert_eq!(frags.len(), 11);
        for (i, (h, p)) in frags.iter().enumerate() {
            assert!(p.len() < 100);
            let mut f = vec![*h];
            f.extend_from_slice(p);
            let got = r.push(&f).expect("valid");
            assert_eq!(got.is_some(), i + 1 == frags.len());
            out = got.or(out);
        }
        assert_eq!(out.expect("complete"), msg);
        // An empty message is one empty last fragment.
        assert_eq!(fragments(&[], 100).count(), 1);
        assert_eq!(r.push(&[FRAG_LAST]), Ok(Some(Vec::new())));
    }

    #[test]
    fn reassembly_refuses_bad_headers_and_long_messages() {
        let mut r = Reassembler::new(10);
        assert_eq!(r.push(&[]), Err(FragmentError::BadHeader(None)));
        assert_eq!(r.push(&[7, 1]), Err(FragmentError::BadHeader(Some(7))));
        assert_eq!(r.push(&[FRAG_MORE, 1, 2, 3, 4, 5, 6]), Ok(None));
        assert_eq!(
            r.push(&[FRAG_LAST, 1, 2, 3, 4, 5]),
            Err(FragmentError::TooLong { limit: 10 })
        );
        // It starts over after the refusal.
        assert_eq!(r.push(&[FRAG_LAST, 9]), Ok(Some(vec![9])));
    }
}
