//! The `session` target: an arbitrary sequence of engine inputs, network events and time steps
//! applied to one connected sender/receiver pair, with the sessions' safety rules checked after
//! every step.
//!
//! The pair uses a small fixed layout. The fuzzer decides which frames are delivered (in order or
//! not), dropped or duplicated, which write batches complete or fail, when time advances, and
//! when either engine submits, registers, cancels or retires. Rules checked (a violation panics):
//!
//! - nothing panics (every input, however wrong — including arbitrary frames from a hostile
//!   peer — is answered with a value or an error);
//! - a sender completes a request only after its last chunk was submitted, every write batch of
//!   the request was reported complete (none failed), and its aux data (if it sends it) was
//!   submitted;
//! - a receiver completes a request only after a successful last result and the aux data for it
//!   were delivered to it;
//! - no write batch is emitted for a request after it was cancelled, ended or retired;
//! - after `Quiesced`, an endpoint emits nothing more for the request (no write, no event, no
//!   result, aux or registration frame; refusing `Cancel` frames are allowed), and `Quiesced`
//!   comes once, after exactly one terminal event;
//! - nothing waits without a deadline: after the case, with the network and transport catching
//!   up and twelve seconds passing, every registered request ended and quiesced on the receiver,
//!   and every request whose last chunk was submitted (or that was cancelled) on the sender.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use arbitrary::{Arbitrary, Unstructured};
use kvpipe_core::session::{
    Deadlines, Event, LocalHello, Output, Receiver, ReceiverConfig, ReceiverInput, Registration,
    SendRequest, Sender, SenderConfig, SenderInput, WriteBatchId,
};
use kvpipe_core::wire::{AuxData, Frame, Topology, TransferStatus};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Duration, GroupIndex,
    InstanceId, Instant, LayerGroupLayout, PeerId, PoolLayout, RegionId, RequestId,
};

/// Tokens per block of the fixed layout.
const TPB: u32 = 4;
/// How the receiver names the sender.
const SENDER: PeerId = PeerId(0);
/// How the sender names the receiver.
const RECEIVER: PeerId = PeerId(1000);
/// Request ids the fuzzer picks from.
const REQUESTS: u64 = 4;

/// One step of a case.
#[derive(Arbitrary, Clone, Debug)]
pub enum Op {
    /// The prefill engine opens a request.
    Open {
        /// Request (modulo the id space).
        request: u8,
        /// Whether the sender sends the aux data.
        sends_aux: bool,
    },
    /// The decode engine registers a request.
    Register {
        /// Request.
        request: u8,
        /// Prompt tokens the receiver has cached (modulo the prompt).
        cached: u8,
    },
    /// The prefill engine submits the next chunk of a request.
    SubmitChunk {
        /// Request.
        request: u8,
        /// Tokens in the chunk (0 is allowed).
        tokens: u8,
        /// Make it the last chunk (it then runs to the prompt's end).
        last: bool,
    },
    /// The prefill engine submits the aux data.
    SubmitAux {
        /// Request.
        request: u8,
    },
    /// Deliver the oldest frame in one direction.
    DeliverNext {
        /// Towards the receiver (else towards the sender).
        to_receiver: bool,
    },
    /// Deliver any pending frame (out of order).
    DeliverAny {
        /// Towards the receiver.
        to_receiver: bool,
        /// Which (modulo the queue).
        index: u8,
    },
    /// Drop a pending frame.
    Drop {
        /// Towards the receiver.
        to_receiver: bool,
        /// Which.
        index: u8,
    },
    /// Duplicate a pending frame (the copy goes to the back).
    Duplicate {
        /// Towards the receiver.
        to_receiver: bool,
        /// Which.
        index: u8,
    },
    /// The transport reports a pending write batch complete.
    CompleteWrite {
        /// Which (modulo the pending batches).
        index: u8,
    },
    /// The transport reports a pending write batch failed.
    FailWrite {
        /// Which.
        index: u8,
        /// Failure status (0 maps to `WriteFailed`).
        status: u8,
    },
    /// Time passes; due timers fire.
    Advance {
        /// Milliseconds.
        millis: u16,
    },
    /// The prefill engine cancels a request.
    CancelSender {
        /// Request.
        request: u8,
    },
    /// The decode engine cancels a request.
    CancelReceiver {
        /// Request.
        request: u8,
    },
    /// The prefill engine retires a request.
    RetireSender {
        /// Request.
        request: u8,
    },
    /// The decode engine retires a request.
    RetireReceiver {
        /// Request.
        request: u8,
    },
    /// The network and transport catch up: every pending write completes and every pending
    /// frame is delivered in order, until nothing is left.
    Pump,
    /// A hostile or broken peer: an arbitrary frame (its request id folded into the case's
    /// id space) is delivered to one side.
    Inject {
        /// Towards the receiver.
        to_receiver: bool,
        /// Request the frame is about (for session frames).
        request: u8,
        /// The frame.
        frame: Frame,
    },
    /// The connection drops (both sides are told; pending frames are lost).
    Disconnect,
    /// The connection comes back (both sides start a handshake).
    Reconnect,
}

