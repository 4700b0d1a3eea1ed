//! Properties of the chunk geometry and of ordinal pairing, over random prompts, block sizes,
//! chunkings, windows and prefixes.

use std::collections::BTreeMap;

use kvpipe_core::{
    chunk_window, early_prefix_window, plan_group, plan_group_with_cursor, plan_rank_group,
    total_blocks, AnchoredRun, BlockId, BlockRun, ChunkSpec, DstCursor, LayerGroupLayout,
    PoolLayout, RankGroup, RegionId, StaleBoundary, WritePlan,
};
use proptest::prelude::*;

fn group(tpb: u32, window: Option<u32>) -> LayerGroupLayout {
    LayerGroupLayout {
        layers: 1,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 1,
        elem_bytes: 1,
        tokens_per_block: tpb,
        window,
        ..LayerGroupLayout::default()
    }
}

/// A prompt, its reused prefix and a chunking of `[prefix, prompt)` into consecutive chunks.
fn chunking() -> impl Strategy<Value = (u32, u32, Vec<u32>)> {
    (1u32..400)
        .prop_flat_map(|prompt| (Just(prompt), 0..=prompt))
        .prop_flat_map(|(prompt, prefix)| {
            let cuts = proptest::collection::vec(prefix..=prompt, 0..12);
            (Just(prompt), Just(prefix), cuts)
        })
        .prop_map(|(prompt, prefix, mut cuts)| {
            cuts.push(prompt);
            cuts.sort_unstable();
            cuts.dedup();
            (prompt, prefix, cuts)
        })
}

