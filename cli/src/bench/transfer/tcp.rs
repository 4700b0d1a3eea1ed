//! `kvpipe bench transfer --transport tcp`: the same request moved between a sender node and a
//! receiver node over loopback TCP (real sessions, admission of every data write, payloads read
//! straight into the destination), against `tcp-raw`: the same bytes pushed over plain sockets
//! with the same number of connections (one writer and one reader thread per connection, each
//! connection carrying an equal contiguous share, read straight into the destination too).
//!
//! The baseline is the best of a sweep of plain-socket write sizes ([`RAW_WRITES`]: 256 KiB,
//! 1 MiB, 4 MiB, 32 MiB and the whole share in one call), all measured in the same run as the
//! transport: every run moves the request once through the transport and once per write size,
//! in an order rotated from run to run. The best size is the one with the lowest median time;
//! `ratio` is the median over runs of that size's time divided by the transport's time in the
//! same run (a change in the shared machine's load between runs cancels out), and
//! `ratio_of_medians` is `gbps / baseline_gbps`. The JSON lists every size's figures
//! (`raw_sweep`) and names the best (`baseline_write`). Every transfer starts from a zeroed
//! destination; the transport's is verified every run, each raw size's in the first.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::median;
use kvpipe_core::session::LocalHello;
use kvpipe_core::wire::Topology;
use kvpipe_core::{
    AnchoredRun, BlockId, InstanceId, LayerGroupLayout, ReceiverConfig, RegionId, RequestId,
    SenderConfig,
};
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig, TcpReceiver, TcpSender};
use serde::Serialize;

use super::pair::{Pair, Patience};
use super::{chunks, layout, mem_available, ContiguousSource, TransferBenchArgs};
use crate::CliError;

/// Write sizes of the plain-socket sweep (`None`: each connection's whole share in one call).
pub(super) const RAW_WRITES: [Option<usize>; 5] = [
    Some(256 << 10),
    Some(1 << 20),
    Some(4 << 20),
    Some(32 << 20),
    None,
];

#[derive(Debug, Serialize)]
struct TcpTransferReport {
    transport: &'static str,
    bytes: u64,
    seconds: f64,
    gbps: f64,
    baseline: &'static str,
    /// The write size of the best plain-socket configuration.
    baseline_write: String,
    baseline_seconds: f64,
    baseline_gbps: f64,
    /// Median over runs of each run's own ratio (best baseline's time / transport time).
    ratio: f64,
    /// `gbps / baseline_gbps`.
    ratio_of_medians: f64,
    verified: bool,
    model: &'static str,
    tokens: u32,
    chunk_tokens: u32,
    write_batches: u32,
    connections: usize,
    /// The transport's socket call sizes.
    socket_write_bytes: usize,
    socket_read_bytes: usize,
    runs: u32,
    memory_limited: bool,
    writes_refused: u64,
    /// Every run's seconds.
    transport_runs_s: Vec<f64>,
    baseline_runs_s: Vec<f64>,
    /// Every write size of the baseline sweep.
    raw_sweep: Vec<RawSize>,
}

/// One write size of the plain-socket sweep.
#[derive(Debug, Serialize)]
pub(super) struct RawSize {
    pub(super) write: String,
    /// Bytes per write call (the whole share for `whole share`).
    pub(super) write_bytes: u64,
    pub(super) seconds: f64,
    pub(super) gbps: f64,
    pub(super) runs_s: Vec<f64>,
}

/// How long the transport's request waits for each step (loopback: generous).
pub(super) const PATIENCE: Patience = Patience {
    registered: Duration::from_secs(10),
    completed: Duration::from_secs(600),
    quiesced: Duration::from_secs(10),
};

