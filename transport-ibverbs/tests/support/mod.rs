//! Shared pieces of the device tests: opening the device (loudly), a fabric node whose
//! handler records every event, and waits with deadlines.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpipe_core::RegionId;
use kvpipe_ibverbs::{
    DeviceSpec, Exposure, Fabric, FabricConfig, FabricEvent, FabricHandler, LinkFailure, LinkId,
    MemoryTable, VerbsDevice, WriteFailure,
};

/// Opens the device named by `KVPIPE_VERBS_DEVICE` (or the first active one), or panics with
/// the reason: a test that needs a device must not pass without one.
pub fn open_device() -> VerbsDevice {
    let spec = match std::env::var("KVPIPE_VERBS_DEVICE") {
        Ok(name) => DeviceSpec::named(name),
        Err(_) => DeviceSpec::default(),
    };
    VerbsDevice::open(&spec).unwrap_or_else(|e| {
        panic!("this test needs an RDMA device (run it in the Soft-RoCE guest): {e}")
    })
}

/// An event as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    Connected(LinkId),
    Message(LinkId, Vec<u8>),
    WritesDone(LinkId, u64, Result<(), WriteFailure>),
    Disconnected(LinkId, LinkFailure),
}

#[derive(Default)]
pub struct Recorder {
    events: Mutex<Vec<Recorded>>,
    cv: Condvar,
}

impl FabricHandler for Recorder {
    fn handle(&self, event: FabricEvent) {
        let e = match event {
            FabricEvent::Connected { link } => Recorded::Connected(link),
            FabricEvent::Message { link, bytes } => Recorded::Message(link, bytes),
            FabricEvent::WritesDone {
                link,
                token,
                result,
            } => Recorded::WritesDone(link, token, result),
            FabricEvent::Disconnected { link, cause } => Recorded::Disconnected(link, cause),
        };
        self.events.lock().unwrap().push(e);
        self.cv.notify_all();
    }
}

/// A fabric over some registered regions, recording its events.
pub struct Node {
    // Dropped before the regions it registered.
    pub fabric: Fabric,
    pub recorder: Arc<Recorder>,
    regions: Vec<(RegionId, Vec<u8>)>,
    /// Links `wait_connected` returned already.
    taken: Mutex<Vec<LinkId>>,
}

impl Node {
    pub fn new(
        device: &VerbsDevice,
        config: FabricConfig,
        regions: Vec<(RegionId, Vec<u8>, Exposure)>,
    ) -> Node {
        let mut table = MemoryTable::new();
        let mut kept = Vec::new();
        for (id, mut bytes, exposure) in regions {
            // SAFETY: the Vec's heap buffer is kept (never resized) in `kept` and dropped
            // after the fabric.
            unsafe {
                table
                    .register_host(device, id, bytes.as_mut_ptr(), bytes.len(), exposure)
                    .expect("register");
            }
            kept.push((id, bytes));
        }
        let recorder = Arc::new(Recorder::default());
        let fabric = Fabric::new(device.clone(), table, config, recorder.clone()).expect("fabric");
        Node {
            fabric,
            recorder,
            regions: kept,
            taken: Mutex::new(Vec::new()),
        }
    }

    /// A copy of a region's bytes (read through the raw pointer: the adapter may write it).
    pub fn region(&self, id: RegionId) -> Vec<u8> {
        let (_, bytes) = self.regions.iter().find(|(r, _)| *r == id).expect("region");
        // SAFETY: the buffer is alive; the copy races no Rust reference.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()).to_vec() }
    }

    pub fn events(&self) -> Vec<Recorded> {
        self.recorder.events.lock().unwrap().clone()
    }

    /// Waits until `f` finds something in the events, or panics at the deadline.
    pub fn wait_for<T>(
        &self,
        what: &str,
        within: Duration,
        f: impl Fn(&[Recorded]) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + within;
        let mut ev = self.recorder.events.lock().unwrap();
        loop {
            if let Some(t) = f(&ev) {
                return t;
            }
            let now = Instant::now();
            if now >= deadline {
                panic!("timed out waiting for {what}; events: {:?}", *ev);
            }
            ev = self.recorder.cv.wait_timeout(ev, deadline - now).unwrap().0;
        }
    }

    /// The oldest link that connected and was not returned before (waiting for one).
    pub fn wait_connected(&self, within: Duration) -> LinkId {
        let taken = self.taken.lock().unwrap().clone();
        let link = self.wait_for("a link to connect", within, |ev| {
            ev.iter().find_map(|e| match e {
                Recorded::Connected(l) if !taken.contains(l) => Some(*l),
                _ => None,
            })
        });
        self.taken.lock().unwrap().push(link);
        link
    }

    pub fn wait_messages(&self, link: LinkId, n: usize, within: Duration) -> Vec<Vec<u8>> {
        self.wait_for(&format!("{n} messages on {link}"), within, |ev| {
            let got: Vec<Vec<u8>> = ev
                .iter()
                .filter_map(|e| match e {
                    Recorded::Message(l, b) if *l == link => Some(b.clone()),
                    _ => None,
                })
                .collect();
            (got.len() >= n).then_some(got)
        })
    }

    pub fn wait_writes(
        &self,
        link: LinkId,
        token: u64,
        within: Duration,
    ) -> Result<(), WriteFailure> {
        self.wait_for(&format!("writes {token} on {link}"), within, |ev| {
            ev.iter().find_map(|e| match e {
                Recorded::WritesDone(l, t, r) if *l == link && *t == token => Some(r.clone()),
                _ => None,
            })
        })
    }

    pub fn wait_disconnected(&self, link: LinkId, within: Duration) -> LinkFailure {
        self.wait_for(&format!("{link} to disconnect"), within, |ev| {
            ev.iter().find_map(|e| match e {
                Recorded::Disconnected(l, c) if *l == link => Some(c.clone()),
                _ => None,
            })
        })
    }
}
