//! `kvpipe bench transfer --transport verbs`: the same request moved between a sender node and
//! a receiver node over RDMA verbs on one device (real sessions, control frames over
//! SEND/RECV, the plan as RDMA WRITEs), against `"baseline":"ib_write_bw"`: perftest's
//! `ib_write_bw` run on the same device in the same run, with the same message size (the
//! transport's RDMA WRITE size) and one queue pair, moving the same number of bytes, its
//! average bandwidth parsed from its report. The transport and the baseline run back to back in
//! alternating order; `ratio` is the median of the runs' own ratios (baseline time / transport
//! time) and `ratio_of_medians` is `gbps / baseline_gbps`, as for the other transports.
//! `ib_write_bw` keeps up to 128 writes in flight; the transport keeps
//! [`FabricConfig::write_window`](kvpipe_ibverbs::FabricConfig::write_window) bytes.

use std::net::TcpListener;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::median;
use kvpipe_core::session::{Deadlines, LocalHello};
use kvpipe_core::wire::Topology;
use kvpipe_core::{
    AnchoredRun, BlockId, InstanceId, LayerGroupLayout, ReceiverConfig, RegionId, RequestId,
    SenderConfig,
};
use kvpipe_ibverbs::{Exposure, MemoryTable, VerbsConfig, VerbsReceiver, VerbsSender};
use serde::Serialize;

use super::pair::{Pair, Patience};
use super::{chunks, layout, mem_available, ContiguousSource, TransferBenchArgs};
use crate::nodes::open_device;
use crate::CliError;

#[derive(Debug, Serialize)]
struct VerbsTransferReport {
    transport: &'static str,
    bytes: u64,
    seconds: f64,
    gbps: f64,
    baseline: &'static str,
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
    device: String,
    /// Bytes per RDMA WRITE, the transport's and the baseline's.
    message_bytes: u64,
    /// Queue pairs, the transport's and the baseline's.
    qps: u32,
    runs: u32,
    memory_limited: bool,
    /// Every run's seconds, transport then baseline.
    transport_runs_s: Vec<f64>,
    baseline_runs_s: Vec<f64>,
}

/// One `ib_write_bw` measurement on `device` (GID `gid`): `iters` writes of `size` bytes over
/// one queue pair between a server and a client process on this machine. Returns the seconds
/// the bytes took at the average bandwidth it reports. Under emulation it now and then reports
/// a bandwidth of 0 (its cycle count goes wrong); such a run is repeated, up to three times.
fn ib_write_bw(device: &str, gid: u32, size: u64, iters: u64) -> Result<f64, CliError> {
    let mut last = None;
    for _ in 0..3 {
        match ib_write_bw_once(device, gid, size, iters) {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| "ib_write_bw did not run".into()))
}

fn ib_write_bw_once(device: &str, gid: u32, size: u64, iters: u64) -> Result<f64, CliError> {
    // A free port for its TCP exchange (taken back at once; a clash only fails this run).
    let port = TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let (gid, size, iters) = (gid.to_string(), size.to_string(), iters.to_string());
    let common = [
        "-d",
        device,
        "-x",
        gid.as_str(),
        "-s",
        size.as_str(),
        "-n",
        iters.as_str(),
        "-q",
        "1",
        "-F",
        // Only the average bandwidth, in Gb/s with six decimals (the table has two, too coarse
        // for an emulated device's fractions of a Gb/s).
        "--report_gbits",
        "--output=bandwidth",
        "-p",
        port.as_str(),
    ];
    let mut server = Command::new("ib_write_bw")
        .args(common)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run ib_write_bw (install perftest): {e}"))?;
    let mut output = None;
    // The server needs a moment to listen; the client is retried until it connects.
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(250));
        let out = Command::new("ib_write_bw")
            .args(common)
            .arg("127.0.0.1")
            .stderr(Stdio::null())
            .output()?;
        if out.status.success() {
            output = Some(out);
            break;
        }
        if server.try_wait()?.is_some() {
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = output.ok_or("ib_write_bw did not run (its client never connected)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let gbits = parse_bandwidth(&text)
        .ok_or_else(|| format!("cannot read ib_write_bw's report:\n{text}"))?;
    let bytes: f64 = size.parse::<f64>()? * iters.parse::<f64>()?;
    Ok(bytes * 8.0 / (gbits * 1e9))
}

/// The average bandwidth (Gb/s) that `ib_write_bw --report_gbits --output=bandwidth` prints
/// on its last line; `None` when there is none or it is 0.
fn parse_bandwidth(text: &str) -> Option<f64> {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())?
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|g| *g > 0.0)
}

