//! Registered memory: the engine's KV pools and aux buffers, addressed by [`RegionId`].
//!
//! A region is described by its kind and its bytes: host memory ([`RegionMemory::Host`]) or,
//! with the `cuda` feature, device memory (`RegionMemory::Device`, registered with
//! `RegionTable::register_device`). The copy path dispatches on the pair of kinds — host to
//! host by `memcpy`, anything touching a GPU through the copy engine of `kvpipe-cuda` — so
//! neither the core nor the driver knows which memory a region is.
//!
//! The transport never owns the engine's memory. It holds a registration (an [`Arc`]) for every
//! write batch that may still touch a region, and [`RegionTable::deregister`] refuses while one
//! does, so the engine can only take memory back once the transport is quiesced for it.

use std::ptr::NonNull;
use std::sync::Arc;

use kvpipe_core::RegionId;
use rustc_hash::FxHashMap as HashMap;
use thiserror::Error;

/// Which memory a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RegionKind {
    /// Ordinary process memory.
    Host,
    /// Memory of a GPU.
    #[cfg(feature = "cuda")]
    Device {
        /// The device's ordinal.
        ordinal: usize,
    },
}

/// What a region is used for (for messages and statistics; copies do not care).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegionUse {
    /// A KV pool.
    KvPool,
    /// An aux buffer (first tokens, draft tokens).
    Aux,
}

/// A span of host memory the engine lent to the transport.
#[derive(Debug)]
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `HostRegion` is a pointer and a length; the registration's contract
// (`RegionTable::register_host`) makes the engine keep the memory valid and leaves the bytes
// the transport copies untouched by anything else while a write batch is in flight, so
// sharing the description between threads is sound.
unsafe impl Send for HostRegion {}
// SAFETY: as above; the region itself has no interior state.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// A span of device memory the engine lent to the transport: a device address on one GPU.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceRegion {
    ordinal: usize,
    ptr: u64,
    len: usize,
}

#[cfg(feature = "cuda")]
impl DeviceRegion {
    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The memory of one registered region.
#[derive(Debug)]
#[non_exhaustive]
pub enum RegionMemory {
    /// Host memory.
    Host(HostRegion),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Device(DeviceRegion),
}

impl RegionMemory {
    /// The kind of memory.
    pub fn kind(&self) -> RegionKind {
        match self {
            RegionMemory::Host(_) => RegionKind::Host,
            #[cfg(feature = "cuda")]
            RegionMemory::Device(d) => RegionKind::Device { ordinal: d.ordinal },
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RegionMemory::Host(h) => h.len,
            #[cfg(feature = "cuda")]
            RegionMemory::Device(d) => d.len,
        }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One registration: the memory and what it is for.
#[derive(Debug)]
pub struct Registration {
    /// The region's id, as it appears in layouts and write plans.
    pub id: RegionId,
    /// What it is used for.
    pub usage: RegionUse,
    /// The memory.
    pub memory: RegionMemory,
}

/// Why a registration was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RegistrationError {
    /// The id is already registered.
    #[error("{0} is already registered")]
    AlreadyRegistered(RegionId),
    /// The id is not registered.
    #[error("{0} is not registered")]
    NotRegistered(RegionId),
    /// A write batch may still touch the region.
    #[error("{region} is still used by {holders} in-flight write batch(es); wait for Quiesced")]
    InUse {
        /// The region.
        region: RegionId,
        /// Batches holding it.
        holders: usize,
    },
    /// A null pointer with a non-zero length.
    #[error("{0} was given a null pointer")]
    NullPointer(RegionId),
}

/// The regions of one endpoint, by id.
#[derive(Debug, Default)]
pub struct RegionTable {
    regions: HashMap<RegionId, Arc<Registration>>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        RegionTable::default()
    }

