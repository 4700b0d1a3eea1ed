//! Stop and quiesce: failures, timeouts, cancels and lost peers end a session on both sides, and
//! its blocks stay pinned until no writer can still write them. The receiver's part of the
//! shared session frame (`EndpointRole`) is here.

use super::*;

impl EndpointRole for Receiver {
    type Session = RecvSession;
    type Kept = RetiredGrant;

    fn sessions(&self) -> &SessionTable<RecvSession, RetiredGrant> {
        &self.sessions
    }

    fn shell(&mut self) -> &mut Shell {
        &mut self.shell
    }

    fn forget_peer(&mut self, peer: PeerId) {
        // The transport promises none of the peer's admitted writes still applies.
        for flight in self.writes.remove_peer(peer) {
            if let Some(s) = self.sessions.live.get_mut(&flight.request) {
                s.writes_in_flight = s.writes_in_flight.saturating_sub(1);
            }
        }
    }

    fn participant_gone(&mut self, request: RequestId, peer: PeerId) -> bool {
        let session = self.sessions.live.get_mut(&request).expect("listed");
        let w = session
            .writers
            .iter_mut()
            .find(|w| w.peer == peer)
            .expect("listed");
        let done = w.finished();
        w.on(WriterEvent::Disconnected);
        w.held.clear();
        done
    }

    fn participant_stopped(&mut self, request: RequestId, peer: PeerId) {
        // A sender sends Cancel only when none of its writes for the request is in flight.
        if let Some(s) = self.sessions.live.get_mut(&request) {
            if let Some(w) = s.writers.iter_mut().find(|w| w.peer == peer) {
                w.on(WriterEvent::Confirmed);
            }
        }
    }

    fn on_peer_ready(&mut self, now: Instant, peer: PeerId) {
        self.send_waiting_registrations(now, peer);
    }

    fn on_session_frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        self.on_writer_frame(now, peer, frame);
    }

    fn on_handshake_timeout(&mut self, now: Instant, peer: PeerId) {
        self.fail_peer_sessions(now, peer, Stop::TimedOut(Wait::Handshake));
    }

    fn on_request_timeout(&mut self, now: Instant, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if session.phase.is_active() {
            let all_done = session.writers.iter().all(|w| w.phase == WriterPhase::Done);
            let result_deadline = session.result_deadline(self.config.deadlines.result_idle);
            if !all_done && result_deadline <= now {
                self.stop(now, request, Stop::TimedOut(Wait::Results));
                return;
            }
            if session.aux_deadline.is_some_and(|at| at <= now) {
                self.stop(now, request, Stop::TimedOut(Wait::Aux));
                return;
            }
            let next = if all_done {
                session.aux_deadline
            } else {
                session.result_armed = Some(result_deadline);
                Some(result_deadline)
            };
            self.shell.timers.arm_opt(next, TimerKey::Request(request));
        } else if session.phase == RecvPhase::Stopping {
            if session.quiesce_deadline.is_some_and(|at| at <= now) {
                let fence: Vec<PeerId> = session
                    .writers
                    .iter_mut()
                    .filter_map(|w| w.on(WriterEvent::FenceRequested).then_some(w.peer))
                    .collect();
                // Writes still landing from writers that did confirm are fenced too.
                let landing: Vec<PeerId> = if session.writes_in_flight > 0 {
                    session.writers.iter().map(|w| w.peer).collect()
                } else {
                    Vec::new()
                };
                for peer in fence.into_iter().chain(landing) {
                    self.shell.close(peer, CloseReason::QuiesceFence);
                }
            } else {
                self.shell
                    .timers
                    .arm_opt(session.quiesce_deadline, TimerKey::Request(request));
            }
        }
    }

    /// Ends an active session: reports it, tells every writer that has not stopped, and waits
    /// for their confirmation before [`Event::Quiesced`].
    fn stop(&mut self, now: Instant, request: RequestId, why: Stop) {
        let Some(session) = self.sessions.begin_stop(request) else {
            return;
        };
        let receiver_slice = session.frame.slice;
        let reason = match why {
            Stop::Failed { .. } => CancelReason::Failure,
            Stop::TimedOut(_) => CancelReason::Timeout,
            Stop::Cancelled(_) => CancelReason::Engine,
        };
        let quiesce_at = now + self.config.deadlines.quiesce;
        session.quiesce_deadline = Some(quiesce_at);
        let mut notify = Vec::new();
        let mut held = Vec::new();
        for w in session.writers.iter_mut() {
            held.extend(w.held.drain(..).map(|(_, frame)| (w.peer, frame)));
            if w.phase == WriterPhase::Unregistered {
                // The writer never got the grant: nothing of it can land, so it is not waited
                // for. It is still told (when connected), so that it stops computing and
                // pinning the request instead of waiting out its registration deadline.
                w.on(WriterEvent::SessionStopped);
                if self.shell.peers.is_ready(w.peer) {
                    notify.push(w.peer);
                }
            } else {
                // Every writer that got the registration hears of it, even one that already
                // sent its last result (it may still be waiting to send the aux data); only
                // those that have not stopped are waited for.
                notify.push(w.peer);
            }
        }
        self.shell
            .stopped(request, why, Some(receiver_slice), quiesce_at);
        for peer in notify {
            self.shell
                .send(now, peer, Frame::Cancel(Cancel { request, reason }));
        }
        // Frames that waited for data are the writers' word now (a terminal result confirms a
        // writer stopped); late data is discarded.
        for (peer, frame) in held {
            self.process_frame(now, peer, frame);
        }
        self.check_drained(now, request);
    }

    fn check_drained(&mut self, _now: Instant, request: RequestId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if session.phase != RecvPhase::Stopping
            || session.writes_in_flight > 0
            || !session.writers.iter().all(|w| w.phase.has_stopped())
        {
            return;
        }
        if session
            .phase
            .on(RecvEvent::Drained)
            .advance(&mut session.phase)
        {
            session.quiesce_deadline = None;
            self.shell.quiesced(request, session.blocks_pinned);
        }
    }
}

impl Receiver {
    pub(super) fn on_peer_cancel(&mut self, now: Instant, peer: PeerId, cancel: Cancel) {
        let request = cancel.request;
        if self.sessions.retired.contains(request) {
            self.shell.counters.duplicates += 1;
            return;
        }
        if !self.sessions.live.contains_key(&request) {
            // Not registered yet: remember it and cancel the registration when it comes.
            self.shell
                .remembered_cancels
                .insert(request, CancelOrigin::Peer(peer));
            return;
        }
        self.on_participant_cancel(now, request, peer);
    }
}
