//! # kvpipe-core
//!
//! The sans-IO protocol core of kvpipe: it streams an LLM request's KV cache from a prefill
//! server to a decode server while prefill is still running. This crate holds the wire frames
//! ([`wire`]), the chunk geometry ([`geometry`]), write planning ([`plan`]; between ranks split
//! differently by tensor and pipeline parallelism: [`shard`]; a chunk submitted in layer ranges
//! as the engine computes them: [`layers`]) and the two endpoint state machines ([`session`]): a
//! [`Sender`] per prefill rank and a [`Receiver`] per decode rank. It does no I/O, reads no clock, spawns no threads and contains no `unsafe`; transports
//! drive it.
//!
//! ## The run loop
//!
//! A transport owns the sockets, the memory and the clock, and drives both endpoints the same
//! way ([`Endpoint`]; `docs/TRANSPORT.md` is the whole contract). Whenever something happens it
//! hands the endpoint one input carrying `now` — a [`TransportInput`] (a peer connected, the
//! bytes of a frame arrived, a write batch completed, the timer fired), or an engine command
//! ([`Sender::open_request`], [`Sender::submit_chunk`], [`Receiver::register`], …, each sugar
//! for a [`SenderInput`] / [`ReceiverInput`]) — then drains `poll_output()` until it returns
//! `None` and carries out each [`Output`]:
//!
//! - [`Output::Transmit`]: send its `bytes` (encoded at the negotiated version) to the peer;
//! - [`Output::ExecuteWrites`] (sender): copy the plan's extents into the receiver's memory,
//!   then report [`TransportInput::WritesCompleted`] or [`TransportInput::WritesFailed`]. A
//!   receiving transport that applies the bytes itself asks [`Receiver::admit_write`] for each
//!   and reports [`TransportInput::WriteFinished`] when it landed;
//! - [`Output::ClosePeer`]: flush what was sent before, tear the connection down, then report
//!   [`TransportInput::PeerDisconnected`];
//! - [`Output::Event`]: hand it to the engine ([`Event::Quiesced`] means the request's blocks
//!   may be freed).
//!
//! Finally it arms a timer for `poll_timeout()` and delivers [`TransportInput::Timeout`] when
//! it fires (early is harmless). The example drives one sender and one receiver by hand through
//! a two-chunk transfer; a real transport does the same with sockets and a clock.
//!
//! ```
//! use kvpipe_core::session::{
//!     Admission, LocalHello, Registration, SendRequest, Sender, SenderConfig, Receiver,
//!     ReceiverConfig, Event, Output, TransportInput,
//! };
//! use kvpipe_core::wire::{AuxData, Topology};
//! use kvpipe_core::{
//!     AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, GroupIndex,
//!     InstanceId, Instant, LayerGroupLayout, PeerId, PoolLayout, RegionId, RequestId,
//! };
//!
//! // One layer group: 4 tokens per block, one pool of 128-byte slots.
//! fn layout(region: u32) -> Vec<LayerGroupLayout> {
//!     vec![LayerGroupLayout {
//!         layers: 2, kv_factor: 2, kv_heads: 1, head_dim: 4, elem_bytes: 2,
//!         tokens_per_block: 4, window: None, block_layout: Default::default(),
//!         pools: [PoolLayout { region: RegionId(region), layer_begin: 0, layers: 2, slot_bytes: 128 }]
//!             .into_iter().collect(),
//!         shard: Default::default(), // this rank holds the whole model
//!     }]
//! }
//!
//! // The prefill engine's cache: block ordinal `o` of the request lives in slot `10 + o`.
//! struct Cache;
//! impl BlockSource for Cache {
//!     fn block_run(&mut self, _: RequestId, _: GroupIndex, begin: u32, end: u32, out: &mut BlockRun)
//!         -> Result<(), BlockSourceError> {
//!         out.first_ordinal = begin;
//!         out.ids = (begin..end).map(|o| BlockId(10 + o)).collect();
//!         Ok(())
//!     }
//! }
//!
//! // The sender names the receiver PeerId(1); the receiver names the sender PeerId(0).
//! let (to_receiver, to_sender) = (PeerId(1), PeerId(0));
//! let mut sender = Sender::new(SenderConfig::new(
//!     LocalHello::new(InstanceId(1), Topology::default(), layout(1)))).unwrap();
//! let mut receiver = Receiver::new(ReceiverConfig::new(
//!     LocalHello::new(InstanceId(2), Topology::default(), layout(2)), /* grant seed */ 7)).unwrap();
//!
//! // Carry every output of both endpoints to its destination until both are idle.
//! fn pump(now: Instant, s: &mut Sender, r: &mut Receiver, events: &mut Vec<Event>) {
//!     loop {
//!         let mut idle = true;
//!         while let Some(out) = s.poll_output() {
//!             idle = false;
//!             match out {
//!                 Output::Transmit { bytes, .. } => r
//!                     .handle_transport(now, TransportInput::FrameReceived { peer: PeerId(0), bytes })
//!                     .unwrap(),
//!                 Output::ExecuteWrites { batch, plan, headers, .. } => {
//!                     // A byte-stream transport sends each extent behind its encoded header;
//!                     // the receiving side decodes it, asks for admission, copies, and reports
//!                     // it landed. In one process the header goes across as it is.
//!                     for e in plan.extents() {
//!                         let header = headers.frame(e.dst_region, e.dst_offset, e.len);
//!                         let Admission::Apply { ticket, .. } = r.admit_write(now, PeerId(0), &header)
//!                             else { panic!("inside the grant") };
//!                         // (copy e.len bytes here)
//!                         r.handle_transport(now, TransportInput::WriteFinished { ticket, landed: true })
//!                             .unwrap();
//!                     }
//!                     s.handle_transport(now, TransportInput::WritesCompleted { batch }).unwrap();
//!                 }
//!                 Output::Event(e) => events.push(e),
//!                 Output::ClosePeer { .. } => unreachable!("nothing fails here"),
//!                 // Only where a transport offers its own data path in the handshake.
//!                 Output::DataPath(_) => unreachable!("no data-path offer here"),
//!             }
//!         }
//!         while let Some(out) = r.poll_output() {
//!             idle = false;
//!             match out {
//!                 Output::Transmit { bytes, .. } => s
//!                     .handle_transport(now, TransportInput::FrameReceived { peer: PeerId(1), bytes })
//!                     .unwrap(),
//!                 Output::Event(e) => events.push(e),
//!                 _ => unreachable!("a receiver only transmits and reports"),
//!             }
//!         }
//!         if idle { return; }
//!     }
//! }
//!
//! let mut events = Vec::new();
//! let mut now = Instant::from_millis(1);
//! // Connect: both sides send a Hello and check the other's.
//! sender.handle_transport(now, TransportInput::PeerConnected { peer: to_receiver }).unwrap();
//! receiver.handle_transport(now, TransportInput::PeerConnected { peer: to_sender }).unwrap();
//! pump(now, &mut sender, &mut receiver, &mut events);
//! assert!(sender.is_peer_ready(to_receiver) && receiver.is_peer_ready(to_sender));
//!
//! // The decode side registers its blocks for a 16-token prompt (4 blocks, slots 50..54).
//! let request = RequestId(42);
//! let ids: Vec<BlockId> = (50..54).map(BlockId).collect();
//! receiver.register(now, Registration {
//!     request, prompt_len: 16, groups: vec![AnchoredRun::from_ids(0, &ids)],
//!     writers: [to_sender].into_iter().collect(), aux_capacity: 256, expected_part: None,
//! }).unwrap();
//! // The prefill side opens the request and submits its chunks as prefill computes them.
//! sender.open_request(now, SendRequest::new(request, [to_receiver])).unwrap();
//! pump(now, &mut sender, &mut receiver, &mut events);
//!
//! let chunk = |start, end, is_last| ChunkSpec {
//!     start, end, prompt_len: 16, prepopulated_len: 0, is_last, prefix_sent_early: false,
//! };
//! sender.submit_chunk(now, request, chunk(0, 8, false), &mut Cache).unwrap();
//! pump(now, &mut sender, &mut receiver, &mut events);
//! now = now + kvpipe_core::Duration::from_millis(5);
//! sender.submit_chunk(now, request, chunk(8, 16, true), &mut Cache).unwrap();
//! // The first generated token travels inline after the KV.
//! let aux = AuxData { prompt_tokens: 16, cached_tokens: 0, first_tokens: vec![7], draft_tokens: vec![] };
//! sender.submit_aux(now, request, aux).unwrap();
//! pump(now, &mut sender, &mut receiver, &mut events);
//!
//! // Both sides completed, then quiesced: the blocks may be freed and the request retired.
//! let completed = events.iter().filter(|e| matches!(e, Event::Completed { .. })).count();
//! assert_eq!(completed, 2);
//! assert!(events.iter().any(|e| matches!(e, Event::Completed { aux: Some(a), bytes_written: 512, .. }
//!     if a.first_tokens == [7])));
//! sender.retire(now, request).unwrap();
//! receiver.retire(now, request).unwrap();
//! assert_eq!(sender.counters().bytes_written, 4 * 128);
//! assert_eq!(receiver.counters().bytes_landed, 4 * 128);
//! // Nothing is pending but the heartbeats' deadline.
//! assert!(sender.poll_timeout().is_some());
//! ```
#![forbid(unsafe_code)]

