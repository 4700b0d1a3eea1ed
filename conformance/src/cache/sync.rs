//! Keeping the host buffers and the pools' device memory in step: downloads before checks,
//! uploads after writes. Without the `cuda` feature (or before the pools are placed on a device)
//! each call does nothing.

use super::error::CacheError;
use super::ReferenceCache;

impl ReferenceCache {
    /// Brings the pools' bytes back from device memory into the host buffers the checks read
    /// ([`ReferenceCache::verify`], [`ReferenceCache::snapshot`], [`ReferenceCache::region`]);
    /// a no-op for a cache whose pools are host memory. Call it when no transfer touches the
    /// pools (every request quiesced).
    pub fn sync_from_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.download_all();
        }
        Ok(())
    }

    /// [`ReferenceCache::sync_from_device`] for the slots requests hold only (every slot a
    /// check of a request reads): the host bytes of other slots stay as they were, and
    /// uncommitted. Without a device it does nothing.
    pub fn sync_held_from_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.download_held();
        }
        Ok(())
    }

    /// Whether the pools live in device memory (`cuda` feature:
    /// `ReferenceCache::place_on_device`).
    pub fn is_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.device.is_placed();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Uploads the slots the host wrote since the last upload (pools in device memory only).
    pub(super) fn flush_device(&mut self) -> Result<(), CacheError> {
        #[cfg(feature = "cuda")]
        if self.device.is_placed() {
            return self.upload_dirty();
        }
        Ok(())
    }
}
