//! The suite's harness over the in-process transport (`kvpipe-mem`).
//!
//! It lives here rather than in `kvpipe-mem` because this crate already depends on
//! `kvpipe-mem` (the `kvpipe` program runs the demo over it); `kvpipe-mem`'s own
//! `tests/conformance.rs` runs the suite through it.

use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::wire::Role;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Duration, Event, Instant, PeerId, Receiver, Sender};
use kvpipe_mem::{Endpoint, MemPair, PairConfig, RegionUse, RECEIVER_PEER, SENDER_PEER};
use kvpipe_netem::{BatchFault, LossModel, NetemConfig, ScriptedBatch};

use super::{BatchTiming, FaultKind, FaultPlan, Harness, Link, LinkError, PoolMemory};
use crate::cache::ReferenceCache;

/// Runs the suite over [`MemPair`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MemHarness {
    /// Copy threads per large write batch (`None`: the transport's default).
    pub copy_threads: Option<usize>,
    /// Where both caches' pools live (device memory: copied by the GPU's copy engines).
    pub memory: PoolMemory,
}

fn endpoint(side: Role) -> Endpoint {
    match side {
        Role::Sender => Endpoint::Sender,
        Role::Receiver => Endpoint::Receiver,
    }
}

/// The suite's fault plan as the mem transport's network emulation: lost frames vanish,
/// delayed ones hold up their link, reordered ones overtake the frame before them, handshakes
/// are spared, failed batches land half their bytes, stalled ones land and report late.
fn netem_config(faults: &FaultPlan) -> NetemConfig {
    let batch = |nth: u64, fault: BatchFault| ScriptedBatch {
        writer: 0,
        nth,
        fault,
    };
    let fail = BatchFault::Fail(TransferStatus::WriteFailed);
    let stall = BatchFault::Stall(Duration::from_millis(faults.stall_ms));
    NetemConfig {
        seed: faults.seed,
        loss: faults.drop,
        loss_model: LossModel::Drop,
        duplicate: faults.duplicate,
        reorder: faults.reorder,
        delay: faults.delay,
        delay_range: (Duration::ZERO, Duration::from_millis(faults.max_delay_ms)),
        write_failure: faults.fail_writes,
        scripted_batches: (faults.fail_batches.iter().map(|&n| batch(n, fail)))
            .chain(faults.stall_batches.iter().map(|&n| batch(n, stall)))
            .collect(),
        spare_handshake: true,
        ..NetemConfig::default()
    }
}

fn transport(e: impl std::fmt::Display) -> LinkError {
    LinkError::Transport(e.to_string())
}

impl Harness for MemHarness {
    type Link = MemPair;

    fn name(&self) -> &'static str {
        "mem"
    }

    fn supports(&self, _kind: FaultKind) -> bool {
        true
    }

    unsafe fn connect(
        &self,
        sender: SenderConfig,
        receiver: ReceiverConfig,
        sender_cache: &mut ReferenceCache,
        receiver_cache: &mut ReferenceCache,
        faults: &FaultPlan,
    ) -> Result<MemPair, LinkError> {
        let mut config = PairConfig::new(sender, receiver);
        if let Some(t) = self.copy_threads {
            config.copy_threads = t;
        }
        config.faults = netem_config(faults);
        let mut pair = MemPair::new(config).map_err(|e| LinkError::Transport(e.to_string()))?;
        for (side, cache) in [
            (Endpoint::Sender, &mut *sender_cache),
            (Endpoint::Receiver, &mut *receiver_cache),
        ] {
            self.memory.place(cache)?;
            let ids: Vec<_> = cache.region_ids().collect();
            for id in ids {
                #[cfg(feature = "cuda")]
                if let Some(pool) = cache.device_pool(id) {
                    // SAFETY: the cache owns the device buffer and outlives the pair (the
                    // caller's contract); the sessions pin blocks until quiesced.
                    unsafe {
                        pair.register_device(
                            side,
                            id,
                            RegionUse::KvPool,
                            pool.ordinal,
                            pool.ptr,
                            pool.len,
                        )
                    }
                    .map_err(transport)?;
                    continue;
                }
                let bytes = cache.region_mut(id).unwrap_or_default();
                // SAFETY: the caller keeps the caches alive and unmoved while the pair lives;
                // the sessions pin blocks until quiesced, and the suite's engine touches only
                // blocks no in-flight batch reads or writes.
                unsafe {
                    pair.register_host(side, id, RegionUse::KvPool, bytes.as_mut_ptr(), bytes.len())
                }
                .map_err(transport)?;
            }
        }
        pair.connect().map_err(transport)?;
        Ok(pair)
    }
}

impl Link for MemPair {
    fn now(&self) -> Instant {
        MemPair::now(self)
    }

    #[cfg(feature = "cuda")]
    fn gates_slices(&self) -> bool {
        true
    }

    #[cfg(feature = "cuda")]
    fn gate_slice(
        &mut self,
        request: kvpipe_core::RequestId,
        slice: kvpipe_core::SenderSliceId,
        fence: std::sync::Arc<kvpipe_cuda::Fence>,
    ) -> Result<(), LinkError> {
        MemPair::gate_slice(self, request, slice, fence);
        Ok(())
    }

    fn sender(&mut self) -> &mut Sender {
        self.sender_mut()
    }

    fn receiver(&mut self) -> &mut Receiver {
        self.receiver_mut()
    }

    fn sender_peer(&self) -> PeerId {
        SENDER_PEER
    }

    fn receiver_peer(&self) -> PeerId {
        RECEIVER_PEER
    }

    fn pump(&mut self) -> Result<(), LinkError> {
        MemPair::pump(self).map_err(transport)
    }

    fn wait(&mut self, max: std::time::Duration) {
        MemPair::wait(self, max);
    }

    fn take_events(&mut self) -> Vec<(Role, Instant, Event)> {
        MemPair::take_events(self)
            .into_iter()
            .map(|(e, at, ev)| {
                let side = match e {
                    Endpoint::Sender => Role::Sender,
                    Endpoint::Receiver => Role::Receiver,
                };
                (side, at, ev)
            })
            .collect()
    }

    fn kill(&mut self, side: Role) -> Result<(), LinkError> {
        MemPair::kill(self, endpoint(side)).map_err(transport)
    }

    fn is_alive(&self, side: Role) -> bool {
        MemPair::is_alive(self, endpoint(side))
    }

    fn writes_in_flight(&self) -> usize {
        MemPair::writes_in_flight(self)
    }

    fn batch_timings(&self) -> Vec<BatchTiming> {
        MemPair::batch_timings(self)
            .iter()
            .map(|t| BatchTiming {
                bytes: t.bytes,
                issued: t.issued,
                transfer: t.copy_finished - t.copy_started,
                copied: t.copy_finished,
                reported: t.reported,
            })
            .collect()
    }
}
