//! [`MemPair`]: one sender and one receiver endpoint in one process — the common case of
//! [`MemNetwork`], with the same run loop.

use kvpipe_core::{
    ConfigError, Event, Instant, PeerId, Receiver, ReceiverConfig, RegionId, Sender, SenderConfig,
};

use crate::network::{
    receiver_peer, sender_peer, BatchTiming, DriveError, MemNetwork, NetworkConfig, Node, PairStats,
};
use crate::region::{RegionTable, RegionUse, RegistrationError};
use kvpipe_driver::Clock;
use kvpipe_netem::{NetemConfig, NetemCounters};

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

impl Endpoint {
    fn node(self) -> Node {
        match self {
            Endpoint::Sender => Node::Sender(0),
            Endpoint::Receiver => Node::Receiver(0),
        }
    }
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
    pub faults: NetemConfig,
}

impl PairConfig {
    /// Both endpoints' configurations, copies on up to 4 threads for batches of 8 MiB or more,
    /// no faults.
    pub fn new(sender: SenderConfig, receiver: ReceiverConfig) -> Self {
        let n = NetworkConfig::new(Vec::new(), Vec::new());
        PairConfig {
            sender,
            receiver,
            copy_threads: n.copy_threads,
            parallel_threshold: n.parallel_threshold,
            faults: n.faults,
        }
    }
}

/// A sender and a receiver in one process.
///
/// Usage: register both sides' memory, [`connect`](Self::connect), then issue engine commands
/// through [`sender_mut`](Self::sender_mut) / [`receiver_mut`](Self::receiver_mut) with
/// [`now`](Self::now), and call [`pump`](Self::pump) (non-blocking) or
/// [`drive_until`](Self::drive_until) (bounded) to let the endpoints and the transport work.
/// Events of both endpoints are collected in order ([`take_events`](Self::take_events)).
#[derive(Debug)]
pub struct MemPair {
    net: MemNetwork,
}

impl MemPair {
    /// A pair with no memory registered and no connection yet, or the first endpoint
    /// configuration that cannot run pipelined transfer.
    pub fn new(config: PairConfig) -> Result<Self, ConfigError> {
        debug_assert_eq!(sender_peer(0), SENDER_PEER);
        debug_assert_eq!(receiver_peer(0), RECEIVER_PEER);
        let mut n = NetworkConfig::new(vec![config.sender], vec![config.receiver]);
        n.copy_threads = config.copy_threads;
        n.parallel_threshold = config.parallel_threshold;
        n.faults = config.faults;
        Ok(MemPair {
            net: MemNetwork::new(n)?,
        })
    }

    /// The underlying network (one sender, one receiver).
    pub fn network(&mut self) -> &mut MemNetwork {
        &mut self.net
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
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { self.net.register_host(endpoint.node(), id, usage, ptr, len) }
    }

    /// Registers `len` bytes of device memory of `endpoint` (at device address `ptr` on GPU
    /// `ordinal`) as region `id`.
    ///
    /// # Safety
    ///
    /// The contract of [`RegionTable::register_device`].
    #[cfg(feature = "cuda")]
    pub unsafe fn register_device(
        &mut self,
        endpoint: Endpoint,
        id: RegionId,
        usage: RegionUse,
        ordinal: usize,
        ptr: u64,
        len: usize,
    ) -> Result<(), RegistrationError> {
        let table = (self.net.regions_mut(endpoint.node())).expect("a pair has both endpoints");
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { table.register_device(id, usage, ordinal, ptr, len) }
    }

    /// Removes a region; refused while a write batch may still touch it.
    pub fn deregister(
        &mut self,
        endpoint: Endpoint,
        id: RegionId,
    ) -> Result<(), RegistrationError> {
        self.net.deregister(endpoint.node(), id)
    }

    /// The regions of `endpoint`.
    pub fn regions(&self, endpoint: Endpoint) -> &RegionTable {
        self.net
            .regions(endpoint.node())
            .expect("a pair has both endpoints")
    }

