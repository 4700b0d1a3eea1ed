//! [`CopyEngine`]: its streams on each device it uses, peer access, and submitting a list of
//! extents (coalesced, grouped into strided runs, spread over the streams by bytes queued).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use super::copies::{coalesce_in, CopyExtent, CopyOp, Direction, Memory};
use super::events::EventPool;
use super::rows::RowCopier;
use super::strided::{strided_runs, StridedRun};
use super::ticket::CopyTicket;
use crate::{check_driver, CudaError, Device, Fence};

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
    /// The row-copy kernel for strided runs (`None`: turned off, or the driver could not load
    /// it: strided runs then go as 2D copies).
    rows: Option<RowCopier>,
    /// Whether the kernel was ever launched here (the engine's drop then waits for the streams
    /// before it unloads the kernel).
    launched: bool,
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
    /// Whether strided device → device runs may go through the row-copy kernel.
    row_kernel: bool,
}

/// Set to `0` in the environment, a [`CopyEngine`] issues strided device → device runs as
/// `cuMemcpy2DAsync` copies instead of through kvpipe's row-copy kernel (the copy engines then
/// do all the work, and the SMs none). [`CopyEngine::set_row_kernel`] overrides it.
pub const COPY_KERNEL_ENV: &str = "KVPIPE_CUDA_COPY_KERNEL";

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
            row_kernel: std::env::var_os(COPY_KERNEL_ENV).is_none_or(|v| v != "0"),
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
        // Without the kernel (turned off, or a driver that cannot load it) strided runs go as
        // 2D copies.
        let rows = self.row_kernel.then(|| RowCopier::load().ok()).flatten();
        self.devices.push(DeviceStreams {
            device,
            streams,
            rows,
            launched: false,
        });
        Ok(self.devices.len() - 1)
    }

    /// Whether strided device → device runs (more than one row of one length, at constant
    /// pitches, all aligned to 16 bytes) go through kvpipe's row-copy kernel (`true`, the
    /// default unless [`COPY_KERNEL_ENV`] is `0`) or as `cuMemcpy2DAsync` copies. Applies to
    /// devices opened after the call.
    pub fn set_row_kernel(&mut self, on: bool) {
        self.row_kernel = on;
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
        // SAFETY: forwarded.
        unsafe { self.submit_after(extents, None) }
    }

    /// [`submit`](Self::submit), with every copy starting on the GPU only once the work before
    /// `after` has run (`cuStreamWaitEvent` on each stream the submission uses; the call
    /// itself never waits). The host does not have to see that work done before it issues
    /// the copies, so they start as soon as it is over.
    ///
    /// A later submission that lands on one of those streams queues behind this one, so it
    /// waits for the fence too: fine for an engine whose ranges are computed in the order they
    /// are submitted, as a forward pass computes them.
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit), with "until the ticket reports completion" covering the
    /// wait for the fence as well: the source bytes may still be being written by the work
    /// before the fence (that is its point), and nothing else may touch them.
    pub unsafe fn submit_after(
        &mut self,
        extents: &[CopyExtent],
        after: Option<&Fence>,
    ) -> Result<CopyTicket, CudaError> {
        let mut copies = std::mem::take(&mut self.copies);
        let mut memories = std::mem::take(&mut self.memories);
        let mut runs = std::mem::take(&mut self.runs);
        let r = coalesce_in(extents, &mut copies, &mut memories).and_then(|()| {
            strided_runs(&copies, &memories, &mut runs);
            // SAFETY: forwarded; the caller upholds the contract for these copies.
            unsafe { self.issue(&runs, after) }
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
    unsafe fn issue(
        &mut self,
        copies: &[StridedRun],
        after: Option<&Fence>,
    ) -> Result<CopyTicket, CudaError> {
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
                unsafe { self.issue_on(d, ordinal, copies, after, &mut ticket) }
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
    /// executes, each stream first waiting for `after`, and records an event behind them on
    /// every stream used.
    ///
    /// # Safety
    ///
    /// As for [`submit_after`](Self::submit_after).
    unsafe fn issue_on(
        &mut self,
        d: usize,
        ordinal: usize,
        copies: &[StridedRun],
        after: Option<&Fence>,
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
            if let (false, Some(fence)) = (self.used[s], after) {
                // SAFETY: a live stream of this engine, its context current.
                unsafe { fence.hold(self.devices[d].streams[s]) }?;
            }
            self.used[s] = true;
            if c.rows == 1 {
                // SAFETY: forwarded; the caller vouches for the addresses.
                unsafe { self.copy_on(d, s, &c.first) }?;
            // SAFETY: as above, for every row of the run.
            } else if unsafe { self.rows_on(d, s, c) } {
                // The kernel took it.
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

    /// Launches the row-copy kernel for `run` on stream `s` of device slot `d` (its context is
    /// current) where it is loaded and fits the run; `false`: not launched (nothing enqueued).
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn rows_on(&mut self, d: usize, s: usize, run: &StridedRun) -> bool {
        let dev = &mut self.devices[d];
        let Some(rows) = dev.rows.as_ref().filter(|_| RowCopier::fits(run)) else {
            return false;
        };
        // SAFETY: it fits, and the caller vouches for every row's addresses; the rows do not
        // overlap (every pitch is at least the length, as `strided_runs` formed the run).
        let launched = unsafe { rows.launch(run, dev.streams[s]) }.is_ok();
        dev.launched |= launched;
        launched
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
                if let Some(rows) = &d.rows {
                    if d.launched {
                        // The kernel's module goes with the engine: its launches must be over
                        // first (copies take microseconds).
                        for &s in &d.streams {
                            // SAFETY: a live stream of this engine.
                            let _ = unsafe { result::stream::synchronize(s) };
                        }
                    }
                    // SAFETY: nothing of it is queued or running any more.
                    unsafe { rows.unload() };
                }
                for &s in &d.streams {
                    // SAFETY: created by this engine, destroyed once.
                    let _ = unsafe { result::stream::destroy(s) };
                }
            }
        }
    }
}
