//! The suite's harness over the RDMA verbs transport (`kvpipe-ibverbs`): a sender node and a
//! receiver node in one process, each with its own fabric and completion poller, connected
//! over a loopback bootstrap, with the reference caches' pools registered by address (the
//! receiver's for remote writes). It needs an RDMA device (Soft-RoCE in the test guest).
//! Frame and write faults are not injected (those scenarios are skipped); killing a side
//! shuts its node down, which the other side sees as a lost link.

use std::time::Duration as StdDuration;

use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::PeerId;
use kvpipe_ibverbs::{
    DeviceSpec, Exposure, MemoryTable, VerbsConfig, VerbsDevice, VerbsReceiver, VerbsSender,
};

use super::threaded::ThreadedLink;
use super::{FaultKind, FaultPlan, Harness, LinkError};
use crate::cache::ReferenceCache;

/// Runs the suite over two verbs nodes on one device.
#[derive(Clone, Debug, Default)]
pub struct VerbsHarness {
    /// The device (`None`: `KVPIPE_VERBS_DEVICE` if set, else the first active device).
    pub device: Option<String>,
}

impl VerbsHarness {
    /// The harness on the named device.
    pub fn on(device: impl Into<String>) -> Self {
        VerbsHarness {
            device: Some(device.into()),
        }
    }

    /// Registers every region of `cache` with `device`, by address.
    ///
    /// # Safety
    ///
    /// The cache must outlive every node built on the table and keep its regions where they are
    /// (the reference cache never reallocates a region).
    pub unsafe fn register_cache(
        cache: &mut ReferenceCache,
        device: &VerbsDevice,
        exposure: Exposure,
    ) -> Result<MemoryTable, LinkError> {
        let ids: Vec<_> = cache.region_ids().collect();
        let mut table = MemoryTable::new();
        for id in ids {
            let bytes = cache.region_mut(id).unwrap_or_default();
            // SAFETY: forwarded from the caller; the sessions pin blocks until quiesced.
            unsafe { table.register_host(device, id, bytes.as_mut_ptr(), bytes.len(), exposure) }
                .map_err(transport)?;
        }
        Ok(table)
    }

    /// Opens the harness's device.
    pub fn open_device(&self) -> Result<VerbsDevice, LinkError> {
        let name = self
            .device
            .clone()
            .or_else(|| std::env::var("KVPIPE_VERBS_DEVICE").ok());
        let spec = name.map_or_else(DeviceSpec::default, DeviceSpec::named);
        VerbsDevice::open(&spec).map_err(transport)
    }
}

/// A sender node and a receiver node on one device, as the suite drives them.
pub type VerbsLink = ThreadedLink<VerbsSender, VerbsReceiver>;

fn transport(e: impl std::fmt::Display) -> LinkError {
    LinkError::Transport(e.to_string())
}

impl Harness for VerbsHarness {
    type Link = VerbsLink;

    fn name(&self) -> &'static str {
        "verbs"
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
    ) -> Result<VerbsLink, LinkError> {
        if faults.is_active() {
            return Err(LinkError::Unsupported(FaultKind::Frames));
        }
        let device = self.open_device()?;
        let origin = std::time::Instant::now();
        let verbs = VerbsConfig {
            origin: Some(origin),
            ..VerbsConfig::default()
        };
        // SAFETY: the caller keeps both caches alive and unmoved while the link lives.
        let (tx_regions, rx_regions) = unsafe {
            (
                Self::register_cache(sender_cache, &device, Exposure::Local)?,
                Self::register_cache(receiver_cache, &device, Exposure::RemoteWrite)?,
            )
        };
        let rx = VerbsReceiver::receiver(receiver, device.clone(), rx_regions, verbs.clone())
            .map_err(transport)?;
        let addr = rx.listen("127.0.0.1:0").map_err(transport)?;
        let tx = VerbsSender::sender(sender, device, tx_regions, verbs).map_err(transport)?;
        let receiver_peer = tx.connect(addr).map_err(transport)?;
        // The receiver numbers its links from 0: its first is the sender. Its side of the link
        // comes up just after the sender's — or is already gone again when the handshake was
        // refused (a version mismatch): the sender's link going down ends the wait too, and the
        // scenario checks what both sides reported.
        let start = std::time::Instant::now();
        while rx.fabric().links().is_empty() && !tx.fabric().links().is_empty() {
            if start.elapsed() > StdDuration::from_secs(10) {
                return Err(LinkError::Transport("the receiver never accepted".into()));
            }
            std::thread::sleep(StdDuration::from_millis(1));
        }
        Ok(ThreadedLink::new(
            tx,
            rx,
            PeerId(0),
            receiver_peer,
            origin,
            (),
        ))
    }
}
