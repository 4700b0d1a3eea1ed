//! Allocations: [`DeviceBuffer`] (device memory) and [`PinnedBuffer`] (page-locked host
//! memory, which the GPU's copy engines reach without a staging copy).

use std::ptr::NonNull;

use cudarc::driver::{result, sys};

use crate::{CudaError, Device};

/// Device memory allocated with `cuMemAlloc`, freed on drop.
///
/// The buffer is a pointer and a length: reading and writing it goes through the copy engine
/// ([`CopyEngine`](crate::CopyEngine)) or the synchronous helpers below.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Device,
    /// What `cuMemAlloc` returned (freed on drop).
    raw: sys::CUdeviceptr,
    /// The first byte handed out: `raw` rounded up to a host page.
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: the buffer owns a device allocation (an address, not host memory); every driver call
// on it binds the device's context first, and the driver API may be called from any thread.
unsafe impl Send for DeviceBuffer {}
// SAFETY: the shared methods only read the address or enqueue driver calls that bind the
// context first; they do not mutate the buffer's fields.
unsafe impl Sync for DeviceBuffer {}

pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<(), CudaError> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(CudaError::OutOfBounds {
            offset: offset as u64,
            len: len as u64,
            size: size as u64,
        });
    }
    Ok(())
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device`, starting on a host page boundary and padded to whole
    /// pages (so any page-aligned range of it can be exported as a dmabuf). The contents are
    /// undefined.
    pub fn new(device: &Device, len: usize) -> Result<DeviceBuffer, CudaError> {
        device.bind()?;
        let page = crate::dmabuf::host_page_size();
        let pages = (len.max(1) as u64).div_ceil(page) * page;
        // SAFETY: the context is current; the allocation is freed here or in `drop`.
        let mut raw = unsafe { result::malloc_sync(pages as usize) }
            .map_err(CudaError::driver("cuMemAlloc"))?;
        if raw % page != 0 {
            // Small allocations may be carved out of a larger one at a finer alignment: ask
            // for a page more and start at the first page boundary inside.
            // SAFETY: allocated just above, freed once.
            let _ = unsafe { result::free_sync(raw) };
            // SAFETY: as above.
            raw = unsafe { result::malloc_sync((pages + page) as usize) }
                .map_err(CudaError::driver("cuMemAlloc"))?;
        }
        Ok(DeviceBuffer {
            device: device.clone(),
            raw,
            ptr: raw.div_ceil(page) * page,
            len,
        })
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs `op` on a fresh non-blocking stream and waits for that stream, so the operation
    /// has landed in device memory when this returns. (`cuMemsetD8` and `cuMemcpyHtoD` from
    /// pageable memory may return before the device is done, and they run on the legacy default
    /// stream, which the copy engine's non-blocking streams do not wait for.)
    fn on_own_stream(
        &self,
        call: &'static str,
        op: impl FnOnce(sys::CUstream) -> Result<(), cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        self.device.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(CudaError::driver("cuStreamCreate"))?;
        let r = op(stream).map_err(CudaError::driver(call)).and_then(|()| {
            // SAFETY: the stream was created above and is live.
            unsafe { result::stream::synchronize(stream) }
                .map_err(CudaError::driver("cuStreamSynchronize"))
        });
        // SAFETY: created above, destroyed once; its work is done or failed.
        let _ = unsafe { result::stream::destroy(stream) };
        r
    }

    /// Sets every byte to `byte` and waits for it (`cuMemsetD8Async` on a stream of its own).
    pub fn fill(&mut self, byte: u8) -> Result<(), CudaError> {
        let (ptr, len) = (self.ptr, self.len);
        self.on_own_stream("cuMemsetD8Async", |stream| {
            // SAFETY: the range is this allocation; `&mut self` means no copy of ours touches
            // it, and the stream is waited for before returning.
            unsafe { result::memset_d8_async(ptr, byte, len, stream) }
        })
    }

    /// Copies `src` to bytes `offset..offset + src.len()` and waits until the bytes are in
    /// device memory (`cuMemcpyHtoDAsync` on a stream of its own).
    pub fn upload(&mut self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        check_range(offset, src.len(), self.len)?;
        let dst = self.ptr + offset as u64;
        self.on_own_stream("cuMemcpyHtoDAsync", |stream| {
            // SAFETY: the range was checked against the allocation; the stream is waited for
            // before returning, so `src` is not read afterwards.
            unsafe { result::memcpy_htod_async(dst, src, stream) }
        })
    }

    /// Copies bytes `offset..offset + dst.len()` into `dst` and waits for it
    /// (`cuMemcpyDtoHAsync` on a stream of its own).
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        check_range(offset, dst.len(), self.len)?;
        let src = self.ptr + offset as u64;
        self.on_own_stream("cuMemcpyDtoHAsync", |stream| {
            // SAFETY: the range was checked against the allocation; the stream is waited for
            // before returning, so `dst` is not written afterwards.
            unsafe { result::memcpy_dtoh_async(dst, src, stream) }
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // `cuMemFree` waits for work still using the allocation. An error here (a device that
        // failed) leaves nothing to do but leak.
        if self.device.bind().is_ok() {
            // SAFETY: allocated by `cuMemAlloc` in `new`, freed once.
            let _ = unsafe { result::free_sync(self.raw) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable to every context), freed on drop. Host
/// ↔ device copies from and to it run asynchronously at full link speed; copies from pageable
/// memory are staged by the driver.
#[derive(Debug)]
pub struct PinnedBuffer {
    device: Device,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation; access goes through `&self`/`&mut self` like a `Vec`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` zeroed bytes (at least one) of pinned host memory through `device`'s
    /// context.
    pub fn new(device: &Device, len: usize) -> Result<PinnedBuffer, CudaError> {
        device.bind()?;
        // SAFETY: the context is current; the allocation is freed in `drop`.
        let raw = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(CudaError::driver("cuMemHostAlloc"))?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(CudaError::OutOfBounds {
            offset: 0,
            len: len as u64,
            size: 0,
        })?;
        // SAFETY: `ptr` points to `len.max(1)` freshly allocated bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// The device whose context allocated it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes (zeroed in `new`), valid while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc` in `new`, freed once.
            let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
        }
    }
}
