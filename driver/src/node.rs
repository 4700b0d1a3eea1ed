//! The driver: one core endpoint behind one lock. Every input goes in through
//! [`Locked::feed`]-and-[`Driver::drain`], under the lock, in one place: the observer sees it,
//! the endpoint applies it, and its outputs are carried out at once, in the order it produced
//! them: frames and write batches go to the transport's [`Io`], events to the engine's queue,
//! write reports straight back into the endpoint.
//!
//! A transport thread that must never wait for the engine (a completion poller) posts what
//! it saw to the inbox ([`Driver::post`]); whoever takes the lock next applies the inbox first,
//! so nothing that arrived is checked against a deadline after it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use kvpipe_core::session::{CloseReason, DataWriteHeaders, WriteBatchId};
use kvpipe_core::{
    DataPathNegotiation, Endpoint, Event, Instant, Output, PeerId, TransportInput, WritePlan,
};
use kvpipe_observe::Observer;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::batches::Batches;
use crate::clock::{Clock, WallInstant};
use crate::events::EventQueue;

/// What a transport does with the endpoint's outputs. Its methods run under the node's lock:
/// none may block or wait for the peer.
pub trait Io: Send + 'static {
    /// Queues an encoded frame to `peer`. A peer without a link is dropped silently: its
    /// disconnect is (or was) reported.
    fn transmit(&mut self, peer: PeerId, bytes: Bytes);

    /// Hands a write batch to the transport (see [`Posted`]).
    fn post_writes(
        &mut self,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &WritePlan,
        headers: &DataWriteHeaders,
    ) -> Posted;

    /// Closes `peer`'s link for `reason`; returns when the timer must look again (the close's
    /// deadline), if it must.
    fn close_peer(&mut self, peer: PeerId, reason: CloseReason) -> Option<WallInstant>;

    /// Sees every event before the engine does.
    fn saw_event(&mut self, _event: &Event) {}

    /// Takes a step of the data-path negotiation ([`DataPathNegotiation`]) and returns an input
    /// for the endpoint to take at once, if there is one. A transport that evaluates a peer's
    /// offer later (it may take a while) returns `None` and delivers
    /// [`TransportInput::DataPathAnswered`] itself, within the handshake deadline. By default
    /// every offer is declined at once with an empty answer (a transport with no data path of
    /// its own to offer), and a peer's answer is ignored.
    fn data_path(&mut self, negotiation: DataPathNegotiation) -> Option<TransportInput> {
        match negotiation {
            DataPathNegotiation::Offered { peer, .. } => Some(TransportInput::DataPathAnswered {
                peer,
                answer: Bytes::new(),
            }),
            DataPathNegotiation::Answered { .. } => None,
        }
    }

    /// The timer's round: deals with the transport's own deadlines passed by `now` and returns
    /// the next one.
    fn timer_round(&mut self, _now: WallInstant) -> Option<WallInstant> {
        None
    }
}

/// What became of a write batch handed to [`Io::post_writes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// In flight, all of it: the transport reports it with [`Arrival::BatchDone`]. `done`:
    /// every part was done already (the report is made now). A transport that can queue only
    /// part of a batch refuses it whole ([`Refused`](Self::Refused)), or leaves it to the
    /// peer's disconnect ([`NoPeer`](Self::NoPeer)).
    Queued {
        /// Already done.
        done: bool,
    },
    /// Nothing to write: it completes at once.
    Empty,
    /// Refused whole: it fails at once.
    Refused,
    /// The peer has no link any more: nothing is reported (its disconnect drops the batch).
    NoPeer,
}

/// What a transport saw, for the endpoint.
#[derive(Debug)]
pub enum Arrival {
    /// An input as it is (a frame, a connected peer, a landed write).
    Input(TransportInput),
    /// The transport finished a batch it took as [`Posted::Queued`] (`ok`: every byte placed).
    BatchDone {
        /// The batch.
        batch: WriteBatchId,
        /// Whether all of it was placed.
        ok: bool,
    },
    /// The peer's link is gone and nothing of it touches memory any more: its batches are
    /// forgotten and the endpoint hears `PeerDisconnected`.
    PeerGone(PeerId),
}

