//! The driver: the one place that feeds the core's [`Sender`] / [`Receiver`] from the fabric
//! and carries out what they ask. Everything verbs-specific is in the [`Fabric`] below it;
//! this module maps its events onto the endpoints' inputs and their outputs onto fabric calls:
//!
//! | fabric → core | core → fabric |
//! |---|---|
//! | `Connected` → `PeerConnected` | `Transmit` → encode, [`Fabric::send`] |
//! | `Message` → decode → `FrameReceived` | `ExecuteWrites` → [`Fabric::post_writes`] |
//! | `WritesDone` → `WritesCompleted` / `WritesFailed` | `ClosePeer` → [`Fabric::close`] |
//! | `Disconnected` → `PeerDisconnected` | `Event` → the engine's queue |
//! | timer → `Timeout` at `poll_timeout()` | |
//!
//! A peer is a link: `PeerId(n)` is `LinkId(n)`. Nothing here holds a frame back or checks a
//! write: a result frame travels on the same queue pair after the writes it reports, and RC
//! places those writes first; a peer is reported disconnected only after its queue pair is
//! destroyed.
//!
//! The completion poller never waits for the engine: fabric events go to an inbox, applied at
//! once if the node's lock is free, else by whoever takes the lock next — every taker applies
//! the inbox first (the engine's guard also when it is released), so a frame that arrived while
//! the engine held its endpoint is seen before any deadline is checked. The poller retries
//! the lock on every round while the inbox is not empty.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::Duration as StdDuration;

use kvpipe_core::session::{
    CloseReason, Counters, DataPath, Registration, SendRequest, TransportInput, UsageError,
    WriteBatchId,
};
use kvpipe_core::wire::{AuxData, TransferStatus};
use kvpipe_core::Endpoint as CoreEndpoint;
use kvpipe_core::{
    BlockSource, ChunkSpec, Event, Instant, LayerRange, Output, PeerId, Receiver, ReceiverConfig,
    ReceiverSliceId, RequestId, Sender, SenderConfig, Submitted,
};
use kvpipe_observe::Observer;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::device::VerbsDevice;
use crate::fabric::{
    Fabric, FabricConfig, FabricEvent, FabricHandler, LinkId, Posted, WriteFailure,
};
use crate::memory::MemoryTable;

/// What the driver needs from a core endpoint: the transport contract's [`CoreEndpoint`],
/// owned by the node's threads.
pub(crate) trait Endpoint: CoreEndpoint + Send + 'static {}

impl<E: CoreEndpoint + Send + 'static> Endpoint for E {}

/// Configuration of a verbs node.
#[derive(Clone, Debug, Default)]
pub struct VerbsConfig {
    /// The fabric's sizes and timeouts.
    pub fabric: FabricConfig,
    /// The instant the node's clock counts from (default: when the node is made). Nodes that
    /// compare event times share one.
    pub origin: Option<std::time::Instant>,
}

/// Write batches whose timings are kept (the most recent ones).
const MAX_TIMINGS: usize = 1 << 16;

/// Everything behind the node's lock.
pub(crate) struct State<E> {
    endpoint: E,
    events: VecDeque<(Instant, Event)>,
    /// Batches posted and not reported: peer, bytes, issue time.
    in_flight: HashMap<WriteBatchId, (PeerId, u64, Instant)>,
    /// (bytes, issued, reported) of recent batches.
    timings: VecDeque<(u64, Instant, Instant)>,
    /// Spans, events and metrics of what the endpoint did.
    observer: Observer,
}

impl<E: Endpoint> State<E> {
    /// Hands a transport input to the endpoint (and to the observer first). A usage error
    /// would be a driver bug; the endpoint changed nothing then.
    fn feed(&mut self, now: Instant, input: TransportInput) {
        self.observer.input(now, &input);
        let _ = self.endpoint.handle_transport(now, input);
    }
}

