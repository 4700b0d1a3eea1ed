//! The blocking driver's shared state: the core endpoint behind one lock, the peers and their
//! connections, the timer thread and the accept thread.
//!
//! Every input is fed to the core under the lock, and the outputs are drained under it at once:
//! frames and data writes are queued to connection writer threads (never written under the
//! lock), events go to the engine's queue. A peer's `PeerDisconnected` is reported only when
//! the last of its connection threads has exited, so no write of a closed peer still touches
//! memory after the core hears of it.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use parking_lot::{Condvar, Mutex as StateMutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration as StdDuration;

use kvpipe_core::session::{CloseReason, WriteBatchId};
use kvpipe_core::wire::{Frame, TransferStatus, PROTOCOL_VERSION};
use kvpipe_core::{Event, Instant, Output, PeerId, RequestId};

use super::conn::{reader_loop, writer_loop, Job};
use crate::config::TcpConfig;
use crate::endpoint::Endpoint;
use crate::grant::GrantTable;
use crate::memory::RegionTable;
use crate::pieces::split_plan;
use crate::preamble::{Preamble, PREAMBLE_LEN};
use crate::stats::{bump, StatCells};

/// The queue of a connection's writer (a thread or a task).
pub(crate) enum JobTx {
    /// A writer thread.
    Thread(mpsc::Sender<Job>),
    /// A writer task.
    #[cfg(feature = "tokio")]
    Task(tokio::sync::mpsc::UnboundedSender<Job>),
}

impl JobTx {
    fn send(&self, job: Job) -> Result<(), ()> {
        match self {
            JobTx::Thread(tx) => tx.send(job).map_err(|_| ()),
            #[cfg(feature = "tokio")]
            JobTx::Task(tx) => tx.send(job).map_err(|_| ()),
        }
    }
}

/// The receiving end of a connection writer's queue, until its writer starts.
pub(crate) enum JobRx {
    /// For a writer thread.
    Thread(mpsc::Receiver<Job>),
    /// For a writer task.
    #[cfg(feature = "tokio")]
    Task(tokio::sync::mpsc::UnboundedReceiver<Job>),
}

/// Where connection I/O runs.
#[derive(Clone, Debug)]
pub(crate) enum Backend {
    /// One reader and one writer thread per connection.
    Threads,
    /// One reader and one writer task per connection on this runtime.
    #[cfg(feature = "tokio")]
    Tokio(tokio::runtime::Handle),
}

/// One connection of a peer, as the node holds it.
pub(crate) struct ConnHandle {
    /// A handle for shutting the socket down from any thread.
    stream: TcpStream,
    /// The writer's queue (`None` once closing).
    tx: Option<JobTx>,
    /// The reader's and writer's halves and the writer's queue, until the bundle starts.
    pending: Option<(TcpStream, TcpStream, JobRx)>,
}

/// A connected peer: a bundle of connections.
pub(crate) struct PeerLink {
    token: u64,
    expected: usize,
    conns: Vec<ConnHandle>,
    /// The whole bundle is attached and its threads started.
    started: bool,
    /// When the first connection was attached (an unstarted bundle is dropped after the
    /// preamble timeout).
    attached_at: std::time::Instant,
    /// Connection threads still running.
    threads: u32,
    /// Closing: nothing new is queued to the connections.
    pub(crate) closing: Arc<AtomicBool>,
    /// Readers stop at their next wake-up (an abrupt close, or one the core asked for). An
    /// orderly close leaves it unset: readers read on until the peer's end of stream.
    pub(crate) stop: Arc<AtomicBool>,
    /// An orderly close is under way and nothing went wrong in it so far.
    orderly: bool,
    /// No frame or write from the peer is accepted any more.
    pub(crate) untrusted: bool,
    /// Sockets are shut down at this time if a graceful close has not finished.
    close_deadline: Option<std::time::Instant>,
    /// The negotiated protocol version (0 before the handshake).
    pub(crate) negotiated: Arc<AtomicU16>,
}

impl PeerLink {
    fn version(&self) -> u16 {
        match self.negotiated.load(Ordering::Relaxed) {
            0 => PROTOCOL_VERSION,
            v => v,
        }
    }

    fn shutdown_sockets(&mut self) {
        self.orderly = false;
        self.stop.store(true, Ordering::Release);
        for c in &mut self.conns {
            c.tx = None;
            let _ = c.stream.shutdown(Shutdown::Both);
        }
    }
}