/// The chunk specs of a chunking: `[prefix, c0), [c0, c1), …, [.., prompt)`; a prompt wholly
/// cached still has one (empty) final chunk.
fn chunks(prompt: u32, prefix: u32, cuts: &[u32], early: bool) -> Vec<ChunkSpec> {
    let mut out = Vec::new();
    let mut start = prefix;
    for &end in cuts {
        if end == start && end != prompt {
            continue;
        }
        out.push(ChunkSpec {
            start,
            end,
            prompt_len: prompt,
            prepopulated_len: prefix,
            is_last: end == prompt,
            prefix_sent_early: early,
        });
        start = end;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Every ordinal of `[0, total)` (windowed groups: `[stale, total)`) is sent by exactly one
    /// chunk (or by the early prefix send), nothing else is sent, and each block is sent by the
    /// first chunk that has it computed (the final chunk: every block left): a windowed group
    /// streams from its stale boundary instead of waiting for the final chunk.
    #[test]
    fn block_windows_tile_the_prompt_exactly_once(
        (prompt, prefix, cuts) in chunking(),
        tpb in 1u32..40,
        window in proptest::option::of(1u32..500),
        early in any::<bool>(),
    ) {
        let g = group(tpb, window);
        let total = total_blocks(prompt, tpb).unwrap();
        let stale = StaleBoundary::for_group(prompt, &g).unwrap().ordinal();
        let windowed = g.is_windowed_for(prompt);
        prop_assert!(stale <= total);
        prop_assert_eq!(stale > 0, windowed && stale > 0);
        let mut sent = vec![0u32; total as usize];
        if early {
            if let Some(w) = early_prefix_window(prompt, prefix, &g).unwrap() {
                prop_assert!(w.begin >= stale);
                for o in w.begin..w.end { sent[o as usize] += 1; }
            }
        }
        for c in chunks(prompt, prefix, &cuts, early) {
            let w = chunk_window(&c, &g).unwrap();
            // The model: every block at or above the boundary not sent yet whose tokens are
            // all computed by the end of this chunk (at the final chunk: every one left).
            let due: Vec<u32> = (stale..total)
                .filter(|&o| sent[o as usize] == 0 && (c.is_last || (o + 1) * tpb <= c.end))
                .collect();
            match w {
                None => prop_assert!(due.is_empty(), "chunk {:?} skipped {:?}", c, due),
                Some(w) => {
                    prop_assert!(!w.is_empty());
                    prop_assert!(w.begin >= stale, "sent below the stale boundary");
                    prop_assert!(w.end <= total);
                    prop_assert_eq!((w.begin..w.end).collect::<Vec<_>>(), due);
                    for o in w.begin..w.end { sent[o as usize] += 1; }
                }
            }
        }
        for (o, &n) in sent.iter().enumerate() {
            let expected = u32::from(o as u32 >= stale);
            prop_assert_eq!(n, expected, "ordinal {} sent {} times (stale {})", o, n, stale);
        }
    }

    /// Pairing is by ordinal: every extent copies the source block of ordinal `o` into the
    /// receiver's block of ordinal `o`, exactly the ordinals both sides hold, once each.
    #[test]
    fn pairs_map_equal_ordinals(
        src_first in 0u32..50,
        src_ids in proptest::collection::vec(0u32..1000, 0..60),
        dst_first in 0u32..60,
        dst_ids in proptest::collection::vec(0u32..1000, 0..60),
        split in 1u16..4,
        same_split in any::<bool>(),
    ) {
        // Layers 4; sender split at `split`, receiver in one pool; 2 bytes per layer.
        let mk = |split: &[u16], region: u32| {
            let mut pools = smallvec::SmallVec::new();
            let mut begin = 0;
            for (i, &layers) in split.iter().enumerate() {
                pools.push(PoolLayout {
                    region: RegionId(region + i as u32),
                    layer_begin: begin,
                    layers,
                    slot_bytes: u64::from(layers) * 2,
                });
                begin += layers;
            }
            LayerGroupLayout { layers: 4, pools, ..group(1, None) }
        };
        let s = mk(&[split, 4 - split], 10);
        let d = if same_split { mk(&[split, 4 - split], 20) } else { mk(&[4], 20) };
        // Distinct ids on each side, so a slot names one ordinal.
        let uniq = |v: &[u32]| {
            let mut seen = std::collections::BTreeSet::new();
            v.iter().copied().filter(|x| seen.insert(*x)).map(BlockId).collect::<Vec<_>>()
        };
        let src = BlockRun { first_ordinal: src_first, ids: uniq(&src_ids) };
        let dst_list = uniq(&dst_ids);
        let dst = AnchoredRun::from_ids(dst_first, &dst_list);
        let src_ord: BTreeMap<u32, u32> = src.ids.iter().enumerate()
            .map(|(i, id)| (id.0, src_first + i as u32)).collect();
        let dst_ord: BTreeMap<u32, u32> = dst_list.iter().enumerate()
            .map(|(i, id)| (id.0, dst_first + i as u32)).collect();

        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &src, &dst, &mut plan).unwrap();
        // Bytes per (ordinal, layer) written, from the extents.
        let mut written: BTreeMap<(u32, u64), u32> = BTreeMap::new();
        for e in plan.extents() {
            let src_pool = s.pools.iter().find(|p| p.region == e.src_region).unwrap();
            for k in (0..e.len).step_by(2) {
                let so = e.src_offset + k;
                let doff = e.dst_offset + k;
                let (sslot, soff) = (so / src_pool.slot_bytes, so % src_pool.slot_bytes);
                let dst_pool = d.pools.iter().find(|p| p.region == e.dst_region).unwrap();
                let (dslot, dlayer) = (
                    doff / dst_pool.slot_bytes,
                    u64::from(dst_pool.layer_begin) + (doff % dst_pool.slot_bytes) / 2,
                );
                let slayer = u64::from(src_pool.layer_begin) + soff / 2;
                prop_assert_eq!(slayer, dlayer, "layer moved");
                let so_ord = src_ord[&(sslot as u32)];
                let do_ord = dst_ord[&(dslot as u32)];
                prop_assert_eq!(so_ord, do_ord, "ordinal moved");
                *written.entry((so_ord, slayer)).or_default() += 1;
            }
        }
        let both: Vec<u32> = src_ord.values().copied().filter(|o| dst_ord.values().any(|d| d == o)).collect();
        prop_assert_eq!(stats.paired_blocks as usize, both.len());
        prop_assert_eq!(stats.unpaired_src_blocks as usize, src.ids.len() - both.len());
        prop_assert_eq!(written.len(), both.len() * 4);
        prop_assert!(written.values().all(|&n| n == 1));
        prop_assert_eq!(stats.bytes, both.len() as u64 * 8);
        prop_assert_eq!(plan.total_bytes(), stats.bytes);
    }

    /// Planning a request's chunks one after another with a cursor gives the same plans as
    /// planning each from scratch, on fragmented receiver runs.
    #[test]
    fn cursor_planning_matches_fresh_planning(
        dst_ids in proptest::collection::vec(0u32..64, 1..80),
        dst_first in 0u32..8,
        cuts in proptest::collection::vec(0u32..90, 0..8),
    ) {
        let g = LayerGroupLayout {
            pools: smallvec::smallvec![PoolLayout { region: RegionId(1), layer_begin: 0, layers: 1, slot_bytes: 2 }],
            ..group(1, None)
        };
        let dst = AnchoredRun::from_ids(dst_first, &dst_ids.iter().copied().map(BlockId).collect::<Vec<_>>());
        let end = 90u32;
        let mut cuts = cuts;
        cuts.push(end);
        cuts.sort_unstable();
        let mut cursor = DstCursor::default();
        let mut start = 0;
        for c in cuts {
            let src = BlockRun { first_ordinal: start, ids: (start..c).map(|o| BlockId(1000 + o)).collect() };
            let (mut a, mut b) = (WritePlan::new(), WritePlan::new());
            let sa = plan_group(&g, &g, &src, &dst, &mut a).unwrap();
            let sb = plan_group_with_cursor(&g, &g, &src, &dst, &mut cursor, &mut b).unwrap();
            prop_assert_eq!(a, b);
            prop_assert_eq!(sa, sb);
            start = c;
        }
    }
}

