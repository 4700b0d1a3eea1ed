//! Windowed pools that hold only live blocks: evicted slots are recycled at once (possibly for
//! another request), and no write is ever planned from or into a slot that was recycled under
//! it — also when the receiver keeps a larger window than the sender, so that the blocks the
//! sender evicts have somewhere to go. Several requests are prefilled chunk by chunk, interleaved, on one sender cache; every
//! chunk's plan is carried out only a few chunks later (a transfer in flight while prefill goes
//! on and windows slide), and each of its bytes is checked to still belong to the block it was
//! planned for, on both sides, when it is written.

use std::collections::{BTreeMap, VecDeque};

use kvpipe_conformance::cache::{
    apply_plan, AllocationStyle, CacheSpec, GroupSpec, ReferenceCache,
};
use kvpipe_core::{
    chunk_window, plan_group, AnchoredRun, BlockId, BlockRun, BlockSource, ChunkSpec, GroupIndex,
    RequestId, StaleBoundary, WritePlan,
};
use proptest::prelude::*;

/// One request of a run: prompt, chunk ends, prefixes on both sides.
#[derive(Clone, Debug)]
struct Req {
    prompt: u32,
    cuts: Vec<u32>,
    sender_prefix: u32,
    receiver_prefix: u32,
}

#[derive(Clone, Debug)]
struct Case {
    tpb: u32,
    window: u32,
    /// How much larger the receiver's window is (it keeps blocks the sender evicts).
    receiver_extra_window: u32,
    sinks: u32,
    style: AllocationStyle,
    seed: Option<u64>,
    requests: Vec<Req>,
    /// Chunks a plan stays in flight before it is carried out.
    delays: Vec<u8>,
}

/// A plan waiting to be carried out, with the (request, ordinal) every slot it touches held
/// when it was planned.
struct InFlight {
    due: usize,
    plan: WritePlan,
    request: RequestId,
    owners: Vec<(bool, GroupIndex, BlockId, (RequestId, u32))>,
}

/// What a run saw.
#[derive(Debug, Default)]
struct Seen {
    /// Slots handed to a (request, ordinal) other than the one they held before.
    recycled: usize,
    /// Peak slots of the windowed group on the sender.
    sender_window_peak: u32,
}

fn spec(c: &Case, receiver: bool) -> CacheSpec {
    let blocks: u32 = c.requests.iter().map(|r| r.prompt.div_ceil(c.tpb)).sum();
    CacheSpec {
        tokens_per_block: c.tpb,
        groups: vec![
            GroupSpec::full(2, &[1, 1]),
            if receiver {
                GroupSpec::full(1, &[1]).windowed(c.window + c.receiver_extra_window, 0)
            } else {
                GroupSpec::full(1, &[1]).windowed(c.window, c.sinks)
            },
        ],
        slots_per_group: blocks + 2,
        first_region: if receiver { 100 } else { 1 },
        slot_order_seed: c.seed.map(|s| s ^ u64::from(receiver)),
        materialize: true,
    }
}

/// Every (side, group, slot) `plan` reads or writes, with the block each holds now.
fn owners(
    sender: &ReferenceCache,
    receiver: &ReferenceCache,
    plan: &WritePlan,
) -> Vec<(bool, GroupIndex, BlockId, (RequestId, u32))> {
    let mut out = Vec::new();
    for e in plan.extents() {
        for (is_sender, cache, region, offset) in [
            (true, sender, e.src_region, e.src_offset),
            (false, receiver, e.dst_region, e.dst_offset),
        ] {
            let mut at = offset;
            while at < offset + e.len {
                let loc = cache.locate(region, at).expect("inside the region");
                let owner = cache.owner(loc.group, loc.slot).expect("a held slot");
                out.push((is_sender, loc.group, loc.slot, owner));
                let slot_bytes = cache.layout(loc.group).unwrap().pools[loc.pool].slot_bytes;
                at += slot_bytes - loc.offset_in_slot;
            }
        }
    }
    out
}

