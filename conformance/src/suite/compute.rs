//! How the engine model's simulated prefill compute passes: the engine's thread waits out each
//! layer range's share of the compute time, sleeping ([`SimulatedCompute::Sleep`]), or a kernel
//! keeps a GPU busy for that share and the thread waits for it as a serving engine waits for
//! its forward pass ([`SimulatedCompute::Gpu`]).
//!
//! The difference shows on the device path's tail. A serving engine's GPU computes the next
//! layers while one range's KV leaves, and the thread that hands a range over (vLLM's
//! `save_kv_layer`, or a thread waiting on the layer's CUDA event) is running when the range
//! is done. A sleeping simulation leaves the GPU idle and the thread asleep, and both pay a
//! wake-up on the tail: the first copy after an idle GPU starts tens of microseconds late
//! (docs/PERFORMANCE.md, "Run 4").

use kvpipe_core::Instant;

use super::{Link, LinkError};

/// How the simulated prefill compute passes (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SimulatedCompute {
    /// The engine's thread waits out each range's compute time, asleep between pumps.
    #[default]
    Sleep,
    /// A kernel keeps GPU `ordinal` busy for each range's compute time (`cuda` feature); the
    /// range is computed when the kernel is seen done, and the engine's thread waits for
    /// that by polling, as a serving engine's thread waits on its forward pass.
    #[cfg(feature = "cuda")]
    Gpu {
        /// The GPU.
        ordinal: usize,
    },
}

/// How long before a range's compute is over the engine stops sleeping and polls.
#[cfg(feature = "cuda")]
const POLL_BEFORE: std::time::Duration = std::time::Duration::from_micros(300);

/// The running simulated compute of one workload.
pub(super) struct Compute {
    #[cfg(feature = "cuda")]
    busy: Option<kvpipe_cuda::BusyKernel>,
}

impl Compute {
    pub(super) fn new(how: SimulatedCompute) -> Result<Compute, LinkError> {
        match how {
            SimulatedCompute::Sleep => Ok(Compute {
                #[cfg(feature = "cuda")]
                busy: None,
            }),
            #[cfg(feature = "cuda")]
            SimulatedCompute::Gpu { ordinal } => {
                let gpu = |e: kvpipe_cuda::CudaError| LinkError::Transport(e.to_string());
                let device = kvpipe_cuda::Device::open(ordinal).map_err(gpu)?;
                Ok(Compute {
                    busy: Some(kvpipe_cuda::BusyKernel::new(&device).map_err(gpu)?),
                })
            }
        }
    }

    /// A range's compute begins now and lasts until `ready`.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn start(&mut self, now: Instant, ready: Instant) -> Result<(), LinkError> {
        #[cfg(feature = "cuda")]
        if let Some(busy) = &mut self.busy {
            let share = if ready > now {
                std::time::Duration::from_nanos((ready - now).as_nanos())
            } else {
                std::time::Duration::ZERO
            };
            busy.launch(share)
                .map_err(|e| LinkError::Transport(e.to_string()))?;
        }
        Ok(())
    }

    /// Whether the range whose compute lasts until `ready` is computed.
    pub(super) fn is_over(&self, now: Instant, ready: Instant) -> Result<bool, LinkError> {
        #[cfg(feature = "cuda")]
        if let Some(busy) = &self.busy {
            return busy
                .is_done()
                .map_err(|e| LinkError::Transport(e.to_string()));
        }
        Ok(now >= ready)
    }

    /// Waits (driving `link`) for at most `max`, or less near the end of the compute: with a
    /// GPU kernel the last stretch is polled, not slept through.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn wait(
        &self,
        link: &mut impl Link,
        now: Instant,
        ready: Instant,
        max: std::time::Duration,
    ) {
        #[cfg(feature = "cuda")]
        if self.busy.is_some() {
            let left = if ready > now {
                std::time::Duration::from_nanos((ready - now).as_nanos())
            } else {
                std::time::Duration::ZERO
            };
            match left.checked_sub(POLL_BEFORE) {
                Some(sleep) if !sleep.is_zero() => link.wait(max.min(sleep)),
                _ => std::hint::spin_loop(),
            }
            return;
        }
        link.wait(max);
    }
}
