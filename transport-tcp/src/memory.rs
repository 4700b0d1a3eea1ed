//! Registered memory: the regions the transport reads source bytes from (sender) and writes
//! payloads into (receiver).
//!
//! A region is memory the engine hands to the network, like an RDMA memory registration: the
//! transport's threads access it through a raw pointer while the engine keeps using other parts
//! of it. The engine's side of the contract is the protocol's pinning rule: it does not modify
//! source blocks of a request, nor touch destination blocks of a request, until the request's
//! `Quiesced` event.
//!
//! With the `cuda` feature a region may be GPU memory (`DeviceRegion`, registered with
//! `RegionTable::insert_device`): the sender copies its source bytes into pinned host staging
//! buffers before they go on the socket, the receiver reads payloads into pinned staging buffers
//! and copies them up to the device, each pipelined with the socket (see the crate doc).

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use kvpipe_core::RegionId;

// Device memory (`cuda` feature), defined with the rest of the GPU path in `crate::gpu`.
#[cfg(feature = "cuda")]
pub use crate::gpu::DeviceRegion;

/// A contiguous block of memory registered with a transport node. Cheap to clone (shared).
#[derive(Clone)]
pub struct MemoryRegion {
    inner: Arc<RegionInner>,
}

struct RegionInner {
    ptr: NonNull<u8>,
    len: usize,
    /// Frees the memory on drop when the region owns it.
    owned: bool,
}

// SAFETY: the region is plain bytes reached through a raw pointer; every access goes through
// `copy_*` (raw copies) or the crate's `slice`/`slice_mut`, whose callers uphold the pinning
// contract (no two parties write the same bytes at once).
unsafe impl Send for RegionInner {}
// SAFETY: as above.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if self.owned {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
            // SAFETY: `ptr`/`len` came from `Box::into_raw` of a `Box<[u8]>` in `from_vec`, and
            // this is the only place that frees it.
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

/// A byte range outside a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bytes [{offset}, {offset}+{len}) lie outside a region of {region_len} bytes")]
pub struct OutOfBounds {
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// The region's length.
    pub region_len: u64,
}

impl MemoryRegion {
    /// A region owning `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0; len])
    }

    /// A region owning `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let boxed: Box<[u8]> = bytes.into_boxed_slice();
        let len = boxed.len();
        let raw = Box::into_raw(boxed) as *mut u8;
        MemoryRegion {
            inner: Arc::new(RegionInner {
                ptr: NonNull::new(raw).unwrap_or(NonNull::dangling()),
                len,
                owned: true,
            }),
        }
    }

    /// A region over foreign memory (an engine's KV pool, pinned host memory).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as any clone of the
    /// region exists, and the caller must follow the pinning contract of the module doc.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> Self {
        MemoryRegion {
            inner: Arc::new(RegionInner {
                ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
                len,
                owned: false,
            }),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize, OutOfBounds> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.inner.len as u64 => Ok(offset as usize),
            _ => Err(OutOfBounds {
                offset,
                len,
                region_len: self.inner.len as u64,
            }),
        }
    }

    /// Whether `[offset, offset + len)` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        self.check(offset, len).is_ok()
    }

    /// Copies bytes out of the region, starting at `offset`.
    pub fn copy_to(&self, offset: u64, out: &mut [u8]) -> Result<(), OutOfBounds> {
        let start = self.check(offset, out.len() as u64)?;
        // SAFETY: the range is inside the region (checked); raw copy, no reference into the
        // region is created.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.inner.ptr.as_ptr().add(start),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// Copies `bytes` into the region at `offset`.
    pub fn copy_from(&self, offset: u64, bytes: &[u8]) -> Result<(), OutOfBounds> {
        let start = self.check(offset, bytes.len() as u64)?;
        // SAFETY: as in `copy_to`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.inner.ptr.as_ptr().add(start),
                bytes.len(),
            );
        }
        Ok(())
    }

    /// The region's bytes, copied into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        // The whole region is in bounds.
        let _ = self.copy_to(0, &mut out);
        out
    }

    /// A shared view of `[offset, offset + len)`.
    ///
    /// # Safety
    /// Nobody may write these bytes while the returned slice lives.
    pub(crate) unsafe fn slice(&self, offset: u64, len: u64) -> Result<&[u8], OutOfBounds> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds (checked); the caller guarantees no concurrent writer.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr.as_ptr().add(start), len as usize) })
    }

    /// An exclusive view of `[offset, offset + len)`.
    ///
    /// # Safety
    /// Nobody else may read or write these bytes while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, offset: u64, len: u64) -> Result<&mut [u8], OutOfBounds> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds (checked); the caller guarantees exclusive access.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.inner.ptr.as_ptr().add(start), len as usize)
        })
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.inner.len)
            .field("owned", &self.inner.owned)
            .finish()
    }
}

