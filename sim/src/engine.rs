//! The engines that drive the workload: they admit requests as they arrive (at most
//! `max_active` at once), open them on the writer ranks, compute prefill chunks at a simulated
//! pace and submit them (whole, or in layer ranges as their layers are computed:
//! [`SimConfig::layers_per_slice`](crate::SimConfig::layers_per_slice)), register them on the receiver (usually first, sometimes late), submit
//! the aux data, sometimes cancel from either side, sometimes submit to a request that already
//! ended (refused, nothing changes), and free a request's blocks and retire it only on
//! `Quiesced`.
//!
//! The [`Engine`] acts on the [`Stage`] it is lent and records what it did with the [`Oracle`].
//! An action that calls several endpoints in turn ([`EngineAction`]) is taken one call at a
//! time ([`Engine::step`]), so the world can drain the endpoints after each call.

use kvpipe_core::session::{
    EngineFault, Registration, SendRequest, SenderInput, Submitted, UsageError,
};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{ChunkSpec, Duration, Instant, LayerRange, RequestId};

use kvpipe_netem::Netem;

use crate::action::{sender_peer, Action, RECEIVER_PEER};
use crate::config::PlantedBug;
use crate::mistake::{DecodeMistake, EngineMistake, Mistaken, Mistakes};
use crate::oracle::Oracle;
use crate::report::Terminal;
use crate::stage::{Called, Stage};
use crate::summary::who;
use crate::workload::{CancelSide, RequestPlan};
use crate::SimRng;

/// Bytes of the receiver's aux slot.
const AUX_CAPACITY: u32 = 1024;

/// The workload and where the engines are in it.
#[derive(Debug)]
pub(crate) struct Engine {
    /// The requests, in arrival order.
    pub(crate) plans: Vec<RequestPlan>,
    /// The engines' own choices (late submits, partial cancels, when to retire), a stream
    /// apart from the network's, so a change of fault rates does not move them.
    rng: SimRng,
    /// The engines' mistakes (see [`EngineMistake`]).
    mistakes: Mistakes,
    /// The next request to admit.
    next_admit: usize,
    /// Requests admitted and not finished on every side.
    active: usize,
    /// When the last request was admitted.
    pub(crate) last_start: Instant,
    /// Layers per layer range a chunk is submitted in (0: whole chunks).
    layers_per_slice: u32,
    /// The sender ranks' layers (every rank holds the model's layers).
    layer_count: u32,
    /// Per request, where the next layer range of its current chunk starts.
    next_layer: Vec<u32>,
}

impl Engine {
    /// The engines of a workload; with `layers_per_slice` > 0 every chunk is submitted in
    /// ranges of that many of the senders' `layer_count` layers, each as its layers are
    /// computed.
    pub(crate) fn new(
        mut plans: Vec<RequestPlan>,
        rng: SimRng,
        mistakes: Mistakes,
        layers_per_slice: u32,
        layer_count: u32,
    ) -> Self {
        plans.sort_by_key(|p| p.arrival);
        let next_layer = vec![0; plans.len()];
        Engine {
            plans,
            rng,
            mistakes,
            next_admit: 0,
            active: 0,
            last_start: Instant::ZERO,
            layers_per_slice,
            layer_count,
            next_layer,
        }
    }

    /// The layer range request `i`'s current chunk submits next (`None`: whole chunks).
    fn layer_range(&self, i: usize) -> Option<LayerRange> {
        (self.layers_per_slice > 0).then(|| {
            let begin = self.next_layer[i];
            LayerRange::new(begin, (begin + self.layers_per_slice).min(self.layer_count))
        })
    }

    /// When the next submission of chunk `k` of request `i` is computed, from now: the whole
    /// chunk's compute, or the next layer range's share of it.
    fn compute_step(&self, i: usize, k: usize) -> Duration {
        let whole = self.compute_time(i, k);
        match self.layer_range(i) {
            None => whole,
            Some(r) => Duration::from_nanos(
                whole.as_nanos() * u64::from(r.len()) / u64::from(self.layer_count.max(1)),
            ),
        }
    }

