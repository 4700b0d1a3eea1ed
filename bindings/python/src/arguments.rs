//! Arguments whose conversion failures name the argument and what it accepts.
//!
//! PyO3's own conversions report a bad integer as a bare ``OverflowError`` ("out of range
//! integral type conversion attempted") and a wrong type with its generic text, neither naming
//! the argument. The helpers here convert those arguments as the rest of the binding checks
//! its inputs: ``TypeError`` for a wrong type, ``ValueError`` for a value out of range, each
//! message saying which argument, what it accepts and what was given.

use kvpipe_core::{GroupIndex, LayerOrder, LayerRange};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString, PyTuple};

/// An unsigned integer type an argument converts to.
pub(crate) trait Unsigned: for<'a, 'py> FromPyObject<'a, 'py, Error = PyErr> {
    /// The largest value, for the message.
    fn max() -> u64;
}

impl Unsigned for u8 {
    fn max() -> u64 {
        u64::from(u8::MAX)
    }
}

impl Unsigned for u16 {
    fn max() -> u64 {
        u64::from(u16::MAX)
    }
}

impl Unsigned for u32 {
    fn max() -> u64 {
        u64::from(u32::MAX)
    }
}

impl Unsigned for u64 {
    fn max() -> u64 {
        u64::MAX
    }
}

/// `value` or `"?"` when even its `repr` fails.
fn shown(value: &Bound<'_, PyAny>) -> String {
    value.repr().map_or_else(|_| "?".into(), |r| r.to_string())
}

/// The name of `value`'s type.
fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Argument `name` as a `T`: any integer (or object with ``__index__``) from 0 to `T`'s
/// largest value. ``ValueError`` when it is out of that range, ``TypeError`` when it is not an
/// integer; both name the argument and the range.
pub(crate) fn unsigned<T: Unsigned>(value: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    value.extract::<T>().map_err(|e| {
        let accepted = format!("{name} must be an integer from 0 to {}", T::max());
        if e.is_instance_of::<PyOverflowError>(value.py()) {
            PyValueError::new_err(format!("{accepted}, got {}", shown(value)))
        } else {
            PyTypeError::new_err(format!(
                "{accepted}, got {} (type {})",
                shown(value),
                type_name(value)
            ))
        }
    })
}

/// The ``layers`` argument of ``Sender.submit_chunk``: a ``(begin, end)`` tuple of the rank's
/// layer positions. ``TypeError`` for anything but a tuple or for items that are not integers,
/// ``ValueError`` for a tuple of another length or a position out of range. Whether the range
/// fits the rank's layers and the chunk's earlier ranges is the core's check.
pub(crate) fn layer_range(value: &Bound<'_, PyAny>) -> PyResult<LayerRange> {
    const ACCEPTED: &str = "layers must be None (the whole chunk) or a (begin, end) tuple of \
                            layer positions";
    let tuple = value.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{ACCEPTED}, got {} (type {})",
            shown(value),
            type_name(value)
        ))
    })?;
    if tuple.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "{ACCEPTED}, got a tuple of length {}: {}",
            tuple.len(),
            shown(value)
        )));
    }
    let begin = unsigned(&tuple.get_item(0)?, "the begin of layers=(begin, end)")?;
    let end = unsigned(&tuple.get_item(1)?, "the end of layers=(begin, end)")?;
    Ok(LayerRange::new(begin, end))
}

/// The ``layer_order`` argument of ``Sender.tcp`` and ``mem_pair``: an iterable of layer group
/// indices, one per layer of the rank, in compute order (the caller keeps ``None``, the groups
/// one after the other). An empty order is refused with ``ValueError`` rather than taken as the
/// default (the core's empty order), a string or a non-iterable with ``TypeError``, an index
/// that is not an integer or out of range as [`unsigned`] says. Whether the order fits the
/// layout is the core's check.
pub(crate) fn layer_order(value: &Bound<'_, PyAny>) -> PyResult<LayerOrder> {
    const ACCEPTED: &str = "layer_order must be None (the layer groups one after the other) or \
                            a sequence of layer group indices, one per layer of the rank";
    let not_a_sequence = || {
        PyTypeError::new_err(format!(
            "{ACCEPTED}, got {} (type {})",
            shown(value),
            type_name(value)
        ))
    };
    // A string iterates, but its characters are no group indices.
    if value.is_instance_of::<PyString>()
        || value.is_instance_of::<PyBytes>()
        || value.is_instance_of::<PyByteArray>()
    {
        return Err(not_a_sequence());
    }
    let mut groups = Vec::new();
    for (i, item) in value.try_iter().map_err(|_| not_a_sequence())?.enumerate() {
        groups.push(GroupIndex(unsigned(&item?, &format!("layer_order[{i}]"))?));
    }
    if groups.is_empty() {
        return Err(PyValueError::new_err(format!(
            "layer_order is empty: it must list the layer group of each of the rank's layers, \
             or be None for the groups one after the other; got {}",
            shown(value)
        )));
    }
    Ok(LayerOrder { groups })
}

/// The ``connections`` argument of ``Sender.tcp`` and ``Receiver.tcp``: sockets per peer, 1 to
/// 255. ``ValueError`` for another integer (a negative one included), ``TypeError`` for a
/// non-integer.
pub(crate) fn connections(value: &Bound<'_, PyAny>) -> PyResult<usize> {
    const ACCEPTED: &str = "connections must be between 1 and 255";
    match value.extract::<u8>() {
        Ok(n) if n >= 1 => Ok(usize::from(n)),
        Err(e) if !e.is_instance_of::<PyOverflowError>(value.py()) => {
            Err(PyTypeError::new_err(format!(
                "{ACCEPTED}, got {} (type {})",
                shown(value),
                type_name(value)
            )))
        }
        _ => Err(PyValueError::new_err(format!(
            "{ACCEPTED}, got {}",
            shown(value)
        ))),
    }
}

