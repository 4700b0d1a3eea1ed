//! The suite's harness over the TCP transport (`kvpipe-tcp`): a sender node and a receiver
//! node in one process, connected over loopback sockets, with the reference caches' memory
//! registered by address. Frame and write faults are not injected (those scenarios are skipped);
//! killing a side shuts its node down, which the other side sees as a lost connection.

use std::time::Duration as StdDuration;

use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::PeerId;
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig, TcpReceiver, TcpSender};

use super::threaded::ThreadedLink;
use super::{FaultKind, FaultPlan, Harness, LinkError, PoolMemory};
use crate::cache::ReferenceCache;

/// Runs the suite over two TCP nodes on loopback.
#[derive(Clone, Copy, Debug)]
pub struct TcpHarness {
    /// Connections per peer.
    pub connections: usize,
    /// Where both caches' pools live (device memory: through the transport's pinned staging).
    pub memory: PoolMemory,
    /// Run the nodes on the async driver (a two-worker tokio runtime owned by the link) instead
    /// of the blocking one.
    #[cfg(feature = "tokio")]
    pub tokio: bool,
}

impl TcpHarness {
    /// Registers every region of `cache` by address (its device pools once it is placed on a
    /// device).
    ///
    /// # Safety
    ///
    /// The cache must outlive every node built on the table and keep its regions where they are
    /// (the reference cache never reallocates a region; see [`Harness::connect`]).
    pub unsafe fn register_cache(cache: &mut ReferenceCache) -> RegionTable {
        let ids: Vec<_> = cache.region_ids().collect();
        let mut table = RegionTable::new();
        for id in ids {
            #[cfg(feature = "cuda")]
            if let Some(pool) = cache.device_pool(id) {
                // SAFETY: the cache owns the device buffer and outlives the node (the caller's
                // contract); the sessions pin blocks until quiesced.
                let region = unsafe {
                    kvpipe_tcp::DeviceRegion::from_raw_parts(pool.ordinal, pool.ptr, pool.len)
                };
                table.insert_device(id, region);
                continue;
            }
            let bytes = cache.region_mut(id).unwrap_or_default();
            // SAFETY: forwarded from the caller; the sessions pin blocks until quiesced.
            let region = unsafe { MemoryRegion::from_raw_parts(bytes.as_mut_ptr(), bytes.len()) };
            table.insert(id, region);
        }
        table
    }

    /// The blocking driver with `connections` connections per peer.
    pub fn blocking(connections: usize) -> Self {
        TcpHarness {
            connections,
            memory: PoolMemory::Host,
            #[cfg(feature = "tokio")]
            tokio: false,
        }
    }

    /// The async driver with `connections` connections per peer.
    #[cfg(feature = "tokio")]
    pub fn tokio(connections: usize) -> Self {
        TcpHarness {
            connections,
            memory: PoolMemory::Host,
            tokio: true,
        }
    }
}

impl Default for TcpHarness {
    fn default() -> Self {
        TcpHarness::blocking(2)
    }
}

/// A sender node and a receiver node connected over loopback, as the suite drives them.
pub type TcpLink = ThreadedLink<TcpSender, TcpReceiver, Runtime>;

/// What the link holds until both nodes are gone: the async driver's runtime, if it runs on one.
#[cfg(feature = "tokio")]
type Runtime = Option<tokio::runtime::Runtime>;
#[cfg(not(feature = "tokio"))]
type Runtime = ();

fn transport(e: impl std::fmt::Display) -> LinkError {
    LinkError::Transport(e.to_string())
}

impl Harness for TcpHarness {
    type Link = TcpLink;

    fn name(&self) -> &'static str {
        #[cfg(feature = "tokio")]
        if self.tokio {
            return "tcp (tokio)";
        }
        "tcp"
    }

    fn supports(&self, kind: FaultKind) -> bool {
        kind == FaultKind::PeerDeath
    }

    unsafe fn connect(
        &self,
        sender: SenderConfig,
        receiver: ReceiverConfig,
        sender_cache: &mut ReferenceCache,
        receiver_cache: &mut ReferenceCache,
        faults: &FaultPlan,
    ) -> Result<TcpLink, LinkError> {
        if faults.is_active() {
            return Err(LinkError::Unsupported(FaultKind::Frames));
        }
        self.memory.place(sender_cache)?;
        self.memory.place(receiver_cache)?;
        let origin = std::time::Instant::now();
        let tcp = TcpConfig {
            connections_per_peer: self.connections,
            min_piece_bytes: 4096,
            origin: Some(origin),
            ..TcpConfig::default()
        };
        // SAFETY: the caller keeps both caches alive and unmoved while the link lives.
        let (tx_regions, rx_regions) = unsafe {
            (
                Self::register_cache(sender_cache),
                Self::register_cache(receiver_cache),
            )
        };
        #[cfg(feature = "tokio")]
        let runtime = if self.tokio {
            Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(transport)?,
            )
        } else {
            None
        };
        #[cfg(feature = "tokio")]
        if let Some(rt) = &runtime {
            use kvpipe_tcp::tokio_driver;
            let handle = rt.handle().clone();
            let rx = tokio_driver::TcpReceiver::new(receiver, tcp.clone(), rx_regions, handle)
                .map_err(transport)?;
            let addr = rx.listen("127.0.0.1:0").map_err(transport)?;
            let tx = tokio_driver::TcpSender::new(sender, tcp, tx_regions, rt.handle().clone())
                .map_err(transport)?;
            let peer = rt.block_on(tx.connect(addr)).map_err(transport)?;
            return Self::link(origin, tx.into_inner(), rx.into_inner(), peer, runtime);
        }
        let rx = TcpReceiver::new(receiver, tcp.clone(), rx_regions).map_err(transport)?;
        let addr = rx.listen("127.0.0.1:0").map_err(transport)?;
        let tx = TcpSender::new(sender, tcp, tx_regions).map_err(transport)?;
        let peer = tx.connect(addr).map_err(transport)?;
        #[cfg(not(feature = "tokio"))]
        let runtime = ();
        Self::link(origin, tx, rx, peer, runtime)
    }
}

impl TcpHarness {
    /// The link over connected nodes, once the receiver accepted the sender.
    fn link(
        origin: std::time::Instant,
        tx: TcpSender,
        rx: TcpReceiver,
        receiver_peer: PeerId,
        runtime: Runtime,
    ) -> Result<TcpLink, LinkError> {
        let start = std::time::Instant::now();
        // A node numbers its peers from 0 in the order they connect: the receiver's first
        // accepted connection is the sender (it may already be gone after a rejected handshake).
        let sender_peer = loop {
            if rx.stats().connections > 0 {
                break PeerId(0);
            }
            if start.elapsed() > StdDuration::from_secs(5) {
                return Err(LinkError::Transport("the receiver never accepted".into()));
            }
            std::thread::sleep(StdDuration::from_millis(1));
        };
        Ok(ThreadedLink::new(
            tx,
            rx,
            sender_peer,
            receiver_peer,
            origin,
            runtime,
        ))
    }
}
