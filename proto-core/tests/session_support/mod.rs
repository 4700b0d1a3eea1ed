//! Test support for the session tests: a tiny block source, a small layout, and `Net`, which
//! connects senders and receivers in memory (Transmit outputs are delivered to the other side;
//! write batches complete at once or are held for the test to report).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};

use kvpipe_core::session::{
    Admission, DataWriteHeaders, Deadlines, Event, LocalHello, Output, Receiver, ReceiverConfig,
    ReceiverInput, Registration, SendRequest, Sender, SenderConfig, SenderInput, TransportInput,
    WriteBatchId, WriteTicket,
};
use kvpipe_core::wire::{Frame, Topology};
use kvpipe_core::WritePlan;
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, GroupIndex,
    InstanceId, LayerGroupLayout, PeerId, PoolLayout, RegionId, RequestId, SenderSliceId,
};
use kvpipe_core::{Duration, Instant};
use smallvec::smallvec;

pub const TPB: u32 = 4;

/// One full-attention group: 2 layers, K/V, 1 head of 4 elements of 2 bytes: 64 bytes per layer
/// per block, 128-byte slots in one pool.
pub fn layout(region: u32) -> Vec<LayerGroupLayout> {
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
        pools: smallvec![PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 2,
            slot_bytes: 128,
        }],
    }]
}

pub const BLOCK_BYTES: u64 = 128;

pub fn deadlines() -> Deadlines {
    Deadlines {
        handshake: Duration::from_millis(100),
        registration: Duration::from_millis(1_000),
        write_completion: Duration::from_millis(200),
        result_wait: Duration::from_millis(5_000),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_millis(5_000),
        aux_wait: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(50),
        liveness_timeout: Duration::from_millis(400),
        quiesce: Duration::from_millis(150),
    }
}

pub fn sender_config(i: usize) -> SenderConfig {
    let mut c = SenderConfig::new(LocalHello::new(
        InstanceId(10 + i as u64),
        Topology::default(),
        layout(1),
    ));
    c.deadlines = deadlines();
    c
}

pub fn receiver_config(j: usize) -> ReceiverConfig {
    let mut c = ReceiverConfig::new(
        LocalHello::new(InstanceId(20 + j as u64), Topology::default(), layout(2)),
        0x5eed + j as u64,
    );
    c.deadlines = deadlines();
    c
}

/// A block source over a fixed allocation per request: ordinal `o` lives in slot `base + o`.
/// Records every query so tests can check the queries stay bounded.
#[derive(Default)]
pub struct TestSource {
    pub allocations: BTreeMap<RequestId, (u32, u32)>,
    pub queries: Vec<(RequestId, GroupIndex, u32, u32)>,
}

impl TestSource {
    pub fn with(request: RequestId, base: u32, blocks: u32) -> Self {
        let mut s = TestSource::default();
        s.allocations.insert(request, (base, blocks));
        s
    }
}

impl BlockSource for TestSource {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        self.queries.push((request, group, begin, end));
        let &(base, blocks) = self
            .allocations
            .get(&request)
            .ok_or(BlockSourceError::UnknownRequest(request))?;
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
        out.ids = (begin..end).map(|o| BlockId(base + o)).collect();
        Ok(())
    }
}

/// How sender `i` names receiver `j`.
pub fn rx_peer(j: usize) -> PeerId {
    PeerId(1000 + j as u32)
}

/// How receiver `j` names sender `i`.
pub fn tx_peer(i: usize) -> PeerId {
    PeerId(i as u32)
}

pub fn chunk(start: u32, end: u32, prompt_len: u32, is_last: bool) -> ChunkSpec {
    ChunkSpec {
        start,
        end,
        prompt_len,
        prepopulated_len: 0,
        is_last,
        prefix_sent_early: false,
    }
}

/// A registration of the whole prompt into destination blocks 500, 501, …
pub fn registration(request: RequestId, prompt_len: u32, writers: &[usize]) -> Registration {
    registration_from(request, prompt_len, writers, 500)
}

