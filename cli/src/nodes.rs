//! The prefill and decode nodes of a two-process transfer (`kvpipe demo --connect`, `kvpipe
//! serve`), over TCP or RDMA verbs: one enum per role, so the commands drive either the same way.

use std::time::Duration;

use kvpipe_conformance::cache::ReferenceCache;
use kvpipe_conformance::suite::{TcpHarness, VerbsHarness};
use kvpipe_core::session::{Registration, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, Event, Instant, PeerId, ReceiverConfig, ReceiverSliceId, RequestId,
    SenderConfig, Submitted,
};
use kvpipe_ibverbs::{
    DeviceSpec, Exposure, MemoryTable, VerbsConfig, VerbsDevice, VerbsReceiver, VerbsSender,
};
use kvpipe_tcp::{TcpConfig, TcpDataPath, TcpReceiver, TcpSender};

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
}

/// Parses `--data-path`: auto (peer copies when both sides' pools are device memory and the
/// decode side's CUDA IPC handles open here — the same host — else the sockets), peer-copy
/// (peer copies or a failed connect, with the reason) or socket.
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

/// Opens the device `--device` names, or the first active one.
pub(crate) fn open_device(device: Option<&str>) -> Result<VerbsDevice, CliError> {
    let spec = device.map_or_else(DeviceSpec::default, DeviceSpec::named);
    VerbsDevice::open(&spec).map_err(|e| {
        format!(
            "--transport verbs needs an active RDMA device: {e} (without RDMA hardware, \
             scripts/rxe-vm.sh runs kvpipe in a guest with a Soft-RoCE device)"
        )
        .into()
    })
}

/// Registers every region of `cache` with `device`.
///
/// # Safety
/// As [`TcpHarness::register_cache`]: `cache` outlives the node and never moves its regions.
unsafe fn verbs_regions(
    cache: &mut ReferenceCache,
    device: &VerbsDevice,
    exposure: Exposure,
) -> Result<MemoryTable, CliError> {
    // SAFETY: forwarded from the caller.
    Ok(unsafe { VerbsHarness::register_cache(cache, device, exposure)? })
}

/// The prefill side's node.
pub(crate) enum PrefillNode {
    Tcp(TcpSender),
    Verbs(VerbsSender),
}

impl PrefillNode {
    /// A node over `cache`'s regions.
    ///
    /// # Safety
    /// As [`TcpHarness::register_cache`].
    pub(crate) unsafe fn new(
        transport: &TransportChoice,
        config: SenderConfig,
        cache: &mut ReferenceCache,
        data_path: TcpDataPath,
    ) -> Result<Self, CliError> {
        Ok(match transport {
            TransportChoice::Tcp(connections) => {
                let tcp = TcpConfig {
                    connections_per_peer: *connections,
                    data_path,
                    ..TcpConfig::default()
                };
                // SAFETY: forwarded from the caller.
                PrefillNode::Tcp(TcpSender::new(config, tcp, unsafe {
                    TcpHarness::register_cache(cache)
                })?)
            }
            TransportChoice::Verbs(device) => {
                let device = open_device(device.as_deref())?;
                // SAFETY: forwarded from the caller.
                let table = unsafe { verbs_regions(cache, &device, Exposure::Local)? };
                PrefillNode::Verbs(VerbsSender::sender(
                    config,
                    device,
                    table,
                    VerbsConfig::default(),
                )?)
            }
        })
    }

    /// How the data moved: "peer-copy" (CUDA IPC), "socket" (TCP) or "rdma".
    pub(crate) fn data_path(&self) -> &'static str {
        match self {
            PrefillNode::Tcp(n) if n.stats().peer_copy_peers > 0 => "peer-copy",
            PrefillNode::Tcp(_) => "socket",
            PrefillNode::Verbs(_) => "rdma",
        }
    }

    /// Bytes this node copied straight into the decode side's memory (peer copies).
    pub(crate) fn bytes_placed(&self) -> u64 {
        match self {
            PrefillNode::Tcp(n) => n.stats().bytes_placed,
            PrefillNode::Verbs(_) => 0,
        }
    }

    pub(crate) fn connect(&self, addr: &str) -> Result<PeerId, CliError> {
        let connected = match self {
            PrefillNode::Tcp(n) => n.connect(addr).map_err(CliError::from),
            PrefillNode::Verbs(n) => n.connect(addr).map_err(CliError::from),
        };
        connected.map_err(|e| format!("connecting to {addr}: {e}").into())
    }

    pub(crate) fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self {
            PrefillNode::Tcp(n) => n.next_event(timeout),
            PrefillNode::Verbs(n) => n.next_event(timeout),
        }
    }

    pub(crate) fn next_event_at(&self, timeout: Duration) -> Option<(Instant, Event)> {
        match self {
            PrefillNode::Tcp(n) => n.next_event_at(timeout),
            PrefillNode::Verbs(n) => n.next_event_at(timeout),
        }
    }

    pub(crate) fn open_request(&self, req: SendRequest) -> Result<(), UsageError> {
        match self {
            PrefillNode::Tcp(n) => n.open_request(req),
            PrefillNode::Verbs(n) => n.open_request(req),
        }
    }

    pub(crate) fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        match self {
            PrefillNode::Tcp(n) => n.submit_chunk(request, spec, source),
            PrefillNode::Verbs(n) => n.submit_chunk(request, spec, source),
        }
    }

    pub(crate) fn submit_aux(&self, request: RequestId, data: AuxData) -> Result<(), UsageError> {
        match self {
            PrefillNode::Tcp(n) => n.submit_aux(request, data),
            PrefillNode::Verbs(n) => n.submit_aux(request, data),
        }
    }

    pub(crate) fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        match self {
            PrefillNode::Tcp(n) => n.retire(request),
            PrefillNode::Verbs(n) => n.retire(request),
        }
    }

    /// Closes in order (what is queued reaches the peer first), bounded by `within`.
    pub(crate) fn close(self, within: Duration) -> Result<(), CliError> {
        match self {
            PrefillNode::Tcp(n) => Ok(n.close(within)?),
            PrefillNode::Verbs(n) => close_verbs(n.close(within)),
        }
    }
}

