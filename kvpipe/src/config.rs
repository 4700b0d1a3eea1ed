//! What a node is made from: the KV layout, the handshake's identity, deadlines, the
//! transport and its settings, and the engine's memory.

use kvpipe_core::session::{Deadlines, LocalHello};
use kvpipe_core::wire::Topology;
use kvpipe_core::{
    ConfigError, InstanceId, LayerGroupLayout, LayerOrder, ReceiverConfig, RegionId, SenderConfig,
    Side,
};
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig};

use crate::transport::Transport;
use crate::EmbedError;

/// One region of the engine's memory (a KV pool), lent to a node by address: host memory, or
/// (`cuda` feature) memory of one GPU.
///
/// Whoever makes a node from it promises what [`MemoryRegion::from_raw_parts`] asks: the bytes
/// stay valid (not freed, not moved) while the node exists, and the engine leaves a request's
/// blocks alone from the chunk that sends them (prefill) or the registration (decode) until the
/// request's `Quiesced` event. GPU memory must be allocated in this process (`cuMemAlloc`,
/// `cudaMalloc`, or a framework's allocator on top of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawRegion {
    /// The id the layout's pools name ([`kvpipe_core::PoolLayout::region`]).
    pub id: RegionId,
    /// First byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
    /// Where the bytes are: `None`, host memory; `Some(ordinal)`, `ptr` is a CUDA device
    /// address on GPU `ordinal`.
    pub device: Option<u32>,
}

impl RawRegion {
    /// `bytes` as a host region named `id`. The slice is only borrowed for its address: the
    /// node's contract ([`RawRegion`]) is the caller's to keep.
    pub fn host(id: RegionId, bytes: &mut [u8]) -> Self {
        RawRegion {
            id,
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            device: None,
        }
    }
}

/// How a node is set up; [`NodeConfig::new`] gives the defaults around a layout.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The KV cache's layer groups and their pools, in group order (both sides' layouts must
    /// pair up: the handshake checks them).
    pub layout: Vec<LayerGroupLayout>,
    /// This rank's place in the parallel topology (default: the whole model on one rank).
    pub topology: Topology,
    /// The handshake's instance id (`None`: one drawn from the process id and the clock).
    pub instance: Option<InstanceId>,
    /// Every deadline the core keeps.
    pub deadlines: Deadlines,
    /// (Decode) the seed of the memory grants (`None`: drawn like the instance id).
    pub grant_seed: Option<u64>,
    /// The transport [`PrefillNode::new`](crate::PrefillNode::new) and
    /// [`DecodeNode::new`](crate::DecodeNode::new) build, with its settings (default: TCP with
    /// default settings). [`mem_pair`](crate::mem_pair) ignores it.
    pub transport: Transport,
    /// (Prefill) the order in which the engine computes the rank's layers, which the layer
    /// ranges of [`PrefillNode::submit_chunk_layers`](crate::PrefillNode::submit_chunk_layers)
    /// index (default: the layer groups stacked in group order; a model whose groups
    /// interleave, as Gemma 3's local and global layers do, lists each layer's group).
    pub layer_order: LayerOrder,
    /// The TCP settings [`PrefillNode::tcp`](crate::PrefillNode::tcp) and
    /// [`DecodeNode::tcp`](crate::DecodeNode::tcp) use (`transport` is the one place for new
    /// code: `Transport::Tcp` carries its own).
    pub tcp: TcpConfig,
}

impl NodeConfig {
    /// Default deadlines and TCP settings around `layout`.
    pub fn new(layout: Vec<LayerGroupLayout>) -> Self {
        NodeConfig {
            layout,
            topology: Topology::default(),
            instance: None,
            deadlines: Deadlines::default(),
            grant_seed: None,
            layer_order: LayerOrder::stacked(),
            transport: Transport::Tcp(TcpConfig::default()),
            tcp: TcpConfig::default(),
        }
    }

