//! The receiver's peer copies ([`crate::peer_copy`]): each admitted write copied device →
//! device from the sender's exported region into this node's own memory, by the reader, and
//! waited for before the write is reported landed.

use std::time::Instant;

use kvpipe_cuda::{CopyExtent, CudaError};

use super::staging::{device, StagingGpu, StagingSpec, STAGING_WAIT};

/// The reader's pulls: each admitted write copied by the GPU from the sender's exported region
/// (opened in this process) into this node's own destination, on a stream of the reader's own,
/// and waited for before the write is reported landed. So no copy into this node's memory
/// outlives the reader's report of it.
pub(crate) struct PullCopies {
    spec: StagingSpec,
    gpu: Option<Box<dyn StagingGpu>>,
}

impl PullCopies {
    pub(crate) fn new(spec: StagingSpec) -> Self {
        PullCopies { spec, gpu: None }
    }

    /// Copies `len` bytes from device address `src` to device address `dst` (each
    /// `(ordinal, address)`) and waits for the copy (bounded by [`STAGING_WAIT`]). A copy that
    /// does not finish in time is left running, with its ticket and engine kept alive for good,
    /// and is an error.
    ///
    /// # Safety
    ///
    /// `src` stays valid, and `dst` is memory nobody else writes or reads, until this returns.
    pub(crate) unsafe fn copy(
        &mut self,
        src: (usize, u64),
        dst: (usize, u64),
        len: u64,
    ) -> Result<(), CudaError> {
        if self.gpu.is_none() {
            self.gpu = Some((self.spec.gpu)()?);
        }
        let gpu = self.gpu.as_mut().expect("created above");
        let extent = CopyExtent {
            src: device(src.0, src.1),
            src_offset: 0,
            dst: device(dst.0, dst.1),
            dst_offset: 0,
            len,
        };
        // SAFETY: forwarded from the caller.
        let copy = unsafe { gpu.copy(extent) }?;
        if let Err(e) = copy.wait(Instant::now() + STAGING_WAIT) {
            std::mem::forget(copy);
            std::mem::forget(self.gpu.take());
            return Err(e);
        }
        Ok(())
    }
}
