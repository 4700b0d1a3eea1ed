//! Where a peer's data writes go, as the node decides it during the peer's handshake and its
//! connection halves and a connecting caller learn it ([`PeerPlacement`]).
//!
//! A link that offers nothing, or is offered nothing, is placed on the sockets when it is made.
//! Otherwise the placement is decided once, under the node's lock, inside the core's handshake
//! (see [`crate::peer_copy`]): on the receiver when its transport answers the sender's offer
//! (before its `HelloAccept` leaves), on the sender when the core reports the receiver's answer
//! (before `PeerReady`). Either way before the first data write of the peer can be planned,
//! sent or read, so a connection half reads the decision when it first needs it and keeps it.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::peer_copy::PeerMappings;

/// How a peer's data writes travel.
#[derive(Clone, Debug, Default)]
pub(crate) enum Placement {
    /// Over the sockets.
    #[default]
    Socket,
    /// (Receiver) this node pulls them from the sender's regions, opened here.
    Pull(Arc<PeerMappings>),
    /// (Sender) the peer pulls them: pieces carry their source, batches complete on the
    /// peer's acknowledgements.
    Source,
}

/// Where a link's handshake left its data path.
#[derive(Clone, Debug, Default)]
pub(crate) enum Decision {
    /// The handshake runs.
    #[default]
    Pending,
    /// Decided.
    Placed(Placement),
    /// No data path for the peer, and why: this node asked for peer copies and cannot have
    /// them. The link is (being) closed.
    Refused(String),
    /// The link went away before its handshake decided (a rejected or failed handshake: the
    /// engine hears why from the core).
    Gone,
}

/// A link's placement, shared by the link, its connection halves and a caller waiting in
/// `connect` (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct PeerPlacement {
    state: Mutex<Decision>,
    decided: Condvar,
}

impl PeerPlacement {
    /// A placement decided from the start (tests).
    #[cfg(test)]
    pub(crate) fn placed(placement: Placement) -> Arc<Self> {
        Arc::new(PeerPlacement {
            state: Mutex::new(Decision::Placed(placement)),
            decided: Condvar::new(),
        })
    }

    /// A placement the handshake decides.
    pub(crate) fn pending() -> Arc<Self> {
        Arc::default()
    }

    /// Decides, once: a second decision changes nothing.
    pub(crate) fn decide(&self, decision: Decision) {
        let mut state = self.state.lock();
        if matches!(*state, Decision::Pending) && !matches!(decision, Decision::Pending) {
            *state = decision;
            self.decided.notify_all();
        }
    }

    /// The decision so far.
    pub(crate) fn get(&self) -> Decision {
        self.state.lock().clone()
    }

    /// Whether the peer pulls this node's writes (a sender's link).
    pub(crate) fn is_source(&self) -> bool {
        matches!(*self.state.lock(), Decision::Placed(Placement::Source))
    }

    /// Waits for the decision until `deadline` (`Pending` when none came by then).
    pub(crate) fn wait(&self, deadline: Instant) -> Decision {
        let mut state = self.state.lock();
        while matches!(*state, Decision::Pending) {
            if self.decided.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn decided_once_and_waited_for_with_a_deadline() {
        let p = PeerPlacement::pending();
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(p.wait(soon), Decision::Pending), "timed out");
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.wait(Instant::now() + Duration::from_secs(10)))
        };
        p.decide(Decision::Placed(Placement::Source));
        p.decide(Decision::Refused("too late".into()));
        assert!(matches!(
            waiter.join().unwrap(),
            Decision::Placed(Placement::Source)
        ));
        assert!(p.is_source());
        assert!(!PeerPlacement::placed(Placement::Socket).is_source());
    }
}
