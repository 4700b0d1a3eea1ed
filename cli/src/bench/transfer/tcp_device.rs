//! `kvpipe bench transfer --transport tcp --memory device`: the TCP bench's request with both
//! sides' KV pools in GPU 0's memory, moved between a sender node and a receiver node over
//! loopback sockets through the transport's pinned staging (device → pinned → socket → pinned
//! → device, each hop pipelined with the next).
//!
//! A staged transfer can go no faster than the slower of two things, so the baseline is
//! `min(tcp-raw, pinned-copy)` in bytes per second, both measured in the same run:
//!
//! - `tcp-raw`: the same bytes from host memory to host memory over as many plain loopback
//!   sockets, the best of the TCP bench's sweep of write sizes (see `tcp.rs`);
//! - `pinned-copy`: the same bytes copied by the GPU both ways at once, device → pinned host
//!   memory on one stream and pinned host memory → device on another (`cuMemcpyDtoHAsync` /
//!   `cuMemcpyHtoDAsync` through 256 MiB pinned buffers), until both are done: what PCIe moves
//!   while every byte crosses it twice.
//!
//! Every run moves the request once through the transport, once per raw write size and once
//! through the pinned copy, in an order rotated from run to run; each run's baseline is the
//! slower of its best raw time and its pinned-copy time (the raw size is chosen by median over
//! the runs), and `ratio` is the median of the runs' baseline / transport times. Every
//! transport run starts from a zeroed device destination and is verified after it: the whole
//! destination pool is copied back to the host and compared byte by byte with the source.

use std::process::ExitCode;

use crate::CliError;

/// Without the `cuda` feature there is no device memory to measure.
#[cfg(not(feature = "cuda"))]
pub(super) fn run(_args: super::TransferBenchArgs) -> Result<ExitCode, CliError> {
    Err(crate::NEEDS_CUDA.into())
}