/// Everything behind the node's lock.
pub(crate) struct State<E> {
    pub(crate) endpoint: E,
    pub(crate) peers: HashMap<PeerId, PeerLink>,
    tokens: HashMap<u64, PeerId>,
    next_peer: u32,
    pub(crate) events: VecDeque<(Instant, Event)>,
    /// Write batches in flight: the peer and the connection parts still being written.
    batches: HashMap<WriteBatchId, (PeerId, u32)>,
    /// Issue time and bytes of the batches in flight.
    issued: HashMap<WriteBatchId, (u64, Instant)>,
    /// (bytes, issued, reported) of the most recent completed batches.
    pub(crate) timings: VecDeque<(u64, Instant, Instant)>,
    pub(crate) grants: GrantTable,
    shutdown: bool,
    /// The node is closing: no new connection is attached.
    closing_node: bool,
    /// While the node closes: how each removed peer ended (`true`: orderly).
    closed: HashMap<PeerId, bool>,
}

/// The node shared by the engine's handle and every thread.
pub(crate) struct Shared<E> {
    pub(crate) state: Arc<StateMutex<State<E>>>,
    events_cv: Condvar,
    timer_cv: Condvar,
    origin: std::time::Instant,
    pub(crate) regions: RegionTable,
    pub(crate) config: TcpConfig,
    pub(crate) stats: StatCells,
    token_counter: AtomicU64,
    backend: Backend,
    /// Wakes async waiters for events.
    #[cfg(feature = "tokio")]
    pub(crate) events_notify: tokio::sync::Notify,
}

impl<E: Endpoint> Shared<E> {
    /// The core's notion of now.
    pub(crate) fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State<E>> {
        self.state.lock()
    }

