//! The engines that drive the workload: they admit requests as they arrive (at most
//! `max_active` at once), open them on the writer ranks, compute prefill chunks at a simulated
//! pace and submit them, register them on the receiver (usually first, sometimes late), submit
//! the aux data, sometimes cancel from either side, sometimes submit to a request that already
//! ended (refused, nothing changes), and free a request's blocks and retire it only on
//! `Quiesced`.

use kvpipe_core::session::{Registration, SendRequest, SenderInput, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Duration, GroupIndex, Instant,
    RequestId,
};

use super::config::PlantedBug;
use super::workload::{CancelSide, RequestPlan};
use super::world::{sender_peer, Action, Simulation, RECEIVER_PEER};
use super::SimRng;

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
    /// The engines' mistakes (see [`EngineMistake`]), a stream of their own for the same reason.
    mistakes: SimRng,
    /// Probability that a writer's chunk carries a mistake (0 unless the `engine` fault is on).
    mistake_rate: f64,
    /// The next request to admit.
    pub(crate) next_admit: usize,
    /// Requests admitted and not finished on every side.
    pub(crate) active: usize,
    /// When the last request was admitted.
    pub(crate) last_start: Instant,
}

impl Engine {
    pub(crate) fn new(
        mut plans: Vec<RequestPlan>,
        rng: SimRng,
        mistakes: SimRng,
        mistake_rate: f64,
    ) -> Self {
        plans.sort_by_key(|p| p.arrival);
        Engine {
            plans,
            rng,
            mistakes,
            mistake_rate,
            next_admit: 0,
            active: 0,
            last_start: Instant::ZERO,
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

impl Simulation {
    /// Starts the next request: schedules its open, registration and cancel, and (by fault
    /// injection) the death of one of its connections.
    pub(crate) fn admit(&mut self) {
        let now = self.sched.now();
        let i = self.engine.next_admit;
        self.engine.next_admit += 1;
        self.engine.active += 1;
        self.engine.last_start = now;
        self.oracle.records[i].started_at = Some(now);
        let plan = self.engine.plans[i].clone();
        self.note(|| {
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
        self.sched.schedule(now + plan.open_after, Action::Open(i));
        self.sched
            .schedule(now + plan.register_after, Action::Register(i));
        if let Some((after, side)) = plan.cancel {
            self.sched.schedule(now + after, Action::Cancel(i, side));
        }
        let span = Duration::from_nanos(
            plan.per_token.as_nanos() * u64::from(plan.prompt_len) + 1_000_000,
        );
        if let Some(death) = self.net.netem.peer_death(&plan.writers, span) {
            self.sched.schedule(
                now + death.after,
                Action::KillLink {
                    link: death.victim,
                    injected: true,
                    silent: death.silent,
                },
            );
        }
    }

    /// The prefill engines of the writer ranks open request `i`.
    pub(crate) fn open(&mut self, i: usize) {
        let now = self.sched.now();
        let plan = self.engine.plans[i].clone();
        for (w, &rank) in plan.writers.iter().enumerate() {
            let res = self.hosts.sender_caches[rank].begin_prefill(
                plan.id,
                plan.prompt_len,
                plan.sender_prefix,
                plan.allocation,
            );
            self.check(res, || format!("S{rank} cache begin {}", plan.id));
            self.oracle.records[i].senders[w].started = true;
            self.note(|| format!("engine S{rank} open {}", plan.id));
            let res = self.hosts.senders[rank].open_request(
                now,
                SendRequest {
                    request: plan.id,
                    receivers: [RECEIVER_PEER].into_iter().collect(),
                    beam_width: 1,
                },
            );
            self.check(res, || format!("S{rank} open {}", plan.id));
            self.drain();
        }
        let at = now + self.engine.compute_time(i, 0);
        self.sched.schedule(at, Action::Compute(i, 0));
    }

    /// The writer ranks computed chunk `k` of request `i` and submit it.
    pub(crate) fn compute(&mut self, i: usize, k: usize) {
        let now = self.sched.now();
        let spec = self.engine.chunk_spec(i, k);
        let request = self.engine.plans[i].id;
        let writers = self.engine.plans[i].writers.clone();
        let mut any = false;
        for (w, &rank) in writers.iter().enumerate() {
            if self.oracle.records[i].senders[w].terminal.is_some() {
                // An engine that learns of the end late still submits: refused, nothing
                // changes.
                if self.engine_rng().chance(0.3) {
                    let res = self.hosts.senders[rank]
                        .submit_chunk(now, request, spec, &mut self.hosts.sender_caches[rank])
                        .map(|_| ());
                    self.expect_ended(res, rank, request);
                    self.drain();
                }
                continue;
            }
            any = true;
            let res = self.hosts.sender_caches[rank].compute_chunk(request, spec.start, spec.end);
            self.check(res, || format!("S{rank} cache compute {request}"));
            self.note(|| {
                format!(
                    "engine S{rank} chunk {request} [{}, {}){}",
                    spec.start,
                    spec.end,
                    if spec.is_last { " last" } else { "" }
                )
            });
            match self.engine.mistake(k) {
                Some(mistake) => self.submit_mistaken(i, w, k, mistake),
                None => self.submit_plain(i, w, k),
            }
        }
        if !any {
            return;
        }
        if spec.is_last {
            let at = now + self.engine.plans[i].aux_after;
            self.sched.schedule(at, Action::Aux(i));
        } else {
            let at = now + self.engine.compute_time(i, k + 1);
            self.sched.schedule(at, Action::Compute(i, k + 1));
        }
    }

    /// Writer `w` of request `i` submits chunk `k` with an engine mistake. The sender must
    /// refuse it and fail the request on both sides; the one mistake the contract cannot see at
    /// once (a windowed group's run short of blocks the receiver needs) must fail it when the
    /// writer's bytes fall short of its share. Either way the request may not complete.
    fn submit_mistaken(&mut self, i: usize, w: usize, k: usize, mistake: EngineMistake) {
        let now = self.sched.now();
        let mut spec = self.engine.chunk_spec(i, k);
        let request = self.engine.plans[i].id;
        let rank = self.engine.plans[i].writers[w];
        if let EngineMistake::PrefixChanged = mistake {
            // A later chunk claims another cached prefix than the first one did.
            spec.prepopulated_len = if spec.prepopulated_len == 0 {
                spec.start.min(1)
            } else {
                spec.prepopulated_len - 1
            };
            if spec.prepopulated_len == self.engine.chunk_spec(i, k).prepopulated_len {
                // Nothing to change (a chunk at token 0 cannot claim a prefix).
                return self.submit_plain(i, w, k);
            }
        }
        let mut source = Mistaken {
            cache: &mut self.hosts.sender_caches[rank],
            mistake,
            bent: false,
        };
        let res = self.hosts.senders[rank].submit_chunk(now, request, spec, &mut source);
        let bent = source.bent || matches!(mistake, EngineMistake::PrefixChanged);
        if !bent {
            // Every run was empty: nothing to bend, a plain chunk.
            if res.is_ok() && spec.is_last {
                self.oracle.records[i].senders[w].last_chunk = true;
            }
            self.check(res.map(|_| ()), || format!("S{rank} submit {request}"));
            self.drain();
            return;
        }
        self.oracle.engine_mistakes += 1;
        self.oracle.records[i].engine_mistake = true;
        self.note(|| format!("engine S{rank} mistaken chunk {request} ({mistake:?}): {res:?}"));
        match res {
            // Caught at once: the session ended with EngineError.
            Err(UsageError::BlockRun(_) | UsageError::PrefixChanged { .. }) => {
                self.oracle.records[i].fatal[w] = true;
            }
            Ok(_) => {
                // A windowed group's short run: within the contract, so accepted; the writer's
                // share check must fail it later.
                if spec.is_last {
                    self.oracle.records[i].senders[w].last_chunk = true;
                }
                self.oracle.records[i].fatal[w] = true;
            }
            Err(other) => self.anomaly(format!(
                "S{rank} mistaken chunk {request} ({mistake:?}) gave {other:?}"
            )),
        }
        self.drain();
    }

    /// Writer `w` of request `i` submits chunk `k` as computed.
    fn submit_plain(&mut self, i: usize, w: usize, k: usize) {
        let now = self.sched.now();
        let spec = self.engine.chunk_spec(i, k);
        let request = self.engine.plans[i].id;
        let rank = self.engine.plans[i].writers[w];
        let res = self.hosts.senders[rank]
            .submit_chunk(now, request, spec, &mut self.hosts.sender_caches[rank])
            .map(|_| ());
        if res.is_ok() && spec.is_last {
            self.oracle.records[i].senders[w].last_chunk = true;
        }
        self.check(res, || {
            format!("S{rank} submit {request} [{}, {})", spec.start, spec.end)
        });
        self.drain();
    }

    /// Every writer rank submits request `i`'s aux data.
    pub(crate) fn aux(&mut self, i: usize) {
        let now = self.sched.now();
        let request = self.engine.plans[i].id;
        for w in 0..self.engine.plans[i].writers.len() {
            let rank = self.engine.plans[i].writers[w];
            if self.oracle.records[i].senders[w].terminal.is_some() {
                // An engine that learns of the end late still submits: refused, nothing
                // changes.
                if self.engine_rng().chance(0.3) {
                    let res = self.hosts.senders[rank].handle_input(SenderInput::Aux {
                        now,
                        request,
                        data: AuxData::default(),
                    });
                    self.expect_ended(res, rank, request);
                }
                continue;
            }
            let data = AuxData {
                prompt_tokens: self.engine.plans[i].prompt_len,
                cached_tokens: self.engine.plans[i].sender_prefix,
                first_tokens: vec![(request.0 % 50_000) as u32],
                draft_tokens: vec![],
            };
            self.note(|| format!("engine S{rank} aux {request}"));
            let res =
                self.hosts.senders[rank].handle_input(SenderInput::Aux { now, request, data });
            self.oracle.records[i].senders[w].aux |= res.is_ok();
            self.check(res, || format!("S{rank} aux {request}"));
            self.drain();
        }
    }

    /// A call on a request that already ended must be refused as ended (or retired).
    fn expect_ended(&mut self, res: Result<(), UsageError>, rank: usize, request: RequestId) {
        match res {
            Err(UsageError::SessionEnded(r) | UsageError::Retired(r)) if r == request => {}
            other => self.anomaly(format!("S{rank} call on ended {request} gave {other:?}")),
        }
    }

    /// The decode engine registers request `i`'s destination blocks.
    pub(crate) fn register(&mut self, i: usize) {
        let now = self.sched.now();
        let plan = self.engine.plans[i].clone();
        let groups = match self.hosts.receiver_cache.register_destination(
            plan.id,
            plan.prompt_len,
            plan.receiver_prefix,
        ) {
            Ok(g) => g,
            Err(e) => {
                self.check(Err(e), || format!("R cache register {}", plan.id));
                return;
            }
        };
        self.oracle.records[i].receiver.started = true;
        self.note(|| format!("engine R register {}", plan.id));
        let res = self
            .hosts
            .receiver
            .register(
                now,
                Registration {
                    request: plan.id,
                    prompt_len: plan.prompt_len,
                    groups,
                    writers: plan.writers.iter().map(|&r| sender_peer(r)).collect(),
                    aux_capacity: AUX_CAPACITY,
                },
            )
            .map(|_| ());
        if res.is_ok() {
            self.oracle.records[i].registered_at = Some(now);
        }
        self.check(res, || format!("R register {}", plan.id));
        self.drain();
    }

    /// An engine cancels request `i`.
    pub(crate) fn cancel(&mut self, i: usize, side: CancelSide) {
        let now = self.sched.now();
        let request = self.engine.plans[i].id;
        match side {
            CancelSide::Sender => {
                let writers = self.engine.plans[i].writers.clone();
                // Usually every writer rank's engine cancels; sometimes only one of them.
                let only = (writers.len() > 1 && self.engine_rng().chance(0.4))
                    .then(|| self.engine_rng().below(writers.len() as u64) as usize);
                for (w, &rank) in writers.iter().enumerate() {
                    if self.oracle.records[i].senders[w].retired || only.is_some_and(|o| o != w) {
                        continue;
                    }
                    self.oracle.records[i].cancel_issued = true;
                    self.note(|| format!("engine S{rank} cancel {request}"));
                    let res = self.hosts.senders[rank].cancel(now, request);
                    self.check(res, || format!("S{rank} cancel {request}"));
                    self.drain();
                }
            }
            CancelSide::Receiver => {
                if self.oracle.records[i].receiver.retired {
                    return;
                }
                self.oracle.records[i].cancel_issued = true;
                self.note(|| format!("engine R cancel {request}"));
                let res = self.hosts.receiver.cancel(now, request);
                self.check(res, || format!("R cancel {request}"));
                self.drain();
            }
        }
    }

    /// `Quiesced` for request `i` on sender rank `from` (`None`: the receiver): no write can
    /// touch its blocks any more; the engine frees them and retires the request, at once or a
    /// little later (late frames then meet a quiesced session).
    pub(crate) fn on_quiesced(&mut self, i: usize, from: Option<usize>) {
        let request = self.engine.plans[i].id;
        match from {
            Some(_) if self.cfg.planted_bug == Some(PlantedBug::KeepBlocks(request)) => {}
            Some(rank) => self.hosts.sender_caches[rank].release(request),
            None => self.hosts.receiver_cache.release(request),
        }
        if self.engine_rng().chance(0.5) {
            self.retire(i, from);
        } else {
            let at = self.sched.now() + Duration::from_nanos(self.engine_rng().below(3_000_000));
            self.sched.schedule(at, Action::Retire(i, from));
        }
    }

    /// The engine of sender rank `from` (`None`: the receiver's) retires request `i`.
    pub(crate) fn retire(&mut self, i: usize, from: Option<usize>) {
        let now = self.sched.now();
        let request = self.engine.plans[i].id;
        let who = who(from);
        let res = match from {
            Some(rank) => {
                let w = self.engine.plans[i]
                    .writers
                    .iter()
                    .position(|&r| r == rank)
                    .expect("a writer");
                self.oracle.records[i].senders[w].retired = true;
                self.hosts.senders[rank].retire(now, request)
            }
            None => {
                self.oracle.records[i].receiver.retired = true;
                self.hosts.receiver.retire(now, request)
            }
        };
        self.note(|| format!("engine {who} retire {request}"));
        self.check(res, || format!("{who} retire {request}"));
        let r = &self.oracle.records[i];
        if r.finished_at.is_none() && r.receiver.retired && r.senders.iter().all(|s| s.retired) {
            self.oracle.records[i].finished_at = Some(now);
            self.engine.active -= 1;
            self.note(|| format!("engine finished {request}"));
        }
    }

    /// The engines' generator.
    fn engine_rng(&mut self) -> &mut SimRng {
        &mut self.engine.rng
    }
}

/// How the trace names sender rank `from` (`None`: the receiver).
pub(crate) fn who(from: Option<usize>) -> String {
    match from {
        Some(r) => format!("S{r}"),
        None => "R".to_string(),
    }
}

/// A mistake of the prefill engine in the chunk it hands the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineMistake {
    /// One block more than asked.
    TooLong,
    /// The run's first block dropped (allowed only in a windowed group, where the receiver's
    /// share check catches it).
    DropHead,
    /// The run starts one ordinal late, so it ends past the asked end.
    Shifted,
    /// The run's last block dropped, so it ends early.
    EndsEarly,
    /// A later chunk claims another cached prefix.
    PrefixChanged,
}

impl Engine {
    /// Whether a writer's chunk `k` carries a mistake, and which.
    fn mistake(&mut self, k: usize) -> Option<EngineMistake> {
        if self.mistake_rate == 0.0 || !self.mistakes.chance(self.mistake_rate) {
            return None;
        }
        let kinds: &[EngineMistake] = if k == 0 {
            &[
                EngineMistake::TooLong,
                EngineMistake::DropHead,
                EngineMistake::Shifted,
                EngineMistake::EndsEarly,
            ]
        } else {
            &[
                EngineMistake::TooLong,
                EngineMistake::DropHead,
                EngineMistake::Shifted,
                EngineMistake::EndsEarly,
                EngineMistake::PrefixChanged,
            ]
        };
        self.mistakes.pick(kinds).copied()
    }
}

/// A block source that bends the cache's first non-empty run by `mistake`.
struct Mistaken<'a, S> {
    cache: &'a mut S,
    mistake: EngineMistake,
    /// Whether a run was bent (an empty run has nothing to bend).
    bent: bool,
}

impl<S: BlockSource> BlockSource for Mistaken<'_, S> {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        self.cache.block_run(request, group, begin, end, out)?;
        if self.bent || out.ids.is_empty() {
            return Ok(());
        }
        match self.mistake {
            EngineMistake::TooLong => out.ids.push(BlockId(u32::MAX - 1)),
            EngineMistake::DropHead => {
                out.ids.remove(0);
                out.first_ordinal += 1;
            }
            EngineMistake::Shifted => out.first_ordinal += 1,
            EngineMistake::EndsEarly => {
                out.ids.pop();
            }
            EngineMistake::PrefixChanged => return Ok(()),
        }
        self.bent = true;
        Ok(())
    }
}
