//! The copy engine: lists of extents copied asynchronously on the engine's own streams, with
//! completion observed through CUDA events.
//!
//! 1. [`CopyEngine::submit`] merges extents that are contiguous on both sides into one copy
//!    ([`coalesce`]), so a write plan of many adjacent blocks becomes a few large copies.
//! 2. Each copy is issued on a stream of the device that executes it — the destination for
//!    device → device and host → device, the source for device → host and for peer copies
//!    (the GPU pushes over NVLink/PCIe; peer access is enabled once per pair of devices where
//!    the hardware allows it, otherwise the driver stages the copy) — spreading copies over the
//!    device's streams by bytes queued.
//! 3. One event is recorded behind the last copy on every stream used; the returned
//!    [`CopyTicket`] holds them. [`CopyTicket::is_complete`] polls them, [`CopyTicket::wait`]
//!    polls until a deadline. Nothing synchronizes a whole device or context.
//! 4. Device → device copies of one length whose sources and destinations each advance by a
//!    constant pitch (a head slice of every layer of a block, as tensor-parallel splits write)
//!    go as one 2D copy ([`strided_runs`], `cuMemcpy2DAsync`) instead of one call each: the
//!    driver calls, not the bytes, bound a batch of many small extents.
//! 5. Events are reused: a dropped ticket hands its events back to the engine's pool, and the
//!    next submission records them again, so a submission in steady state creates and destroys
//!    none (each is a driver call of its own on the submit path).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use crate::{check_driver, CudaError, Device};

/// Where one side of a copy lives, and its base address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Memory {
    /// Host memory (pinned or pageable) starting at `addr`.
    Host {
        /// The address of the first byte.
        addr: usize,
    },
    /// Device memory of device `ordinal` starting at device address `addr`.
    Device {
        /// The device.
        ordinal: usize,
        /// The device address of the first byte.
        addr: u64,
    },
}

impl Memory {
    /// The address of byte `offset`.
    fn at(self, offset: u64) -> u64 {
        match self {
            Memory::Host { addr } => addr as u64 + offset,
            Memory::Device { addr, .. } => addr + offset,
        }
    }

    fn ordinal(self) -> Option<usize> {
        match self {
            Memory::Host { .. } => None,
            Memory::Device { ordinal, .. } => Some(ordinal),
        }
    }
}

/// One extent: `len` bytes from `src` + `src_offset` to `dst` + `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyExtent {
    /// The source memory.
    pub src: Memory,
    /// First source byte.
    pub src_offset: u64,
    /// The destination memory.
    pub dst: Memory,
    /// First destination byte.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What kind of driver copy an extent becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Within one device (`cuMemcpyDtoDAsync`).
    DeviceToDevice {
        /// The device.
        ordinal: usize,
    },
    /// Between two devices (`cuMemcpyPeerAsync`).
    Peer {
        /// The source device.
        src: usize,
        /// The destination device.
        dst: usize,
    },
    /// Host to device (`cuMemcpyHtoDAsync`).
    HostToDevice {
        /// The device.
        ordinal: usize,
    },
    /// Device to host (`cuMemcpyDtoHAsync`).
    DeviceToHost {
        /// The device.
        ordinal: usize,
    },
}

impl Direction {
    /// The device whose stream carries the copy.
    pub fn executor(self) -> usize {
        match self {
            Direction::DeviceToDevice { ordinal }
            | Direction::HostToDevice { ordinal }
            | Direction::DeviceToHost { ordinal } => ordinal,
            Direction::Peer { src, .. } => src,
        }
    }
}

/// One driver copy: absolute addresses (host addresses as integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyOp {
    /// Its kind.
    pub direction: Direction,
    /// The first source byte.
    pub src: u64,
    /// The first destination byte.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Turns extents into driver copies, merging each extent into the previous copy when both
/// sides continue it (same direction, same memory on each side, source and destination both
/// contiguous). Empty extents vanish. Host → host extents are refused: they are the caller's
/// `memcpy`.
pub fn coalesce(extents: &[CopyExtent], out: &mut Vec<CopyOp>) -> Result<(), CudaError> {
    coalesce_in(extents, out, &mut Vec::new())
}

