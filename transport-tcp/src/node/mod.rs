//! The node: one core endpoint driven by [`kvpipe_driver`] (its lock, outputs, timer, events,
//! guard and engine commands), the peers' connection bundles, and the accept loop.
//!
//! The driver's lock holds the endpoint, the peer links ([`TcpIo`]) and the write batches in
//! flight, and is taken only for short calls: an engine command, a frame, an admission, a
//! landed write, a written batch, a stopped connection half, a timeout. Each call hands one
//! input to the endpoint and carries out its outputs at once: frames and data-write pieces are
//! queued to the connections' writers ([`io`]), events to the engine's queue. Socket reads
//! and writes, and with them every payload byte, move outside the lock, on the backend's
//! threads or tasks ([`Spawn`]).
//!
//! - [`io`]: the endpoint's outputs as connection work, and the links' deadlines;
//! - [`link`]: a peer's connection bundle and its one phase (assembling, open, closing,
//!   aborted);
//! - [`bundle`]: connecting, accepting, and starting a complete bundle;
//! - [`lobby`]: accepted connections that have not completed the handshake, their caps;
//! - [`hooks`]: what a connection's halves report, as endpoint inputs;
//! - [`lifecycle`]: the engine-facing node (start, listen, connect, close);
//! - [`offers`]: a peer's peer-copy offer, evaluated off the lock and answered in the
//!   handshake.
//!
//! This file holds the shared state only; each concern's file adds its methods to it, and no
//! two files call into each other.

mod bundle;
mod hooks;
mod io;
pub(crate) mod lifecycle;
mod link;
mod lobby;
mod offers;

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use kvpipe_core::{Endpoint, Instant, PeerId};
use kvpipe_driver::{Driver, Locked};
use parking_lot::{Condvar, MutexGuard};

use crate::config::TcpConfig;
use crate::conn::{Inbound, Outbound};
use crate::memory::RegionTable;
use crate::stats::StatCells;
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

/// The TCP side of a node, behind the driver's lock: the peers' links, the accepted
/// connections still reading their preamble, and whether the node takes new peers.
pub struct TcpIo {
    pub(crate) links: Links,
    /// Accepted connections reading their preamble.
    lobby: Lobby,
    pub(crate) phase: NodePhase,
    regions: Arc<RegionTable>,
    config: TcpConfig,
    stats: Arc<StatCells>,
    /// Where a peer's peer-copy offer goes (set once the node is built).
    offers: Option<offers::OfferDesk>,
}

/// Everything behind the node's lock.
pub(crate) type State<E> = Locked<E, TcpIo>;

/// The node, shared by the engine's handle, the helper threads and every connection half.
pub(crate) struct Shared<E> {
    pub(crate) driver: Arc<Driver<E, TcpIo>>,
    /// Notified whenever a peer link is removed.
    peers_gone: Condvar,
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
        self.driver.now()
    }

    /// Takes the node's lock.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State<E>> {
        self.driver.lock()
    }

    /// Carries out every pending output of the endpoint.
    pub(crate) fn drain(&self, st: &mut State<E>, now: Instant) {
        self.driver.drain(st, now);
    }

    /// Makes the timer thread wake by `at`.
    fn wake_timer_by(&self, st: &mut State<E>, at: std::time::Instant) {
        self.driver.wake_timer_by(st, at);
    }
}
