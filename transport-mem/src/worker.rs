//! The copy worker: a thread that executes write batches in the order they were issued and
//! reports each one's outcome, so the driver and the engine keep running while bytes move.

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

#[derive(Debug)]
pub(crate) struct CopyWorker {
    jobs: Option<mpsc::Sender<Job>>,
    pub(crate) done: mpsc::Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl CopyWorker {
    pub(crate) fn spawn(clock: Clock, threads: usize, parallel_threshold: u64) -> Self {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvpipe-mem-copy".into())
            .spawn(move || {
                while let Ok(job) = jobs_rx.recv() {
                    let started = clock.now();
                    job.writes.execute(threads, parallel_threshold);
                    let finished = clock.now();
                    let done = Done {
                        batch: job.batch,
                        sender: job.sender,
                        receiver: job.receiver,
                        bytes: job.writes.bytes(),
                        status: job.fail.unwrap_or(TransferStatus::Success),
                        tickets: job.tickets,
                        started,
                        finished,
                    };
                    // Release the registrations before reporting, so a region is free to
                    // deregister once its batches are reported.
                    drop(job.writes);
                    if done_tx.send(done).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the copy worker thread");
        CopyWorker {
            jobs: Some(jobs_tx),
            done: done_rx,
            thread: Some(thread),
        }
    }

    pub(crate) fn submit(&self, job: Job) {
        if let Some(tx) = &self.jobs {
            // The worker only stops when this handle is dropped.
            let _ = tx.send(job);
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
