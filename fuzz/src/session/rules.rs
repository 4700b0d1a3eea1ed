//! The rules checked on every output the endpoints emit (see the module doc of
//! [`session`](super)): draining both endpoints, each output against what the case did so far.

use kvpipe_core::session::{DataPathNegotiation, Event, Output};
use kvpipe_core::wire::Frame;
use kvpipe_core::RequestId;

use super::world::{RECEIVER, SENDER};
use super::{Pair, PendingBatch};

impl Pair {
    /// Drains both endpoints, checking every output against the rules.
    pub(super) fn drain(&mut self) {
        loop {
            let mut any = false;
            while let Some(o) = self.sender.poll_output() {
                any = true;
                self.sender_outputs.push(o.clone());
                self.on_sender_output(o);
            }
            while let Some(o) = self.receiver.poll_output() {
                any = true;
                self.receiver_outputs.push(o.clone());
                self.on_receiver_output(o);
            }
            if !any {
                return;
            }
        }
    }

    fn on_sender_output(&mut self, o: Output) {
        match o {
            Output::Transmit { peer, frame, bytes } => {
                assert_eq!(peer, RECEIVER, "sender transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.send_track.entry(r).or_default();
                    assert!(!t.quiesced, "sender sent {frame:?} after Quiesced");
                }
                self.transmit(true, bytes);
            }
            Output::ExecuteWrites {
                batch,
                request,
                plan,
                headers,
                ..
            } => {
                let t = self.send_track.entry(request).or_default();
                assert!(
                    !t.no_writes && !t.quiesced,
                    "write {batch} emitted for {request}, which was cancelled, ended or retired"
                );
                self.batches.entry(request).or_default().0 += 1;
                self.stats.batches += 1;
                self.pending.push(PendingBatch {
                    batch,
                    request,
                    plan,
                    headers,
                });
            }
            Output::ClosePeer { .. } => self.disconnect(),
            Output::DataPath(DataPathNegotiation::Answered { peer, .. }) => {
                assert_eq!(peer, RECEIVER, "an answer from an unknown peer");
            }
            Output::DataPath(n) => panic!("the receiver offered no data path: {n:?}"),
            Output::Event(e) => {
                let Some(r) = event_request(&e) else { return };
                let t = self.send_track.entry(r).or_default().clone();
                assert!(!t.quiesced, "sender event {e:?} after Quiesced");
                match e {
                    Event::Completed { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        assert!(
                            self.last_submitted.contains(&r),
                            "sender completed {r} before its last chunk"
                        );
                        let (issued, done, failed) =
                            self.batches.get(&r).copied().unwrap_or_default();
                        assert!(
                            issued == done && !failed,
                            "sender completed {r} with {issued} batches issued, {done} complete, \
                             failed {failed}"
                        );
                        assert!(
                            self.aux_submitted.contains(&r),
                            "sender completed {r} before its aux data was submitted"
                        );
                        assert!(
                            self.receiver_completed.contains(&r),
                            "sender completed {r} before its receiver did"
                        );
                        self.stats.sender_completed += 1;
                        self.mark_terminal(true, r);
                    }
                    Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        self.stats.ended_otherwise += 1;
                        self.mark_terminal(true, r);
                    }
                    Event::Quiesced { .. } => {
                        assert!(t.terminal, "Quiesced before a terminal event for {r}");
                        self.send_track.entry(r).or_default().quiesced = true;
                    }
                    _ => {}
                }
            }
        }
    }

    fn on_receiver_output(&mut self, o: Output) {
        match o {
            Output::Transmit { peer, frame, bytes } => {
                assert_eq!(peer, SENDER, "receiver transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.recv_track.entry(r).or_default();
                    assert!(!t.quiesced, "receiver sent {frame:?} after Quiesced");
                }
                self.transmit(false, bytes);
            }
            Output::ExecuteWrites { .. } => panic!("a receiver emitted a write batch"),
            Output::ClosePeer { .. } => self.disconnect(),
            // Answered by a `DataPathAnswered` step, or the handshake times out.
            Output::DataPath(DataPathNegotiation::Offered { peer, .. }) => {
                assert_eq!(peer, SENDER, "an offer from an unknown peer");
            }
            Output::DataPath(n) => panic!("the receiver made no offer: {n:?}"),
            Output::Event(e) => {
                let Some(r) = event_request(&e) else { return };
                let t = self.recv_track.entry(r).or_default().clone();
                assert!(!t.quiesced, "receiver event {e:?} after Quiesced");
                match e {
                    Event::Completed { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        assert!(
                            self.delivered_last.contains(&r),
                            "receiver completed {r} before a successful last result arrived"
                        );
                        assert!(
                            self.delivered_aux.contains(&r),
                            "receiver completed {r} before its aux data arrived"
                        );
                        self.stats.receiver_completed += 1;
                        self.receiver_completed.insert(r);
                        self.mark_terminal(false, r);
                    }
                    Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        self.stats.ended_otherwise += 1;
                        self.mark_terminal(false, r);
                    }
                    Event::Quiesced { .. } => {
                        assert!(t.terminal, "Quiesced before a terminal event for {r}");
                        assert!(
                            !self.applying_for(r),
                            "receiver quiesced {r} with a write still being applied"
                        );
                        self.recv_track.entry(r).or_default().quiesced = true;
                    }
                    _ => {}
                }
            }
        }
    }

    /// Whether a write of `request` is still being applied.
    pub(super) fn applying_for(&self, request: RequestId) -> bool {
        self.applying.iter().any(|a| a.request == request)
    }

    fn mark_terminal(&mut self, sender: bool, r: RequestId) {
        let t = if sender {
            self.send_track.entry(r).or_default()
        } else {
            self.recv_track.entry(r).or_default()
        };
        t.terminal = true;
        t.no_writes = true;
    }
}

/// The request a session frame is about (`None` for connection frames and `Cancel`, which an
/// endpoint may send to refuse or confirm at any time).
fn session_frame_request(frame: &Frame) -> Option<RequestId> {
    match frame {
        Frame::RecvRegistration(r) => Some(r.request),
        Frame::KvResult(r) => Some(r.request),
        Frame::AuxResult(a) => Some(a.request),
        Frame::RecvComplete(c) => Some(c.request),
        _ => None,
    }
}

fn event_request(e: &Event) -> Option<RequestId> {
    match e {
        Event::Registered { request, .. }
        | Event::Completed { request, .. }
        | Event::Failed { request, .. }
        | Event::TimedOut { request, .. }
        | Event::Cancelled { request, .. }
        | Event::Quiesced { request } => Some(*request),
        _ => None,
    }
}
