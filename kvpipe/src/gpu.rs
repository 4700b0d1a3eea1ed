//! Whether a GPU region can be served here: the build must have the `cuda` feature, and the
//! machine a CUDA driver that sees the region's GPU. Checked before a region reaches a
//! transport, so a GPU address is never handed to code that cannot use it (and cudarc, which
//! panics where libcuda is missing, is never reached without a driver).

use kvpipe_core::RegionId;

use crate::EmbedError;

/// Why a GPU region cannot be served (see [`EmbedError::DeviceRegion`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuUnavailable {
    /// This build of kvpipe has no GPU support. (The message's first words are the ones
    /// kvpipe gave before GPU regions could be served at all, which callers may match.)
    #[error(
        "which this build's transports cannot read or write yet (kvpipe was built without its \
         `cuda` feature)"
    )]
    NoCudaFeature,
    /// The CUDA driver cannot be loaded here, or does not see the region's GPU.
    #[cfg(feature = "cuda")]
    #[error("but the CUDA driver cannot serve it: {0}")]
    Cuda(kvpipe_cuda::CudaError),
}

/// Refuses the first GPU region this build or machine cannot serve, of `regions` given as
/// `(id, GPU ordinal or None for host memory)`.
pub(crate) fn check(
    regions: impl IntoIterator<Item = (RegionId, Option<u32>)>,
) -> Result<(), EmbedError> {
    for (id, device) in regions {
        if let Some(ordinal) = device {
            usable(id, ordinal)?;
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn usable(region: RegionId, ordinal: u32) -> Result<(), EmbedError> {
    let refuse = |e| EmbedError::DeviceRegion {
        region,
        ordinal,
        reason: GpuUnavailable::Cuda(e),
    };
    // `device_count` loads the driver only after checking that libcuda is present.
    let count = kvpipe_cuda::device_count().map_err(refuse)?;
    if ordinal as usize >= count {
        return Err(refuse(kvpipe_cuda::CudaError::NoDevice {
            ordinal: ordinal as usize,
            count,
        }));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn usable(region: RegionId, ordinal: u32) -> Result<(), EmbedError> {
    Err(refuse(region, ordinal))
}

/// The refusal of a GPU region in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn refuse(region: RegionId, ordinal: u32) -> EmbedError {
    EmbedError::DeviceRegion {
        region,
        ordinal,
        reason: GpuUnavailable::NoCudaFeature,
    }
}
