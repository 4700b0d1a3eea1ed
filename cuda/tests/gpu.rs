//! Tests that need a GPU. Each one is reported as ignored, with the reason ("skipped: no CUDA
//! driver"), where no driver or device is found — counted among the ignored tests, never the
//! passed ones (see the crate doc). `scripts/gpu-check` runs them on the GPU machine.

use std::io::{Seek, SeekFrom};
use std::time::{Duration, Instant};

use kvpipe_cuda::{
    check_driver, device_count, host_page_size, BusyKernel, CopyEngine, CopyExtent, CudaError,
    Device, DeviceBuffer, Fence, IpcHandle, IpcMapping, Memory, PinnedBuffer, Stream, Uploader,
};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

type TestResult = Result<(), Failed>;

/// Device 0, or the reason the test is skipped.
fn device() -> Result<Device, String> {
    check_driver().map_err(|e| format!("skipped: {e}"))?;
    Device::open(0).map_err(|e| format!("skipped: {e}"))
}

fn gpu(name: &'static str, test: fn(&Device) -> TestResult) -> Trial {
    Trial::ignorable_test(name, move || match device() {
        Err(reason) => Ok(Completion::ignored_with(reason)),
        Ok(d) => test(&d).map(|()| Completion::Completed),
    })
}

/// Bytes that differ from their neighbours and from zero (xorshift), seeded.
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

fn download(buf: &DeviceBuffer) -> Result<Vec<u8>, CudaError> {
    let mut out = vec![0u8; buf.len()];
    buf.download(0, &mut out)?;
    Ok(out)
}

fn dev(buf: &DeviceBuffer) -> Memory {
    Memory::Device {
        ordinal: buf.device().ordinal(),
        addr: buf.ptr(),
    }
}

fn extent(src: Memory, so: u64, dst: Memory, d: u64, len: u64) -> CopyExtent {
    CopyExtent {
        src,
        src_offset: so,
        dst,
        dst_offset: d,
        len,
    }
}

