//! What C passes in: the node configuration (layer groups, pools, regions, deadlines,
//! topology), chunks, aux data and registrations, and their conversion to the core's types.

use std::ffi::{c_char, c_void, CStr};

use kvpipe::{NodeConfig, RawRegion};
use kvpipe_core::session::{Deadlines, Registration};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, ChunkSpec, Duration, GroupIndex, GroupShard, InstanceId,
    LayerGroupLayout, LayerOrder, PeerId, PoolLayout, RegionId, RequestId,
};

use crate::status::Failure;

/// One pool of a layer group: the region holding a range of the group's layers for every block
/// slot; block slot `b` is the bytes `[b * slot_bytes, (b + 1) * slot_bytes)` of the region.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvpipe_pool {
    /// The region's id (a [`kvpipe_region`]'s `id`).
    pub region: u32,
    /// First layer in this pool, counted from the rank's first layer of the group.
    pub layer_begin: u16,
    /// Consecutive layers in this pool.
    pub layers: u16,
    /// Bytes per block slot (at least `layers` × the layer's block bytes; may include padding).
    pub slot_bytes: u64,
}

/// One layer group: layers sharing one block table per request. A slot's bytes are laid out
/// `[layer][K|V][head][token][dim]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_layer_group {
    /// Layers of the group on this rank.
    pub layers: u16,
    /// 2 for separate K and V planes, 1 for MLA's joint latent.
    pub kv_factor: u8,
    /// KV heads on this rank.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8).
    pub elem_bytes: u8,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Sliding attention window in tokens; 0 for full attention.
    pub window: u32,
    /// The pools holding the group's layers, in layer order.
    pub pools: *const kvpipe_pool,
    /// Entries of `pools`.
    pub pool_count: usize,
    /// Layers of the group in the whole model (0: this rank holds them all).
    pub model_layers: u16,
    /// The first of the model's layers this rank holds.
    pub first_layer: u16,
    /// KV heads of the group in the whole model (0: this rank holds them all).
    pub model_kv_heads: u16,
    /// The first of the model's KV heads this rank holds.
    pub first_head: u16,
}

/// Engine memory lent to a node: valid for reads and writes of `len` bytes from `ptr` until the
/// node is freed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_region {
    /// The id the pools name.
    pub id: u32,
    /// First byte.
    pub ptr: *mut c_void,
    /// Length in bytes.
    pub len: usize,
}

/// Every deadline the core keeps; [`kvpipe_deadlines_default`] fills the defaults. Each must
/// be positive but `result_per_token_us`, and `liveness_timeout_ms` must exceed
/// `heartbeat_interval_ms`: a node made with another is refused with `KVPIPE_ERR_CONFIG`,
/// naming the field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvpipe_deadlines {
    /// From connection to a validated handshake.
    pub handshake_ms: u64,
    /// (Prefill) from opening a request to every receiver's registration.
    pub registration_ms: u64,
    /// (Prefill) from handing a write batch to the transport to its report.
    pub write_completion_ms: u64,
    /// (Decode) the base of the overall cap on a request, registration to last result.
    pub result_wait_ms: u64,
    /// (Decode) what the overall cap adds per prompt token, in microseconds.
    pub result_per_token_us: u64,
    /// (Decode) a request that made progress fails when no further progress comes this long.
    pub result_idle_ms: u64,
    /// From the last chunk (prefill) or last result (decode) to the aux data.
    pub aux_wait_ms: u64,
    /// A heartbeat goes to a peer nothing was sent to for this long.
    pub heartbeat_interval_ms: u64,
    /// A peer nothing arrived from for this long is lost.
    pub liveness_timeout_ms: u64,
    /// From a failure to the confirmation that no write can still land.
    pub quiesce_ms: u64,
}

/// This rank's place in the parallel topology (all zero: the whole model on one rank).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvpipe_topology {
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// This rank's tensor-parallel rank.
    pub tp_rank: u16,
    /// Pipeline-parallel size.
    pub pp_size: u16,
    /// This rank's pipeline-parallel rank.
    pub pp_rank: u16,
    /// First model layer held.
    pub layer_begin: u16,
    /// One past the last model layer held.
    pub layer_end: u16,
}

