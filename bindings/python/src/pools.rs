//! KV pools from Python objects, used in place: host buffers (the buffer protocol), DLPack
//! tensors (host or GPU) and CUDA arrays (`__cuda_array_interface__`).
//!
//! Each pool value is tried in this order:
//!
//! 1. **The buffer protocol** (numpy arrays, `bytearray`, `mmap`): host memory; C-contiguous,
//!    and writable for a decode pool.
//! 2. **DLPack** (`__dlpack__` and `__dlpack_device__`: torch tensors, CuPy, JAX): where the
//!    memory is comes from `__dlpack_device__` (CPU and CUDA pinned host memory: a host pool;
//!    CUDA and CUDA managed memory: a device pool on that GPU); the address, shape and strides
//!    from the capsule, which is held (not consumed), so the producer frees the tensor only once
//!    the node lets go of it. A versioned capsule's read-only flag refuses a decode pool, its
//!    copied flag any pool (writes would land in a copy).
//! 3. **`__cuda_array_interface__`** (versions 2 and 3): a device pool; the object must also
//!    say which GPU holds it through `__dlpack_device__`, since the interface does not.
//!
//! The byte length is elements × item size; strides must describe a C-contiguous buffer (or be
//! absent); a decode pool must be writable. kvpipe synchronises no stream when it takes a pool:
//! the engine submits a chunk only once its KV is computed.

use std::ffi::{c_void, CStr};

use kvpipe::RawRegion;
use kvpipe_core::RegionId;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

/// What keeps one pool's memory alive and exported while its node exists.
enum Held {
    /// A buffer-protocol view (for numpy, it also keeps the array from resizing).
    Buffer { _view: PyUntypedBuffer },
    /// The pool object, and the DLPack capsule taken from it (dropping the last reference to
    /// the capsule lets the producer free what it exported).
    Object {
        _object: Py<PyAny>,
        _capsule: Option<Py<PyAny>>,
    },
}

/// The objects a node's regions point into. Dropping it releases them.
pub(crate) struct Pools {
    _held: Vec<Held>,
}

/// The regions of a `{region id: pool}` mapping. The decode side writes into its pools, so
/// `writable` pools must not be read-only.
pub(crate) fn pools(
    given: &Bound<'_, PyDict>,
    writable: bool,
) -> PyResult<(Vec<RawRegion>, Pools)> {
    let mut regions = Vec::with_capacity(given.len());
    let mut held = Vec::with_capacity(given.len());
    for (key, value) in given.iter() {
        let id: u32 = key.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "a pool's key is its region id, an integer from 0 to {}; got {}",
                u32::MAX,
                key.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?;
        let (pool, keep) = pool(id, &value, writable)?;
        regions.push(RawRegion {
            id: RegionId(id),
            ptr: pool.ptr as *mut u8,
            len: pool.len,
            device: pool.device,
        });
        held.push(keep);
    }
    Ok((regions, Pools { _held: held }))
}

/// Where one pool's bytes are.
struct Memory {
    ptr: usize,
    len: usize,
    device: Option<u32>,
}

fn pool(id: u32, value: &Bound<'_, PyAny>, writable: bool) -> PyResult<(Memory, Held)> {
    // SAFETY: `value` is a live object and the GIL is held (the `Bound`).
    if unsafe { pyo3::ffi::PyObject_CheckBuffer(value.as_ptr()) } == 1 {
        return host_buffer(id, value, writable);
    }
    if let Some(export) = value.getattr_opt("__dlpack__")? {
        let place = dlpack_device(id, value)?
            .ok_or_else(|| missing(id, value, "has __dlpack__ but no __dlpack_device__"))?;
        return dlpack(id, value, &export, place, writable);
    }
    if let Some(cai) = value.getattr_opt("__cuda_array_interface__")? {
        let ordinal = match dlpack_device(id, value)? {
            Some(Place::Device(ordinal)) => ordinal,
            Some(Place::Host) => {
                return Err(PyValueError::new_err(format!(
                    "pool {id} has __cuda_array_interface__ (GPU memory), but its \
                     __dlpack_device__ says host memory"
                )))
            }
            None => {
                return Err(missing(
                    id,
                    value,
                    "has __cuda_array_interface__, which does not say which GPU holds it, and \
                     no __dlpack_device__ that would",
                ))
            }
        };
        let (ptr, len) = cuda_array(id, &cai, writable)?;
        let memory = Memory {
            ptr,
            len,
            device: Some(ordinal),
        };
        let keep = Held::Object {
            _object: value.clone().unbind(),
            _capsule: None,
        };
        return Ok((memory, keep));
    }
    Err(missing(
        id,
        value,
        "is neither a buffer (a numpy array), a DLPack tensor (__dlpack__) nor a CUDA array \
         (__cuda_array_interface__)",
    ))
}