/// Everything behind the node's lock.
pub struct Locked<E, T> {
    /// The core endpoint.
    pub endpoint: E,
    /// The transport's state (links, queues).
    pub io: T,
    /// Write batches in flight.
    pub batches: Batches,
    /// Spans, events and metrics of what the endpoint did.
    observer: Observer,
    /// When the sleeping timer thread wakes (`None` while it is awake).
    timer_at: Option<WallInstant>,
}

impl<E: Endpoint, T> Locked<E, T> {
    /// Hands a transport input to the endpoint (and to the observer first). A usage error
    /// would be a driver bug (an unknown peer, ticket or batch); the endpoint changed nothing
    /// then, so it is dropped.
    pub fn feed(&mut self, now: Instant, input: TransportInput) {
        self.observer.input(now, &input);
        let _ = self.endpoint.handle_transport(now, input);
    }

    /// Applies `arrival` (its outputs are carried out by the caller's [`Driver::drain`]).
    pub fn apply(&mut self, now: Instant, arrival: Arrival) {
        match arrival {
            Arrival::Input(input) => self.feed(now, input),
            Arrival::BatchDone { batch, ok } => {
                if let Some(report) = self.batches.finish(batch, ok, now) {
                    self.feed(now, report);
                }
            }
            Arrival::PeerGone(peer) => {
                self.batches.forget_peer(peer);
                self.feed(now, TransportInput::PeerDisconnected { peer });
            }
        }
    }
}

/// The node: the locked state, the inbox, the engine's event queue, the clock and the timer.
pub struct Driver<E, T> {
    state: Arc<Mutex<Locked<E, T>>>,
    /// Arrivals not applied yet, in order.
    inbox: Mutex<VecDeque<Arrival>>,
    inbox_len: AtomicUsize,
    events: EventQueue,
    clock: Clock,
    /// Wakes the timer thread.
    timer: Condvar,
    stopped: AtomicBool,
}

/// Longest sleep of the timer thread between checks.
const MAX_SLEEP: StdDuration = StdDuration::from_millis(500);

