//! The `session` target: the endpoints' own input enums ([`SenderInput`], [`ReceiverInput`]
//! with [`TransportInput`]) applied to one connected sender/receiver pair, with the frames
//! between them carried by the seeded network emulation (`kvpipe_netem`: delayed, lost,
//! duplicated, reordered as the case's configuration says), and the sessions' safety rules
//! checked after every step.
//!
//! A case is a network configuration and a list of [`Step`]s. Most steps are real inputs
//! ([`Step::Sender`], [`Step::Receiver`]): arbitrary engine commands (open, chunk with arbitrary
//! block runs, a layer range of a chunk, aux, cancel, retire, register with arbitrary anchored runs), transport reports,
//! arbitrary frame bytes from a hostile peer, and arbitrary (decoded) data-write headers, which
//! go through [`Receiver::admit_write`]. The harness folds each into the case's small world before
//! applying it (the endpoints would refuse most raw values at once): `now` is the case's clock,
//! request ids fall into four, peers are the pair's, batch ids and write tickets name ones that
//! are pending, and connection reports reach both ends (the transport contract). A few steps
//! are conveniences that make progress likely: a well-formed chunk from a fixed block source (whole, or the next layer range of one),
//! a well-formed registration, a batch that lands through admission and completes, a
//! data-write header inside the request's grant, frames delivered as they fall due.
//!
//! Rules checked (a violation panics):
//!
//! - nothing panics (every input, however wrong — including arbitrary bytes from a hostile
//!   peer — is answered with a value or an error);
//! - a sender completes a request only after its last chunk (all its layer ranges) was submitted, every write batch of
//!   the request was reported complete (none failed), and its aux data was submitted;
//! - a receiver completes a request only after a successful last result and the aux data for it
//!   were delivered to it;
//! - no write batch is emitted for a request after it was cancelled, ended or retired;
//! - after `Quiesced`, an endpoint emits nothing more for the request (no write, no event, no
//!   result, aux or registration frame), and `Quiesced` comes once, after exactly one terminal
//!   event;
//! - admitted writes never overlap one still being applied, and always lie inside the request's
//!   `granted_extents`;
//! - nothing waits without a deadline: after the case, with the network and transport catching
//!   up and twelve seconds passing, every registered request ended and quiesced on the receiver,
//!   and every request whose last chunk was submitted (or that was cancelled) on the sender;
//! - replaying each endpoint's recorded inputs into a fresh endpoint gives the same outputs.

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use kvpipe_core::session::{
    Admission, DataWriteHeaders, Deadlines, Event, LocalHello, Output, Receiver, ReceiverConfig,
    ReceiverInput, Registration, SendRequest, Sender, SenderConfig, SenderInput, TransportInput,
    WriteBatchId, WriteTicket,
};
use kvpipe_core::wire::{AuxData, DataWrite, Frame, Topology, TransferStatus};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Duration, GroupIndex,
    InstanceId, Instant, LayerGroupLayout, LayerRange, PeerId, PoolLayout, RegionId, RequestId,
    WritePlan,
};
use kvpipe_netem::{Direction, FrameQueue, Link, LossModel, Netem, NetemConfig};

/// Tokens per block of the fixed layout.
const TPB: u32 = 4;
/// Bytes per block slot.
const SLOT: u64 = 128;
/// How the receiver names the sender.
const SENDER: PeerId = PeerId(0);
/// How the sender names the receiver.
const RECEIVER: PeerId = PeerId(1000);
/// Request ids the cases fold into.
const REQUESTS: u64 = 4;
/// The receiver's pool region.
const RECEIVER_REGION: RegionId = RegionId(2);

/// The network between the endpoints, as a case configures it (rates in 1/256).
#[derive(Arbitrary, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetemCase {
    /// Seed of the emulation.
    pub seed: u64,
    /// Frames lost for good.
    pub loss: u8,
    /// Frames delivered twice.
    pub duplicate: u8,
    /// Frames that overtake the one before them.
    pub reorder: u8,
    /// Frames held up to 50 ms.
    pub delay: u8,
}

impl NetemCase {
    fn config(self) -> NetemConfig {
        let p = |x: u8| f64::from(x) / 256.0;
        NetemConfig {
            seed: self.seed,
            loss: p(self.loss),
            loss_model: LossModel::Drop,
            duplicate: p(self.duplicate),
            reorder: p(self.reorder),
            delay: p(self.delay),
            delay_range: (Duration::ZERO, Duration::from_millis(50)),
            spare_handshake: true,
            ..NetemConfig::default()
        }
    }
}

