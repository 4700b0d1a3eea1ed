//! Connections shared by both endpoints: the handshake and liveness of every peer.

use std::collections::{BTreeMap, VecDeque};

use super::config::Deadlines;
use super::timers::{TimerKey, Timers};
use super::{frame_kind, CloseReason, Counters, Event, Output, ProtocolError, UsageError};
use crate::ids::PeerId;
use crate::time::Instant;
use crate::wire::{negotiate, Frame, Heartbeat, Hello};

#[derive(Clone, Debug)]
pub(crate) struct PeerEntry {
    /// The peer's Hello, once validated.
    pub(crate) remote: Option<Hello>,
    /// A close was requested; waiting for the transport's disconnect report.
    pub(crate) closing: bool,
    /// The handshake was refused (by either side): frames are dropped.
    rejected: bool,
    connected_at: Instant,
    last_rx: Instant,
    last_tx: Instant,
    heartbeat_seq: u64,
}

/// Where a frame goes after the connection layer saw it.
pub(crate) enum Route {
    /// Consumed by the connection layer (handshake, heartbeat, dropped).
    Done,
    /// The handshake just completed: the endpoint may send queued frames to the peer.
    BecameReady,
    /// A session frame from a ready peer.
    Session(Frame),
}

/// What a peer's deadline did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerExpiry {
    None,
    Handshake,
    Liveness,
}

#[derive(Clone, Debug)]
pub(crate) struct PeerTable {
    local: Hello,
    deadlines: Deadlines,
    peers: BTreeMap<PeerId, PeerEntry>,
}

impl PeerTable {
    pub(crate) fn new(local: Hello, deadlines: Deadlines) -> Self {
        PeerTable {
            local,
            deadlines,
            peers: BTreeMap::new(),
        }
    }