/// How a node is made. Zeroed fields and null pointers take the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_node_config {
    /// The KV cache's layer groups, in group order (the two sides' layouts must pair up).
    pub groups: *const kvpipe_layer_group,
    /// Entries of `groups`.
    pub group_count: usize,
    /// The engine memory the pools live in.
    pub regions: *const kvpipe_region,
    /// Entries of `regions`.
    pub region_count: usize,
    /// Deadlines (null: [`kvpipe_deadlines_default`]).
    pub deadlines: *const kvpipe_deadlines,
    /// Topology (null: the whole model on one rank).
    pub topology: *const kvpipe_topology,
    /// The handshake's instance id (0: drawn from the process id and the clock).
    pub instance: u64,
    /// (Decode) the seed of memory grants (0: drawn like the instance id).
    pub grant_seed: u64,
    /// (TCP) connections the connecting side opens per peer, 1 to 255 (0: the transport's
    /// default, 2).
    pub tcp_connections: u32,
    /// (Prefill) the order the engine computes the rank's layers in, as each layer's group
    /// index, one entry per layer (null: the groups one after the other), which the layer
    /// ranges of `kvpipe_sender_submit_chunk_layers` index. A model whose groups interleave
    /// (Gemma 3's five local layers per global one) lists it.
    pub layer_order: *const u16,
    /// Entries of `layer_order` (0 with null).
    pub layer_order_count: usize,
}

/// One prefill chunk just computed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvpipe_chunk {
    /// First token computed by the chunk.
    pub start: u32,
    /// One past the last token computed.
    pub end: u32,
    /// Tokens in the whole prompt.
    pub prompt_len: u32,
    /// Prefix tokens the prefill side had cached (reused, not recomputed).
    pub prepopulated_len: u32,
    /// Whether this is the request's last chunk (`end == prompt_len`).
    pub is_last: bool,
    /// Whether the cached prefix was sent before the first chunk, with
    /// `kvpipe_sender_submit_prefix`.
    pub prefix_sent_early: bool,
}

/// A request's aux data: carried inline after its KV, handed to the decode side with
/// `KVPIPE_EVENT_COMPLETED`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_aux {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens the prefill side had cached.
    pub cached_tokens: u32,
    /// The first generated token(s).
    pub first_tokens: *const u32,
    /// Entries of `first_tokens`.
    pub first_token_count: usize,
    /// Speculative draft tokens.
    pub draft_tokens: *const u32,
    /// Entries of `draft_tokens`.
    pub draft_token_count: usize,
}

/// The destination blocks of one layer group: block ordinal `first_ordinal + i` lands in slot
/// `ids[i]`. Blocks the decode side holds already are left out (start later, or end earlier).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_block_list {
    /// Ordinal of `ids[0]`.
    pub first_ordinal: u32,
    /// Slots of consecutive ordinals.
    pub ids: *const u32,
    /// Entries of `ids`.
    pub count: usize,
}

/// A request's destination on the decode side, registered before its prefill starts.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_registration {
    /// The request (the same id on both sides).
    pub request: u64,
    /// Tokens in the prompt.
    pub prompt_len: u32,
    /// One block list per layer group, in group order.
    pub groups: *const kvpipe_block_list,
    /// Entries of `groups`.
    pub group_count: usize,
    /// The peers that write the request (prefill ranks), as this node numbers them.
    pub writers: *const u32,
    /// Entries of `writers`.
    pub writer_count: usize,
    /// Largest aux data accepted, in encoded bytes (1024 is plenty for a few tokens).
    pub aux_capacity: u32,
}