/// [`coalesce`], also giving each copy's memory on both sides (`memories[i]` for `out[i]`).
fn coalesce_in(
    extents: &[CopyExtent],
    out: &mut Vec<CopyOp>,
    memories: &mut Vec<(Memory, Memory)>,
) -> Result<(), CudaError> {
    out.clear();
    memories.clear();
    for (index, e) in extents.iter().enumerate() {
        let direction = match (e.src.ordinal(), e.dst.ordinal()) {
            (None, None) => return Err(CudaError::HostToHost { index }),
            (Some(s), Some(d)) if s == d => Direction::DeviceToDevice { ordinal: s },
            (Some(src), Some(dst)) => Direction::Peer { src, dst },
            (None, Some(ordinal)) => Direction::HostToDevice { ordinal },
            (Some(ordinal), None) => Direction::DeviceToHost { ordinal },
        };
        if e.len == 0 {
            continue;
        }
        let (src, dst) = (e.src.at(e.src_offset), e.dst.at(e.dst_offset));
        if let Some(last) = out.last_mut() {
            if last.direction == direction
                && memories.last() == Some(&(e.src, e.dst))
                && last.src.checked_add(last.len) == Some(src)
                && last.dst.checked_add(last.len) == Some(dst)
            {
                last.len += e.len;
                continue;
            }
        }
        out.push(CopyOp {
            direction,
            src,
            dst,
            len: e.len,
        });
        memories.push((e.src, e.dst));
    }
    Ok(())
}

/// The largest pitch a 2D copy is given (the driver's limit is at least 2^31 - 1 on every
/// device it supports).
const MAX_PITCH: u64 = (1 << 31) - 1;

/// A run of `rows` copies of one direction and length whose sources advance by `src_pitch`
/// and destinations by `dst_pitch` bytes from `first`'s (one copy when `rows` is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct StridedRun {
    /// The first copy (its length is each row's).
    first: CopyOp,
    /// Copies in the run.
    rows: u64,
    /// Bytes from one row's source to the next's.
    src_pitch: u64,
    /// Bytes from one row's destination to the next's.
    dst_pitch: u64,
}

impl StridedRun {
    /// Bytes the run copies.
    fn bytes(&self) -> u64 {
        self.first.len * self.rows
    }

    /// Row `k` as a copy of its own.
    fn row(&self, k: u64) -> CopyOp {
        CopyOp {
            src: self.first.src + k * self.src_pitch,
            dst: self.first.dst + k * self.dst_pitch,
            ..self.first
        }
    }
}

/// Groups `copies` (as [`coalesce_in`] leaves them, with their `memories`) into runs, in
/// order: consecutive device → device copies of one device, one length and the same memory on
/// each side (a 2D copy's span, gaps included, must lie in one allocation) whose sources and
/// destinations advance by constant pitches, each at least the length (rows never overlap)
/// and at most [`MAX_PITCH`], form one run; every other copy is a run of one.
fn strided_runs(copies: &[CopyOp], memories: &[(Memory, Memory)], out: &mut Vec<StridedRun>) {
    out.clear();
    let mut i = 0;
    while i < copies.len() {
        let first = copies[i];
        let mut run = StridedRun {
            first,
            rows: 1,
            src_pitch: 0,
            dst_pitch: 0,
        };
        if let (Direction::DeviceToDevice { .. }, Some(next)) = (first.direction, copies.get(i + 1))
        {
            let pitch = |a: u64, b: u64| {
                b.checked_sub(a)
                    .filter(|&p| p >= first.len && p <= MAX_PITCH)
            };
            if let (true, Some(sp), Some(dp)) = (
                next.direction == first.direction
                    && next.len == first.len
                    && memories.get(i + 1) == memories.get(i),
                pitch(first.src, next.src),
                pitch(first.dst, next.dst),
            ) {
                run.src_pitch = sp;
                run.dst_pitch = dp;
                while let Some(c) = copies.get(i + run.rows as usize) {
                    if memories.get(i + run.rows as usize) != memories.get(i) {
                        break;
                    }
                    let at = |base: u64, p: u64| {
                        p.checked_mul(run.rows).and_then(|o| base.checked_add(o))
                    };
                    if c.direction != first.direction
                        || c.len != first.len
                        || Some(c.src) != at(first.src, sp)
                        || Some(c.dst) != at(first.dst, dp)
                    {
                        break;
                    }
                    run.rows += 1;
                }
            }
        }
        i += run.rows as usize;
        out.push(run);
    }
}

