//! The engines that drive the workload: they admit requests as they arrive (at most
//! `max_active` at once), open them on the writer ranks, compute prefill chunks at a simulated
//! pace and submit them, register them on the receiver (usually first, sometimes late), submit
//! the aux data, sometimes cancel from either side, sometimes submit to a request that already
//! ended (refused, nothing changes), and free a request's blocks and retire it only on
//! `Quiesced`.

use kvpipe_core::session::{Registration, SendRequest, SenderInput, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{ChunkSpec, Duration, Instant, RequestId};

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
    /// The next request to admit.
    pub(crate) next_admit: usize,
    /// Requests admitted and not finished on every side.
    pub(crate) active: usize,
    /// When the last request was admitted.
    pub(crate) last_start: Instant,
}

impl Engine {
    pub(crate) fn new(mut plans: Vec<RequestPlan>, rng: SimRng) -> Self {
        plans.sort_by_key(|p| p.arrival);
        Engine {
            plans,
            rng,
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
