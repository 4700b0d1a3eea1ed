//! What the scheduler holds: the actions scheduled at a point of virtual time, and how the
//! endpoints name each other.

use bytes::Bytes;
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::PeerId;

use crate::workload::CancelSide;

/// How the receiver names sender rank `r`.
pub(crate) fn sender_peer(rank: usize) -> PeerId {
    PeerId(rank as u32)
}

/// How every sender rank names the receiver.
pub const RECEIVER_PEER: PeerId = PeerId(1000);

/// Something scheduled at a point of virtual time.
#[derive(Clone, Debug)]
pub(crate) enum Action {
    Open(usize),
    Register(usize),
    Compute(usize, usize),
    Aux(usize),
    Cancel(usize, CancelSide),
    /// The engine retires request `.0` on sender rank `Some(r)` or the receiver (`None`).
    Retire(usize, Option<usize>),
    Deliver {
        link: usize,
        to_receiver: bool,
        epoch: u64,
        bytes: Bytes,
    },
    WriteDone {
        sender: usize,
        batch: WriteBatchId,
    },
    KillLink {
        link: usize,
        injected: bool,
        silent: bool,
    },
    NotifyDown {
        link: usize,
        to_receiver: bool,
        injected: bool,
    },
    Reconnect {
        link: usize,
    },
}
