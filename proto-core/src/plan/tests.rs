//! Tests of the planner's entry points: ranks holding the same part of the model, then ranks
//! split differently (head slices, layer ranges, replicas).

use crate::blocks::{AnchoredRun, BlockRun};
use crate::ids::RegionId;
use crate::layout::{LayerGroupLayout, PoolLayout};
use crate::plan::*;
use crate::wire::Topology;

mod plan_group_tests {
    use smallvec::smallvec;

    use super::*;
    use crate::ids::BlockId;

    /// A group of 4 layers, 8 bytes per layer per block, split into pools of the given sizes.
    fn layout(split: &[u16], first_region: u32) -> LayerGroupLayout {
        let mut pools = smallvec![];
        let mut begin = 0;
        for (i, &layers) in split.iter().enumerate() {
            pools.push(PoolLayout {
                region: RegionId(first_region + i as u32),
                layer_begin: begin,
                layers,
                slot_bytes: u64::from(layers) * 8,
            });
            begin += layers;
        }
        LayerGroupLayout {
            layers: 4,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 2,
            elem_bytes: 1,
            tokens_per_block: 2,
            window: None,
            pools,
            ..LayerGroupLayout::default()
        }
    }

    fn run(first: u32, ids: &[u32]) -> BlockRun {
        BlockRun {
            first_ordinal: first,
            ids: ids.iter().copied().map(BlockId).collect(),
        }
    }

    fn ext(src_region: u32, src: u64, dst_region: u32, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(src_region),
            src_offset: src,
            dst_region: RegionId(dst_region),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn contiguous_blocks_coalesce_into_one_extent_per_pool() {
        let (s, d) = (layout(&[2, 2], 10), layout(&[2, 2], 20));
        let dst = AnchoredRun::from_ids(0, &[100, 101, 102, 103].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(1, &[5, 6, 7]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                ext(10, 5 * 16, 20, 101 * 16, 48),
                ext(11, 5 * 16, 21, 101 * 16, 48)
            ]
        );
        assert_eq!(
            stats,
            PairStats {
                paired_blocks: 3,
                unpaired_src_blocks: 0,
                first_ordinal: 1,
                extents_added: 2,
                bytes: 96,
            }
        );
    }

    #[test]
    fn receiver_prefix_is_not_sent_and_ordinals_pair_exactly() {
        let (s, d) = (layout(&[4], 1), layout(&[4], 2));
        // The receiver holds ordinals 0..2 already: its run starts at 2, in two id runs.
        let dst = AnchoredRun::from_ids(2, &[40, 41, 9].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[0, 1, 2, 3, 4]), &dst, &mut plan).unwrap();
        assert_eq!(stats.paired_blocks, 3);
        assert_eq!(stats.unpaired_src_blocks, 2);
        assert_eq!(stats.first_ordinal, 2);
        assert_eq!(
            plan.extents(),
            &[
                ext(1, 2 * 32, 2, 40 * 32, 64),
                ext(1, 4 * 32, 2, 9 * 32, 32)
            ]
        );
        // A chunk entirely inside the receiver's prefix plans nothing.
        plan.clear();
        let stats = plan_group(&s, &d, &run(0, &[0, 1]), &dst, &mut plan).unwrap();
        assert_eq!(stats.paired_blocks, 0);
        assert!(plan.is_empty());
    }