    /// When the next request arrives, if one may start (fewer than `max_active` running).
    pub(crate) fn next_arrival(&self, max_active: usize, now: Instant) -> Option<Instant> {
        (self.active < max_active && self.next_admit < self.plans.len())
            .then(|| (Instant::ZERO + self.plans[self.next_admit].arrival).max(now))
    }

    /// Whether every request was admitted and finished.
    pub(crate) fn finished(&self) -> bool {
        self.next_admit == self.plans.len() && self.active == 0
    }

    fn chunk_spec(&self, i: usize, k: usize) -> ChunkSpec {
        let p = &self.plans[i];
        let start = if k == 0 {
            p.sender_prefix
        } else {
            p.chunk_ends[k - 1]
        };
        ChunkSpec {
            start,
            end: p.chunk_ends[k],
            prompt_len: p.prompt_len,
            prepopulated_len: p.sender_prefix,
            is_last: k + 1 == p.chunk_ends.len(),
            prefix_sent_early: false,
        }
    }

    fn compute_time(&self, i: usize, k: usize) -> Duration {
        let spec = self.chunk_spec(i, k);
        Duration::from_nanos(
            self.plans[i].per_token.as_nanos() * u64::from(spec.end - spec.start) + 1_000,
        )
    }
}

/// An engine action that calls the endpoints one writer at a time: the world takes its steps
/// ([`Engine::step`]) and drains the endpoints after each call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineAction {
    /// The prefill engines of the writer ranks open request `.0`.
    Open(usize),
    /// The decode engine registers request `.0`'s destination blocks.
    Register(usize),
    /// The writer ranks computed chunk `.1` of request `.0` and submit it.
    Compute(usize, usize),
    /// Every writer rank submits request `.0`'s aux data.
    Aux(usize),
    /// An engine cancels request `.0`.
    Cancel(usize, CancelSide),
}

/// Where an [`EngineAction`] is: the writer whose turn is next and what the action learned so
/// far. Made by [`Engine::begin`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    action: EngineAction,
    /// The next writer's index (the receiver's turn is index 0 of a receiver action).
    next: usize,
    /// (Compute) a writer's session was still active.
    any: bool,
    /// (Cancel from the sender side) the only writer whose engine cancels, when only one does.
    only: Option<usize>,
}

impl Engine {
    /// Starts `action` (a partial sender-side cancel picks its writer here, before any turn).
    pub(crate) fn begin(&mut self, action: EngineAction) -> Progress {
        let only = match action {
            EngineAction::Cancel(i, CancelSide::Sender) => {
                let writers = self.plans[i].writers.len();
                // Usually every writer rank's engine cancels; sometimes only one of them.
                (writers > 1 && self.rng.chance(0.4))
                    .then(|| self.rng.below(writers as u64) as usize)
            }
            _ => None,
        };
        Progress {
            action,
            next: 0,
            any: false,
            only,
        }
    }

