//! kvpipe-tcp with device memory (`cuda` feature): whole transfers over loopback sockets
//! between pools in GPU memory, through pinned staging on both sides. The tests that need a GPU
//! are reported as ignored, with the reason ("skipped: no CUDA driver"), where no driver or
//! device is found — counted among the ignored tests, never the passed ones; `scripts/gpu-check`
//! runs them on the GPU machine. One test covers the opposite case: without a driver, a
//! transfer between device pools fails cleanly on both sides (it is ignored where a driver is
//! present).

use std::time::{Duration, Instant};

use kvpipe_core::session::{LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Event, GroupIndex,
    InstanceId, LayerGroupLayout, PeerId, PoolLayout, ReceiverConfig, RegionId, RequestId,
    SenderConfig,
};
use kvpipe_cuda::{check_driver, Device, DeviceBuffer};
use kvpipe_tcp::{
    DeviceRegion, MemoryRegion, RegionTable, TcpConfig, TcpDataPath, TcpReceiver, TcpSender,
};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// Device 0, or the reason the test is skipped.
fn device() -> Result<Device, String> {
    check_driver().map_err(|e| format!("skipped: {e}"))?;
    Device::open(0).map_err(|e| format!("skipped: {e}"))
}

fn gpu(name: &'static str, test: fn(&Device) -> Result<(), Failed>) -> Trial {
    Trial::ignorable_test(name, move || match device() {
        Err(reason) => Ok(Completion::ignored_with(reason)),
        Ok(d) => test(&d).map(|()| Completion::Completed),
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

const TPB: u32 = 16;
const BLOCKS: u32 = 48;
/// Receiver pool slots: more than the request needs, so untouched slots can be checked.
const DST_SLOTS: u32 = 64;
/// Staging slots smaller than the coalesced runs, so every connection's ring wraps many times.
const STAGING_SLOT: usize = 48 << 10;

fn layout(region: u32) -> LayerGroupLayout {
    let mut l = LayerGroupLayout {
        layers: 4,
        kv_factor: 2,
        kv_heads: 2,
        head_dim: 64,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        ..LayerGroupLayout::default()
    };
    let slot_bytes = l.layer_block_bytes().unwrap_or(0) * 4;
    l.pools.push(PoolLayout {
        region: RegionId(region),
        layer_begin: 0,
        layers: 4,
        slot_bytes,
    });
    l
}

fn slot_bytes() -> usize {
    layout(1).pools[0].slot_bytes as usize
}

/// Ordinal `o` lives in sender slot `o`.
struct ContiguousSource;

impl BlockSource for ContiguousSource {
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
        if end > BLOCKS {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: BLOCKS,
            });
        }
        out.first_ordinal = begin;
        out.ids.clear();
        out.ids.extend((begin..end).map(BlockId));
        Ok(())
    }
}

/// The receiver's slot of ordinal `o`: the first half in order (contiguous, so the writes
/// merge into long pieces), the second half reversed (every block its own piece).
fn dst_slot(o: u32) -> u32 {
    if o < BLOCKS / 2 {
        o
    } else {
        DST_SLOTS - 1 - (o - BLOCKS / 2)
    }
}

/// Where one side's pool lives.
enum Pool {
    Host(MemoryRegion),
    Device(DeviceBuffer),
}

impl Pool {
    /// A pool of `slots` slots holding `bytes`, in device memory when `device` is given.
    fn new(bytes: Vec<u8>, device: Option<&Device>) -> Result<Pool, Failed> {
        Ok(match device {
            None => Pool::Host(MemoryRegion::from_vec(bytes)),
            Some(d) => {
                let mut buf = DeviceBuffer::new(d, bytes.len())?;
                buf.upload(0, &bytes)?;
                Pool::Device(buf)
            }
        })
    }

    fn table(&self, id: RegionId) -> RegionTable {
        let mut t = RegionTable::new();
        match self {
            Pool::Host(r) => t.insert(id, r.clone()),
            // SAFETY: the buffer outlives the nodes (the tests drop the nodes first), and the
            // tests touch it only once both sides quiesced.
            Pool::Device(b) => t.insert_device(id, unsafe {
                DeviceRegion::from_raw_parts(b.device().ordinal(), b.ptr(), b.len())
            }),
        }
        t
    }

