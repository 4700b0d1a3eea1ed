//! The shape of a reference cache: its layer groups ([`GroupSpec`]), their block slots and
//! pools ([`CacheSpec`], with the memory a spec needs), and how the sender allocates a
//! request's blocks ([`AllocationStyle`]).

/// One layer group of a [`CacheSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Layers in the group.
    pub layers: u16,
    /// 2 for K and V planes, 1 for MLA.
    pub kv_factor: u8,
    /// KV heads.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Bytes per element.
    pub elem_bytes: u8,
    /// Sliding window in tokens; `None` for full attention.
    pub window: Option<u32>,
    /// Leading tokens a windowed group keeps resident while the window slides past them.
    pub sink_tokens: u32,
    /// Layers held by each pool, in layer order (sums to `layers`).
    pub pool_split: Vec<u16>,
    /// Extra bytes at the end of every slot (padding: consecutive slots then never coalesce).
    pub slot_padding: u64,
}

impl GroupSpec {
    /// A full-attention group of `layers` layers with a small head geometry, held in pools of
    /// `pool_split` layers each.
    pub fn full(layers: u16, pool_split: &[u16]) -> Self {
        GroupSpec {
            layers,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 2,
            elem_bytes: 1,
            window: None,
            sink_tokens: 0,
            pool_split: pool_split.to_vec(),
            slot_padding: 0,
        }
    }

    /// The same group with a sliding window of `window` tokens and `sink_tokens` sink tokens.
    pub fn windowed(mut self, window: u32, sink_tokens: u32) -> Self {
        self.window = Some(window);
        self.sink_tokens = sink_tokens;
        self
    }
}

/// The shape of a [`ReferenceCache`](super::ReferenceCache).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// Tokens per block (every group).
    pub tokens_per_block: u32,
    /// The layer groups.
    pub groups: Vec<GroupSpec>,
    /// Block slots per group (every pool of a group has this many).
    pub slots_per_group: u32,
    /// Region id of the first pool; pools are numbered consecutively from it, group by group.
    pub first_region: u32,
    /// `None`: slots are handed out in order (contiguous ids); `Some(seed)`: in a seeded
    /// shuffled order, so block tables are fragmented.
    pub slot_order_seed: Option<u64>,
    /// Whether pools have memory. Without it the cache only keeps block tables (benches).
    pub materialize: bool,
}

/// Bytes of bookkeeping per slot of each group (free list, owner, touched flag, and a request
/// table entry for the block the slot holds), rounded up.
const TABLE_BYTES_PER_SLOT: u64 = 64;

impl GroupSpec {
    /// Bytes of one block over all the group's pools (`None`: it does not fit in a `u64`).
    pub fn block_bytes(&self, tokens_per_block: u32) -> Option<u64> {
        let per_layer = u64::from(self.kv_factor)
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(tokens_per_block))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.elem_bytes))?;
        per_layer.checked_mul(u64::from(self.layers))?.checked_add(
            self.slot_padding
                .checked_mul(self.pool_split.len() as u64)?,
        )
    }
}

impl CacheSpec {
    /// Bytes every pool reserves (every slot of every pool; `None`: past `u64`). A windowed
    /// pool's memory is committed only as its slots are first used; see
    /// [`CacheSpec::footprint`].
    pub fn pool_bytes(&self) -> Option<u64> {
        if !self.materialize {
            return Some(0);
        }
        self.groups.iter().try_fold(0u64, |sum, g| {
            g.block_bytes(self.tokens_per_block)?
                .checked_mul(u64::from(self.slots_per_group))?
                .checked_add(sum)
        })
    }

    /// An upper bound on the memory a cache built from this spec holds while it serves
    /// `requests` requests at once prefilled in chunks of `chunk_tokens` (`None`: past `u64`):
    /// its block tables, its full-attention pools (committed whole when built) and, of each
    /// windowed pool, the slots its window, the chunk being computed and the sink tokens can
    /// hold at once for every request. Computed without allocating, so a caller
    /// can refuse a spec that does not fit before building it.
    pub fn footprint(&self, requests: u32, chunk_tokens: u32) -> Option<u64> {
        let tpb = u64::from(self.tokens_per_block.max(1));
        let slots = u64::from(self.slots_per_group);
        self.groups.iter().try_fold(0u64, |sum, g| {
            let tables = slots.checked_mul(TABLE_BYTES_PER_SLOT)?;
            let used = match g.window {
                Some(w) if self.materialize => {
                    let per_request = u64::from(w).div_ceil(tpb)
                        + u64::from(chunk_tokens).div_ceil(tpb)
                        + u64::from(g.sink_tokens).div_ceil(tpb)
                        + 2;
                    per_request.checked_mul(u64::from(requests))?.min(slots)
                }
                _ if self.materialize => slots,
                _ => 0,
            };
            g.block_bytes(self.tokens_per_block)?
                .checked_mul(used)?
                .checked_add(tables)?
                .checked_add(sum)
        })
    }
}

/// How the sender allocates a request's full-attention blocks (a windowed group always
/// allocates a block when the chunk that computes it runs: its pool holds only live blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllocationStyle {
    /// Every block of the prompt when prefill begins.
    FullPrompt,
    /// The blocks each chunk needs, when it is computed.
    Incremental,
}
