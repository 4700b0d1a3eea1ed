//! kvpipe-mem with device memory (`cuda` feature). The tests that need a GPU are reported as
//! ignored, with the reason ("skipped: no CUDA driver"), where no driver or device is found —
//! counted among the ignored tests, never the passed ones; `scripts/gpu-check` runs them on the
//! GPU machine. One test covers the opposite case: without a driver, a transfer between device
//! pools fails cleanly on both sides (it is ignored where a driver is present).

use std::time::Duration;

use kvpipe_core::session::{LocalHello, Registration, SendRequest, Submitted};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, Event, GroupIndex,
    InstanceId, LayerGroupLayout, PoolLayout, ReceiverConfig, RegionId, RequestId, SenderConfig,
    SenderInput, WriteExtent, WritePlan,
};
use kvpipe_cuda::{check_driver, BusyKernel, CopyEngine, CopyExtent, Device, DeviceBuffer, Memory};
use kvpipe_mem::{
    CopyError, Endpoint, MemPair, Node, PairConfig, RegionKind, RegionTable, RegionUse,
    RegistrationError, ResolvedBatch, RECEIVER_PEER, SENDER_PEER,
};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

type Outcome = Result<Completion, Failed>;

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

fn download(buf: &DeviceBuffer) -> Result<Vec<u8>, Failed> {
    let mut out = vec![0u8; buf.len()];
    buf.download(0, &mut out)?;
    Ok(out)
}

// ----- a whole transfer through the sessions -----

const TPB: u32 = 16;
const BLOCKS: u32 = 48;
/// Receiver pool slots: more than the request needs, so untouched slots can be checked.
const DST_SLOTS: u32 = 64;

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
/// merge), the second half reversed (every block its own copy).
fn dst_slot(o: u32) -> u32 {
    if o < BLOCKS / 2 {
        o
    } else {
        DST_SLOTS - 1 - (o - BLOCKS / 2)
    }
}

/// Registers both pools on the pair as device memory (sender: region 1, receiver: region 2).
///
/// # Safety
///
/// The addresses must stay valid device memory until the pair is dropped (or never be
/// touched: without a driver nothing is copied).
unsafe fn register(pair: &mut MemPair, src: (u64, usize), dst: (u64, usize)) {
    let net = pair.network();
    // SAFETY: forwarded to the caller.
    unsafe {
        net.regions_mut(Node::Sender(0))
            .unwrap()
            .register_device(RegionId(1), RegionUse::KvPool, 0, src.0, src.1)
            .unwrap();
        net.regions_mut(Node::Receiver(0))
            .unwrap()
            .register_device(RegionId(2), RegionUse::KvPool, 0, dst.0, dst.1)
            .unwrap();
    }
}

fn new_pair() -> MemPair {
    let hello =
        |i, l: LayerGroupLayout| LocalHello::new(InstanceId(i), Topology::default(), vec![l]);
    MemPair::new(PairConfig::new(
        SenderConfig::new(hello(1, layout(1))),
        ReceiverConfig::new(hello(2, layout(2)), 5),
    ))
    .expect("a supported configuration")
}

/// Runs one request of `BLOCKS` blocks in chunks of 5 blocks over `pair` (memory registered)
/// and returns every event until the receiver completed or either side failed, and both sides
/// quiesced.
fn transfer(pair: &mut MemPair) -> Result<Vec<(Endpoint, Event)>, Failed> {
    transfer_with(pair, &mut |_, _, _| Ok(()))
}