#[cfg(feature = "cuda")]
pub(super) use gpu::run;

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::{Duration, Instant};

    use kvpipe_conformance::cache::fill_filler;
    use kvpipe_conformance::suite::demo::median;
    use kvpipe_core::session::LocalHello;
    use kvpipe_core::wire::Topology;
    use kvpipe_core::{
        AnchoredRun, BlockId, InstanceId, LayerGroupLayout, ReceiverConfig, RegionId, RequestId,
        SenderConfig,
    };
    use kvpipe_cuda::{CopyEngine, CopyExtent, Device, DeviceBuffer, Memory, PinnedBuffer};
    use kvpipe_tcp::{DeviceRegion, RegionTable, TcpConfig, TcpReceiver, TcpSender};
    use serde::Serialize;

    use super::super::pair::Pair;
    use super::super::tcp::{raw_pairs, sweep, timed_raw, RawSize, PATIENCE, RAW_WRITES};
    use super::super::{chunks, layout, mem_available, ContiguousSource, TransferBenchArgs};
    use super::{CliError, ExitCode};

    /// Pinned buffer each direction of the pinned-copy baseline cycles through.
    const PINNED_RING: usize = 256 << 20;
    /// Piece size of the pinned-copy baseline.
    const PINNED_PIECE: u64 = 64 << 20;

    #[derive(Debug, Serialize)]
    struct TcpDeviceReport {
        transport: &'static str,
        memory: &'static str,
        device: String,
        bytes: u64,
        seconds: f64,
        gbps: f64,
        baseline: &'static str,
        /// Median over runs of each run's baseline: the slower of the best raw time and the
        /// pinned-copy time.
        baseline_seconds: f64,
        baseline_gbps: f64,
        /// Median over runs of each run's own ratio (baseline time / transport time).
        ratio: f64,
        /// `gbps / baseline_gbps`.
        ratio_of_medians: f64,
        verified: bool,
        model: &'static str,
        tokens: u32,
        chunk_tokens: u32,
        write_batches: u32,
        connections: usize,
        socket_write_bytes: usize,
        socket_read_bytes: usize,
        staging_slot_bytes: usize,
        staging_slots: usize,
        runs: u32,
        memory_limited: bool,
        writes_refused: u64,
        /// The best raw write size and its figures.
        raw_write: String,
        raw_seconds: f64,
        raw_gbps: f64,
        /// The pinned copy both ways at once.
        pinned_copy_seconds: f64,
        pinned_copy_gbps: f64,
        /// Which of the two limited each run (`tcp-raw` or `pinned-copy`).
        limited_by: Vec<&'static str>,
        transport_runs_s: Vec<f64>,
        baseline_runs_s: Vec<f64>,
        raw_runs_s: Vec<f64>,
        pinned_copy_runs_s: Vec<f64>,
        raw_sweep: Vec<RawSize>,
    }

    /// The pinned-copy baseline: `bytes` device → pinned on `down` and pinned → device on
    /// `up`, at once; returns the seconds until both finished.
    fn pinned_copy(
        down: &mut CopyEngine,
        up: &mut CopyEngine,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        rings: (&PinnedBuffer, &PinnedBuffer),
        bytes: u64,
    ) -> Result<f64, CliError> {
        let dev = |b: &DeviceBuffer| Memory::Device {
            ordinal: b.device().ordinal(),
            addr: b.ptr(),
        };
        let host = |p: &PinnedBuffer| Memory::Host {
            addr: p.as_ptr() as usize,
        };
        let ring = rings.0.len() as u64;
        let mut d2h = Vec::new();
        let mut h2d = Vec::new();
        let mut at = 0;
        while at < bytes {
            let len = (bytes - at).min(PINNED_PIECE);
            let r = at % ring;
            let len = len.min(ring - r);
            d2h.push(CopyExtent {
                src: dev(src),
                src_offset: at,
                dst: host(rings.0),
                dst_offset: r,
                len,
            });
            h2d.push(CopyExtent {
                src: host(rings.1),
                src_offset: r,
                dst: dev(dst),
                dst_offset: at,
                len,
            });
            at += len;
        }
        let t0 = Instant::now();
        // SAFETY: every extent lies inside its buffer (offsets below `bytes` in the pools,
        // below the ring's length in the pinned buffers); nothing else touches the buffers
        // until both tickets are waited for below.
        let (a, b) = unsafe { (down.submit(&d2h)?, up.submit(&h2d)?) };
        let deadline = Instant::now() + Duration::from_secs(120);
        a.wait(deadline)?;
        b.wait(deadline)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Whether the first `bytes` of `dst` equal `src` (read back in pieces).
    fn verify(src: &[u8], dst: &DeviceBuffer, buf: &mut [u8]) -> Result<bool, CliError> {
        let mut at = 0;
        while at < src.len() {
            let take = (src.len() - at).min(buf.len());
            dst.download(at, &mut buf[..take])?;
            if buf[..take] != src[at..at + take] {
                return Ok(false);
            }
            at += take;
        }
        Ok(true)
    }

    pub(in super::super) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
        kvpipe_cuda::check_driver()?;
        let device = Device::open(0)?;
        let name = device.name()?;
        let connections = args.connections().clamp(1, 255);
        let tpb = args.tokens_per_block.max(1);
        let chunk_tokens = args.chunk_tokens.max(tpb) / tpb * tpb;
        let src_layout = layout(1, tpb);
        let dst_layout = layout(2, tpb);
        let slot_bytes = src_layout.pools[0].slot_bytes;
        let per_token = slot_bytes / u64::from(tpb);
        // Both pools on the GPU; on the host the source's content and the raw baseline's
        // destination.
        let mut tokens = args.tokens.max(1);
        let mut memory_limited = false;
        let (free, _) = device.memory_info()?;
        let mut budget = (free as u64).saturating_sub(1 << 30) / 2;
        if let Some(avail) = mem_available() {
            budget = budget.min(avail.saturating_sub(2 << 30) / 2);
        }
        if u64::from(tokens) * per_token > budget {
            tokens = ((budget / per_token) as u32 / chunk_tokens * chunk_tokens).max(chunk_tokens);
            memory_limited = true;
        }
        let blocks = tokens.div_ceil(tpb);
        let bytes = u64::from(blocks) * slot_bytes;
        let pool_bytes = bytes as usize;
        let mut host_src = vec![0u8; pool_bytes];
        fill_filler(RegionId(1), 0, &mut host_src);
        let mut host_dst = vec![1u8; pool_bytes];
        let mut src = DeviceBuffer::new(&device, pool_bytes)?;
        src.upload(0, &host_src)?;
        let mut dst = DeviceBuffer::new(&device, pool_bytes)?;
        dst.fill(1)?;
        let rings = (
            PinnedBuffer::new(&device, PINNED_RING.min(pool_bytes))?,
            PinnedBuffer::new(&device, PINNED_RING.min(pool_bytes))?,
        );
        let (mut down, mut up) = (CopyEngine::new(1)?, CopyEngine::new(1)?);
        let mut readback = vec![0u8; (256 << 20).min(pool_bytes)];

        let hello = |i, l: &LayerGroupLayout| {
            LocalHello::new(InstanceId(i), Topology::default(), vec![l.clone()])
        };
        let defaults = TcpConfig::default();
        let tcp = TcpConfig {
            connections_per_peer: connections,
            socket_write_bytes: args
                .socket_write_bytes
                .unwrap_or(defaults.socket_write_bytes),
            socket_read_bytes: args.socket_read_bytes.unwrap_or(defaults.socket_read_bytes),
            staging_slot_bytes: args
                .staging_slot_bytes
                .unwrap_or(defaults.staging_slot_bytes),
            staging_slots: args.staging_slots.unwrap_or(defaults.staging_slots),
            ..defaults
        };
        let table = |id, b: &DeviceBuffer| {
            let mut t = RegionTable::new();
            // SAFETY: both buffers outlive the nodes (shut down before the end of this
            // function) and are touched here only between transfers (zeroing, verification
            // and the baselines run after both sides quiesced, when no write is in flight).
            t.insert_device(id, unsafe {
                DeviceRegion::from_raw_parts(b.device().ordinal(), b.ptr(), b.len())
            });
            t
        };
        let rx = TcpReceiver::new(
            ReceiverConfig::new(hello(2, &dst_layout), 11),
            tcp.clone(),
            table(RegionId(2), &dst),
        )?;
        let addr = rx.listen("127.0.0.1:0")?;
        let tx = TcpSender::new(
            SenderConfig::new(hello(1, &src_layout)),
            tcp.clone(),
            table(RegionId(1), &src),
        )?;
        let receiver_peer = tx.connect(addr)?;
        let pair = Pair::ready(&*tx, &*rx, receiver_peer, Duration::from_secs(10))?;
        let mut raw = raw_pairs(connections)?;

        let mut anchored = AnchoredRun::empty(0);
        for b in 0..blocks {
            anchored.push(BlockId(b));
        }
        let specs = chunks(tokens, chunk_tokens);
        let mut source = ContiguousSource { blocks };
        let runs = args.runs.max(1);
        let mut t_tcp = Vec::new();
        let mut t_raw: Vec<Vec<f64>> = vec![Vec::new(); RAW_WRITES.len()];
        let mut t_pinned = Vec::new();
        let mut verified = true;
        // Untimed warm-up of the transport (staging buffers and streams created) and of the
        // pinned copy.
        let variants = 2 + RAW_WRITES.len();
        for run in 0..=runs {
            for k in 0..variants {
                let variant = (k + run as usize) % variants;
                if run == 0 && variant > 1 {
                    continue;
                }
                if variant == 1 {
                    let t =
                        pinned_copy(&mut down, &mut up, &src, &dst, (&rings.0, &rings.1), bytes)?;
                    if run > 0 {
                        t_pinned.push(t);
                    }
                    continue;
                }
                if let Some(i) = variant.checked_sub(2) {
                    let (t, ok) =
                        timed_raw(&mut raw, &host_src, &mut host_dst, RAW_WRITES[i], run == 1);
                    t_raw[i].push(t);
                    verified &= ok;
                    continue;
                }
                let request = RequestId(u64::from(run) + 1);
                dst.fill(0)?;
                let elapsed =
                    pair.timed_request(request, tokens, &anchored, &specs, &mut source, PATIENCE)?;
                verified &= verify(&host_src, &dst, &mut readback)?;
                if run > 0 {
                    t_tcp.push(elapsed);
                }
            }
        }
        let writes_refused = rx.stats().writes_refused;
        tx.shutdown();
        rx.shutdown();
        drop((tx, rx));

        let gbps_of = |seconds: f64| bytes as f64 / seconds / 1e9;
        let (raw_sweep, best) = sweep(&t_raw, bytes, connections);
        let t_best = t_raw[best].clone();
        let mut limited_by = Vec::new();
        let t_baseline: Vec<f64> = t_best
            .iter()
            .zip(&t_pinned)
            .map(|(&r, &p)| {
                limited_by.push(if r >= p { "tcp-raw" } else { "pinned-copy" });
                r.max(p)
            })
            .collect();
        let ratio = median(t_tcp.iter().zip(&t_baseline).map(|(t, b)| b / t).collect());
        let seconds = median(t_tcp.clone());
        let baseline_seconds = median(t_baseline.clone());
        let pinned_copy_seconds = median(t_pinned.clone());
        let report = TcpDeviceReport {
            transport: "tcp",
            memory: "device",
            device: name,
            bytes,
            seconds,
            gbps: gbps_of(seconds),
            baseline: "min(tcp-raw, pinned-copy)",
            baseline_seconds,
            baseline_gbps: gbps_of(baseline_seconds),
            ratio,
            ratio_of_medians: baseline_seconds / seconds,
            verified,
            model: "llama3-8b",
            tokens,
            chunk_tokens,
            write_batches: specs.len() as u32,
            connections,
            socket_write_bytes: tcp.socket_write_bytes,
            socket_read_bytes: tcp.socket_read_bytes,
            staging_slot_bytes: tcp.staging_slot_bytes,
            staging_slots: tcp.staging_slots,
            runs,
            memory_limited,
            writes_refused,
            raw_write: raw_sweep[best].write.clone(),
            raw_seconds: raw_sweep[best].seconds,
            raw_gbps: raw_sweep[best].gbps,
            pinned_copy_seconds,
            pinned_copy_gbps: gbps_of(pinned_copy_seconds),
            limited_by,
            transport_runs_s: t_tcp,
            baseline_runs_s: t_baseline,
            raw_runs_s: t_best,
            pinned_copy_runs_s: t_pinned,
            raw_sweep,
        };
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "transfer over tcp in device memory ({}, {connections} connection(s), staging {} × {} KiB): {bytes} bytes ({tokens} tokens of llama3-8b KV, {} batches) in {seconds:.3} s = {:.2} GB/s",
                report.device,
                report.staging_slots,
                report.staging_slot_bytes >> 10,
                report.write_batches,
                report.gbps
            );
            println!(
                "tcp-raw, host to host over {connections} plain socket(s), best write size ({}): {:.3} s = {:.2} GB/s",
                report.raw_write, report.raw_seconds, report.raw_gbps
            );
            println!(
                "pinned-copy, device → pinned and pinned → device at once: {pinned_copy_seconds:.3} s = {:.2} GB/s",
                report.pinned_copy_gbps
            );
            println!(
                "ratio {:.3} against the slower of the two (target ≥ 0.8), verified: {verified}{}",
                report.ratio,
                if memory_limited {
                    " (prompt shortened to fit memory)"
                } else {
                    ""
                }
            );
        }
        Ok(if verified {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}
