//! `kvpipe serve --listen ADDR`: the decode side of a two-process transfer over TCP or RDMA
//! verbs (`--transport`). It builds the decode engine's reference cache, waits for a prefill
//! node (`kvpipe demo --transport tcp|verbs --connect ADDR`, given the same workload flags) to
//! connect, registers the workload's
//! requests with it, and verifies every byte that arrives against the deterministic content the
//! prefill side computed.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvpipe::{DecodeNode, NodeConfig};
use kvpipe_conformance::cache::{CacheSpec, GroupSpec, ReferenceCache};
use kvpipe_conformance::suite::demo::{median, percentile, Model};
use kvpipe_core::session::{Deadlines, Registration};
use kvpipe_core::wire::Role;
use kvpipe_core::{Event, PeerId, RequestId};
use serde::Serialize;

use super::nodes::{decode_node, TransportChoice};
use super::observe::MetricsEndpoint;
use super::outcome::Failures;
use super::{preflight, CliError};

/// Arguments of `kvpipe serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on (for example 127.0.0.1:7070; port 0 picks a free one, printed on
    /// stderr).
    #[arg(long)]
    listen: String,
    /// Transport: tcp, or verbs (RDMA: the bootstrap listens on --listen, data moves by RDMA
    /// WRITE on --device).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// With --transport verbs: the RDMA device (default: the first with an active port).
    #[arg(long)]
    device: Option<String>,
    /// Model whose KV cache is received (as `kvpipe demo --model`).
    #[arg(long, default_value = "llama3-8b", value_parser = parse_model)]
    model: Model,
    /// Tokens in each request's prompt (default 4096; 1024 with --transport verbs, so that both
    /// sides' caches fit the 2 GiB Soft-RoCE test guest).
    #[arg(
        long,
        default_value_t = 4096,
        default_value_if("transport", "verbs", "1024")
    )]
    prompt_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Sliding window override (as `kvpipe demo --window`).
    #[arg(long)]
    window: Option<u32>,
    /// Tokens of the prompt this side has cached already (prefix reuse).
    #[arg(long, default_value_t = 0)]
    receiver_prefix: u32,
    /// Requests the prefill side sends (ids 1..=N).
    #[arg(long, default_value_t = 2)]
    requests: u32,
    /// How long to wait for the prefill side to connect, in seconds.
    #[arg(long, default_value_t = 120)]
    accept_timeout_s: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Serve the process's metrics in Prometheus text format at http://ADDR/metrics (port 0
    /// picks a free one, printed on stderr after the listening address).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// With --metrics: keep serving them this many seconds after the transfer (and the report)
    /// before exiting, so a scraper sees the final figures (default 0).
    #[arg(long)]
    metrics_linger_s: Option<u64>,
    /// Where the KV pools live: host, or device (GPU --gpu; needs the `cuda` feature and
    /// --transport tcp). Verification copies every pool back to the host.
    #[arg(long, default_value = "host")]
    memory: String,
    /// With --memory device: the GPU (default 0).
    #[arg(long)]
    gpu: Option<usize>,
    /// With --transport tcp: how data reaches this side's pools — auto (peer copies when both
    /// sides' pools are device memory and this side opens the prefill side's CUDA IPC handles,
    /// i.e. it runs on the same host: this side then pulls every write itself; else the
    /// sockets; the default), peer-copy (refuse to fall back) or socket.
    #[arg(long, value_parser = super::nodes::parse_data_path)]
    data_path: Option<kvpipe_tcp::TcpDataPath>,
}

/// Where a two-process command puts its pools (`--memory`, `--gpu`), checked before anything
/// runs.
pub(crate) fn two_process_memory(
    memory: &str,
    gpu: usize,
    transport: &TransportChoice,
) -> Result<kvpipe_conformance::suite::PoolMemory, CliError> {
    use kvpipe_conformance::suite::PoolMemory;
    match memory {
        "host" => Ok(PoolMemory::Host),
        "device" if !matches!(transport, TransportChoice::Tcp(_)) => {
            Err("--memory device runs across processes over --transport tcp only".into())
        }
        #[cfg(feature = "cuda")]
        "device" => {
            kvpipe_cuda::check_driver()?;
            kvpipe_cuda::Device::open(gpu)?;
            Ok(PoolMemory::Device { ordinal: gpu })
        }
        #[cfg(not(feature = "cuda"))]
        "device" => {
            let _ = gpu;
            Err(crate::NEEDS_CUDA.into())
        }
        other => Err(format!("--memory {other:?}: use host or device").into()),
    }
}

