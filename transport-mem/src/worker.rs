//! The copy worker: a thread that starts write batches in the order they were issued and
//! reports each one's outcome in that order, so the driver and the engine keep running while
//! bytes move.
//!
//! A host batch is copied on the worker's threads before the next job is taken. With the
//! `cuda` feature, a batch whose segments all touch device memory is submitted to the copy
//! engine right where it is issued, on the driver's thread (issuing async copies takes
//! microseconds, and the GPU starts without waiting for the worker to wake up); the worker then
//! only watches it. A batch mixing host → host segments with device ones goes to the worker,
//! which copies the host part and submits the rest. Either way the copies are left running: the
//! worker takes further jobs meanwhile and polls the batches in flight through their CUDA
//! events (spinning for a short while after progress, then sleeping in short steps on the job
//! queue), reporting each once it and every earlier batch are done.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvpipe_core::session::{WriteBatchId, WriteTicket};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::Instant;

use crate::clock::Clock;

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

/// What the worker is handed: a batch to carry out, or one already started (device copies
/// issued on the driver's thread) to watch and report.
#[derive(Debug)]
enum Work {
    Run(Job),
    #[cfg(feature = "cuda")]
    Watch(Started),
}

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

impl Started {
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

/// Copies the host → host segments of `writes` and submits the rest to `engine` (created on
/// first use; a failure, e.g. no driver, fails this batch and the next one tries again).
#[cfg(feature = "cuda")]
fn start_device(
    engine: &mut Option<kvpipe_cuda::CopyEngine>,
    clock: &Clock,
    writes: ResolvedBatch,
    threads: usize,
    parallel_threshold: u64,
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
    match writes.start(engine, threads, parallel_threshold) {
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
        let started = self.clock.now();
        let bytes = job.writes.bytes();
        #[cfg(feature = "cuda")]
        let copying = if job.writes.touches_device() {
            start_device(
                &mut self.engine,
                &self.clock,
                job.writes,
                self.threads,
                self.parallel_threshold,
            )
        } else {
            self.copy_host(job.writes)
        };
        #[cfg(not(feature = "cuda"))]
        let copying = self.copy_host(job.writes);
        self.started.push_back(Started {
            batch: job.batch,
            sender: job.sender,
            receiver: job.receiver,
            bytes,
            tickets: job.tickets,
            fail: job.fail,
            started,
            copying,
        });
    }

    fn copy_host(&self, writes: ResolvedBatch) -> Copying {
        let ok = writes
            .execute(self.threads, self.parallel_threshold)
            .is_ok();
        // Release the registrations before reporting, so a region is free to deregister
        // once its batches are reported.
        drop(writes);
        Copying::Finished {
            ok,
            at: self.clock.now(),
        }
    }

    /// Reports every finished batch at the front of the queue, in issue order. `Err` when the
    /// driver is gone; `Ok(true)` when something was reported.
    fn report(&mut self, done_tx: &mpsc::Sender<Done>) -> Result<bool, ()> {
        let mut any = false;
        while let Some((ok, finished)) = self.started.front().and_then(|s| s.poll(&self.clock)) {
            // The batch (and its registrations: the copies are over) is released at the end
            // of this block, before the report.
            let done = {
                let Some(s) = self.started.pop_front() else {
                    break;
                };
                Done {
                    batch: s.batch,
                    sender: s.sender,
                    receiver: s.receiver,
                    bytes: s.bytes,
                    status: match (ok, s.fail) {
                        (true, None) => TransferStatus::Success,
                        (true, Some(status)) => status,
                        (false, _) => TransferStatus::WriteFailed,
                    },
                    tickets: s.tickets,
                    started: s.started,
                    finished,
                }
            };
            done_tx.send(done).map_err(|_| ())?;
            any = true;
        }
        Ok(any)
    }

    /// Takes jobs and reports outcomes until the job queue is closed and every started batch
    /// is reported (copies are never abandoned: their memory must outlive them).
    fn take(&mut self, work: Work) {
        match work {
            Work::Run(job) => self.start(job),
            #[cfg(feature = "cuda")]
            Work::Watch(started) => self.started.push_back(started),
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

#[derive(Debug)]
pub(crate) struct CopyWorker {
    jobs: Option<mpsc::Sender<Work>>,
    done: mpsc::Receiver<Done>,
    /// Per batch submitted and not reported yet, in order (the worker reports in issue order):
    /// whether it touches device memory.
    #[cfg(feature = "cuda")]
    kinds: VecDeque<bool>,
    thread: Option<JoinHandle<()>>,
    /// The copy engine of the driver's thread, for batches started where they are issued.
    #[cfg(feature = "cuda")]
    engine: Option<kvpipe_cuda::CopyEngine>,
    #[cfg(feature = "cuda")]
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
            #[cfg(feature = "cuda")]
            kinds: VecDeque::new(),
            thread: Some(thread),
            #[cfg(feature = "cuda")]
            engine: None,
            #[cfg(feature = "cuda")]
            clock,
        }
    }

    /// A report, if one is ready.
    pub(crate) fn try_done(&mut self) -> Option<Done> {
        let done = self.done.try_recv().ok()?;
        #[cfg(feature = "cuda")]
        self.kinds.pop_front();
        Some(done)
    }

    /// The next report, waiting up to `limit`. While a device batch is in flight it polls for
    /// up to [`DEVICE_SPIN`] first, then sleeps on the channel.
    pub(crate) fn done_within(&mut self, limit: std::time::Duration) -> Option<Done> {
        #[cfg(feature = "cuda")]
        if self.kinds.iter().any(|&device| device) {
            let start = std::time::Instant::now();
            let spin = limit.min(DEVICE_SPIN);
            loop {
                if let Some(done) = self.try_done() {
                    return Some(done);
                }
                if start.elapsed() >= spin {
                    break;
                }
                std::thread::yield_now();
            }
            let done = self.done.recv_timeout(limit.saturating_sub(spin)).ok()?;
            self.kinds.pop_front();
            return Some(done);
        }
        let done = self.done.recv_timeout(limit).ok()?;
        #[cfg(feature = "cuda")]
        self.kinds.pop_front();
        Some(done)
    }

    pub(crate) fn submit(&mut self, job: Job) {
        #[cfg(feature = "cuda")]
        self.kinds.push_back(job.writes.touches_device());
        #[cfg(feature = "cuda")]
        let work =
            if job.writes.touches_device() && !job.writes.segments().iter().any(|s| s.is_host()) {
                // Device copies only: issue them now (they run asynchronously) and let the worker
                // watch them.
                let started = self.clock.now();
                let bytes = job.writes.bytes();
                let copying = start_device(&mut self.engine, &self.clock, job.writes, 1, u64::MAX);
                Work::Watch(Started {
                    batch: job.batch,
                    sender: job.sender,
                    receiver: job.receiver,
                    bytes,
                    tickets: job.tickets,
                    fail: job.fail,
                    started,
                    copying,
                })
            } else {
                Work::Run(job)
            };
        #[cfg(not(feature = "cuda"))]
        let work = Work::Run(job);
        if let Some(tx) = &self.jobs {
            // The worker only stops when this handle is dropped.
            let _ = tx.send(work);
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
