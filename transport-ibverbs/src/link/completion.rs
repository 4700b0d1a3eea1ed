//! Progress: reaping the completion queue (receives reassembled into messages, signaled sends
//! and writes freeing room, flushes after a failure), reposting receive buffers, and noticing
//! the peer's end on the bootstrap socket.

use std::io;
use std::time::Instant;

use sideway::ibverbs::completion::WorkCompletionStatus;
use sideway::ibverbs::queue_pair::{QueuePair, SetScatterGatherEntry};

use super::{
    wr_id, Inner, Link, State, KIND_SHIFT, LOW_MASK, PEER_CLOSE_GRACE, SOCKET_CHECK, WR_RECV,
    WR_SEND, WR_WRITE,
};
use crate::fabric::api::{status_name, FabricEvent, LinkFailure, WriteFailure};

impl Link {
    /// Reaps completions, delivers messages, posts what waits, checks the peer's liveness and
    /// advances a teardown. Returns whether anything happened.
    pub(crate) fn progress(&self, events: &mut Vec<FabricEvent>) -> bool {
        let mut wcs: Vec<(u64, u32, u32)> = Vec::new();
        if let Ok(poller) = self.cq.start_poll() {
            for wc in poller.take(64) {
                wcs.push((wc.wr_id(), wc.status(), wc.byte_len()));
            }
        }
        let now = Instant::now();
        let mut inner = self.lock();
        if inner.state == State::Closed {
            return !wcs.is_empty();
        }
        let mut did = !wcs.is_empty();
        let mut reposts: Vec<u32> = Vec::new();
        for (id, status, len) in wcs {
            self.complete(&mut inner, id, status, len, &mut reposts, events, now);
        }
        if !reposts.is_empty() && matches!(inner.state, State::Live | State::Draining { .. }) {
            self.repost(&mut inner, &reposts, now);
        }
        match inner.state {
            State::Live | State::Draining { .. } => {
                if now.saturating_duration_since(inner.last_socket_check) >= SOCKET_CHECK {
                    inner.last_socket_check = now;
                    if let Some(cause) = self.peer_gone() {
                        self.teardown_after(&mut inner, cause, now, PEER_CLOSE_GRACE);
                        return true;
                    }
                }
                did |= self.pump(&mut inner);
                if let State::Draining { deadline } = inner.state {
                    let idle = inner.sends.is_empty()
                        && inner.batches.is_empty()
                        && inner.signaled.is_empty();
                    if idle || now >= deadline {
                        self.teardown(&mut inner, LinkFailure::Closed, now);
                        did = true;
                    }
                }
            }
            State::Failing { .. } => {
                Self::to_error(&mut inner, now);
                let State::Failing {
                    errored, deadline, ..
                } = inner.state
                else {
                    unreachable!("matched above")
                };
                if errored && (inner.recv_posted == 0 || now >= deadline) {
                    // The fence: once the queue pair is destroyed the adapter neither reads
                    // this side's sources nor places the peer's writes for this link.
                    inner.qp = None;
                    inner.state = State::Closed;
                    events.push(FabricEvent::Disconnected {
                        link: self.id,
                        cause: inner.cause.clone().unwrap_or(LinkFailure::Closed),
                    });
                    did = true;
                }
            }
            State::Closed => {}
        }
        did
    }

