//! # kvpipe
//!
//! The engine API of kvpipe: what an LLM serving engine embeds to stream a request's KV cache
//! from its prefill server to its decode server while prefill is still running. One
//! [`PrefillNode`] per prefill rank drives the protocol core's [`Sender`](kvpipe_core::Sender),
//! one [`DecodeNode`] per decode rank its [`Receiver`](kvpipe_core::Receiver), over a transport
//! chosen by configuration ([`NodeConfig::transport`]); commands, events and errors are the
//! same whatever the transport. As an application depends on quinn rather than quinn-proto, an
//! engine depends on this crate and names no transport's own types; kvpipe's C ABI
//! (`bindings/c`) and Python package (`bindings/python`) are built on it.
//!
//! | transport | made by | crosses processes | GPU memory (`cuda` feature) |
//! |---|---|---|---|
//! | [`Transport::Mem`] | [`mem_pair`] (both sides at once) | no | device copies |
//! | [`Transport::Tcp`] | [`PrefillNode::new`], [`DecodeNode::new`] | yes | pinned staging, or peer copies on one host |
//! | `Transport::Verbs` (`verbs` feature) | [`PrefillNode::new`], [`DecodeNode::new`] | yes (RDMA) | dma-buf registration |
//!
//! ## Example
//!
//! A request of 16 tokens (4 blocks of 4 tokens) moved in this process, in two prefill chunks,
//! from slots 0..4 of the prefill pool into slots 4..8 of the decode pool.
//!
//! ```
//! use std::time::Duration;
//!
//! use kvpipe::{
//!     mem_pair, AnchoredRun, AuxData, BlockId, BlockTables, ChunkSpec, Event, LayerGroupLayout,
//!     LayerRange, Node, NodeConfig, PoolLayout, RawRegion, RegionId, Registration, RequestId,
//!     Role, SendRequest, MEM_RECEIVER_PEER, MEM_SENDER_PEER,
//! };
//!
//! // One layer group: 2 layers, K and V, 1 head of 4 dims in 2-byte elements, 4 tokens per
//! // block: a slot of 2 * 2 * 4 * 4 * 2 = 128 bytes, in one pool named `region`.
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
//! // The next event `want` accepts (others are skipped); every wait has a deadline.
//! fn wait<E: Role>(node: &Node<E>, want: fn(&Event) -> bool) -> Result<Event, Box<dyn std::error::Error>> {
//!     loop {
//!         match node.next_event(Duration::from_secs(10))? {
//!             Some(e) if want(&e) => return Ok(e),
//!             Some(e @ Event::Failed { .. }) => return Err(format!("{e:?}").into()),
//!             Some(_) => {}
//!             None => return Err("no event within 10 s".into()),
//!         }
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The engine's memory: a pool of 8 slots on each side.
//! let mut src: Vec<u8> = (0..8 * 128).map(|i| (i % 251) as u8).collect();
//! let mut dst = vec![0u8; 8 * 128];
//! let src_regions = [RawRegion::host(RegionId(1), &mut src)];
//! let dst_regions = [RawRegion::host(RegionId(2), &mut dst)];
//!
//! // SAFETY: `src` and `dst` outlive both nodes (dropped below, before they are read), and
//! // nothing touches them while a transfer may write them.
//! let (prefill, decode) = unsafe {
//!     mem_pair(&NodeConfig::new(layout(1)), &src_regions, &NodeConfig::new(layout(2)), &dst_regions)?
//! };
//! let ready: fn(&Event) -> bool = |e| matches!(e, Event::PeerReady { .. });
//! wait(&decode, ready)?;
//! wait(&prefill, ready)?;
//!
//! // Decode: register the destination blocks (ordinals 0..4 in slots 4..8) and the writer.
//! let request = RequestId(7);
//! let slots: Vec<BlockId> = (4..8).map(BlockId).collect();
//! decode.register(Registration {
//!     request,
//!     prompt_len: 16,
//!     groups: vec![AnchoredRun::from_ids(0, &slots)],
//!     writers: [MEM_SENDER_PEER].into_iter().collect(),
//!     aux_capacity: 64,
//!     expected_part: None,
//! })?;
//!
//! // Prefill: open the request, then submit each chunk as soon as it is computed. The block
//! // table says where each block ordinal lives (ordinal o in slot o).
//! prefill.open_request(SendRequest::new(request, [MEM_RECEIVER_PEER]))?;
//! let table: Vec<Option<BlockId>> = (0..4).map(|o| Some(BlockId(o))).collect();
//! let groups: [&[Option<BlockId>]; 1] = [&table];
//! for (start, end, is_last) in [(0, 8, false), (8, 16, true)] {
//!     let chunk = ChunkSpec { start, end, prompt_len: 16, prepopulated_len: 0, is_last, prefix_sent_early: false };
//!     if !is_last {
//!         prefill.submit_chunk(request, chunk, &mut BlockTables { groups: &groups })?;
//!         continue;
//!     }
//!     // The last chunk layer by layer, each layer as soon as it is computed (see "Layer by
//!     // layer" below).
//!     for layer in 0..prefill.layer_count()? {
//!         let layers = LayerRange::new(layer, layer + 1);
//!         prefill.submit_chunk_layers(request, chunk, layers, &mut BlockTables { groups: &groups })?;
//!     }
//! }
//! // The first generated token travels after the KV.
//! prefill.submit_aux(request, AuxData { prompt_tokens: 16, cached_tokens: 0, first_tokens: vec![42], draft_tokens: vec![] })?;
//!
//! // Both sides complete, then quiesce: only then are the blocks the engine's again.
//! let Event::Completed { aux, bytes_written, .. } = wait(&decode, |e| matches!(e, Event::Completed { .. }))? else { unreachable!() };
//! assert_eq!((aux.unwrap().first_tokens, bytes_written), (vec![42], 4 * 128));
//! wait(&decode, |e| matches!(e, Event::Quiesced { .. }))?;
//! wait(&prefill, |e| matches!(e, Event::Completed { .. }))?;
//! wait(&prefill, |e| matches!(e, Event::Quiesced { .. }))?;
//! prefill.retire(request)?;
//! decode.retire(request)?;
//!
//! drop((prefill, decode));
//! assert_eq!(dst[4 * 128..], src[..4 * 128]);
//! # Ok(())
//! # }
//! ```
//!
//! Across processes the same code runs on `PrefillNode::new` / `DecodeNode::new` with
//! [`Transport::Tcp`] (or verbs): the decode side [`listen`](Node::listen)s, the prefill side
//! [`connect`](Node::connect)s and names the peer by the id `connect` returns; the decode side
//! learns the prefill side's id from its [`Event::PeerReady`].
//!
//! ## Layer by layer
//!
//! A chunk may also leave in layer ranges, each as soon as the engine has computed those
//! layers (vLLM calls `save_kv_layer` per layer; TensorRT-LLM's `KVSlice` carries a
//! `layer_range`), so the last chunk's transfer overlaps its own compute and only about one
//! range's transfer is left after prefill.
//! [`submit_chunk_layers`](PrefillNode::submit_chunk_layers) takes the same [`ChunkSpec`] for
//! every range of a chunk and a [`LayerRange`] of the rank's layers, counted in compute order
//! ([`NodeConfig::layer_order`]; by default the layer groups one after the other): the ranges of
//! one chunk run from layer 0 to [`layer_count`](PrefillNode::layer_count) in order, without
//! gaps. The first range asks the block source for the chunk's blocks; later ranges ask
//! nothing. The example above sends its last chunk that way, one layer at a time.
//!
//! ## A node's methods
//!
//! Sorted as quinn sorts its `Connection`'s (each method's own doc has the details):
//!
//! - **Getters**: [`transport`](Node::transport), [`is_peer_ready`](Node::is_peer_ready),
//!   [`counters`](Node::counters), [`session_count`](Node::session_count).
//! - **Commands**: [`listen`](Node::listen), [`connect`](Node::connect); prefill:
//!   [`open_request`](PrefillNode::open_request) (optional: a chunk opens the request too),
//!   [`submit_prefix`](PrefillNode::submit_prefix),
//!   [`submit_chunk`](PrefillNode::submit_chunk) (or, layer range by layer range as the
//!   engine computes them, [`submit_chunk_layers`](PrefillNode::submit_chunk_layers): see
//!   below), [`submit_aux`](PrefillNode::submit_aux);
//!   decode: [`register`](DecodeNode::register); both: `cancel`, `retire`, and
//!   [`close`](Node::close). A command is applied to the endpoint at once and handed to the
//!   transport before it returns; it never waits for the peer. A block source
//!   ([`BlockSource`], or [`BlockTables`] over the engine's block
//!   tables) is asked only for the blocks of the chunk being submitted, with the node
//!   unlocked (it may call into the node; the chunk is checked again when applied).
//! - **Events**: [`next_event`](Node::next_event) blocks up to a timeout and returns the
//!   endpoint's events in order: `PeerReady` / `PeerRejected` per peer; per request
//!   `Registered` (prefill), then exactly one outcome — `Completed`, `Failed` (both sides learn
//!   at once, naming both slice ids), `TimedOut` or `Cancelled` — and then `Quiesced`.
//! - **Memory**: regions ([`RawRegion`]) are lent by address when a node is made and must stay
//!   valid until it is dropped. A request's blocks belong to the transfer from the chunk that
//!   sends them (prefill) or the registration (decode) until its `Quiesced` event — also after
//!   a failure, a timeout or a cancel, since a write may still be in flight — and only then may
//!   the engine reuse them and `retire` the request. A region may be GPU memory
//!   ([`RawRegion::device`], `cuda` feature); without the feature, or without a CUDA driver
//!   that sees that GPU, the node is refused ([`EmbedError::DeviceRegion`]).
//! - **Errors**: one enum, [`EmbedError`], whatever the transport. A refused command is
//!   [`EmbedError::Usage`] (the caller's bug; the endpoint is unchanged) and a configuration
//!   that cannot run pipelined transfer [`EmbedError::Config`], both the core's own errors,
//!   which name the values involved and say what to change. What the peer did wrong never
//!   comes back as an error of a command: it fails the request (`Event::Failed`). Every
//!   method of a closed node returns [`EmbedError::Closed`].
//!
//! ## Feature flags
//!
//! | feature | what it enables |
//! |---|---|
//! | `verbs` *(default)* | the RDMA verbs transport (`Transport::Verbs`, `kvpipe-ibverbs`). It loads libibverbs at run time: it builds anywhere with cmake and libclang, and without an RDMA device a node on it is refused with an error that says so. |
//! | `cuda` | GPU regions ([`RawRegion::device`]) on every transport. Builds without CUDA installed and loads the driver at run time. |

