//! End-to-end checks of chunk geometry, bounded block runs and write planning against the
//! reference paged KV cache: a request is prefilled chunk by chunk on a sender cache, every
//! chunk's plan is applied by memcpy to a receiver cache, and the receiver's bytes are verified.

use std::collections::BTreeSet;

use kvpipe_conformance::cache::{
    apply_plan, AllocationStyle, CacheSpec, GroupSpec, ReferenceCache,
};
use kvpipe_core::{
    chunk_window, early_prefix_window, plan_group, BlockId, BlockRun, BlockSource,
    BlockSourceError, BlockWindow, ChunkSpec, GroupIndex, RequestId, StaleBoundary, WritePlan,
};
use proptest::prelude::*;

const REQ: RequestId = RequestId(7);

/// One group of a scenario: window, sink tokens, sender pool split, receiver pool split, slot
/// padding.
type GroupCase = (Option<u32>, u32, Vec<u16>, Vec<u16>, u64);

/// One randomised transfer.
#[derive(Clone, Debug)]
struct Scenario {
    tpb: u32,
    prompt: u32,
    /// Per group: window, sinks, sender pool split, receiver pool split, slot padding.
    groups: Vec<GroupCase>,
    cuts: Vec<u32>,
    sender_prefix: u32,
    receiver_prefix: u32,
    style: AllocationStyle,
    prefix_sent_early: bool,
    sender_seed: Option<u64>,
    receiver_seed: Option<u64>,
}

fn spec(s: &Scenario, receiver: bool) -> CacheSpec {
    let total = s.prompt.div_ceil(s.tpb);
    CacheSpec {
        tokens_per_block: s.tpb,
        groups: s
            .groups
            .iter()
            .map(|(window, sinks, ssplit, rsplit, pad)| {
                let split = if receiver { rsplit } else { ssplit };
                let mut g = GroupSpec::full(split.iter().sum(), split);
                g.window = *window;
                g.sink_tokens = *sinks;
                g.slot_padding = *pad;
                g
            })
            .collect(),
        // Room for the request and some slack, so slot ids are not all used.
        slots_per_group: total + 5,
        first_region: if receiver { 100 } else { 1 },
        slot_order_seed: if receiver {
            s.receiver_seed
        } else {
            s.sender_seed
        },
        materialize: true,
    }
}

/// The chunks of the scenario, from the sender's prefix to the prompt's end.
fn chunks(s: &Scenario) -> Vec<ChunkSpec> {
    let mut cuts: Vec<u32> = s
        .cuts
        .iter()
        .copied()
        .filter(|&c| c > s.sender_prefix && c < s.prompt)
        .collect();
    cuts.push(s.prompt);
    cuts.sort_unstable();
    cuts.dedup();
    let mut start = s.sender_prefix;
    cuts.into_iter()
        .map(|end| {
            let c = ChunkSpec {
                start,
                end,
                prompt_len: s.prompt,
                prepopulated_len: s.sender_prefix,
                is_last: end == s.prompt,
                prefix_sent_early: s.prefix_sent_early,
            };
            start = end;
            c
        })
        .collect()
}

