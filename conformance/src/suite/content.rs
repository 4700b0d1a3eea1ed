//! The content writer: one thread, for a whole run, that writes each chunk's or layer range's
//! computed KV into the sender's cache while the engine's loop keeps the transport going, as a
//! GPU computes while a serving engine's thread goes on.
//!
//! One thread for the run, not one per range: starting a thread and joining the last one put
//! that work on the engine's thread right after it submitted a range, while that range's copy
//! was ending, and with two requests the first one's tail was 1.6–3.6× the second's on the
//! H200 (docs/PERFORMANCE.md, run 13). A serving engine launches its next forward pass and goes
//! on; this costs one channel send. For the same reason the engine model joins the thread only
//! after every request ended.

use std::sync::mpsc;
use std::sync::Mutex;

use crate::cache::{CacheError, ReferenceCache};

/// One range's content, written into the cache.
pub(super) type ContentJob = Box<dyn FnOnce(&mut ReferenceCache) -> Result<(), CacheError> + Send>;

/// The content writer's handle on the engine's thread: at most one job at a time.
pub(super) struct ContentWriter {
    jobs: Option<mpsc::Sender<ContentJob>>,
    done: mpsc::Receiver<Result<(), CacheError>>,
    busy: bool,
}

/// Why a job's outcome did not come.
#[derive(Debug)]
pub(super) enum ContentError {
    /// The job ran and failed.
    Cache(CacheError),
    /// The thread is gone (a job panicked).
    Gone,
}

impl ContentWriter {
    /// Starts the thread in `scope`; it takes `cache` for each job and leaves it unlocked
    /// between jobs, for the engine's thread to submit from. It ends when the handle is
    /// dropped.
    pub(super) fn spawn<'scope, 'env, 'c: 'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        cache: &'env Mutex<&'c mut ReferenceCache>,
    ) -> ContentWriter {
        let (jobs, inbox) = mpsc::channel::<ContentJob>();
        let (report, done) = mpsc::channel();
        scope.spawn(move || {
            for job in inbox {
                let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
                // A job that panics ends the thread with its outcome unsent: the engine's
                // thread sees the channel closed and reports it.
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut cache)));
                drop(cache);
                let Ok(outcome) = outcome else { return };
                if report.send(outcome).is_err() {
                    return;
                }
            }
        });
        ContentWriter {
            jobs: Some(jobs),
            done,
            busy: false,
        }
    }

    /// Hands `job` to the thread. The previous job must be over ([`try_done`](Self::try_done)
    /// returned its outcome).
    pub(super) fn start(&mut self, job: ContentJob) -> Result<(), ContentError> {
        debug_assert!(!self.busy, "one content job at a time");
        let jobs = self.jobs.as_ref().ok_or(ContentError::Gone)?;
        jobs.send(job).map_err(|_| ContentError::Gone)?;
        self.busy = true;
        Ok(())
    }

    /// The running job's outcome once it is over; `None` while it runs (or when none runs).
    pub(super) fn try_done(&mut self) -> Option<Result<(), ContentError>> {
        if !self.busy {
            return None;
        }
        match self.done.try_recv() {
            Ok(outcome) => {
                self.busy = false;
                Some(outcome.map_err(ContentError::Cache))
            }
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                self.busy = false;
                self.jobs = None;
                Some(Err(ContentError::Gone))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::workload::{RequestPlan, Workload};
    use std::time::{Duration, Instant};

    fn outcome(writer: &mut ContentWriter) -> Result<(), ContentError> {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(o) = writer.try_done() {
                return o;
            }
            assert!(Instant::now() < until, "the content job never reported");
            std::thread::yield_now();
        }
    }

    #[test]
    fn jobs_run_in_turn_and_a_panic_is_reported_not_propagated() {
        let w = Workload::small(vec![RequestPlan::new(1, 64, 32)]);
        let mut cache = ReferenceCache::new(&w.cache_spec(false)).expect("a cache");
        let shared = Mutex::new(&mut cache);
        std::thread::scope(|scope| {
            let mut writer = ContentWriter::spawn(scope, &shared);
            assert!(writer.try_done().is_none(), "nothing runs yet");
            writer.start(Box::new(|_| Ok(()))).expect("started");
            assert!(outcome(&mut writer).is_ok());
            writer
                .start(Box::new(|_| {
                    Err(CacheError::InvalidSpec {
                        group: 3,
                        reason: "a failing job",
                    })
                }))
                .expect("started");
            assert!(matches!(
                outcome(&mut writer),
                Err(ContentError::Cache(CacheError::InvalidSpec {
                    group: 3,
                    ..
                }))
            ));
            // The job gets the cache.
            writer
                .start(Box::new(|c| {
                    assert!(!c.layouts().is_empty());
                    panic!("a panicking job")
                }))
                .expect("started");
            assert!(matches!(outcome(&mut writer), Err(ContentError::Gone)));
            assert!(matches!(
                writer.start(Box::new(|_| Ok(()))),
                Err(ContentError::Gone)
            ));
        });
        // The cache is this thread's again after the writer's scope.
        assert!(!cache.layouts().is_empty());
    }
}
