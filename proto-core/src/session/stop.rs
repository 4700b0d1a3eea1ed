//! Why a session stops, the same for both roles: the status the stop carries and the event the
//! engine gets. Each endpoint decides whom it tells and how it waits for quiesce.

use super::{CancelOrigin, Event, Wait};
use crate::ids::{PeerId, ReceiverSliceId, RequestId, SenderSliceId};
use crate::wire::TransferStatus;

/// Why a session stops.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stop {
    /// A failure: a slice, a peer or the engine broke the transfer.
    Failed {
        /// The status both sides report.
        cause: TransferStatus,
        /// The peer involved, if one.
        peer: Option<PeerId>,
        /// The sender's slice the failure is attributed to, when known.
        slice: Option<SenderSliceId>,
    },
    /// A deadline passed.
    TimedOut(Wait),
    /// The engine or a peer cancelled.
    Cancelled(CancelOrigin),
}

impl Stop {
    /// A failure with `cause` that `peer` caused or reported, in no slice in particular.
    pub(crate) fn by(peer: PeerId, cause: TransferStatus) -> Stop {
        Stop::Failed {
            cause,
            peer: Some(peer),
            slice: None,
        }
    }

    /// `peer` broke a protocol rule, in `slice` when one is known.
    pub(crate) fn protocol(peer: PeerId, slice: Option<SenderSliceId>) -> Stop {
        Stop::Failed {
            cause: TransferStatus::ProtocolError,
            peer: Some(peer),
            slice,
        }
    }

    /// `peer` was reported disconnected.
    pub(crate) fn lost(peer: PeerId) -> Stop {
        Stop::by(peer, TransferStatus::PeerLost)
    }

    /// The status the stop carries to the peers: the failure's cause, `InDoubt` for a write
    /// batch whose report never came (its bytes may or may not have landed), `TimedOut` for
    /// any other deadline, `Cancelled` for a cancel.
    pub(crate) fn status(self) -> TransferStatus {
        match self {
            Stop::Failed { cause, .. } => cause,
            Stop::TimedOut(Wait::Writes) => TransferStatus::InDoubt,
            Stop::TimedOut(_) => TransferStatus::TimedOut,
            Stop::Cancelled(_) => TransferStatus::Cancelled,
        }
    }

    /// What the engine learns: a failure names `receiver_slice` (the registration, when known).
    pub(crate) fn event(
        self,
        request: RequestId,
        receiver_slice: Option<ReceiverSliceId>,
    ) -> Event {
        match self {
            Stop::Failed { cause, peer, slice } => Event::Failed {
                request,
                cause,
                peer,
                sender_slice: slice,
                receiver_slice,
            },
            Stop::TimedOut(wait) => Event::TimedOut {
                request,
                waiting_for: wait,
            },
            Stop::Cancelled(origin) => Event::Cancelled { request, origin },
        }
    }
}
