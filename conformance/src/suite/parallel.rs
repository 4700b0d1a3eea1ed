//! Scenarios of heterogeneous parallelism: the prefill side and the decode side split the same
//! model differently (tensor parallelism of other sizes in both directions, KV heads duplicated
//! over more ranks than heads, a decode-side pipeline split, a decode side keeping a larger
//! window). Every transport runs them with [`conformance_tests!`](crate::conformance_tests).
//!
//! A harness connects one sender to one receiver, so each (prefill rank, decode rank) pair that
//! shares part of the model is one connected pair, and the ranks' caches are shared by their
//! pairs: the decode rank's memory receives the head slices and layer ranges of every prefill
//! rank that writes it, each over its own connection, and each pair's registrations declare the
//! part of the decode rank that its one writer writes (`Registration::expected_part`). (A
//! decode rank with several writers on one endpoint is exercised by `kvpipe demo
//! --sender-tp/--receiver-tp/--receiver-pp` and the simulator.) Each scenario
//! checks that every request completes on every pair, that every decode rank's bytes equal the
//! whole model's content for its part, that the prefill ranks' blocks are unchanged, that
//! nothing outside the granted blocks changed, and that nothing is left behind.

use kvpipe_core::session::{GroupPart, LocalHello, Registration, SendRequest};
use kvpipe_core::wire::{AuxData, Role, Topology};
use kvpipe_core::{
    AnchoredRun, BlockId, ChunkSpec, Event, GroupIndex, InstanceId, Instant, ReceiverConfig,
    RequestId, SenderConfig, SenderInput,
};

use super::engine::submit;
use super::workload::{layer_slices, suite_deadlines};
use super::{FaultPlan, Harness, Link, SuiteError};
use crate::cache::{split_rank, writers_of, AllocationStyle, CacheSpec, GroupSpec, ReferenceCache};

/// One mapping between a prefill side and a decode side.
#[derive(Clone, Copy, Debug)]
pub struct ParallelScenario {
    /// Its name (also the `#[test]` name made by `conformance_tests!`).
    pub name: &'static str,
    /// What it checks, in one line.
    pub about: &'static str,
    /// KV heads of the model.
    heads: u16,
    /// Prefill tensor-parallel size.
    sender_tp: u16,
    /// Decode tensor-parallel size.
    receiver_tp: u16,
    /// Decode pipeline-parallel size.
    receiver_pp: u16,
    /// Window of the model's local layers on the prefill side.
    window: u32,
    /// The decode side's window of those layers (at least `window`).
    receiver_window: u32,
    /// Each chunk submitted in layer ranges of this many layers (`None`: whole chunks).
    layers_per_slice: Option<u16>,
}

/// Every heterogeneous scenario.
pub fn parallel_scenarios() -> Vec<ParallelScenario> {
    let base = ParallelScenario {
        name: "",
        about: "",
        heads: 4,
        sender_tp: 1,
        receiver_tp: 1,
        receiver_pp: 1,
        window: 20,
        receiver_window: 20,
        layers_per_slice: None,
    };
    vec![
        ParallelScenario {
            name: "parallel_fewer_prefill_ranks",
            about: "prefill TP 2 to decode TP 4: each decode rank takes a head slice of one prefill rank",
            sender_tp: 2,
            receiver_tp: 4,
            ..base
        },
        ParallelScenario {
            name: "parallel_more_prefill_ranks",
            about: "prefill TP 4 to decode TP 2: each decode rank gathers the heads of two prefill ranks",
            sender_tp: 4,
            receiver_tp: 2,
            ..base
        },
        ParallelScenario {
            name: "parallel_duplicated_heads",
            about: "2 KV heads over prefill TP 4 and decode TP 8: each head on several ranks, each decode rank written by one replica",
            heads: 2,
            sender_tp: 4,
            receiver_tp: 8,
            ..base
        },
        ParallelScenario {
            name: "parallel_decode_pipeline",
            about: "prefill TP 1 to decode PP 2: each decode rank takes its layer range",
            receiver_pp: 2,
            ..base
        },
        ParallelScenario {
            name: "parallel_tensor_and_pipeline",
            about: "prefill TP 4 to decode TP 2 x PP 2: head slices of layer ranges",
            sender_tp: 4,
            receiver_tp: 2,
            receiver_pp: 2,
            ..base
        },
        ParallelScenario {
            name: "parallel_larger_decode_window",
            about: "prefill TP 2 to decode TP 1 keeping a larger window: blocks from the prefill side's stale boundary arrive",
            sender_tp: 2,
            receiver_window: 36,
            ..base
        },
        ParallelScenario {
            name: "parallel_layer_slices_tensor",
            about: "prefill TP 4 to decode TP 2, each chunk in layer ranges of one layer: head slices range by range",
            sender_tp: 4,
            receiver_tp: 2,
            layers_per_slice: Some(1),
            ..base
        },
        ParallelScenario {
            name: "parallel_layer_slices_pipeline",
            about: "prefill TP 2 to decode TP 2 x PP 2, layer ranges of 3 that straddle the decode ranks' layer split",
            sender_tp: 2,
            receiver_tp: 2,
            receiver_pp: 2,
            layers_per_slice: Some(3),
            ..base
        },
    ]
}