/// Fills `out` with the core's default deadlines.
///
/// # Safety
/// `out` is null or points to writable memory for one [`kvpipe_deadlines`].
#[no_mangle]
pub unsafe extern "C" fn kvpipe_deadlines_default(out: *mut kvpipe_deadlines) {
    crate::status::guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("out is null"));
        }
        let d = Deadlines::default();
        let ms = |d: Duration| d.as_nanos() / 1_000_000;
        let value = kvpipe_deadlines {
            handshake_ms: ms(d.handshake),
            registration_ms: ms(d.registration),
            write_completion_ms: ms(d.write_completion),
            result_wait_ms: ms(d.result_wait),
            result_per_token_us: d.result_per_token.as_nanos() / 1000,
            result_idle_ms: ms(d.result_idle),
            aux_wait_ms: ms(d.aux_wait),
            heartbeat_interval_ms: ms(d.heartbeat_interval),
            liveness_timeout_ms: ms(d.liveness_timeout),
            quiesce_ms: ms(d.quiesce),
        };
        // SAFETY: non-null and writable (the caller's promise).
        unsafe { out.write(value) };
        Ok(crate::status::kvpipe_status::KVPIPE_OK)
    });
}

/// The `count` elements at `ptr` (empty when `count` is 0, whatever `ptr` is).
///
/// # Safety
/// When `count > 0`, `ptr` points to `count` readable, initialized elements.
pub(crate) unsafe fn slice<'a, T>(
    ptr: *const T,
    count: usize,
    what: &str,
) -> Result<&'a [T], Failure> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!(
            "{what} is null but its count is {count}"
        )));
    }
    // SAFETY: non-null, `count` readable elements (the caller's promise).
    Ok(unsafe { std::slice::from_raw_parts(ptr, count) })
}

/// A reference to the struct at `ptr`.
///
/// # Safety
/// `ptr` is null or points to a readable, initialized `T`.
pub(crate) unsafe fn reference<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: null or valid (the caller's promise).
    unsafe { ptr.as_ref() }.ok_or_else(|| Failure::invalid(format!("{what} is null")))
}

/// The UTF-8 string at `ptr`.
///
/// # Safety
/// `ptr` is null or a NUL-terminated string.
pub(crate) unsafe fn string<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is null")));
    }
    // SAFETY: NUL-terminated (the caller's promise).
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| Failure::invalid(format!("{what} is not UTF-8")))
}

fn duration_ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

impl kvpipe_deadlines {
    fn to_core(self) -> Deadlines {
        Deadlines {
            handshake: duration_ms(self.handshake_ms),
            registration: duration_ms(self.registration_ms),
            write_completion: duration_ms(self.write_completion_ms),
            result_wait: duration_ms(self.result_wait_ms),
            result_per_token: Duration::from_nanos(self.result_per_token_us.saturating_mul(1000)),
            result_idle: duration_ms(self.result_idle_ms),
            aux_wait: duration_ms(self.aux_wait_ms),
            heartbeat_interval: duration_ms(self.heartbeat_interval_ms),
            liveness_timeout: duration_ms(self.liveness_timeout_ms),
            quiesce: duration_ms(self.quiesce_ms),
        }
    }
}

/// A node configuration and its regions, read from C.
pub(crate) struct ReadConfig {
    pub(crate) node: NodeConfig,
    pub(crate) regions: Vec<RawRegion>,
}

