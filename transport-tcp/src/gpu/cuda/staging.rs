//! Device memory on a byte stream (`cuda` feature): pinned host staging slots between the GPU
//! and the socket, pipelined so neither waits on the other.
//!
//! A connection half that meets device memory allocates, once, a ring of
//! [`TcpConfig::staging_slots`](crate::TcpConfig::staging_slots) pinned slots of
//! [`TcpConfig::staging_slot_bytes`](crate::TcpConfig::staging_slot_bytes) each, and a copy
//! engine with a stream of its own.
//!
//! - **Sending** ([`SendStaging`]): the writer keeps the ring full ahead of the socket: every
//!   free slot gets the next bytes of the next device payloads in stream order (device → pinned,
//!   asynchronous), so while the socket takes slot *k* the GPU fills slots *k + 1*, *k + 2*, …
//!   A slot's bytes go into a vectored write only once its copy completed, and the slot is
//!   refilled only once those bytes were written out.
//! - **Receiving** ([`RecvStaging`]): payload bytes of an admitted device write are read from the
//!   socket into the current slot; a full slot (or the payload's last bytes) is copied up
//!   (pinned → device, asynchronous) and reading goes on into the next slot, which is reused only
//!   after its previous copy completed. When the payload's last byte is read, the reader waits
//!   for the write's copies and only then reports the write landed: a write is landed when its
//!   bytes are in device memory, as the transport contract says.
//!
//! Waits are for copies of at most one slot issued earlier (tens to hundreds of microseconds at
//! PCIe speed), bounded by [`STAGING_WAIT`]; the shells do not know about them (the async shell
//! spends them on its worker, as it spends a socket write's memory copy). Nothing is reported
//! (a batch written, a write finished, a half stopped) while a copy that touches its
//! memory may still run.
//!
//! The GPU is reached through [`StagingGpu`] ([`CudaGpu`] over `kvpipe-cuda`), so the
//! bookkeeping is tested without one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpipe_cuda::{CopyEngine, CopyExtent, CopyTicket, CudaError, Device, Memory, PinnedBuffer};

use crate::config::TcpConfig;

/// The longest wait for one staging copy; past it the connection fails.
pub(crate) const STAGING_WAIT: Duration = Duration::from_secs(60);

/// Host memory staging copies go through (page-locked, so the GPU's copy engines reach it).
pub(crate) trait StagingMemory: Send {
    /// The first byte.
    fn ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
}

impl StagingMemory for PinnedBuffer {
    fn ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        PinnedBuffer::len(self)
    }
}

/// A copy the GPU may still be running.
pub(crate) trait PendingCopy: Send {
    /// Whether it finished (never blocks).
    fn is_complete(&self) -> Result<bool, CudaError>;
    /// Waits until it finished or `deadline` passed.
    fn wait(&self, deadline: Instant) -> Result<(), CudaError>;
}

impl PendingCopy for CopyTicket {
    fn is_complete(&self) -> Result<bool, CudaError> {
        CopyTicket::is_complete(self)
    }
    fn wait(&self, deadline: Instant) -> Result<(), CudaError> {
        CopyTicket::wait(self, deadline)
    }
}

/// What staging needs of the GPU.
pub(crate) trait StagingGpu: Send {
    /// `len` bytes of pinned host memory, allocated through GPU `ordinal`'s context.
    fn allocate(&mut self, ordinal: usize, len: usize)
        -> Result<Box<dyn StagingMemory>, CudaError>;