    fn bytes(&self) -> Result<Vec<u8>, Failed> {
        Ok(match self {
            Pool::Host(r) => r.to_vec(),
            Pool::Device(b) => {
                let mut out = vec![0u8; b.len()];
                b.download(0, &mut out)?;
                out
            }
        })
    }
}

/// Waits for the first event `pred` accepts, returning every event seen.
fn wait_for(
    next: impl Fn(Duration) -> Option<Event>,
    mut pred: impl FnMut(&Event) -> bool,
) -> Result<Vec<Event>, Failed> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        if let Some(e) = next(Duration::from_millis(100)) {
            let done = pred(&e);
            seen.push(e);
            if done {
                return Ok(seen);
            }
        }
    }
    Err(format!("timed out; events so far: {seen:?}").into())
}

/// One request of `BLOCKS` blocks in ragged chunks from the sender's region 1 (`src`) to the
/// receiver's region 2 (`dst`) over `connections` loopback connections. Returns the sender's
/// and the receiver's events up to both sides' `Quiesced`.
fn transfer(
    src: RegionTable,
    dst: RegionTable,
    connections: usize,
    data_path: TcpDataPath,
) -> Result<(Vec<Event>, Vec<Event>), Failed> {
    let hello =
        |i, l: LayerGroupLayout| LocalHello::new(InstanceId(i), Topology::default(), vec![l]);
    let tcp = TcpConfig {
        connections_per_peer: connections,
        min_piece_bytes: 4096,
        staging_slot_bytes: STAGING_SLOT,
        staging_slots: 3,
        data_path,
        ..TcpConfig::default()
    };
    let rx = TcpReceiver::new(
        ReceiverConfig::new(hello(2, layout(2)), 5),
        tcp.clone(),
        dst,
    )?;
    let addr = rx.listen("127.0.0.1:0")?;
    let tx = TcpSender::new(SenderConfig::new(hello(1, layout(1))), tcp, src)?;
    let receiver_peer = tx.connect(addr)?;
    let mut rx_events = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
    )?;
    let sender_peer = match rx_events.last() {
        Some(Event::PeerReady { peer, .. }) => *peer,
        _ => PeerId(0),
    };
    let mut tx_events = wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
    )?;
    let request = RequestId(1);
    let tokens = BLOCKS * TPB;
    let mut anchored = AnchoredRun::empty(0);
    for o in 0..BLOCKS {
        anchored.push(BlockId(dst_slot(o)));
    }
    rx.register(Registration {
        request,
        prompt_len: tokens,
        groups: vec![anchored],
        writers: std::iter::once(sender_peer).collect(),
        aux_capacity: 64,
        expected_part: None,
    })?;
    tx.open_request(SendRequest {
        request,
        receivers: std::iter::once(receiver_peer).collect(),
        beam_width: 1,
    })?;
    tx_events.extend(wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::Registered { .. }),
    )?);
    let chunk = 5 * TPB + 3; // ragged chunks: some end inside a block
    let mut start = 0;
    while start < tokens {
        let end = (start + chunk).min(tokens);
        let spec = ChunkSpec {
            start,
            end,
            prompt_len: tokens,
            prepopulated_len: 0,
            is_last: end == tokens,
            prefix_sent_early: false,
        };
        // A session ended under the engine (a failure) refuses further chunks: stop.
        if tx
            .submit_chunk(request, spec, &mut ContiguousSource)
            .is_err()
        {
            break;
        }
        start = end;
    }
    let _ = tx.submit_aux(
        request,
        AuxData {
            prompt_tokens: tokens,
            ..AuxData::default()
        },
    );
    let quiesced = |e: &Event| matches!(e, Event::Quiesced { .. });
    rx_events.extend(wait_for(|t| rx.next_event(t), quiesced)?);
    tx_events.extend(wait_for(|t| tx.next_event(t), quiesced)?);
    tx.shutdown();
    rx.shutdown();
    Ok((tx_events, rx_events))
}