    /// Runs `f` on the state, then drains the core's outputs.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut State<E>, Instant) -> R) -> R {
        let mut st = self.lock();
        let now = self.now();
        let r = f(&mut st, now);
        self.drain(&mut st, now);
        r
    }

    /// Carries out every pending output of the core.
    pub(crate) fn drain(&self, st: &mut State<E>, now: Instant) {
        loop {
            let mut reports: Vec<(WriteBatchId, TransferStatus)> = Vec::new();
            while let Some(out) = st.endpoint.poll_output() {
                match out {
                    Output::Transmit { peer, frame, .. } => {
                        let Some(link) = st.peers.get_mut(&peer) else {
                            continue;
                        };
                        match &frame {
                            Frame::HelloAccept(a) => {
                                link.negotiated.store(a.version, Ordering::Relaxed);
                            }
                            Frame::RecvRegistration(reg) => {
                                // The grant covers exactly the registered blocks, for exactly
                                // the peers the registration goes to.
                                let groups = st.endpoint.local_groups();
                                st.grants.grant(peer, reg, groups);
                            }
                            _ => {}
                        }
                        let Some(link) = st.peers.get_mut(&peer) else {
                            continue;
                        };
                        let mut bytes = vec![0; frame.encoded_len()];
                        if frame.emit_versioned(link.version(), &mut bytes).is_ok() {
                            if let Some(tx) = link.conns.first().and_then(|c| c.tx.as_ref()) {
                                let _ = tx.send(Job::Frame(bytes));
                            }
                        }
                    }
                    Output::ExecuteWrites {
                        peer,
                        batch,
                        request,
                        grant,
                        plan,
                        ..
                    } => {
                        let Some(link) = st.peers.get_mut(&peer) else {
                            continue;
                        };
                        let parts = split_plan(
                            &plan,
                            request,
                            grant,
                            link.version(),
                            link.conns.len(),
                            &self.config,
                            &self.regions,
                        );
                        match parts {
                            Err(_) => reports.push((batch, TransferStatus::WriteFailed)),
                            Ok(parts) => {
                                let mut queued = 0;
                                for (c, pieces) in parts.into_iter().enumerate() {
                                    if pieces.is_empty() {
                                        continue;
                                    }
                                    if let Some(tx) = link.conns[c].tx.as_ref() {
                                        if tx.send(Job::Data { batch, pieces }).is_ok() {
                                            queued += 1;
                                        }
                                    }
                                }
                                if queued == 0 && !link.closing.load(Ordering::Relaxed) {
                                    reports.push((batch, TransferStatus::Success));
                                } else if queued > 0 {
                                    st.batches.insert(batch, (peer, queued));
                                    st.issued.insert(batch, (plan.total_bytes(), now));
                                }
                            }
                        }
                    }
                    Output::ClosePeer { peer, reason } => {
                        let graceful = matches!(
                            reason,
                            CloseReason::HandshakeRejected
                                | CloseReason::RejectedByPeer
                                | CloseReason::ProtocolViolation
                        );
                        self.begin_close(st, peer, graceful);
                    }
                    Output::Event(event) => self.on_event(st, now, event),
                }
            }
            if reports.is_empty() {
                break;
            }
            for (batch, status) in reports {
                st.endpoint.writes_done(now, batch, status);
            }
        }
        self.timer_cv.notify_all();
    }

    fn on_event(&self, st: &mut State<E>, now: Instant, event: Event) {
        match &event {
            Event::Completed { request, .. }
            | Event::Failed { request, .. }
            | Event::TimedOut { request, .. }
            | Event::Cancelled { request, .. } => {
                if let Some(g) = st.grants.entries.get(request) {
                    g.revoked.store(true, Ordering::Release);
                }
            }
            Event::Quiesced { request } => {
                if let Some(g) = st.grants.entries.get_mut(request) {
                    g.revoked.store(true, Ordering::Release);
                    if g.inside > 0 {
                        // Released by the last reader leaving the request's memory.
                        g.quiesce_pending = true;
                        return;
                    }
                }
                st.grants.retire(*request);
            }
            _ => {}
        }
        st.events.push_back((now, event));
        self.notify_events();
    }

    fn notify_events(&self) {
        self.events_cv.notify_all();
        #[cfg(feature = "tokio")]
        self.events_notify.notify_waiters();
    }

    /// Starts tearing `peer` down: gracefully (queued frames are flushed first, bounded by
    /// `close_grace`) or at once.
    pub(crate) fn begin_close(&self, st: &mut State<E>, peer: PeerId, graceful: bool) {
        self.abandon(st, peer);
        let Some(link) = st.peers.get_mut(&peer) else {
            return;
        };
        if !link.closing.swap(true, Ordering::AcqRel) {
            bump(&self.stats.peers_closed, 1);
        }
        link.stop.store(true, Ordering::Release);
        if graceful {
            if link.close_deadline.is_none() {
                link.close_deadline = Some(std::time::Instant::now() + self.config.close_grace);
                for c in &mut link.conns {
                    if let Some(tx) = c.tx.take() {
                        let _ = tx.send(Job::Close);
                    }
                }
            }
        } else {
            link.shutdown_sockets();
        }
        self.timer_cv.notify_all();
    }

    /// Starts an orderly close of `peer` unless it is closing already: every connection's
    /// writer flushes what is queued and shuts its sending side down, readers go on reading
    /// (and handling) until the peer's end of stream; at `until` the sockets are shut down.
    /// Returns whether it started.
    pub(crate) fn begin_linger(
        &self,
        st: &mut State<E>,
        peer: PeerId,
        until: std::time::Instant,
    ) -> bool {
        self.abandon(st, peer);
        let Some(link) = st.peers.get_mut(&peer) else {
            return false;
        };
        if link.closing.swap(true, Ordering::AcqRel) {
            return false;
        }
        bump(&self.stats.peers_closed, 1);
        link.orderly = true;
        link.close_deadline = Some(until);
        for c in &mut link.conns {
            if let Some(tx) = c.tx.take() {
                let _ = tx.send(Job::Close);
            }
        }
        self.timer_cv.notify_all();
        true
    }

    /// A connection reader of `peer` ended (then call [`Shared::thread_exit`]). The peer's end
    /// of stream starts an orderly close of the whole peer; a failure spoils an orderly close
    /// under way and shuts the peer's sockets down.
    pub(crate) fn reader_end(&self, peer: PeerId, end: ReaderEnd) {
        let mut st = self.lock();
        let Some(link) = st.peers.get_mut(&peer) else {
            return;
        };
        match end {
            ReaderEnd::Eof => {
                if !link.closing.load(Ordering::Acquire) {
                    let until = std::time::Instant::now() + self.config.close_grace;
                    self.begin_linger(&mut st, peer, until);
                }
            }
            ReaderEnd::Stopped => {}
            ReaderEnd::Failed => {
                if link.orderly {
                    link.shutdown_sockets();
                }
                link.orderly = false;
            }
        }
    }

    /// A frame arrived from `peer`. Frames of a request this node granted are held until the
    /// data they report has landed (writes travel on other connections than results).
    pub(crate) fn deliver_frame(&self, peer: PeerId, frame: Frame) {
        let mut st = self.lock();
        let now = self.now();
        if st.peers.get(&peer).is_none_or(|l| l.untrusted) {
            return;
        }
        let request = match &frame {
            Frame::KvResult(r) => Some(r.request),
            Frame::AuxResult(a) => Some(a.request),
            Frame::Cancel(c) => Some(c.request),
            _ => None,
        };
        let st = &mut *st;
        let account = request.and_then(|r| st.grants.account(r, peer));
        match account {
            Some(acct) => {
                if let Frame::KvResult(r) = &frame {
                    if r.status == TransferStatus::Success {
                        acct.reported = acct.reported.saturating_add(r.bytes_written);
                    }
                }
                let need = acct.reported;
                if acct.held.is_empty() && acct.consumed >= need {
                    st.endpoint.frame(now, peer, frame);
                } else {
                    acct.held.push_back((need, frame));
                }
            }
            None => st.endpoint.frame(now, peer, frame),
        }
        self.drain(st, now);
    }

    /// Releases the held frames of (`request`, `peer`) whose data has landed.
    fn release(&self, st: &mut State<E>, request: RequestId, peer: PeerId, now: Instant) {
        let mut ready = Vec::new();
        if let Some(acct) = st.grants.account(request, peer) {
            while acct
                .held
                .front()
                .is_some_and(|(need, _)| acct.consumed >= *need)
            {
                if let Some((_, f)) = acct.held.pop_front() {
                    ready.push(f);
                }
            }
        }
        for f in ready {
            st.endpoint.frame(now, peer, f);
        }
    }

    /// A reader finished with a write of `len` payload bytes for `request` (`applied`: it held a
    /// place inside the request's memory).
    pub(crate) fn finish_write(&self, peer: PeerId, request: RequestId, len: u64, applied: bool) {
        let mut st = self.lock();
        let now = self.now();
        let st = &mut *st;
        if let Some(g) = st.grants.entries.get_mut(&request) {
            if let Some(acct) = g.writers.iter_mut().find(|a| a.peer == peer) {
                acct.consumed = acct.consumed.saturating_add(len);
            }
            if applied {
                g.inside = g.inside.saturating_sub(1);
                if g.inside == 0 && g.quiesce_pending {
                    g.quiesce_pending = false;
                    st.events.push_back((now, Event::Quiesced { request }));
                    st.grants.retire(request);
                    self.notify_events();
                }
            }
        }
        self.release(st, request, peer, now);
        self.drain(st, now);
    }

    /// A connection part of `batch` was written out.
    pub(crate) fn part_done(&self, batch: WriteBatchId) {
        let mut st = self.lock();
        let now = self.now();
        let done = match st.batches.get_mut(&batch) {
            Some((_, left)) => {
                *left -= 1;
                *left == 0
            }
            None => false,
        };
        if done {
            st.batches.remove(&batch);
            if let Some((bytes, issued)) = st.issued.remove(&batch) {
                if st.timings.len() >= MAX_TIMINGS {
                    st.timings.pop_front();
                }
                st.timings.push_back((bytes, issued, now));
            }
            st.endpoint.writes_done(now, batch, TransferStatus::Success);
            self.drain(&mut st, now);
        }
    }

    /// A connection thread of `peer` exited; the last one reports the disconnect.
    pub(crate) fn thread_exit(&self, peer: PeerId) {
        let mut st = self.lock();
        let now = self.now();
        let Some(link) = st.peers.get_mut(&peer) else {
            return;
        };
        link.threads = link.threads.saturating_sub(1);
        if link.threads > 0 {
            // Make the others stop too: a peer lives and dies as a whole.
            if !link.closing.load(Ordering::Acquire) {
                self.begin_close(&mut st, peer, false);
            } else if link.close_deadline.is_none() {
                link.shutdown_sockets();
            }
            return;
        }
        let link = st.peers.remove(&peer).expect("present");
        if st.closing_node {
            st.closed.insert(peer, link.orderly);
        }
        st.tokens.remove(&link.token);
        st.batches.retain(|_, (p, _)| *p != peer);
        let State {
            batches, issued, ..
        } = &mut *st;
        issued.retain(|b, _| batches.contains_key(b));
        for g in st.grants.entries.values_mut() {
            if let Some(a) = g.writers.iter_mut().find(|a| a.peer == peer) {
                a.held.clear();
            }
        }
        st.endpoint.disconnected(now, peer);
        self.drain(&mut st, now);
        self.events_cv.notify_all();
    }

    pub(crate) fn new_token(&self) -> u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(self.token_counter.fetch_add(1, Ordering::Relaxed));
        h.write_u128(self.origin.elapsed().as_nanos());
        h.write_u32(std::process::id());
        h.finish()
    }

    pub(crate) fn configure(&self, stream: &TcpStream) -> io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(self.config.poll_interval))?;
        stream.set_write_timeout(self.config.write_stall_timeout)?;
        Ok(())
    }

    /// Adds a connection to `peer`'s bundle (creating the peer for index 0). Once the bundle
    /// is complete every connection's threads start. Returns the peer and whether it started:
    /// only then is the core told it connected, so no frame is read — and no data write can be
    /// sent and lost — before the node holds every connection of the peer.
    fn attach(
        self: &Arc<Self>,
        st: &mut State<E>,
        pre: Preamble,
        stream: TcpStream,
    ) -> Option<(PeerId, bool)> {
        if st.closing_node {
            return None;
        }
        let peer = if pre.index == 0 {
            if st.tokens.contains_key(&pre.token) {
                return None;
            }
            let peer = PeerId(st.next_peer);
            st.next_peer += 1;
            st.tokens.insert(pre.token, peer);
            st.peers.insert(
                peer,
                PeerLink {
                    token: pre.token,
                    expected: usize::from(pre.count),
                    conns: Vec::new(),
                    started: false,
                    attached_at: std::time::Instant::now(),
                    threads: 0,
                    closing: Arc::new(AtomicBool::new(false)),
                    stop: Arc::new(AtomicBool::new(false)),
                    orderly: false,
                    untrusted: false,
                    close_deadline: None,
                    negotiated: Arc::new(AtomicU16::new(0)),
                },
            );
            peer
        } else {
            let peer = *st.tokens.get(&pre.token)?;
            let link = st.peers.get(&peer)?;
            if link.started
                || link.closing.load(Ordering::Acquire)
                || link.conns.len() != usize::from(pre.index)
                || link.expected != usize::from(pre.count)
            {
                return None;
            }
            peer
        };
        let (Ok(read_half), Ok(write_half)) = (stream.try_clone(), stream.try_clone()) else {
            self.abandon(st, peer);
            return None;
        };
        let link = st.peers.get_mut(&peer).expect("present");
        let (tx, rx) = match &self.backend {
            Backend::Threads => {
                let (tx, rx) = mpsc::channel();
                (JobTx::Thread(tx), JobRx::Thread(rx))
            }
            #[cfg(feature = "tokio")]
            Backend::Tokio(_) => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (JobTx::Task(tx), JobRx::Task(rx))
            }
        };
        link.conns.push(ConnHandle {
            stream,
            tx: Some(tx),
            pending: Some((read_half, write_half, rx)),
        });
        bump(&self.stats.connections, 1);
        if link.conns.len() < link.expected {
            return Some((peer, false));
        }
        link.started = true;
        let stop = link.stop.clone();
        let negotiated = link.negotiated.clone();
        let pending: Vec<_> = link
            .conns
            .iter_mut()
            .filter_map(|c| c.pending.take())
            .collect();
        let mut spawned = 0;
        for (read_half, write_half, rx) in pending {
            let (closing, negotiated) = (stop.clone(), negotiated.clone());
            spawned += match (&self.backend, rx) {
                (Backend::Threads, JobRx::Thread(rx)) => {
                    let node = self.clone();
                    let r = thread::Builder::new()
                        .name(format!("kvpipe-tcp-rd-{}", peer.0))
                        .spawn(move || reader_loop(node, peer, read_half, closing, negotiated));
                    let node = self.clone();
                    let w = thread::Builder::new()
                        .name(format!("kvpipe-tcp-wr-{}", peer.0))
                        .spawn(move || writer_loop(node, peer, write_half, rx));
                    u32::from(r.is_ok()) + u32::from(w.is_ok())
                }
                #[cfg(feature = "tokio")]
                (Backend::Tokio(handle), JobRx::Task(rx)) => crate::tokio_driver::spawn_connection(
                    handle,
                    self.clone(),
                    peer,
                    read_half,
                    write_half,
                    rx,
                    closing,
                    negotiated,
                ),
                #[cfg(feature = "tokio")]
                _ => 0,
            };
        }
        let link = st.peers.get_mut(&peer).expect("present");
        link.threads += spawned;
        if spawned < 2 * link.expected as u32 {
            link.shutdown_sockets();
        }
        Some((peer, true))
    }

    /// Drops a peer whose bundle never started (no thread runs for it, the core never heard
    /// of it).
    fn abandon(&self, st: &mut State<E>, peer: PeerId) {
        if st.peers.get(&peer).is_some_and(|l| !l.started) {
            if let Some(link) = st.peers.remove(&peer) {
                st.tokens.remove(&link.token);
            }
        }
    }
}

