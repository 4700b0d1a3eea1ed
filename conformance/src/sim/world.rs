//! The simulation itself: endpoints, caches, the seeded network and the engine that drives
//! requests, advanced one earliest deadline at a time.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use kvpipe_core::session::{
    Admission, DataWriteHeaders, Deadlines, Event, LocalHello, Output, Receiver, ReceiverConfig,
    ReceiverInput, Registration, SendRequest, Sender, SenderConfig, SenderInput, TransportInput,
    UsageError, WriteBatchId,
};
use kvpipe_core::wire::{AuxData, Frame, Topology, TransferStatus};
use kvpipe_core::{
    ChunkSpec, Duration, GrantId, GroupIndex, InstanceId, Instant, PeerId, RegionId, RequestId,
    WritePlan,
};
use smallvec::SmallVec;

use super::faults::{FaultKind, FaultRates, FaultSet};
use super::report::{Outcome, RequestOutcome, SimReport, Terminal};
use super::rng::SimRng;
use super::workload::{random_workload, CancelSide, RequestPlan, WorkloadShape};
use crate::cache::{CacheSpec, GroupSpec, ReferenceCache};

/// How the receiver names sender rank `r`.
fn sender_peer(rank: usize) -> PeerId {
    PeerId(rank as u32)
}

/// How every sender rank names the receiver.
pub const RECEIVER_PEER: PeerId = PeerId(1000);

/// Bytes of the receiver's aux slot.
const AUX_CAPACITY: u32 = 1024;

/// Everything a simulation run is parameterised by.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Seed of every random choice (workload and faults).
    pub seed: u64,
    /// Sender ranks (each writes some requests; some requests are written by two, as under
    /// tensor parallelism).
    pub senders: usize,
    /// Faults switched on.
    pub faults: FaultSet,
    /// How often they strike.
    pub rates: FaultRates,
    /// Deadlines of both endpoints.
    pub deadlines: Deadlines,
    /// Requests in progress at once (later arrivals wait).
    pub max_active: usize,
    /// Longest prompt of a random workload.
    pub max_prompt: u32,
    /// Percentage of random requests the engine cancels.
    pub cancel_percent: u64,
    /// Tokens per block of the simulated model.
    pub tokens_per_block: u32,
    /// Sliding window of the model's second layer group, in tokens.
    pub window: u32,
    /// Leading tokens the senders keep resident in the windowed group.
    pub sink_tokens: u32,
    /// How the senders' pools split the first (full-attention) group's layers.
    pub sender_pool_split: Vec<u16>,
    /// How the receiver's pools split them (the planner pairs layer ranges across splits).
    pub receiver_pool_split: Vec<u16>,
    /// Padding bytes at the end of every receiver slot.
    pub receiver_slot_padding: u64,
    /// Record a readable trace of every step (scripted scenarios).
    pub trace: bool,
    /// A deliberate bug, to check that the simulator catches it (tests only).
    pub planted_bug: Option<PlantedBug>,
    /// Steps after which the run stops and unfinished requests count as hung (0: automatic).
    pub max_steps: u64,
    /// Virtual time past the last start after which unfinished requests count as hung.
    pub time_limit: Duration,
}

impl SimConfig {
    /// Two sender ranks, short deadlines, the given seed and faults. The model's block size,
    /// window and sink tokens are drawn from the seed too, so sweeps over seeds cover several.
    pub fn new(seed: u64, faults: FaultSet) -> Self {
        let mut rng = SimRng::new(seed).fork(3);
        let tokens_per_block = *rng.pick(&[4, 4, 8, 16, 1]).expect("non-empty");
        let window = *rng.pick(&[24, 12, 40, 64, 100]).expect("non-empty");
        let sink_tokens = *rng.pick(&[0, 4, 8]).expect("non-empty");
        let splits: [&[u16]; 4] = [&[1, 2], &[3], &[2, 1], &[1, 1, 1]];
        let sender_pool_split = rng.pick(&splits).expect("non-empty").to_vec();
        let receiver_pool_split = rng.pick(&splits).expect("non-empty").to_vec();
        let receiver_slot_padding = *rng.pick(&[0, 0, 8, 24]).expect("non-empty");
        SimConfig {
            seed,
            senders: 2,
            faults,
            rates: FaultRates::default(),
            deadlines: Deadlines {
                handshake: Duration::from_millis(100),
                registration: Duration::from_millis(1_000),
                write_completion: Duration::from_millis(200),
                result_wait: Duration::from_millis(5_000),
                result_per_token: Duration::ZERO,
                result_idle: Duration::from_millis(5_000),
                aux_wait: Duration::from_millis(300),
                heartbeat_interval: Duration::from_millis(50),
                liveness_timeout: Duration::from_millis(400),
                quiesce: Duration::from_millis(150),
            },
            max_active: 24,
            max_prompt: 160,
            cancel_percent: 5,
            tokens_per_block,
            window,
            sink_tokens,
            sender_pool_split,
            receiver_pool_split,
            receiver_slot_padding,
            trace: false,
            planted_bug: None,
            max_steps: 0,
            time_limit: Duration::from_secs(120),
        }
    }

    /// The reference cache of sender rank `rank` (`None`: the receiver's) for a workload whose
    /// longest prompt is `max_prompt` tokens.
    pub fn cache_spec(&self, rank: Option<usize>, max_prompt: u32) -> CacheSpec {
        let blocks = max_prompt.div_ceil(self.tokens_per_block) + 1;
        let split = if rank.is_some() {
            &self.sender_pool_split
        } else {
            &self.receiver_pool_split
        };
        let mut full = GroupSpec::full(split.iter().sum(), split);
        full.kv_heads = 2;
        if rank.is_none() {
            full.slot_padding = self.receiver_slot_padding;
        }
        let windowed = GroupSpec::full(1, &[1]).windowed(self.window, self.sink_tokens);
        CacheSpec {
            tokens_per_block: self.tokens_per_block,
            groups: vec![full, windowed],
            slots_per_group: blocks * self.max_active as u32 + 8,
            first_region: rank.map_or(1000, |r| 100 * (r as u32 + 1)),
            slot_order_seed: Some(self.seed ^ rank.map_or(0xdec0, |r| r as u64 + 1)),
            materialize: true,
        }
    }
}

/// A deliberate mistake of the simulated engine or transport, for tests that show the
/// simulator's checks catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlantedBug {
    /// The sender engine never frees this request's blocks.
    KeepBlocks(RequestId),
    /// The transport flips one byte of every write of this request.
    FlipByte(RequestId),
}

