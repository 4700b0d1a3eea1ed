//! Tensor- and pipeline-parallel splits of a model over ranks: what each rank's reference cache
//! holds, its topology, and which sender ranks write which receiver rank. Used by the
//! simulator, the `kvpipe demo --sender-tp/--receiver-tp/--receiver-pp` runs and the
//! conformance scenarios of heterogeneous layouts.

use kvpipe_core::wire::Topology;
use kvpipe_core::{writes_to, GroupShard, LayerGroupLayout};

use super::error::CacheError;
use super::spec::{CacheSpec, GroupSpec};
use super::ReferenceCache;

/// One rank of a split model: its topology, the groups it holds (its layers and KV heads, for
/// a [`CacheSpec`]) and where they sit in the model (for
/// [`ReferenceCache::with_shards`](super::ReferenceCache::with_shards)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShape {
    /// Tensor- and pipeline-parallel position (`layer_begin..layer_end` spans the rank's
    /// layers, counting the groups' layers one group after another).
    pub topology: Topology,
    /// What the rank holds of each group.
    pub groups: Vec<GroupSpec>,
    /// Where that sits in the whole model's groups.
    pub shards: Vec<GroupShard>,
}

/// The layers of a group of `layers` layers pipeline rank `rank` of `size` holds, as
/// `(first, count)`: an even split, the first ranks taking one more when `size` does not divide
/// `layers`.
pub fn pipeline_layers(layers: u16, size: u16, rank: u16) -> (u16, u16) {
    let size = size.max(1);
    let (per, extra) = (layers / size, layers % size);
    let first = rank * per + rank.min(extra);
    (first, per + u16::from(rank < extra))
}

/// The part of the model `model` (each group with the whole model's layers and KV heads) held
/// by tensor rank `tp_rank` of `tp` and pipeline rank `pp_rank` of `pp`: heads by the rule of
/// [`kvpipe_core::shard`], layers split by [`pipeline_layers`]. A rank holding all of a
/// group's layers keeps the model's pool split; a pipeline rank holds its layers in one pool.
pub fn split_rank(
    model: &[GroupSpec],
    tp: u16,
    tp_rank: u16,
    pp: u16,
    pp_rank: u16,
) -> Result<RankShape, CacheError> {
    let mut groups = Vec::with_capacity(model.len());
    let mut shards = Vec::with_capacity(model.len());
    // The rank's layers, counting the groups' layers one group after another.
    let (mut offset, mut layer_begin, mut layer_end) = (0u16, u16::MAX, 0u16);
    for (g, m) in model.iter().enumerate() {
        let (first_layer, layers) = pipeline_layers(m.layers, pp, pp_rank);
        let (shard, kv_heads) =
            GroupShard::for_rank(m.layers, first_layer, m.kv_heads, tp, tp_rank).ok_or(
                CacheError::InvalidSpec {
                    group: g as u16,
                    reason: "the model's KV heads cannot be split over the tensor-parallel ranks",
                },
            )?;
        let pool_split = if layers == m.layers {
            m.pool_split.clone()
        } else if layers == 0 {
            Vec::new()
        } else {
            vec![layers]
        };
        groups.push(GroupSpec {
            layers,
            kv_heads,
            pool_split,
            ..m.clone()
        });
        shards.push(shard);
        if layers > 0 {
            layer_begin = layer_begin.min(offset + first_layer);
            layer_end = layer_end.max(offset + first_layer + layers);
        }
        offset += m.layers;
    }
    let topology = Topology {
        tp_size: tp.max(1),
        tp_rank,
        pp_size: pp.max(1),
        pp_rank,
        layer_begin: layer_begin.min(layer_end),
        layer_end,
    };
    Ok(RankShape {
        topology,
        groups,
        shards,
    })
}

/// How a model is spread over a set of sender ranks and one receiver rank (the simulator's
/// world): the senders are the tensor-parallel ranks of one prefill instance (`sender_tp` of
/// them) or, with `sender_tp` 1, separate instances each holding the whole model; the receiver
/// is one rank of a tensor × pipeline split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankSplit {
    /// Tensor-parallel size of the sender ranks (1: each holds the whole model).
    pub sender_tp: u16,
    /// Tensor-parallel size of the decode side.
    pub receiver_tp: u16,
    /// The receiver's tensor-parallel rank.
    pub receiver_tp_rank: u16,
    /// Pipeline-parallel size of the decode side.
    pub receiver_pp: u16,
    /// The receiver's pipeline-parallel rank.
    pub receiver_pp_rank: u16,
}

impl RankSplit {
    /// Every rank holds the whole model.
    pub const WHOLE: RankSplit = RankSplit {
        sender_tp: 1,
        receiver_tp: 1,
        receiver_tp_rank: 0,
        receiver_pp: 1,
        receiver_pp_rank: 0,
    };

    /// The splits of two sender ranks a simulation draws from: separate instances; tensor
    /// parallelism 2 against a decode side of 1, or of 2 (either rank), or 1 against 2; and a
    /// receiver pipeline split of 2 (either rank).
    pub const SIMULATED: [RankSplit; 7] = [
        RankSplit::WHOLE,
        RankSplit::tensor(2, 1, 0),
        RankSplit::tensor(2, 2, 0),
        RankSplit::tensor(2, 2, 1),
        RankSplit::tensor(1, 2, 1),
        RankSplit::pipeline(2, 2, 0),
        RankSplit::pipeline(2, 2, 1),
    ];

