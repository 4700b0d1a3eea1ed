//! What every part of a step acts on: the configuration, the virtual clock with its queue of
//! scheduled actions, the endpoints with their caches ([`Hosts`]) and the [`Trace`]. The world
//! owns it and lends it to the engine, the network and the oracle, which never call each other's
//! endpoints' outputs: they say whether they [`Called`] an endpoint, and the world drains it.

use kvpipe_conformance::cache::ReferenceCache;
use kvpipe_core::session::{Output, Receiver, Sender};
use kvpipe_core::Instant;

use crate::action::Action;
use crate::config::SimConfig;
use crate::scheduler::Scheduler;

/// The endpoints and the memory they move: sender ranks and the receiver with their reference
/// caches.
#[derive(Debug)]
pub(crate) struct Hosts {
    pub(crate) senders: Vec<Sender>,
    pub(crate) receiver: Receiver,
    pub(crate) sender_caches: Vec<ReferenceCache>,
    pub(crate) receiver_cache: ReferenceCache,
    /// Slots per group of every cache (all free at the end of a clean run).
    pub(crate) slots_per_group: u32,
}

/// What the run leaves for a reader: a readable line per step, the anomalies met (each one a
/// bug somewhere), and every output drained from each endpoint, when asked for.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    pub(crate) on: bool,
    pub(crate) lines: Vec<String>,
    pub(crate) anomalies: Vec<String>,
    /// Outputs drained, with their endpoint (sender rank, or `None`: the receiver).
    pub(crate) outputs: Option<Vec<(Option<usize>, Output)>>,
}

impl Trace {
    pub(crate) fn note(&mut self, now: Instant, line: impl FnOnce() -> String) {
        if self.on {
            let t = now.as_nanos();
            let text = line();
            self.lines.push(format!(
                "{:>5}.{:03}ms {text}",
                t / 1_000_000,
                (t / 1_000) % 1_000
            ));
        }
    }
}

/// Whether a part handed an endpoint an input, so the world must drain the endpoints' outputs
/// before anything else happens.
#[must_use = "the world drains the endpoints after a part called one"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Called {
    /// An endpoint was called.
    Endpoint,
    /// No endpoint was called.
    Nothing,
}

/// See the module doc.
#[derive(Debug)]
pub(crate) struct Stage {
    pub(crate) cfg: SimConfig,
    pub(crate) sched: Scheduler<Action>,
    pub(crate) hosts: Hosts,
    pub(crate) trace: Trace,
}

impl Stage {
    /// Current virtual time.
    pub(crate) fn now(&self) -> Instant {
        self.sched.now()
    }

    pub(crate) fn note(&mut self, line: impl FnOnce() -> String) {
        self.trace.note(self.sched.now(), line);
    }

    /// Records an anomaly (each one a bug somewhere).
    pub(crate) fn anomaly(&mut self, line: String) {
        self.note(|| format!("ANOMALY {line}"));
        self.trace.anomalies.push(line);
    }

    pub(crate) fn check<E: std::fmt::Display>(
        &mut self,
        res: Result<(), E>,
        what: impl FnOnce() -> String,
    ) {
        if let Err(e) = res {
            self.anomaly(format!("{}: {e}", what()));
        }
    }
}
