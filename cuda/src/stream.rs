//! [`Stream`]: a plain stream for baselines — what a hand-written copy loop does, to measure
//! the copy engine against.

use cudarc::driver::{result, sys};

use crate::{CudaError, Device};

/// A plain stream, for baselines: one `cuMemcpyDtoDAsync` per call, in order, and a stream
/// synchronize at the end (what a hand-written copy loop does).
#[derive(Debug)]
pub struct Stream {
    device: Device,
    stream: sys::CUstream,
}

// SAFETY: as for `CopyEngine`: the stream is owned, every call binds the context first.
unsafe impl Send for Stream {}

impl Stream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<Stream, CudaError> {
        device.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(CudaError::driver("cuStreamCreate"))?;
        Ok(Stream {
            device: device.clone(),
            stream,
        })
    }

    /// Enqueues `cuMemcpyDtoDAsync(dst, src, len)`.
    ///
    /// # Safety
    ///
    /// `src..src + len` and `dst..dst + len` are device memory of this device, valid and
    /// untouched by anything else until [`synchronize`](Self::synchronize) returns.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: forwarded; the caller vouches for both ranges.
        unsafe { result::memcpy_dtod_async(dst, src, len, self.stream) }
            .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }

    /// Waits for everything enqueued on this stream (`cuStreamSynchronize`).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: a live stream of this device.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::stream::destroy(self.stream) };
        }
    }
}