fn parse_model(s: &str) -> Result<Model, String> {
    Model::ALL
        .iter()
        .find(|(n, _)| *n == s)
        .map(|(_, m)| *m)
        .ok_or_else(|| format!("unknown model {s:?}"))
}

/// The cache both sides of a two-process demo build from the same flags (`first_region`
/// differs: 1 on the prefill side, 1000 on the decode side).
pub(crate) fn two_process_cache(
    groups: Vec<GroupSpec>,
    tokens_per_block: u32,
    prompt_tokens: u32,
    requests: u32,
    first_region: u32,
) -> Result<ReferenceCache, CliError> {
    let tpb = tokens_per_block.max(1);
    let spec = CacheSpec {
        tokens_per_block: tpb,
        groups,
        slots_per_group: prompt_tokens.div_ceil(tpb) * requests + 1,
        first_region,
        slot_order_seed: None,
        materialize: true,
    };
    Ok(ReferenceCache::new(&spec)?)
}

/// Deadlines for a demo across processes: long waits for the other side's engine, prompt
/// liveness.
pub(crate) fn two_process_deadlines() -> Deadlines {
    Deadlines {
        registration: kvpipe_core::Duration::from_secs(600),
        result_wait: kvpipe_core::Duration::from_secs(600),
        result_per_token: kvpipe_core::Duration::ZERO,
        result_idle: kvpipe_core::Duration::from_secs(600),
        write_completion: kvpipe_core::Duration::from_secs(60),
        ..Deadlines::default()
    }
}

#[derive(Debug, Serialize)]
struct ServeReport {
    role: &'static str,
    transport: &'static str,
    model: &'static str,
    requests: u32,
    completed: u32,
    failed: u32,
    bytes: u64,
    seconds: f64,
    gbps: f64,
    mismatched_blocks: usize,
    writes_refused: u64,
    verified: bool,
    /// Where the pools lived: "host" or "device".
    memory: &'static str,
    /// How the data arrived: "peer-copy" (CUDA IPC), "socket" or "rdma".
    data_path: &'static str,
    /// Data writes this side pulled from the prefill side's device memory (peer copies).
    writes_placed: u64,
    /// Per completed request, as this side sees it alone: the request's last burst of data
    /// began → complete (`RequestTimings::receiver_tail`), p50 (the median: for an even count
    /// the mean of the middle two) and p99 (nearest rank).
    exposed_tail_p50_ms: f64,
    exposed_tail_p99_ms: f64,
    /// Per completed request: first write admitted (its bytes began to arrive) → last byte
    /// landed, p50 (median) and p99.
    transfer_p50_ms: f64,
    transfer_p99_ms: f64,
}

/// Flags of another transport or memory than this run's are refused, naming what they apply
/// to, rather than ignored.
fn refuse_outside_their_mode(args: &ServeArgs) -> Result<(), CliError> {
    let (transport, memory) = (args.transport.as_str(), args.memory.as_str());
    let metrics = args.metrics.is_some();
    let with = if metrics { " with --metrics" } else { "" };
    preflight::refuse_outside_mode(
        (transport, memory, with),
        (args.device.is_some(), args.gpu.is_some()),
        &[
            (
                args.data_path.is_some(),
                transport == "tcp",
                "--data-path",
                "--transport tcp",
            ),
            (
                args.metrics_linger_s.is_some(),
                metrics,
                "--metrics-linger-s",
                "--metrics",
            ),
        ],
    )
}

