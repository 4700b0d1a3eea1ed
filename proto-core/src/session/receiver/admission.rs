//! Admission: each data write is checked against the request's grant, its writers and the bytes in
//! flight or landed before a byte of it is applied, and its landing is recorded.

use super::*;

impl Receiver {
    pub(super) fn on_write_arrived(
        &mut self,
        now: Instant,
        peer: PeerId,
        header: &DataWrite,
    ) -> Result<Admission, UsageError> {
        let Some(phase) = self.shell.peers.phase(peer) else {
            return Err(UsageError::UnknownPeer(peer));
        };
        let refusal = match self.config.data_path {
            DataPath::Ordered => Err(WriteRefusal::NotAccepted),
            DataPath::Landed => self.check_write(now, peer, header),
        };
        match refusal {
            Ok(admission) => Ok(admission),
            Err(refusal) => {
                self.shell.counters.writes_refused += 1;
                if matches!(
                    phase,
                    crate::session::state::PeerPhase::Handshaking
                        | crate::session::state::PeerPhase::Ready
                ) {
                    self.refuse(now, peer, refusal);
                }
                Ok(Admission::Refuse(refusal))
            }
        }
    }

    /// Decides on a data write; admits it (recording the flight) or says why not.
    pub(super) fn check_write(
        &mut self,
        now: Instant,
        peer: PeerId,
        w: &DataWrite,
    ) -> Result<Admission, WriteRefusal> {
        if !self.shell.peers.is_ready(peer) {
            return Err(WriteRefusal::PeerNotReady(peer));
        }
        let request = w.request;
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return match self.sessions.retired.get(request) {
                Some(r) if r.grant == w.grant && r.writers.contains(&peer) => {
                    self.shell.counters.late_writes += 1;
                    Ok(Admission::Discard { len: w.len })
                }
                _ => Err(WriteRefusal::UnknownRequest(request)),
            };
        };
        match check_in_session(&self.writes, session, peer, w)? {
            Checked::Admit => Ok(admit(&mut self.writes, session, now, peer, w)),
            Checked::Discard => {
                self.shell.counters.late_writes += 1;
                Ok(Admission::Discard { len: w.len })
            }
        }
    }

    /// The fast path of [`admit_writes`](Self::admit_writes): admits the leading writes of
    /// `writes` that name the request of the first one and that [`check_write`](Self::check_write)
    /// would admit, and returns how many it admitted. The peer and the session are looked up
    /// once; it stops (leaving the write to the full path) at the first write that names
    /// another request or that [`check_in_session`] would not admit.
    pub(super) fn admit_run(
        &mut self,
        now: Instant,
        peer: PeerId,
        writes: &[DataWrite],
        out: &mut Vec<Admission>,
    ) -> usize {
        let Some(first) = writes.first() else {
            return 0;
        };
        if self.config.data_path != DataPath::Landed || !self.shell.peers.is_ready(peer) {
            return 0;
        }
        let request = first.request;
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return 0;
        };
        let mut admitted = 0;
        for w in writes {
            if w.request != request
                || !matches!(
                    check_in_session(&self.writes, session, peer, w),
                    Ok(Checked::Admit)
                )
            {
                break;
            }
            out.push(admit(&mut self.writes, session, now, peer, w));
            admitted += 1;
        }
        admitted
    }

    /// A refused write: the peer is not trusted any more. The request it named fails on both
    /// sides (when the peer is one of its writers), then the peer is closed.
    pub(super) fn refuse(&mut self, now: Instant, peer: PeerId, refusal: WriteRefusal) {
        let named = match refusal {
            WriteRefusal::WrongGrant { request, .. }
            | WriteRefusal::OutsideGrant { request, .. }
            | WriteRefusal::Overlap { request, .. } => Some(request),
            _ => None,
        };
        if let Some(request) = named {
            let writer =
                self.sessions.live.get(&request).is_some_and(|s| {
                    s.phase.is_active() && s.writers.iter().any(|w| w.peer == peer)
                });
            if writer {
                self.stop(now, request, Stop::by(peer, TransferStatus::GrantViolation));
            }
        }
        self.shell
            .violation(peer, ProtocolError::WriteRefused { refusal });
        self.shell.close(peer, CloseReason::GrantViolation);
    }

    pub(super) fn on_write_finished(
        &mut self,
        now: Instant,
        ticket: crate::session::WriteTicket,
        landed: bool,
    ) -> Result<(), UsageError> {
        let Some(flight) = self.writes.finish(ticket) else {
            if self.writes.issued(ticket) {
                // Forgotten when its peer disconnected: a late report is harmless.
                return Ok(());
            }
            return Err(UsageError::UnknownTicket(ticket));
        };
        let request = flight.request;
        let idle = self.config.deadlines.result_idle;
        // One lookup of the session for the write's bookkeeping; the held results and the
        // drain are looked at only when there is something to do.
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return Ok(());
        };
        session.writes_in_flight = session.writes_in_flight.saturating_sub(1);
        let mut release = false;
        if landed {
            session.timings.last_byte = Some(now);
            if let Some(due) = session.progressed(now, idle) {
                self.shell.timers.arm(due, TimerKey::Request(request));
            }
            session
                .landed
                .insert(flight.region, flight.offset, flight.offset + flight.len);
            self.shell.counters.bytes_landed += flight.len;
            if let Some(w) = session.writers.iter_mut().find(|w| w.peer == flight.peer) {
                w.landed = w.landed.saturating_add(flight.len);
                release = w.held.front().is_some_and(|(need, _)| *need <= w.landed);
            }
        }
        let stopping = session.phase == RecvPhase::Stopping;
        if release {
            self.release_held(now, request, flight.peer);
        }
        if stopping || release {
            // (It looks at the phase itself: the held results may have stopped the session.)
            self.check_drained(now, request);
        }
        Ok(())
    }
}