/// [`transfer`], with `submitted` called after each chunk's submission, before the pump that
/// carries it out.
fn transfer_with(
    pair: &mut MemPair,
    submitted: &mut dyn FnMut(&mut MemPair, RequestId, Submitted) -> Result<(), Failed>,
) -> Result<Vec<(Endpoint, Event)>, Failed> {
    let request = RequestId(1);
    let tokens = BLOCKS * TPB;
    pair.connect()?;
    pair.drive_until(Duration::from_secs(10), |p| {
        p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
    })?;
    let mut anchored = AnchoredRun::empty(0);
    for o in 0..BLOCKS {
        anchored.push(BlockId(dst_slot(o)));
    }
    let now = pair.now();
    pair.receiver_mut().register(
        now,
        Registration {
            request,
            prompt_len: tokens,
            groups: vec![anchored],
            writers: std::iter::once(SENDER_PEER).collect(),
            aux_capacity: 64,
            expected_part: None,
        },
    )?;
    pair.sender_mut().open_request(
        now,
        SendRequest {
            request,
            receivers: std::iter::once(RECEIVER_PEER).collect(),
            beam_width: 1,
        },
    )?;
    let mut events = Vec::new();
    pair.drive_until(Duration::from_secs(10), |p| {
        for (side, _, e) in p.take_events() {
            events.push((side, e));
        }
        events
            .iter()
            .any(|(_, e)| matches!(e, Event::Registered { .. }))
    })?;
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
        let now = pair.now();
        let outcome = pair
            .sender_mut()
            .submit_chunk(now, request, spec, &mut ContiguousSource)?;
        submitted(pair, request, outcome)?;
        pair.pump()?;
        for (side, _, e) in pair.take_events() {
            events.push((side, e));
        }
        start = end;
        // A failed request takes no more chunks (the engine learns it from the event).
        if failed(&events) {
            break;
        }
    }
    if !failed(&events) {
        let now = pair.now();
        pair.sender_mut().handle_input(SenderInput::Aux {
            now,
            request,
            data: AuxData {
                prompt_tokens: tokens,
                ..AuxData::default()
            },
        })?;
    }
    pair.drive_until(Duration::from_secs(30), |p| {
        for (side, _, e) in p.take_events() {
            events.push((side, e));
        }
        let quiesced = events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Quiesced { .. }))
            .count();
        quiesced >= 2
    })?;
    Ok(events)
}

fn failed(events: &[(Endpoint, Event)]) -> bool {
    events
        .iter()
        .any(|(s, e)| *s == Endpoint::Sender && matches!(e, Event::Failed { .. }))
}

fn completed(events: &[(Endpoint, Event)]) -> bool {
    events
        .iter()
        .any(|(s, e)| *s == Endpoint::Receiver && matches!(e, Event::Completed { .. }))
}

/// Both pools in device memory: every block lands in its slot, merged and scattered writes
/// alike, and no other byte of the destination pool changes.
fn a_transfer_between_device_pools_lands_every_block(d: &Device) -> Result<(), Failed> {
    let slot = layout(1).pools[0].slot_bytes as usize;
    let data = pattern(slot * BLOCKS as usize, 21);
    let mut src = DeviceBuffer::new(d, data.len())?;
    src.upload(0, &data)?;
    let mut dst = DeviceBuffer::new(d, slot * DST_SLOTS as usize)?;
    dst.fill(0x5A)?;
    let mut pair = new_pair();
    // SAFETY: both buffers outlive `pair` (dropped at the end of this function, before them).
    unsafe { register(&mut pair, (src.ptr(), src.len()), (dst.ptr(), dst.len())) };
    let events = transfer(&mut pair)?;
    assert!(completed(&events), "{events:?}");
    assert!(pair.stats().batches > 0);
    drop(pair);
    let out = download(&dst)?;
    let mut expected = vec![0x5Au8; out.len()];
    for o in 0..BLOCKS as usize {
        let to = dst_slot(o as u32) as usize;
        expected[to * slot..(to + 1) * slot].copy_from_slice(&data[o * slot..(o + 1) * slot]);
    }
    assert!(
        out == expected,
        "the destination pool differs from the expected bytes"
    );
    Ok(())
}

