//! What must hold, and what the run saw: one record per request (how each side ended, which
//! faults hit it), the anomalies met, and the judgement at the end — every request ended on
//! every side (no hang), no write touched a block that was not its request's (no stray write),
//! the receiver's bytes are exactly the sender's, nothing is left behind (no leak), and a fatal
//! fault never leaves one side completed (no one-sided outcome).
//!
//! The oracle reads the endpoints and caches on the [`Stage`] and the plans it is given; it
//! never calls an endpoint. When an endpoint reports `Quiesced` it says so ([`Quiesced`]) and
//! the world hands it to the engine.

use std::collections::{BTreeMap, HashMap};

use kvpipe_conformance::cache::ReferenceCache;
use kvpipe_core::session::state::{RecvPhase, SendPhase, TargetPhase};
use kvpipe_core::session::{Event, Wait};
use kvpipe_core::{GroupIndex, Instant, PeerId, RegionId, RequestId, Sender};
use smallvec::SmallVec;

use crate::action::RECEIVER_PEER;
use crate::report::{Outcome, RequestOutcome, SimReport, Terminal};
use crate::stage::{Hosts, Stage};
use crate::summary::{event_summary, who};
use crate::workload::RequestPlan;

/// One side's view of a request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SideState {
    pub(crate) started: bool,
    /// (Sender) the engine submitted the last chunk / the aux data.
    pub(crate) last_chunk: bool,
    pub(crate) aux: bool,
    pub(crate) terminal: Option<Terminal>,
    pub(crate) quiesced: bool,
    pub(crate) retired: bool,
}

/// What happened to one request.
#[derive(Clone, Debug)]
pub(crate) struct RequestRecord {
    pub(crate) started_at: Option<Instant>,
    pub(crate) finished_at: Option<Instant>,
    pub(crate) senders: SmallVec<[SideState; 2]>,
    pub(crate) receiver: SideState,
    /// Per writer: a fault that must fail this writer's session and the receiver's.
    pub(crate) fatal: SmallVec<[bool; 2]>,
    pub(crate) cancel_issued: bool,
    /// A fault touched it: one of its connections died or one of its write batches failed.
    pub(crate) exposed: bool,
    pub(crate) corrupted: bool,
    pub(crate) verified: bool,
    /// A writer's engine handed its sender a mistaken chunk, or the decode engine a mistaken
    /// registration: the request may not complete.
    pub(crate) engine_mistake: bool,
    /// The receiver refused the decode engine's mistaken registration: it never held a session
    /// for the request (the engine then recomputes the prompt itself).
    pub(crate) registration_refused: bool,
    /// When the receiver's engine registered it.
    pub(crate) registered_at: Option<Instant>,
    /// When one of its writes last landed on the receiver (admitted and applied).
    pub(crate) last_landing: Option<Instant>,
}

/// The records of every request (the anomalies met are in the [`Trace`](crate::stage::Trace)).
#[derive(Debug)]
pub(crate) struct Oracle {
    pub(crate) records: Vec<RequestRecord>,
    index: HashMap<RequestId, usize>,
    /// Mistaken chunks the engines handed their senders.
    pub(crate) engine_mistakes: u64,
    /// Mistaken registrations the decode engine handed the receiver.
    pub(crate) decode_mistakes: u64,
    /// Requests the receiver timed out while they were progressing (see
    /// [`Oracle::check_result_timeout`]).
    pub(crate) timed_out_progressing: u64,
    /// Per endpoint (`None`: the receiver) and peer: the disconnects it was told of, and the
    /// `PeerLost` events it reported. Each disconnect must give exactly one.
    pub(crate) disconnects: BTreeMap<(Option<usize>, PeerId), (u64, u64)>,
}

/// An endpoint reported `Quiesced` for a request: no write can touch its blocks any more, so
/// its engine may free them and retire it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Quiesced {
    /// The request's index in the plans.
    pub(crate) index: usize,
    /// The sender rank that reported it (`None`: the receiver).
    pub(crate) from: Option<usize>,
}

