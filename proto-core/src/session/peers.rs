//! Connections shared by both endpoints: the handshake, the negotiated version (every frame is
//! encoded and decoded here, so a driver never learns it) and liveness of every peer.
//!
//! A handshake that passed its checks completes at once, unless a data-path offer is part of
//! it: a peer's offer waits for the transport's answer before this side's `HelloAccept` leaves
//! ([`DataPathNegotiation::Offered`], [`PeerTable::answered`]), and this side's own offer waits
//! for the peer's `HelloAccept`, whose answer is reported just before `PeerReady`
//! ([`DataPathNegotiation::Answered`]). Both waits are bounded by the handshake deadline.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use super::config::Deadlines;
use super::state::{PeerEvent, PeerPhase};
use super::timers::{TimerKey, Timers};
use super::{CloseReason, Counters, DataPathNegotiation, Event, Output, ProtocolError, UsageError};
use crate::ids::PeerId;
use crate::plan::check_pairable;
use crate::time::Instant;
use crate::wire::{
    negotiate, DecodeError, Frame, FrameHeader, FrameKind, Heartbeat, Hello, HelloAccept,
    HelloReject, RejectReason, Role, Topology, MAX_BODY_LEN, MAX_DATA_PATH_LEN,
    MAX_HANDSHAKE_BODY_LEN, PROTOCOL_VERSION,
};

#[derive(Clone, Debug)]
pub(crate) struct PeerEntry {
    phase: PeerPhase,
    /// The peer's Hello, once validated.
    remote: Option<Hello>,
    /// The version negotiated at the handshake (this build's newest before it).
    version: u16,
    connected_at: Instant,
    last_rx: Instant,
    last_tx: Instant,
    heartbeat_seq: u64,
    /// The data-path offer this side's Hello carried.
    offer: Option<Bytes>,
    /// The peer's Hello, accepted, while the data-path negotiation holds the handshake.
    held: Option<Held>,
    /// The answer of the peer's `HelloAccept`, once it came (this side offered).
    peer_answer: Option<Option<Bytes>>,
    /// Why this side closed the connection, if it did.
    closed_for: Option<CloseReason>,
}

impl PeerEntry {
    /// Why this side closed the connection (`None`: it did not; the peer or the network did).
    pub(crate) fn closed_for(&self) -> Option<CloseReason> {
        self.closed_for
    }
}

/// A peer's Hello that passed every check, while the data-path negotiation holds the handshake.
#[derive(Clone, Debug)]
struct Held {
    remote: Hello,
    /// This side's `HelloAccept` (sent, or waiting for the transport's answer).
    accept: HelloAccept,
    /// The peer offered a data path and the transport has not answered yet.
    answer_due: bool,
}

/// Where a frame goes after the connection layer saw it.
pub(crate) enum Route {
    /// Consumed by the connection layer (handshake, heartbeat, dropped).
    Done,
    /// The handshake just completed: the endpoint may send queued frames to the peer.
    BecameReady,
    /// A session frame from a ready peer.
    Session(Frame),
    /// Bytes from a ready peer that are no frame: the peer is being closed; its sessions fail.
    Malformed,
}

/// What a peer's deadline did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerExpiry {
    None,
    Handshake,
    Liveness,
}

/// Most departed peers a [`PeerTable`] remembers (the smallest ids go first: the threaded
/// transports number their connections upwards and never reuse an id).
const DEPARTED_MAX: usize = if cfg!(test) { 4 } else { 4096 };

#[derive(Clone, Debug)]
pub(crate) struct PeerTable {
    local: Hello,
    deadlines: Deadlines,
    peers: BTreeMap<PeerId, PeerEntry>,
    /// Peers whose connection ended and that did not connect again (at most
    /// [`DEPARTED_MAX`]), kept when the transport never reuses an id: a request opened or
    /// registered towards one fails at once, as the connection's end failed the requests that
    /// were open then, instead of waiting out its registration or result deadline for a peer
    /// that is gone.
    departed: BTreeSet<PeerId>,
    /// Whether the transport may reuse a departed peer's id (then none is kept in `departed`).
    ids_reused: bool,
}

impl PeerTable {
    pub(crate) fn new(local: Hello, deadlines: Deadlines, ids_reused: bool) -> Self {
        PeerTable {
            local,
            deadlines,
            peers: BTreeMap::new(),
            departed: BTreeSet::new(),
            ids_reused,
        }
    }