/// One registration: host memory, or (`cuda` feature) device memory.
#[derive(Clone, Debug)]
pub(crate) enum Registered {
    /// Host memory, read and written in place.
    Host(MemoryRegion),
    /// Device memory, moved through pinned staging buffers (or pulled by the peer).
    Device(crate::gpu::DeviceRegion),
}

impl Registered {
    /// Whether it is device memory.
    pub(crate) fn is_device(&self) -> bool {
        match self {
            Registered::Host(_) => false,
            Registered::Device(_) => true,
        }
    }

    /// Whether `[offset, offset + len)` lies inside the region.
    pub(crate) fn contains(&self, offset: u64, len: u64) -> bool {
        match self {
            Registered::Host(r) => r.contains(offset, len),
            Registered::Device(d) => d.contains(offset, len),
        }
    }
}

impl From<crate::gpu::DeviceRegion> for Registered {
    fn from(region: crate::gpu::DeviceRegion) -> Self {
        Registered::Device(region)
    }
}

/// The regions registered with one node, by id.
#[derive(Clone, Debug, Default)]
pub struct RegionTable {
    regions: HashMap<RegionId, Registered>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `region` as `id` (replacing an earlier registration of the same id).
    pub fn insert(&mut self, id: RegionId, region: MemoryRegion) {
        self.register(id, Registered::Host(region));
    }

    /// Registers `registered` as `id`, of either kind (device memory: `insert_device`, in
    /// `crate::gpu`).
    pub(crate) fn register(&mut self, id: RegionId, registered: Registered) {
        self.regions.insert(id, registered);
    }

    /// The host region registered as `id` (`None` for device memory).
    pub fn get(&self, id: RegionId) -> Option<&MemoryRegion> {
        match self.regions.get(&id)? {
            Registered::Host(r) => Some(r),
            Registered::Device(_) => None,
        }
    }

    /// The registration of `id`, of either kind.
    pub(crate) fn registered(&self, id: RegionId) -> Option<&Registered> {
        self.regions.get(&id)
    }

    /// Every registration, by id.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (RegionId, &Registered)> + '_ {
        self.regions.iter().map(|(id, r)| (*id, r))
    }

    /// Every registered id.
    pub fn ids(&self) -> impl Iterator<Item = RegionId> + '_ {
        self.regions.keys().copied()
    }
}

impl FromIterator<(RegionId, MemoryRegion)> for RegionTable {
    fn from_iter<T: IntoIterator<Item = (RegionId, MemoryRegion)>>(iter: T) -> Self {
        RegionTable {
            regions: iter
                .into_iter()
                .map(|(id, r)| (id, Registered::Host(r)))
                .collect(),
        }
    }
}

/// Device memory (`cuda` feature).
#[cfg(feature = "cuda")]
impl RegionTable {
    /// Registers device memory as `id` (replacing an earlier registration of the same id).
    pub fn insert_device(&mut self, id: RegionId, region: DeviceRegion) {
        self.register(id, region.into());
    }

    /// The device region registered as `id` (`None` for host memory).
    pub fn get_device(&self, id: RegionId) -> Option<&DeviceRegion> {
        match self.registered(id)? {
            Registered::Device(d) => Some(d),
            Registered::Host(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked() {
        let r = MemoryRegion::from_vec((0..16).collect());
        let mut out = [0u8; 4];
        r.copy_to(12, &mut out).unwrap();
        assert_eq!(out, [12, 13, 14, 15]);
        assert!(r.copy_to(13, &mut out).is_err());
        assert!(r.copy_from(u64::MAX, &[1]).is_err());
        r.copy_from(0, &[9, 9]).unwrap();
        assert_eq!(&r.to_vec()[..3], &[9, 9, 2]);
        assert!(r.contains(16, 0));
        assert!(!r.contains(16, 1));
    }
}
