//! Sending: control messages and write batches queued in order, then posted as credits, send
//! buffers, send-queue room and the write window allow, chained into one doorbell.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvpipe_core::WriteExtent;
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::queue_pair::{
    PostSendError, PostSendGuard, QueuePair, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

use super::{
    wr_id, Inner, Link, PendingBatch, PendingSend, Signaled, State, SIGNAL_EVERY, WR_CREDIT,
    WR_SEND, WR_WRITE,
};
use crate::fabric::api::{LinkFailure, Posted, WriteFailure};
use crate::flow::fragments;
use crate::writes::{map_extents, WriteMappingError};

impl Link {
    /// Queues a control message and posts what the credits and the send queue allow.
    pub(crate) fn send_message(&self, message: Vec<u8>) -> Result<(), LinkFailure> {
        let mut inner = self.lock();
        if inner.state != State::Live {
            return Err(inner.cause.clone().unwrap_or(LinkFailure::Closed));
        }
        inner.sends.push_back(PendingSend { message, sent: 0 });
        self.pump(&mut inner);
        Ok(())
    }

    /// Turns `extents` into RDMA WRITEs reported as `token`, queues them and posts what the
    /// send queue allows.
    pub(crate) fn post_writes(
        &self,
        token: u64,
        extents: &[WriteExtent],
    ) -> Result<Posted, WriteFailure> {
        let mut inner = self.lock();
        if inner.state != State::Live {
            return Err(WriteFailure::LinkDown(
                inner.cause.clone().unwrap_or(LinkFailure::Closed),
            ));
        }
        let (mut wrs, mut segments) = (Vec::new(), Vec::new());
        let inner_ref = &*inner;
        map_extents(
            extents,
            |r| inner_ref.memory.local(r),
            |r| inner_ref.peer_regions.get(&r).copied(),
            inner_ref.limits,
            &mut wrs,
            &mut segments,
        )
        .map_err(|e: WriteMappingError| WriteFailure::Unmappable(e.to_string()))?;
        if wrs.is_empty() {
            return Ok(Posted::Done);
        }
        inner.batches.push_back(PendingBatch {
            token,
            wrs,
            segments,
            next: 0,
        });
        self.pump(&mut inner);
        Ok(Posted::Queued)
    }

    /// Posts, in one `ibv_post_send`, a due credit return and as many queued operations as
    /// credits, send buffers and send-queue room allow. Returns whether it posted anything.
    pub(super) fn pump(&self, inner: &mut Inner) -> bool {
        match self.post_queued(inner) {
            Ok(posted) => posted > 0,
            Err(e) => {
                self.teardown(
                    inner,
                    LinkFailure::Verbs(format!("post_send: {e:?}")),
                    Instant::now(),
                );
                true
            }
        }
    }

    fn post_queued(&self, inner: &mut Inner) -> Result<u32, PostSendError> {
        let returned = inner.credit_word.load(Ordering::Acquire);
        let Inner {
            qp,
            sends,
            batches,
            signaled,
            sq_outstanding,
            sq_depth,
            unsignaled,
            posted_write_bytes,
            unsignaled_bytes,
            write_window,
            free_send_slots,
            credits,
            returns,
            peer_credit,
            ctrl_buf,
            ctrl_mr,
            ..
        } = inner;
        let Some(qp) = qp.as_mut() else {
            return Ok(0);
        };
        let lkey = ctrl_mr.lkey();
        let mut guard = qp.start_post_send();
        let mut posted = 0u32;
        let room = |posted: u32| *sq_outstanding + posted < *sq_depth;
        // Closes the run of unsignaled work requests with a signaled one.
        let sign = |signaled: &mut VecDeque<Signaled>,
                    unsignaled: &mut u32,
                    unsignaled_bytes: &mut u64,
                    send_slot: Option<u32>,
                    batch_done: Option<u64>| {
            signaled.push_back(Signaled {
                covered: *unsignaled + 1,
                write_bytes: *unsignaled_bytes,
                send_slot,
                batch_done,
            });
            *unsignaled = 0;
            *unsignaled_bytes = 0;
        };
        if let Some(count) = returns.due() {
            if room(posted) {
                guard
                    .construct_wr(
                        wr_id(WR_CREDIT, 0),
                        WorkRequestFlags::Signaled | WorkRequestFlags::Inline,
                    )
                    .setup_write(peer_credit.1, peer_credit.0)
                    .setup_inline_data(&count.to_le_bytes());
                sign(signaled, unsignaled, unsignaled_bytes, None, None);
                returns.written(count);
                posted += 1;
            }
        }
        // Control messages first: they overtake writes not posted yet (never posted ones: RC
        // keeps the order of what is on the queue pair).
        'sends: while let Some(op) = sends.front_mut() {
            loop {
                if !room(posted) || credits.available(returned) == 0 || free_send_slots.is_empty() {
                    break 'sends;
                }
                let Some((header, payload)) =
                    fragments(&op.message[op.sent..], self.frag_len).next()
                else {
                    sends.pop_front();
                    continue 'sends;
                };
                let slot = free_send_slots.pop().expect("checked non-empty");
                let start = slot as usize * self.slot_len;
                let buf = &mut ctrl_buf[start..start + 1 + payload.len()];
                buf[0] = header;
                buf[1..].copy_from_slice(payload);
                let addr = buf.as_ptr() as u64;
                // SAFETY: the send buffer lies inside the registered control buffer and is not
                // reused before this send's completion frees it.
                unsafe {
                    guard
                        .construct_wr(wr_id(WR_SEND, slot.into()), WorkRequestFlags::Signaled)
                        .setup_send()
                        .setup_sge(lkey, addr, (1 + payload.len()) as u32);
                }
                sign(signaled, unsignaled, unsignaled_bytes, Some(slot), None);
                credits.spend();
                posted += 1;
                op.sent += payload.len();
                if op.sent >= op.message.len() {
                    sends.pop_front();
                    continue 'sends;
                }
            }
        }
        // Then writes, in order, while the window of posted write bytes has room (at least one
        // work request may always be posted), so control messages never wait behind more than
        // a window of data.
        let mut sges: Vec<ibv_sge> = Vec::new();
        'batches: while let Some(b) = batches.front_mut() {
            while b.next < b.wrs.len() {
                let w = b.wrs[b.next];
                let window_full =
                    *posted_write_bytes > 0 && *posted_write_bytes + w.len > *write_window;
                if !room(posted) || window_full {
                    break 'batches;
                }
                let last = b.next + 1 == b.wrs.len();
                // Signal often enough that completions free both the send queue and the window.
                let signal = last
                    || *unsignaled + 1 >= SIGNAL_EVERY
                    || *unsignaled_bytes + w.len >= *write_window / 4;
                let flags = if signal {
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                sges.clear();
                sges.extend(
                    b.segments[w.first..w.first + w.count]
                        .iter()
                        .map(|s| ibv_sge {
                            addr: s.addr,
                            length: s.len,
                            lkey: s.lkey,
                        }),
                );
                // SAFETY: every segment lies inside a registered local region (checked by the
                // mapping); the sessions keep the source blocks pinned until the batch is
                // reported or the link disconnected.
                unsafe {
                    guard
                        .construct_wr(wr_id(WR_WRITE, b.token), flags)
                        .setup_write(w.rkey, w.remote_addr)
                        .setup_sge_list(&sges);
                }
                *posted_write_bytes += w.len;
                *unsignaled_bytes += w.len;
                if signal {
                    sign(
                        signaled,
                        unsignaled,
                        unsignaled_bytes,
                        None,
                        last.then_some(b.token),
                    );
                } else {
                    *unsignaled += 1;
                }
                posted += 1;
                b.next += 1;
            }
            batches.pop_front();
        }
        if posted == 0 {
            // Nothing was added to the guard (posting an empty list is not allowed).
            return Ok(0);
        }
        guard.post()?;
        *sq_outstanding += posted;
        Ok(posted)
    }
}
