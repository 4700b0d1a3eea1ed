//! The GPU path as built without the `cuda` feature: the same API, over nothing. No device
//! region can be made ([`DeviceRegion`] has no values), so no payload is ever device memory and
//! the staging calls have nothing to do; whatever would reach a GPU refuses with
//! [`GpuError::NotBuilt`].

use std::collections::HashMap;

use kvpipe_core::RegionId;

use crate::config::TcpConfig;
use crate::memory::RegionTable;
use crate::peer_copy::{OfferEntry, PlacedRegion};

/// What the GPU path says in a build without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum GpuError {
    /// Device memory, or a GPU, was asked for.
    #[error("kvpipe-tcp was built without the `cuda` feature")]
    NotBuilt,
}

/// Whether this build reaches GPUs: it does not.
pub(crate) fn supported() -> Result<(), GpuError> {
    Err(GpuError::NotBuilt)
}

/// Device memory, which this build cannot register: never constructed, so it is never a
/// region's memory.
#[derive(Clone, Debug)]
pub(crate) enum DeviceRegion {}

impl DeviceRegion {
    pub(crate) fn ordinal(&self) -> usize {
        match *self {}
    }

    pub(crate) fn ptr(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn contains(&self, _offset: u64, _len: u64) -> bool {
        match *self {}
    }
}

/// How a connection half would stage device memory: nothing to configure.
#[derive(Clone)]
pub(crate) struct StagingSpec;

impl StagingSpec {
    pub(crate) fn from_config(_config: &TcpConfig) -> Self {
        StagingSpec
    }
}

/// A writer's staging, which never holds anything: no payload is device memory.
pub(crate) struct SendStaging;

impl SendStaging {
    /// Nothing is staged, so nothing is kept ahead of the socket for it.
    pub(crate) fn ring_bytes(_config: &TcpConfig) -> usize {
        0
    }

    pub(crate) fn new(_spec: StagingSpec) -> Self {
        SendStaging
    }

    /// Refuses: there is no device memory to stage.
    ///
    /// # Safety
    ///
    /// None needed (nothing is read); `unsafe` as in the `cuda` build.
    pub(crate) unsafe fn stage(
        &mut self,
        _seq: u64,
        _ordinal: usize,
        _addr: u64,
        _len: u64,
    ) -> Result<bool, GpuError> {
        Err(GpuError::NotBuilt)
    }

    pub(crate) fn poll(&mut self) -> Result<(), GpuError> {
        Ok(())
    }

    pub(crate) fn wait_first(&mut self, _seq: u64) -> Result<(), GpuError> {
        Ok(())
    }

    /// Nothing staged: only an empty payload is whole.
    pub(crate) fn ready_bytes<'a>(
        &'a self,
        _seq: u64,
        len: u64,
        _emit: impl FnMut(u64, &'a [u8]),
    ) -> bool {
        len == 0
    }

    pub(crate) fn release(&mut self, _seq: u64, _written: u64) {}

    pub(crate) fn settle(&mut self) {}
}

/// A reader's staging, which is never active: no write lands in device memory.
pub(crate) struct RecvStaging;

impl RecvStaging {
    pub(crate) fn new(_spec: StagingSpec) -> Self {
        RecvStaging
    }

    pub(crate) fn active(&self) -> bool {
        false
    }

    /// Refuses: there is no device memory to land in.
    pub(crate) fn begin(&mut self, _ordinal: usize, _addr: u64) -> Result<(), GpuError> {
        Err(GpuError::NotBuilt)
    }

    pub(crate) fn buffer(&mut self, _max: usize) -> &mut [u8] {
        &mut []
    }

    pub(crate) fn filled(&mut self, _n: usize, _last: bool) -> Result<(), GpuError> {
        Ok(())
    }

    pub(crate) fn finish_write(&mut self) -> Result<(), GpuError> {
        Ok(())
    }

    pub(crate) fn abandon(&mut self) {}
}

/// A reader's pulls, which refuse: this build copies nothing device to device.
pub(crate) struct PullCopies;

impl PullCopies {
    pub(crate) fn new(_spec: StagingSpec) -> Self {
        PullCopies
    }

    /// Refuses.
    ///
    /// # Safety
    ///
    /// None needed (nothing is copied); `unsafe` as in the `cuda` build.
    pub(crate) unsafe fn copy(
        &mut self,
        _src: (usize, u64),
        _dst: (usize, u64),
        _len: u64,
    ) -> Result<(), GpuError> {
        Err(GpuError::NotBuilt)
    }
}

/// Opened peer regions: there are none.
#[derive(Debug, Default)]
pub(crate) struct IpcMappings;

/// Refuses: this build cannot export regions.
pub(crate) fn export(_regions: &RegionTable) -> Result<Vec<OfferEntry>, String> {
    Err(GpuError::NotBuilt.to_string())
}

/// Refuses: this build cannot open a peer's regions.
pub(crate) fn import(
    _entries: &[OfferEntry],
    _regions: &RegionTable,
) -> Result<(HashMap<RegionId, PlacedRegion>, IpcMappings), String> {
    Err(GpuError::NotBuilt.to_string())
}
