//! The transport's part, as the in-process transport plays it: data writes through the
//! receiver's admission, write batches carried out and reported, transport inputs folded into
//! the case, and the network and transport catching up.

use kvpipe_core::session::{Admission, TransportInput, WriteTicket};
use kvpipe_core::wire::{DataWrite, TransferStatus};

use super::world::{fold, RECEIVER, SENDER};
use super::{Applying, Pair, PendingBatch};

impl Pair {
    /// Asks the receiver to admit a data write; checks and remembers an admitted one.
    pub(super) fn admit(&mut self, header: &DataWrite) -> Admission {
        let request = header.request;
        let admission = self.receiver.admit_write(self.now, SENDER, header);
        if let Admission::Apply {
            ticket,
            region,
            offset,
            len,
        } = admission
        {
            let grant = self
                .receiver
                .granted_extents(request)
                .expect("an admitted write's request has a grant");
            assert!(
                grant.contains(region, offset, len),
                "admitted {region} [{offset}, +{len}) outside {request}'s grant"
            );
            for a in &self.applying {
                assert!(
                    a.region != region || a.offset + a.len <= offset || offset + len <= a.offset,
                    "admitted {region} [{offset}, +{len}) overlaps {a:?} still being applied"
                );
            }
            self.applying.push(Applying {
                ticket,
                request,
                region,
                offset,
                len,
            });
            self.stats.admitted += 1;
        }
        self.drain();
        admission
    }

    /// Reports an admitted write finished.
    fn finish(&mut self, ticket: WriteTicket, landed: bool) {
        self.applying.retain(|a| a.ticket != ticket);
        let r = self
            .receiver
            .handle_transport(self.now, TransportInput::WriteFinished { ticket, landed });
        self.count(r);
        self.drain();
    }

    /// Reports a batch to the sender (completed, or failed with `status`).
    pub(super) fn report_batch(&mut self, b: PendingBatch, status: Option<TransferStatus>) {
        let input = match status {
            None => TransportInput::WritesCompleted { batch: b.batch },
            Some(status) => TransportInput::WritesFailed {
                batch: b.batch,
                status,
            },
        };
        let res = self.sender.handle_transport(self.now, input);
        if res.is_ok() {
            let e = self.batches.entry(b.request).or_default();
            match status {
                None => e.1 += 1,
                Some(_) => e.2 = true,
            }
        }
        self.count(res);
        self.drain();
    }

    /// Carries a pending batch out as the in-process transport would: every extent through
    /// admission, applied, reported landed; then the batch is reported complete (or failed if
    /// a write was refused).
    pub(super) fn land_batch(&mut self, index: usize) {
        if self.pending.is_empty() {
            return;
        }
        let b = self.pending.remove(index % self.pending.len());
        let mut refused = false;
        for e in b.plan.extents() {
            let header = b.headers.frame(e.dst_region, e.dst_offset, e.len);
            match self.admit(&header) {
                Admission::Apply { ticket, .. } => self.finish(ticket, true),
                Admission::Discard { .. } => {}
                Admission::Refuse(_) => {
                    refused = true;
                    break;
                }
            }
        }
        let status = refused.then_some(TransferStatus::GrantViolation);
        self.report_batch(b, status);
    }

    pub(super) fn sender_transport(&mut self, input: TransportInput) {
        let now = self.now;
        match input {
            TransportInput::PeerConnected { .. } => self.reconnect(None),
            TransportInput::PeerConnectedWithOffer { offer, .. } => self.reconnect(Some(offer)),
            TransportInput::PeerDisconnected { .. } => self.disconnect(),
            TransportInput::FrameReceived { bytes, .. } => {
                if self.connected {
                    self.deliver(false, bytes);
                }
            }
            // The receiver offers nothing: an answer on the sender's side waits for nothing.
            TransportInput::DataPathAnswered { answer, .. } => {
                let input = TransportInput::DataPathAnswered {
                    peer: RECEIVER,
                    answer,
                };
                let r = self.sender.handle_transport(now, input);
                assert!(r.is_err(), "a sender took an answer to an offer never made");
                self.count(r);
            }
            TransportInput::WritesCompleted { batch }
            | TransportInput::WritesFailed { batch, .. }
                if !self.pending.is_empty() =>
            {
                // A report for a pending batch (the bytes are lost: nothing landed).
                let b = self.pending.remove(batch.0 as usize % self.pending.len());
                let status = match input {
                    TransportInput::WritesFailed { status, .. } => Some(status),
                    _ => None,
                };
                self.report_batch(b, status);
            }
            TransportInput::WriteArrived { header, .. } => {
                let a = self.sender.admit_write(now, RECEIVER, &header);
                assert!(
                    matches!(a, Admission::Refuse(_)),
                    "a sender admitted a data write: {a:?}"
                );
            }
            other => {
                let r = self.sender.handle_transport(now, other);
                self.count(r);
            }
        }
    }

    pub(super) fn receiver_transport(&mut self, input: TransportInput) {
        let now = self.now;
        match input {
            TransportInput::PeerConnected { .. } => self.reconnect(None),
            TransportInput::PeerConnectedWithOffer { offer, .. } => self.reconnect(Some(offer)),
            TransportInput::PeerDisconnected { .. } => self.disconnect(),
            TransportInput::FrameReceived { bytes, .. } => {
                if self.connected {
                    self.deliver(true, bytes);
                }
            }
            // The receiver's transport answers the sender's offer (if one waits).
            TransportInput::DataPathAnswered { answer, .. } => {
                let input = TransportInput::DataPathAnswered {
                    peer: SENDER,
                    answer,
                };
                let r = self.receiver.handle_transport(now, input);
                self.count(r);
            }
            TransportInput::WriteArrived { mut header, .. } => {
                if self.connected {
                    // An arbitrary header, its request folded into the case's few.
                    header.request = fold(header.request);
                    let _ = self.admit(&header);
                }
            }
            TransportInput::WriteFinished { ticket, landed } if !self.applying.is_empty() => {
                let i = ticket.0 as usize % self.applying.len();
                let ticket = self.applying[i].ticket;
                self.finish(ticket, landed);
            }
            other => {
                let r = self.receiver.handle_transport(now, other);
                self.count(r);
            }
        }
    }

    /// The network and transport catch up: batches land, writes finish, frames arrive.
    pub(super) fn pump(&mut self) {
        for _ in 0..64 {
            if self.pending.is_empty()
                && self.applying.is_empty()
                && self.to_receiver.is_empty()
                && self.to_sender.is_empty()
            {
                break;
            }
            for a in std::mem::take(&mut self.applying) {
                self.finish(a.ticket, true);
            }
            while !self.pending.is_empty() {
                self.land_batch(0);
            }
            while let Some(b) = self.to_receiver.take(0) {
                self.deliver(true, b);
            }
            while let Some(b) = self.to_sender.take(0) {
                self.deliver(false, b);
            }
        }
    }
}
