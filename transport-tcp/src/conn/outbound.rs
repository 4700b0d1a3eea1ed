//! The writing half of one connection: the node queues encoded frames and the data-write pieces
//! of write batches on a [`JobQueue`]; the writer's [`Outbound`] turns the queue into the slices
//! of the next vectored `write` (header and source bytes of each piece, straight from registered
//! memory) and, as bytes go out, reports each finished batch part to the node.
//!
//! A shell's loop is: [`Outbound::next`]; on [`Next::Write`] write
//! [`Outbound::slices`] and pass the count to [`Outbound::written`]; on [`Next::Wait`] wait on
//! the queue; on [`Next::Close`] shut the sending side down; then [`Outbound::finish`].

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::Bytes;
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::PeerId;
use parking_lot::{Condvar, Mutex};

use super::hooks::{HalfEnd, NodeHooks, WriteEnd};
use super::pieces::Piece;
use crate::stats::{bump, StatCells};

/// Most slices in one vectored write (Linux accepts 1024).
const MAX_SLICES: usize = 256;

/// Work for a connection's writer.
pub(crate) enum Job {
    /// An encoded control frame.
    Frame(Bytes),
    /// This connection's part of a write batch: its data writes, in order.
    Data {
        /// The batch.
        batch: WriteBatchId,
        /// The pieces (never empty).
        pieces: Vec<Piece>,
    },
    /// Write out everything queued before, then shut the sending side down.
    Close,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QueueState {
    /// Jobs are accepted.
    Open,
    /// A close was queued: nothing more is accepted.
    Closing,
    /// The connection is being torn down (or its writer stopped): the writer stops at once.
    Aborted,
}

/// A connection's job queue, shared by the node (which fills it) and the writer (which empties
/// it). Its lock is the writer's own, never the node's.
pub(crate) struct JobQueue {
    inner: Mutex<(Vec<Job>, QueueState)>,
    ready: Condvar,
    /// Wakes an async writer.
    #[cfg(feature = "tokio")]
    notify: tokio::sync::Notify,
}

impl JobQueue {
    pub(crate) fn new() -> Self {
        JobQueue {
            inner: Mutex::new((Vec::new(), QueueState::Open)),
            ready: Condvar::new(),
            #[cfg(feature = "tokio")]
            notify: tokio::sync::Notify::new(),
        }
    }

    /// Queues `job`; `false` when the queue no longer accepts jobs (closing or torn down).
    pub(crate) fn push(&self, job: Job) -> bool {
        {
            let mut q = self.inner.lock();
            if q.1 != QueueState::Open {
                return false;
            }
            if matches!(job, Job::Close) {
                q.1 = QueueState::Closing;
            }
            q.0.push(job);
        }
        self.wake();
        true
    }

    /// Stops the writer at its next step; queued jobs are dropped.
    pub(crate) fn abort(&self) {
        {
            let mut q = self.inner.lock();
            q.1 = QueueState::Aborted;
            q.0.clear();
        }
        self.wake();
    }

    fn wake(&self) {
        self.ready.notify_one();
        #[cfg(feature = "tokio")]
        self.notify.notify_one();
    }

    /// Moves every queued job to `out`. Returns whether the connection was aborted.
    fn take(&self, out: &mut VecDeque<Entry>) -> bool {
        let mut q = self.inner.lock();
        for job in q.0.drain(..) {
            match job {
                Job::Frame(bytes) => out.push_back(Entry::Frame(bytes)),
                Job::Data { batch, pieces } => {
                    let last = pieces.len().saturating_sub(1);
                    out.extend(
                        pieces
                            .into_iter()
                            .enumerate()
                            .map(|(i, piece)| Entry::Piece {
                                piece,
                                ends_part: (i == last).then_some(batch),
                            }),
                    );
                }
                Job::Close => out.push_back(Entry::Close),
            }
        }
        q.1 == QueueState::Aborted
    }

    #[cfg(feature = "tokio")]
    fn has_work(&self) -> bool {
        let q = self.inner.lock();
        !q.0.is_empty() || q.1 == QueueState::Aborted
    }