impl Oracle {
    /// One empty record per plan (in plan order).
    pub(crate) fn new(plans: &[RequestPlan]) -> Self {
        Oracle {
            records: plans
                .iter()
                .map(|p| RequestRecord {
                    started_at: None,
                    finished_at: None,
                    senders: p.writers.iter().map(|_| SideState::default()).collect(),
                    receiver: SideState::default(),
                    fatal: p.writers.iter().map(|_| false).collect(),
                    cancel_issued: false,
                    exposed: false,
                    corrupted: false,
                    verified: false,
                    engine_mistake: false,
                    registration_refused: false,
                    registered_at: None,
                    last_landing: None,
                })
                .collect(),
            index: plans.iter().enumerate().map(|(i, p)| (p.id, i)).collect(),
            engine_mistakes: 0,
            decode_mistakes: 0,
            timed_out_progressing: 0,
            disconnects: BTreeMap::new(),
        }
    }

    /// Endpoint `side` was told `peer` disconnected.
    pub(crate) fn told_disconnected(&mut self, side: Option<usize>, peer: PeerId) {
        self.disconnects.entry((side, peer)).or_default().0 += 1;
    }

    /// Every disconnect an endpoint was told of that did not give exactly one `PeerLost`.
    pub(crate) fn peer_loss_mismatches(&self) -> Vec<String> {
        (self.disconnects.iter())
            .filter(|(_, (told, lost))| told != lost)
            .map(|((side, peer), (told, lost))| {
                format!(
                    "{} reported PeerLost {lost} time(s) for {peer} after {told} disconnect(s)",
                    who(*side)
                )
            })
            .collect()
    }

    /// The plan index of `request`.
    pub(crate) fn find(&self, request: RequestId) -> Option<usize> {
        self.index.get(&request).copied()
    }

    /// Marks `request`'s writer `rank` as hit by a fatal fault if its session is still active.
    pub(crate) fn mark_fatal(
        &mut self,
        plans: &[RequestPlan],
        sender: &Sender,
        rank: usize,
        request: RequestId,
    ) {
        if !sender.phase(request).is_some_and(|p| p.is_active()) {
            return;
        }
        // A writer that handed everything to the connection and waits for the receiver's
        // `RecvComplete`: the fault either lost those frames too (then the receiver fails as
        // well) or only the receiver's word (the inherent race of the last frame, counted as
        // `split`, in the safe direction: the receiver's KV is whole). Neither is one-sided.
        if sender.target_phase(request, RECEIVER_PEER) == Some(TargetPhase::Confirming) {
            return;
        }
        if let Some(i) = self.find(request) {
            if let Some(w) = plans[i].writers.iter().position(|&r| r == rank) {
                self.records[i].fatal[w] = true;
            }
        }
    }