/// Without a driver, a transfer between device pools fails on both sides and quiesces — no
/// panic, no hang. (Where a driver is present this case cannot happen and the test is ignored.)
fn without_a_driver_device_batches_fail_the_request_cleanly() -> Outcome {
    if check_driver().is_ok() {
        return Ok(Completion::ignored_with(
            "skipped: a CUDA driver is present",
        ));
    }
    let mut pair = new_pair();
    // SAFETY: without a driver nothing is ever copied, so the addresses are never touched.
    unsafe {
        register(
            &mut pair,
            (0x7f00_0000_0000, 1 << 24),
            (0x7f10_0000_0000, 1 << 24),
        )
    };
    let events = transfer(&mut pair)?;
    assert!(!completed(&events), "{events:?}");
    for side in [Endpoint::Sender, Endpoint::Receiver] {
        assert!(
            events
                .iter()
                .any(|(s, e)| *s == side && matches!(e, Event::Failed { .. })),
            "{side:?} did not fail: {events:?}"
        );
    }
    assert_eq!(pair.writes_in_flight(), 0);
    Ok(Completion::Completed)
}

// ----- batches without the sessions -----

fn plan(extents: &[(u32, u64, u32, u64, u64)]) -> WritePlan {
    let mut p = WritePlan::new();
    for &(sr, so, dr, doff, len) in extents {
        p.push(WriteExtent {
            src_region: RegionId(sr),
            src_offset: so,
            dst_region: RegionId(dr),
            dst_offset: doff,
            len,
        });
    }
    p
}

/// One batch mixing host → host, host → device, device → device and device → host extents:
/// each lands where it should.
fn a_batch_may_mix_host_and_device_regions(d: &Device) -> Result<(), Failed> {
    let n = 1 << 20;
    let host_src = pattern(n, 1);
    let mut host_dst = vec![0u8; 2 * n];
    let dev_data = pattern(n, 2);
    let mut dev_src = DeviceBuffer::new(d, n)?;
    dev_src.upload(0, &dev_data)?;
    let mut dev_dst = DeviceBuffer::new(d, 2 * n)?;
    dev_dst.fill(0)?;
    let (mut s, mut t) = (RegionTable::new(), RegionTable::new());
    let mut host_src_copy = host_src.clone();
    // SAFETY: every buffer outlives the tables and the batch (declared before them) and is only
    // read after the batch was executed.
    unsafe {
        s.register_slice(RegionId(1), RegionUse::KvPool, &mut host_src_copy)?;
        s.register_device(RegionId(2), RegionUse::KvPool, 0, dev_src.ptr(), n)?;
        t.register_slice(RegionId(3), RegionUse::KvPool, &mut host_dst)?;
        t.register_device(RegionId(4), RegionUse::KvPool, 0, dev_dst.ptr(), 2 * n)?;
    }
    let q = n as u64 / 4;
    let batch = ResolvedBatch::resolve(
        &plan(&[
            (1, 0, 3, 0, q),         // host → host
            (1, q, 4, 0, q),         // host → device
            (2, 0, 4, n as u64, q),  // device → device
            (2, q, 3, n as u64, q),  // device → host
            (2, 2 * q, 4, q, 2 * q), // device → device, continuing the host → device one
        ]),
        &s,
        &t,
    )?;
    assert!(batch.touches_device());
    batch.execute(2, 0)?;
    drop(batch);
    let (q, n) = (q as usize, n);
    assert!(host_dst[..q] == host_src[..q]);
    assert!(host_dst[n..n + q] == dev_data[q..2 * q]);
    assert!(host_dst[q..n].iter().all(|&b| b == 0));
    let out = download(&dev_dst)?;
    assert!(out[..q] == host_src[q..2 * q]);
    assert!(out[q..3 * q] == dev_data[2 * q..4 * q]);
    assert!(out[n..n + q] == dev_data[..q]);
    assert!(out[3 * q..n].iter().all(|&b| b == 0));
    assert!(out[n + q..].iter().all(|&b| b == 0));
    Ok(())
}