    /// Takes the next turn of `p`: one writer's (or the receiver's) part, saying whether it
    /// called an endpoint; `None` once the action is over (its closing part, such as scheduling
    /// the next chunk, then done).
    pub(crate) fn step(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        p: &mut Progress,
    ) -> Option<Called> {
        let turn = p.next;
        p.next += 1;
        match p.action {
            EngineAction::Open(i) if turn < self.plans[i].writers.len() => {
                Some(self.open(stage, oracle, i, turn))
            }
            EngineAction::Open(i) => {
                let at = stage.now() + self.compute_step(i, 0);
                stage.sched.schedule(at, Action::Compute(i, 0));
                None
            }
            EngineAction::Register(i) if turn == 0 => Some(self.register(stage, oracle, i)),
            EngineAction::Compute(i, k) if turn < self.plans[i].writers.len() => {
                Some(self.compute(stage, oracle, i, k, turn, &mut p.any))
            }
            EngineAction::Compute(i, k) => {
                if let Some(r) = self.layer_range(i) {
                    if r.end < self.layer_count {
                        // The chunk's next layers are computed next.
                        self.next_layer[i] = r.end;
                        if p.any {
                            let at = stage.now() + self.compute_step(i, k);
                            stage.sched.schedule(at, Action::Compute(i, k));
                        }
                        return None;
                    }
                    self.next_layer[i] = 0;
                }
                if p.any {
                    let now = stage.now();
                    if self.chunk_spec(i, k).is_last {
                        let at = now + self.plans[i].aux_after;
                        stage.sched.schedule(at, Action::Aux(i));
                    } else {
                        let at = now + self.compute_step(i, k + 1);
                        stage.sched.schedule(at, Action::Compute(i, k + 1));
                    }
                }
                None
            }
            EngineAction::Aux(i) if turn < self.plans[i].writers.len() => {
                Some(self.aux(stage, oracle, i, turn))
            }
            EngineAction::Cancel(i, CancelSide::Sender) if turn < self.plans[i].writers.len() => {
                Some(self.cancel_sender(stage, oracle, i, turn, p.only))
            }
            EngineAction::Cancel(i, CancelSide::Receiver) if turn == 0 => {
                Some(self.cancel_receiver(stage, oracle, i))
            }
            EngineAction::Register(_) | EngineAction::Aux(_) | EngineAction::Cancel(..) => None,
        }
    }

    /// Starts the next request: schedules its open, registration and cancel, and (by fault
    /// injection, drawn from `netem`) the death of one of its connections.
    pub(crate) fn admit(&mut self, stage: &mut Stage, oracle: &mut Oracle, netem: &mut Netem) {
        let now = stage.now();
        let i = self.next_admit;
        self.next_admit += 1;
        self.active += 1;
        self.last_start = now;
        oracle.records[i].started_at = Some(now);
        let plan = self.plans[i].clone();
        stage.note(|| {
            format!(
                "engine start {} prompt={} chunks={:?} sender_prefix={} receiver_prefix={} \
                 writers={:?}",
                plan.id,
                plan.prompt_len,
                plan.chunk_ends,
                plan.sender_prefix,
                plan.receiver_prefix,
                plan.writers
            )
        });
        stage.sched.schedule(now + plan.open_after, Action::Open(i));
        stage
            .sched
            .schedule(now + plan.register_after, Action::Register(i));
        if let Some((after, side)) = plan.cancel {
            stage.sched.schedule(now + after, Action::Cancel(i, side));
        }
        let span = Duration::from_nanos(
            plan.per_token.as_nanos() * u64::from(plan.prompt_len) + 1_000_000,
        );
        if let Some(death) = netem.peer_death(&plan.writers, span) {
            stage.sched.schedule(
                now + death.after,
                Action::KillLink {
                    link: death.victim,
                    injected: true,
                    silent: death.silent,
                },
            );
        }
    }

    /// Writer `w`'s prefill engine opens request `i`.
    fn open(&mut self, stage: &mut Stage, oracle: &mut Oracle, i: usize, w: usize) -> Called {
        let now = stage.now();
        let plan = &self.plans[i];
        let rank = plan.writers[w];
        let res = stage.hosts.sender_caches[rank].begin_prefill(
            plan.id,
            plan.prompt_len,
            plan.sender_prefix,
            plan.allocation,
        );
        stage.check(res, || format!("S{rank} cache begin {}", plan.id));
        oracle.records[i].senders[w].started = true;
        stage.note(|| format!("engine S{rank} open {}", plan.id));
        let res = stage.hosts.senders[rank].open_request(
            now,
            SendRequest {
                request: plan.id,
                receivers: [RECEIVER_PEER].into_iter().collect(),
                beam_width: 1,
            },
        );
        stage.check(res, || format!("S{rank} open {}", plan.id));
        Called::Endpoint
    }

