//! [`MemNetwork`]: several sender and receiver endpoints in one process, every sender connected
//! to every receiver by in-memory frame queues, write batches carried out by one copy worker —
//! the core's run loop driven with real time. [`MemPair`](crate::MemPair) is its one-to-one
//! special case.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use kvpipe_core::session::{
    Admission, DataWriteHeaders, Output, TransportInput, UsageError, WriteBatchId, WriteTicket,
};
use kvpipe_core::wire::{Role, TransferStatus};
use kvpipe_core::{
    ConfigError, Event, Instant, PeerId, Receiver, ReceiverConfig, RegionId, Sender, SenderConfig,
};
use kvpipe_observe::Observer;
use thiserror::Error;

use crate::clock::Clock;
use crate::copy::ResolvedBatch;
use crate::region::{RegionTable, RegionUse, RegistrationError};
use crate::worker::{CopyWorker, Done, Job};
use kvpipe_netem::{Direction, FrameQueue, Link, Netem, NetemConfig, NetemCounters};

/// One endpoint of a network: sender `i` or receiver `j`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Node {
    /// Sender `i` (a prefill rank).
    Sender(usize),
    /// Receiver `j` (a decode rank).
    Receiver(usize),
}

/// How receivers name sender `i`.
pub fn sender_peer(i: usize) -> PeerId {
    PeerId(1 + 2 * i as u32)
}

/// How senders name receiver `j`.
pub fn receiver_peer(j: usize) -> PeerId {
    PeerId(2 + 2 * j as u32)
}

fn sender_index(peer: PeerId) -> Option<usize> {
    (peer.0 % 2 == 1).then(|| (peer.0 as usize - 1) / 2)
}

fn receiver_index(peer: PeerId) -> Option<usize> {
    (peer.0 % 2 == 0 && peer.0 > 0).then(|| (peer.0 as usize - 2) / 2)
}

/// How a [`MemNetwork`] is set up.
#[derive(Clone, Debug)]
pub struct NetworkConfig {
    /// One configuration per sender.
    pub senders: Vec<SenderConfig>,
    /// One configuration per receiver.
    pub receivers: Vec<ReceiverConfig>,
    /// Threads that copy one large write batch (the copy worker is one of them).
    pub copy_threads: usize,
    /// Batches of at least this many bytes are split over `copy_threads` threads.
    pub parallel_threshold: u64,
    /// Faults to inject (none by default), drawn by one [`Netem`] for the whole network.
    pub faults: NetemConfig,
}

impl NetworkConfig {
    /// The endpoints' configurations, copies on up to 4 threads for batches of 8 MiB or more,
    /// no faults.
    pub fn new(senders: Vec<SenderConfig>, receivers: Vec<ReceiverConfig>) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        NetworkConfig {
            senders,
            receivers,
            copy_threads: cores.clamp(1, 4),
            parallel_threshold: 8 << 20,
            faults: NetemConfig::default(),
        }
    }
}

/// What a network has carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairStats {
    /// Frames queued.
    pub frames: u64,
    /// Their encoded bytes.
    pub frame_bytes: u64,
    /// Frames addressed to a peer id no endpoint has (dropped).
    pub misaddressed: u64,
    /// Write batches executed.
    pub batches: u64,
    /// Bytes copied by write batches.
    pub bytes_copied: u64,
    /// Write batches that failed.
    pub failed_batches: u64,
}

/// Batch timings a network keeps at most ([`MemNetwork::batch_timings`]): when full, the oldest
/// half is dropped.
pub const MAX_BATCH_TIMINGS: usize = 1 << 16;

/// Appends `item` to `recent`, first dropping the oldest half when it holds `max` already:
/// amortized O(1), and never more than `max` kept.
fn keep_recent<T>(recent: &mut Vec<T>, max: usize, item: T) {
    if recent.len() >= max {
        recent.drain(..max.div_ceil(2));
    }
    recent.push(item);
}

