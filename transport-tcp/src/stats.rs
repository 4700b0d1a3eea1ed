//! Transport counters (the protocol's own counters are the core's `Counters`).

use std::sync::atomic::{AtomicU64, Ordering};

/// What a node's sockets have done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TcpStats {
    /// Connections opened or accepted.
    pub connections: u64,
    /// Data writes sent (pieces, each one `DataWrite` header plus payload).
    pub writes_sent: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Data writes applied to registered memory.
    pub writes_applied: u64,
    /// Payload bytes applied to registered memory.
    pub bytes_applied: u64,
    /// Writes the receiver refused (outside any grant, wrong grant, unknown request, …): never
    /// applied, and nothing more was read from their connection.
    pub writes_refused: u64,
    /// Writes for a request whose session had ended: drained, never applied.
    pub late_writes: u64,
    /// Payload bytes drained without being applied.
    pub bytes_drained: u64,
    /// Admitted writes whose destination is not registered memory (or lies past its end):
    /// never applied, and the connection was torn down.
    pub unbacked_writes: u64,
    /// Frame headers no kvpipe peer sends, or declaring a body over the peer's limit (handed to
    /// the core as a frame, which fails the peer with a protocol error; nothing more was read).
    pub decode_errors: u64,
    /// Peers whose close started: asked by the core, started by the peer ending its stream, by
    /// an I/O error, or by closing the node.
    pub peers_closed: u64,
    /// Accepted connections dropped before their preamble arrived: past the preamble timeout,
    /// closed by the peer, or with an invalid preamble.
    pub preambles_failed: u64,
    /// Unauthenticated connections (reading their preamble, assembling or handshaking)
    /// dropped to make room for newer ones (`TcpConfig::max_unauthenticated`,
    /// `max_unauthenticated_per_address`).
    pub unauthenticated_dropped: u64,
    /// Peers whose data writes move by peer copies (CUDA IPC, `TcpDataPath`), counted on both
    /// sides once the offer was accepted.
    pub peer_copy_peers: u64,
    /// Payload bytes the peer pulled from this node's device memory by peer copies and
    /// acknowledged (sender).
    pub bytes_placed: u64,
    /// Data writes this node pulled from a peer's device memory into its own by peer copies
    /// (receiver; counted in `writes_applied` too).
    pub writes_placed: u64,
}

#[derive(Debug, Default)]
pub(crate) struct StatCells {
    pub(crate) connections: AtomicU64,
    pub(crate) writes_sent: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) writes_applied: AtomicU64,
    pub(crate) bytes_applied: AtomicU64,
    pub(crate) writes_refused: AtomicU64,
    pub(crate) late_writes: AtomicU64,
    pub(crate) bytes_drained: AtomicU64,
    pub(crate) unbacked_writes: AtomicU64,
    pub(crate) decode_errors: AtomicU64,
    pub(crate) peers_closed: AtomicU64,
    pub(crate) preambles_failed: AtomicU64,
    pub(crate) unauthenticated_dropped: AtomicU64,
    pub(crate) peer_copy_peers: AtomicU64,
    pub(crate) bytes_placed: AtomicU64,
    pub(crate) writes_placed: AtomicU64,
}

pub(crate) fn bump(cell: &AtomicU64, by: u64) {
    cell.fetch_add(by, Ordering::Relaxed);
}

impl StatCells {
    pub(crate) fn snapshot(&self) -> TcpStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TcpStats {
            connections: g(&self.connections),
            writes_sent: g(&self.writes_sent),
            bytes_sent: g(&self.bytes_sent),
            writes_applied: g(&self.writes_applied),
            bytes_applied: g(&self.bytes_applied),
            writes_refused: g(&self.writes_refused),
            late_writes: g(&self.late_writes),
            bytes_drained: g(&self.bytes_drained),
            unbacked_writes: g(&self.unbacked_writes),
            decode_errors: g(&self.decode_errors),
            peers_closed: g(&self.peers_closed),
            preambles_failed: g(&self.preambles_failed),
            unauthenticated_dropped: g(&self.unauthenticated_dropped),
            peer_copy_peers: g(&self.peer_copy_peers),
            bytes_placed: g(&self.bytes_placed),
            writes_placed: g(&self.writes_placed),
        }
    }
}