fn missing(id: u32, value: &Bound<'_, PyAny>, what: &str) -> PyErr {
    let ty = value
        .get_type()
        .name()
        .map_or_else(|_| "object".into(), |n| n.to_string());
    PyTypeError::new_err(format!("pool {id} (a {ty}) {what}"))
}

fn host_buffer(id: u32, value: &Bound<'_, PyAny>, writable: bool) -> PyResult<(Memory, Held)> {
    let buffer = PyUntypedBuffer::get(value)?;
    if !buffer.is_c_contiguous() {
        return Err(not_contiguous(id));
    }
    if writable && buffer.readonly() {
        return Err(read_only(id));
    }
    let ptr: *mut c_void = buffer.buf_ptr();
    let memory = Memory {
        ptr: ptr as usize,
        len: buffer.len_bytes(),
        device: None,
    };
    Ok((memory, Held::Buffer { _view: buffer }))
}

fn not_contiguous(id: u32) -> PyErr {
    PyBufferError::new_err(format!(
        "pool {id} is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray or \
         .contiguous() copies, which would leave the engine's own pool untouched)"
    ))
}

fn read_only(id: u32) -> PyErr {
    PyBufferError::new_err(format!(
        "pool {id} is read-only, but the decode side writes the received KV into it"
    ))
}

/// Host memory, or memory on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Host,
    Device(u32),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Host => f.write_str("host memory"),
            Place::Device(ordinal) => write!(f, "GPU {ordinal}"),
        }
    }
}

// DLPack device types (dlpack.h's DLDeviceType).
const DL_CPU: i64 = 1;
const DL_CUDA: i64 = 2;
const DL_CUDA_HOST: i64 = 3;
const DL_CUDA_MANAGED: i64 = 13;

fn place(id: u32, device_type: i64, device_id: i64) -> PyResult<Place> {
    match device_type {
        DL_CPU | DL_CUDA_HOST => Ok(Place::Host),
        DL_CUDA | DL_CUDA_MANAGED => u32::try_from(device_id).map(Place::Device).map_err(|_| {
            PyValueError::new_err(format!(
                "pool {id} is on CUDA device {device_id}, which is not a device ordinal"
            ))
        }),
        other => Err(PyValueError::new_err(format!(
            "pool {id} lives on DLPack device type {other}; kvpipe takes host memory (1: CPU, \
             3: CUDA pinned host) and CUDA memory (2: CUDA, 13: CUDA managed)"
        ))),
    }
}

/// The place `__dlpack_device__()` names, or `None` when the object has no such method.
fn dlpack_device(id: u32, value: &Bound<'_, PyAny>) -> PyResult<Option<Place>> {
    let Some(method) = value.getattr_opt("__dlpack_device__")? else {
        return Ok(None);
    };
    let answer = method.call0()?;
    let (device_type, device_id): (i64, i64) = answer.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "pool {id}: __dlpack_device__() must return (device_type, device_id), two integers; \
             got {}",
            answer.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })?;
    place(id, device_type, device_id).map(Some)
}

/// Whether `strides` lay `shape` out C-contiguously, with `item` the step of the last
/// dimension in the strides' unit (bytes or items): a dimension of extent 1 may have any
/// stride, and an empty array is contiguous.
fn c_contiguous(shape: &[u64], strides: &[i64], item: u64) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = item;
    for (&n, &stride) in shape.iter().zip(strides).rev() {
        if n != 1 && u64::try_from(stride).ok() != Some(expected) {
            return false;
        }
        expected = expected.saturating_mul(n);
    }
    true
}

/// The bytes of `shape` elements of `item` bytes, or why they do not fit in memory.
fn byte_len(id: u32, shape: &[u64], item: u64) -> PyResult<usize> {
    shape
        .iter()
        .try_fold(item, |acc, &n| acc.checked_mul(n))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "pool {id}: shape {shape:?} of {item}-byte items is larger than memory"
            ))
        })
}

