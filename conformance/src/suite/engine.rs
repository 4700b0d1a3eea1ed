//! The engine model the scenarios, the demo and the benches share: prefill chunk by chunk on a
//! sender [`ReferenceCache`], destination registration on a receiver cache, the endpoints
//! driven over a [`Link`], then verification. With [`TransferMode::LayerSlices`] a chunk's
//! simulated compute is spread over its layers and each range of layers is submitted
//! ([`Sender::submit_chunk_layers`](kvpipe_core::Sender::submit_chunk_layers)) as soon as its
//! share of the compute is over; the exposed tail then runs from the last range's compute.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use kvpipe_core::session::{LocalHello, Registration, SendRequest, Submitted, UsageError};
use kvpipe_core::wire::{AuxData, Role, Topology};
use kvpipe_core::{
    BlockId, ChunkSpec, Duration, Event, GroupIndex, InstanceId, Instant, LayerRange,
    ReceiverConfig, RequestId, SenderConfig, SenderInput,
};

#[cfg(feature = "cuda")]
use super::compute::SimulatedCompute;
use super::compute::{time_until, Compute};
use super::content::{ContentError, ContentJob, ContentWriter};
use super::report::{Outcome, RequestReport, RunReport};
use super::verify::{corrupt_one_byte, verify_against_sender};
use super::workload::{layer_slices, Interrupt, RequestPlan, TransferMode, Workload};
use super::{Harness, Link, SuiteError};
use crate::cache::ReferenceCache;

/// Submits a computed chunk, or one layer range of it.
pub(crate) fn submit(
    sender: &mut kvpipe_core::Sender,
    now: Instant,
    request: RequestId,
    spec: ChunkSpec,
    layers: Option<LayerRange>,
    cache: &mut ReferenceCache,
) -> Result<Submitted, UsageError> {
    match layers {
        Some(layers) => sender.submit_chunk_layers(now, request, spec, layers, cache),
        None => sender.submit_chunk(now, request, spec, cache),
    }
}

struct ReqState {
    plan: RequestPlan,
    chunks: Vec<(u32, u32)>,
    next_chunk: usize,
    registered: bool,
    report: RequestReport,
}

fn usage(side: Role) -> impl Fn(UsageError) -> SuiteError {
    move |e| SuiteError::Usage {
        side,
        message: e.to_string(),
    }
}

fn cache_err(e: impl std::fmt::Display) -> SuiteError {
    SuiteError::Cache(e.to_string())
}

fn content_err(e: ContentError) -> SuiteError {
    match e {
        ContentError::Cache(e) => cache_err(e),
        ContentError::Gone => SuiteError::Check("the content writer panicked".into()),
    }
}

/// The first generated token a request's aux data carries (deterministic, checked on arrival).
fn first_token(id: RequestId) -> u32 {
    (id.0 as u32).wrapping_mul(2_654_435_761) ^ 0x5eed
}

/// Runs `workload` over `harness` and reports what happened; checks are the caller's, except
/// that the run itself must settle in time.
pub fn run_workload<H: Harness>(harness: &H, w: &Workload) -> Result<RunReport, SuiteError> {
    run_workload_with(harness, w, |_, _| {})
}

