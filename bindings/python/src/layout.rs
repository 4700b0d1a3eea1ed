//! The KV cache's shape as Python describes it, and deadlines.

use kvpipe_core::session::Deadlines;
use kvpipe_core::{Duration, GroupShard, LayerGroupLayout, PoolLayout, RegionId};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arguments::layout;

/// One pool of a layer group: a region (a key of the node's ``pools``) holding ``layers``
/// consecutive layers of the group for every block slot. Block slot ``b`` is the bytes
/// ``[b * slot_bytes, (b + 1) * slot_bytes)`` of the region.
#[pyclass(frozen, get_all, module = "kvpipe")]
#[derive(Clone, Debug)]
pub(crate) struct Pool {
    /// The region id (the key of the pool object in ``pools``).
    region: u32,
    /// Consecutive layers held.
    layers: u16,
    /// Bytes per block slot (at least ``layers`` times a layer's block bytes).
    slot_bytes: u64,
    /// The first layer held, counted from the rank's first layer of the group.
    layer_begin: u16,
}

#[pymethods]
impl Pool {
    #[new]
    #[pyo3(signature = (region, layers, slot_bytes, layer_begin = 0))]
    fn new(
        #[pyo3(from_py_with = layout::region)] region: u32,
        #[pyo3(from_py_with = layout::layers)] layers: u16,
        #[pyo3(from_py_with = layout::slot_bytes)] slot_bytes: u64,
        #[pyo3(from_py_with = layout::layer_begin)] layer_begin: u16,
    ) -> Self {
        Pool {
            region,
            layers,
            slot_bytes,
            layer_begin,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Pool(region={}, layers={}, slot_bytes={}, layer_begin={})",
            self.region, self.layers, self.slot_bytes, self.layer_begin
        )
    }
}

/// One layer group: layers sharing one block table per request. A slot's bytes are laid out
/// ``[layer][K|V][head][token][dim]``. ``window`` is the sliding attention window in tokens
/// (``None``: full attention); the ``model_*``/``first_*`` fields place a tensor- or
/// pipeline-parallel rank's part in the whole model (0: this rank holds the whole group).
#[pyclass(frozen, get_all, module = "kvpipe")]
#[derive(Clone, Debug)]
pub(crate) struct LayerGroup {
    /// Layers of the group on this rank.
    layers: u16,
    /// KV heads on this rank.
    kv_heads: u16,
    /// Elements per head.
    head_dim: u16,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8).
    elem_bytes: u8,
    /// Tokens per block.
    tokens_per_block: u32,
    /// The pools holding the group's layers, in layer order.
    pools: Vec<Pool>,
    /// 2 for separate K and V planes, 1 for MLA's joint latent.
    kv_factor: u8,
    /// Sliding window in tokens, or None.
    window: Option<u32>,
    /// Layers of the group in the whole model (0: all on this rank).
    model_layers: u16,
    /// The first of the model's layers this rank holds.
    first_layer: u16,
    /// KV heads of the group in the whole model (0: all on this rank).
    model_kv_heads: u16,
    /// The first of the model's KV heads this rank holds.
    first_head: u16,
}