    /// Sender tensor parallelism `sender_tp` against receiver rank `rank` of `receiver_tp`.
    pub const fn tensor(sender_tp: u16, receiver_tp: u16, rank: u16) -> Self {
        RankSplit {
            sender_tp,
            receiver_tp,
            receiver_tp_rank: rank,
            ..RankSplit::WHOLE
        }
    }

    /// Sender tensor parallelism `sender_tp` against pipeline rank `rank` of `receiver_pp`.
    pub const fn pipeline(sender_tp: u16, receiver_pp: u16, rank: u16) -> Self {
        RankSplit {
            sender_tp,
            receiver_pp,
            receiver_pp_rank: rank,
            ..RankSplit::WHOLE
        }
    }

    /// What sender rank `Some(r)` (or the receiver, `None`) holds of `model`.
    pub fn shape(&self, rank: Option<usize>, model: &[GroupSpec]) -> Result<RankShape, CacheError> {
        match rank {
            Some(_) if self.sender_tp <= 1 => split_rank(model, 1, 0, 1, 0),
            Some(r) => split_rank(model, self.sender_tp, r as u16, 1, 0),
            None => split_rank(
                model,
                self.receiver_tp,
                self.receiver_tp_rank,
                self.receiver_pp,
                self.receiver_pp_rank,
            ),
        }
    }

    /// The topology and cache of sender rank `Some(r)` (or the receiver) when `spec`'s groups
    /// are the whole model's.
    pub fn cache(
        &self,
        rank: Option<usize>,
        spec: &CacheSpec,
    ) -> Result<(Topology, ReferenceCache), CacheError> {
        let shape = self.shape(rank, &spec.groups)?;
        let spec = CacheSpec {
            groups: shape.groups,
            ..spec.clone()
        };
        Ok((
            shape.topology,
            ReferenceCache::with_shards(&spec, &shape.shards)?,
        ))
    }
}

/// The sender ranks (indices into `senders`: each a topology and its layouts) that write the
/// receiver rank, i.e. its expected writers: see [`kvpipe_core::writes_to`].
pub fn writers_of(
    senders: &[(Topology, Vec<LayerGroupLayout>)],
    receiver: &(Topology, Vec<LayerGroupLayout>),
) -> Vec<usize> {
    senders
        .iter()
        .enumerate()
        .filter(|(_, (t, groups))| writes_to(t, groups, &receiver.0, &receiver.1))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_ranks_split_layers_evenly() {
        assert_eq!(pipeline_layers(80, 2, 1), (40, 40));
        assert_eq!(pipeline_layers(5, 2, 0), (0, 3));
        assert_eq!(pipeline_layers(5, 2, 1), (3, 2));
        assert_eq!(pipeline_layers(1, 2, 1), (1, 0));
        assert_eq!(pipeline_layers(7, 1, 0), (0, 7));
    }

    #[test]
    fn simulated_splits_give_every_receiver_byte_a_writer() {
        let model = vec![
            GroupSpec {
                kv_heads: 2,
                ..GroupSpec::full(3, &[1, 2])
            },
            GroupSpec::full(1, &[1]).windowed(24, 4),
        ];
        for split in RankSplit::SIMULATED {
            let shape = |rank| split.shape(rank, &model).unwrap();
            let senders: Vec<_> = (0..2)
                .map(|r| {
                    let s = shape(Some(r));
                    (s.topology, layouts(&s))
                })
                .collect();
            let r = shape(None);
            let writers = writers_of(&senders, &(r.topology, layouts(&r)));
            let expected = match split.sender_tp {
                1 => vec![0, 1],
                _ if split.receiver_tp == 2 => vec![usize::from(split.receiver_tp_rank)],
                _ => vec![0, 1],
            };
            assert_eq!(writers, expected, "{split:?}");
        }
    }

    fn layouts(shape: &RankShape) -> Vec<LayerGroupLayout> {
        let spec = CacheSpec {
            tokens_per_block: 4,
            groups: shape.groups.clone(),
            slots_per_group: 1,
            first_region: 1,
            slot_order_seed: None,
            materialize: false,
        };
        ReferenceCache::with_shards(&spec, &shape.shards)
            .unwrap()
            .layouts()
    }

    #[test]
    fn ranks_hold_their_heads_and_layers() {
        let model = vec![
            GroupSpec {
                kv_heads: 8,
                ..GroupSpec::full(80, &[40, 40])
            },
            GroupSpec {
                kv_heads: 8,
                ..GroupSpec::full(3, &[3])
            },
        ];
        let r = split_rank(&model, 2, 1, 2, 1).unwrap();
        assert_eq!(
            (
                r.groups[0].layers,
                r.groups[0].kv_heads,
                r.groups[0].pool_split.clone()
            ),
            (40, 4, vec![40])
        );
        assert_eq!(
            r.shards[0],
            GroupShard {
                model_layers: 80,
                first_layer: 40,
                model_kv_heads: 8,
                first_head: 4
            }
        );
        assert_eq!((r.groups[1].layers, r.shards[1].first_layer), (1, 2));
        assert_eq!((r.topology.layer_begin, r.topology.layer_end), (40, 83));
        let whole = split_rank(&model, 1, 0, 1, 0).unwrap();
        assert_eq!(whole.groups, model);
        assert_eq!(
            (whole.topology.layer_begin, whole.topology.layer_end),
            (0, 83)
        );
        assert!(split_rank(&model, 3, 0, 1, 0).is_err());
    }
}
