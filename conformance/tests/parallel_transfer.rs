//! Heterogeneous tensor and pipeline parallelism against the reference caches: the model is
//! split over sender ranks one way and over receiver ranks another; every sender rank prefills
//! its part chunk by chunk and plans each chunk against every receiver rank
//! ([`plan_rank_group`]); the receivers' bytes are then checked against the whole model's
//! content — every block each receiver rank holds, every layer and head of it.

use kvpipe_conformance::cache::{
    apply_plan, split_rank, writers_of, AllocationStyle, CacheSpec, GroupSpec, ReferenceCache,
};
use kvpipe_core::{
    chunk_window, plan_rank_group, AnchoredRun, BlockRun, BlockSource, ChunkSpec, DstCursor,
    GroupIndex, RankGroup, RequestId, WritePlan,
};
use proptest::prelude::*;

const REQ: RequestId = RequestId(3);

#[derive(Clone, Debug)]
struct Case {
    tpb: u32,
    prompt: u32,
    cuts: Vec<u32>,
    heads: u16,
    layers: u16,
    window: Option<u32>,
    sender_tp: u16,
    receiver_tp: u16,
    receiver_pp: u16,
    sender_prefix: u32,
    receiver_prefix: u32,
}

fn model(c: &Case) -> Vec<GroupSpec> {
    let mut groups = vec![GroupSpec {
        kv_heads: c.heads,
        ..GroupSpec::full(c.layers, &[1, c.layers - 1])
    }];
    if let Some(w) = c.window {
        groups.push(GroupSpec {
            kv_heads: c.heads,
            ..GroupSpec::full(2, &[2]).windowed(w, 0)
        });
    }
    groups
}

fn cache(
    c: &Case,
    tp: u16,
    tp_rank: u16,
    pp: u16,
    pp_rank: u16,
    region: u32,
) -> (kvpipe_core::wire::Topology, ReferenceCache) {
    let shape = split_rank(&model(c), tp, tp_rank, pp, pp_rank).unwrap();
    let spec = CacheSpec {
        tokens_per_block: c.tpb,
        groups: shape.groups,
        slots_per_group: c.prompt.div_ceil(c.tpb) + 2,
        first_region: region,
        slot_order_seed: Some(u64::from(region)),
        materialize: true,
    };
    (
        shape.topology,
        ReferenceCache::with_shards(&spec, &shape.shards).unwrap(),
    )
}