fn run(c: &Case) -> Result<Seen, TestCaseError> {
    let mut sender = ReferenceCache::new(&spec(c, false)).unwrap();
    let mut receiver = ReferenceCache::new(&spec(c, true)).unwrap();
    let (ls, lr) = (sender.layouts(), receiver.layouts());
    let ids: Vec<RequestId> = (0..c.requests.len())
        .map(|i| RequestId(i as u64 + 1))
        .collect();
    let mut runs: Vec<Vec<AnchoredRun>> = Vec::new();
    let mut chunks: Vec<VecDeque<ChunkSpec>> = Vec::new();
    for (r, &id) in c.requests.iter().zip(&ids) {
        sender
            .begin_prefill(id, r.prompt, r.sender_prefix, c.style)
            .unwrap();
        runs.push(
            receiver
                .register_destination(id, r.prompt, r.receiver_prefix)
                .unwrap(),
        );
        let mut cuts: Vec<u32> = r
            .cuts
            .iter()
            .copied()
            .filter(|&x| x > r.sender_prefix && x < r.prompt)
            .collect();
        cuts.push(r.prompt);
        cuts.sort_unstable();
        cuts.dedup();
        let mut start = r.sender_prefix;
        chunks.push(
            cuts.into_iter()
                .map(|end| {
                    let chunk = ChunkSpec {
                        start,
                        end,
                        prompt_len: r.prompt,
                        prepopulated_len: r.sender_prefix,
                        is_last: end == r.prompt,
                        prefix_sent_early: false,
                    };
                    start = end;
                    chunk
                })
                .collect(),
        );
    }
    // Who held each slot last, to count recycling.
    let mut last_owner: BTreeMap<(bool, GroupIndex, BlockId), (RequestId, u32)> = BTreeMap::new();
    let mut seen = Seen::default();
    let mut note = |cache: &ReferenceCache, is_sender: bool, id: RequestId, seen: &mut Seen| {
        for g in 0..cache.group_count() {
            let group = GroupIndex(g as u16);
            for (ordinal, slot) in cache
                .table(id, group)
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                if let Some(slot) = slot {
                    let now = (id, ordinal as u32);
                    if let Some(before) = last_owner.insert((is_sender, group, *slot), now) {
                        seen.recycled += usize::from(before != now);
                    }
                }
            }
        }
    };
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut pending_writes = vec![0usize; ids.len()];
    let mut released = vec![false; ids.len()];
    let mut step = 0usize;
    let mut src = BlockRun::default();
    loop {
        let mut any = false;
        for (i, &id) in ids.iter().enumerate() {
            let Some(chunk) = chunks[i].pop_front() else {
                continue;
            };
            any = true;
            sender.compute_chunk(id, chunk.start, chunk.end).unwrap();
            note(&sender, true, id, &mut seen);
            let mut plan = WritePlan::new();
            for (g, layout) in ls.iter().enumerate() {
                if let Some(w) = chunk_window(&chunk, layout).unwrap() {
                    sender
                        .block_run(id, GroupIndex(g as u16), w.begin, w.end, &mut src)
                        .unwrap();
                    // Every block a chunk sends is resident: nothing it names was evicted.
                    prop_assert_eq!((src.first_ordinal, src.end_ordinal()), (w.begin, w.end));
                    plan_group(layout, &lr[g], &src, &runs[i][g], &mut plan).unwrap();
                }
            }
            if !plan.is_empty() {
                let owners = owners(&sender, &receiver, &plan);
                let delay = usize::from(c.delays[step % c.delays.len()]);
                in_flight.push(InFlight {
                    due: step + delay,
                    plan,
                    request: id,
                    owners,
                });
                pending_writes[i] += 1;
            }
            step += 1;
            // Carry out the writes that are due: each slot must still hold its block.
            let mut k = 0;
            while k < in_flight.len() {
                if in_flight[k].due > step {
                    k += 1;
                    continue;
                }
                let w = in_flight.swap_remove(k);
                for &(is_sender, group, slot, planned) in &w.owners {
                    let cache = if is_sender { &sender } else { &receiver };
                    prop_assert_eq!(
                        cache.owner(group, slot),
                        Some(planned),
                        "a write of {} reaches {} slot {:?} of {} recycled since it was planned",
                        w.request,
                        if is_sender { "sender" } else { "receiver" },
                        slot,
                        group
                    );
                }
                apply_plan(&sender, &mut receiver, &w.plan).unwrap();
                let i = ids.iter().position(|r| *r == w.request).unwrap();
                pending_writes[i] -= 1;
            }
            // A request whose prefill is done and whose writes all landed frees its sender
            // blocks (quiesced): the next chunks recycle them.
            for j in 0..ids.len() {
                if chunks[j].is_empty() && pending_writes[j] == 0 && !released[j] {
                    released[j] = true;
                    sender.release(ids[j]);
                }
            }
        }
        if !any && in_flight.is_empty() {
            break;
        }
        if !any {
            step += 1;
            let due = std::mem::take(&mut in_flight);
            for w in due {
                apply_plan(&sender, &mut receiver, &w.plan).unwrap();
                let i = ids.iter().position(|r| *r == w.request).unwrap();
                pending_writes[i] -= 1;
            }
        }
    }
    seen.sender_window_peak = sender.peak_slots(GroupIndex(1));
    for (r, &id) in c.requests.iter().zip(&ids) {
        note(&receiver, false, id, &mut seen);
        // Every block at or above the sender's stale boundary arrived right (a larger
        // receiver window's older blocks are the receiver's own business).
        for (g, layout) in ls.iter().enumerate() {
            let stale = StaleBoundary::for_group(r.prompt, layout)
                .unwrap()
                .ordinal();
            let blocks = r.prompt.div_ceil(c.tpb);
            let bad = receiver.verify_blocks(id, GroupIndex(g as u16), stale..blocks);
            prop_assert_eq!(bad, vec![], "{} arrived wrong", id);
        }
    }
    Ok(seen)
}