/// Completed batch timings kept (the most recent ones).
const MAX_TIMINGS: usize = 1 << 16;

/// The engine-facing node: owns the shared state and the helper threads.
pub(crate) struct Node<E: Endpoint> {
    pub(crate) shared: Arc<Shared<E>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl<E: Endpoint> Node<E> {
    pub(crate) fn new(
        endpoint: E,
        config: TcpConfig,
        regions: RegionTable,
        backend: Backend,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Arc::new(StateMutex::new(State {
                endpoint,
                peers: HashMap::new(),
                tokens: HashMap::new(),
                next_peer: 0,
                events: VecDeque::new(),
                batches: HashMap::new(),
                issued: HashMap::new(),
                timings: VecDeque::new(),
                grants: GrantTable::default(),
                shutdown: false,
                closing_node: false,
                closed: HashMap::new(),
            })),
            events_cv: Condvar::new(),
            timer_cv: Condvar::new(),
            origin: config.origin.unwrap_or_else(std::time::Instant::now),
            regions,
            config,
            stats: StatCells::default(),
            token_counter: AtomicU64::new(0),
            backend,
            #[cfg(feature = "tokio")]
            events_notify: tokio::sync::Notify::new(),
        });
        let timer = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("kvpipe-tcp-timer".into())
                .spawn(move || timer_loop(&shared))
                .expect("spawning the timer thread")
        };
        Node {
            shared,
            threads: Mutex::new(vec![timer]),
        }
    }

    /// Listens on `addr`; every accepted connection bundle becomes a peer.
    pub(crate) fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = self.shared.clone();
        let handle = thread::Builder::new()
            .name("kvpipe-tcp-accept".into())
            .spawn(move || accept_loop(&shared, listener))?;
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        Ok(local)
    }

    /// Opens `connections_per_peer` connections to `addr` and starts the handshake on them.
    pub(crate) fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        let shared = &self.shared;
        let streams = shared.open_bundle(addr)?;
        shared.adopt_bundle(streams)
    }
}