/// When one write batch was handed to the copy worker and when its outcome was reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchTiming {
    /// The sender that issued it.
    pub sender: usize,
    /// The receiver it wrote to.
    pub receiver: usize,
    /// The batch.
    pub batch: WriteBatchId,
    /// Bytes in the batch.
    pub bytes: u64,
    /// When the sender asked for it.
    pub issued: Instant,
    /// When the copy worker began copying it.
    pub copy_started: Instant,
    /// When the copy worker finished copying it.
    pub copy_finished: Instant,
    /// When its outcome was reported to the sender.
    pub reported: Instant,
}

/// Why driving stopped.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DriveError {
    /// The transport fed an endpoint an input it refused (a driver bug).
    #[error("{node:?} refused the driver's input: {error}")]
    Usage {
        /// The endpoint.
        node: Node,
        /// Its error.
        error: UsageError,
    },
    /// No such endpoint.
    #[error("the network has no {0:?}")]
    NoSuchNode(Node),
    /// The condition did not hold before the time limit.
    #[error("nothing satisfied the wait within {waited_ms} ms")]
    Stalled {
        /// How long it waited.
        waited_ms: u64,
    },
    /// The endpoints kept producing work without time passing.
    #[error("the endpoints did not settle after {0} steps")]
    Livelock(u64),
    /// The copy worker did not report in-flight batches in time.
    #[error("{0} write batch(es) were still in flight after the wait")]
    WritesStuck(usize),
}

#[derive(Debug)]
struct LinkState {
    connected: bool,
    to_receiver: FrameQueue,
    to_sender: FrameQueue,
    /// The emulated connection (its latency and ordering).
    emulated: Link,
    in_flight: usize,
}

/// Longest the driver waits for the copy worker when a connection is torn down.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// Steps of one [`MemNetwork::pump`] before it reports a livelock.
const MAX_STEPS: u64 = 1 << 22;

/// Senders and receivers in one process (see the module doc).
///
/// Usage: register every endpoint's memory, [`connect_all`](Self::connect_all), then issue
/// engine commands through [`sender_mut`](Self::sender_mut) /
/// [`receiver_mut`](Self::receiver_mut) with [`now`](Self::now), and call
/// [`pump`](Self::pump) (non-blocking) or [`drive_until`](Self::drive_until) (bounded). Events
/// of every endpoint are collected in order ([`take_events`](Self::take_events)).
#[derive(Debug)]
pub struct MemNetwork {
    clock: Clock,
    senders: Vec<Sender>,
    receivers: Vec<Receiver>,
    sender_regions: Vec<RegionTable>,
    receiver_regions: Vec<RegionTable>,
    links: Vec<LinkState>,
    sender_alive: Vec<bool>,
    receiver_alive: Vec<bool>,
    worker: CopyWorker,
    in_flight: usize,
    reports: VecDeque<Done>,
    /// Reports held back by a stall fault, with their release time.
    held: Vec<(Instant, Done)>,
    /// Batches whose report is to be held, with how long.
    stalls: HashMap<(usize, WriteBatchId), kvpipe_core::Duration>,
    issued: HashMap<(usize, WriteBatchId), (u64, Instant)>,
    /// Timings of recent batches, in report order: at most [`MAX_BATCH_TIMINGS`] (the oldest
    /// half is dropped when full), so a long-running network does not grow with the batches it
    /// carried.
    timings: Vec<BatchTiming>,
    netem: Netem,
    events: VecDeque<(Node, Instant, Event)>,
    stats: PairStats,
    /// One observer per endpoint: spans, events and metrics of what it did.
    sender_obs: Vec<Observer>,
    receiver_obs: Vec<Observer>,
}

