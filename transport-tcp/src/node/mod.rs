//! The node: one core endpoint behind one lock, the peers' connection bundles, and two helper
//! threads (the timer and, when listening, the accept loop).
//!
//! The lock holds the endpoint, the peer links and the write batches in flight, and is taken
//! only for short calls: an engine command, a frame, an admission, a landed write, a written
//! batch, a stopped connection half, a timeout. Each call hands one input to the endpoint
//! and carries out its outputs at once ([`drain`]): frames and data-write pieces are queued to
//! the connections' writers, events to the engine's queue. Socket reads and writes, and with
//! them every payload byte, move outside the lock, on the backend's threads or tasks
//! ([`Spawn`]).
//!
//! - [`link`]: a peer's connection bundle and its one phase (assembling, open, closing,
//!   aborted);
//! - [`bundle`]: connecting, accepting, and starting a complete bundle;
//! - [`lobby`]: accepted connections that have not completed the handshake, their caps;
//! - [`hooks`]: what a connection's halves report, as endpoint inputs;
//! - [`drain`]: carrying out the endpoint's outputs;
//! - [`timer`]: the endpoint's deadline and the links' deadlines;
//! - [`batches`], [`events`], [`guard`]: write batches in flight, the engine's event queue,
//!   exclusive access to the endpoint;
//! - [`lifecycle`]: the engine-facing node (start, listen, connect, close).
//!
//! This file holds the shared state only; each concern's file adds its methods to it, and no
//! two files call into each other.

mod batches;
mod bundle;
mod drain;
mod events;
pub(crate) mod guard;
mod hooks;
pub(crate) mod lifecycle;
mod link;
mod lobby;
mod timer;

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration as StdDuration;

use kvpipe_core::{Endpoint, Instant, PeerId, TransportInput};
use kvpipe_observe::Observer;
use parking_lot::{Condvar, Mutex};

use crate::config::TcpConfig;
use crate::conn::{Inbound, Outbound};
use crate::memory::RegionTable;
use crate::stats::StatCells;
use batches::Batches;
use events::EventQueue;
use link::Links;
use lobby::Lobby;

/// Where connection I/O runs: starts the two halves of one connection on threads or tasks.
pub(crate) trait Spawn: Send + Sync + 'static {
    /// Starts `inbound` reading from `stream` and `outbound` writing to it. Returns how many of
    /// the two started (a half that did not start is dropped without a report).
    fn start(&self, peer: PeerId, stream: TcpStream, inbound: Inbound, outbound: Outbound) -> u32;
}

/// Whether the node takes new peers.
pub(crate) enum NodePhase {
    /// Running.
    Running,
    /// Closing every peer in order: how each one ended (`true`: orderly).
    Closing(HashMap<PeerId, bool>),
    /// Stopped: helper threads end, every link is aborted.
    Stopped,
}

/// Everything behind the node's lock.
pub(crate) struct State<E> {
    pub(crate) endpoint: E,
    pub(crate) links: Links,
    /// Accepted connections reading their preamble.
    lobby: Lobby,
    pub(crate) batches: Batches,
    pub(crate) phase: NodePhase,
    /// When the sleeping timer thread wakes (`None` while it is awake).
    timer_at: Option<std::time::Instant>,
    /// Spans, events and metrics of what the endpoint did.
    pub(crate) observer: Observer,
}

impl<E: Endpoint> State<E> {
    /// Hands a transport input to the endpoint (and to the observer first). A usage error
    /// would be a driver bug (an unknown peer, ticket or batch); the endpoint changed nothing
    /// then, so it is dropped.
    pub(crate) fn feed(&mut self, now: Instant, input: TransportInput) {
        self.observer.input(now, &input);
        let _ = self.endpoint.handle_transport(now, input);
    }
}

/// The node, shared by the engine's handle, the helper threads and every connection half.
pub(crate) struct Shared<E> {
    pub(crate) state: Arc<Mutex<State<E>>>,
    /// Notified whenever a peer link is removed.
    peers_gone: Condvar,
    /// Wakes the timer thread.
    timer: Condvar,
    pub(crate) events: EventQueue,
    origin: std::time::Instant,
    regions: Arc<RegionTable>,
    pub(crate) config: TcpConfig,
    pub(crate) stats: Arc<StatCells>,
    tokens: AtomicU64,
    /// Whether the accept thread goes on (cleared when the node starts closing; read without
    /// the lock, which `attach` checks again).
    accepting: AtomicBool,
    /// This node's peer-copy offer, made on the first request for it.
    offer: std::sync::OnceLock<crate::peer_copy::Offer>,
    spawn: Box<dyn Spawn>,
}

impl<E: Endpoint + Send + 'static> Shared<E> {
    /// The core's notion of now.
    pub(crate) fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall-clock instant of the core's `at` (`None`: too far to matter).
    fn wall(&self, at: Instant) -> Option<std::time::Instant> {
        self.origin
            .checked_add(StdDuration::from_nanos(at.as_nanos()))
    }

    /// Makes the timer thread wake by `at` (it re-reads every deadline when it wakes).
    fn wake_timer_by(&self, st: &mut State<E>, at: std::time::Instant) {
        if st.timer_at.is_some_and(|t| at < t) {
            st.timer_at = Some(at);
            self.timer.notify_one();
        }
    }
}
