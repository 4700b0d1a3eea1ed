//! The two core endpoints behind one interface, so one driver serves both roles.

use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::{
    Instant, LayerGroupLayout, Output, PeerId, Receiver, ReceiverInput, RequestId, Sender,
    SenderInput,
};

/// What a driver needs from a core endpoint. Usage errors returned by the core here would be
/// driver bugs (an unknown peer, a batch reported twice); they are ignored, as the core leaves
/// its state unchanged on them.
pub(crate) trait Endpoint: Send + 'static {
    fn connected(&mut self, now: Instant, peer: PeerId);
    fn disconnected(&mut self, now: Instant, peer: PeerId);
    fn frame(&mut self, now: Instant, peer: PeerId, frame: Frame);
    fn timeout(&mut self, now: Instant);
    fn writes_done(&mut self, now: Instant, batch: WriteBatchId, status: TransferStatus);
    fn poll_output(&mut self) -> Option<Output>;
    fn poll_timeout(&mut self) -> Option<Instant>;
    fn is_peer_ready(&self, peer: PeerId) -> bool;
    /// A write for `request` was refused: fail the request as far as the core allows.
    fn write_refused(&mut self, now: Instant, peer: PeerId, request: RequestId);
    /// The local pool layout, per layer group.
    fn local_groups(&self) -> &[LayerGroupLayout];
}

impl Endpoint for Sender {
    fn connected(&mut self, now: Instant, peer: PeerId) {
        let _ = self.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerConnected { peer },
        });
    }
    fn disconnected(&mut self, now: Instant, peer: PeerId) {
        let _ = self.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerDisconnected { peer },
        });
    }
    fn frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        let _ = self.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer,
                bytes: match frame.to_bytes() {
                    Ok(b) => b,
                    Err(_) => return,
                },
            },
        });
    }
    fn timeout(&mut self, now: Instant) {
        let _ = self.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::Timeout,
        });
    }
    fn writes_done(&mut self, now: Instant, batch: WriteBatchId, status: TransferStatus) {
        let input = if status == TransferStatus::Success {
            SenderInput::Transport {
                now,
                input: kvpipe_core::session::TransportInput::WritesCompleted { batch },
            }
        } else {
            SenderInput::Transport {
                now,
                input: kvpipe_core::session::TransportInput::WritesFailed { batch, status },
            }
        };
        let _ = self.handle_input(input);
    }
    fn poll_output(&mut self) -> Option<Output> {
        Sender::poll_output(self)
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        Sender::poll_timeout(self)
    }
    fn is_peer_ready(&self, peer: PeerId) -> bool {
        Sender::is_peer_ready(self, peer)
    }
    fn write_refused(&mut self, _now: Instant, _peer: PeerId, _request: RequestId) {
        // A sender grants nothing: the peer is simply not trusted any more.
    }
    fn local_groups(&self) -> &[LayerGroupLayout] {
        &self.config().local.groups
    }
}

impl Endpoint for Receiver {
    fn connected(&mut self, now: Instant, peer: PeerId) {
        let _ = self.handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerConnected { peer },
        });
    }
    fn disconnected(&mut self, now: Instant, peer: PeerId) {
        let _ = self.handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerDisconnected { peer },
        });
    }
    fn frame(&mut self, now: Instant, peer: PeerId, frame: Frame) {
        let _ = self.handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer,
                bytes: match frame.to_bytes() {
                    Ok(b) => b,
                    Err(_) => return,
                },
            },
        });
    }
    fn timeout(&mut self, now: Instant) {
        let _ = self.handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::Timeout,
        });
    }
    fn writes_done(&mut self, _now: Instant, _batch: WriteBatchId, _status: TransferStatus) {}
    fn poll_output(&mut self) -> Option<Output> {
        Receiver::poll_output(self)
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        Receiver::poll_timeout(self)
    }
    fn is_peer_ready(&self, peer: PeerId) -> bool {
        Receiver::is_peer_ready(self, peer)
    }
    fn write_refused(&mut self, now: Instant, peer: PeerId, request: RequestId) {
        let _ = peer;
        let _ = self.handle_input(ReceiverInput::Cancel { now, request });
    }
    fn local_groups(&self) -> &[LayerGroupLayout] {
        &self.config().local.groups
    }
}
