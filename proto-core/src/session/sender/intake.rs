//! Chunk intake: the engine's open, chunks, early prefix, aux data, cancel and retire, checked and
//! applied; a chunk becomes a slice.

use super::*;

impl Sender {
    pub(super) fn on_open(&mut self, now: Instant, req: SendRequest) -> Result<(), UsageError> {
        let request = req.request;
        self.sessions.check_new(request)?;
        if req.receivers.is_empty() {
            return Err(UsageError::NoPeers(request));
        }
        let settings = PipelineConfig {
            beam_width: req.beam_width,
            ..self.config.pipeline
        };
        if let Err(error) = settings.validate() {
            return Err(UsageError::Unsupported { request, error });
        }
        if let Some(peer) = named_twice(&req.receivers) {
            return Err(UsageError::DuplicatePeer { request, peer });
        }
        let registration_deadline = now + self.config.deadlines.registration;
        self.sessions.live.insert(
            request,
            SendSession {
                phase: SendPhase::Streaming,
                targets: req.receivers.iter().map(|&p| Target::new(p)).collect(),
                slices: Vec::new(),
                next_start: None,
                open_chunk: None,
                prompt_len: None,
                prepopulated_len: None,
                prefix_sent_early: false,
                aux: None,
                registration_deadline,
                aux_deadline: None,
                confirm_deadline: None,
                quiesce_deadline: None,
                stop_status: TransferStatus::Success,
                stop_slice: None,
                bytes_written: 0,
                timings: RequestTimings {
                    started: now,
                    ended: now,
                    ..RequestTimings::default()
                },
                blocks_pinned: 0,
            },
        );
        self.shell
            .timers
            .arm(registration_deadline, TimerKey::Request(request));
        if let Some(origin) = self.shell.remembered_cancels.take(request) {
            self.pending_registrations.take(request);
            self.stop(now, request, Stop::Cancelled(origin));
            return Ok(());
        }
        for (peer, reg) in self.pending_registrations.take(request) {
            self.on_registration(now, peer, reg);
        }
        self.meet_departed(now, request, &req.receivers);
        Ok(())
    }

    /// The checks on a chunk that need no block run; the state is not changed.
    pub(super) fn check_chunk(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
    ) -> Result<SendPhase, UsageError> {
        let session = self.sessions.held(request)?;
        let Some(next_phase) = chunk_phase(session.phase, spec.is_last) else {
            return Err(if session.phase == SendPhase::Finishing {
                UsageError::ChunkAfterLast(request)
            } else {
                UsageError::SessionEnded(request)
            });
        };
        if let Some(open) = &session.open_chunk {
            return Err(self.chunk_layers_unfinished(request, open));
        }
        match session.next_start {
            Some(expected) if spec.start != expected => {
                return Err(UsageError::ChunkOutOfOrder {
                    request,
                    expected,
                    got: spec.start,
                });
            }
            // The first chunk starts where the cached prefix ends: one that starts later
            // leaves tokens no chunk sends, and the request would complete without them.
            None if spec.start > spec.prepopulated_len => {
                return Err(UsageError::FirstChunkAfterPrefix {
                    request,
                    start: spec.start,
                    prepopulated_len: spec.prepopulated_len,
                });
            }
            _ => {}
        }
        if let Some(expected) = session.prompt_len {
            if spec.prompt_len != expected {
                return Err(UsageError::PromptLenChanged {
                    request,
                    expected,
                    got: spec.prompt_len,
                });
            }
        }
        if spec.prefix_sent_early != session.prefix_sent_early {
            return Err(UsageError::EarlyPrefixMismatch {
                request,
                sent_early: session.prefix_sent_early,
            });
        }
        spec.validate()
            .map_err(|error| UsageError::Geometry { request, error })?;
        Ok(next_phase)
    }

    /// The checks on an early prefix that need no block run, and its block windows.
    pub(super) fn check_prefix(
        &self,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
    ) -> Result<Windows, UsageError> {
        let session = self.sessions.held(request)?;
        if !session.phase.is_active() {
            return Err(UsageError::SessionEnded(request));
        }
        if session.next_start.is_some() || session.prefix_sent_early {
            return Err(UsageError::PrefixAfterChunks(request));
        }
        self.group_windows(request, |layout| {
            early_prefix_window(prompt_len, prepopulated_len, layout)
        })
    }