    /// Writer `w` computed chunk `k` of request `i` and submits it (`any`: set when its
    /// session is still active).
    fn compute(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        k: usize,
        w: usize,
        any: &mut bool,
    ) -> Called {
        let now = stage.now();
        let spec = self.chunk_spec(i, k);
        let request = self.plans[i].id;
        let rank = self.plans[i].writers[w];
        if oracle.records[i].senders[w].terminal.is_some() {
            // An engine that learns of the end late still submits: refused, nothing changes.
            if !self.rng.chance(0.3) {
                return Called::Nothing;
            }
            let res = submit_computed(stage, now, rank, request, spec, self.layer_range(i));
            expect_ended(stage, res, rank, request);
            return Called::Endpoint;
        }
        *any = true;
        let range = self.layer_range(i);
        if range.is_some_and(|r| r.begin > 0) {
            // A later layer range of the chunk: its bytes were computed with the first.
            stage.note(|| format!("engine S{rank} chunk {request} {}", range.unwrap()));
            self.submit_plain(stage, oracle, i, w, k);
            return Called::Endpoint;
        }
        let res = stage.hosts.sender_caches[rank].compute_chunk(request, spec.start, spec.end);
        stage.check(res, || format!("S{rank} cache compute {request}"));
        stage.note(|| {
            format!(
                "engine S{rank} chunk {request} [{}, {}){}{}",
                spec.start,
                spec.end,
                if spec.is_last { " last" } else { "" },
                range.map(|r| format!(" {r}")).unwrap_or_default()
            )
        });
        match self.mistakes.draw(k) {
            Some(mistake) => self.submit_mistaken(stage, oracle, i, w, k, mistake),
            None => self.submit_plain(stage, oracle, i, w, k),
        }
        Called::Endpoint
    }