pub(crate) struct Shared<E> {
    state: Arc<Mutex<State<E>>>,
    /// Fabric events not applied yet, in order.
    inbox: std::sync::Mutex<VecDeque<FabricEvent>>,
    inbox_len: AtomicUsize,
    events_cv: Condvar,
    timer_cv: Condvar,
    stop: AtomicBool,
    origin: std::time::Instant,
    fabric: OnceLock<Fabric>,
}

fn link(peer: PeerId) -> LinkId {
    LinkId(peer.0)
}

impl<E: Endpoint> Shared<E> {
    fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Takes the node's lock and applies the inbox.
    fn lock(&self) -> MutexGuard<'_, State<E>> {
        let mut st = self.state.lock();
        self.settle(&mut st);
        st
    }

    /// Applies every fabric event in the inbox (the caller holds the lock), then carries out
    /// what the core asked.
    fn settle(&self, st: &mut State<E>) {
        if self.inbox_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = self.now();
        loop {
            let batch: Vec<FabricEvent> = {
                let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
                self.inbox_len.store(0, Ordering::Release);
                inbox.drain(..).collect()
            };
            if batch.is_empty() {
                break;
            }
            for event in batch {
                self.apply(st, now, event);
            }
        }
        self.drain(st, now);
    }

    /// Carries out every pending output of the core.
    fn drain(&self, st: &mut State<E>, now: Instant) {
        let Some(fabric) = self.fabric.get() else {
            return;
        };
        loop {
            let mut reports: Vec<(WriteBatchId, TransferStatus)> = Vec::new();
            while let Some(out) = st.endpoint.poll_output() {
                st.observer.output(now, &out);
                match out {
                    Output::Transmit { peer, bytes, .. } => {
                        // A link that is down reports its disconnect; nothing to do here.
                        let _ = fabric.send(link(peer), bytes.to_vec());
                    }
                    Output::ExecuteWrites {
                        peer, batch, plan, ..
                    } => match fabric.post_writes(link(peer), batch.0, plan.extents()) {
                        Ok(Posted::Queued) => {
                            st.in_flight.insert(batch, (peer, plan.total_bytes(), now));
                        }
                        Ok(Posted::Done) => reports.push((batch, TransferStatus::Success)),
                        Err(WriteFailure::LinkDown(_)) => {}
                        Err(_) => reports.push((batch, TransferStatus::WriteFailed)),
                    },
                    Output::ClosePeer { peer, reason } => {
                        // After a refused handshake the peer should still read why.
                        let graceful = matches!(
                            reason,
                            CloseReason::HandshakeRejected
                                | CloseReason::RejectedByPeer
                                | CloseReason::ProtocolViolation
                        );
                        fabric.close(link(peer), graceful);
                    }
                    Output::Event(event) => {
                        st.events.push_back((now, event));
                        self.events_cv.notify_all();
                    }
                }
            }
            if reports.is_empty() {
                break;
            }
            for (batch, status) in reports {
                report_writes(st, now, batch, status);
            }
        }
        st.observer.counters(&st.endpoint);
        self.timer_cv.notify_all();
    }
}

impl<E: Endpoint> FabricHandler for Shared<E> {
    fn handle(&self, event: FabricEvent) {
        {
            let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
            inbox.push_back(event);
            self.inbox_len.store(inbox.len(), Ordering::Release);
        }
        self.idle();
    }

    fn idle(&self) {
        if self.inbox_len.load(Ordering::Acquire) > 0 {
            if let Some(mut st) = self.state.try_lock() {
                self.settle(&mut st);
            }
        }
    }
}

