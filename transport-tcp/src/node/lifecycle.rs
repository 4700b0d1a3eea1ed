//! The engine-facing node: it starts the timer thread, listens, connects, and closes every
//! peer in order (or aborts them) when the engine is done.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration as StdDuration;

use kvpipe_core::{Endpoint, Event, Instant, PeerId};
use kvpipe_observe::Observer;
use parking_lot::{Condvar, Mutex};

use super::batches::Batches;
use super::events::EventQueue;
use super::link::{LinkPhase, Links};
use super::lobby::Lobby;
use super::{bundle, timer, NodePhase, Shared, Spawn, State};
use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::stats::{bump, StatCells};

/// The engine-facing node: owns the shared state and the helper threads.
pub(crate) struct Node<E: Endpoint + Send + 'static> {
    pub(crate) shared: Arc<Shared<E>>,
    helpers: Mutex<Vec<JoinHandle<()>>>,
    /// Where the accept threads listen (to wake them when the node stops).
    listening: Mutex<Vec<SocketAddr>>,
}

impl<E: Endpoint + Send + 'static> Node<E> {
    pub(crate) fn new(
        endpoint: E,
        config: TcpConfig,
        regions: RegionTable,
        spawn: Box<dyn Spawn>,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Arc::new(Mutex::new(State {
                observer: Observer::new(endpoint.role(), "tcp"),
                endpoint,
                links: Links::default(),
                lobby: Lobby::default(),
                batches: Batches::default(),
                phase: NodePhase::Running,
                timer_at: None,
            })),
            peers_gone: Condvar::new(),
            timer: Condvar::new(),
            events: EventQueue::default(),
            origin: config.origin.unwrap_or_else(std::time::Instant::now),
            regions: Arc::new(regions),
            config,
            stats: Arc::new(StatCells::default()),
            tokens: AtomicU64::new(0),
            accepting: AtomicBool::new(true),
            offer: std::sync::OnceLock::new(),
            spawn,
        });
        let timer = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("kvpipe-tcp-timer".into())
                .spawn(move || timer::run(&shared))
                .expect("spawning the timer thread")
        };
        Node {
            shared,
            helpers: Mutex::new(vec![timer]),
            listening: Mutex::new(Vec::new()),
        }
    }

    /// Listens on `addr`; every accepted connection bundle becomes a peer.
    pub(crate) fn listen(&self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        let (local, handle) = bundle::listen(&self.shared, addr)?;
        self.helpers.lock().push(handle);
        self.listening.lock().push(local);
        Ok(local)
    }

    /// Opens `connections_per_peer` connections to `addr`; the handshake starts on them.
    pub(crate) fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        let (streams, placement) = self.shared.open_bundle(addr)?;
        self.shared.adopt_bundle(streams, placement)
    }

    /// The next event, waiting up to `timeout`.
    pub(crate) fn next_event(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        self.shared.events.next(timeout)
    }

    /// Every queued event, without waiting.
    pub(crate) fn take_events(&self) -> Vec<(Instant, Event)> {
        self.shared.events.take_all()
    }

    /// The peers now (assembling, open or closing), in id order.
    pub(crate) fn peers(&self) -> Vec<PeerId> {
        self.shared.state.lock().links.ids()
    }

    /// Write batches handed to connections and not written out yet.
    pub(crate) fn writes_in_flight(&self) -> usize {
        self.shared.state.lock().batches.in_flight()
    }

    /// `(bytes, issued, written out)` of recent write batches, in completion order.
    pub(crate) fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
        self.shared.state.lock().batches.timings()
    }

    /// Closes every peer in order (see the crate doc), bounded by `within`, then stops the
    /// node's threads. Peers still open at the deadline are shut down at once.
    pub(crate) fn close(&self, within: StdDuration) -> Result<(), CloseError> {
        let until = super::events::deadline_after(within);
        let shared = &self.shared;
        let mut st = shared.state.lock();
        if matches!(st.phase, NodePhase::Stopped) {
            return Ok(());
        }
        st.phase = NodePhase::Closing(HashMap::new());
        shared.accepting.store(false, Ordering::Release);
        st.lobby.clear();
        let mut lingering = Vec::new();
        for peer in st.links.ids() {
            let Some(link) = st.links.get_mut(peer) else {
                continue;
            };
            match link.phase {
                LinkPhase::Assembling { .. } => {
                    st.links.remove(peer);
                }
                LinkPhase::Open => {
                    link.close_orderly(until);
                    bump(&shared.stats.peers_closed, 1);
                    lingering.push(peer);
                }
                LinkPhase::Closing { .. } | LinkPhase::Aborted => {}
            }
        }
        shared.wake_timer_by(&mut st, until);
        while !st.links.is_empty() {
            if shared.peers_gone.wait_until(&mut st, until).timed_out() {
                break;
            }
        }
        let spoiled = match &st.phase {
            NodePhase::Closing(outcomes) => lingering
                .iter()
                .filter(|p| outcomes.get(p) != Some(&true))
                .count(),
            _ => lingering.len(),
        };
        let open = st.links.len();
        drop(st);
        self.shutdown();
        match spoiled.max(open) {
            0 => Ok(()),
            peers => Err(CloseError::Unflushed { peers }),
        }
    }

    /// Aborts every peer (queued frames and data may be lost), stops the helper threads and
    /// waits (bounded) for the connection halves to stop.
    pub(crate) fn shutdown(&self) {
        {
            let mut st = self.shared.state.lock();
            st.phase = NodePhase::Stopped;
            self.shared.accepting.store(false, Ordering::Release);
            st.lobby.clear();
            for peer in st.links.ids() {
                match st.links.get_mut(peer) {
                    Some(link) if matches!(link.phase, LinkPhase::Assembling { .. }) => {
                        st.links.remove(peer);
                    }
                    Some(link) => {
                        link.abort();
                    }
                    None => {}
                }
            }
            self.shared.timer.notify_all();
        }
        for &local in self.listening.lock().iter() {
            bundle::wake_acceptor(local);
        }
        let helpers: Vec<JoinHandle<()>> = std::mem::take(&mut *self.helpers.lock());
        for h in helpers {
            let _ = h.join();
        }
        let deadline = std::time::Instant::now() + StdDuration::from_secs(5);
        let mut st = self.shared.state.lock();
        while !st.links.is_empty() {
            if self
                .shared
                .peers_gone
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                break;
            }
        }
    }
}

impl<E: Endpoint + Send + 'static> Drop for Node<E> {
    fn drop(&mut self) {
        let _ = self.close(self.shared.config.close_grace);
    }
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
