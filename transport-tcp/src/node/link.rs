//! A peer as the node holds it: a bundle of connections and one phase.
//!
//! ```text
//! Assembling ──(last connection attached, halves started)──> Open
//! Open ──(close asked by the core, the peer's end of stream, closing the node)──> Closing
//! Open | Closing ──(a failure, an abort asked by the core, the close deadline)──> Aborted
//! ```
//!
//! The core hears of a peer when it turns `Open`, and of its disconnect when the last of its
//! connection halves stopped (whatever the phase then); the link is removed at that moment.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::Arc;

use bytes::Bytes;
use kvpipe_core::PeerId;

use super::lobby::Unproven;
use crate::conn::{Backlog, Job, JobQueue, TalliedPiece};
use crate::peer_copy::Offer;
use crate::placement::{Decision, PeerPlacement};
use crate::preamble::Preamble;

/// One connection of a bundle.
pub(crate) struct Conn {
    /// Its index in the bundle (0: control).
    index: u8,
    /// A handle for shutting the socket down from any thread.
    socket: TcpStream,
    /// The writer's queue.
    pub(crate) queue: Arc<JobQueue>,
    /// The stream, until the bundle starts.
    pub(crate) pending: Option<TcpStream>,
}

impl Conn {
    /// Whether the peer's control frames travel on this connection (the bundle's first).
    pub(crate) fn carries_frames(&self) -> bool {
        self.index == 0
    }
}

/// Where a link is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkPhase {
    /// Connections are arriving; no half runs and the core has not heard of the peer. Dropped
    /// if incomplete after the preamble timeout.
    Assembling {
        /// When the first connection was attached.
        since: std::time::Instant,
    },
    /// Every connection's reader and writer run.
    Open,
    /// An orderly close: every writer writes out its queue and shuts its sending side down;
    /// readers read on (frames still reach the core, data writes still land) until the peer's
    /// end of stream. Aborted at `until`.
    Closing {
        /// The close deadline.
        until: std::time::Instant,
        /// Whether every close job was queued (a writer that stopped early spoils the close).
        clean: bool,
    },
    /// The sockets are shut down; the halves are stopping.
    Aborted,
}

/// A peer's connection bundle.
pub(crate) struct PeerLink {
    token: u64,
    expected: usize,
    pub(crate) conns: Vec<Conn>,
    /// Data-write pieces no connection writer took yet.
    pub(crate) backlog: Arc<Backlog>,
    /// Connection halves (readers and writers) still running.
    pub(crate) halves: u32,
    pub(crate) phase: LinkPhase,
    /// For an accepted peer: its address and when its first connection was accepted (`None`:
    /// this node connected to it).
    pub(crate) origin: Option<(IpAddr, std::time::Instant)>,
    /// Whether its handshake completed (the core reported it ready).
    pub(crate) authenticated: bool,
    /// How its data writes travel (decided by the handshake when an offer is part of it).
    pub(crate) placement: Arc<PeerPlacement>,
    /// The peer-copy offer this node made the peer in its `Hello` (a connecting sender).
    pub(crate) offer: Option<Offer>,
}

impl PeerLink {
    /// Queues a batch's `pieces` to the connections' writers: on the backlog, which each
    /// writer takes from as its stream runs low (waking them). Returns whether they were
    /// queued: all of them, or none once the link is no longer open.
    pub(crate) fn queue_pieces(&self, pieces: Vec<TalliedPiece>) -> bool {
        if !self.backlog.push(pieces) {
            return false;
        }
        for c in &self.conns {
            c.queue.poke();
        }
        true
    }

    /// Queues an encoded frame on the control connection (dropped unless open).
    pub(crate) fn transmit(&self, bytes: Bytes) {
        if let Some(c) = self.conns.first() {
            c.queue.push(Job::Frame(bytes));
        }
    }

    /// Starts an orderly close bounded by `until`. Returns whether the link was open.
    pub(crate) fn close_orderly(&mut self, until: std::time::Instant) -> bool {
        if self.phase != LinkPhase::Open {
            return false;
        }
        self.backlog.close();
        let mut clean = true;
        for c in &self.conns {
            clean &= c.queue.push(Job::Close);
        }
        self.phase = LinkPhase::Closing { until, clean };
        true
    }

    /// Shuts every socket down at once: writers stop, blocked reads and writes return. Returns
    /// whether the link was open.
    pub(crate) fn abort(&mut self) -> bool {
        self.backlog.abort();
        for c in &self.conns {
            c.queue.abort();
            let _ = c.socket.shutdown(Shutdown::Both);
        }
        let was_open = self.phase == LinkPhase::Open;
        self.phase = LinkPhase::Aborted;
        was_open
    }

    /// Whether an orderly close is under way and nothing spoiled it so far.
    pub(crate) fn closing_cleanly(&self) -> bool {
        matches!(self.phase, LinkPhase::Closing { clean: true, .. })
    }

