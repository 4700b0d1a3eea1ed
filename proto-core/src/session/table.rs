//! The sessions an endpoint holds and the request ids it retired, looked up the same way by
//! both roles: a request is held, retired (and refused), or unknown. Opening, cancelling and
//! retiring follow one rule on both sides; only what a session holds differs.

use std::collections::BTreeMap;

use super::counters::Counters;
use super::retired::Retired;
use super::state::SessionPhase;
use super::UsageError;
use crate::ids::{PeerId, RequestId};
use crate::time::{Duration, Instant};

/// A per-request session, as the table sees it.
pub(crate) trait HeldSession {
    /// The role's phase enum.
    type Phase: SessionPhase;
    /// The session's phase.
    fn phase(&self) -> Self::Phase;
    /// Moves the session to `phase`.
    fn set_phase(&mut self, phase: Self::Phase);
    /// Whether `peer` takes part in the request (a receiver of a sender session, a writer of a
    /// receiver session).
    fn involves(&self, peer: PeerId) -> bool;
    /// Whether `peer` takes part in the request and has not finished its part (losing it
    /// fails the session).
    fn awaits(&self, peer: PeerId) -> bool;
}

/// The first peer named twice in `peers`, if one is (the engine names each peer of a request
/// once).
pub(crate) fn named_twice(peers: &[PeerId]) -> Option<PeerId> {
    (peers.iter().enumerate())
        .find(|(i, p)| peers[..*i].contains(p))
        .map(|(_, p)| *p)
}

/// What a cancel from the engine, or a peer, does to a request.
pub(crate) enum CancelStep {
    /// The request is not held yet: remember the cancel for when it is.
    Remember,
    /// The request is active: stop it.
    Stop,
    /// The request ended already: nothing to do.
    Ended,
}

/// The held sessions by request id, and the retired ids (each with what the role keeps of it).
#[derive(Debug)]
pub(crate) struct SessionTable<S, R> {
    /// The sessions not retired yet.
    pub(crate) live: BTreeMap<RequestId, S>,
    /// Retired ids, remembered for one horizon.
    pub(crate) retired: Retired<R>,
}

impl<S: HeldSession, R> SessionTable<S, R> {
    pub(crate) fn new(retired_horizon: Duration, max_retired: usize) -> Self {
        SessionTable {
            live: BTreeMap::new(),
            retired: Retired::new(retired_horizon, max_retired),
        }
    }

    /// The phase of `request`'s session: `None` if unknown, the role's retired phase if retired
    /// (and still remembered).
    pub(crate) fn phase(&self, request: RequestId) -> Option<S::Phase> {
        if let Some(s) = self.live.get(&request) {
            Some(s.phase())
        } else if self.retired.contains(request) {
            Some(S::Phase::RETIRED)
        } else {
            None
        }
    }

    /// Refuses to open `request` again: a retired id, or one held already.
    pub(crate) fn check_new(&self, request: RequestId) -> Result<(), UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        if self.live.contains_key(&request) {
            return Err(UsageError::DuplicateRequest(request));
        }
        Ok(())
    }

    /// The held session of `request`, or why the engine may not name it: retired, or unknown.
    pub(crate) fn held(&self, request: RequestId) -> Result<&S, UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        self.live
            .get(&request)
            .ok_or(UsageError::UnknownRequest(request))
    }

    /// As [`held`](Self::held), for changing the session.
    pub(crate) fn held_mut(&mut self, request: RequestId) -> Result<&mut S, UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        self.live
            .get_mut(&request)
            .ok_or(UsageError::UnknownRequest(request))
    }

    /// The session of `request`, moved to its stopping phase, when it is held and was active
    /// (`None`: nothing to stop).
    pub(crate) fn begin_stop(&mut self, request: RequestId) -> Option<&mut S> {
        let session = self.live.get_mut(&request)?;
        let phase = session.phase().stopped()?;
        session.set_phase(phase);
        Some(session)
    }

    /// What the engine's cancel of `request` does; a retired request is refused.
    pub(crate) fn cancel_step(&self, request: RequestId) -> Result<CancelStep, UsageError> {
        if self.retired.contains(request) {
            return Err(UsageError::Retired(request));
        }
        Ok(match self.live.get(&request) {
            None => CancelStep::Remember,
            Some(s) if s.phase().is_active() => CancelStep::Stop,
            Some(_) => CancelStep::Ended,
        })
    }

    /// Retires `request` once it completed or quiesced, keeping `keep(session)` for one
    /// horizon; refused (nothing changed) while it may still be written, or when unknown.
    pub(crate) fn retire(
        &mut self,
        now: Instant,
        request: RequestId,
        counters: &mut Counters,
        keep: impl FnOnce(S) -> R,
    ) -> Result<(), UsageError> {
        if !self.held(request)?.phase().may_retire() {
            return Err(UsageError::NotQuiesced(request));
        }
        let session = self.live.remove(&request).expect("held");
        self.retired.insert(now, request, keep(session));
        counters.retirements += 1;
        counters.retired_forgotten_early = self.retired.forgotten_early();
        Ok(())
    }

    /// The held requests whose session satisfies `pred`, in id order (a list, so the caller
    /// can change the sessions while it walks it).
    pub(crate) fn requests_where(&self, pred: impl Fn(&S) -> bool) -> Vec<RequestId> {
        (self.live.iter())
            .filter(|(_, s)| pred(s))
            .map(|(r, _)| *r)
            .collect()
    }

    /// The held requests `peer` takes part in, in id order.
    pub(crate) fn involving(&self, peer: PeerId) -> Vec<RequestId> {
        self.requests_where(|s| s.involves(peer))
    }
}