/// The address and byte length of a `__cuda_array_interface__` dict (versions 2 and 3).
fn cuda_array(id: u32, cai: &Bound<'_, PyAny>, writable: bool) -> PyResult<(usize, usize)> {
    let bad =
        |what: String| PyValueError::new_err(format!("pool {id}: __cuda_array_interface__ {what}"));
    let cai = cai.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "pool {id}: __cuda_array_interface__ must be a dict, got a {}",
            cai.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(name)?
            .ok_or_else(|| bad(format!("has no {name:?} entry")))
    };
    let version: i64 = field("version")?
        .extract()
        .map_err(|_| bad("\"version\" is not an integer".into()))?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!(
            "is version {version}; kvpipe reads versions 2 and 3"
        )));
    }
    let shape: Vec<i64> = field("shape")?
        .extract()
        .map_err(|_| bad("\"shape\" is not a tuple of integers".into()))?;
    let shape = shape
        .iter()
        .map(|&n| u64::try_from(n))
        .collect::<Result<Vec<u64>, _>>()
        .map_err(|_| bad(format!("\"shape\" {shape:?} has a negative extent")))?;
    let typestr: String = field("typestr")?
        .extract()
        .map_err(|_| bad("\"typestr\" is not a string".into()))?;
    let item = item_size(&typestr).map_err(bad)?;
    let (ptr, readonly): (u64, bool) = field("data")?
        .extract()
        .map_err(|_| bad("\"data\" is not (pointer, read_only): an integer and a bool".into()))?;
    if let Some(mask) = cai.get_item("mask")? {
        if !mask.is_none() {
            return Err(bad(
                "has a mask; a KV pool is a plain array, every element valid".into(),
            ));
        }
    }
    if let Some(strides) = cai.get_item("strides")? {
        if !strides.is_none() {
            let strides: Vec<i64> = strides
                .extract()
                .map_err(|_| bad("\"strides\" is neither None nor a tuple of integers".into()))?;
            if strides.len() != shape.len() {
                return Err(bad(format!(
                    "has {} strides for {} dimensions",
                    strides.len(),
                    shape.len()
                )));
            }
            if !c_contiguous(&shape, &strides, item) {
                return Err(not_contiguous(id));
            }
        }
    }
    if writable && readonly {
        return Err(read_only(id));
    }
    let len = byte_len(id, &shape, item)?;
    let ptr = usize::try_from(ptr).map_err(|_| bad(format!("address {ptr:#x} is too large")))?;
    Ok((ptr, len))
}

/// The item size of an array-interface type string (`"<f2"`, `"|u1"`, `"<V16"`).
fn item_size(typestr: &str) -> Result<u64, String> {
    let mut chars = typestr.chars();
    let (order, kind) = (chars.next(), chars.next());
    let digits = chars.as_str();
    let size = digits.parse::<u64>().ok().filter(|&n| n > 0);
    match (order, kind, size) {
        (
            Some('<' | '>' | '|' | '='),
            Some('b' | 'i' | 'u' | 'f' | 'c' | 'm' | 'M' | 'S' | 'V'),
            Some(n),
        ) => Ok(n),
        (Some('<' | '>' | '|' | '='), Some('U'), Some(n)) => n
            .checked_mul(4)
            .ok_or_else(|| format!("typestr {typestr:?} is too large")),
        _ => Err(format!(
            "typestr {typestr:?} is not a plain type: an order (<, >, |), a kind (b, i, u, f, c, \
             m, M, S, U, V) and a size in bytes"
        )),
    }
}