mod config;
mod error;
#[cfg(feature = "cuda")]
mod fenced;
mod gpu;
mod mem;
mod node;
mod role;
mod stats;
mod tables;
mod transport;
#[cfg(feature = "verbs")]
mod verbs;

pub use config::{instance_id, NodeConfig, RawRegion};
pub use error::EmbedError;
#[cfg(feature = "cuda")]
pub use fenced::{Fence, FENCE_WAIT};
pub use gpu::GpuUnavailable;
#[cfg(feature = "verbs")]
pub use kvpipe_ibverbs::{DeviceSpec, FabricConfig, IdlePolicy};
pub use kvpipe_tcp::{TcpConfig, TcpDataPath};
pub use mem::{MEM_RECEIVER_PEER, MEM_SENDER_PEER};
pub use node::{mem_pair, DecodeNode, Node, PrefillNode};
pub use role::Role;
pub use stats::DataPathStats;
pub use tables::BlockTables;
pub use transport::Transport;
#[cfg(feature = "verbs")]
pub use transport::VerbsConfig;

/// The protocol core this crate drives, for what the re-exports below leave out.
pub use kvpipe_core;
pub use kvpipe_core::session::{
    Counters, Deadlines, EngineFault, Registration, SendRequest, Submitted, UsageError,
};
pub use kvpipe_core::wire::{AuxData, Topology};
pub use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, ConfigError, Event,
    GroupIndex, InstanceId, LayerGroupLayout, LayerOrder, LayerRange, PeerId, PoolLayout,
    ReceiverSliceId, RegionId, RequestId, SenderSliceId,
};
