//! The writing half of one connection: the node queues encoded frames on the connection's
//! [`JobQueue`] and the data-write pieces of write batches on the peer's [`Backlog`], shared by
//! all its connections; the writer's [`Outbound`] takes pieces from the backlog as its stream
//! runs low, turns both into the slices of the next vectored `write` (header and source bytes
//! of each piece, straight from registered memory) and, as the last piece of a batch goes out,
//! reports the batch to the node.
//!
//! A shell's loop is: [`Outbound::next`]; on [`Next::Write`] write
//! [`Outbound::slices`] and pass the count to [`Outbound::written`]; on [`Next::Wait`] wait on
//! the queue; on [`Next::Close`] shut the sending side down; then [`Outbound::finish`].
//!
//! On a peer-copy connection ([`crate::peer_copy`]) a piece is its header and its source (the
//! receiver pulls the bytes): it is added to the connection's [`PullAcks`] before it is
//! written, and its batch is reported by the reader once the receiver acknowledged it.
//!
//! A piece whose source is device memory (`cuda` feature) is staged through pinned host slots
//! ([`crate::gpu`]): [`Outbound::next`] keeps the slots filled ahead of the socket and
//! waits (briefly, for one slot's copy) only when the next bytes to write are still being
//! copied; [`Outbound::slices`] offers only bytes whose copy completed.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::Bytes;
use kvpipe_core::PeerId;
use parking_lot::{Condvar, Mutex};

use super::acks::PullAcks;
use super::backlog::{Backlog, BatchTally, TalliedPiece};
use super::hooks::{HalfEnd, NodeHooks, WriteEnd};
use super::pieces::{Payload, Piece};
use crate::config::TcpConfig;
use crate::gpu::{GpuError, SendStaging, StagingSpec};
use crate::placement::{Decision, PeerPlacement, Placement};
use crate::stats::{bump, StatCells};

/// Most slices in one vectored write (Linux accepts 1024).
const MAX_SLICES: usize = 256;

/// Largest pieces a peer-copy writer keeps unacknowledged: the receiver copies one piece at a
/// time per connection, so the next headers must already be in its socket buffer when a copy
/// completes, or every piece would wait a round trip.
const PULL_AHEAD_PIECES: u64 = 4;

/// Work for a connection's writer.
pub(crate) enum Job {
    /// An encoded control frame.
    Frame(Bytes),
    /// Data writes bound to this connection, in order (tests; the node queues pieces on the
    /// peer's `Backlog`, which any connection takes from).
    #[cfg(test)]
    Data(Vec<TalliedPiece>),
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
    inner: Mutex<Queue>,
    ready: Condvar,
    /// Wakes an async writer.
    #[cfg(feature = "tokio")]
    notify: tokio::sync::Notify,
}

struct Queue {
    jobs: Vec<Job>,
    state: QueueState,
    /// Pieces were added to the peer's backlog since the writer last looked.
    poked: bool,
}

impl JobQueue {
    pub(crate) fn new() -> Self {
        JobQueue {
            inner: Mutex::new(Queue {
                jobs: Vec::new(),
                state: QueueState::Open,
                poked: false,
            }),
            ready: Condvar::new(),
            #[cfg(feature = "tokio")]
            notify: tokio::sync::Notify::new(),
        }
    }

    /// Queues `job`; `false` when the queue no longer accepts jobs (closing or torn down).
    pub(crate) fn push(&self, job: Job) -> bool {
        {
            let mut q = self.inner.lock();
            if q.state != QueueState::Open {
                return false;
            }
            if matches!(job, Job::Close) {
                q.state = QueueState::Closing;
            }
            q.jobs.push(job);
        }
        self.wake();
        true
    }

    /// The frames queued and not taken yet (tests).
    #[cfg(test)]
    pub(crate) fn queued_frames(&self) -> Vec<Bytes> {
        let q = self.inner.lock();
        q.jobs
            .iter()
            .filter_map(|j| match j {
                Job::Frame(b) => Some(b.clone()),
                _ => None,
            })
            .collect()
    }

