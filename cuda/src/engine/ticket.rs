//! [`CopyTicket`]: the copies of one submission, polled or waited on through their events.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys};

use super::events::EventPool;
use crate::poll::{event_done, poll_until};
use crate::{CudaError, Device};

/// The copies of one [`CopyEngine::submit`]: done when every event it holds has completed.
///
/// [`CopyEngine::submit`]: super::CopyEngine::submit
#[derive(Debug)]
#[must_use = "the copies may still be running: poll or wait on the ticket before reusing their memory"]
pub struct CopyTicket {
    pub(super) events: Vec<(Device, sys::CUevent)>,
    /// Where completed events go when the ticket is dropped (`None`: destroyed).
    pub(super) pool: Option<Arc<EventPool>>,
    pub(super) bytes: u64,
    pub(super) copies: usize,
}

// SAFETY: the ticket owns its events; every call on one binds its device's context first, and
// the driver API may be called from any thread.
unsafe impl Send for CopyTicket {}

// SAFETY: querying an event (`&self`) does not change it.
unsafe impl Sync for CopyTicket {}

impl CopyTicket {
    /// Bytes the submission copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Driver copies issued (extents after merging contiguous ones; a strided run counts once).
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// Whether every copy has finished (`cuEventQuery`; never blocks). A copy that failed on
    /// the device is an error.
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        for (device, event) in &self.events {
            device.bind()?;
            // SAFETY: an event created and recorded by the engine, destroyed only in `drop`;
            // its device's context was made current above.
            if !unsafe { event_done(*event) }? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Polls until every copy has finished or `deadline` passes (then
    /// [`CudaError::Timeout`]; the copies keep running). Spins for the first tenth of a
    /// millisecond, then sleeps in short steps.
    pub fn wait(&self, deadline: Instant) -> Result<(), CudaError> {
        poll_until(deadline, || self.is_complete())
    }
}

impl Drop for CopyTicket {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            // Recording an event again replaces what it captured, and this ticket, the only
            // one that looked at it, is gone: the next submission can use it as it is.
            for (device, event) in std::mem::take(&mut self.events) {
                pool.put(device, event);
            }
            return;
        }
        for (device, event) in &self.events {
            if device.bind().is_ok() {
                // SAFETY: created by the engine, destroyed once; destroying an event whose
                // work is pending is allowed (resources are released when it completes).
                let _ = unsafe { result::event::destroy(*event) };
            }
        }
    }
}