impl MemNetwork {
    /// A network with no memory registered and no connection yet, or the first endpoint
    /// configuration that cannot run pipelined transfer.
    pub fn new(config: NetworkConfig) -> Result<Self, ConfigError> {
        let clock = Clock::new();
        let (s, r) = (config.senders.len(), config.receivers.len());
        let senders = config
            .senders
            .into_iter()
            .map(Sender::new)
            .collect::<Result<_, _>>()?;
        let receivers = config
            .receivers
            .into_iter()
            .map(Receiver::new)
            .collect::<Result<_, _>>()?;
        let mut netem = Netem::new(config.faults);
        let links = (0..s * r)
            .map(|_| LinkState {
                connected: false,
                to_receiver: FrameQueue::default(),
                to_sender: FrameQueue::default(),
                emulated: netem.link(),
                in_flight: 0,
            })
            .collect();
        Ok(MemNetwork {
            clock,
            senders,
            receivers,
            sender_regions: (0..s).map(|_| RegionTable::new()).collect(),
            receiver_regions: (0..r).map(|_| RegionTable::new()).collect(),
            links,
            sender_alive: vec![true; s],
            receiver_alive: vec![true; r],
            worker: CopyWorker::spawn(clock, config.copy_threads, config.parallel_threshold),
            in_flight: 0,
            reports: VecDeque::new(),
            held: Vec::new(),
            stalls: HashMap::new(),
            issued: HashMap::new(),
            timings: Vec::new(),
            netem,
            events: VecDeque::new(),
            stats: PairStats::default(),
            sender_obs: (0..s).map(|_| Observer::new(Role::Sender, "mem")).collect(),
            receiver_obs: (0..r)
                .map(|_| Observer::new(Role::Receiver, "mem"))
                .collect(),
        })
    }

    fn link(&self, s: usize, r: usize) -> usize {
        s * self.receivers.len() + r
    }

    // ----- memory -----

    /// Registers host memory of `node` as region `id`.
    ///
    /// # Safety
    ///
    /// The contract of [`RegionTable::register_host`]: the memory stays valid until the region
    /// is deregistered or the network is dropped, and the engine leaves the bytes of pinned
    /// blocks alone until the sessions report [`Event::Quiesced`].
    pub unsafe fn register_host(
        &mut self,
        node: Node,
        id: RegionId,
        usage: RegionUse,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(), RegistrationError> {
        let table = self
            .regions_mut(node)
            .ok_or(RegistrationError::NotRegistered(id))?;
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { table.register_host(id, usage, ptr, len) }
    }

    /// Removes a region; refused while a write batch may still touch it.
    pub fn deregister(&mut self, node: Node, id: RegionId) -> Result<(), RegistrationError> {
        self.regions_mut(node)
            .ok_or(RegistrationError::NotRegistered(id))?
            .deregister(id)
    }

    /// The regions of `node`.
    pub fn regions(&self, node: Node) -> Option<&RegionTable> {
        match node {
            Node::Sender(i) => self.sender_regions.get(i),
            Node::Receiver(j) => self.receiver_regions.get(j),
        }
    }

    /// The regions of `node`, to register memory of another kind (e.g. device memory).
    pub fn regions_mut(&mut self, node: Node) -> Option<&mut RegionTable> {
        match node {
            Node::Sender(i) => self.sender_regions.get_mut(i),
            Node::Receiver(j) => self.receiver_regions.get_mut(j),
        }
    }

    // ----- getters -----

    /// The current time on the network's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The network's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Number of senders.
    pub fn sender_count(&self) -> usize {
        self.senders.len()
    }

    /// Number of receivers.
    pub fn receiver_count(&self) -> usize {
        self.receivers.len()
    }

    /// Sender `i`. Panics if there is none (a caller bug).
    pub fn sender(&self, i: usize) -> &Sender {
        &self.senders[i]
    }

    /// Sender `i`, for engine commands; call [`pump`](Self::pump) afterwards. Panics if there
    /// is none.
    pub fn sender_mut(&mut self, i: usize) -> &mut Sender {
        &mut self.senders[i]
    }

    /// Receiver `j`. Panics if there is none (a caller bug).
    pub fn receiver(&self, j: usize) -> &Receiver {
        &self.receivers[j]
    }

    /// Receiver `j`, for engine commands; call [`pump`](Self::pump) afterwards. Panics if
    /// there is none.
    pub fn receiver_mut(&mut self, j: usize) -> &mut Receiver {
        &mut self.receivers[j]
    }

    /// What the network carried.
    pub fn stats(&self) -> PairStats {
        self.stats
    }

    /// Faults injected so far.
    pub fn fault_counts(&self) -> NetemCounters {
        *self.netem.counters()
    }

    /// Write batches handed to the copy worker and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.in_flight
    }