fn case() -> impl Strategy<Value = Case> {
    let req = (1u32..=60).prop_flat_map(|prompt| {
        (
            Just(prompt),
            proptest::collection::vec(1..=prompt, 0..6),
            0..=prompt,
            0..=prompt,
        )
            .prop_map(|(prompt, cuts, sp, rp)| Req {
                prompt,
                cuts,
                sender_prefix: sp,
                receiver_prefix: rp,
            })
    });
    (
        1u32..=4,
        1u32..=20,
        prop_oneof![Just(0u32), 1u32..=12],
        0u32..=6,
        any::<bool>(),
        proptest::option::of(any::<u64>()),
        proptest::collection::vec(req, 1..=4),
        proptest::collection::vec(0u8..=3, 1..6),
    )
        .prop_map(
            |(tpb, window, extra, sinks, incremental, seed, requests, delays)| Case {
                tpb,
                window,
                receiver_extra_window: extra,
                sinks,
                style: if incremental {
                    AllocationStyle::Incremental
                } else {
                    AllocationStyle::FullPrompt
                },
                seed,
                requests,
                delays,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over random chunkings, prefixes on both sides, sinks, allocation styles and slot orders,
    /// with writes landing chunks after they were planned, no write touches a recycled slot and
    /// every receiver block arrives right.
    #[test]
    fn no_write_reaches_a_recycled_slot(c in case()) {
        run(&c)?;
    }
}

#[test]
fn evicted_slots_are_recycled_while_transfers_are_in_flight() {
    // Three requests of 48 tokens, window 8 tokens (tpb 2), chunks of 8 tokens, writes landing
    // two chunks after they were planned.
    let req = |sender_prefix| Req {
        prompt: 48,
        cuts: (1..6).map(|k| k * 8).collect(),
        sender_prefix,
        receiver_prefix: 0,
    };
    let c = Case {
        tpb: 2,
        window: 8,
        receiver_extra_window: 6,
        sinks: 2,
        style: AllocationStyle::FullPrompt,
        seed: None,
        requests: vec![req(0), req(0), req(20)],
        delays: vec![2],
    };
    let seen = run(&c).unwrap();
    assert!(seen.recycled > 20, "slots were recycled: {seen:?}");
    // The windowed pool held at most, per request, the sink block, the window and one chunk:
    // 1 + 4 + 4 blocks (+1 for a window that starts mid-block), never a whole prompt's 24.
    assert!(
        seen.sender_window_peak <= 3 * (1 + 5 + 4),
        "windowed pool held {} blocks",
        seen.sender_window_peak
    );
}

#[test]
fn windowed_pools_commit_only_their_live_blocks() {
    let mut cache = ReferenceCache::new(&CacheSpec {
        tokens_per_block: 4,
        groups: vec![
            GroupSpec::full(1, &[1]),
            GroupSpec::full(1, &[1]).windowed(16, 0),
        ],
        slots_per_group: 200,
        first_region: 1,
        slot_order_seed: Some(9),
        materialize: true,
    })
    .unwrap();
    let id = RequestId(1);
    // A 400-token prompt (100 blocks) with a reused prefix of 200 tokens, in chunks of 40.
    cache
        .begin_prefill(id, 400, 200, AllocationStyle::FullPrompt)
        .unwrap();
    // The prefix's head left the window: only its last blocks were ever allocated.
    assert!(cache.peak_slots(GroupIndex(1)) <= 5);
    for start in (200..400).step_by(40) {
        cache.compute_chunk(id, start, start + 40).unwrap();
    }
    assert_eq!(cache.peak_slots(GroupIndex(0)), 100);
    // Window (4 blocks + 1 partial) and one chunk (10 blocks).
    assert!(cache.peak_slots(GroupIndex(1)) <= 15);
    let live = cache
        .table(id, GroupIndex(1))
        .unwrap()
        .iter()
        .flatten()
        .count() as u64;
    assert!(live <= 5);
    let block = |g: u16| cache.layout(GroupIndex(g)).unwrap().pools[0].slot_bytes;
    assert_eq!(cache.resident_bytes(), 100 * block(0) + live * block(1));
    assert_eq!(
        cache.peak_resident_bytes(),
        100 * block(0) + u64::from(cache.peak_slots(GroupIndex(1))) * block(1)
    );
    // Only the slots ever handed out hold anything but zeros (the OS commits nothing else).
    let region = cache.region(kvpipe_core::RegionId(2)).unwrap();
    let slot_bytes = block(1) as usize;
    let used = region
        .chunks(slot_bytes)
        .filter(|s| s.iter().any(|&b| b != 0))
        .count();
    assert_eq!(used as u32, cache.peak_slots(GroupIndex(1)));
    assert_eq!(cache.verify(id), vec![]);
}
