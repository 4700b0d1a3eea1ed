//! The verbs fabric of one node: its links to peers (RC queue pairs set up over a TCP
//! bootstrap), the accept thread, and the completion poller that drives every link. It knows
//! nothing of sessions: it moves opaque control messages and executes write plans, and
//! reports what happened as [`FabricEvent`]s to one [`FabricHandler`].
//!
//! # Threads and locks
//!
//! One poller thread reaps every link's completion queue, delivers messages, posts what waits
//! for credits or send-queue room, watches each link's bootstrap socket and advances
//! teardowns; it idles by the bounded spin-then-sleep [`IdlePolicy`](crate::idle::IdlePolicy), and is woken early by
//! every submission. The handler is called from the poller (and from `connect` / the accept
//! thread for [`FabricEvent::Connected`]) with no fabric lock held, so it may call back into
//! the fabric (`send`, `post_writes`, `close`). A link is polled only after its `Connected`
//! event returned, so nothing of a link reaches the handler before its `Connected`.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use kvpipe_core::WriteExtent;

pub(crate) mod api;

pub use api::{
    FabricConfig, FabricEvent, FabricHandler, LinkFailure, LinkId, Posted, WriteFailure,
};

use crate::device::VerbsDevice;
use crate::idle::{Backoff, IdleStep};
use crate::link::Link;
use crate::memory::MemoryTable;

struct Shared {
    device: VerbsDevice,
    memory: Arc<MemoryTable>,
    config: FabricConfig,
    links: Mutex<HashMap<LinkId, Arc<Link>>>,
    next_link: AtomicU32,
    handler: Mutex<Option<Arc<dyn FabricHandler>>>,
    poller: Mutex<Option<Thread>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn handler(&self) -> Option<Arc<dyn FabricHandler>> {
        lock(&self.handler).clone()
    }

    fn link(&self, link: LinkId) -> Option<Arc<Link>> {
        lock(&self.links).get(&link).cloned()
    }

    fn wake(&self) {
        if let Some(t) = lock(&self.poller).as_ref() {
            t.unpark();
        }
    }

    /// Sets a link up on a connected socket, reports it, then hands it to the poller.
    fn adopt(&self, socket: TcpStream) -> io::Result<LinkId> {
        if self.stop.load(Ordering::Acquire) {
            return Err(io::Error::other("the fabric is shut down"));
        }
        let id = LinkId(self.next_link.fetch_add(1, Ordering::Relaxed));
        let link = Link::establish(id, &self.device, self.memory.clone(), &self.config, socket)?;
        let link = Arc::new(link);
        // In the table first, so the handler can send on it while it hears of it; polled
        // only once announced, so nothing of the link reaches the handler before that.
        lock(&self.links).insert(id, link.clone());
        if let Some(h) = self.handler() {
            h.handle(FabricEvent::Connected { link: id });
        }
        link.announced.store(true, Ordering::Release);
        self.wake();
        Ok(id)
    }
}

/// The verbs fabric of one node (see the module documentation).
pub struct Fabric {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fabric")
            .field("device", &self.shared.device)
            .field("links", &self.links())
            .finish()
    }
}

impl Fabric {
    /// A fabric on `device` exposing `memory`'s remote-write regions to every peer, reporting
    /// to `handler`. Starts the poller thread.
    pub fn new(
        device: VerbsDevice,
        memory: MemoryTable,
        config: FabricConfig,
        handler: Arc<dyn FabricHandler>,
    ) -> io::Result<Fabric> {
        let shared = Arc::new(Shared {
            device,
            memory: Arc::new(memory),
            config,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU32::new(0),
            handler: Mutex::new(Some(handler)),
            poller: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let poller = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("kvpipe-verbs-cq".into())
                .spawn(move || poll_loop(&shared))?
        };
        *lock(&shared.poller) = Some(poller.thread().clone());
        Ok(Fabric {
            shared,
            threads: Mutex::new(vec![poller]),
        })
    }

    /// The device the fabric runs on.
    pub fn device(&self) -> &VerbsDevice {
        &self.shared.device
    }

    /// The configuration.
    pub fn config(&self) -> &FabricConfig {
        &self.shared.config
    }

    /// Bytes of the largest RDMA WRITE the fabric posts: the configured size, capped by the
    /// port's maximum message size.
    pub fn write_request_bytes(&self) -> u64 {
        crate::link::write_request_bytes(&self.shared.config, &self.shared.device)
    }

    /// Accepts bootstrap connections on `addr`; each becomes a link.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = self.shared.clone();
        let handle = thread::Builder::new()
            .name("kvpipe-verbs-accept".into())
            .spawn(move || accept_loop(&shared, &listener))?;
        lock(&self.threads).push(handle);
        Ok(local)
    }