    /// When the timer must act on this link: drop an incomplete bundle, or abort a close that
    /// did not finish.
    pub(crate) fn deadline(
        &self,
        preamble_timeout: std::time::Duration,
    ) -> Option<std::time::Instant> {
        match self.phase {
            LinkPhase::Assembling { since } => Some(since + preamble_timeout),
            LinkPhase::Closing { until, .. } => Some(until),
            LinkPhase::Open | LinkPhase::Aborted => None,
        }
    }
}

/// What attaching a connection did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Attached {
    /// Not part of any acceptable bundle: dropped.
    Refused,
    /// Part of `peer`'s bundle, which waits for more connections.
    Waiting(PeerId),
    /// The last connection of `peer`'s bundle: start it.
    Complete(PeerId),
}

/// Every peer of a node, by id and by bundle token.
#[derive(Default)]
pub(crate) struct Links {
    by_peer: HashMap<PeerId, PeerLink>,
    by_token: HashMap<u64, PeerId>,
    next_peer: u32,
}

impl Links {
    pub(crate) fn get(&self, peer: PeerId) -> Option<&PeerLink> {
        self.by_peer.get(&peer)
    }

    pub(crate) fn get_mut(&mut self, peer: PeerId) -> Option<&mut PeerLink> {
        self.by_peer.get_mut(&peer)
    }

    /// Every peer, in id order.
    pub(crate) fn ids(&self) -> Vec<PeerId> {
        let mut ids: Vec<PeerId> = self.by_peer.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_peer.is_empty()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (PeerId, &mut PeerLink)> {
        self.by_peer.iter_mut().map(|(p, l)| (*p, l))
    }

    /// Accepted peers still assembling their bundle or handshaking (closing and aborted ones
    /// are on their way out and do not count).
    pub(crate) fn unproven(&self) -> Vec<Unproven> {
        self.by_peer
            .iter()
            .filter(|(_, l)| {
                !l.authenticated
                    && matches!(l.phase, LinkPhase::Assembling { .. } | LinkPhase::Open)
            })
            .filter_map(|(&peer, l)| {
                let (addr, since) = l.origin?;
                Some(Unproven {
                    peer,
                    addr,
                    since,
                    conns: l.conns.len(),
                })
            })
            .collect()
    }

    /// Removes a link (its sockets close once its halves dropped their streams). A placement
    /// still undecided never will be.
    pub(crate) fn remove(&mut self, peer: PeerId) -> Option<PeerLink> {
        let link = self.by_peer.remove(&peer)?;
        self.by_token.remove(&link.token);
        link.placement.decide(Decision::Gone);
        Some(link)
    }

    /// Adds a connection whose preamble was `pre` to its bundle. The bundle's first connection
    /// to arrive, whatever its index (preambles are read concurrently), makes a new peer
    /// (numbered from 0 in arrival order). `origin`: the address and acceptance time of an
    /// accepted connection (`None`: this node connected); a bundle's connections all come from
    /// one address.
    pub(crate) fn attach(
        &mut self,
        pre: Preamble,
        stream: TcpStream,
        now: std::time::Instant,
        origin: Option<(IpAddr, std::time::Instant)>,
    ) -> Attached {
        let Ok(socket) = stream.try_clone() else {
            return Attached::Refused;
        };
        let peer = match self.by_token.get(&pre.token) {
            Some(&peer) => {
                match self.by_peer.get(&peer) {
                    Some(link)
                        if matches!(link.phase, LinkPhase::Assembling { .. })
                            && link.expected == usize::from(pre.count)
                            && link.conns.iter().all(|c| c.index != pre.index)
                            && link.origin.map(|o| o.0) == origin.map(|o| o.0) => {}
                    _ => return Attached::Refused,
                }
                peer
            }
            None => {
                let peer = PeerId(self.next_peer);
                self.next_peer += 1;
                self.by_token.insert(pre.token, peer);
                self.by_peer.insert(
                    peer,
                    PeerLink {
                        token: pre.token,
                        expected: usize::from(pre.count),
                        conns: Vec::new(),
                        backlog: Arc::default(),
                        halves: 0,
                        phase: LinkPhase::Assembling { since: now },
                        origin,
                        authenticated: false,
                        placement: PeerPlacement::pending(),
                        offer: None,
                    },
                );
                peer
            }
        };
        let link = self.by_peer.get_mut(&peer).expect("present");
        link.conns.push(Conn {
            index: pre.index,
            socket,
            queue: Arc::new(JobQueue::new()),
            pending: Some(stream),
        });
        if link.conns.len() < link.expected {
            Attached::Waiting(peer)
        } else {
            // In index order: control frames travel on connection 0.
            link.conns.sort_by_key(|c| c.index);
            Attached::Complete(peer)
        }
    }
}
