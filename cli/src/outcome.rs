//! How requests ended badly, in words an operator can act on: which requests failed, and
//! whether the peer was lost, stopped answering, or broke a rule.

use std::collections::{BTreeMap, BTreeSet};

use kvpipe_core::session::{CancelOrigin, Wait};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Event, RequestId};

/// The requests that ended without completing, with why.
#[derive(Debug, Default)]
pub(crate) struct Failures {
    why: BTreeMap<RequestId, String>,
    /// The peer was lost (its connection closed or failed).
    lost: bool,
    /// The peer stopped answering (the liveness deadline passed).
    silent: bool,
    /// Rules a peer broke, as the endpoint reported them (they name what differed).
    violations: Vec<String>,
    /// (Prefill side) requests a decode side registered.
    registered: BTreeSet<RequestId>,
    /// Requests that completed.
    completed: usize,
}

impl Failures {
    /// Records `e` if it ends a request without completing it (the first reason counts), or
    /// reports a rule a peer broke.
    pub(crate) fn note(&mut self, e: &Event) {
        let (request, why) = match e {
            Event::Registered { request, .. } => {
                self.registered.insert(*request);
                return;
            }
            Event::Completed { .. } => {
                self.completed += 1;
                return;
            }
            Event::Failed {
                request,
                cause,
                peer,
                ..
            } => {
                if *cause == TransferStatus::PeerLost {
                    self.lost = true;
                }
                let peer = peer.map_or(String::new(), |p| format!(" ({p})"));
                let why = match cause {
                    TransferStatus::PeerLost => format!("the peer{peer} was lost"),
                    other => format!("{other}{peer}"),
                };
                (*request, why)
            }
            Event::TimedOut {
                request,
                waiting_for,
            } => {
                if *waiting_for == Wait::Liveness {
                    self.silent = true;
                }
                let why = match waiting_for {
                    Wait::Liveness => "the peer stopped answering".to_string(),
                    other => format!("timed out waiting for {}", waiting_name(*other)),
                };
                (*request, why)
            }
            Event::ProtocolViolation { peer, error } => {
                self.violations
                    .push(format!("{peer} broke a protocol rule: {error}"));
                return;
            }
            Event::Cancelled { request, origin } => {
                let by = match origin {
                    CancelOrigin::Local => "this side".to_string(),
                    CancelOrigin::Peer(p) => p.to_string(),
                };
                (*request, format!("cancelled by {by}"))
            }
            _ => return,
        };
        self.why.entry(request).or_insert(why);
    }

    /// Whether `request` ended without completing.
    pub(crate) fn contains(&self, request: RequestId) -> bool {
        self.why.contains_key(&request)
    }

    /// How many requests failed.
    pub(crate) fn len(&self) -> usize {
        self.why.len()
    }

    /// One line per rule a peer broke, then one per failed request.
    pub(crate) fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.violations
            .iter()
            .cloned()
            .chain(self.why.iter().map(|(r, why)| format!("{r} failed: {why}")))
    }

    /// What happened to the peer, if the failures say (`who`: how to name it).
    pub(crate) fn peer_cause(&self, who: &str) -> Option<String> {
        match (self.lost, self.silent) {
            (_, true) => Some(format!(
                "{who} stopped answering (nothing arrived from it within the liveness timeout)"
            )),
            (true, false) => Some(format!("{who} was lost (its connection closed or failed)")),
            (false, false) => None,
        }
    }

    /// (Prefill side) when the decode side was lost after completing some requests and before
    /// registering the failed ones: a line saying it may have served all it meant to (a `kvpipe
    /// serve` given fewer `--requests` than this side's `sent`).
    pub(crate) fn served_fewer(&self, sent: usize) -> Option<String> {
        let unregistered: Vec<String> = (self.why.keys())
            .filter(|r| !self.registered.contains(r))
            .map(|r| r.to_string())
            .collect();
        (self.lost && self.completed > 0 && unregistered.len() == self.why.len()).then(|| {
            format!(
                "the decode side registered none of the failed request(s) ({}) and closed after \
                 completing {} request(s): a `kvpipe serve` stops after its own --requests; does \
                 it serve as many as this side sends ({sent})?",
                unregistered.join(", "),
                self.completed
            )
        })
    }

    /// A one-line summary: the peer's fate and the failed requests, of `total`.
    pub(crate) fn summary(&self, who: &str, total: usize) -> String {
        let ids: Vec<String> = self.why.keys().map(|r| r.to_string()).collect();
        let requests = format!(
            "{} of {total} request(s) failed: {}",
            self.len(),
            ids.join(", ")
        );
        match self.peer_cause(who) {
            Some(cause) => format!("{cause}; {requests}"),
            None => requests,
        }
    }
}

fn waiting_name(w: Wait) -> &'static str {
    match w {
        Wait::Handshake => "the handshake",
        Wait::Registration => "the decode side's registration",
        Wait::Writes => "the transport to write a batch",
        Wait::Results => "the prefill side's results",
        Wait::Aux => "the aux data",
        Wait::Completion => "the decode side's completion",
        Wait::Liveness => "the peer",
    }
}
