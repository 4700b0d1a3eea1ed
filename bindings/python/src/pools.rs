//! KV pools from Python objects: any C-contiguous buffer, used in place.

use std::ffi::c_void;

use kvpipe::RawRegion;
use kvpipe_core::RegionId;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The buffers a node's regions point into. Holding a buffer keeps its exporting object alive
/// (and, for numpy, unable to resize); dropping it releases the view.
pub(crate) struct Pools {
    _buffers: Vec<PyUntypedBuffer>,
}

/// The regions of a `{region id: buffer}` mapping. The decode side writes into its pools, so
/// `writable` pools must not be read-only.
pub(crate) fn pools(
    given: &Bound<'_, PyDict>,
    writable: bool,
) -> PyResult<(Vec<RawRegion>, Pools)> {
    let mut regions = Vec::with_capacity(given.len());
    let mut buffers = Vec::with_capacity(given.len());
    for (key, value) in given.iter() {
        let id: u32 = key.extract()?;
        let buffer = PyUntypedBuffer::get(&value)?;
        if !buffer.is_c_contiguous() {
            return Err(PyBufferError::new_err(format!(
                "pool {id} is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray \
                 copies, which would leave the engine's own pool untouched)"
            )));
        }
        if writable && buffer.readonly() {
            return Err(PyBufferError::new_err(format!(
                "pool {id} is read-only, but the decode side writes the received KV into it"
            )));
        }
        let ptr: *mut c_void = buffer.buf_ptr();
        regions.push(RawRegion {
            id: RegionId(id),
            ptr: ptr.cast(),
            len: buffer.len_bytes(),
            device: None,
        });
        buffers.push(buffer);
    }
    Ok((regions, Pools { _buffers: buffers }))
}
