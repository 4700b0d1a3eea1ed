//! How long one write batch's device copies take, seen from the host: issued → seen finished
//! by polling its event, and the GPU's own time between two events around it. Shapes of the
//! demo's batches (llama3-8b, 32-token blocks of 4 MiB): a whole 16-block chunk (64 MiB, one
//! copy), one 4-layer range of it (16 rows of 512 KiB, 4 MiB apart: one 2D copy, or one copy
//! per row on one or two streams), and a 4 KiB copy (the floor). Each shape runs back to back
//! ("busy"), after 20 ms of an idle GPU with this thread asleep ("idle-sleep", as the demo's
//! simulated compute leaves both) and after 20 ms of an idle GPU with this thread spinning
//! ("idle-spin": the GPU's own wake-up alone), then through [`CopyEngine`] as the mem transport
//! submits and polls it, strided runs through kvpipe's row-copy kernel and as 2D copies (two
//! engines, alternating), with one more shape: a chunk whose 16 blocks are not adjacent (rows
//! of 4 MiB, 64 KiB apart).
//!
//! `cargo run --release -p kvpipe-cuda --example copy_latency [-- ROUNDS]`; prints one JSON
//! line per case (medians and 90th percentiles in µs). Needs a GPU; without a driver it says so
//! and exits with status 1.

use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use kvpipe_cuda::{CopyEngine, CopyExtent, Device, DeviceBuffer, Memory};

const MIB: u64 = 1 << 20;

/// One copy shape: rows of `len` bytes, `pitch` apart on both sides.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    rows: u64,
    len: u64,
    pitch: u64,
}

/// What the GPU and this thread did before a copy.
#[derive(Clone, Copy, PartialEq)]
enum Before {
    /// The previous copy, just finished.
    Busy,
    /// 20 ms asleep.
    IdleSleep,
    /// 20 ms spinning on the CPU.
    IdleSpin,
}

impl Before {
    const ALL: [Before; 3] = [Before::Busy, Before::IdleSleep, Before::IdleSpin];