/// A device batch in flight holds its registrations: the region cannot be deregistered until
/// the copies are done and the batch is released.
fn a_device_batch_in_flight_keeps_its_regions(d: &Device) -> Result<(), Failed> {
    let n = 64 << 20;
    let mut src = DeviceBuffer::new(d, n)?;
    src.upload(0, &pattern(n, 9))?;
    let dst = DeviceBuffer::new(d, n)?;
    let (mut s, mut t) = (RegionTable::new(), RegionTable::new());
    // SAFETY: the buffers outlive the tables and the batch.
    unsafe {
        s.register_device(RegionId(1), RegionUse::KvPool, 0, src.ptr(), n)?;
        t.register_device(RegionId(2), RegionUse::KvPool, 0, dst.ptr(), n)?;
    }
    assert_eq!(
        t.get(RegionId(2)).map(|r| r.memory.kind()),
        Some(RegionKind::Device { ordinal: 0 })
    );
    let batch = ResolvedBatch::resolve(&plan(&[(1, 0, 2, 0, n as u64)]), &s, &t)?;
    let mut engine = CopyEngine::new(2)?;
    let in_flight = batch.start(&mut engine, 1, 0)?;
    assert_eq!(in_flight.device_copies(), 1);
    assert!(matches!(
        t.deregister(RegionId(2)),
        Err(RegistrationError::InUse { holders: 1, .. })
    ));
    in_flight.wait(std::time::Instant::now() + Duration::from_secs(30))?;
    drop(in_flight);
    assert_eq!(t.deregister(RegionId(2)), Ok(()));
    let mut back = vec![0u8; n];
    dst.download(0, &mut back)?;
    assert!(back == pattern(n, 9));
    Ok(())
}

/// Executing a device batch where the driver cannot be used is an error, not a panic.
fn without_a_driver_executing_a_device_batch_is_an_error() -> Outcome {
    let Err(e) = check_driver() else {
        return Ok(Completion::ignored_with(
            "skipped: a CUDA driver is present",
        ));
    };
    let (mut s, mut t) = (RegionTable::new(), RegionTable::new());
    // SAFETY: without a driver nothing is ever copied, so the addresses are never touched.
    unsafe {
        s.register_device(RegionId(1), RegionUse::KvPool, 0, 0x7f00_0000_0000, 4096)?;
        t.register_device(RegionId(2), RegionUse::KvPool, 0, 0x7f10_0000_0000, 4096)?;
    }
    let batch = ResolvedBatch::resolve(&plan(&[(1, 0, 2, 0, 4096)]), &s, &t)?;
    assert_eq!(batch.execute(1, 0), Err(CopyError::Device(e)));
    Ok(Completion::Completed)
}

