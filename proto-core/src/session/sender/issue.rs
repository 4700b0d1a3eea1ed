//! Issue and planning: a receiver's registration is checked and adopted, and every slice it has not
//! had yet is planned into its blocks and handed to the transport as a write batch, in slice order.

use super::*;

impl Sender {
    /// Why registration `reg` of held `request` cannot be written: another group count than
    /// this rank's, ordinals that do not end at the prompt's last block, a block named twice,
    /// an aux slot smaller than the aux data already submitted, or another prompt length than
    /// the request's chunks declared.
    fn registration_fault(
        &self,
        request: RequestId,
        reg: &RecvRegistration,
    ) -> Option<ProtocolError> {
        let expected = self.config.local.groups.len();
        if reg.groups.len() != expected {
            return Some(ProtocolError::GroupCountMismatch {
                request,
                expected,
                got: reg.groups.len(),
            });
        }
        let layout = &self.config.local.groups;
        if let Err(error) =
            check_registration_ordinals(request, reg.prompt_len, &reg.groups, layout)
        {
            return Some(error);
        }
        // Two ordinals written into one slot: the receiver would refuse the second write as a
        // grant violation and close the link. O(r log r) per group in its id runs.
        if let Some((group, block)) = reg
            .groups
            .iter()
            .enumerate()
            .find_map(|(g, run)| run.repeated_id().map(|b| (g, b)))
        {
            return Some(ProtocolError::RepeatedBlock {
                request,
                group,
                block,
            });
        }
        let session = self.sessions.live.get(&request)?;
        // Aux data taken before this receiver registered that its slot cannot hold: it would
        // refuse the aux after this side completed, so the request fails on both sides now.
        if let Some(len) = session.aux.as_ref().map(AuxData::slot_len) {
            if len > u64::from(reg.aux_capacity) {
                return Some(ProtocolError::AuxTooLarge {
                    request,
                    len,
                    capacity: reg.aux_capacity,
                });
            }
        }
        let local = session.prompt_len?;
        (local != reg.prompt_len).then_some(ProtocolError::PromptLenMismatch {
            request,
            registered: reg.prompt_len,
            local,
        })
    }

    pub(super) fn on_registration(&mut self, now: Instant, peer: PeerId, reg: RecvRegistration) {
        let request = reg.request;
        let refuse = Frame::Cancel(Cancel {
            request,
            reason: CancelReason::Failure,
        });
        if self.sessions.retired.contains(request) {
            self.shell.send(now, peer, refuse);
            return;
        }
        let Some(session) = self.sessions.live.get_mut(&request) else {
            if self.shell.remembered_cancels.contains(request) {
                let frame = Frame::Cancel(Cancel {
                    request,
                    reason: CancelReason::Engine,
                });
                self.shell.send(now, peer, frame);
            } else if self.pending_registrations.len < self.config.max_pending_registrations {
                if self.pending_registrations.push(now, peer, reg) {
                    let at = now + self.config.deadlines.registration;
                    self.shell.timers.arm(at, TimerKey::Request(request));
                }
            } else {
                self.shell.send(now, peer, refuse);
            }
            return;
        };
        let Some(t) = session.targets.iter().position(|t| t.peer == peer) else {
            self.shell.send(now, peer, refuse);
            self.shell.violation(
                peer,
                ProtocolError::NotAParticipant {
                    kind: "RecvRegistration",
                    request,
                },
            );
            return;
        };
        if let Some(known) = &session.targets[t].registration {
            if *known == reg {
                self.shell.counters.duplicates += 1;
            } else {
                self.stop_protocol(
                    now,
                    request,
                    peer,
                    ProtocolError::DuplicateRegistration { request },
                );
            }
            return;
        }
        if !session.phase.is_active() {
            // The session ended before this receiver registered: nothing was or will be written.
            let target = &mut session.targets[t];
            if target.on(TargetEvent::TerminalSent) {
                let frame = Frame::Cancel(Cancel {
                    request,
                    reason: status_reason(session.stop_status),
                });
                self.shell.send(now, peer, frame);
            }
            return;
        }
        if let Some(error) = self.registration_fault(request, &reg) {
            // Adopted all the same, so the failure names the receiver's slice.
            self.adopt_registration(request, t, reg);
            self.stop_protocol(now, request, peer, error);
            return;
        }
        let receiver_slice = reg.slice;
        self.adopt_registration(request, t, reg);
        self.shell.event(Event::Registered {
            request,
            peer,
            receiver_slice,
        });
        self.issue_pending(now, request, t);
        self.progress(now, request);
    }

    pub(super) fn adopt_registration(
        &mut self,
        request: RequestId,
        t: usize,
        reg: RecvRegistration,
    ) {
        if let Some(target) = self
            .sessions
            .live
            .get_mut(&request)
            .and_then(|s| s.targets.get_mut(t))
        {
            target.registration = Some(reg);
            target.on(TargetEvent::Registered);
        }
    }

