//! Peer copies in the core's handshake ([`crate::peer_copy`]): a peer's offer, which the core
//! hands to the node (`DataPathNegotiation::Offered`), is evaluated on a thread of its own, off
//! the node's lock (opening CUDA IPC handles takes a while, and the driver's calls need a full
//! stack); the link is placed and the answer handed to the core in one hold of the lock, so
//! the link pulls before the `HelloAccept` that lets the sender write leaves. The sender's side
//! places its link when the core reports the peer's answer (`TcpIo::data_path`).

use std::sync::Arc;
use std::thread;

use bytes::Bytes;
use kvpipe_core::wire::Role;
use kvpipe_core::{Endpoint, PeerId, TransportInput};
use kvpipe_driver::deadline_after;

use super::Shared;
use crate::peer_copy::{self, Answer, TcpDataPath};
use crate::placement::{Decision, Placement};
use crate::stats::bump;

/// Stack of an offer's thread: the CUDA driver's calls need more than a small one.
const OFFER_STACK: usize = 2 << 20;

/// Where the node's I/O (under the lock) hands a peer's offer, to be evaluated and answered.
pub(crate) type OfferDesk = Arc<dyn Fn(PeerId, Bytes) + Send + Sync>;

impl<E: Endpoint + Send + 'static> Shared<E> {
    /// The desk for this node's offers: a thread per offer. A node that is gone answers
    /// nothing (its peers' handshakes time out); one without a thread for the offer neither.
    pub(super) fn offer_desk(self: &Arc<Self>) -> OfferDesk {
        let node = Arc::downgrade(self);
        Arc::new(move |peer, offer| {
            let node = node.clone();
            let spawned = thread::Builder::new()
                .name("kvpipe-tcp-offer".into())
                .stack_size(OFFER_STACK)
                .spawn(move || {
                    if let Some(shared) = node.upgrade() {
                        shared.answer_offer(peer, &offer);
                    }
                });
            if spawned.is_err() {
                tracing::warn!(target: "kvpipe::tcp", %peer, "no thread for a peer-copy offer; the handshake will time out");
            }
        })
    }

    /// Evaluates `peer`'s offer, places its link, and answers through the core. A receiver
    /// on `PeerCopy` that cannot pull answers why, then closes the peer (after the answer).
    fn answer_offer(&self, peer: PeerId, offer: &[u8]) {
        let is_receiver = self.lock().endpoint.role() == Role::Receiver;
        let opened = peer_copy::evaluate(offer, self.config.data_path, is_receiver, &self.regions);
        let mut st = self.lock();
        let now = self.now();
        let st = &mut *st;
        // Gone meanwhile: the opened regions close here.
        let Some(link) = st.io.links.get_mut(peer) else {
            return;
        };
        let mut refused = false;
        let answer = match opened {
            Ok(mappings) => {
                bump(&self.stats.peer_copy_peers, 1);
                link.placement
                    .decide(Decision::Placed(Placement::Pull(Arc::new(mappings))));
                Answer::Accepted
            }
            Err(why) => {
                if self.config.data_path == TcpDataPath::PeerCopy {
                    // No fall back to the sockets.
                    tracing::warn!(target: "kvpipe::tcp", %peer, %why, "no peer copies from a sender; dropped (data path peer-copy)");
                    link.placement.decide(Decision::Refused(why.clone()));
                    refused = true;
                } else {
                    link.placement.decide(Decision::Placed(Placement::Socket));
                }
                Answer::Declined(why)
            }
        };
        let answer = Bytes::from(answer.encode());
        st.feed(now, TransportInput::DataPathAnswered { peer, answer });
        self.drain(st, now);
        if refused {
            let until = deadline_after(self.config.close_grace);
            if let Some(link) = st.io.links.get_mut(peer) {
                if link.close_orderly(until) {
                    bump(&self.stats.peers_closed, 1);
                    self.wake_timer_by(st, until);
                }
            }
        }
    }
}
