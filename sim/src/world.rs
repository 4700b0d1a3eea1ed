//! The simulation itself: the world owns the [`Stage`] (the configuration, the virtual clock,
//! the endpoints and their caches, the trace) and the three parts that act on it — the
//! [`Network`], the [`Engine`] and the [`Oracle`] — and advances them one earliest deadline at a
//! time. It is the one place that drains the endpoints' outputs and routes each one to the part
//! it concerns; the parts never call each other.

use kvpipe_conformance::cache::{writers_of, RankSplit, ReferenceCache};
use kvpipe_core::session::{
    LocalHello, Output, Receiver, ReceiverConfig, ReceiverInput, Sender, SenderConfig, SenderInput,
    TransportInput,
};
use kvpipe_core::wire::{Frame, Topology};
use kvpipe_core::{Duration, InstanceId, Instant};
use kvpipe_netem::Netem;

use crate::action::Action;
use crate::config::{ScriptedFault, SimConfig};
use crate::engine::{Engine, EngineAction};
use crate::faults::FaultKind;
use crate::mistake::Mistakes;
use crate::network::{NetCounters, Network};
use crate::oracle::Oracle;
use crate::report::SimReport;
use crate::scheduler::Scheduler;
use crate::stage::{Called, Hosts, Stage, Trace};
use crate::summary::{frame_summary, who};
use crate::workload::{random_workload, RequestPlan, WorkloadShape};
use crate::SimRng;

/// A deterministic simulation of sender ranks and a receiver (see the crate doc).
pub struct Simulation {
    stage: Stage,
    net: Network,
    engine: Engine,
    oracle: Oracle,
}

impl Simulation {
    /// A simulation of `count` random requests drawn from the configuration's seed.
    pub fn random(cfg: SimConfig, count: usize) -> Self {
        let mut rng = SimRng::new(cfg.seed).fork(1);
        let shape = WorkloadShape {
            max_prompt: cfg.max_prompt,
            max_chunks: 6,
            senders: cfg.senders,
            mean_gap: Duration::from_micros(400),
            cancel_percent: cfg.cancel_percent,
            per_token: cfg.prefill_per_token,
        };
        let mut plans = random_workload(&mut rng, count, &shape);
        let mut cfg = cfg;
        let splits: Vec<_> = (RankSplit::SIMULATED.iter())
            .filter(|s| s.sender_tp <= 1 || usize::from(s.sender_tp) == cfg.senders)
            .collect();
        cfg.split = **SimRng::new(cfg.seed)
            .fork(5)
            .pick(&splits)
            .expect("non-empty");
        if cfg.faults.contains(FaultKind::RandomIds) {
            // As engines hash their string ids: any 64-bit value, in any order (distinct).
            let mut ids = SimRng::new(cfg.seed).fork(9);
            let mut taken = std::collections::HashSet::new();
            for p in &mut plans {
                let id = loop {
                    let id = ids.next_u64();
                    if taken.insert(id) {
                        break id;
                    }
                };
                p.id = kvpipe_core::RequestId(id);
            }
        }
        for p in &mut plans {
            // Separate instances: one writes the whole model (tensor-parallel ranks: the
            // ranks that hold the receiver's part, set by `Simulation::new`).
            p.writers.truncate(1);
        }
        Simulation::new(cfg, plans, Vec::new())
    }

