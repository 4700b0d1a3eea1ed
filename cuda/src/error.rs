//! The crate's one error type.

use cudarc::driver::DriverError;
use thiserror::Error;

/// Why a CUDA operation could not be carried out. Every fallible function of the crate returns
/// it; none of them panics when the driver or the device is missing.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (libcuda) could not be loaded: this machine has no NVIDIA
    /// driver. The message is exactly "no CUDA driver", so scripts and tests can match it.
    #[error("no CUDA driver")]
    NoDriver,
    /// The driver is there but the device ordinal is not (or the driver sees no device at all).
    #[error("no CUDA device {ordinal}: the driver sees {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code}): {description}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The `CUresult` value.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The driver's description of it.
        description: String,
    },
    /// Copies were still running when the caller's deadline passed. They keep running: the
    /// memory they touch must stay valid until the ticket reports completion.
    #[error("copies still running after {waited_ms} ms (deadline passed); wait again before freeing their memory")]
    Timeout {
        /// How long the caller waited.
        waited_ms: u64,
    },
    /// An extent copies host memory to host memory: that is the caller's `memcpy`, not a job for
    /// the GPU's copy engines.
    #[error("extent {index} copies host memory to host memory; copy it on the host")]
    HostToHost {
        /// The extent's index in the submitted list.
        index: usize,
    },
    /// An offset and length do not fit in the allocation they name.
    #[error("bytes {offset}+{len} lie outside the {size}-byte allocation")]
    OutOfBounds {
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The allocation's size.
        size: u64,
    },
    /// The device cannot export memory as dmabuf (needs the open kernel modules and a Linux
    /// kernel with dmabuf support).
    #[error("CUDA device {ordinal} cannot export memory as dmabuf")]
    DmabufUnsupported {
        /// The device.
        ordinal: usize,
    },
    /// Memory of one device handed to an object made for another.
    #[error("memory of CUDA device {got} given to an object of device {expected}")]
    WrongDevice {
        /// The object's device.
        expected: usize,
        /// The memory's device.
        got: usize,
    },
    /// An IPC handle that cannot be used: the wrong length, or a range that overflows.
    #[error("invalid CUDA IPC handle: {reason}")]
    IpcHandle {
        /// What is wrong with it.
        reason: String,
    },
    /// The page-aligned range around the bytes asked for leaves their allocation, so it cannot
    /// be exported as a dmabuf; allocate with [`DeviceBuffer`](crate::DeviceBuffer) (page
    /// aligned) or export a range whose pages the allocation covers.
    #[error("the pages around {ptr:#x}+{len} ({page}-byte pages) are not all inside the allocation {base:#x}+{size}")]
    DmabufUnaligned {
        /// First byte asked for.
        ptr: u64,
        /// Bytes asked for.
        len: u64,
        /// The allocation's first byte.
        base: u64,
        /// The allocation's size.
        size: u64,
        /// The host page size.
        page: u64,
    },
}

impl CudaError {
    /// Wraps a driver error of `call`. Only called with errors the driver returned, so the
    /// driver is loaded and can name them.
    pub(crate) fn driver(call: &'static str) -> impl Fn(DriverError) -> CudaError {
        move |e| {
            let name = e
                .error_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "unknown error".into());
            let description = e
                .error_string()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            CudaError::Driver {
                call,
                code: e.0 as u32,
                name,
                description,
            }
        }
    }
}