    /// Issue and report times of the recent write batches, in report order: every batch since
    /// the last [`take_batch_timings`](Self::take_batch_timings) while fewer than
    /// [`MAX_BATCH_TIMINGS`] were reported, else at least the most recent half of that.
    pub fn batch_timings(&self) -> &[BatchTiming] {
        &self.timings
    }

    /// Takes the timings [`batch_timings`](Self::batch_timings) shows, leaving none.
    pub fn take_batch_timings(&mut self) -> Vec<BatchTiming> {
        std::mem::take(&mut self.timings)
    }

    /// Whether sender `s` and receiver `r` are connected.
    pub fn is_connected(&self, s: usize, r: usize) -> bool {
        s < self.senders.len() && r < self.receivers.len() && self.links[self.link(s, r)].connected
    }

    /// Whether `node` exists and is alive (not [killed](Self::kill)).
    pub fn is_alive(&self, node: Node) -> bool {
        match node {
            Node::Sender(i) => self.sender_alive.get(i).copied().unwrap_or(false),
            Node::Receiver(j) => self.receiver_alive.get(j).copied().unwrap_or(false),
        }
    }

    /// Takes the events every endpoint reported since the last call, in order, with the time
    /// each was drained.
    pub fn take_events(&mut self) -> Vec<(Node, Instant, Event)> {
        self.events.drain(..).collect()
    }

    // ----- connections -----

    /// Connects sender `s` and receiver `r` (both start their handshake).
    pub fn connect(&mut self, s: usize, r: usize) -> Result<(), DriveError> {
        if s >= self.senders.len() {
            return Err(DriveError::NoSuchNode(Node::Sender(s)));
        }
        if r >= self.receivers.len() {
            return Err(DriveError::NoSuchNode(Node::Receiver(r)));
        }
        if !self.sender_alive[s] || !self.receiver_alive[r] {
            return Ok(());
        }
        let now = self.now();
        let l = self.link(s, r);
        self.links[l].connected = true;
        self.links[l].emulated.restart(now);
        self.feed_sender(
            s,
            now,
            TransportInput::PeerConnected {
                peer: receiver_peer(r),
            },
        )?;
        self.feed_receiver(
            r,
            now,
            TransportInput::PeerConnected {
                peer: sender_peer(s),
            },
        )?;
        self.pump()
    }

    /// Connects every sender to every receiver.
    pub fn connect_all(&mut self) -> Result<(), DriveError> {
        for s in 0..self.senders.len() {
            for r in 0..self.receivers.len() {
                self.connect(s, r)?;
            }
        }
        Ok(())
    }

    /// Kills `node` as if its process died: it takes no more input, its frames vanish, and
    /// every endpoint connected to it learns the connection is lost once no write can still
    /// land.
    pub fn kill(&mut self, node: Node) -> Result<(), DriveError> {
        let links: Vec<(usize, usize)> = match node {
            Node::Sender(s) if s < self.senders.len() => {
                self.sender_alive[s] = false;
                (0..self.receivers.len()).map(|r| (s, r)).collect()
            }
            Node::Receiver(r) if r < self.receivers.len() => {
                self.receiver_alive[r] = false;
                (0..self.senders.len()).map(|s| (s, r)).collect()
            }
            _ => return Err(DriveError::NoSuchNode(node)),
        };
        for (s, r) in links {
            self.disconnect(s, r)?;
        }
        Ok(())
    }

