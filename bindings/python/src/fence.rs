//! `after=`: a chunk handed over while the GPU may still be computing it. The stream given
//! (a `torch.cuda.Stream`, or anything with `cuda_stream` and `device_index`) gets a
//! [`kvpipe::Fence`] recorded behind the work queued on it so far; the chunk's copies wait for
//! it (see `PrefillNode::submit_chunk_layers_after`).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// The fence a submission waits for (never made without the `cuda` feature).
#[cfg(feature = "cuda")]
pub(crate) type After = std::sync::Arc<kvpipe::Fence>;
/// The fence a submission waits for (never made without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub(crate) enum After {}

/// The stream's raw handle and its GPU, or a `TypeError` that says what is expected.
fn stream_of(stream: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
    let wrong = || {
        PyTypeError::new_err(format!(
            "after must be a CUDA stream (torch.cuda.Stream, or an object with integer \
             cuda_stream and device_index attributes), not {}",
            stream
                .get_type()
                .name()
                .map_or_else(|_| "this object".to_string(), |n| n.to_string())
        ))
    };
    let handle = stream
        .getattr_opt("cuda_stream")?
        .ok_or_else(wrong)?
        .extract::<u64>()
        .map_err(|_| wrong())?;
    let device = stream
        .getattr_opt("device_index")?
        .ok_or_else(wrong)?
        .extract::<usize>()
        .map_err(|_| wrong())?;
    Ok((handle, device))
}

/// A fence behind the work queued so far on `stream`.
#[cfg(feature = "cuda")]
pub(crate) fn after(stream: &Bound<'_, PyAny>) -> PyResult<After> {
    let (handle, ordinal) = stream_of(stream)?;
    // SAFETY: the object says it is a CUDA stream of GPU `ordinal`; a stream of the framework
    // lives in that device's primary context, which kvpipe uses too. A handle that is no live
    // stream is the caller's bug, as with torch's own raw-stream calls.
    let fence = unsafe { kvpipe::Fence::on_stream(ordinal, handle) }
        .map_err(|e| crate::errors::to_py(kvpipe::EmbedError::Fence(e.to_string())))?;
    Ok(std::sync::Arc::new(fence))
}

/// Without the `cuda` feature no fence can be made: a clear error (after the argument's own
/// check, so a wrong type reads the same in every build).
#[cfg(not(feature = "cuda"))]
pub(crate) fn after(stream: &Bound<'_, PyAny>) -> PyResult<After> {
    stream_of(stream)?;
    Err(crate::errors::TransportError::new_err(
        "after= needs GPU support, and this build of kvpipe has none (it was built without its \
         `cuda` feature)",
    ))
}