    /// Wakes a waiting writer to look at the peer's backlog (pieces were added to it).
    pub(crate) fn poke(&self) {
        {
            let mut q = self.inner.lock();
            if q.state == QueueState::Aborted {
                return;
            }
            q.poked = true;
        }
        self.wake();
    }

    /// Stops the writer at its next step; queued jobs are dropped.
    pub(crate) fn abort(&self) {
        {
            let mut q = self.inner.lock();
            q.state = QueueState::Aborted;
            q.jobs.clear();
        }
        self.wake();
    }

    fn wake(&self) {
        self.ready.notify_one();
        #[cfg(feature = "tokio")]
        self.notify.notify_one();
    }

    /// Moves every queued job to `out`, numbering pieces from `*seq + 1`. Returns whether the
    /// connection was aborted.
    fn take(&self, out: &mut VecDeque<Entry>, seq: &mut u64) -> bool {
        #[cfg(not(test))]
        let _ = seq;
        let mut q = self.inner.lock();
        q.poked = false;
        for job in q.jobs.drain(..) {
            match job {
                Job::Frame(bytes) => out.push_back(Entry::Frame(bytes)),
                #[cfg(test)]
                Job::Data(pieces) => out.extend(pieces.into_iter().map(|p| Entry::piece(p, seq))),
                Job::Close => out.push_back(Entry::Close),
            }
        }
        q.state == QueueState::Aborted
    }

    #[cfg(feature = "tokio")]
    fn has_work(&self) -> bool {
        let q = self.inner.lock();
        !q.jobs.is_empty() || q.poked || q.state == QueueState::Aborted
    }

    /// Blocks until a job is queued, the peer's backlog got pieces, or the connection is
    /// aborted (blocking writers).
    pub(crate) fn wait(&self) {
        let mut q = self.inner.lock();
        while q.jobs.is_empty() && !q.poked && q.state != QueueState::Aborted {
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
        /// Its batch's pieces not written out yet.
        tally: Arc<BatchTally>,
        /// The piece's number on this connection (from 1), by which staging knows it.
        seq: u64,
    },
    Close,
}

impl Entry {
    /// A piece numbered `*seq + 1` on this connection.
    fn piece(p: TalliedPiece, seq: &mut u64) -> Entry {
        *seq += 1;
        Entry::Piece {
            piece: p.piece,
            tally: p.tally,
            seq: *seq,
        }
    }

    /// Itself, unless it is a pulled piece (whose payload is not on the stream).
    fn pulled_not(&self) -> Option<&Entry> {
        match self {
            Entry::Piece { piece, .. } if piece.pulled() => None,
            other => Some(other),
        }
    }

