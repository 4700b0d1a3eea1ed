//! The engine-facing node: it starts the timer thread, listens, connects, and closes every
//! peer in order (or aborts them) when the engine is done.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration as StdDuration;

use kvpipe_core::{Endpoint, PeerId};
use kvpipe_driver::{deadline_after, Driver};
use parking_lot::{Condvar, Mutex};

use super::link::LinkPhase;
use super::{bundle, NodePhase, Shared, Spawn, TcpIo};
use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::placement::Decision;
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
        let regions = Arc::new(regions);
        let stats = Arc::new(StatCells::default());
        let io = TcpIo::new(regions.clone(), config.clone(), stats.clone());
        let origin = config.origin.unwrap_or_else(std::time::Instant::now);
        let shared = Arc::new(Shared {
            driver: Driver::new(endpoint, io, "tcp", origin),
            peers_gone: Condvar::new(),
            regions,
            config,
            stats,
            tokens: AtomicU64::new(0),
            accepting: AtomicBool::new(true),
            offer: std::sync::OnceLock::new(),
            spawn,
        });
        let desk = shared.offer_desk();
        shared.lock().io.offers = Some(desk);
        let timer = shared
            .driver
            .spawn_timer("kvpipe-tcp-timer")
            .expect("spawning the timer thread");
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

    /// Opens `connections_per_peer` connections to `addr`; the handshake starts on them. A
    /// sender offering peer copies returns once the handshake placed the peer (by the preamble
    /// timeout): on the sockets when the peer declined (`Auto`), or an error saying why
    /// (`PeerCopy`, the peer then closed). A handshake that failed otherwise (rejected, cut)
    /// returns the peer, whose events say why, as without an offer.
    pub(crate) fn connect(&self, addr: impl ToSocketAddrs) -> io::Result<PeerId> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        let (streams, offer) = self.shared.open_bundle(addr)?;
        let offered = offer.is_some();
        let (peer, placement) = self.shared.adopt_bundle(streams, offer)?;
        if !offered {
            return Ok(peer);
        }
        let within = self.shared.config.preamble_timeout;
        let error = match placement.wait(deadline_after(within)) {
            Decision::Placed(_) | Decision::Gone => return Ok(peer),
            Decision::Refused(why) => io::Error::other(format!("peer copies refused: {why}")),
            Decision::Pending => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the peer at {addr} did not answer the peer-copy offer within {within:?} (a \
                     kvpipe receiver answers in its handshake; is it one, and is it answering?)"
                ),
            ),
        };
        if let Some(link) = self.shared.lock().io.links.get_mut(peer) {
            link.abort();
        }
        Err(error)
    }

    /// The peers now (assembling, open or closing), in id order.
    pub(crate) fn peers(&self) -> Vec<PeerId> {
        self.shared.lock().io.links.ids()
    }

    /// Closes every peer in order (see the crate doc), bounded by `within`, then stops the
    /// node's threads. Peers still open at the deadline are shut down at once.
    pub(crate) fn close(&self, within: StdDuration) -> Result<(), CloseError> {
        let until = deadline_after(within);
        let shared = &self.shared;
        let mut st = shared.lock();
        if matches!(st.io.phase, NodePhase::Stopped) {
            return Ok(());
        }
        st.io.phase = NodePhase::Closing(HashMap::new());
        shared.accepting.store(false, Ordering::Release);
        st.io.lobby.clear();
        let mut lingering = Vec::new();
        for peer in st.io.links.ids() {
            let Some(link) = st.io.links.get_mut(peer) else {
                continue;
            };
            match link.phase {
                LinkPhase::Assembling { .. } => {
                    st.io.links.remove(peer);
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
        while !st.io.links.is_empty() {
            if shared.peers_gone.wait_until(&mut st, until).timed_out() {
                break;
            }
        }
        // The peers that did not close in order: those whose orderly close failed, and those
        // still open at the deadline.
        let mut unflushed: Vec<PeerId> = match &st.io.phase {
            NodePhase::Closing(outcomes) => (lingering.iter())
                .filter(|p| outcomes.get(p) != Some(&true))
                .copied()
                .collect(),
            _ => lingering.clone(),
        };
        unflushed.extend(st.io.links.ids());
        unflushed.sort_unstable();
        unflushed.dedup();
        drop(st);
        self.shutdown();
        if unflushed.is_empty() {
            Ok(())
        } else {
            Err(CloseError::Unflushed {
                peers: unflushed.len(),
                which: unflushed,
            })
        }
    }

    /// Aborts every peer (queued frames and data may be lost), stops the helper threads and
    /// waits (bounded) for the connection halves to stop.
    pub(crate) fn shutdown(&self) {
        {
            let mut st = self.shared.lock();
            st.io.phase = NodePhase::Stopped;
            self.shared.accepting.store(false, Ordering::Release);
            st.io.lobby.clear();
            for peer in st.io.links.ids() {
                match st.io.links.get_mut(peer) {
                    Some(link) if matches!(link.phase, LinkPhase::Assembling { .. }) => {
                        st.io.links.remove(peer);
                    }
                    Some(link) => {
                        link.abort();
                    }
                    None => {}
                }
            }
        }
        self.shared.driver.stop();
        for &local in self.listening.lock().iter() {
            bundle::wake_acceptor(local);
        }
        let helpers: Vec<JoinHandle<()>> = std::mem::take(&mut *self.helpers.lock());
        for h in helpers {
            let _ = h.join();
        }
        let deadline = std::time::Instant::now() + StdDuration::from_secs(5);
        let mut st = self.shared.lock();
        while !st.io.links.is_empty() {
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
    #[error(
        "{peers} peer(s) did not close in order before the deadline: {}",
        which.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
    )]
    Unflushed {
        /// How many.
        peers: usize,
        /// Which, in id order.
        which: Vec<PeerId>,
    },
    /// The close was interrupted (the async driver's runtime shut down first).
    #[error("the close was interrupted before it finished")]
    Interrupted,
}
