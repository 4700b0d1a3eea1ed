//! Memory registration: one registration per KV pool (never per request), made once before
//! the node starts, and the table the data path looks regions up in.
//!
//! A region is registered either for local use only ([`Exposure::Local`]: a sender's source
//! pools, which the adapter only reads) or for remote writes ([`Exposure::RemoteWrite`]: a
//! receiver's destination pools, whose address, length and remote key are announced to every
//! peer at connection setup). See the crate documentation for what the remote key does and
//! does not protect.
//!
//! Device memory is registered through a dma-buf ([`MemoryTable::register_dmabuf`]); with the
//! `cuda` feature, `MemoryTable::register_device` exports GPU memory itself
//! (`cuMemGetHandleForAddressRange`, through `kvpipe-cuda`) and registers it with the device
//! address as its iova, so write plans and remote descriptors name GPU memory by the addresses
//! the engine allocated.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;

use kvpipe_core::RegionId;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::AccessFlags;
use thiserror::Error;

use crate::bootstrap::RegionDescriptor;
use crate::device::VerbsDevice;
use crate::writes::LocalRegion;

/// Who may access a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exposure {
    /// Only this node's adapter (the source of RDMA WRITEs).
    Local,
    /// Peers may RDMA-write into it: it is announced to every peer.
    RemoteWrite,
}

/// A registration that failed.
#[derive(Debug, Error)]
pub enum RegisterError {
    /// The region id is registered already.
    #[error("{0} is registered already")]
    Duplicate(RegionId),
    /// An empty region cannot be registered.
    #[error("{0} is empty")]
    Empty(RegionId),
    /// The device refused the registration.
    #[error("registering {region} ({len} bytes) failed: {message}")]
    Verbs {
        /// The region.
        region: RegionId,
        /// Its length.
        len: usize,
        /// The error.
        message: String,
    },
    /// GPU memory could not be exported as a dma-buf (no CUDA driver, a device without dma-buf
    /// support, memory the driver did not allocate).
    #[cfg(feature = "cuda")]
    #[error("exporting {region} as a dma-buf failed: {error}")]
    Cuda {
        /// The region.
        region: RegionId,
        /// Why.
        error: kvpipe_cuda::CudaError,
    },
}

/// Device memory exported as a dma-buf, for [`MemoryTable::register_dmabuf`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dmabuf {
    /// The dma-buf file descriptor (the registration does not take ownership).
    pub fd: RawFd,
    /// Offset of the region's first byte in the dma-buf.
    pub offset: u64,
    /// Length in bytes.
    pub len: usize,
    /// The address work requests name the region's first byte by (the local and remote
    /// addresses of the region are `iova`-based).
    pub iova: u64,
}

struct Registered {
    mr: Arc<MemoryRegion>,
    exposure: Exposure,
}

/// The node's registered regions, by the region ids the core plans with.
#[derive(Default)]
pub struct MemoryTable {
    regions: HashMap<RegionId, Registered>,
}

impl std::fmt::Debug for MemoryTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.regions.iter().map(|(id, r)| {
                (
                    id,
                    (r.mr.get_ptr(), r.mr.region_len(), r.exposure, r.mr.rkey()),
                )
            }))
            .finish()
    }
}

fn access(exposure: Exposure) -> AccessFlags {
    match exposure {
        Exposure::Local => AccessFlags::LocalWrite,
        Exposure::RemoteWrite => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
    }
}

impl MemoryTable {
    /// An empty table.
    pub fn new() -> Self {
        MemoryTable::default()
    }

    /// Registers `len` bytes of host memory at `ptr` as `region`.
    ///
    /// # Safety
    ///
    /// The bytes must stay valid (not freed, not moved) for as long as the table or any node
    /// built on it lives, and no one may hold a Rust reference to bytes a peer writes while a
    /// write may land (the sessions' quiesce rule: memory of a request is the engine's again
    /// only after its `Quiesced` event).
    pub unsafe fn register_host(
        &mut self,
        device: &VerbsDevice,
        region: RegionId,
        ptr: *mut u8,
        len: usize,
        exposure: Exposure,
    ) -> Result<(), RegisterError> {
        self.check(region, len)?;
        // SAFETY: the caller keeps `ptr..ptr + len` valid while the registration lives.
        let mr = unsafe { device.pd.reg_mr(ptr as usize, len, access(exposure)) };
        self.insert(region, len, exposure, mr.map_err(|e| format!("{e:?}")))
    }

    /// Registers GPU (or other device) memory exported as a dma-buf (see [`Dmabuf`]). The
    /// hook for the `cuda` feature, which exports GPU memory with
    /// `cuMemGetHandleForAddressRange`; the transport itself treats the region like any other.
    ///
    /// # Safety
    ///
    /// `dmabuf.fd` must be a dma-buf whose memory stays valid for its `offset..offset + len`
    /// while the registration lives, under the same quiesce rule as
    /// [`MemoryTable::register_host`].
    pub unsafe fn register_dmabuf(
        &mut self,
        device: &VerbsDevice,
        region: RegionId,
        dmabuf: Dmabuf,
        exposure: Exposure,
    ) -> Result<(), RegisterError> {
        self.check(region, dmabuf.len)?;
        // SAFETY: forwarded from the caller.
        let mr = unsafe {
            device.pd.reg_dmabuf_mr(
                dmabuf.offset,
                dmabuf.len,
                dmabuf.iova,
                dmabuf.fd,
                access(exposure),
            )
        };
        self.insert(
            region,
            dmabuf.len,
            exposure,
            mr.map_err(|e| format!("{e:?}")),
        )
    }

