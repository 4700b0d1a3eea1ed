//! `kvpipe demo --sender-tp A --receiver-tp B --receiver-pp C`: the whole model's KV moved
//! between a prefill side split over `A` tensor-parallel ranks and a decode side split over
//! `B` tensor × `C` pipeline ranks, every rank side by side in this process over one
//! in-process network (`kvpipe-mem`'s `MemNetwork`: every sender rank connected to every
//! receiver rank).
//!
//! Each rank holds its part of the model in its own reference cache (its KV heads of every
//! layer it holds). Every receiver rank expects a final result from exactly the sender ranks
//! that hold part of what it holds (the overlap rule of `kvpipe_core::shard`), and a sender
//! rank opens each request towards exactly the receiver ranks it writes. The sender ranks
//! prefill the same chunks (each its own heads); each chunk's head-slice and layer-range writes
//! go out as soon as it is computed. At the end every receiver rank's bytes are checked against
//! the ground truth of the whole model: the content the model's layer, head, token and element
//! must hold, whichever rank computed them.
//!
//! With `--memory device` every rank's pools are placed in the memory of the one GPU `--gpu`
//! (one GPU per rank would be the real deployment; here all ranks share one) and the copies
//! run on its copy engines; verification reads back the slots the requests hold.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration as StdDuration;

use kvpipe_conformance::cache::{
    split_rank, writers_of, AllocationStyle, CacheSpec, GroupSpec, ReferenceCache,
};
use kvpipe_conformance::suite::demo::{median, percentile, Model};
use kvpipe_conformance::suite::PoolMemory;
use kvpipe_core::session::{Deadlines, LocalHello, Registration, RequestTimings, SendRequest};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    ChunkSpec, Duration, Event, InstanceId, Instant, ReceiverConfig, RequestId, SenderConfig,
    SenderInput,
};
use kvpipe_mem::{receiver_peer, sender_peer, MemNetwork, NetworkConfig, Node, RegionUse};
use serde::Serialize;

use super::DemoArgs;
use crate::CliError;

/// The figures of a heterogeneous run.
#[derive(Debug, Serialize)]
struct ParallelSummary {
    transport: &'static str,
    /// Where every rank's pools lived: "host" or "device".
    memory: &'static str,
    model: &'static str,
    mode: &'static str,
    sender_tp: u16,
    receiver_tp: u16,
    receiver_pp: u16,
    /// Sender ranks that write each receiver rank, in receiver order (tensor rank major).
    writers: Vec<Vec<usize>>,
    requests: u32,
    /// Requests every receiver rank completed.
    completed: u32,
    prompt_tokens: u32,
    chunk_tokens: u32,
    /// Bytes the receiver ranks reported written, over all of them.
    bytes: u64,
    chunks: u64,
    write_batches: u64,
    /// From the first chunk's compute to the last rank settling.
    seconds: f64,
    chunk_transfer_ms: f64,
    /// Median over requests of the exposed tail: the last sender rank's last chunk computed →
    /// the last decode rank complete (every rank's timings, on the network's one clock); for
    /// an even count of requests the mean of the middle two.
    exposed_tail_ms: f64,
    max_exposed_tail_ms: f64,
    /// The median again, as the table's "p50" (the p99 is nearest rank).
    exposed_tail_p50_ms: f64,
    exposed_tail_p99_ms: f64,
    /// Per request: the first sender rank's first byte sent → the last decode rank's last
    /// byte landed; p50 the median, p99 nearest rank.
    transfer_p50_ms: f64,
    transfer_p99_ms: f64,
    /// Destination bytes checked against the whole model's content.
    bytes_verified: u64,
    /// Destination blocks (over all receiver ranks) that differ from it.
    mismatched_blocks: u64,
    /// The most KV the caches of both sides held at once (each cache's peak, summed).
    live_kv_bytes: u64,
    /// This process's peak resident memory (Linux `VmHWM`), when known.
    peak_rss_bytes: Option<u64>,
    verified: bool,
}

/// The model's groups with the whole model's KV heads (`llama3-70b-tp8` is one rank of 8).
pub(super) fn whole_model(model: Model, window: Option<u32>) -> Vec<GroupSpec> {
    let mut groups = model.groups(window);
    if model == Model::Llama3_70bTp8 {
        for g in &mut groups {
            g.kv_heads *= 8;
        }
    }
    groups
}