/// A whole fuzz case.
#[derive(Arbitrary, Clone, Debug)]
pub struct SessionCase {
    /// The steps, in order.
    pub ops: Vec<Op>,
}

/// What a run saw (for tests over structured cases).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Sender completions.
    pub sender_completed: u64,
    /// Receiver completions.
    pub receiver_completed: u64,
    /// Terminal events other than completion (both sides).
    pub ended_otherwise: u64,
    /// Write batches issued.
    pub batches: u64,
}

fn layout(region: u32) -> Vec<LayerGroupLayout> {
    vec![LayerGroupLayout {
        layers: 2,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 4,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        block_layout: Default::default(),
        pools: [PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 2,
            slot_bytes: 128,
        }]
        .into_iter()
        .collect(),
    }]
}

fn deadlines() -> Deadlines {
    Deadlines {
        handshake: Duration::from_millis(100),
        registration: Duration::from_millis(1_000),
        write_completion: Duration::from_millis(200),
        result_wait: Duration::from_millis(2_000),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_millis(2_000),
        aux_wait: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(50),
        liveness_timeout: Duration::from_millis(400),
        quiesce: Duration::from_millis(150),
    }
}

/// The prompt length of request `r` (fixed, so both engines agree).
fn prompt_len(r: RequestId) -> u32 {
    5 + 7 * r.0 as u32
}

fn request(r: u8) -> RequestId {
    RequestId(u64::from(r) % REQUESTS + 1)
}

/// Request `r`'s blocks on the sender: ordinal `o` in slot `100 * r + o`.
struct FixedSource;

impl BlockSource for FixedSource {
    fn block_run(
        &mut self,
        request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let blocks = prompt_len(request).div_ceil(TPB);
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end > blocks {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: blocks,
            });
        }
        out.first_ordinal = begin;
        out.ids.clear();
        out.ids
            .extend((begin..end).map(|o| BlockId(100 * request.0 as u32 + o)));
        Ok(())
    }
}

/// Per-endpoint, per-request bookkeeping for the rules.
#[derive(Clone, Debug, Default)]
struct Track {
    terminal: bool,
    quiesced: bool,
    /// No write may be emitted any more (cancelled, ended or retired).
    no_writes: bool,
}

struct Pair {
    now: Instant,
    sender: Sender,
    receiver: Receiver,
    connected: bool,
    to_receiver: VecDeque<Frame>,
    to_sender: VecDeque<Frame>,
    pending: Vec<(WriteBatchId, RequestId)>,
    next_start: BTreeMap<RequestId, u32>,
    last_submitted: BTreeSet<RequestId>,
    sends_aux: BTreeMap<RequestId, bool>,
    /// Requests opened on the sender / registered on the receiver.
    opened: BTreeSet<RequestId>,
    registered: BTreeSet<RequestId>,
    /// Requests the sender engine cancelled.
    cancelled: BTreeSet<RequestId>,
    aux_submitted: BTreeSet<RequestId>,
    batches: BTreeMap<RequestId, (u64, u64, bool)>,
    /// (request) → delivered to the receiver: a successful last result, aux data.
    delivered_last: BTreeSet<RequestId>,
    delivered_aux: BTreeSet<RequestId>,
    send_track: BTreeMap<RequestId, Track>,
    recv_track: BTreeMap<RequestId, Track>,
    stats: SessionStats,
}

