//! Heterogeneous parallelism: which part of the model each rank holds, and which sender rank
//! writes which receiver rank.
//!
//! Every rank describes its part of each layer group with a [`GroupShard`]: a range of the
//! group's layers (pipeline parallelism; any split) and a range of the model's KV heads (tensor
//! parallelism). The two sides of a transfer may be split differently; the planner
//! ([`plan_rank_group`](crate::plan::plan_rank_group)) writes the part both hold, as layer-range
//! and head-slice extents. The rules:
//!
//! 1. **Heads follow the tensor-parallel rank.** With `H` KV heads in the model and `T` ranks,
//!    rank `r` holds heads `r·H/T .. (r+1)·H/T` when `H ≥ T` (`T` divides `H`), and the single
//!    head `r / (T/H)` when `H < T` (`H` divides `T`): then `T/H` ranks hold each head, its
//!    *replicas* ([`check_shard`] enforces this).
//! 2. **A sender rank writes a group to a receiver rank** when their layer ranges and head
//!    ranges overlap and, if the sender's heads are replicated, it is the replica that receiver
//!    takes them from: the one with `sender.tp_rank % replicas == receiver.tp_rank % replicas`
//!    ([`writes_group`]). Every receiver byte thus has exactly one writer, and the replicas
//!    share the receivers between them.
//! 3. **A receiver expects** one final result from each sender rank that writes at least one of
//!    its groups ([`writes_to`]); the engine lists those in the registration's writers, and a
//!    sender rank opens a request towards exactly the receivers it writes.

use thiserror::Error;

use crate::layout::{GroupShard, LayerGroupLayout};
use crate::wire::Topology;

/// The tensor-parallel size of `topology` (0, as in `Topology::default()`, counts as 1).
pub fn tp_size(topology: &Topology) -> u16 {
    topology.tp_size.max(1)
}

/// The KV heads tensor-parallel rank `tp_rank` of `tp_size` holds of a group with
/// `model_kv_heads` heads (rule 1 of the module doc) as `(first_head, kv_heads)`, or `None`
/// when neither count divides the other or the rank is out of range.
pub fn rank_heads(model_kv_heads: u16, tp_size: u16, tp_rank: u16) -> Option<(u16, u16)> {
    let (h, t) = (model_kv_heads, tp_size.max(1));
    if h == 0 || tp_rank >= t {
        return None;
    }
    if h >= t {
        (h % t == 0).then(|| (tp_rank * (h / t), h / t))
    } else {
        (t % h == 0).then(|| (tp_rank / (t / h), 1))
    }
}

impl GroupShard {
    /// The shard of tensor-parallel rank `tp_rank` of `tp_size` holding layers
    /// `first_layer .. first_layer + layers` of a group of `model_layers` layers and
    /// `model_kv_heads` KV heads; with the rank's `kv_heads`. `None` when the heads cannot be
    /// split over `tp_size` ranks (see [`rank_heads`]).
    pub fn for_rank(
        model_layers: u16,
        first_layer: u16,
        model_kv_heads: u16,
        tp_size: u16,
        tp_rank: u16,
    ) -> Option<(GroupShard, u16)> {
        let (first_head, kv_heads) = rank_heads(model_kv_heads, tp_size, tp_rank)?;
        Some((
            GroupShard {
                model_layers,
                first_layer,
                model_kv_heads,
                first_head,
            },
            kv_heads,
        ))
    }
}

/// How many tensor-parallel ranks of `topology` hold the same heads of `layout` (1 unless the
/// model has fewer KV heads than ranks).
pub fn head_replicas(topology: &Topology, layout: &LayerGroupLayout) -> u16 {
    let (h, t) = (layout.model_kv_heads().max(1), tp_size(topology));
    if h < t {
        t / h
    } else {
        1
    }
}

/// Checks that `layout`'s shard lies inside the model and that its heads are those rule 1 of
/// the module doc gives `topology`'s tensor-parallel rank.
pub fn check_shard(topology: &Topology, layout: &LayerGroupLayout) -> Result<(), ShardError> {
    let layers = layout.layer_range();
    if layers.end > u32::from(layout.model_layers()) {
        return Err(ShardError::LayersPastModel {
            first_layer: layout.shard.first_layer,
            layers: layout.layers,
            model_layers: layout.model_layers(),
        });
    }
    let heads = layout.head_range();
    if heads.end > u32::from(layout.model_kv_heads()) || layout.kv_heads == 0 {
        return Err(ShardError::HeadsPastModel {
            first_head: layout.shard.first_head,
            kv_heads: layout.kv_heads,
            model_kv_heads: layout.model_kv_heads(),
        });
    }
    let (t, r) = (tp_size(topology), topology.tp_rank);
    match rank_heads(layout.model_kv_heads(), t, r) {
        None => Err(ShardError::HeadsNotSplit {
            model_kv_heads: layout.model_kv_heads(),
            tp_size: t,
            tp_rank: r,
        }),
        Some((first, count)) if (first, count) != (layout.shard.first_head, layout.kv_heads) => {
            Err(ShardError::NotTheRanksHeads {
                tp_rank: r,
                tp_size: t,
                expected_first: first,
                expected_count: count,
                first_head: layout.shard.first_head,
                kv_heads: layout.kv_heads,
            })
        }
        Some(_) => Ok(()),
    }
}

