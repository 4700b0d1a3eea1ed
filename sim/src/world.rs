//! The simulation itself: the endpoints and their caches ([`Hosts`]), wired to the scheduler,
//! the network, the engines and the oracle, advanced one earliest deadline at a time.

use bytes::Bytes;
use kvpipe_core::session::{
    Event, LocalHello, Output, Receiver, ReceiverConfig, ReceiverInput, Sender, SenderConfig,
    SenderInput, TransportInput, WriteBatchId,
};
use kvpipe_core::wire::{Frame, Topology};
use kvpipe_core::{Duration, InstanceId, Instant, PeerId};
use kvpipe_netem::Netem;

use super::config::{ScriptedFault, SimConfig};
use super::engine::{who, Engine};
use super::faults::FaultKind;
use super::network::{NetCounters, Network};
use super::oracle::Oracle;
use super::report::SimReport;
use super::scheduler::Scheduler;
use super::workload::{random_workload, CancelSide, RequestPlan, WorkloadShape};
use super::SimRng;
use kvpipe_conformance::cache::{writers_of, RankSplit, ReferenceCache};

/// How the receiver names sender rank `r`.
pub(crate) fn sender_peer(rank: usize) -> PeerId {
    PeerId(rank as u32)
}

/// How every sender rank names the receiver.
pub const RECEIVER_PEER: PeerId = PeerId(1000);

/// Something scheduled at a point of virtual time.
#[derive(Clone, Debug)]
pub(crate) enum Action {
    Open(usize),
    Register(usize),
    Compute(usize, usize),
    Aux(usize),
    Cancel(usize, CancelSide),
    /// The engine retires request `.0` on sender rank `Some(r)` or the receiver (`None`).
    Retire(usize, Option<usize>),
    Deliver {
        link: usize,
        to_receiver: bool,
        epoch: u64,
        bytes: Bytes,
    },
    WriteDone {
        sender: usize,
        batch: WriteBatchId,
    },
    KillLink {
        link: usize,
        injected: bool,
        silent: bool,
    },
    NotifyDown {
        link: usize,
        to_receiver: bool,
        injected: bool,
    },
    Reconnect {
        link: usize,
    },
}

/// The endpoints and the memory they move: sender ranks and the receiver with their reference
/// caches.
#[derive(Debug)]
pub(crate) struct Hosts {
    pub(crate) senders: Vec<Sender>,
    pub(crate) receiver: Receiver,
    pub(crate) sender_caches: Vec<ReferenceCache>,
    pub(crate) receiver_cache: ReferenceCache,
    /// Slots per group of every cache (all free at the end of a clean run).
    pub(crate) slots_per_group: u32,
}

/// What the run leaves for a reader: a readable line per step, and every output drained from
/// each endpoint, when asked for.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    on: bool,
    lines: Vec<String>,
    /// Outputs drained, with their endpoint (sender rank, or `None`: the receiver).
    outputs: Option<Vec<(Option<usize>, Output)>>,
}

impl Trace {
    pub(crate) fn note(&mut self, now: Instant, line: impl FnOnce() -> String) {
        if self.on {
            let t = now.as_nanos();
            let text = line();
            self.lines.push(format!(
                "{:>5}.{:03}ms {text}",
                t / 1_000_000,
                (t / 1_000) % 1_000
            ));
        }
    }
}