impl Pair {
    fn new() -> Self {
        let mut sc = SenderConfig::new(LocalHello::new(
            InstanceId(1),
            Topology::default(),
            layout(1),
        ));
        sc.deadlines = deadlines();
        let mut rc = ReceiverConfig::new(
            LocalHello::new(InstanceId(2), Topology::default(), layout(2)),
            7,
        );
        rc.deadlines = deadlines();
        let mut pair = Pair {
            now: Instant::from_millis(1),
            sender: Sender::new(sc),
            receiver: Receiver::new(rc),
            connected: false,
            to_receiver: VecDeque::new(),
            to_sender: VecDeque::new(),
            pending: Vec::new(),
            next_start: BTreeMap::new(),
            last_submitted: BTreeSet::new(),
            sends_aux: BTreeMap::new(),
            opened: BTreeSet::new(),
            registered: BTreeSet::new(),
            cancelled: BTreeSet::new(),
            aux_submitted: BTreeSet::new(),
            batches: BTreeMap::new(),
            delivered_last: BTreeSet::new(),
            delivered_aux: BTreeSet::new(),
            send_track: BTreeMap::new(),
            recv_track: BTreeMap::new(),
            stats: SessionStats::default(),
        };
        pair.reconnect();
        // Finish the handshake so cases start with a ready connection.
        for _ in 0..4 {
            pair.deliver(true, 0);
            pair.deliver(false, 0);
        }
        pair
    }

    fn reconnect(&mut self) {
        if self.connected {
            return;
        }
        self.connected = true;
        let now = self.now;
        let _ = self.sender.handle_input(SenderInput::PeerConnected {
            now,
            peer: RECEIVER,
        });
        let _ = self
            .receiver
            .handle_input(ReceiverInput::PeerConnected { now, peer: SENDER });
        self.drain();
    }

    fn disconnect(&mut self) {
        if !self.connected {
            return;
        }
        self.connected = false;
        self.to_receiver.clear();
        self.to_sender.clear();
        let now = self.now;
        let _ = self.sender.handle_input(SenderInput::PeerDisconnected {
            now,
            peer: RECEIVER,
        });
        let _ = self
            .receiver
            .handle_input(ReceiverInput::PeerDisconnected { now, peer: SENDER });
        self.drain();
    }

    fn queue(&mut self, to_receiver: bool) -> &mut VecDeque<Frame> {
        if to_receiver {
            &mut self.to_receiver
        } else {
            &mut self.to_sender
        }
    }

    fn deliver(&mut self, to_receiver: bool, index: usize) {
        let q = self.queue(to_receiver);
        if q.is_empty() {
            return;
        }
        let i = index % q.len();
        let Some(frame) = q.remove(i) else { return };
        let now = self.now;
        if to_receiver {
            match &frame {
                Frame::KvResult(r) if r.is_last && r.status == TransferStatus::Success => {
                    self.delivered_last.insert(r.request);
                }
                Frame::AuxResult(a) if a.status == TransferStatus::Success => {
                    self.delivered_aux.insert(a.request);
                }
                _ => {}
            }
            let _ = self.receiver.handle_input(ReceiverInput::FrameReceived {
                now,
                peer: SENDER,
                frame,
            });
        } else {
            let _ = self.sender.handle_input(SenderInput::FrameReceived {
                now,
                peer: RECEIVER,
                frame,
            });
        }
        self.drain();
    }

    fn tick(&mut self) {
        let now = self.now;
        if self.sender.poll_timeout().is_some_and(|at| at <= now) {
            let _ = self.sender.handle_input(SenderInput::Timeout { now });
        }
        if self.receiver.poll_timeout().is_some_and(|at| at <= now) {
            let _ = self.receiver.handle_input(ReceiverInput::Timeout { now });
        }
        self.drain();
    }

