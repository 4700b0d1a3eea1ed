//! The copy worker: a thread that starts write batches in the order they were issued and
//! reports each one's outcome in that order, so the driver and the engine keep running while
//! bytes move.
//!
//! A host batch is copied on the worker's threads before the next job is taken, unless it is
//! small ([`INLINE_HOST_BYTES`] or less): then the driver copies it where it is issued, since
//! a few kilobytes copy in less time than it takes to wake the worker and hear back from it
//! (tens of microseconds, which would sit on the exposed tail of every small layer range or
//! request). With the
//! `cuda` feature, a batch whose segments all touch device memory is submitted to the copy
//! engine right where it is issued, on the driver's thread (issuing async copies takes
//! microseconds, and the GPU starts without waiting for the worker to wake up), and the driver
//! watches it too: it polls the batch's CUDA events when it looks for reports, so a device
//! batch's completion reaches the driver with no thread handoff (no wake-up of the worker, no
//! channel) — a device copy of a chunk takes tens of microseconds, about what waking a
//! sleeping thread takes. A batch mixing host → host segments with device ones goes to the
//! worker, which copies the host part and submits the rest, leaves the copies running, takes
//! further jobs meanwhile and polls the batches in flight through their CUDA events (spinning
//! for a short while after progress, then sleeping in short steps on the job queue). Reports
//! come out in issue order either way: a batch is reported once it and every earlier batch are
//! done.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvpipe_core::session::{WriteBatchId, WriteTicket};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::Instant;

use kvpipe_driver::Clock;

use crate::copy::ResolvedBatch;

/// One batch for the worker.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) batch: WriteBatchId,
    /// The sender that issued it and the receiver it writes to.
    pub(crate) sender: usize,
    pub(crate) receiver: usize,
    pub(crate) writes: ResolvedBatch,
    /// The receiver's admissions of the batch's writes, reported finished after the copy.
    pub(crate) tickets: Vec<WriteTicket>,
    /// A failure to report after copying (fault injection); `None`: success.
    pub(crate) fail: Option<TransferStatus>,
    /// The fence the batch's copies wait for (the engine's compute of its source).
    #[cfg(feature = "cuda")]
    pub(crate) after: Option<std::sync::Arc<kvpipe_cuda::Fence>>,
}

/// What the worker reports for one batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) batch: WriteBatchId,
    pub(crate) sender: usize,
    pub(crate) receiver: usize,
    pub(crate) bytes: u64,
    pub(crate) status: TransferStatus,
    /// The receiver's admissions of the batch's writes.
    pub(crate) tickets: Vec<WriteTicket>,
    /// When the copy began and ended.
    pub(crate) started: Instant,
    pub(crate) finished: Instant,
}

/// What the worker is handed: a batch to carry out.
#[derive(Debug)]
enum Work {
    Run(Job),
}

/// The largest host → host batch the driver copies itself, on its own thread, instead of
/// handing it to the worker: copying 64 KiB takes a few microseconds, a round trip through
/// the worker thread tens.
pub(crate) const INLINE_HOST_BYTES: u64 = 64 * 1024;

/// How long the worker spins on batches in flight after the last progress before it sleeps
/// between polls.
const SPIN: std::time::Duration = std::time::Duration::from_millis(2);
/// The longest sleep between two polls of batches in flight.
const POLL: std::time::Duration = std::time::Duration::from_micros(100);

/// A batch's copy: finished (host copies, or a batch that failed to start) or running.
#[derive(Debug)]
enum Copying {
    Finished {
        ok: bool,
        at: Instant,
    },
    #[cfg(feature = "cuda")]
    Device(crate::copy::InFlight),
}

/// A started batch waiting to be reported.
#[derive(Debug)]
struct Started {
    batch: WriteBatchId,
    sender: usize,
    receiver: usize,
    bytes: u64,
    tickets: Vec<WriteTicket>,
    fail: Option<TransferStatus>,
    started: Instant,
    copying: Copying,
}

/// The fence a batch's copies wait for (`()` without the `cuda` feature).
#[cfg(feature = "cuda")]
type Gate = Option<std::sync::Arc<kvpipe_cuda::Fence>>;
/// The fence a batch's copies wait for (`()` without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
type Gate = ();

impl Job {
    /// Whether the batch waits for a fence.
    fn gated(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.after.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }
}