/// Picks the stream for a copy: the one with the fewest bytes queued by this submission
/// (the first such on ties), so a single large copy stays on the first stream and many copies
/// spread evenly.
pub fn least_loaded(queued: &[u64]) -> usize {
    let mut best = 0;
    for (i, &q) in queued.iter().enumerate() {
        if q < queued[best] {
            best = i;
        }
    }
    best
}

/// A device's streams, created on first use.
#[derive(Debug)]
struct DeviceStreams {
    device: Device,
    streams: Vec<sys::CUstream>,
}

/// Copies lists of extents between host and device memory and between devices, on its own
/// non-blocking streams (`streams_per_device` on each device it executes copies on; devices are
/// opened on first use).
///
/// Submissions on one engine are not ordered against each other unless they share a stream;
/// every submission's [`CopyTicket`] says when its own copies are done.
#[derive(Debug)]
pub struct CopyEngine {
    streams_per_device: usize,
    devices: Vec<DeviceStreams>,
    /// (executor, peer) pairs whose peer access was looked at.
    peers: Vec<(usize, usize)>,
    copies: Vec<CopyOp>,
    memories: Vec<(Memory, Memory)>,
    runs: Vec<StridedRun>,
    queued: Vec<u64>,
    used: Vec<bool>,
    /// Events of dropped tickets, ready to be recorded again.
    events: Arc<EventPool>,
}

/// Events of dropped tickets, kept for reuse (shared by an engine and its tickets; the last
/// holder destroys what is left).
#[derive(Debug, Default)]
struct EventPool {
    free: Mutex<Vec<(Device, sys::CUevent)>>,
}

/// Events kept at most (per engine, all devices).
const MAX_POOLED_EVENTS: usize = 64;

// SAFETY: the pool owns its events (no ticket holds them any more); every driver call on one
// binds its device's context first, and the driver API may be called from any thread. The
// mutex serialises access to the list.
unsafe impl Send for EventPool {}
// SAFETY: as above; all access goes through the mutex.
unsafe impl Sync for EventPool {}

impl EventPool {
    /// A free event of device `ordinal`, if one is kept.
    fn take(&self, ordinal: usize) -> Option<(Device, sys::CUevent)> {
        let mut free = self.free.lock().ok()?;
        let i = free.iter().position(|(d, _)| d.ordinal() == ordinal)?;
        Some(free.swap_remove(i))
    }

    /// Keeps a completed event, or destroys it when the pool is full.
    fn put(&self, device: Device, event: sys::CUevent) {
        if let Ok(mut free) = self.free.lock() {
            if free.len() < MAX_POOLED_EVENTS {
                free.push((device, event));
                return;
            }
        }
        destroy_event(&device, event);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let free = match self.free.get_mut() {
            Ok(free) => std::mem::take(free),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for (device, event) in free {
            destroy_event(&device, event);
        }
    }
}

/// Destroys `event` of `device` (errors are ignored: nothing is left to do about them).
fn destroy_event(device: &Device, event: sys::CUevent) {
    if device.bind().is_ok() {
        // SAFETY: the caller owns the event and hands it over; no one queries it afterwards.
        let _ = unsafe { result::event::destroy(event) };
    }
}

// SAFETY: the engine owns its streams; every driver call on them binds their device's context
// first, and the driver API may be called from any thread. `&mut self` on every method that
// uses them keeps calls on one engine from racing.
unsafe impl Send for CopyEngine {}

impl CopyEngine {
    /// An engine with `streams_per_device` streams (at least one) on each device it uses.
    /// Checks the driver; opens no device yet.
    pub fn new(streams_per_device: usize) -> Result<CopyEngine, CudaError> {
        check_driver()?;
        Ok(CopyEngine {
            streams_per_device: streams_per_device.max(1),
            devices: Vec::new(),
            peers: Vec::new(),
            copies: Vec::new(),
            memories: Vec::new(),
            runs: Vec::new(),
            queued: Vec::new(),
            used: Vec::new(),
            events: Arc::default(),
        })
    }