    /// Drains both endpoints, checking every output against the rules.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            while let Some(o) = self.sender.poll_output() {
                any = true;
                self.on_sender_output(o);
            }
            while let Some(o) = self.receiver.poll_output() {
                any = true;
                self.on_receiver_output(o);
            }
            if !any {
                return;
            }
        }
    }

    fn on_sender_output(&mut self, o: Output) {
        match o {
            Output::Transmit { peer, frame } => {
                assert_eq!(peer, RECEIVER, "sender transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.send_track.entry(r).or_default();
                    assert!(!t.quiesced, "sender sent {frame:?} after Quiesced");
                }
                if self.connected {
                    self.to_receiver.push_back(through_the_wire(frame));
                }
            }
            Output::ExecuteWrites { batch, request, .. } => {
                let t = self.send_track.entry(request).or_default();
                assert!(
                    !t.no_writes && !t.quiesced,
                    "write {batch} emitted for {request}, which was cancelled, ended or retired"
                );
                self.batches.entry(request).or_default().0 += 1;
                self.stats.batches += 1;
                self.pending.push((batch, request));
            }
            Output::ClosePeer { .. } => self.disconnect(),
            Output::Event(e) => {
                let Some(r) = event_request(&e) else { return };
                let t = self.send_track.entry(r).or_default().clone();
                assert!(!t.quiesced, "sender event {e:?} after Quiesced");
                match e {
                    Event::Completed { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        assert!(
                            self.last_submitted.contains(&r),
                            "sender completed {r} before its last chunk"
                        );
                        let (issued, done, failed) =
                            self.batches.get(&r).copied().unwrap_or_default();
                        assert!(
                            !failed && issued == done,
                            "sender completed {r} with {issued} batches issued, {done} \
                             completed, failed={failed}"
                        );
                        if self.sends_aux.get(&r).copied().unwrap_or(false) {
                            assert!(
                                self.aux_submitted.contains(&r),
                                "sender completed {r} without its aux data"
                            );
                        }
                        self.stats.sender_completed += 1;
                        self.mark_terminal(true, r);
                    }
                    Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        self.stats.ended_otherwise += 1;
                        self.mark_terminal(true, r);
                    }
                    Event::Quiesced { .. } => {
                        assert!(t.terminal, "Quiesced before a terminal event for {r}");
                        self.send_track.entry(r).or_default().quiesced = true;
                    }
                    _ => {}
                }
            }
        }
    }

    fn on_receiver_output(&mut self, o: Output) {
        match o {
            Output::Transmit { peer, frame } => {
                assert_eq!(peer, SENDER, "receiver transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.recv_track.entry(r).or_default();
                    assert!(!t.quiesced, "receiver sent {frame:?} after Quiesced");
                }
                if self.connected {
                    self.to_sender.push_back(through_the_wire(frame));
                }
            }
            Output::ExecuteWrites { .. } => panic!("a receiver emitted a write batch"),
            Output::ClosePeer { .. } => self.disconnect(),
            Output::Event(e) => {
                let Some(r) = event_request(&e) else { return };
                let t = self.recv_track.entry(r).or_default().clone();
                assert!(!t.quiesced, "receiver event {e:?} after Quiesced");
                match e {
                    Event::Completed { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        assert!(
                            self.delivered_last.contains(&r),
                            "receiver completed {r} before a successful last result arrived"
                        );
                        assert!(
                            self.delivered_aux.contains(&r),
                            "receiver completed {r} before its aux data arrived"
                        );
                        self.stats.receiver_completed += 1;
                        self.mark_terminal(false, r);
                    }
                    Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. } => {
                        assert!(!t.terminal, "second terminal event {e:?}");
                        self.stats.ended_otherwise += 1;
                        self.mark_terminal(false, r);
                    }
                    Event::Quiesced { .. } => {
                        assert!(t.terminal, "Quiesced before a terminal event for {r}");
                        self.recv_track.entry(r).or_default().quiesced = true;
                    }
                    _ => {}
                }
            }
        }
    }

    fn mark_terminal(&mut self, sender: bool, r: RequestId) {
        let t = if sender {
            self.send_track.entry(r).or_default()
        } else {
            self.recv_track.entry(r).or_default()
        };
        t.terminal = true;
        t.no_writes = true;
    }

    fn apply(&mut self, op: Op) {
        let now = self.now;
        match op {
            Op::Open {
                request: r,
                sends_aux,
            } => {
                let r = request(r);
                let res = self.sender.open_request(
                    now,
                    SendRequest {
                        request: r,
                        receivers: [RECEIVER].into_iter().collect(),
                        sends_aux,
                    },
                );
                if res.is_ok() {
                    self.sends_aux.insert(r, sends_aux);
                    self.opened.insert(r);
                }
            }
            Op::Register { request: r, cached } => {
                let r = request(r);
                let prompt = prompt_len(r);
                let blocks = prompt.div_ceil(TPB);
                let first = (u32::from(cached) % (prompt + 1)) / TPB;
                let ids: Vec<BlockId> = (first..blocks)
                    .map(|o| BlockId(500 + 20 * r.0 as u32 + o))
                    .collect();
                let res = self.receiver.register(
                    now,
                    Registration {
                        request: r,
                        prompt_len: prompt,
                        groups: vec![AnchoredRun::from_ids(first, &ids)],
                        writers: [SENDER].into_iter().collect(),
                        aux_capacity: 256,
                    },
                );
                if res.is_ok() {
                    self.registered.insert(r);
                }
            }
            Op::SubmitChunk {
                request: r,
                tokens,
                last,
            } => {
                let r = request(r);
                let prompt = prompt_len(r);
                let start = self.next_start.get(&r).copied().unwrap_or(0);
                let mut end = (start + u32::from(tokens)).min(prompt);
                if last {
                    end = prompt;
                }
                let spec = ChunkSpec {
                    start,
                    end,
                    prompt_len: prompt,
                    prepopulated_len: 0,
                    is_last: end == prompt,
                    prefix_sent_early: false,
                };
                if self
                    .sender
                    .submit_chunk(now, r, spec, &mut FixedSource)
                    .is_ok()
                {
                    self.next_start.insert(r, end);
                    if spec.is_last {
                        self.last_submitted.insert(r);
                    }
                }
            }
            Op::SubmitAux { request: r } => {
                let r = request(r);
                let res = self.sender.handle_input(SenderInput::AuxSubmitted {
                    now,
                    request: r,
                    data: AuxData {
                        prompt_tokens: prompt_len(r),
                        cached_tokens: 0,
                        first_tokens: vec![7],
                        draft_tokens: vec![],
                    },
                });
                if res.is_ok() {
                    self.aux_submitted.insert(r);
                }
            }
            Op::DeliverNext { to_receiver } => self.deliver(to_receiver, 0),
            Op::DeliverAny { to_receiver, index } => self.deliver(to_receiver, index.into()),
            Op::Drop { to_receiver, index } => {
                let q = self.queue(to_receiver);
                if !q.is_empty() {
                    let i = usize::from(index) % q.len();
                    q.remove(i);
                }
            }
            Op::Duplicate { to_receiver, index } => {
                let q = self.queue(to_receiver);
                if !q.is_empty() {
                    let i = usize::from(index) % q.len();
                    let f = q[i].clone();
                    q.push_back(f);
                }
            }
            Op::CompleteWrite { index } => {
                if !self.pending.is_empty() {
                    let (batch, r) = self.pending.remove(usize::from(index) % self.pending.len());
                    let res = self
                        .sender
                        .handle_input(SenderInput::WritesCompleted { now, batch });
                    if res.is_ok() {
                        self.batches.entry(r).or_default().1 += 1;
                    }
                }
            }
            Op::FailWrite { index, status } => {
                if !self.pending.is_empty() {
                    let (batch, r) = self.pending.remove(usize::from(index) % self.pending.len());
                    let status = match status % 4 {
                        0 => TransferStatus::WriteFailed,
                        1 => TransferStatus::GrantViolation,
                        2 => TransferStatus::PeerLost,
                        _ => TransferStatus::InDoubt,
                    };
                    let res =
                        self.sender
                            .handle_input(SenderInput::WritesFailed { now, batch, status });
                    if res.is_ok() {
                        self.batches.entry(r).or_default().2 = true;
                    }
                }
            }
            Op::Advance { millis } => {
                self.now += Duration::from_millis(u64::from(millis % 1000));
            }
            Op::CancelSender { request: r } => {
                let r = request(r);
                if self.sender.cancel(now, r).is_ok() {
                    self.send_track.entry(r).or_default().no_writes = true;
                    self.cancelled.insert(r);
                }
            }
            Op::CancelReceiver { request: r } => {
                let _ = self.receiver.cancel(now, request(r));
            }
            Op::RetireSender { request: r } => {
                let r = request(r);
                if self.sender.retire(now, r).is_ok() {
                    let t = self.send_track.entry(r).or_default();
                    assert!(t.quiesced, "the sender retired {r} before Quiesced");
                    t.no_writes = true;
                }
            }
            Op::RetireReceiver { request: r } => {
                let r = request(r);
                if self.receiver.retire(now, r).is_ok() {
                    let t = self.recv_track.entry(r).or_default();
                    assert!(t.quiesced, "the receiver retired {r} before Quiesced");
                }
            }
            Op::Pump => {
                for _ in 0..64 {
                    if self.pending.is_empty()
                        && self.to_receiver.is_empty()
                        && self.to_sender.is_empty()
                    {
                        break;
                    }
                    for (batch, r) in std::mem::take(&mut self.pending) {
                        let res = self
                            .sender
                            .handle_input(SenderInput::WritesCompleted { now, batch });
                        if res.is_ok() {
                            self.batches.entry(r).or_default().1 += 1;
                        }
                        self.drain();
                    }
                    while !self.to_receiver.is_empty() || !self.to_sender.is_empty() {
                        self.deliver(true, 0);
                        self.deliver(false, 0);
                    }
                }
            }
            Op::Inject {
                to_receiver,
                request: r,
                mut frame,
            } => {
                let r = request(r);
                match &mut frame {
                    Frame::RecvRegistration(f) => f.request = r,
                    Frame::KvResult(f) => f.request = r,
                    Frame::AuxResult(f) => f.request = r,
                    Frame::Cancel(f) => f.request = r,
                    Frame::DataWrite(f) => f.request = r,
                    _ => {}
                }
                if self.connected {
                    self.queue(to_receiver).push_front(frame);
                    self.deliver(to_receiver, 0);
                }
            }
            Op::Disconnect => self.disconnect(),
            Op::Reconnect => self.reconnect(),
        }
        self.drain();
        self.tick();
    }
}

