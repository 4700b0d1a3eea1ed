//! `kvpipe demo --transport tcp|verbs --connect ADDR`: the prefill side of a two-process transfer. It
//! connects to `kvpipe serve` (the decode side), prefills the workload's requests chunk by chunk
//! into its reference cache, and pushes every chunk's blocks as soon as they are computed.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe::{EmbedError, NodeConfig};
use kvpipe_conformance::cache::AllocationStyle;
use kvpipe_conformance::suite::demo::{median, percentile};
use kvpipe_conformance::suite::PoolMemory;
use kvpipe_core::session::{SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{ChunkSpec, Event, RequestId};
use serde::Serialize;

use super::DemoArgs;
use crate::nodes::{prefill_node, TransportChoice};
use crate::outcome::Failures;
use crate::serve::{two_process_cache, two_process_deadlines};
use crate::CliError;

#[derive(Debug, Serialize)]
struct PrefillReport {
    role: &'static str,
    transport: &'static str,
    peer: String,
    model: &'static str,
    requests: u32,
    completed: u32,
    prompt_tokens: u32,
    chunk_tokens: u32,
    chunks: u32,
    bytes: u64,
    seconds: f64,
    connections: usize,
    /// Where the pools lived: "host" or "device".
    memory: &'static str,
    /// How the data moved: "peer-copy" (CUDA IPC), "socket" or "rdma".
    data_path: &'static str,
    /// Bytes the decode side pulled from this side's device memory (peer copies), acknowledged.
    bytes_placed: u64,
    /// Per request, this side's view (`RequestTimings::tail`): last chunk computed → the
    /// sender finished (last batch written, last result and aux data sent); the median, for
    /// an even count of requests the mean of the middle two. Every figure of no request
    /// (none completed) is `null`, not 0.
    exposed_tail_ms: Option<f64>,
    max_exposed_tail_ms: Option<f64>,
    /// The median again, as the printed "p50" (the p99 is nearest rank).
    exposed_tail_p50_ms: Option<f64>,
    exposed_tail_p99_ms: Option<f64>,
    /// Per request: first batch handed to the transport → last batch reported written; p50
    /// the median, p99 nearest rank.
    transfer_p50_ms: Option<f64>,
    transfer_p99_ms: Option<f64>,
}

pub(super) fn run(args: &DemoArgs, addr: &str, memory: PoolMemory) -> Result<ExitCode, CliError> {
    let tpb = args.tokens_per_block.max(1);
    let mut cache = two_process_cache(
        args.model.groups(args.window),
        tpb,
        args.prompt_tokens,
        args.requests,
        1,
    )?;
    // Device pools: every computed chunk is uploaded before it is submitted.
    memory.place(&mut cache).map_err(|e| e.to_string())?;
    let config = NodeConfig {
        deadlines: two_process_deadlines(),
        ..NodeConfig::new(cache.layouts())
    };
    let connections = args.connections().clamp(1, 255);
    let transport = TransportChoice::parse(&args.transport, connections, args.device.as_deref())?;
    // SAFETY: `cache` outlives the node (shut down below); the engine computes only blocks no
    // transfer reads (a chunk's blocks are sent after they are computed, and stay untouched).
    let tx = unsafe {
        prefill_node(
            &transport,
            config,
            &mut cache,
            args.data_path.unwrap_or(kvpipe_tcp::TcpDataPath::Auto),
        )?
    };
    let peer = tx.connect(addr).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    // What the other side broke, if it broke a rule before the connection closed.
    let mut violation = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "the decode side did not complete the handshake within 10 s: no connection to \
                 {addr} was made, or nothing there answered (is a `kvpipe serve` listening \
                 there, and reachable from here?)"
            )
            .into());
        }
        match tx.next_event(left)? {
            Some(Event::PeerReady { .. }) => break,
            Some(Event::PeerRejected { message, .. }) => {
                return Err(format!("the handshake failed: {message}").into())
            }
            Some(Event::ProtocolViolation { error, .. }) => violation = Some(error.to_string()),
            Some(Event::PeerLost { reason, .. }) => {
                let why = match (reason, violation) {
                    (_, Some(broken)) => format!("this side closed it: {broken}"),
                    (Some(r), None) => format!("this side closed it: {r:?}"),
                    (None, None) => "the other side or the network closed it".to_string(),
                };
                return Err(format!(
                    "the connection to {addr} closed before the handshake completed ({why})"
                )
                .into());
            }
            _ => {}
        }
    }

    let ids: Vec<RequestId> = (1..=args.requests)
        .map(|i| RequestId(u64::from(i)))
        .collect();
    for &id in &ids {
        cache.begin_prefill(
            id,
            args.prompt_tokens,
            args.sender_prefix,
            AllocationStyle::FullPrompt,
        )?;
        tx.open_request(SendRequest {
            request: id,
            receivers: std::iter::once(peer).collect(),
            beam_width: 1,
        })?;
    }
    let step = args.chunk_tokens.max(1);
    let mut events: Vec<(Instant, Event)> = Vec::new();
    // Requests that ended without completing (the decode side lost, silent, or refusing):
    // their remaining chunks are not computed.
    let mut failures = Failures::default();
    let mut chunks = 0u32;
    let start = Instant::now();
    let mut next_start = vec![args.sender_prefix.min(args.prompt_tokens); ids.len()];
    loop {
        let mut any = false;
        for (i, &id) in ids.iter().enumerate() {
            let begin = next_start[i];
            if begin == u32::MAX {
                continue;
            }
            if failures.contains(id) {
                next_start[i] = u32::MAX;
                continue;
            }
            let end = begin.saturating_add(step).min(args.prompt_tokens);
            any = true;
            cache.compute_chunk(id, begin, end)?;
            std::thread::sleep(Duration::from_millis(args.prefill_ms_per_chunk));
            let is_last = end >= args.prompt_tokens;
            next_start[i] = if is_last { u32::MAX } else { end };
            let spec = ChunkSpec {
                start: begin,
                end,
                prompt_len: args.prompt_tokens,
                prepopulated_len: args.sender_prefix,
                is_last,
                prefix_sent_early: false,
            };
            // A request that ended meanwhile (its failure event says why) takes no more chunks.
            let submitted = ended_is_ok(tx.submit_chunk(id, spec, &mut cache))?;
            chunks += u32::from(submitted.is_some());
            if is_last && submitted.is_some() {
                ended_is_ok(tx.submit_aux(
                    id,
                    AuxData {
                        prompt_tokens: args.prompt_tokens,
                        cached_tokens: args.sender_prefix,
                        first_tokens: vec![id.0 as u32],
                        draft_tokens: Vec::new(),
                    },
                ))?;
            }
            if submitted.is_none() {
                next_start[i] = u32::MAX;
            }
            while let Some(e) = tx.next_event(Duration::ZERO)? {
                failures.note(&e);
                events.push((Instant::now(), e));
            }
        }
        if !any || next_start.iter().all(|&s| s == u32::MAX) {
            break;
        }
    }
    let limit = Instant::now() + Duration::from_secs(900);
    let quiesced = |events: &[(Instant, Event)]| {
        events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Quiesced { .. }))
            .count()
    };
    while quiesced(&events) < ids.len() {
        if Instant::now() > limit {
            return Err("the transfer did not finish in 900 s".into());
        }
        if let Some(e) = tx.next_event(Duration::from_millis(200))? {
            failures.note(&e);
            events.push((Instant::now(), e));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let (mut tails, mut transfers) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    let mut completed = 0;
    let ms = |d: kvpipe_core::Duration| d.as_nanos() as f64 / 1e6;
    for (_, e) in &events {
        if let Event::Completed {
            bytes_written,
            timings,
            ..
        } = e
        {
            completed += 1;
            bytes += bytes_written;
            tails.extend(timings.tail().map(ms));
            transfers.extend(timings.transfer().map(ms));
        }
    }
    for &id in &ids {
        let _ = tx.retire(id);
    }
    let path = tx.data_path()?;
    let (data_path, bytes_placed) = (path.path, path.bytes_placed);
    // An orderly close: what is still queued (the last results) reaches the other side before
    // this process exits.
    if let Err(e) = tx.close(Duration::from_secs(10)) {
        eprintln!("kvpipe demo: {e}");
    }
    let max_tail = tails.iter().copied().fold(0.0, f64::max);
    // The exposed tail's median, reported as `exposed_tail_ms` and as its p50.
    let tail_median = median(tails.clone());
    let of_tails = |x: f64| (!tails.is_empty()).then_some(x);
    let of_transfers = |x: f64| (!transfers.is_empty()).then_some(x);
    let report = PrefillReport {
        role: "prefill",
        transport: transport.name(),
        peer: addr.to_string(),
        model: args.model.name(),
        requests: args.requests,
        completed,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        chunks,
        bytes,
        seconds,
        connections,
        memory: memory.name(),
        data_path,
        bytes_placed,
        exposed_tail_ms: of_tails(tail_median),
        max_exposed_tail_ms: of_tails(max_tail),
        exposed_tail_p50_ms: of_tails(tail_median),
        exposed_tail_p99_ms: of_tails(percentile(&tails, 99.0)),
        transfer_p50_ms: of_transfers(median(transfers.clone())),
        transfer_p99_ms: of_transfers(percentile(&transfers, 99.0)),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "prefill side: {} of {} request(s) sent to {addr}, {bytes} bytes in {chunks} chunks, \
             {:.2} s, from {} memory by {}",
            report.completed, report.requests, report.seconds, report.memory, report.data_path
        );
        // Percentiles of no request would print as zeros, which read as instant transfers.
        match (
            report.exposed_tail_p50_ms,
            report.exposed_tail_p99_ms,
            report.max_exposed_tail_ms,
        ) {
            (Some(p50), Some(p99), Some(max)) => println!(
                "exposed tail: p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms (this side's \
                 view: last chunk computed → last result and aux data sent)"
            ),
            _ => println!("exposed tail: none (no request completed)"),
        }
        if let (Some(p50), Some(p99)) = (report.transfer_p50_ms, report.transfer_p99_ms) {
            println!(
                "transfer: p50 {p50:.2} ms, p99 {p99:.2} ms (first batch handed to the transport \
                 → last batch written)"
            );
        }
    }
    for line in failures.lines().chain(failures.served_fewer(ids.len())) {
        eprintln!("kvpipe demo: {line}");
    }
    if failures.len() > 0 {
        let who = format!("the decode side at {addr}");
        return Err(failures.summary(&who, ids.len()).into());
    }
    Ok(if completed == args.requests {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A command's result, with "the request already ended" turned into `None`: the request's
/// failure event (already queued) says why.
fn ended_is_ok<T>(r: Result<T, EmbedError>) -> Result<Option<T>, EmbedError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(EmbedError::Usage(UsageError::SessionEnded(_))) => Ok(None),
        Err(e) => Err(e),
    }
}