/// The heterogeneous scenario named `name`.
pub fn parallel_scenario(name: &str) -> Option<ParallelScenario> {
    parallel_scenarios().into_iter().find(|s| s.name == name)
}

/// Tokens per block of the scenarios' model.
const TPB: u32 = 4;
/// The requests: (prompt, chunk, sender prefix, receiver prefix).
const REQUESTS: [(u32, u32, u32, u32); 3] = [(61, 16, 0, 0), (45, 12, 9, 0), (38, 20, 0, 13)];

/// One rank: its topology and its cache (boxed: the transport holds its memory by address).
struct Rank {
    topology: Topology,
    cache: Box<ReferenceCache>,
}

fn model(heads: u16, window: u32) -> Vec<GroupSpec> {
    vec![
        GroupSpec {
            kv_heads: heads,
            ..GroupSpec::full(4, &[2, 2])
        },
        GroupSpec {
            kv_heads: heads,
            ..GroupSpec::full(2, &[2]).windowed(window, 4)
        },
    ]
}

fn rank(model: &[GroupSpec], at: (u16, u16, u16, u16), region: u32) -> Result<Rank, SuiteError> {
    let check = |e: crate::cache::CacheError| SuiteError::Cache(e.to_string());
    let shape = split_rank(model, at.0, at.1, at.2, at.3).map_err(check)?;
    let blocks: u32 = REQUESTS.iter().map(|r| r.0.div_ceil(TPB)).sum();
    let spec = CacheSpec {
        tokens_per_block: TPB,
        groups: shape.groups,
        slots_per_group: blocks + 3,
        first_region: region,
        slot_order_seed: Some(u64::from(region)),
        materialize: true,
    };
    Ok(Rank {
        topology: shape.topology,
        cache: Box::new(ReferenceCache::with_shards(&spec, &shape.shards).map_err(check)?),
    })
}

/// One connected pair: prefill rank `sender` to decode rank `receiver`.
struct Pair<L> {
    sender: usize,
    receiver: usize,
    /// What the pair's one writer writes of the decode rank: the part its registrations expect.
    expected: Vec<GroupPart>,
    link: L,
    completed: [usize; 2],
    quiesced: usize,
}

