//! Closing and failing a link: the queue pair moved to the error state, the socket shut down,
//! the flushes reaped, then the queue pair destroyed (see the module doc of
//! [`link`](super)).

use std::io;
use std::net::Shutdown;
use std::time::{Duration, Instant};

use sideway::ibverbs::queue_pair::{QueuePair, QueuePairAttribute, QueuePairState};

use super::{later, verbs, Inner, Link, State, FLUSH_WAIT};
use crate::fabric::api::LinkFailure;

impl Link {
    /// Starts closing: gracefully (what is queued is sent and acknowledged first, bounded by
    /// `grace`) or at once.
    pub(crate) fn close(&self, graceful: bool, grace: Duration) {
        let mut inner = self.lock();
        let now = Instant::now();
        match inner.state {
            State::Live if graceful => {
                inner.state = State::Draining {
                    deadline: later(now, grace),
                };
                inner.cause.get_or_insert(LinkFailure::Closed);
            }
            State::Live | State::Draining { .. } => {
                self.teardown(&mut inner, LinkFailure::Closed, now);
            }
            State::Failing { .. } | State::Closed => {}
        }
    }

    /// Fails the link now (as if the queue pair went to the error state on its own).
    pub(crate) fn fail(&self, cause: LinkFailure) {
        let mut inner = self.lock();
        self.teardown(&mut inner, cause, Instant::now());
    }

    /// Moves the queue pair to the error state (a test hook for the failure paths: every
    /// posted work request flushes, the link then fails as it would on a fabric error).
    pub(crate) fn force_error_state(&self) -> io::Result<()> {
        let mut inner = self.lock();
        let qp = inner
            .qp
            .as_mut()
            .ok_or_else(|| io::Error::other("the queue pair is destroyed"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        qp.modify(&attr).map_err(|e| verbs("QP to ERR", e))
    }

    /// Whether the link was torn down completely (reported disconnected).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().state == State::Closed
    }

    /// Starts the teardown (see the module documentation); the queue pair goes to the error
    /// state after `grace`.
    pub(super) fn teardown_after(
        &self,
        inner: &mut Inner,
        cause: LinkFailure,
        now: Instant,
        grace: Duration,
    ) {
        if matches!(inner.state, State::Failing { .. } | State::Closed) {
            return;
        }
        let _ = self.socket.shutdown(Shutdown::Both);
        inner.cause = Some(cause);
        inner.sends.clear();
        inner.batches.clear();
        inner.state = State::Failing {
            error_at: later(now, grace),
            errored: false,
            deadline: later(later(now, grace), FLUSH_WAIT),
        };
        if grace.is_zero() {
            Self::to_error(inner, now);
        }
    }

    pub(super) fn teardown(&self, inner: &mut Inner, cause: LinkFailure, now: Instant) {
        self.teardown_after(inner, cause, now, Duration::ZERO);
    }

    /// Moves the queue pair of a failing link to the error state once its grace is over.
    pub(super) fn to_error(inner: &mut Inner, now: Instant) {
        if let State::Failing {
            error_at,
            errored: errored @ false,
            ..
        } = &mut inner.state
        {
            if now >= *error_at {
                *errored = true;
                if let Some(qp) = inner.qp.as_mut() {
                    let mut attr = QueuePairAttribute::new();
                    attr.setup_state(QueuePairState::Error);
                    let _ = qp.modify(&attr);
                }
            }
        }
    }
}