    /// The streams of device `ordinal`, opening it and creating them on first use.
    fn device(&mut self, ordinal: usize) -> Result<usize, CudaError> {
        if let Some(i) = self
            .devices
            .iter()
            .position(|d| d.device.ordinal() == ordinal)
        {
            return Ok(i);
        }
        let device = Device::open(ordinal)?;
        device.bind()?;
        let mut streams = Vec::with_capacity(self.streams_per_device);
        for _ in 0..self.streams_per_device {
            match result::stream::create(result::stream::StreamKind::NonBlocking) {
                Ok(s) => streams.push(s),
                Err(e) => {
                    for s in streams {
                        // SAFETY: created just above, never used.
                        let _ = unsafe { result::stream::destroy(s) };
                    }
                    return Err(CudaError::driver("cuStreamCreate")(e));
                }
            }
        }
        self.devices.push(DeviceStreams { device, streams });
        Ok(self.devices.len() - 1)
    }

    /// Enables `executor`'s access to `peer`'s memory once, where the hardware allows it.
    fn enable_peer(&mut self, executor: usize, peer: usize) -> Result<(), CudaError> {
        if self.peers.contains(&(executor, peer)) {
            return Ok(());
        }
        let e = self.device(executor)?;
        let p = self.device(peer)?;
        let (exec, peer_dev) = (&self.devices[e].device, &self.devices[p].device);
        if exec.can_access_peer(peer_dev)? {
            exec.bind()?;
            // SAFETY: both contexts are live primary contexts; the executor's is current.
            let r = unsafe { sys::cuCtxEnablePeerAccess(peer_dev.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS
                && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(CudaError::driver("cuCtxEnablePeerAccess")(
                    cudarc::driver::DriverError(r),
                ));
            }
        }
        self.peers.push((executor, peer));
        Ok(())
    }

    /// Issues the copies of `extents` (merged where contiguous) on the engine's streams and
    /// returns at once with a ticket that tells when they are done.
    ///
    /// On an error nothing of this submission is left running (streams it already used are
    /// waited for), so the caller may reuse the memory at once.
    ///
    /// # Safety
    ///
    /// Every extent's bytes must be valid memory of the kind it names (device addresses of
    /// that device's allocations; host addresses the process may read or write) and must stay
    /// valid, untouched by anything else, until the ticket reports completion — dropping the
    /// ticket does not stop the copies. Destination ranges must not overlap each other or a
    /// source range.
    pub unsafe fn submit(&mut self, extents: &[CopyExtent]) -> Result<CopyTicket, CudaError> {
        let mut copies = std::mem::take(&mut self.copies);
        let mut memories = std::mem::take(&mut self.memories);
        let mut runs = std::mem::take(&mut self.runs);
        let r = coalesce_in(extents, &mut copies, &mut memories).and_then(|()| {
            strided_runs(&copies, &memories, &mut runs);
            // SAFETY: forwarded; the caller upholds the contract for these copies.
            unsafe { self.issue(&runs) }
        });
        self.copies = copies;
        self.memories = memories;
        self.runs = runs;
        r
    }

    /// Issues `copies`, grouped by executing device in order of first appearance.
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn issue(&mut self, copies: &[StridedRun]) -> Result<CopyTicket, CudaError> {
        let mut ticket = CopyTicket {
            events: Vec::new(),
            pool: Some(self.events.clone()),
            bytes: copies.iter().map(StridedRun::bytes).sum(),
            copies: copies.len(),
        };
        let mut executors: Vec<usize> = Vec::new();
        for c in copies.iter().map(|r| &r.first) {
            if let Direction::Peer { src, dst } = c.direction {
                self.enable_peer(src, dst)?;
            }
            if !executors.contains(&c.direction.executor()) {
                executors.push(c.direction.executor());
            }
        }
        for ordinal in executors {
            let d = self.device(ordinal)?;
            self.used.clear();
            let r = self.devices[d].device.bind().and_then(|()| {
                // SAFETY: forwarded; the caller upholds the contract for these copies.
                unsafe { self.issue_on(d, ordinal, copies, &mut ticket) }
            });
            if let Err(e) = r {
                // Leave nothing running that the caller cannot see: wait for what this
                // submission issued so far (on this device's streams and in earlier events),
                // then report.
                for s in 0..self.used.len() {
                    if self.used[s] {
                        // SAFETY: a live stream of this engine.
                        let _ = unsafe { result::stream::synchronize(self.devices[d].streams[s]) };
                    }
                }
                let _ = ticket.wait(Instant::now() + Duration::from_secs(60));
                return Err(e);
            }
        }
        Ok(ticket)
    }

    /// Issues the copies that device slot `d` (ordinal `ordinal`, its context current)
    /// executes and records an event behind them on every stream used.
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn issue_on(
        &mut self,
        d: usize,
        ordinal: usize,
        copies: &[StridedRun],
        ticket: &mut CopyTicket,
    ) -> Result<(), CudaError> {
        let n = self.devices[d].streams.len();
        self.queued.clear();
        self.queued.resize(n, 0);
        self.used.clear();
        self.used.resize(n, false);
        for c in copies
            .iter()
            .filter(|c| c.first.direction.executor() == ordinal)
        {
            let s = least_loaded(&self.queued);
            self.queued[s] += c.bytes();
            self.used[s] = true;
            if c.rows == 1 {
                // SAFETY: forwarded; the caller vouches for the addresses.
                unsafe { self.copy_on(d, s, &c.first) }?;
            // SAFETY: as above, for every row of the run.
            } else if unsafe { self.copy_2d_on(d, s, c) }.is_err() {
                // The driver refused the 2D copy (it checks the arguments when the copy is
                // issued, and then enqueues nothing): the rows one by one.
                for k in 0..c.rows {
                    // SAFETY: as above.
                    unsafe { self.copy_on(d, s, &c.row(k)) }?;
                }
            }
        }
        for s in 0..n {
            if self.used[s] {
                let dev = &self.devices[d];
                let (device, event) = match self.events.take(ordinal) {
                    Some(pooled) => pooled,
                    None => (
                        dev.device.clone(),
                        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                            .map_err(CudaError::driver("cuEventCreate"))?,
                    ),
                };
                ticket.events.push((device, event));
                // SAFETY: an event this ticket alone holds (fresh or from the pool) and a live
                // stream of the current context.
                unsafe { result::event::record(event, dev.streams[s]) }
                    .map_err(CudaError::driver("cuEventRecord"))?;
            }
        }
        Ok(())
    }

    /// Issues a strided run of device → device copies as one 2D copy on stream `s` of device
    /// slot `d` (its context is current).
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn copy_2d_on(&self, d: usize, s: usize, run: &StridedRun) -> Result<(), CudaError> {
        let stream = self.devices[d].streams[s];
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: run.first.src,
            srcArray: std::ptr::null_mut(),
            srcPitch: run.src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: run.first.dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: run.dst_pitch as usize,
            WidthInBytes: run.first.len as usize,
            Height: run.rows as usize,
        };
        // SAFETY: the caller guarantees every row's addresses are valid device memory for the
        // row's length until the ticket completes ([`strided_runs`] formed the run from those
        // copies); the descriptor lives across the call.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) }
            .result()
            .map_err(CudaError::driver("cuMemcpy2DAsync"))
    }