/// A destination of `len` bytes of `fill` after `extents` copied from `data` into it.
fn expected_after(extents: &[CopyExtent], data: &[u8], fill: u8, len: usize) -> Vec<u8> {
    let mut expected = vec![fill; len];
    for e in extents {
        let (s, t, n) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
        expected[t..t + n].copy_from_slice(&data[s..s + n]);
    }
    expected
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn buffers_round_trip_through_upload_fill_and_download(d: &Device) -> TestResult {
    let data = pattern(3 << 20, 7);
    let mut buf = DeviceBuffer::new(d, data.len())?;
    assert_eq!(buf.ptr() % host_page_size(), 0, "buffers start on a page");
    buf.fill(0xA5)?;
    assert!(download(&buf)?.iter().all(|&b| b == 0xA5));
    buf.upload(0, &data)?;
    assert!(download(&buf)? == data);
    assert!(matches!(
        buf.upload(buf.len() - 2, &[1, 2, 3]),
        Err(CudaError::OutOfBounds { .. })
    ));
    let mut pinned = PinnedBuffer::new(d, 4096)?;
    assert!(pinned.as_slice().iter().all(|&b| b == 0));
    pinned.as_mut_slice().copy_from_slice(&data[..4096]);
    buf.upload(100, pinned.as_slice())?;
    let mut back = vec![0u8; 4096];
    buf.download(100, &mut back)?;
    assert!(back == data[..4096]);
    Ok(())
}

/// Many block-sized extents, most adjacent on both sides (merged into few copies), some
/// scattered; every destination byte checked, untouched bytes keep their poison.
fn device_to_device_extents_are_merged_and_copied_exactly(d: &Device) -> TestResult {
    let block = 64 << 10;
    let blocks = 64u64;
    let data = pattern((block * blocks) as usize, 11);
    let mut src = DeviceBuffer::new(d, data.len())?;
    src.upload(0, &data)?;
    let mut dst = DeviceBuffer::new(d, data.len() * 2)?;
    dst.fill(0xEE)?;
    // Blocks 0..40 to 0..40 (one run), blocks 40..64 to the second half in reverse order
    // (no two adjacent): 1 + 24 copies.
    let mut extents = Vec::new();
    for b in 0..40 {
        extents.push(extent(dev(&src), b * block, dev(&dst), b * block, block));
    }
    for b in 40..blocks {
        let to = blocks + (blocks - 1 - b);
        extents.push(extent(dev(&src), b * block, dev(&dst), to * block, block));
    }
    let mut engine = CopyEngine::new(2)?;
    // SAFETY: both buffers outlive the wait below and nothing else touches them meanwhile.
    let ticket = unsafe { engine.submit(&extents) }?;
    assert_eq!(ticket.copies(), 25);
    assert_eq!(ticket.bytes(), block * blocks);
    ticket.wait(deadline())?;
    assert!(ticket.is_complete()?);
    let out = download(&dst)?;
    assert!(
        out == expected_after(&extents, &data, 0xEE, out.len()),
        "destination differs from the expected bytes"
    );
    Ok(())
}

/// Host → device from pinned and from pageable memory, then device → host, in one submission
/// each; the bytes come back unchanged.
fn host_device_copies_both_ways_from_pinned_and_pageable_memory(d: &Device) -> TestResult {
    let len = 8 << 20;
    let data = pattern(len, 3);
    let mut pinned = PinnedBuffer::new(d, len)?;
    pinned.as_mut_slice().copy_from_slice(&data);
    let pageable = pattern(len, 5);
    let mut buf = DeviceBuffer::new(d, 2 * len)?;
    buf.fill(0)?;
    let host = |p: *const u8| Memory::Host { addr: p as usize };
    let mut engine = CopyEngine::new(2)?;
    let up = [
        extent(host(pinned.as_ptr()), 0, dev(&buf), 0, len as u64),
        extent(
            host(pageable.as_ptr()),
            0,
            dev(&buf),
            len as u64,
            len as u64,
        ),
    ];
    // SAFETY: the host buffers and `buf` outlive the wait and are not touched meanwhile.
    unsafe { engine.submit(&up) }?.wait(deadline())?;
    let mut back = vec![0u8; 2 * len];
    let down = [extent(
        dev(&buf),
        0,
        host(back.as_mut_ptr()),
        0,
        2 * len as u64,
    )];
    // SAFETY: as above; `back` is not read before the wait returns.
    let ticket = unsafe { engine.submit(&down) }?;
    assert_eq!(ticket.copies(), 1);
    ticket.wait(deadline())?;
    assert!(back[..len] == data[..], "pinned half differs");
    assert!(back[len..] == pageable[..], "pageable half differs");
    Ok(())
}

/// A head slice of every layer plane (one strided run: sources adjacent, destinations a plane
/// apart) lands exactly, and bytes between the rows stay as they were: through the row-copy
/// kernel where the run is aligned to 16 bytes and within its grid, as a 2D copy otherwise,
/// and as a 2D copy with the kernel turned off.
fn strided_extents_go_as_one_copy_and_land_exactly(d: &Device) -> TestResult {
    // (row bytes, planes, destination shift): rows of 8 KiB, of 8200 bytes (not a multiple of
    // 16), of 1 MiB, of 16 bytes, of 48 bytes in more rows than the kernel's grid holds, and
    // of 8 KiB shifted by 8 bytes (aligned rows at unaligned addresses).
    let shapes = [
        (8192u64, 80u64, 0u64),
        (8200, 80, 0),
        (1 << 20, 64, 0),
        (16, 5000, 0),
        (48, 70_000, 0),
        (8192, 80, 8),
    ];
    for kernel in [true, false] {
        for (row, planes, shift) in shapes {
            let heads = 4u64;
            let data = pattern((row * planes) as usize, 17 + row);
            let mut src = DeviceBuffer::new(d, data.len())?;
            src.upload(0, &data)?;
            let mut dst = DeviceBuffer::new(d, (row * planes * heads + shift) as usize)?;
            dst.fill(0x5A)?;
            let head = 2;
            let extents: Vec<_> = (0..planes)
                .map(|p| {
                    let at = (p * heads + head) * row + shift;
                    extent(dev(&src), p * row, dev(&dst), at, row)
                })
                .collect();
            let mut engine = CopyEngine::new(2)?;
            engine.set_row_kernel(kernel);
            // SAFETY: both buffers outlive the wait below and nothing else touches them
            // meanwhile.
            let ticket = unsafe { engine.submit(&extents) }?;
            assert_eq!(ticket.copies(), 1);
            assert_eq!(ticket.bytes(), row * planes);
            ticket.wait(deadline())?;
            let out = download(&dst)?;
            assert!(
                out == expected_after(&extents, &data, 0x5A, out.len()),
                "rows of {row} bytes shifted by {shift}, kernel {kernel}"
            );
        }
    }
    Ok(())
}

/// Several submissions in flight at once on several streams: each ticket completes and every
/// byte lands; a ticket is polled without blocking until it completes.
fn many_submissions_in_flight_complete_independently(d: &Device) -> TestResult {
    let chunk = 16 << 20;
    let chunks = 8;
    let data = pattern(chunk * chunks, 13);
    let mut src = DeviceBuffer::new(d, data.len())?;
    src.upload(0, &data)?;
    let mut dst = DeviceBuffer::new(d, data.len())?;
    dst.fill(0)?;
    let mut engine = CopyEngine::new(4)?;
    let mut tickets = Vec::new();
    for c in 0..chunks as u64 {
        // Each chunk as 16 interleaved extents, so they do not merge: the engine spreads them.
        let n = 16u64;
        let piece = chunk as u64 / n;
        let extents: Vec<_> = (0..n)
            .map(|i| {
                let off = c * chunk as u64 + ((i * 7) % n) * piece;
                extent(dev(&src), off, dev(&dst), off, piece)
            })
            .collect();
        // SAFETY: both buffers outlive the waits below and are not touched meanwhile.
        tickets.push(unsafe { engine.submit(&extents) }?);
    }
    let limit = deadline();
    for t in &tickets {
        while !t.is_complete()? {
            assert!(Instant::now() < limit, "a ticket did not complete in 30 s");
            std::thread::yield_now();
        }
    }
    assert!(download(&dst)? == data);
    Ok(())
}

/// Events go back to the engine when a ticket is dropped and are recorded again by later
/// submissions: a ticket that reuses one still reports only its own copies (a small copy
/// submitted behind a large one in flight lands before its ticket says so), over many rounds.
/// Prints the median cost of one small submission, polled until done, in microseconds.
fn reused_events_report_only_their_own_copies(d: &Device) -> TestResult {
    let big = 64 << 20;
    let small = 4096;
    let data = pattern(big, 21);
    let mut src = DeviceBuffer::new(d, big)?;
    src.upload(0, &data)?;
    let mut dst = DeviceBuffer::new(d, big)?;
    let mut engine = CopyEngine::new(2)?;
    for round in 0..50u64 {
        let limit = deadline();
        dst.fill(0)?;
        // SAFETY: both buffers outlive the waits below and are not touched meanwhile.
        let large = unsafe { engine.submit(&[extent(dev(&src), 0, dev(&dst), 0, big as u64)]) }?;
        let at = big as u64 - small as u64 * (1 + round % 16);
        // SAFETY: as above; the small copy reads bytes the large one does not write.
        let ticket =
            unsafe { engine.submit(&[extent(dev(&src), at, dev(&dst), at, small as u64)]) }?;
        while !ticket.is_complete()? {
            assert!(Instant::now() < limit, "a ticket did not complete in 30 s");
        }
        drop(ticket);
        large.wait(limit)?;
        let mut landed = vec![0u8; small];
        dst.download(at as usize, &mut landed)?;
        assert!(
            landed == data[at as usize..at as usize + small],
            "round {round}"
        );
    }
    // Without a large copy in flight: the submission's own cost.
    let limit = deadline();
    let mut alone = Vec::new();
    for _ in 0..1000 {
        let start = Instant::now();
        // SAFETY: as above.
        let ticket = unsafe { engine.submit(&[extent(dev(&src), 0, dev(&dst), 0, small as u64)]) }?;
        while !ticket.is_complete()? {
            assert!(Instant::now() < limit, "a ticket did not complete in 30 s");
        }
        drop(ticket);
        alone.push(start.elapsed());
    }
    alone.sort();
    println!(
        "small device copy, submit + poll until done: median {:.1} µs, p90 {:.1} µs (1000 rounds)",
        alone[alone.len() / 2].as_secs_f64() * 1e6,
        alone[alone.len() * 9 / 10].as_secs_f64() * 1e6
    );
    Ok(())
}

fn host_to_host_extents_are_refused(_d: &Device) -> TestResult {
    let a = [1u8; 8];
    let mut b = [0u8; 8];
    let mut engine = CopyEngine::new(1)?;
    let e = extent(
        Memory::Host {
            addr: a.as_ptr() as usize,
        },
        0,
        Memory::Host {
            addr: b.as_mut_ptr() as usize,
        },
        0,
        8,
    );
    // SAFETY: refused before any copy is issued.
    let r = unsafe { engine.submit(&[e]) };
    assert_eq!(r.unwrap_err(), CudaError::HostToHost { index: 0 });
    assert_eq!(b, [0u8; 8]);
    Ok(())
}

/// A range of a device buffer exported as a dmabuf: the fd covers the whole pages around it
/// (a dmabuf's size is what seeking to its end returns) and the offset says where it starts.
fn device_memory_exports_as_a_dmabuf(d: &Device) -> TestResult {
    if !d.supports_dmabuf()? {
        return Err("the device reports no dmabuf support".into());
    }
    let page = host_page_size();
    let buf = DeviceBuffer::new(d, 4 << 20)?;
    let whole = buf.export_dmabuf(0, buf.len())?;
    assert_eq!(
        (whole.offset, whole.len, whole.addr),
        (0, 4 << 20, buf.ptr())
    );
    let mut f = std::fs::File::from(whole.fd);
    assert_eq!(f.seek(SeekFrom::End(0))?, 4 << 20);
    let (off, len) = (page as usize + 100, 3 * page as usize);
    let part = buf.export_dmabuf(off, len)?;
    assert_eq!(part.offset, 100);
    assert_eq!(part.len, len as u64);
    assert_eq!(part.addr, buf.ptr() + off as u64);
    let mut f = std::fs::File::from(part.fd);
    assert_eq!(f.seek(SeekFrom::End(0))?, 4 * page);
    assert!(matches!(
        buf.export_dmabuf(buf.len() - 10, 20),
        Err(CudaError::OutOfBounds { .. })
    ));
    Ok(())
}

/// Device 0 → device 1 and back through the engine (needs two GPUs).
fn peer_copies_between_two_devices() -> Result<Completion, Failed> {
    let d0 = match device() {
        Ok(d) => d,
        Err(reason) => return Ok(Completion::ignored_with(reason)),
    };
    if device_count()? < 2 {
        return Ok(Completion::ignored_with("skipped: needs 2 CUDA devices"));
    }
    let d1 = Device::open(1)?;
    let data = pattern(32 << 20, 17);
    let mut a = DeviceBuffer::new(&d0, data.len())?;
    a.upload(0, &data)?;
    let mut b = DeviceBuffer::new(&d1, data.len())?;
    b.fill(0)?;
    let mut c = DeviceBuffer::new(&d0, data.len())?;
    c.fill(0)?;
    let mut engine = CopyEngine::new(2)?;
    let len = data.len() as u64;
    // SAFETY: the buffers outlive the waits and are not touched meanwhile.
    unsafe { engine.submit(&[extent(dev(&a), 0, dev(&b), 0, len)]) }?.wait(deadline())?;
    // SAFETY: as above.
    unsafe { engine.submit(&[extent(dev(&b), 0, dev(&c), 0, len)]) }?.wait(deadline())?;
    assert!(download(&b)? == data);
    assert!(download(&c)? == data);
    Ok(Completion::Completed)
}

/// Bytes of the IPC round trip and of each bench repetition.
const IPC_BYTES: usize = 256 << 20;
/// Extents the bench copies (one KV block's worth of bytes each, like a write plan's pieces).
const BENCH_EXTENT: u64 = 4 << 20;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// The importing process of the IPC tests (this binary started again with `KVPIPE_IPC_CHILD`
/// set to the handle): opens the handle on `KVPIPE_IPC_ORDINAL`, checks that it reads the
/// exporter's pattern, overwrites it with the next pattern through the copy engine, and with
/// `KVPIPE_IPC_BENCH` set times the copy engine against a plain `cuMemcpyDtoDAsync` loop of the
/// same extents into the mapping and prints one JSON line.
fn ipc_child(handle_hex: &str) -> Result<(), Box<dyn std::error::Error>> {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let ordinal: usize = env("KVPIPE_IPC_ORDINAL").parse().unwrap_or(0);
    let seed: u64 = env("KVPIPE_IPC_SEED").parse()?;
    let handle = IpcHandle::from_bytes(&unhex(handle_hex))?;
    let device = Device::open(ordinal)?;
    let mapping = IpcMapping::open(&device, &handle)?;
    let len = mapping.len() as usize;
    let mut local = DeviceBuffer::new(&device, len)?;
    local.fill(0)?;
    let remote = Memory::Device {
        ordinal: mapping.ordinal(),
        addr: mapping.ptr(),
    };
    let mut engine = CopyEngine::new(2)?;
    // SAFETY: both allocations live until the waits return; the exporter does not touch its
    // buffer while this process runs.
    unsafe { engine.submit(&[extent(remote, 0, dev(&local), 0, len as u64)]) }?.wait(deadline())?;
    if download(&local)? != pattern(len, seed) {
        return Err("the mapping does not hold the exporter's bytes".into());
    }
    local.upload(0, &pattern(len, seed + 1))?;
    let extents: Vec<CopyExtent> = (0..len as u64)
        .step_by(BENCH_EXTENT as usize)
        .map(|o| extent(dev(&local), o, remote, o, BENCH_EXTENT.min(len as u64 - o)))
        .collect();
    // SAFETY: as above.
    unsafe { engine.submit(&extents) }?.wait(deadline())?;
    if std::env::var_os("KVPIPE_IPC_BENCH").is_some() {
        let reps = 20;
        let stream = Stream::new(&device)?;
        let mut best = (f64::MAX, f64::MAX);
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..reps {
                // SAFETY: as above; every submission is waited for.
                unsafe { engine.submit(&extents) }?.wait(deadline())?;
            }
            let engine_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for _ in 0..reps {
                for e in &extents {
                    // SAFETY: as above; the stream is synchronized below.
                    unsafe {
                        stream.copy_dtod(
                            mapping.ptr() + e.dst_offset,
                            local.ptr() + e.src_offset,
                            e.len as usize,
                        )
                    }?;
                }
                stream.synchronize()?;
            }
            let base_s = t.elapsed().as_secs_f64();
            best = (best.0.min(engine_s), best.1.min(base_s));
        }
        let bytes = (len * reps) as f64;
        let (gbps, base) = (bytes / best.0 / 1e9, bytes / best.1 / 1e9);
        println!(
            "{{\"figure\":\"ipc-copy\",\"bytes_per_rep\":{len},\"extent_bytes\":{BENCH_EXTENT},\"reps\":{reps},\"exporter_gpu\":0,\"importer_gpu\":{ordinal},\"gbps\":{gbps:.1},\"baseline\":\"cuda-memcpy-peer\",\"baseline_gbps\":{base:.1},\"ratio\":{:.3}}}",
            gbps / base
        );
        // The mapping ends with the pattern the parent checks.
        // SAFETY: as above.
        unsafe { engine.submit(&extents) }?.wait(deadline())?;
    }
    Ok(())
}