    /// Makes the writes of `slice` of `request` start on the GPU only once `fence` passed (see
    /// [`MemNetwork::gate_slice`]): call it after the submission that returned the slice, before
    /// the next [`pump`](Self::pump).
    #[cfg(feature = "cuda")]
    pub fn gate_slice(
        &mut self,
        request: kvpipe_core::RequestId,
        slice: kvpipe_core::SenderSliceId,
        fence: std::sync::Arc<kvpipe_cuda::Fence>,
    ) {
        // The network refuses only a sender index it does not have; a pair has sender 0.
        let gated = self.net.gate_slice(0, request, slice, fence);
        debug_assert!(gated.is_ok(), "{gated:?}");
    }

    // ----- getters -----

    /// The current time on the pair's clock.
    pub fn now(&self) -> Instant {
        self.net.now()
    }

    /// The pair's clock.
    pub fn clock(&self) -> &Clock {
        self.net.clock()
    }

    /// The sender endpoint.
    pub fn sender(&self) -> &Sender {
        self.net.sender(0)
    }

    /// The sender endpoint, for engine commands; call [`pump`](Self::pump) afterwards.
    pub fn sender_mut(&mut self) -> &mut Sender {
        self.net.sender_mut(0)
    }

    /// The receiver endpoint.
    pub fn receiver(&self) -> &Receiver {
        self.net.receiver(0)
    }

    /// The receiver endpoint, for engine commands; call [`pump`](Self::pump) afterwards.
    pub fn receiver_mut(&mut self) -> &mut Receiver {
        self.net.receiver_mut(0)
    }

    /// What the pair carried.
    pub fn stats(&self) -> PairStats {
        self.net.stats()
    }

    /// Faults injected so far.
    pub fn fault_counts(&self) -> NetemCounters {
        self.net.fault_counts()
    }

    /// Write batches handed to the copy worker and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.net.writes_in_flight()
    }

    /// Issue and report times of the recent write batches, in report order (see
    /// [`MemNetwork::batch_timings`]: at most [`MAX_BATCH_TIMINGS`](crate::MAX_BATCH_TIMINGS)).
    pub fn batch_timings(&self) -> &[BatchTiming] {
        self.net.batch_timings()
    }

    /// Takes the timings [`batch_timings`](Self::batch_timings) shows, leaving none.
    pub fn take_batch_timings(&mut self) -> Vec<BatchTiming> {
        self.net.take_batch_timings()
    }

    /// Whether the connection is up.
    pub fn is_connected(&self) -> bool {
        self.net.is_connected(0, 0)
    }

    /// Whether `endpoint` is alive (not [killed](Self::kill)).
    pub fn is_alive(&self, endpoint: Endpoint) -> bool {
        self.net.is_alive(endpoint.node())
    }

    /// Takes the events both endpoints reported since the last call, in order, with the time
    /// each was drained.
    pub fn take_events(&mut self) -> Vec<(Endpoint, Instant, Event)> {
        self.net
            .take_events()
            .into_iter()
            .map(|(node, at, e)| {
                let endpoint = match node {
                    Node::Sender(_) => Endpoint::Sender,
                    Node::Receiver(_) => Endpoint::Receiver,
                };
                (endpoint, at, e)
            })
            .collect()
    }

    // ----- connection and run loop -----

    /// Connects the two endpoints (both start their handshake).
    pub fn connect(&mut self) -> Result<(), DriveError> {
        self.net.connect(0, 0)
    }

    /// Kills `endpoint` as if its process died: it takes no more input, its frames vanish, and
    /// the other endpoint learns the connection is lost once no write can still land.
    pub fn kill(&mut self, endpoint: Endpoint) -> Result<(), DriveError> {
        self.net.kill(endpoint.node())
    }

    /// See [`MemNetwork::pump`].
    pub fn pump(&mut self) -> Result<(), DriveError> {
        self.net.pump()
    }

    /// See [`MemNetwork::next_wake`].
    pub fn next_wake(&mut self) -> Option<Instant> {
        self.net.next_wake()
    }

    /// See [`MemNetwork::wait`].
    pub fn wait(&mut self, max: std::time::Duration) {
        self.net.wait(max);
    }

    /// Pumps and waits until `done(self)` holds, for at most `limit`.
    pub fn drive_until(
        &mut self,
        limit: std::time::Duration,
        done: impl FnMut(&mut Self) -> bool,
    ) -> Result<(), DriveError> {
        crate::network::drive(self, limit, Self::pump, Self::wait, done)
    }
}
