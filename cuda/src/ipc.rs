//! CUDA IPC: device memory of one process opened by another process on the same host
//! (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
//!
//! The exporting process calls [`export_ipc`] (or [`DeviceBuffer::export_ipc`]) and sends the
//! [`IpcHandle`] — [`IPC_HANDLE_LEN`] bytes, [`IpcHandle::to_bytes`] — over any channel; the
//! importing process decodes it ([`IpcHandle::from_bytes`], which refuses any other length)
//! and opens it with [`IpcMapping::open`] on one of its devices. The mapping's address is valid
//! in the importer's contexts until the mapping is dropped (`cuIpcCloseMemHandle`).
//!
//! - The driver hands out handles for whole allocations (what `cuMemAlloc` returned). A handle
//!   therefore names the allocation's base, and [`IpcHandle::offset`] says where the exported
//!   bytes start inside it ([`DeviceBuffer`] starts its bytes on a page boundary inside a
//!   larger allocation).
//! - The importer may open the handle on another GPU than the exporter's: it is opened with
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, and copies between the two devices are then peer
//!   copies over NVLink or PCIe.
//! - A process cannot open a handle it exported itself (the driver refuses with
//!   `CUDA_ERROR_INVALID_CONTEXT`): IPC is between processes.
//! - The memory stays allocated as long as the exporter keeps it; an exporter must not free
//!   it while an importer may still copy into it (the protocol's quiesce-before-free rule,
//!   with the importer's copies waited for before it reports a batch done).

use cudarc::driver::sys;

use crate::{check_driver, CudaError, Device, DeviceBuffer};

/// Bytes of the driver's opaque handle (`CUipcMemHandle`).
pub const IPC_DRIVER_HANDLE_LEN: usize = 64;

/// Bytes of an encoded [`IpcHandle`]: the driver's 64-byte handle, then the offset and the
/// length of the exported bytes (u64 little endian each).
pub const IPC_HANDLE_LEN: usize = IPC_DRIVER_HANDLE_LEN + 16;

/// Device memory exported for another process: the driver's handle of the allocation, and the
/// exported bytes' place inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    /// The driver's handle of the whole allocation (`cuIpcGetMemHandle`).
    pub handle: [u8; IPC_DRIVER_HANDLE_LEN],
    /// Where the exported bytes start inside the allocation.
    pub offset: u64,
    /// Bytes exported.
    pub len: u64,
}

impl IpcHandle {
    /// The handle as [`IPC_HANDLE_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; IPC_HANDLE_LEN] {
        let mut out = [0u8; IPC_HANDLE_LEN];
        out[..IPC_DRIVER_HANDLE_LEN].copy_from_slice(&self.handle);
        out[IPC_DRIVER_HANDLE_LEN..IPC_DRIVER_HANDLE_LEN + 8]
            .copy_from_slice(&self.offset.to_le_bytes());
        out[IPC_DRIVER_HANDLE_LEN + 8..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a handle; anything but exactly [`IPC_HANDLE_LEN`] bytes, or an offset and
    /// length that overflow, is refused ([`CudaError::IpcHandle`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle, CudaError> {
        if bytes.len() != IPC_HANDLE_LEN {
            return Err(CudaError::IpcHandle {
                reason: format!("{} bytes, an IPC handle has {IPC_HANDLE_LEN}", bytes.len()),
            });
        }
        let mut handle = [0u8; IPC_DRIVER_HANDLE_LEN];
        handle.copy_from_slice(&bytes[..IPC_DRIVER_HANDLE_LEN]);
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (offset, len) = (word(IPC_DRIVER_HANDLE_LEN), word(IPC_DRIVER_HANDLE_LEN + 8));
        if offset.checked_add(len).is_none() {
            return Err(CudaError::IpcHandle {
                reason: format!("offset {offset} + length {len} overflow"),
            });
        }
        Ok(IpcHandle {
            handle,
            offset,
            len,
        })
    }
}

/// Exports `len` bytes of device memory at `ptr` on `device` (memory of this process,
/// allocated with `cuMemAlloc`/`cudaMalloc` or an allocator on top of them) for another
/// process: finds the allocation around `ptr` (`cuMemGetAddressRange`) and asks the driver for
/// its handle (`cuIpcGetMemHandle`).
pub fn export_ipc(device: &Device, ptr: u64, len: u64) -> Result<IpcHandle, CudaError> {
    check_driver()?;
    device.bind()?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes two values through valid pointers; the driver checks the address.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(CudaError::driver("cuMemGetAddressRange"))?;
    let offset = ptr - base;
    if offset.checked_add(len).is_none_or(|end| end > size as u64) {
        return Err(CudaError::OutOfBounds {
            offset,
            len,
            size: size as u64,
        });
    }
    let mut raw = sys::CUipcMemHandle {
        reserved: [0; IPC_DRIVER_HANDLE_LEN],
    };
    // SAFETY: `base` is the start of a live allocation of the current context; the driver
    // writes the 64-byte handle through a valid pointer.
    unsafe { sys::cuIpcGetMemHandle(&mut raw, base) }
        .result()
        .map_err(CudaError::driver("cuIpcGetMemHandle"))?;
    let mut handle = [0u8; IPC_DRIVER_HANDLE_LEN];
    for (out, b) in handle.iter_mut().zip(raw.reserved) {
        *out = b as u8;
    }
    Ok(IpcHandle {
        handle,
        offset,
        len,
    })
}