/// Exports a buffer, lets a second process (this binary again) open it, read it and overwrite
/// it, and checks the bytes it left; the exporting process itself cannot open its own handle.
fn ipc_round_trip(d: &Device, bench: bool) -> TestResult {
    let seed = 41;
    let mut buf = DeviceBuffer::new(d, IPC_BYTES)?;
    buf.upload(0, &pattern(IPC_BYTES, seed))?;
    let handle = buf.export_ipc()?;
    assert_eq!(handle.len, IPC_BYTES as u64);
    assert_eq!(IpcHandle::from_bytes(&handle.to_bytes())?, handle);
    // The driver refuses a handle in the process that exported it: an error, never a panic.
    assert!(IpcMapping::open(d, &handle).is_err());
    let ordinal = if bench && device_count()? > 1 { 1 } else { 0 };
    let mut child = std::process::Command::new(std::env::current_exe()?);
    child
        .env("KVPIPE_IPC_CHILD", hex(&handle.to_bytes()))
        .env("KVPIPE_IPC_SEED", seed.to_string())
        .env("KVPIPE_IPC_ORDINAL", ordinal.to_string());
    if bench {
        child.env("KVPIPE_IPC_BENCH", "1");
    }
    let out = child.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "importer failed: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    if bench {
        for line in stdout.lines().filter(|l| l.starts_with('{')) {
            println!("{line}");
        }
    }
    assert!(
        download(&buf)? == pattern(IPC_BYTES, seed + 1),
        "the importer's copies did not land in the exported buffer"
    );
    Ok(())
}