    /// The started, unfinished requests written by sender rank `link`.
    pub(crate) fn open_on_link(&self, plans: &[RequestPlan], link: usize) -> Vec<RequestId> {
        self.records
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                r.started_at.is_some()
                    && r.finished_at.is_none()
                    && plans[*i].writers.contains(&link)
            })
            .map(|(i, _)| plans[i].id)
            .collect()
    }

    /// Marks every started, unfinished request written by sender rank `link` as touched by a
    /// fault of that connection.
    pub(crate) fn expose_link(&mut self, plans: &[RequestPlan], link: usize) {
        for (i, r) in self.records.iter_mut().enumerate() {
            if r.started_at.is_some() && r.finished_at.is_none() && plans[i].writers.contains(&link)
            {
                r.exposed = true;
            }
        }
    }

    /// Judges every request and the endpoints at the end of a run (see the module doc), with
    /// the `anomalies` the run met.
    pub(crate) fn judge(
        &self,
        plans: &[RequestPlan],
        hosts: &Hosts,
        batch_requests: &[RequestId],
        slots_per_group: u32,
        anomalies: &[String],
    ) -> SimReport {
        let mut report = SimReport {
            requests: plans.len() as u64,
            ..SimReport::default()
        };
        let mut outcomes = Vec::with_capacity(plans.len());
        for (i, plan) in plans.iter().enumerate() {
            let rec = &self.records[i];
            let request = plan.id;
            let sides_done = rec.finished_at.is_some();
            let mut leak = Vec::new();
            if sides_done {
                if batch_requests.contains(&request) {
                    leak.push("a write batch never reported");
                }
                for &rank in &plan.writers {
                    if hosts.sender_caches[rank].computed_tokens(request).is_some() {
                        leak.push("sender blocks not freed");
                    }
                    if hosts.senders[rank].phase(request) != Some(SendPhase::Retired) {
                        leak.push("sender session not retired");
                    }
                }
                if hosts.receiver_cache.computed_tokens(request).is_some() {
                    leak.push("receiver blocks not freed");
                }
                // A refused registration left no session behind.
                let held = !rec.registration_refused;
                if held && hosts.receiver.phase(request) != Some(RecvPhase::Retired) {
                    leak.push("receiver session not retired");
                }
            }
            let completed = |s: &SideState| s.terminal == Some(Terminal::Completed);
            let all_completed = completed(&rec.receiver) && rec.senders.iter().all(completed);
            let any_completed = completed(&rec.receiver) || rec.senders.iter().any(completed);
            let outcome = if !sides_done {
                Outcome::Hung
            } else if !leak.is_empty() {
                Outcome::Leaked
            } else if rec.corrupted {
                Outcome::Corrupted
            } else if all_completed {
                Outcome::Completed
            } else if rec.cancel_issued {
                Outcome::Cancelled
            } else {
                Outcome::Failed
            };
            let one_sided = sides_done
                && rec.fatal.iter().enumerate().any(|(w, &fatal)| {
                    fatal && (completed(&rec.senders[w]) || completed(&rec.receiver))
                });
            let fatal = rec.fatal.iter().any(|&f| f);
            match outcome {
                Outcome::Completed => report.completed += 1,
                Outcome::Failed => report.failed += 1,
                Outcome::Cancelled => report.cancelled += 1,
                Outcome::Hung => report.hung += 1,
                Outcome::Corrupted => report.corrupted += 1,
                Outcome::Leaked => report.leaked += 1,
            }
            report.one_sided += u64::from(one_sided);
            let bug = one_sided
                || matches!(
                    outcome,
                    Outcome::Hung | Outcome::Corrupted | Outcome::Leaked
                );
            if bug && report.first_bugs.len() < 10 {
                report.first_bugs.push(request.0);
            }
            report.fatal += u64::from(fatal);
            // Bad data the receiver still took as a success: wrong bytes, or a request an engine
            // mistake hit.
            report.undetected +=
                u64::from(completed(&rec.receiver) && (rec.corrupted || rec.engine_mistake));
            match rec.receiver.terminal {
                Some(Terminal::Failed) => report.receiver_failed += 1,
                Some(Terminal::TimedOut) => report.receiver_timed_out += 1,
                Some(Terminal::Cancelled) => report.receiver_cancelled += 1,
                Some(Terminal::Completed) | None => {}
            }
            report.split += u64::from(sides_done && any_completed && !all_completed);
            outcomes.push(RequestOutcome {
                request,
                outcome,
                one_sided,
                fatal,
                exposed: rec.exposed,
                receiver: rec.receiver.terminal,
                senders: rec.senders.iter().map(|s| s.terminal).collect(),
                leaks: leak.iter().map(|s| s.to_string()).collect(),
                duration: match (rec.started_at, rec.finished_at) {
                    (Some(a), Some(b)) => Some(b.saturating_duration_since(a)),
                    _ => None,
                },
            });
        }
        // Endpoint-wide leak check: nothing may remain once every request was retired.
        if report.hung == 0 {
            let left = leftovers(hosts, batch_requests.len(), slots_per_group);
            if !left.is_empty() && report.leaked == 0 {
                report.leaked += 1;
            }
            report.leak_details = left;
        }
        report.anomalies = anomalies.len() as u64;
        report.first_anomalies = anomalies.iter().take(5).cloned().collect();
        report.outcomes = outcomes;
        report
    }

    /// The receiver timed request `i` out waiting for results. That is right only once the
    /// overall cap passed (registration + `result_wait` + prompt × `result_per_token`) or the
    /// request stopped progressing; a write of it that landed within `result_idle` is progress
    /// the deadline must have followed. (Only landings count here: results and aux data are
    /// progress too, but a duplicate of an old frame is not, so counting frames could blame a
    /// correct timeout.)
    pub(crate) fn check_result_timeout(
        &mut self,
        stage: &mut Stage,
        plans: &[RequestPlan],
        i: usize,
    ) {
        let now = stage.now();
        let rec = &self.records[i];
        let Some(registered) = rec.registered_at else {
            return;
        };
        let d = &stage.cfg.deadlines;
        let per_token = d.result_per_token.as_nanos();
        let cap = registered
            + d.result_wait
            + kvpipe_core::Duration::from_nanos(
                per_token.saturating_mul(u64::from(plans[i].prompt_len)),
            );
        if let Some(landed) = rec.last_landing.filter(|&at| now < at + d.result_idle) {
            if now < cap {
                let request = plans[i].id;
                self.timed_out_progressing += 1;
                stage.trace.anomalies.push(format!(
                    "R timed {request} out at {now} while progressing (last write landed at \
                     {landed}, cap {cap})"
                ));
            }
        }
    }

    /// Records an endpoint's event and checks it: one terminal event per side, a writer
    /// completes only after its last chunk, its aux data and its writes, the receiver only with
    /// exactly the sender's bytes; `Quiesced` only after the terminal event, once (and then
    /// returned, for the engine). `in_flight(rank, request)`: whether a write batch of `request`
    /// from sender rank `rank` is still in flight.
    pub(crate) fn on_event(
        &mut self,
        stage: &mut Stage,
        plans: &[RequestPlan],
        in_flight: impl Fn(usize, RequestId) -> bool,
        from: Option<usize>,
        event: Event,
    ) -> Option<Quiesced> {
        let who = who(from);
        let (request, terminal) = match &event {
            Event::Completed { request, .. } => (*request, Some(Terminal::Completed)),
            Event::Failed { request, .. } => (*request, Some(Terminal::Failed)),
            Event::TimedOut { request, .. } => (*request, Some(Terminal::TimedOut)),
            Event::Cancelled { request, .. } => (*request, Some(Terminal::Cancelled)),
            Event::Quiesced { request } => (*request, None),
            other => {
                if let Event::PeerLost { peer, .. } = other {
                    self.disconnects.entry((from, *peer)).or_default().1 += 1;
                }
                let text = event_summary(other);
                stage.note(|| format!("{who} event {text}"));
                return None;
            }
        };
        let text = event_summary(&event);
        stage.note(|| format!("{who} event {text}"));
        let Some(i) = self.find(request) else {
            stage
                .trace
                .anomalies
                .push(format!("{who} event for unknown {request}"));
            return None;
        };
        if let (
            None,
            Event::TimedOut {
                waiting_for: Wait::Results,
                ..
            },
        ) = (from, &event)
        {
            self.check_result_timeout(stage, plans, i);
        }
        let side = match from {
            Some(rank) => match plans[i].writers.iter().position(|&r| r == rank) {
                Some(w) => &mut self.records[i].senders[w],
                None => {
                    stage.trace.anomalies.push(format!(
                        "{who} event for {request}, which it does not write"
                    ));
                    return None;
                }
            },
            None => &mut self.records[i].receiver,
        };
        if let Some(t) = terminal {
            if side.terminal.is_some() {
                stage
                    .trace
                    .anomalies
                    .push(format!("{who} second terminal event {text}"));
            } else {
                side.terminal = Some(t);
            }
            if let (Some(rank), Terminal::Completed) = (from, t) {
                // A writer completes only after its last chunk (and its aux data), with none of
                // its write batches still in flight.
                let w = plans[i].writers.iter().position(|&r| r == rank);
                let s = w.map(|w| self.records[i].senders[w]).unwrap_or_default();
                let writing = in_flight(rank, request);
                if !s.last_chunk || !s.aux || writing {
                    stage.trace.anomalies.push(format!(
                        "{who} completed {request} early: last chunk {}, aux {}, writes in \
                         flight {writing}",
                        s.last_chunk, s.aux
                    ));
                }
            }
            if from.is_none() && t == Terminal::Completed {
                self.records[i].verified = true;
                let bad = stage.hosts.receiver_cache.verify(request);
                if !bad.is_empty() {
                    let first = bad[0];
                    stage.note(|| format!("CORRUPTED {request}: {first:?}"));
                    self.records[i].corrupted = true;
                }
            }
            return None;
        }
        // Quiesced: no write can touch the blocks any more; the engine frees them and retires.
        if side.quiesced || side.terminal.is_none() {
            stage.trace.anomalies.push(format!(
                "{who} Quiesced for {request} twice or before its terminal event"
            ));
        }
        side.quiesced = true;
        Some(Quiesced { index: i, from })
    }
}