/// A deterministic simulation of sender ranks and a receiver (see the module doc).
pub struct Simulation {
    pub(crate) cfg: SimConfig,
    pub(crate) sched: Scheduler<Action>,
    pub(crate) hosts: Hosts,
    pub(crate) net: Network,
    pub(crate) engine: Engine,
    pub(crate) oracle: Oracle,
    pub(crate) trace: Trace,
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
        let sender_endpoints = (0..senders)
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
        let engine = Engine::new(
            plans,
            SimRng::new(cfg.seed).fork(4),
            SimRng::new(cfg.seed).fork(6),
            mistake_rate,
        );
        let mut sim = Simulation {
            sched: Scheduler::new(max_steps),
            hosts: Hosts {
                senders: sender_endpoints,
                receiver: Receiver::new(rc)
                    .expect("the simulator's endpoint configurations are supported"),
                sender_caches,
                receiver_cache,
                slots_per_group: receiver_spec.slots_per_group,
            },
            net: Network::new(netem, senders),
            oracle: Oracle::new(&engine.plans),
            engine,
            trace: Trace {
                on: cfg.trace,
                lines: Vec::new(),
                outputs: None,
            },
            cfg,
        };
        for link in 0..senders {
            sim.sched
                .schedule(Instant::ZERO, Action::Reconnect { link });
        }
        for f in &script {
            let (link, at, silent) = match *f {
                ScriptedFault::KillLink { sender, at } => (sender, at, false),
                ScriptedFault::BreakLink { sender, at } => (sender, at, true),
                ScriptedFault::FailBatch { .. } => continue,
            };
            sim.sched.schedule(
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
        self.sched.now()
    }

    /// The readable trace (empty unless [`SimConfig::trace`] is on).
    pub fn trace(&self) -> &[String] {
        &self.trace.lines
    }

    /// Usage errors and other surprises the engine side met (each one a bug somewhere).
    pub fn anomalies(&self) -> &[String] {
        &self.oracle.anomalies
    }

    /// What the network and transport did.
    pub fn net_counters(&self) -> NetCounters {
        self.net.counters()
    }

    /// The sender endpoint of rank `rank`.
    pub fn sender(&self, rank: usize) -> &Sender {
        &self.hosts.senders[rank]
    }

    /// The receiver endpoint.
    pub fn receiver(&self) -> &Receiver {
        &self.hosts.receiver
    }

    /// The receiver endpoint (for its recorded inputs).
    pub fn receiver_mut(&mut self) -> &mut Receiver {
        &mut self.hosts.receiver
    }

    /// The sender endpoint of rank `rank` (for its recorded inputs).
    pub fn sender_mut(&mut self, rank: usize) -> &mut Sender {
        &mut self.hosts.senders[rank]
    }

    /// Switches recording on or off: every endpoint records its inputs
    /// ([`Sender::record_inputs`]) and the simulation keeps every output it drains, so an
    /// endpoint can be replayed and compared ([`take_outputs`](Self::take_outputs)).
    pub fn record(&mut self, on: bool) {
        for s in &mut self.hosts.senders {
            s.record_inputs(on);
        }
        self.hosts.receiver.record_inputs(on);
        self.trace.outputs = on.then(Vec::new);
    }

    /// The outputs drained from sender rank `Some(r)` (`None`: the receiver) since recording
    /// started, in order; the others are kept.
    pub fn take_outputs(&mut self, from: Option<usize>) -> Vec<Output> {
        let Some(all) = &mut self.trace.outputs else {
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
            if self.sched.exhausted()
                || self.sched.now() > self.engine.last_start + self.cfg.time_limit
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
        consider(self.sched.next_at(), Next::Action);
        for r in 0..self.hosts.senders.len() {
            consider(self.hosts.senders[r].poll_timeout(), Next::SenderTimer(r));
        }
        consider(self.hosts.receiver.poll_timeout(), Next::ReceiverTimer);
        consider(
            self.engine
                .next_arrival(self.cfg.max_active, self.sched.now()),
            Next::Arrival,
        );
        let Some((at, next)) = best else {
            return false;
        };
        self.sched.begin_step(at);
        let now = self.sched.now();
        match next {
            Next::Action => {
                let action = self.sched.pop().expect("peeked");
                self.perform(action);
            }
            Next::SenderTimer(r) => {
                let res = self.hosts.senders[r].handle_input(SenderInput::Transport {
                    now,
                    input: TransportInput::Timeout,
                });
                self.check(res, || format!("S{r} timeout"));
                self.drain();
            }
            Next::ReceiverTimer => {
                let res = self.hosts.receiver.handle_input(ReceiverInput::Transport {
                    now,
                    input: TransportInput::Timeout,
                });
                self.check(res, || "R timeout".to_string());
                self.drain();
            }
            Next::Arrival => self.admit(),
        }
        true
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::Open(i) => self.open(i),
            Action::Register(i) => self.register(i),
            Action::Compute(i, k) => self.compute(i, k),
            Action::Aux(i) => self.aux(i),
            Action::Cancel(i, side) => self.cancel(i, side),
            Action::Retire(i, from) => self.retire(i, from),
            Action::Deliver {
                link,
                to_receiver,
                epoch,
                bytes,
            } => self.deliver(link, to_receiver, epoch, bytes),
            Action::WriteDone { sender, batch } => self.write_done(sender, batch),
            Action::KillLink {
                link,
                injected,
                silent: true,
            } => self.break_link(link, injected),
            Action::KillLink { link, injected, .. } => self.kill_link(link, injected, "died"),
            Action::NotifyDown {
                link,
                to_receiver,
                injected,
            } => self.notify_down(link, to_receiver, injected),
            Action::Reconnect { link } => self.reconnect(link),
        }
    }

    pub(crate) fn note(&mut self, line: impl FnOnce() -> String) {
        self.trace.note(self.sched.now(), line);
    }

    /// Records an anomaly (each one a bug somewhere).
    pub(crate) fn anomaly(&mut self, line: String) {
        self.note(|| format!("ANOMALY {line}"));
        self.oracle.anomalies.push(line);
    }

    pub(crate) fn check<E: std::fmt::Display>(
        &mut self,
        res: Result<(), E>,
        what: impl FnOnce() -> String,
    ) {
        if let Err(e) = res {
            self.anomaly(format!("{}: {e}", what()));
        }
    }

    /// Drains every endpoint's outputs until none has any left, carrying each one out.
    ///
    /// An endpoint whose outputs never run dry within one step is a livelock: the run stops
    /// (unfinished requests then count as hung) and the anomaly is recorded.
    pub(crate) fn drain(&mut self) {
        loop {
            let mut any = false;
            for r in 0..self.hosts.senders.len() {
                while let Some(o) = self.hosts.senders[r].poll_output() {
                    any = true;
                    if self.count_output() {
                        return;
                    }
                    self.on_output(Some(r), o);
                }
            }
            while let Some(o) = self.hosts.receiver.poll_output() {
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
        match self.sched.count_output() {
            None => false,
            Some(first) => {
                if first {
                    let now = self.sched.now();
                    self.oracle.anomalies.push(format!(
                        "livelock at {now}: outputs never ran dry within one step"
                    ));
                }
                true
            }
        }
    }

    fn on_output(&mut self, from: Option<usize>, output: Output) {
        if let Some(all) = &mut self.trace.outputs {
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
                    self.note(|| format!("{who} -> {to} {}", frame_summary(&frame)));
                }
                self.send_frame(link, from.is_some(), frame, bytes);
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
                self.note(|| {
                    format!(
                        "{who} writes {batch} {request} {slice} {}B in {} extents",
                        plan.total_bytes(),
                        plan.len()
                    )
                });
                self.issue_batch(rank, batch, request, grant, plan, headers);
            }
            Output::ClosePeer { peer, reason } => {
                let link = from.unwrap_or(peer.0 as usize);
                self.net.counters.closes += 1;
                self.note(|| format!("{who} close link S{link}: {reason:?}"));
                self.kill_link(link, false, "closed");
            }
            Output::Event(event) => self.on_event(from, event),
        }
    }

    // ----- the end -----

    fn report(&mut self) -> SimReport {
        let mut report = self.oracle.judge(
            &self.engine.plans,
            &self.hosts,
            &self.net.batch_requests(),
            self.hosts.slots_per_group,
        );
        let net = self.net.counters();
        report.virtual_ms = self.sched.now().as_nanos() / 1_000_000;
        report.steps = self.sched.steps();
        report.stray_writes = net.stray_writes;
        report.refused_writes = net.refused_writes;
        report.frames = net.frames;
        report.write_batches = net.write_batches;
        report.write_failures = net.write_failures;
        report.link_deaths = net.link_deaths;
        report.engine_faults = self.oracle.engine_mistakes;
        report.timed_out_progressing = self.oracle.timed_out_progressing;
        report
    }
}

/// One line about a frame (no grants or hashes: they are seeded values).
pub fn frame_summary(frame: &Frame) -> String {
    match frame {
        Frame::Hello(h) => format!("Hello {:?} inst#{}", h.role, h.instance.0),
        Frame::HelloAccept(a) => format!("HelloAccept v{}", a.version),
        Frame::HelloReject(r) => format!("HelloReject {:?}", r.reason),
        Frame::RecvRegistration(r) => format!(
            "RecvRegistration {} {} prompt={} groups={}",
            r.request,
            r.slice,
            r.prompt_len,
            r.groups
                .iter()
                .map(|g| format!("{}+{}", g.first_ordinal, g.block_count()))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Frame::KvResult(r) => format!(
            "KvResult {} {} {}{} {:?} {}B",
            r.request,
            r.sender_slice,
            r.receiver_slice,
            if r.is_last { " last" } else { "" },
            r.status,
            r.bytes_written
        ),
        Frame::AuxResult(a) => format!("AuxResult {} {:?}", a.request, a.status),
        Frame::Cancel(c) => format!("Cancel {} {:?}", c.request, c.reason),
        Frame::Heartbeat(h) => format!("Heartbeat {}", h.seq),
        Frame::DataWrite(d) => format!("DataWrite {} {}B", d.request, d.len),
    }
}

/// One line about an event.
pub fn event_summary(event: &Event) -> String {
    match event {
        Event::PeerReady { peer, role, .. } => format!("PeerReady {peer} {role:?}"),
        Event::PeerRejected { peer, reason, .. } => format!("PeerRejected {peer} {reason:?}"),
        Event::ProtocolViolation { peer, error } => format!("ProtocolViolation {peer}: {error}"),
        Event::Registered {
            request,
            peer,
            receiver_slice,
        } => format!("Registered {request} {peer} {receiver_slice}"),
        Event::Completed {
            request,
            bytes_written,
            aux,
            ..
        } => format!(
            "Completed {request} {bytes_written}B{}",
            if aux.is_some() { " +aux" } else { "" }
        ),
        Event::Failed {
            request,
            cause,
            peer,
            sender_slice,
            receiver_slice,
        } => format!(
            "Failed {request} {cause:?} peer={} sslice={} rslice={}",
            peer.map_or("-".into(), |p| p.to_string()),
            sender_slice.map_or("-".into(), |s| s.0.to_string()),
            receiver_slice.map_or("-".into(), |s| s.0.to_string()),
        ),
        Event::TimedOut {
            request,
            waiting_for,
        } => format!("TimedOut {request} {waiting_for:?}"),
        Event::Cancelled { request, origin } => format!("Cancelled {request} {origin:?}"),
        Event::Quiesced { request } => format!("Quiesced {request}"),
    }
}