fn run(c: &Case) -> Result<(), TestCaseError> {
    let mut senders: Vec<_> = (0..c.sender_tp)
        .map(|r| cache(c, c.sender_tp, r, 1, 0, 1 + 10 * u32::from(r)))
        .collect();
    let mut receivers = Vec::new();
    for tr in 0..c.receiver_tp {
        for pr in 0..c.receiver_pp {
            let region = 1000 + 10 * u32::from(tr * c.receiver_pp + pr);
            receivers.push(cache(c, c.receiver_tp, tr, c.receiver_pp, pr, region));
        }
    }
    for (_, s) in &mut senders {
        s.begin_prefill(REQ, c.prompt, c.sender_prefix, AllocationStyle::Incremental)
            .unwrap();
    }
    let runs: Vec<Vec<AnchoredRun>> = receivers
        .iter_mut()
        .map(|(_, r)| {
            r.register_destination(REQ, c.prompt, c.receiver_prefix)
                .unwrap()
        })
        .collect();
    // The expected writers from the overlap of ranks, checked against who plans anything.
    let sender_shapes: Vec<_> = senders.iter().map(|(t, s)| (*t, s.layouts())).collect();
    let expected: Vec<Vec<usize>> = receivers
        .iter()
        .map(|(t, r)| writers_of(&sender_shapes, &(*t, r.layouts())))
        .collect();
    let mut wrote = vec![vec![false; senders.len()]; receivers.len()];
    let mut cursors = vec![vec![vec![DstCursor::default(); 2]; receivers.len()]; senders.len()];
    let mut cuts: Vec<u32> = c
        .cuts
        .iter()
        .copied()
        .filter(|&x| x > c.sender_prefix && x < c.prompt)
        .collect();
    cuts.push(c.prompt);
    cuts.sort_unstable();
    cuts.dedup();
    let mut start = c.sender_prefix;
    let mut src = BlockRun::default();
    for end in cuts {
        let chunk = ChunkSpec {
            start,
            end,
            prompt_len: c.prompt,
            prepopulated_len: c.sender_prefix,
            is_last: end == c.prompt,
            prefix_sent_early: false,
        };
        start = end;
        for (s, (st, sender)) in senders.iter_mut().enumerate() {
            sender.compute_chunk(REQ, chunk.start, chunk.end).unwrap();
            let sl = sender.layouts();
            for (g, layout) in sl.iter().enumerate() {
                let Some(w) = chunk_window(&chunk, layout).unwrap() else {
                    continue;
                };
                sender
                    .block_run(REQ, GroupIndex(g as u16), w.begin, w.end, &mut src)
                    .unwrap();
                for (r, (rt, receiver)) in receivers.iter_mut().enumerate() {
                    let rl = receiver.layouts();
                    let mut plan = WritePlan::new();
                    plan_rank_group(
                        RankGroup {
                            topology: st,
                            layout,
                        },
                        RankGroup {
                            topology: rt,
                            layout: &rl[g],
                        },
                        &src,
                        &runs[r][g],
                        &mut cursors[s][r][g],
                        &mut plan,
                    )
                    .unwrap();
                    wrote[r][s] |= !plan.is_empty();
                    apply_plan(sender, receiver, &plan).unwrap();
                }
            }
        }
    }
    for (r, (_, receiver)) in receivers.iter().enumerate() {
        // Every block the receiver rank holds, every byte, is the whole model's content.
        prop_assert_eq!(receiver.verify(REQ), vec![], "receiver rank {}", r);
        let actual: Vec<usize> = (0..senders.len()).filter(|&s| wrote[r][s]).collect();
        // A writer may have nothing to send when the receiver holds the whole prompt already.
        prop_assert!(
            actual.iter().all(|s| expected[r].contains(s)),
            "receiver rank {}: written by {:?}, expected {:?}",
            r,
            actual,
            expected[r]
        );
        if c.receiver_prefix == 0 {
            prop_assert_eq!(&actual, &expected[r], "receiver rank {}", r);
        }
    }
    Ok(())
}

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..=4,
        1u32..=40,
        0u32..3,
        2u16..=5,
        proptest::option::of(1u32..=24),
        (0u32..4, 0u32..4, 1u16..=3),
        any::<u64>(),
    )
        .prop_flat_map(|(tpb, prompt, heads_log, layers, window, tp, seed)| {
            (
                Just((tpb, prompt, heads_log, layers, window, tp, seed)),
                proptest::collection::vec(1..=prompt, 0..5),
                0..=prompt,
                0..=prompt,
            )
        })
        .prop_map(
            |((tpb, prompt, heads_log, layers, window, tp, _), cuts, sp, rp)| Case {
                tpb,
                prompt,
                cuts,
                heads: 1 << heads_log,
                layers,
                window,
                sender_tp: 1 << tp.0,
                receiver_tp: 1 << tp.1,
                receiver_pp: tp.2,
                sender_prefix: sp,
                receiver_prefix: rp,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Any tensor-parallel sizes on the two sides (either larger, heads duplicated when there
    /// are fewer than ranks), any receiver pipeline split, windows, chunkings and prefixes:
    /// every receiver rank ends up with the whole model's bytes for its part, written by
    /// exactly the sender ranks the overlap rule names.
    #[test]
    fn every_receiver_rank_gets_its_part_of_the_model(c in case()) {
        run(&c)?;
    }
}

#[test]
fn llama_70b_from_eight_ranks_to_two_by_two() {
    // The demo's mapping at a small scale: 8 KV heads, sender TP 8, receiver TP 2 × PP 2.
    let c = Case {
        tpb: 4,
        prompt: 37,
        cuts: vec![8, 16, 24, 32],
        heads: 8,
        layers: 6,
        window: None,
        sender_tp: 8,
        receiver_tp: 2,
        receiver_pp: 2,
        sender_prefix: 0,
        receiver_prefix: 0,
    };
    run(&c).unwrap();
    // And the other direction: TP 2 to TP 8 (one head per receiver rank).
    run(&Case {
        sender_tp: 2,
        receiver_tp: 8,
        receiver_pp: 1,
        ..c.clone()
    })
    .unwrap();
    // Duplicated heads: 2 KV heads over 8 sender ranks to 4 receiver ranks.
    run(&Case {
        heads: 2,
        sender_tp: 8,
        receiver_tp: 4,
        window: Some(12),
        ..c
    })
    .unwrap();
}