fn ipc_memory_round_trips_between_two_processes(d: &Device) -> TestResult {
    ipc_round_trip(d, false)
}

fn ipc_copy_bench_against_cuda_memcpy(d: &Device) -> TestResult {
    ipc_round_trip(d, true)
}

/// The busy kernel holds its GPU for the time asked (its event not done before), and a copy
/// on another stream is not held up behind it.
fn the_busy_kernel_keeps_the_gpu_busy_for_the_time_asked(d: &Device) -> TestResult {
    // Everything that may synchronize the context (allocations, loading the kernel, the copy
    // engine's first streams) happens before the kernel runs.
    let (mut src, dst) = (
        DeviceBuffer::new(d, 1 << 20)?,
        DeviceBuffer::new(d, 1 << 20)?,
    );
    src.upload(0, &pattern(1 << 20, 5))?;
    let mut engine = CopyEngine::new(1)?;
    let copy = [extent(dev(&src), 0, dev(&dst), 0, 1 << 20)];
    // SAFETY: both buffers outlive the waits below and nothing else touches them meanwhile.
    unsafe { engine.submit(&copy) }?.wait(deadline())?;
    let mut busy = BusyKernel::new(d)?;
    assert!(busy.is_done()?, "nothing launched yet");
    let start = Instant::now();
    busy.launch(Duration::from_millis(20))?;
    assert!(!busy.is_done()?, "done at once after a 20 ms launch");
    // A 1 MiB copy on the copy engine's stream finishes while the kernel still runs.
    // SAFETY: as above.
    unsafe { engine.submit(&copy) }?.wait(deadline())?;
    let copied = start.elapsed();
    while !busy.is_done()? {
        if start.elapsed() > Duration::from_secs(10) {
            return Err("the busy kernel ran past 10 s".into());
        }
        std::hint::spin_loop();
    }
    let held = start.elapsed();
    assert!(held >= Duration::from_millis(19), "done after {held:?}");
    assert!(
        copied < Duration::from_millis(19),
        "the copy waited {copied:?}"
    );
    assert_eq!(download(&dst)?, pattern(1 << 20, 5));
    // Launches queue behind each other.
    let start = Instant::now();
    busy.launch(Duration::from_millis(5))?;
    busy.launch(Duration::from_millis(5))?;
    while !busy.is_done()? {
        std::hint::spin_loop();
    }
    assert!(
        start.elapsed() >= Duration::from_millis(9),
        "{:?}",
        start.elapsed()
    );
    // Dropping it while a launch runs does not wait for the launch.
    busy.launch(Duration::from_secs(5))?;
    let start = Instant::now();
    drop(busy);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    Ok(())
}