    /// Applies an early prefix (errors as in [`Self::on_chunk`]).
    pub(super) fn on_prefix(
        &mut self,
        now: Instant,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        let windows = self.check_prefix(request, prompt_len, prepopulated_len)?;
        check_answers(request, &windows, &runs)?;
        if let Some(fault) = self.run_fault(request, &windows, &runs, prompt_len) {
            self.fail_engine(now, request);
            return Ok(Submitted::EngineFault(fault));
        }
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        session.prefix_sent_early = true;
        session.prompt_len = Some(prompt_len);
        session.prepopulated_len = Some(prepopulated_len);
        if runs.is_empty() {
            return Ok(Submitted::Nothing);
        }
        Ok(Submitted::Slice(
            self.add_slice(now, request, false, runs, None),
        ))
    }

    /// Applies a chunk. An error is a usage error (nothing changed); an engine's broken answer
    /// is the outcome [`Submitted::EngineFault`] (the input was applied and failed the session).
    pub(super) fn on_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        let next_phase = self.check_chunk(request, &spec)?;
        let windows = self.chunk_windows(request, &spec)?;
        self.apply_chunk(now, request, spec, next_phase, &windows, runs, None)
    }

    /// The chunk's block window in each group that sends something, in group order.
    pub(super) fn chunk_windows(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
    ) -> Result<Windows, UsageError> {
        self.group_windows(request, |layout| chunk_window(spec, layout))
    }

    /// The block window `window` gives each group, for the groups that send something, in
    /// group order.
    fn group_windows(
        &self,
        request: RequestId,
        window: impl Fn(&LayerGroupLayout) -> Result<Option<BlockWindow>, GeometryError>,
    ) -> Result<Windows, UsageError> {
        let mut windows = SmallVec::new();
        for (g, layout) in self.config.local.groups.iter().enumerate() {
            if let Some(w) =
                window(layout).map_err(|error| UsageError::Geometry { request, error })?
            {
                // Before the engine is asked (a binding sizes its answer's buffer by the
                // window): a window larger than the pools can never be resident.
                if let Some(slots) = self.pool_slots[g] {
                    if u64::from(w.len()) > slots {
                        return Err(UsageError::ChunkPastPool {
                            request,
                            group: g,
                            blocks: w.len(),
                            slots,
                        });
                    }
                }
                windows.push((GroupIndex(g as u16), w));
            }
        }
        Ok(windows)
    }

    /// The first of `runs` that breaks the block-source contract for its window of `windows`,
    /// or names a block past its group's pools.
    fn run_fault(
        &self,
        request: RequestId,
        windows: &[(GroupIndex, BlockWindow)],
        runs: &[(GroupIndex, BlockRun)],
        prompt_len: u32,
    ) -> Option<EngineFault> {
        runs.iter()
            .zip(windows)
            .find_map(|((group, run), (_, asked))| {
                let layout = &self.config.local.groups[usize::from(group.0)];
                if let Some(error) = check_run(request, *group, *asked, run, layout, prompt_len) {
                    return Some(EngineFault::BlockRun(error));
                }
                let slots = self.pool_slots[usize::from(group.0)]?;
                let block = run.ids.iter().find(|id| u64::from(id.0) >= slots)?;
                Some(EngineFault::BlockPastPool {
                    request,
                    group: *group,
                    block: *block,
                    slots,
                })
            })
    }

    /// Applies a checked chunk whose block windows are `windows`: `runs` must answer exactly
    /// those, group by group (errors as in [`Self::on_chunk`]). `layers`: the chunk's first
    /// layer range, when it is submitted in ranges.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        next_phase: SendPhase,
        windows: &[(GroupIndex, BlockWindow)],
        runs: Vec<(GroupIndex, BlockRun)>,
        layers: Option<LayerRange>,
    ) -> Result<Submitted, UsageError> {
        check_answers(request, windows, &runs)?;
        // From here on the input is applied: an engine error fails the session.
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        let mismatch = session.targets.iter().find_map(|t| {
            t.registration
                .as_ref()
                .filter(|reg| reg.prompt_len != spec.prompt_len)
                .map(|reg| (t.peer, reg.prompt_len))
        });
        if let Some((peer, registered)) = mismatch {
            self.stop_protocol(
                now,
                request,
                peer,
                ProtocolError::PromptLenMismatch {
                    request,
                    registered,
                    local: spec.prompt_len,
                },
            );
            return Ok(Submitted::EngineFault(
                EngineFault::PromptLenDiffersFromRegistration {
                    request,
                    registered,
                    local: spec.prompt_len,
                },
            ));
        }
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        if let Some(expected) = session.prepopulated_len {
            if spec.prepopulated_len != expected {
                self.fail_engine(now, request);
                return Ok(Submitted::EngineFault(EngineFault::PrefixChanged {
                    request,
                    expected,
                    got: spec.prepopulated_len,
                }));
            }
        }
        if let Some(fault) = self.run_fault(request, windows, &runs, spec.prompt_len) {
            self.fail_engine(now, request);
            return Ok(Submitted::EngineFault(fault));
        }
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        session.next_start = Some(spec.end);
        session.prompt_len = Some(spec.prompt_len);
        session.prepopulated_len = Some(spec.prepopulated_len);
        session.timings.first_chunk.get_or_insert(now);
        // A first range that is not the chunk's last opens the chunk (see `layers.rs`).
        if let Some(layers) = layers.filter(|l| l.end < self.layer_count()) {
            return Ok(Submitted::sent(
                self.open_layered_chunk(now, request, spec, layers, runs),
            ));
        }
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        if spec.is_last {
            session.timings.last_chunk = Some(now);
        }
        if runs.is_empty() && !spec.is_last {
            return Ok(Submitted::Nothing);
        }
        session.phase = next_phase;
        Ok(Submitted::Slice(self.add_slice(
            now,
            request,
            spec.is_last,
            runs,
            None,
        )))
    }

    /// Creates a slice of the request from its block runs (or, for a layer range, the layers it
    /// writes) and writes it to every receiver that has registered.
    pub(super) fn add_slice(
        &mut self,
        now: Instant,
        request: RequestId,
        is_last: bool,
        runs: Vec<(GroupIndex, BlockRun)>,
        layers: Option<SliceLayers>,
    ) -> SenderSliceId {
        let session = self
            .sessions
            .live
            .get_mut(&request)
            .expect("the caller checked");
        let id = SenderSliceId(session.slices.len() as u32);
        let blocks: u64 = runs.iter().map(|(_, run)| run.ids.len() as u64).sum();
        session.blocks_pinned += blocks;
        self.shell.counters.blocks_pinned += blocks;
        session.slices.push(Slice {
            id,
            is_last,
            runs,
            planned_by: 0,
            layers,
        });
        self.shell.counters.slices += 1;
        if is_last && session.aux.is_none() {
            let at = now + self.config.deadlines.aux_wait;
            session.aux_deadline = Some(at);
            self.shell.timers.arm(at, TimerKey::Request(request));
        }
        for t in 0..session.targets.len() {
            self.issue_pending(now, request, t);
        }
        self.progress(now, request);
        id
    }

    /// The engine broke its contract for `request`: the KV cannot be trusted, so the request
    /// fails on both sides.
    pub(super) fn fail_engine(&mut self, now: Instant, request: RequestId) {
        self.stop(
            now,
            request,
            Stop::Failed {
                cause: TransferStatus::EngineError,
                peer: None,
                slice: None,
            },
        );
    }

    pub(super) fn on_cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        match self.sessions.cancel_step(request)? {
            CancelStep::Remember => {
                self.shell
                    .remembered_cancels
                    .insert(request, CancelOrigin::Local);
                // Receivers that already registered learn at once.
                let waiting = self.pending_registrations.take(request);
                for (peer, _) in waiting {
                    let frame = Frame::Cancel(Cancel {
                        request,
                        reason: CancelReason::Engine,
                    });
                    self.shell.send(now, peer, frame);
                }
            }
            CancelStep::Stop => self.stop(now, request, Stop::Cancelled(CancelOrigin::Local)),
            CancelStep::Ended => {}
        }
        Ok(())
    }

    pub(super) fn on_retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
        let counters = &mut self.shell.counters;
        self.sessions.retire(now, request, counters, |_| ())
    }

    /// Aux data at or after the session's aux deadline is late, whether or not a timer poll
    /// ran since: the deadline wins over an input at the same `now`. The deadline is applied
    /// first, exactly as the timer would apply it (a [`TransportInput::Timeout`] at `now`,
    /// recorded as its own input so that a recorded run replays the same), and the aux data
    /// then finds the session ended.
    pub(super) fn time_out_late_aux(&mut self, now: Instant, request: RequestId) {
        let late = self.sessions.live.get(&request).is_some_and(|s| {
            s.phase.is_active() && s.aux.is_none() && s.aux_deadline.is_some_and(|at| at <= now)
        });
        if late {
            let timeout = SenderInput::Transport {
                now,
                input: TransportInput::Timeout,
            };
            // A timer poll is never a caller bug: it cannot fail.
            let _ = self.handle_input(timeout);
        }
    }

    /// Takes the engine's aux data while the session is active; it goes out after every
    /// receiver's last result. A late one never gets here active (see
    /// [`Self::time_out_late_aux`]).
    pub(super) fn on_aux_submitted(
        &mut self,
        now: Instant,
        request: RequestId,
        data: AuxData,
    ) -> Result<(), UsageError> {
        let session = self.sessions.held_mut(request)?;
        if session.aux.is_some() {
            return Err(UsageError::AuxAlreadySubmitted(request));
        }
        if !session.phase.is_active() {
            return Err(UsageError::SessionEnded(request));
        }
        let frame = Frame::AuxResult(AuxResult {
            request,
            status: TransferStatus::Success,
            data,
        });
        if let Some((len, max)) = oversized(&frame) {
            return Err(UsageError::AuxTooLarge { request, len, max });
        }
        let Frame::AuxResult(AuxResult { data, .. }) = frame else {
            unreachable!("built above")
        };
        // The smallest aux slot among the receivers registered so far; one that registers
        // later with a smaller slot fails the request on both sides (`registration_fault`).
        let len = data.slot_len();
        let smallest = session
            .targets
            .iter()
            .filter_map(|t| t.registration.as_ref().map(|r| (t.peer, r.aux_capacity)))
            .min_by_key(|&(_, capacity)| capacity);
        if let Some((peer, capacity)) = smallest.filter(|&(_, c)| len > u64::from(c)) {
            return Err(UsageError::AuxOverSlot {
                request,
                peer,
                len,
                capacity,
            });
        }
        session.aux = Some(data);
        session.aux_deadline = None;
        self.progress(now, request);
        Ok(())
    }
}