impl<E: Endpoint> Shared<E> {
    /// Feeds one fabric event to the core (outputs are carried out by the caller's drain).
    fn apply(&self, st: &mut State<E>, now: Instant, event: FabricEvent) {
        match event {
            FabricEvent::Connected { link } => {
                let peer = PeerId(link.0);
                st.feed(now, TransportInput::PeerConnected { peer });
            }
            FabricEvent::Message { link, bytes } => {
                // The core decodes it at the negotiated version; bytes that are no frame fail
                // the peer's sessions and close it.
                let input = TransportInput::FrameReceived {
                    peer: PeerId(link.0),
                    bytes: bytes.into(),
                };
                st.feed(now, input);
            }
            FabricEvent::WritesDone { token, result, .. } => {
                let batch = WriteBatchId(token);
                if let Some((_, bytes, issued)) = st.in_flight.remove(&batch) {
                    if st.timings.len() >= MAX_TIMINGS {
                        st.timings.pop_front();
                    }
                    st.timings.push_back((bytes, issued, now));
                }
                let status = match result {
                    Ok(()) => TransferStatus::Success,
                    Err(_) => TransferStatus::WriteFailed,
                };
                report_writes(st, now, batch, status);
            }
            FabricEvent::Disconnected { link, .. } => {
                let peer = PeerId(link.0);
                st.in_flight.retain(|_, (p, _, _)| *p != peer);
                st.feed(now, TransportInput::PeerDisconnected { peer });
            }
        }
    }
}

/// Reports a write batch's outcome to the endpoint (a receiver takes none: ignored).
fn report_writes<E: Endpoint>(
    st: &mut State<E>,
    now: Instant,
    batch: WriteBatchId,
    status: TransferStatus,
) {
    let input = if status == TransferStatus::Success {
        TransportInput::WritesCompleted { batch }
    } else {
        TransportInput::WritesFailed { batch, status }
    };
    st.feed(now, input);
}

fn timer_loop<E: Endpoint>(shared: &Shared<E>) {
    let mut st = shared.lock();
    while !shared.stop.load(Ordering::Acquire) {
        // What arrived while others held the lock counts before any deadline does.
        shared.settle(&mut st);
        let now = shared.now();
        let next = st.endpoint.poll_timeout();
        if next.is_some_and(|at| at <= now) {
            st.feed(now, TransportInput::Timeout);
            shared.drain(&mut st, now);
            continue;
        }
        let wait = next.map_or(StdDuration::from_millis(500), |at| {
            StdDuration::from(at - now).min(StdDuration::from_millis(500))
        });
        shared
            .timer_cv
            .wait_for(&mut st, wait.max(StdDuration::from_micros(100)));
    }
}

/// A core endpoint driven over RDMA verbs: [`VerbsSender`] (prefill side) or
/// [`VerbsReceiver`] (decode side).
///
/// Make one with [`VerbsNode::sender`] / [`VerbsNode::receiver`] over an opened device and
/// the node's registered memory, then [`listen`](Self::listen) and/or
/// [`connect`](Self::connect); every link is a peer. Engine commands go through the named
/// methods or the [`endpoint`](Self::endpoint) guard; events come from
/// [`next_event`](Self::next_event).
#[allow(private_bounds)]
pub struct VerbsNode<E: Endpoint> {
    shared: Arc<Shared<E>>,
    timer: Option<JoinHandle<()>>,
}

/// A prefill-side node: a core [`Sender`] over verbs. Its regions are registered
/// [`Exposure::Local`](crate::Exposure::Local).
pub type VerbsSender = VerbsNode<Sender>;
/// A decode-side node: a core [`Receiver`] over verbs. Its regions are registered
/// [`Exposure::RemoteWrite`](crate::Exposure::RemoteWrite).
pub type VerbsReceiver = VerbsNode<Receiver>;