/// A registration of the whole prompt into destination blocks `first`, `first + 1`, … (two
/// live requests need blocks of their own).
pub fn registration_from(
    request: RequestId,
    prompt_len: u32,
    writers: &[usize],
    first: u32,
) -> Registration {
    let blocks = prompt_len.div_ceil(TPB);
    Registration {
        request,
        prompt_len,
        groups: vec![AnchoredRun::from_ids(
            0,
            &(0..blocks).map(|o| BlockId(first + o)).collect::<Vec<_>>(),
        )],
        writers: writers.iter().map(|&i| tx_peer(i)).collect(),
        aux_capacity: 1024,
        expected_part: None,
    }
}

pub fn send_request(request: RequestId, receivers: &[usize]) -> SendRequest {
    SendRequest::new(request, receivers.iter().map(|&j| rx_peer(j)))
}

/// Where an output came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Sender(usize),
    Receiver(usize),
}

/// A write batch the test holds instead of completing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub sender: usize,
    pub receiver: usize,
    pub batch: WriteBatchId,
    pub request: RequestId,
    pub slice: SenderSliceId,
    pub bytes: u64,
    pub plan: WritePlan,
    pub headers: DataWriteHeaders,
}

/// Senders and receivers connected in memory.
pub struct Net {
    pub now: Instant,
    pub senders: Vec<Sender>,
    pub receivers: Vec<Receiver>,
    /// Complete every write batch as soon as it is issued.
    pub auto_complete: bool,
    pub held: Vec<Held>,
    /// Every output, in the order drained.
    pub log: Vec<(Side, Output)>,
    pub connected: BTreeSet<(usize, usize)>,
    /// Links (sender, receiver) whose frames are dropped (both ways).
    pub cut: BTreeSet<(usize, usize)>,
    /// Links (sender, receiver) whose sender → receiver frames are dropped (as if queued behind
    /// a payload that takes long); the receiver's still reach the sender.
    pub stalled: BTreeSet<(usize, usize)>,
}

impl Net {
    pub fn new(senders: usize, receivers: usize) -> Self {
        Net::new_with(senders, receivers, true)
    }

    /// [`Net::new`] whose endpoints run with `peer_ids_reused` as given: `false` as over TCP
    /// or verbs, where a departed peer's id never comes back.
    pub fn new_with(senders: usize, receivers: usize, peer_ids_reused: bool) -> Self {
        Net {
            now: Instant::from_millis(1),
            senders: (0..senders)
                .map(|i| {
                    let mut c = sender_config(i);
                    c.peer_ids_reused = peer_ids_reused;
                    Sender::new(c).unwrap()
                })
                .collect(),
            receivers: (0..receivers)
                .map(|j| {
                    let mut c = receiver_config(j);
                    c.peer_ids_reused = peer_ids_reused;
                    Receiver::new(c).unwrap()
                })
                .collect(),
            auto_complete: true,
            held: Vec::new(),
            log: Vec::new(),
            connected: BTreeSet::new(),
            cut: BTreeSet::new(),
            stalled: BTreeSet::new(),
        }
    }

    /// `writers` tensor-parallel sender ranks, each holding one of the model's `writers` KV
    /// heads, and one receiver holding them all, connected: each writer writes its head of
    /// every block (the receiver's slots are `writers` times the senders').
    pub fn tensor_parallel(writers: usize) -> Self {
        let mut net = Net::tensor_parallel_unconnected(writers);
        for i in 0..writers {
            net.connect(i, 0);
        }
        net.pump();
        net
    }

    /// [`Net::tensor_parallel`]'s ranks before any of them connected.
    pub fn tensor_parallel_unconnected(writers: usize) -> Self {
        Net::tensor_parallel_unconnected_with(writers, true)
    }