/// Bytes this process held in RAM at its peak (`VmHWM` of `/proc/self/status`), on Linux.
pub(super) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One rank: its topology and its cache (boxed: the network holds its memory by address).
struct Rank {
    topology: Topology,
    cache: Box<ReferenceCache>,
}

fn rank(
    model: &[GroupSpec],
    args: &DemoArgs,
    (tp, tp_rank, pp, pp_rank): (u16, u16, u16, u16),
    first_region: u32,
) -> Result<Rank, CliError> {
    let shape = split_rank(model, tp, tp_rank, pp, pp_rank)
        .map_err(|e| format!("cannot split {} this way: {e}", args.model.name()))?;
    let blocks = args.prompt_tokens.div_ceil(args.tokens_per_block);
    let spec = CacheSpec {
        tokens_per_block: args.tokens_per_block,
        groups: shape.groups,
        slots_per_group: blocks * args.requests + 1,
        first_region,
        slot_order_seed: None,
        materialize: true,
    };
    Ok(Rank {
        topology: shape.topology,
        cache: Box::new(ReferenceCache::with_shards(&spec, &shape.shards)?),
    })
}

fn deadlines() -> Deadlines {
    // The ranks' prefill runs one after another on this thread: generous liveness.
    Deadlines {
        handshake: Duration::from_secs(60),
        registration: Duration::from_secs(600),
        write_completion: Duration::from_secs(120),
        result_wait: Duration::from_secs(900),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_secs(900),
        aux_wait: Duration::from_secs(120),
        heartbeat_interval: Duration::from_secs(1),
        liveness_timeout: Duration::from_secs(120),
        quiesce: Duration::from_secs(10),
    }
}

