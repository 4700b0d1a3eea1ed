//! Stop and quiesce: failures, timeouts, cancels and lost peers end a session on both sides, and
//! its blocks stay pinned until no write of it can still land. The sender's part of the shared
//! session frame (`EndpointRole`) is here.

use super::*;

impl EndpointRole for Sender {
    type Session = SendSession;
    type Kept = ();

    fn shell(&mut self) -> &mut Shell {
        &mut self.shell
    }

    fn sessions(&self) -> &SessionTable<SendSession, ()> {
        &self.sessions
    }

    fn forget_peer(&mut self, peer: PeerId) {
        self.pending_registrations.remove_peer(peer);
        self.link_progress.remove(&peer);
        // Batches towards the peer can no longer touch memory.
        let sessions = &self.sessions.live;
        self.batches.retain(|_, r| {
            sessions
                .get(&r.request)
                .is_none_or(|s| s.targets[r.target].peer != peer)
        });
    }

    fn participant_gone(&mut self, request: RequestId, peer: PeerId) -> bool {
        let session = self.sessions.live.get_mut(&request).expect("listed");
        let target = session
            .targets
            .iter_mut()
            .find(|t| t.peer == peer)
            .expect("listed");
        let finished_here = target.phase.is_finished();
        target.on(TargetEvent::Disconnected);
        target.inflight = 0;
        for ts in &mut target.slices {
            ts.deadline = None;
        }
        finished_here
    }

    // A receiver writes nothing: its cancel only ends the request.
    fn participant_stopped(&mut self, _request: RequestId, _peer: PeerId) {}

    // Registrations come from the receivers; a ready peer changes nothing by itself.
    fn on_peer_ready(&mut self, _now: Instant, _peer: PeerId) {}

    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        match frame {
            Frame::RecvRegistration(reg) => self.on_registration(now, peer, reg),
            Frame::Cancel(cancel) => self.on_peer_cancel(now, peer, cancel),
            Frame::RecvComplete(done) => self.on_recv_complete(now, peer, done.request),
            other => self.shell.violation(
                peer,
                ProtocolError::UnexpectedFrame {
                    kind: frame_kind(&other),
                    role: Role::Sender,
                },
            ),
        }
    }

    // A session waits for its receiver's registration under its own deadline.
    fn on_handshake_timeout(&mut self, _now: Instant, _peer: PeerId) {}

    fn on_request_timeout(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            // Registrations held for a request the engine never opened: after the registration
            // deadline nobody will write them; their receivers learn at once.
            let expired = self
                .pending_registrations
                .since(request)
                .is_some_and(|at| at + self.config.deadlines.registration <= now);
            if expired {
                for (peer, _) in self.pending_registrations.take(request) {
                    let frame = Frame::Cancel(Cancel {
                        request,
                        reason: CancelReason::Timeout,
                    });
                    self.shell.send(now, peer, frame);
                }
            }
            return;
        };
        if session.phase.is_active() {
            let (progress, wc) = (&self.link_progress, self.config.deadlines.write_completion);
            let write_due = session.targets.iter().any(|t| {
                t.slices.iter().any(|ts| {
                    write_deadline(progress, wc, t.peer, ts.deadline).is_some_and(|at| at <= now)
                })
            });
            if write_due {
                self.stop(now, request, Stop::TimedOut(Wait::Writes));
                return;
            }
            let unregistered = session
                .targets
                .iter()
                .any(|t| t.phase == TargetPhase::AwaitingRegistration);
            if unregistered && session.registration_deadline <= now {
                self.stop(now, request, Stop::TimedOut(Wait::Registration));
                return;
            }
            if session.aux_deadline.is_some_and(|at| at <= now) {
                self.stop(now, request, Stop::TimedOut(Wait::Aux));
                return;
            }
            if session.awaited_confirm().is_some_and(|at| at <= now) {
                self.stop(now, request, Stop::TimedOut(Wait::Completion));
                return;
            }
        } else if session.phase == SendPhase::Stopping
            && session.quiesce_deadline.is_some_and(|at| at <= now)
        {
            let fence: Vec<PeerId> = session
                .targets
                .iter_mut()
                .filter(|t| t.inflight > 0)
                .filter_map(|t| t.on(TargetEvent::FenceRequested).then_some(t.peer))
                .collect();
            for peer in fence {
                self.shell.close(peer, CloseReason::QuiesceFence);
            }
            return;
        }
        self.rearm(request);
    }

    /// Ends an active session: reports it, tells every receiver at once, and waits for the
    /// in-flight writes before [`Event::Quiesced`].
    fn stop(&mut self, now: Instant, request: RequestId, why: Stop) {
        let Some(session) = self.sessions.begin_stop(request) else {
            return;
        };
        // A failure names the registration of the peer involved, when that peer registered.
        let receiver_slice = match why {
            Stop::Failed { peer, slice, .. } => {
                session.stop_slice = slice;
                (session.targets.iter())
                    .find(|t| Some(t.peer) == peer)
                    .and_then(Target::receiver_slice)
            }
            Stop::TimedOut(_) | Stop::Cancelled(_) => None,
        };
        let status = why.status();
        session.stop_status = status;
        // The slice the failure is attributed to, named the same on both sides (none when the
        // failure is not a slice's).
        let failed_slice = session.stop_slice.unwrap_or(SenderSliceId::NONE);
        let quiesce_at = now + self.config.deadlines.quiesce;
        session.quiesce_deadline = Some(quiesce_at);
        let mut frames = Vec::new();
        for target in session.targets.iter_mut() {
            for ts in &mut target.slices {
                ts.deadline = None;
            }
            if !target.on(TargetEvent::SessionStopped) {
                continue;
            }
            match target.receiver_slice() {
                Some(receiver_slice) => {
                    let is_last = target.inflight == 0;
                    if is_last {
                        target.on(TargetEvent::TerminalSent);
                    }
                    frames.push((
                        target.peer,
                        Frame::KvResult(KvResult {
                            request,
                            sender_slice: failed_slice,
                            receiver_slice,
                            is_last,
                            status,
                            bytes_written: 0,
                        }),
                    ));
                }
                None => {
                    target.on(TargetEvent::TerminalSent);
                    frames.push((
                        target.peer,
                        Frame::Cancel(Cancel {
                            request,
                            reason: status_reason(status),
                        }),
                    ));
                }
            }
        }
        self.shell.stopped(request, why, receiver_slice, quiesce_at);
        self.send_frames(now, frames);
        self.check_drained(now, request);
    }

    /// In a stopping session: sends each receiver's terminal result once its writes drained, and
    /// quiesces the session once no write is in flight.
    fn check_drained(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if session.phase != SendPhase::Stopping {
            return;
        }
        let status = session.stop_status;
        // The slice the failure is attributed to, named the same on both sides (none when the
        // failure is not a slice's).
        let failed_slice = session.stop_slice.unwrap_or(SenderSliceId::NONE);
        let mut frames = Vec::new();
        for target in session.targets.iter_mut() {
            if target.inflight > 0
                || !matches!(target.phase, TargetPhase::Draining | TargetPhase::Fencing)
            {
                continue;
            }
            target.on(TargetEvent::TerminalSent);
            let frame = match target.receiver_slice() {
                Some(receiver_slice) => Frame::KvResult(KvResult {
                    request,
                    sender_slice: failed_slice,
                    receiver_slice,
                    is_last: true,
                    status,
                    bytes_written: 0,
                }),
                None => Frame::Cancel(Cancel {
                    request,
                    reason: status_reason(status),
                }),
            };
            frames.push((target.peer, frame));
        }
        let drained = session.targets.iter().all(|t| t.inflight == 0);
        let blocks_pinned = session.blocks_pinned;
        let mut quiesced = false;
        if drained {
            if let Transition::To(p) = session.phase.on(SendEvent::Drained) {
                session.phase = p;
                session.quiesce_deadline = None;
                quiesced = true;
            }
        }
        self.send_frames(now, frames);
        if quiesced {
            self.shell.quiesced(request, blocks_pinned);
        }
    }
}

