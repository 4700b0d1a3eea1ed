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

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvpipe_core::{RegionId, WriteExtent};
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, GenericCompletionQueue, WorkCompletionStatus,
};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendError, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use crate::bootstrap::{self, ConnectInfo, RegionDescriptor};
use crate::device::VerbsDevice;
use crate::fabric::api::{
    status_name, FabricConfig, FabricEvent, LinkFailure, LinkId, Posted, WriteFailure,
};
use crate::flow::{fragments, CreditReturn, Credits, Reassembler};
use crate::memory::MemoryTable;
pub(crate) use kvpipe_driver::later;

use crate::writes::{map_extents, Segment, WrLimits, WriteMappingError, WriteRequest};

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

/// Work requests a link may have on its send queue.
fn sq_depth(config: &FabricConfig, device: &VerbsDevice) -> u32 {
    // Deeper than two signaling intervals, so a full queue always holds a signaled request
    // whose completion frees room.
    let floor = 2 * SIGNAL_EVERY + 8;
    config
        .send_queue_depth
        .clamp(floor, device.max_qp_wr.max(floor))
}

/// Bytes per RDMA WRITE: the configured size capped by the port's maximum message size.
pub(crate) fn write_request_bytes(config: &FabricConfig, device: &VerbsDevice) -> u64 {
    config.max_write_bytes.clamp(1, device.max_msg.max(4096))
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

/// A random-enough 24-bit packet sequence number (no RNG dependency: a hash of time and pid).
fn initial_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    (h.finish() & 0xFF_FFFF) as u32
}

