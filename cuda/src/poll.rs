//! Asking an event whether its work ran, and polling until it did: what tickets, fences and
//! the busy kernel share.

use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use crate::CudaError;

/// Whether `event` has completed (`cuEventQuery`; never blocks). Work that failed on the
/// device is an error.
///
/// # Safety
///
/// `event` is a live event, its context current on this thread.
pub(crate) unsafe fn event_done(event: sys::CUevent) -> Result<bool, CudaError> {
    // SAFETY: forwarded from the caller.
    match unsafe { result::event::query(event) } {
        Ok(()) => Ok(true),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(CudaError::driver("cuEventQuery")(e)),
    }
}

/// Polls `done` until it holds or `deadline` passes (then [`CudaError::Timeout`]). Spins for the
/// first tenth of a millisecond, then sleeps in short steps.
pub(crate) fn poll_until(
    deadline: Instant,
    mut done: impl FnMut() -> Result<bool, CudaError>,
) -> Result<(), CudaError> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CudaError::Timeout {
                waited_ms: (now - start).as_millis() as u64,
            });
        }
        if now - start < Duration::from_micros(100) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep((deadline - now).min(Duration::from_micros(20)));
        }
    }
}
