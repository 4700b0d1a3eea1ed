//! Bringing a link up: the queue pair and completion queue, the control channel's buffers and
//! credits, the exchange over the bootstrap socket, and the send-queue and write sizes it
//! is given.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
};
use sideway::ibverbs::AccessFlags;

use super::{verbs, wr_id, Inner, Link, State, SIGNAL_EVERY, WR_RECV};
use crate::bootstrap::{self, ConnectInfo};
use crate::device::VerbsDevice;
use crate::fabric::api::{FabricConfig, LinkId};
use crate::flow::{CreditReturn, Credits, Reassembler};
use crate::memory::MemoryTable;
use crate::writes::WrLimits;

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
}