/// What the endpoints and caches still hold (each line a leak).
fn leftovers(hosts: &Hosts, batches: usize, slots_per_group: u32) -> Vec<String> {
    let mut left = Vec::new();
    for (r, s) in hosts.senders.iter().enumerate() {
        if s.session_count() != 0 {
            left.push(format!("S{r} holds {} sessions", s.session_count()));
        }
        if s.pending_registration_count() != 0 {
            left.push(format!(
                "S{r} holds {} registrations of unopened requests",
                s.pending_registration_count()
            ));
        }
        if s.batches_in_flight() != 0 {
            left.push(format!(
                "S{r} has {} batches in flight",
                s.batches_in_flight()
            ));
        }
    }
    if hosts.receiver.session_count() != 0 {
        left.push(format!(
            "R holds {} sessions",
            hosts.receiver.session_count()
        ));
    }
    if batches != 0 {
        left.push(format!("{batches} write batches never reported"));
    }
    let caches = hosts
        .sender_caches
        .iter()
        .chain(std::iter::once(&hosts.receiver_cache));
    for (c, cache) in caches.enumerate() {
        for g in 0..cache.group_count() {
            let free = cache.free_slots(GroupIndex(g as u16));
            if free != slots_per_group as usize {
                left.push(format!(
                    "cache {c} group {g}: {} slots still held",
                    slots_per_group as usize - free
                ));
            }
        }
    }
    left
}

/// The request owning a byte range of `region` in `cache`, when it is not `request`
/// (`Some(None)`: the slot is free or outside the cache).
pub(crate) fn foreign_owner(
    cache: &ReferenceCache,
    region: RegionId,
    offset: u64,
    len: u64,
    request: RequestId,
) -> Option<Option<RequestId>> {
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let Some(loc) = cache.locate(region, at) else {
            return Some(None);
        };
        match cache.owner(loc.group, loc.slot) {
            Some((owner, _)) if owner == request => {}
            Some((owner, _)) => return Some(Some(owner)),
            None => return Some(None),
        }
        let slot_bytes = cache.layout(loc.group)?.pools[loc.pool].slot_bytes;
        at += slot_bytes - loc.offset_in_slot;
    }
    None
}
