//! The endpoint's outputs as connection work, under the driver's lock: nothing here blocks or
//! touches a socket. Frames and data-write pieces go to the connection writers' queues, close
//! requests to the peer's link; the timer's round drops bundles that stayed incomplete past
//! the preamble timeout and aborts orderly closes past their deadline.

use bytes::Bytes;
use kvpipe_core::session::{CloseReason, DataWriteHeaders, WriteBatchId};
use kvpipe_core::{DataPathNegotiation, Event, PeerId, TransportInput, WritePlan};
use kvpipe_driver::{deadline_after, Io, Posted, WallInstant};

use super::link::LinkPhase;
use super::TcpIo;
use crate::conn::{cut_plan, BatchTally, TalliedPiece};
use crate::peer_copy::{self, TcpDataPath};
use crate::placement::{Decision, Placement};
use crate::stats::bump;

impl Io for TcpIo {
    fn transmit(&mut self, peer: PeerId, bytes: Bytes) {
        if let Some(link) = self.links.get(peer) {
            link.transmit(bytes);
        }
    }

    /// Cuts a write batch into pieces and queues them to the peer's connections (on the
    /// link's backlog, which the connection writers take from).
    fn post_writes(
        &mut self,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &WritePlan,
        headers: &DataWriteHeaders,
    ) -> Posted {
        // A peer without a link was reported disconnected: the endpoint emits nothing for it.
        // One whose link is closing or aborted is going away: its disconnect, reported once
        // every half of it stopped, drops the batch (and fails its requests as the peer lost),
        // so the batch is not failed here as a refused write.
        let Some(link) = self.links.get(peer).filter(|l| l.phase == LinkPhase::Open) else {
            return Posted::NoPeer;
        };
        let Ok(pieces) = cut_plan(
            plan,
            |region, offset, len| headers.encode(region, offset, len),
            link.conns.len(),
            (self.config.min_piece_bytes, self.config.max_piece_bytes),
            &self.regions,
            link.placement.is_source(),
        ) else {
            // A source extent outside registered memory: nothing is sent.
            return Posted::Refused;
        };
        if pieces.is_empty() {
            return Posted::Empty;
        }
        // One more than the pieces: the hold released below, once the pieces are queued, so
        // that no writer reports the batch before.
        let tally = BatchTally::new(batch, pieces.len() as u64 + 1);
        let queued = link.queue_pieces(
            pieces
                .into_iter()
                .map(|piece| TalliedPiece {
                    piece,
                    tally: tally.clone(),
                })
                .collect(),
        );
        if !queued {
            // The link started closing meanwhile (a writer ended): as above.
            return Posted::NoPeer;
        }
        Posted::Queued {
            // Every piece was written out already.
            done: tally.done(1),
        }
    }

    /// A peer that stopped answering (or is fenced) is aborted at once; otherwise what was
    /// queued to it is flushed first, bounded by the close grace, so it learns why (a
    /// rejection, a refused write).
    fn close_peer(&mut self, peer: PeerId, reason: CloseReason) -> Option<WallInstant> {
        let link = self.links.get_mut(peer)?;
        let until = deadline_after(self.config.close_grace);
        let started = match reason {
            CloseReason::LivenessTimeout
            | CloseReason::HandshakeTimeout
            | CloseReason::QuiesceFence => link.abort(),
            CloseReason::HandshakeRejected
            | CloseReason::RejectedByPeer
            | CloseReason::ProtocolViolation
            | CloseReason::GrantViolation => link.close_orderly(until),
        };
        if !started {
            return None;
        }
        tracing::debug!(target: "kvpipe::tcp", %peer, ?reason, "closing the peer's connections");
        bump(&self.stats.peers_closed, 1);
        Some(until)
    }

    fn saw_event(&mut self, event: &Event) {
        if let Event::PeerReady { peer, .. } = event {
            // Proven: it no longer counts against the caps on unauthenticated connections.
            if let Some(link) = self.links.get_mut(*peer) {
                link.authenticated = true;
                // A handshake without an offer leaves the peer on the sockets.
                link.placement.decide(Decision::Placed(Placement::Socket));
            }
        }
    }

    /// A peer's offer goes to the node's desk (answered off the lock, see `offers.rs`); the
    /// peer's answer to this node's offer places the link, before `PeerReady`.
    fn data_path(&mut self, negotiation: DataPathNegotiation) -> Option<TransportInput> {
        match negotiation {
            DataPathNegotiation::Offered { peer, offer } => match &self.offers {
                Some(desk) if self.links.get(peer).is_some() => {
                    desk(peer, offer);
                    None
                }
                _ => Some(TransportInput::DataPathAnswered {
                    peer,
                    answer: Bytes::new(),
                }),
            },
            DataPathNegotiation::Answered { peer, answer } => {
                let link = self.links.get_mut(peer)?;
                let offer = link.offer.as_ref()?;
                match peer_copy::peer_pulls(answer.as_deref(), offer) {
                    Ok(()) => {
                        bump(&self.stats.peer_copy_peers, 1);
                        link.placement.decide(Decision::Placed(Placement::Source));
                    }
                    // No fall back to the sockets: the connect fails with the reason.
                    Err(why) if self.config.data_path == TcpDataPath::PeerCopy => {
                        link.placement.decide(Decision::Refused(why));
                        link.abort();
                    }
                    Err(why) => {
                        tracing::info!(target: "kvpipe::tcp", %peer, %why, "peer copies declined; data goes over the sockets");
                        link.placement.decide(Decision::Placed(Placement::Socket));
                    }
                }
                None
            }
        }
    }

    fn timer_round(&mut self, now: WallInstant) -> Option<WallInstant> {
        let timeout = self.config.preamble_timeout;
        let mut wake = None::<WallInstant>;
        let mut stale = Vec::new();
        for (peer, link) in self.links.iter_mut() {
            match link.deadline(timeout) {
                Some(at) if at <= now => match link.phase {
                    LinkPhase::Assembling { .. } => stale.push(peer),
                    _ => {
                        link.abort();
                    }
                },
                Some(at) => wake = Some(wake.map_or(at, |w| w.min(at))),
                None => {}
            }
        }
        for peer in stale {
            // The core never heard of it; its sockets close with the link.
            self.links.remove(peer);
        }
        wake
    }
}

impl TcpIo {
    /// Links and lobby of a new node.
    pub(super) fn new(
        regions: std::sync::Arc<crate::memory::RegionTable>,
        config: crate::config::TcpConfig,
        stats: std::sync::Arc<crate::stats::StatCells>,
    ) -> Self {
        TcpIo {
            links: Default::default(),
            lobby: Default::default(),
            phase: super::NodePhase::Running,
            regions,
            config,
            stats,
            offers: None,
        }
    }
}
