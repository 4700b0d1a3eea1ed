//! Memory registration: one registration per KV pool (never per request), made once before
//! the node starts, and the table the data path looks regions up in.
//!
//! A region is registered either for local use only ([`Exposure::Local`]: a sender's source
//! pools, which the adapter only reads) or for remote writes ([`Exposure::RemoteWrite`]: a
//! receiver's destination pools, whose address, length and remote key are announced to every
//! peer at connection setup). See the crate documentation for what the remote key does and
//! does not protect.

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
