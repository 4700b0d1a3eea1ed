//! The driver check and [`Device`]: one GPU's primary context.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext};

use crate::CudaError;

/// Checks once per process that the CUDA driver can be loaded and initialised.
///
/// `Err(CudaError::NoDriver)` (message "no CUDA driver") when libcuda cannot be loaded — on a
/// machine without an NVIDIA driver. Every other function of the crate calls this first, so
/// none of them reaches cudarc's loader (which panics when the library is missing).
pub fn check_driver() -> Result<(), CudaError> {
    static DRIVER: OnceLock<Result<(), CudaError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to open the library by its usual names and closes it again.
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError::NoDriver);
            }
            result::init().map_err(CudaError::driver("cuInit"))
        })
        .clone()
}

/// Devices the driver sees.
pub fn device_count() -> Result<usize, CudaError> {
    check_driver()?;
    let n = result::device::get_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// The driver's CUDA version, e.g. 13000 for 13.0.
pub fn driver_version() -> Result<i32, CudaError> {
    check_driver()?;
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(CudaError::driver("cuDriverGetVersion"))?;
    Ok(v)
}

/// One GPU, through its primary context (the one the CUDA runtime, PyTorch and the other
/// frameworks share, so pointers they allocate are valid here). Cheap to clone; the context is
/// released when the last clone (and every buffer, stream and event made from it) is gone.
#[derive(Clone, Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
}

impl Device {
    /// Opens device `ordinal` (retains its primary context).
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        Ok(Device { ctx })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String, CudaError> {
        self.ctx
            .name()
            .map_err(CudaError::driver("cuDeviceGetName"))
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(CudaError::driver("cuMemGetInfo"))
    }

    /// Whether the device can export memory as dmabuf (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub fn supports_dmabuf(&self) -> Result<bool, CudaError> {
        self.ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .map(|v| v != 0)
            .map_err(CudaError::driver("cuDeviceGetAttribute"))
    }

    /// Whether this device can read and write `peer`'s memory directly (NVLink or PCIe
    /// peer-to-peer).
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool, CudaError> {
        let mut can = 0;
        // SAFETY: both devices came from `cuDeviceGet`; writes one int through a valid pointer.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device()) }
            .result()
            .map_err(CudaError::driver("cuDeviceCanAccessPeer"))?;
        Ok(can != 0)
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))
    }

    /// The raw context.
    pub(crate) fn cu_ctx(&self) -> sys::CUcontext {
        self.ctx.cu_ctx()
    }
}