impl Link {
    /// Creates the queue pair and control channel, runs the bootstrap exchange on `socket`
    /// and connects the queue pair. On return the link is live (receive buffers posted, the
    /// peer's too) and `socket` is non-blocking.
    pub(crate) fn establish(
        id: LinkId,
        device: &VerbsDevice,
        memory: Arc<MemoryTable>,
        config: &FabricConfig,
        mut socket: TcpStream,
    ) -> io::Result<Link> {
        socket.set_read_timeout(Some(config.handshake_timeout))?;
        socket.set_write_timeout(Some(config.handshake_timeout))?;
        socket.set_nodelay(true)?;
        let recv_depth = config.recv_depth.clamp(4, device.max_qp_wr.max(4));
        let buf_len = config.recv_buf_len.clamp(64, 1 << 20);
        let send_slots = config.send_buffers.max(1);
        let sq_depth = sq_depth(config, device);
        let max_sge = config.max_sge.clamp(1, device.max_sge.max(1));
        let cqe = (recv_depth + sq_depth + 16).min(device.max_cqe.max(64));
        let cq = device
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .build()
            .map_err(|e| verbs("ibv_create_cq", e))?;
        let generic = GenericCompletionQueue::from(Arc::clone(&cq));
        let mut qp = device
            .pd
            .create_qp_builder()
            .setup_send_cq(generic.clone())
            .setup_recv_cq(generic)
            .setup_max_send_wr(sq_depth)
            .setup_max_recv_wr(recv_depth)
            .setup_max_send_sge(max_sge)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(64)
            .build()
            .map_err(|e| verbs("ibv_create_qp", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(device.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr).map_err(|e| verbs("QP to INIT", e))?;

        let slots = (recv_depth + send_slots) as usize;
        let mut ctrl_buf = vec![0u8; slots * buf_len as usize].into_boxed_slice();
        let credit_word = Box::new(AtomicU64::new(0));
        // SAFETY: both buffers are owned by the link and dropped after its queue pair (field
        // order of `Inner`), so the registrations never outlive them.
        let ctrl_mr = unsafe {
            device.pd.reg_mr(
                ctrl_buf.as_mut_ptr() as usize,
                ctrl_buf.len(),
                AccessFlags::LocalWrite,
            )
        }
        .map_err(|e| verbs("registering the control buffers", e))?;
        // SAFETY: as above; the peer RDMA-writes its credit count here.
        let credit_mr = unsafe {
            device.pd.reg_mr(
                credit_word.as_ptr() as usize,
                8,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            )
        }
        .map_err(|e| verbs("registering the credit word", e))?;

        // Every receive buffer is posted before the peer can learn our queue pair number.
        {
            let mut guard = qp.start_post_recv();
            for slot in 0..recv_depth {
                let addr = ctrl_buf.as_ptr() as u64 + u64::from(slot) * u64::from(buf_len);
                // SAFETY: the slot lies inside the registered control buffer.
                unsafe {
                    guard.construct_wr(wr_id(WR_RECV, slot.into())).setup_sge(
                        ctrl_mr.lkey(),
                        addr,
                        buf_len,
                    );
                }
            }
            guard
                .post()
                .map_err(|e| verbs("posting receive buffers", e))?;
        }

        let psn = initial_psn();
        let local = ConnectInfo {
            lid: device.lid,
            mtu: device.mtu,
            qpn: qp.qp_number(),
            psn,
            gid: std::net::Ipv6Addr::from(device.gid).octets(),
            recv_depth,
            recv_buf_len: buf_len,
            credit_addr: credit_word.as_ptr() as u64,
            credit_rkey: credit_mr.rkey(),
            regions: memory.descriptors(),
        };
        let peer = bootstrap::exchange(&mut socket, &local)?;

        let mtu = Mtu::from(u32::from(peer.mtu.min(device.mtu).clamp(1, 5)));
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid)
            .setup_port(device.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(device.gid_index as u8)
            .setup_grh_dest_gid(&Gid::from(std::net::Ipv6Addr::from(peer.gid)))
            .setup_grh_hop_limit(64);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        qp.modify(&attr).map_err(|e| verbs("QP to RTR", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(psn)
            .setup_timeout(config.ack_timeout)
            .setup_retry_cnt(config.retry_count)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        qp.modify(&attr).map_err(|e| verbs("QP to RTS", e))?;
        bootstrap::ready(&mut socket)?;
        socket.set_nonblocking(true)?;

        let inner = Inner {
            qp: Some(qp),
            state: State::Live,
            cause: None,
            sends: VecDeque::new(),
            batches: VecDeque::new(),
            posted_write_bytes: 0,
            unsignaled_bytes: 0,
            write_window: config.write_window.max(1),
            signaled: VecDeque::new(),
            sq_outstanding: 0,
            sq_depth,
            unsignaled: 0,
            recv_posted: recv_depth,
            free_send_slots: (recv_depth..recv_depth + send_slots).rev().collect(),
            credits: Credits::new(peer.recv_depth),
            returns: CreditReturn::new(recv_depth),
            reassembler: Reassembler::new(config.max_message),
            peer_regions: peer.regions.iter().map(|d| (d.region, *d)).collect(),
            peer_credit: (peer.credit_addr, peer.credit_rkey),
            limits: WrLimits {
                max_sge: max_sge as usize,
                max_bytes: write_request_bytes(config, device),
            },
            memory,
            last_socket_check: Instant::now(),
            ctrl_mr,
            _credit_mr: credit_mr,
            ctrl_buf,
            credit_word,
        };
        Ok(Link {
            id,
            announced: AtomicBool::new(false),
            cq,
            inner: Mutex::new(inner),
            socket,
            recv_depth,
            slot_len: buf_len as usize,
            frag_len: buf_len.min(peer.recv_buf_len) as usize,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a control message and posts what the credits and the send queue allow.
    pub(crate) fn send_message(&self, message: Vec<u8>) -> Result<(), LinkFailure> {
        let mut inner = self.lock();
        if inner.state != State::Live {
            return Err(inner.cause.clone().unwrap_or(LinkFailure::Closed));
        }
        inner.sends.push_back(PendingSend { message, sent: 0 });
        self.pump(&mut inner);
        Ok(())
    }

    /// Turns `extents` into RDMA WRITEs reported as `token`, queues them and posts what the
    /// send queue allows.
    pub(crate) fn post_writes(
        &self,
        token: u64,
        extents: &[WriteExtent],
    ) -> Result<Posted, WriteFailure> {
        let mut inner = self.lock();
        if inner.state != State::Live {
            return Err(WriteFailure::LinkDown(
                inner.cause.clone().unwrap_or(LinkFailure::Closed),
            ));
        }
        let (mut wrs, mut segments) = (Vec::new(), Vec::new());
        let inner_ref = &*inner;
        map_extents(
            extents,
            |r| inner_ref.memory.local(r),
            |r| inner_ref.peer_regions.get(&r).copied(),
            inner_ref.limits,
            &mut wrs,
            &mut segments,
        )
        .map_err(|e: WriteMappingError| WriteFailure::Unmappable(e.to_string()))?;
        if wrs.is_empty() {
            return Ok(Posted::Done);
        }
        inner.batches.push_back(PendingBatch {
            token,
            wrs,
            segments,
            next: 0,
        });
        self.pump(&mut inner);
        Ok(Posted::Queued)
    }

    /// Starts closing: gracefully (what is queued is sent and acknowledged first, bounded by
    /// `grace`) or at once.
    pub(crate) fn close(&self, graceful: bool, grace: Duration) {
        let mut inner = self.lock();
        let now = Instant::now();
        match inner.state {
            State::Live if graceful => {
                inner.state = State::Draining {
                    deadline: later(now, grace),
                };
                inner.cause.get_or_insert(LinkFailure::Closed);
            }
            State::Live | State::Draining { .. } => {
                self.teardown(&mut inner, LinkFailure::Closed, now);
            }
            State::Failing { .. } | State::Closed => {}
        }
    }

    /// Fails the link now (as if the queue pair went to the error state on its own).
    pub(crate) fn fail(&self, cause: LinkFailure) {
        let mut inner = self.lock();
        self.teardown(&mut inner, cause, Instant::now());
    }

    /// Moves the queue pair to the error state (a test hook for the failure paths: every
    /// posted work request flushes, the link then fails as it would on a fabric error).
    pub(crate) fn force_error_state(&self) -> io::Result<()> {
        let mut inner = self.lock();
        let qp = inner
            .qp
            .as_mut()
            .ok_or_else(|| io::Error::other("the queue pair is destroyed"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        qp.modify(&attr).map_err(|e| verbs("QP to ERR", e))
    }

    /// Whether the link was torn down completely (reported disconnected).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().state == State::Closed
    }

    /// Starts the teardown (see the module documentation); the queue pair goes to the error
    /// state after `grace`.
    fn teardown_after(&self, inner: &mut Inner, cause: LinkFailure, now: Instant, grace: Duration) {
        if matches!(inner.state, State::Failing { .. } | State::Closed) {
            return;
        }
        let _ = self.socket.shutdown(Shutdown::Both);
        inner.cause = Some(cause);
        inner.sends.clear();
        inner.batches.clear();
        inner.state = State::Failing {
            error_at: later(now, grace),
            errored: false,
            deadline: later(later(now, grace), FLUSH_WAIT),
        };
        if grace.is_zero() {
            Self::to_error(inner, now);
        }
    }

    fn teardown(&self, inner: &mut Inner, cause: LinkFailure, now: Instant) {
        self.teardown_after(inner, cause, now, Duration::ZERO);
    }

    /// Moves the queue pair of a failing link to the error state once its grace is over.
    fn to_error(inner: &mut Inner, now: Instant) {
        if let State::Failing {
            error_at,
            errored: errored @ false,
            ..
        } = &mut inner.state
        {
            if now >= *error_at {
                *errored = true;
                if let Some(qp) = inner.qp.as_mut() {
                    let mut attr = QueuePairAttribute::new();
                    attr.setup_state(QueuePairState::Error);
                    let _ = qp.modify(&attr);
                }
            }
        }
    }

    /// Reaps completions, delivers messages, posts what waits, checks the peer's liveness and
    /// advances a teardown. Returns whether anything happened.
    pub(crate) fn progress(&self, events: &mut Vec<FabricEvent>) -> bool {
        let mut wcs: Vec<(u64, u32, u32)> = Vec::new();
        if let Ok(poller) = self.cq.start_poll() {
            for wc in poller.take(64) {
                wcs.push((wc.wr_id(), wc.status(), wc.byte_len()));
            }
        }
        let now = Instant::now();
        let mut inner = self.lock();
        if inner.state == State::Closed {
            return !wcs.is_empty();
        }
        let mut did = !wcs.is_empty();
        let mut reposts: Vec<u32> = Vec::new();
        for (id, status, len) in wcs {
            self.complete(&mut inner, id, status, len, &mut reposts, events, now);
        }
        if !reposts.is_empty() && matches!(inner.state, State::Live | State::Draining { .. }) {
            self.repost(&mut inner, &reposts, now);
        }
        match inner.state {
            State::Live | State::Draining { .. } => {
                if now.saturating_duration_since(inner.last_socket_check) >= SOCKET_CHECK {
                    inner.last_socket_check = now;
                    if let Some(cause) = self.peer_gone() {
                        self.teardown_after(&mut inner, cause, now, PEER_CLOSE_GRACE);
                        return true;
                    }
                }
                did |= self.pump(&mut inner);
                if let State::Draining { deadline } = inner.state {
                    let idle = inner.sends.is_empty()
                        && inner.batches.is_empty()
                        && inner.signaled.is_empty();
                    if idle || now >= deadline {
                        self.teardown(&mut inner, LinkFailure::Closed, now);
                        did = true;
                    }
                }
            }
            State::Failing { .. } => {
                Self::to_error(&mut inner, now);
                let State::Failing {
                    errored, deadline, ..
                } = inner.state
                else {
                    unreachable!("matched above")
                };
                if errored && (inner.recv_posted == 0 || now >= deadline) {
                    // The fence: once the queue pair is destroyed the adapter neither reads
                    // this side's sources nor places the peer's writes for this link.
                    inner.qp = None;
                    inner.state = State::Closed;
                    events.push(FabricEvent::Disconnected {
                        link: self.id,
                        cause: inner.cause.clone().unwrap_or(LinkFailure::Closed),
                    });
                    did = true;
                }
            }
            State::Closed => {}
        }
        did
    }

    /// Whether the peer ended the bootstrap socket (its process died, or it tore down).
    fn peer_gone(&self) -> Option<LinkFailure> {
        let mut b = [0u8; 1];
        match self.socket.peek(&mut b) {
            Ok(0) => Some(LinkFailure::PeerClosed),
            Ok(_) => Some(LinkFailure::Protocol(
                "the peer sent bytes on the bootstrap socket after setup".into(),
            )),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(e) => Some(LinkFailure::Socket(e.to_string())),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        inner: &mut Inner,
        id: u64,
        status: u32,
        len: u32,
        reposts: &mut Vec<u32>,
        events: &mut Vec<FabricEvent>,
        now: Instant,
    ) {
        let (kind, low) = (id >> KIND_SHIFT, id & LOW_MASK);
        let ok = status == WorkCompletionStatus::Success as u32;
        let failing = matches!(inner.state, State::Failing { .. } | State::Closed);
        if kind == WR_RECV {
            inner.recv_posted = inner.recv_posted.saturating_sub(1);
            if !ok {
                if !failing {
                    self.teardown(inner, LinkFailure::completion("receive", status), now);
                }
                return;
            }
            let slot = low as u32;
            // A successful receive is delivered even while tearing down: the peer sent it
            // before it closed.
            let start = slot as usize * self.slot_len;
            let end = start + (len as usize).min(self.slot_len);
            if end > inner.ctrl_buf.len() || slot >= self.recv_depth {
                self.teardown(
                    inner,
                    LinkFailure::Protocol("receive in an unknown slot".into()),
                    now,
                );
                return;
            }
            match inner.reassembler.push(&inner.ctrl_buf[start..end]) {
                Ok(Some(bytes)) => events.push(FabricEvent::Message {
                    link: self.id,
                    bytes,
                }),
                Ok(None) => {}
                Err(e) => {
                    self.teardown(inner, LinkFailure::Protocol(e.to_string()), now);
                    return;
                }
            }
            reposts.push(slot);
            return;
        }
        if inner.state == State::Closed {
            return;
        }
        if !ok {
            // Flushes only echo a failure already being handled; any other error is the
            // failure itself (also when it arrives while the link is going down).
            let flushed = status == WorkCompletionStatus::WorkRequestFlushedError as u32;
            if failing && flushed {
                return;
            }
            if kind == WR_WRITE {
                events.push(FabricEvent::WritesDone {
                    link: self.id,
                    token: low,
                    result: Err(WriteFailure::Completion(status_name(status), status)),
                });
            }
            let op = match kind {
                WR_SEND => "send",
                WR_WRITE => "RDMA write",
                _ => "credit write",
            };
            let cause = LinkFailure::completion(op, status);
            if failing {
                // The peer closed because of this error: it is the better cause.
                if inner.cause == Some(LinkFailure::PeerClosed) {
                    inner.cause = Some(cause);
                }
            } else {
                self.teardown(inner, cause, now);
            }
            return;
        }
        // A successful completion is of the oldest signaled work request.
        if let Some(done) = inner.signaled.pop_front() {
            inner.sq_outstanding = inner.sq_outstanding.saturating_sub(done.covered);
            inner.posted_write_bytes = inner.posted_write_bytes.saturating_sub(done.write_bytes);
            if let Some(slot) = done.send_slot {
                inner.free_send_slots.push(slot);
            }
            if let Some(token) = done.batch_done {
                events.push(FabricEvent::WritesDone {
                    link: self.id,
                    token,
                    result: Ok(()),
                });
            }
        }
    }

    fn repost(&self, inner: &mut Inner, slots: &[u32], now: Instant) {
        let local_len = self.slot_len;
        let base = inner.ctrl_buf.as_ptr() as u64;
        let lkey = inner.ctrl_mr.lkey();
        let Some(qp) = inner.qp.as_mut() else {
            return;
        };
        let mut guard = qp.start_post_recv();
        for &slot in slots {
            // SAFETY: the slot lies inside the registered control buffer.
            unsafe {
                guard.construct_wr(wr_id(WR_RECV, slot.into())).setup_sge(
                    lkey,
                    base + slot as u64 * local_len as u64,
                    local_len as u32,
                );
            }
        }
        match guard.post() {
            Ok(()) => {
                inner.recv_posted += slots.len() as u32;
                for _ in slots {
                    inner.returns.reposted();
                }
            }
            Err(e) => self.teardown(inner, LinkFailure::Verbs(format!("post_recv: {e:?}")), now),
        }
    }

    /// Posts, in one `ibv_post_send`, a due credit return and as many queued operations as
    /// credits, send buffers and send-queue room allow. Returns whether it posted anything.
    fn pump(&self, inner: &mut Inner) -> bool {
        match self.post_queued(inner) {
            Ok(posted) => posted > 0,
            Err(e) => {
                self.teardown(
                    inner,
                    LinkFailure::Verbs(format!("post_send: {e:?}")),
                    Instant::now(),
                );
                true
            }
        }
    }

    fn post_queued(&self, inner: &mut Inner) -> Result<u32, PostSendError> {
        let returned = inner.credit_word.load(Ordering::Acquire);
        let Inner {
            qp,
            sends,
            batches,
            signaled,
            sq_outstanding,
            sq_depth,
            unsignaled,
            posted_write_bytes,
            unsignaled_bytes,
            write_window,
            free_send_slots,
            credits,
            returns,
            peer_credit,
            ctrl_buf,
            ctrl_mr,
            ..
        } = inner;
        let Some(qp) = qp.as_mut() else {
            return Ok(0);
        };
        let lkey = ctrl_mr.lkey();
        let mut guard = qp.start_post_send();
        let mut posted = 0u32;
        let room = |posted: u32| *sq_outstanding + posted < *sq_depth;
        // Closes the run of unsignaled work requests with a signaled one.
        let sign = |signaled: &mut VecDeque<Signaled>,
                    unsignaled: &mut u32,
                    unsignaled_bytes: &mut u64,
                    send_slot: Option<u32>,
                    batch_done: Option<u64>| {
            signaled.push_back(Signaled {
                covered: *unsignaled + 1,
                write_bytes: *unsignaled_bytes,
                send_slot,
                batch_done,
            });
            *unsignaled = 0;
            *unsignaled_bytes = 0;
        };
        if let Some(count) = returns.due() {
            if room(posted) {
                guard
                    .construct_wr(
                        wr_id(WR_CREDIT, 0),
                        WorkRequestFlags::Signaled | WorkRequestFlags::Inline,
                    )
                    .setup_write(peer_credit.1, peer_credit.0)
                    .setup_inline_data(&count.to_le_bytes());
                sign(signaled, unsignaled, unsignaled_bytes, None, None);
                returns.written(count);
                posted += 1;
            }
        }
        // Control messages first: they overtake writes not posted yet (never posted ones: RC
        // keeps the order of what is on the queue pair).
        'sends: while let Some(op) = sends.front_mut() {
            loop {
                if !room(posted) || credits.available(returned) == 0 || free_send_slots.is_empty() {
                    break 'sends;
                }
                let Some((header, payload)) =
                    fragments(&op.message[op.sent..], self.frag_len).next()
                else {
                    sends.pop_front();
                    continue 'sends;
                };
                let slot = free_send_slots.pop().expect("checked non-empty");
                let start = slot as usize * self.slot_len;
                let buf = &mut ctrl_buf[start..start + 1 + payload.len()];
                buf[0] = header;
                buf[1..].copy_from_slice(payload);
                let addr = buf.as_ptr() as u64;
                // SAFETY: the send buffer lies inside the registered control buffer and is not
                // reused before this send's completion frees it.
                unsafe {
                    guard
                        .construct_wr(wr_id(WR_SEND, slot.into()), WorkRequestFlags::Signaled)
                        .setup_send()
                        .setup_sge(lkey, addr, (1 + payload.len()) as u32);
                }
                sign(signaled, unsignaled, unsignaled_bytes, Some(slot), None);
                credits.spend();
                posted += 1;
                op.sent += payload.len();
                if op.sent >= op.message.len() {
                    sends.pop_front();
                    continue 'sends;
                }
            }
        }
        // Then writes, in order, while the window of posted write bytes has room (at least one
        // work request may always be posted), so control messages never wait behind more than
        // a window of data.
        let mut sges: Vec<ibv_sge> = Vec::new();
        'batches: while let Some(b) = batches.front_mut() {
            while b.next < b.wrs.len() {
                let w = b.wrs[b.next];
                let window_full =
                    *posted_write_bytes > 0 && *posted_write_bytes + w.len > *write_window;
                if !room(posted) || window_full {
                    break 'batches;
                }
                let last = b.next + 1 == b.wrs.len();
                // Signal often enough that completions free both the send queue and the window.
                let signal = last
                    || *unsignaled + 1 >= SIGNAL_EVERY
                    || *unsignaled_bytes + w.len >= *write_window / 4;
                let flags = if signal {
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                sges.clear();
                sges.extend(
                    b.segments[w.first..w.first + w.count]
                        .iter()
                        .map(|s| ibv_sge {
                            addr: s.addr,
                            length: s.len,
                            lkey: s.lkey,
                        }),
                );
                // SAFETY: every segment lies inside a registered local region (checked by the
                // mapping); the sessions keep the source blocks pinned until the batch is
                // reported or the link disconnected.
                unsafe {
                    guard
                        .construct_wr(wr_id(WR_WRITE, b.token), flags)
                        .setup_write(w.rkey, w.remote_addr)
                        .setup_sge_list(&sges);
                }
                *posted_write_bytes += w.len;
                *unsignaled_bytes += w.len;
                if signal {
                    sign(
                        signaled,
                        unsignaled,
                        unsignaled_bytes,
                        None,
                        last.then_some(b.token),
                    );
                } else {
                    *unsignaled += 1;
                }
                posted += 1;
                b.next += 1;
            }
            batches.pop_front();
        }
        if posted == 0 {
            // Nothing was added to the guard (posting an empty list is not allowed).
            return Ok(0);
        }
        guard.post()?;
        *sq_outstanding += posted;
        Ok(posted)
    }
}