impl<E: Endpoint> Shared<E> {
    /// Connects the connections of one peer bundle and writes their preambles.
    pub(crate) fn open_bundle(
        &self,
        addr: impl ToSocketAddrs,
    ) -> io::Result<Vec<(Preamble, TcpStream)>> {
        let shared = self;
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
        let addr = *addrs
            .first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        let count = shared.config.connections_per_peer.clamp(1, 255);
        let token = shared.new_token();
        let mut streams = Vec::with_capacity(count);
        for index in 0..count {
            let mut s = TcpStream::connect_timeout(&addr, shared.config.preamble_timeout)?;
            shared.configure(&s)?;
            let pre = Preamble {
                index: index as u8,
                count: count as u8,
                token,
            };
            s.write_all(&pre.encode())?;
            streams.push((pre, s));
        }
        Ok(streams)
    }

    /// Makes a peer of connected streams (from [`Shared::open_bundle`]) and starts the
    /// handshake.
    pub(crate) fn adopt_bundle(
        self: &Arc<Self>,
        streams: Vec<(Preamble, TcpStream)>,
    ) -> io::Result<PeerId> {
        let shared = self;
        let mut st = shared.lock();
        let now = shared.now();
        let mut peer = None;
        for (pre, s) in streams {
            match shared.attach(&mut st, pre, s) {
                Some(p) => peer = Some(p),
                None => break,
            }
        }
        let peer = match peer {
            Some((peer, true)) => peer,
            Some((peer, false)) => {
                shared.abandon(&mut st, peer);
                return Err(io::Error::other("could not start the connections"));
            }
            None => return Err(io::Error::other("could not start the connection")),
        };
        st.endpoint.connected(now, peer);
        shared.drain(&mut st, now);
        Ok(peer)
    }
}

