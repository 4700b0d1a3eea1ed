//! What a fabric's users and its links share: link ids, the events the fabric reports and the
//! handler that receives them, why links and writes fail, and the fabric's sizes and timeouts.
//! Apart from the fabric itself, so that a link depends on these words and the fabric on links,
//! not each on the other.

use std::fmt;
use std::time::Duration;

use sideway::ibverbs::completion::WorkCompletionStatus;
use thiserror::Error;

use crate::idle::IdlePolicy;

/// A link to one peer, numbered from 0 by the node in the order links come up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinkId(pub u32);

impl fmt::Display for LinkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "link#{}", self.0)
    }
}

/// Why a link went down.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LinkFailure {
    /// This side closed it.
    #[error("closed by this side")]
    Closed,
    /// The peer's bootstrap socket ended: its process died or it tore the link down.
    #[error("the peer closed the link (its bootstrap socket ended)")]
    PeerClosed,
    /// A work request completed with an error (the queue pair is in the error state).
    #[error("{op} completed with {name} (status {status})")]
    Completion {
        /// What completed.
        op: &'static str,
        /// The status's name.
        name: &'static str,
        /// The verbs status code.
        status: u32,
    },
    /// The peer broke the control channel's framing.
    #[error("the peer broke the control channel: {0}")]
    Protocol(String),
    /// The bootstrap socket failed.
    #[error("bootstrap socket failed: {0}")]
    Socket(String),
    /// A verbs call failed.
    #[error("verbs call failed: {0}")]
    Verbs(String),
    /// The fabric shut down.
    #[error("the fabric shut down")]
    Shutdown,
}

impl LinkFailure {
    pub(crate) fn completion(op: &'static str, status: u32) -> Self {
        LinkFailure::Completion {
            op,
            name: status_name(status),
            status,
        }
    }
}

/// Why a write batch failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WriteFailure {
    /// The link is down (nothing was posted).
    #[error("the link is down: {0}")]
    LinkDown(LinkFailure),
    /// The plan names memory that is not registered or announced (nothing was posted).
    #[error("the plan cannot be posted: {0}")]
    Unmappable(String),
    /// A write completed with an error; the link fails with it.
    #[error("an RDMA write completed with {0} (status {1})")]
    Completion(&'static str, u32),
}

/// Whether a submitted write batch is done already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// Posted (or queued); a [`FabricEvent::WritesDone`] reports it.
    Queued,
    /// It writes nothing: done at once, no event follows.
    Done,
}

/// What the fabric reports.
#[derive(Debug)]
pub enum FabricEvent {
    /// A link is up (both queue pairs ready, receive buffers posted).
    Connected {
        /// The link.
        link: LinkId,
    },
    /// A whole control message arrived.
    Message {
        /// The link.
        link: LinkId,
        /// The message.
        bytes: Vec<u8>,
    },
    /// A write batch finished: every write was acknowledged by the peer's adapter (placed in
    /// its memory), or one failed.
    WritesDone {
        /// The link.
        link: LinkId,
        /// The token the batch was posted with.
        token: u64,
        /// The outcome.
        result: Result<(), WriteFailure>,
    },
    /// The link is gone: its queue pair is destroyed, no write of it can still read local
    /// memory or land in it. Batches not reported yet never will be.
    Disconnected {
        /// The link.
        link: LinkId,
        /// Why.
        cause: LinkFailure,
    },
}

/// Receives the fabric's events.
pub trait FabricHandler: Send + Sync + 'static {
    /// One event; called with no fabric lock held.
    fn handle(&self, event: FabricEvent);

    /// Called by the poller on every round (a handler that defers work can finish it here).
    fn idle(&self) {}
}

/// Sizes and timeouts of a fabric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Receive buffers each link keeps posted for control messages (the peer's credits).
    pub recv_depth: u32,
    /// Size of each control buffer; longer messages are fragmented.
    pub recv_buf_len: u32,
    /// Send buffers per link (control messages in flight).
    pub send_buffers: u32,
    /// Work requests per link's send queue.
    pub send_queue_depth: u32,
    /// Scatter/gather entries per RDMA WRITE (capped by the device).
    pub max_sge: u32,
    /// Bytes per RDMA WRITE (longer extents are split; capped by the port's maximum message
    /// size).
    pub max_write_bytes: u64,
    /// Bytes of RDMA WRITEs a link keeps posted at once; the rest waits in the link's queue,
    /// where control messages overtake it. Bounds how long a control message (a heartbeat, a
    /// cancel) waits behind data: a window at the link's rate.
    pub write_window: u64,
    /// Longest control message accepted.
    pub max_message: usize,
    /// RC ACK timeout exponent (4.096 µs × 2^n).
    pub ack_timeout: u8,
    /// RC retransmissions before a work request fails.
    pub retry_count: u8,
    /// Bound on the bootstrap exchange.
    pub handshake_timeout: Duration,
    /// Bound on a graceful close.
    pub close_grace: Duration,
    /// The poller's idle policy.
    pub idle: IdlePolicy,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            recv_depth: 64,
            recv_buf_len: 4096,
            send_buffers: 32,
            send_queue_depth: 256,
            max_sge: 16,
            // Large enough for line rate, small enough to interleave control messages.
            max_write_bytes: 1 << 20,
            write_window: 4 << 20,
            max_message: (16 << 20) + 64,
            // 4.096 µs × 2^16 ≈ 268 ms per try, so a peer whose responses stall under
            // emulation is not given up on too early; a dead peer is noticed through its
            // bootstrap socket long before.
            ack_timeout: 16,
            retry_count: 7,
            handshake_timeout: Duration::from_secs(10),
            close_grace: Duration::from_secs(2),
            idle: IdlePolicy::default(),
        }
    }
}

pub(crate) fn status_name(status: u32) -> &'static str {
    use WorkCompletionStatus as S;
    const NAMES: [(WorkCompletionStatus, &str); 12] = [
        (S::Success, "SUCCESS"),
        (S::LocalLengthError, "LOC_LEN_ERR"),
        (S::LocalQueuePairOperationError, "LOC_QP_OP_ERR"),
        (S::LocalProtectionError, "LOC_PROT_ERR"),
        (S::WorkRequestFlushedError, "WR_FLUSH_ERR"),
        (S::LocalAccessError, "LOC_ACCESS_ERR"),
        (S::RemoteInvalidRequestError, "REM_INV_REQ_ERR"),
        (S::RemoteAccessError, "REM_ACCESS_ERR"),
        (S::RemoteOperationError, "REM_OP_ERR"),
        (S::RetryCounterExceededError, "RETRY_EXC_ERR"),
        (
            S::ResponderNotReadyRetryCounterExceededError,
            "RNR_RETRY_EXC_ERR",
        ),
        (S::FatalError, "FATAL_ERR"),
    ];
    NAMES
        .iter()
        .find(|(s, _)| *s as u32 == status)
        .map_or("error", |(_, n)| n)
}
