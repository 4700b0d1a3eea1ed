//! [`Fence`]: the point a stream's queued work has reached, for copies to wait on the GPU.
//!
//! A serving engine hands a layer range over while the GPU may still be computing it (vLLM
//! calls `save_kv_layer` as it queues the layer's kernels, not when they ran). Waiting for that
//! on the host puts a round trip on the tail: the host sees the compute done, then issues the
//! copy, then the GPU starts it. A copy queued behind a fence (`cuStreamWaitEvent`) starts on the
//! GPU the moment the compute ends, with its issue already paid for.

use std::time::Instant;

use cudarc::driver::{result, sys};

use crate::poll::{event_done, poll_until};
use crate::{CudaError, Device};

/// The work queued on one stream when the fence was recorded (a CUDA event recorded behind
/// it): done once all of that work has run. Copies submitted with
/// [`CopyEngine::submit_after`](crate::CopyEngine::submit_after) start only then.
#[derive(Debug)]
pub struct Fence {
    device: Device,
    event: sys::CUevent,
}

// SAFETY: the fence owns its event; every call on it binds its device's context first, and the
// driver API may be called from any thread.
unsafe impl Send for Fence {}

// SAFETY: querying an event (`&self`) or making a stream wait on it does not change it.
unsafe impl Sync for Fence {}

impl Fence {
    /// Records a fence behind the work queued so far on `stream` of `device`: a raw `CUstream`
    /// of the device's primary context (PyTorch's `torch.cuda.Stream.cuda_stream`, for
    /// one), or 0 for the legacy default stream.
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a live stream of `device`'s primary context.
    pub unsafe fn record(device: &Device, stream: u64) -> Result<Fence, CudaError> {
        device.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(CudaError::driver("cuEventCreate"))?;
        let fence = Fence {
            device: device.clone(),
            event,
        };
        // SAFETY: a fresh event of the current context; the caller vouches for the stream.
        unsafe { result::event::record(event, stream as sys::CUstream) }
            .map_err(CudaError::driver("cuEventRecord"))?;
        Ok(fence)
    }

    /// [`record`](Self::record) on GPU `ordinal`, opened here (an engine that holds no
    /// [`Device`] of its own: a framework's stream and its device index).
    ///
    /// # Safety
    ///
    /// As for [`record`](Self::record).
    pub unsafe fn on_stream(ordinal: usize, stream: u64) -> Result<Fence, CudaError> {
        let device = Device::open(ordinal)?;
        // SAFETY: forwarded.
        unsafe { Fence::record(&device, stream) }
    }

    /// The GPU whose stream the fence was recorded on.
    pub fn ordinal(&self) -> usize {
        self.device.ordinal()
    }

    /// Whether the work before the fence has run (`cuEventQuery`; never blocks). Work that
    /// failed on the device is an error.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.device.bind()?;
        // SAFETY: the event is this fence's own and live; its context was made current above.
        unsafe { event_done(self.event) }
    }

    /// Polls until the work before the fence has run or `deadline` passes (then
    /// [`CudaError::Timeout`]). Spins for the first tenth of a millisecond, then sleeps in
    /// short steps.
    pub fn wait(&self, deadline: Instant) -> Result<(), CudaError> {
        poll_until(deadline, || self.is_done())
    }

    /// Makes `stream` (of the current context) wait for the fence before its later work.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the context that is current on this thread.
    pub(crate) unsafe fn hold(&self, stream: sys::CUstream) -> Result<(), CudaError> {
        // SAFETY: the event is live (this fence holds it); the caller vouches for the stream.
        // An event of another device is allowed.
        unsafe {
            result::stream::wait_event(
                stream,
                self.event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(CudaError::driver("cuStreamWaitEvent"))
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `record`, destroyed once. A stream may still wait on it: the
            // driver releases the event once it completed, and the wait keeps what it captured.
            let _ = unsafe { result::event::destroy(self.event) };
        }
    }
}
