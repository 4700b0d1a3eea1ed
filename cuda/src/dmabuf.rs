//! Exporting device memory as a dmabuf file descriptor (`cuMemGetHandleForAddressRange`), the
//! form an RDMA NIC registers GPU memory in (`ibv_reg_dmabuf_mr(pd, offset, len, iova, fd,
//! access)`).
//!
//! The driver exports whole host pages: the exported range is the requested bytes widened to
//! page boundaries, and [`Dmabuf::offset`] says where the requested bytes start inside it.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::{check_driver, CudaError, Device, DeviceBuffer};

/// Device memory exported as a dmabuf: pass `fd`, `offset` and `len` to the NIC's dmabuf
/// registration, and `addr` as its iova so remote writes name the same addresses as local
/// copies. Closing `fd` (dropping it) after registration is fine: the registration keeps its
/// own reference.
#[derive(Debug)]
pub struct Dmabuf {
    /// The dmabuf file descriptor (covers whole host pages around the requested bytes).
    pub fd: OwnedFd,
    /// Where the requested bytes start inside the dmabuf.
    pub offset: u64,
    /// Bytes requested.
    pub len: u64,
    /// The device address of the first requested byte.
    pub addr: u64,
}

/// The host's page size (what the driver aligns dmabuf exports to).
pub fn host_page_size() -> u64 {
    static PAGE: OnceLock<u64> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: `sysconf` only reads a system constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            page as u64
        } else {
            4096
        }
    })
}

/// The page-aligned window to export for bytes `ptr..ptr + len` of the allocation
/// `base..base + size`: `(start, span, offset)` — the window's first byte, its length, and
/// where `ptr` lies inside it. Refused when the window would leave the allocation.
pub fn dmabuf_window(
    base: u64,
    size: u64,
    ptr: u64,
    len: u64,
    page: u64,
) -> Result<(u64, u64, u64), CudaError> {
    let unaligned = CudaError::DmabufUnaligned {
        ptr,
        len,
        base,
        size,
        page,
    };
    let end = ptr.checked_add(len).filter(|_| len > 0 && page > 0);
    let (Some(end), Some(alloc_end)) = (end, base.checked_add(size)) else {
        return Err(CudaError::OutOfBounds {
            offset: ptr.wrapping_sub(base),
            len,
            size,
        });
    };
    if ptr < base || end > alloc_end {
        return Err(CudaError::OutOfBounds {
            offset: ptr.wrapping_sub(base),
            len,
            size,
        });
    }
    let start = ptr / page * page;
    let Some(stop) = end.checked_next_multiple_of(page) else {
        return Err(unaligned);
    };
    if start < base || stop > alloc_end {
        return Err(unaligned);
    }
    Ok((start, stop - start, ptr - start))
}

/// Exports bytes `ptr..ptr + len` of device memory on `device` as a dmabuf. The memory may
/// come from any allocator of this process that uses `cuMemAlloc`/`cudaMalloc` (the driver
/// checks the address); the page-aligned window around it must lie inside one allocation.
pub fn export_dmabuf(device: &Device, ptr: u64, len: u64) -> Result<Dmabuf, CudaError> {
    check_driver()?;
    if !device.supports_dmabuf()? {
        return Err(CudaError::DmabufUnsupported {
            ordinal: device.ordinal(),
        });
    }
    device.bind()?;
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: writes the allocation's base and size through valid pointers; the driver
    // refuses an address it did not allocate.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(CudaError::driver("cuMemGetAddressRange"))?;
    let (start, span, offset) = dmabuf_window(base, size as u64, ptr, len, host_page_size())?;
    let mut fd: libc::c_int = -1;
    // SAFETY: `start..start + span` lies inside one allocation (checked above) and is page
    // aligned; the driver writes an int file descriptor through a valid pointer.
    unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut libc::c_int).cast(),
            start,
            span as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    }
    .result()
    .map_err(CudaError::driver("cuMemGetHandleForAddressRange"))?;
    if fd < 0 {
        return Err(CudaError::DmabufUnsupported {
            ordinal: device.ordinal(),
        });
    }
    // SAFETY: the driver returned a new file descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(Dmabuf {
        fd,
        offset,
        len,
        addr: ptr,
    })
}

impl DeviceBuffer {
    /// Exports bytes `offset..offset + len` of the buffer as a dmabuf (see [`export_dmabuf`]).
    /// A `DeviceBuffer` starts on a page and is padded to whole pages, so every range of it
    /// can be exported.
    pub fn export_dmabuf(&self, offset: usize, len: usize) -> Result<Dmabuf, CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(CudaError::OutOfBounds {
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            });
        }
        export_dmabuf(self.device(), self.ptr() + offset as u64, len as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_the_requested_bytes_widened_to_pages() {
        let page = 4096;
        let base = 0x7000_0000_0000;
        assert_eq!(
            dmabuf_window(base, 1 << 20, base, 1 << 20, page),
            Ok((base, 1 << 20, 0))
        );
        assert_eq!(
            dmabuf_window(base, 1 << 20, base + 5000, 100, page),
            Ok((base + 4096, 4096, 904))
        );
        assert_eq!(
            dmabuf_window(base, 1 << 20, base + 4000, 200, page),
            Ok((base, 8192, 4000))
        );
    }

    #[test]
    fn windows_leaving_the_allocation_are_refused() {
        let page = 4096;
        let base = 0x7000_0000_0100; // not page aligned
        assert!(matches!(
            dmabuf_window(base, 1 << 20, base, 64, page),
            Err(CudaError::DmabufUnaligned { .. })
        ));
        let base = 0x7000_0000_0000;
        // Size not a whole number of pages: the last page is not all inside.
        assert!(matches!(
            dmabuf_window(base, 5000, base + 4096, 10, page),
            Err(CudaError::DmabufUnaligned { .. })
        ));
        for (ptr, len) in [
            (base + 4096, 1 << 20),
            (base - 1, 8),
            (base, 0),
            (u64::MAX, 2),
        ] {
            assert!(
                matches!(
                    dmabuf_window(base, 1 << 20, ptr, len, page),
                    Err(CudaError::OutOfBounds { .. })
                ),
                "{ptr:#x}+{len}"
            );
        }
    }
}