#[allow(private_bounds)]
impl<E: Endpoint> VerbsNode<E> {
    fn start(
        endpoint: E,
        device: VerbsDevice,
        memory: MemoryTable,
        config: VerbsConfig,
    ) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            inbox: std::sync::Mutex::new(VecDeque::new()),
            inbox_len: AtomicUsize::new(0),
            state: Arc::new(Mutex::new(State {
                observer: Observer::new(endpoint.role(), "verbs"),
                endpoint,
                events: VecDeque::new(),
                in_flight: HashMap::new(),
                timings: VecDeque::new(),
            })),
            events_cv: Condvar::new(),
            timer_cv: Condvar::new(),
            stop: AtomicBool::new(false),
            origin: config.origin.unwrap_or_else(std::time::Instant::now),
            fabric: OnceLock::new(),
        });
        let fabric = Fabric::new(device, memory, config.fabric, shared.clone())?;
        let _ = shared.fabric.set(fabric);
        let timer = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("kvpipe-verbs-timer".into())
                .spawn(move || timer_loop(&shared))?
        };
        Ok(VerbsNode {
            shared,
            timer: Some(timer),
        })
    }

    /// The fabric under the node (links, device, failure injection for tests).
    pub fn fabric(&self) -> &Fabric {
        self.shared.fabric.get().expect("set at start")
    }

    /// Accepts connections on `addr`; each becomes a peer.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        self.fabric().listen(addr)
    }

    /// Connects to a node listening at `addr`; the handshake starts at once. Peers are numbered
    /// from 0 in the order links come up. Do not call it while holding an
    /// [`EndpointGuard`].
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        self.fabric().connect(addr).map(|l| PeerId(l.0))
    }

    /// Exclusive access to the core endpoint; outputs are carried out when the guard drops.
    pub fn endpoint(&self) -> EndpointGuard<E> {
        let mut guard = self.shared.state.lock_arc();
        self.shared.settle(&mut guard);
        EndpointGuard {
            guard: Some(guard),
            shared: self.shared.clone(),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut E, Instant) -> R) -> R {
        let mut st = self.shared.lock();
        let now = self.shared.now();
        let r = f(&mut st.endpoint, now);
        self.shared.drain(&mut st, now);
        r
    }

    /// The node's current time.
    pub fn now(&self) -> Instant {
        self.shared.now()
    }

    /// The next event, waiting up to `timeout`.
    pub fn next_event(&self, timeout: StdDuration) -> Option<Event> {
        self.next_event_at(timeout).map(|(_, e)| e)
    }

    /// The next event and the time it was reported at, waiting up to `timeout`.
    pub fn next_event_at(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        let deadline = crate::link::later(std::time::Instant::now(), timeout);
        let mut st = self.shared.lock();
        loop {
            if let Some(e) = st.events.pop_front() {
                return Some(e);
            }
            if self
                .shared
                .events_cv
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                return st.events.pop_front();
            }
        }
    }

    /// Every queued event with its time, without waiting.
    pub fn take_events(&self) -> Vec<(Instant, Event)> {
        self.shared.lock().events.drain(..).collect()
    }

    /// The peers whose links are up or closing.
    pub fn peers(&self) -> Vec<PeerId> {
        self.fabric()
            .links()
            .into_iter()
            .map(|l| PeerId(l.0))
            .collect()
    }

    /// Write batches posted and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.shared.lock().in_flight.len()
    }

    /// `(bytes, issued, reported)` of recent write batches, in report order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.shared.lock().timings.iter().copied().collect()
    }

    /// Closes every link, gracefully within `within` (queued frames and writes are sent and
    /// acknowledged first), then stops the node. Returns whether every link closed in order.
    pub fn close(mut self, within: StdDuration) -> bool {
        let clean = self.fabric().close_all(true, within);
        self.stop();
        clean
    }

    /// Closes every link at once and stops the node (what dropping it does).
    pub fn shutdown(&self) {
        self.fabric().shutdown();
    }

    fn stop(&mut self) {
        self.fabric().shutdown();
        self.shared.stop.store(true, Ordering::Release);
        self.shared.timer_cv.notify_all();
        if let Some(t) = self.timer.take() {
            let _ = t.join();
        }
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> Drop for VerbsNode<E> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl VerbsNode<Sender> {
    /// A prefill-side node on `device` reading sources from `memory`.
    pub fn sender(
        config: SenderConfig,
        device: VerbsDevice,
        memory: MemoryTable,
        verbs: VerbsConfig,
    ) -> io::Result<Self> {
        let sender = Sender::new(config).map_err(io::Error::other)?;
        Self::start(sender, device, memory, verbs)
    }

    /// Opens a request (see [`Sender::open_request`]).
    pub fn open_request(&self, req: SendRequest) -> Result<(), UsageError> {
        self.with(|ep, now| ep.open_request(now, req))
    }

    /// Submits a computed chunk (see [`Sender::submit_chunk`]).
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        // The engine's block source runs with the driver unlocked (see kvpipe-tcp's).
        let query = self.with(|ep, _| ep.chunk_query(request, &spec))?;
        let runs = query.ask(source)?;
        self.with(|ep, now| ep.submit_chunk_runs(now, request, spec, runs))
    }

    /// Submits layers `layers` of a computed chunk, as the engine finishes them (see
    /// [`Sender::submit_chunk_layers`]). Only a chunk's first range asks `source` for blocks,
    /// with the driver unlocked as [`submit_chunk`](Self::submit_chunk) does.
    pub fn submit_chunk_layers(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        let query = self.with(|ep, _| ep.chunk_layers_query(request, &spec, layers))?;
        let runs = query.ask(source)?;
        self.with(|ep, now| ep.submit_chunk_layers_runs(now, request, spec, layers, runs))
    }

    /// Submits the request's aux data.
    pub fn submit_aux(&self, request: RequestId, data: AuxData) -> Result<(), UsageError> {
        self.with(|ep, now| ep.submit_aux(now, request, data))
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event.
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.retire(now, request))
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.shared.lock().endpoint.counters()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.shared.lock().endpoint.is_peer_ready(peer)
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.shared.lock().endpoint.session_count()
    }
}