pub(crate) fn run(args: ServeArgs) -> Result<ExitCode, CliError> {
    refuse_outside_their_mode(&args)?;
    let transport = TransportChoice::parse(&args.transport, 1, args.device.as_deref())?;
    let memory = two_process_memory(&args.memory, args.gpu.unwrap_or(0), &transport)?;
    let workload = preflight::Workload {
        model: args.model,
        window: args.window,
        prompt_tokens: args.prompt_tokens,
        // The decode side computes no chunks; its windowed groups register the window only.
        chunk_tokens: 1,
        tokens_per_block: args.tokens_per_block,
        requests: args.requests,
    };
    workload.check_ranges(&[("--receiver-prefix", args.receiver_prefix)])?;
    preflight::at_most(
        "--accept-timeout-s",
        args.accept_timeout_s,
        preflight::MAX_WAIT_S,
        "a week",
    )?;
    preflight::listen_address("--listen", &args.listen)?;
    // Both bound here: the second to bind would find the address taken.
    if args.metrics.as_deref() == Some(args.listen.as_str()) && !args.listen.ends_with(":0") {
        return Err(format!(
            "--listen and --metrics both name {}: give the metrics endpoint an address of its own",
            args.listen
        )
        .into());
    }
    workload
        .one_side("--prompt-tokens, --requests or --tokens-per-block")
        .check()?;
    // Before the node: its observer takes its metric handles from the recorder.
    let metrics = args
        .metrics
        .as_deref()
        .map(MetricsEndpoint::start)
        .transpose()?;
    let mut cache = two_process_cache(
        args.model.groups(args.window),
        args.tokens_per_block,
        args.prompt_tokens,
        args.requests,
        1000,
    )?;
    memory.place(&mut cache).map_err(|e| e.to_string())?;
    let config = NodeConfig {
        deadlines: two_process_deadlines(),
        ..NodeConfig::new(cache.layouts())
    };
    // SAFETY: `cache` outlives the node (shut down below) and is touched only for registrations
    // and for verification after each request quiesced.
    let data_path = args.data_path.unwrap_or(kvpipe_tcp::TcpDataPath::Auto);
    let rx = unsafe { decode_node(&transport, config, &mut cache, data_path)? };
    let addr = (rx.listen(args.listen.as_str())).map_err(|e| format!("--listen: {e}"))?;
    eprintln!("kvpipe serve: listening on {addr}");
    if let Some(m) = &metrics {
        eprintln!("kvpipe serve: metrics on http://{}/metrics", m.addr());
    }

    let accept_deadline = deadline_in(Duration::from_secs(args.accept_timeout_s));
    let peer: PeerId = loop {
        let peer = wait_for_prefill_node(&rx, accept_deadline)?;
        // A peer may leave right after its handshake; registering for it then would wait for
        // a writer that never comes. Wait for another one instead.
        if rx.is_peer_ready(peer)? {
            break peer;
        }
        eprintln!("kvpipe serve: {peer} left right after its handshake; waiting for another");
    };
    eprintln!("kvpipe serve: prefill node connected as {peer}");
    // A prefill side keeping a smaller window (allowed: the handshake only refuses a smaller
    // one here) never sends the blocks before its own stale boundary: they are not checked.
    let sender_windows: Vec<Option<u32>> = rx
        .peer_groups(peer)?
        .unwrap_or_default()
        .iter()
        .map(|g| g.window)
        .collect();
    for (g, (l, sent)) in cache.layouts().iter().zip(&sender_windows).enumerate() {
        let kept = l.window.unwrap_or(u32::MAX);
        if let Some(sent) = sent.filter(|&w| w < kept && w < args.prompt_tokens) {
            let kept = l
                .window
                .map_or("full attention".into(), |w| format!("{w} tokens"));
            eprintln!(
                "kvpipe serve: layer group {g}: the prefill side keeps a {sent}-token window \
                 against this side's {kept}: blocks before its stale boundary are not sent, and \
                 not checked"
            );
        }
    }
    let start = Instant::now();
    let ids: Vec<RequestId> = (1..=args.requests)
        .map(|i| RequestId(u64::from(i)))
        .collect();
    for &request in &ids {
        let groups =
            cache.register_destination(request, args.prompt_tokens, args.receiver_prefix)?;
        rx.register(Registration {
            request,
            prompt_len: args.prompt_tokens,
            groups,
            writers: std::iter::once(peer).collect(),
            aux_capacity: 1024,
            expected_part: None,
        })?;
    }
    // If it left meanwhile, requests registered after its departure would wait for it until
    // their deadline: end them now (those registered before it left have failed already).
    let left_early = !rx.is_peer_ready(peer)?;
    if left_early {
        for &request in &ids {
            let _ = rx.cancel(request);
        }
    }
    let mut completed = Vec::new();
    let mut failures = Failures::default();
    let mut quiesced = 0u32;
    let mut bytes = 0u64;
    let mut last_completion = start;
    let (mut tails, mut transfers) = (Vec::new(), Vec::new());
    let limit = Instant::now() + Duration::from_secs(900);
    while quiesced < args.requests {
        if Instant::now() > limit {
            return Err("the transfer did not finish in 900 s".into());
        }
        match rx.next_event(Duration::from_millis(200))? {
            Some(Event::Completed {
                request,
                bytes_written,
                timings,
                ..
            }) => {
                bytes += bytes_written;
                if let Some(d) = timings.receiver_tail() {
                    tails.push(ms(d));
                }
                if let Some(d) = timings.transfer() {
                    transfers.push(ms(d));
                }
                last_completion = Instant::now();
                completed.push(request);
            }
            Some(
                e @ (Event::Failed { .. }
                | Event::TimedOut { .. }
                | Event::Cancelled { .. }
                | Event::ProtocolViolation { .. }),
            ) => failures.note(&e),
            Some(Event::Quiesced { request }) => {
                quiesced += 1;
                let _ = rx.retire(request);
            }
            _ => {}
        }
    }
    let seconds = last_completion.duration_since(start).as_secs_f64();
    // Every request quiesced: no transfer touches the pools. Device pools: the slots the
    // requests hold are read back (what the checks below compare).
    cache.sync_held_from_device()?;
    let path = rx.data_path()?;
    let (data_path, writes_placed, writes_refused) =
        (path.path, path.writes_placed, path.writes_refused);
    let mismatched_blocks: usize = completed
        .iter()
        .map(|&r| {
            // A window the handshake accepted always has a stale boundary.
            let bad = cache.verify_sent(r, &sender_windows);
            bad.unwrap_or_else(|_| cache.verify(r)).len()
        })
        .sum();
    // An orderly close: what is still queued (the last results) reaches the other side before
    // this process exits.
    if let Err(e) = rx.close(Duration::from_secs(10)) {
        eprintln!("kvpipe serve: {e}");
    }
    let verified = mismatched_blocks == 0 && completed.len() as u32 == args.requests;
    let report = ServeReport {
        role: "decode",
        transport: transport.name(),
        model: args.model.name(),
        requests: args.requests,
        completed: completed.len() as u32,
        failed: failures.len() as u32,
        bytes,
        seconds,
        gbps: if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        },
        mismatched_blocks,
        writes_refused,
        verified,
        memory: memory.name(),
        data_path,
        writes_placed,
        exposed_tail_p50_ms: median(tails.clone()),
        exposed_tail_p99_ms: percentile(&tails, 99.0),
        transfer_p50_ms: median(transfers.clone()),
        transfer_p99_ms: percentile(&transfers, 99.0),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "decode side: {} of {} request(s) completed, {} bytes received in {:.2} s ({:.2} GB/s) \
             into {} memory by {}",
            report.completed,
            report.requests,
            bytes,
            seconds,
            report.gbps,
            report.memory,
            report.data_path
        );
        if report.completed == 0 {
            // Percentiles of no request would print as zeros, which read as instant transfers.
            println!("exposed tail: none (no request completed)");
        } else {
            println!(
                "exposed tail: p50 {:.2} ms, p99 {:.2} ms (this side's view: the last burst of \
                 data began → complete)",
                report.exposed_tail_p50_ms, report.exposed_tail_p99_ms
            );
            println!(
                "transfer: p50 {:.2} ms, p99 {:.2} ms (first byte arriving → last byte landed)",
                report.transfer_p50_ms, report.transfer_p99_ms
            );
        }
        println!(
            "verification: {}",
            if verified {
                "OK: every received block equals the prefill side's content".to_string()
            } else {
                format!(
                    "FAILED: {mismatched_blocks} block(s) differ, {} request(s) failed",
                    failures.len()
                )
            }
        );
    }
    let linger = args.metrics_linger_s.unwrap_or(0);
    if metrics.is_some() && linger > 0 {
        use std::io::Write;
        // The report is out before the wait.
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs(linger));
    }
    for line in failures.lines() {
        eprintln!("kvpipe serve: {line}");
    }
    if left_early {
        return Err(format!(
            "the prefill node ({peer}) disconnected right after its handshake, before its \
             requests were registered"
        )
        .into());
    }
    if failures.len() > 0 {
        let who = format!("the prefill node ({peer})");
        return Err(format!(
            "{} (this side registered {} prompt tokens per request)",
            failures.summary(&who, ids.len()),
            args.prompt_tokens
        )
        .into());
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `now + d`, or far in the future when that overflows the clock.
pub(crate) fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Waits for a prefill node's handshake, by `deadline`.
fn wait_for_prefill_node(rx: &DecodeNode, deadline: Instant) -> Result<PeerId, CliError> {
    let mut refused = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(match refused {
                None => "no prefill node connected in time".into(),
                Some(message) => format!(
                    "no prefill node completed the handshake in time; the last one was refused: \
                     {message}"
                )
                .into(),
            });
        }
        match rx.next_event(left)? {
            Some(Event::PeerReady {
                peer,
                role: Role::Sender,
                ..
            }) => return Ok(peer),
            Some(Event::PeerRejected { message, .. }) => {
                eprintln!("kvpipe serve: refused a peer: {message}");
                refused = Some(message);
            }
            _ => {}
        }
    }
}

fn ms(d: kvpipe_core::Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}