/// Checks a rank's own place before it talks to anyone: each rank below its size (a size of 0
/// counts as 1), its layers in order, and every group's shard as [`check_shard`] wants it. A
/// node whose topology fails here would be refused by every peer's handshake.
pub fn check_topology(
    topology: &Topology,
    groups: &[LayerGroupLayout],
) -> Result<(), TopologyError> {
    for (kind, rank, size) in [
        ("tensor-parallel", topology.tp_rank, topology.tp_size),
        ("pipeline-parallel", topology.pp_rank, topology.pp_size),
    ] {
        if rank >= size.max(1) {
            return Err(TopologyError::RankNotBelowSize { kind, rank, size });
        }
    }
    if topology.layer_begin > topology.layer_end {
        return Err(TopologyError::LayersReversed {
            begin: topology.layer_begin,
            end: topology.layer_end,
        });
    }
    for (group, layout) in groups.iter().enumerate() {
        check_shard(topology, layout).map_err(|error| TopologyError::Shard { group, error })?;
    }
    Ok(())
}

/// A rank's place in the parallel topology that no deployment has (see [`check_topology`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TopologyError {
    /// A rank is not below its group's size.
    #[error(
        "{kind} rank {rank} is not below the {kind} size {size} (ranks count from 0; a size of \
         0 counts as 1)"
    )]
    RankNotBelowSize {
        /// `tensor-parallel` or `pipeline-parallel`.
        kind: &'static str,
        /// The rank given.
        rank: u16,
        /// The size given.
        size: u16,
    },
    /// The rank's layer range is reversed.
    #[error("the rank's layers begin at {begin}, after their end {end}")]
    LayersReversed {
        /// First layer given.
        begin: u16,
        /// One past the last layer given.
        end: u16,
    },
    /// A group's shard does not fit the model or the rank.
    #[error("layer group {group}: {error}")]
    Shard {
        /// The group (index in the layout).
        group: usize,
        /// What is wrong.
        error: ShardError,
    },
}

/// Whether the sender rank (`src_topology`, `src`) writes this group to the receiver rank
/// (`dst_topology`, `dst`): rule 2 of the module doc. Both layouts describe the same group.
pub fn writes_group(
    src_topology: &Topology,
    src: &LayerGroupLayout,
    dst_topology: &Topology,
    dst: &LayerGroupLayout,
) -> bool {
    let overlap = |a: core::ops::Range<u32>, b: core::ops::Range<u32>| {
        a.start.max(b.start) < a.end.min(b.end)
    };
    if !overlap(src.layer_range(), dst.layer_range())
        || !overlap(src.head_range(), dst.head_range())
    {
        return false;
    }
    let replicas = head_replicas(src_topology, src);
    replicas == 1 || src_topology.tp_rank % replicas == dst_topology.tp_rank % replicas
}

/// Whether the sender rank writes at least one group to the receiver rank (rule 3): whether it
/// is one of the receiver's expected writers, and the receiver one of its targets.
pub fn writes_to(
    src_topology: &Topology,
    src_groups: &[LayerGroupLayout],
    dst_topology: &Topology,
    dst_groups: &[LayerGroupLayout],
) -> bool {
    src_groups
        .iter()
        .zip(dst_groups)
        .any(|(s, d)| writes_group(src_topology, s, dst_topology, d))
}

