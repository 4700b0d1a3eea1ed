//! What a connection's halves report to their node, and how a half stops.

use bytes::Bytes;
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::DataWrite;
use kvpipe_core::{Admission, PeerId, WriteTicket};

/// What a connection's halves tell their node. Each call is short: the node takes its lock,
/// hands the input to the core endpoint and carries out the outputs (frames are queued to
/// writers, never written under the lock).
pub(crate) trait NodeHooks: Send + Sync {
    /// A whole frame arrived from `peer`.
    fn frame(&self, peer: PeerId, bytes: Bytes);
    /// The largest frame body `peer` may send now (the core's: a handshake's until it
    /// completed).
    fn body_limit(&self, peer: PeerId) -> u32;
    /// The header of a data write from `peer` arrived (decoded by the stream reader): the
    /// core's answer.
    fn admit(&self, peer: PeerId, header: &DataWrite) -> Admission;
    /// Payload of an admitted write from `peer` is still arriving (the core's
    /// `TransportInput::DataArriving`: the peer is alive while a long payload holds its frames
    /// back). Called at most every [`ARRIVING_EVERY`](super::inbound::ARRIVING_EVERY) per
    /// connection.
    fn data_arriving(&self, peer: PeerId);
    /// An admitted write is over (`landed`: every byte is in memory).
    fn write_finished(&self, ticket: WriteTicket, landed: bool);
    /// The last piece of `batch` is written out (by this connection; the others were written
    /// by any of the peer's connections).
    fn batch_written(&self, batch: WriteBatchId);
    /// One half of a connection of `peer` stopped; it touches no memory any more.
    fn half_ended(&self, peer: PeerId, end: HalfEnd);
}

/// How one half of a connection stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HalfEnd {
    /// The reader stopped.
    Read(ReadEnd),
    /// The writer stopped.
    Write(WriteEnd),
}

/// How a reader stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// The peer ended its stream at a frame boundary (or the node shut the socket down).
    Eof,
    /// The core refused a data write, or the stream carried bytes that are no frame (handed to
    /// the core, which reported the protocol error): nothing more is read from this connection
    /// (the core already asked to close the peer).
    Refused,
    /// A socket error, a stream cut inside a frame or payload, or an admitted destination that
    /// is not registered memory.
    Failed,
}

/// How a writer stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WriteEnd {
    /// Everything queued before the close was written, then the sending side was shut down.
    Closed,
    /// A write failed (or stalled), or the node aborted the connection.
    Failed,
}
