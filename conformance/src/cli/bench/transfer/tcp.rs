//! `kvpipe bench transfer --transport tcp`: the same request moved between a sender node and a
//! receiver node over loopback TCP (real sessions, grant checks, payloads read straight into the
//! destination), against `tcp-raw`: the same bytes pushed over plain sockets with the same
//! number of connections (one writer and one reader thread per connection, reading straight into
//! the destination too), measured in the same run. The transport and the baseline run back to
//! back in alternating order; `ratio` is the median of the runs' own ratios (as for the mem
//! bench: a change in the shared machine's load between runs cancels out) and
//! `ratio_of_medians` is `gbps / baseline_gbps`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe_conformance::cache::fill_filler;
use kvpipe_conformance::suite::demo::median;
use kvpipe_core::session::{LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, Event, InstanceId, LayerGroupLayout, PeerId, ReceiverConfig, RegionId,
    RequestId, SenderConfig,
};
use kvpipe_tcp::{MemoryRegion, RegionTable, TcpConfig, TcpReceiver, TcpSender};
use serde::Serialize;

use super::{chunks, layout, mem_available, ContiguousSource, TransferBenchArgs};
use crate::cli::CliError;

#[derive(Debug, Serialize)]
struct TcpTransferReport {
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
    connections: usize,
    runs: u32,
    memory_limited: bool,
    writes_refused: u64,
    /// Every run's seconds, transport then baseline.
    transport_runs_s: Vec<f64>,
    baseline_runs_s: Vec<f64>,
}

fn wait_event(
    next: impl Fn(Duration) -> Option<Event>,
    limit: Duration,
    mut pred: impl FnMut(&Event) -> bool,
) -> Result<(), CliError> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(e) = next(Duration::from_millis(100)) {
            match &e {
                Event::Failed { .. } | Event::TimedOut { .. } | Event::PeerRejected { .. } => {
                    return Err(format!("transfer failed: {e:?}").into())
                }
                _ if pred(&e) => return Ok(()),
                _ => {}
            }
        }
    }
    Err("timed out waiting for the transfer".into())
}

/// `connections` connected socket pairs over loopback: (writer end, reader end).
fn raw_pairs(connections: usize) -> std::io::Result<Vec<(TcpStream, TcpStream)>> {
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

/// Pushes `src` into `dst` over the pairs, each connection carrying an equal contiguous share.
fn raw_transfer(pairs: &mut [(TcpStream, TcpStream)], src: &[u8], dst: &mut [u8]) -> bool {
    let n = pairs.len().max(1);
    let share = src.len().div_ceil(n);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for ((w, r), (s, d)) in pairs
            .iter_mut()
            .zip(src.chunks(share).zip(dst.chunks_mut(share)))
        {
            handles.push(scope.spawn(move || w.write_all(s).is_ok()));
            handles.push(scope.spawn(move || r.read_exact(d).is_ok()));
        }
        handles.into_iter().all(|h| h.join().unwrap_or(false))
    })
}

/// One timed baseline run into a zeroed `dst`: its seconds and whether `dst` came out equal.
fn timed_raw(pairs: &mut [(TcpStream, TcpStream)], src: &[u8], dst: &mut [u8]) -> (f64, bool) {
    dst.fill(0);
    let t0 = Instant::now();
    let ok = raw_transfer(pairs, src, dst);
    let t = t0.elapsed().as_secs_f64();
    (t, ok && src == dst)
}