pub(super) fn run(
    args: &DemoArgs,
    sender_tp: u16,
    receiver_tp: u16,
    receiver_pp: u16,
    memory: PoolMemory,
) -> Result<ExitCode, CliError> {
    if args.transport != "mem" {
        return Err("--sender-tp/--receiver-tp/--receiver-pp run over --transport mem".into());
    }
    if args.ranks != 1 {
        return Err("--ranks runs identical ranks side by side; with --sender-tp, --receiver-tp and --receiver-pp every rank of both sides already runs".into());
    }
    if sender_tp == 0 || receiver_tp == 0 || receiver_pp == 0 {
        return Err("--sender-tp, --receiver-tp and --receiver-pp must be at least 1".into());
    }
    let model = whole_model(args.model, args.window);
    let mut senders = Vec::new();
    for r in 0..sender_tp {
        senders.push(rank(
            &model,
            args,
            (sender_tp, r, 1, 0),
            1 + 100 * u32::from(r),
        )?);
    }
    let mut receivers = Vec::new();
    for tr in 0..receiver_tp {
        for pr in 0..receiver_pp {
            let region = 100_000 + 100 * u32::from(tr * receiver_pp + pr);
            receivers.push(rank(
                &model,
                args,
                (receiver_tp, tr, receiver_pp, pr),
                region,
            )?);
        }
    }
    let shapes: Vec<_> = senders
        .iter()
        .map(|s| (s.topology, s.cache.layouts()))
        .collect();
    let writers: Vec<Vec<usize>> = receivers
        .iter()
        .map(|r| writers_of(&shapes, &(r.topology, r.cache.layouts())))
        .collect();
    // Sender rank i writes the receiver ranks that list it; the first writer of each receiver
    // sends it the aux data.
    let targets: Vec<Vec<usize>> = (0..senders.len())
        .map(|i| {
            (0..receivers.len())
                .filter(|&j| writers[j].contains(&i))
                .collect()
        })
        .collect();

    let config = NetworkConfig::new(
        senders
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut c = SenderConfig::new(LocalHello::new(
                    InstanceId(100 + i as u64),
                    s.topology,
                    s.cache.layouts(),
                ));
                c.deadlines = deadlines();
                c
            })
            .collect(),
        receivers
            .iter()
            .enumerate()
            .map(|(j, r)| {
                let mut c = ReceiverConfig::new(
                    LocalHello::new(InstanceId(200 + j as u64), r.topology, r.cache.layouts()),
                    0x6b76 + j as u64,
                );
                c.deadlines = deadlines();
                c
            })
            .collect(),
    );
    let mut net = MemNetwork::new(config)?;
    for (nodes, ranks) in [
        (Node::Sender as fn(usize) -> Node, &mut senders),
        (Node::Receiver as fn(usize) -> Node, &mut receivers),
    ] {
        for (i, r) in ranks.iter_mut().enumerate() {
            memory.place(&mut r.cache)?;
            let ids: Vec<_> = r.cache.region_ids().collect();
            for id in ids {
                #[cfg(feature = "cuda")]
                if let Some(pool) = r.cache.device_pool(id) {
                    let table = net
                        .regions_mut(nodes(i))
                        .ok_or("the network has every rank's node")?;
                    // SAFETY: the cache owns the device buffer and outlives `net` (dropped
                    // before any cache is read back); the sessions pin blocks until quiesced.
                    unsafe {
                        table.register_device(
                            id,
                            RegionUse::KvPool,
                            pool.ordinal,
                            pool.ptr,
                            pool.len,
                        )
                    }?;
                    continue;
                }
                let bytes = r.cache.region_mut(id).unwrap_or_default();
                // SAFETY: every cache is boxed (its regions never move or resize) and outlives
                // `net`, which is dropped before any cache is read for verification; the engine
                // loop below computes only blocks no in-flight batch reads, and frees nothing
                // before the requests quiesce.
                unsafe {
                    net.register_host(
                        nodes(i),
                        id,
                        RegionUse::KvPool,
                        bytes.as_mut_ptr(),
                        bytes.len(),
                    )
                }?;
            }
        }
    }
    net.connect_all()?;
    let (s_count, r_count) = (senders.len(), receivers.len());
    let mut events: Vec<(Node, Instant, Event)> = Vec::new();
    net.drive_until(StdDuration::from_secs(60), |n| {
        events.extend(n.take_events());
        (0..s_count).all(|i| (0..r_count).all(|j| n.sender(i).is_peer_ready(receiver_peer(j))))
            || events
                .iter()
                .any(|(_, _, e)| matches!(e, Event::PeerRejected { .. }))
    })
    .map_err(|e| format!("handshake: {e}"))?;
    if let Some((_, _, Event::PeerRejected { message, .. })) = events
        .iter()
        .find(|(_, _, e)| matches!(e, Event::PeerRejected { .. }))
    {
        return Err(format!("a handshake was refused: {message}").into());
    }

    let ids: Vec<RequestId> = (1..=args.requests)
        .map(|i| RequestId(u64::from(i)))
        .collect();
    for &id in &ids {
        let now = net.now();
        for (i, s) in senders.iter_mut().enumerate() {
            if targets[i].is_empty() {
                continue;
            }
            s.cache.begin_prefill(
                id,
                args.prompt_tokens,
                args.sender_prefix,
                AllocationStyle::FullPrompt,
            )?;
            net.sender_mut(i).open_request(
                now,
                SendRequest {
                    request: id,
                    receivers: targets[i].iter().map(|&j| receiver_peer(j)).collect(),
                    beam_width: 1,
                },
            )?;
        }
        for (j, r) in receivers.iter_mut().enumerate() {
            let groups =
                r.cache
                    .register_destination(id, args.prompt_tokens, args.receiver_prefix)?;
            net.receiver_mut(j).register(
                now,
                Registration {
                    request: id,
                    prompt_len: args.prompt_tokens,
                    groups,
                    writers: writers[j].iter().map(|&i| sender_peer(i)).collect(),
                    aux_capacity: 4096,
                    expected_part: None,
                },
            )?;
        }
        net.pump()?;
    }

    // Prefill, round-robin over the requests, chunk by chunk on every sender rank.
    let step = args.chunk_tokens.max(1);
    let mut next = vec![args.sender_prefix.min(args.prompt_tokens); ids.len()];
    let mut chunks = 0u64;
    let started = net.now();
    let per_chunk = Duration::from_millis(args.prefill_ms_per_chunk);
    loop {
        let mut any = false;
        for (k, &id) in ids.iter().enumerate() {
            let start = next[k];
            if start == u32::MAX {
                continue;
            }
            any = true;
            let end = start.saturating_add(step).min(args.prompt_tokens);
            let is_last = end >= args.prompt_tokens;
            next[k] = if is_last { u32::MAX } else { end };
            let compute_start = net.now();
            for (i, s) in senders.iter_mut().enumerate() {
                if !targets[i].is_empty() {
                    s.cache.compute_chunk(id, start, end)?;
                }
            }
            // The rest of the chunk's simulated compute: the transport keeps moving meanwhile.
            let ready = compute_start + per_chunk;
            loop {
                net.pump()?;
                events.extend(net.take_events());
                let now = net.now();
                if now >= ready {
                    break;
                }
                net.wait(StdDuration::from_nanos((ready - now).as_nanos()));
            }
            let spec = if args.monolithic {
                is_last.then_some(ChunkSpec {
                    start: args.sender_prefix.min(args.prompt_tokens),
                    end,
                    prompt_len: args.prompt_tokens,
                    prepopulated_len: args.sender_prefix,
                    is_last,
                    prefix_sent_early: false,
                })
            } else {
                Some(ChunkSpec {
                    start,
                    end,
                    prompt_len: args.prompt_tokens,
                    prepopulated_len: args.sender_prefix,
                    is_last,
                    prefix_sent_early: false,
                })
            };
            if let Some(spec) = spec {
                chunks += 1;
                let now = net.now();
                for (i, s) in senders.iter_mut().enumerate() {
                    if targets[i].is_empty() {
                        continue;
                    }
                    net.sender_mut(i)
                        .submit_chunk(now, id, spec, &mut *s.cache)?;
                    if is_last {
                        // Every writer sends the request's aux data.
                        net.sender_mut(i).handle_input(SenderInput::Aux {
                            now,
                            request: id,
                            data: AuxData {
                                prompt_tokens: args.prompt_tokens,
                                cached_tokens: args.sender_prefix,
                                first_tokens: vec![id.0 as u32],
                                draft_tokens: Vec::new(),
                            },
                        })?;
                    }
                }
            }
            net.pump()?;
            events.extend(net.take_events());
        }
        if !any {
            break;
        }
    }
    // Until every rank has ended and quiesced every request.
    let endpoints =
        ids.len() * (receivers.len() + targets.iter().filter(|t| !t.is_empty()).count());
    let quiesced = |events: &[(Node, Instant, Event)]| {
        events
            .iter()
            .filter(|(_, _, e)| matches!(e, Event::Quiesced { .. }))
            .count()
    };
    net.drive_until(StdDuration::from_secs(900), |n| {
        events.extend(n.take_events());
        quiesced(&events) >= endpoints
    })
    .map_err(|e| format!("the transfer did not settle: {e}"))?;
    let finished = net.now();
    let now = net.now();
    for &id in &ids {
        for (i, t) in targets.iter().enumerate() {
            if !t.is_empty() {
                net.sender_mut(i).retire(now, id)?;
            }
        }
        for j in 0..receivers.len() {
            net.receiver_mut(j).retire(now, id)?;
        }
    }
    net.pump()?;
    let timings = net.batch_timings().to_vec();
    drop(net);
    // Pools in device memory: the checks below read back the slots the requests hold.
    for r in &mut receivers {
        r.cache.sync_held_from_device()?;
    }

    // Outcomes, tails and bytes.
    let mut completions: BTreeMap<RequestId, Vec<RequestTimings>> = BTreeMap::new();
    let mut sent: BTreeMap<RequestId, Vec<RequestTimings>> = BTreeMap::new();
    let mut bytes = 0;
    for (node, _, e) in &events {
        match e {
            Event::Completed {
                request,
                bytes_written,
                timings,
                ..
            } if matches!(node, Node::Receiver(_)) => {
                completions.entry(*request).or_default().push(*timings);
                bytes += bytes_written;
            }
            Event::Completed {
                request, timings, ..
            } => sent.entry(*request).or_default().push(*timings),
            Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. } => {
                eprintln!("kvpipe demo: {node:?}: {e:?}");
            }
            _ => {}
        }
    }
    let completed = ids
        .iter()
        .filter(|id| {
            completions
                .get(id)
                .is_some_and(|c| c.len() == receivers.len())
        })
        .count() as u32;
    let ms = |d: kvpipe_core::Duration| d.as_nanos() as f64 / 1e6;
    let (mut tails, mut transfers) = (Vec::new(), Vec::new());
    for id in &ids {
        let (Some(rx), Some(tx)) = (completions.get(id), sent.get(id)) else {
            continue;
        };
        let done = rx.iter().map(|t| t.ended).max();
        let computed = tx.iter().filter_map(|t| t.last_chunk).max();
        if let (Some(done), Some(computed)) = (done, computed) {
            tails.push(ms(done - computed));
        }
        let first = tx.iter().filter_map(|t| t.first_byte).min();
        let landed = rx.iter().filter_map(|t| t.last_byte).max();
        if let (Some(first), Some(landed)) = (first, landed) {
            transfers.push(ms(landed - first));
        }
    }
    // Every destination byte against the whole model's content.
    let (mut mismatched, mut verified_bytes) = (0u64, 0u64);
    for r in &receivers {
        let layouts = r.cache.layouts();
        for &id in &ids {
            mismatched += r.cache.verify(id).len() as u64;
            for (g, l) in layouts.iter().enumerate() {
                let block: u64 = l.pools.iter().map(|p| p.slot_bytes).sum();
                let held = r
                    .cache
                    .table(id, kvpipe_core::GroupIndex(g as u16))
                    .unwrap_or_default()
                    .iter()
                    .flatten()
                    .count() as u64;
                verified_bytes += held * block;
            }
        }
    }
    let live_kv_bytes = senders
        .iter()
        .chain(&receivers)
        .map(|r| r.cache.peak_resident_bytes())
        .sum();
    // The exposed tail's median, reported as `exposed_tail_ms` and as its p50.
    let tail_median = median(tails.clone());
    let summary = ParallelSummary {
        transport: "mem",
        memory: memory.name(),
        model: args.model.name(),
        mode: if args.monolithic {
            "monolithic"
        } else {
            "pipelined"
        },
        sender_tp,
        receiver_tp,
        receiver_pp,
        writers,
        requests: args.requests,
        completed,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        bytes,
        chunks,
        write_batches: timings.len() as u64,
        seconds: (finished - started).as_nanos() as f64 / 1e9,
        chunk_transfer_ms: median(
            timings
                .iter()
                .map(|t| (t.copy_finished - t.copy_started).as_nanos() as f64 / 1e6)
                .collect(),
        ),
        exposed_tail_ms: tail_median,
        max_exposed_tail_ms: tails.iter().copied().fold(0.0, f64::max),
        exposed_tail_p50_ms: tail_median,
        exposed_tail_p99_ms: percentile(&tails, 99.0),
        transfer_p50_ms: median(transfers.clone()),
        transfer_p99_ms: percentile(&transfers, 99.0),
        bytes_verified: verified_bytes,
        mismatched_blocks: mismatched,
        live_kv_bytes,
        peak_rss_bytes: peak_rss_bytes(),
        verified: mismatched == 0 && completed == args.requests,
    };
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print_table(&summary);
    }
    Ok(if summary.verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_table(s: &ParallelSummary) {
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let rows = [
        ("transport", s.transport.to_string()),
        (
            "kv pools",
            match s.memory {
                "device" => "device memory (every rank on one GPU), read back to verify".into(),
                other => format!("{other} memory"),
            },
        ),
        ("model", s.model.to_string()),
        ("mode", s.mode.to_string()),
        (
            "ranks",
            format!(
                "prefill TP {} → decode TP {} × PP {}",
                s.sender_tp, s.receiver_tp, s.receiver_pp
            ),
        ),
        (
            "writers",
            s.writers
                .iter()
                .enumerate()
                .map(|(j, w)| format!("R{j}←{w:?}"))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        (
            "requests",
            format!(
                "{} ({} completed on every decode rank)",
                s.requests, s.completed
            ),
        ),
        (
            "prompt",
            format!("{} tokens, chunks of {}", s.prompt_tokens, s.chunk_tokens),
        ),
        ("bytes", format!("{} ({:.2} GiB)", s.bytes, gib(s.bytes))),
        (
            "chunks",
            format!("{} ({} write batches)", s.chunks, s.write_batches),
        ),
        ("wall time", format!("{:.2} s", s.seconds)),
        (
            "chunk transfer",
            format!("{:.2} ms (median write batch)", s.chunk_transfer_ms),
        ),
        (
            "exposed tail",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (last chunk computed → every decode \
                 rank complete)",
                s.exposed_tail_p50_ms, s.exposed_tail_p99_ms, s.max_exposed_tail_ms
            ),
        ),
        (
            "transfer time",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms (first byte sent → last byte landed, per request)",
                s.transfer_p50_ms, s.transfer_p99_ms
            ),
        ),
        (
            "memory",
            format!(
                "{:.2} GiB live KV on both sides, peak RSS {}",
                gib(s.live_kv_bytes),
                s.peak_rss_bytes
                    .map_or("unknown".to_string(), |b| format!("{:.2} GiB", gib(b)))
            ),
        ),
        (
            "verification",
            if s.verified {
                format!(
                    "OK: {} destination bytes equal to the whole model's content",
                    s.bytes_verified
                )
            } else {
                format!(
                    "FAILED: {} block(s) differ, {} of {} request(s) completed",
                    s.mismatched_blocks, s.completed, s.requests
                )
            },
        ),
    ];
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}