pub(super) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
    let device = open_device(args.device.as_deref())?;
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
    // SAFETY: `src` and `dst` outlive both nodes (shut down before the end of this function),
    // are never resized, and are touched here only between transfers (zeroing and
    // verification run after both sides quiesced, when no write is in flight).
    let (tx_regions, rx_regions) = unsafe {
        let mut s = MemoryTable::new();
        s.register_host(
            &device,
            RegionId(1),
            src.as_mut_ptr(),
            src.len(),
            Exposure::Local,
        )?;
        let mut d = MemoryTable::new();
        d.register_host(
            &device,
            RegionId(2),
            dst.as_mut_ptr(),
            dst.len(),
            Exposure::RemoteWrite,
        )?;
        (s, d)
    };
    let name = device.name().to_string();
    let (gid_index, _) = device.gid();
    // Every batch is submitted at once and waits behind the ones before it: on a slow device
    // (Soft-RoCE moves tens of MB/s) the default write deadline would pass.
    let deadlines = Deadlines {
        write_completion: kvpipe_core::Duration::from_secs(1800),
        result_wait: kvpipe_core::Duration::from_secs(1800),
        ..Deadlines::default()
    };
    let mut rx_config = ReceiverConfig::new(hello(2, &dst_layout), 11);
    rx_config.deadlines = deadlines;
    let mut tx_config = SenderConfig::new(hello(1, &src_layout));
    tx_config.deadlines = deadlines;
    let rx = VerbsReceiver::receiver(
        rx_config,
        device.clone(),
        rx_regions,
        VerbsConfig::default(),
    )?;
    let addr = rx.listen("127.0.0.1:0")?;
    let tx = VerbsSender::sender(tx_config, device, tx_regions, VerbsConfig::default())?;
    let message_bytes = tx.fabric().write_request_bytes();
    let receiver_peer = tx.connect(addr)?;
    let pair = Pair::ready(&*tx, &*rx, receiver_peer, Duration::from_secs(30))?;

    let mut anchored = AnchoredRun::empty(0);
    for b in 0..blocks {
        anchored.push(BlockId(b));
    }
    let specs = chunks(tokens, chunk_tokens);
    let bytes = u64::from(blocks) * slot_bytes;
    let iters = bytes.div_ceil(message_bytes);
    let mut source = ContiguousSource { blocks };
    let mut t_verbs = Vec::new();
    let mut t_base = Vec::new();
    let mut verified = true;
    for run in 0..args.runs.max(1) {
        let request = RequestId(u64::from(run) + 1);
        let base_first = run % 2 == 1;
        if base_first {
            t_base.push(ib_write_bw(&name, gid_index, message_bytes, iters)?);
        }
        dst.fill(0);
        let patience = Patience {
            registered: Duration::from_secs(30),
            completed: Duration::from_secs(1800),
            quiesced: Duration::from_secs(30),
        };
        t_verbs.push(pair.timed_request(
            request,
            tokens,
            &anchored,
            &specs,
            &mut source,
            patience,
        )?);
        verified &= src[..bytes as usize] == dst[..bytes as usize];
        if !base_first {
            t_base.push(ib_write_bw(&name, gid_index, message_bytes, iters)?);
        }
    }
    tx.shutdown();
    rx.shutdown();
    drop((tx, rx));

    let paired_ratio = median(t_verbs.iter().zip(&t_base).map(|(t, b)| b / t).collect());
    let seconds = median(t_verbs.clone());
    let baseline_seconds = median(t_base.clone());
    let gbps = bytes as f64 / seconds / 1e9;
    let baseline_gbps = bytes as f64 / baseline_seconds / 1e9;
    let report = VerbsTransferReport {
        transport: "verbs",
        bytes,
        seconds,
        gbps,
        baseline: "ib_write_bw",
        baseline_seconds,
        baseline_gbps,
        ratio: paired_ratio,
        ratio_of_medians: gbps / baseline_gbps,
        verified,
        model: "llama3-8b",
        tokens,
        chunk_tokens,
        write_batches: specs.len() as u32,
        device: name,
        message_bytes,
        qps: 1,
        runs: args.runs.max(1),
        memory_limited,
        transport_runs_s: t_verbs,
        baseline_runs_s: t_base,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "transfer over verbs ({}, 1 QP, {message_bytes}-byte writes): {bytes} bytes ({tokens} tokens of llama3-8b KV, {} batches) in {seconds:.3} s = {gbps:.3} GB/s",
            report.device, report.write_batches
        );
        println!(
            "baseline ib_write_bw, same bytes in {message_bytes}-byte writes on 1 QP: {baseline_seconds:.3} s = {baseline_gbps:.3} GB/s"
        );
        println!(
            "ratio {:.3} (target ≥ 0.9), verified: {verified}{}",
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

#[cfg(test)]
mod tests {
    use super::parse_bandwidth;

    #[test]
    fn reads_the_bandwidth_ib_write_bw_prints() {
        assert_eq!(parse_bandwidth("0.210108\n"), Some(0.210108));
        assert_eq!(
            parse_bandwidth("warning: x\n23.078868\n\n"),
            Some(23.078868)
        );
        assert_eq!(parse_bandwidth("0.000000\n"), None);
        assert_eq!(parse_bandwidth(" #bytes #iterations\n"), None);
        assert_eq!(parse_bandwidth(""), None);
    }
}
