//! The fault kinds the simulator injects, each switched on separately, and their rates (the
//! network emulation's configuration is made from them: [`SimConfig::netem_config`]).
//!
//! [`SimConfig::netem_config`]: super::SimConfig::netem_config

use core::fmt;
use core::str::FromStr;

use thiserror::Error;

/// One kind of fault the simulated network and transport can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// Per-link base latency with jitter (off: every frame takes a fixed few microseconds).
    Latency,
    /// A frame is lost on the wire; the reliable stream retransmits it after a retransmission
    /// timeout (head-of-line blocking the connection); too many losses in a row reset the
    /// connection.
    Loss,
    /// A frame is delivered twice in a row.
    Duplication,
    /// Write batches complete out of issue order, and frames of different connections overtake
    /// each other (a connection itself stays ordered, as the transport contract requires).
    Reordering,
    /// A frame is held for a long spike (tens to hundreds of milliseconds), blocking its
    /// connection; deadlines may pass.
    Delay,
    /// A write batch fails (partly applied) and is reported failed.
    WriteFailure,
    /// A connection between a sender rank and the receiver dies; both sides are told, its
    /// in-flight frames and writes are lost, and it reconnects later.
    PeerDeath,
    /// The prefill engine makes a mistake: its block source answers a chunk with a run longer
    /// than asked, short of its head, shifted, ending early, or the chunk says another prefix
    /// was cached. The sender must catch it and fail the request on both sides.
    Engine,
    /// The decode engine makes a mistake in a registration: it leaves out one of the request's
    /// writer ranks, lists a rank that holds the same part as another writer, or registers too
    /// few blocks. The receiver must refuse the registration (or, when a writer's handshake
    /// comes later, fail the request): it may never complete.
    Decode,
    /// Request ids are random 64-bit values in any order (engines hash their string ids), not
    /// a counter.
    RandomIds,
}

impl FaultKind {
    /// Every kind, in a fixed order.
    pub const ALL: [FaultKind; 10] = [
        FaultKind::Latency,
        FaultKind::Loss,
        FaultKind::Duplication,
        FaultKind::Reordering,
        FaultKind::Delay,
        FaultKind::WriteFailure,
        FaultKind::PeerDeath,
        FaultKind::Engine,
        FaultKind::Decode,
        FaultKind::RandomIds,
    ];

    /// The kind's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Latency => "latency",
            FaultKind::Loss => "loss",
            FaultKind::Duplication => "duplication",
            FaultKind::Reordering => "reordering",
            FaultKind::Delay => "delay",
            FaultKind::WriteFailure => "write-failure",
            FaultKind::PeerDeath => "peer-death",
            FaultKind::Engine => "engine",
            FaultKind::Decode => "decode",
            FaultKind::RandomIds => "random-ids",
        }
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`FaultKind`]s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FaultSet(u16);

impl FaultSet {
    /// No fault at all.
    pub const NONE: FaultSet = FaultSet(0);

    /// Every fault kind.
    pub fn all() -> Self {
        FaultKind::ALL
            .iter()
            .fold(FaultSet::NONE, |s, &k| s.with(k))
    }

    /// This set plus `kind`.
    pub fn with(self, kind: FaultKind) -> Self {
        FaultSet(self.0 | kind.bit())
    }

    /// Whether `kind` is in the set.
    pub fn contains(self, kind: FaultKind) -> bool {
        self.0 & kind.bit() != 0
    }

    /// The kinds in the set.
    pub fn kinds(self) -> impl Iterator<Item = FaultKind> {
        FaultKind::ALL
            .into_iter()
            .filter(move |k| self.contains(*k))
    }
}

impl fmt::Display for FaultSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.kinds().map(FaultKind::name).collect();
        f.write_str(&names.join(","))
    }
}

/// A fault list that names no known kind.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FaultParseError {
    /// An unknown name.
    #[error(
        "unknown fault kind `{0}` (expected none, all, or a comma list of latency, loss, \
         duplication, reordering, delay, write-failure, peer-death, engine, decode, random-ids)"
    )]
    UnknownKind(String),
}

impl FromStr for FaultSet {
    type Err = FaultParseError;

    /// `none`, `all`, or a comma list of kind names.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "none" | "" => return Ok(FaultSet::NONE),
            "all" => return Ok(FaultSet::all()),
            _ => {}
        }
        s.split(',').try_fold(FaultSet::NONE, |set, name| {
            let name = name.trim();
            FaultKind::ALL
                .iter()
                .find(|k| k.name() == name || k.name().replace('-', "_") == name)
                .map(|&k| set.with(k))
                .ok_or_else(|| FaultParseError::UnknownKind(name.to_string()))
        })
    }
}

/// How often each fault strikes when its kind is switched on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultRates {
    /// Probability that a frame is lost (each retransmission is lost with `loss_retry`).
    pub loss: f64,
    /// Probability that a retransmitted frame is lost again.
    pub loss_retry: f64,
    /// Losses in a row after which the connection resets.
    pub loss_reset_after: u32,
    /// Probability that a frame is duplicated.
    pub duplication: f64,
    /// Probability that a frame is held for a delay spike.
    pub delay: f64,
    /// Probability that a write batch fails.
    pub write_failure: f64,
    /// Probability that a request's start schedules the death of one of its connections.
    pub peer_death: f64,
    /// Probability that a writer's chunk is handed to the sender with an engine mistake.
    pub engine: f64,
    /// Probability that the decode engine's registration of a request carries a mistake.
    pub decode: f64,
    /// Probability that a frame's header is damaged on the wire (decoding catches it, and the
    /// receiving endpoint closes the connection). Applies whatever the fault set: off (0) by
    /// default, and not a [`FaultKind`], so `--faults all` keeps its meaning.
    pub corruption: f64,
}

impl Default for FaultRates {
    fn default() -> Self {
        FaultRates {
            loss: 0.01,
            loss_retry: 0.25,
            loss_reset_after: 4,
            duplication: 0.02,
            delay: 0.002,
            write_failure: 0.01,
            peer_death: 0.01,
            engine: 0.01,
            decode: 0.01,
            corruption: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{FaultKind, FaultSet};

    #[test]
    fn parses_lists_and_round_trips() {
        assert_eq!("none".parse::<FaultSet>().unwrap(), FaultSet::NONE);
        let all: FaultSet = "all".parse().unwrap();
        assert!(FaultKind::ALL.iter().all(|&k| all.contains(k)));
        let some: FaultSet = "loss, peer-death".parse().unwrap();
        assert!(some.contains(FaultKind::Loss) && some.contains(FaultKind::PeerDeath));
        assert!(!some.contains(FaultKind::Delay));
        assert_eq!(some.to_string(), "loss,peer-death");
        assert_eq!(all.to_string().parse::<FaultSet>().unwrap(), all);
        assert!("lost".parse::<FaultSet>().is_err());
    }
}