    /// Whether the peer ended the bootstrap socket (its process died, or it tore down).
    fn peer_gone(&self) -> Option<LinkFailure> {
        let mut b = [0u8; 1];
        match self.socket.peek(&mut b) {
            Ok(0) => Some(LinkFailure::PeerClosed),
            Ok(_) => Some(LinkFailure::Protocol(
                "the peer sent bytes on the bootstrap socket after setup".into(),
            )),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(e) => Some(LinkFailure::Socket(e.to_string())),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        inner: &mut Inner,
        id: u64,
        status: u32,
        len: u32,
        reposts: &mut Vec<u32>,
        events: &mut Vec<FabricEvent>,
        now: Instant,
    ) {
        let (kind, low) = (id >> KIND_SHIFT, id & LOW_MASK);
        let ok = status == WorkCompletionStatus::Success as u32;
        let failing = matches!(inner.state, State::Failing { .. } | State::Closed);
        if kind == WR_RECV {
            inner.recv_posted = inner.recv_posted.saturating_sub(1);
            if !ok {
                if !failing {
                    self.teardown(inner, LinkFailure::completion("receive", status), now);
                }
                return;
            }
            let slot = low as u32;
            // A successful receive is delivered even while tearing down: the peer sent it
            // before it closed.
            let start = slot as usize * self.slot_len;
            let end = start + (len as usize).min(self.slot_len);
            if end > inner.ctrl_buf.len() || slot >= self.recv_depth {
                self.teardown(
                    inner,
                    LinkFailure::Protocol("receive in an unknown slot".into()),
                    now,
                );
                return;
            }
            match inner.reassembler.push(&inner.ctrl_buf[start..end]) {
                Ok(Some(bytes)) => events.push(FabricEvent::Message {
                    link: self.id,
                    bytes,
                }),
                Ok(None) => {}
                Err(e) => {
                    self.teardown(inner, LinkFailure::Protocol(e.to_string()), now);
                    return;
                }
            }
            reposts.push(slot);
            return;
        }
        if inner.state == State::Closed {
            return;
        }
        if !ok {
            // Flushes only echo a failure already being handled; any other error is the
            // failure itself (also when it arrives while the link is going down).
            let flushed = status == WorkCompletionStatus::WorkRequestFlushedError as u32;
            if failing && flushed {
                return;
            }
            if kind == WR_WRITE {
                events.push(FabricEvent::WritesDone {
                    link: self.id,
                    token: low,
                    result: Err(WriteFailure::Completion(status_name(status), status)),
                });
            }
            let op = match kind {
                WR_SEND => "send",
                WR_WRITE => "RDMA write",
                _ => "credit write",
            };
            let cause = LinkFailure::completion(op, status);
            if failing {
                // The peer closed because of this error: it is the better cause.
                if inner.cause == Some(LinkFailure::PeerClosed) {
                    inner.cause = Some(cause);
                }
            } else {
                self.teardown(inner, cause, now);
            }
            return;
        }
        // A successful completion is of the oldest signaled work request.
        if let Some(done) = inner.signaled.pop_front() {
            inner.sq_outstanding = inner.sq_outstanding.saturating_sub(done.covered);
            inner.posted_write_bytes = inner.posted_write_bytes.saturating_sub(done.write_bytes);
            if let Some(slot) = done.send_slot {
                inner.free_send_slots.push(slot);
            }
            if let Some(token) = done.batch_done {
                events.push(FabricEvent::WritesDone {
                    link: self.id,
                    token,
                    result: Ok(()),
                });
            }
        }
    }

    fn repost(&self, inner: &mut Inner, slots: &[u32], now: Instant) {
        let local_len = self.slot_len;
        let base = inner.ctrl_buf.as_ptr() as u64;
        let lkey = inner.ctrl_mr.lkey();
        let Some(qp) = inner.qp.as_mut() else {
            return;
        };
        let mut guard = qp.start_post_recv();
        for &slot in slots {
            // SAFETY: the slot lies inside the registered control buffer.
            unsafe {
                guard.construct_wr(wr_id(WR_RECV, slot.into())).setup_sge(
                    lkey,
                    base + slot as u64 * local_len as u64,
                    local_len as u32,
                );
            }
        }
        match guard.post() {
            Ok(()) => {
                inner.recv_posted += slots.len() as u32;
                for _ in slots {
                    inner.returns.reposted();
                }
            }
            Err(e) => self.teardown(inner, LinkFailure::Verbs(format!("post_recv: {e:?}")), now),
        }
    }
}