pub(super) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
    let connections = args.connections.clamp(1, 255);
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
    let tcp = TcpConfig {
        connections_per_peer: connections,
        ..TcpConfig::default()
    };
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
    let mut sender_peer = PeerId(0);
    wait_event(
        |t| rx.next_event(t),
        Duration::from_secs(10),
        |e| match e {
            Event::PeerReady { peer, .. } => {
                sender_peer = *peer;
                true
            }
            _ => false,
        },
    )?;
    wait_event(
        |t| tx.next_event(t),
        Duration::from_secs(10),
        |e| matches!(e, Event::PeerReady { .. }),
    )?;
    let mut raw = raw_pairs(connections)?;

    let mut anchored = AnchoredRun::empty(0);
    for b in 0..blocks {
        anchored.push(BlockId(b));
    }
    let specs = chunks(tokens, chunk_tokens);
    let bytes = u64::from(blocks) * slot_bytes;
    let mut source = ContiguousSource { blocks };
    let mut t_tcp = Vec::new();
    let mut t_raw = Vec::new();
    let mut verified = true;
    for run in 0..args.runs.max(1) {
        let request = RequestId(u64::from(run) + 1);
        let raw_first = run % 2 == 1;
        if raw_first {
            let (t, ok) = timed_raw(&mut raw, &src[..bytes as usize], &mut dst[..bytes as usize]);
            t_raw.push(t);
            verified &= ok;
        }
        dst.fill(0);
        rx.register(Registration {
            request,
            prompt_len: tokens,
            groups: vec![anchored.clone()],
            writers: std::iter::once(sender_peer).collect(),
            aux_capacity: 64,
        })?;
        tx.open_request(SendRequest {
            request,
            receivers: std::iter::once(receiver_peer).collect(),
            beam_width: 1,
        })?;
        wait_event(
            |t| tx.next_event(t),
            Duration::from_secs(10),
            |e| matches!(e, Event::Registered { request: r, .. } if *r == request),
        )?;
        let t0 = Instant::now();
        for spec in &specs {
            tx.submit_chunk(request, *spec, &mut source)?;
        }
        tx.submit_aux(
            request,
            AuxData {
                prompt_tokens: tokens,
                ..AuxData::default()
            },
        )?;
        wait_event(
            |t| rx.next_event(t),
            Duration::from_secs(600),
            |e| matches!(e, Event::Completed { request: r, .. } if *r == request),
        )?;
        t_tcp.push(t0.elapsed().as_secs_f64());
        wait_event(
            |t| rx.next_event(t),
            Duration::from_secs(10),
            |e| matches!(e, Event::Quiesced { request: r } if *r == request),
        )?;
        wait_event(
            |t| tx.next_event(t),
            Duration::from_secs(10),
            |e| matches!(e, Event::Quiesced { request: r } if *r == request),
        )?;
        tx.retire(request)?;
        rx.retire(request)?;
        verified &= src[..bytes as usize] == dst[..bytes as usize];

        if !raw_first {
            let (t, ok) = timed_raw(&mut raw, &src[..bytes as usize], &mut dst[..bytes as usize]);
            t_raw.push(t);
            verified &= ok;
        }
    }
    let writes_refused = rx.stats().writes_refused;
    tx.shutdown();
    rx.shutdown();
    drop((tx, rx));

    // Each run's transport and baseline ran back to back: the median of the runs' own ratios
    // is the figure of merit; the ratio of the medians is reported beside it.
    let paired_ratio = median(t_tcp.iter().zip(&t_raw).map(|(t, r)| r / t).collect());
    let seconds = median(t_tcp.clone());
    let baseline_seconds = median(t_raw.clone());
    let gbps = bytes as f64 / seconds / 1e9;
    let baseline_gbps = bytes as f64 / baseline_seconds / 1e9;
    let report = TcpTransferReport {
        transport: "tcp",
        bytes,
        seconds,
        gbps,
        baseline: "tcp-raw",
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
        runs: args.runs.max(1),
        memory_limited,
        writes_refused,
        transport_runs_s: t_tcp,
        baseline_runs_s: t_raw,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "transfer over tcp ({connections} connection(s)): {bytes} bytes ({tokens} tokens of llama3-8b KV, {} batches) in {seconds:.3} s = {gbps:.2} GB/s",
            report.write_batches
        );
        println!(
            "baseline tcp-raw, same bytes over {connections} plain socket(s): {baseline_seconds:.3} s = {baseline_gbps:.2} GB/s"
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