impl<E: Endpoint> Node<E> {
    /// The next event, waiting up to `timeout`.
    pub(crate) fn next_event(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        let deadline = std::time::Instant::now() + timeout;
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

    /// Every queued event, without waiting.
    pub(crate) fn take_events(&self) -> Vec<(Instant, Event)> {
        self.shared.lock().events.drain(..).collect()
    }

    /// The peers connected now, in id order.
    pub(crate) fn peers(&self) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = self.shared.lock().peers.keys().copied().collect();
        p.sort_unstable();
        p
    }

    /// Write batches handed to connections and not written out yet.
    pub(crate) fn writes_in_flight(&self) -> usize {
        self.shared.lock().batches.len()
    }

    /// Closes every peer in order (see the crate doc), bounded by `within`, then stops the
    /// node's threads. Peers still open at the deadline are shut down at once.
    pub(crate) fn close(&self, within: StdDuration) -> Result<(), CloseError> {
        let until = std::time::Instant::now() + within;
        let mut st = self.shared.lock();
        if st.shutdown {
            return Ok(());
        }
        st.closing_node = true;
        st.closed.clear();
        let peers: Vec<PeerId> = st.peers.keys().copied().collect();
        let mut lingering = Vec::new();
        for p in peers {
            if self.shared.begin_linger(&mut st, p, until) {
                lingering.push(p);
            }
        }
        while !st.peers.is_empty() {
            if self.shared.events_cv.wait_until(&mut st, until).timed_out() {
                break;
            }
        }
        let spoiled = lingering
            .iter()
            .filter(|p| st.closed.get(p) != Some(&true))
            .count();
        let open = st.peers.len();
        drop(st);
        self.shutdown();
        match spoiled.max(open) {
            0 => Ok(()),
            peers => Err(CloseError::Unflushed { peers }),
        }
    }