/// The phase a chunk (the request's last when `is_last`) moves a session in `phase` to, or
/// `None` when no chunk may come in that phase.
pub(super) fn chunk_phase(phase: SendPhase, is_last: bool) -> Option<SendPhase> {
    let event = if is_last {
        SendEvent::LastChunk
    } else {
        SendEvent::Chunk
    };
    match phase.on(event) {
        Transition::To(p) => Some(p),
        Transition::Ignored | Transition::Refused => None,
    }
}

/// Checks one group's block run against the bounded block-source contract: it ends exactly at
/// the asked end, is never longer than asked, and is shorter only in a windowed group (whose
/// evicted head the contract allows).
/// The stale boundary of a windowed group for a prompt of `prompt_len` tokens (0 for a group
/// without a window).
fn stale(layout: &crate::layout::LayerGroupLayout, prompt_len: u32) -> u32 {
    layout.window.map_or(0, |w| {
        crate::geometry::stale_boundary(prompt_len, w, layout.tokens_per_block).unwrap_or(0)
    })
}

fn check_run(
    request: RequestId,
    group: GroupIndex,
    asked: BlockWindow,
    run: &BlockRun,
    layout: &crate::layout::LayerGroupLayout,
    prompt_len: u32,
) -> Option<BlockRunError> {
    let len = u32::try_from(run.ids.len()).unwrap_or(u32::MAX);
    let returned = BlockWindow {
        begin: run.first_ordinal,
        end: run.first_ordinal.saturating_add(len),
    };
    let fault = if len > asked.len() {
        BlockRunFault::TooLong
    } else if returned.end != asked.end || run.first_ordinal.checked_add(len).is_none() {
        BlockRunFault::WrongEnd
    } else if len < asked.len() && !layout.is_windowed_for(prompt_len) {
        BlockRunFault::TooShort
    } else if len < asked.len() && run.first_ordinal > asked.begin.max(stale(layout, prompt_len)) {
        // Every block from the stale boundary on stays in the window to the end of prefill:
        // the decode side registers them, and a correct cache still holds them.
        BlockRunFault::InsideWindow
    } else {
        return None;
    };
    Some(BlockRunError {
        request,
        group,
        asked,
        returned,
        fault,
    })
}

/// The block windows of a chunk (or prefix) in the groups that send something, in group order.
pub(super) type Windows = SmallVec<[(GroupIndex, BlockWindow); 4]>;

/// Refuses block runs that do not answer `windows` group by group (the engine answered another
/// query).
fn check_answers(
    request: RequestId,
    windows: &[(GroupIndex, BlockWindow)],
    runs: &[(GroupIndex, BlockRun)],
) -> Result<(), UsageError> {
    let given: Vec<GroupIndex> = runs.iter().map(|(g, _)| *g).collect();
    if given.len() != windows.len() || given.iter().zip(windows).any(|(a, (b, _))| a != b) {
        return Err(UsageError::RunsDoNotMatchChunk {
            request,
            expected: windows.iter().map(|(g, _)| *g).collect(),
            given,
        });
    }
    Ok(())
}
