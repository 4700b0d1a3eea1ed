//! [`MemPair`]: a sender and a receiver endpoint in one process, connected by in-memory frame
//! queues, with write batches carried out by the copy worker — the core's run loop driven with
//! real time.

use std::collections::{HashMap, VecDeque};

use kvpipe_core::session::{Output, UsageError, WriteBatchId};
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::{
    Event, Instant, PeerId, Receiver, ReceiverConfig, ReceiverInput, RegionId, Sender,
    SenderConfig, SenderInput,
};
use thiserror::Error;

use crate::clock::Clock;
use crate::copy::ResolvedBatch;
use crate::faults::{FaultConfig, FaultCounts, FaultInjector};
use crate::region::{RegionTable, RegionUse, RegistrationError};
use crate::worker::{CopyWorker, Done, Job};

/// How the receiver names the sender.
pub const SENDER_PEER: PeerId = PeerId(1);
/// How the sender names the receiver.
pub const RECEIVER_PEER: PeerId = PeerId(2);

/// One of the two endpoints of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// The prefill side.
    Sender,
    /// The decode side.
    Receiver,
}

/// How a [`MemPair`] is set up.
#[derive(Clone, Debug)]
pub struct PairConfig {
    /// The sender endpoint's configuration.
    pub sender: SenderConfig,
    /// The receiver endpoint's configuration.
    pub receiver: ReceiverConfig,
    /// Threads that copy one large write batch (the copy worker is one of them).
    pub copy_threads: usize,
    /// Batches of at least this many bytes are split over `copy_threads` threads.
    pub parallel_threshold: u64,
    /// Faults to inject (none by default).
    pub faults: FaultConfig,
}

impl PairConfig {
    /// Both endpoints' configurations, copies on up to 4 threads for batches of 8 MiB or more,
    /// no faults.
    pub fn new(sender: SenderConfig, receiver: ReceiverConfig) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        PairConfig {
            sender,
            receiver,
            copy_threads: cores.clamp(1, 4),
            parallel_threshold: 8 << 20,
            faults: FaultConfig::default(),
        }
    }
}

/// What a pair has carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairStats {
    /// Frames encoded and queued.
    pub frames: u64,
    /// Their encoded bytes.
    pub frame_bytes: u64,
    /// Frames the codec refused to encode (not sent).
    pub encode_errors: u64,
    /// Frames that failed to decode (dropped).
    pub decode_errors: u64,
    /// Write batches executed.
    pub batches: u64,
    /// Bytes copied by write batches.
    pub bytes_copied: u64,
    /// Write batches that failed.
    pub failed_batches: u64,
}

/// When one write batch was handed to the copy worker and when its outcome was reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchTiming {
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

/// Why driving the pair stopped.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DriveError {
    /// The transport fed an endpoint an input it refused (a driver bug).
    #[error("the {endpoint:?} refused the driver's input: {error}")]
    Usage {
        /// The endpoint.
        endpoint: Endpoint,
        /// Its error.
        error: UsageError,
    },
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
struct QueuedFrame {
    deliver_at: Instant,
    bytes: Vec<u8>,
}

/// Longest the driver waits for the copy worker when a connection is torn down.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// Steps of one [`MemPair::pump`] before it reports a livelock.
const MAX_STEPS: u64 = 1 << 22;

/// A sender and a receiver in one process (see the module doc).
///
/// Usage: register both sides' memory, [`connect`](Self::connect), then issue engine commands
/// through [`sender_mut`](Self::sender_mut) / [`receiver_mut`](Self::receiver_mut) with
/// [`now`](Self::now), and call [`pump`](Self::pump) (non-blocking) or
/// [`drive_until`](Self::drive_until) (bounded) to let the endpoints and the transport work.
/// Events of both endpoints are collected in order ([`take_events`](Self::take_events)).
#[derive(Debug)]
pub struct MemPair {
    clock: Clock,
    sender: Sender,
    receiver: Receiver,
    sender_regions: RegionTable,
    receiver_regions: RegionTable,
    to_receiver: VecDeque<QueuedFrame>,
    to_sender: VecDeque<QueuedFrame>,
    worker: CopyWorker,
    in_flight: usize,
    reports: VecDeque<Done>,
    /// Reports held back by a stall fault, with their release time.
    held: Vec<(Instant, Done)>,
    /// Batches whose report is to be held, with how long.
    stalls: HashMap<WriteBatchId, kvpipe_core::Duration>,
    issued: HashMap<WriteBatchId, (u64, Instant)>,
    timings: Vec<BatchTiming>,
    faults: FaultInjector,
    events: VecDeque<(Endpoint, Instant, Event)>,
    stats: PairStats,
    sender_alive: bool,
    receiver_alive: bool,
    connected: bool,
}