impl ParallelScenario {
    /// Runs the scenario over `harness`.
    pub fn run<H: Harness>(&self, harness: &H) -> Result<(), SuiteError> {
        let check = |m: String| Err(SuiteError::Check(format!("{}: {m}", self.name)));
        let mut senders = Vec::new();
        for r in 0..self.sender_tp {
            let m = model(self.heads, self.window);
            senders.push(rank(&m, (self.sender_tp, r, 1, 0), 1 + 10 * u32::from(r))?);
        }
        let mut receivers = Vec::new();
        for tr in 0..self.receiver_tp {
            for pr in 0..self.receiver_pp {
                let m = model(self.heads, self.receiver_window);
                let region = 1000 + 10 * u32::from(tr * self.receiver_pp + pr);
                receivers.push(rank(
                    &m,
                    (self.receiver_tp, tr, self.receiver_pp, pr),
                    region,
                )?);
            }
        }
        let shapes: Vec<_> = (senders.iter())
            .map(|s| (s.topology, s.cache.layouts()))
            .collect();
        let before: Vec<Vec<Vec<u8>>> = receivers.iter().map(|r| r.cache.snapshot()).collect();

        // One connected pair per (prefill rank, decode rank) that share part of the model.
        let mut pairs = Vec::new();
        for (j, r) in receivers.iter_mut().enumerate() {
            for s in writers_of(&shapes, &(r.topology, r.cache.layouts())) {
                let mut sc = SenderConfig::new(LocalHello::new(
                    InstanceId(10 + s as u64),
                    senders[s].topology,
                    senders[s].cache.layouts(),
                ));
                sc.deadlines = suite_deadlines();
                let mut rc = ReceiverConfig::new(
                    LocalHello::new(InstanceId(100 + j as u64), r.topology, r.cache.layouts()),
                    0x9a11 + (j * 64 + s) as u64,
                );
                rc.deadlines = suite_deadlines();
                // SAFETY: every cache is boxed (its regions never move or resize) and outlives
                // the pairs, which are dropped before any cache is read for verification.
                let link = unsafe {
                    harness.connect(
                        sc,
                        rc,
                        &mut senders[s].cache,
                        &mut r.cache,
                        &FaultPlan::default(),
                    )?
                };
                let expected = (senders[s].cache.layouts().iter())
                    .zip(&r.cache.layouts())
                    .map(|(src, dst)| {
                        GroupPart::written_by(&senders[s].topology, src, &r.topology, dst)
                    })
                    .collect();
                pairs.push(Pair {
                    sender: s,
                    receiver: j,
                    expected,
                    link,
                    completed: [0; 2],
                    quiesced: 0,
                });
            }
        }
        for j in 0..receivers.len() {
            if !pairs.iter().any(|p| p.receiver == j) {
                return check(format!("decode rank {j} has no writer"));
            }
        }
        let limit = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let settle = |pairs: &mut Vec<Pair<H::Link>>,
                      done: &dyn Fn(&Pair<H::Link>) -> bool|
         -> Result<(), SuiteError> {
            loop {
                for p in pairs.iter_mut() {
                    p.link.pump()?;
                    for (side, _, e) in p.link.take_events() {
                        let k = usize::from(side == Role::Receiver);
                        match e {
                            Event::Completed { .. } => p.completed[k] += 1,
                            Event::Quiesced { .. } => p.quiesced += 1,
                            Event::Failed { .. }
                            | Event::TimedOut { .. }
                            | Event::Cancelled { .. }
                            | Event::PeerRejected { .. } => {
                                return Err(SuiteError::Check(format!(
                                    "pair {}->{}: {side:?} {e:?}",
                                    p.sender, p.receiver
                                )))
                            }
                            _ => {}
                        }
                    }
                }
                if pairs.iter().all(done) {
                    return Ok(());
                }
                if std::time::Instant::now() > limit {
                    return Err(SuiteError::Stalled {
                        limit_ms: 30_000,
                        pending: "heterogeneous pairs did not settle".into(),
                    });
                }
                for p in pairs.iter_mut() {
                    p.link.wait(std::time::Duration::from_millis(1));
                }
            }
        };
        for p in &mut pairs {
            let (sp, rp) = (p.link.sender_peer(), p.link.receiver_peer());
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !(p.link.sender().is_peer_ready(rp) && p.link.receiver().is_peer_ready(sp)) {
                if std::time::Instant::now() > deadline {
                    return check(format!("pair {}->{}: no handshake", p.sender, p.receiver));
                }
                p.link.pump()?;
                p.link.wait(std::time::Duration::from_millis(1));
            }
        }

        // Open and register every request on every pair.
        let ids: Vec<RequestId> = (1..=REQUESTS.len() as u64).map(RequestId).collect();
        let cache = |e: crate::cache::CacheError| SuiteError::Cache(e.to_string());
        let usage = |side: Role| {
            move |e: kvpipe_core::session::UsageError| SuiteError::Usage {
                side,
                message: e.to_string(),
            }
        };
        for (&id, &(prompt, _, sp, rp)) in ids.iter().zip(&REQUESTS) {
            for s in &mut senders {
                s.cache
                    .begin_prefill(id, prompt, sp, AllocationStyle::Incremental)
                    .map_err(cache)?;
            }
            let mut per_receiver: Vec<Vec<AnchoredRun>> = Vec::new();
            for r in &mut receivers {
                per_receiver.push(
                    r.cache
                        .register_destination(id, prompt, rp)
                        .map_err(cache)?,
                );
            }
            for p in &mut pairs {
                let now = p.link.now();
                let writer = p.link.sender_peer();
                let receiver = p.link.receiver_peer();
                p.link
                    .receiver()
                    .register(
                        now,
                        Registration {
                            request: id,
                            prompt_len: prompt,
                            groups: per_receiver[p.receiver].clone(),
                            writers: std::iter::once(writer).collect(),
                            aux_capacity: 1024,
                            expected_part: Some(p.expected.clone()),
                        },
                    )
                    .map_err(usage(Role::Receiver))?;
                p.link
                    .sender()
                    .open_request(
                        now,
                        SendRequest {
                            request: id,
                            receivers: std::iter::once(receiver).collect(),
                            beam_width: 1,
                        },
                    )
                    .map_err(usage(Role::Sender))?;
            }
        }

        // Prefill, round-robin over the requests; every prefill rank computes its part of each
        // chunk, and every pair submits it.
        let chunks: Vec<Vec<(u32, u32)>> = REQUESTS
            .iter()
            .map(|&(prompt, step, sp, _)| {
                let mut out = Vec::new();
                let mut start = sp;
                loop {
                    let end = (start + step).min(prompt);
                    out.push((start, end));
                    if end >= prompt {
                        return out;
                    }
                    start = end;
                }
            })
            .collect();
        let most = chunks.iter().map(Vec::len).max().unwrap_or(0);
        let slices: Vec<Option<kvpipe_core::LayerRange>> = match self.layers_per_slice {
            Some(n) => layer_slices(&model(self.heads, self.window), n)
                .into_iter()
                .map(Some)
                .collect(),
            None => vec![None],
        };
        for k in 0..most {
            for (i, &id) in ids.iter().enumerate() {
                let Some(&(start, end)) = chunks[i].get(k) else {
                    continue;
                };
                let (prompt, _, sp, _) = REQUESTS[i];
                for s in &mut senders {
                    s.cache.compute_chunk(id, start, end).map_err(cache)?;
                }
                let spec = ChunkSpec {
                    start,
                    end,
                    prompt_len: prompt,
                    prepopulated_len: sp,
                    is_last: end == prompt,
                    prefix_sent_early: false,
                };
                for p in &mut pairs {
                    for &slice in &slices {
                        let now = p.link.now();
                        submit(
                            p.link.sender(),
                            now,
                            id,
                            spec,
                            slice,
                            &mut senders[p.sender].cache,
                        )
                        .map_err(usage(Role::Sender))?;
                        p.link.pump()?;
                    }
                    let now = p.link.now();
                    if spec.is_last {
                        let data = AuxData {
                            prompt_tokens: prompt,
                            cached_tokens: sp,
                            first_tokens: vec![id.0 as u32],
                            draft_tokens: Vec::new(),
                        };
                        p.link
                            .sender()
                            .handle_input(SenderInput::Aux {
                                now,
                                request: id,
                                data,
                            })
                            .map_err(usage(Role::Sender))?;
                    }
                    p.link.pump()?;
                }
            }
        }
        let n = ids.len();
        settle(&mut pairs, &|p: &Pair<H::Link>| {
            p.completed == [n, n] && p.quiesced == 2 * n
        })?;
        for p in &mut pairs {
            let now: Instant = p.link.now();
            for &id in &ids {
                p.link
                    .sender()
                    .retire(now, id)
                    .map_err(usage(Role::Sender))?;
                p.link
                    .receiver()
                    .retire(now, id)
                    .map_err(usage(Role::Receiver))?;
            }
            p.link.pump()?;
            let left = p.link.sender().session_count()
                + p.link.sender().pending_registration_count()
                + p.link.receiver().session_count();
            if left != 0 || p.link.writes_in_flight() != 0 {
                return check(format!(
                    "pair {}->{}: {left} session(s), {} write batch(es) left",
                    p.sender,
                    p.receiver,
                    p.link.writes_in_flight()
                ));
            }
        }
        drop(pairs);

        // Every decode rank holds the whole model's content for its part; the prefill ranks'
        // blocks are unchanged; nothing outside the granted blocks changed.
        for &id in &ids {
            for (j, r) in receivers.iter().enumerate() {
                // The prefill side never sends below its own stale boundary; a larger decode
                // window's older blocks are the decode side's own business.
                let sender_windows: Vec<Option<u32>> = r
                    .cache
                    .layouts()
                    .iter()
                    .map(|l| l.window.map(|_| self.window))
                    .collect();
                let bad = r
                    .cache
                    .verify_sent(id, &sender_windows)
                    .map_err(|e| SuiteError::Check(e.to_string()))?;
                if !bad.is_empty() {
                    return check(format!("decode rank {j}, {id}: {bad:?}"));
                }
            }
            for (i, s) in senders.iter().enumerate() {
                let bad = s.cache.verify(id);
                if !bad.is_empty() {
                    return check(format!(
                        "prefill rank {i} changed under the transfer: {bad:?}"
                    ));
                }
            }
        }
        for (j, r) in receivers.iter().enumerate() {
            let granted: Vec<(GroupIndex, BlockId)> = ids
                .iter()
                .flat_map(|&id| {
                    (0..r.cache.group_count()).flat_map(move |g| {
                        let group = GroupIndex(g as u16);
                        r.cache
                            .table(id, group)
                            .unwrap_or_default()
                            .iter()
                            .flatten()
                            .map(move |slot| (group, *slot))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let stray: Vec<_> = r
                .cache
                .changed_slots(&before[j])
                .into_iter()
                .filter(|(g, _, slot)| !granted.contains(&(*g, *slot)))
                .collect();
            if !stray.is_empty() {
                return check(format!(
                    "decode rank {j}: bytes outside the granted blocks changed: {stray:?}"
                ));
            }
        }
        Ok(())
    }
}

/// Runs the heterogeneous scenario `name` over `harness` (used by `conformance_tests!`).
pub fn run_parallel<H: Harness>(harness: &H, name: &str) -> Result<(), SuiteError> {
    parallel_scenario(name)
        .ok_or_else(|| SuiteError::Check(format!("no heterogeneous scenario {name}")))?
        .run(harness)
}
