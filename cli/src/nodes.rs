//! The nodes of a two-process transfer (`kvpipe demo --connect`, `kvpipe serve`): the engine
//! API's [`PrefillNode`] and [`DecodeNode`] over TCP or RDMA verbs, on the reference cache's
//! pools, made as an engine makes them.

use kvpipe::{
    DecodeNode, DeviceSpec, EmbedError, NodeConfig, PrefillNode, RawRegion, TcpConfig, TcpDataPath,
    Transport, VerbsConfig,
};
use kvpipe_conformance::cache::ReferenceCache;

use super::CliError;

/// A transport of the two-process commands.
#[derive(Clone, Debug)]
pub(crate) enum TransportChoice {
    /// TCP with this many connections per peer.
    Tcp(usize),
    /// RDMA verbs on this device (`None`: the first active one).
    Verbs(Option<String>),
}

impl TransportChoice {
    /// Parses `--transport` (with `--connections` and `--device`).
    pub(crate) fn parse(
        transport: &str,
        connections: usize,
        device: Option<&str>,
    ) -> Result<Self, CliError> {
        match transport {
            "tcp" => Ok(TransportChoice::Tcp(connections.clamp(1, 255))),
            "verbs" => Ok(TransportChoice::Verbs(device.map(str::to_string))),
            t => {
                Err(format!("transport {t:?} cannot run across processes; use tcp or verbs").into())
            }
        }
    }

    /// The transport's name in reports.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            TransportChoice::Tcp(_) => "tcp",
            TransportChoice::Verbs(_) => "verbs",
        }
    }

    /// The engine API's transport for this choice.
    fn transport(&self, data_path: TcpDataPath) -> Transport {
        match self {
            TransportChoice::Tcp(connections) => Transport::Tcp(TcpConfig {
                connections_per_peer: *connections,
                data_path,
                ..TcpConfig::default()
            }),
            TransportChoice::Verbs(device) => Transport::Verbs(VerbsConfig {
                device: device
                    .as_deref()
                    .map_or_else(DeviceSpec::default, DeviceSpec::named),
                ..VerbsConfig::default()
            }),
        }
    }

    /// `e`, with a hint where the verbs transport found no RDMA device.
    fn explain(&self, e: EmbedError) -> CliError {
        match (self, &e) {
            (TransportChoice::Verbs(_), EmbedError::Io(io))
                if io.kind() == std::io::ErrorKind::NotFound =>
            {
                format!(
                    "--transport verbs: {e} (scripts/rxe-vm.sh runs kvpipe in a guest with a \
                     Soft-RoCE device)"
                )
                .into()
            }
            _ => e.into(),
        }
    }
}

/// Parses `--data-path`: auto (peer copies when both sides' pools are device memory and the
/// two processes share a host, else the sockets), peer-copy (peer copies or a failed connect,
/// with the reason) or socket.
pub(crate) fn parse_data_path(s: &str) -> Result<TcpDataPath, String> {
    match s {
        "auto" => Ok(TcpDataPath::Auto),
        "peer-copy" => Ok(TcpDataPath::PeerCopy),
        "socket" => Ok(TcpDataPath::Socket),
        other => Err(format!(
            "unknown data path {other:?}; choose auto, peer-copy or socket"
        )),
    }
}

/// Opens the device `--device` names, or the first active one (for the commands that drive the
/// verbs transport's own nodes: the in-process demo and `bench transfer`).
pub(crate) fn open_device(device: Option<&str>) -> Result<kvpipe_ibverbs::VerbsDevice, CliError> {
    let spec = device.map_or_else(DeviceSpec::default, DeviceSpec::named);
    kvpipe_ibverbs::VerbsDevice::open(&spec).map_err(|e| {
        format!(
            "--transport verbs needs an active RDMA device: {e} (without RDMA hardware, \
             scripts/rxe-vm.sh runs kvpipe in a guest with a Soft-RoCE device)"
        )
        .into()
    })
}

/// Every pool of `cache` as the engine API takes it: host memory, or device memory where the
/// cache placed its pools on a GPU.
///
/// # Safety
/// `cache` outlives the node made from the regions and never moves its pools.
unsafe fn cache_regions(cache: &mut ReferenceCache) -> Vec<RawRegion> {
    let ids: Vec<_> = cache.region_ids().collect();
    ids.into_iter()
        .map(|id| {
            #[cfg(feature = "cuda")]
            if let Some(pool) = cache.device_pool(id) {
                return RawRegion {
                    id,
                    ptr: pool.ptr as *mut u8,
                    len: pool.len,
                    device: Some(pool.ordinal as u32),
                };
            }
            RawRegion::host(id, cache.region_mut(id).unwrap_or_default())
        })
        .collect()
}

/// The prefill side's node over `cache`'s pools.
///
/// # Safety
/// `cache` outlives the node and never moves its pools; the engine leaves a request's blocks
/// alone from the chunk that sends them until the request's `Quiesced`.
pub(crate) unsafe fn prefill_node(
    transport: &TransportChoice,
    config: NodeConfig,
    cache: &mut ReferenceCache,
    data_path: TcpDataPath,
) -> Result<PrefillNode, CliError> {
    let config = config.with_transport(transport.transport(data_path));
    // SAFETY: forwarded from the caller.
    unsafe { PrefillNode::new(&config, &cache_regions(cache)) }.map_err(|e| transport.explain(e))
}

/// The decode side's node over `cache`'s pools.
///
/// # Safety
/// As [`prefill_node`], from the registration until the request's `Quiesced`.
pub(crate) unsafe fn decode_node(
    transport: &TransportChoice,
    config: NodeConfig,
    cache: &mut ReferenceCache,
    data_path: TcpDataPath,
) -> Result<DecodeNode, CliError> {
    let config = config.with_transport(transport.transport(data_path));
    // SAFETY: forwarded from the caller.
    unsafe { DecodeNode::new(&config, &cache_regions(cache)) }.map_err(|e| transport.explain(e))
}