impl Started {
    /// Starts `job`'s writes now with `start` (which copies them, or submits them and returns
    /// what to watch) and keeps what the batch's report needs.
    fn begin(
        job: Job,
        clock: &Clock,
        start: impl FnOnce(ResolvedBatch, Gate) -> Copying,
    ) -> Started {
        let started = clock.now();
        let bytes = job.writes.bytes();
        #[cfg(feature = "cuda")]
        let copying = start(job.writes, job.after);
        #[cfg(not(feature = "cuda"))]
        let copying = start(job.writes, ());
        Started {
            batch: job.batch,
            sender: job.sender,
            receiver: job.receiver,
            bytes,
            tickets: job.tickets,
            fail: job.fail,
            started,
            copying,
        }
    }

    /// The report of a batch whose copy is over (`ok`, at `finished`). The batch (and its
    /// registrations: the copies are over) is released here, before the report goes out.
    fn into_done(self, ok: bool, finished: Instant) -> Done {
        Done {
            batch: self.batch,
            sender: self.sender,
            receiver: self.receiver,
            bytes: self.bytes,
            status: match (ok, self.fail) {
                (true, None) => TransferStatus::Success,
                (true, Some(status)) => status,
                (false, _) => TransferStatus::WriteFailed,
            },
            tickets: self.tickets,
            started: self.started,
            finished,
        }
    }

    /// `Some((ok, finished))` once the copy is over.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn poll(&self, clock: &Clock) -> Option<(bool, Instant)> {
        match &self.copying {
            Copying::Finished { ok, at } => Some((*ok, *at)),
            #[cfg(feature = "cuda")]
            Copying::Device(f) => match f.is_complete() {
                Ok(false) => None,
                Ok(true) => Some((true, clock.now())),
                Err(_) => Some((false, clock.now())),
            },
        }
    }
}

/// Copies a host → host batch on the calling thread.
fn copy_host(clock: &Clock, writes: ResolvedBatch, threads: usize, threshold: u64) -> Copying {
    let ok = writes.execute(threads, threshold).is_ok();
    // Release the registrations before reporting, so a region is free to deregister once
    // its batches are reported.
    drop(writes);
    Copying::Finished {
        ok,
        at: clock.now(),
    }
}

/// Copies the host → host segments of `writes` and submits the rest to `engine` (created on
/// first use; a failure, e.g. no driver, fails this batch and the next one tries again), all
/// after `after` ([`ResolvedBatch::start_after`]: on the GPU, or first on this thread where the
/// host takes part).
#[cfg(feature = "cuda")]
fn start_device(
    engine: &mut Option<kvpipe_cuda::CopyEngine>,
    clock: &Clock,
    writes: ResolvedBatch,
    threads: usize,
    parallel_threshold: u64,
    after: Gate,
) -> Copying {
    if engine.is_none() {
        *engine = kvpipe_cuda::CopyEngine::new(crate::copy::DEVICE_STREAMS).ok();
    }
    let Some(engine) = engine.as_mut() else {
        return Copying::Finished {
            ok: false,
            at: clock.now(),
        };
    };
    match writes.start_after(engine, threads, parallel_threshold, after.as_deref()) {
        Ok(in_flight) => Copying::Device(in_flight),
        Err(_) => Copying::Finished {
            ok: false,
            at: clock.now(),
        },
    }
}

/// The worker thread's state: the copy settings, the engine (created on the first device
/// batch) and the batches started but not reported yet.
struct Worker {
    clock: Clock,
    threads: usize,
    parallel_threshold: u64,
    #[cfg(feature = "cuda")]
    engine: Option<kvpipe_cuda::CopyEngine>,
    started: VecDeque<Started>,
}

impl Worker {
    fn start(&mut self, job: Job) {
        let (clock, threads, threshold) = (self.clock, self.threads, self.parallel_threshold);
        #[cfg(feature = "cuda")]
        let engine = &mut self.engine;
        let started = Started::begin(job, &clock, |writes, after| {
            // A gated batch goes through the copy engine even with host memory only: it waits
            // for its fence there.
            #[cfg(feature = "cuda")]
            if writes.touches_device() || after.is_some() {
                return start_device(engine, &clock, writes, threads, threshold, after);
            }
            #[cfg(not(feature = "cuda"))]
            let () = after;
            copy_host(&clock, writes, threads, threshold)
        });
        self.started.push_back(started);
    }