    #[test]
    fn different_pool_splits_follow_the_finer_split() {
        let (s, d) = (layout(&[1, 3], 10), layout(&[3, 1], 20));
        let dst = AnchoredRun::from_ids(0, &[7].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[2]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                // layer 0: src pool 0, dst pool 0
                ext(10, 2 * 8, 20, 7 * 24, 8),
                // layers 1..3: src pool 1 (from its start), dst pool 0 (from layer 1)
                ext(11, 2 * 24, 20, 7 * 24 + 8, 16),
                // layer 3: src pool 1 (layer 2 of it), dst pool 1
                ext(11, 2 * 24 + 16, 21, 7 * 8, 8),
            ]
        );
        assert_eq!(plan.total_bytes(), 32);
    }

    #[test]
    fn cursor_resumes_and_gives_the_same_plan() {
        let (s, d) = (layout(&[4], 1), layout(&[4], 2));
        let ids: Vec<BlockId> = (0..64).map(|i| BlockId(i * 3)).collect(); // 64 id runs
        let dst = AnchoredRun::from_ids(0, &ids);
        let src: Vec<u32> = (0..64).collect();
        let mut cursor = DstCursor::default();
        for (a, b) in [(0, 10), (10, 11), (11, 40), (40, 64), (5, 9)] {
            let chunk = run(a, &src[a as usize..b as usize]);
            let (mut p1, mut p2) = (WritePlan::new(), WritePlan::new());
            plan_group(&s, &d, &chunk, &dst, &mut p1).unwrap();
            plan_group_with_cursor(&s, &d, &chunk, &dst, &mut cursor, &mut p2).unwrap();
            assert_eq!(p1, p2);
            assert_eq!(p1.len() as u32, b - a);
        }
    }

    #[test]
    fn unpairable_layouts_are_named() {
        let s = layout(&[2, 2], 1);
        let mut d = layout(&[2, 2], 3);
        d.kv_heads = 2;
        let err = check_pairable(&s, &d).unwrap_err();
        assert_eq!(
            err,
            PlanError::LayoutMismatch {
                field: "model_kv_heads",
                sender: 1,
                receiver: 2
            }
        );
        assert!(err
            .to_string()
            .contains("model_kv_heads is 1 on the sender and 2"));
        let mut d = layout(&[2, 2], 3);
        d.window = Some(8);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::WindowMismatch { .. })
        ));
        // A receiver may keep a larger window than the sender.
        let mut s = layout(&[2, 2], 1);
        s.window = Some(8);
        for w in [Some(8), Some(9), None] {
            d.window = w;
            assert!(check_pairable(&s, &d).is_ok(), "{w:?}");
        }
        d.window = Some(7);
        assert!(check_pairable(&s, &d).is_err());
        let s = layout(&[2, 2], 1);
        let mut d = layout(&[2, 2], 3);
        d.shard.model_layers = 4;
        d.shard.first_layer = 1;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::ShardPastModel {
                side: Side::Receiver,
                ..
            })
        ));
        let mut d = layout(&[2, 2], 3);
        d.pools[1].layer_begin = 3;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::PoolsDoNotTile {
                side: Side::Receiver,
                pool: 1,
                ..
            })
        ));
        let d = layout(&[2, 1], 3);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::PoolsCoverWrongLayers { covered: 3, .. })
        ));
        let mut d = layout(&[2, 2], 3);
        d.pools[0].slot_bytes = 15;
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::SlotTooSmall { needed: 16, .. })
        ));
    }

    #[test]
    fn a_layout_of_sizes_no_block_can_have_is_refused_on_its_own() {
        let ok = layout(&[2, 2], 1);
        assert_eq!(
            check_layout(Side::Sender, &ok),
            Ok(ok.layer_block_bytes().unwrap())
        );
        let field = |change: fn(&mut LayerGroupLayout)| {
            let mut l = ok.clone();
            change(&mut l);
            match check_layout(Side::Receiver, &l) {
                Err(PlanError::FieldOutOfRange { side, field, .. }) => {
                    assert_eq!(side, Side::Receiver);
                    field
                }
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(field(|l| l.kv_heads = 0), "kv_heads");
        assert_eq!(field(|l| l.head_dim = 0), "head_dim");
        assert_eq!(field(|l| l.elem_bytes = 0), "elem_bytes");
        assert_eq!(field(|l| l.tokens_per_block = 0), "tokens_per_block");
        assert_eq!(field(|l| l.kv_factor = 0), "kv_factor");
        assert_eq!(field(|l| l.kv_factor = 3), "kv_factor");
        assert_eq!(field(|l| l.window = Some(0)), "window");
        // A pipeline rank that holds none of the group's layers has no pool: that is fine.
        let mut none = ok.clone();
        none.layers = 0;
        none.pools.clear();
        assert_eq!(check_layout(Side::Sender, &none).map(|_| ()), Ok(()));
        // The pairing check refuses the same, naming the side.
        let (mut s, mut d) = (ok.clone(), layout(&[2, 2], 2));
        s.window = Some(0);
        d.window = Some(0);
        assert!(matches!(
            check_pairable(&s, &d),
            Err(PlanError::FieldOutOfRange {
                side: Side::Sender,
                field: "window",
                ..
            })
        ));
    }

    #[test]
    fn offset_overflow_leaves_the_plan_unchanged() {
        let mut s = layout(&[4], 1);
        s.pools[0].slot_bytes = u64::MAX / 2;
        let d = layout(&[4], 2);
        let dst = AnchoredRun::from_ids(0, &[0, 1, 2].map(BlockId));
        let mut plan = WritePlan::new();
        plan.push(ext(1, 0, 2, 0, 32));
        let before = plan.clone();
        let err = plan_group(&s, &d, &run(0, &[1, 2, 3]), &dst, &mut plan).unwrap_err();
        assert!(matches!(
            err,
            PlanError::OffsetOverflow {
                side: Side::Sender,
                block: 2,
                ..
            }
        ));
        assert_eq!(plan, before);
    }
}

mod heterogeneous_tests {
    use smallvec::smallvec;

    use super::*;
    use crate::ids::BlockId;
    use crate::layout::GroupShard;

    /// A rank of a 4-layer, 4-head group (head dim 2, 1-byte elements, 2 tokens per block: a
    /// head's plane of a block is 4 bytes): `layers` layers from `first_layer`, `heads` heads
    /// from `first_head`, one pool.
    fn rank(
        first_layer: u16,
        layers: u16,
        first_head: u16,
        heads: u16,
        region: u32,
    ) -> LayerGroupLayout {
        LayerGroupLayout {
            layers,
            kv_factor: 2,
            kv_heads: heads,
            head_dim: 2,
            elem_bytes: 1,
            tokens_per_block: 2,
            window: None,
            pools: smallvec![PoolLayout {
                region: RegionId(region),
                layer_begin: 0,
                layers,
                slot_bytes: u64::from(layers) * 2 * u64::from(heads) * 4,
            }],
            shard: GroupShard {
                model_layers: 4,
                first_layer,
                model_kv_heads: 4,
                first_head,
            },
            ..LayerGroupLayout::default()
        }
    }

    fn run(first: u32, ids: &[u32]) -> BlockRun {
        BlockRun {
            first_ordinal: first,
            ids: ids.iter().copied().map(BlockId).collect(),
        }
    }

    fn ext(src: u64, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(1),
            src_offset: src,
            dst_region: RegionId(2),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn a_receiver_with_fewer_heads_gets_one_slice_per_layer_and_plane() {
        // Sender: all 4 heads (32 bytes a layer); receiver: heads 2..3 of tensor rank 2 of 4
        // (8 bytes a layer), all layers.
        let (s, d) = (rank(0, 4, 0, 4, 1), rank(0, 4, 2, 1, 2));
        let pairing = check_pairable(&s, &d).unwrap();
        assert_eq!((pairing.head_begin, pairing.head_end), (2, 3));
        assert!(!pairing.whole_layers());
        let dst = AnchoredRun::from_ids(0, &[10].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[3]), &dst, &mut plan).unwrap();
        // The receiver's block is contiguous; the sender's slices are 16 bytes apart (a
        // plane of 4 heads): one 4-byte slice per (layer, plane), nothing merges.
        let expected: Vec<WriteExtent> = (0..8)
            .map(|p| ext(3 * 128 + 2 * 4 + p * 16, 10 * 32 + p * 4, 4))
            .collect();
        assert_eq!(plan.extents(), &expected[..]);
        assert_eq!(stats.bytes, 32);
        assert_eq!(stats.paired_blocks, 1);
    }

    #[test]
    fn extents_merge_only_where_both_sides_are_contiguous() {
        // The same single head on both sides (another tensor rank of the same size): whole
        // layers, and consecutive slots merge into one extent.
        let (s, d) = (rank(0, 4, 1, 1, 1), rank(0, 4, 1, 1, 2));
        assert!(check_pairable(&s, &d).unwrap().whole_layers());
        let dst = AnchoredRun::from_ids(0, &[20, 21, 22].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[5, 6, 7]), &dst, &mut plan).unwrap();
        assert_eq!(plan.extents(), &[ext(5 * 32, 20 * 32, 96)]);
        // A sender holding heads 0..2, a receiver holding all 4 (single plane): the slices are
        // contiguous at the source but 8 bytes apart at the destination (its other heads):
        // one extent per layer.
        let mut s = rank(0, 4, 0, 2, 1);
        let mut d = rank(0, 4, 0, 4, 2);
        s.kv_factor = 1;
        d.kv_factor = 1;
        s.pools[0].slot_bytes = 4 * 8;
        d.pools[0].slot_bytes = 4 * 16;
        let dst = AnchoredRun::from_ids(0, &[1].map(BlockId));
        let mut plan = WritePlan::new();
        plan_group(&s, &d, &run(0, &[0]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[
                ext(0, 64, 8),
                ext(8, 80, 8),
                ext(16, 96, 8),
                ext(24, 112, 8)
            ]
        );
    }

    #[test]
    fn a_pipeline_rank_receives_its_layer_range() {
        // Receiver: layers 2..4 (pipeline rank 1 of 2), all heads: one whole-layer extent
        // from the sender's layer 2 on.
        let (s, d) = (rank(0, 4, 0, 4, 1), rank(2, 2, 0, 4, 2));
        let dst = AnchoredRun::from_ids(0, &[0, 1].map(BlockId));
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[4, 5]), &dst, &mut plan).unwrap();
        assert_eq!(
            plan.extents(),
            &[ext(4 * 128 + 64, 0, 64), ext(5 * 128 + 64, 64, 64)]
        );
        assert_eq!(stats.bytes, 128);
        // Layers the receiver does not hold plan nothing.
        let d = rank(2, 2, 0, 4, 2);
        let s = rank(0, 2, 0, 4, 1);
        let mut plan = WritePlan::new();
        let stats = plan_group(&s, &d, &run(0, &[4]), &dst, &mut plan).unwrap();
        assert!(plan.is_empty());
        assert_eq!((stats.paired_blocks, stats.unpaired_src_blocks), (0, 1));
    }

    #[test]
    fn only_the_chosen_replica_writes_duplicated_heads() {
        // 1 KV head over 4 sender ranks (4 replicas); the receiver is rank 3 of 4 (replica 3
        // of the same head): only sender rank 3 writes it.
        let one_head = |region| {
            let mut l = rank(0, 4, 0, 1, region);
            l.shard.model_kv_heads = 1;
            l
        };
        let topo = |tp_size, tp_rank| Topology {
            tp_size,
            tp_rank,
            ..Topology::default()
        };
        let (s, d) = (one_head(1), one_head(2));
        let dst = AnchoredRun::from_ids(0, &[0].map(BlockId));
        let dt = topo(4, 3);
        for r in 0..4 {
            let st = topo(4, r);
            let mut plan = WritePlan::new();
            let stats = plan_rank_group(
                RankGroup {
                    topology: &st,
                    layout: &s,
                },
                RankGroup {
                    topology: &dt,
                    layout: &d,
                },
                &run(0, &[0]),
                &dst,
                &mut DstCursor::default(),
                &mut plan,
            )
            .unwrap();
            assert_eq!(plan.is_empty(), r != 3, "sender rank {r}");
            assert_eq!(stats.paired_blocks, u32::from(r == 3));
        }
    }
}