    /// Starts one asynchronous copy.
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::submit`]: both sides valid and untouched by anything else until the
    /// copy completed.
    unsafe fn copy(&mut self, extent: CopyExtent) -> Result<Box<dyn PendingCopy>, CudaError>;
}

/// The GPU through `kvpipe-cuda`: pinned buffers, and a copy engine with one stream per device
/// (a connection half's copies run in order).
pub(crate) struct CudaGpu {
    engine: CopyEngine,
}

impl StagingGpu for CudaGpu {
    fn allocate(
        &mut self,
        ordinal: usize,
        len: usize,
    ) -> Result<Box<dyn StagingMemory>, CudaError> {
        let device = Device::open(ordinal)?;
        Ok(Box::new(PinnedBuffer::new(&device, len)?))
    }

    unsafe fn copy(&mut self, extent: CopyExtent) -> Result<Box<dyn PendingCopy>, CudaError> {
        // SAFETY: forwarded; the caller upholds the engine's contract.
        Ok(Box::new(unsafe { self.engine.submit(&[extent]) }?))
    }
}

/// Makes the GPU handle of one connection half, on its first device payload.
pub(crate) type GpuFactory = Arc<dyn Fn() -> Result<Box<dyn StagingGpu>, CudaError> + Send + Sync>;

/// How a connection half stages device memory.
#[derive(Clone)]
pub(crate) struct StagingSpec {
    /// Bytes per slot.
    pub(crate) slot_bytes: usize,
    /// Slots in the ring.
    pub(crate) slots: usize,
    /// The GPU.
    pub(crate) gpu: GpuFactory,
}

impl StagingSpec {
    /// The node's settings over the real GPU.
    pub(crate) fn from_config(config: &TcpConfig) -> Self {
        StagingSpec {
            slot_bytes: config.staging_slot_bytes.max(4096),
            slots: config.staging_slots.max(2),
            gpu: Arc::new(|| {
                Ok(Box::new(CudaGpu {
                    engine: CopyEngine::new(1)?,
                }) as Box<dyn StagingGpu>)
            }),
        }
    }
}

/// The pinned ring and the GPU it belongs to.
struct Ring {
    gpu: Box<dyn StagingGpu>,
    memory: Box<dyn StagingMemory>,
    slot_bytes: usize,
    slots: usize,
}

impl Ring {
    fn new(spec: &StagingSpec, ordinal: usize) -> Result<Ring, CudaError> {
        let mut gpu = (spec.gpu)()?;
        let memory = gpu.allocate(ordinal, spec.slot_bytes * spec.slots)?;
        Ok(Ring {
            gpu,
            memory,
            slot_bytes: spec.slot_bytes,
            slots: spec.slots,
        })
    }

    /// The host address of slot `slot`.
    fn slot_addr(&self, slot: usize) -> usize {
        debug_assert!(slot < self.slots && (slot + 1) * self.slot_bytes <= self.memory.len());
        self.memory.ptr() as usize + slot * self.slot_bytes
    }
}

fn host(addr: usize) -> Memory {
    Memory::Host { addr }
}

/// Device address `addr` of GPU `ordinal`.
pub(super) fn device(ordinal: usize, addr: u64) -> Memory {
    Memory::Device { ordinal, addr }
}

/// Waits for every copy of `copies` (bounded by [`STAGING_WAIT`] in all).
fn wait_all<'a>(copies: impl Iterator<Item = &'a Box<dyn PendingCopy>>) -> Result<(), CudaError> {
    let deadline = Instant::now() + STAGING_WAIT;
    let mut result = Ok(());
    for c in copies {
        if let Err(e) = c.wait(deadline) {
            result = Err(e);
        }
    }
    result
}

/// One slot's worth of a device payload being staged for sending.
struct SendPart {
    /// The stream entry (piece) it belongs to.
    seq: u64,
    /// Its first byte's offset in the piece's payload.
    offset: u64,
    /// Bytes.
    len: usize,
    /// The device → pinned copy, until it completed.
    copy: Option<Box<dyn PendingCopy>>,
}

/// The writer's staging: device payloads copied into the ring ahead of the socket (see the
/// module doc). Pieces are identified by a sequence number the writer gives each queue entry.
pub(crate) struct SendStaging {
    spec: StagingSpec,
    ring: Option<Ring>,
    /// Staged parts in stream order; part `i` occupies slot `(head + i) % slots`.
    parts: VecDeque<SendPart>,
    head: usize,
    /// Pieces up to this sequence number are wholly staged.
    staged_through: u64,
    /// Bytes staged of the piece after them.
    cursor: u64,
    /// Copies left running when the ring could not be waited for (never reused or freed).
    abandoned: bool,
}

impl SendStaging {
    /// Bytes a writer keeps ahead of its socket for device payloads: every slot of the ring
    /// (as configured, before `StagingSpec::from_config`'s floors).
    pub(crate) fn ring_bytes(config: &TcpConfig) -> usize {
        config
            .staging_slots
            .saturating_mul(config.staging_slot_bytes)
    }

    pub(crate) fn new(spec: StagingSpec) -> Self {
        SendStaging {
            spec,
            ring: None,
            parts: VecDeque::new(),
            head: 0,
            staged_through: 0,
            cursor: 0,
            abandoned: false,
        }
    }

    /// Stages what fits of piece `seq` (`len` payload bytes at device address `addr` of GPU
    /// `ordinal`). Pieces must be offered in stream order, each until it is wholly staged.
    /// `Ok(true)`: the piece is wholly staged; `Ok(false)`: the ring is full.
    ///
    /// # Safety
    ///
    /// The device bytes stay valid and unchanged until the piece is released
    /// ([`SendStaging::release`]) or the staging is settled.
    pub(crate) unsafe fn stage(
        &mut self,
        seq: u64,
        ordinal: usize,
        addr: u64,
        len: u64,
    ) -> Result<bool, CudaError> {
        if seq <= self.staged_through {
            return Ok(true);
        }
        if self.ring.is_none() {
            self.ring = Some(Ring::new(&self.spec, ordinal)?);
        }
        let ring = self.ring.as_mut().expect("created above");
        while self.cursor < len && self.parts.len() < ring.slots {
            let n = (len - self.cursor).min(ring.slot_bytes as u64);
            let slot = (self.head + self.parts.len()) % ring.slots;
            let extent = CopyExtent {
                src: device(ordinal, addr),
                src_offset: self.cursor,
                dst: host(ring.slot_addr(slot)),
                dst_offset: 0,
                len: n,
            };
            // SAFETY: the slot is free (not among the staged parts, so no write reads it and no
            // copy writes it); the device bytes are the caller's to keep valid until released.
            let copy = unsafe { ring.gpu.copy(extent) }?;
            self.parts.push_back(SendPart {
                seq,
                offset: self.cursor,
                len: n as usize,
                copy: Some(copy),
            });
            self.cursor += n;
        }
        if self.cursor < len {
            return Ok(false);
        }
        self.staged_through = seq;
        self.cursor = 0;
        Ok(true)
    }

    /// Notes every copy that completed, in order (stops at the first still running).
    pub(crate) fn poll(&mut self) -> Result<(), CudaError> {
        for part in &mut self.parts {
            match &part.copy {
                None => {}
                Some(c) if c.is_complete()? => part.copy = None,
                Some(_) => break,
            }
        }
        Ok(())
    }

    /// Waits for the first staged part of piece `seq`, if it is still being copied.
    pub(crate) fn wait_first(&mut self, seq: u64) -> Result<(), CudaError> {
        if let Some(part) = self.parts.front_mut().filter(|p| p.seq == seq) {
            if let Some(c) = &part.copy {
                c.wait(Instant::now() + STAGING_WAIT)?;
                part.copy = None;
            }
        }
        Ok(())
    }

    /// Calls `emit(offset, bytes)` with the staged parts of piece `seq` in order (`offset`: the
    /// part's place in the payload), as long as their copies completed. Returns whether every
    /// part up to the payload's end (`len`) was emitted (`false`: later bytes are still being
    /// copied, or not staged yet).
    pub(crate) fn ready_bytes<'a>(
        &'a self,
        seq: u64,
        len: u64,
        mut emit: impl FnMut(u64, &'a [u8]),
    ) -> bool {
        let Some(ring) = &self.ring else {
            return len == 0;
        };
        let mut end = 0;
        for (i, part) in self.parts.iter().enumerate() {
            if part.seq != seq {
                if part.seq > seq {
                    break;
                }
                continue;
            }
            if part.copy.is_some() {
                return false;
            }
            let slot = (self.head + i) % ring.slots;
            // SAFETY: the part's copy completed and the slot is not refilled before the part is
            // released, which happens only after these bytes were written (`&self` is borrowed
            // for as long as the slices live).
            let bytes =
                unsafe { std::slice::from_raw_parts(ring.slot_addr(slot) as *const u8, part.len) };
            emit(part.offset, bytes);
            end = part.offset + part.len as u64;
        }
        end == len
    }

    /// Frees the parts of piece `seq` whose bytes lie below payload offset `written` (all of
    /// them with `u64::MAX`).
    pub(crate) fn release(&mut self, seq: u64, written: u64) {
        let Some(ring) = &self.ring else {
            return;
        };
        while let Some(part) = self.parts.front() {
            if part.seq > seq || (part.seq == seq && part.offset + part.len as u64 > written) {
                break;
            }
            debug_assert!(
                part.copy.is_none(),
                "bytes written before their copy finished"
            );
            self.parts.pop_front();
            self.head = (self.head + 1) % ring.slots;
        }
    }

    /// Waits for every copy still running (the writer stops: its pieces' memory is released
    /// once it reports). On failure the ring is kept alive for good rather than freed under a
    /// copy that may still write it.
    pub(crate) fn settle(&mut self) {
        let result = wait_all(self.parts.iter().filter_map(|p| p.copy.as_ref()));
        self.parts.clear();
        if result.is_err() && !self.abandoned {
            self.abandoned = true;
            std::mem::forget(self.ring.take());
        }
    }

    /// Parts staged now (tests).
    #[cfg(test)]
    pub(crate) fn staged_parts(&self) -> usize {
        self.parts.len()
    }
}

/// Where the device write being received goes.
#[derive(Clone, Copy, Debug)]
struct DeviceWrite {
    ordinal: usize,
    /// The device address of the current slot's first byte.
    dst: u64,
}

/// The reader's staging: payload bytes of an admitted device write read into the ring and
/// copied up slot by slot (see the module doc).
pub(crate) struct RecvStaging {
    spec: StagingSpec,
    ring: Option<Ring>,
    /// Per slot: the pinned → device copy last issued from it, until it completed.
    copies: Vec<Option<Box<dyn PendingCopy>>>,
    slot: usize,
    fill: usize,
    write: Option<DeviceWrite>,
}

impl RecvStaging {
    pub(crate) fn new(spec: StagingSpec) -> Self {
        RecvStaging {
            spec,
            ring: None,
            copies: Vec::new(),
            slot: 0,
            fill: 0,
            write: None,
        }
    }

    /// Whether a device write is being read.
    pub(crate) fn active(&self) -> bool {
        self.write.is_some()
    }

    /// A device write's payload follows: its bytes go to device address `addr` of GPU
    /// `ordinal`. Makes the current slot free (waits for its previous copy).
    pub(crate) fn begin(&mut self, ordinal: usize, addr: u64) -> Result<(), CudaError> {
        if self.ring.is_none() {
            let ring = Ring::new(&self.spec, ordinal)?;
            self.copies = (0..ring.slots).map(|_| None).collect();
            self.ring = Some(ring);
        }
        self.fill = 0;
        self.free_slot(self.slot)?;
        self.write = Some(DeviceWrite { ordinal, dst: addr });
        Ok(())
    }

    /// Where the next payload bytes are read: at most `max` bytes of the current slot. Only
    /// while [`active`](Self::active).
    pub(crate) fn buffer(&mut self, max: usize) -> &mut [u8] {
        let Some(ring) = &self.ring else {
            return &mut [];
        };
        let take = (ring.slot_bytes - self.fill).min(max);
        // SAFETY: the current slot's previous copy completed (`begin` and `filled` wait for it
        // before making a slot current) and no copy reads it until `filled` issues one, so this
        // is the only reference to these bytes while the socket read fills them.
        unsafe {
            std::slice::from_raw_parts_mut((ring.slot_addr(self.slot) + self.fill) as *mut u8, take)
        }
    }

    /// `n` bytes were read into [`buffer`](Self::buffer); `last`: they end the payload. A full
    /// slot, or the payload's end, is copied up; reading goes on in the next slot.
    pub(crate) fn filled(&mut self, n: usize, last: bool) -> Result<(), CudaError> {
        self.fill += n;
        let slot_bytes = self.ring.as_ref().map_or(0, |r| r.slot_bytes);
        if self.fill < slot_bytes && !last {
            return Ok(());
        }
        let (Some(ring), Some(write)) = (self.ring.as_mut(), self.write.as_mut()) else {
            return Ok(());
        };
        if self.fill > 0 {
            let extent = CopyExtent {
                src: host(ring.slot_addr(self.slot)),
                src_offset: 0,
                dst: device(write.ordinal, write.dst),
                dst_offset: 0,
                len: self.fill as u64,
            };
            // SAFETY: the slot holds the bytes just read and is not handed out again before
            // this copy completed; the destination is the admitted write's own memory (no other
            // admitted write overlaps it, and it stays pinned until the write is reported).
            let copy = unsafe { ring.gpu.copy(extent) }?;
            self.copies[self.slot] = Some(copy);
            write.dst += self.fill as u64;
            self.slot = (self.slot + 1) % ring.slots;
            self.fill = 0;
        }
        if last {
            return Ok(());
        }
        self.free_slot(self.slot)
    }

    /// The payload was read: waits until every byte of it is in device memory.
    pub(crate) fn finish_write(&mut self) -> Result<(), CudaError> {
        self.write = None;
        let result = wait_all(self.copies.iter().flatten());
        self.forget_copies(result.is_ok());
        result
    }

    /// The write is cut short: its bytes not copied yet are dropped, and the copies already
    /// issued are waited for (they write the admitted memory, which is released once the write
    /// is reported).
    pub(crate) fn abandon(&mut self) {
        self.write = None;
        self.fill = 0;
        let ok = wait_all(self.copies.iter().flatten()).is_ok();
        self.forget_copies(ok);
    }

    /// Drops the finished copies; after a failed wait keeps the ring alive for good rather than
    /// freeing it under a copy that may still read it.
    fn forget_copies(&mut self, ok: bool) {
        if ok {
            self.copies.iter_mut().for_each(|c| *c = None);
        } else if let Some(ring) = self.ring.take() {
            std::mem::forget(ring);
            std::mem::forget(std::mem::take(&mut self.copies));
        }
    }

    /// Waits for slot `slot`'s previous copy.
    fn free_slot(&mut self, slot: usize) -> Result<(), CudaError> {
        if let Some(c) = self.copies.get_mut(slot).and_then(Option::take) {
            if let Err(e) = c.wait(Instant::now() + STAGING_WAIT) {
                self.copies[slot] = Some(c);
                return Err(e);
            }
        }
        Ok(())
    }
}

/// A GPU for tests: "device" addresses are host addresses, copies are carried out only when
/// waited for or completed by the test, and every call is logged.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use kvpipe_cuda::{CopyExtent, CudaError, Memory};

    use super::{GpuFactory, PendingCopy, StagingGpu, StagingMemory, StagingSpec};

    /// What the fake GPU did, shared with the test.
    #[derive(Default)]
    pub(crate) struct FakeState {
        /// Copies not carried out yet.
        pending: Vec<(CopyExtent, Arc<AtomicBool>)>,
        /// "d2h LEN", "h2d LEN", "done LEN", "alloc LEN", in order.
        pub(crate) log: Vec<String>,
        /// The most copies pending at once.
        pub(crate) most_pending: usize,
    }

    fn addr(m: Memory, offset: u64) -> usize {
        match m {
            Memory::Host { addr } => addr + offset as usize,
            Memory::Device { addr, .. } => addr as usize + offset as usize,
        }
    }

    impl FakeState {
        fn carry_out(&mut self, i: usize) {
            let (e, done) = self.pending.remove(i);
            // SAFETY: the tests hand out addresses of live buffers they own for the whole test;
            // the staging code keeps both sides untouched until the copy completes, as it does
            // for the real GPU.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    addr(e.src, e.src_offset) as *const u8,
                    addr(e.dst, e.dst_offset) as *mut u8,
                    e.len as usize,
                );
            }
            done.store(true, Ordering::SeqCst);
            self.log.push(format!("done {}", e.len));
        }

        /// Carries out every pending copy.
        pub(crate) fn complete_all(&mut self) {
            while !self.pending.is_empty() {
                self.carry_out(0);
            }
        }

        /// Copies not carried out yet.
        pub(crate) fn pending(&self) -> usize {
            self.pending.len()
        }
    }

    struct FakeCopy {
        done: Arc<AtomicBool>,
        state: Arc<Mutex<FakeState>>,
    }

    impl PendingCopy for FakeCopy {
        fn is_complete(&self) -> Result<bool, CudaError> {
            Ok(self.done.load(Ordering::SeqCst))
        }
        fn wait(&self, _deadline: Instant) -> Result<(), CudaError> {
            let mut st = self.state.lock().unwrap();
            // Copies run in order on one stream: waiting for this one finishes those before.
            while !self.done.load(Ordering::SeqCst) {
                st.carry_out(0);
            }
            Ok(())
        }
    }

    struct HostAlloc {
        ptr: *mut u8,
        len: usize,
    }

    // SAFETY: owns its allocation, like a `Box<[u8]>`.
    unsafe impl Send for HostAlloc {}

    impl StagingMemory for HostAlloc {
        fn ptr(&self) -> *mut u8 {
            self.ptr
        }
        fn len(&self) -> usize {
            self.len
        }
    }

    impl Drop for HostAlloc {
        fn drop(&mut self) {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
            // SAFETY: from `Box::into_raw` in `allocate`, freed once.
            drop(unsafe { Box::from_raw(slice) });
        }
    }

    struct FakeGpu(Arc<Mutex<FakeState>>);

    impl StagingGpu for FakeGpu {
        fn allocate(
            &mut self,
            _ordinal: usize,
            len: usize,
        ) -> Result<Box<dyn StagingMemory>, CudaError> {
            self.0.lock().unwrap().log.push(format!("alloc {len}"));
            let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
            Ok(Box::new(HostAlloc { ptr, len }))
        }

        unsafe fn copy(&mut self, e: CopyExtent) -> Result<Box<dyn PendingCopy>, CudaError> {
            let mut st = self.0.lock().unwrap();
            let dir = match (e.src, e.dst) {
                (Memory::Device { .. }, Memory::Device { .. }) => "d2d",
                (Memory::Device { .. }, _) => "d2h",
                _ => "h2d",
            };
            st.log.push(format!("{dir} {}", e.len));
            let done = Arc::new(AtomicBool::new(false));
            st.pending.push((e, done.clone()));
            st.most_pending = st.most_pending.max(st.pending.len());
            Ok(Box::new(FakeCopy {
                done,
                state: self.0.clone(),
            }))
        }
    }

    /// A spec over a fake GPU and the state it shares with the test.
    pub(crate) fn spec(slot_bytes: usize, slots: usize) -> (StagingSpec, Arc<Mutex<FakeState>>) {
        let state = Arc::new(Mutex::new(FakeState::default()));
        let shared = state.clone();
        let gpu: GpuFactory =
            Arc::new(move || Ok(Box::new(FakeGpu(shared.clone())) as Box<dyn StagingGpu>));
        (
            StagingSpec {
                slot_bytes,
                slots,
                gpu,
            },
            state,
        )
    }

    /// A spec whose GPU cannot be reached (no driver).
    pub(crate) fn no_driver() -> StagingSpec {
        StagingSpec {
            slot_bytes: 8,
            slots: 2,
            gpu: Arc::new(|| Err(CudaError::NoDriver)),
        }
    }
}