impl MemPair {
    /// A pair with no memory registered and no connection yet.
    pub fn new(config: PairConfig) -> Self {
        let clock = Clock::new();
        MemPair {
            clock,
            sender: Sender::new(config.sender),
            receiver: Receiver::new(config.receiver),
            sender_regions: RegionTable::new(),
            receiver_regions: RegionTable::new(),
            to_receiver: VecDeque::new(),
            to_sender: VecDeque::new(),
            worker: CopyWorker::spawn(clock, config.copy_threads, config.parallel_threshold),
            in_flight: 0,
            reports: VecDeque::new(),
            held: Vec::new(),
            stalls: HashMap::new(),
            issued: HashMap::new(),
            timings: Vec::new(),
            faults: FaultInjector::new(config.faults),
            events: VecDeque::new(),
            stats: PairStats::default(),
            sender_alive: true,
            receiver_alive: true,
            connected: false,
        }
    }

    // ----- memory -----

    /// Registers host memory of `endpoint` as region `id`.
    ///
    /// # Safety
    ///
    /// The contract of [`RegionTable::register_host`]: the memory stays valid until the region
    /// is deregistered or the pair is dropped, and the engine leaves the bytes of pinned blocks
    /// alone until the sessions report [`Event::Quiesced`].
    pub unsafe fn register_host(
        &mut self,
        endpoint: Endpoint,
        id: RegionId,
        usage: RegionUse,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(), RegistrationError> {
        let table = match endpoint {
            Endpoint::Sender => &mut self.sender_regions,
            Endpoint::Receiver => &mut self.receiver_regions,
        };
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { table.register_host(id, usage, ptr, len) }
    }

    /// Removes a region; refused while a write batch may still touch it.
    pub fn deregister(
        &mut self,
        endpoint: Endpoint,
        id: RegionId,
    ) -> Result<(), RegistrationError> {
        self.regions_mut(endpoint).deregister(id)
    }

    /// The regions of `endpoint`.
    pub fn regions(&self, endpoint: Endpoint) -> &RegionTable {
        match endpoint {
            Endpoint::Sender => &self.sender_regions,
            Endpoint::Receiver => &self.receiver_regions,
        }
    }

    fn regions_mut(&mut self, endpoint: Endpoint) -> &mut RegionTable {
        match endpoint {
            Endpoint::Sender => &mut self.sender_regions,
            Endpoint::Receiver => &mut self.receiver_regions,
        }
    }

    // ----- getters -----

    /// The current time on the pair's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The pair's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The sender endpoint.
    pub fn sender(&self) -> &Sender {
        &self.sender
    }

    /// The sender endpoint, for engine commands; call [`pump`](Self::pump) afterwards.
    pub fn sender_mut(&mut self) -> &mut Sender {
        &mut self.sender
    }

    /// The receiver endpoint.
    pub fn receiver(&self) -> &Receiver {
        &self.receiver
    }

    /// The receiver endpoint, for engine commands; call [`pump`](Self::pump) afterwards.
    pub fn receiver_mut(&mut self) -> &mut Receiver {
        &mut self.receiver
    }

    /// What the pair carried.
    pub fn stats(&self) -> PairStats {
        self.stats
    }

    /// Faults injected so far.
    pub fn fault_counts(&self) -> FaultCounts {
        self.faults.counts
    }

    /// Write batches handed to the copy worker and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.in_flight
    }