    /// [`Net::tensor_parallel_unconnected`] with `peer_ids_reused` as given (see
    /// [`Net::new_with`]).
    pub fn tensor_parallel_unconnected_with(writers: usize, peer_ids_reused: bool) -> Self {
        let mut net = Net::new(writers, 1);
        let heads = writers as u16;
        for (i, sender) in net.senders.iter_mut().enumerate() {
            let mut groups = layout(1);
            groups[0].shard.model_kv_heads = heads;
            groups[0].shard.first_head = i as u16;
            let topology = Topology {
                tp_size: heads,
                tp_rank: i as u16,
                pp_size: 1,
                pp_rank: 0,
                layer_begin: 0,
                layer_end: 2,
            };
            let mut c =
                SenderConfig::new(LocalHello::new(InstanceId(10 + i as u64), topology, groups));
            c.deadlines = deadlines();
            c.peer_ids_reused = peer_ids_reused;
            *sender = Sender::new(c).unwrap();
        }
        let mut groups = layout(2);
        groups[0].kv_heads = heads;
        groups[0].shard.model_kv_heads = heads;
        groups[0].pools[0].slot_bytes *= u64::from(heads);
        let mut c = ReceiverConfig::new(
            LocalHello::new(InstanceId(20), Topology::default(), groups),
            0x5eed,
        );
        c.deadlines = deadlines();
        c.peer_ids_reused = peer_ids_reused;
        net.receivers[0] = Receiver::new(c).unwrap();
        net
    }

    /// A network with every sender connected to every receiver, handshakes done.
    pub fn connected(senders: usize, receivers: usize) -> Self {
        let mut net = Net::new(senders, receivers);
        for i in 0..senders {
            for j in 0..receivers {
                net.connect(i, j);
            }
        }
        net.pump();
        net
    }