    /// Issues one copy on stream `s` of device slot `d` (its context is current).
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn copy_on(&self, d: usize, s: usize, c: &CopyOp) -> Result<(), CudaError> {
        let stream = self.devices[d].streams[s];
        let len = c.len as usize;
        // SAFETY (all arms): the caller guarantees the addresses are valid memory of the kinds
        // `coalesce` read from the extents, for `len` bytes, until the ticket completes.
        unsafe {
            match c.direction {
                Direction::DeviceToDevice { .. } => {
                    result::memcpy_dtod_async(c.dst, c.src, len, stream)
                        .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
                }
                Direction::HostToDevice { .. } => {
                    sys::cuMemcpyHtoDAsync_v2(c.dst, c.src as usize as *const _, len, stream)
                        .result()
                        .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
                }
                Direction::DeviceToHost { .. } => {
                    sys::cuMemcpyDtoHAsync_v2(c.dst as usize as *mut _, c.src, len, stream)
                        .result()
                        .map_err(CudaError::driver("cuMemcpyDtoHAsync"))
                }
                Direction::Peer { src, dst } => {
                    let ctx = |o: usize| {
                        self.devices
                            .iter()
                            .find(|x| x.device.ordinal() == o)
                            .map(|x| x.device.cu_ctx())
                    };
                    let (Some(src_ctx), Some(dst_ctx)) = (ctx(src), ctx(dst)) else {
                        return Err(CudaError::NoDevice {
                            ordinal: dst,
                            count: self.devices.len(),
                        });
                    };
                    result::memcpy_peer_async(dst_ctx, c.dst, src_ctx, c.src, len, stream)
                        .map_err(CudaError::driver("cuMemcpyPeerAsync"))
                }
            }
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Destroying a stream with work queued returns at once; the driver releases it when
        // the work is done. Tickets hold their own events, so they stay valid.
        for d in &self.devices {
            if d.device.bind().is_ok() {
                for &s in &d.streams {
                    // SAFETY: created by this engine, destroyed once.
                    let _ = unsafe { result::stream::destroy(s) };
                }
            }
        }
    }
}

/// The copies of one [`CopyEngine::submit`]: done when every event it holds has completed.
#[derive(Debug)]
#[must_use = "the copies may still be running: poll or wait on the ticket before reusing their memory"]
pub struct CopyTicket {
    events: Vec<(Device, sys::CUevent)>,
    /// Where completed events go when the ticket is dropped (`None`: destroyed).
    pool: Option<Arc<EventPool>>,
    bytes: u64,
    copies: usize,
}

// SAFETY: the ticket owns its events; every call on one binds its device's context first, and
// the driver API may be called from any thread.
unsafe impl Send for CopyTicket {}
// SAFETY: querying an event (`&self`) does not change it.
unsafe impl Sync for CopyTicket {}

impl CopyTicket {
    /// Bytes the submission copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Driver copies issued (extents after merging contiguous ones; a strided run counts once).
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// Whether every copy has finished (`cuEventQuery`; never blocks). A copy that failed on
    /// the device is an error.
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        for (device, event) in &self.events {
            device.bind()?;
            // SAFETY: an event created and recorded by the engine, destroyed only in `drop`.
            match unsafe { result::event::query(*event) } {
                Ok(()) => {}
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
                Err(e) => return Err(CudaError::driver("cuEventQuery")(e)),
            }
        }
        Ok(true)
    }

