//! What the sender keeps per request: the session, its receivers (targets) and slices, the
//! registrations that arrived before their request was opened.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct Slice {
    pub(super) id: SenderSliceId,
    pub(super) is_last: bool,
    /// The chunk's block runs, kept until every receiver's registration planned them (a
    /// layered chunk's are held by its first range's slice until its last range is planned).
    pub(super) runs: Vec<(GroupIndex, BlockRun)>,
    pub(super) planned_by: usize,
    /// For one layer range of a chunk: which layers it writes (`None`: the whole chunk).
    pub(super) layers: Option<SliceLayers>,
}

/// The layers one slice of a layered chunk writes.
#[derive(Clone, Debug)]
pub(super) struct SliceLayers {
    /// Index of the slice whose `runs` hold the chunk's block runs (its first range's).
    pub(super) runs_at: usize,
    /// Per group of the rank, in group order: the rank's layers of the group the range covers.
    pub(super) groups: SmallVec<[core::ops::Range<u16>; 4]>,
    /// Whether this is the chunk's last range: planning it moves each receiver's cursors past
    /// the chunk and, once every receiver planned it, releases the chunk's runs.
    pub(super) last_of_chunk: bool,
}

/// A chunk submitted in layer ranges whose last range has not come yet.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpenChunk {
    /// The chunk; every later range names the same.
    pub(super) spec: ChunkSpec,
    /// Where the next range must start.
    pub(super) next_layer: u32,
    /// The slice holding the chunk's block runs (`None`: the chunk writes nothing).
    pub(super) runs_at: Option<usize>,
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TargetSlice {
    pub(super) done: bool,
    pub(super) bytes: u64,
    pub(super) deadline: Option<Instant>,
}

/// One receiver of a request: its registration, where planning stopped, and its slices.
#[derive(Clone, Debug)]
pub(super) struct Target {
    pub(super) peer: PeerId,
    pub(super) phase: TargetPhase,
    pub(super) registration: Option<RecvRegistration>,
    /// Where planning stopped in each group's anchored run (successive chunks cost O(chunk)).
    pub(super) cursors: SmallVec<[DstCursor; 2]>,
    pub(super) slices: Vec<TargetSlice>,
    pub(super) results_sent: usize,
    /// Write batches towards the receiver not reported yet.
    pub(super) inflight: u32,
}

impl Target {
    pub(super) fn new(peer: PeerId) -> Self {
        Target {
            peer,
            phase: TargetPhase::AwaitingRegistration,
            registration: None,
            cursors: SmallVec::new(),
            slices: Vec::new(),
            results_sent: 0,
            inflight: 0,
        }
    }

    pub(super) fn receiver_slice(&self) -> Option<ReceiverSliceId> {
        self.registration.as_ref().map(|r| r.slice)
    }

    /// Moves the target's phase; an event its phase does not take changes nothing.
    pub(super) fn on(&mut self, event: TargetEvent) -> bool {
        self.phase.on(event).advance(&mut self.phase)
    }
}

#[derive(Clone, Debug)]
pub(crate) struct SendSession {
    pub(super) phase: SendPhase,
    pub(super) targets: SmallVec<[Target; 2]>,
    pub(super) slices: Vec<Slice>,
    pub(super) next_start: Option<u32>,
    /// A chunk submitted in layer ranges, until its last range.
    pub(super) open_chunk: Option<OpenChunk>,
    pub(super) prompt_len: Option<u32>,
    /// The prefix length the first chunk (or the early prefix) declared; later chunks agree.
    pub(super) prepopulated_len: Option<u32>,
    /// The cached prefix was sent before the first chunk.
    pub(super) prefix_sent_early: bool,
    pub(super) aux: Option<AuxData>,
    pub(super) registration_deadline: Instant,
    pub(super) aux_deadline: Option<Instant>,
    /// When the receivers' `RecvComplete` is due: `result_wait` after the last target went
    /// `Confirming`.
    pub(super) confirm_deadline: Option<Instant>,
    pub(super) quiesce_deadline: Option<Instant>,
    /// Status carried by the terminal frames after a stop.
    pub(super) stop_status: TransferStatus,
    pub(super) stop_slice: Option<SenderSliceId>,
    pub(super) bytes_written: u64,
    pub(super) timings: RequestTimings,
    /// Blocks of the block runs of every slice, released (counted) when the session quiesces.
    pub(super) blocks_pinned: u64,
}

impl SendSession {
    /// When the receivers' `RecvComplete` is due while one is awaited (`None` when none is).
    pub(super) fn awaited_confirm(&self) -> Option<Instant> {
        (self.targets.iter())
            .any(|t| t.phase == TargetPhase::Confirming)
            .then_some(self.confirm_deadline)
            .flatten()
    }
}

impl HeldSession for SendSession {
    type Phase = SendPhase;
    fn phase(&self) -> SendPhase {
        self.phase
    }
    fn set_phase(&mut self, phase: SendPhase) {
        self.phase = phase;
    }
    fn involves(&self, peer: PeerId) -> bool {
        self.targets.iter().any(|t| t.peer == peer)
    }
    fn awaits(&self, peer: PeerId) -> bool {
        (self.targets.iter()).any(|t| t.peer == peer && !t.phase.is_finished())
    }
}

/// Registrations that arrived before the engine opened their request, by request.
/// Registrations held for one request, from the peers that sent them, in arrival order.
pub(super) type Held = SmallVec<[(PeerId, RecvRegistration); 1]>;

#[derive(Clone, Debug, Default)]
pub(super) struct PendingRegistrations {
    /// Per request: when its first registration arrived, and the registrations.
    pub(super) by_request: BTreeMap<RequestId, (Instant, Held)>,
    pub(super) len: usize,
}

impl PendingRegistrations {
    /// Holds `reg`; returns true for the request's first registration (its deadline starts).
    pub(super) fn push(&mut self, now: Instant, peer: PeerId, reg: RecvRegistration) -> bool {
        let mut first = false;
        let (_, list) = self.by_request.entry(reg.request).or_insert_with(|| {
            first = true;
            (now, SmallVec::new())
        });
        list.push((peer, reg));
        self.len += 1;
        first
    }

    /// Removes and returns the request's registrations, in arrival order.
    pub(super) fn take(&mut self, request: RequestId) -> Held {
        let taken = self
            .by_request
            .remove(&request)
            .map(|(_, list)| list)
            .unwrap_or_default();
        self.len -= taken.len();
        taken
    }

    /// When the request's first held registration arrived.
    pub(super) fn since(&self, request: RequestId) -> Option<Instant> {
        self.by_request.get(&request).map(|(at, _)| *at)
    }

    pub(super) fn remove(&mut self, request: RequestId, peer: PeerId) {
        if let Some((_, list)) = self.by_request.get_mut(&request) {
            let before = list.len();
            list.retain(|(p, _)| *p != peer);
            self.len -= before - list.len();
            if list.is_empty() {
                self.by_request.remove(&request);
            }
        }
    }

    pub(super) fn remove_peer(&mut self, peer: PeerId) {
        let mut removed = 0;
        self.by_request.retain(|_, (_, list)| {
            let before = list.len();
            list.retain(|(p, _)| *p != peer);
            removed += before - list.len();
            !list.is_empty()
        });
        self.len -= removed;
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct BatchRef {
    pub(super) request: RequestId,
    pub(super) target: usize,
    pub(super) slice: usize,
}
