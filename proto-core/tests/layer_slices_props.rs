//! Layer slices write exactly what whole chunks write: over random geometries (full attention,
//! windows with an evicted head, sink blocks, prefix reuse on either side, pools split at any
//! layer, tensor- and pipeline-parallel splits), random chunkings and random slicings of each
//! chunk into layer ranges, every destination byte is written exactly once, from the same source
//! byte as the whole-chunk submission writes it, and the request completes only after the last
//! chunk's last range.

mod session_support;

use std::collections::BTreeMap;

use kvpipe_core::session::{Event, LocalHello, Output, Registration};
use kvpipe_core::wire::Topology;
use kvpipe_core::{
    plan_rank_group, plan_rank_group_layers, AnchoredRun, BlockId, BlockRun, BlockSource,
    BlockSourceError, ChunkSpec, DstCursor, GroupIndex, GroupShard, InstanceId, LayerGroupLayout,
    LayerOrder, LayerRange, PoolLayout, RankGroup, Receiver, ReceiverConfig, RegionId, RequestId,
    Sender, SenderConfig, WriteExtent, WritePlan,
};
use proptest::prelude::*;
use session_support::{deadlines, rx_peer, tx_peer, Net, Side};

const R: RequestId = RequestId(11);

/// Splits `0..n` into contiguous non-empty ranges at the given cut points.
fn slicing(n: u32, cuts: &[u32]) -> Vec<LayerRange> {
    let mut points: Vec<u32> = cuts
        .iter()
        .map(|c| c % n.max(1))
        .filter(|&c| c > 0)
        .collect();
    points.push(n);
    points.sort_unstable();
    points.dedup();
    let mut begin = 0;
    points
        .into_iter()
        .map(|end| {
            let r = LayerRange::new(begin, end);
            begin = end;
            r
        })
        .collect()
}

/// Each destination byte → the source byte written to it; panics when a byte is written twice.
/// Kept as merged runs: (dst region, dst offset) → (len, src region, src offset).
fn byte_map(
    extents: impl IntoIterator<Item = WriteExtent>,
) -> BTreeMap<(u32, u64), (u64, u32, u64)> {
    let mut sorted: Vec<WriteExtent> = extents.into_iter().collect();
    sorted.sort_by_key(|e| (e.dst_region.0, e.dst_offset));
    let mut map: BTreeMap<(u32, u64), (u64, u32, u64)> = BTreeMap::new();
    let mut last: Option<(u32, u64)> = None;
    for e in sorted {
        if let Some(key) = last {
            let (len, src_region, src_offset) = map[&key];
            if key.0 == e.dst_region.0 {
                assert!(
                    key.1 + len <= e.dst_offset,
                    "byte {} written twice",
                    e.dst_offset
                );
                if key.1 + len == e.dst_offset
                    && src_region == e.src_region.0
                    && src_offset + len == e.src_offset
                {
                    map.get_mut(&key).unwrap().0 += e.len;
                    continue;
                }
            }
        }
        map.insert(
            (e.dst_region.0, e.dst_offset),
            (e.len, e.src_region.0, e.src_offset),
        );
        last = Some((e.dst_region.0, e.dst_offset));
    }
    map
}

// ----- planning: tensor and pipeline splits -----