impl<E: Endpoint + Send + 'static, T: Io> Driver<E, T> {
    /// A node driving `endpoint` over `io`, its clock counting from `origin`; `transport` names
    /// it in the observer's spans and metrics.
    pub fn new(endpoint: E, io: T, transport: &'static str, origin: WallInstant) -> Arc<Self> {
        Arc::new(Driver {
            state: Arc::new(Mutex::new(Locked {
                observer: Observer::new(endpoint.role(), transport),
                endpoint,
                io,
                batches: Batches::default(),
                timer_at: None,
            })),
            inbox: Mutex::new(VecDeque::new()),
            inbox_len: AtomicUsize::new(0),
            events: EventQueue::default(),
            clock: Clock::starting_at(origin),
            timer: Condvar::new(),
            stopped: AtomicBool::new(false),
        })
    }

    /// The core's now.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The node's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The engine's event queue.
    pub fn events(&self) -> &EventQueue {
        &self.events
    }

    /// Takes the node's lock; the inbox is applied first.
    pub fn lock(&self) -> MutexGuard<'_, Locked<E, T>> {
        let mut st = self.state.lock();
        self.settle(&mut st);
        st
    }

    /// Runs `f` on the endpoint under the lock with the node's now, then carries out its
    /// outputs.
    pub fn with<R>(&self, f: impl FnOnce(&mut E, Instant) -> R) -> R {
        let mut st = self.lock();
        let now = self.now();
        let r = f(&mut st.endpoint, now);
        self.drain(&mut st, now);
        r
    }

    /// Applies `arrival` under the lock (waiting for it) and carries out what followed.
    pub fn deliver(&self, arrival: Arrival) {
        let mut st = self.lock();
        let now = self.now();
        st.apply(now, arrival);
        self.drain(&mut st, now);
    }

    /// Queues `arrival` for whoever takes the lock next, and applies the inbox at once if the
    /// lock is free. Never waits for the lock.
    pub fn post(&self, arrival: Arrival) {
        {
            let mut inbox = self.inbox.lock();
            inbox.push_back(arrival);
            self.inbox_len.store(inbox.len(), Ordering::Release);
        }
        self.try_settle();
    }

    /// Applies the inbox if it is not empty and the lock is free (a poller calls it on each
    /// round while arrivals wait).
    pub fn try_settle(&self) {
        if self.inbox_len.load(Ordering::Acquire) > 0 {
            if let Some(mut st) = self.state.try_lock() {
                self.settle(&mut st);
            }
        }
    }

    /// Applies every arrival in the inbox (the caller holds the lock), then carries out what
    /// the endpoint asked.
    pub(crate) fn settle(&self, st: &mut Locked<E, T>) {
        if self.inbox_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = self.now();
        loop {
            let batch: Vec<Arrival> = {
                let mut inbox = self.inbox.lock();
                self.inbox_len.store(0, Ordering::Release);
                inbox.drain(..).collect()
            };
            if batch.is_empty() {
                break;
            }
            for arrival in batch {
                st.apply(now, arrival);
            }
        }
        self.drain(st, now);
    }

    /// Carries out every pending output of the endpoint, in order; a write batch's report
    /// known at once goes back into the endpoint before the next round.
    pub fn drain(&self, st: &mut Locked<E, T>, now: Instant) {
        let mut reports = Vec::new();
        loop {
            while let Some(output) = st.endpoint.poll_output() {
                st.observer.output(now, &output);
                match output {
                    Output::Transmit { peer, bytes, .. } => st.io.transmit(peer, bytes),
                    Output::ExecuteWrites {
                        peer,
                        batch,
                        plan,
                        headers,
                        ..
                    } => {
                        let posted = st.io.post_writes(peer, batch, &plan, &headers);
                        reports.extend(self.posted(st, now, peer, batch, &plan, posted));
                    }
                    Output::ClosePeer { peer, reason } => {
                        if let Some(at) = st.io.close_peer(peer, reason) {
                            self.wake_timer_by(st, at);
                        }
                    }
                    Output::Event(event) => {
                        st.io.saw_event(&event);
                        self.events.push(now, event);
                    }
                    Output::DataPath(negotiation) => reports.extend(st.io.data_path(negotiation)),
                }
            }
            if reports.is_empty() {
                break;
            }
            for report in reports.drain(..) {
                st.feed(now, report);
            }
        }
        st.observer.counters(&st.endpoint);
        if let Some(at) = st
            .endpoint
            .poll_timeout()
            .and_then(|at| self.clock.wall(at))
        {
            self.wake_timer_by(st, at);
        }
    }

    /// Records a posted batch; its report where it is known at once.
    fn posted(
        &self,
        st: &mut Locked<E, T>,
        now: Instant,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &WritePlan,
        posted: Posted,
    ) -> Option<TransportInput> {
        match posted {
            Posted::Queued { done } => {
                st.batches.issue(batch, peer, plan.total_bytes(), now);
                if done {
                    return st.batches.finish(batch, true, now);
                }
                None
            }
            Posted::Empty => Some(TransportInput::WritesCompleted { batch }),
            Posted::Refused => Some(TransportInput::WritesFailed {
                batch,
                status: kvpipe_core::wire::TransferStatus::WriteFailed,
            }),
            Posted::NoPeer => None,
        }
    }

    /// Makes the timer thread wake by `at` (it re-reads every deadline when it wakes).
    pub fn wake_timer_by(&self, st: &mut Locked<E, T>, at: WallInstant) {
        if st.timer_at.is_some_and(|t| at < t) {
            st.timer_at = Some(at);
            self.timer.notify_one();
        }
    }

    /// Write batches in flight.
    pub fn writes_in_flight(&self) -> usize {
        self.lock().batches.in_flight()
    }

    /// `(bytes, issued, done)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.lock().batches.timings()
    }

    /// Starts the timer thread, named `name`: it delivers the endpoint's timeouts and the
    /// transport's own ([`Io::timer_round`]) until [`stop`](Self::stop).
    pub fn spawn_timer(
        self: &Arc<Self>,
        name: &str,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let driver = self.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || driver.timer_loop())
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Makes the timer thread end (join it afterwards).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Under the lock, so the timer cannot miss it between its check and its wait.
        let _st = self.state.lock();
        self.timer.notify_all();
    }

    fn timer_loop(&self) {
        let mut st = self.lock();
        loop {
            if self.is_stopped() {
                return;
            }
            // What arrived while others held the lock counts before any deadline does.
            self.settle(&mut st);
            let now = self.now();
            if st.endpoint.poll_timeout().is_some_and(|at| at <= now) {
                st.feed(now, TransportInput::Timeout);
                self.drain(&mut st, now);
                continue;
            }
            let wall = WallInstant::now();
            let mut wake = wall + MAX_SLEEP;
            if let Some(at) = st.io.timer_round(wall) {
                wake = wake.min(at);
            }
            if let Some(at) = st
                .endpoint
                .poll_timeout()
                .and_then(|at| self.clock.wall(at))
            {
                wake = wake.min(at);
            }
            st.timer_at = Some(wake);
            self.timer.wait_until(&mut st, wake);
            st.timer_at = None;
        }
    }

    /// Exclusive access to the endpoint (see [`EndpointGuard`](crate::EndpointGuard)).
    pub fn guard(self: &Arc<Self>) -> crate::EndpointGuard<E, T> {
        let mut st = self.state.lock_arc();
        self.settle(&mut st);
        crate::EndpointGuard::new(st, self.clone())
    }
}