/// [`run_workload`], calling `progress(chunks_submitted, chunks_total)` after every chunk.
pub fn run_workload_with<H: Harness>(
    harness: &H,
    w: &Workload,
    mut progress: impl FnMut(u64, u64),
) -> Result<RunReport, SuiteError> {
    let mut sender_cache = Box::new(ReferenceCache::new(&w.cache_spec(false)).map_err(cache_err)?);
    let mut receiver_cache = Box::new(ReferenceCache::new(&w.cache_spec(true)).map_err(cache_err)?);
    let before = w.check_untouched.then(|| receiver_cache.snapshot());

    let mut s_hello = LocalHello::new(InstanceId(1), Topology::default(), sender_cache.layouts());
    let mut r_hello = LocalHello::new(InstanceId(2), Topology::default(), receiver_cache.layouts());
    if let Some(v) = w.receiver_versions {
        r_hello.versions = v;
    }
    s_hello.topology.tp_size = 1;
    r_hello.topology.tp_size = 1;
    let mut s_config = SenderConfig::new(s_hello);
    s_config.deadlines = w.deadlines;
    s_config.layer_order = w.layer_order.clone();
    let mut r_config = ReceiverConfig::new(r_hello, 0x6b76_7069_7065);
    r_config.deadlines = w.deadlines;

    // SAFETY: both caches are boxed (their regions never move or resize) and declared before
    // `link`, so they outlive it.
    let mut link = unsafe {
        harness.connect(
            s_config,
            r_config,
            &mut sender_cache,
            &mut receiver_cache,
            &w.faults,
        )?
    };
    let started = link.now();
    let limit = started + Duration::from_nanos(w.time_limit.as_nanos() as u64);
    let mut events = Vec::new();
    let mut states: Vec<ReqState> = w
        .requests
        .iter()
        .map(|p| ReqState {
            chunks: p.chunks(),
            next_chunk: 0,
            registered: false,
            report: RequestReport {
                id: p.id,
                sender: Outcome::Pending,
                receiver: Outcome::Pending,
                sender_quiesced: false,
                receiver_quiesced: false,
                chunks: 0,
                last_compute_done: None,
                receiver_completed_at: None,
                mismatched_blocks: 0,
                bytes_verified: 0,
                source_blocks_changed: 0,
                sender_timings: None,
                receiver_timings: None,
            },
            plan: p.clone(),
        })
        .collect();
    let index: BTreeMap<RequestId, usize> = states
        .iter()
        .enumerate()
        .map(|(i, s)| (s.plan.id, i))
        .collect();
    let total_chunks: u64 = states
        .iter()
        .map(|s| match w.mode {
            TransferMode::Pipelined | TransferMode::LayerSlices(_) => s.chunks.len() as u64,
            TransferMode::Monolithic => 1,
        })
        .sum();
    let mut submitted = 0u64;
    let mut recorder = super::timeline::TimelineRecorder::default();
    progress(0, total_chunks);

    // Open every request on the sender and register the up-front ones on the receiver.
    let receiver_peer = link.receiver_peer();
    for st in &mut states {
        let p = &st.plan;
        sender_cache
            .begin_prefill(p.id, p.prompt, p.sender_prefix, w.allocation)
            .map_err(cache_err)?;
        let now = link.now();
        link.sender()
            .open_request(
                now,
                SendRequest {
                    request: p.id,
                    receivers: std::iter::once(receiver_peer).collect(),
                    beam_width: 1,
                },
            )
            .map_err(usage(Role::Sender))?;
        if p.prefix_early {
            let now = link.now();
            link.sender()
                .submit_prefix(now, p.id, p.prompt, p.sender_prefix, &mut *sender_cache)
                .map_err(usage(Role::Sender))?;
        }
        if p.register_after_chunks == 0 {
            register(&mut link, &mut receiver_cache, st)?;
        }
    }
    link.pump()?;

    // Prefill: round-robin over the requests, one chunk at a time.
    let collect =
        |link: &mut H::Link, events: &mut Vec<(Role, Instant, Event)>, states: &mut [ReqState]| {
            for (side, at, e) in link.take_events() {
                apply_event(side, at, &e, states, &index);
                events.push((side, at, e));
            }
        };
    // The rest of a layer range's simulated compute, the transport running meanwhile. Returns
    // when the compute was seen over: the link's time read just before the check that saw it.
    let finish_compute = |link: &mut H::Link,
                          events: &mut Vec<(Role, Instant, Event)>,
                          states: &mut [ReqState],
                          compute: &Compute,
                          ready: Instant|
     -> Result<Instant, SuiteError> {
        loop {
            let before = link.now();
            if compute.is_over(before, ready)? {
                return Ok(before);
            }
            if let Some(at) = compute.poll_until_over(before, ready, || link.now())? {
                return Ok(at);
            }
            link.pump()?;
            collect(link, events, states);
            let now = link.now();
            let left = time_until(now, ready);
            compute.wait(link, now, ready, left);
        }
    };
    let mut order: Vec<usize> = Vec::new();
    match w.mode {
        TransferMode::Pipelined | TransferMode::LayerSlices(_) => {
            let most = states.iter().map(|s| s.chunks.len()).max().unwrap_or(0);
            for k in 0..most {
                for (i, s) in states.iter().enumerate() {
                    if k < s.chunks.len() {
                        order.push(i);
                    }
                }
            }
        }
        TransferMode::Monolithic => {
            for (i, s) in states.iter().enumerate() {
                order.extend(std::iter::repeat_n(i, s.chunks.len()));
            }
        }
    }
    let per_chunk = Duration::from_nanos(w.prefill_per_chunk.as_nanos() as u64);
    // The layer ranges a chunk is submitted in, as each one is computed (`None`: the whole
    // chunk at once), and each range's share of the chunk's compute.
    let slices: Vec<Option<LayerRange>> = match w.mode {
        TransferMode::LayerSlices(n) => layer_slices(&w.groups, n).into_iter().map(Some).collect(),
        TransferMode::Pipelined | TransferMode::Monolithic => vec![None],
    };
    let slice_layers = |s: &Option<LayerRange>| s.map_or(1, |s| u64::from(s.len()));
    let chunk_layers: u64 = slices.iter().map(slice_layers).sum::<u64>().max(1);
    let layouts = sender_cache.layouts();
    let mut compute = Compute::new(w.compute)?;
    // The sender's cache, shared with the content writer for the prefill: locked by the writer
    // while it writes a range's content, by this thread while it submits. The writer's thread
    // ends (and is joined) only after every request ended: joining it blocks this thread,
    // which must not happen while the last range's copy is being watched.
    let shared = Mutex::new(&mut *sender_cache);
    std::thread::scope(|scope| -> Result<(), SuiteError> {
        let mut writer = ContentWriter::spawn(scope, &shared);
        for i in order {
            let compute_start = link.now();
            let (start, end) = states[i].chunks[states[i].next_chunk];
            let id = states[i].plan.id;
            // When each layer range's compute is over: the chunk's compute spread over its layers.
            let mut done_layers = 0;
            let ready: Vec<Instant> = slices
                .iter()
                .map(|s| {
                    done_layers += slice_layers(s);
                    compute_start
                        + Duration::from_nanos(
                            (u128::from(per_chunk.as_nanos()) * u128::from(done_layers)
                                / u128::from(chunk_layers)) as u64,
                        )
                })
                .collect();
            let k = states[i].next_chunk;
            states[i].next_chunk += 1;
            let is_last = states[i].next_chunk == states[i].chunks.len();
            let mut slice_started = compute_start;
            let mut sending_groups: Vec<GroupIndex> = Vec::new();
            // Handed over behind a fence (`SimulatedCompute::Gpu::fenced`), a range's KV is the
            // kernel's work: its content is put in place first, then its kernel runs for the
            // range's whole share and the range is handed over at once, while it runs.
            #[cfg(feature = "cuda")]
            let fenced = matches!(w.compute, SimulatedCompute::Gpu { fenced: true, .. })
                && link.gates_slices();
            #[cfg(not(feature = "cuda"))]
            let fenced = false;
            let mut nominal_began = compute_start;
            for (r, (slice, &ready)) in slices.iter().zip(&ready).enumerate() {
                let share = ready - nominal_began;
                nominal_began = ready;
                let last_range = r + 1 == slices.len();
                // The content this range computes: the whole chunk's, or its layers of each group.
                let group_layers: Option<Vec<std::ops::Range<u16>>> =
                    slice.map(|l| w.layer_order.group_ranges(&layouts, l).into_vec());
                let range_layers = group_layers.clone();
                let content: ContentJob =
                    Box::new(move |cache: &mut ReferenceCache| match group_layers {
                        Some(layers) => {
                            cache.compute_chunk_layers(id, start, end, &layers, last_range)
                        }
                        None => cache.compute_chunk(id, start, end),
                    });
                if !fenced {
                    compute.start(link.now(), ready)?;
                }
                if w.prefill_per_chunk.is_zero() {
                    content(&mut shared.lock().unwrap_or_else(|p| p.into_inner()))
                        .map_err(cache_err)?;
                } else {
                    // With a compute time the content is written by the content writer, as a GPU
                    // computes while the engine's loop goes on: the transport keeps being driven
                    // (and earlier slices' completions are seen when they happen) until the content
                    // is written and the range's share of the compute time is over.
                    writer.start(content).map_err(content_err)?;
                    loop {
                        link.pump()?;
                        collect(&mut link, &mut events, &mut states);
                        let now = link.now();
                        let written = match writer.try_done() {
                            Some(outcome) => {
                                outcome.map_err(content_err)?;
                                true
                            }
                            None => false,
                        };
                        if written {
                            break;
                        }
                        let wait = if now < ready {
                            std::time::Duration::from_nanos((ready - now).as_nanos())
                        } else {
                            std::time::Duration::from_micros(100)
                        };
                        // While the content is being written, look again soon: the range is
                        // submitted as soon as it is computed.
                        compute.wait(
                            &mut link,
                            now,
                            ready,
                            wait.min(std::time::Duration::from_micros(200)),
                        );
                    }
                }
                let ready = if fenced {
                    let ready = link.now() + share;
                    compute.start(link.now(), ready)?;
                    ready
                } else {
                    ready
                };
                // A range handed over while its compute runs: its copies wait for this fence on
                // the GPU. A compute already over (a share too short to see) needs none: the
                // range is computed now, as in the other modes.
                #[cfg(feature = "cuda")]
                let fence = if fenced && !compute.is_over(link.now(), ready)? {
                    compute.fence()?
                } else {
                    None
                };
                #[cfg(not(feature = "cuda"))]
                let fence: Option<()> = None;
                let mut computed = match fence {
                    None => finish_compute(&mut link, &mut events, &mut states, &compute, ready)?,
                    Some(_) => link.now(),
                };
                let handed = computed;
                let st = &mut states[i];
                let mut sent = None;
                if r == 0 && !st.registered && st.plan.register_after_chunks as usize == k {
                    register(&mut link, &mut receiver_cache, st)?;
                }
                let spec = match w.mode {
                    TransferMode::Pipelined | TransferMode::LayerSlices(_) => Some(ChunkSpec {
                        start,
                        end,
                        prompt_len: st.plan.prompt,
                        prepopulated_len: st.plan.sender_prefix,
                        is_last,
                        prefix_sent_early: st.plan.prefix_early,
                    }),
                    TransferMode::Monolithic if is_last => Some(ChunkSpec {
                        start: st.plan.sender_prefix.min(st.plan.prompt),
                        end: st.plan.prompt,
                        prompt_len: st.plan.prompt,
                        prepopulated_len: st.plan.sender_prefix,
                        is_last: true,
                        prefix_sent_early: st.plan.prefix_early,
                    }),
                    TransferMode::Monolithic => None,
                };
                let submits = spec.is_some()
                    && link.is_alive(Role::Sender)
                    && !states[i].report.sender.is_end();
                if let (Some(spec), true) = (spec, submits) {
                    let now = link.now();
                    if let (0, Some(layers)) = (r, slice) {
                        // The groups the chunk sends blocks of: a range of only other groups'
                        // layers is a slice without a write batch, which the timeline must not
                        // pair with one.
                        sending_groups = link
                            .sender()
                            .chunk_layers_query(id, &spec, *layers)
                            .map(|q| q.windows().iter().map(|(g, _)| *g).collect())
                            .unwrap_or_default();
                    }
                    let writes = range_layers.as_ref().is_none_or(|layers| {
                        sending_groups
                            .iter()
                            .any(|g| layers.get(usize::from(g.0)).is_some_and(|l| !l.is_empty()))
                    });
                    let mut cache = shared.lock().unwrap_or_else(|p| p.into_inner());
                    let result = submit(link.sender(), now, id, spec, *slice, &mut cache);
                    drop(cache);
                    match result {
                        Ok(Submitted::EngineFault(fault)) => {
                            // The reference cache keeps its contract: a fault is the suite's
                            // bug.
                            return Err(SuiteError::Usage {
                                side: Role::Sender,
                                message: fault.to_string(),
                            });
                        }
                        Ok(outcome) => {
                            #[cfg(feature = "cuda")]
                            if let (Some(fence), Some(slice)) = (&fence, outcome.slice()) {
                                link.gate_slice(id, slice, fence.clone())?;
                            }
                            sent = Some((now, outcome.slice().is_some() && writes));
                        }
                        // The session ended under the engine (a peer's cancel, a failure): a
                        // real engine stops submitting; so do we.
                        Err(UsageError::SessionEnded(_)) => {}
                        Err(e) => return Err(usage(Role::Sender)(e)),
                    }
                    if last_range {
                        states[i].report.chunks += 1;
                        submitted += 1;
                    }
                }
                if fence.is_some() {
                    // The range's batch is issued now, its copies queued behind the compute.
                    link.pump()?;
                    // A compute seen over at the first look after the hand-over may have ended
                    // during it: counted from the hand-over, so the submission is on the tail.
                    computed = if compute.is_over(link.now(), ready)? {
                        handed
                    } else {
                        finish_compute(&mut link, &mut events, &mut states, &compute, ready)?
                    };
                }
                let st = &mut states[i];
                if is_last && last_range {
                    st.report.last_compute_done = Some(computed);
                }
                if submits && is_last && last_range {
                    // The first token exists once the last layer is computed.
                    let data = AuxData {
                        prompt_tokens: st.plan.prompt,
                        cached_tokens: st.plan.sender_prefix,
                        first_tokens: vec![first_token(id)],
                        draft_tokens: Vec::new(),
                    };
                    let now = link.now();
                    match link.sender().handle_input(SenderInput::Aux {
                        now,
                        request: id,
                        data,
                    }) {
                        Ok(()) | Err(UsageError::SessionEnded(_)) => {}
                        Err(e) => return Err(usage(Role::Sender)(e)),
                    }
                }
                // The range goes out now: the engine's own bookkeeping below (the progress bar,
                // the timeline) must not sit between a range's compute and its batch.
                link.pump()?;
                if last_range {
                    progress(submitted, total_chunks);
                }
                recorder.chunk(
                    i,
                    super::timeline::ChunkTiming {
                        index: k as u32,
                        tokens: (start, end),
                        layers: slice.map(|s| (s.begin, s.end)),
                        compute_started: slice_started,
                        computed,
                        submitted: sent.map(|(at, _)| at),
                        sliced: sent.is_some_and(|(_, sliced)| sliced),
                        batch: None,
                    },
                );
                slice_started = computed;
            }
            let st = &states[i];
            if let Some((after, what)) = st.plan.interrupt {
                if after as usize == k {
                    let now = link.now();
                    match what {
                        Interrupt::Cancel(Role::Sender) => {
                            link.sender().cancel(now, id).map_err(usage(Role::Sender))?;
                        }
                        Interrupt::Cancel(Role::Receiver) => {
                            if st.registered {
                                link.receiver()
                                    .cancel(now, id)
                                    .map_err(usage(Role::Receiver))?;
                            }
                        }
                        Interrupt::Kill(side) => link.kill(side)?,
                    }
                }
            }
            link.pump()?;
            collect(&mut link, &mut events, &mut states);
        }
        // Late registrations that never came due (the request had fewer chunks).
        for st in &mut states {
            if !st.registered && link.is_alive(Role::Receiver) {
                register(&mut link, &mut receiver_cache, st)?;
            }
        }

        // Wait until every request ended and quiesced on every living side.
        loop {
            link.pump()?;
            collect(&mut link, &mut events, &mut states);
            let s_alive = link.is_alive(Role::Sender);
            let r_alive = link.is_alive(Role::Receiver);
            let waiting = |s: &&ReqState| {
                (s_alive && !s.report.sender_quiesced) || (r_alive && !s.report.receiver_quiesced)
            };
            // Checked on every pass of the loop, which is the exposed tail's: the words are made
            // only for the error.
            if !states.iter().any(|s| waiting(&s)) {
                break;
            }
            let now = link.now();
            if now >= limit {
                let pending: Vec<String> = states
                    .iter()
                    .filter(waiting)
                    .map(|s| {
                        format!(
                            "{}: sender {:?}{}, receiver {:?}{}",
                            s.plan.id,
                            s.report.sender,
                            if s.report.sender_quiesced {
                                " (quiesced)"
                            } else {
                                ""
                            },
                            s.report.receiver,
                            if s.report.receiver_quiesced {
                                " (quiesced)"
                            } else {
                                ""
                            },
                        )
                    })
                    .collect();
                return Err(SuiteError::Stalled {
                    limit_ms: w.time_limit.as_millis() as u64,
                    pending: pending.join("; "),
                });
            }
            link.wait(
                std::time::Duration::from_nanos((limit - now).as_nanos())
                    .min(std::time::Duration::from_millis(20)),
            );
        }
        Ok(())
    })?;
    let finished = link.now();

    // Retire everything (the engines may now free the blocks) and look for leftovers.
    let now = link.now();
    for st in &states {
        if link.is_alive(Role::Sender) {
            link.sender()
                .retire(now, st.plan.id)
                .map_err(usage(Role::Sender))?;
        }
        if link.is_alive(Role::Receiver) && st.registered {
            link.receiver()
                .retire(now, st.plan.id)
                .map_err(usage(Role::Receiver))?;
        }
    }
    link.pump()?;
    collect(&mut link, &mut events, &mut states);
    let mut leftover_sessions = 0;
    if link.is_alive(Role::Sender) {
        leftover_sessions +=
            link.sender().session_count() + link.sender().pending_registration_count();
    }
    if link.is_alive(Role::Receiver) {
        leftover_sessions += link.receiver().session_count();
    }
    let leftover_writes = link.writes_in_flight();
    let batch_timings = link.batch_timings();
    drop(link);
    // Pools in device memory: the checks below read back what they compare — every byte when
    // they look for stray writes, else the slots the requests hold (host memory then stays at
    // about the live KV: a windowed pool's unused slots are never committed).
    for cache in [&mut sender_cache, &mut receiver_cache] {
        if w.check_untouched {
            cache.sync_from_device().map_err(cache_err)?;
        } else {
            cache.sync_held_from_device().map_err(cache_err)?;
        }
    }

    // Verification: every destination byte of completed requests; nothing stray anywhere.
    if w.corrupt_one_byte {
        if let Some(st) = states.iter().find(|s| s.report.receiver.is_completed()) {
            corrupt_one_byte(&mut receiver_cache, st.plan.id);
        }
    }
    let mut bytes = 0;
    for st in &mut states {
        if w.verify_content {
            // The transport only reads the sender's memory: its blocks still hold what prefill
            // computed, whatever happened to the transfer.
            st.report.source_blocks_changed = sender_cache.verify(st.plan.id).len();
        }
        if let Outcome::Completed { bytes: b, aux } = &st.report.receiver {
            bytes += b;
            let id = st.plan.id;
            let (mismatched, verified) = verify_against_sender(&sender_cache, &receiver_cache, id);
            let mut bad: BTreeSet<(GroupIndex, u32)> = mismatched.into_iter().collect();
            if w.verify_content {
                for m in receiver_cache.verify(id) {
                    bad.insert((m.group, m.ordinal));
                }
            }
            let aux_ok = aux.as_ref().is_some_and(|a| {
                a.first_tokens == [first_token(id)] && a.prompt_tokens == st.plan.prompt
            });
            st.report.mismatched_blocks = bad.len() + usize::from(!aux_ok);
            st.report.bytes_verified = verified;
        }
    }
    let stray_writes = match &before {
        Some(before) => {
            let granted: BTreeSet<(GroupIndex, BlockId)> = states
                .iter()
                .filter(|s| s.registered)
                .flat_map(|s| {
                    let id = s.plan.id;
                    let cache = &receiver_cache;
                    (0..cache.group_count()).flat_map(move |g| {
                        let group = GroupIndex(g as u16);
                        cache
                            .table(id, group)
                            .unwrap_or_default()
                            .iter()
                            .flatten()
                            .map(move |slot| (group, *slot))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            receiver_cache
                .changed_slots(before)
                .into_iter()
                .filter(|(g, _, slot)| !granted.contains(&(*g, *slot)))
                .collect()
        }
        None => Vec::new(),
    };
    let timeline = recorder.finish(
        started,
        states.iter().map(|s| {
            let r = &s.report;
            (r.id, r.last_compute_done, r.receiver_completed_at)
        }),
        &batch_timings,
    );
    Ok(RunReport {
        chunks: states.iter().map(|s| u64::from(s.report.chunks)).sum(),
        requests: states.into_iter().map(|s| s.report).collect(),
        events,
        stray_writes,
        bytes,
        started,
        finished,
        batch_timings,
        leftover_sessions,
        leftover_writes,
        timeline,
    })
}

/// Registers `st`'s destination on the receiver cache and endpoint.
fn register(
    link: &mut impl Link,
    receiver_cache: &mut ReferenceCache,
    st: &mut ReqState,
) -> Result<(), SuiteError> {
    let p = &st.plan;
    let groups = receiver_cache
        .register_destination(p.id, p.prompt, p.receiver_prefix)
        .map_err(cache_err)?;
    st.registered = true;
    if !link.is_alive(Role::Receiver) {
        return Ok(());
    }
    let now = link.now();
    let writer = link.sender_peer();
    link.receiver()
        .register(
            now,
            Registration {
                request: p.id,
                prompt_len: p.prompt,
                groups,
                writers: std::iter::once(writer).collect(),
                aux_capacity: 4096,
                expected_part: None,
            },
        )
        .map_err(usage(Role::Receiver))?;
    Ok(())
}

fn apply_event(
    side: Role,
    at: Instant,
    e: &Event,
    states: &mut [ReqState],
    index: &BTreeMap<RequestId, usize>,
) {
    let (request, outcome) = match e {
        Event::Completed {
            request,
            bytes_written,
            aux,
            ..
        } => (
            *request,
            Some(Outcome::Completed {
                bytes: *bytes_written,
                aux: aux.clone(),
            }),
        ),
        Event::Failed { request, cause, .. } => (*request, Some(Outcome::Failed(*cause))),
        Event::TimedOut {
            request,
            waiting_for,
        } => (*request, Some(Outcome::TimedOut(*waiting_for))),
        Event::Cancelled { request, .. } => (*request, Some(Outcome::Cancelled)),
        Event::Quiesced { request } => (*request, None),
        _ => return,
    };
    let Some(&i) = index.get(&request) else {
        return;
    };
    let r = &mut states[i].report;
    if let Event::Completed { timings, .. } = e {
        match side {
            Role::Sender => r.sender_timings = Some(*timings),
            Role::Receiver => r.receiver_timings = Some(*timings),
        }
    }
    match (side, outcome) {
        (Role::Sender, Some(o)) => r.sender = o,
        (Role::Receiver, Some(o)) => {
            if o.is_completed() {
                r.receiver_completed_at = Some(at);
            }
            r.receiver = o;
        }
        (Role::Sender, None) => r.sender_quiesced = true,
        (Role::Receiver, None) => r.receiver_quiesced = true,
    }
}