    /// Writer `w` of request `i` submits chunk `k` with an engine mistake. The sender must
    /// refuse it and fail the request on both sides; the one mistake the contract cannot see at
    /// once (a windowed group's run short of blocks the receiver needs) must fail it when the
    /// writer's bytes fall short of its share. Either way the request may not complete.
    fn submit_mistaken(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        w: usize,
        k: usize,
        mistake: EngineMistake,
    ) {
        let now = stage.now();
        let mut spec = self.chunk_spec(i, k);
        let request = self.plans[i].id;
        let rank = self.plans[i].writers[w];
        if let EngineMistake::PrefixChanged = mistake {
            // A later chunk claims another cached prefix than the first one did.
            spec.prepopulated_len = if spec.prepopulated_len == 0 {
                spec.start.min(1)
            } else {
                spec.prepopulated_len - 1
            };
            if spec.prepopulated_len == self.chunk_spec(i, k).prepopulated_len {
                // Nothing to change (a chunk at token 0 cannot claim a prefix).
                return self.submit_plain(stage, oracle, i, w, k);
            }
        }
        let mut source = Mistaken {
            cache: &mut stage.hosts.sender_caches[rank],
            mistake,
            bent: false,
        };
        let range = self.layer_range(i);
        let res = match range {
            None => stage.hosts.senders[rank].submit_chunk(now, request, spec, &mut source),
            Some(r) => {
                stage.hosts.senders[rank].submit_chunk_layers(now, request, spec, r, &mut source)
            }
        };
        let bent = source.bent || matches!(mistake, EngineMistake::PrefixChanged);
        // The request's last submission: its last chunk, whole or its last layer range.
        let last = spec.is_last && range.is_none_or(|r| r.end == self.layer_count);
        if !bent {
            // Every run was empty: nothing to bend, a plain chunk.
            if res.is_ok() && last {
                oracle.records[i].senders[w].last_chunk = true;
            }
            let res = match res {
                Ok(Submitted::EngineFault(fault)) => {
                    stage.anomaly(format!("S{rank} unbent chunk {request} gave {fault}"));
                    Ok(())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            stage.check(res, || format!("S{rank} submit {request}"));
            return;
        }
        oracle.engine_mistakes += 1;
        oracle.records[i].engine_mistake = true;
        stage.note(|| format!("engine S{rank} mistaken chunk {request} ({mistake:?}): {res:?}"));
        match res {
            // Caught at once: the session ended with EngineError.
            Ok(Submitted::EngineFault(
                EngineFault::BlockRun(_) | EngineFault::PrefixChanged { .. },
            )) => {
                oracle.records[i].fatal[w] = true;
            }
            Ok(Submitted::EngineFault(other)) => stage.anomaly(format!(
                "S{rank} mistaken chunk {request} ({mistake:?}) gave {other:?}"
            )),
            Ok(Submitted::Slice(_) | Submitted::Nothing) => {
                // A windowed group's short run: within the contract, so accepted; the writer's
                // share check must fail it later.
                if last {
                    oracle.records[i].senders[w].last_chunk = true;
                }
                oracle.records[i].fatal[w] = true;
            }
            Err(other) => stage.anomaly(format!(
                "S{rank} mistaken chunk {request} ({mistake:?}) gave {other:?}"
            )),
        }
    }

    /// Writer `w` of request `i` submits chunk `k` as computed.
    fn submit_plain(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        w: usize,
        k: usize,
    ) {
        let now = stage.now();
        let spec = self.chunk_spec(i, k);
        let request = self.plans[i].id;
        let rank = self.plans[i].writers[w];
        let range = self.layer_range(i);
        let res = submit_computed(stage, now, rank, request, spec, range);
        if res.is_ok() && spec.is_last && range.is_none_or(|r| r.end == self.layer_count) {
            oracle.records[i].senders[w].last_chunk = true;
        }
        stage.check(res, || {
            format!("S{rank} submit {request} [{}, {})", spec.start, spec.end)
        });
    }

    /// Writer `w` submits request `i`'s aux data.
    fn aux(&mut self, stage: &mut Stage, oracle: &mut Oracle, i: usize, w: usize) -> Called {
        let now = stage.now();
        let request = self.plans[i].id;
        let rank = self.plans[i].writers[w];
        if oracle.records[i].senders[w].terminal.is_some() {
            // An engine that learns of the end late still submits: refused, nothing changes.
            if !self.rng.chance(0.3) {
                return Called::Nothing;
            }
            let res = stage.hosts.senders[rank].handle_input(SenderInput::Aux {
                now,
                request,
                data: AuxData::default(),
            });
            expect_ended(stage, res, rank, request);
            // Refused: it queued no output, so nothing to drain.
            return Called::Nothing;
        }
        let data = AuxData {
            prompt_tokens: self.plans[i].prompt_len,
            cached_tokens: self.plans[i].sender_prefix,
            first_tokens: vec![(request.0 % 50_000) as u32],
            draft_tokens: vec![],
        };
        stage.note(|| format!("engine S{rank} aux {request}"));
        let res = stage.hosts.senders[rank].handle_input(SenderInput::Aux { now, request, data });
        oracle.records[i].senders[w].aux |= res.is_ok();
        stage.check(res, || format!("S{rank} aux {request}"));
        Called::Endpoint
    }

    /// The decode engine registers request `i`'s destination blocks.
    fn register(&mut self, stage: &mut Stage, oracle: &mut Oracle, i: usize) -> Called {
        let now = stage.now();
        let plan = &self.plans[i];
        let groups = match stage.hosts.receiver_cache.register_destination(
            plan.id,
            plan.prompt_len,
            plan.receiver_prefix,
        ) {
            Ok(g) => g,
            Err(e) => {
                stage.check(Err(e), || format!("R cache register {}", plan.id));
                return Called::Nothing;
            }
        };
        oracle.records[i].receiver.started = true;
        stage.note(|| format!("engine R register {}", plan.id));
        let mut registration = Registration {
            request: plan.id,
            prompt_len: plan.prompt_len,
            groups,
            writers: plan.writers.iter().map(|&r| sender_peer(r)).collect(),
            aux_capacity: AUX_CAPACITY,
            expected_part: None,
        };
        let spare: Vec<usize> = (0..stage.hosts.senders.len())
            .filter(|r| !plan.writers.contains(r))
            .collect();
        // A mistake that changes nothing (a truncation of a registration with no block: the
        // decode side holds the whole prompt) is no mistake, and is not expected to fail.
        let mistake = (self.mistakes.draw_decode(plan.writers.len(), spare.len()))
            .filter(|&m| bend_registration(&mut registration, m, &spare));
        let res = stage.hosts.receiver.register(now, registration).map(|_| ());
        let Some(mistake) = mistake else {
            if res.is_ok() {
                oracle.records[i].registered_at = Some(now);
            }
            stage.check(res, || format!("R register {}", plan.id));
            return Called::Endpoint;
        };
        oracle.decode_mistakes += 1;
        let record = &mut oracle.records[i];
        record.engine_mistake = true;
        record.fatal.iter_mut().for_each(|f| *f = true);
        stage.note(|| {
            format!(
                "engine R mistaken registration {} ({mistake:?}): {res:?}",
                plan.id
            )
        });
        match res {
            Ok(()) => {
                // A writer's handshake is not known yet: the receiver must fail the request
                // once it is (or wait out a writer that never writes).
                record.registered_at = Some(now);
            }
            Err(UsageError::WritersDoNotCover(_) | UsageError::RegistrationOutsidePrompt(_)) => {
                // Refused, nothing held: the engine frees its blocks and recomputes.
                record.registration_refused = true;
                record.receiver.terminal = Some(Terminal::Failed);
                record.receiver.quiesced = true;
                record.receiver.retired = true;
                stage.hosts.receiver_cache.release(plan.id);
                if record.finished_at.is_none() && record.senders.iter().all(|s| s.retired) {
                    record.finished_at = Some(now);
                    self.active -= 1;
                }
            }
            Err(other) => stage.anomaly(format!(
                "R mistaken registration {} ({mistake:?}) gave {other:?}",
                plan.id
            )),
        }
        Called::Endpoint
    }

    /// Writer `w`'s engine cancels request `i` (unless it retired it, or `only` another one
    /// cancels).
    fn cancel_sender(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        w: usize,
        only: Option<usize>,
    ) -> Called {
        let now = stage.now();
        let request = self.plans[i].id;
        let rank = self.plans[i].writers[w];
        if oracle.records[i].senders[w].retired || only.is_some_and(|o| o != w) {
            return Called::Nothing;
        }
        oracle.records[i].cancel_issued = true;
        stage.note(|| format!("engine S{rank} cancel {request}"));
        let res = stage.hosts.senders[rank].cancel(now, request);
        stage.check(res, || format!("S{rank} cancel {request}"));
        Called::Endpoint
    }

    /// The decode engine cancels request `i` (unless it retired it).
    fn cancel_receiver(&mut self, stage: &mut Stage, oracle: &mut Oracle, i: usize) -> Called {
        let now = stage.now();
        let request = self.plans[i].id;
        if oracle.records[i].receiver.retired {
            return Called::Nothing;
        }
        oracle.records[i].cancel_issued = true;
        stage.note(|| format!("engine R cancel {request}"));
        let res = stage.hosts.receiver.cancel(now, request);
        stage.check(res, || format!("R cancel {request}"));
        Called::Endpoint
    }

    /// `Quiesced` for request `i` on sender rank `from` (`None`: the receiver): no write can
    /// touch its blocks any more; the engine frees them and retires the request, at once or a
    /// little later (late frames then meet a quiesced session).
    pub(crate) fn on_quiesced(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        from: Option<usize>,
    ) {
        let request = self.plans[i].id;
        match from {
            Some(_) if stage.cfg.planted_bug == Some(PlantedBug::KeepBlocks(request)) => {}
            Some(rank) => stage.hosts.sender_caches[rank].release(request),
            None => stage.hosts.receiver_cache.release(request),
        }
        if self.rng.chance(0.5) {
            self.retire(stage, oracle, i, from);
        } else {
            let at = stage.now() + Duration::from_nanos(self.rng.below(3_000_000));
            stage.sched.schedule(at, Action::Retire(i, from));
        }
    }

    /// The engine of sender rank `from` (`None`: the receiver's) retires request `i`.
    pub(crate) fn retire(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        i: usize,
        from: Option<usize>,
    ) {
        let now = stage.now();
        let request = self.plans[i].id;
        let who = who(from);
        let res = match from {
            Some(rank) => {
                let w = self.plans[i]
                    .writers
                    .iter()
                    .position(|&r| r == rank)
                    .expect("a writer");
                oracle.records[i].senders[w].retired = true;
                stage.hosts.senders[rank].retire(now, request)
            }
            None => {
                oracle.records[i].receiver.retired = true;
                stage.hosts.receiver.retire(now, request)
            }
        };
        stage.note(|| format!("engine {who} retire {request}"));
        stage.check(res, || format!("{who} retire {request}"));
        let r = &oracle.records[i];
        if r.finished_at.is_none() && r.receiver.retired && r.senders.iter().all(|s| s.retired) {
            oracle.records[i].finished_at = Some(now);
            self.active -= 1;
            stage.note(|| format!("engine finished {request}"));
        }
    }
}

/// Bends a registration by the decode engine's `mistake` (`spare`: sender ranks that are not
/// writers of the request); whether it changed anything (a registration with no block cannot
/// be truncated).
fn bend_registration(reg: &mut Registration, mistake: DecodeMistake, spare: &[usize]) -> bool {
    match mistake {
        DecodeMistake::DropWriter => {
            reg.writers.pop();
        }
        DecodeMistake::ExtraWriter => reg.writers.push(sender_peer(spare[0])),
        DecodeMistake::Truncated => {
            let Some(run) = reg.groups.iter_mut().find(|g| g.block_count() > 0) else {
                return false;
            };
            let last = run.runs.last_mut().expect("a non-empty run has an id run");
            if last.len == 1 {
                run.runs.pop();
            } else {
                last.len -= 1;
            }
        }
    }
    true
}

/// Sender `rank` submits a chunk its engine computed as it should (whole, or layer range
/// `range` of it), answered by its own cache: an engine fault there is the simulator's or the
/// core's bug, an anomaly; a usage error is left to the caller's check.
fn submit_computed(
    stage: &mut Stage,
    now: Instant,
    rank: usize,
    request: RequestId,
    spec: ChunkSpec,
    range: Option<LayerRange>,
) -> Result<(), UsageError> {
    let cache = &mut stage.hosts.sender_caches[rank];
    let sender = &mut stage.hosts.senders[rank];
    let res = match range {
        None => sender.submit_chunk(now, request, spec, cache),
        Some(r) => sender.submit_chunk_layers(now, request, spec, r, cache),
    };
    match res {
        Ok(Submitted::EngineFault(fault)) => {
            stage.anomaly(format!("S{rank} plain chunk {request} gave {fault}"));
            Ok(())
        }
        Ok(Submitted::Slice(_) | Submitted::Nothing) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A call on a request that already ended must be refused as ended (or retired).
fn expect_ended(stage: &mut Stage, res: Result<(), UsageError>, rank: usize, request: RequestId) {
    match res {
        Err(UsageError::SessionEnded(r) | UsageError::Retired(r)) if r == request => {}
        other => stage.anomaly(format!("S{rank} call on ended {request} gave {other:?}")),
    }
}