/// Checks that every byte an extent copies goes from ordinal `o`, layer `l`, byte `b` of the
/// sender to the same ordinal, layer and byte of the receiver.
fn check_extents_pair_ordinals(
    sender: &ReferenceCache,
    receiver: &ReferenceCache,
    plan: &WritePlan,
) -> Result<(), TestCaseError> {
    for e in plan.extents() {
        let mut k = 0;
        while k < e.len {
            let s = sender.locate(e.src_region, e.src_offset + k).unwrap();
            let d = receiver.locate(e.dst_region, e.dst_offset + k).unwrap();
            prop_assert_eq!(s.group, d.group);
            let sl = &sender.layout(s.group).unwrap();
            let dl = &receiver.layout(d.group).unwrap();
            let (sp, dp) = (sl.pools[s.pool], dl.pools[d.pool]);
            let layer_bytes = sl.layer_block_bytes().unwrap();
            prop_assert!(
                s.offset_in_slot < u64::from(sp.layers) * layer_bytes,
                "copies padding"
            );
            prop_assert!(
                d.offset_in_slot < u64::from(dp.layers) * layer_bytes,
                "writes padding"
            );
            let s_layer = u64::from(sp.layer_begin) * layer_bytes + s.offset_in_slot;
            let d_layer = u64::from(dp.layer_begin) * layer_bytes + d.offset_in_slot;
            prop_assert_eq!(s_layer, d_layer, "byte lands at another layer or offset");
            let so = sender.owner(s.group, s.slot).map(|(_, o)| o);
            let d_o = receiver.owner(d.group, d.slot).map(|(_, o)| o);
            prop_assert!(so.is_some());
            prop_assert_eq!(so, d_o, "pair of different ordinals");
            // Advance to the next slot boundary on either side.
            let step = (sp.slot_bytes - s.offset_in_slot).min(dp.slot_bytes - d.offset_in_slot);
            k += step;
        }
    }
    Ok(())
}