    /// Issue and report times of every write batch so far, in report order.
    pub fn batch_timings(&self) -> &[BatchTiming] {
        &self.timings
    }

    /// Whether the connection is up.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Whether `endpoint` is alive (not [killed](Self::kill)).
    pub fn is_alive(&self, endpoint: Endpoint) -> bool {
        match endpoint {
            Endpoint::Sender => self.sender_alive,
            Endpoint::Receiver => self.receiver_alive,
        }
    }

    /// Takes the events both endpoints reported since the last call, in order, with the time
    /// each was drained.
    pub fn take_events(&mut self) -> Vec<(Endpoint, Instant, Event)> {
        self.events.drain(..).collect()
    }

    // ----- connection -----

    /// Connects the two endpoints (both start their handshake).
    pub fn connect(&mut self) -> Result<(), DriveError> {
        let now = self.now();
        self.connected = true;
        self.sender
            .handle_input(SenderInput::PeerConnected {
                now,
                peer: RECEIVER_PEER,
            })
            .map_err(sender_err)?;
        self.receiver
            .handle_input(ReceiverInput::PeerConnected {
                now,
                peer: SENDER_PEER,
            })
            .map_err(receiver_err)?;
        self.pump()
    }

    /// Kills `endpoint` as if its process died: it takes no more input, its frames vanish, and
    /// the other endpoint learns the connection is lost once no write can still land.
    pub fn kill(&mut self, endpoint: Endpoint) -> Result<(), DriveError> {
        match endpoint {
            Endpoint::Sender => self.sender_alive = false,
            Endpoint::Receiver => self.receiver_alive = false,
        }
        self.disconnect()
    }

    /// Tears the connection down: waits (bounded) for every in-flight write batch, reports them,
    /// then reports the disconnect to both living endpoints.
    fn disconnect(&mut self) -> Result<(), DriveError> {
        if !self.connected {
            return Ok(());
        }
        self.connected = false;
        self.to_receiver.clear();
        self.to_sender.clear();
        let deadline = std::time::Instant::now() + DRAIN_LIMIT;
        while self.in_flight > self.reports.len() + self.held.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.worker.done.recv_timeout(left) {
                Ok(done) => self.reports.push_back(done),
                Err(_) => return Err(DriveError::WritesStuck(self.in_flight)),
            }
        }
        // Tearing the connection down ends every stall: the bytes have landed.
        self.reports.extend(self.held.drain(..).map(|(_, d)| d));
        self.stalls.clear();
        self.report_writes()?;
        let now = self.now();
        if self.sender_alive {
            self.sender
                .handle_input(SenderInput::PeerDisconnected {
                    now,
                    peer: RECEIVER_PEER,
                })
                .map_err(sender_err)?;
        }
        if self.receiver_alive {
            self.receiver
                .handle_input(ReceiverInput::PeerDisconnected {
                    now,
                    peer: SENDER_PEER,
                })
                .map_err(receiver_err)?;
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
            while let Ok(done) = self.worker.done.try_recv() {
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
            if self.sender_alive && self.sender.poll_timeout().is_some_and(|at| at <= now) {
                self.sender
                    .handle_input(SenderInput::Timeout { now })
                    .map_err(sender_err)?;
                progressed = true;
            }
            if self.receiver_alive && self.receiver.poll_timeout().is_some_and(|at| at <= now) {
                self.receiver
                    .handle_input(ReceiverInput::Timeout { now })
                    .map_err(receiver_err)?;
                progressed = true;
            }
            progressed |= self.deliver(now)?;
            progressed |= self.drain_outputs(now)?;
            if !progressed {
                return Ok(());
            }
        }
        Err(DriveError::Livelock(MAX_STEPS))
    }

    /// When something is due next without outside input: a timer or a delayed frame.
    pub fn next_wake(&mut self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        if self.sender_alive {
            consider(self.sender.poll_timeout());
        }
        if self.receiver_alive {
            consider(self.receiver.poll_timeout());
        }
        consider(self.to_receiver.front().map(|f| f.deliver_at));
        consider(self.to_sender.front().map(|f| f.deliver_at));
        for (at, _) in &self.held {
            consider(Some(*at));
        }
        next
    }