    /// Closes every peer at once (queued frames and data may be lost), stops the helper threads
    /// and waits (bounded) for connection threads.
    pub(crate) fn shutdown(&self) {
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
            let peers: Vec<PeerId> = st.peers.keys().copied().collect();
            for p in peers {
                self.shared.begin_close(&mut st, p, false);
            }
            self.shared.timer_cv.notify_all();
        }
        let handles: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for h in handles {
            let _ = h.join();
        }
        let deadline = std::time::Instant::now() + StdDuration::from_secs(5);
        let mut st = self.shared.lock();
        while !st.peers.is_empty() && std::time::Instant::now() < deadline {
            self.shared
                .events_cv
                .wait_for(&mut st, StdDuration::from_millis(50));
        }
    }
}

impl<E: Endpoint> Drop for Node<E> {
    fn drop(&mut self) {
        let _ = self.close(self.shared.config.close_grace);
    }
}

/// How a connection reader ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReaderEnd {
    /// The peer ended its stream at a frame boundary.
    Eof,
    /// The node told it to stop.
    Stopped,
    /// A socket error, a truncated or malformed frame, or a refused write.
    Failed,
}

/// An orderly close did not finish.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CloseError {
    /// Some peers' connections did not all flush, shut down and see the peer's end of stream
    /// before the deadline (or failed on the way); they were shut down at once.
    #[error("{peers} peer(s) did not close in order before the deadline")]
    Unflushed {
        /// How many.
        peers: usize,
    },
    /// The close was interrupted (the async driver's runtime shut down first).
    #[error("the close was interrupted before it finished")]
    Interrupted,
}