/// Runs a transfer from a pool on `src_device` to one on `dst_device` (host when `None`) and
/// checks every destination byte: granted slots hold their source block, the others their
/// poison.
fn transfer_and_check(
    src_device: Option<&Device>,
    dst_device: Option<&Device>,
    connections: usize,
) -> Result<(), Failed> {
    transfer_and_check_on(src_device, dst_device, connections, TcpDataPath::Socket)
}

fn transfer_and_check_on(
    src_device: Option<&Device>,
    dst_device: Option<&Device>,
    connections: usize,
    data_path: TcpDataPath,
) -> Result<(), Failed> {
    let sb = slot_bytes();
    let data = pattern(BLOCKS as usize * sb, 3);
    let src = Pool::new(data.clone(), src_device)?;
    let dst = Pool::new(vec![0xEE; DST_SLOTS as usize * sb], dst_device)?;
    let (tx_events, rx_events) = transfer(
        src.table(RegionId(1)),
        dst.table(RegionId(2)),
        connections,
        data_path,
    )?;
    let completed = |events: &[Event]| events.iter().any(|e| matches!(e, Event::Completed { .. }));
    if !completed(&tx_events) || !completed(&rx_events) {
        return Err(format!("not completed: sender {tx_events:?}, receiver {rx_events:?}").into());
    }
    let out = dst.bytes()?;
    let mut expected = vec![0xEEu8; out.len()];
    for o in 0..BLOCKS as usize {
        let d = dst_slot(o as u32) as usize;
        expected[d * sb..(d + 1) * sb].copy_from_slice(&data[o * sb..(o + 1) * sb]);
    }
    if out != expected {
        let first = out.iter().zip(&expected).position(|(a, b)| a != b);
        return Err(format!("destination differs, first at byte {first:?}").into());
    }
    if src.bytes()? != data {
        return Err("the source changed".into());
    }
    Ok(())
}

fn a_transfer_between_device_pools_lands_every_block(d: &Device) -> Result<(), Failed> {
    transfer_and_check(Some(d), Some(d), 3)
}

fn one_connection_between_device_pools(d: &Device) -> Result<(), Failed> {
    transfer_and_check(Some(d), Some(d), 1)
}

fn device_sender_to_host_receiver(d: &Device) -> Result<(), Failed> {
    transfer_and_check(Some(d), None, 2)
}

fn host_sender_to_device_receiver(d: &Device) -> Result<(), Failed> {
    transfer_and_check(None, Some(d), 2)
}

/// Both nodes in one process: the driver refuses to open a process's own IPC handles, so
/// `Auto` falls back to staging (and lands every block), and `PeerCopy` fails the connect
/// naming the failed import. (Two processes: `kvpipe-cli`'s GPU tests.)
fn in_one_process_peer_copies_fall_back_or_fail_the_connect(d: &Device) -> Result<(), Failed> {
    transfer_and_check_on(Some(d), Some(d), 2, TcpDataPath::Auto)?;
    let sb = slot_bytes();
    let src = Pool::new(pattern(BLOCKS as usize * sb, 3), Some(d))?;
    let dst = Pool::new(vec![0xEE; DST_SLOTS as usize * sb], Some(d))?;
    let err = match transfer(
        src.table(RegionId(1)),
        dst.table(RegionId(2)),
        2,
        TcpDataPath::PeerCopy,
    ) {
        Ok(_) => return Err("peer copies within one process were accepted".into()),
        Err(e) => e.message().map(str::to_string).unwrap_or_default(),
    };
    if !err.contains("peer copies refused") || !err.contains("cuIpcOpenMemHandle") {
        return Err(format!("unexpected error: {err}").into());
    }
    Ok(())
}