/// The second chunk's slice gated behind a fence: its copies wait on the GPU for the compute
/// before the fence, so what that compute leaves in the source (here: bytes written while it
/// runs, after the submission) is what lands; the other chunks' bytes land as they were. (The
/// first chunk's batch made the pair's copy engine: loading its kernel may wait for the GPU.)
fn a_gated_slice_copies_what_the_compute_before_its_fence_left(d: &Device) -> Result<(), Failed> {
    let slot = layout(1).pools[0].slot_bytes as usize;
    let (old, new) = (
        pattern(slot * BLOCKS as usize, 21),
        pattern(slot * BLOCKS as usize, 22),
    );
    let mut src = DeviceBuffer::new(d, old.len())?;
    src.upload(0, &old)?;
    let mut fresh = DeviceBuffer::new(d, new.len())?;
    fresh.upload(0, &new)?;
    let mut dst = DeviceBuffer::new(d, slot * DST_SLOTS as usize)?;
    dst.fill(0x5A)?;
    let mut pair = new_pair();
    // SAFETY: both buffers outlive `pair` (dropped below, before them).
    unsafe { register(&mut pair, (src.ptr(), src.len()), (dst.ptr(), dst.len())) };
    let device = |b: &DeviceBuffer| Memory::Device {
        ordinal: 0,
        addr: b.ptr(),
    };
    // The second chunk sends blocks 5..10 (chunks of 5 blocks and 3 tokens).
    let second = 5 * slot as u64;
    let rewrite = [CopyExtent {
        src: device(&fresh),
        src_offset: second,
        dst: device(&src),
        dst_offset: second,
        len: second,
    }];
    // The writer's streams and kernel are made now: loading a kernel may wait for the GPU.
    let mut writer = CopyEngine::new(1)?;
    let warm = [CopyExtent {
        src: device(&fresh),
        src_offset: 0,
        dst: device(&fresh),
        dst_offset: 64,
        len: 64,
    }];
    // SAFETY: bytes of `fresh` no copy below reads (its first block), waited for here.
    unsafe { writer.submit(&warm) }?.wait(std::time::Instant::now() + Duration::from_secs(30))?;
    let mut busy = BusyKernel::new(d)?;
    let (mut slices, mut gated) = (0, 0);
    let events = transfer_with(&mut pair, &mut |pair, request, outcome| {
        let Some(slice) = outcome.slice() else {
            return Ok(());
        };
        slices += 1;
        if slices == 1 {
            // The first batch goes out and is reported before the gated one is issued.
            pair.drive_until(Duration::from_secs(10), |p| {
                p.writes_in_flight() == 0 && p.stats().batches == 1
            })?;
        }
        if slices != 2 {
            return Ok(());
        }
        gated += 1;
        busy.launch(Duration::from_millis(300))?;
        let fence = std::sync::Arc::new(busy.fence()?);
        pair.gate_slice(request, slice, fence.clone());
        pair.pump()?;
        // The batch is issued; its copies wait for the compute. Write the source meanwhile.
        // SAFETY: `fresh` and `src` outlive the wait; the gated copy reads `src` only after the
        // fence, which this copy ends before (checked below).
        unsafe { writer.submit(&rewrite) }?
            .wait(std::time::Instant::now() + Duration::from_secs(30))?;
        if fence.is_done()? {
            return Err("the compute ended before the source was rewritten: inconclusive".into());
        }
        assert_eq!(pair.writes_in_flight(), 1, "the gated batch is issued");
        assert_eq!(
            pair.stats().batches,
            1,
            "a gated batch reported before its fence"
        );
        Ok(())
    })?;
    assert_eq!(gated, 1);
    assert!(completed(&events), "{events:?}");
    drop(pair);
    let out = download(&dst)?;
    let mut expected = vec![0x5Au8; out.len()];
    for o in 0..BLOCKS as usize {
        let to = dst_slot(o as u32) as usize;
        let from = if (5..10).contains(&o) { &new } else { &old };
        expected[to * slot..(to + 1) * slot].copy_from_slice(&from[o * slot..(o + 1) * slot]);
    }
    assert!(
        out == expected,
        "the gated chunk landed the bytes written before its fence passed, the others as they were"
    );
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        gpu(
            "a_gated_slice_copies_what_the_compute_before_its_fence_left",
            a_gated_slice_copies_what_the_compute_before_its_fence_left,
        ),
        gpu(
            "a_transfer_between_device_pools_lands_every_block",
            a_transfer_between_device_pools_lands_every_block,
        ),
        gpu(
            "a_batch_may_mix_host_and_device_regions",
            a_batch_may_mix_host_and_device_regions,
        ),
        gpu(
            "a_device_batch_in_flight_keeps_its_regions",
            a_device_batch_in_flight_keeps_its_regions,
        ),
        Trial::ignorable_test(
            "without_a_driver_device_batches_fail_the_request_cleanly",
            without_a_driver_device_batches_fail_the_request_cleanly,
        ),
        Trial::ignorable_test(
            "without_a_driver_executing_a_device_batch_is_an_error",
            without_a_driver_executing_a_device_batch_is_an_error,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
