//! [`MemNetwork`]: several sender and receiver endpoints in one process, every sender connected
//! to every receiver by in-memory frame queues, write batches carried out by one copy worker —
//! the core's run loop driven with real time. [`MemPair`](crate::MemPair) is its one-to-one
//! special case.
//!
//! - this file: the network's state, construction, regions and getters;
//! - [`links`]: connecting, disconnecting and killing endpoints;
//! - [`run`]: the run loop (reports, timers, frames, outputs, copies).

use std::collections::VecDeque;
#[cfg(feature = "cuda")]
use std::sync::Arc;

use rustc_hash::FxHashMap as HashMap;

use bytes::Bytes;
use kvpipe_core::session::{
    Admission, DataWriteHeaders, Output, TransportInput, UsageError, WriteBatchId, WriteTicket,
};
use kvpipe_core::wire::{Role, TransferStatus};
use kvpipe_core::{
    ConfigError, Event, Instant, PeerId, Receiver, ReceiverConfig, RegionId, Sender, SenderConfig,
};
#[cfg(feature = "cuda")]
use kvpipe_core::{RequestId, SenderSliceId};
use kvpipe_observe::Observer;
use thiserror::Error;

use crate::copy::ResolvedBatch;
use crate::region::{RegionTable, RegionUse, RegistrationError};
use crate::worker::{CopyWorker, Done, Job};
use kvpipe_driver::Clock;
use kvpipe_netem::{Direction, FrameQueue, Link, Netem, NetemConfig, NetemCounters};

mod links;
mod run;

pub(crate) use run::drive;

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
    /// Buffers reused from one batch's admission to the next.
    scratch: Scratch,
    /// Fences the engine put before slices' writes ([`gate_slice`](Self::gate_slice)), per
    /// sender and request, until the fence passed or the request quiesced.
    #[cfg(feature = "cuda")]
    gates: HashMap<(usize, RequestId), Vec<SliceGate>>,
}

/// A slice and the fence its writes wait for.
#[cfg(feature = "cuda")]
type SliceGate = (SenderSliceId, Arc<kvpipe_cuda::Fence>);

/// The headers of a batch's writes and their admissions, kept between batches so issuing one
/// allocates neither.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    pub(super) frames: Vec<kvpipe_core::wire::DataWrite>,
    pub(super) admissions: Vec<Admission>,
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
            stalls: HashMap::default(),
            issued: HashMap::default(),
            timings: Vec::new(),
            netem,
            events: VecDeque::new(),
            stats: PairStats::default(),
            sender_obs: (0..s).map(|_| Observer::new(Role::Sender, "mem")).collect(),
            receiver_obs: (0..r)
                .map(|_| Observer::new(Role::Receiver, "mem"))
                .collect(),
            scratch: Scratch::default(),
            #[cfg(feature = "cuda")]
            gates: HashMap::default(),
        })
    }

    /// Makes every write batch of sender `s`'s slice `slice` of `request` (to each receiver,
    /// including one whose registration comes later) start on the GPU only once `fence`
    /// passed, with no wait on the host; a batch with host memory on either side of a segment
    /// waits for the fence on the copy worker's thread first (so does every batch behind it on
    /// that thread). Call it after the submission that returned the slice and before the next
    /// [`pump`](Self::pump), which carries its batches out.
    ///
    /// The source bytes may still be being written by the work before the fence; as for any
    /// batch, nothing else may touch them until the request quiesces. The fence is let go once
    /// it passed or the request quiesced.
    #[cfg(feature = "cuda")]
    pub fn gate_slice(
        &mut self,
        s: usize,
        request: RequestId,
        slice: SenderSliceId,
        fence: Arc<kvpipe_cuda::Fence>,
    ) -> Result<(), DriveError> {
        if s >= self.senders.len() {
            return Err(DriveError::NoSuchNode(Node::Sender(s)));
        }
        let gates = self.gates.entry((s, request)).or_default();
        // Fences that passed gate nothing any more.
        gates.retain(|(_, f)| !matches!(f.is_done(), Ok(true)));
        gates.push((slice, fence));
        Ok(())
    }

    /// The fence before `slice`'s writes, if one was put there and has not passed.
    #[cfg(feature = "cuda")]
    fn gate(
        &mut self,
        s: usize,
        request: RequestId,
        slice: SenderSliceId,
    ) -> Option<Arc<kvpipe_cuda::Fence>> {
        let gates = self.gates.get_mut(&(s, request))?;
        let i = gates.iter().position(|(k, _)| *k == slice)?;
        if matches!(gates[i].1.is_done(), Ok(true)) {
            gates.swap_remove(i);
            return None;
        }
        Some(gates[i].1.clone())
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