    pub(crate) fn is_ready(&self, peer: PeerId) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|p| p.remote.is_some() && !p.rejected)
    }

    pub(crate) fn remote(&self, peer: PeerId) -> Option<&Hello> {
        self.peers.get(&peer).and_then(|p| p.remote.as_ref())
    }

    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }

    pub(crate) fn connected(
        &mut self,
        now: Instant,
        peer: PeerId,
        out: &mut VecDeque<Output>,
        timers: &mut Timers,
    ) -> Result<(), UsageError> {
        if self.peers.contains_key(&peer) {
            return Err(UsageError::PeerAlreadyConnected(peer));
        }
        self.peers.insert(
            peer,
            PeerEntry {
                remote: None,
                closing: false,
                rejected: false,
                connected_at: now,
                last_rx: now,
                last_tx: now,
                heartbeat_seq: 0,
            },
        );
        out.push_back(Output::Transmit {
            peer,
            frame: Frame::Hello(self.local.clone()),
        });
        timers.arm(now + self.deadlines.handshake, TimerKey::Peer(peer));
        Ok(())
    }

    pub(crate) fn disconnected(&mut self, peer: PeerId) -> Result<PeerEntry, UsageError> {
        self.peers
            .remove(&peer)
            .ok_or(UsageError::UnknownPeer(peer))
    }

    /// Queues `frame` for `peer` if it is connected and not closing.
    pub(crate) fn transmit(
        &mut self,
        now: Instant,
        peer: PeerId,
        frame: Frame,
        out: &mut VecDeque<Output>,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if p.closing || p.rejected {
                return;
            }
            p.last_tx = now;
            out.push_back(Output::Transmit { peer, frame });
        }
    }

    /// Asks the transport to close `peer` (once).
    pub(crate) fn close(
        &mut self,
        peer: PeerId,
        reason: CloseReason,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if !p.closing {
                p.closing = true;
                counters.peers_closed += 1;
                out.push_back(Output::ClosePeer { peer, reason });
            }
        }
    }

    pub(crate) fn on_frame(
        &mut self,
        now: Instant,
        peer: PeerId,
        frame: Frame,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> Result<Route, UsageError> {
        let local = &self.local;
        let entry = self
            .peers
            .get_mut(&peer)
            .ok_or(UsageError::UnknownPeer(peer))?;
        if entry.rejected {
            return Ok(Route::Done);
        }
        entry.last_rx = now;
        match frame {
            Frame::Hello(remote) => {
                if let Some(known) = &entry.remote {
                    if *known != remote {
                        counters.protocol_errors += 1;
                        out.push_back(Output::Event(Event::ProtocolViolation {
                            peer,
                            error: ProtocolError::SecondHello,
                        }));
                    } else {
                        counters.duplicates += 1;
                    }
                    return Ok(Route::Done);
                }
                match negotiate(local, &remote) {
                    Ok(accept) => {
                        let instance = remote.instance;
                        let role = remote.role;
                        entry.remote = Some(remote);
                        entry.last_tx = now;
                        out.push_back(Output::Transmit {
                            peer,
                            frame: Frame::HelloAccept(accept),
                        });
                        out.push_back(Output::Event(Event::PeerReady {
                            peer,
                            instance,
                            role,
                        }));
                        timers.arm_opt(self.next_deadline(peer), TimerKey::Peer(peer));
                        Ok(Route::BecameReady)
                    }
                    Err(reject) => {
                        entry.rejected = true;
                        counters.peers_rejected += 1;
                        out.push_back(Output::Transmit {
                            peer,
                            frame: Frame::HelloReject(reject.clone()),
                        });
                        out.push_back(Output::Event(Event::PeerRejected {
                            peer,
                            reason: reject.reason,
                            message: reject.message,
                        }));
                        self.close(peer, CloseReason::HandshakeRejected, out, counters);
                        Ok(Route::Done)
                    }
                }
            }
            Frame::HelloReject(reject) => {
                entry.rejected = true;
                counters.peers_rejected += 1;
                out.push_back(Output::Event(Event::PeerRejected {
                    peer,
                    reason: reject.reason,
                    message: reject.message,
                }));
                self.close(peer, CloseReason::RejectedByPeer, out, counters);
                Ok(Route::Done)
            }
            Frame::HelloAccept(_) | Frame::Heartbeat(_) => Ok(Route::Done),
            Frame::DataWrite(_) => {
                // Data writes are the transport's business; one reaching the core is dropped.
                counters.protocol_errors += 1;
                out.push_back(Output::Event(Event::ProtocolViolation {
                    peer,
                    error: ProtocolError::UnexpectedFrame {
                        kind: "DataWrite",
                        role: local.role,
                    },
                }));
                Ok(Route::Done)
            }
            other => {
                if entry.remote.is_none() {
                    counters.protocol_errors += 1;
                    out.push_back(Output::Event(Event::ProtocolViolation {
                        peer,
                        error: ProtocolError::FrameBeforeHandshake {
                            kind: frame_kind(&other),
                        },
                    }));
                    self.close(peer, CloseReason::ProtocolViolation, out, counters);
                    return Ok(Route::Done);
                }
                Ok(Route::Session(other))
            }
        }
    }

    /// The peer's next deadline: the handshake's before it completes, then the heartbeat's and
    /// the liveness timeout's. A closing peer has none (it waits for the transport).
    pub(crate) fn next_deadline(&self, peer: PeerId) -> Option<Instant> {
        let p = self.peers.get(&peer)?;
        if p.closing || p.rejected {
            return None;
        }
        if p.remote.is_none() {
            return Some(p.connected_at + self.deadlines.handshake);
        }
        Some(
            (p.last_tx + self.deadlines.heartbeat_interval)
                .min(p.last_rx + self.deadlines.liveness_timeout),
        )
    }

    /// Fires the peer's due deadlines: sends a heartbeat when idle, closes the peer when its
    /// handshake or liveness deadline passed. Re-arms the next deadline.
    pub(crate) fn on_timeout(
        &mut self,
        now: Instant,
        peer: PeerId,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> PeerExpiry {
        let Some(p) = self.peers.get_mut(&peer) else {
            return PeerExpiry::None;
        };
        if p.closing || p.rejected {
            return PeerExpiry::None;
        }
        let d = self.deadlines;
        let expiry = if p.remote.is_none() {
            if now >= p.connected_at + d.handshake {
                PeerExpiry::Handshake
            } else {
                PeerExpiry::None
            }
        } else if now >= p.last_rx + d.liveness_timeout {
            PeerExpiry::Liveness
        } else {
            if now >= p.last_tx + d.heartbeat_interval {
                p.heartbeat_seq += 1;
                p.last_tx = now;
                counters.heartbeats_sent += 1;
                out.push_back(Output::Transmit {
                    peer,
                    frame: Frame::Heartbeat(Heartbeat {
                        seq: p.heartbeat_seq,
                    }),
                });
            }
            PeerExpiry::None
        };
        match expiry {
            PeerExpiry::Handshake => {
                counters.timeouts += 1;
                self.close(peer, CloseReason::HandshakeTimeout, out, counters);
            }
            PeerExpiry::Liveness => {
                counters.timeouts += 1;
                self.close(peer, CloseReason::LivenessTimeout, out, counters);
            }
            PeerExpiry::None => timers.arm_opt(self.next_deadline(peer), TimerKey::Peer(peer)),
        }
        expiry
    }
}
