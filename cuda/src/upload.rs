//! [`Uploader`]: host → device uploads of many pieces through one page-locked staging buffer on
//! one stream, waited for once.
//!
//! [`DeviceBuffer::upload`] makes a stream, copies from pageable memory (the driver stages it
//! through its own page-locked buffers, on the calling thread and under the driver's locks),
//! waits, and destroys the stream, for every call. That is fine once, but an engine model that
//! uploads a layer range's 16 blocks as 16 calls while the transport's thread issues and polls
//! copies makes that thread wait on the driver. Here the bytes are copied into page-locked
//! staging with a plain `memcpy`, each piece goes out as an asynchronous DMA on the uploader's
//! own stream, and the stream is waited for only when the staging is full or the caller is
//! done ([`finish`](Uploader::finish)).

use cudarc::driver::{result, sys};

use crate::memory::check_range;
use crate::{CudaError, DeviceBuffer, PinnedBuffer};

/// Host → device uploads through page-locked staging (see the module doc).
#[derive(Debug)]
pub struct Uploader {
    stream: sys::CUstream,
    staging: PinnedBuffer,
    /// Bytes of `staging` holding pieces whose DMA may still be running.
    used: usize,
}

// SAFETY: the stream and the staging are owned; every driver call binds the context first, and
// the driver API may be called from any thread.
unsafe impl Send for Uploader {}

impl Uploader {
    /// An uploader for `device` with `staging` bytes (at least one) of page-locked memory:
    /// uploads larger than that go out in pieces, waiting for the staging in between.
    pub fn new(device: &crate::Device, staging: usize) -> Result<Uploader, CudaError> {
        let staging = PinnedBuffer::new(device, staging.max(1))?;
        device.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(CudaError::driver("cuStreamCreate"))?;
        Ok(Uploader {
            stream,
            staging,
            used: 0,
        })
    }

    /// Queues a copy of `src` to bytes `offset..offset + src.len()` of `dst`, a buffer of the
    /// uploader's device ([`CudaError::WrongDevice`] otherwise). `src` is copied into the
    /// staging before this returns (it may change afterwards). The bytes are in device memory
    /// once [`finish`](Self::finish) returned: until then the copy may still be running, and
    /// nothing else may read or write that range of `dst` (the borrow of `dst` ends with this
    /// call, the copy does not).
    pub fn upload(
        &mut self,
        dst: &mut DeviceBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<(), CudaError> {
        check_range(offset, src.len(), dst.len())?;
        let (expected, got) = (self.staging.device().ordinal(), dst.device().ordinal());
        if expected != got {
            return Err(CudaError::WrongDevice { expected, got });
        }
        dst.device().bind()?;
        let mut done = 0;
        while done < src.len() {
            if self.used == self.staging.len() {
                self.finish()?;
            }
            let n = (src.len() - done).min(self.staging.len() - self.used);
            let at = self.used;
            self.staging.as_mut_slice()[at..at + n].copy_from_slice(&src[done..done + n]);
            let target = dst.ptr() + (offset + done) as u64;
            // SAFETY: `target..target + n` lies inside `dst` (checked above); the staging bytes
            // `at..at + n` are not written again until the stream was waited for (`finish`,
            // which every reuse of the staging and `drop` call first).
            unsafe {
                result::memcpy_htod_async(target, &self.staging.as_slice()[at..at + n], self.stream)
            }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
            self.used += n;
            done += n;
        }
        Ok(())
    }

    /// Waits until every queued upload is in device memory.
    pub fn finish(&mut self) -> Result<(), CudaError> {
        if self.used == 0 {
            return Ok(());
        }
        self.staging.device().bind()?;
        // SAFETY: a live stream of this device.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(CudaError::driver("cuStreamSynchronize"))?;
        self.used = 0;
        Ok(())
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // The staging is freed after this: no DMA may still read it.
        let _ = self.finish();
        if self.staging.device().bind().is_ok() {
            // SAFETY: created in `new`, destroyed once; its work is done (waited for above).
            let _ = unsafe { result::stream::destroy(self.stream) };
        }
    }
}