    /// Whether `peer`'s connection ended and it did not connect again (among the last
    /// [`DEPARTED_MAX`] peers that left).
    pub(crate) fn has_departed(&self, peer: PeerId) -> bool {
        self.departed.contains(&peer)
    }

    pub(crate) fn is_ready(&self, peer: PeerId) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|p| p.phase == PeerPhase::Ready)
    }

    pub(crate) fn phase(&self, peer: PeerId) -> Option<PeerPhase> {
        self.peers.get(&peer).map(|p| p.phase)
    }

    pub(crate) fn remote(&self, peer: PeerId) -> Option<&Hello> {
        self.peers.get(&peer).and_then(|p| p.remote.as_ref())
    }

    /// The version negotiated with `peer` (if its handshake completed).
    pub(crate) fn version(&self, peer: PeerId) -> Option<u16> {
        self.peers
            .get(&peer)
            .filter(|p| p.remote.is_some())
            .map(|p| p.version)
    }

    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }

    /// The largest frame body `peer` may send: a handshake's until its Hello was accepted.
    pub(crate) fn body_limit(&self, peer: PeerId) -> u32 {
        if self.version(peer).is_some() {
            MAX_BODY_LEN
        } else {
            MAX_HANDSHAKE_BODY_LEN
        }
    }

    fn step(entry: &mut PeerEntry, event: PeerEvent) -> bool {
        entry.phase.on(event).advance(&mut entry.phase)
    }

    /// `peer` connected: sends this side's Hello, carrying `offer` if there is one.
    pub(crate) fn connected(
        &mut self,
        now: Instant,
        (peer, offer): (PeerId, Option<Bytes>),
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> Result<(), UsageError> {
        if self.peers.contains_key(&peer) {
            return Err(UsageError::PeerAlreadyConnected(peer));
        }
        check_data_path_len(offer.as_ref())?;
        // A transport may give a new connection the id of one that ended.
        self.departed.remove(&peer);
        self.peers.insert(
            peer,
            PeerEntry {
                phase: PeerPhase::Handshaking,
                remote: None,
                version: PROTOCOL_VERSION,
                connected_at: now,
                last_rx: now,
                last_tx: now,
                heartbeat_seq: 0,
                offer: offer.clone(),
                held: None,
                peer_answer: None,
                closed_for: None,
            },
        );
        let hello = Frame::Hello(Hello {
            data_path_offer: offer,
            ..self.local.clone()
        });
        self.emit(peer, hello, out, counters);
        timers.arm(now + self.deadlines.handshake, TimerKey::Peer(peer));
        Ok(())
    }

    pub(crate) fn disconnected(&mut self, peer: PeerId) -> Result<PeerEntry, UsageError> {
        let entry = self
            .peers
            .remove(&peer)
            .ok_or(UsageError::UnknownPeer(peer))?;
        if !self.ids_reused {
            self.departed.insert(peer);
        }
        if self.departed.len() > DEPARTED_MAX {
            self.departed.pop_first();
        }
        Ok(entry)
    }

    /// Encodes `frame` at the peer's version and queues it. Returns false (and counts it) if
    /// the codec refused it.
    fn emit(
        &mut self,
        peer: PeerId,
        frame: Frame,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
    ) -> bool {
        let version = self
            .peers
            .get(&peer)
            .map_or(PROTOCOL_VERSION, |p| p.version);
        let mut buf = vec![0u8; frame.encoded_len()];
        match frame.emit_versioned(version, &mut buf) {
            Ok(n) => {
                buf.truncate(n);
                out.push_back(Output::Transmit {
                    peer,
                    frame,
                    bytes: Bytes::from(buf),
                });
                true
            }
            Err(_) => {
                counters.encode_errors += 1;
                false
            }
        }
    }

    /// Queues `frame` for `peer` if it is connected and not closing. Returns false when the
    /// frame cannot be encoded (the caller fails what depended on it).
    pub(crate) fn transmit(
        &mut self,
        now: Instant,
        peer: PeerId,
        frame: Frame,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
    ) -> bool {
        let Some(p) = self.peers.get_mut(&peer) else {
            return true;
        };
        if !matches!(p.phase, PeerPhase::Handshaking | PeerPhase::Ready) {
            return true;
        }
        p.last_tx = now;
        self.emit(peer, frame, out, counters)
    }

    /// Asks the transport to close `peer` (once); from now on nothing from it is accepted.
    pub(crate) fn close(
        &mut self,
        peer: PeerId,
        reason: CloseReason,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if Self::step(p, PeerEvent::Close) {
                p.closed_for.get_or_insert(reason);
                counters.peers_closed += 1;
                out.push_back(Output::ClosePeer { peer, reason });
            }
        }
    }

    /// Payload from `peer` is arriving on the stream its frames take: it is alive.
    pub(crate) fn alive(&mut self, now: Instant, peer: PeerId) -> Result<(), UsageError> {
        let p = self
            .peers
            .get_mut(&peer)
            .ok_or(UsageError::UnknownPeer(peer))?;
        if matches!(p.phase, PeerPhase::Handshaking | PeerPhase::Ready) {
            p.last_rx = p.last_rx.max(now);
        }
        Ok(())
    }

    /// Decodes and routes the bytes of one frame from `peer`.
    pub(crate) fn on_bytes(
        &mut self,
        now: Instant,
        peer: PeerId,
        bytes: &[u8],
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> Result<Route, UsageError> {
        let entry = self
            .peers
            .get_mut(&peer)
            .ok_or(UsageError::UnknownPeer(peer))?;
        if !matches!(entry.phase, PeerPhase::Handshaking | PeerPhase::Ready) {
            // Rejected or closing: the peer is no longer listened to.
            return Ok(Route::Done);
        }
        entry.last_rx = now;
        if entry.remote.is_none() {
            if let Some(error) = past_handshake_limit(bytes) {
                return Ok(self.malformed(peer, error, out, counters));
            }
        }
        let decoded = match entry.remote {
            Some(_) => Frame::parse_negotiated(bytes, entry.version),
            None => Frame::parse(bytes),
        };
        let frame = match decoded {
            Ok((frame, n)) if n == bytes.len() => frame,
            Ok((frame, n)) => {
                let error = DecodeError::TrailingBytes {
                    kind: frame.kind(),
                    extra: bytes.len() - n,
                };
                return Ok(self.malformed(peer, error, out, counters));
            }
            Err(error) => return Ok(self.malformed(peer, error, out, counters)),
        };
        self.on_frame(now, peer, frame, out, counters, timers)
    }

    /// Bytes that are no frame: the connection cannot be trusted any more.
    fn malformed(
        &mut self,
        peer: PeerId,
        error: DecodeError,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
    ) -> Route {
        counters.decode_errors += 1;
        counters.protocol_errors += 1;
        let ready = self.is_ready(peer);
        out.push_back(Output::Event(Event::ProtocolViolation {
            peer,
            error: ProtocolError::Undecodable { error },
        }));
        self.close(peer, CloseReason::ProtocolViolation, out, counters);
        if ready {
            Route::Malformed
        } else {
            Route::Done
        }
    }

    fn on_frame(
        &mut self,
        now: Instant,
        peer: PeerId,
        frame: Frame,
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> Result<Route, UsageError> {
        let entry = self.peers.get_mut(&peer).expect("checked by on_bytes");
        match frame {
            Frame::Hello(remote) => {
                let known = entry
                    .remote
                    .as_ref()
                    .or(entry.held.as_ref().map(|h| &h.remote));
                if let Some(known) = known {
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
                match negotiate(&self.local, &remote).and_then(|accept| {
                    check_pairing(&self.local, &remote)?;
                    Ok(accept)
                }) {
                    Ok(accept) => {
                        entry.version = accept.version;
                        entry.last_tx = now;
                        let offer = remote.data_path_offer.clone();
                        entry.held = Some(Held {
                            remote,
                            accept: accept.clone(),
                            answer_due: offer.is_some(),
                        });
                        match offer {
                            // The transport answers first; the HelloAccept carries its answer.
                            Some(offer) => {
                                out.push_back(Output::DataPath(DataPathNegotiation::Offered {
                                    peer,
                                    offer,
                                }))
                            }
                            None => {
                                self.emit(peer, Frame::HelloAccept(accept), out, counters);
                            }
                        }
                        Ok(self.try_complete(peer, out, timers))
                    }
                    Err(reject) => {
                        Self::step(entry, PeerEvent::Rejected);
                        counters.peers_rejected += 1;
                        self.emit(peer, Frame::HelloReject(reject.clone()), out, counters);
                        close_rejected(peer, reject, CloseReason::HandshakeRejected, out, counters);
                        Ok(Route::Done)
                    }
                }
            }
            Frame::HelloReject(reject) => {
                Self::step(entry, PeerEvent::Rejected);
                counters.peers_rejected += 1;
                close_rejected(peer, reject, CloseReason::RejectedByPeer, out, counters);
                Ok(Route::Done)
            }
            // The answer to this side's offer; the handshake may complete now.
            Frame::HelloAccept(accept)
                if entry.offer.is_some()
                    && entry.remote.is_none()
                    && entry.peer_answer.is_none() =>
            {
                entry.peer_answer = Some(accept.data_path_answer);
                Ok(self.try_complete(peer, out, timers))
            }
            Frame::HelloAccept(_) | Frame::Heartbeat(_) => Ok(Route::Done),
            Frame::DataWrite(_) => {
                // Data writes reach a receiver through admission, never as control frames.
                counters.protocol_errors += 1;
                out.push_back(Output::Event(Event::ProtocolViolation {
                    peer,
                    error: ProtocolError::UnexpectedFrame {
                        kind: "DataWrite",
                        role: self.local.role,
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
                            kind: super::frame_kind(&other),
                        },
                    }));
                    self.close(peer, CloseReason::ProtocolViolation, out, counters);
                    return Ok(Route::Done);
                }
                Ok(Route::Session(other))
            }
        }
    }

    /// The transport answered `peer`'s data-path offer: this side's `HelloAccept` carries the
    /// answer, and the handshake completes unless this side waits for the peer's answer too.
    /// A usage error (nothing changed) unless `peer`'s handshake waits for that answer.
    pub(crate) fn answered(
        &mut self,
        now: Instant,
        (peer, answer): (PeerId, Bytes),
        out: &mut VecDeque<Output>,
        counters: &mut Counters,
        timers: &mut Timers,
    ) -> Result<Route, UsageError> {
        check_data_path_len(Some(&answer))?;
        let entry = self
            .peers
            .get_mut(&peer)
            .ok_or(UsageError::UnknownPeer(peer))?;
        let held = match &mut entry.held {
            Some(held) if held.answer_due && entry.phase == PeerPhase::Handshaking => held,
            _ => return Err(UsageError::NoOfferPending(peer)),
        };
        held.answer_due = false;
        let accept = HelloAccept {
            data_path_answer: Some(answer),
            ..held.accept.clone()
        };
        entry.last_tx = now;
        self.emit(peer, Frame::HelloAccept(accept), out, counters);
        Ok(self.try_complete(peer, out, timers))
    }

    /// Completes `peer`'s held handshake once nothing holds it any more: the transport answered
    /// the peer's offer (if it made one) and the peer answered this side's (if it made one).
    fn try_complete(
        &mut self,
        peer: PeerId,
        out: &mut VecDeque<Output>,
        timers: &mut Timers,
    ) -> Route {
        let Some(entry) = self.peers.get_mut(&peer) else {
            return Route::Done;
        };
        let waiting = entry.held.as_ref().is_none_or(|h| h.answer_due)
            || (entry.offer.is_some() && entry.peer_answer.is_none());
        if waiting {
            return Route::Done;
        }
        let held = entry.held.take().expect("checked above");
        let (instance, role) = (held.remote.instance, held.remote.role);
        entry.remote = Some(held.remote);
        Self::step(entry, PeerEvent::HelloAccepted);
        if entry.offer.is_some() {
            let answer = entry.peer_answer.take().flatten();
            out.push_back(Output::DataPath(DataPathNegotiation::Answered {
                peer,
                answer,
            }));
        }
        out.push_back(Output::Event(Event::PeerReady {
            peer,
            instance,
            role,
        }));
        timers.arm_opt(self.next_deadline(peer), TimerKey::Peer(peer));
        Route::BecameReady
    }

    /// The peer's next deadline: the handshake's before it completes, then the heartbeat's and
    /// the liveness timeout's. A rejected or closing peer has none (it waits for the transport).
    pub(crate) fn next_deadline(&self, peer: PeerId) -> Option<Instant> {
        let p = self.peers.get(&peer)?;
        match p.phase {
            PeerPhase::Handshaking => Some(p.connected_at + self.deadlines.handshake),
            PeerPhase::Ready => Some(
                (p.last_tx + self.deadlines.heartbeat_interval)
                    .min(p.last_rx + self.deadlines.liveness_timeout),
            ),
            PeerPhase::Rejected | PeerPhase::Closing => None,
        }
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
        let d = self.deadlines;
        let Some(p) = self.peers.get_mut(&peer) else {
            return PeerExpiry::None;
        };
        let mut heartbeat = None;
        let expiry = match p.phase {
            PeerPhase::Rejected | PeerPhase::Closing => return PeerExpiry::None,
            PeerPhase::Handshaking if now >= p.connected_at + d.handshake => PeerExpiry::Handshake,
            PeerPhase::Handshaking => PeerExpiry::None,
            PeerPhase::Ready if now >= p.last_rx + d.liveness_timeout => PeerExpiry::Liveness,
            PeerPhase::Ready => {
                if now >= p.last_tx + d.heartbeat_interval {
                    p.heartbeat_seq += 1;
                    p.last_tx = now;
                    heartbeat = Some(p.heartbeat_seq);
                }
                PeerExpiry::None
            }
        };
        if let Some(seq) = heartbeat {
            counters.heartbeats_sent += 1;
            self.emit(peer, Frame::Heartbeat(Heartbeat { seq }), out, counters);
        }
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

/// A data-path offer or answer the wire cannot carry.
fn check_data_path_len(bytes: Option<&Bytes>) -> Result<(), UsageError> {
    match bytes {
        Some(b) if b.len() > MAX_DATA_PATH_LEN => Err(UsageError::DataPathTooLong {
            len: b.len(),
            max: MAX_DATA_PATH_LEN,
        }),
        _ => Ok(()),
    }
}

/// A frame from a peer whose handshake has not completed that declares a body longer than a
/// handshake's (checked before decoding it).
fn past_handshake_limit(bytes: &[u8]) -> Option<DecodeError> {
    let header = FrameHeader::view(bytes)?;
    let kind = FrameKind::from_code(header.kind)?;
    let len = header.body_len.get();
    (len > MAX_HANDSHAKE_BODY_LEN).then_some(DecodeError::BodyTooLong {
        kind,
        len,
        max: MAX_HANDSHAKE_BODY_LEN,
    })
}

/// Checks, once the versions and model agree, that the two sides can actually be paired:
/// sound topologies, and pool layouts the planner can pair group by group. A mismatch is
/// refused at the handshake naming the first difference, instead of failing every request at
/// its first slice.
/// Tells the engine the handshake with `peer` was refused (`reject`, by either side) and asks
/// the transport to close the peer.
fn close_rejected(
    peer: PeerId,
    reject: HelloReject,
    reason: CloseReason,
    out: &mut VecDeque<Output>,
    counters: &mut Counters,
) {
    out.push_back(Output::Event(Event::PeerRejected {
        peer,
        reason: reject.reason,
        message: reject.message,
    }));
    counters.peers_closed += 1;
    out.push_back(Output::ClosePeer { peer, reason });
}

fn check_pairing(local: &Hello, remote: &Hello) -> Result<(), HelloReject> {
    for (who, t) in [("local", &local.topology), ("remote", &remote.topology)] {
        if let Some(problem) = topology_problem(t) {
            return Err(HelloReject {
                reason: RejectReason::TopologyMismatch,
                message: format!("{who} topology is unsound: {problem}"),
            });
        }
    }
    let (src, dst) = match local.role {
        Role::Sender => (&local.groups, &remote.groups),
        Role::Receiver => (&remote.groups, &local.groups),
    };
    if src.len() != dst.len() {
        return Err(HelloReject {
            reason: RejectReason::LayoutMismatch,
            message: format!(
                "the sender has {} layer groups, the receiver {}",
                src.len(),
                dst.len()
            ),
        });
    }
    for (g, (s, d)) in src.iter().zip(dst).enumerate() {
        if let Err(e) = check_pairable(s, d) {
            return Err(HelloReject {
                reason: RejectReason::LayoutMismatch,
                message: format!("group#{g}: {e}"),
            });
        }
    }
    Ok(())
}

fn topology_problem(t: &Topology) -> Option<String> {
    if t.tp_size > 0 && t.tp_rank >= t.tp_size {
        return Some(format!(
            "tensor-parallel rank {} of size {}",
            t.tp_rank, t.tp_size
        ));
    }
    if t.pp_size > 0 && t.pp_rank >= t.pp_size {
        return Some(format!(
            "pipeline-parallel rank {} of size {}",
            t.pp_rank, t.pp_size
        ));
    }
    if t.layer_begin > t.layer_end {
        return Some(format!(
            "layers {}..{} run backwards",
            t.layer_begin, t.layer_end
        ));
    }
    None
}