impl VerbsNode<Receiver> {
    /// A decode-side node on `device` exposing `memory`'s remote-write regions to its peers.
    pub fn receiver(
        config: ReceiverConfig,
        device: VerbsDevice,
        memory: MemoryTable,
        verbs: VerbsConfig,
    ) -> io::Result<Self> {
        // RC places a writer's data before its later frames: results are trusted on arrival.
        let mut config = config;
        config.data_path = DataPath::Ordered;
        let receiver = Receiver::new(config).map_err(io::Error::other)?;
        Self::start(receiver, device, memory, verbs)
    }

    /// Registers a request's destination blocks (see [`Receiver::register`]).
    pub fn register(&self, reg: Registration) -> Result<ReceiverSliceId, UsageError> {
        self.with(|ep, now| ep.register(now, reg))
    }

    /// Cancels a request.
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event.
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.retire(now, request))
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.shared.lock().endpoint.counters()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.shared.lock().endpoint.is_peer_ready(peer)
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.shared.lock().endpoint.session_count()
    }
}

/// Exclusive access to a node's core endpoint, for engine commands the node does not wrap.
/// While it lives the node's threads wait; when it drops, every output the commands produced
/// is carried out.
#[allow(private_bounds)]
pub struct EndpointGuard<E: Endpoint> {
    guard: Option<parking_lot::ArcMutexGuard<parking_lot::RawMutex, State<E>>>,
    shared: Arc<Shared<E>>,
}

#[allow(private_bounds)]
impl<E: Endpoint> EndpointGuard<E> {
    /// The node's current time.
    pub fn now(&self) -> Instant {
        self.shared.now()
    }

    /// Write batches posted and not reported yet.
    pub fn writes_in_flight(&self) -> usize {
        self.guard.as_ref().map_or(0, |st| st.in_flight.len())
    }

    /// `(bytes, issued, reported)` of recent write batches, in report order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.guard
            .as_ref()
            .map_or_else(Vec::new, |st| st.timings.iter().copied().collect())
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> std::ops::Deref for EndpointGuard<E> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.guard.as_ref().expect("held until drop").endpoint
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> std::ops::DerefMut for EndpointGuard<E> {
    fn deref_mut(&mut self) -> &mut E {
        &mut self.guard.as_mut().expect("held until drop").endpoint
    }
}

#[allow(private_bounds)]
impl<E: Endpoint> Drop for EndpointGuard<E> {
    fn drop(&mut self) {
        if let Some(mut st) = self.guard.take() {
            self.shared.settle(&mut st);
            let now = self.shared.now();
            self.shared.drain(&mut st, now);
        }
    }
}