#[pymethods]
impl LayerGroup {
    #[new]
    #[pyo3(signature = (
        layers, kv_heads, head_dim, elem_bytes, tokens_per_block, pools, *, kv_factor = 2,
        window = None, model_layers = 0, first_layer = 0, model_kv_heads = 0, first_head = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = layout::layers)] layers: u16,
        #[pyo3(from_py_with = layout::kv_heads)] kv_heads: u16,
        #[pyo3(from_py_with = layout::head_dim)] head_dim: u16,
        #[pyo3(from_py_with = layout::elem_bytes)] elem_bytes: u8,
        #[pyo3(from_py_with = layout::tokens_per_block)] tokens_per_block: u32,
        pools: Vec<PyRef<'_, Pool>>,
        #[pyo3(from_py_with = layout::kv_factor)] kv_factor: u8,
        #[pyo3(from_py_with = layout::window)] window: Option<u32>,
        #[pyo3(from_py_with = layout::model_layers)] model_layers: u16,
        #[pyo3(from_py_with = layout::first_layer)] first_layer: u16,
        #[pyo3(from_py_with = layout::model_kv_heads)] model_kv_heads: u16,
        #[pyo3(from_py_with = layout::first_head)] first_head: u16,
    ) -> Self {
        LayerGroup {
            layers,
            kv_heads,
            head_dim,
            elem_bytes,
            tokens_per_block,
            pools: pools.iter().map(|p| (**p).clone()).collect(),
            kv_factor,
            window,
            model_layers,
            first_layer,
            model_kv_heads,
            first_head,
        }
    }

    /// Bytes one layer contributes to one block slot:
    /// ``kv_factor * kv_heads * tokens_per_block * head_dim * elem_bytes``.
    fn layer_block_bytes(&self) -> u64 {
        self.to_core().layer_block_bytes().unwrap_or(u64::MAX)
    }

    fn __repr__(&self) -> String {
        format!(
            "LayerGroup(layers={}, kv_heads={}, head_dim={}, elem_bytes={}, tokens_per_block={}, \
             pools=[{}], kv_factor={}, window={:?})",
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.elem_bytes,
            self.tokens_per_block,
            self.pools
                .iter()
                .map(Pool::__repr__)
                .collect::<Vec<_>>()
                .join(", "),
            self.kv_factor,
            self.window
        )
    }
}

impl LayerGroup {
    pub(crate) fn to_core(&self) -> LayerGroupLayout {
        LayerGroupLayout {
            layers: self.layers,
            kv_factor: self.kv_factor,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            elem_bytes: self.elem_bytes,
            tokens_per_block: self.tokens_per_block,
            window: self.window,
            block_layout: Default::default(),
            pools: self
                .pools
                .iter()
                .map(|p| PoolLayout {
                    region: RegionId(p.region),
                    layer_begin: p.layer_begin,
                    layers: p.layers,
                    slot_bytes: p.slot_bytes,
                })
                .collect(),
            shard: GroupShard {
                model_layers: self.model_layers,
                first_layer: self.first_layer,
                model_kv_heads: self.model_kv_heads,
                first_head: self.first_head,
            },
        }
    }
}

/// The core layout of a list of ``LayerGroup``s.
pub(crate) fn layout(groups: &[PyRef<'_, LayerGroup>]) -> Vec<LayerGroupLayout> {
    groups.iter().map(|g| g.to_core()).collect()
}

/// Deadlines from a ``{name: seconds}`` mapping over the defaults.
pub(crate) fn deadlines(given: Option<&Bound<'_, PyDict>>) -> PyResult<Deadlines> {
    let mut d = Deadlines::default();
    let Some(given) = given else { return Ok(d) };
    for (key, value) in given.iter() {
        let name: String = key.extract()?;
        let seconds: f64 = value.extract()?;
        // A deadline is held in whole nanoseconds (u64): about 584 years at most. Whether a
        // zero can work is the core's rule (`Deadlines::check`, a ConfigError at start).
        const MAX_SECONDS: u64 = u64::MAX / 1_000_000_000;
        if !(seconds.is_finite() && (0.0..=MAX_SECONDS as f64).contains(&seconds)) {
            // A huge value in exponent form, not its three hundred digits.
            let got = if seconds.abs() < 1e12 {
                format!("{seconds}")
            } else {
                format!("{seconds:e}")
            };
            return Err(PyValueError::new_err(format!(
                "deadline {name:?} must be a number of seconds from 0 to {MAX_SECONDS} (about \
                 584 years), got {got}"
            )));
        }
        let duration = Duration::from_nanos((seconds * 1e9) as u64);
        let slot = match name.as_str() {
            "handshake" => &mut d.handshake,
            "registration" => &mut d.registration,
            "write_completion" => &mut d.write_completion,
            "result_wait" => &mut d.result_wait,
            "result_per_token" => &mut d.result_per_token,
            "result_idle" => &mut d.result_idle,
            "aux_wait" => &mut d.aux_wait,
            "heartbeat_interval" => &mut d.heartbeat_interval,
            "liveness_timeout" => &mut d.liveness_timeout,
            "quiesce" => &mut d.quiesce,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "unknown deadline {name:?}; the deadlines are handshake, registration, \
                     write_completion, result_wait, result_per_token, result_idle, aux_wait, \
                     heartbeat_interval, liveness_timeout and quiesce"
                )))
            }
        };
        *slot = duration;
    }
    Ok(d)
}