/// A transport's node built on this driver: what harnesses and the engine API reach through.
pub trait Driven {
    /// The core endpoint it drives.
    type Endpoint: Endpoint + Send + 'static;
    /// The transport's I/O.
    type Io: Io;
    /// The driver under the node.
    fn driver(&self) -> &Arc<Driver<Self::Endpoint, Self::Io>>;
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use kvpipe_core::session::LocalHello;
    use kvpipe_core::wire::Topology;
    use kvpipe_core::{InstanceId, Receiver, ReceiverConfig};

    use super::*;

    /// An `Io` that counts the frames it was asked to send.
    #[derive(Default)]
    struct Counting(Arc<AtomicU32>);

    impl Io for Counting {
        fn transmit(&mut self, _peer: PeerId, _bytes: Bytes) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        fn post_writes(
            &mut self,
            _: PeerId,
            _: WriteBatchId,
            _: &WritePlan,
            _: &DataWriteHeaders,
        ) -> Posted {
            Posted::Refused
        }
        fn close_peer(&mut self, _: PeerId, _: CloseReason) -> Option<WallInstant> {
            None
        }
    }

    fn receiver() -> Receiver {
        let hello = LocalHello::new(InstanceId(1), Topology::default(), vec![]);
        Receiver::new(ReceiverConfig::new(hello, 7)).unwrap()
    }

    #[test]
    fn what_arrives_while_the_engine_holds_the_endpoint_is_applied_when_it_lets_go() {
        let sent = Arc::new(AtomicU32::new(0));
        let driver = Driver::new(
            receiver(),
            Counting(sent.clone()),
            "test",
            WallInstant::now(),
        );
        let guard = driver.guard();
        // The poller cannot take the lock: the arrival waits in the inbox.
        driver.post(Arrival::Input(TransportInput::PeerConnected {
            peer: PeerId(3),
        }));
        assert_eq!(guard.peer_count(), 0);
        assert_eq!(sent.load(Ordering::Relaxed), 0);
        drop(guard);
        // Applied on release, and its output (the handshake's first frame) carried out, before
        // anyone takes the lock again.
        assert_eq!(sent.load(Ordering::Relaxed), 1);
        assert_eq!(driver.lock().endpoint.peer_count(), 1);
    }

    #[test]
    fn the_timer_thread_ends_when_the_driver_stops() {
        let driver = Driver::new(receiver(), Counting::default(), "test", WallInstant::now());
        let timer = driver.spawn_timer("kvpipe-test-timer").unwrap();
        driver.stop();
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || done.send(timer.join().is_ok()));
        assert_eq!(ended.recv_timeout(StdDuration::from_secs(10)), Ok(true));
        assert!(driver.is_stopped());
    }
}
