//! Shared fixtures of the loopback tests: a small model layout, filled regions, a linear block
//! source, nodes with short deadlines, raw-socket frame helpers and event waits.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvpipe_core::session::{Deadlines, LocalHello};
use kvpipe_core::wire::{Frame, Topology, HEADER_LEN};
use kvpipe_core::{
    BlockId, BlockRun, BlockSource, BlockSourceError, Event, GroupIndex, InstanceId,
    LayerGroupLayout, PoolLayout, ReceiverConfig, RegionId, RequestId, SenderConfig,
};
use kvpipe_tcp::preamble::Preamble;
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig, TcpReceiver, TcpSender};
use smallvec::smallvec;

/// Tokens per block.
pub const TPB: u32 = 4;
/// Bytes of one layer of one block: kv 2 × heads 2 × tpb 4 × dim 16 × 2 bytes.
pub const LAYER_BLOCK: u64 = 512;

/// One full-attention group of two layers, one pool per layer, pools at `first_region`.
pub fn layout(first_region: u32) -> Vec<LayerGroupLayout> {
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
        pools: smallvec![
            PoolLayout {
                region: RegionId(first_region),
                layer_begin: 0,
                layers: 1,
                slot_bytes: LAYER_BLOCK,
            },
            PoolLayout {
                region: RegionId(first_region + 1),
                layer_begin: 1,
                layers: 1,
                slot_bytes: LAYER_BLOCK,
            },
        ],
    }]
}

/// The source byte at `offset` of sender region `region`.
pub fn source_byte(region: u32, offset: u64) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 9) ^ (u64::from(region) * 7)) as u8 | 1
}

/// Regions of `slots` slots for every pool of `layout`; sender regions hold [`source_byte`],
/// receiver regions zeros.
pub fn regions(layout: &[LayerGroupLayout], slots: u64, filled: bool) -> RegionTable {
    let mut t = RegionTable::new();
    for g in layout {
        for p in &g.pools {
            let len = (p.slot_bytes * slots) as usize;
            let bytes = if filled {
                (0..len as u64)
                    .map(|o| source_byte(p.region.0, o))
                    .collect()
            } else {
                vec![0; len]
            };
            t.insert(p.region, MemoryRegion::from_vec(bytes));
        }
    }
    t
}

/// A block source where request `r`'s block at ordinal `i` sits in slot `base + i`.
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

/// Deadlines short enough for tests.
pub fn fast_deadlines() -> Deadlines {
    Deadlines {
        handshake: kvpipe_core::Duration::from_millis(2000),
        registration: kvpipe_core::Duration::from_millis(5000),
        write_completion: kvpipe_core::Duration::from_millis(5000),
        result_wait: kvpipe_core::Duration::from_millis(10000),
        result_per_token: kvpipe_core::Duration::ZERO,
        result_idle: kvpipe_core::Duration::from_millis(10000),
        aux_wait: kvpipe_core::Duration::from_millis(2000),
        heartbeat_interval: kvpipe_core::Duration::from_millis(100),
        liveness_timeout: kvpipe_core::Duration::from_millis(600),
        quiesce: kvpipe_core::Duration::from_millis(1000),
    }
}

pub fn sender_config(instance: u64) -> SenderConfig {
    let mut c = SenderConfig::new(LocalHello::new(
        InstanceId(instance),
        Topology::default(),
        layout(10),
    ));
    c.deadlines = fast_deadlines();
    c
}

pub fn receiver_config(instance: u64) -> ReceiverConfig {
    let mut c = ReceiverConfig::new(
        LocalHello::new(InstanceId(instance), Topology::default(), layout(20)),
        instance ^ 0x5eed,
    );
    c.deadlines = fast_deadlines();
    c
}

pub fn tcp(connections: usize) -> TcpConfig {
    TcpConfig {
        connections_per_peer: connections,
        min_piece_bytes: 4096,
        ..TcpConfig::default()
    }
}

/// A sender node with `slots` filled source slots per pool.
pub fn sender(instance: u64, connections: usize, slots: u64) -> (TcpSender, RegionTable) {
    let config = sender_config(instance);
    let regions = regions(&config.local.groups, slots, true);
    (
        TcpSender::new(config, tcp(connections), regions.clone()).unwrap(),
        regions,
    )
}

/// A receiver node with `slots` zeroed destination slots per pool.
pub fn receiver(instance: u64, slots: u64) -> (TcpReceiver, RegionTable) {
    let config = receiver_config(instance);
    let regions = regions(&config.local.groups, slots, false);
    (
        TcpReceiver::new(config, tcp(1), regions.clone()).unwrap(),
        regions,
    )
}

/// Waits until `pred` accepts an event; returns it and every event seen before it.
pub fn wait_for(
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

/// Checks that destination block `dst` holds source block `src` in every pool.
pub fn block_matches(src: &RegionTable, dst: &RegionTable, src_slot: u32, dst_slot: u32) -> bool {
    (0..2).all(|p| {
        let s = src.get(RegionId(10 + p)).unwrap();
        let d = dst.get(RegionId(20 + p)).unwrap();
        let mut a = vec![0; LAYER_BLOCK as usize];
        let mut b = vec![0; LAYER_BLOCK as usize];
        s.copy_to(u64::from(src_slot) * LAYER_BLOCK, &mut a)
            .unwrap();
        d.copy_to(u64::from(dst_slot) * LAYER_BLOCK, &mut b)
            .unwrap();
        a == b
    })
}

/// A raw connection speaking the wire format by hand.
pub struct RawPeer {
    pub stream: TcpStream,
}

impl RawPeer {
    pub fn connect(addr: std::net::SocketAddr, token: u64) -> RawPeer {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream
            .write_all(
                &Preamble {
                    index: 0,
                    count: 1,
                    token,
                    flags: 0,
                }
                .encode(),
            )
            .unwrap();
        RawPeer { stream }
    }

    pub fn send(&mut self, frame: &Frame) {
        self.stream.write_all(&frame.to_vec().unwrap()).unwrap();
    }

    /// The next frame, or `None` at end of stream or on error.
    pub fn recv(&mut self) -> Option<Frame> {
        let mut head = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut head).ok()?;
        let (_, _, total) = Frame::peek_header(&head).ok()?;
        let mut buf = vec![0; total];
        buf[..HEADER_LEN].copy_from_slice(&head);
        self.stream.read_exact(&mut buf[HEADER_LEN..]).ok()?;
        Frame::parse(&buf).ok().map(|(f, _)| f)
    }

    /// Skips frames until `pred` accepts one.
    pub fn recv_until(&mut self, mut pred: impl FnMut(&Frame) -> bool) -> Option<Frame> {
        for _ in 0..1000 {
            let f = self.recv()?;
            if pred(&f) {
                return Some(f);
            }
        }
        None
    }

    /// Whether the node closed the connection (within the read timeout).
    pub fn closed_by_node(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        for _ in 0..1000 {
            match self.stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
        false
    }
}
