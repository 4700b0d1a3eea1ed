//! One RC link to a peer: its queue pair and completion queue, the control channel (receive
//! buffers kept posted, send buffers, credits), the queues of what waits for credits or
//! send-queue room, and its teardown.
//!
//! A link queues control messages and write batches apart, each in order. Control messages
//! are posted first (as credits and send buffers allow); RDMA WRITEs are posted while the bytes
//! of posted writes stay within the write window. A control message so waits behind at most a
//! window of data, never behind whole batches (a heartbeat stuck behind a slow batch would
//! look like a dead peer), and overtakes only writes not posted yet. The protocol allows it: a
//! result frame is produced only after every write it reports completed, and RC places the
//! writes posted before a SEND before the SEND is delivered. All posts of one
//! [`Link::progress`] or submission are chained into one `ibv_post_send` (one doorbell).
//!
//! Send-queue accounting: every SEND and credit write is signaled; of a write batch's work
//! requests the last one is, and one at least every [`SIGNAL_EVERY`] requests and every
//! quarter window of bytes. A signaled completion frees every slot (and window byte) posted up
//! to it (RC completes a send queue in order).
//!
//! Teardown ([`Link::fail`], or a graceful close once everything queued is acknowledged): the
//! queue pair is moved to the error state (every posted work request flushes; when the peer
//! closed first, only after [`PEER_CLOSE_GRACE`], so errors already on their way are reported
//! as themselves), the bootstrap socket is shut down (the peer's link sees its end and tears
//! down too), the receive flushes are reaped (bounded by [`FLUSH_WAIT`]), then the queue pair
//! is destroyed — after that the adapter touches no memory for this link, neither reading
//! sources nor placing a peer's writes — and only then is the link reported disconnected.
//!
//! This file holds the link's state ([`Link`] and what is behind its lock) and what its parts
//! share; the other files add their part:
//!
//! - `establish.rs`: bringing a link up (queue pair, control channel, bootstrap exchange);
//! - `post.rs`: queueing control messages and write batches, and posting them;
//! - `completion.rs`: reaping completions, reposting receive buffers, the peer's end;
//! - `teardown.rs`: closing and failing a link.

mod completion;
mod establish;
mod post;
mod teardown;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvpipe_core::RegionId;
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::BasicQueuePair;

use crate::bootstrap::RegionDescriptor;
use crate::fabric::api::{LinkFailure, LinkId};
use crate::flow::{CreditReturn, Credits, Reassembler};
use crate::memory::MemoryTable;
use crate::writes::{Segment, WrLimits, WriteRequest};

pub(crate) use establish::write_request_bytes;

pub(crate) use kvpipe_driver::later;

/// Of a write batch's work requests, every this many is signaled (besides the last), so a long
/// batch frees send-queue room while it runs.
pub(crate) const SIGNAL_EVERY: u32 = 32;

/// Longest wait for a failed link's receive buffers to flush before its queue pair is
/// destroyed anyway.
pub(crate) const FLUSH_WAIT: Duration = Duration::from_millis(500);

/// After the peer's bootstrap socket ends, how long the queue pair keeps running before it is
/// moved to the error state: completions already on their way (a remote access error that
/// made the peer tear down, acknowledgements of the last writes) are still reported as what
/// they are rather than as flushes.
const PEER_CLOSE_GRACE: Duration = Duration::from_millis(100);

/// How often a live link checks its bootstrap socket for the peer's end.
const SOCKET_CHECK: Duration = Duration::from_millis(1);

// Work request ids: the kind in the top byte, a slot or batch token below.
const KIND_SHIFT: u32 = 56;

const LOW_MASK: u64 = (1 << KIND_SHIFT) - 1;

const WR_RECV: u64 = 1;

const WR_SEND: u64 = 2;

const WR_WRITE: u64 = 3;

const WR_CREDIT: u64 = 4;

fn wr_id(kind: u64, low: u64) -> u64 {
    (kind << KIND_SHIFT) | (low & LOW_MASK)
}

/// A control message waiting for credits or room; `sent` bytes of it went out already.
struct PendingSend {
    message: Vec<u8>,
    sent: usize,
}

/// A write batch; work requests `next..` are not posted yet.
struct PendingBatch {
    token: u64,
    wrs: Vec<WriteRequest>,
    segments: Vec<Segment>,
    next: usize,
}

/// A signaled work request on the send queue.
struct Signaled {
    /// Send-queue slots its completion frees.
    covered: u32,
    /// Write bytes (of the window) its completion frees.
    write_bytes: u64,
    /// A send buffer its completion frees.
    send_slot: Option<u32>,
    /// The write batch its completion completes.
    batch_done: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Live,
    /// A graceful close: no new operations; torn down once everything is acknowledged.
    Draining {
        deadline: Instant,
    },
    /// Torn down: the queue pair goes to the error state at `error_at`, then the flushes are
    /// reaped (until `deadline`), then it is destroyed.
    Failing {
        error_at: Instant,
        errored: bool,
        deadline: Instant,
    },
    /// The queue pair is destroyed; the link was reported disconnected.
    Closed,
}

/// Everything behind a link's lock.
struct Inner {
    // Dropped first: the queue pair goes before the memory it may touch.
    qp: Option<BasicQueuePair>,
    state: State,
    cause: Option<LinkFailure>,
    sends: VecDeque<PendingSend>,
    batches: VecDeque<PendingBatch>,
    /// Bytes of RDMA WRITEs on the send queue (not yet freed by a signaled completion).
    posted_write_bytes: u64,
    /// Of those, bytes of unsignaled writes since the last signaled work request.
    unsignaled_bytes: u64,
    write_window: u64,
    signaled: VecDeque<Signaled>,
    /// Work requests on the send queue not yet freed by a signaled completion.
    sq_outstanding: u32,
    sq_depth: u32,
    /// Unsignaled work requests posted since the last signaled one.
    unsignaled: u32,
    recv_posted: u32,
    free_send_slots: Vec<u32>,
    credits: Credits,
    returns: CreditReturn,
    reassembler: Reassembler,
    peer_regions: HashMap<RegionId, RegionDescriptor>,
    peer_credit: (u64, u32),
    limits: WrLimits,
    memory: Arc<MemoryTable>,
    last_socket_check: Instant,
    // The control channel's memory, after the queue pair.
    ctrl_mr: Arc<MemoryRegion>,
    /// Kept registered while the link lives (the peer writes credits into it).
    _credit_mr: Arc<MemoryRegion>,
    ctrl_buf: Box<[u8]>,
    credit_word: Box<AtomicU64>,
}

/// One RC link to a peer.
pub(crate) struct Link {
    pub(crate) id: LinkId,
    /// Its `Connected` event was delivered: the poller may now report anything else of it.
    pub(crate) announced: AtomicBool,
    cq: Arc<BasicCompletionQueue>,
    inner: Mutex<Inner>,
    socket: TcpStream,
    recv_depth: u32,
    /// Size of each local control buffer (receive and send).
    slot_len: usize,
    /// Longest fragment sent: the smaller of both sides' buffer sizes.
    frag_len: usize,
}

fn verbs(what: &str, e: impl std::fmt::Debug) -> io::Error {
    io::Error::other(format!("{what}: {e:?}"))
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}
