//! Results: write batches reported by the transport, results sent in slice order after their
//! writes, the aux data, and a receiver's cancel.

use super::*;

impl Sender {
    /// Sends every result that may leave now, in slice order, then the aux data; completes the
    /// session once every receiver said it completed (`RecvComplete`).
    pub(super) fn progress(&mut self, now: Instant, request: RequestId) {
        let confirm_at = now + self.config.deadlines.result_wait;
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if !session.phase.is_active() {
            return;
        }
        let mut frames: Vec<(PeerId, Frame)> = Vec::new();
        for target in session.targets.iter_mut() {
            if !matches!(
                target.phase,
                TargetPhase::Streaming | TargetPhase::AwaitingAux
            ) {
                continue;
            }
            let Some(reg) = &target.registration else {
                continue;
            };
            let receiver_slice = reg.slice;
            while target.results_sent < target.slices.len()
                && target.slices[target.results_sent].done
            {
                let k = target.results_sent;
                let slice = &session.slices[k];
                let ts = target.slices[k];
                frames.push((
                    target.peer,
                    Frame::KvResult(KvResult {
                        request,
                        sender_slice: slice.id,
                        receiver_slice,
                        is_last: slice.is_last,
                        status: TransferStatus::Success,
                        bytes_written: ts.bytes,
                    }),
                ));
                target.results_sent += 1;
                if slice.is_last {
                    target.on(TargetEvent::LastResultSent);
                }
            }
            if target.phase == TargetPhase::AwaitingAux {
                if let Some(aux) = &session.aux {
                    frames.push((
                        target.peer,
                        Frame::AuxResult(AuxResult {
                            request,
                            status: TransferStatus::Success,
                            data: aux.clone(),
                        }),
                    ));
                    target.on(TargetEvent::AuxSent);
                    // Counted from the last receiver that got everything: one that registered
                    // late (and is still being written) is not cut short by an earlier one's.
                    session.confirm_deadline = Some(confirm_at);
                    self.shell
                        .timers
                        .arm(confirm_at, TimerKey::Request(request));
                }
            }
        }
        let finished = session.targets.iter().all(|t| t.phase.is_finished());
        let bytes = session.bytes_written;
        session.timings.ended = now;
        let timings = session.timings;
        let blocks_pinned = session.blocks_pinned;
        let mut transition = None;
        if finished {
            if let Transition::To(p) = session.phase.on(SendEvent::Finished) {
                session.phase = p;
                transition = Some(p);
            }
        }
        self.send_frames(now, frames);
        if transition == Some(SendPhase::Completed) {
            self.shell
                .completed(now, request, bytes, None, timings, blocks_pinned, &[]);
        }
    }

    /// Receiver `peer` completed `request` (its `RecvComplete`): the target is finished, and
    /// the session completes once every target is. A frame for a request this side no longer
    /// holds (stopped, retired, never opened) is late and harmless.
    pub(super) fn on_recv_complete(&mut self, now: Instant, peer: PeerId, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        let Some(target) = session.targets.iter_mut().find(|t| t.peer == peer) else {
            self.shell.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "RecvComplete",
                    request,
                },
            );
            return;
        };
        if target.on(TargetEvent::Confirmed) && session.phase.is_active() {
            self.progress(now, request);
        }
    }

    pub(super) fn send_frames(&mut self, now: Instant, frames: Vec<(PeerId, Frame)>) {
        for (peer, frame) in frames {
            if let Frame::KvResult(r) = &frame {
                self.shell.counters.results.bump(r.status);
            }
            self.shell.send(now, peer, frame);
        }
    }

    pub(super) fn on_batch_report(
        &mut self,
        now: Instant,
        batch: WriteBatchId,
        status: TransferStatus,
    ) -> Result<(), UsageError> {
        let Some(r) = self.batches.remove(&batch) else {
            if batch.0 < self.next_batch {
                // Issued, and forgotten when its peer disconnected: a late report is harmless.
                return Ok(());
            }
            return Err(UsageError::UnknownBatch(batch));
        };
        let Some(session) = self.sessions.live.get_mut(&r.request) else {
            return Ok(());
        };
        let target = &mut session.targets[r.target];
        target.inflight = target.inflight.saturating_sub(1);
        let peer = target.peer;
        let ts = &mut target.slices[r.slice];
        ts.deadline = None;
        if status == TransferStatus::Success {
            let last = self.link_progress.entry(peer).or_insert(now);
            *last = (*last).max(now);
            ts.done = true;
            let bytes = ts.bytes;
            session.bytes_written += bytes;
            session.timings.last_byte = Some(now);
            self.shell.counters.bytes_written += bytes;
            if session.phase.is_active() {
                self.progress(now, r.request);
            } else {
                self.check_drained(now, r.request);
            }
        } else if session.phase.is_active() {
            let slice = session.slices[r.slice].id;
            self.stop(
                now,
                r.request,
                Stop::Failed {
                    cause: status,
                    peer: Some(peer),
                    slice: Some(slice),
                },
            );
        } else {
            self.check_drained(now, r.request);
        }
        Ok(())
    }

    pub(super) fn on_peer_cancel(&mut self, now: Instant, peer: PeerId, cancel: Cancel) {
        let request = cancel.request;
        let confirm = Frame::Cancel(Cancel {
            request,
            reason: cancel.reason,
        });
        if self.sessions.retired.contains(request) {
            // Nothing of a retired request is in flight: confirm at once.
            self.shell.send(now, peer, confirm);
            return;
        }
        if !self.sessions.live.contains_key(&request) {
            // Not opened yet: nothing is in flight. Confirm, and cancel it when it opens.
            self.shell
                .remembered_cancels
                .insert(request, CancelOrigin::Peer(peer));
            self.pending_registrations.remove(request, peer);
            self.shell.send(now, peer, confirm);
            return;
        }
        self.on_participant_cancel(now, request, peer);
    }
}