impl Sender {
    /// Arms the session's earliest pending deadline.
    pub(super) fn rearm(&mut self, request: RequestId) {
        let Some(session) = self.sessions.live.get(&request) else {
            return;
        };
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n: Instant| n.min(at)));
            }
        };
        if session.phase.is_active() {
            for t in &session.targets {
                for ts in &t.slices {
                    consider(write_deadline(
                        &self.link_progress,
                        self.config.deadlines.write_completion,
                        t.peer,
                        ts.deadline,
                    ));
                }
            }
            if session
                .targets
                .iter()
                .any(|t| t.phase == TargetPhase::AwaitingRegistration)
            {
                consider(Some(session.registration_deadline));
            }
            consider(session.aux_deadline);
            consider(session.awaited_confirm());
        } else if session.phase == SendPhase::Stopping {
            consider(session.quiesce_deadline);
        }
        self.shell.timers.arm_opt(next, TimerKey::Request(request));
    }
}

/// When a write batch towards `peer` issued with deadline `issued_deadline` (issue time +
/// `write_completion`) is due: never before `write_completion` has passed with no batch towards
/// `peer` completing (`progress`: when one last did), so batches queued behind others on a slow
/// but moving link (a late registration's replay, a long prompt) are not failed while their
/// link works. A link that stops completing fails them `write_completion` after its last
/// completion.
fn write_deadline(
    progress: &BTreeMap<PeerId, Instant>,
    write_completion: crate::time::Duration,
    peer: PeerId,
    issued_deadline: Option<Instant>,
) -> Option<Instant> {
    let at = issued_deadline?;
    Some(match progress.get(&peer) {
        Some(&last) => at.max(last + write_completion),
        None => at,
    })
}
