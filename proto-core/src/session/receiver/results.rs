//! Held results: a writer's results are taken in slice order once the bytes they report have
//! landed, each writer's share is checked, and the request completes.

use super::*;

impl Receiver {
    /// A session frame from writer (or would-be writer) `peer`: a result, the aux data or a
    /// cancel.
    pub(super) fn on_writer_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        let request = match &frame {
            Frame::KvResult(r) => r.request,
            Frame::AuxResult(a) => a.request,
            Frame::Cancel(c) => c.request,
            other => {
                self.shell.violation(
                    peer,
                    ProtocolError::UnexpectedFrame {
                        kind: frame_kind(other),
                        role: Role::Receiver,
                    },
                );
                return;
            }
        };
        if self.config.data_path == DataPath::Landed {
            // Data and frames may travel on different connections: while the session is
            // active, a frame waits until the bytes its writer reported so far have landed.
            // A stopped session discards late data, so its frames (the writers' confirmations)
            // are taken at once.
            if let Some(w) = self
                .sessions
                .live
                .get_mut(&request)
                .filter(|s| s.phase.is_active())
                .and_then(|s| s.writers.iter_mut().find(|w| w.peer == peer))
            {
                let need = match &frame {
                    Frame::KvResult(r) if r.status == TransferStatus::Success => {
                        if !w.arrived.insert(r.sender_slice) {
                            self.shell.counters.duplicates += 1;
                            return;
                        }
                        w.reported.saturating_add(r.bytes_written)
                    }
                    _ => w.reported,
                };
                if !w.held.is_empty() || w.landed < need {
                    if w.held.len() >= MAX_HELD_FRAMES {
                        self.stop_protocol(
                            now,
                            request,
                            peer,
                            ProtocolError::TooManyHeldFrames {
                                request,
                                held: MAX_HELD_FRAMES,
                            },
                        );
                        return;
                    }
                    w.reported = need;
                    w.held.push_back((need, frame));
                    return;
                }
                w.reported = need;
            }
        }
        self.process_frame(now, peer, frame);
    }

    /// Processes the held frames of (`request`, `peer`) whose data has landed.
    pub(super) fn release_held(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        loop {
            let Some(w) = self
                .sessions
                .live
                .get_mut(&request)
                .and_then(|s| s.writers.iter_mut().find(|w| w.peer == peer))
            else {
                return;
            };
            match w.held.front() {
                Some((need, _)) if *need <= w.landed => {}
                _ => return,
            }
            let (_, frame) = w.held.pop_front().expect("checked");
            self.process_frame(now, peer, frame);
        }
    }

    pub(super) fn process_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        match frame {
            Frame::KvResult(result) => self.on_result(now, peer, result),
            Frame::AuxResult(aux) => self.on_aux(now, peer, aux),
            Frame::Cancel(cancel) => self.on_peer_cancel(now, peer, cancel),
            _ => {}
        }
    }

    /// Finds the session and writer a frame from `peer` is about; reports a violation if none.
    ///
    /// A result for a request this receiver does not hold (retired, or never registered) is
    /// answered with a `Cancel`: whatever the sender still does for it has no destination here.
    pub(super) fn locate(
        &mut self,
        now: Instant,
        peer: PeerId,
        request: RequestId,
        kind: &'static str,
    ) -> Option<usize> {
        let stop = Frame::Cancel(Cancel {
            request,
            reason: CancelReason::Failure,
        });
        if self.sessions.retired.contains(request) {
            self.shell.counters.duplicates += 1;
            self.shell.send(now, peer, stop);
            return None;
        }
        let Some(session) = self.sessions.live.get(&request) else {
            self.shell
                .violation(peer, ProtocolError::UnknownRequest { kind, request });
            self.shell.send(now, peer, stop);
            return None;
        };
        let Some(w) = session.writers.iter().position(|w| w.peer == peer) else {
            self.shell
                .violation(peer, ProtocolError::NotAParticipant { kind, request });
            return None;
        };
        Some(w)
    }

    pub(super) fn on_result(&mut self, now: Instant, peer: PeerId, r: KvResult) {
        let request = r.request;
        let Some(w) = self.locate(now, peer, request, "KvResult") else {
            return;
        };
        let session = self.sessions.live.get_mut(&request).expect("located");
        let expected = session.frame.slice;
        if r.receiver_slice != expected {
            let error = ProtocolError::UnknownSlice {
                request,
                expected,
                got: r.receiver_slice,
            };
            self.stop_protocol_at(now, request, peer, error, r.sender_slice.get());
            return;
        }
        let writer = &mut session.writers[w];
        // A failure is never a duplicate: it may follow the writer's successful last result
        // (the aux data failed), and a stopping session needs its terminal confirmation.
        if r.status == TransferStatus::Success && writer.seen.contains(&r.sender_slice) {
            self.shell.counters.duplicates += 1;
            return;
        }
        self.shell.counters.results.bump(r.status);
        if !session.phase.is_active() {
            // Stopping: a terminal result is the writer's confirmation that it stopped.
            if r.is_last {
                writer.on(WriterEvent::Confirmed);
            }
            self.check_drained(now, request);
            return;
        }
        if r.status != TransferStatus::Success {
            if r.is_last {
                writer.on(WriterEvent::Confirmed);
            }
            let why = if r.status == TransferStatus::Cancelled {
                // The writer's engine cancelled: a cancel, not a failure of the transfer.
                Stop::Cancelled(CancelOrigin::Peer(peer))
            } else {
                Stop::Failed {
                    cause: r.status,
                    peer: Some(peer),
                    slice: r.sender_slice.get(),
                }
            };
            self.stop(now, request, why);
            return;
        }
        // A successful result names a real slice, never one after the writer's last, and a
        // writer has one last slice.
        let after_last = r.sender_slice.get().is_none()
            || writer.last.is_some_and(|last| r.sender_slice > last)
            || (r.is_last && writer.last.is_some())
            || (r.is_last && writer.seen.last().is_some_and(|&max| max > r.sender_slice));
        if after_last {
            let error = ProtocolError::ResultAfterLast { request };
            self.stop_protocol_at(now, request, peer, error, r.sender_slice.get());
            return;
        }
        writer.seen.insert(r.sender_slice);
        if r.is_last {
            writer.last = Some(r.sender_slice);
        }
        writer.result_bytes = writer.result_bytes.saturating_add(r.bytes_written);
        // Done once the last result and every slice before it arrived (results may be
        // reordered by a transport that reorders frames).
        let done = writer
            .last
            .is_some_and(|last| writer.seen.len() as u64 == u64::from(last.0) + 1);
        let (reported, landed) = (writer.result_bytes, writer.landed);
        session.bytes_written += r.bytes_written;
        if done {
            // The writer is done: it must have written exactly its share of the registration,
            // landed (a transport that reports landings) and reported.
            let expected = self.writer_share(request, peer);
            let landed = (self.config.data_path == DataPath::Landed).then_some(landed);
            if reported != expected || landed.is_some_and(|l| l != expected) {
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::BytesMismatch {
                        request,
                        expected,
                        reported,
                        landed,
                    },
                );
                return;
            }
            let session = self.sessions.live.get_mut(&request).expect("located");
            session.writers[w].on(WriterEvent::LastResult);
        }
        let session = self.sessions.live.get_mut(&request).expect("located");
        if self.config.data_path == DataPath::Ordered {
            // No landing reports: a result is the moment its bytes are known to be placed.
            session.timings.first_byte.get_or_insert(now);
            session.timings.last_byte = Some(now);
        }
        self.shell.counters.bytes_written += r.bytes_written;
        self.note_progress(now, request);
        self.progress(now, request);
    }

    /// The bytes writer `peer` must write into `request`'s registration: for every group it
    /// writes (its layers and heads overlap this rank's, and it is the replica this rank takes
    /// them from), the overlap's bytes for each registered block it sends (in a windowed
    /// group, those at or above the stale boundary of its window).
    pub(super) fn writer_share(&self, request: RequestId, peer: PeerId) -> u64 {
        let (Some(session), Some(hello)) = (
            self.sessions.live.get(&request),
            self.shell.peers.remote(peer),
        ) else {
            return 0;
        };
        let local = &self.config.local;
        let prompt = session.frame.prompt_len;
        let mut total = 0u64;
        for (g, (run, dst)) in session.frame.groups.iter().zip(&local.groups).enumerate() {
            let Some(src) = hello.groups.get(g) else {
                continue;
            };
            if !writes_group(&hello.topology, src, &local.topology, dst) {
                continue;
            }
            let tpb = dst.tokens_per_block;
            let blocks = u64::from(total_blocks(prompt, tpb).unwrap_or(0));
            let stale = match src.window {
                Some(win) if win < prompt => {
                    u64::from(stale_boundary(prompt, win, tpb).unwrap_or(0))
                }
                _ => 0,
            };
            let first = u64::from(run.first_ordinal);
            let sent = (first + run.block_count())
                .min(blocks)
                .saturating_sub(first.max(stale));
            let overlap = |a: core::ops::Range<u32>, b: core::ops::Range<u32>| {
                u64::from(a.end.min(b.end).saturating_sub(a.start.max(b.start)))
            };
            let per_block = u64::from(dst.kv_factor)
                .saturating_mul(u64::from(tpb))
                .saturating_mul(u64::from(dst.head_dim))
                .saturating_mul(u64::from(dst.elem_bytes))
                .saturating_mul(overlap(src.layer_range(), dst.layer_range()))
                .saturating_mul(overlap(src.head_range(), dst.head_range()));
            total = total.saturating_add(sent.saturating_mul(per_block));
        }
        total
    }

    /// Something of the request arrived: the idle deadline restarts from `now`.
    pub(super) fn note_progress(&mut self, now: Instant, request: RequestId) {
        let idle = self.config.deadlines.result_idle;
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if let Some(due) = session.progressed(now, idle) {
            self.shell.timers.arm(due, TimerKey::Request(request));
        }
    }

    /// Completes the session when every writer's last result and the aux data arrived.
    pub(super) fn progress(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        let all_done = session.writers.iter().all(|w| w.phase == WriterPhase::Done);
        if all_done && session.writes_in_flight > 0 {
            // Every writer reported its last result, yet bytes are still landing: they were
            // never reported.
            let writes = session.writes_in_flight;
            let peer = session.writers.first().map(|w| w.peer);
            if let Some(peer) = peer {
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::UnreportedWrites { request, writes },
                );
            }
            return;
        }
        let all_aux = session.writers.iter().all(|w| w.aux);
        let event = if all_done && all_aux {
            RecvEvent::Finished
        } else {
            RecvEvent::Progress
        };
        if all_done && !all_aux && session.aux_deadline.is_none() {
            let at = now + self.config.deadlines.aux_wait;
            session.aux_deadline = Some(at);
            self.shell.timers.arm(at, TimerKey::Request(request));
        }
        if let Transition::To(p) = session.phase.on(event) {
            session.phase = p;
            if p == RecvPhase::Completed {
                session.timings.ended = now;
                let (bytes, aux, timings, pinned) = (
                    session.bytes_written,
                    session.aux.clone(),
                    session.timings,
                    session.blocks_pinned,
                );
                // Each writer completes only on hearing it.
                let writers: SmallVec<[PeerId; 2]> =
                    session.writers.iter().map(|w| w.peer).collect();
                self.shell
                    .completed(now, request, bytes, aux, timings, pinned, &writers);
            }
        }
    }
}