/// A layer group's shard that does not fit its model or its rank.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ShardError {
    /// The rank's layers run past the group's layers in the model.
    #[error(
        "the rank holds layers {first_layer}..+{layers} of a group of {model_layers} layers: \
         its layer range must lie inside the model"
    )]
    LayersPastModel {
        /// First layer the rank claims.
        first_layer: u16,
        /// Layers it claims.
        layers: u16,
        /// The group's layers in the model.
        model_layers: u16,
    },
    /// The rank's heads run past the model's KV heads, or it holds none.
    #[error(
        "the rank holds KV heads {first_head}..+{kv_heads} of the model's {model_kv_heads}: \
         it must hold at least one head, inside the model"
    )]
    HeadsPastModel {
        /// First head the rank claims.
        first_head: u16,
        /// Heads it claims.
        kv_heads: u16,
        /// The model's KV heads.
        model_kv_heads: u16,
    },
    /// The model's KV heads cannot be spread over the tensor-parallel ranks.
    #[error(
        "{model_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks (rank \
         {tp_rank}): one count must divide the other"
    )]
    HeadsNotSplit {
        /// The model's KV heads.
        model_kv_heads: u16,
        /// Tensor-parallel size.
        tp_size: u16,
        /// This rank.
        tp_rank: u16,
    },
    /// The rank claims other heads than its tensor-parallel rank holds.
    #[error(
        "tensor-parallel rank {tp_rank} of {tp_size} holds KV heads \
         {expected_first}..+{expected_count}, but its layout says {first_head}..+{kv_heads}"
    )]
    NotTheRanksHeads {
        /// This rank.
        tp_rank: u16,
        /// Tensor-parallel size.
        tp_size: u16,
        /// First head the rank holds by rule 1.
        expected_first: u16,
        /// Heads it holds by rule 1.
        expected_count: u16,
        /// First head the layout claims.
        first_head: u16,
        /// Heads the layout claims.
        kv_heads: u16,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(tp_size: u16, tp_rank: u16) -> Topology {
        Topology {
            tp_size,
            tp_rank,
            ..Topology::default()
        }
    }

    fn rank(model_heads: u16, tp: u16, r: u16, layers: (u16, u16, u16)) -> LayerGroupLayout {
        let (model_layers, first_layer, n) = layers;
        let (shard, kv_heads) =
            GroupShard::for_rank(model_layers, first_layer, model_heads, tp, r).unwrap();
        LayerGroupLayout {
            layers: n,
            kv_heads,
            kv_factor: 2,
            head_dim: 4,
            elem_bytes: 1,
            tokens_per_block: 2,
            shard,
            ..LayerGroupLayout::default()
        }
    }

    #[test]
    fn heads_follow_the_rank_with_replicas_below_one_head_per_rank() {
        assert_eq!(rank_heads(8, 2, 1), Some((4, 4)));
        assert_eq!(rank_heads(8, 8, 5), Some((5, 1)));
        assert_eq!(rank_heads(2, 8, 5), Some((1, 1)));
        assert_eq!(rank_heads(8, 0, 0), Some((0, 8)));
        assert_eq!(rank_heads(8, 3, 0), None);
        assert_eq!(rank_heads(3, 8, 0), None);
        assert_eq!(rank_heads(8, 2, 2), None);
        assert_eq!(head_replicas(&topo(8, 0), &rank(2, 8, 0, (4, 0, 4))), 4);
        assert_eq!(head_replicas(&topo(2, 0), &rank(8, 2, 0, (4, 0, 4))), 1);
    }

    #[test]
    fn shards_are_checked_against_model_and_rank() {
        let ok = rank(8, 4, 3, (32, 16, 16));
        assert_eq!(check_shard(&topo(4, 3), &ok), Ok(()));
        assert!(matches!(
            check_shard(&topo(4, 2), &ok),
            Err(ShardError::NotTheRanksHeads {
                expected_first: 4,
                first_head: 6,
                ..
            })
        ));
        assert!(matches!(
            check_shard(&topo(3, 2), &ok),
            Err(ShardError::HeadsNotSplit { tp_size: 3, .. })
        ));
        let mut past = ok.clone();
        past.layers = 17;
        assert!(matches!(
            check_shard(&topo(4, 3), &past),
            Err(ShardError::LayersPastModel {
                model_layers: 32,
                ..
            })
        ));
        let mut heads = ok.clone();
        heads.shard.first_head = 7;
        assert!(matches!(
            check_shard(&topo(4, 3), &heads),
            Err(ShardError::HeadsPastModel { .. })
        ));
        // The whole model on one rank (the default shard, any default topology).
        let whole = LayerGroupLayout {
            layers: 3,
            kv_heads: 2,
            ..LayerGroupLayout::default()
        };
        assert_eq!(check_shard(&Topology::default(), &whole), Ok(()));
        assert!(check_shard(&topo(2, 0), &whole).is_err());
    }

    /// Every (receiver rank, head, layer) has exactly one writer, for every mapping.
    #[test]
    fn every_receiver_byte_has_exactly_one_writer() {
        let layers = 6u16;
        for heads in [1u16, 2, 4, 8] {
            for s_tp in [1u16, 2, 4, 8] {
                for r_tp in [1u16, 2, 4, 8] {
                    for r_pp in [1u16, 2, 3] {
                        if rank_heads(heads, s_tp, 0).is_none()
                            || rank_heads(heads, r_tp, 0).is_none()
                        {
                            continue;
                        }
                        let senders: Vec<_> = (0..s_tp)
                            .map(|r| (topo(s_tp, r), rank(heads, s_tp, r, (layers, 0, layers))))
                            .collect();
                        for rr in 0..r_tp {
                            for rp in 0..r_pp {
                                let per = layers / r_pp;
                                let dst = rank(heads, r_tp, rr, (layers, rp * per, per));
                                let dt = topo(r_tp, rr);
                                for h in dst.head_range() {
                                    for l in dst.layer_range() {
                                        let writers = senders
                                            .iter()
                                            .filter(|(st, s)| {
                                                writes_group(st, s, &dt, &dst)
                                                    && s.head_range().contains(&h)
                                                    && s.layer_range().contains(&l)
                                            })
                                            .count();
                                        assert_eq!(
                                            writers, 1,
                                            "heads {heads} tp {s_tp}->{r_tp} pp {r_pp}: rank \
                                             {rr}/{rp} head {h} layer {l}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