/// A fault a scripted scenario injects at an exact point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScriptedFault {
    /// The `nth` write batch (from 0) sender rank `sender` issues fails with `status`.
    FailBatch {
        /// The sender rank.
        sender: usize,
        /// Which of its batches.
        nth: u64,
        /// The failure reported.
        status: TransferStatus,
    },
    /// The connection of sender rank `sender` dies at `at` (from the origin); both sides are
    /// told.
    KillLink {
        /// The sender rank.
        sender: usize,
        /// When.
        at: Duration,
    },
    /// The connection of sender rank `sender` dies silently at `at`: nobody is told, frames
    /// vanish and writes stall until an endpoint's deadline closes it.
    BreakLink {
        /// The sender rank.
        sender: usize,
        /// When.
        at: Duration,
    },
}

/// Something scheduled at a point of virtual time.
#[derive(Clone, Debug)]
enum Action {
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
        bytes: bytes::Bytes,
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

#[derive(Debug)]
struct Scheduled {
    at: Instant,
    seq: u64,
    action: Action,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed, so the max-heap pops the earliest (then first scheduled) action.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// The connection between one sender rank and the receiver.
#[derive(Clone, Debug)]
struct Link {
    up: bool,
    /// Died silently: frames vanish and writes stall until an endpoint closes it.
    broken: bool,
    epoch: u64,
    base_latency: u64,
    /// Delivery time of the last frame each way (a connection delivers in order).
    last_to_receiver: Instant,
    last_to_sender: Instant,
    /// Completion time of the last write batch (in order unless reordering is on).
    last_write: Instant,
}

/// A write batch the simulated transport is carrying out.
#[derive(Clone, Debug)]
struct InFlightBatch {
    request: RequestId,
    grant: GrantId,
    plan: WritePlan,
    headers: DataWriteHeaders,
    fail: Option<TransferStatus>,
    /// Issued on a connection already down: none of it can land.
    stillborn: bool,
}

/// One side's view of a request.
#[derive(Clone, Copy, Debug, Default)]
struct SideState {
    started: bool,
    /// (Sender) the engine submitted the last chunk / the aux data.
    last_chunk: bool,
    aux: bool,
    terminal: Option<Terminal>,
    quiesced: bool,
    retired: bool,
}

#[derive(Clone, Debug)]
struct RequestRecord {
    started_at: Option<Instant>,
    finished_at: Option<Instant>,
    senders: SmallVec<[SideState; 2]>,
    receiver: SideState,
    /// Per writer: a fault that must fail this writer's session and the receiver's.
    fatal: SmallVec<[bool; 2]>,
    cancel_issued: bool,
    /// A fault touched it: one of its connections died or one of its write batches failed.
    exposed: bool,
    corrupted: bool,
    verified: bool,
}

/// Counters of what the simulated network and transport did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames handed to the network.
    pub frames: u64,
    /// Frames lost once (then retransmitted).
    pub losses: u64,
    /// Frames delivered twice.
    pub duplicates: u64,
    /// Frames held for a delay spike.
    pub delays: u64,
    /// Frames dropped because their connection was down or died.
    pub dropped: u64,
    /// Write batches executed.
    pub write_batches: u64,
    /// Write batches failed by fault injection.
    pub write_failures: u64,
    /// Connections that died (injected, or too many losses).
    pub link_deaths: u64,
    /// Connections closed at an endpoint's request.
    pub closes: u64,
    /// Writes that touched a block not owned by their request (a freed or reused block).
    pub stray_writes: u64,
    /// Writes the receiver's admission refused (never applied).
    pub refused_writes: u64,
}

/// A deterministic simulation of sender ranks and a receiver (see the module doc).
pub struct Simulation {
    cfg: SimConfig,
    rng: SimRng,
    now: Instant,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    senders: Vec<Sender>,
    receiver: Receiver,
    sender_caches: Vec<ReferenceCache>,
    receiver_cache: ReferenceCache,
    slots_per_group: u32,
    links: Vec<Link>,
    plans: Vec<RequestPlan>,
    records: Vec<RequestRecord>,
    index: HashMap<RequestId, usize>,
    next_admit: usize,
    active: usize,
    batches: BTreeMap<(usize, WriteBatchId), InFlightBatch>,
    batches_issued: Vec<u64>,
    script: Vec<ScriptedFault>,
    net: NetCounters,
    anomalies: Vec<String>,
    trace: Vec<String>,
    outputs_this_step: u64,
    livelocked: bool,
    steps: u64,
    max_steps: u64,
    last_start: Instant,
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
        };
        let plans = random_workload(&mut rng, count, &shape);
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
        let sender_caches: Vec<ReferenceCache> = (0..senders)
            .map(|r| {
                ReferenceCache::new(&cfg.cache_spec(Some(r), max_prompt))
                    .expect("the simulated model is valid")
            })
            .collect();
        let receiver_spec = cfg.cache_spec(None, max_prompt);
        let receiver_cache =
            ReferenceCache::new(&receiver_spec).expect("the simulated model is valid");
        let topology = |rank: usize, size: usize| Topology {
            tp_size: size as u16,
            tp_rank: rank as u16,
            pp_size: 1,
            pp_rank: 0,
            layer_begin: 0,
            layer_end: 3,
        };
        let sender_endpoints = (0..senders)
            .map(|r| {
                let mut c = SenderConfig::new(LocalHello::new(
                    InstanceId(10 + r as u64),
                    topology(r, senders),
                    sender_caches[r].layouts(),
                ));
                c.deadlines = cfg.deadlines;
                Sender::new(c).expect("the simulator's endpoint configurations are supported")
            })
            .collect();
        let mut rc = ReceiverConfig::new(
            LocalHello::new(InstanceId(1), topology(0, 1), receiver_cache.layouts()),
            cfg.seed ^ 0x5eed,
        );
        rc.deadlines = cfg.deadlines;
        let mut rng = SimRng::new(cfg.seed).fork(2);
        let links = (0..senders)
            .map(|_| Link {
                up: false,
                broken: false,
                epoch: 0,
                base_latency: if cfg.faults.contains(FaultKind::Latency) {
                    rng.range(20_000, 2_000_000)
                } else {
                    5_000
                },
                last_to_receiver: Instant::ZERO,
                last_to_sender: Instant::ZERO,
                last_write: Instant::ZERO,
            })
            .collect();
        let mut plans = plans;
        plans.sort_by_key(|p| p.arrival);
        let index: HashMap<RequestId, usize> =
            plans.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
        let records = plans
            .iter()
            .map(|p| RequestRecord {
                started_at: None,
                finished_at: None,
                senders: p.writers.iter().map(|_| SideState::default()).collect(),
                receiver: SideState::default(),
                fatal: p.writers.iter().map(|_| false).collect(),
                cancel_issued: false,
                exposed: false,
                corrupted: false,
                verified: false,
            })
            .collect();
        let max_steps = if cfg.max_steps == 0 {
            2_000 * plans.len() as u64 + 1_000_000
        } else {
            cfg.max_steps
        };
        let mut sim = Simulation {
            slots_per_group: receiver_spec.slots_per_group,
            rng,
            now: Instant::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            senders: sender_endpoints,
            receiver: Receiver::new(rc)
                .expect("the simulator's endpoint configurations are supported"),
            sender_caches,
            receiver_cache,
            links,
            plans,
            records,
            index,
            next_admit: 0,
            active: 0,
            batches: BTreeMap::new(),
            batches_issued: vec![0; senders],
            script,
            net: NetCounters::default(),
            anomalies: Vec::new(),
            trace: Vec::new(),
            outputs_this_step: 0,
            livelocked: false,
            steps: 0,
            max_steps,
            last_start: Instant::ZERO,
            cfg,
        };
        for link in 0..senders {
            sim.schedule(Instant::ZERO, Action::Reconnect { link });
        }
        let kills: Vec<(usize, Duration, bool)> = sim
            .script
            .iter()
            .filter_map(|f| match *f {
                ScriptedFault::KillLink { sender, at } => Some((sender, at, false)),
                ScriptedFault::BreakLink { sender, at } => Some((sender, at, true)),
                ScriptedFault::FailBatch { .. } => None,
            })
            .collect();
        for (link, at, silent) in kills {
            sim.schedule(
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
        self.now
    }

    /// The readable trace (empty unless [`SimConfig::trace`] is on).
    pub fn trace(&self) -> &[String] {
        &self.trace
    }

    /// Usage errors and other surprises the engine side met (each one a bug somewhere).
    pub fn anomalies(&self) -> &[String] {
        &self.anomalies
    }

    /// What the network and transport did.
    pub fn net_counters(&self) -> &NetCounters {
        &self.net
    }

    /// The sender endpoint of rank `rank`.
    pub fn sender(&self, rank: usize) -> &Sender {
        &self.senders[rank]
    }

    /// The receiver endpoint.
    pub fn receiver(&self) -> &Receiver {
        &self.receiver
    }

    /// Whether every request was admitted and finished (retired on every side).
    pub fn finished(&self) -> bool {
        self.next_admit == self.plans.len() && self.active == 0
    }

    // ----- driving -----

    /// Runs until every request finished, or the step or time bound is reached (unfinished
    /// requests then count as hung), and reports.
    pub fn run(&mut self) -> SimReport {
        while !self.finished() {
            if self.steps >= self.max_steps
                || self.livelocked
                || self.now > self.last_start + self.cfg.time_limit
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
        consider(self.queue.peek().map(|s| s.at), Next::Action);
        for r in 0..self.senders.len() {
            consider(self.senders[r].poll_timeout(), Next::SenderTimer(r));
        }
        consider(self.receiver.poll_timeout(), Next::ReceiverTimer);
        if self.active < self.cfg.max_active && self.next_admit < self.plans.len() {
            let arrival = Instant::ZERO + self.plans[self.next_admit].arrival;
            consider(Some(arrival.max(self.now)), Next::Arrival);
        }
        let Some((at, next)) = best else {
            return false;
        };
        self.now = self.now.max(at);
        self.steps += 1;
        self.outputs_this_step = 0;
        let now = self.now;
        match next {
            Next::Action => {
                let s = self.queue.pop().expect("peeked");
                self.perform(s.action);
            }
            Next::SenderTimer(r) => {
                let res = self.senders[r].handle_input(SenderInput::Transport {
                    now,
                    input: TransportInput::Timeout,
                });
                self.check(res, || format!("S{r} timeout"));
                self.drain();
            }
            Next::ReceiverTimer => {
                let res = self.receiver.handle_input(ReceiverInput::Transport {
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

    fn schedule(&mut self, at: Instant, action: Action) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            action,
        });
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if self.cfg.trace {
            let t = self.now.as_nanos();
            let text = line();
            self.trace.push(format!(
                "{:>5}.{:03}ms {text}",
                t / 1_000_000,
                (t / 1_000) % 1_000
            ));
        }
    }

    fn check<E: std::fmt::Display>(&mut self, res: Result<(), E>, what: impl FnOnce() -> String) {
        if let Err(e) = res {
            let line = format!("{}: {e}", what());
            self.note(|| format!("ANOMALY {line}"));
            self.anomalies.push(line);
        }
    }

    fn admit(&mut self) {
        let i = self.next_admit;
        self.next_admit += 1;
        self.active += 1;
        let now = self.now;
        self.last_start = now;
        self.records[i].started_at = Some(now);
        let plan = self.plans[i].clone();
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
        self.schedule(now + plan.open_after, Action::Open(i));
        self.schedule(now + plan.register_after, Action::Register(i));
        if let Some((after, side)) = plan.cancel {
            self.schedule(now + after, Action::Cancel(i, side));
        }
        if self.cfg.faults.contains(FaultKind::PeerDeath)
            && self.rng.chance(self.cfg.rates.peer_death)
        {
            let link = *self.rng.pick(&plan.writers).expect("a writer");
            let span = plan.per_token.as_nanos() * u64::from(plan.prompt_len) + 1_000_000;
            let at = now + Duration::from_nanos(self.rng.below(span));
            let silent = self.rng.chance(0.5);
            self.schedule(
                at,
                Action::KillLink {
                    link,
                    injected: true,
                    silent,
                },
            );
        }
    }

    fn perform(&mut self, action: Action) {
        let now = self.now;
        match action {
            Action::Open(i) => self.open(i),
            Action::Register(i) => self.register(i),
            Action::Compute(i, k) => self.compute(i, k),
            Action::Aux(i) => {
                // Every writer rank sends the request's aux data.
                let request = self.plans[i].id;
                for w in 0..self.plans[i].writers.len() {
                    let rank = self.plans[i].writers[w];
                    if self.records[i].senders[w].terminal.is_some() {
                        // An engine that learns of the end late still submits: refused,
                        // nothing changes.
                        if self.rng.chance(0.3) {
                            let res = self.senders[rank].handle_input(SenderInput::Aux {
                                now,
                                request,
                                data: AuxData::default(),
                            });
                            self.expect_ended(res, rank, request);
                        }
                        continue;
                    }
                    let data = AuxData {
                        prompt_tokens: self.plans[i].prompt_len,
                        cached_tokens: self.plans[i].sender_prefix,
                        first_tokens: vec![(request.0 % 50_000) as u32],
                        draft_tokens: vec![],
                    };
                    self.note(|| format!("engine S{rank} aux {request}"));
                    let res =
                        self.senders[rank].handle_input(SenderInput::Aux { now, request, data });
                    self.records[i].senders[w].aux |= res.is_ok();
                    self.check(res, || format!("S{rank} aux {request}"));
                    self.drain();
                }
            }
            Action::Cancel(i, side) => self.cancel(i, side),
            Action::Retire(i, from) => self.retire(i, from),
            Action::Deliver {
                link,
                to_receiver,
                epoch,
                bytes,
            } => {
                if !self.links[link].up || self.links[link].epoch != epoch {
                    self.net.dropped += 1;
                    return;
                }
                let res = if to_receiver {
                    self.receiver.handle_transport(
                        now,
                        TransportInput::FrameReceived {
                            peer: sender_peer(link),
                            bytes,
                        },
                    )
                } else {
                    self.senders[link].handle_transport(
                        now,
                        TransportInput::FrameReceived {
                            peer: RECEIVER_PEER,
                            bytes,
                        },
                    )
                };
                self.check(res, || format!("deliver on link {link}"));
                self.drain();
            }
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
            Action::Reconnect { link } => {
                let l = &mut self.links[link];
                if l.up {
                    return;
                }
                l.up = true;
                l.broken = false;
                l.epoch += 1;
                l.last_to_receiver = now;
                l.last_to_sender = now;
                l.last_write = now;
                self.note(|| format!("link S{link} connected"));
                let res = self.senders[link].handle_input(SenderInput::Transport {
                    now,
                    input: TransportInput::PeerConnected {
                        peer: RECEIVER_PEER,
                    },
                });
                self.check(res, || format!("S{link} connect"));
                let res = self.receiver.handle_input(ReceiverInput::Transport {
                    now,
                    input: TransportInput::PeerConnected {
                        peer: sender_peer(link),
                    },
                });
                self.check(res, || format!("R connect S{link}"));
                self.drain();
            }
        }
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

    fn open(&mut self, i: usize) {
        let now = self.now;
        let plan = self.plans[i].clone();
        for (w, &rank) in plan.writers.iter().enumerate() {
            let res = self.sender_caches[rank].begin_prefill(
                plan.id,
                plan.prompt_len,
                plan.sender_prefix,
                plan.allocation,
            );
            self.check(res, || format!("S{rank} cache begin {}", plan.id));
            self.records[i].senders[w].started = true;
            self.note(|| format!("engine S{rank} open {}", plan.id));
            let res = self.senders[rank].open_request(
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
        let at = now + self.compute_time(i, 0);
        self.schedule(at, Action::Compute(i, 0));
    }

    fn compute(&mut self, i: usize, k: usize) {
        let now = self.now;
        let spec = self.chunk_spec(i, k);
        let request = self.plans[i].id;
        let writers = self.plans[i].writers.clone();
        let mut any = false;
        for (w, &rank) in writers.iter().enumerate() {
            if self.records[i].senders[w].terminal.is_some() {
                // An engine that learns of the end late still submits: refused, nothing
                // changes.
                if self.rng.chance(0.3) {
                    let res = self.senders[rank]
                        .submit_chunk(now, request, spec, &mut self.sender_caches[rank])
                        .map(|_| ());
                    self.expect_ended(res, rank, request);
                    self.drain();
                }
                continue;
            }
            any = true;
            let res = self.sender_caches[rank].compute_chunk(request, spec.start, spec.end);
            self.check(res, || format!("S{rank} cache compute {request}"));
            self.note(|| {
                format!(
                    "engine S{rank} chunk {request} [{}, {}){}",
                    spec.start,
                    spec.end,
                    if spec.is_last { " last" } else { "" }
                )
            });
            let res = self.senders[rank]
                .submit_chunk(now, request, spec, &mut self.sender_caches[rank])
                .map(|_| ());
            if res.is_ok() && spec.is_last {
                self.records[i].senders[w].last_chunk = true;
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
            let at = now + self.plans[i].aux_after;
            self.schedule(at, Action::Aux(i));
        } else {
            let at = now + self.compute_time(i, k + 1);
            self.schedule(at, Action::Compute(i, k + 1));
        }
    }

    /// A call on a request that already ended must be refused as ended (or retired).
    fn expect_ended(&mut self, res: Result<(), UsageError>, rank: usize, request: RequestId) {
        match res {
            Err(UsageError::SessionEnded(r) | UsageError::Retired(r)) if r == request => {}
            other => {
                let line = format!("S{rank} call on ended {request} gave {other:?}");
                self.note(|| format!("ANOMALY {line}"));
                self.anomalies.push(line);
            }
        }
    }

    fn register(&mut self, i: usize) {
        let now = self.now;
        let plan = self.plans[i].clone();
        let groups = match self.receiver_cache.register_destination(
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
        self.records[i].receiver.started = true;
        self.note(|| format!("engine R register {}", plan.id));
        let res = self
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

    fn cancel(&mut self, i: usize, side: CancelSide) {
        let now = self.now;
        let request = self.plans[i].id;
        match side {
            CancelSide::Sender => {
                let writers = self.plans[i].writers.clone();
                // Usually every writer rank's engine cancels; sometimes only one of them.
                let only = (writers.len() > 1 && self.rng.chance(0.4))
                    .then(|| self.rng.below(writers.len() as u64) as usize);
                for (w, &rank) in writers.iter().enumerate() {
                    if self.records[i].senders[w].retired || only.is_some_and(|o| o != w) {
                        continue;
                    }
                    self.records[i].cancel_issued = true;
                    self.note(|| format!("engine S{rank} cancel {request}"));
                    let res = self.senders[rank].cancel(now, request);
                    self.check(res, || format!("S{rank} cancel {request}"));
                    self.drain();
                }
            }
            CancelSide::Receiver => {
                if self.records[i].receiver.retired {
                    return;
                }
                self.records[i].cancel_issued = true;
                self.note(|| format!("engine R cancel {request}"));
                let res = self.receiver.cancel(now, request);
                self.check(res, || format!("R cancel {request}"));
                self.drain();
            }
        }
    }

    /// Drains every endpoint's outputs until none has any left, carrying each one out.
    ///
    /// An endpoint whose outputs never run dry within one step is a livelock: the run stops
    /// (unfinished requests then count as hung) and the anomaly is recorded.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            for r in 0..self.senders.len() {
                while let Some(o) = self.senders[r].poll_output() {
                    any = true;
                    if self.count_output() {
                        return;
                    }
                    self.on_output(Some(r), o);
                }
            }
            while let Some(o) = self.receiver.poll_output() {
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
        const MAX_OUTPUTS_PER_STEP: u64 = 1_000_000;
        self.outputs_this_step += 1;
        if self.outputs_this_step > MAX_OUTPUTS_PER_STEP {
            if !self.livelocked {
                self.livelocked = true;
                self.anomalies.push(format!(
                    "livelock at {}: outputs never ran dry within one step",
                    self.now
                ));
            }
            return true;
        }
        false
    }

    fn on_output(&mut self, from: Option<usize>, output: Output) {
        let who = who(from);
        match output {
            Output::Transmit { peer, frame, bytes } => {
                let link = match from {
                    Some(r) => r,
                    None => peer.0 as usize,
                };
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
                let link = match from {
                    Some(r) => r,
                    None => peer.0 as usize,
                };
                self.net.closes += 1;
                self.note(|| format!("{who} close link S{link}: {reason:?}"));
                self.kill_link(link, false, "closed");
            }
            Output::Event(event) => self.on_event(from, event),
        }
    }

    fn send_frame(&mut self, link: usize, to_receiver: bool, frame: Frame, bytes: bytes::Bytes) {
        self.net.frames += 1;
        // Every frame crosses the wire as the bytes the endpoint encoded: they must decode to
        // the frame it meant.
        match Frame::parse(&bytes) {
            Ok((decoded, n)) if decoded == frame && n == bytes.len() => {}
            other => {
                let line = format!(
                    "frame {} does not cross the wire: {other:?}",
                    frame_summary(&frame)
                );
                self.note(|| format!("ANOMALY {line}"));
                self.anomalies.push(line);
                return;
            }
        }
        if !self.links[link].up || self.links[link].broken {
            self.net.dropped += 1;
            return;
        }
        let faults = self.cfg.faults;
        let rates = self.cfg.rates;
        let base = self.links[link].base_latency;
        let mut delay = if faults.contains(FaultKind::Latency) {
            base + self.rng.below(base / 2 + 1)
        } else {
            base
        };
        if faults.contains(FaultKind::Reordering) {
            // Connections overtake each other: a jitter larger than the base latency.
            delay += self.rng.below(3 * base + 200_000);
        }
        let mut at = self.now + Duration::from_nanos(delay);
        if faults.contains(FaultKind::Loss) && self.rng.chance(rates.loss) {
            let mut losses = 0;
            loop {
                losses += 1;
                self.net.losses += 1;
                at += Duration::from_millis(3);
                if losses >= rates.loss_reset_after {
                    // The stream gives up: the connection resets.
                    self.note(|| format!("link S{link} lost a frame {losses} times"));
                    self.schedule(
                        at,
                        Action::KillLink {
                            link,
                            injected: true,
                            silent: false,
                        },
                    );
                    return;
                }
                if !self.rng.chance(rates.loss_retry) {
                    break;
                }
            }
        }
        if faults.contains(FaultKind::Delay) && self.rng.chance(rates.delay) {
            self.net.delays += 1;
            at += Duration::from_nanos(self.rng.range(10_000_000, 450_000_000));
        }
        let l = &mut self.links[link];
        let last = if to_receiver {
            &mut l.last_to_receiver
        } else {
            &mut l.last_to_sender
        };
        at = at.max(*last);
        *last = at;
        let epoch = l.epoch;
        let dup = faults.contains(FaultKind::Duplication) && self.rng.chance(rates.duplication);
        if dup {
            self.net.duplicates += 1;
            self.schedule(
                at,
                Action::Deliver {
                    link,
                    to_receiver,
                    epoch,
                    bytes: bytes.clone(),
                },
            );
        }
        self.schedule(
            at,
            Action::Deliver {
                link,
                to_receiver,
                epoch,
                bytes,
            },
        );
    }

    fn issue_batch(
        &mut self,
        rank: usize,
        batch: WriteBatchId,
        request: RequestId,
        grant: GrantId,
        plan: WritePlan,
        headers: DataWriteHeaders,
    ) {
        let nth = self.batches_issued[rank];
        self.batches_issued[rank] += 1;
        self.net.write_batches += 1;
        let scripted = self.script.iter().find_map(|f| match *f {
            ScriptedFault::FailBatch {
                sender,
                nth: n,
                status,
            } if sender == rank && n == nth => Some(status),
            _ => None,
        });
        let fail = scripted.or_else(|| {
            (self.cfg.faults.contains(FaultKind::WriteFailure)
                && self.rng.chance(self.cfg.rates.write_failure))
            .then(|| {
                if self.rng.chance(0.8) {
                    TransferStatus::WriteFailed
                } else {
                    TransferStatus::GrantViolation
                }
            })
        });
        let mut latency = 20_000 + plan.total_bytes() / 10;
        let l = &self.links[rank];
        let mut at;
        if self.cfg.faults.contains(FaultKind::Reordering) {
            latency += self.rng.below(500_000);
            at = self.now + Duration::from_nanos(latency);
        } else {
            at = self.now + Duration::from_nanos(latency);
            at = at.max(l.last_write);
        }
        if !l.up {
            // The transport cannot start it: reported failed at once.
            at = self.now;
        }
        self.links[rank].last_write = self.links[rank].last_write.max(at);
        let stillborn = !self.links[rank].up;
        let fail = if stillborn {
            Some(TransferStatus::PeerLost)
        } else {
            fail
        };
        self.batches.insert(
            (rank, batch),
            InFlightBatch {
                request,
                grant,
                plan,
                headers,
                fail,
                stillborn,
            },
        );
        self.schedule(
            at,
            Action::WriteDone {
                sender: rank,
                batch,
            },
        );
        if self.links[rank].broken {
            // It stalls on the silently dead connection: the writer cannot complete.
            self.mark_fatal(rank, request);
        }
    }

    fn write_done(&mut self, rank: usize, batch: WriteBatchId) {
        let now = self.now;
        if self.links[rank].broken
            && self
                .batches
                .get(&(rank, batch))
                .is_some_and(|b| !b.stillborn)
        {
            // The connection died silently: the batch stalls until the connection is closed.
            return;
        }
        let Some(b) = self.batches.remove(&(rank, batch)) else {
            // Dropped with its connection.
            return;
        };
        let input = match b.fail {
            None => {
                self.apply(rank, &b, b.plan.len());
                self.note(|| format!("S{rank} {batch} completed"));
                SenderInput::Transport {
                    now,
                    input: TransportInput::WritesCompleted { batch },
                }
            }
            Some(status) => {
                let part = self.rng.below(b.plan.len() as u64 + 1) as usize;
                if !b.stillborn {
                    self.apply(rank, &b, part);
                    self.net.write_failures += 1;
                    self.mark_fatal(rank, b.request);
                    if let Some(&i) = self.index.get(&b.request) {
                        self.records[i].exposed = true;
                    }
                }
                self.note(|| format!("S{rank} {batch} failed: {status:?}"));
                SenderInput::Transport {
                    now,
                    input: TransportInput::WritesFailed { batch, status },
                }
            }
        };
        let res = self.senders[rank].handle_input(input);
        self.check(res, || format!("S{rank} report {batch}"));
        self.drain();
    }

    /// Marks every started, unfinished request written by sender rank `link` as touched by a
    /// fault of that connection.
    fn expose_link(&mut self, link: usize) {
        for (i, r) in self.records.iter_mut().enumerate() {
            if r.started_at.is_some()
                && r.finished_at.is_none()
                && self.plans[i].writers.contains(&link)
            {
                r.exposed = true;
            }
        }
    }

    /// Marks `request`'s writer `rank` as hit by a fatal fault if its session is still active.
    fn mark_fatal(&mut self, rank: usize, request: RequestId) {
        let active = self.senders[rank]
            .phase(request)
            .is_some_and(|p| p.is_active());
        if !active {
            return;
        }
        if let Some(&i) = self.index.get(&request) {
            if let Some(w) = self.plans[i].writers.iter().position(|&r| r == rank) {
                self.records[i].fatal[w] = true;
            }
        }
    }

    /// Lands the first `extents` extents of `b` as the receiving transport would: each is
    /// admitted by the receiver, copied from sender `rank`'s memory to the receiver's, and
    /// reported landed. The oracle checks that every block an admitted write touched still
    /// belongs to the request.
    fn apply(&mut self, rank: usize, b: &InFlightBatch, extents: usize) {
        let now = self.now;
        let grant_ok = self.receiver.grant(b.request) == Some(b.grant);
        let mut stray: Vec<Option<RequestId>> = Vec::new();
        for e in &b.plan.extents()[..extents] {
            let header = b.headers.encode(e.dst_region, e.dst_offset, e.len);
            let ticket = match self.receiver.admit_write(now, sender_peer(rank), &header) {
                Admission::Apply { ticket, .. } => ticket,
                Admission::Discard { .. } => continue,
                Admission::Refuse(reason) => {
                    self.net.refused_writes += 1;
                    self.note(|| format!("S{rank} write refused: {reason}"));
                    break;
                }
            };
            if !grant_ok {
                stray.push(None);
            }
            for (cache, region, offset) in [
                (&self.sender_caches[rank], e.src_region, e.src_offset),
                (&self.receiver_cache, e.dst_region, e.dst_offset),
            ] {
                if let Some(other) = foreign_owner(cache, region, offset, e.len, b.request) {
                    stray.push(other);
                }
            }
            let src = self.sender_caches[rank]
                .region(e.src_region)
                .and_then(|m| m.get(e.src_offset as usize..(e.src_offset + e.len) as usize));
            let dst = self
                .receiver_cache
                .region_mut(e.dst_region)
                .and_then(|m| m.get_mut(e.dst_offset as usize..(e.dst_offset + e.len) as usize));
            match (src, dst) {
                (Some(s), Some(d)) => {
                    d.copy_from_slice(s);
                    if self.cfg.planted_bug == Some(PlantedBug::FlipByte(b.request)) {
                        d[0] ^= 0x5a;
                    }
                }
                _ => stray.push(None),
            }
            let res = self.receiver.handle_transport(
                now,
                TransportInput::WriteFinished {
                    ticket,
                    landed: true,
                },
            );
            self.check(res, || format!("S{rank} write landed"));
        }
        if !stray.is_empty() {
            self.net.stray_writes += stray.len() as u64;
            let request = b.request;
            self.note(|| format!("STRAY write of {request} ({} extents)", stray.len()));
            self.anomalies.push(format!(
                "stray write of {request} at {}: {} extents outside its blocks or grant",
                self.now,
                stray.len()
            ));
            for r in std::iter::once(Some(request)).chain(stray) {
                if let Some(i) = r.and_then(|r| self.index.get(&r).copied()) {
                    self.records[i].corrupted = true;
                }
            }
        }
    }

    fn kill_link(&mut self, link: usize, injected: bool, how: &str) {
        let now = self.now;
        if !self.links[link].up {
            return;
        }
        self.links[link].up = false;
        self.links[link].broken = false;
        self.links[link].epoch += 1;
        self.expose_link(link);
        self.net.link_deaths += u64::from(injected);
        self.note(|| format!("link S{link} {how}"));
        // Writes in flight either landed before the death or never will.
        let dying: Vec<(usize, WriteBatchId)> = self
            .batches
            .keys()
            .filter(|(r, _)| *r == link)
            .copied()
            .collect();
        for key in dying {
            let b = self.batches.remove(&key).expect("listed");
            let part = self.rng.below(b.plan.len() as u64 + 1) as usize;
            if !b.stillborn {
                self.apply(link, &b, part);
            }
        }
        // One side learns at once, the other a little later.
        let receiver_first = self.rng.chance(0.5);
        let later = now + Duration::from_nanos(self.rng.below(2_000_000));
        self.schedule(
            later,
            Action::NotifyDown {
                link,
                to_receiver: !receiver_first,
                injected,
            },
        );
        let back = later + Duration::from_nanos(self.rng.range(5_000_000, 50_000_000));
        self.schedule(back, Action::Reconnect { link });
        self.notify_down(link, receiver_first, injected);
    }

    /// Tells one side that the connection of sender rank `link` is gone.
    ///
    /// An injected death is fatal for every request whose session on that sender rank is still
    /// active when the sender learns of it (a session that completed before, having handed its
    /// last frames to the dying connection, is the protocol's inherent race, not a fault it
    /// could act on).
    fn notify_down(&mut self, link: usize, to_receiver: bool, injected: bool) {
        let now = self.now;
        // Requests that started while the death was not yet noticed are touched by it too.
        self.expose_link(link);
        if injected && !to_receiver {
            let requests: Vec<RequestId> = self
                .records
                .iter()
                .enumerate()
                .filter(|(i, r)| {
                    r.started_at.is_some()
                        && r.finished_at.is_none()
                        && self.plans[*i].writers.contains(&link)
                })
                .map(|(i, _)| self.plans[i].id)
                .collect();
            for request in requests {
                self.mark_fatal(link, request);
            }
        }
        self.note(|| {
            format!(
                "{} learns link S{link} is down",
                if to_receiver { "R" } else { "S" }
            )
        });
        let res = if to_receiver {
            self.receiver.handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: sender_peer(link),
                },
            })
        } else {
            self.senders[link].handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: RECEIVER_PEER,
                },
            })
        };
        self.check(res, || format!("link S{link} down"));
        self.drain();
    }

    /// The connection of sender rank `link` dies silently: nobody is told; frames vanish and
    /// writes stall until an endpoint's deadline closes it.
    fn break_link(&mut self, link: usize, injected: bool) {
        let l = &mut self.links[link];
        if !l.up || l.broken {
            return;
        }
        l.broken = true;
        l.epoch += 1;
        self.expose_link(link);
        self.net.link_deaths += u64::from(injected);
        self.note(|| format!("link S{link} died silently"));
        // A writer with a batch stalled on it can complete neither side.
        let stalled: Vec<RequestId> = self
            .batches
            .iter()
            .filter(|((r, _), _)| *r == link)
            .map(|(_, b)| b.request)
            .collect();
        for request in stalled {
            self.mark_fatal(link, request);
        }
    }

    fn on_event(&mut self, from: Option<usize>, event: Event) {
        let who = who(from);
        let (request, terminal) = match &event {
            Event::Completed { request, .. } => (*request, Some(Terminal::Completed)),
            Event::Failed { request, .. } => (*request, Some(Terminal::Failed)),
            Event::TimedOut { request, .. } => (*request, Some(Terminal::TimedOut)),
            Event::Cancelled { request, .. } => (*request, Some(Terminal::Cancelled)),
            Event::Quiesced { request } => (*request, None),
            other => {
                let text = event_summary(other);
                self.note(|| format!("{who} event {text}"));
                return;
            }
        };
        let text = event_summary(&event);
        self.note(|| format!("{who} event {text}"));
        let Some(&i) = self.index.get(&request) else {
            self.anomalies
                .push(format!("{who} event for unknown {request}"));
            return;
        };
        let side = match from {
            Some(rank) => match self.plans[i].writers.iter().position(|&r| r == rank) {
                Some(w) => &mut self.records[i].senders[w],
                None => {
                    self.anomalies.push(format!(
                        "{who} event for {request}, which it does not write"
                    ));
                    return;
                }
            },
            None => &mut self.records[i].receiver,
        };
        if let Some(t) = terminal {
            if side.terminal.is_some() {
                self.anomalies
                    .push(format!("{who} second terminal event {text}"));
            } else {
                side.terminal = Some(t);
            }
            if let (Some(rank), Terminal::Completed) = (from, t) {
                // A writer completes only after its last chunk (and its aux data), with none of
                // its write batches still in flight.
                let w = self.plans[i].writers.iter().position(|&r| r == rank);
                let s = w.map(|w| self.records[i].senders[w]).unwrap_or_default();
                let in_flight = self
                    .batches
                    .iter()
                    .any(|((r, _), b)| *r == rank && b.request == request);
                if !s.last_chunk || !s.aux || in_flight {
                    self.anomalies.push(format!(
                        "{who} completed {request} early: last chunk {}, aux {}, writes in \
                         flight {in_flight}",
                        s.last_chunk, s.aux
                    ));
                }
            }
            if from.is_none() && t == Terminal::Completed {
                self.records[i].verified = true;
                let bad = self.receiver_cache.verify(request);
                if !bad.is_empty() {
                    let first = bad[0];
                    self.note(|| format!("CORRUPTED {request}: {first:?}"));
                    self.records[i].corrupted = true;
                }
            }
            return;
        }
        // Quiesced: no write can touch the blocks any more; free them and retire.
        if side.quiesced || side.terminal.is_none() {
            self.anomalies.push(format!(
                "{who} Quiesced for {request} twice or before its terminal event"
            ));
        }
        side.quiesced = true;
        match from {
            Some(_) if self.cfg.planted_bug == Some(PlantedBug::KeepBlocks(request)) => {}
            Some(rank) => self.sender_caches[rank].release(request),
            None => self.receiver_cache.release(request),
        }
        // The engine retires at once, or a little later (late frames then meet a quiesced
        // session).
        if self.rng.chance(0.5) {
            self.retire(i, from);
        } else {
            let at = self.now + Duration::from_nanos(self.rng.below(3_000_000));
            self.schedule(at, Action::Retire(i, from));
        }
    }

    fn retire(&mut self, i: usize, from: Option<usize>) {
        let now = self.now;
        let request = self.plans[i].id;
        let who = who(from);
        let res = match from {
            Some(rank) => {
                let w = self.plans[i]
                    .writers
                    .iter()
                    .position(|&r| r == rank)
                    .expect("a writer");
                self.records[i].senders[w].retired = true;
                self.senders[rank].retire(now, request)
            }
            None => {
                self.records[i].receiver.retired = true;
                self.receiver.retire(now, request)
            }
        };
        self.note(|| format!("engine {who} retire {request}"));
        self.check(res, || format!("{who} retire {request}"));
        let r = &self.records[i];
        if r.finished_at.is_none() && r.receiver.retired && r.senders.iter().all(|s| s.retired) {
            self.records[i].finished_at = Some(now);
            self.active -= 1;
            self.note(|| format!("engine finished {request}"));
        }
    }

    // ----- the end -----

    fn report(&mut self) -> SimReport {
        let mut report = SimReport {
            requests: self.plans.len() as u64,
            virtual_ms: self.now.as_nanos() / 1_000_000,
            steps: self.steps,
            ..SimReport::default()
        };
        let mut outcomes = Vec::with_capacity(self.plans.len());
        for (i, plan) in self.plans.iter().enumerate() {
            let rec = &self.records[i];
            let request = plan.id;
            let sides_done = rec.finished_at.is_some();
            let mut leak = Vec::new();
            if sides_done {
                if self.batches.values().any(|b| b.request == request) {
                    leak.push("a write batch never reported");
                }
                for &rank in &plan.writers {
                    if self.sender_caches[rank].computed_tokens(request).is_some() {
                        leak.push("sender blocks not freed");
                    }
                    if self.senders[rank].phase(request)
                        != Some(kvpipe_core::session::state::SendPhase::Retired)
                    {
                        leak.push("sender session not retired");
                    }
                }
                if self.receiver_cache.computed_tokens(request).is_some() {
                    leak.push("receiver blocks not freed");
                }
                if self.receiver.phase(request)
                    != Some(kvpipe_core::session::state::RecvPhase::Retired)
                {
                    leak.push("receiver session not retired");
                }
            }
            let all_completed = rec.receiver.terminal == Some(Terminal::Completed)
                && rec
                    .senders
                    .iter()
                    .all(|s| s.terminal == Some(Terminal::Completed));
            let any_completed = rec.receiver.terminal == Some(Terminal::Completed)
                || rec
                    .senders
                    .iter()
                    .any(|s| s.terminal == Some(Terminal::Completed));
            let outcome = if !sides_done {
                Outcome::Hung
            } else if !leak.is_empty() {
                Outcome::Leaked
            } else if rec.corrupted {
                Outcome::Corrupted
            } else if all_completed {
                Outcome::Completed
            } else if rec.cancel_issued {
                Outcome::Cancelled
            } else {
                Outcome::Failed
            };
            let one_sided = sides_done
                && rec.fatal.iter().enumerate().any(|(w, &fatal)| {
                    fatal
                        && (rec.senders[w].terminal == Some(Terminal::Completed)
                            || rec.receiver.terminal == Some(Terminal::Completed))
                });
            let fatal = rec.fatal.iter().any(|&f| f);
            match outcome {
                Outcome::Completed => report.completed += 1,
                Outcome::Failed => report.failed += 1,
                Outcome::Cancelled => report.cancelled += 1,
                Outcome::Hung => report.hung += 1,
                Outcome::Corrupted => report.corrupted += 1,
                Outcome::Leaked => report.leaked += 1,
            }
            report.one_sided += u64::from(one_sided);
            let bug = one_sided
                || matches!(
                    outcome,
                    Outcome::Hung | Outcome::Corrupted | Outcome::Leaked
                );
            if bug && report.first_bugs.len() < 10 {
                report.first_bugs.push(request.0);
            }
            report.fatal += u64::from(fatal);
            match rec.receiver.terminal {
                Some(Terminal::Failed) => report.receiver_failed += 1,
                Some(Terminal::TimedOut) => report.receiver_timed_out += 1,
                Some(Terminal::Cancelled) => report.receiver_cancelled += 1,
                Some(Terminal::Completed) | None => {}
            }
            report.split += u64::from(sides_done && any_completed && !all_completed);
            outcomes.push(RequestOutcome {
                request,
                outcome,
                one_sided,
                fatal,
                exposed: rec.exposed,
                receiver: rec.receiver.terminal,
                senders: rec.senders.iter().map(|s| s.terminal).collect(),
                leaks: leak.iter().map(|s| s.to_string()).collect(),
                duration: match (rec.started_at, rec.finished_at) {
                    (Some(a), Some(b)) => Some(b.saturating_duration_since(a)),
                    _ => None,
                },
            });
        }
        // Endpoint-wide leak check: nothing may remain once every request was retired.
        if report.hung == 0 {
            let mut left = Vec::new();
            for (r, s) in self.senders.iter().enumerate() {
                if s.session_count() != 0 {
                    left.push(format!("S{r} holds {} sessions", s.session_count()));
                }
                if s.pending_registration_count() != 0 {
                    left.push(format!(
                        "S{r} holds {} registrations of unopened requests",
                        s.pending_registration_count()
                    ));
                }
                if s.batches_in_flight() != 0 {
                    left.push(format!(
                        "S{r} has {} batches in flight",
                        s.batches_in_flight()
                    ));
                }
            }
            if self.receiver.session_count() != 0 {
                left.push(format!(
                    "R holds {} sessions",
                    self.receiver.session_count()
                ));
            }
            if !self.batches.is_empty() {
                left.push(format!(
                    "{} write batches never reported",
                    self.batches.len()
                ));
            }
            let caches = self
                .sender_caches
                .iter()
                .chain(std::iter::once(&self.receiver_cache));
            for (c, cache) in caches.enumerate() {
                for g in 0..cache.group_count() {
                    let free = cache.free_slots(GroupIndex(g as u16));
                    if free != self.slots_per_group as usize {
                        left.push(format!(
                            "cache {c} group {g}: {} slots still held",
                            self.slots_per_group as usize - free
                        ));
                    }
                }
            }
            if !left.is_empty() && report.leaked == 0 {
                report.leaked += 1;
            }
            report.leak_details = left;
        }
        report.stray_writes = self.net.stray_writes;
        report.refused_writes = self.net.refused_writes;
        report.anomalies = self.anomalies.len() as u64;
        report.first_anomalies = self.anomalies.iter().take(5).cloned().collect();
        report.frames = self.net.frames;
        report.write_batches = self.net.write_batches;
        report.write_failures = self.net.write_failures;
        report.link_deaths = self.net.link_deaths;
        report.outcomes = outcomes;
        report
    }
}

/// The request owning a byte range of `region` in `cache`, when it is not `request`
/// (`Some(None)`: the slot is free or outside the cache).
fn foreign_owner(
    cache: &ReferenceCache,
    region: RegionId,
    offset: u64,
    len: u64,
    request: RequestId,
) -> Option<Option<RequestId>> {
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let Some(loc) = cache.locate(region, at) else {
            return Some(None);
        };
        match cache.owner(loc.group, loc.slot) {
            Some((owner, _)) if owner == request => {}
            Some((owner, _)) => return Some(Some(owner)),
            None => return Some(None),
        }
        let slot_bytes = cache.layout(loc.group)?.pools[loc.pool].slot_bytes;
        at += slot_bytes - loc.offset_in_slot;
    }
    None
}

fn who(from: Option<usize>) -> String {
    match from {
        Some(r) => format!("S{r}"),
        None => "R".to_string(),
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