/// Without a driver nothing can be staged: the request fails on both sides and both quiesce
/// (the addresses are never touched). Runs where no driver is found.
fn without_a_driver_device_pools_fail_the_request_cleanly() -> Result<Completion, Failed> {
    if check_driver().is_ok() {
        return Ok(Completion::ignored_with(
            "skipped: a CUDA driver is present",
        ));
    }
    let sb = slot_bytes();
    // SAFETY: without a driver no copy is ever issued, so these addresses are never touched.
    let fake = |len: usize| unsafe { DeviceRegion::from_raw_parts(0, 0x7f00_0000_0000, len) };
    for (src_device, dst_device) in [(true, false), (false, true)] {
        let src = Pool::Host(MemoryRegion::from_vec(pattern(BLOCKS as usize * sb, 3)));
        let dst = Pool::Host(MemoryRegion::zeroed(DST_SLOTS as usize * sb));
        // One side's table points at "device memory".
        let src_table = if src_device {
            device_table(RegionId(1), fake(BLOCKS as usize * sb))
        } else {
            src.table(RegionId(1))
        };
        let dst_table = if dst_device {
            device_table(RegionId(2), fake(DST_SLOTS as usize * sb))
        } else {
            dst.table(RegionId(2))
        };
        let (tx_events, rx_events) = transfer(src_table, dst_table, 2, TcpDataPath::Socket)?;
        let failed = |events: &[Event]| events.iter().any(|e| matches!(e, Event::Failed { .. }));
        let completed =
            |events: &[Event]| events.iter().any(|e| matches!(e, Event::Completed { .. }));
        // The decode side never completes. With the device memory on the decode side, the
        // sender may finish first (its writes sit in the socket buffers before the decode side
        // reads them) and complete its own part; with it on the prefill side nothing is sent,
        // so both fail.
        let sender_ok = failed(&tx_events) || (dst_device && completed(&tx_events));
        if !sender_ok || !failed(&rx_events) || completed(&rx_events) {
            return Err(format!(
                "device on the {} side: expected the decode side to fail; sender {tx_events:?}, receiver {rx_events:?}",
                if src_device { "sender" } else { "receiver" }
            )
            .into());
        }
        if !dst_device && dst.bytes()?.iter().any(|&b| b != 0) {
            return Err("a failed transfer changed the host destination".into());
        }
    }
    Ok(Completion::Completed)
}

fn device_table(id: RegionId, region: DeviceRegion) -> RegionTable {
    let mut t = RegionTable::new();
    t.insert_device(id, region);
    t
}