/// One step of a case.
#[derive(Arbitrary, Clone, Debug)]
pub enum Step {
    /// An input to the sender, folded into the case (see the module doc).
    Sender(SenderInput),
    /// An input to the receiver, folded into the case; a `WriteArrived` goes through
    /// [`Receiver::admit_write`].
    Receiver(ReceiverInput),
    /// The prefill engine opens a request towards the receiver (a real [`SenderInput::Open`]).
    Open {
        /// Request (folded).
        request: u8,
        /// Two beams instead of one (pipelined transfer refuses it).
        several_beams: bool,
    },
    /// The prefill engine submits the next chunk of a request, its runs from a fixed block
    /// source (a real [`SenderInput::Chunk`]).
    Chunk {
        /// Request (folded).
        request: u8,
        /// Tokens in the chunk (0 is allowed).
        tokens: u8,
        /// Make it the last chunk (it then runs to the prompt's end).
        last: bool,
    },
    /// The prefill engine submits well-formed aux data (a real [`SenderInput::Aux`]).
    Aux {
        /// Request (folded).
        request: u8,
    },
    /// The decode engine registers a request with a well-formed destination.
    Register {
        /// Request (folded).
        request: u8,
        /// Prompt tokens the receiver has cached (modulo the prompt).
        cached: u8,
    },
    /// A pending write batch lands through the receiver's admission and is reported complete
    /// (as the in-process transport carries one out).
    LandBatch {
        /// Which (modulo the pending batches).
        index: u8,
    },
    /// A data-write header for a request, inside its grant unless `stray`, through
    /// [`Receiver::admit_write`].
    DataWrite {
        /// Request (folded).
        request: u8,
        /// Destination offset, in 16-byte units.
        offset: u16,
        /// Length, in 16-byte units.
        len: u8,
        /// Carry a wrong grant or aim outside the registered blocks.
        stray: bool,
    },
    /// Frames due by now are delivered (both ways).
    Deliver,
    /// A queued frame is delivered now, whatever its time.
    DeliverAny {
        /// Towards the receiver.
        to_receiver: bool,
        /// Which (modulo the queue).
        index: u8,
    },
    /// Time passes; due frames arrive and due timers fire.
    Advance {
        /// Milliseconds (modulo 1000).
        millis: u16,
    },
    /// The network and transport catch up: pending batches land, admitted writes finish, and
    /// queued frames are delivered, until nothing is left.
    Pump,
    /// A structured frame from a hostile peer (its request folded), encoded at the build's
    /// version and delivered at once.
    Frame {
        /// Towards the receiver.
        to_receiver: bool,
        /// Request the frame is about (for session frames).
        request: u8,
        /// The frame.
        frame: Frame,
    },
    /// The prefill engine submits the next layer range of a request's chunk (a real
    /// [`SenderInput::ChunkLayers`], the first range's runs from the fixed block source): the
    /// open chunk's next range, or the first range of a new chunk as [`Step::Chunk`] makes it.
    ChunkLayers {
        /// Request (folded).
        request: u8,
        /// Tokens in a new chunk (0 is allowed).
        tokens: u8,
        /// Make a new chunk the last (it then runs to the prompt's end).
        last: bool,
        /// Layers in the range (modulo the layers left, plus one).
        layers: u8,
    },
}

