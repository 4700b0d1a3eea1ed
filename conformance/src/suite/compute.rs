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
        /// Each range is handed over as soon as its compute is queued, behind a fence its
        /// copies wait for on the GPU (as vLLM calls `save_kv_layer` while the layer's kernels
        /// are queued), where the transport gates slices (the in-process one): the range's
        /// content is put in place first, then its kernel runs for the range's whole share
        /// while the range is handed over. Elsewhere, and when `false`, the range is handed
        /// over once the compute is seen done. The aux data (the first token) still goes once
        /// the compute is over, and the tail is measured from the compute's end.
        fenced: bool,
    },
}

/// The time from `now` to `ready`, zero once it passed.
pub(super) fn time_until(now: Instant, ready: Instant) -> std::time::Duration {
    // The core's `Instant` subtraction saturates at zero.
    std::time::Duration::from_nanos((ready - now).as_nanos())
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
            SimulatedCompute::Gpu { ordinal, .. } => {
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
            let share = time_until(now, ready);
            busy.launch(share)
                .map_err(|e| LinkError::Transport(e.to_string()))?;
        }
        Ok(())
    }

    /// A fence behind the compute launched so far, where it runs on a GPU.
    #[cfg(feature = "cuda")]
    pub(super) fn fence(&self) -> Result<Option<std::sync::Arc<kvpipe_cuda::Fence>>, LinkError> {
        match &self.busy {
            Some(busy) => busy
                .fence()
                .map(|f| Some(std::sync::Arc::new(f)))
                .map_err(|e| LinkError::Transport(e.to_string())),
            None => Ok(None),
        }
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

    /// Near the end of a GPU compute (within [`POLL_BEFORE`] of `ready`), polls its kernel
    /// until it is done, driving nothing meanwhile, and returns `Some(at)`, `at` being `clock()`
    /// read just before the query that saw the kernel done: the range is computed no later
    /// than it was seen, not a pump later (a pump may be carrying out the range's own copy,
    /// queued behind a fence). `None` elsewhere, and after a second of polling past `ready`
    /// (the caller goes on driving and asks again).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn poll_until_over(
        &self,
        now: Instant,
        ready: Instant,
        clock: impl Fn() -> Instant,
    ) -> Result<Option<Instant>, LinkError> {
        #[cfg(feature = "cuda")]
        if let Some(busy) = &self.busy {
            let left = time_until(now, ready);
            if left > POLL_BEFORE {
                return Ok(None);
            }
            let give_up = std::time::Instant::now() + left + std::time::Duration::from_secs(1);
            loop {
                let at = clock();
                if busy
                    .is_done()
                    .map_err(|e| LinkError::Transport(e.to_string()))?
                {
                    return Ok(Some(at));
                }
                if std::time::Instant::now() > give_up {
                    return Ok(None);
                }
                std::hint::spin_loop();
            }
        }
        Ok(None)
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
            let left = time_until(now, ready);
            match left.checked_sub(POLL_BEFORE) {
                Some(sleep) if !sleep.is_zero() => link.wait(max.min(sleep)),
                _ => std::hint::spin_loop(),
            }
            return;
        }
        link.wait(max);
    }
}
