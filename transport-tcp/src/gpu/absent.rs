//! The GPU path as built without the `cuda` feature: the same API, over nothing. No device
//! region can be made ([`DeviceRegion`] has no values), so no payload is ever device memory and
//! the staging calls have nothing to do; whatever would reach a GPU refuses with
//! [`GpuError::NotBuilt`].

use std::collections::HashMap;

use kvpipe_core::RegionId;

use crate::config::TcpConfig;
use crate::gpu::{OfferEntry, PlacedRegion};

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
pub(crate) fn export<'a>(
    _regions: impl Iterator<Item = (RegionId, Option<&'a DeviceRegion>)>,
) -> Result<Vec<OfferEntry>, String> {
    Err(GpuError::NotBuilt.to_string())
}

/// Refuses: this build cannot open a peer's regions.
pub(crate) fn import(
    _entries: &[OfferEntry],
    _ordinal: usize,
) -> Result<(HashMap<RegionId, PlacedRegion>, IpcMappings), String> {
    Err(GpuError::NotBuilt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOT_BUILT: &str = "kvpipe-tcp was built without the `cuda` feature";

    #[test]
    fn whatever_needs_a_gpu_refuses_and_says_why() {
        assert_eq!(supported().unwrap_err().to_string(), NOT_BUILT);
        assert_eq!(
            export(std::iter::once((RegionId(1), None))).unwrap_err(),
            NOT_BUILT
        );
        assert_eq!(import(&[], 0).unwrap_err(), NOT_BUILT);
        let spec = StagingSpec::from_config(&TcpConfig::default());
        let mut pulls = PullCopies::new(spec.clone());
        // SAFETY: the stand-in copies nothing.
        let pulled = unsafe { pulls.copy((0, 0x1000), (0, 0x2000), 8) };
        assert_eq!(pulled, Err(GpuError::NotBuilt));
        let mut recv = RecvStaging::new(spec.clone());
        assert_eq!(recv.begin(0, 0x1000), Err(GpuError::NotBuilt));
        assert!(!recv.active(), "a refused write is not being staged");
        let mut send = SendStaging::new(spec);
        // SAFETY: the stand-in reads nothing.
        assert_eq!(
            unsafe { send.stage(1, 0, 0x1000, 8) },
            Err(GpuError::NotBuilt)
        );
    }

    #[test]
    fn staging_holds_nothing_and_keeps_nothing_ahead_of_the_socket() {
        let config = TcpConfig {
            staging_slots: 4,
            staging_slot_bytes: 1 << 20,
            ..TcpConfig::default()
        };
        assert_eq!(SendStaging::ring_bytes(&config), 0);
        let send = SendStaging::new(StagingSpec::from_config(&config));
        let mut emitted = 0;
        assert!(
            send.ready_bytes(1, 0, |_, _| emitted += 1),
            "an empty payload is whole"
        );
        assert!(
            !send.ready_bytes(1, 8, |_, _| emitted += 1),
            "no bytes are ever staged"
        );
        assert_eq!(emitted, 0);
        let mut recv = RecvStaging::new(StagingSpec::from_config(&config));
        assert!(recv.buffer(64).is_empty());
    }
}