/// The peer-copy fence, with three processes on one GPU. This process is the decode side
/// (device pools, `PeerCopy`, deadlines of about a second). A first prefill process (this
/// test binary again, `KVPIPE_FENCE_PREFILL` set) streams request 1 one block per chunk, slowly;
/// once some of its writes landed it is stopped (`SIGSTOP`). The decode side times the request
/// out, quiesces, and registers request 2 on the same blocks, fed by a second, healthy prefill
/// process with other bytes; request 2 completes and its bytes are checked. Then the first
/// process is resumed (`SIGCONT`) and goes on submitting chunks of request 1 for a while; the
/// blocks of request 2 are checked again, byte for byte. With the receiver pulling every write
/// itself nothing of the resumed process can land there.
fn a_stopped_prefill_process_cannot_write_into_blocks_handed_back(
    d: &Device,
) -> Result<(), Failed> {
    let sb = slot_bytes();
    let dst = Pool::new(vec![0xEE; DST_SLOTS as usize * sb], Some(d))?;
    let hello = LocalHello::new(InstanceId(2), Topology::default(), vec![layout(2)]);
    let mut config = ReceiverConfig::new(hello, 5);
    config.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(200);
    config.deadlines.liveness_timeout = kvpipe_core::Duration::from_millis(1500);
    config.deadlines.result_idle = kvpipe_core::Duration::from_millis(1500);
    let rx = TcpReceiver::new(config, fence_tcp(), dst.table(RegionId(2)))?;
    let addr = rx.listen("127.0.0.1:0")?;
    let mut children = Children::default();
    let next = |t| rx.next_event(t);

    // Request 1 from the process that will be stopped: 48 blocks, one per 150 ms.
    let stopped = children.spawn(&addr.to_string(), 1, 11, 150)?;
    let peer_of = |events: &[Event]| match events.last() {
        Some(Event::PeerReady { peer, .. }) => *peer,
        _ => PeerId(u32::MAX),
    };
    let a = peer_of(&wait_for(next, |e| matches!(e, Event::PeerReady { .. }))?);
    let blocks = || {
        let mut run = AnchoredRun::empty(0);
        for o in 0..BLOCKS {
            run.push(BlockId(dst_slot(o)));
        }
        run
    };
    let registration = |request, writer| Registration {
        request: RequestId(request),
        prompt_len: BLOCKS * TPB,
        groups: vec![blocks()],
        writers: std::iter::once(writer).collect(),
        aux_capacity: 64,
        expected_part: None,
    };
    rx.register(registration(1, a))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while rx.stats().writes_placed < 4 {
        if Instant::now() > deadline {
            return Err(format!("request 1 did not start: {:?}", rx.stats()).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    signal("STOP", stopped)?;
    let landed_before_stop = rx.stats().writes_placed;
    // The decode side times request 1 out and hands its blocks back.
    let quiesced =
        |r: u64| move |e: &Event| matches!(e, Event::Quiesced { request } if request.0 == r);
    let one = wait_for(next, quiesced(1))?;
    if one.iter().any(|e| matches!(e, Event::Completed { .. })) {
        return Err(format!("request 1 completed while its writer was stopped: {one:?}").into());
    }

    // Request 2 into the same blocks, from a healthy prefill process.
    let healthy = children.spawn(&addr.to_string(), 2, 22, 0)?;
    let b = peer_of(&wait_for(next, |e| matches!(e, Event::PeerReady { .. }))?);
    rx.register(registration(2, b))?;
    let two = wait_for(next, quiesced(2))?;
    if !two
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if request.0 == 2))
    {
        return Err(format!("request 2 did not complete: {two:?}").into());
    }
    let data = pattern(BLOCKS as usize * sb, 22);
    let differing = |out: &[u8]| {
        (0..BLOCKS as usize)
            .map(|o| {
                let d = dst_slot(o as u32) as usize;
                out[d * sb..(d + 1) * sb]
                    .iter()
                    .zip(&data[o * sb..(o + 1) * sb])
                    .filter(|(a, b)| a != b)
                    .count()
            })
            .sum::<usize>()
    };
    let before = differing(&dst.bytes()?);
    // Resume the stopped process and give it time to do whatever it still had queued.
    signal("CONT", stopped)?;
    std::thread::sleep(Duration::from_secs(3));
    let after = differing(&dst.bytes()?);
    let status = children.wait(healthy, Duration::from_secs(30));
    let resumed = children.wait(stopped, Duration::ZERO);
    println!(
        "{{\"figure\":\"peer-copy-fence\",\"writes_landed_before_stop\":{landed_before_stop},\"bytes_differing_after_completion\":{before},\"bytes_differing_after_resume\":{after},\"healthy_prefill_exit\":\"{status}\",\"stopped_prefill_exit\":\"{resumed}\"}}"
    );
    rx.shutdown();
    if before != 0 || after != 0 {
        return Err(format!(
            "request 2's blocks differ from its bytes: {before} bytes after it completed, {after} after the stopped prefill process resumed"
        )
        .into());
    }
    Ok(())
}

fn fence_tcp() -> TcpConfig {
    TcpConfig {
        connections_per_peer: 2,
        min_piece_bytes: 4096,
        data_path: TcpDataPath::PeerCopy,
        ..TcpConfig::default()
    }
}

/// Prefill processes started by the fence test, killed when it ends.
#[derive(Default)]
struct Children(Vec<std::process::Child>);

impl Children {
    /// Starts this binary as a prefill process sending request `request` (bytes of `seed`)
    /// to `addr`, `pace_ms` between chunks. Returns its pid.
    fn spawn(&mut self, addr: &str, request: u64, seed: u64, pace_ms: u64) -> Result<u32, Failed> {
        let child = std::process::Command::new(std::env::current_exe()?)
            .env(
                "KVPIPE_FENCE_PREFILL",
                format!("{addr} {request} {seed} {pace_ms}"),
            )
            .stdout(std::process::Stdio::null())
            .spawn()?;
        let pid = child.id();
        self.0.push(child);
        Ok(pid)
    }

    /// Waits (at most `within`) for `pid` to exit: how it did.
    fn wait(&mut self, pid: u32, within: Duration) -> String {
        let deadline = Instant::now() + within;
        for c in self.0.iter_mut().filter(|c| c.id() == pid) {
            loop {
                if let Ok(Some(status)) = c.try_wait() {
                    return status.to_string();
                }
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        "still running".into()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if let Ok(Some(_)) = c.try_wait() {
                continue;
            }
            let _ = std::process::Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .stderr(std::process::Stdio::null())
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn signal(name: &str, pid: u32) -> Result<(), Failed> {
    let ok = std::process::Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()?
        .success();
    if ok {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed").into())
    }
}

/// The prefill process of the fence test (`KVPIPE_FENCE_PREFILL="ADDR REQUEST SEED PACE_MS"`):
/// connects with peer copies, sends one request from a device pool of `pattern(SEED)`, one
/// block per chunk with `PACE_MS` between chunks, and waits for its `Quiesced`.
fn fence_prefill(spec: &str) -> Result<(), Failed> {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [addr, request, seed, pace] = parts[..] else {
        return Err(format!("bad KVPIPE_FENCE_PREFILL: {spec}").into());
    };
    let num = |s: &str| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
    let (request, seed, pace) = (RequestId(num(request)?), num(seed)?, num(pace)?);
    let d = Device::open(0)?;
    let sb = slot_bytes();
    let src = Pool::new(pattern(BLOCKS as usize * sb, seed), Some(&d))?;
    let hello = LocalHello::new(
        InstanceId(10 + request.0),
        Topology::default(),
        vec![layout(1)],
    );
    let mut config = SenderConfig::new(hello);
    config.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(200);
    let tx = TcpSender::new(config, fence_tcp(), src.table(RegionId(1)))?;
    let peer = tx.connect(addr)?;
    wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
    )?;
    tx.open_request(SendRequest {
        request,
        receivers: std::iter::once(peer).collect(),
        beam_width: 1,
    })?;
    wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::Registered { .. }),
    )?;
    let tokens = BLOCKS * TPB;
    for b in 0..BLOCKS {
        let spec = ChunkSpec {
            start: b * TPB,
            end: (b + 1) * TPB,
            prompt_len: tokens,
            prepopulated_len: 0,
            is_last: b + 1 == BLOCKS,
            prefix_sent_early: false,
        };
        // A failed session refuses further chunks; the stopped process, resumed, keeps trying
        // for a while (whatever it still queues must not land in the decode side's blocks).
        let _ = tx.submit_chunk(request, spec, &mut ContiguousSource);
        std::thread::sleep(Duration::from_millis(pace));
    }
    let _ = tx.submit_aux(
        request,
        AuxData {
            prompt_tokens: tokens,
            ..AuxData::default()
        },
    );
    wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::Quiesced { .. }),
    )?;
    tx.shutdown();
    Ok(())
}