    pub fn connect(&mut self, i: usize, j: usize) {
        let now = self.now;
        self.connected.insert((i, j));
        self.senders[i]
            .handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerConnected { peer: rx_peer(j) },
            })
            .unwrap();
        self.receivers[j]
            .handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerConnected { peer: tx_peer(i) },
            })
            .unwrap();
    }

    /// Connects sender `i` and receiver `j`, the sender offering `offer` as a transport's data
    /// path.
    pub fn connect_offering(&mut self, i: usize, j: usize, offer: &'static [u8]) {
        let now = self.now;
        self.connected.insert((i, j));
        self.senders[i]
            .handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerConnectedWithOffer {
                    peer: rx_peer(j),
                    offer: bytes::Bytes::from_static(offer),
                },
            })
            .unwrap();
        self.receivers[j]
            .handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerConnected { peer: tx_peer(i) },
            })
            .unwrap();
    }

    pub fn disconnect(&mut self, i: usize, j: usize) {
        if !self.connected.remove(&(i, j)) {
            return;
        }
        let now = self.now;
        self.senders[i]
            .handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerDisconnected { peer: rx_peer(j) },
            })
            .unwrap();
        self.receivers[j]
            .handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerDisconnected { peer: tx_peer(i) },
            })
            .unwrap();
    }

    /// Drains every endpoint until none has output left.
    pub fn pump(&mut self) {
        for _ in 0..10_000 {
            let mut progress = false;
            for i in 0..self.senders.len() {
                while let Some(o) = self.senders[i].poll_output() {
                    progress = true;
                    self.log.push((Side::Sender(i), o.clone()));
                    self.route_sender(i, o);
                }
            }
            for j in 0..self.receivers.len() {
                while let Some(o) = self.receivers[j].poll_output() {
                    progress = true;
                    self.log.push((Side::Receiver(j), o.clone()));
                    self.route_receiver(j, o);
                }
            }
            if !progress {
                return;
            }
        }
        panic!("livelock: outputs never ran dry");
    }

    fn route_sender(&mut self, i: usize, o: Output) {
        let now = self.now;
        match o {
            Output::Transmit { peer, bytes, .. } => {
                let j = (peer.0 - 1000) as usize;
                if self.connected.contains(&(i, j))
                    && !self.cut.contains(&(i, j))
                    && !self.stalled.contains(&(i, j))
                {
                    self.receivers[j]
                        .handle_input(ReceiverInput::Transport {
                            now,
                            input: TransportInput::FrameReceived {
                                peer: tx_peer(i),
                                bytes,
                            },
                        })
                        .unwrap();
                }
            }
            Output::ExecuteWrites {
                peer,
                batch,
                request,
                slice,
                plan,
                headers,
                ..
            } => {
                let j = (peer.0 - 1000) as usize;
                if self.auto_complete {
                    self.land(i, j, &plan, &headers);
                    self.senders[i]
                        .handle_input(SenderInput::Transport {
                            now,
                            input: TransportInput::WritesCompleted { batch },
                        })
                        .unwrap();
                } else {
                    self.held.push(Held {
                        sender: i,
                        receiver: j,
                        batch,
                        request,
                        slice,
                        bytes: plan.total_bytes(),
                        plan,
                        headers,
                    });
                }
            }
            Output::ClosePeer { peer, .. } => {
                let j = (peer.0 - 1000) as usize;
                self.disconnect(i, j);
            }
            // The tests answer offers themselves (`session_data_path.rs`).
            Output::Event(_) | Output::DataPath(_) => {}
        }
    }

    fn route_receiver(&mut self, j: usize, o: Output) {
        let now = self.now;
        match o {
            Output::Transmit { peer, bytes, .. } => {
                let i = peer.0 as usize;
                if self.connected.contains(&(i, j)) && !self.cut.contains(&(i, j)) {
                    self.senders[i]
                        .handle_input(SenderInput::Transport {
                            now,
                            input: TransportInput::FrameReceived {
                                peer: rx_peer(j),
                                bytes,
                            },
                        })
                        .unwrap();
                }
            }
            Output::ClosePeer { peer, .. } => self.disconnect(peer.0 as usize, j),
            Output::ExecuteWrites { .. } => panic!("a receiver never executes writes"),
            Output::Event(_) | Output::DataPath(_) => {}
        }
    }

    /// Reports admitted write `ticket` of receiver `j` landed, now.
    pub fn write_landed(&mut self, j: usize, ticket: WriteTicket) {
        let now = self.now;
        self.receivers[j]
            .handle_transport(
                now,
                TransportInput::WriteFinished {
                    ticket,
                    landed: true,
                },
            )
            .unwrap();
    }

    /// Carries a plan's writes into receiver `j` as a stream transport would: each extent is
    /// admitted by the receiver, "copied", and reported landed. Returns the admissions.
    pub fn land(
        &mut self,
        i: usize,
        j: usize,
        plan: &WritePlan,
        headers: &DataWriteHeaders,
    ) -> Vec<Admission> {
        let now = self.now;
        let mut out = Vec::new();
        if !self.connected.contains(&(i, j)) {
            return out;
        }
        for e in plan.extents() {
            let header = headers.frame(e.dst_region, e.dst_offset, e.len);
            let admission = self.receivers[j].admit_write(now, tx_peer(i), &header);
            if let Admission::Apply { ticket, .. } = admission {
                self.write_landed(j, ticket);
            }
            out.push(admission);
        }
        out
    }

    /// Reports held batch `index` (in issue order) as completed (its writes land first).
    pub fn complete_held(&mut self, index: usize) {
        let h = self.held.remove(index);
        self.land(h.sender, h.receiver, &h.plan, &h.headers);
        let now = self.now;
        self.senders[h.sender]
            .handle_input(SenderInput::Transport {
                now,
                input: TransportInput::WritesCompleted { batch: h.batch },
            })
            .unwrap();
        self.pump();
    }

    /// Reports held batch `index` as failed.
    pub fn fail_held(&mut self, index: usize, status: kvpipe_core::wire::TransferStatus) {
        let h = self.held.remove(index);
        let now = self.now;
        self.senders[h.sender]
            .handle_input(SenderInput::Transport {
                now,
                input: TransportInput::WritesFailed {
                    batch: h.batch,
                    status,
                },
            })
            .unwrap();
        self.pump();
    }

    /// Advances virtual time to `until`, firing every deadline on the way in order.
    pub fn run_until(&mut self, until: Instant) {
        for _ in 0..100_000 {
            let next = self
                .senders
                .iter_mut()
                .filter_map(|s| s.poll_timeout())
                .chain(self.receivers.iter_mut().filter_map(|r| r.poll_timeout()))
                .min();
            match next {
                Some(at) if at <= until => {
                    self.now = self.now.max(at);
                    let now = self.now;
                    for s in &mut self.senders {
                        if s.poll_timeout().is_some_and(|t| t <= now) {
                            s.handle_input(SenderInput::Transport {
                                now,
                                input: TransportInput::Timeout,
                            })
                            .unwrap();
                        }
                    }
                    for r in &mut self.receivers {
                        if r.poll_timeout().is_some_and(|t| t <= now) {
                            r.handle_input(ReceiverInput::Transport {
                                now,
                                input: TransportInput::Timeout,
                            })
                            .unwrap();
                        }
                    }
                    self.pump();
                }
                _ => break,
            }
        }
        self.now = self.now.max(until);
    }

    pub fn advance(&mut self, d: Duration) {
        let until = self.now + d;
        self.run_until(until);
    }

    /// Events drained from `side`, in order.
    pub fn events(&self, side: Side) -> Vec<Event> {
        self.log
            .iter()
            .filter(|(s, _)| *s == side)
            .filter_map(|(_, o)| match o {
                Output::Event(e) => Some(e.clone()),
                _ => None,
            })
            .collect()
    }

    /// Frames `side` transmitted, in order (heartbeats left out).
    pub fn frames(&self, side: Side) -> Vec<Frame> {
        self.log
            .iter()
            .filter(|(s, _)| *s == side)
            .filter_map(|(_, o)| match o {
                Output::Transmit { frame, .. } if !matches!(frame, Frame::Heartbeat(_)) => {
                    Some(frame.clone())
                }
                _ => None,
            })
            .collect()
    }

    /// Index in the log of the first output matching `f`.
    pub fn position(&self, f: impl Fn(&(Side, Output)) -> bool) -> Option<usize> {
        self.log.iter().position(f)
    }

    pub fn submit(
        &mut self,
        i: usize,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Option<SenderSliceId> {
        let now = self.now;
        let outcome = self.senders[i]
            .submit_chunk(now, request, spec, source)
            .unwrap();
        self.pump();
        outcome.slice()
    }

    pub fn aux(&mut self, i: usize, request: RequestId) {
        let now = self.now;
        self.senders[i]
            .handle_input(SenderInput::Aux {
                now,
                request,
                data: kvpipe_core::wire::AuxData {
                    prompt_tokens: 10,
                    cached_tokens: 0,
                    first_tokens: vec![42],
                    draft_tokens: vec![],
                },
            })
            .unwrap();
        self.pump();
    }

    pub fn register(&mut self, j: usize, reg: Registration) {
        let now = self.now;
        self.receivers[j].register(now, reg).unwrap();
        self.pump();
    }

    pub fn open(&mut self, i: usize, req: SendRequest) {
        let now = self.now;
        self.senders[i].open_request(now, req).unwrap();
        self.pump();
    }

    /// One sender and one receiver, connected, whose write batches are held for the test, with
    /// `request` registered (`prompt_len` tokens) and opened; the returned source holds the
    /// prompt's blocks (from block 100).
    pub fn held_pair(request: RequestId, prompt_len: u32) -> (Net, TestSource) {
        let mut net = Net::connected(1, 1);
        net.auto_complete = false;
        let source = TestSource::with(request, 100, prompt_len / TPB);
        net.register(0, registration(request, prompt_len, &[0]));
        net.open(0, send_request(request, &[0]));
        (net, source)
    }

    /// [`held_pair`](Self::held_pair) for a 16-token prompt whose first chunk (8 tokens) was
    /// submitted.
    pub fn first_chunk_held(request: RequestId) -> (Net, TestSource) {
        let (mut net, mut source) = Net::held_pair(request, 16);
        net.submit(0, request, chunk(0, 8, 16, false), &mut source);
        (net, source)
    }
}

pub fn is_event(e: &Event, f: impl Fn(&Event) -> bool) -> bool {
    f(e)
}