fn uploads_larger_than_the_staging_land_in_pieces_once_finished(d: &Device) -> TestResult {
    let data = pattern(5 << 20, 11);
    let mut buf = DeviceBuffer::new(d, 8 << 20)?;
    buf.fill(0)?;
    // Staging of 1 MiB + 3 bytes: pieces end in the middle of words, and the staging fills
    // up several times within one upload.
    let mut up = Uploader::new(d, (1 << 20) + 3)?;
    let pieces = [
        (0usize, 7usize),
        (4096, 2 << 20),
        (3 << 20, 1),
        ((3 << 20) + 9, 3 << 20),
    ];
    let mut expected = vec![0u8; buf.len()];
    for &(at, len) in &pieces {
        let mut src = data[..len].to_vec();
        up.upload(&mut buf, at, &src)?;
        // The uploader took its own copy: changing the source afterwards changes nothing.
        src.fill(0xEE);
        expected[at..at + len].copy_from_slice(&data[..len]);
    }
    up.finish()?;
    assert!(
        download(&buf)? == expected,
        "every piece landed where asked"
    );
    let near_end = buf.len() - 2;
    assert!(matches!(
        up.upload(&mut buf, near_end, &[1, 2, 3]),
        Err(CudaError::OutOfBounds { .. })
    ));
    up.finish()?;
    assert!(
        download(&buf)? == expected,
        "a refused upload wrote nothing"
    );
    Ok(())
}