    /// A simulation of the given requests and scripted faults (random faults as configured).
    pub fn new(cfg: SimConfig, plans: Vec<RequestPlan>, script: Vec<ScriptedFault>) -> Self {
        let max_prompt = plans
            .iter()
            .map(|p| p.prompt_len)
            .max()
            .unwrap_or(1)
            .max(cfg.max_prompt);
        let senders = cfg.senders.max(1);
        let valid = "the simulated model and split are valid";
        let (topologies, sender_caches): (Vec<Topology>, Vec<ReferenceCache>) = (0..senders)
            .map(|r| {
                cfg.split
                    .cache(Some(r), &cfg.cache_spec(Some(r), max_prompt))
                    .expect(valid)
            })
            .unzip();
        let receiver_spec = cfg.cache_spec(None, max_prompt);
        let (receiver_topology, receiver_cache) =
            cfg.split.cache(None, &receiver_spec).expect(valid);
        let mut plans = plans;
        if cfg.split.sender_tp > 1 {
            // Tensor-parallel senders: a request is written by every rank holding part of
            // what the receiver holds.
            let shapes: Vec<_> = (topologies.iter().copied())
                .zip(sender_caches.iter().map(ReferenceCache::layouts))
                .collect();
            let writers = writers_of(&shapes, &(receiver_topology, receiver_cache.layouts()));
            plans.iter_mut().for_each(|p| p.writers = writers.clone());
        }
        let sender_endpoints: Vec<Sender> = (0..senders)
            .map(|r| {
                let mut c = SenderConfig::new(LocalHello::new(
                    InstanceId(10 + r as u64),
                    topologies[r],
                    sender_caches[r].layouts(),
                ));
                c.deadlines = cfg.deadlines;
                Sender::new(c).expect("the simulator's endpoint configurations are supported")
            })
            .collect();
        let mut rc = ReceiverConfig::new(
            LocalHello::new(InstanceId(1), receiver_topology, receiver_cache.layouts()),
            cfg.seed ^ 0x5eed,
        );
        rc.deadlines = cfg.deadlines;
        let netem = Netem::with_rng(cfg.netem_config(&script), SimRng::new(cfg.seed).fork(2));
        let max_steps = if cfg.max_steps == 0 {
            2_000 * plans.len() as u64 + 1_000_000
        } else {
            cfg.max_steps
        };
        let mistake_rate = if cfg.faults.contains(FaultKind::Engine) {
            cfg.rates.engine
        } else {
            0.0
        };
        let decode_rate = if cfg.faults.contains(FaultKind::Decode) {
            cfg.rates.decode
        } else {
            0.0
        };
        let engine = Engine::new(
            plans,
            SimRng::new(cfg.seed).fork(4),
            Mistakes::new(
                SimRng::new(cfg.seed).fork(6),
                mistake_rate,
                SimRng::new(cfg.seed).fork(8),
                decode_rate,
            ),
            cfg.layers_per_slice,
            sender_endpoints.first().map_or(0, |s| s.layer_count()),
        );
        let mut sim = Simulation {
            stage: Stage {
                sched: Scheduler::new(max_steps),
                hosts: Hosts {
                    senders: sender_endpoints,
                    receiver: Receiver::new(rc)
                        .expect("the simulator's endpoint configurations are supported"),
                    sender_caches,
                    receiver_cache,
                    slots_per_group: receiver_spec.slots_per_group,
                },
                trace: Trace {
                    on: cfg.trace,
                    ..Trace::default()
                },
                cfg,
            },
            net: Network::new(netem, senders),
            oracle: Oracle::new(&engine.plans),
            engine,
        };
        for link in 0..senders {
            sim.stage
                .sched
                .schedule(Instant::ZERO, Action::Reconnect { link });
        }
        for f in &script {
            let (link, at, silent) = match *f {
                ScriptedFault::KillLink { sender, at } => (sender, at, false),
                ScriptedFault::BreakLink { sender, at } => (sender, at, true),
                ScriptedFault::FailBatch { .. } => continue,
            };
            sim.stage.sched.schedule(
                Instant::ZERO + at,
                Action::KillLink {
                    link,
                    injected: true,
                    silent,
                },
            );
        }
        sim
    }