    /// Blocks until a write batch finishes, a timer or delayed frame is due, or `max` passed —
    /// whichever comes first. Never blocks longer than `max`.
    pub fn wait(&mut self, max: std::time::Duration) {
        let mut limit = max;
        if let Some(at) = self.next_wake() {
            limit = limit.min(self.clock.until(at));
        }
        if !self.reports.is_empty() || limit.is_zero() {
            return;
        }
        if self.in_flight > self.held.len() {
            if let Ok(done) = self.worker.done.recv_timeout(limit) {
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

    /// Takes a report from the copy worker: queued for the sender, or held if the batch stalls.
    fn accept_report(&mut self, done: Done) {
        match self.stalls.remove(&done.batch) {
            Some(d) => self.held.push((self.clock.now() + d, done)),
            None => self.reports.push_back(done),
        }
    }

    /// Reports finished write batches to the sender.
    fn report_writes(&mut self) -> Result<bool, DriveError> {
        let mut any = false;
        while let Some(done) = self.reports.pop_front() {
            any = true;
            self.in_flight -= 1;
            self.stats.batches += 1;
            if let Some((bytes, issued)) = self.issued.remove(&done.batch) {
                self.timings.push(BatchTiming {
                    batch: done.batch,
                    bytes,
                    issued,
                    copy_started: done.started,
                    copy_finished: done.finished,
                    reported: self.clock.now(),
                });
            }
            if done.status == TransferStatus::Success {
                self.stats.bytes_copied += done.bytes;
            } else {
                self.stats.failed_batches += 1;
            }
            if !self.sender_alive {
                continue;
            }
            let now = self.now();
            let input = if done.status == TransferStatus::Success {
                SenderInput::WritesCompleted {
                    now,
                    batch: done.batch,
                }
            } else {
                SenderInput::WritesFailed {
                    now,
                    batch: done.batch,
                    status: done.status,
                }
            };
            self.sender.handle_input(input).map_err(sender_err)?;
        }
        Ok(any)
    }

    /// Delivers every frame that is due.
    fn deliver(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        while self
            .to_receiver
            .front()
            .is_some_and(|f| f.deliver_at <= now)
        {
            let f = self.to_receiver.pop_front().expect("checked");
            any = true;
            if let Some(frame) = self.decode(&f.bytes) {
                if self.receiver_alive {
                    self.receiver
                        .handle_input(ReceiverInput::FrameReceived {
                            now,
                            peer: SENDER_PEER,
                            frame,
                        })
                        .map_err(receiver_err)?;
                }
            }
        }
        while self.to_sender.front().is_some_and(|f| f.deliver_at <= now) {
            let f = self.to_sender.pop_front().expect("checked");
            any = true;
            if let Some(frame) = self.decode(&f.bytes) {
                if self.sender_alive {
                    self.sender
                        .handle_input(SenderInput::FrameReceived {
                            now,
                            peer: RECEIVER_PEER,
                            frame,
                        })
                        .map_err(sender_err)?;
                }
            }
        }
        Ok(any)
    }

    fn decode(&mut self, bytes: &[u8]) -> Option<Frame> {
        match Frame::parse(bytes) {
            Ok((frame, n)) if n == bytes.len() => Some(frame),
            _ => {
                self.stats.decode_errors += 1;
                None
            }
        }
    }

    /// Carries out every output both endpoints have queued.
    fn drain_outputs(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        let mut close = false;
        while self.sender_alive {
            let Some(out) = self.sender.poll_output() else {
                break;
            };
            any = true;
            match out {
                Output::Transmit { frame, .. } => self.transmit(Endpoint::Sender, now, &frame),
                Output::ExecuteWrites {
                    peer, batch, plan, ..
                } => {
                    self.execute(now, peer, batch, &plan)?;
                }
                Output::ClosePeer { .. } => close = true,
                Output::Event(e) => {
                    let at = self.clock.now();
                    self.events.push_back((Endpoint::Sender, at, e));
                }
            }
        }
        while self.receiver_alive {
            let Some(out) = self.receiver.poll_output() else {
                break;
            };
            any = true;
            match out {
                Output::Transmit { frame, .. } => self.transmit(Endpoint::Receiver, now, &frame),
                // A receiver never writes; nothing to carry out.
                Output::ExecuteWrites { .. } => {}
                Output::ClosePeer { .. } => close = true,
                Output::Event(e) => {
                    let at = self.clock.now();
                    self.events.push_back((Endpoint::Receiver, at, e));
                }
            }
        }
        if close {
            self.disconnect()?;
        }
        Ok(any)
    }

    /// Encodes `frame` with the wire codec and queues it towards the other endpoint.
    fn transmit(&mut self, from: Endpoint, now: Instant, frame: &Frame) {
        let to_alive = match from {
            Endpoint::Sender => self.receiver_alive,
            Endpoint::Receiver => self.sender_alive,
        };
        if !self.connected || !to_alive {
            return;
        }
        let Ok(bytes) = frame.to_vec() else {
            // A frame the codec cannot encode never leaves (the core builds only valid ones).
            self.stats.encode_errors += 1;
            return;
        };
        self.stats.frames += 1;
        self.stats.frame_bytes += bytes.len() as u64;
        let handshake = matches!(
            frame,
            Frame::Hello(_) | Frame::HelloAccept(_) | Frame::HelloReject(_)
        );
        let fate = self.faults.frame(handshake);
        if fate.drop {
            return;
        }
        let queue = match from {
            Endpoint::Sender => &mut self.to_receiver,
            Endpoint::Receiver => &mut self.to_sender,
        };
        // A delay holds back this frame and every later one (a slow link keeps its order);
        // only a reordered frame overtakes the frame queued before it.
        let after_last = queue.back().map_or(now, |f| f.deliver_at);
        let mut deliver_at = (now + fate.delay).max(after_last);
        let copies = if fate.duplicate { 2 } else { 1 };
        for _ in 0..copies {
            let mut at = queue.len();
            if fate.reorder && at > 0 {
                at -= 1;
                deliver_at = queue[at].deliver_at;
            }
            queue.insert(
                at,
                QueuedFrame {
                    deliver_at,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    /// Hands a write batch to the copy worker (or fails it at once if it cannot be resolved).
    fn execute(
        &mut self,
        now: Instant,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &kvpipe_core::WritePlan,
    ) -> Result<(), DriveError> {
        let fail_now = |pair: &mut Self| {
            pair.stats.failed_batches += 1;
            pair.sender
                .handle_input(SenderInput::WritesFailed {
                    now,
                    batch,
                    status: TransferStatus::WriteFailed,
                })
                .map_err(sender_err)
        };
        if !self.connected || !self.receiver_alive {
            return fail_now(self);
        }
        let mut writes =
            match ResolvedBatch::resolve(plan, &self.sender_regions, &self.receiver_regions) {
                Ok(w) => w,
                Err(_) => return fail_now(self),
            };
        let (fails, stall) = self.faults.batch();
        if let Some(d) = stall {
            self.stalls.insert(batch, d);
        }
        let fail = if fails {
            writes.truncate_half();
            Some(TransferStatus::WriteFailed)
        } else {
            None
        };
        self.in_flight += 1;
        self.issued.insert(batch, (writes.bytes(), now));
        self.worker.submit(Job {
            batch,
            peer,
            writes,
            fail,
        });
        Ok(())
    }
}

impl Drop for MemPair {
    fn drop(&mut self) {
        // The worker field is dropped after this: it finishes its batches and joins, so no
        // copy outlives the pair.
        self.to_receiver.clear();
        self.to_sender.clear();
    }
}

fn sender_err(error: UsageError) -> DriveError {
    DriveError::Usage {
        endpoint: Endpoint::Sender,
        error,
    }
}

fn receiver_err(error: UsageError) -> DriveError {
    DriveError::Usage {
        endpoint: Endpoint::Receiver,
        error,
    }
}