/// One rank of a tensor/pipeline split of a group of `layers` layers and `heads` KV heads
/// (tokens per block `tpb`, head dim 1, 1-byte elements), with its pools split as `split`
/// (layer counts summing to the rank's layers).
fn shard_rank(
    layers: (u16, u16, u16),
    heads: u16,
    tp: (u16, u16),
    tpb: u32,
    split: &[u16],
    first_region: u32,
) -> (kvpipe_core::wire::Topology, LayerGroupLayout) {
    let (model_layers, first_layer, n) = layers;
    let (shard, kv_heads) =
        kvpipe_core::GroupShard::for_rank(model_layers, first_layer, heads, tp.0, tp.1).unwrap();
    let layer_bytes = 2 * u64::from(kv_heads) * u64::from(tpb);
    let mut pools = smallvec::SmallVec::new();
    let mut begin = 0;
    for (i, &l) in split.iter().enumerate() {
        pools.push(PoolLayout {
            region: RegionId(first_region + i as u32),
            layer_begin: begin,
            layers: l,
            // A little padding, so slots never line up by accident.
            slot_bytes: u64::from(l) * layer_bytes + 3,
        });
        begin += l;
    }
    let layout = LayerGroupLayout {
        layers: n,
        kv_factor: 2,
        kv_heads,
        head_dim: 1,
        elem_bytes: 1,
        tokens_per_block: tpb,
        window: None,
        pools,
        shard,
        ..LayerGroupLayout::default()
    };
    let topology = kvpipe_core::wire::Topology {
        tp_size: tp.0,
        tp_rank: tp.1,
        ..Default::default()
    };
    (topology, layout)
}

/// What byte `offset` of a slot of `pool` of `layout` holds, in model coordinates:
/// (layer, K/V plane, head, byte inside the head's plane); `None` in the padding.
fn model_coords(
    layout: &LayerGroupLayout,
    pool: &PoolLayout,
    in_slot: u64,
) -> Option<(u32, u64, u32, u64)> {
    let head = u64::from(layout.tokens_per_block);
    let plane = u64::from(layout.kv_heads) * head;
    let layer_bytes = 2 * plane;
    if in_slot >= u64::from(pool.layers) * layer_bytes {
        return None;
    }
    let layer =
        layout.shard.first_layer as u64 + u64::from(pool.layer_begin) + in_slot / layer_bytes;
    let kv = (in_slot % layer_bytes) / plane;
    let h = u64::from(layout.shard.first_head) + (in_slot % plane) / head;
    Some((layer as u32, kv, h as u32, in_slot % head))
}