/// A whole fuzz case.
#[derive(Arbitrary, Clone, Debug)]
pub struct SessionCase {
    /// The network.
    pub netem: NetemCase,
    /// The steps, in order.
    pub steps: Vec<Step>,
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
    /// Data writes admitted.
    pub admitted: u64,
    /// Inputs an endpoint refused as a usage error.
    pub refused: u64,
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
        shard: Default::default(),
        pools: [PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 2,
            slot_bytes: SLOT,
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

fn sender_config() -> SenderConfig {
    let mut sc = SenderConfig::new(LocalHello::new(
        InstanceId(1),
        Topology::default(),
        layout(1),
    ));
    sc.deadlines = deadlines();
    sc
}

fn receiver_config() -> ReceiverConfig {
    let mut rc = ReceiverConfig::new(
        LocalHello::new(InstanceId(2), Topology::default(), layout(2)),
        7,
    );
    rc.deadlines = deadlines();
    rc
}

/// The prompt length of request `r` (fixed, so both engines agree).
fn prompt_len(r: RequestId) -> u32 {
    5 + 7 * r.0 as u32
}

/// Folds any request id into `1..=REQUESTS` (ids already there stay).
fn fold(r: RequestId) -> RequestId {
    RequestId(r.0.wrapping_sub(1) % REQUESTS + 1)
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

/// A write batch the sender asked for and nobody reported yet.
#[derive(Clone, Debug)]
struct PendingBatch {
    batch: WriteBatchId,
    request: RequestId,
    plan: WritePlan,
    headers: DataWriteHeaders,
}

/// A data write the receiver admitted and that is still being applied.
#[derive(Clone, Copy, Debug)]
struct Applying {
    ticket: WriteTicket,
    request: RequestId,
    region: RegionId,
    offset: u64,
    len: u64,
}

struct Pair {
    now: Instant,
    sender: Sender,
    receiver: Receiver,
    connected: bool,
    netem: Netem,
    link: Link,
    to_receiver: FrameQueue,
    to_sender: FrameQueue,
    pending: Vec<PendingBatch>,
    applying: Vec<Applying>,
    next_start: BTreeMap<RequestId, u32>,
    /// Per request, the chunk submitted in layer ranges whose last range has not come.
    open_chunk: BTreeMap<RequestId, ChunkSpec>,
    last_submitted: BTreeSet<RequestId>,
    /// Requests opened on the sender / registered on the receiver.
    opened: BTreeSet<RequestId>,
    registered: BTreeSet<RequestId>,
    /// Requests the sender engine cancelled.
    cancelled: BTreeSet<RequestId>,
    aux_submitted: BTreeSet<RequestId>,
    /// Per request: batches issued, completed, whether one failed.
    batches: BTreeMap<RequestId, (u64, u64, bool)>,
    /// (request) → delivered to the receiver: a successful last result, aux data.
    delivered_last: BTreeSet<RequestId>,
    delivered_aux: BTreeSet<RequestId>,
    send_track: BTreeMap<RequestId, Track>,
    recv_track: BTreeMap<RequestId, Track>,
    /// Every output of each endpoint, in order (for the replay check).
    sender_outputs: Vec<Output>,
    receiver_outputs: Vec<Output>,
    stats: SessionStats,
}

impl Pair {
    fn new(netem: NetemCase) -> Self {
        let mut sender = Sender::new(sender_config()).expect("a supported configuration");
        let mut receiver = Receiver::new(receiver_config()).expect("a supported configuration");
        sender.record_inputs(true);
        receiver.record_inputs(true);
        let mut netem = Netem::new(netem.config());
        let link = netem.link();
        let mut pair = Pair {
            now: Instant::from_millis(1),
            sender,
            receiver,
            connected: false,
            netem,
            link,
            to_receiver: FrameQueue::default(),
            to_sender: FrameQueue::default(),
            pending: Vec::new(),
            applying: Vec::new(),
            next_start: BTreeMap::new(),
            open_chunk: BTreeMap::new(),
            last_submitted: BTreeSet::new(),
            opened: BTreeSet::new(),
            registered: BTreeSet::new(),
            cancelled: BTreeSet::new(),
            aux_submitted: BTreeSet::new(),
            batches: BTreeMap::new(),
            delivered_last: BTreeSet::new(),
            delivered_aux: BTreeSet::new(),
            send_track: BTreeMap::new(),
            recv_track: BTreeMap::new(),
            sender_outputs: Vec::new(),
            receiver_outputs: Vec::new(),
            stats: SessionStats::default(),
        };
        pair.reconnect();
        // Finish the handshake (handshake frames are spared) so cases start ready.
        for _ in 0..4 {
            pair.deliver_due();
        }
        pair
    }

    fn reconnect(&mut self) {
        if self.connected {
            return;
        }
        self.connected = true;
        self.link.restart(self.now);
        let now = self.now;
        let input = |peer| TransportInput::PeerConnected { peer };
        let r = self.sender.handle_transport(now, input(RECEIVER));
        self.count(r);
        let r = self.receiver.handle_transport(now, input(SENDER));
        self.count(r);
        self.drain();
    }

    /// The connection is gone: both ends are told once nothing of it can touch memory (the
    /// pending batches fail, the admitted writes are given up).
    fn disconnect(&mut self) {
        if !self.connected {
            return;
        }
        self.connected = false;
        self.to_receiver.clear();
        self.to_sender.clear();
        let now = self.now;
        for a in std::mem::take(&mut self.applying) {
            let input = TransportInput::WriteFinished {
                ticket: a.ticket,
                landed: false,
            };
            let r = self.receiver.handle_transport(now, input);
            self.count(r);
        }
        for b in std::mem::take(&mut self.pending) {
            self.report_batch(b, Some(TransferStatus::PeerLost));
        }
        let input = |peer| TransportInput::PeerDisconnected { peer };
        let r = self.sender.handle_transport(now, input(RECEIVER));
        self.count(r);
        let r = self.receiver.handle_transport(now, input(SENDER));
        self.count(r);
        self.drain();
    }

    fn count<E>(&mut self, res: Result<(), E>) {
        self.stats.refused += u64::from(res.is_err());
    }

    /// Delivers one frame's bytes.
    fn deliver(&mut self, to_receiver: bool, bytes: Bytes) {
        let now = self.now;
        if to_receiver {
            match Frame::parse(&bytes) {
                Ok((Frame::KvResult(r), _)) if r.is_last && r.status == TransferStatus::Success => {
                    self.delivered_last.insert(r.request);
                }
                Ok((Frame::AuxResult(a), _)) if a.status == TransferStatus::Success => {
                    self.delivered_aux.insert(a.request);
                }
                _ => {}
            }
            let input = TransportInput::FrameReceived {
                peer: SENDER,
                bytes,
            };
            let r = self.receiver.handle_transport(now, input);
            self.count(r);
        } else {
            let input = TransportInput::FrameReceived {
                peer: RECEIVER,
                bytes,
            };
            let r = self.sender.handle_transport(now, input);
            self.count(r);
        }
        self.drain();
    }

    /// Delivers every frame due by now, both ways, until none is left.
    fn deliver_due(&mut self) {
        loop {
            let now = self.now;
            if let Some(b) = self.to_receiver.pop_due(now) {
                self.deliver(true, b);
            } else if let Some(b) = self.to_sender.pop_due(now) {
                self.deliver(false, b);
            } else {
                return;
            }
        }
    }

    fn tick(&mut self) {
        let now = self.now;
        if self.sender.poll_timeout().is_some_and(|at| at <= now) {
            let r = self.sender.handle_transport(now, TransportInput::Timeout);
            self.count(r);
        }
        if self.receiver.poll_timeout().is_some_and(|at| at <= now) {
            let r = self.receiver.handle_transport(now, TransportInput::Timeout);
            self.count(r);
        }
        self.drain();
    }

    /// Drains both endpoints, checking every output against the rules.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            while let Some(o) = self.sender.poll_output() {
                any = true;
                self.sender_outputs.push(o.clone());
                self.on_sender_output(o);
            }
            while let Some(o) = self.receiver.poll_output() {
                any = true;
                self.receiver_outputs.push(o.clone());
                self.on_receiver_output(o);
            }
            if !any {
                return;
            }
        }
    }

