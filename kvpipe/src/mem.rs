//! The in-process transport behind a pair of handles: one `kvpipe-mem` pair, shared by the
//! prefill and the decode handle and pumped by whichever of them is used. Each handle takes
//! only its own endpoint's events.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant as StdInstant};

use kvpipe_core::{Event, Instant, PeerId, Side};
use kvpipe_mem::{Endpoint, MemPair, PairConfig, RegionUse};

use crate::config::{check_regions, region_bytes, NodeConfig, RawRegion};
use crate::role::Role;
use crate::EmbedError;

/// How the decode handle of a [`mem_pair`](crate::mem_pair) names the prefill side.
pub const MEM_SENDER_PEER: PeerId = kvpipe_mem::SENDER_PEER;
/// How the prefill handle of a [`mem_pair`](crate::mem_pair) names the decode side.
pub const MEM_RECEIVER_PEER: PeerId = kvpipe_mem::RECEIVER_PEER;

/// Longest one wait inside [`MemSide::next_event`] holds the pair, so the other handle's
/// commands are not kept waiting.
const WAIT_SLICE: Duration = Duration::from_millis(2);

struct MemState {
    pair: MemPair,
    /// Undelivered events: the prefill side's, then the decode side's.
    events: [VecDeque<Event>; 2],
}

impl MemState {
    fn pump(&mut self) -> Result<(), EmbedError> {
        self.pair.pump()?;
        for (side, _, event) in self.pair.take_events() {
            self.events[slot(side)].push_back(event);
        }
        Ok(())
    }
}

fn slot(side: Endpoint) -> usize {
    match side {
        Endpoint::Sender => 0,
        Endpoint::Receiver => 1,
    }
}

/// One handle's view of the shared pair.
pub(crate) struct MemSide {
    state: Arc<Mutex<MemState>>,
    side: Endpoint,
}

impl MemSide {
    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A panic elsewhere cannot leave the pair half-updated in a way the next pump cannot
        // read, so a poisoned lock is used as it is.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs one engine command on this side's endpoint, then lets the pair carry it out.
    pub(crate) fn command<E: Role, T>(
        &self,
        f: impl FnOnce(&mut E, Instant) -> Result<T, kvpipe_core::session::UsageError>,
    ) -> Result<T, EmbedError> {
        let mut st = self.lock();
        let now = st.pair.now();
        let out = f(E::of_pair(&mut st.pair), now)?;
        st.pump()?;
        Ok(out)
    }

    /// Runs a submission on the prefill endpoint and gates the slice it made behind `after`
    /// ([`MemPair::gate_slice`]) before the pair carries it out: its copies wait for the fence
    /// on the GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn submit_gated(
        &self,
        request: kvpipe_core::RequestId,
        after: &std::sync::Arc<kvpipe_cuda::Fence>,
        f: impl FnOnce(
            &mut kvpipe_core::Sender,
            Instant,
        ) -> Result<kvpipe_core::Submitted, kvpipe_core::session::UsageError>,
    ) -> Result<kvpipe_core::Submitted, EmbedError> {
        let mut st = self.lock();
        let now = st.pair.now();
        let out = f(st.pair.sender_mut(), now)?;
        if let Some(slice) = out.slice() {
            st.pair.gate_slice(request, slice, after.clone());
        }
        st.pump()?;
        Ok(out)
    }

    /// Reads the endpoint (a getter).
    pub(crate) fn read<E: Role, T>(&self, f: impl FnOnce(&mut E) -> T) -> T {
        f(E::of_pair(&mut self.lock().pair))
    }

    /// This side's next event, pumping the pair while waiting up to `timeout`.
    pub(crate) fn next_event(&self, timeout: Duration) -> Result<Option<Event>, EmbedError> {
        // The handle passes at most one slice (`Node::next_event` cuts longer waits up).
        let deadline = StdInstant::now() + timeout;
        loop {
            let mut st = self.lock();
            st.pump()?;
            if let Some(event) = st.events[slot(self.side)].pop_front() {
                return Ok(Some(event));
            }
            let left = deadline.saturating_duration_since(StdInstant::now());
            if left.is_zero() {
                return Ok(None);
            }
            st.pair.wait(left.min(WAIT_SLICE));
        }
    }

    /// Lets go of this side of the pair, as a process would by closing its connection: what
    /// it queued is carried first, then the side takes no more input, every write batch in
    /// flight to or from it is waited for (bounded by the transport's drain limit), and only
    /// then does the other side hear the disconnect, so its requests with this side fail with
    /// `PeerLost` at once and no later write touches this side's regions. Closing a side twice
    /// does nothing.
    pub(crate) fn close(&self) -> Result<(), EmbedError> {
        let mut st = self.lock();
        if !st.pair.is_alive(self.side) {
            return Ok(());
        }
        let queued = st.pump();
        st.pair.kill(self.side)?;
        st.events[slot(self.side)].clear();
        queued?;
        st.pump()
    }
}