    /// Reports every finished batch at the front of the queue, in issue order. `Err` when the
    /// driver is gone; `Ok(true)` when something was reported.
    fn report(&mut self, done_tx: &mpsc::Sender<Done>) -> Result<bool, ()> {
        let mut any = false;
        while let Some((ok, finished)) = self.started.front().and_then(|s| s.poll(&self.clock)) {
            let Some(s) = self.started.pop_front() else {
                break;
            };
            done_tx.send(s.into_done(ok, finished)).map_err(|_| ())?;
            any = true;
        }
        Ok(any)
    }

    /// Takes jobs and reports outcomes until the job queue is closed and every started batch
    /// is reported (copies are never abandoned: their memory must outlive them).
    fn take(&mut self, work: Work) {
        match work {
            Work::Run(job) => self.start(job),
        }
    }

    fn run(mut self, jobs_rx: mpsc::Receiver<Work>, done_tx: mpsc::Sender<Done>) {
        let mut open = true;
        let mut progress = std::time::Instant::now();
        loop {
            match self.report(&done_tx) {
                Err(()) => return,
                Ok(true) => progress = std::time::Instant::now(),
                Ok(false) => {}
            }
            if self.started.is_empty() {
                if !open {
                    return;
                }
                match jobs_rx.recv() {
                    Ok(work) => self.take(work),
                    Err(_) => return,
                }
                progress = std::time::Instant::now();
                continue;
            }
            // Batches are running on a GPU (nothing else stays unreported): take new jobs
            // without blocking for long, so their completion is seen soon.
            let job = if progress.elapsed() < SPIN {
                match jobs_rx.try_recv() {
                    Ok(job) => Some(job),
                    Err(mpsc::TryRecvError::Empty) => {
                        std::thread::yield_now();
                        None
                    }
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            } else if open {
                match jobs_rx.recv_timeout(POLL) {
                    Ok(job) => Some(job),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            } else {
                std::thread::sleep(POLL);
                None
            };
            if let Some(work) = job {
                self.take(work);
                progress = std::time::Instant::now();
            }
        }
    }
}

/// How long a driver waiting for reports polls first while a device batch is in flight: a
/// device copy of a chunk takes tens of microseconds, about what waking a sleeping thread takes.
#[cfg(feature = "cuda")]
const DEVICE_SPIN: std::time::Duration = std::time::Duration::from_millis(1);

/// How long of [`DEVICE_SPIN`] the driver polls without yielding its core in between: a
/// layer range's copy is seen done tens of microseconds after its issue, a 64 MiB chunk's in
/// about 80.
#[cfg(feature = "cuda")]
const DEVICE_SPIN_HOT: std::time::Duration = std::time::Duration::from_micros(150);

/// The longest sleep between two polls of a device batch the driver watches, once
/// [`DEVICE_SPIN`] is over.
#[cfg(feature = "cuda")]
const DEVICE_POLL: std::time::Duration = std::time::Duration::from_micros(20);

/// A batch submitted and not reported yet, in issue order.
#[derive(Debug)]
enum Pending {
    /// Carried out by the worker thread (reported on its channel, in issue order among the
    /// worker's batches); whether it touches device memory.
    Worker {
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        device: bool,
    },
    /// Started on the driver's thread and watched here: a small host batch copied at once, or
    /// device copies running.
    Driver(Started),
}

#[derive(Debug)]
pub(crate) struct CopyWorker {
    jobs: Option<mpsc::Sender<Work>>,
    done: mpsc::Receiver<Done>,
    /// Every batch submitted and not reported yet, in issue order (reports keep it).
    pending: VecDeque<Pending>,
    thread: Option<JoinHandle<()>>,
    /// The copy engine of the driver's thread, for batches started where they are issued.
    #[cfg(feature = "cuda")]
    engine: Option<kvpipe_cuda::CopyEngine>,
    clock: Clock,
}

impl CopyWorker {
    pub(crate) fn spawn(clock: Clock, threads: usize, parallel_threshold: u64) -> Self {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Work>();
        let (done_tx, done_rx) = mpsc::channel();
        let worker = Worker {
            clock,
            threads,
            parallel_threshold,
            #[cfg(feature = "cuda")]
            engine: None,
            started: VecDeque::new(),
        };
        let thread = std::thread::Builder::new()
            .name("kvpipe-mem-copy".into())
            .spawn(move || worker.run(jobs_rx, done_tx))
            .expect("spawning the copy worker thread");
        CopyWorker {
            jobs: Some(jobs_tx),
            done: done_rx,
            pending: VecDeque::new(),
            thread: Some(thread),
            #[cfg(feature = "cuda")]
            engine: None,
            clock,
        }
    }

    /// A report, if one is ready: the oldest batch's, once it is done (reports keep issue
    /// order).
    pub(crate) fn try_done(&mut self) -> Option<Done> {
        let done = match self.pending.front()? {
            Pending::Worker { .. } => self.done.try_recv().ok()?,
            Pending::Driver(started) => {
                let (ok, finished) = started.poll(&self.clock)?;
                match self.pending.pop_front() {
                    Some(Pending::Driver(s)) => return Some(s.into_done(ok, finished)),
                    _ => return None,
                }
            }
        };
        self.pending.pop_front();
        Some(done)
    }

    /// Whether the oldest batch not reported yet touches device memory.
    #[cfg(feature = "cuda")]
    fn device_first(&self) -> bool {
        match self.pending.front() {
            Some(Pending::Worker { device }) => *device,
            Some(Pending::Driver(_)) => true,
            None => false,
        }
    }

    /// The next report, waiting up to `limit`. While a device batch is in flight it polls for
    /// up to [`DEVICE_SPIN`] first (yielding its core between polls only after
    /// [`DEVICE_SPIN_HOT`]), then sleeps on the channel (a batch of the worker) or in
    /// steps of [`DEVICE_POLL`] (a batch the driver watches).
    pub(crate) fn done_within(&mut self, limit: std::time::Duration) -> Option<Done> {
        if let Some(done) = self.try_done() {
            return Some(done);
        }
        #[cfg(feature = "cuda")]
        if self.device_first() {
            let start = std::time::Instant::now();
            let spin = limit.min(DEVICE_SPIN);
            loop {
                if let Some(done) = self.try_done() {
                    return Some(done);
                }
                let spun = start.elapsed();
                if spun >= spin {
                    break;
                }
                // Without a system call while a layer range's or a chunk's copy may be about
                // to end; yielding the core after that.
                if spun < DEVICE_SPIN_HOT {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            while matches!(self.pending.front(), Some(Pending::Driver(_))) {
                let left = limit.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return None;
                }
                std::thread::sleep(left.min(DEVICE_POLL));
                if let Some(done) = self.try_done() {
                    return Some(done);
                }
            }
            if self.pending.is_empty() {
                return None;
            }
            let done = self
                .done
                .recv_timeout(limit.saturating_sub(start.elapsed()))
                .ok()?;
            self.pending.pop_front();
            return Some(done);
        }
        if self.pending.is_empty() {
            // Nothing in flight: nothing will be reported; wait out the limit as a receive would.
            std::thread::sleep(limit);
            return None;
        }
        let done = self.done.recv_timeout(limit).ok()?;
        self.pending.pop_front();
        Some(done)
    }

    pub(crate) fn submit(&mut self, job: Job) {
        if job.writes.bytes() <= INLINE_HOST_BYTES && !job.writes.touches_device() && !job.gated() {
            // Small and host only: copied now, reported in issue order like any other batch.
            let started = Started::begin(job, &self.clock, |writes, _ungated| {
                copy_host(&self.clock, writes, 1, u64::MAX)
            });
            self.pending.push_back(Pending::Driver(started));
            return;
        }
        // A gated batch the host takes part in waits for its fence on the worker, never here.
        #[cfg(feature = "cuda")]
        if job.writes.touches_device()
            && !(job.writes.segments().iter())
                .any(|s| s.is_host() || (job.gated() && s.touches_host()))
        {
            // Device copies only: issue them now (they run asynchronously, after the batch's
            // fence where it has one) and watch them here.
            let (clock, engine) = (self.clock, &mut self.engine);
            let started = Started::begin(job, &clock, |writes, after| {
                start_device(engine, &clock, writes, 1, u64::MAX, after)
            });
            self.pending.push_back(Pending::Driver(started));
            return;
        }
        #[cfg(feature = "cuda")]
        let device = job.writes.touches_device();
        #[cfg(not(feature = "cuda"))]
        let device = false;
        self.pending.push_back(Pending::Worker { device });
        if let Some(tx) = &self.jobs {
            // The worker only stops when this handle is dropped.
            let _ = tx.send(Work::Run(job));
        }
    }
}

impl Drop for CopyWorker {
    fn drop(&mut self) {
        // Closing the queue lets the worker finish the batches it holds and exit; joining it
        // guarantees no copy outlives the driver (and so the registrations' memory).
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