/// Runs the scenario; returns the windows sent per group (early prefix first).
fn run(s: &Scenario) -> Result<Vec<Vec<BlockWindow>>, TestCaseError> {
    let mut sender = ReferenceCache::new(&spec(s, false)).unwrap();
    let mut receiver = ReferenceCache::new(&spec(s, true)).unwrap();
    sender
        .begin_prefill(REQ, s.prompt, s.sender_prefix, s.style)
        .unwrap();
    let runs = receiver
        .register_destination(REQ, s.prompt, s.receiver_prefix)
        .unwrap();
    let before = receiver.snapshot();
    let layouts_s = sender.layouts();
    let layouts_r = receiver.layouts();
    let mut sent: Vec<Vec<BlockWindow>> = vec![Vec::new(); layouts_s.len()];
    let mut src = BlockRun::default();
    let mut plan = WritePlan::new();

    let mut send = |sender: &mut ReferenceCache,
                    receiver: &mut ReferenceCache,
                    g: usize,
                    w: BlockWindow,
                    sent: &mut Vec<Vec<BlockWindow>>|
     -> Result<(), TestCaseError> {
        sent[g].push(w);
        sender
            .block_run(REQ, GroupIndex(g as u16), w.begin, w.end, &mut src)
            .unwrap();
        // The chunk's blocks are all resident: the run is the whole window.
        prop_assert_eq!(src.first_ordinal, w.begin);
        prop_assert_eq!(src.end_ordinal(), w.end);
        plan.clear();
        plan_group(&layouts_s[g], &layouts_r[g], &src, &runs[g], &mut plan).unwrap();
        check_extents_pair_ordinals(sender, receiver, &plan)?;
        apply_plan(sender, receiver, &plan).unwrap();
        Ok(())
    };

    if s.prefix_sent_early {
        for (g, layout) in layouts_s.iter().enumerate() {
            if let Some(w) = early_prefix_window(s.prompt, s.sender_prefix, layout).unwrap() {
                send(&mut sender, &mut receiver, g, w, &mut sent)?;
            }
        }
    }
    for c in chunks(s) {
        sender.compute_chunk(REQ, c.start, c.end).unwrap();
        for (g, layout) in layouts_s.iter().enumerate() {
            if let Some(w) = chunk_window(&c, layout).unwrap() {
                send(&mut sender, &mut receiver, g, w, &mut sent)?;
            }
        }
    }

    // The sender computed everything correctly (the content model itself).
    prop_assert_eq!(sender.verify(REQ), vec![]);
    // Every block the receiver holds is byte-identical to what the sender computed.
    prop_assert_eq!(receiver.verify(REQ), vec![]);
    // Exactly the receiver's missing blocks changed, in every pool; nothing else did.
    let changed: BTreeSet<_> = receiver.changed_slots(&before).into_iter().collect();
    let mut expected = BTreeSet::new();
    for (g, run) in runs.iter().enumerate() {
        for (_, id) in run.iter() {
            for p in 0..layouts_r[g].pools.len() {
                expected.insert((GroupIndex(g as u16), p, id));
            }
        }
    }
    prop_assert_eq!(changed, expected);
    // And the receiver's blocks equal the sender's, byte for byte, wherever both hold them.
    for (g, run) in runs.iter().enumerate() {
        for (ordinal, dst_id) in run.iter() {
            let src_id =
                sender.table(REQ, GroupIndex(g as u16)).unwrap()[ordinal as usize].unwrap();
            let (ls, lr) = (&layouts_s[g], &layouts_r[g]);
            let lb = ls.layer_block_bytes().unwrap() as usize;
            for layer in 0..ls.layers {
                let byte_of =
                    |cache: &ReferenceCache, l: &kvpipe_core::LayerGroupLayout, id: BlockId| {
                        let p = l
                            .pools
                            .iter()
                            .find(|p| layer >= p.layer_begin && layer < p.layer_begin + p.layers)
                            .unwrap();
                        let at = (u64::from(id.0) * p.slot_bytes) as usize
                            + usize::from(layer - p.layer_begin) * lb;
                        cache.region(p.region).unwrap()[at..at + lb].to_vec()
                    };
                prop_assert_eq!(byte_of(&sender, ls, src_id), byte_of(&receiver, lr, dst_id));
            }
        }
    }
    Ok(sent)
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1u32..=6, 1u32..=60)
        .prop_flat_map(|(tpb, prompt)| {
            let group = (
                proptest::option::of(1u32..=70),
                0u32..=8,
                prop_oneof![
                    Just(vec![2u16]),
                    Just(vec![1u16, 1]),
                    Just(vec![1u16, 2]),
                    Just(vec![2u16, 1])
                ],
                0u64..=1,
                0u8..3,
            )
                .prop_map(|(window, sinks, split, pad, receiver_split)| {
                    let layers: u16 = split.iter().sum();
                    // The receiver splits the same layers alike (whole-slot runs coalesce),
                    // into one pool, or one pool per layer.
                    let rsplit = match receiver_split {
                        0 => split.clone(),
                        1 => vec![layers],
                        _ => vec![1; layers as usize],
                    };
                    (window, sinks, split, rsplit, pad)
                });
            (
                Just(tpb),
                Just(prompt),
                proptest::collection::vec(group, 1..=3),
                proptest::collection::vec(0..=prompt, 0..8),
                0..=prompt,
                0..=prompt,
                prop_oneof![
                    Just(AllocationStyle::FullPrompt),
                    Just(AllocationStyle::Incremental)
                ],
                any::<bool>(),
                proptest::option::of(any::<u64>()),
                proptest::option::of(any::<u64>()),
            )
        })
        .prop_map(
            |(tpb, prompt, groups, cuts, sp, rp, style, early, ss, rs)| Scenario {
                tpb,
                prompt,
                groups,
                cuts,
                sender_prefix: sp,
                receiver_prefix: rp,
                style,
                prefix_sent_early: early,
                sender_seed: ss,
                receiver_seed: rs,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Applying every chunk's plan makes the receiver's missing blocks byte-identical to the
    /// sender's and changes nothing else; the windows tile each group exactly once.
    #[test]
    fn chunked_transfer_reproduces_the_sender_cache(s in scenario()) {
        let sent = run(&s)?;
        let layouts = ReferenceCache::new(&spec(&s, false)).unwrap().layouts();
        for (g, windows) in sent.iter().enumerate() {
            let total = s.prompt.div_ceil(s.tpb);
            let stale = StaleBoundary::for_group(s.prompt, &layouts[g]).unwrap().ordinal();
            let mut count = vec![0u32; total as usize];
            for w in windows {
                for o in w.begin..w.end { count[o as usize] += 1; }
            }
            for (o, n) in count.into_iter().enumerate() {
                prop_assert_eq!(n, u32::from(o as u32 >= stale), "group {} ordinal {}", g, o);
            }
        }
    }

    /// The bounded query against a model of the contract, with windows, sinks and both
    /// allocation styles, in the middle of prefill.
    #[test]
    fn bounded_block_run_contract(
        tpb in 1u32..=5,
        prompt in 1u32..=80,
        window in proptest::option::of(1u32..=60),
        sinks in 0u32..=10,
        incremental in any::<bool>(),
        computed_frac in 0u32..=100,
        queries in proptest::collection::vec((0u32..=40, 0u32..=40), 1..20),
    ) {
        let mut g = GroupSpec::full(1, &[1]);
        g.window = window;
        g.sink_tokens = sinks;
        let mut cache = ReferenceCache::new(&CacheSpec {
            tokens_per_block: tpb,
            groups: vec![g, GroupSpec::full(1, &[1])],
            slots_per_group: 100,
            first_region: 1,
            slot_order_seed: Some(3),
            materialize: false,
        }).unwrap();
        let style = if incremental { AllocationStyle::Incremental } else { AllocationStyle::FullPrompt };
        cache.begin_prefill(REQ, prompt, 0, style).unwrap();
        let computed = prompt * computed_frac / 100;
        cache.compute_chunk(REQ, 0, computed).unwrap();
        let table = cache.table(REQ, GroupIndex(0)).unwrap().to_vec();
        let allocated = table.len() as u32;
        let mut out = BlockRun { first_ordinal: 99, ids: vec![BlockId(5); 3] };
        for (a, b) in queries {
            let before = cache.lookups();
            let r = cache.block_run(REQ, GroupIndex(0), a, b, &mut out);
            prop_assert!(cache.lookups() - before <= u64::from(b.saturating_sub(a)), "not O(end - begin)");
            if a > b {
                prop_assert_eq!(r, Err(BlockSourceError::BeginAfterEnd { begin: a, end: b }));
                continue;
            }
            if b > allocated {
                prop_assert_eq!(r, Err(BlockSourceError::PastAllocation { end: b, allocated }));
                continue;
            }
            r.unwrap();
            // Model: the resident entries of [a, b) after the last gap.
            let slice = &table[a as usize..b as usize];
            let from = slice.iter().rposition(Option::is_none).map_or(0, |i| i + 1);
            let expected: Vec<BlockId> = slice[from..].iter().map(|x| x.unwrap()).collect();
            prop_assert_eq!(out.first_ordinal, b - expected.len() as u32);
            prop_assert_eq!(&out.ids, &expected);
        }
        prop_assert_eq!(
            cache.block_run(RequestId(8), GroupIndex(0), 0, 0, &mut out),
            Err(BlockSourceError::UnknownRequest(RequestId(8)))
        );
        prop_assert_eq!(
            cache.block_run(REQ, GroupIndex(2), 0, 0, &mut out),
            Err(BlockSourceError::UnknownGroup(GroupIndex(2)))
        );
    }
}

fn fixed(prompt: u32, tpb: u32, groups: Vec<(Option<u32>, u32)>, cuts: &[u32]) -> Scenario {
    Scenario {
        tpb,
        prompt,
        groups: groups
            .into_iter()
            .map(|(w, sinks)| (w, sinks, vec![1, 1], vec![2], 0))
            .collect(),
        cuts: cuts.to_vec(),
        sender_prefix: 0,
        receiver_prefix: 0,
        style: AllocationStyle::Incremental,
        prefix_sent_early: false,
        sender_seed: Some(11),
        receiver_seed: Some(12),
    }
}

fn w(begin: u32, end: u32) -> BlockWindow {
    BlockWindow { begin, end }
}

#[test]
fn reference_chunking_over_the_cache() {
    let s = fixed(32, 4, vec![(None, 0)], &[6, 12]);
    let sent = run(&s).unwrap();
    assert_eq!(sent, vec![vec![w(0, 1), w(1, 3), w(3, 8)]]);
}

#[test]
fn reused_prefix_is_sent_with_the_first_chunk() {
    let mut s = fixed(32, 4, vec![(None, 0)], &[14]);
    s.sender_prefix = 6;
    assert_eq!(run(&s).unwrap(), vec![vec![w(0, 3), w(3, 8)]]);
    // The receiver already holds 9 tokens: its two full blocks are not written.
    s.receiver_prefix = 9;
    assert_eq!(run(&s).unwrap(), vec![vec![w(0, 3), w(3, 8)]]);
}

#[test]
fn windowed_group_with_sinks_streams_from_the_stale_boundary() {
    // prompt 32, W 10, tpb 4: stale 5; sinks keep block 0 resident (gap at 1..5). Chunks below
    // the boundary send nothing for the windowed group; from there each chunk sends its own
    // computed blocks.
    let s = fixed(
        32,
        4,
        vec![(None, 0), (Some(10), 3)],
        &[2, 6, 7, 12, 22, 26],
    );
    let sent = run(&s).unwrap();
    assert_eq!(sent[0], vec![w(0, 1), w(1, 3), w(3, 5), w(5, 6), w(6, 8)]);
    assert_eq!(sent[1], vec![w(5, 6), w(6, 8)]);
    // A window covering the prompt streams like full attention.
    let s = fixed(32, 4, vec![(Some(32), 3)], &[6, 12]);
    assert_eq!(run(&s).unwrap(), vec![vec![w(0, 1), w(1, 3), w(3, 8)]]);
}

#[test]
fn sinks_and_evicted_window_head_follow_the_last_gap_rule() {
    let mut g = GroupSpec::full(1, &[1]).windowed(10, 5);
    g.slot_padding = 0;
    let mut cache = ReferenceCache::new(&CacheSpec {
        tokens_per_block: 4,
        groups: vec![g],
        slots_per_group: 16,
        first_region: 1,
        slot_order_seed: None,
        materialize: true,
    })
    .unwrap();
    cache
        .begin_prefill(REQ, 32, 0, AllocationStyle::FullPrompt)
        .unwrap();
    cache.compute_chunk(REQ, 0, 32).unwrap();
    // Sinks: blocks 0, 1 (5 tokens); evicted 2..5; window 5..8.
    let table = cache.table(REQ, GroupIndex(0)).unwrap().to_vec();
    let resident: Vec<bool> = table.iter().map(Option::is_some).collect();
    assert_eq!(
        resident,
        [true, true, false, false, false, true, true, true]
    );
    let mut out = BlockRun::default();
    cache.block_run(REQ, GroupIndex(0), 0, 8, &mut out).unwrap();
    assert_eq!(out.first_ordinal, 5);
    assert_eq!(
        out.ids,
        table[5..].iter().map(|x| x.unwrap()).collect::<Vec<_>>()
    );
    cache.block_run(REQ, GroupIndex(0), 0, 2, &mut out).unwrap();
    assert_eq!((out.first_ordinal, out.ids.len()), (0, 2));
    cache.block_run(REQ, GroupIndex(0), 0, 4, &mut out).unwrap();
    assert_eq!((out.first_ordinal, out.ids.len()), (4, 0));
    cache.block_run(REQ, GroupIndex(0), 6, 6, &mut out).unwrap();
    assert_eq!((out.first_ordinal, out.ids.len()), (6, 0));
    assert_eq!(
        cache.block_run(REQ, GroupIndex(0), 7, 6, &mut out),
        Err(BlockSourceError::BeginAfterEnd { begin: 7, end: 6 })
    );
    assert_eq!(
        cache.block_run(REQ, GroupIndex(0), 0, 9, &mut out),
        Err(BlockSourceError::PastAllocation {
            end: 9,
            allocated: 8
        })
    );
}

#[test]
fn incremental_allocation_bounds_the_query_by_what_is_allocated() {
    let mut cache = ReferenceCache::new(&CacheSpec {
        tokens_per_block: 4,
        groups: vec![GroupSpec::full(2, &[1, 1])],
        slots_per_group: 16,
        first_region: 1,
        slot_order_seed: Some(5),
        materialize: true,
    })
    .unwrap();
    cache
        .begin_prefill(REQ, 32, 0, AllocationStyle::Incremental)
        .unwrap();
    cache.compute_chunk(REQ, 0, 6).unwrap();
    let mut out = BlockRun::default();
    cache.block_run(REQ, GroupIndex(0), 0, 2, &mut out).unwrap();
    assert_eq!(out.ids.len(), 2);
    assert_eq!(
        cache.block_run(REQ, GroupIndex(0), 0, 3, &mut out),
        Err(BlockSourceError::PastAllocation {
            end: 3,
            allocated: 2
        })
    );
    // Block 1 is allocated but half computed: its tokens 6, 7 still hold filler.
    assert_eq!(cache.verify(REQ), vec![]);
}

#[test]
fn a_block_sent_before_it_is_complete_is_detected() {
    // Send block 1 in the chunk (0, 6), which computed only half of it: the receiver ends up
    // with the sender's filler for tokens 6 and 7.
    let s = fixed(8, 4, vec![(None, 0)], &[]);
    let mut sender = ReferenceCache::new(&spec(&s, false)).unwrap();
    let mut receiver = ReferenceCache::new(&spec(&s, true)).unwrap();
    sender
        .begin_prefill(REQ, 8, 0, AllocationStyle::FullPrompt)
        .unwrap();
    let runs = receiver.register_destination(REQ, 8, 0).unwrap();
    sender.compute_chunk(REQ, 0, 6).unwrap();
    let mut src = BlockRun::default();
    sender
        .block_run(REQ, GroupIndex(0), 0, 2, &mut src)
        .unwrap();
    let mut plan = WritePlan::new();
    let (ls, lr) = (sender.layouts(), receiver.layouts());
    plan_group(&ls[0], &lr[0], &src, &runs[0], &mut plan).unwrap();
    apply_plan(&sender, &mut receiver, &plan).unwrap();
    sender.compute_chunk(REQ, 6, 8).unwrap();
    let bad = receiver.verify(REQ);
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].ordinal, 1);
}