    /// Blocks until a job is queued or the connection is aborted (blocking writers).
    pub(crate) fn wait(&self) {
        let mut q = self.inner.lock();
        while q.0.is_empty() && q.1 != QueueState::Aborted {
            self.ready.wait(&mut q);
        }
    }

    /// Waits until a job is queued or the connection is aborted (async writers).
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_async(&self) {
        // A wake with no waiter leaves a permit, so a job queued between the check and the
        // wait is not missed.
        while !self.has_work() {
            self.notify.notified().await;
        }
    }
}

/// One item of the writer's queue.
enum Entry {
    Frame(Bytes),
    Piece {
        piece: Piece,
        /// The batch whose part on this connection ends with this piece.
        ends_part: Option<WriteBatchId>,
    },
    Close,
}

impl Entry {
    fn wire_len(&self) -> usize {
        match self {
            Entry::Frame(b) => b.len(),
            Entry::Piece { piece, .. } => piece.header.len() + piece.len as usize,
            Entry::Close => 0,
        }
    }
}

/// What the writer does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Write [`Outbound::slices`].
    Write,
    /// Nothing to write: wait on the queue.
    Wait,
    /// Everything before the close is written: shut the sending side down, then finish.
    Close,
    /// The node aborted the connection: finish at once.
    Stop,
}

/// The writing half of one connection (see the module doc).
pub(crate) struct Outbound {
    peer: PeerId,
    queue: Arc<JobQueue>,
    hooks: Arc<dyn NodeHooks>,
    stats: Arc<StatCells>,
    entries: VecDeque<Entry>,
    /// Bytes of the front entry already written.
    front_done: usize,
    /// Most bytes one write call takes.
    write_max: usize,
}

impl Outbound {
    pub(crate) fn new(
        peer: PeerId,
        queue: Arc<JobQueue>,
        hooks: Arc<dyn NodeHooks>,
        stats: Arc<StatCells>,
        write_max: usize,
    ) -> Self {
        Outbound {
            peer,
            queue,
            hooks,
            stats,
            entries: VecDeque::new(),
            front_done: 0,
            write_max: write_max.max(1),
        }
    }

    /// The queue to wait on after [`Next::Wait`].
    pub(crate) fn queue(&self) -> &JobQueue {
        &self.queue
    }

    /// Takes what the node queued and says what to do.
    pub(crate) fn next(&mut self) -> Next {
        if self.queue.take(&mut self.entries) {
            return Next::Stop;
        }
        match self.entries.front() {
            None => Next::Wait,
            Some(Entry::Close) => Next::Close,
            Some(_) => Next::Write,
        }
    }

    /// The slices of the next write: the front entries up to the close, at most `write_max`
    /// bytes and [`MAX_SLICES`] slices.
    pub(crate) fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut out = Vec::with_capacity(8);
        let mut skip = self.front_done;
        let mut budget = self.write_max;
        for entry in &self.entries {
            if budget == 0 || out.len() + 2 > MAX_SLICES {
                break;
            }
            match entry {
                Entry::Frame(bytes) => push_part(&mut out, bytes, &mut skip, &mut budget),
                Entry::Piece { piece, .. } => {
                    push_part(&mut out, &piece.header, &mut skip, &mut budget);
                    push_part(&mut out, piece.payload(), &mut skip, &mut budget);
                }
                Entry::Close => break,
            }
        }
        out
    }

    /// `n` bytes of [`slices`](Self::slices) were written.
    pub(crate) fn written(&mut self, mut n: usize) {
        while let Some(front) = self.entries.front() {
            let left = front.wire_len() - self.front_done;
            if n < left || matches!(front, Entry::Close) {
                self.front_done += n;
                return;
            }
            n -= left;
            self.front_done = 0;
            if let Some(Entry::Piece { piece, ends_part }) = self.entries.pop_front() {
                bump(&self.stats.writes_sent, 1);
                bump(&self.stats.bytes_sent, piece.len);
                drop(piece);
                if let Some(batch) = ends_part {
                    self.hooks.batch_part_written(batch);
                }
            }
        }
    }

    /// The writer stopped: the queue accepts nothing more, and the node hears of it.
    pub(crate) fn finish(self, end: WriteEnd) {
        self.queue.abort();
        drop(self.entries);
        self.hooks.half_ended(self.peer, HalfEnd::Write(end));
    }
}