fn timer_loop<E: Endpoint>(shared: &Shared<E>) {
    let mut st = shared.lock();
    loop {
        if st.shutdown {
            return;
        }
        let now = shared.now();
        let wall = std::time::Instant::now();
        let mut next_close: Option<std::time::Instant> = None;
        let stale: Vec<PeerId> = st
            .peers
            .iter()
            .filter(|(_, l)| !l.started && l.attached_at + shared.config.preamble_timeout <= wall)
            .map(|(p, _)| *p)
            .collect();
        for p in stale {
            shared.abandon(&mut st, p);
        }
        for link in st.peers.values_mut() {
            if !link.started {
                let at = link.attached_at + shared.config.preamble_timeout;
                next_close = Some(next_close.map_or(at, |n| n.min(at)));
            }
            if let Some(at) = link.close_deadline {
                if at <= wall {
                    link.shutdown_sockets();
                    link.close_deadline = Some(wall + StdDuration::from_secs(3600));
                } else {
                    next_close = Some(next_close.map_or(at, |n| n.min(at)));
                }
            }
        }
        let next = st.endpoint.poll_timeout();
        if let Some(at) = next {
            if at <= now {
                st.endpoint.timeout(now);
                shared.drain(&mut st, now);
                continue;
            }
        }
        let mut wait = StdDuration::from_millis(500);
        if let Some(at) = next {
            wait = wait.min(StdDuration::from(at - now));
        }
        if let Some(at) = next_close {
            wait = wait.min(at.saturating_duration_since(wall));
        }
        shared
            .timer_cv
            .wait_for(&mut st, wait.max(StdDuration::from_micros(100)));
    }
}

fn accept_loop<E: Endpoint>(shared: &Arc<Shared<E>>, listener: TcpListener) {
    loop {
        {
            let st = shared.lock();
            if st.shutdown || st.closing_node {
                return;
            }
        }
        match listener.accept() {
            Ok((mut stream, _)) => {
                let ok = stream.set_nonblocking(false).is_ok()
                    && stream
                        .set_read_timeout(Some(shared.config.preamble_timeout))
                        .is_ok();
                let mut buf = [0u8; PREAMBLE_LEN];
                if !ok || stream.read_exact(&mut buf).is_err() {
                    continue;
                }
                let Ok(pre) = Preamble::decode(&buf) else {
                    continue;
                };
                if shared.configure(&stream).is_err() {
                    continue;
                }
                let mut st = shared.lock();
                let now = shared.now();
                if let Some((peer, true)) = shared.attach(&mut st, pre, stream) {
                    st.endpoint.connected(now, peer);
                    shared.drain(&mut st, now);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(StdDuration::from_millis(2));
            }
            Err(_) => thread::sleep(StdDuration::from_millis(10)),
        }
    }
}

/// Exclusive access to a node's core endpoint, for engine commands the handles do not wrap.
/// While it lives the node's threads wait; when it is dropped, every output the commands
/// produced is carried out.
#[allow(private_bounds)]
pub struct EndpointGuard<E: Endpoint> {
    guard: Option<parking_lot::ArcMutexGuard<parking_lot::RawMutex, State<E>>>,
    shared: Arc<Shared<E>>,
}

#[allow(private_bounds)]
impl<E: Endpoint> EndpointGuard<E> {
    pub(crate) fn new(shared: &Arc<Shared<E>>) -> Self {
        EndpointGuard {
            guard: Some(shared.state.lock_arc()),
            shared: shared.clone(),
        }
    }

    /// The node's current time (what the endpoint's inputs take as `now`).
    pub fn now(&self) -> Instant {
        self.shared.now()
    }

    /// Write batches handed to connections and not written out yet.
    pub fn writes_in_flight(&self) -> usize {
        self.guard.as_ref().map_or(0, |st| st.batches.len())
    }

    /// `(bytes, issued, written out)` of recent write batches, in completion order.
    pub fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.guard
            .as_ref()
            .map_or_else(Vec::new, |st| st.timings.iter().copied().collect())
    }
}

impl<E: Endpoint> std::ops::Deref for EndpointGuard<E> {
    type Target = E;
    fn deref(&self) -> &E {
        &self.guard.as_ref().expect("held until drop").endpoint
    }
}

impl<E: Endpoint> std::ops::DerefMut for EndpointGuard<E> {
    fn deref_mut(&mut self) -> &mut E {
        &mut self.guard.as_mut().expect("held until drop").endpoint
    }
}

impl<E: Endpoint> Drop for EndpointGuard<E> {
    fn drop(&mut self) {
        if let Some(mut st) = self.guard.take() {
            let now = self.shared.now();
            self.shared.drain(&mut st, now);
        }
    }
}