#[test]
fn one_chunk_gives_the_same_extents_as_a_monolithic_transfer() {
    for window in [None, Some(9)] {
        let s = fixed(30, 4, vec![(window, 0), (None, 0)], &[]);
        let mut sender = ReferenceCache::new(&spec(&s, false)).unwrap();
        let mut receiver = ReferenceCache::new(&spec(&s, true)).unwrap();
        sender
            .begin_prefill(REQ, 30, 0, AllocationStyle::FullPrompt)
            .unwrap();
        sender.compute_chunk(REQ, 0, 30).unwrap();
        let runs = receiver.register_destination(REQ, 30, 0).unwrap();
        let (ls, lr) = (sender.layouts(), receiver.layouts());
        let chunk = ChunkSpec {
            start: 0,
            end: 30,
            prompt_len: 30,
            is_last: true,
            ..ChunkSpec::default()
        };
        let (mut chunked, mut monolithic) = (WritePlan::new(), WritePlan::new());
        let mut src = BlockRun::default();
        for g in 0..2 {
            let gi = GroupIndex(g as u16);
            let win = chunk_window(&chunk, &ls[g]).unwrap().unwrap();
            sender
                .block_run(REQ, gi, win.begin, win.end, &mut src)
                .unwrap();
            plan_group(&ls[g], &lr[g], &src, &runs[g], &mut chunked).unwrap();
            // Monolithic: every resident block of the request, as a whole-request transfer
            // would take it.
            let whole = sender.whole_block_list(REQ, gi).unwrap();
            plan_group(&ls[g], &lr[g], &whole, &runs[g], &mut monolithic).unwrap();
        }
        assert_eq!(chunked, monolithic);
        assert!(!chunked.is_empty());
    }
}