fn main() {
    if let Ok(spec) = std::env::var("KVPIPE_FENCE_PREFILL") {
        // This binary started as the fence test's prefill process.
        std::process::exit(match fence_prefill(&spec) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("fence prefill process: {e:?}");
                1
            }
        });
    }
    let args = Arguments::from_args();
    let tests = vec![
        gpu(
            "a_transfer_between_device_pools_lands_every_block",
            a_transfer_between_device_pools_lands_every_block,
        ),
        gpu(
            "one_connection_between_device_pools",
            one_connection_between_device_pools,
        ),
        gpu(
            "device_sender_to_host_receiver",
            device_sender_to_host_receiver,
        ),
        gpu(
            "host_sender_to_device_receiver",
            host_sender_to_device_receiver,
        ),
        gpu(
            "in_one_process_peer_copies_fall_back_or_fail_the_connect",
            in_one_process_peer_copies_fall_back_or_fail_the_connect,
        ),
        gpu(
            "a_stopped_prefill_process_cannot_write_into_blocks_handed_back",
            a_stopped_prefill_process_cannot_write_into_blocks_handed_back,
        ),
        Trial::ignorable_test(
            "without_a_driver_device_pools_fail_the_request_cleanly",
            without_a_driver_device_pools_fail_the_request_cleanly,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
