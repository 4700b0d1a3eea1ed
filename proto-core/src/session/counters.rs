//! What an endpoint has done so far ([`Counters`]), read with `counters()`.

use super::*;

/// Counts of transfer outcomes, one per [`TransferStatus`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StatusCounts {
    /// [`TransferStatus::Success`].
    pub success: u64,
    /// [`TransferStatus::WriteFailed`].
    pub write_failed: u64,
    /// [`TransferStatus::InDoubt`].
    pub in_doubt: u64,
    /// [`TransferStatus::Cancelled`].
    pub cancelled: u64,
    /// [`TransferStatus::TimedOut`].
    pub timed_out: u64,
    /// [`TransferStatus::GrantViolation`].
    pub grant_violation: u64,
    /// [`TransferStatus::PeerLost`].
    pub peer_lost: u64,
    /// [`TransferStatus::ProtocolError`].
    pub protocol_error: u64,
    /// [`TransferStatus::EngineError`].
    pub engine_error: u64,
}

impl StatusCounts {
    /// The count for `status`.
    pub fn get(&self, status: TransferStatus) -> u64 {
        match status {
            TransferStatus::Success => self.success,
            TransferStatus::WriteFailed => self.write_failed,
            TransferStatus::InDoubt => self.in_doubt,
            TransferStatus::Cancelled => self.cancelled,
            TransferStatus::TimedOut => self.timed_out,
            TransferStatus::GrantViolation => self.grant_violation,
            TransferStatus::PeerLost => self.peer_lost,
            TransferStatus::ProtocolError => self.protocol_error,
            TransferStatus::EngineError => self.engine_error,
        }
    }

    /// Sum over all statuses.
    pub fn total(&self) -> u64 {
        self.success
            + self.write_failed
            + self.in_doubt
            + self.cancelled
            + self.timed_out
            + self.grant_violation
            + self.peer_lost
            + self.protocol_error
            + self.engine_error
    }

    pub(crate) fn bump(&mut self, status: TransferStatus) {
        let slot = match status {
            TransferStatus::Success => &mut self.success,
            TransferStatus::WriteFailed => &mut self.write_failed,
            TransferStatus::InDoubt => &mut self.in_doubt,
            TransferStatus::Cancelled => &mut self.cancelled,
            TransferStatus::TimedOut => &mut self.timed_out,
            TransferStatus::GrantViolation => &mut self.grant_violation,
            TransferStatus::PeerLost => &mut self.peer_lost,
            TransferStatus::ProtocolError => &mut self.protocol_error,
            TransferStatus::EngineError => &mut self.engine_error,
        };
        *slot += 1;
    }
}

/// What an endpoint has done so far; read with `counters()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    /// Bytes in write plans handed to the transport (sender).
    pub bytes_planned: u64,
    /// Bytes the transport reported written (sender) or writers reported written (receiver).
    pub bytes_written: u64,
    /// Slices created (sender: chunks that sent something).
    pub slices: u64,
    /// Write batches handed to the transport (sender).
    pub write_batches: u64,
    /// Slice results sent (sender) or received (receiver), by status.
    pub results: StatusCounts,
    /// Requests that failed, by cause (timeouts and cancels included).
    pub failures: StatusCounts,
    /// Deadlines that passed (each fails one request, except handshake and liveness).
    pub timeouts: u64,
    /// Requests cancelled (from either side).
    pub cancellations: u64,
    /// Requests completed.
    pub completions: u64,
    /// Requests quiesced.
    pub quiesced: u64,
    /// Requests retired.
    pub retirements: u64,
    /// Retired ids forgotten before their horizon passed because `max_retired` were remembered
    /// (a late frame naming one is then treated as one for an unknown request).
    pub retired_forgotten_early: u64,
    /// Protocol errors seen from peers.
    pub protocol_errors: u64,
    /// Duplicate frames ignored.
    pub duplicates: u64,
    /// Connections the endpoint asked to close.
    pub peers_closed: u64,
    /// Handshakes refused (by either side).
    pub peers_rejected: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Frames the codec refused to encode (not sent).
    pub encode_errors: u64,
    /// Frames from peers that did not decode.
    pub decode_errors: u64,
    /// Data writes refused by admission (receiver).
    pub writes_refused: u64,
    /// Data writes discarded because their request had ended (receiver).
    pub late_writes: u64,
    /// Payload bytes of admitted writes reported landed (receiver).
    pub bytes_landed: u64,
    /// Blocks the sessions pinned so far: the blocks of every chunk's (and early prefix's)
    /// block runs (sender), the registered blocks of every request (receiver). A session holds
    /// them until [`Event::Quiesced`].
    pub blocks_pinned: u64,
    /// Of [`blocks_pinned`](Self::blocks_pinned), those whose session quiesced: the engine may
    /// reuse them. `blocks_pinned - blocks_released` blocks are pinned now.
    pub blocks_released: u64,
}