    /// Plans and hands to the transport every slice target `t` has not been given yet, in order.
    pub(super) fn issue_pending(&mut self, now: Instant, request: RequestId, t: usize) {
        loop {
            let Some(session) = self.sessions.live.get_mut(&request) else {
                return;
            };
            if !session.phase.is_active() {
                return;
            }
            let target = &mut session.targets[t];
            let Some(reg) = &target.registration else {
                return;
            };
            let k = target.slices.len();
            if k >= session.slices.len() {
                return;
            }
            let peer = target.peer;
            let (Some(remote), Some(version)) = (
                self.shell.peers.remote(peer),
                self.shell.peers.version(peer),
            ) else {
                return;
            };
            let slice = &session.slices[k];
            // A layer range writes its layers of the blocks its chunk's first range holds.
            let (runs, layers) = match &slice.layers {
                None => (&slice.runs, None),
                Some(l) => match session.slices.get(l.runs_at) {
                    Some(first) => (&first.runs, Some(l)),
                    None => (&slice.runs, None),
                },
            };
            let plan = &mut self.plan_buffer;
            plan.clear();
            let mut error = None;
            let groups = self.config.local.groups.len();
            target.cursors.resize(groups, DstCursor::default());
            for (group, run) in runs {
                let g = usize::from(group.0);
                // Group counts were checked against the layout at the handshake and at the
                // registration; a miss here is reported, never indexed.
                let (Some(src), Some(dst), Some(dst_run), Some(cursor)) = (
                    self.config.local.groups.get(g),
                    remote.groups.get(g),
                    reg.groups.get(g),
                    target.cursors.get_mut(g),
                ) else {
                    error = Some(ProtocolError::GroupCountMismatch {
                        request,
                        expected: groups,
                        got: reg.groups.len().min(remote.groups.len()),
                    });
                    break;
                };
                let src = RankGroup {
                    topology: &self.config.local.topology,
                    layout: src,
                };
                let dst = RankGroup {
                    topology: &remote.topology,
                    layout: dst,
                };
                let planned = match layers {
                    None => plan_rank_group(src, dst, run, dst_run, cursor, plan),
                    Some(l) => {
                        let keep = l.groups.get(g).cloned().unwrap_or(0..0);
                        // The chunk's earlier ranges plan the same blocks from the same place:
                        // only its last range moves the cursor past the chunk.
                        let mut start = *cursor;
                        let at = if l.last_of_chunk { cursor } else { &mut start };
                        plan_rank_group_layers(src, dst, run, dst_run, keep, at, plan)
                    }
                };
                if let Err(e) = planned {
                    error = Some(ProtocolError::Unplannable { request, error: e });
                    break;
                }
            }
            if let Some(error) = error {
                // Attributed to the slice being planned, on both sides.
                let slice = self
                    .sessions
                    .live
                    .get(&request)
                    .and_then(|s| s.slices.get(k))
                    .map(|s| s.id);
                self.stop_protocol_at(now, request, peer, error, slice);
                return;
            }
            let slice_id = slice.id;
            let grant = reg.grant;
            let bytes = plan.total_bytes();
            let session = self.sessions.live.get_mut(&request).expect("present");
            let slice = &mut session.slices[k];
            slice.planned_by += 1;
            if slice.planned_by >= session.targets.len() {
                // Every receiver has its plan: the block runs are no longer needed (a layered
                // chunk's, once its last range is planned).
                match &slice.layers {
                    None => slice.runs = Vec::new(),
                    Some(l) if l.last_of_chunk => {
                        let at = l.runs_at;
                        if let Some(first) = session.slices.get_mut(at) {
                            first.runs = Vec::new();
                        }
                    }
                    Some(_) => {}
                }
            }
            let target = &mut session.targets[t];
            if self.plan_buffer.is_empty() {
                target.slices.push(TargetSlice {
                    done: true,
                    bytes: 0,
                    deadline: None,
                });
                continue;
            }
            let batch = WriteBatchId(self.next_batch);
            self.next_batch += 1;
            let deadline = now + self.config.deadlines.write_completion;
            target.slices.push(TargetSlice {
                done: false,
                bytes,
                deadline: Some(deadline),
            });
            target.inflight += 1;
            session.timings.first_byte.get_or_insert(now);
            session.timings.writes += 1;
            self.batches.insert(
                batch,
                BatchRef {
                    request,
                    target: t,
                    slice: k,
                },
            );
            self.shell.counters.bytes_planned += bytes;
            self.shell.counters.write_batches += 1;
            // One entry per request, not one per batch: a batch's deadline is never earlier
            // than one already armed for the request unless none is, and when that one fires
            // the request re-arms its earliest pending deadline (`rearm`). With an entry per
            // batch, a request of 512 batches held 512 and took them all out when it quiesced.
            let key = TimerKey::Request(request);
            if self
                .shell
                .timers
                .earliest(key)
                .is_none_or(|at| at > deadline)
            {
                self.shell.timers.arm(deadline, key);
            }
            self.shell.outputs.push_back(Output::ExecuteWrites {
                peer,
                batch,
                request,
                slice: slice_id,
                grant,
                plan: self.plan_buffer.clone(),
                headers: DataWriteHeaders {
                    version,
                    request,
                    grant,
                },
            });
        }
    }
}
