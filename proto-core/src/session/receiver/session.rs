//! What the receiver keeps per request: the session, its writers, what it remembers of a
//! retired request.

use super::*;

/// Most frames held per writer while they wait for the data they report to land.
pub(super) const MAX_HELD_FRAMES: usize = 1024;

/// One sender rank of a request, as the receiver tracks it.
#[derive(Clone, Debug)]
pub(super) struct Writer {
    pub(super) peer: PeerId,
    pub(super) phase: WriterPhase,
    /// The slices whose successful result was taken (a duplicate is dropped, never counted).
    pub(super) seen: BTreeSet<SenderSliceId>,
    /// The writer's last slice, once its `is_last` result was taken: the writer is done when
    /// every slice up to it was seen.
    pub(super) last: Option<SenderSliceId>,
    /// The slices whose successful result arrived (held ones included), so a duplicate never
    /// counts as reported bytes.
    pub(super) arrived: BTreeSet<SenderSliceId>,
    /// Payload bytes of this writer's admitted writes that landed.
    pub(super) landed: u64,
    /// Bytes this writer's successful results reported (held ones included).
    pub(super) reported: u64,
    /// Frames that arrived before the data they report landed, each with the landed count it
    /// needs ([`DataPath::Landed`]).
    pub(super) held: VecDeque<(u64, Frame)>,
    /// The writer's aux data arrived.
    pub(super) aux: bool,
    /// Bytes the writer's taken successful results reported.
    pub(super) result_bytes: u64,
}

impl Writer {
    /// Everything of this writer arrived: its successful last result and its aux data.
    pub(super) fn finished(&self) -> bool {
        self.phase == WriterPhase::Done && self.aux
    }

    pub(super) fn on(&mut self, event: WriterEvent) -> bool {
        self.phase.on(event).advance(&mut self.phase)
    }
}

#[derive(Clone, Debug)]
pub(crate) struct RecvSession {
    pub(super) phase: RecvPhase,
    pub(super) frame: RecvRegistration,
    pub(super) extents: GrantedExtents,
    pub(super) writers: SmallVec<[Writer; 2]>,
    /// Admitted writes of the request still being applied.
    pub(super) writes_in_flight: u32,
    pub(super) aux: Option<AuxData>,
    pub(super) timings: RequestTimings,
    /// The overall cap: registration + `result_wait` + prompt × `result_per_token`.
    pub(super) result_cap: Instant,
    /// When a result, landed data or aux data last arrived.
    pub(super) last_progress: Option<Instant>,
    /// The earliest timer armed for the result deadline and not fired yet (progress arms a
    /// timer only when it brings the deadline before it, so the queue stays small).
    pub(super) result_armed: Option<Instant>,
    pub(super) aux_deadline: Option<Instant>,
    pub(super) quiesce_deadline: Option<Instant>,
    pub(super) bytes_written: u64,
    /// Blocks of the registration, released (counted) when the session quiesces.
    pub(super) blocks_pinned: u64,
    /// The bytes that landed; a write overlapping them is refused (no byte lands twice).
    pub(super) landed: LandedExtents,
    /// The part the writers must cover (`None`: all the rank holds).
    pub(super) expected_part: Option<Vec<GroupPart>>,
    /// The writers' cover was proved (every writer's handshake was known).
    pub(super) cover_proved: bool,
}

impl HeldSession for RecvSession {
    type Phase = RecvPhase;
    fn phase(&self) -> RecvPhase {
        self.phase
    }
    fn set_phase(&mut self, phase: RecvPhase) {
        self.phase = phase;
    }
    fn involves(&self, peer: PeerId) -> bool {
        self.writers.iter().any(|w| w.peer == peer)
    }
    fn awaits(&self, peer: PeerId) -> bool {
        (self.writers.iter()).any(|w| w.peer == peer && !w.finished())
    }
}

impl RecvSession {
    /// When the results are due: the overall cap, and once progress was made, the idle
    /// deadline after the last progress, whichever comes first.
    pub(super) fn result_deadline(&self, idle: crate::time::Duration) -> Instant {
        match self.last_progress {
            Some(at) => self.result_cap.min(at + idle),
            None => self.result_cap,
        }
    }

    /// Progress was made at `now`: the result deadline moves on. Returns the deadline to arm
    /// when it is earlier than the one armed (a later one is re-armed by the entry that fires).
    pub(super) fn progressed(
        &mut self,
        now: Instant,
        idle: crate::time::Duration,
    ) -> Option<Instant> {
        self.last_progress = Some(now);
        let due = self.result_deadline(idle);
        if self.result_armed.is_none_or(|armed| due < armed) {
            self.result_armed = Some(due);
            return Some(due);
        }
        None
    }
}

/// What the receiver remembers of a retired request: late writes carrying its grant from one
/// of its writers are discarded, anything else naming it is refused.
#[derive(Clone, Debug)]
pub(crate) struct RetiredGrant {
    pub(super) grant: GrantId,
    pub(super) writers: SmallVec<[PeerId; 2]>,
}
