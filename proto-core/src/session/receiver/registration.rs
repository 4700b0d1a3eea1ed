//! Registration: the engine's registration checked (prompt, window, canonical runs, expected
//! part); the writers' cover proved once every writer's handshake is known, and only then the
//! registration sent to them; cancel and retire.

use super::*;

impl Receiver {
    pub(super) fn on_register(
        &mut self,
        now: Instant,
        reg: Registration,
    ) -> Result<(), UsageError> {
        let request = reg.request;
        self.sessions.check_new(request)?;
        if reg.writers.is_empty() {
            return Err(UsageError::NoPeers(request));
        }
        if let Some(peer) = named_twice(&reg.writers) {
            return Err(UsageError::DuplicatePeer { request, peer });
        }
        if u64::from(reg.aux_capacity) < AuxData::SLOT_MIN {
            return Err(UsageError::AuxSlotTooSmall {
                request,
                capacity: reg.aux_capacity,
                min: AuxData::SLOT_MIN,
            });
        }
        let expected = self.config.local.groups.len();
        if reg.groups.len() != expected {
            return Err(UsageError::GroupCountMismatch {
                request,
                expected,
                got: reg.groups.len(),
            });
        }
        // O(r log r) per group in its id runs (see `AnchoredRun::repeated_id`), so a
        // registration of thousands of contiguous blocks stays cheap. Only within a group, the
        // unit the layout gives a pool to: groups whose pools share memory are not compared.
        for (group, run) in reg.groups.iter().enumerate() {
            if let Some(block) = run.repeated_id() {
                return Err(UsageError::RepeatedBlock {
                    request,
                    group,
                    block,
                });
            }
        }
        for (group, (run, layout)) in reg.groups.iter().zip(&self.config.local.groups).enumerate() {
            let past = (layout.slots_in(&self.config.region_bytes))
                .and_then(|slots| Some((run.first_id_from(slots)?, slots)));
            if let Some((block, slots)) = past {
                return Err(UsageError::BlockPastPool {
                    request,
                    group,
                    block,
                    slots,
                });
            }
        }
        let sessions = &self.sessions;
        let pins = |holder| {
            (sessions.live.get(&holder))
                .is_some_and(|s| matches!(s.phase, RecvPhase::Receiving | RecvPhase::Stopping))
        };
        if let Some((group, block, holder)) = self.held.conflict(&reg.groups, pins) {
            return Err(UsageError::BlockHeldByRequest {
                request,
                group,
                block,
                holder,
            });
        }
        crate::session::check_registration_ordinals(
            request,
            reg.prompt_len,
            &reg.groups,
            &self.config.local.groups,
        )
        .map_err(UsageError::RegistrationOutsidePrompt)?;
        self.check_registration_window(request, reg.prompt_len, &reg.groups)?;
        if let Some(parts) = &reg.expected_part {
            self.check_expected_part(request, parts)?;
        }
        let cover_proved =
            match self.prove_cover(request, &reg.writers, reg.expected_part.as_deref()) {
                Some(Err(error)) => return Err(UsageError::WritersDoNotCover(error)),
                Some(Ok(())) => true,
                None => false,
            };
        let slice = ReceiverSliceId(self.next_slice);
        let frame = RecvRegistration {
            request,
            slice,
            prompt_len: reg.prompt_len,
            grant: GrantId(0),
            aux_capacity: reg.aux_capacity,
            groups: reg.groups,
        };
        let frame = Frame::RecvRegistration(frame);
        if let Some((len, max)) = oversized(&frame) {
            return Err(UsageError::RegistrationTooLarge { request, len, max });
        }
        // A registration the wire cannot carry (a hand-built run that is not canonical) would
        // never reach a writer and the request would wait out its deadline: refuse it now.
        if let Err(error) = frame.to_vec() {
            return Err(UsageError::RegistrationUnencodable { request, error });
        }
        let Frame::RecvRegistration(mut frame) = frame else {
            unreachable!("built above")
        };
        // Validated: from here on the state changes.
        self.next_slice = self.next_slice.wrapping_add(1);
        frame.grant = GrantId(self.next_grant());
        let extents = GrantedExtents::compute(&self.config.local.groups, &frame.groups);
        let blocks_pinned: u64 = frame.groups.iter().map(|g| g.block_count()).sum();
        let d = self.config.deadlines;
        let per_token = d.result_per_token.as_nanos();
        let result_cap = now
            + d.result_wait
            + crate::time::Duration::from_nanos(
                per_token.saturating_mul(u64::from(frame.prompt_len)),
            );
        self.held.hold(request, &frame.groups);
        self.sessions.live.insert(
            request,
            RecvSession {
                phase: RecvPhase::Receiving,
                frame,
                extents,
                writers: reg
                    .writers
                    .iter()
                    .map(|&peer| Writer {
                        peer,
                        phase: WriterPhase::Unregistered,
                        seen: BTreeSet::new(),
                        last: None,
                        arrived: BTreeSet::new(),
                        landed: 0,
                        reported: 0,
                        held: VecDeque::new(),
                        aux: false,
                        result_bytes: 0,
                    })
                    .collect(),
                writes_in_flight: 0,
                aux: None,
                timings: RequestTimings {
                    started: now,
                    ended: now,
                    ..RequestTimings::default()
                },
                result_cap,
                last_progress: None,
                result_armed: Some(result_cap),
                aux_deadline: None,
                quiesce_deadline: None,
                bytes_written: 0,
                blocks_pinned,
                landed: LandedExtents::default(),
                expected_part: reg.expected_part,
                cover_proved,
            },
        );
        self.shell.counters.blocks_pinned += blocks_pinned;
        self.shell
            .timers
            .arm(result_cap, TimerKey::Request(request));
        if let Some(origin) = self.shell.remembered_cancels.take(request) {
            self.stop(now, request, Stop::Cancelled(origin));
            return Ok(());
        }
        self.meet_departed(now, request, &reg.writers);
        if !self.is_active(request) {
            return Ok(());
        }
        // No writer may start (and so complete on its side) before the writers' cover is
        // proved: a writer whose handshake comes later could still prove it wrong.
        if cover_proved {
            self.send_registrations(now, request);
        }
        Ok(())
    }

