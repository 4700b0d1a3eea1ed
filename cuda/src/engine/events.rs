//! The events of dropped tickets, kept for the next submission to record again.

use std::sync::Mutex;

use cudarc::driver::{result, sys};

use crate::Device;

/// Events of dropped tickets, kept for reuse (shared by an engine and its tickets; the last
/// holder destroys what is left).
#[derive(Debug, Default)]
pub(super) struct EventPool {
    free: Mutex<Vec<(Device, sys::CUevent)>>,
}

/// Events kept at most (per engine, all devices).
const MAX_POOLED_EVENTS: usize = 64;

// SAFETY: the pool owns its events (no ticket holds them any more); every driver call on one
// binds its device's context first, and the driver API may be called from any thread. The
// mutex serialises access to the list.
unsafe impl Send for EventPool {}

// SAFETY: as above; all access goes through the mutex.
unsafe impl Sync for EventPool {}

impl EventPool {
    /// A free event of device `ordinal`, if one is kept.
    pub(super) fn take(&self, ordinal: usize) -> Option<(Device, sys::CUevent)> {
        let mut free = self.free.lock().ok()?;
        let i = free.iter().position(|(d, _)| d.ordinal() == ordinal)?;
        Some(free.swap_remove(i))
    }

    /// Keeps a completed event, or destroys it when the pool is full.
    pub(super) fn put(&self, device: Device, event: sys::CUevent) {
        if let Ok(mut free) = self.free.lock() {
            if free.len() < MAX_POOLED_EVENTS {
                free.push((device, event));
                return;
            }
        }
        destroy_event(&device, event);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let free = match self.free.get_mut() {
            Ok(free) => std::mem::take(free),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for (device, event) in free {
            destroy_event(&device, event);
        }
    }
}

/// Destroys `event` of `device` (errors are ignored: nothing is left to do about them).
fn destroy_event(device: &Device, event: sys::CUevent) {
    if device.bind().is_ok() {
        // SAFETY: the caller owns the event and hands it over; no one queries it afterwards.
        let _ = unsafe { result::event::destroy(event) };
    }
}