fn write_label(write: Option<usize>) -> String {
    match write {
        None => "whole share".into(),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

/// `connections` connected socket pairs over loopback: (writer end, reader end).
pub(super) fn raw_pairs(connections: usize) -> std::io::Result<Vec<(TcpStream, TcpStream)>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut out = Vec::new();
    for _ in 0..connections {
        let w = TcpStream::connect(addr)?;
        let (r, _) = listener.accept()?;
        w.set_nodelay(true)?;
        r.set_nodelay(true)?;
        out.push((w, r));
    }
    Ok(out)
}

/// Pushes `src` into `dst` over the pairs, each connection carrying an equal contiguous share
/// written in calls of at most `write` bytes (`None`: the whole share at once).
fn raw_transfer(
    pairs: &mut [(TcpStream, TcpStream)],
    src: &[u8],
    dst: &mut [u8],
    write: Option<usize>,
) -> bool {
    let n = pairs.len().max(1);
    let share = src.len().div_ceil(n);
    let step = write.unwrap_or(share).max(1);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for ((w, r), (s, d)) in pairs
            .iter_mut()
            .zip(src.chunks(share).zip(dst.chunks_mut(share)))
        {
            handles.push(scope.spawn(move || s.chunks(step).all(|c| w.write_all(c).is_ok())));
            handles.push(scope.spawn(move || r.read_exact(d).is_ok()));
        }
        handles.into_iter().all(|h| h.join().unwrap_or(false))
    })
}

/// One timed baseline run into a zeroed `dst`: its seconds and, when `verify`, whether `dst`
/// came out equal to `src`.
pub(super) fn timed_raw(
    pairs: &mut [(TcpStream, TcpStream)],
    src: &[u8],
    dst: &mut [u8],
    write: Option<usize>,
    verify: bool,
) -> (f64, bool) {
    dst.fill(0);
    let t0 = Instant::now();
    let ok = raw_transfer(pairs, src, dst, write);
    let t = t0.elapsed().as_secs_f64();
    (t, ok && (!verify || src == dst))
}

/// Every write size's figures from its runs' seconds (`t_raw[i]`: [`RAW_WRITES`]`[i]`), and
/// the index of the best (lowest median time).
pub(super) fn sweep(t_raw: &[Vec<f64>], bytes: u64, connections: usize) -> (Vec<RawSize>, usize) {
    let share = bytes.div_ceil(connections as u64);
    let raw_sweep: Vec<RawSize> = RAW_WRITES
        .iter()
        .zip(t_raw)
        .map(|(&write, runs_s)| {
            let seconds = median(runs_s.clone());
            RawSize {
                write: write_label(write),
                write_bytes: write.map_or(share, |w| w as u64),
                seconds,
                gbps: bytes as f64 / seconds / 1e9,
                runs_s: runs_s.clone(),
            }
        })
        .collect();
    let best = (0..raw_sweep.len())
        .min_by(|&a, &b| raw_sweep[a].seconds.total_cmp(&raw_sweep[b].seconds))
        .unwrap_or(0);
    (raw_sweep, best)
}

