//! A rank's place in the parallel topology, from the node constructors' keyword arguments.

use kvpipe_core::wire::Topology;
use kvpipe_core::{check_shard, LayerGroupLayout};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The constructors' ``tp_size``, ``tp_rank``, ``pp_size`` and ``pp_rank``, as Python gave them
/// (checked by [`RankPlace::topology`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RankPlace {
    /// Tensor-parallel size.
    pub(crate) tp_size: i64,
    /// This rank's tensor-parallel rank.
    pub(crate) tp_rank: i64,
    /// Pipeline-parallel size.
    pub(crate) pp_size: i64,
    /// This rank's pipeline-parallel rank.
    pub(crate) pp_rank: i64,
}

impl Default for RankPlace {
    /// The whole model on one rank.
    fn default() -> Self {
        RankPlace {
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
        }
    }
}

/// `size` and `rank` of one kind of parallelism, or why they cannot be.
fn size_and_rank(kind: &str, size: i64, rank: i64) -> PyResult<(u16, u16)> {
    let size = match u16::try_from(size) {
        Ok(s) if s >= 1 => s,
        _ => {
            return Err(PyValueError::new_err(format!(
                "{kind}_size must be between 1 and 65535 (1: no {kind} parallelism), got {size}"
            )))
        }
    };
    match u16::try_from(rank) {
        Ok(r) if r < size => Ok((size, r)),
        _ => Err(PyValueError::new_err(format!(
            "{kind}_rank must be between 0 and {kind}_size - 1 = {}, got {rank}",
            size - 1
        ))),
    }
}

impl RankPlace {
    /// The topology of a rank holding `layout`: the sizes and ranks given, checked, and the
    /// rank's layers (counting the groups' layers one group after another, as each group's
    /// `first_layer` places them in the model). Every group's heads must be those its tensor
    /// rank holds (the check each handshake makes, made once here so a wrong rank is refused
    /// when the node is made, not at every peer).
    pub(crate) fn topology(&self, layout: &[LayerGroupLayout]) -> PyResult<Topology> {
        let (tp_size, tp_rank) = size_and_rank("tp", self.tp_size, self.tp_rank)?;
        let (pp_size, pp_rank) = size_and_rank("pp", self.pp_size, self.pp_rank)?;
        let (mut offset, mut begin, mut end) = (0u32, u32::MAX, 0u32);
        for group in layout {
            let range = group.layer_range();
            if !range.is_empty() {
                begin = begin.min(offset.saturating_add(range.start));
                end = end.max(offset.saturating_add(range.end));
            }
            offset = offset.saturating_add(u32::from(group.model_layers()));
        }
        let clamp = |layer: u32| u16::try_from(layer).unwrap_or(u16::MAX);
        let topology = Topology {
            tp_size,
            tp_rank,
            pp_size,
            pp_rank,
            layer_begin: clamp(begin.min(end)),
            layer_end: clamp(end),
        };
        for (g, group) in layout.iter().enumerate() {
            if let Err(e) = check_shard(&topology, group) {
                return Err(PyValueError::new_err(format!(
                    "layer group {g}: {e} (tp_size={tp_size}, tp_rank={tp_rank}; a group's \
                     first_head and kv_heads must be those of the rank's tensor-parallel rank)"
                )));
            }
        }
        Ok(topology)
    }
}

/// The KV heads tensor-parallel rank ``tp_rank`` of ``tp_size`` holds of a model with
/// ``model_kv_heads`` KV heads, as ``(first_head, kv_heads)`` (kvpipe's rule: contiguous equal
/// shares, one replicated head when there are fewer heads than ranks). Raises ``ValueError``
/// when ``tp_size`` is 0, neither count divides the other or the rank is out of range.
#[pyfunction]
pub(crate) fn rank_heads(model_kv_heads: u16, tp_size: u16, tp_rank: u16) -> PyResult<(u16, u16)> {
    // The core reads a tensor-parallel size of 0 as 1 (a topology's default); a caller who
    // names a size means one of at least one rank.
    if tp_size == 0 {
        return Err(PyValueError::new_err(
            "tp_size must be at least 1 (the ranks of the tensor-parallel group), got 0",
        ));
    }
    kvpipe_core::shard::rank_heads(model_kv_heads, tp_size, tp_rank).ok_or_else(|| {
        PyValueError::new_err(format!(
            "{model_kv_heads} KV heads cannot be split over tp_size={tp_size} for tp_rank={tp_rank} \
             (one count must divide the other, and the rank must be below tp_size)"
        ))
    })
}

/// Whether prefill tensor rank ``src_rank`` of ``src_tp`` writes decode tensor rank
/// ``dst_rank`` of ``dst_tp``, for a model whose full-attention layers have ``model_kv_heads``
/// KV heads (the core's writer rule: their heads overlap and, where heads are replicated, the
/// prefill rank is the replica the decode rank takes them from). Raises ``ValueError`` as
/// :func:`rank_heads`.
#[pyfunction]
pub(crate) fn tensor_writes_to(
    model_kv_heads: u16,
    src_tp: u16,
    src_rank: u16,
    dst_tp: u16,
    dst_rank: u16,
) -> PyResult<bool> {
    let side = |tp_size: u16, tp_rank: u16| -> PyResult<(Topology, LayerGroupLayout)> {
        let (first_head, kv_heads) = rank_heads(model_kv_heads, tp_size, tp_rank)?;
        let shard = kvpipe_core::GroupShard {
            model_layers: 1,
            first_layer: 0,
            model_kv_heads,
            first_head,
        };
        let topology = Topology {
            tp_size,
            tp_rank,
            pp_size: 1,
            pp_rank: 0,
            layer_begin: 0,
            layer_end: 1,
        };
        let layout = LayerGroupLayout {
            layers: 1,
            kv_heads,
            shard,
            ..LayerGroupLayout::default()
        };
        Ok((topology, layout))
    };
    let (src_topology, src) = side(src_tp, src_rank)?;
    let (dst_topology, dst) = side(dst_tp, dst_rank)?;
    Ok(kvpipe_core::writes_group(
        &src_topology,
        &src,
        &dst_topology,
        &dst,
    ))
}