    fn name(self) -> &'static str {
        match self {
            Before::Busy => "busy",
            Before::IdleSleep => "idle-sleep",
            Before::IdleSpin => "idle-spin",
        }
    }

    /// Leaves the GPU idle as this case says.
    fn pause(self) {
        let idle = Duration::from_millis(20);
        match self {
            Before::Busy => {}
            Before::IdleSleep => std::thread::sleep(idle),
            Before::IdleSpin => {
                let start = Instant::now();
                while start.elapsed() < idle {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// How a shape is issued.
#[derive(Clone, Copy, PartialEq)]
enum Issue {
    /// One `cuMemcpy2DAsync` (or one `cuMemcpyDtoDAsync` for one row).
    TwoD,
    /// One `cuMemcpyDtoDAsync` per row, all on stream 0.
    Rows,
    /// One `cuMemcpyDtoDAsync` per row, alternating between two streams.
    RowsTwoStreams,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn check(r: sys::CUresult, what: &str) {
    if r != sys::CUresult::CUDA_SUCCESS {
        panic!("{what}: {r:?}");
    }
}

/// Issues `shape` from `src` to `dst` on `streams` as `issue` says.
///
/// # Safety
/// `src` and `dst` hold `rows * pitch` bytes of device memory of the current context.
unsafe fn issue(shape: Shape, how: Issue, src: u64, dst: u64, streams: &[sys::CUstream; 2]) {
    match how {
        Issue::TwoD if shape.rows > 1 => {
            let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
            let copy = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: device,
                srcHost: std::ptr::null(),
                srcDevice: src,
                srcArray: std::ptr::null_mut(),
                srcPitch: shape.pitch as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: device,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst,
                dstArray: std::ptr::null_mut(),
                dstPitch: shape.pitch as usize,
                WidthInBytes: shape.len as usize,
                Height: shape.rows as usize,
            };
            // SAFETY: the caller's contract.
            check(
                unsafe { sys::cuMemcpy2DAsync_v2(&copy, streams[0]) },
                "cuMemcpy2DAsync",
            );
        }
        _ => {
            for k in 0..shape.rows {
                let s = if how == Issue::RowsTwoStreams {
                    streams[(k % 2) as usize]
                } else {
                    streams[0]
                };
                let off = k * shape.pitch;
                // SAFETY: the caller's contract.
                unsafe { result::memcpy_dtod_async(dst + off, src + off, shape.len as usize, s) }
                    .expect("cuMemcpyDtoDAsync");
            }
        }
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(30);
    if let Err(e) = kvpipe_cuda::check_driver() {
        eprintln!("copy_latency: {e}");
        std::process::exit(1);
    }
    let device = Device::open(0).expect("device 0");
    // The scattered chunk's 16 rows of 4 MiB, 64 KiB apart, need a little over 64 MiB.
    let span = 65 * MIB;
    let src = DeviceBuffer::new(&device, span as usize).expect("source buffer");
    let mut dst = DeviceBuffer::new(&device, span as usize).expect("destination buffer");
    dst.fill(0).expect("fill");
    let ctx = cudarc::driver::CudaContext::new(0).expect("context");
    ctx.bind_to_thread().expect("bind");
    let mk = || result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream");
    let streams = [mk(), mk()];
    let timed = || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).expect("event");
    let (ev0, ev1, ev2) = (timed(), timed(), timed());

    let shapes = [
        Shape {
            name: "chunk 64 MiB (1 copy)",
            rows: 1,
            len: 64 * MIB,
            pitch: 64 * MIB,
        },
        Shape {
            name: "range 16 x 512 KiB, pitch 4 MiB",
            rows: 16,
            len: MIB / 2,
            pitch: 4 * MIB,
        },
        Shape {
            name: "range 8 MiB contiguous (1 copy)",
            rows: 1,
            len: 8 * MIB,
            pitch: 8 * MIB,
        },
        Shape {
            name: "4 KiB",
            rows: 1,
            len: 4096,
            pitch: 4096,
        },
    ];
    for shape in shapes {
        for how in [Issue::TwoD, Issue::Rows, Issue::RowsTwoStreams] {
            if shape.rows == 1 && how != Issue::TwoD {
                continue;
            }
            for before in Before::ALL {
                let (mut host, mut gpu, mut issue_us) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..rounds {
                    before.pause();
                    let t0 = Instant::now();
                    // SAFETY: both buffers hold `span` bytes; every shape fits in it.
                    unsafe {
                        result::event::record(ev0, streams[0]).expect("record");
                        issue(shape, how, src.ptr(), dst.ptr(), &streams);
                        result::event::record(ev1, streams[0]).expect("record");
                        result::event::record(ev2, streams[1]).expect("record");
                    }
                    let t1 = Instant::now();
                    // SAFETY: events of this context, recorded above.
                    while unsafe { result::event::query(ev1) }.is_err()
                        || unsafe { result::event::query(ev2) }.is_err()
                    {
                        std::hint::spin_loop();
                    }
                    let t2 = Instant::now();
                    host.push((t2 - t0).as_nanos() as f64 / 1e3);
                    issue_us.push((t1 - t0).as_nanos() as f64 / 1e3);
                    // SAFETY: completed events of one context.
                    let a = unsafe { result::event::elapsed(ev0, ev1) }.expect("elapsed");
                    let b = unsafe { result::event::elapsed(ev0, ev2) }.expect("elapsed");
                    gpu.push(f64::from(a.max(b)) * 1e3);
                }
                let how_name = match how {
                    Issue::TwoD if shape.rows > 1 => "2d",
                    Issue::TwoD => "1d",
                    Issue::Rows => "rows-1-stream",
                    Issue::RowsTwoStreams => "rows-2-streams",
                };
                println!(
                    "{{\"case\":\"{}\",\"issue\":\"{how_name}\",\"gpu\":\"{}\",\"host_p50_us\":{:.1},\"host_p90_us\":{:.1},\"gpu_p50_us\":{:.1},\"issue_p50_us\":{:.1},\"gbps_p50\":{:.0}}}",
                    shape.name,
                    before.name(),
                    percentile(&mut host, 50.0),
                    percentile(&mut host, 90.0),
                    percentile(&mut gpu, 50.0),
                    percentile(&mut issue_us, 50.0),
                    (shape.rows * shape.len) as f64 / 1e3 / percentile(&mut gpu, 50.0),
                );
            }
        }
    }

    // Through the copy engine, as the mem transport uses it: submit, then poll the ticket;
    // strided runs through the row-copy kernel and as 2D copies, alternating round by round.
    let mut engines = [true, false].map(|kernel| {
        let mut e = CopyEngine::new(2).expect("engine");
        e.set_row_kernel(kernel);
        e
    });
    let mem = |b: &DeviceBuffer| Memory::Device {
        ordinal: 0,
        addr: b.ptr(),
    };
    let scattered = Shape {
        name: "chunk 16 x 4 MiB, pitch 4 MiB + 64 KiB",
        rows: 16,
        len: 4 * MIB,
        pitch: 4 * MIB + 64 * 1024,
    };
    for shape in [shapes[0], shapes[1], scattered, shapes[3]] {
        for before in Before::ALL {
            let extents: Vec<CopyExtent> = (0..shape.rows)
                .map(|k| CopyExtent {
                    src: mem(&src),
                    src_offset: k * shape.pitch,
                    dst: mem(&dst),
                    dst_offset: k * shape.pitch,
                    len: shape.len,
                })
                .collect();
            let (mut host, mut issue_us) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
            let mut copies = 0;
            for _ in 0..rounds {
                for (k, engine) in engines.iter_mut().enumerate() {
                    before.pause();
                    let t0 = Instant::now();
                    // SAFETY: the extents lie in the two buffers, which outlive the ticket.
                    let ticket = unsafe { engine.submit(&extents) }.expect("submit");
                    let t1 = Instant::now();
                    while !ticket.is_complete().expect("query") {
                        std::hint::spin_loop();
                    }
                    host[k].push(t0.elapsed().as_nanos() as f64 / 1e3);
                    issue_us[k].push((t1 - t0).as_nanos() as f64 / 1e3);
                    copies = ticket.copies();
                }
            }
            for (k, strided) in ["row kernel", "2d copy"].iter().enumerate() {
                println!(
                    "{{\"case\":\"engine: {}\",\"strided\":\"{strided}\",\"driver_copies\":{copies},\"gpu\":\"{}\",\"host_p50_us\":{:.1},\"host_p90_us\":{:.1},\"issue_p50_us\":{:.1},\"gbps_p50\":{:.0}}}",
                    shape.name,
                    before.name(),
                    percentile(&mut host[k], 50.0),
                    percentile(&mut host[k], 90.0),
                    percentile(&mut issue_us[k], 50.0),
                    (shape.rows * shape.len) as f64 / 1e3 / percentile(&mut host[k], 50.0),
                );
            }
        }
    }
}