impl DeviceBuffer {
    /// Exports the buffer's bytes for another process (see [`export_ipc`]); the handle's
    /// offset is where [`ptr`](DeviceBuffer::ptr) lies in the underlying allocation.
    pub fn export_ipc(&self) -> Result<IpcHandle, CudaError> {
        export_ipc(self.device(), self.ptr(), self.len() as u64)
    }
}

/// Another process's device memory, opened in this one (`cuIpcOpenMemHandle` with
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`) on one device; closed on drop
/// (`cuIpcCloseMemHandle`).
///
/// The mapping gives the exported bytes a device address in this process
/// ([`ptr`](Self::ptr)), usable by the copy engine as memory of [`ordinal`](Self::ordinal).
#[derive(Debug)]
pub struct IpcMapping {
    device: Device,
    /// What `cuIpcOpenMemHandle` returned (the allocation's base).
    base: sys::CUdeviceptr,
    handle: IpcHandle,
}

// SAFETY: the mapping is an address; opening and closing bind the device's context first, and
// the driver API may be called from any thread.
unsafe impl Send for IpcMapping {}
// SAFETY: the shared methods only read the fields.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens `handle` (exported by another process) on `device`.
    pub fn open(device: &Device, handle: &IpcHandle) -> Result<IpcMapping, CudaError> {
        check_driver()?;
        device.bind()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_DRIVER_HANDLE_LEN],
        };
        for (out, &b) in raw.reserved.iter_mut().zip(&handle.handle) {
            *out = b as _;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; the driver checks the handle and writes the address
        // through a valid pointer. The mapping is closed once, in `drop`.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw,
                sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(CudaError::driver("cuIpcOpenMemHandle"))?;
        Ok(IpcMapping {
            device: device.clone(),
            base,
            handle: *handle,
        })
    }

    /// The device address (in this process) of the first exported byte.
    pub fn ptr(&self) -> u64 {
        self.base + self.handle.offset
    }

    /// Bytes exported.
    pub fn len(&self) -> u64 {
        self.handle.len
    }

    /// Whether nothing was exported.
    pub fn is_empty(&self) -> bool {
        self.handle.len == 0
    }

    /// The device the mapping was opened on.
    pub fn ordinal(&self) -> usize {
        self.device.ordinal()
    }

    /// The device it was opened on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // The caller waited for every copy into the mapping (the copy engine's tickets). An
        // error here (a failed device) leaves nothing to do.
        if self.device.bind().is_ok() {
            // SAFETY: opened in `open`, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> IpcHandle {
        let mut handle = [0u8; IPC_DRIVER_HANDLE_LEN];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(7) ^ 0xa5;
        }
        IpcHandle {
            handle,
            offset: 0x1000,
            len: 3 << 30,
        }
    }

    #[test]
    fn a_handle_round_trips_through_its_bytes() {
        let h = sample();
        let bytes = h.to_bytes();
        assert_eq!(bytes.len(), IPC_HANDLE_LEN);
        assert_eq!(&bytes[..64], &h.handle);
        assert_eq!(&bytes[64..72], &0x1000u64.to_le_bytes());
        assert_eq!(IpcHandle::from_bytes(&bytes), Ok(h));
    }

    #[test]
    fn a_handle_of_the_wrong_length_is_refused() {
        let bytes = sample().to_bytes();
        for len in [0, 64, IPC_HANDLE_LEN - 1, IPC_HANDLE_LEN + 1] {
            let mut v = bytes.to_vec();
            v.resize(len, 0);
            let e = IpcHandle::from_bytes(&v).unwrap_err();
            assert!(
                matches!(&e, CudaError::IpcHandle { reason } if reason.contains(&len.to_string())),
                "{e}"
            );
        }
    }

    #[test]
    fn a_handle_whose_range_overflows_is_refused() {
        let mut h = sample();
        h.offset = u64::MAX - 4;
        h.len = 8;
        assert!(matches!(
            IpcHandle::from_bytes(&h.to_bytes()),
            Err(CudaError::IpcHandle { .. })
        ));
    }

    #[test]
    fn without_a_driver_export_and_open_say_so() {
        if check_driver().is_ok() {
            return;
        }
        assert_eq!(
            Device::open(0).map(|_| ()).unwrap_err(),
            CudaError::NoDriver
        );
    }
}