/// dlpack.h's `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// dlpack.h's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// dlpack.h's `DLTensor`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// dlpack.h's `DLManagedTensor` (the legacy capsule, named `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// dlpack.h's `DLManagedTensorVersioned` (DLPack 1.x, named `dltensor_versioned`).
#[repr(C)]
struct DlManagedTensorVersioned {
    major: u32,
    minor: u32,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const FLAG_READ_ONLY: u64 = 1 << 0;
const FLAG_IS_COPIED: u64 = 1 << 1;
/// More dimensions than any array library makes; a larger count is a broken capsule.
const MAX_DIMS: i32 = 64;

/// A DLPack pool: `__dlpack__(max_version=(1, 1))`, or `__dlpack__()` from a producer that
/// predates DLPack 1.0 (its capsule cannot say it is read-only).
fn dlpack(
    id: u32,
    value: &Bound<'_, PyAny>,
    export: &Bound<'_, PyAny>,
    place_said: Place,
    writable: bool,
) -> PyResult<(Memory, Held)> {
    let py = value.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", PyTuple::new(py, [1u32, 1])?)?;
    let capsule = match export.call((), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => export.call0()?,
        Err(e) => return Err(e),
    };
    let bad = |what: String| PyValueError::new_err(format!("pool {id}: __dlpack__() {what}"));
    let cap = capsule.cast::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err(format!(
            "pool {id}: __dlpack__() must return a DLPack capsule, got a {}",
            capsule
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    let (tensor, flags) = if let Ok(ptr) = cap.pointer_checked(Some(VERSIONED)) {
        // SAFETY: a capsule named `dltensor_versioned` holds a `DLManagedTensorVersioned`
        // (DLPack's contract), alive while the capsule is (held by `capsule` here).
        let managed = unsafe { &*ptr.as_ptr().cast::<DlManagedTensorVersioned>() };
        if managed.major != 1 {
            return Err(bad(format!(
                "gave a DLPack {}.{} tensor; kvpipe reads DLPack 1.x",
                managed.major, managed.minor
            )));
        }
        (managed.dl_tensor, managed.flags)
    } else if let Ok(ptr) = cap.pointer_checked(Some(LEGACY)) {
        // SAFETY: a capsule named `dltensor` holds a `DLManagedTensor` (DLPack's contract),
        // alive while the capsule is.
        let managed = unsafe { &*ptr.as_ptr().cast::<DlManagedTensor>() };
        (managed.dl_tensor, 0)
    } else {
        let name = cap.name().ok().flatten().map_or_else(
            || "no name".into(),
            // SAFETY: the name of a live capsule is a valid C string while it lives.
            |n| format!("{:?}", unsafe { n.as_cstr() }.to_string_lossy()),
        );
        return Err(bad(format!(
            "gave a capsule with {name}, not an unconsumed \"dltensor\" or \
             \"dltensor_versioned\" (was it already used?)"
        )));
    };
    if flags & FLAG_IS_COPIED != 0 {
        return Err(bad(
            "exported a copy; a pool must be used in place (the node would read or write the \
             copy, not the engine's pool)"
                .into(),
        ));
    }
    if writable && flags & FLAG_READ_ONLY != 0 {
        return Err(read_only(id));
    }
    let t = tensor;
    let said = place(id, t.device.device_type.into(), t.device.device_id.into())?;
    if said != place_said {
        return Err(bad(format!(
            "gave a tensor in {said}, but __dlpack_device__() says {place_said}"
        )));
    }
    if !(0..=MAX_DIMS).contains(&t.ndim) {
        return Err(bad(format!("gave a tensor with {} dimensions", t.ndim)));
    }
    if t.ndim > 0 && t.shape.is_null() {
        return Err(bad(format!(
            "gave a tensor of {} dimensions without a shape",
            t.ndim
        )));
    }
    let ndim = t.ndim as usize;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: a DLTensor's `shape` points to `ndim` extents, alive with the capsule.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape = shape
        .iter()
        .map(|&n| u64::try_from(n))
        .collect::<Result<Vec<u64>, _>>()
        .map_err(|_| {
            bad(format!(
                "gave a tensor of shape {shape:?}, with a negative extent"
            ))
        })?;
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if bits == 0 || bits % 8 != 0 {
        return Err(bad(format!(
            "gave items of {} bits × {} lanes; a pool's items are whole bytes",
            t.dtype.bits, t.dtype.lanes
        )));
    }
    let item = bits / 8;
    if ndim > 0 && !t.strides.is_null() {
        // SAFETY: a non-null `strides` points to `ndim` strides (in items), alive with the
        // capsule.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        if !c_contiguous(&shape, strides, 1) {
            return Err(not_contiguous(id));
        }
    }
    let len = byte_len(id, &shape, item)?;
    let ptr = (t.data as usize)
        .checked_add(usize::try_from(t.byte_offset).unwrap_or(usize::MAX))
        .ok_or_else(|| bad("gave an address past the end of memory".into()))?;
    let memory = Memory {
        ptr,
        len,
        device: match said {
            Place::Host => None,
            Place::Device(ordinal) => Some(ordinal),
        },
    };
    let keep = Held::Object {
        _object: value.clone().unbind(),
        _capsule: Some(capsule.unbind()),
    };
    Ok((memory, keep))
}