/// What a write to a live session from a ready peer gets, once [`check_in_session`] passed.
enum Checked {
    /// Apply it.
    Admit,
    /// The session ended: the write is late, its bytes are dropped.
    Discard,
}

/// The checks of a data write against the live session it names (the peer is ready), in the
/// order their refusals are reported: its grant, its writer, the granted extents, the session's
/// phase, then no overlap with a write in flight or the bytes landed.
fn check_in_session(
    writes: &WritesInFlight,
    session: &RecvSession,
    peer: PeerId,
    w: &DataWrite,
) -> Result<Checked, WriteRefusal> {
    let request = w.request;
    if session.frame.grant != w.grant {
        return Err(WriteRefusal::WrongGrant {
            request,
            got: w.grant,
        });
    }
    if !session
        .writers
        .iter()
        .any(|x| x.peer == peer && x.phase != WriterPhase::Unregistered)
    {
        return Err(WriteRefusal::NotAWriter { request, peer });
    }
    if !session.extents.contains(w.region, w.offset, w.len) {
        return Err(WriteRefusal::OutsideGrant {
            request,
            region: w.region,
            offset: w.offset,
            len: w.len,
        });
    }
    if !session.phase.is_active() {
        return Ok(Checked::Discard);
    }
    let end = w.offset + w.len; // `contains` checked it does not overflow
    if writes.overlaps(w.region, w.offset, end) || session.landed.overlaps(w.region, w.offset, end)
    {
        return Err(WriteRefusal::Overlap {
            request,
            region: w.region,
            offset: w.offset,
            len: w.len,
        });
    }
    Ok(Checked::Admit)
}

/// Admits `w`, which passed [`check_in_session`]: records the flight and counts it in its
/// session.
fn admit(
    writes: &mut WritesInFlight,
    session: &mut RecvSession,
    now: Instant,
    peer: PeerId,
    w: &DataWrite,
) -> Admission {
    // Data begins to move again after the request's pipeline drained: every write landed and
    // every byte landed was reported by a result (see `RequestTimings::last_burst`).
    if session.writes_in_flight == 0 && session.writers.iter().all(|x| x.landed == x.reported) {
        session.timings.last_burst = Some(now);
    }
    session.writes_in_flight += 1;
    session.timings.writes += 1;
    session.timings.first_byte.get_or_insert(now);
    let ticket = writes.admit(Flight {
        request: w.request,
        peer,
        region: w.region,
        offset: w.offset,
        len: w.len,
    });
    Admission::Apply {
        ticket,
        region: w.region,
        offset: w.offset,
        len: w.len,
    }
}
