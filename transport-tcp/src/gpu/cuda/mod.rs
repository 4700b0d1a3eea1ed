//! The GPU path as built with the `cuda` feature, over `kvpipe-cuda` (see the parent module).

mod ipc;
mod pull;
mod region;
mod staging;

pub use region::DeviceRegion;

pub(crate) use ipc::{export, import, IpcMappings};
pub(crate) use kvpipe_cuda::CudaError as GpuError;
pub(crate) use pull::PullCopies;
#[cfg(test)]
pub(crate) use staging::fake;
pub(crate) use staging::{RecvStaging, SendStaging, StagingSpec};

/// Whether this build reaches GPUs: it does (whether a driver is installed is found out when
/// one is first used).
pub(crate) fn supported() -> Result<(), GpuError> {
    Ok(())
}
