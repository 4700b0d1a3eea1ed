//! Device memory registered with a node: [`DeviceRegion`] (the region table registers it:
//! `RegionTable::insert_device`).

use std::sync::Arc;

/// GPU memory registered with a node (`cuda` feature): a device address on one GPU. Cheap to
/// clone (shared). The transport never dereferences it on the host: the sender copies source
/// bytes down into pinned staging buffers, the receiver copies payloads up from them, both with
/// the GPU's copy engines.
#[derive(Clone, Debug)]
pub struct DeviceRegion {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
struct DeviceInner {
    ordinal: usize,
    ptr: u64,
    len: usize,
}

impl DeviceRegion {
    /// A region over `len` bytes of device memory at device address `ptr` on GPU `ordinal`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of GPU `ordinal` allocated in this process
    /// (`cuMemAlloc`, `cudaMalloc`, or a framework's allocator on top of them), valid for as
    /// long as any clone of the region exists, and the caller must follow the pinning contract
    /// of the [`memory`](crate::memory) module doc.
    pub unsafe fn from_raw_parts(ordinal: usize, ptr: u64, len: usize) -> Self {
        DeviceRegion {
            inner: Arc::new(DeviceInner { ordinal, ptr, len }),
        }
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.inner.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Whether `[offset, offset + len)` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.inner.len as u64)
    }
}