    /// Registers `len` bytes of host memory at `ptr` as region `id`.
    ///
    /// # Safety
    ///
    /// Until [`deregister`](Self::deregister) succeeds for `id` (or the table and every
    /// write batch it handed out are dropped), `ptr..ptr + len` must stay valid for reads and
    /// writes, and nothing else may access the bytes a write batch copies while that batch is in
    /// flight. The kvpipe sessions guarantee the latter for blocks they pinned: the engine must
    /// not reuse a request's blocks before [`kvpipe_core::Event::Quiesced`].
    pub unsafe fn register_host(
        &mut self,
        id: RegionId,
        usage: RegionUse,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(), RegistrationError> {
        if self.regions.contains_key(&id) {
            return Err(RegistrationError::AlreadyRegistered(id));
        }
        let ptr = match NonNull::new(ptr) {
            Some(p) => p,
            None if len == 0 => NonNull::dangling(),
            None => return Err(RegistrationError::NullPointer(id)),
        };
        self.insert(id, usage, RegionMemory::Host(HostRegion { ptr, len }))
    }

    /// Registers `len` bytes of device memory at device address `ptr` on GPU `ordinal` as
    /// region `id`. Write batches that touch it are copied by the GPU's copy engines
    /// (`kvpipe-cuda`): device to device, between devices, and to or from host regions.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of device `ordinal` allocated in this process
    /// (`cuMemAlloc`, `cudaMalloc`, a framework's allocator on top of them) and, as for
    /// [`register_host`](Self::register_host), stay allocated until
    /// [`deregister`](Self::deregister) succeeds for `id` (or the table and every write batch it
    /// handed out are dropped), with nothing else touching the bytes of an in-flight write
    /// batch.
    #[cfg(feature = "cuda")]
    pub unsafe fn register_device(
        &mut self,
        id: RegionId,
        usage: RegionUse,
        ordinal: usize,
        ptr: u64,
        len: usize,
    ) -> Result<(), RegistrationError> {
        if self.regions.contains_key(&id) {
            return Err(RegistrationError::AlreadyRegistered(id));
        }
        if ptr == 0 && len > 0 {
            return Err(RegistrationError::NullPointer(id));
        }
        self.insert(
            id,
            usage,
            RegionMemory::Device(DeviceRegion { ordinal, ptr, len }),
        )
    }

    fn insert(
        &mut self,
        id: RegionId,
        usage: RegionUse,
        memory: RegionMemory,
    ) -> Result<(), RegistrationError> {
        if self.regions.contains_key(&id) {
            return Err(RegistrationError::AlreadyRegistered(id));
        }
        self.regions
            .insert(id, Arc::new(Registration { id, usage, memory }));
        Ok(())
    }

    /// Registers a mutable slice the caller keeps alive (see
    /// [`register_host`](Self::register_host) for the contract).
    ///
    /// # Safety
    ///
    /// As for [`register_host`](Self::register_host): the slice's memory must outlive the
    /// registration, and nothing may touch the bytes of an in-flight write batch.
    pub unsafe fn register_slice(
        &mut self,
        id: RegionId,
        usage: RegionUse,
        bytes: &mut [u8],
    ) -> Result<(), RegistrationError> {
        // SAFETY: forwarded; the caller upholds the contract for the slice's memory.
        unsafe { self.register_host(id, usage, bytes.as_mut_ptr(), bytes.len()) }
    }

    /// Removes region `id`. Refused while a write batch may still touch it.
    pub fn deregister(&mut self, id: RegionId) -> Result<(), RegistrationError> {
        let reg = self
            .regions
            .get(&id)
            .ok_or(RegistrationError::NotRegistered(id))?;
        let holders = Arc::strong_count(reg) - 1;
        if holders > 0 {
            return Err(RegistrationError::InUse {
                region: id,
                holders,
            });
        }
        self.regions.remove(&id);
        Ok(())
    }

    /// The registration of `id`.
    pub fn get(&self, id: RegionId) -> Option<&Arc<Registration>> {
        self.regions.get(&id)
    }

    /// Registered regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Regions some in-flight write batch still holds.
    pub fn in_use(&self) -> usize {
        self.regions
            .values()
            .filter(|r| Arc::strong_count(r) > 1)
            .count()
    }
}
