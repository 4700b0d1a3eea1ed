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

// ---- session fixtures: a small model layout, pools, a linear block source, nodes ----

use kvpipe_core::session::{Deadlines, LocalHello};
use kvpipe_core::wire::Topology;
use kvpipe_core::{
    BlockId, BlockRun, BlockSource, BlockSourceError, Event, GroupIndex, InstanceId,
    LayerGroupLayout, PoolLayout, ReceiverConfig, RequestId, SenderConfig,
};
use kvpipe_ibverbs::{VerbsConfig, VerbsReceiver, VerbsSender};
use smallvec::smallvec;

/// Tokens per block.
pub const TPB: u32 = 4;
/// Bytes of one layer of one block: kv 2 × heads 2 × tpb 4 × dim 16 × 2 bytes.
pub const LAYER_BLOCK: u64 = 512;

/// One full-attention group of two layers, one pool per layer, pools at `first_region`.
pub fn layout(first_region: u32) -> Vec<LayerGroupLayout> {
    let pool = |i: u32| PoolLayout {
        region: RegionId(first_region + i),
        layer_begin: i as u16,
        layers: 1,
        slot_bytes: LAYER_BLOCK,
    };
    vec![LayerGroupLayout {
        layers: 2,
        kv_factor: 2,
        kv_heads: 2,
        head_dim: 16,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        block_layout: Default::default(),
        shard: Default::default(),
        pools: smallvec![pool(0), pool(1)],
    }]
}

/// The source byte at `offset` of sender region `region`.
pub fn source_byte(region: u32, offset: u64) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 9) ^ (u64::from(region) * 7)) as u8 | 1
}

/// The pools of one side: `slots` slots per pool of `layout`, filled with [`source_byte`]
/// (sender) or zeros (receiver). Keep it alive (and declared before the node) while a node
/// uses it.
pub struct Pools {
    bufs: Vec<(RegionId, Vec<u8>)>,
}

impl Pools {
    pub fn new(layout: &[LayerGroupLayout], slots: u64, filled: bool) -> Pools {
        let mut bufs = Vec::new();
        for g in layout {
            for p in &g.pools {
                let len = p.slot_bytes * slots;
                let bytes = if filled {
                    (0..len).map(|o| source_byte(p.region.0, o)).collect()
                } else {
                    vec![0; len as usize]
                };
                bufs.push((p.region, bytes));
            }
        }
        Pools { bufs }
    }

    /// Registers every pool; `registered_len` can register less of a region than it holds
    /// (the adapter then refuses writes past that length).
    pub fn table(
        &mut self,
        device: &VerbsDevice,
        exposure: Exposure,
        registered_len: impl Fn(RegionId, usize) -> usize,
    ) -> MemoryTable {
        let mut t = MemoryTable::new();
        for (id, bytes) in &mut self.bufs {
            let len = registered_len(*id, bytes.len());
            // SAFETY: the buffers live (unmoved) as long as `self`, which the tests keep
            // alive longer than the node.
            unsafe {
                t.register_host(device, *id, bytes.as_mut_ptr(), len, exposure)
                    .expect("register");
            }
        }
        t
    }

    /// A copy of one slot of a region (read through the raw pointer).
    pub fn slot(&self, region: RegionId, slot: u32) -> Vec<u8> {
        let (_, b) = self
            .bufs
            .iter()
            .find(|(r, _)| *r == region)
            .expect("region");
        let at = (u64::from(slot) * LAYER_BLOCK) as usize;
        // SAFETY: in bounds; a copy, no reference to bytes the adapter may write.
        unsafe { std::slice::from_raw_parts(b.as_ptr().add(at), LAYER_BLOCK as usize).to_vec() }
    }
}

/// Whether receiver slot `dst` holds sender slot `src` in both pools (sender pools 10, 11;
/// receiver pools 20, 21).
pub fn block_matches(src: &Pools, dst: &Pools, src_slot: u32, dst_slot: u32) -> bool {
    (0..2).all(|p| src.slot(RegionId(10 + p), src_slot) == dst.slot(RegionId(20 + p), dst_slot))
}

/// Whether receiver slot `dst` is still all zeros in both pools.
pub fn block_untouched(dst: &Pools, dst_slot: u32) -> bool {
    (0..2).all(|p| dst.slot(RegionId(20 + p), dst_slot).iter().all(|&b| b == 0))
}

/// A block source where a request's block at ordinal `i` sits in slot `base + i`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub base: u32,
    pub blocks: u32,
}

impl BlockSource for Linear {
    fn block_run(
        &mut self,
        _request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end > self.blocks {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: self.blocks,
            });
        }
        out.first_ordinal = begin;
        out.ids.clear();
        out.ids.extend((begin..end).map(|i| BlockId(self.base + i)));
        Ok(())
    }
}

/// Deadlines short enough for tests, long enough for an emulated guest.
pub fn test_deadlines() -> Deadlines {
    Deadlines {
        handshake: kvpipe_core::Duration::from_millis(5000),
        registration: kvpipe_core::Duration::from_millis(10000),
        write_completion: kvpipe_core::Duration::from_millis(10000),
        result_wait: kvpipe_core::Duration::from_millis(20000),
        result_per_token: kvpipe_core::Duration::ZERO,
        result_idle: kvpipe_core::Duration::from_millis(20000),
        aux_wait: kvpipe_core::Duration::from_millis(5000),
        heartbeat_interval: kvpipe_core::Duration::from_millis(200),
        liveness_timeout: kvpipe_core::Duration::from_millis(2000),
        quiesce: kvpipe_core::Duration::from_millis(2000),
    }
}

pub fn sender_config(instance: u64) -> SenderConfig {
    let mut c = SenderConfig::new(LocalHello::new(
        InstanceId(instance),
        Topology::default(),
        layout(10),
    ));
    c.deadlines = test_deadlines();
    c
}

pub fn receiver_config(instance: u64) -> ReceiverConfig {
    let mut c = ReceiverConfig::new(
        LocalHello::new(InstanceId(instance), Topology::default(), layout(20)),
        instance ^ 0x5eed,
    );
    c.deadlines = test_deadlines();
    c
}

/// A sender node over `pools` (registered for local use).
pub fn sender(device: &VerbsDevice, instance: u64, pools: &mut Pools) -> VerbsSender {
    let table = pools.table(device, Exposure::Local, |_, len| len);
    VerbsSender::sender(
        sender_config(instance),
        device.clone(),
        table,
        VerbsConfig::default(),
    )
    .expect("sender node")
}

/// A receiver node over `pools` (registered for remote writes, `registered_len` of each).
pub fn receiver(
    device: &VerbsDevice,
    instance: u64,
    pools: &mut Pools,
    registered_len: impl Fn(RegionId, usize) -> usize,
) -> VerbsReceiver {
    let table = pools.table(device, Exposure::RemoteWrite, registered_len);
    VerbsReceiver::receiver(
        receiver_config(instance),
        device.clone(),
        table,
        VerbsConfig::default(),
    )
    .expect("receiver node")
}

/// Waits until `pred` accepts an event; returns it and every event seen before it.
pub fn wait_event(
    next: impl Fn(Duration) -> Option<Event>,
    mut pred: impl FnMut(&Event) -> bool,
    timeout: Duration,
) -> Result<(Event, Vec<Event>), Vec<Event>> {
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(seen);
        }
        match next(left.min(Duration::from_millis(100))) {
            Some(e) if pred(&e) => return Ok((e, seen)),
            Some(e) => seen.push(e),
            None => {}
        }
    }
}