    /// The same configuration over `transport`.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    fn local(&self) -> LocalHello {
        LocalHello::new(
            self.instance.unwrap_or_else(instance_id),
            self.topology,
            self.layout.clone(),
        )
    }

    /// The core sender's configuration.
    pub fn sender_config(&self) -> SenderConfig {
        let mut config = SenderConfig::new(self.local());
        config.deadlines = self.deadlines;
        config.layer_order = self.layer_order.clone();
        config
    }

    /// The core receiver's configuration.
    pub fn receiver_config(&self) -> ReceiverConfig {
        let seed = self.grant_seed.unwrap_or_else(|| instance_id().0);
        let mut config = ReceiverConfig::new(self.local(), seed);
        config.deadlines = self.deadlines;
        config
    }
}

/// An instance id for this process: the process id and the wall clock, so a restarted process
/// is told apart from its predecessor.
pub fn instance_id() -> InstanceId {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    InstanceId(nanos ^ (u64::from(std::process::id()) << 40))
}

/// The TCP transport's table of `regions`: host regions read and written in place, GPU
/// regions (`cuda` feature) through pinned staging or peer copies.
///
/// # Safety
/// As [`RawRegion`].
pub(crate) unsafe fn tcp_regions(regions: &[RawRegion]) -> Result<RegionTable, EmbedError> {
    let mut table = RegionTable::new();
    for r in regions {
        match r.device {
            None => {
                // SAFETY: the caller keeps the bytes valid while the node exists (RawRegion's
                // contract, forwarded).
                table.insert(r.id, unsafe { MemoryRegion::from_raw_parts(r.ptr, r.len) });
            }
            #[cfg(feature = "cuda")]
            Some(ordinal) => {
                // SAFETY: as above; `ptr` is device memory of GPU `ordinal` (RawRegion's
                // contract), which the transport only reaches through the driver's copies.
                let region = unsafe {
                    kvpipe_tcp::DeviceRegion::from_raw_parts(ordinal as usize, r.ptr as u64, r.len)
                };
                table.insert_device(r.id, region);
            }
            #[cfg(not(feature = "cuda"))]
            Some(ordinal) => return Err(crate::gpu::refuse(r.id, ordinal)),
        }
    }
    Ok(table)
}

/// Each region's id and length, for the core's checks of the blocks a request names
/// ([`SenderConfig::region_bytes`], [`ReceiverConfig::region_bytes`]).
pub(crate) fn region_bytes(regions: &[RawRegion]) -> Vec<(RegionId, u64)> {
    regions.iter().map(|r| (r.id, r.len as u64)).collect()
}

/// Refuses a layout whose groups break a rule every layout keeps
/// ([`kvpipe_core::plan::check_layout`], named as `side`'s), regions that share an id or have a
/// null address, GPU regions this build or machine cannot serve (see [`crate::gpu::check`]),
/// and a layout whose pools name a region that is not given (every write to or from it would
/// fail at run time instead).
pub(crate) fn check_regions(
    config: &NodeConfig,
    regions: &[RawRegion],
    side: Side,
) -> Result<(), EmbedError> {
    for (group, layout) in config.layout.iter().enumerate() {
        kvpipe_core::plan::check_layout(side, layout)
            .map_err(|error| ConfigError::Layout { group, error })?;
    }
    let mut seen = std::collections::HashSet::new();
    for r in regions {
        if r.ptr.is_null() && r.len > 0 {
            return Err(EmbedError::NullRegion(r.id));
        }
        if !seen.insert(r.id) {
            return Err(EmbedError::DuplicateRegion(r.id));
        }
    }
    if side == Side::Receiver {
        // Per address space (host, each GPU), in address order: each region must end before
        // the next begins.
        let mut spans: Vec<_> = (regions.iter())
            .filter(|r| r.len > 0)
            .map(|r| (r.device, r.ptr as usize, r.len, r.id))
            .collect();
        spans.sort_by_key(|&(device, start, _, _)| (device, start));
        for w in spans.windows(2) {
            let ((d0, s0, l0, a), (d1, s1, _, b)) = (w[0], w[1]);
            if d0 == d1 && s1 < s0.saturating_add(l0) {
                return Err(EmbedError::OverlappingRegions { a, b });
            }
        }
    }
    crate::gpu::check(regions.iter().map(|r| (r.id, r.device)))?;
    for (g, group) in config.layout.iter().enumerate() {
        if let Some(pool) = group.pools.iter().find(|p| !seen.contains(&p.region)) {
            return Err(EmbedError::MissingRegion {
                group: g,
                region: pool.region,
            });
        }
    }
    Ok(())
}