pub mod blocks;
pub mod config;
pub mod geometry;
pub mod ids;
pub mod layers;
pub mod layout;
pub mod plan;
pub mod session;
pub mod shard;
pub mod source;
pub mod stream;
pub mod time;
pub mod wire;

pub use blocks::{AnchoredRun, BlockRun, IdRun};
pub use config::{ConfigError, PipelineConfig, SchedulingPolicy};
pub use geometry::{
    chunk_window, early_prefix_window, stale_boundary, total_blocks, BlockWindow, ChunkSpec,
    ChunkSpecField, ChunkSpecValue, GeometryError, StaleBoundary,
};
pub use ids::{
    BlockId, GrantId, GroupIndex, InstanceId, PeerId, ReceiverSliceId, RegionId, RequestId,
    SenderSliceId,
};
pub use layers::{LayerOrder, LayerOrderError, LayerRange};
pub use layout::{BlockLayout, GroupShard, LayerGroupLayout, PoolLayout};
pub use plan::{
    check_layout, check_pairable, plan_group, plan_group_with_cursor, plan_rank_group,
    plan_rank_group_layers, DstCursor, GroupPairing, PairStats, PlanError, RankGroup, Side,
    WriteExtent, WritePlan,
};
pub use session::{
    Admission, DataPath, DataPathNegotiation, Endpoint, EngineFault, Event, Output, Receiver,
    ReceiverConfig, ReceiverInput, Sender, SenderConfig, SenderInput, Submitted, TransportInput,
    WriteTicket,
};
pub use shard::{check_shard, check_topology, writes_group, writes_to, ShardError, TopologyError};
pub use source::{BlockSource, BlockSourceError};
pub use time::{Duration, Instant};