fn copies_after_a_fence_start_once_the_work_before_it_ran(d: &Device) -> TestResult {
    let n = 1 << 20;
    let (mut src, mut fresh, mut dst) = (
        DeviceBuffer::new(d, n)?,
        DeviceBuffer::new(d, n)?,
        DeviceBuffer::new(d, n)?,
    );
    src.upload(0, &pattern(n, 1))?;
    fresh.upload(0, &pattern(n, 2))?;
    let copy = [extent(dev(&src), 0, dev(&dst), 0, n as u64)];
    let rewrite = [extent(dev(&fresh), 0, dev(&src), 0, n as u64)];
    // Two engines, each with its streams made (and its kernel loaded) before the compute runs.
    let (mut gated, mut free) = (CopyEngine::new(1)?, CopyEngine::new(1)?);
    // SAFETY (every submission below): the buffers outlive the waits, and nothing but the
    // submissions touches them meanwhile.
    unsafe { gated.submit(&copy) }?.wait(deadline())?;
    unsafe { free.submit(&copy) }?.wait(deadline())?;
    dst.fill(0)?;
    let mut busy = BusyKernel::new(d)?;
    busy.launch(Duration::from_millis(300))?;
    let fence: Fence = busy.fence()?;
    let ticket = unsafe { gated.submit_after(&copy, Some(&fence)) }?;
    // While the compute runs the fenced copy has not started: the source written now (on
    // another engine's stream) is what it copies.
    unsafe { free.submit(&rewrite) }?.wait(deadline())?;
    if fence.is_done()? {
        return Err("the compute ended before the source was rewritten: inconclusive".into());
    }
    assert!(!ticket.is_complete()?, "the copy ran before its fence");
    ticket.wait(deadline())?;
    assert!(fence.is_done()?, "the copy completed before its fence");
    assert!(
        download(&dst)? == pattern(n, 2),
        "the copy read its source as it was when the fence passed"
    );
    // The same copy without a fence runs during the compute (the check above can fail).
    busy.launch(Duration::from_millis(300))?;
    let second = busy.fence()?;
    unsafe { gated.submit(&rewrite) }?.wait(deadline())?;
    assert!(
        !second.is_done()?,
        "an unfenced copy waited for the compute"
    );
    second.wait(deadline())?;
    assert!(second.is_done()?);
    // A fence on a stream with nothing queued is passed at once.
    // SAFETY: 0 is the legacy default stream.
    let idle = unsafe { Fence::record(d, 0) }?;
    idle.wait(deadline())?;
    assert_eq!(idle.ordinal(), d.ordinal());
    Ok(())
}