/// Pool of `layout` holding `region`.
fn pool_of(layout: &LayerGroupLayout, region: RegionId) -> PoolLayout {
    *layout.pools.iter().find(|p| p.region == region).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Heterogeneous tensor and pipeline parallelism: planning every sender rank's chunk
    /// against one receiver rank writes each byte the receiver holds exactly once, from the
    /// sender byte of the same block ordinal, model layer, K/V plane, head and offset — in both
    /// directions of tensor-parallel mismatch, with duplicated heads and any layer split.
    #[test]
    fn every_receiver_byte_is_written_once_from_the_same_model_coordinates(
        heads_log in 0u32..4,
        s_tp_log in 0u32..4,
        r_tp_log in 0u32..4,
        r_pp in 1u16..4,
        layers in 3u16..7,
        tpb in 1u32..4,
        r_rank_seed in any::<u16>(),
        split_seed in any::<bool>(),
        blocks in 1u32..5,
    ) {
        let (heads, s_tp, r_tp) = (1u16 << heads_log, 1u16 << s_tp_log, 1u16 << r_tp_log);
        // The receiver: tensor rank `rr` of `r_tp`, pipeline rank `rp` of `r_pp` (the last
        // rank takes the remainder of the layers).
        let (rr, rp) = (r_rank_seed % r_tp, (r_rank_seed / 16) % r_pp);
        let per = layers / r_pp;
        let first = rp * per;
        let n = if rp + 1 == r_pp { layers - first } else { per };
        let rsplit: Vec<u16> = if split_seed && n > 1 { vec![1, n - 1] } else { vec![n] };
        let (rt, rl) = shard_rank((layers, first, n), heads, (r_tp, rr), tpb, &rsplit, 100);
        prop_assert_eq!(kvpipe_core::check_shard(&rt, &rl), Ok(()));
        let dst_ids: Vec<BlockId> = (0..blocks).map(|b| BlockId(b * 2 + 1)).collect();
        let dst = AnchoredRun::from_ids(0, &dst_ids);
        let mut written: BTreeMap<(u32, u64), u32> = BTreeMap::new();
        let mut writers = 0;
        for sr in 0..s_tp {
            let ssplit: Vec<u16> = if split_seed { vec![layers] } else { vec![2, layers - 2] };
            let (st, sl) = shard_rank((layers, 0, layers), heads, (s_tp, sr), tpb, &ssplit, 10);
            let src = BlockRun { first_ordinal: 0, ids: (0..blocks).map(|b| BlockId(7 + b)).collect() };
            let mut plan = WritePlan::new();
            plan_rank_group(
                RankGroup { topology: &st, layout: &sl },
                RankGroup { topology: &rt, layout: &rl },
                &src, &dst, &mut DstCursor::default(), &mut plan,
            ).unwrap();
            prop_assert_eq!(!plan.is_empty(), kvpipe_core::writes_group(&st, &sl, &rt, &rl));
            writers += usize::from(!plan.is_empty());
            for e in plan.extents() {
                let (sp, dp) = (pool_of(&sl, e.src_region), pool_of(&rl, e.dst_region));
                for k in 0..e.len {
                    let (so, doff) = (e.src_offset + k, e.dst_offset + k);
                    let s_coord = model_coords(&sl, &sp, so % sp.slot_bytes);
                    let d_coord = model_coords(&rl, &dp, doff % dp.slot_bytes);
                    prop_assert!(s_coord.is_some() && d_coord.is_some(), "padding copied");
                    prop_assert_eq!(s_coord, d_coord, "byte moved in the model");
                    let s_ord = (so / sp.slot_bytes) as u32 - 7;
                    let d_ord = dst_ids.iter().position(|id| u64::from(id.0) == doff / dp.slot_bytes).unwrap() as u32;
                    prop_assert_eq!(s_ord, d_ord, "ordinal moved");
                    *written.entry((e.dst_region.0, doff)).or_default() += 1;
                }
            }
        }
        // Every byte the receiver holds (not padding), exactly once.
        let mut expected = 0u64;
        for p in &rl.pools {
            expected += u64::from(blocks) * u64::from(p.layers) * 2 * u64::from(rl.kv_heads) * u64::from(tpb);
        }
        prop_assert_eq!(written.len() as u64, expected);
        prop_assert!(written.values().all(|&n| n == 1));
        prop_assert!(writers >= 1);
    }
}