/// One rank of a tensor/pipeline split of a group (head dim 1, 1-byte elements), pools split
/// as `split`, slots padded.
fn shard_rank(
    layers: (u16, u16, u16),
    heads: u16,
    tp: (u16, u16),
    tpb: u32,
    split: &[u16],
    first_region: u32,
) -> (Topology, LayerGroupLayout) {
    let (model_layers, first_layer, n) = layers;
    let (shard, kv_heads) =
        GroupShard::for_rank(model_layers, first_layer, heads, tp.0, tp.1).unwrap();
    let layer_bytes = 2 * u64::from(kv_heads) * u64::from(tpb);
    let mut pools = smallvec::SmallVec::new();
    let mut begin = 0;
    for (i, &l) in split.iter().enumerate() {
        pools.push(PoolLayout {
            region: RegionId(first_region + i as u32),
            layer_begin: begin,
            layers: l,
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
        pools,
        shard,
        ..LayerGroupLayout::default()
    };
    let topology = Topology {
        tp_size: tp.0,
        tp_rank: tp.1,
        ..Default::default()
    };
    (topology, layout)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Between ranks split differently, the layer ranges of a chunk together plan exactly the
    /// whole chunk's writes (the same destination bytes from the same source bytes, none
    /// twice), and a range's layers of one block in one pool pair are one extent when the heads
    /// match.
    #[test]
    fn layer_ranges_plan_the_whole_chunk_between_any_split(
        heads_log in 0u32..3,
        s_tp_log in 0u32..3,
        r_tp_log in 0u32..3,
        r_pp in 1u16..4,
        layers in 3u16..8,
        tpb in 1u32..4,
        r_rank_seed in any::<u16>(),
        split_seed in 0u16..8,
        blocks in 1u32..6,
        dst_first in 0u32..3,
        contiguous in any::<bool>(),
        cuts in proptest::collection::vec(any::<u32>(), 0..6),
    ) {
        let (heads, s_tp, r_tp) = (1u16 << heads_log, 1u16 << s_tp_log, 1u16 << r_tp_log);
        let (rr, rp) = (r_rank_seed % r_tp, (r_rank_seed / 16) % r_pp);
        let per = layers / r_pp;
        let first = rp * per;
        let n = if rp + 1 == r_pp { layers - first } else { per };
        let rsplit: Vec<u16> = if split_seed % 2 == 1 && n > 1 { vec![1, n - 1] } else { vec![n] };
        let (rt, rl) = shard_rank((layers, first, n), heads, (r_tp, rr), tpb, &rsplit, 100);
        // The receiver caches `dst_first` blocks (prefix reuse): its run starts there.
        let dst_ids: Vec<BlockId> = (dst_first..blocks.max(dst_first))
            .map(|b| BlockId(if contiguous { 40 + b } else { b * 2 + 1 }))
            .collect();
        let dst = AnchoredRun::from_ids(dst_first, &dst_ids);
        for sr in 0..s_tp {
            let cut = 1 + split_seed % (layers - 1);
            let ssplit: Vec<u16> = if split_seed < 4 { vec![layers] } else { vec![cut, layers - cut] };
            let (st, sl) = shard_rank((layers, 0, layers), heads, (s_tp, sr), tpb, &ssplit, 10);
            let ids: Vec<BlockId> = (0..blocks).map(|b| BlockId(7 + b)).collect();
            let src = BlockRun { first_ordinal: 0, ids };
            let (s, d) = (RankGroup { topology: &st, layout: &sl }, RankGroup { topology: &rt, layout: &rl });
            let mut whole = WritePlan::new();
            plan_rank_group(s, d, &src, &dst, &mut DstCursor::default(), &mut whole).unwrap();
            let mut sliced = Vec::new();
            let mut cursor = DstCursor::default();
            for range in slicing(u32::from(layers), &cuts) {
                let mut plan = WritePlan::new();
                let keep = range.begin as u16..range.end as u16;
                let stats = plan_rank_group_layers(s, d, &src, &dst, keep, &mut cursor, &mut plan).unwrap();
                if heads == 1 || s_tp == r_tp {
                    // Same heads on both sides: at most one extent per block and pool pair.
                    let pairs = (sl.pools.len() + rl.pools.len()) as u32;
                    prop_assert!(plan.len() as u32 <= stats.paired_blocks * pairs);
                }
                sliced.extend_from_slice(plan.extents());
            }
            prop_assert_eq!(byte_map(sliced), byte_map(whole.extents().iter().copied()));
        }
    }
}

// ----- sessions: windows, sinks, prefixes, several groups -----

/// A group of `layers` layers (1 head, head dim 2, 1-byte elements) in pools split at `cut`.
fn group(layers: u16, tpb: u32, window: Option<u32>, cut: u16, region: u32) -> LayerGroupLayout {
    let layer_bytes = 2 * 2 * u64::from(tpb);
    let split: Vec<u16> = if cut > 0 && cut < layers {
        vec![cut, layers - cut]
    } else {
        vec![layers]
    };
    let mut pools = smallvec::SmallVec::new();
    let mut begin = 0;
    for (i, &l) in split.iter().enumerate() {
        pools.push(PoolLayout {
            region: RegionId(region + i as u32),
            layer_begin: begin,
            layers: l,
            slot_bytes: u64::from(l) * layer_bytes,
        });
        begin += l;
    }
    LayerGroupLayout {
        layers,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 2,
        elem_bytes: 1,
        tokens_per_block: tpb,
        window,
        pools,
        ..LayerGroupLayout::default()
    }
}

/// The sender's cache: every block resident except, in a windowed group, the evicted ones
/// between the sink blocks and the window (`[sink, evict)`), which no chunk asks for.
struct Cache {
    groups: Vec<(u32, u32)>,
    blocks: u32,
}

impl BlockSource for Cache {
    fn block_run(
        &mut self,
        _request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end > self.blocks {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: self.blocks,
            });
        }
        let (sink, evict) = self.groups[usize::from(group.0)];
        let resident = |o: u32| o < sink || o >= evict;
        // The contiguous resident run ending at `end` (everything up to the last gap dropped).
        let mut first = end;
        while first > begin && resident(first - 1) {
            first -= 1;
        }
        out.first_ordinal = first;
        out.ids = (first..end)
            .map(|o| BlockId(1000 * (u32::from(group.0) + 1) + o))
            .collect();
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct Case {
    groups: Vec<(u16, Option<u32>, u16)>,
    order_seed: Vec<bool>,
    tpb: u32,
    prompt: u32,
    sender_prefix: u32,
    receiver_prefix: u32,
    cuts: Vec<u32>,
    layer_cuts: Vec<Vec<u32>>,
    sink: u32,
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec((1u16..5, proptest::option::of(1u32..40), 0u16..4), 1..3),
        proptest::collection::vec(any::<bool>(), 0..10),
        1u32..5,
        1u32..80,
        any::<u32>(),
        any::<u32>(),
        proptest::collection::vec(any::<u32>(), 0..6),
        proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..4), 8),
        0u32..3,
    )
        .prop_map(
            |(groups, order_seed, tpb, prompt, sp, rp, cuts, layer_cuts, sink)| Case {
                groups,
                order_seed,
                tpb,
                prompt,
                sender_prefix: sp % (prompt + 1),
                receiver_prefix: rp % (prompt + 1),
                cuts,
                layer_cuts,
                sink,
            },
        )
}