fn main() {
    if let Ok(handle) = std::env::var("KVPIPE_IPC_CHILD") {
        match ipc_child(&handle) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("ipc child: {e}");
                std::process::exit(1)
            }
        }
    }
    let args = Arguments::from_args();
    let tests = vec![
        gpu(
            "copies_after_a_fence_start_once_the_work_before_it_ran",
            copies_after_a_fence_start_once_the_work_before_it_ran,
        ),
        gpu(
            "the_busy_kernel_keeps_the_gpu_busy_for_the_time_asked",
            the_busy_kernel_keeps_the_gpu_busy_for_the_time_asked,
        ),
        gpu(
            "ipc_memory_round_trips_between_two_processes",
            ipc_memory_round_trips_between_two_processes,
        ),
        gpu(
            "ipc_copy_bench_against_cuda_memcpy",
            ipc_copy_bench_against_cuda_memcpy,
        ),
        gpu(
            "buffers_round_trip_through_upload_fill_and_download",
            buffers_round_trip_through_upload_fill_and_download,
        ),
        gpu(
            "uploads_larger_than_the_staging_land_in_pieces_once_finished",
            uploads_larger_than_the_staging_land_in_pieces_once_finished,
        ),
        gpu(
            "device_to_device_extents_are_merged_and_copied_exactly",
            device_to_device_extents_are_merged_and_copied_exactly,
        ),
        gpu(
            "host_device_copies_both_ways_from_pinned_and_pageable_memory",
            host_device_copies_both_ways_from_pinned_and_pageable_memory,
        ),
        gpu(
            "strided_extents_go_as_one_copy_and_land_exactly",
            strided_extents_go_as_one_copy_and_land_exactly,
        ),
        gpu(
            "many_submissions_in_flight_complete_independently",
            many_submissions_in_flight_complete_independently,
        ),
        gpu(
            "reused_events_report_only_their_own_copies",
            reused_events_report_only_their_own_copies,
        ),
        gpu(
            "host_to_host_extents_are_refused",
            host_to_host_extents_are_refused,
        ),
        gpu(
            "device_memory_exports_as_a_dmabuf",
            device_memory_exports_as_a_dmabuf,
        ),
        Trial::ignorable_test(
            "peer_copies_between_two_devices",
            peer_copies_between_two_devices,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