/// Reads a node configuration.
///
/// # Safety
/// `config` and every pointer in it follow the field docs of [`kvpipe_node_config`].
pub(crate) unsafe fn read_config(config: *const kvpipe_node_config) -> Result<ReadConfig, Failure> {
    // SAFETY: the caller's promise, forwarded.
    let c = unsafe { reference(config, "config") }?;
    // SAFETY: as above.
    let groups = unsafe { slice(c.groups, c.group_count, "config.groups") }?;
    let mut layout = Vec::with_capacity(groups.len());
    for (i, g) in groups.iter().enumerate() {
        // SAFETY: as above.
        let pools = unsafe { slice(g.pools, g.pool_count, &format!("config.groups[{i}].pools")) }?;
        layout.push(LayerGroupLayout {
            layers: g.layers,
            kv_factor: g.kv_factor,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            elem_bytes: g.elem_bytes,
            tokens_per_block: g.tokens_per_block,
            window: (g.window != 0).then_some(g.window),
            block_layout: Default::default(),
            pools: pools
                .iter()
                .map(|p| PoolLayout {
                    region: RegionId(p.region),
                    layer_begin: p.layer_begin,
                    layers: p.layers,
                    slot_bytes: p.slot_bytes,
                })
                .collect(),
            shard: GroupShard {
                model_layers: g.model_layers,
                first_layer: g.first_layer,
                model_kv_heads: g.model_kv_heads,
                first_head: g.first_head,
            },
        });
    }
    let mut node = NodeConfig::new(layout);
    // SAFETY: null or valid (the caller's promise).
    if let Some(d) = unsafe { c.deadlines.as_ref() } {
        node.deadlines = d.to_core();
    }
    // SAFETY: null or valid (the caller's promise).
    if let Some(t) = unsafe { c.topology.as_ref() } {
        node.topology = Topology {
            tp_size: t.tp_size,
            tp_rank: t.tp_rank,
            pp_size: t.pp_size,
            pp_rank: t.pp_rank,
            layer_begin: t.layer_begin,
            layer_end: t.layer_end,
        };
    }
    node.instance = (c.instance != 0).then_some(InstanceId(c.instance));
    node.grant_seed = (c.grant_seed != 0).then_some(c.grant_seed);
    match c.tcp_connections {
        0 => {}
        n @ 1..=255 => node.tcp.connections_per_peer = n as usize,
        n => {
            return Err(Failure::invalid(format!(
                "config.tcp_connections is {n}; a peer takes 1 to 255 connections"
            )))
        }
    }
    if !c.layer_order.is_null() || c.layer_order_count != 0 {
        // SAFETY: as above.
        let order = unsafe { slice(c.layer_order, c.layer_order_count, "config.layer_order") }?;
        node.layer_order = LayerOrder {
            groups: order.iter().copied().map(GroupIndex).collect(),
        };
    }
    // SAFETY: as above.
    let regions = unsafe { slice(c.regions, c.region_count, "config.regions") }?
        .iter()
        .map(|r| RawRegion {
            id: RegionId(r.id),
            ptr: r.ptr.cast(),
            len: r.len,
            device: None,
        })
        .collect();
    Ok(ReadConfig { node, regions })
}

/// Reads a chunk.
pub(crate) fn chunk_spec(c: &kvpipe_chunk) -> ChunkSpec {
    ChunkSpec {
        start: c.start,
        end: c.end,
        prompt_len: c.prompt_len,
        prepopulated_len: c.prepopulated_len,
        is_last: c.is_last,
        prefix_sent_early: c.prefix_sent_early,
    }
}

/// Reads aux data.
///
/// # Safety
/// The pointers in `a` follow its field docs.
pub(crate) unsafe fn aux_data(a: &kvpipe_aux) -> Result<AuxData, Failure> {
    Ok(AuxData {
        prompt_tokens: a.prompt_tokens,
        cached_tokens: a.cached_tokens,
        // SAFETY: the caller's promise, forwarded.
        first_tokens: unsafe { slice(a.first_tokens, a.first_token_count, "aux.first_tokens") }?
            .to_vec(),
        // SAFETY: as above.
        draft_tokens: unsafe { slice(a.draft_tokens, a.draft_token_count, "aux.draft_tokens") }?
            .to_vec(),
    })
}

/// Reads a registration.
///
/// # Safety
/// The pointers in `r` (and in its block lists) follow their field docs.
pub(crate) unsafe fn registration(r: &kvpipe_registration) -> Result<Registration, Failure> {
    // SAFETY: the caller's promise, forwarded.
    let lists = unsafe { slice(r.groups, r.group_count, "registration.groups") }?;
    let mut groups = Vec::with_capacity(lists.len());
    for (i, list) in lists.iter().enumerate() {
        // SAFETY: as above.
        let ids = unsafe {
            slice(
                list.ids,
                list.count,
                &format!("registration.groups[{i}].ids"),
            )
        }?;
        let ids: Vec<BlockId> = ids.iter().copied().map(BlockId).collect();
        groups.push(AnchoredRun::from_ids(list.first_ordinal, &ids));
    }
    // SAFETY: as above.
    let writers = unsafe { slice(r.writers, r.writer_count, "registration.writers") }?;
    Ok(Registration {
        request: RequestId(r.request),
        prompt_len: r.prompt_len,
        groups,
        writers: writers.iter().copied().map(PeerId).collect(),
        aux_capacity: r.aux_capacity,
        expected_part: None,
    })
}