impl Case {
    fn layouts(&self, region: u32) -> Vec<LayerGroupLayout> {
        self.groups
            .iter()
            .enumerate()
            .map(|(g, &(layers, window, cut))| {
                group(layers, self.tpb, window, cut, region + 10 * g as u32)
            })
            .collect()
    }

    /// An interleaving of the groups' layers picked by `order_seed`.
    fn order(&self) -> LayerOrder {
        let mut left: Vec<u16> = self.groups.iter().map(|g| g.0).collect();
        let mut groups = Vec::new();
        let mut seeds = self.order_seed.iter().cycle();
        while left.iter().any(|&n| n > 0) {
            let pick = if *seeds.next().unwrap_or(&false) {
                left.len() - 1
            } else {
                0
            };
            let g = if left[pick] > 0 {
                pick
            } else {
                left.iter().position(|&n| n > 0).unwrap()
            };
            left[g] -= 1;
            groups.push(GroupIndex(g as u16));
        }
        LayerOrder { groups }
    }

    fn chunks(&self) -> Vec<ChunkSpec> {
        let mut cuts: Vec<u32> = self
            .cuts
            .iter()
            .map(|c| self.sender_prefix + c % (self.prompt - self.sender_prefix + 1))
            .collect();
        cuts.push(self.prompt);
        cuts.sort_unstable();
        cuts.dedup();
        let mut start = self.sender_prefix;
        let mut out = Vec::new();
        for end in cuts {
            if end <= start && end != self.prompt {
                continue;
            }
            out.push(ChunkSpec {
                start,
                end,
                prompt_len: self.prompt,
                prepopulated_len: self.sender_prefix,
                is_last: end == self.prompt,
                prefix_sent_early: false,
            });
            start = end;
        }
        out
    }

    fn cache(&self) -> Cache {
        let blocks = self.prompt.div_ceil(self.tpb);
        let groups = self
            .groups
            .iter()
            .map(|&(_, window, _)| match window {
                Some(w) if w < self.prompt => {
                    // Evict what lies below the stale boundary (never asked for), keep sinks.
                    let stale = kvpipe_core::stale_boundary(self.prompt, w, self.tpb).unwrap();
                    (self.sink.min(stale), stale)
                }
                _ => (0, 0),
            })
            .collect();
        Cache { groups, blocks }
    }

    fn registration(&self) -> Registration {
        let blocks = self.prompt.div_ceil(self.tpb);
        let first = (self.receiver_prefix / self.tpb).min(blocks);
        Registration {
            request: R,
            prompt_len: self.prompt,
            groups: self
                .groups
                .iter()
                .enumerate()
                .map(|(g, &(_, window, _))| {
                    // A windowed group registers from its stale boundary on.
                    let stale = match window {
                        Some(w) if w < self.prompt => {
                            kvpipe_core::stale_boundary(self.prompt, w, self.tpb).unwrap()
                        }
                        _ => 0,
                    };
                    let first = first.max(stale);
                    let ids: Vec<BlockId> =
                        (first..blocks).map(|o| BlockId(3 * o + g as u32)).collect();
                    AnchoredRun::from_ids(first, &ids)
                })
                .collect(),
            writers: [tx_peer(0)].into_iter().collect(),
            aux_capacity: 1024,
            expected_part: None,
        }
    }

    fn net(&self) -> Net {
        let mut net = Net::new(1, 1);
        let mut sc = SenderConfig::new(LocalHello::new(
            InstanceId(10),
            Topology::default(),
            self.layouts(1),
        ));
        sc.deadlines = deadlines();
        sc.layer_order = self.order();
        net.senders[0] = Sender::new(sc).unwrap();
        let mut rc = ReceiverConfig::new(
            LocalHello::new(InstanceId(20), Topology::default(), self.layouts(100)),
            0x5eed,
        );
        rc.deadlines = deadlines();
        net.receivers[0] = Receiver::new(rc).unwrap();
        net.connect(0, 0);
        net.pump();
        net.register(0, self.registration());
        net.open(0, kvpipe_core::session::SendRequest::new(R, [rx_peer(0)]));
        net.aux(0, R);
        net
    }
}