pub(super) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
    let connections = args.connections().clamp(1, 255);
    let tpb = args.tokens_per_block.max(1);
    let chunk_tokens = args.chunk_tokens.max(tpb) / tpb * tpb;
    let src_layout = layout(1, tpb);
    let dst_layout = layout(2, tpb);
    let slot_bytes = src_layout.pools[0].slot_bytes;
    let per_token = slot_bytes / u64::from(tpb);
    let mut tokens = args.tokens.max(1);
    let mut memory_limited = false;
    if let Some(avail) = mem_available() {
        let budget = avail.saturating_sub(1 << 30) / 2;
        if u64::from(tokens) * per_token > budget {
            tokens = ((budget / per_token) as u32 / chunk_tokens * chunk_tokens).max(chunk_tokens);
            memory_limited = true;
        }
    }
    let blocks = tokens.div_ceil(tpb);
    let pool_bytes = (u64::from(blocks) * slot_bytes) as usize;
    let mut src = vec![0u8; pool_bytes];
    fill_filler(RegionId(1), 0, &mut src);
    let mut dst = vec![0u8; pool_bytes];
    dst.fill(1);

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
        ..defaults
    };
    let (socket_write_bytes, socket_read_bytes) = (tcp.socket_write_bytes, tcp.socket_read_bytes);
    // SAFETY: `src` and `dst` outlive both nodes (shut down before the end of this function),
    // are never resized, and are touched here only between transfers (zeroing, verification
    // and the raw baseline run after both sides quiesced, when no write is in flight).
    let (tx_regions, rx_regions) = unsafe {
        let s: RegionTable = [(
            RegionId(1),
            MemoryRegion::from_raw_parts(src.as_mut_ptr(), src.len()),
        )]
        .into_iter()
        .collect();
        let d: RegionTable = [(
            RegionId(2),
            MemoryRegion::from_raw_parts(dst.as_mut_ptr(), dst.len()),
        )]
        .into_iter()
        .collect();
        (s, d)
    };
    let rx = TcpReceiver::new(
        ReceiverConfig::new(hello(2, &dst_layout), 11),
        tcp.clone(),
        rx_regions,
    )?;
    let addr = rx.listen("127.0.0.1:0")?;
    let tx = TcpSender::new(SenderConfig::new(hello(1, &src_layout)), tcp, tx_regions)?;
    let receiver_peer = tx.connect(addr)?;
    let pair = Pair::ready(&*tx, &*rx, receiver_peer, Duration::from_secs(10))?;
    let mut raw = raw_pairs(connections)?;

    let mut anchored = AnchoredRun::empty(0);
    for b in 0..blocks {
        anchored.push(BlockId(b));
    }
    let specs = chunks(tokens, chunk_tokens);
    let bytes = u64::from(blocks) * slot_bytes;
    let mut source = ContiguousSource { blocks };
    let runs = args.runs.max(1);
    let (src_bytes, dst_bytes) = (&src[..bytes as usize], &mut dst[..bytes as usize]);
    let mut t_tcp = Vec::new();
    let mut t_raw: Vec<Vec<f64>> = vec![Vec::new(); RAW_WRITES.len()];
    let mut verified = true;
    // Each run moves the request once through the transport and once per raw write size, in an
    // order rotated from run to run.
    let variants = 1 + RAW_WRITES.len();
    for run in 0..runs {
        for k in 0..variants {
            let variant = (k + run as usize) % variants;
            if let Some(i) = variant.checked_sub(1) {
                // Every variant starts from a zeroed destination; every raw size is verified
                // in the first run (comparing 4 GiB costs about as much as the transfer).
                let (t, ok) = timed_raw(&mut raw, src_bytes, dst_bytes, RAW_WRITES[i], run == 0);
                t_raw[i].push(t);
                verified &= ok;
                continue;
            }
            let request = RequestId(u64::from(run) + 1);
            dst_bytes.fill(0);
            let t =
                pair.timed_request(request, tokens, &anchored, &specs, &mut source, PATIENCE)?;
            t_tcp.push(t);
            verified &= src_bytes == &dst_bytes[..];
        }
    }
    let writes_refused = rx.stats().writes_refused;
    tx.shutdown();
    rx.shutdown();
    drop((tx, rx));

    let gbps_of = |seconds: f64| bytes as f64 / seconds / 1e9;
    let (raw_sweep, best) = sweep(&t_raw, bytes, connections);
    // Each run's transport and baseline ran in the same round: the median of the runs' own
    // ratios is the figure of merit; the ratio of the medians is reported beside it.
    let t_best = t_raw[best].clone();
    let paired_ratio = median(t_tcp.iter().zip(&t_best).map(|(t, r)| r / t).collect());
    let seconds = median(t_tcp.clone());
    let baseline_seconds = raw_sweep[best].seconds;
    let (gbps, baseline_gbps) = (gbps_of(seconds), gbps_of(baseline_seconds));
    let report = TcpTransferReport {
        transport: "tcp",
        bytes,
        seconds,
        gbps,
        baseline: "tcp-raw",
        baseline_write: raw_sweep[best].write.clone(),
        baseline_seconds,
        baseline_gbps,
        ratio: paired_ratio,
        ratio_of_medians: gbps / baseline_gbps,
        verified,
        model: "llama3-8b",
        tokens,
        chunk_tokens,
        write_batches: specs.len() as u32,
        connections,
        socket_write_bytes,
        socket_read_bytes,
        runs,
        memory_limited,
        writes_refused,
        transport_runs_s: t_tcp,
        baseline_runs_s: t_best,
        raw_sweep,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "transfer over tcp ({connections} connection(s)): {bytes} bytes ({tokens} tokens of llama3-8b KV, {} batches) in {seconds:.3} s = {gbps:.2} GB/s",
            report.write_batches
        );
        for r in &report.raw_sweep {
            println!(
                "tcp-raw, same bytes over {connections} plain socket(s) in writes of {}: {:.3} s = {:.2} GB/s",
                r.write, r.seconds, r.gbps
            );
        }
        println!(
            "baseline: the best of them ({}): {baseline_seconds:.3} s = {baseline_gbps:.2} GB/s",
            report.baseline_write
        );
        println!(
            "ratio {:.3} (target ≥ 0.95), verified: {verified}{}",
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