    /// Registers `len` bytes of GPU memory at device address `ptr` on CUDA device `ordinal`
    /// as `region` (`cuda` feature): exports them as a dma-buf ([`export_device_memory`]) and
    /// registers that with the device address as iova, then closes the file descriptor (the
    /// registration keeps its own reference to the dma-buf).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of GPU `ordinal` allocated in this process
    /// (`cuMemAlloc`, `cudaMalloc` or an allocator on them) that stays allocated while the
    /// registration lives, under the same quiesce rule as [`MemoryTable::register_host`].
    #[cfg(feature = "cuda")]
    pub unsafe fn register_device(
        &mut self,
        device: &VerbsDevice,
        region: RegionId,
        ordinal: usize,
        ptr: u64,
        len: usize,
        exposure: Exposure,
    ) -> Result<(), RegisterError> {
        self.check(region, len)?;
        let exported = export_device_memory(region, ordinal, ptr, len)?;
        // SAFETY: the dma-buf covers the caller's device memory, which the caller keeps
        // allocated while the registration lives.
        unsafe { self.register_dmabuf(device, region, exported.dmabuf(), exposure) }
    }

    fn check(&self, region: RegionId, len: usize) -> Result<(), RegisterError> {
        if self.regions.contains_key(&region) {
            return Err(RegisterError::Duplicate(region));
        }
        if len == 0 {
            return Err(RegisterError::Empty(region));
        }
        Ok(())
    }

    fn insert(
        &mut self,
        region: RegionId,
        len: usize,
        exposure: Exposure,
        mr: Result<Arc<MemoryRegion>, String>,
    ) -> Result<(), RegisterError> {
        let mr = mr.map_err(|message| RegisterError::Verbs {
            region,
            len,
            message,
        })?;
        self.regions.insert(region, Registered { mr, exposure });
        Ok(())
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// A region as the write mapping reads from it.
    pub(crate) fn local(&self, region: RegionId) -> Option<LocalRegion> {
        self.regions.get(&region).map(|r| LocalRegion {
            addr: r.mr.get_ptr() as u64,
            len: r.mr.region_len() as u64,
            lkey: r.mr.lkey(),
        })
    }

    /// The descriptors announced to peers: every [`Exposure::RemoteWrite`] region.
    pub fn descriptors(&self) -> Vec<RegionDescriptor> {
        let mut out: Vec<RegionDescriptor> = self
            .regions
            .iter()
            .filter(|(_, r)| r.exposure == Exposure::RemoteWrite)
            .map(|(id, r)| RegionDescriptor {
                region: *id,
                rkey: r.mr.rkey(),
                addr: r.mr.get_ptr() as u64,
                len: r.mr.region_len() as u64,
            })
            .collect();
        out.sort_by_key(|d| d.region);
        out
    }
}

/// GPU memory exported as a dma-buf, ready for [`MemoryTable::register_dmabuf`] (`cuda`
/// feature). Owns the file descriptor (closed on drop; a registration made from it keeps its
/// own reference).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct ExportedDeviceMemory {
    exported: kvpipe_cuda::Dmabuf,
}

#[cfg(feature = "cuda")]
impl ExportedDeviceMemory {
    /// What the registration is given: the file descriptor, where the region starts in the
    /// dma-buf (the driver exports whole host pages), its length, and the device address as
    /// iova.
    pub fn dmabuf(&self) -> Dmabuf {
        use std::os::fd::AsRawFd;
        Dmabuf {
            fd: self.exported.fd.as_raw_fd(),
            offset: self.exported.offset,
            len: self.exported.len as usize,
            iova: self.exported.addr,
        }
    }

    /// The export itself.
    pub fn exported(&self) -> &kvpipe_cuda::Dmabuf {
        &self.exported
    }
}

/// Exports `len` bytes of GPU memory at device address `ptr` on CUDA device `ordinal` as a
/// dma-buf for registering as `region` (`cuda` feature). Fails with
/// [`RegisterError::Cuda`] where there is no CUDA driver ("no CUDA driver"), no such device,
/// no dma-buf support, or memory the driver did not allocate; never touches an RDMA device.
#[cfg(feature = "cuda")]
pub fn export_device_memory(
    region: RegionId,
    ordinal: usize,
    ptr: u64,
    len: usize,
) -> Result<ExportedDeviceMemory, RegisterError> {
    if len == 0 {
        return Err(RegisterError::Empty(region));
    }
    let cuda = |error| RegisterError::Cuda { region, error };
    let gpu = kvpipe_cuda::Device::open(ordinal).map_err(cuda)?;
    let exported = kvpipe_cuda::export_dmabuf(&gpu, ptr, len as u64).map_err(cuda)?;
    Ok(ExportedDeviceMemory { exported })
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    #[test]
    fn device_memory_is_exported_only_where_a_driver_is() {
        let r = export_device_memory(RegionId(7), 0, 0x7f00_0000_0000, 4096);
        match kvpipe_cuda::check_driver() {
            Err(kvpipe_cuda::CudaError::NoDriver) => {
                let e = r.expect_err("no driver, no export");
                assert!(matches!(
                    e,
                    RegisterError::Cuda {
                        region: RegionId(7),
                        error: kvpipe_cuda::CudaError::NoDriver
                    }
                ));
                assert_eq!(
                    e.to_string(),
                    "exporting region#7 as a dma-buf failed: no CUDA driver"
                );
            }
            // With a driver, an address it never allocated is refused by the driver.
            _ => assert!(matches!(r, Err(RegisterError::Cuda { .. }))),
        }
        assert!(matches!(
            export_device_memory(RegionId(7), 0, 0x7f00_0000_0000, 0),
            Err(RegisterError::Empty(RegionId(7)))
        ));
    }
}