/// Encodes `frame` and decodes it again: every frame an endpoint emits must cross the wire
/// unchanged.
fn through_the_wire(frame: Frame) -> Frame {
    let mut buf = vec![0u8; frame.encoded_len()];
    let written = frame
        .emit(&mut buf)
        .unwrap_or_else(|e| panic!("an endpoint emitted {frame:?}, which does not encode: {e}"));
    let (decoded, used) = Frame::parse(&buf[..written])
        .unwrap_or_else(|e| panic!("{frame:?} does not decode after encoding: {e}"));
    assert_eq!(
        (&decoded, used),
        (&frame, written),
        "the wire changed a frame"
    );
    decoded
}

/// The request a session frame is about (`None` for connection frames and `Cancel`, which an
/// endpoint may send to refuse or confirm at any time).
fn session_frame_request(frame: &Frame) -> Option<RequestId> {
    match frame {
        Frame::RecvRegistration(r) => Some(r.request),
        Frame::KvResult(r) => Some(r.request),
        Frame::AuxResult(a) => Some(a.request),
        _ => None,
    }
}

fn event_request(e: &Event) -> Option<RequestId> {
    match e {
        Event::Registered { request, .. }
        | Event::Completed { request, .. }
        | Event::Failed { request, .. }
        | Event::TimedOut { request, .. }
        | Event::Cancelled { request, .. }
        | Event::Quiesced { request } => Some(*request),
        _ => None,
    }
}