    /// Sends the registration to every writer of `request` whose handshake is done and that
    /// has not had it yet.
    fn send_registrations(&mut self, now: Instant, request: RequestId) {
        let ready: SmallVec<[PeerId; 2]> = self
            .sessions
            .live
            .get(&request)
            .map(|s| {
                (s.writers.iter())
                    .filter(|w| w.phase == WriterPhase::Unregistered)
                    .map(|w| w.peer)
                    .filter(|&p| self.shell.peers.is_ready(p))
                    .collect()
            })
            .unwrap_or_default();
        for peer in ready {
            self.send_registration(now, request, peer);
        }
    }

    pub(super) fn on_cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        match self.sessions.cancel_step(request)? {
            CancelStep::Remember => self
                .shell
                .remembered_cancels
                .insert(request, CancelOrigin::Local),
            CancelStep::Stop => self.stop(now, request, Stop::Cancelled(CancelOrigin::Local)),
            CancelStep::Ended => {}
        }
        Ok(())
    }

    pub(super) fn on_retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        let counters = &mut self.shell.counters;
        let mut groups = Vec::new();
        self.sessions.retire(now, request, counters, |s| {
            groups = s.frame.groups;
            RetiredGrant {
                grant: s.frame.grant,
                writers: s.writers.iter().map(|w| w.peer).collect(),
            }
        })?;
        self.held.release(request, &groups);
        Ok(())
    }

    /// splitmix64: a seeded, well-mixed sequence; never zero.
    pub(super) fn next_grant(&mut self) -> u64 {
        loop {
            self.grant_state = self.grant_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.grant_state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return z;
            }
        }
    }

    pub(super) fn send_registration(&mut self, now: Instant, request: RequestId, peer: PeerId) {
        let Some(session) = self.sessions.live.get_mut(&request) else {
            return;
        };
        if !session.phase.is_active() {
            return;
        }
        let Some(w) = session.writers.iter_mut().find(|w| w.peer == peer) else {
            return;
        };
        if !w.on(WriterEvent::RegistrationSent) {
            return;
        }
        let frame = Frame::RecvRegistration(session.frame.clone());
        self.shell.send(now, peer, frame);
    }

    /// Sends, to `peer` that just became ready, the registrations that waited for its
    /// handshake (once the writers' cover of each is proved).
    pub(super) fn send_waiting_registrations(&mut self, now: Instant, peer: PeerId) {
        let waiting = self.sessions.requests_where(|s| {
            s.phase.is_active()
                && (s.writers.iter())
                    .any(|w| w.peer == peer && w.phase == WriterPhase::Unregistered)
        });
        for request in waiting {
            if self.prove_session_cover(now, request, peer) {
                self.send_registrations(now, request);
            }
        }
    }

    /// Once every writer of `request` completed its handshake (the last one, `peer`, just did),
    /// proves that they cover what the registration expects; fails the request if not. Returns
    /// whether the cover is proved (the registration may go to the writers).
    pub(super) fn prove_session_cover(
        &mut self,
        now: Instant,
        request: RequestId,
        peer: PeerId,
    ) -> bool {
        let Some(session) = self.sessions.live.get(&request) else {
            return false;
        };
        if !session.phase.is_active() {
            return false;
        }
        if session.cover_proved {
            return true;
        }
        let writers: SmallVec<[PeerId; 2]> = session.writers.iter().map(|w| w.peer).collect();
        match self.prove_cover(request, &writers, session.expected_part.as_deref()) {
            None => false,
            Some(Ok(())) => {
                if let Some(s) = self.sessions.live.get_mut(&request) {
                    s.cover_proved = true;
                }
                true
            }
            Some(Err(error)) => {
                self.stop_protocol(now, request, peer, error);
                false
            }
        }
    }

    /// What this rank holds of each layer group.
    pub(super) fn held_parts(&self) -> impl Iterator<Item = GroupPart> + '_ {
        self.config.local.groups.iter().map(GroupPart::held)
    }

    /// Refuses a windowed group's blocks below its stale boundary: they are never sent (sink
    /// tokens among them), so the request would complete without them. The decode engine fills
    /// such blocks itself (see docs/PROTOCOL.md, "Sink tokens").
    pub(super) fn check_registration_window(
        &self,
        request: RequestId,
        prompt_len: u32,
        groups: &[AnchoredRun],
    ) -> Result<(), UsageError> {
        for (g, (run, layout)) in groups.iter().zip(&self.config.local.groups).enumerate() {
            let Some(window) = layout.window else {
                continue;
            };
            let stale = stale_boundary(prompt_len, window, layout.tokens_per_block).unwrap_or(0);
            if run.block_count() > 0 && run.first_ordinal < stale {
                return Err(UsageError::RegistrationBelowWindow {
                    request,
                    group: GroupIndex(g as u16),
                    first: run.first_ordinal,
                    stale,
                });
            }
        }
        Ok(())
    }

    /// Refuses an expected part that is not one part per group inside what the rank holds.
    pub(super) fn check_expected_part(
        &self,
        request: RequestId,
        parts: &[GroupPart],
    ) -> Result<(), UsageError> {
        let held: Vec<GroupPart> = self.held_parts().collect();
        for g in 0..held.len().max(parts.len()) {
            let part = parts.get(g).cloned().unwrap_or_default();
            let within = held.get(g).cloned().unwrap_or_default();
            if g >= held.len() || g >= parts.len() || !within.contains(&part) {
                return Err(UsageError::ExpectedPartNotHeld {
                    request,
                    group: GroupIndex(g as u16),
                    part,
                    held: within,
                });
            }
        }
        Ok(())
    }

    /// Whether `writers` (every one's handshake known) write each group's expected part exactly
    /// once; `None` while a writer's handshake is not known yet.
    pub(super) fn prove_cover(
        &self,
        request: RequestId,
        writers: &[PeerId],
        expected: Option<&[GroupPart]>,
    ) -> Option<Result<(), ProtocolError>> {
        let local = &self.config.local;
        let hellos: Vec<(PeerId, &crate::wire::Hello)> = writers
            .iter()
            .map(|&w| self.shell.peers.remote(w).map(|h| (w, h)))
            .collect::<Option<_>>()?;
        // Writers that write some group here; one that writes none would be waited for in vain.
        let mut writes_some: SmallVec<[bool; 4]> = SmallVec::from_elem(false, hellos.len());
        for (g, (dst, held)) in local.groups.iter().zip(self.held_parts()).enumerate() {
            let expected = expected.and_then(|e| e.get(g)).unwrap_or(&held);
            let parts: SmallVec<[(PeerId, GroupPart); 4]> = hellos
                .iter()
                .map(|&(w, hello)| {
                    let part = hello.groups.get(g).map_or_else(GroupPart::default, |src| {
                        GroupPart::written_by(&hello.topology, src, &local.topology, dst)
                    });
                    (w, part)
                })
                .collect();
            for (some, (_, part)) in writes_some.iter_mut().zip(&parts) {
                *some |= !part.is_empty();
            }
            if let Err(fault) = check_group_cover(expected, &parts) {
                return Some(Err(ProtocolError::WritersDoNotCover {
                    request,
                    group: GroupIndex(g as u16),
                    fault,
                }));
            }
        }
        if let Some(((writer, _), _)) = hellos.iter().zip(&writes_some).find(|(_, some)| !**some) {
            return Some(Err(ProtocolError::WriterWritesNothing {
                request,
                writer: *writer,
            }));
        }
        Some(Ok(()))
    }
}
