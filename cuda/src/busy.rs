//! [`BusyKernel`]: a stand-in for a model's compute in demos and benches — a kernel that keeps
//! the GPU busy for a given time, and an event that says when it is over.
//!
//! A serving engine's GPU is busy while prefill runs: the layers after the one whose KV is
//! being sent are being computed. A simulated compute that only sleeps on the host leaves the
//! GPU idle instead, and a GPU that sat idle for milliseconds starts the next copy tens of
//! microseconds later than a busy one (docs/PERFORMANCE.md, "Run 4"). The kernel is one thread
//! spinning on `%globaltimer`, in PTX (`crate::ptx`).

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use crate::poll::event_done;
use crate::ptx::Kernel;
use crate::{CudaError, Device, Fence};

/// `kvpipe_busy(u64 ns)`: one thread spins until the GPU's global timer has advanced `ns`
/// nanoseconds from the kernel's start.
const PTX: &str = r#"
.version 6.0
.target sm_60
.address_size 64

.visible .entry kvpipe_busy(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
spin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p, %rd4, %rd3;
    @%p bra spin;
    ret;
}
"#;

/// A one-thread kernel that keeps its GPU busy for a given time, on a stream of its own, with
/// an event recorded after each launch (see the module doc).
#[derive(Debug)]
pub struct BusyKernel {
    device: Device,
    kernel: Kernel,
    stream: sys::CUstream,
    done: sys::CUevent,
}

// SAFETY: the module, stream and event are owned by this value, and every call binds the
// device's context first, so the handles may move to another thread.
unsafe impl Send for BusyKernel {}

impl BusyKernel {
    /// Loads the kernel on `device` and makes its stream and event.
    pub fn new(device: &Device) -> Result<BusyKernel, CudaError> {
        device.bind()?;
        let kernel = Kernel::load(PTX, "kvpipe_busy")?;
        let made = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(CudaError::driver("cuStreamCreate"))
            .and_then(|stream| {
                match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                    Ok(done) => Ok((stream, done)),
                    Err(e) => {
                        // SAFETY: created just above, destroyed once.
                        let _ = unsafe { result::stream::destroy(stream) };
                        Err(CudaError::driver("cuEventCreate")(e))
                    }
                }
            });
        match made {
            Ok((stream, done)) => Ok(BusyKernel {
                device: device.clone(),
                kernel,
                stream,
                done,
            }),
            Err(e) => {
                // SAFETY: loaded above; nothing of it ran.
                unsafe { kernel.unload() };
                Err(e)
            }
        }
    }

    /// Enqueues the kernel for `busy` of GPU time, then the event [`is_done`](Self::is_done)
    /// watches. Launches queue behind each other on the kernel's stream. Dropping the value
    /// does not wait for them.
    pub fn launch(&mut self, busy: std::time::Duration) -> Result<(), CudaError> {
        self.device.bind()?;
        let mut ns: u64 = busy.as_nanos().try_into().unwrap_or(u64::MAX);
        let mut params = [&mut ns as *mut u64 as *mut c_void];
        // SAFETY: the function belongs to this value's module, its one parameter is the u64
        // `ns`, read at the launch (the driver copies kernel parameters before returning),
        // and the stream is this value's own.
        unsafe {
            result::launch_kernel(
                self.kernel.function,
                (1, 1, 1),
                (1, 1, 1),
                0,
                self.stream,
                &mut params,
            )
        }
        .map_err(CudaError::driver("cuLaunchKernel"))?;
        // SAFETY: the event and the stream are this value's own and live.
        unsafe { result::event::record(self.done, self.stream) }
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// A [`Fence`] behind every launch so far: copies submitted after it start when the
    /// simulated compute is over, as a serving engine's copies queued behind its forward pass.
    pub fn fence(&self) -> Result<Fence, CudaError> {
        // SAFETY: the stream is this value's own, a live stream of its device's primary
        // context.
        unsafe { Fence::record(&self.device, self.stream as u64) }
    }

    /// Whether every launch so far has finished (`cuEventQuery`; true before the first).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.device.bind()?;
        // SAFETY: the event is this value's own and live; its context was made current above.
        unsafe { event_done(self.done) }
    }
}

impl Drop for BusyKernel {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // Dropping never waits for a launch (it may have been asked to run for hours):
            // the stream and the event are released when their work is done, and the module
            // is unloaded only when no launch runs any more (else it stays loaded, a few KiB).
            let idle = self.is_done().unwrap_or(false);
            // SAFETY: each handle was made in `new` and is released once; the module goes
            // only when every launch on the stream has finished.
            unsafe {
                let _ = result::event::destroy(self.done);
                let _ = result::stream::destroy(self.stream);
                if idle {
                    self.kernel.unload();
                }
            }
        }
    }
}
