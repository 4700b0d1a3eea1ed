//! The suite's harness over the RDMA verbs transport (`kvpipe-ibverbs`): a sender node and a
//! receiver node in one process, each with its own fabric and completion poller, connected
//! over a loopback bootstrap, with the reference caches' pools registered by address (the
//! receiver's for remote writes). It needs an RDMA device (Soft-RoCE in the test guest).
//! Frame and write faults are not injected (those scenarios are skipped); killing a side
//! shuts its node down, which the other side sees as a lost link.

use std::time::Duration as StdDuration;

use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::wire::Role;
use kvpipe_core::{Event, Instant, PeerId, Receiver, Sender};
use kvpipe_ibverbs::{
    DeviceSpec, EndpointGuard, Exposure, MemoryTable, VerbsConfig, VerbsDevice, VerbsReceiver,
    VerbsSender,
};

use super::{BatchTiming, FaultKind, FaultPlan, Harness, Link, LinkError};
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
pub struct VerbsLink {
    tx: Option<VerbsSender>,
    rx: Option<VerbsReceiver>,
    tx_guard: Option<EndpointGuard<Sender>>,
    rx_guard: Option<EndpointGuard<Receiver>>,
    sender_peer: PeerId,
    receiver_peer: PeerId,
    origin: std::time::Instant,
}

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
        Ok(VerbsLink {
            tx: Some(tx),
            rx: Some(rx),
            tx_guard: None,
            rx_guard: None,
            sender_peer: PeerId(0),
            receiver_peer,
            origin,
        })
    }
}

impl VerbsLink {
    fn release(&mut self) {
        self.tx_guard = None;
        self.rx_guard = None;
    }
}

impl Link for VerbsLink {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.origin.elapsed().as_nanos() as u64)
    }

    fn sender(&mut self) -> &mut Sender {
        if self.tx_guard.is_none() {
            let node = self.tx.as_ref().expect("the sender is alive");
            self.tx_guard = Some(node.endpoint());
        }
        self.tx_guard.as_mut().expect("just set")
    }

    fn receiver(&mut self) -> &mut Receiver {
        if self.rx_guard.is_none() {
            let node = self.rx.as_ref().expect("the receiver is alive");
            self.rx_guard = Some(node.endpoint());
        }
        self.rx_guard.as_mut().expect("just set")
    }

    fn sender_peer(&self) -> PeerId {
        self.sender_peer
    }

    fn receiver_peer(&self) -> PeerId {
        self.receiver_peer
    }

    fn pump(&mut self) -> Result<(), LinkError> {
        self.release();
        Ok(())
    }

    fn wait(&mut self, max: StdDuration) {
        self.release();
        std::thread::sleep(max.min(StdDuration::from_millis(1)));
    }

    fn take_events(&mut self) -> Vec<(Role, Instant, Event)> {
        self.release();
        let mut out: Vec<(Role, Instant, Event)> = Vec::new();
        if let Some(tx) = &self.tx {
            out.extend(
                tx.take_events()
                    .into_iter()
                    .map(|(at, e)| (Role::Sender, at, e)),
            );
        }
        if let Some(rx) = &self.rx {
            out.extend(
                rx.take_events()
                    .into_iter()
                    .map(|(at, e)| (Role::Receiver, at, e)),
            );
        }
        out.sort_by_key(|(_, at, _)| *at);
        out
    }

    fn kill(&mut self, side: Role) -> Result<(), LinkError> {
        self.release();
        match side {
            Role::Sender => drop(self.tx.take()),
            Role::Receiver => drop(self.rx.take()),
        }
        Ok(())
    }

    fn is_alive(&self, side: Role) -> bool {
        match side {
            Role::Sender => self.tx.is_some(),
            Role::Receiver => self.rx.is_some(),
        }
    }

    fn writes_in_flight(&self) -> usize {
        match (&self.tx_guard, &self.tx) {
            (Some(guard), _) => guard.writes_in_flight(),
            (None, Some(tx)) => tx.writes_in_flight(),
            (None, None) => 0,
        }
    }

    fn batch_timings(&self) -> Vec<BatchTiming> {
        let timings = match (&self.tx_guard, &self.tx) {
            (Some(guard), _) => guard.batch_timings(),
            (None, Some(tx)) => tx.batch_timings(),
            (None, None) => Vec::new(),
        };
        timings
            .into_iter()
            .map(|(bytes, issued, reported)| BatchTiming {
                bytes,
                issued,
                transfer: reported - issued,
                reported,
            })
            .collect()
    }
}

impl Drop for VerbsLink {
    fn drop(&mut self) {
        self.release();
        self.tx = None;
        self.rx = None;
    }
}