fn close_verbs(clean: bool) -> Result<(), CliError> {
    if clean {
        Ok(())
    } else {
        Err("some links did not close in order before the deadline".into())
    }
}

/// The decode side's node.
pub(crate) enum DecodeNode {
    Tcp(TcpReceiver),
    Verbs(VerbsReceiver),
}

impl DecodeNode {
    /// A node over `cache`'s regions.
    ///
    /// # Safety
    /// As [`TcpHarness::register_cache`].
    pub(crate) unsafe fn new(
        transport: &TransportChoice,
        config: ReceiverConfig,
        cache: &mut ReferenceCache,
        data_path: TcpDataPath,
    ) -> Result<Self, CliError> {
        Ok(match transport {
            TransportChoice::Tcp(_) => {
                // SAFETY: forwarded from the caller.
                let regions = unsafe { TcpHarness::register_cache(cache) };
                let tcp = TcpConfig {
                    data_path,
                    ..TcpConfig::default()
                };
                DecodeNode::Tcp(TcpReceiver::new(config, tcp, regions)?)
            }
            TransportChoice::Verbs(device) => {
                let device = open_device(device.as_deref())?;
                // SAFETY: forwarded from the caller.
                let table = unsafe { verbs_regions(cache, &device, Exposure::RemoteWrite)? };
                DecodeNode::Verbs(VerbsReceiver::receiver(
                    config,
                    device,
                    table,
                    VerbsConfig::default(),
                )?)
            }
        })
    }

    pub(crate) fn listen(&self, addr: &str) -> Result<std::net::SocketAddr, CliError> {
        Ok(match self {
            DecodeNode::Tcp(n) => n.listen(addr)?,
            DecodeNode::Verbs(n) => n.listen(addr)?,
        })
    }

    pub(crate) fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self {
            DecodeNode::Tcp(n) => n.next_event(timeout),
            DecodeNode::Verbs(n) => n.next_event(timeout),
        }
    }

    pub(crate) fn register(&self, reg: Registration) -> Result<ReceiverSliceId, UsageError> {
        match self {
            DecodeNode::Tcp(n) => n.register(reg),
            DecodeNode::Verbs(n) => n.register(reg),
        }
    }

    pub(crate) fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        match self {
            DecodeNode::Tcp(n) => n.retire(request),
            DecodeNode::Verbs(n) => n.retire(request),
        }
    }

    pub(crate) fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        match self {
            DecodeNode::Tcp(n) => n.cancel(request),
            DecodeNode::Verbs(n) => n.cancel(request),
        }
    }

    /// Whether the handshake with `peer` completed and the peer is still there.
    pub(crate) fn is_peer_ready(&self, peer: PeerId) -> bool {
        match self {
            DecodeNode::Tcp(n) => n.is_peer_ready(peer),
            DecodeNode::Verbs(n) => n.is_peer_ready(peer),
        }
    }

    /// The windows `peer` keeps, group by group (`None`: full attention), from its handshake.
    pub(crate) fn peer_windows(&self, peer: PeerId) -> Option<Vec<Option<u32>>> {
        let windows = |groups: &[kvpipe_core::LayerGroupLayout]| {
            groups.iter().map(|g| g.window).collect::<Vec<_>>()
        };
        match self {
            DecodeNode::Tcp(n) => n.endpoint().peer_groups(peer).map(windows),
            DecodeNode::Verbs(n) => n.endpoint().peer_groups(peer).map(windows),
        }
    }

    /// How the data arrived: "peer-copy" (CUDA IPC), "socket" (TCP) or "rdma".
    pub(crate) fn data_path(&self) -> &'static str {
        match self {
            DecodeNode::Tcp(n) if n.stats().peer_copy_peers > 0 => "peer-copy",
            DecodeNode::Tcp(_) => "socket",
            DecodeNode::Verbs(_) => "rdma",
        }
    }

    /// Data writes the prefill side placed itself and announced without payload.
    pub(crate) fn writes_placed(&self) -> u64 {
        match self {
            DecodeNode::Tcp(n) => n.stats().writes_placed,
            DecodeNode::Verbs(_) => 0,
        }
    }

    /// Writes the transport refused (TCP's grant check; the verbs adapter's refusals fail the
    /// link instead and are not counted here).
    pub(crate) fn writes_refused(&self) -> u64 {
        match self {
            DecodeNode::Tcp(n) => n.stats().writes_refused,
            DecodeNode::Verbs(_) => 0,
        }
    }

    /// Closes in order, bounded by `within`.
    pub(crate) fn close(self, within: Duration) -> Result<(), CliError> {
        match self {
            DecodeNode::Tcp(n) => Ok(n.close(within)?),
            DecodeNode::Verbs(n) => close_verbs(n.close(within)),
        }
    }
}