/// Converters named after their argument, each as [`unsigned`] converts it.
macro_rules! named_unsigned {
    ($($name:ident: $t:ty),* $(,)?) => {
        $(
            #[doc = concat!("``", stringify!($name), "``.")]
            pub(crate) fn $name(value: &Bound<'_, PyAny>) -> PyResult<$t> {
                super::unsigned(value, stringify!($name))
            }
        )*
    };
}

/// The token counts of ``Sender.submit_chunk`` (``start``, ``end``, ``prompt_len``,
/// ``prepopulated_len``), for ``#[pyo3(from_py_with = ...)]`` (which hands a converter no
/// argument name).
pub(crate) mod chunk {
    use pyo3::prelude::*;

    named_unsigned!(start: u32, end: u32, prompt_len: u32, prepopulated_len: u32);
}

/// A sequence argument `name` whose items each convert as [`unsigned`] does, an item out of
/// range or of another type named by its index (``first_tokens[2] must be …``).
pub(crate) fn unsigned_items<T: Unsigned>(
    value: &Bound<'_, PyAny>,
    name: &str,
) -> PyResult<Vec<T>> {
    let items = value.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a sequence of integers, got {} (type {})",
            shown(value),
            type_name(value)
        ))
    })?;
    items
        .enumerate()
        .map(|(i, item)| unsigned(&item?, &format!("{name}[{i}]")))
        .collect()
}

/// A block run given as ``(first_ordinal, ids)`` (a registration's group, or a block source's
/// answer): ``TypeError`` saying `shape` for another shape, and the ordinal and each id
/// converted as [`unsigned`] does, named after `what`.
pub(crate) fn block_run(
    value: &Bound<'_, PyAny>,
    what: &str,
    shape: &str,
) -> PyResult<(u32, Vec<kvpipe_core::BlockId>)> {
    let (first, ids): (Bound<'_, PyAny>, Bound<'_, PyAny>) = value.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{shape}; got {} (type {})",
            shown(value),
            type_name(value)
        ))
    })?;
    let first = unsigned(&first, &format!("{what}'s first_ordinal"))?;
    let ids = unsigned_items::<u32>(&ids, &format!("{what}'s ids"))?;
    Ok((first, ids.into_iter().map(kvpipe_core::BlockId).collect()))
}

/// The integer fields of ``Pool`` and ``LayerGroup``.
pub(crate) mod layout {
    use pyo3::prelude::*;

    named_unsigned!(
        region: u32,
        layers: u16,
        slot_bytes: u64,
        layer_begin: u16,
        kv_heads: u16,
        head_dim: u16,
        elem_bytes: u8,
        tokens_per_block: u32,
        kv_factor: u8,
        model_layers: u16,
        first_layer: u16,
        model_kv_heads: u16,
        first_head: u16,
    );

    /// ``window``: ``None`` (full attention) or the window in tokens.
    pub(crate) fn window(value: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        if value.is_none() {
            return Ok(None);
        }
        super::unsigned(value, "window").map(Some)
    }
}

/// The aux data's arguments of ``Sender.submit_aux``, and ``Receiver.register``'s
/// ``aux_capacity``.
pub(crate) mod aux {
    use pyo3::prelude::*;

    named_unsigned!(prompt_tokens: u32, cached_tokens: u32, aux_capacity: u32);

    /// ``first_tokens``: the first generated token(s).
    pub(crate) fn first_tokens(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        super::unsigned_items(value, "first_tokens")
    }

    /// ``draft_tokens``: speculative tokens.
    pub(crate) fn draft_tokens(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        super::unsigned_items(value, "draft_tokens")
    }
}

/// Ids, for ``#[pyo3(from_py_with = ...)]``: each as [`unsigned`] converts it (a negative id
/// raises ``ValueError`` naming the argument, not a bare ``OverflowError``).
pub(crate) mod ids {
    use pyo3::prelude::*;
    use pyo3::types::PyString;

    /// ``request``: the request's id.
    pub(crate) fn request(value: &Bound<'_, PyAny>) -> PyResult<u64> {
        super::unsigned(value, "request")
    }

    /// ``peer``: a peer id from ``connect`` or a ``PeerReady`` event.
    pub(crate) fn peer(value: &Bound<'_, PyAny>) -> PyResult<u32> {
        super::unsigned(value, "peer")
    }

    /// ``instance``: the handshake's instance id, or ``None`` for the default.
    pub(crate) fn instance(value: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        if value.is_none() {
            return Ok(None);
        }
        super::unsigned(value, "instance").map(Some)
    }

    /// A list of peer ids named `name` (``receivers``, ``writers``), item by item.
    fn peers(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
        if value.is_instance_of::<PyString>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{name} must be a sequence of peer ids, got {}",
                super::shown(value)
            )));
        }
        value
            .try_iter()
            .map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "{name} must be a sequence of peer ids, got {} (type {})",
                    super::shown(value),
                    super::type_name(value)
                ))
            })?
            .enumerate()
            .map(|(i, item)| super::unsigned(&item?, &format!("{name}[{i}]")))
            .collect()
    }

    /// ``receivers`` of ``Sender.open_request``.
    pub(crate) fn receivers(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        peers(value, "receivers")
    }

    /// ``writers`` of ``Receiver.register``.
    pub(crate) fn writers(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        peers(value, "writers")
    }
}