    fn wire_len(&self) -> usize {
        match self {
            Entry::Frame(b) => b.len(),
            Entry::Piece { piece, .. } => piece.wire_len(),
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
    /// The peer's pieces no writer took yet.
    backlog: Arc<Backlog>,
    /// Payload bytes this writer keeps ahead of its stream: it takes pieces from the backlog
    /// while less than this is left to write (or, pulled, to be acknowledged).
    lookahead: u64,
    /// Payload bytes of the pieces in `entries` (pulled pieces: counted by `acks`).
    ahead: u64,
    /// Pulled pieces awaiting the receiver's acknowledgement (peer copies).
    acks: Option<Arc<PullAcks>>,
    /// Until the link's placement is decided: the acknowledgements to use if the peer pulls.
    acks_if_pulled: Option<(Arc<PullAcks>, Arc<PeerPlacement>)>,
    /// The lookahead with peer copies: [`PULL_AHEAD_PIECES`] of the largest pieces.
    pull_lookahead: u64,
    /// The last piece number added to `acks`.
    expected_through: u64,
    hooks: Arc<dyn NodeHooks>,
    stats: Arc<StatCells>,
    entries: VecDeque<Entry>,
    /// Bytes of the front entry already written.
    front_done: usize,
    /// Most bytes one write call takes.
    write_max: usize,
    /// The last piece number given.
    seq: u64,
    /// Device payloads staged through pinned memory.
    staging: SendStaging,
}

impl Outbound {
    pub(crate) fn new(
        peer: PeerId,
        (queue, backlog): (Arc<JobQueue>, Arc<Backlog>),
        hooks: Arc<dyn NodeHooks>,
        stats: Arc<StatCells>,
        config: &TcpConfig,
    ) -> Self {
        // Enough for the next write call to be a full one and, for device memory, for every
        // staging slot to be filled ahead of the socket.
        let staged = SendStaging::ring_bytes(config);
        let lookahead = config.socket_write_bytes.max(staged).max(1) as u64;
        Outbound {
            peer,
            queue,
            backlog,
            lookahead,
            ahead: 0,
            acks: None,
            acks_if_pulled: None,
            pull_lookahead: lookahead.max(PULL_AHEAD_PIECES.saturating_mul(config.max_piece_bytes)),
            expected_through: 0,
            hooks,
            stats,
            entries: VecDeque::new(),
            front_done: 0,
            write_max: config.socket_write_bytes.max(1),
            seq: 0,
            staging: SendStaging::new(StagingSpec::from_config(config)),
        }
    }

    /// The same writer on a connection whose peer may pull (a sender that offered peer
    /// copies): once the link's placement says the peer pulls, pulled pieces are added to
    /// `acks` before they are written, and their batches are reported by whoever takes the
    /// acknowledgements. Any other placement is the socket path. The handshake decides the
    /// placement before any piece of the peer is queued.
    pub(crate) fn acked_by(mut self, acks: Option<(Arc<PullAcks>, Arc<PeerPlacement>)>) -> Self {
        self.acks_if_pulled = acks;
        self
    }

    /// Reads the link's placement once it is decided.
    fn place(&mut self) {
        let Some((acks, placement)) = &self.acks_if_pulled else {
            return;
        };
        match placement.get() {
            Decision::Pending => return,
            Decision::Placed(Placement::Source) => {
                self.lookahead = self.pull_lookahead;
                self.acks = Some(acks.clone());
            }
            Decision::Placed(_) | Decision::Refused(_) | Decision::Gone => {}
        }
        self.acks_if_pulled = None;
    }

    /// The queue to wait on after [`Next::Wait`].
    pub(crate) fn queue(&self) -> &JobQueue {
        &self.queue
    }

    /// Takes what the node queued, and pieces from the backlog while the stream runs low, and
    /// says what to do.
    pub(crate) fn next(&mut self) -> Next {
        self.place();
        let before = self.entries.len();
        if self.queue.take(&mut self.entries, &mut self.seq) {
            return Next::Stop;
        }
        let acked = self.acks.is_some();
        self.ahead += self
            .entries
            .range(before..)
            .map(|e| match e {
                Entry::Piece { piece, .. } if !(piece.pulled() && acked) => piece.len,
                _ => 0,
            })
            .sum::<u64>();
        self.pull();
        self.expect_acks();
        if self.stage().is_err() {
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
                Entry::Piece { piece, seq, .. } => {
                    push_part(&mut out, &piece.header, &mut skip, &mut budget);
                    // A pulled piece: its source in place of the payload.
                    if let Some(source) = &piece.source {
                        push_part(&mut out, source, &mut skip, &mut budget);
                        continue;
                    }
                    match piece.payload() {
                        Payload::Host(bytes) => push_part(&mut out, bytes, &mut skip, &mut budget),
                        Payload::Device { .. } => {
                            // `skip` is what was written of this payload: staged parts already
                            // written were released, the first left covers it.
                            let written = std::mem::take(&mut skip) as u64;
                            let all = self.staging.ready_bytes(*seq, piece.len, |offset, bytes| {
                                let from = written.saturating_sub(offset).min(bytes.len() as u64);
                                if out.len() < MAX_SLICES {
                                    let mut none = 0;
                                    push_part(
                                        &mut out,
                                        &bytes[from as usize..],
                                        &mut none,
                                        &mut budget,
                                    );
                                }
                            });
                            if !all {
                                // Later bytes are still being copied: write what is ready.
                                break;
                            }
                        }
                    }
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
                if let Some(Entry::Piece { piece, seq, .. }) = front.pulled_not() {
                    let payload_done = self.front_done.saturating_sub(piece.header.len());
                    self.staging.release(*seq, payload_done as u64);
                }
                return;
            }
            n -= left;
            self.front_done = 0;
            if let Some(Entry::Piece { piece, tally, seq }) = self.entries.pop_front() {
                bump(&self.stats.writes_sent, 1);
                bump(&self.stats.bytes_sent, piece.len);
                if piece.pulled() && self.acks.is_some() {
                    // Reported once the receiver acknowledged it (it reads the source until
                    // then).
                    continue;
                }
                self.ahead -= piece.len;
                self.staging.release(seq, u64::MAX);
                drop(piece);
                if tally.done(1) {
                    self.hooks.batch_written(tally.batch());
                }
            }
        }
    }

    /// The writer stopped: the queue accepts nothing more, and the node hears of it (once no
    /// staging copy reads a piece's memory any more).
    pub(crate) fn finish(mut self, end: WriteEnd) {
        self.queue.abort();
        self.staging.settle();
        drop(self.entries);
        self.hooks.half_ended(self.peer, HalfEnd::Write(end));
    }

    /// Takes pieces from the peer's backlog until [`lookahead`](Self::lookahead) payload bytes
    /// are left to write, placing them ahead of a queued close (an orderly close writes out the
    /// backlog first; the peer accepts nothing new once closing).
    fn pull(&mut self) {
        let front_done = match self.entries.front() {
            Some(Entry::Piece { piece, .. }) => self.front_done.saturating_sub(piece.header.len()),
            _ => 0,
        } as u64;
        let unacked = self.acks.as_ref().map_or(0, |a| a.unacked_bytes());
        let left = self.ahead.saturating_sub(front_done) + unacked;
        if left >= self.lookahead {
            return;
        }
        let close = match self.entries.back() {
            Some(Entry::Close) => self.entries.pop_back(),
            _ => None,
        };
        let (entries, seq, ahead) = (&mut self.entries, &mut self.seq, &mut self.ahead);
        let acked = self.acks.is_some();
        self.backlog.take(self.lookahead - left, |p| {
            if !(p.piece.pulled() && acked) {
                *ahead += p.piece.len;
            }
            entries.push_back(Entry::piece(p, seq))
        });
        self.entries.extend(close);
    }

    /// Adds the pulled pieces queued since the last call to the acknowledgements awaited, in
    /// stream order — before any of their bytes can be written, so that no acknowledgement can
    /// arrive for a piece not counted yet.
    fn expect_acks(&mut self) {
        let Some(acks) = &self.acks else {
            return;
        };
        for entry in &self.entries {
            if let Entry::Piece { piece, tally, seq } = entry {
                if *seq > self.expected_through && piece.pulled() {
                    acks.expect(tally.clone(), piece.len);
                }
            }
        }
        self.expected_through = self.seq;
    }

    /// Stages device payloads ahead of the socket, in stream order, as far as the slots allow;
    /// when the next bytes to write are device bytes still being copied, waits for them.
    fn stage(&mut self) -> Result<(), GpuError> {
        for entry in &self.entries {
            let Entry::Piece { piece, seq, .. } = entry else {
                continue;
            };
            if piece.pulled() {
                continue;
            }
            let Payload::Device { ordinal, addr } = piece.payload() else {
                continue;
            };
            // SAFETY: the piece's source bytes are pinned until its batch is reported,
            // which happens only after the piece was written (and its parts released), or
            // after this writer stopped and settled its copies (`finish`).
            if !unsafe { self.staging.stage(*seq, ordinal, addr, piece.len) }? {
                break;
            }
        }
        self.staging.poll()?;
        if let Some(Entry::Piece { piece, seq, .. }) = self.entries.front() {
            if !piece.pulled() && matches!(piece.payload(), Payload::Device { .. }) {
                self.staging.wait_first(*seq)?;
            }
        }
        Ok(())
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
mod tests;
