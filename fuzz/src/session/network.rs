//! The connection between the endpoints: connecting and losing it, frames handed to the
//! network emulation and delivered when due, and the endpoints' timers.

use bytes::Bytes;
use kvpipe_core::session::TransportInput;
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_netem::Direction;

use super::world::{RECEIVER, SENDER};
use super::Pair;

impl Pair {
    /// Connects the endpoints; the sender's Hello carries `offer`, a data-path offer, if any
    /// (the receiver's handshake then waits for a `DataPathAnswered` step, or its deadline).
    pub(super) fn reconnect(&mut self, offer: Option<Bytes>) {
        if self.connected {
            return;
        }
        self.connected = true;
        self.link.restart(self.now);
        let now = self.now;
        let to_receiver = match offer {
            Some(offer) => TransportInput::PeerConnectedWithOffer {
                peer: RECEIVER,
                offer,
            },
            None => TransportInput::PeerConnected { peer: RECEIVER },
        };
        let r = self.sender.handle_transport(now, to_receiver);
        self.count(r);
        let r = self
            .receiver
            .handle_transport(now, TransportInput::PeerConnected { peer: SENDER });
        self.count(r);
        self.drain();
    }

    /// The connection is gone: both ends are told once nothing of it can touch memory (the
    /// pending batches fail, the admitted writes are given up).
    pub(super) fn disconnect(&mut self) {
        if !self.connected {
            return;
        }
        self.connected = false;
        self.to_receiver.clear();
        self.to_sender.clear();
        let now = self.now;
        for a in std::mem::take(&mut self.applying) {
            let input = TransportInput::WriteFinished {
                ticket: a.ticket,
                landed: false,
            };
            let r = self.receiver.handle_transport(now, input);
            self.count(r);
        }
        for b in std::mem::take(&mut self.pending) {
            self.report_batch(b, Some(TransferStatus::PeerLost));
        }
        let input = |peer| TransportInput::PeerDisconnected { peer };
        let r = self.sender.handle_transport(now, input(RECEIVER));
        self.count(r);
        let r = self.receiver.handle_transport(now, input(SENDER));
        self.count(r);
        self.drain();
    }

    /// Delivers one frame's bytes.
    pub(super) fn deliver(&mut self, to_receiver: bool, bytes: Bytes) {
        let now = self.now;
        if to_receiver {
            match Frame::parse(&bytes) {
                Ok((Frame::KvResult(r), _)) if r.is_last && r.status == TransferStatus::Success => {
                    self.delivered_last.insert(r.request);
                }
                Ok((Frame::AuxResult(a), _)) if a.status == TransferStatus::Success => {
                    self.delivered_aux.insert(a.request);
                }
                _ => {}
            }
            let input = TransportInput::FrameReceived {
                peer: SENDER,
                bytes,
            };
            let r = self.receiver.handle_transport(now, input);
            self.count(r);
        } else {
            let input = TransportInput::FrameReceived {
                peer: RECEIVER,
                bytes,
            };
            let r = self.sender.handle_transport(now, input);
            self.count(r);
        }
        self.drain();
    }

    /// Delivers every frame due by now, both ways, until none is left.
    pub(super) fn deliver_due(&mut self) {
        loop {
            let now = self.now;
            if let Some(b) = self.to_receiver.pop_due(now) {
                self.deliver(true, b);
            } else if let Some(b) = self.to_sender.pop_due(now) {
                self.deliver(false, b);
            } else {
                return;
            }
        }
    }

    pub(super) fn tick(&mut self) {
        let now = self.now;
        if self.sender.poll_timeout().is_some_and(|at| at <= now) {
            let r = self.sender.handle_transport(now, TransportInput::Timeout);
            self.count(r);
        }
        if self.receiver.poll_timeout().is_some_and(|at| at <= now) {
            let r = self.receiver.handle_transport(now, TransportInput::Timeout);
            self.count(r);
        }
        self.drain();
    }

    /// Hands a transmitted frame to the network emulation.
    pub(super) fn transmit(&mut self, to_receiver: bool, bytes: Bytes) {
        if !self.connected {
            return;
        }
        let direction = if to_receiver {
            Direction::ToReceiver
        } else {
            Direction::ToSender
        };
        let fate = self.netem.frame(self.now, &mut self.link, direction, bytes);
        if to_receiver {
            self.to_receiver.push(fate);
        } else {
            self.to_sender.push(fate);
        }
    }
}