/// Adds what is left of `bytes` after `skip` bytes, within `budget`.
fn push_part<'a>(
    out: &mut Vec<IoSlice<'a>>,
    bytes: &'a [u8],
    skip: &mut usize,
    budget: &mut usize,
) {
    let from = (*skip).min(bytes.len());
    *skip -= from;
    let take = (bytes.len() - from).min(*budget);
    if take > 0 {
        out.push(IoSlice::new(&bytes[from..from + take]));
        *budget -= take;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryRegion;
    use kvpipe_core::{Admission, WriteTicket};
    use std::sync::Mutex as StdMutex;

    #[derive(Default)]
    struct Recorder {
        parts: StdMutex<Vec<WriteBatchId>>,
    }

    impl NodeHooks for Recorder {
        fn frame(&self, _: PeerId, _: Bytes) {}
        fn body_limit(&self, _: PeerId) -> u32 {
            kvpipe_core::wire::MAX_BODY_LEN
        }
        fn admit(&self, _: PeerId, _: &[u8]) -> Admission {
            Admission::Discard { len: 0 }
        }
        fn write_finished(&self, _: WriteTicket, _: bool) {}
        fn batch_part_written(&self, batch: WriteBatchId) {
            self.parts.lock().unwrap().push(batch);
        }
        fn half_ended(&self, _: PeerId, _: HalfEnd) {}
    }

    fn concat(slices: &[IoSlice<'_>]) -> Vec<u8> {
        slices.iter().flat_map(|s| s.iter().copied()).collect()
    }

    #[test]
    fn writes_in_bounded_slices_and_reports_parts_once_written() {
        let src = MemoryRegion::from_vec((0..100u8).collect());
        let hooks = Arc::new(Recorder::default());
        let queue = Arc::new(JobQueue::new());
        let mut out = Outbound::new(
            PeerId(1),
            queue.clone(),
            hooks.clone(),
            Arc::new(StatCells::default()),
            7,
        );
        assert_eq!(out.next(), Next::Wait);
        assert!(queue.push(Job::Frame(Bytes::from_static(b"frame"))));
        let piece = |off: u64, len: u64| {
            Piece::new([9; kvpipe_core::wire::DATA_WRITE_FRAME_LEN], &src, off, len)
        };
        assert!(queue.push(Job::Data {
            batch: WriteBatchId(4),
            pieces: vec![piece(10, 3).unwrap(), piece(50, 2).unwrap()],
        }));
        assert!(queue.push(Job::Close));
        assert!(!queue.push(Job::Frame(Bytes::from_static(b"late"))));
        let mut wire: Vec<u8> = Vec::new();
        loop {
            match out.next() {
                Next::Write => {
                    let slices = out.slices();
                    let total: usize = slices.iter().map(|s| s.len()).sum();
                    assert!(total <= 7 && total > 0);
                    // Write one byte less than offered when possible: partial writes resume.
                    let n = total.saturating_sub(1).max(1);
                    wire.extend(&concat(&slices)[..n]);
                    out.written(n);
                }
                Next::Close => break,
                other => panic!("{other:?}"),
            }
        }
        let h = kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
        let mut expected = b"frame".to_vec();
        expected.extend(vec![9; h]);
        expected.extend([10, 11, 12]);
        expected.extend(vec![9; h]);
        expected.extend([50, 51]);
        assert_eq!(wire, expected);
        assert_eq!(*hooks.parts.lock().unwrap(), [WriteBatchId(4)]);
        out.finish(WriteEnd::Closed);
    }

    #[test]
    fn an_abort_stops_the_writer_and_refuses_later_jobs() {
        let queue = Arc::new(JobQueue::new());
        let mut out = Outbound::new(
            PeerId(1),
            queue.clone(),
            Arc::new(Recorder::default()),
            Arc::new(StatCells::default()),
            1 << 20,
        );
        assert!(queue.push(Job::Frame(Bytes::from_static(b"x"))));
        queue.abort();
        queue.wait();
        assert_eq!(out.next(), Next::Stop);
        assert!(!queue.push(Job::Frame(Bytes::from_static(b"y"))));
    }
}
