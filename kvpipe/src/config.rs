//! What a node is made from: the KV layout, the handshake's identity, deadlines, the TCP
//! settings, and the engine's memory.

use kvpipe_core::session::{Deadlines, LocalHello};
use kvpipe_core::wire::Topology;
use kvpipe_core::{InstanceId, LayerGroupLayout, ReceiverConfig, RegionId, SenderConfig};
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig};

/// One region of the engine's memory (a KV pool), lent to a node by address.
///
/// Whoever makes a node from it promises what [`MemoryRegion::from_raw_parts`] asks: the bytes
/// stay valid (not freed, not moved) while the node exists, and the engine leaves a request's
/// blocks alone from the chunk that sends them (prefill) or the registration (decode) until the
/// request's `Quiesced` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawRegion {
    /// The id the layout's pools name ([`kvpipe_core::PoolLayout::region`]).
    pub id: RegionId,
    /// First byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
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
    /// The TCP transport's settings (connections per peer, socket call sizes, close grace).
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
            tcp: TcpConfig::default(),
        }
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

/// The TCP transport's table of `regions`.
///
/// # Safety
/// As [`RawRegion`].
pub(crate) unsafe fn tcp_regions(regions: &[RawRegion]) -> RegionTable {
    regions
        .iter()
        .map(|r| {
            // SAFETY: the caller keeps the bytes valid while the node exists (RawRegion's
            // contract, forwarded).
            (r.id, unsafe { MemoryRegion::from_raw_parts(r.ptr, r.len) })
        })
        .collect()
}

/// Refuses regions that share an id or have a null address, and a layout whose pools name a
/// region that is not given (every write to or from it would fail at run time instead).
pub(crate) fn check_regions(
    config: &NodeConfig,
    regions: &[RawRegion],
) -> Result<(), crate::EmbedError> {
    let mut seen = std::collections::HashSet::new();
    for r in regions {
        if r.ptr.is_null() && r.len > 0 {
            return Err(crate::EmbedError::NullRegion(r.id));
        }
        if !seen.insert(r.id) {
            return Err(crate::EmbedError::DuplicateRegion(r.id));
        }
    }
    for (g, group) in config.layout.iter().enumerate() {
        if let Some(pool) = group.pools.iter().find(|p| !seen.contains(&p.region)) {
            return Err(crate::EmbedError::MissingRegion {
                group: g,
                region: pool.region,
            });
        }
    }
    Ok(())
}