    /// Tears the connection between sender `s` and receiver `r` down: waits (bounded) for its
    /// in-flight write batches, reports them, then reports the disconnect to both ends if alive.
    fn disconnect(&mut self, s: usize, r: usize) -> Result<(), DriveError> {
        let l = self.link(s, r);
        if !self.links[l].connected {
            return Ok(());
        }
        self.links[l].connected = false;
        self.links[l].to_receiver.clear();
        self.links[l].to_sender.clear();
        let deadline = std::time::Instant::now() + DRAIN_LIMIT;
        let pending = |net: &Self| {
            net.links[l].in_flight
                > net
                    .reports
                    .iter()
                    .chain(net.held.iter().map(|(_, d)| d))
                    .filter(|d| d.sender == s && d.receiver == r)
                    .count()
        };
        while pending(self) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.worker.done_within(left) {
                Some(done) => self.reports.push_back(done),
                None => return Err(DriveError::WritesStuck(self.links[l].in_flight)),
            }
        }
        // Tearing the connection down ends the link's stalls: the bytes have landed.
        let (released, kept): (Vec<_>, Vec<_>) = self
            .held
            .drain(..)
            .partition(|(_, d)| d.sender == s && d.receiver == r);
        self.held = kept;
        self.reports.extend(released.into_iter().map(|(_, d)| d));
        self.stalls.retain(|(sender, _), _| *sender != s);
        self.report_writes()?;
        let now = self.now();
        if self.sender_alive[s] {
            self.feed_sender(
                s,
                now,
                TransportInput::PeerDisconnected {
                    peer: receiver_peer(r),
                },
            )?;
        }
        if self.receiver_alive[r] {
            self.feed_receiver(
                r,
                now,
                TransportInput::PeerDisconnected {
                    peer: sender_peer(s),
                },
            )?;
        }
        Ok(())
    }

    // ----- the run loop -----

    /// Does everything that can be done now without blocking: reports finished write batches,
    /// fires due timers, delivers due frames and carries out the endpoints' outputs, until
    /// nothing is left.
    pub fn pump(&mut self) -> Result<(), DriveError> {
        for _ in 0..MAX_STEPS {
            let mut progressed = false;
            while let Some(done) = self.worker.try_done() {
                self.accept_report(done);
            }
            let now = self.now();
            let mut i = 0;
            while i < self.held.len() {
                if self.held[i].0 <= now {
                    let (_, done) = self.held.swap_remove(i);
                    self.reports.push_back(done);
                } else {
                    i += 1;
                }
            }
            progressed |= self.report_writes()?;
            let now = self.now();
            for s in 0..self.senders.len() {
                if self.sender_alive[s]
                    && self.senders[s].poll_timeout().is_some_and(|at| at <= now)
                {
                    self.feed_sender(s, now, TransportInput::Timeout)?;
                    progressed = true;
                }
            }
            for r in 0..self.receivers.len() {
                if self.receiver_alive[r]
                    && self.receivers[r].poll_timeout().is_some_and(|at| at <= now)
                {
                    self.feed_receiver(r, now, TransportInput::Timeout)?;
                    progressed = true;
                }
            }
            progressed |= self.deliver(now)?;
            progressed |= self.drain_outputs(now)?;
            if !progressed {
                return Ok(());
            }
        }
        Err(DriveError::Livelock(MAX_STEPS))
    }

    /// When something is due next without outside input: a timer, a delayed frame or a stalled
    /// write report.
    pub fn next_wake(&mut self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        for (s, sender) in self.senders.iter_mut().enumerate() {
            if self.sender_alive[s] {
                consider(sender.poll_timeout());
            }
        }
        for (r, receiver) in self.receivers.iter_mut().enumerate() {
            if self.receiver_alive[r] {
                consider(receiver.poll_timeout());
            }
        }
        for link in &self.links {
            consider(link.to_receiver.next_due());
            consider(link.to_sender.next_due());
        }
        for (at, _) in &self.held {
            consider(Some(*at));
        }
        next
    }

    /// Blocks until a write batch finishes, a timer, delayed frame or stalled report is due, or
    /// `max` passed — whichever comes first. Never blocks longer than `max`. While a batch
    /// touching device memory is in flight it polls for its report for up to a millisecond
    /// before it sleeps: a GPU copies a chunk in about the time a sleeping thread takes to
    /// wake.
    pub fn wait(&mut self, max: std::time::Duration) {
        let mut limit = max;
        if let Some(at) = self.next_wake() {
            limit = limit.min(self.clock.until(at));
        }
        if !self.reports.is_empty() || limit.is_zero() {
            return;
        }
        if self.in_flight > self.held.len() {
            if let Some(done) = self.worker.done_within(limit) {
                self.accept_report(done);
            }
        } else {
            std::thread::sleep(limit);
        }
    }

    /// Pumps and waits until `done(self)` holds, for at most `limit`.
    pub fn drive_until(
        &mut self,
        limit: std::time::Duration,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> Result<(), DriveError> {
        let start = std::time::Instant::now();
        loop {
            self.pump()?;
            if done(self) {
                return Ok(());
            }
            let elapsed = start.elapsed();
            if elapsed >= limit {
                return Err(DriveError::Stalled {
                    waited_ms: elapsed.as_millis() as u64,
                });
            }
            self.wait((limit - elapsed).min(std::time::Duration::from_millis(50)));
        }
    }

    // ----- internals -----

    /// Hands `input` to sender `s` (and its observer).
    fn feed_sender(
        &mut self,
        s: usize,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), DriveError> {
        self.sender_obs[s].input(now, &input);
        self.senders[s]
            .handle_transport(now, input)
            .map_err(usage(Node::Sender(s)))
    }

    /// Hands `input` to receiver `r` (and its observer).
    fn feed_receiver(
        &mut self,
        r: usize,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), DriveError> {
        self.receiver_obs[r].input(now, &input);
        self.receivers[r]
            .handle_transport(now, input)
            .map_err(usage(Node::Receiver(r)))
    }

    /// Takes a report from the copy worker: queued for the sender, or held if the batch stalls.
    fn accept_report(&mut self, done: Done) {
        match self.stalls.remove(&(done.sender, done.batch)) {
            Some(d) => self.held.push((self.clock.now() + d, done)),
            None => self.reports.push_back(done),
        }
    }

    /// Reports finished write batches to their senders.
    fn report_writes(&mut self) -> Result<bool, DriveError> {
        let mut any = false;
        while let Some(done) = self.reports.pop_front() {
            any = true;
            self.in_flight -= 1;
            let l = self.link(done.sender, done.receiver);
            self.links[l].in_flight -= 1;
            self.stats.batches += 1;
            if let Some((bytes, issued)) = self.issued.remove(&(done.sender, done.batch)) {
                keep_recent(
                    &mut self.timings,
                    MAX_BATCH_TIMINGS,
                    BatchTiming {
                        sender: done.sender,
                        receiver: done.receiver,
                        batch: done.batch,
                        bytes,
                        issued,
                        copy_started: done.started,
                        copy_finished: done.finished,
                        reported: self.clock.now(),
                    },
                );
            }
            let landed = done.status == TransferStatus::Success;
            if landed {
                self.stats.bytes_copied += done.bytes;
            } else {
                self.stats.failed_batches += 1;
            }
            let now = self.now();
            // The receiver learns the bytes landed before the sender can report them.
            self.finish_tickets(done.receiver, &done.tickets, landed)?;
            if !self.sender_alive[done.sender] {
                continue;
            }
            let input = if landed {
                TransportInput::WritesCompleted { batch: done.batch }
            } else {
                TransportInput::WritesFailed {
                    batch: done.batch,
                    status: done.status,
                }
            };
            self.feed_sender(done.sender, now, input)?;
        }
        Ok(any)
    }

    /// Delivers every frame that is due, on every link.
    fn deliver(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        let receivers = self.receivers.len();
        for l in 0..self.links.len() {
            let (s, r) = (l / receivers, l % receivers);
            while let Some(bytes) = self.links[l].to_receiver.pop_due(now) {
                any = true;
                if self.receiver_alive[r] {
                    let input = TransportInput::FrameReceived {
                        peer: sender_peer(s),
                        bytes,
                    };
                    self.feed_receiver(r, now, input)?;
                }
            }
            while let Some(bytes) = self.links[l].to_sender.pop_due(now) {
                any = true;
                if self.sender_alive[s] {
                    let input = TransportInput::FrameReceived {
                        peer: receiver_peer(r),
                        bytes,
                    };
                    self.feed_sender(s, now, input)?;
                }
            }
        }
        Ok(any)
    }

    /// Carries out every output every endpoint has queued.
    fn drain_outputs(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        let mut close = Vec::new();
        for s in 0..self.senders.len() {
            while self.sender_alive[s] {
                let Some(out) = self.senders[s].poll_output() else {
                    break;
                };
                any = true;
                self.sender_obs[s].output(now, &out);
                match out {
                    Output::Transmit { peer, bytes, .. } => match receiver_index(peer) {
                        Some(r) if r < self.receivers.len() => {
                            self.transmit(s, r, Direction::ToReceiver, now, bytes);
                        }
                        _ => self.stats.misaddressed += 1,
                    },
                    Output::ExecuteWrites {
                        peer,
                        batch,
                        plan,
                        headers,
                        ..
                    } => self.execute(now, s, peer, batch, &plan, &headers)?,
                    Output::ClosePeer { peer, .. } => {
                        if let Some(r) = receiver_index(peer).filter(|&r| r < self.receivers.len())
                        {
                            close.push((s, r));
                        }
                    }
                    Output::Event(e) => {
                        let at = self.clock.now();
                        self.events.push_back((Node::Sender(s), at, e));
                    }
                }
            }
        }
        for r in 0..self.receivers.len() {
            while self.receiver_alive[r] {
                let Some(out) = self.receivers[r].poll_output() else {
                    break;
                };
                any = true;
                self.receiver_obs[r].output(now, &out);
                match out {
                    Output::Transmit { peer, bytes, .. } => match sender_index(peer) {
                        Some(s) if s < self.senders.len() => {
                            self.transmit(s, r, Direction::ToSender, now, bytes);
                        }
                        _ => self.stats.misaddressed += 1,
                    },
                    // A receiver never writes; nothing to carry out.
                    Output::ExecuteWrites { .. } => {}
                    Output::ClosePeer { peer, .. } => {
                        if let Some(s) = sender_index(peer).filter(|&s| s < self.senders.len()) {
                            close.push((s, r));
                        }
                    }
                    Output::Event(e) => {
                        let at = self.clock.now();
                        self.events.push_back((Node::Receiver(r), at, e));
                    }
                }
            }
        }
        if any {
            for (obs, sender) in self.sender_obs.iter_mut().zip(&self.senders) {
                obs.counters(sender);
            }
            for (obs, receiver) in self.receiver_obs.iter_mut().zip(&self.receivers) {
                obs.counters(receiver);
            }
        }
        for (s, r) in close {
            self.disconnect(s, r)?;
        }
        Ok(any)
    }

    /// Queues the encoded frame `bytes` on the link between sender `s` and receiver `r`, as
    /// the network emulation decides (dropped, delayed, duplicated, reordered, damaged).
    fn transmit(&mut self, s: usize, r: usize, direction: Direction, now: Instant, bytes: Bytes) {
        let l = self.link(s, r);
        let to_alive = match direction {
            Direction::ToReceiver => self.receiver_alive[r],
            Direction::ToSender => self.sender_alive[s],
        };
        if !self.links[l].connected || !to_alive {
            return;
        }
        self.stats.frames += 1;
        self.stats.frame_bytes += bytes.len() as u64;
        let link = &mut self.links[l];
        let fate = self.netem.frame(now, &mut link.emulated, direction, bytes);
        match direction {
            Direction::ToReceiver => link.to_receiver.push(fate),
            Direction::ToSender => link.to_sender.push(fate),
        }
    }

    /// Hands a write batch of sender `s` to the copy worker (or fails it at once if it cannot
    /// be resolved). Every extent is admitted by the receiver first, as a receiving transport
    /// would before applying it: refused ones fail the batch, discarded ones are not copied.
    fn execute(
        &mut self,
        now: Instant,
        s: usize,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &kvpipe_core::WritePlan,
        headers: &DataWriteHeaders,
    ) -> Result<(), DriveError> {
        let fail_now = |net: &mut Self, status: TransferStatus| {
            net.stats.failed_batches += 1;
            net.feed_sender(s, now, TransportInput::WritesFailed { batch, status })
        };
        let Some(r) = receiver_index(peer).filter(|&r| r < self.receivers.len()) else {
            return fail_now(self, TransferStatus::WriteFailed);
        };
        let l = self.link(s, r);
        if !self.links[l].connected || !self.receiver_alive[r] {
            return fail_now(self, TransferStatus::WriteFailed);
        }
        let mut writes = match ResolvedBatch::resolve(
            plan,
            &self.sender_regions[s],
            &self.receiver_regions[r],
        ) {
            Ok(w) => w,
            Err(_) => return fail_now(self, TransferStatus::WriteFailed),
        };
        let mut tickets = Vec::with_capacity(plan.len());
        let mut keep = Vec::with_capacity(plan.len());
        for e in plan.extents() {
            let header = headers.frame(e.dst_region, e.dst_offset, e.len);
            match self.receivers[r].admit_write(now, sender_peer(s), &header) {
                Admission::Apply { ticket, .. } => {
                    tickets.push(ticket);
                    keep.push(true);
                }
                Admission::Discard { .. } => keep.push(false),
                Admission::Refuse(_) => {
                    // The receiver failed the request and asked to close the link.
                    self.finish_tickets(r, &tickets, false)?;
                    return fail_now(self, TransferStatus::GrantViolation);
                }
            }
        }
        writes.retain(&keep);
        let fate = self
            .netem
            .batch(now, &mut self.links[l].emulated, s, writes.bytes());
        if let Some(d) = fate.stall {
            self.stalls.insert((s, batch), d);
        }
        if fate.fail.is_some() {
            // A write that failed part-way: half of its bytes landed.
            writes.truncate_half();
        }
        let fail = fate.fail;
        self.in_flight += 1;
        self.links[l].in_flight += 1;
        self.issued.insert((s, batch), (writes.bytes(), now));
        self.worker.submit(Job {
            batch,
            sender: s,
            receiver: r,
            writes,
            tickets,
            fail,
        });
        Ok(())
    }

    /// Reports the admitted writes of a batch finished to receiver `r`.
    fn finish_tickets(
        &mut self,
        r: usize,
        tickets: &[WriteTicket],
        landed: bool,
    ) -> Result<(), DriveError> {
        if !self.receiver_alive[r] {
            return Ok(());
        }
        let now = self.now();
        for &ticket in tickets {
            self.feed_receiver(r, now, TransportInput::WriteFinished { ticket, landed })?;
        }
        Ok(())
    }
}

impl Drop for MemNetwork {
    fn drop(&mut self) {
        // The worker field is dropped after this: it finishes its batches and joins, so no
        // copy outlives the network.
        for link in &mut self.links {
            link.to_receiver.clear();
            link.to_sender.clear();
        }
    }
}

fn usage(node: Node) -> impl Fn(UsageError) -> DriveError {
    move |error| DriveError::Usage { node, error }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_timings_stay_bounded_and_keep_the_newest() {
        let mut recent = Vec::new();
        for i in 0..1_000u32 {
            keep_recent(&mut recent, 8, i);
            assert!(recent.len() <= 8);
            assert_eq!(recent.last(), Some(&i));
        }
        // The most recent ones, in order, none skipped: at least half of the bound.
        assert!(recent.len() > 4);
        assert!(recent.windows(2).all(|w| w[1] == w[0] + 1));
    }
}