    // ----- getters -----

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        self.stage.sched.now()
    }

    /// The readable trace (empty unless [`SimConfig::trace`] is on).
    pub fn trace(&self) -> &[String] {
        &self.stage.trace.lines
    }

    /// Usage errors and other surprises the engine side met (each one a bug somewhere).
    pub fn anomalies(&self) -> &[String] {
        &self.stage.trace.anomalies
    }

    /// What the network and transport did.
    pub fn net_counters(&self) -> NetCounters {
        self.net.counters()
    }

    /// The sender endpoint of rank `rank`.
    pub fn sender(&self, rank: usize) -> &Sender {
        &self.stage.hosts.senders[rank]
    }

    /// The receiver endpoint.
    pub fn receiver(&self) -> &Receiver {
        &self.stage.hosts.receiver
    }

    /// The receiver endpoint (for its recorded inputs).
    pub fn receiver_mut(&mut self) -> &mut Receiver {
        &mut self.stage.hosts.receiver
    }

    /// The sender endpoint of rank `rank` (for its recorded inputs).
    pub fn sender_mut(&mut self, rank: usize) -> &mut Sender {
        &mut self.stage.hosts.senders[rank]
    }

    /// Switches recording on or off: every endpoint records its inputs
    /// ([`Sender::record_inputs`]) and the simulation keeps every output it drains, so an
    /// endpoint can be replayed and compared ([`take_outputs`](Self::take_outputs)).
    pub fn record(&mut self, on: bool) {
        for s in &mut self.stage.hosts.senders {
            s.record_inputs(on);
        }
        self.stage.hosts.receiver.record_inputs(on);
        self.stage.trace.outputs = on.then(Vec::new);
    }

    /// The outputs drained from sender rank `Some(r)` (`None`: the receiver) since recording
    /// started, in order; the others are kept.
    pub fn take_outputs(&mut self, from: Option<usize>) -> Vec<Output> {
        let Some(all) = &mut self.stage.trace.outputs else {
            return Vec::new();
        };
        let (taken, kept) = std::mem::take(all)
            .into_iter()
            .partition::<Vec<_>, _>(|(f, _)| *f == from);
        *all = kept;
        taken.into_iter().map(|(_, o)| o).collect()
    }

    /// Whether every request was admitted and finished (retired on every side).
    pub fn finished(&self) -> bool {
        self.engine.finished()
    }

    // ----- driving -----

    /// Runs until every request finished, or the step or time bound is reached (unfinished
    /// requests then count as hung), and reports.
    pub fn run(&mut self) -> SimReport {
        while !self.finished() {
            if self.stage.sched.exhausted()
                || self.stage.sched.now() > self.engine.last_start + self.stage.cfg.time_limit
                || !self.step()
            {
                break;
            }
        }
        self.report()
    }

    /// Advances whoever has the earliest deadline — a scheduled delivery, write completion,
    /// prefill chunk or engine action, an endpoint's timer, or the next arrival — by one step.
    /// Returns `false` when nothing is left to do.
    pub fn step(&mut self) -> bool {
        #[derive(Clone, Copy)]
        enum Next {
            Action,
            SenderTimer(usize),
            ReceiverTimer,
            Arrival,
        }
        let mut best: Option<(Instant, Next)> = None;
        let mut consider = |at: Option<Instant>, what: Next| {
            if let Some(at) = at {
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, what));
                }
            }
        };
        consider(self.stage.sched.next_at(), Next::Action);
        for r in 0..self.stage.hosts.senders.len() {
            consider(
                self.stage.hosts.senders[r].poll_timeout(),
                Next::SenderTimer(r),
            );
        }
        consider(
            self.stage.hosts.receiver.poll_timeout(),
            Next::ReceiverTimer,
        );
        consider(
            self.engine
                .next_arrival(self.stage.cfg.max_active, self.stage.sched.now()),
            Next::Arrival,
        );
        let Some((at, next)) = best else {
            return false;
        };
        self.stage.sched.begin_step(at);
        let now = self.stage.sched.now();
        match next {
            Next::Action => {
                let action = self.stage.sched.pop().expect("peeked");
                self.perform(action);
            }
            Next::SenderTimer(r) => {
                let res = self.stage.hosts.senders[r].handle_input(SenderInput::Transport {
                    now,
                    input: TransportInput::Timeout,
                });
                self.stage.check(res, || format!("S{r} timeout"));
                self.drain();
            }
            Next::ReceiverTimer => {
                let res = self
                    .stage
                    .hosts
                    .receiver
                    .handle_input(ReceiverInput::Transport {
                        now,
                        input: TransportInput::Timeout,
                    });
                self.stage.check(res, || "R timeout".to_string());
                self.drain();
            }
            Next::Arrival => {
                self.engine
                    .admit(&mut self.stage, &mut self.oracle, &mut self.net.netem)
            }
        }
        true
    }

    fn perform(&mut self, action: Action) {
        let (stage, oracle, plans) = (&mut self.stage, &mut self.oracle, &self.engine.plans);
        let called = match action {
            Action::Open(i) => return self.engine_action(EngineAction::Open(i)),
            Action::Register(i) => return self.engine_action(EngineAction::Register(i)),
            Action::Compute(i, k) => return self.engine_action(EngineAction::Compute(i, k)),
            Action::Aux(i) => return self.engine_action(EngineAction::Aux(i)),
            Action::Cancel(i, side) => return self.engine_action(EngineAction::Cancel(i, side)),
            Action::Retire(i, from) => return self.engine.retire(stage, oracle, i, from),
            Action::Deliver {
                link,
                to_receiver,
                epoch,
                bytes,
            } => self.net.deliver(stage, link, to_receiver, epoch, bytes),
            Action::WriteDone { sender, batch } => {
                self.net.write_done(stage, oracle, plans, sender, batch)
            }
            Action::KillLink {
                link,
                injected,
                silent: true,
            } => return self.net.break_link(stage, oracle, plans, link, injected),
            Action::KillLink { link, injected, .. } => self
                .net
                .kill_link(stage, oracle, plans, link, injected, "died"),
            Action::NotifyDown {
                link,
                to_receiver,
                injected,
            } => self
                .net
                .notify_down(stage, oracle, plans, link, to_receiver, injected),
            Action::Reconnect { link } => self.net.reconnect(stage, link),
        };
        self.drain_if(called);
    }

    /// Takes an engine action one endpoint call at a time, draining the endpoints after each.
    fn engine_action(&mut self, action: EngineAction) {
        let mut progress = self.engine.begin(action);
        while let Some(called) = self
            .engine
            .step(&mut self.stage, &mut self.oracle, &mut progress)
        {
            self.drain_if(called);
        }
    }

    /// Drains the endpoints if a part called one.
    fn drain_if(&mut self, called: Called) {
        if called == Called::Endpoint {
            self.drain();
        }
    }

    /// Drains every endpoint's outputs until none has any left, carrying each one out.
    ///
    /// An endpoint whose outputs never run dry within one step is a livelock: the run stops
    /// (unfinished requests then count as hung) and the anomaly is recorded.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            for r in 0..self.stage.hosts.senders.len() {
                while let Some(o) = self.stage.hosts.senders[r].poll_output() {
                    any = true;
                    if self.count_output() {
                        return;
                    }
                    self.on_output(Some(r), o);
                }
            }
            while let Some(o) = self.stage.hosts.receiver.poll_output() {
                any = true;
                if self.count_output() {
                    return;
                }
                self.on_output(None, o);
            }
            if !any {
                return;
            }
        }
    }

    /// Counts one output of this step; `true` once the step produced too many (livelock).
    fn count_output(&mut self) -> bool {
        match self.stage.sched.count_output() {
            None => false,
            Some(first) => {
                if first {
                    let now = self.stage.sched.now();
                    self.stage.trace.anomalies.push(format!(
                        "livelock at {now}: outputs never ran dry within one step"
                    ));
                }
                true
            }
        }
    }

    fn on_output(&mut self, from: Option<usize>, output: Output) {
        if let Some(all) = &mut self.stage.trace.outputs {
            all.push((from, output.clone()));
        }
        let who = who(from);
        match output {
            Output::Transmit { peer, frame, bytes } => {
                let link = from.unwrap_or(peer.0 as usize);
                if !matches!(frame, Frame::Heartbeat(_)) {
                    let to = if from.is_some() {
                        "R".to_string()
                    } else {
                        format!("S{link}")
                    };
                    self.stage
                        .note(|| format!("{who} -> {to} {}", frame_summary(&frame)));
                }
                self.net
                    .send_frame(&mut self.stage, link, from.is_some(), frame, bytes);
            }
            Output::ExecuteWrites {
                peer: _,
                batch,
                request,
                slice,
                grant,
                plan,
                headers,
            } => {
                let rank = from.unwrap_or(0);
                self.stage.note(|| {
                    format!(
                        "{who} writes {batch} {request} {slice} {}B in {} extents",
                        plan.total_bytes(),
                        plan.len()
                    )
                });
                self.net.issue_batch(
                    &mut self.stage,
                    &mut self.oracle,
                    &self.engine.plans,
                    rank,
                    batch,
                    request,
                    grant,
                    plan,
                    headers,
                );
            }
            Output::ClosePeer { peer, reason } => {
                let link = from.unwrap_or(peer.0 as usize);
                self.net.counters.closes += 1;
                self.stage
                    .note(|| format!("{who} close link S{link}: {reason:?}"));
                let called = self.net.kill_link(
                    &mut self.stage,
                    &mut self.oracle,
                    &self.engine.plans,
                    link,
                    false,
                    "closed",
                );
                self.drain_if(called);
            }
            Output::Event(event) => {
                let net = &self.net;
                let quiesced = self.oracle.on_event(
                    &mut self.stage,
                    &self.engine.plans,
                    |rank, request| net.has_batch(rank, request),
                    from,
                    event,
                );
                if let Some(q) = quiesced {
                    self.engine
                        .on_quiesced(&mut self.stage, &mut self.oracle, q.index, q.from);
                }
            }
            // The simulated transport offers no data path of its own.
            Output::DataPath(_) => {}
        }
    }

    // ----- the end -----

    fn report(&mut self) -> SimReport {
        let mismatches = self.oracle.peer_loss_mismatches();
        self.stage.trace.anomalies.extend(mismatches);
        let mut report = self.oracle.judge(
            &self.engine.plans,
            &self.stage.hosts,
            &self.net.batch_requests(),
            self.stage.hosts.slots_per_group,
            &self.stage.trace.anomalies,
        );
        let net = self.net.counters();
        report.virtual_ms = self.stage.sched.now().as_nanos() / 1_000_000;
        report.steps = self.stage.sched.steps();
        report.stray_writes = net.stray_writes;
        report.refused_writes = net.refused_writes;
        report.frames = net.frames;
        report.write_batches = net.write_batches;
        report.write_failures = net.write_failures;
        report.link_deaths = net.link_deaths;
        report.engine_faults = self.oracle.engine_mistakes;
        report.decode_faults = self.oracle.decode_mistakes;
        report.timed_out_progressing = self.oracle.timed_out_progressing;
        report
    }
}