impl Drop for MemSide {
    /// A dropped handle closes its side (see [`MemSide::close`]); a batch stuck past the drain
    /// limit cannot be reported from here, and the side is killed regardless.
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// Both sides of an in-process pair over these regions, connected (see
/// [`mem_pair`](crate::mem_pair), which wraps them in handles).
///
/// # Safety
/// Every region follows [`RawRegion`]'s contract until both sides are dropped.
pub(crate) unsafe fn sides(
    sender: &NodeConfig,
    sender_regions: &[RawRegion],
    receiver: &NodeConfig,
    receiver_regions: &[RawRegion],
) -> Result<(MemSide, MemSide), EmbedError> {
    check_regions(sender, sender_regions, Side::Sender)?;
    check_regions(receiver, receiver_regions, Side::Receiver)?;
    let mut sender_core = sender.sender_config();
    sender_core.region_bytes = region_bytes(sender_regions);
    let mut receiver_core = receiver.receiver_config();
    receiver_core.region_bytes = region_bytes(receiver_regions);
    // The pair connects once: a side that closed never comes back, as over TCP.
    sender_core.peer_ids_reused = false;
    receiver_core.peer_ids_reused = false;
    let mut pair = MemPair::new(PairConfig::new(sender_core, receiver_core))?;
    for (side, regions) in [
        (Endpoint::Sender, sender_regions),
        (Endpoint::Receiver, receiver_regions),
    ] {
        for r in regions {
            // SAFETY: the caller keeps the region valid while the pair exists.
            unsafe { register(&mut pair, side, r)? };
        }
    }
    pair.connect()?;
    let state = Arc::new(Mutex::new(MemState {
        pair,
        events: [VecDeque::new(), VecDeque::new()],
    }));
    let side = |side| MemSide {
        state: state.clone(),
        side,
    };
    Ok((side(Endpoint::Sender), side(Endpoint::Receiver)))
}

/// Registers `region` with `side` of `pair`: host memory copied by `memcpy`, GPU memory (`cuda`
/// feature) by the GPU's copy engines.
///
/// # Safety
/// As [`RawRegion`], until the pair is dropped.
unsafe fn register(
    pair: &mut MemPair,
    side: Endpoint,
    region: &RawRegion,
) -> Result<(), EmbedError> {
    match region.device {
        None => {
            // SAFETY: forwarded from the caller.
            unsafe {
                pair.register_host(side, region.id, RegionUse::KvPool, region.ptr, region.len)?
            };
        }
        #[cfg(feature = "cuda")]
        Some(ordinal) => {
            let node = match side {
                Endpoint::Sender => kvpipe_mem::Node::Sender(0),
                Endpoint::Receiver => kvpipe_mem::Node::Receiver(0),
            };
            let table = pair
                .network()
                .regions_mut(node)
                .expect("a pair has both endpoints");
            // SAFETY: forwarded from the caller: `ptr` is device memory of GPU `ordinal`
            // allocated in this process.
            unsafe {
                table.register_device(
                    region.id,
                    RegionUse::KvPool,
                    ordinal as usize,
                    region.ptr as u64,
                    region.len,
                )?
            };
        }
        #[cfg(not(feature = "cuda"))]
        Some(ordinal) => return Err(crate::gpu::refuse(region.id, ordinal)),
    }
    Ok(())
}