    /// Polls until every copy has finished or `deadline` passes (then
    /// [`CudaError::Timeout`]; the copies keep running). Spins for the first tenth of a
    /// millisecond, then sleeps in short steps.
    pub fn wait(&self, deadline: Instant) -> Result<(), CudaError> {
        let start = Instant::now();
        loop {
            if self.is_complete()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CudaError::Timeout {
                    waited_ms: (now - start).as_millis() as u64,
                });
            }
            if now - start < Duration::from_micros(100) {
                std::thread::yield_now();
            } else {
                std::thread::sleep((deadline - now).min(Duration::from_micros(20)));
            }
        }
    }
}

impl Drop for CopyTicket {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            // Recording an event again replaces what it captured, and this ticket, the only
            // one that looked at it, is gone: the next submission can use it as it is.
            for (device, event) in std::mem::take(&mut self.events) {
                pool.put(device, event);
            }
            return;
        }
        for (device, event) in &self.events {
            if device.bind().is_ok() {
                // SAFETY: created by the engine, destroyed once; destroying an event whose
                // work is pending is allowed (resources are released when it completes).
                let _ = unsafe { result::event::destroy(*event) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(addr: u64) -> Memory {
        Memory::Device { ordinal: 0, addr }
    }

    fn ext(src: Memory, so: u64, dst: Memory, d: u64, len: u64) -> CopyExtent {
        CopyExtent {
            src,
            src_offset: so,
            dst,
            dst_offset: d,
            len,
        }
    }

    #[test]
    fn extents_contiguous_on_both_sides_become_one_copy() {
        let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
        let extents = [
            ext(a, 0, b, 0, 100),
            ext(a, 100, b, 100, 50),
            ext(a, 150, b, 150, 0),
            ext(a, 150, b, 150, 10),
            // Source continues, destination does not: a new copy.
            ext(a, 160, b, 500, 10),
            // Destination continues, source does not.
            ext(a, 0, b, 510, 10),
        ];
        let mut out = Vec::new();
        coalesce(&extents, &mut out).unwrap();
        let d = Direction::DeviceToDevice { ordinal: 0 };
        assert_eq!(
            out,
            vec![
                CopyOp {
                    direction: d,
                    src: 0x1000_0000,
                    dst: 0x2000_0000,
                    len: 160
                },
                CopyOp {
                    direction: d,
                    src: 0x1000_0000 + 160,
                    dst: 0x2000_0000 + 500,
                    len: 10
                },
                CopyOp {
                    direction: d,
                    src: 0x1000_0000,
                    dst: 0x2000_0000 + 510,
                    len: 10
                },
            ]
        );
        assert_eq!(out.iter().map(|c| c.len).sum::<u64>(), 180);
    }

    #[test]
    fn directions_follow_the_two_sides_and_never_merge_across_kinds() {
        let host = Memory::Host { addr: 0x5000 };
        let d0 = dev(0x1_0000_0000);
        let d1 = Memory::Device {
            ordinal: 1,
            addr: 0x1_0000_0000,
        };
        let mut out = Vec::new();
        coalesce(
            &[
                ext(host, 0, d0, 0, 8),
                // Contiguous in addresses, but device to host: its own copy.
                ext(d0, 0, host, 8, 8),
                ext(d0, 8, d1, 8, 8),
                ext(d1, 16, d0, 16, 8),
            ],
            &mut out,
        )
        .unwrap();
        let dirs: Vec<_> = out.iter().map(|c| c.direction).collect();
        assert_eq!(
            dirs,
            vec![
                Direction::HostToDevice { ordinal: 0 },
                Direction::DeviceToHost { ordinal: 0 },
                Direction::Peer { src: 0, dst: 1 },
                Direction::Peer { src: 1, dst: 0 },
            ]
        );
        assert_eq!(out[2].direction.executor(), 0);
        assert_eq!(out[3].direction.executor(), 1);
        assert_eq!(out[0].direction.executor(), 0);
    }

    #[test]
    fn host_to_host_extents_are_refused_with_their_index() {
        let host = Memory::Host { addr: 0x5000 };
        let mut out = Vec::new();
        assert_eq!(
            coalesce(
                &[ext(dev(0), 0, host, 0, 4), ext(host, 0, host, 64, 4)],
                &mut out
            ),
            Err(CudaError::HostToHost { index: 1 })
        );
    }

    #[test]
    fn copies_go_to_the_least_loaded_stream() {
        assert_eq!(least_loaded(&[0, 0]), 0);
        assert_eq!(least_loaded(&[10, 0, 5]), 1);
        assert_eq!(least_loaded(&[10, 10, 5]), 2);
    }

    fn runs_of(extents: &[CopyExtent]) -> Vec<StridedRun> {
        let (mut copies, mut memories, mut runs) = (Vec::new(), Vec::new(), Vec::new());
        coalesce_in(extents, &mut copies, &mut memories).unwrap();
        strided_runs(&copies, &memories, &mut runs);
        runs
    }

    #[test]
    fn head_slices_of_every_layer_become_one_strided_run() {
        // One head (8 KiB) of four, for 80 layer planes: sources adjacent, destinations 32 KiB
        // apart; then a copy of another length ends the run.
        let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
        let mut extents: Vec<_> = (0..80u64)
            .map(|l| ext(a, l * 8192, b, l * 32768 + 2 * 8192, 8192))
            .collect();
        extents.push(ext(a, 1 << 24, b, 1 << 24, 100));
        let runs = runs_of(&extents);
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0].rows, runs[0].src_pitch, runs[0].dst_pitch),
            (80, 8192, 32768)
        );
        assert_eq!(runs[0].first.src, 0x1000_0000);
        assert_eq!(runs[0].first.dst, 0x2000_0000 + 2 * 8192);
        assert_eq!(runs[0].bytes(), 80 * 8192);
        assert_eq!((runs[1].rows, runs[1].first.len), (1, 100));
        assert_eq!(runs[0].row(79).src, 0x1000_0000 + 79 * 8192);
        assert_eq!(runs[0].row(79).dst, 0x2000_0000 + 79 * 32768 + 2 * 8192);
    }

    #[test]
    fn only_device_copies_with_constant_forward_pitches_form_runs() {
        let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
        let host = Memory::Host { addr: 0x7000_0000 };
        let count =
            |extents: &[CopyExtent]| runs_of(extents).iter().map(|r| r.rows).collect::<Vec<_>>();
        // Backwards destinations: one copy each.
        assert_eq!(
            count(&[ext(a, 0, b, 4096, 64), ext(a, 64, b, 0, 64)]),
            vec![1, 1]
        );
        // Rows that would overlap (pitch below the length): one copy each.
        assert_eq!(
            count(&[ext(a, 0, b, 0, 64), ext(a, 128, b, 32, 64)]),
            vec![1, 1]
        );
        // The pitch changes after three rows: a run of three, then a new run.
        assert_eq!(
            count(&[
                ext(a, 0, b, 0, 64),
                ext(a, 100, b, 200, 64),
                ext(a, 200, b, 400, 64),
                ext(a, 1000, b, 1000, 64),
                ext(a, 1100, b, 1100, 64),
            ]),
            vec![3, 2]
        );
        // Host → device copies are never strided.
        assert_eq!(
            count(&[ext(host, 0, b, 0, 64), ext(host, 100, b, 200, 64)]),
            vec![1, 1]
        );
        // A pitch past the limit: one copy each.
        assert_eq!(
            count(&[ext(a, 0, b, 0, 64), ext(a, 1 << 32, b, 1 << 32, 64)]),
            vec![1, 1]
        );
        // Rows in two allocations (pools) on one side: a run per allocation, since a 2D
        // copy's span must lie in one.
        let c = dev(0x3000_0000);
        assert_eq!(
            count(&[
                ext(a, 0, b, 0, 64),
                ext(a, 100, b, 200, 64),
                ext(c, 0, b, 400, 64),
                ext(c, 100, b, 600, 64),
            ]),
            vec![2, 2]
        );
        // Contiguous extents of two allocations do not merge either.
        let mut copies = Vec::new();
        coalesce(
            &[ext(a, 0, b, 0, 64), ext(dev(0x1000_0040), 0, b, 64, 64)],
            &mut copies,
        )
        .unwrap();
        assert_eq!(copies.len(), 2);
        let mut runs = vec![];
        strided_runs(&[], &[], &mut runs);
        assert!(runs.is_empty());
    }
}