impl Pair {
    /// Lets the network and transport catch up while twelve seconds pass (no engine input), then
    /// checks that nothing waits without a deadline: every registered request ended and
    /// quiesced on the receiver; every request opened on the sender whose last chunk was
    /// submitted, or that the engine cancelled, ended and quiesced there. (A sender session
    /// still waiting for its engine's chunks may wait: that wait is the engine's.)
    fn settle(&mut self) {
        for _ in 0..12 {
            self.apply(Op::Pump);
            self.apply(Op::Advance { millis: 999 });
        }
        self.apply(Op::Pump);
        for r in &self.registered {
            let t = self.recv_track.get(r).cloned().unwrap_or_default();
            assert!(
                t.terminal && t.quiesced,
                "receiver: {r} registered, still waiting after 12 s: {t:?}"
            );
        }
        for r in &self.opened {
            if self.last_submitted.contains(r) || self.cancelled.contains(r) {
                let t = self.send_track.get(r).cloned().unwrap_or_default();
                assert!(
                    t.terminal && t.quiesced,
                    "sender: {r} (last chunk or cancel given) still waiting after 12 s: {t:?}"
                );
            }
        }
    }
}

/// Runs `case` on a fresh pair, then lets it settle, panicking on the first broken rule.
pub fn run_case(case: &SessionCase) -> SessionStats {
    let mut pair = Pair::new();
    for op in &case.ops {
        pair.apply(op.clone());
    }
    pair.settle();
    pair.stats
}

/// The fuzz entry point: decodes a case from `data` and runs it.
pub fn check(data: &[u8]) {
    if let Ok(case) = SessionCase::arbitrary_take_rest(Unstructured::new(data)) {
        run_case(&case);
    }
}