    /// Hands a transmitted frame to the network emulation.
    fn transmit(&mut self, to_receiver: bool, bytes: Bytes) {
        if !self.connected {
            return;
        }
        let direction = if to_receiver {
            Direction::ToReceiver
        } else {
            Direction::ToSender
        };
        let fate = self.netem.frame(self.now, &mut self.link, direction, bytes);
        if to_receiver {
            self.to_receiver.push(fate);
        } else {
            self.to_sender.push(fate);
        }
    }

    fn on_sender_output(&mut self, o: Output) {
        match o {
            Output::Transmit { peer, frame, bytes } => {
                assert_eq!(peer, RECEIVER, "sender transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.send_track.entry(r).or_default();
                    assert!(!t.quiesced, "sender sent {frame:?} after Quiesced");
                }
                self.transmit(true, bytes);
            }
            Output::ExecuteWrites {
                batch,
                request,
                plan,
                headers,
                ..
            } => {
                let t = self.send_track.entry(request).or_default();
                assert!(
                    !t.no_writes && !t.quiesced,
                    "write {batch} emitted for {request}, which was cancelled, ended or retired"
                );
                self.batches.entry(request).or_default().0 += 1;
                self.stats.batches += 1;
                self.pending.push(PendingBatch {
                    batch,
                    request,
                    plan,
                    headers,
                });
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
                            issued == done && !failed,
                            "sender completed {r} with {issued} batches issued, {done} complete, \
                             failed {failed}"
                        );
                        assert!(
                            self.aux_submitted.contains(&r),
                            "sender completed {r} before its aux data was submitted"
                        );
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
            Output::Transmit { peer, frame, bytes } => {
                assert_eq!(peer, SENDER, "receiver transmits to an unknown peer");
                if let Some(r) = session_frame_request(&frame) {
                    let t = self.recv_track.entry(r).or_default();
                    assert!(!t.quiesced, "receiver sent {frame:?} after Quiesced");
                }
                self.transmit(false, bytes);
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
                        assert!(
                            !self.applying_for(r),
                            "receiver quiesced {r} with a write still being applied"
                        );
                        self.recv_track.entry(r).or_default().quiesced = true;
                    }
                    _ => {}
                }
            }
        }
    }

    /// Whether a write of `request` is still being applied.
    fn applying_for(&self, request: RequestId) -> bool {
        self.applying.iter().any(|a| a.request == request)
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

    /// Asks the receiver to admit a data write; checks and remembers an admitted one.
    fn admit(&mut self, header: &DataWrite) -> Admission {
        let request = header.request;
        let admission = self.receiver.admit_write(self.now, SENDER, header);
        if let Admission::Apply {
            ticket,
            region,
            offset,
            len,
        } = admission
        {
            let grant = self
                .receiver
                .granted_extents(request)
                .expect("an admitted write's request has a grant");
            assert!(
                grant.contains(region, offset, len),
                "admitted {region} [{offset}, +{len}) outside {request}'s grant"
            );
            for a in &self.applying {
                assert!(
                    a.region != region || a.offset + a.len <= offset || offset + len <= a.offset,
                    "admitted {region} [{offset}, +{len}) overlaps {a:?} still being applied"
                );
            }
            self.applying.push(Applying {
                ticket,
                request,
                region,
                offset,
                len,
            });
            self.stats.admitted += 1;
        }
        self.drain();
        admission
    }

    /// Reports an admitted write finished.
    fn finish(&mut self, ticket: WriteTicket, landed: bool) {
        self.applying.retain(|a| a.ticket != ticket);
        let r = self
            .receiver
            .handle_transport(self.now, TransportInput::WriteFinished { ticket, landed });
        self.count(r);
        self.drain();
    }

    /// Reports a batch to the sender (completed, or failed with `status`).
    fn report_batch(&mut self, b: PendingBatch, status: Option<TransferStatus>) {
        let input = match status {
            None => TransportInput::WritesCompleted { batch: b.batch },
            Some(status) => TransportInput::WritesFailed {
                batch: b.batch,
                status,
            },
        };
        let res = self.sender.handle_transport(self.now, input);
        if res.is_ok() {
            let e = self.batches.entry(b.request).or_default();
            match status {
                None => e.1 += 1,
                Some(_) => e.2 = true,
            }
        }
        self.count(res);
        self.drain();
    }

    /// Carries a pending batch out as the in-process transport would: every extent through
    /// admission, applied, reported landed; then the batch is reported complete (or failed if
    /// a write was refused).
    fn land_batch(&mut self, index: usize) {
        if self.pending.is_empty() {
            return;
        }
        let b = self.pending.remove(index % self.pending.len());
        let mut refused = false;
        for e in b.plan.extents() {
            let header = b.headers.frame(e.dst_region, e.dst_offset, e.len);
            match self.admit(&header) {
                Admission::Apply { ticket, .. } => self.finish(ticket, true),
                Admission::Discard { .. } => {}
                Admission::Refuse(_) => {
                    refused = true;
                    break;
                }
            }
        }
        let status = refused.then_some(TransferStatus::GrantViolation);
        self.report_batch(b, status);
    }

    fn apply(&mut self, step: Step) {
        let now = self.now;
        match step {
            Step::Sender(input) => self.sender_input(input),
            Step::Receiver(input) => self.receiver_input(input),
            Step::Chunk {
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
                let res = self.sender.submit_chunk(now, r, spec, &mut FixedSource);
                if res.is_ok() {
                    self.next_start.insert(r, end);
                    if spec.is_last {
                        self.last_submitted.insert(r);
                    }
                }
                self.count(res.map(|_| ()));
            }
            Step::ChunkLayers {
                request: r,
                tokens,
                last,
                layers,
            } => {
                let r = request(r);
                let count = self.sender.layer_count();
                let (spec, begin) = match (self.open_chunk.get(&r), self.sender.next_chunk_layer(r))
                {
                    (Some(spec), Some(next)) => (*spec, next),
                    _ => {
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
                        (spec, 0)
                    }
                };
                let end =
                    (begin + 1 + u32::from(layers) % count.saturating_sub(begin).max(1)).min(count);
                let range = LayerRange::new(begin, end);
                let res = self
                    .sender
                    .submit_chunk_layers(now, r, spec, range, &mut FixedSource);
                if res.is_ok() {
                    self.next_start.insert(r, spec.end);
                    if end == count {
                        self.open_chunk.remove(&r);
                        if spec.is_last {
                            self.last_submitted.insert(r);
                        }
                    } else {
                        self.open_chunk.insert(r, spec);
                    }
                }
                self.count(res.map(|_| ()));
            }
            Step::Open {
                request: r,
                several_beams,
            } => self.sender_input(SenderInput::Open {
                now,
                request: SendRequest {
                    request: request(r),
                    receivers: [RECEIVER].into_iter().collect(),
                    beam_width: if several_beams { 2 } else { 1 },
                },
            }),
            Step::Aux { request: r } => self.sender_input(SenderInput::Aux {
                now,
                request: request(r),
                data: aux_data(request(r)),
            }),
            Step::Register { request: r, cached } => {
                let r = request(r);
                let prompt = prompt_len(r);
                let blocks = prompt.div_ceil(TPB);
                let first = (u32::from(cached) % (prompt + 1)) / TPB;
                let ids: Vec<BlockId> = (first..blocks)
                    .map(|o| BlockId(20 * r.0 as u32 + o))
                    .collect();
                let registration = Registration {
                    request: r,
                    prompt_len: prompt,
                    groups: vec![AnchoredRun::from_ids(first, &ids)],
                    writers: [SENDER].into_iter().collect(),
                    aux_capacity: 256,
                    expected_part: None,
                };
                self.receiver_input(ReceiverInput::Register { now, registration });
            }
            Step::LandBatch { index } => self.land_batch(index.into()),
            Step::DataWrite {
                request: r,
                offset,
                len,
                stray,
            } => {
                let r = request(r);
                let grant = self.receiver.grant(r).unwrap_or_default();
                let base = 20 * r.0 * SLOT;
                let write = DataWrite {
                    request: r,
                    grant: if stray {
                        kvpipe_core::GrantId(grant.0 ^ 1)
                    } else {
                        grant
                    },
                    region: RECEIVER_REGION,
                    offset: base + 16 * u64::from(offset % 64),
                    len: 16 * u64::from(len % 16 + 1),
                };
                let _ = self.admit(&write);
            }
            Step::Deliver => self.deliver_due(),
            Step::DeliverAny { to_receiver, index } => {
                let q = if to_receiver {
                    &mut self.to_receiver
                } else {
                    &mut self.to_sender
                };
                if let Some(bytes) = q.take(index.into()) {
                    self.deliver(to_receiver, bytes);
                }
            }
            Step::Advance { millis } => {
                self.now += Duration::from_millis(u64::from(millis % 1000));
                self.deliver_due();
            }
            Step::Pump => self.pump(),
            Step::Frame {
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
                    if let Ok(bytes) = frame.to_vec() {
                        self.deliver(to_receiver, Bytes::from(bytes));
                    }
                }
            }
        }
        self.drain();
        self.tick();
    }

    /// Folds a sender input into the case (see the module doc) and applies it.
    fn sender_input(&mut self, input: SenderInput) {
        let now = self.now;
        let input = match input {
            SenderInput::Transport { input, .. } => return self.sender_transport(input),
            SenderInput::Open { mut request, .. } => {
                request.request = fold(request.request);
                request.receivers = [RECEIVER].into_iter().collect();
                SenderInput::Open { now, request }
            }
            SenderInput::Chunk {
                request,
                spec,
                runs,
                ..
            } => SenderInput::Chunk {
                now,
                request: fold(request),
                spec,
                runs,
            },
            SenderInput::ChunkLayers {
                request,
                spec,
                layers,
                runs,
                ..
            } => SenderInput::ChunkLayers {
                now,
                request: fold(request),
                spec,
                layers,
                runs,
            },
            SenderInput::Prefix {
                request,
                prompt_len,
                prepopulated_len,
                runs,
                ..
            } => SenderInput::Prefix {
                now,
                request: fold(request),
                prompt_len,
                prepopulated_len,
                runs,
            },
            SenderInput::Aux { request, data, .. } => SenderInput::Aux {
                now,
                request: fold(request),
                data,
            },
            SenderInput::Cancel { request, .. } => SenderInput::Cancel {
                now,
                request: fold(request),
            },
            SenderInput::Retire { request, .. } => SenderInput::Retire {
                now,
                request: fold(request),
            },
        };
        let res = self.sender.handle_input(input.clone());
        if res.is_ok() {
            match input {
                SenderInput::Open { request, .. } => {
                    self.opened.insert(request.request);
                }
                SenderInput::Chunk { request, spec, .. } if spec.is_last => {
                    self.last_submitted.insert(request);
                }
                SenderInput::ChunkLayers {
                    request,
                    spec,
                    layers,
                    ..
                } if spec.is_last && layers.end == self.sender.layer_count() => {
                    self.last_submitted.insert(request);
                }
                SenderInput::Aux { request, .. } => {
                    self.aux_submitted.insert(request);
                }
                SenderInput::Cancel { request, .. } => {
                    self.send_track.entry(request).or_default().no_writes = true;
                    self.cancelled.insert(request);
                }
                SenderInput::Retire { request, .. } => {
                    let t = self.send_track.entry(request).or_default();
                    assert!(t.quiesced, "the sender retired {request} before Quiesced");
                    t.no_writes = true;
                }
                _ => {}
            }
        }
        self.count(res);
    }

    fn sender_transport(&mut self, input: TransportInput) {
        let now = self.now;
        match input {
            TransportInput::PeerConnected { .. } => self.reconnect(),
            TransportInput::PeerDisconnected { .. } => self.disconnect(),
            TransportInput::FrameReceived { bytes, .. } => {
                if self.connected {
                    self.deliver(false, bytes);
                }
            }
            TransportInput::WritesCompleted { batch }
            | TransportInput::WritesFailed { batch, .. }
                if !self.pending.is_empty() =>
            {
                // A report for a pending batch (the bytes are lost: nothing landed).
                let b = self.pending.remove(batch.0 as usize % self.pending.len());
                let status = match input {
                    TransportInput::WritesFailed { status, .. } => Some(status),
                    _ => None,
                };
                self.report_batch(b, status);
            }
            TransportInput::WriteArrived { header, .. } => {
                let a = self.sender.admit_write(now, RECEIVER, &header);
                assert!(
                    matches!(a, Admission::Refuse(_)),
                    "a sender admitted a data write: {a:?}"
                );
            }
            other => {
                let r = self.sender.handle_transport(now, other);
                self.count(r);
            }
        }
    }

    /// Folds a receiver input into the case (see the module doc) and applies it.
    fn receiver_input(&mut self, input: ReceiverInput) {
        let now = self.now;
        let input = match input {
            ReceiverInput::Transport { input, .. } => return self.receiver_transport(input),
            ReceiverInput::Register {
                mut registration, ..
            } => {
                registration.request = fold(registration.request);
                registration.writers = [SENDER].into_iter().collect();
                ReceiverInput::Register { now, registration }
            }
            ReceiverInput::Cancel { request, .. } => ReceiverInput::Cancel {
                now,
                request: fold(request),
            },
            ReceiverInput::Retire { request, .. } => ReceiverInput::Retire {
                now,
                request: fold(request),
            },
        };
        let res = self.receiver.handle_input(input.clone());
        if res.is_ok() {
            match input {
                ReceiverInput::Register { registration, .. } => {
                    self.registered.insert(registration.request);
                }
                ReceiverInput::Retire { request, .. } => {
                    let t = self.recv_track.entry(request).or_default();
                    assert!(t.quiesced, "the receiver retired {request} before Quiesced");
                    assert!(
                        !self.applying_for(request),
                        "the receiver retired {request} with a write still being applied"
                    );
                }
                _ => {}
            }
        }
        self.count(res);
    }

    fn receiver_transport(&mut self, input: TransportInput) {
        let now = self.now;
        match input {
            TransportInput::PeerConnected { .. } => self.reconnect(),
            TransportInput::PeerDisconnected { .. } => self.disconnect(),
            TransportInput::FrameReceived { bytes, .. } => {
                if self.connected {
                    self.deliver(true, bytes);
                }
            }
            TransportInput::WriteArrived { mut header, .. } => {
                if self.connected {
                    // An arbitrary header, its request folded into the case's few.
                    header.request = fold(header.request);
                    let _ = self.admit(&header);
                }
            }
            TransportInput::WriteFinished { ticket, landed } if !self.applying.is_empty() => {
                let i = ticket.0 as usize % self.applying.len();
                let ticket = self.applying[i].ticket;
                self.finish(ticket, landed);
            }
            other => {
                let r = self.receiver.handle_transport(now, other);
                self.count(r);
            }
        }
    }

    /// The network and transport catch up: batches land, writes finish, frames arrive.
    fn pump(&mut self) {
        for _ in 0..64 {
            if self.pending.is_empty()
                && self.applying.is_empty()
                && self.to_receiver.is_empty()
                && self.to_sender.is_empty()
            {
                break;
            }
            for a in std::mem::take(&mut self.applying) {
                self.finish(a.ticket, true);
            }
            while !self.pending.is_empty() {
                self.land_batch(0);
            }
            while let Some(b) = self.to_receiver.take(0) {
                self.deliver(true, b);
            }
            while let Some(b) = self.to_sender.take(0) {
                self.deliver(false, b);
            }
        }
    }

    /// Lets the network and transport catch up while twelve seconds pass (no engine input), then
    /// checks that nothing waits without a deadline: every registered request ended and
    /// quiesced on the receiver; every request opened on the sender whose last chunk was
    /// submitted, or that the engine cancelled, ended and quiesced there. (A sender session
    /// still waiting for its engine's chunks may wait: that wait is the engine's.)
    fn settle(&mut self) {
        for _ in 0..12 {
            self.apply(Step::Pump);
            self.apply(Step::Advance { millis: 999 });
        }
        self.apply(Step::Pump);
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

    /// Replays each endpoint's recorded inputs into a fresh one: the outputs are the same.
    fn check_replay(&mut self) {
        let mut sender = Sender::new(sender_config()).expect("a supported configuration");
        let mut outputs = Vec::new();
        for input in self.sender.take_recorded_inputs() {
            sender
                .handle_input(input.clone())
                .unwrap_or_else(|e| panic!("the replayed sender refused {input:?}: {e}"));
            outputs.extend(std::iter::from_fn(|| sender.poll_output()));
        }
        assert!(
            outputs == self.sender_outputs,
            "the replayed sender's outputs differ"
        );
        let mut receiver = Receiver::new(receiver_config()).expect("a supported configuration");
        let mut outputs = Vec::new();
        for input in self.receiver.take_recorded_inputs() {
            receiver
                .handle_input(input.clone())
                .unwrap_or_else(|e| panic!("the replayed receiver refused {input:?}: {e}"));
            outputs.extend(std::iter::from_fn(|| receiver.poll_output()));
        }
        assert!(
            outputs == self.receiver_outputs,
            "the replayed receiver's outputs differ"
        );
    }
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

/// Runs `case` on a fresh pair, lets it settle and replays it, panicking on the first broken
/// rule.
pub fn run_case(case: &SessionCase) -> SessionStats {
    let mut pair = Pair::new(case.netem);
    for step in &case.steps {
        pair.apply(step.clone());
    }
    pair.settle();
    pair.check_replay();
    pair.stats
}

/// The fuzz entry point: decodes a case from `data` and runs it.
pub fn check(data: &[u8]) {
    if let Ok(case) = SessionCase::arbitrary_take_rest(Unstructured::new(data)) {
        run_case(&case);
    }
}

/// A well-formed aux data for request `r`.
fn aux_data(r: RequestId) -> AuxData {
    AuxData {
        prompt_tokens: prompt_len(r),
        cached_tokens: 0,
        first_tokens: vec![7],
        draft_tokens: vec![],
    }
}