fn completed(net: &Net) -> bool {
    net.events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if *request == R))
}

fn writes(net: &Net) -> Vec<WriteExtent> {
    net.log
        .iter()
        .filter_map(|(_, o)| match o {
            Output::ExecuteWrites { plan, .. } => Some(plan.extents().to_vec()),
            _ => None,
        })
        .flatten()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Through a sender and a receiver: each chunk submitted in random layer ranges writes the
    /// bytes the whole chunks write, each once; only a chunk's first range asks the cache; the
    /// receiver completes after the last chunk's last range and not before.
    #[test]
    fn layered_sessions_write_what_whole_chunks_write(c in case()) {
        let mut whole = c.net();
        let mut cache = c.cache();
        for spec in c.chunks() {
            let now = whole.now;
            whole.senders[0].submit_chunk(now, R, spec, &mut cache).unwrap();
            whole.pump();
        }
        prop_assert!(completed(&whole));

        let mut net = c.net();
        let count = net.senders[0].layer_count();
        let chunks = c.chunks();
        let mut asked = 0;
        for (k, spec) in chunks.iter().enumerate() {
            let ranges = slicing(count, &c.layer_cuts[k % c.layer_cuts.len()]);
            for (i, range) in ranges.iter().enumerate() {
                prop_assert!(!completed(&net), "completed before the last range");
                let query = net.senders[0].chunk_layers_query(R, spec, *range).unwrap();
                prop_assert_eq!(query.is_empty(), i > 0 || query.windows().is_empty());
                asked += query.windows().len();
                let runs = query.ask(&mut cache).unwrap();
                let now = net.now;
                net.senders[0].submit_chunk_layers_runs(now, R, *spec, *range, runs).unwrap();
                net.pump();
            }
        }
        prop_assert!(completed(&net));
        prop_assert!(asked <= chunks.len() * c.groups.len());
        prop_assert_eq!(byte_map(writes(&net)), byte_map(writes(&whole)));
        let bytes = |n: &Net| n.receivers[0].counters().bytes_landed;
        prop_assert_eq!(bytes(&net), bytes(&whole));
    }
}

/// The slot layout makes a layer range of one block one extent: 4 layers in one pool on both
/// sides, blocks in consecutive slots. The whole chunk coalesces into one write; layers 1..3
/// are one write per block, at the range's first layer, two layers long.
#[test]
fn a_layer_range_of_one_block_is_one_extent() {
    let layout = |region| group(4, 2, None, 0, region);
    let (src_layout, dst_layout) = (layout(1), layout(2));
    let layer_bytes = 2 * 2 * 2;
    let slot = 4 * layer_bytes;
    let topology = Topology::default();
    let src = RankGroup {
        topology: &topology,
        layout: &src_layout,
    };
    let dst = RankGroup {
        topology: &topology,
        layout: &dst_layout,
    };
    let run = BlockRun {
        first_ordinal: 0,
        ids: (10..13).map(BlockId).collect(),
    };
    let reg = AnchoredRun::from_ids(0, &(20..23).map(BlockId).collect::<Vec<_>>());
    let mut whole = WritePlan::new();
    plan_rank_group(src, dst, &run, &reg, &mut DstCursor::default(), &mut whole).unwrap();
    assert_eq!(whole.len(), 1);
    assert_eq!(whole.total_bytes(), 3 * slot);
    let mut plan = WritePlan::new();
    let mut cursor = DstCursor::default();
    plan_rank_group_layers(src, dst, &run, &reg, 1..3, &mut cursor, &mut plan).unwrap();
    let expected: Vec<WriteExtent> = (0..3)
        .map(|b| WriteExtent {
            src_region: RegionId(1),
            src_offset: (10 + b) * slot + layer_bytes,
            dst_region: RegionId(2),
            dst_offset: (20 + b) * slot + layer_bytes,
            len: 2 * layer_bytes,
        })
        .collect();
    assert_eq!(plan.extents(), &expected[..]);
    // Every layer in one range is the whole chunk's single write.
    let mut all = WritePlan::new();
    plan_rank_group_layers(src, dst, &run, &reg, 0..4, &mut cursor, &mut all).unwrap();
    assert_eq!(all, whole);
    // An empty range plans nothing.
    let mut none = WritePlan::new();
    plan_rank_group_layers(src, dst, &run, &reg, 2..2, &mut cursor, &mut none).unwrap();
    assert!(none.is_empty());
}