    /// Connects to a listening fabric at `addr` and sets the link up. Its
    /// [`FabricEvent::Connected`] is delivered before this returns. Do not call it while
    /// holding a lock the handler takes.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<LinkId> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        let socket = TcpStream::connect_timeout(&addr, self.shared.config.handshake_timeout)?;
        self.shared.adopt(socket)
    }

    /// Queues a control message on `link` (delivered in order, as one message).
    pub fn send(&self, link: LinkId, message: Vec<u8>) -> Result<(), LinkFailure> {
        let l = self.shared.link(link).ok_or(LinkFailure::Closed)?;
        let r = l.send_message(message);
        self.shared.wake();
        r
    }

    /// Executes a write plan on `link`: RDMA WRITEs from local regions into the peer's
    /// announced regions, reported as `token` by [`FabricEvent::WritesDone`].
    pub fn post_writes(
        &self,
        link: LinkId,
        token: u64,
        extents: &[WriteExtent],
    ) -> Result<Posted, WriteFailure> {
        let l = self
            .shared
            .link(link)
            .ok_or(WriteFailure::LinkDown(LinkFailure::Closed))?;
        let r = l.post_writes(token, extents);
        self.shared.wake();
        r
    }

    /// Closes `link`: gracefully (queued messages and writes are sent and acknowledged first,
    /// bounded by [`FabricConfig::close_grace`]) or at once. A
    /// [`FabricEvent::Disconnected`] follows.
    pub fn close(&self, link: LinkId, graceful: bool) {
        if let Some(l) = self.shared.link(link) {
            l.close(graceful, self.shared.config.close_grace);
            self.shared.wake();
        }
    }

    /// Fails `link` as a fabric error would: its queue pair is moved to the error state
    /// (every posted work request flushes) and the link is torn down like after any failed
    /// completion. For failure tests.
    pub fn inject_error_state(&self, link: LinkId) -> io::Result<()> {
        let l = self
            .shared
            .link(link)
            .ok_or_else(|| io::Error::other(format!("{link} is gone")))?;
        l.force_error_state()?;
        self.shared.wake();
        Ok(())
    }

    /// The links that are up or closing, in id order.
    pub fn links(&self) -> Vec<LinkId> {
        let mut v: Vec<LinkId> = lock(&self.shared.links).keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Closes every link at once, waits (bounded) until each is torn down, stops the threads
    /// and drops the handler. Idempotent.
    pub fn shutdown(&self) {
        self.close_all(false, Duration::ZERO);
    }

    /// Closes every link gracefully within `within`, then as [`Fabric::shutdown`]. Returns
    /// whether every link closed before the deadline.
    pub fn close_all(&self, graceful: bool, within: Duration) -> bool {
        let shared = &self.shared;
        let links: Vec<Arc<Link>> = lock(&shared.links).values().cloned().collect();
        for l in &links {
            l.close(graceful, within);
        }
        shared.wake();
        let deadline = crate::link::later(
            Instant::now(),
            within.saturating_add(crate::link::FLUSH_WAIT + Duration::from_secs(1)),
        );
        while !lock(&shared.links).is_empty() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
        let clean = lock(&shared.links).is_empty();
        shared.stop.store(true, Ordering::Release);
        shared.wake();
        let handles: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.threads));
        for h in handles {
            let _ = h.join();
        }
        *lock(&shared.handler) = None;
        clean
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn poll_loop(shared: &Shared) {
    let mut backoff = Backoff::new(shared.config.idle);
    let mut events: Vec<FabricEvent> = Vec::new();
    let mut links: Vec<Arc<Link>> = Vec::new();
    loop {
        links.clear();
        links.extend(lock(&shared.links).values().cloned());
        let stopping = shared.stop.load(Ordering::Acquire);
        if stopping {
            // Whatever is still up is torn down now (and reported) before the thread ends.
            for l in &links {
                l.fail(LinkFailure::Shutdown);
            }
            if links.is_empty() {
                return;
            }
        }
        let mut did = false;
        for l in links
            .iter()
            .filter(|l| stopping || l.announced.load(Ordering::Acquire))
        {
            did |= l.progress(&mut events);
            if l.is_closed() {
                lock(&shared.links).remove(&l.id);
            }
        }
        let handler = shared.handler();
        if !events.is_empty() {
            did = true;
            if let Some(h) = &handler {
                for e in events.drain(..) {
                    h.handle(e);
                }
            }
            events.clear();
        }
        if let Some(h) = &handler {
            h.idle();
        }
        if did {
            backoff.worked();
            continue;
        }
        match backoff.idle(Instant::now()) {
            IdleStep::Spin => std::hint::spin_loop(),
            IdleStep::Sleep(d) => thread::park_timeout(d),
        }
    }
}

fn accept_loop(shared: &Shared, listener: &TcpListener) {
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((socket, _)) => {
                if socket.set_nonblocking(false).is_ok() {
                    // A failed setup only loses that connection attempt.
                    let _ = shared.adopt(socket);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2));
            }
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}
