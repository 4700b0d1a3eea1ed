//! Connection bundles: the connecting side opens `connections_per_peer` connections, each
//! starting with a [`Preamble`]; the accepting side reads every accepted connection's preamble
//! on a thread of its own, under its own deadline and within the caps on unauthenticated
//! connections ([`super::lobby`]), and collects them by bundle token. Once a bundle
//! is complete its halves start and the core hears `PeerConnected` — in the same hold of the
//! lock, so no frame is read, and no data write can be sent and lost, before the node holds
//! every connection of the peer and the core knows it.

use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration as StdDuration;

use kvpipe_core::wire::Role;
use kvpipe_core::{Endpoint, Instant, PeerId, TransportInput};

use super::link::{Attached, LinkPhase};
use super::lobby::Victim;
use super::{NodePhase, Shared, State};
use crate::conn::PullAcks;
use crate::conn::{Inbound, NodeHooks, Outbound};
use crate::peer_copy::{self, Offer, TcpDataPath};
use crate::placement::PeerPlacement;
use crate::preamble::{Preamble, PREAMBLE_LEN};
use crate::stats::bump;

/// A peer's connected streams, each with its preamble.
pub(crate) type Bundle = Vec<(Preamble, TcpStream)>;

/// Binds `addr` and starts the accept thread.
pub(super) fn listen<E: Endpoint + Send + 'static>(
    shared: &Arc<Shared<E>>,
    addr: impl ToSocketAddrs,
) -> io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    // `PeerCopy` refuses to fall back: a receiver that cannot pull into its memory says so
    // now. (A sender negotiates peer copies where it connects, not where it listens.)
    if shared.config.data_path == TcpDataPath::PeerCopy {
        let receiver = shared.lock().endpoint.role() == Role::Receiver;
        if let (Err(why), true) = (shared.can_pull(), receiver) {
            return Err(io::Error::other(format!(
                "peer copies were asked for, but this node cannot take them: {why}"
            )));
        }
    }
    let shared = shared.clone();
    let handle = thread::Builder::new()
        .name("kvpipe-tcp-accept".into())
        .spawn(move || accept_loop(&shared, listener))?;
    Ok((local, handle))
}

/// Accepts connections (blocking) until the node stops accepting; [`wake_acceptor`] unblocks
/// it then. The loop never reads from a connection: each one's preamble is read on a thread of
/// its own, under its own deadline, after room was made for it (see [`super::lobby`]).
fn accept_loop<E: Endpoint + Send + 'static>(shared: &Arc<Shared<E>>, listener: TcpListener) {
    for stream in listener.incoming() {
        if !shared.accepting.load(Ordering::Acquire) {
            return;
        }
        match stream {
            Ok(stream) => shared.welcome(stream),
            // Out of descriptors or memory, or a connection reset before it was accepted.
            Err(_) => thread::sleep(StdDuration::from_millis(10)),
        }
    }
}

/// Wakes the accept thread blocked on the listener at `local` (it then sees that the node stopped
/// accepting).
pub(super) fn wake_acceptor(local: SocketAddr) {
    let mut addr = local;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let _ = TcpStream::connect_timeout(&addr, StdDuration::from_secs(1));
}

/// Stack of a preamble thread: it reads 16 bytes.
const PREAMBLE_STACK: usize = 64 << 10;

/// Reads a preamble from `stream` by `deadline`, however the bytes are spread out in time.
fn read_preamble(mut stream: &TcpStream, deadline: std::time::Instant) -> Option<Preamble> {
    let mut buf = [0u8; PREAMBLE_LEN];
    let mut filled = 0;
    while filled < PREAMBLE_LEN {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return None;
        }
        stream.set_read_timeout(Some(left)).ok()?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return None,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Preamble::decode(&buf).ok()
}

impl<E: Endpoint + Send + 'static> Shared<E> {
    /// Takes an accepted connection: makes room for it among the unauthenticated ones, then
    /// reads its preamble on a thread of its own.
    fn welcome(self: &Arc<Self>, stream: TcpStream) {
        let Ok(peer_addr) = stream.peer_addr() else {
            return;
        };
        let Ok(handle) = stream.try_clone() else {
            return;
        };
        let addr = peer_addr.ip();
        let since = std::time::Instant::now();
        let ticket = {
            let mut st = self.lock();
            if !matches!(st.io.phase, NodePhase::Running) {
                return;
            }
            let unproven = st.io.links.unproven();
            let victims = st.io.lobby.make_room(
                &unproven,
                addr,
                self.config.max_unauthenticated_per_address,
                self.config.max_unauthenticated,
            );
            bump(&self.stats.unauthenticated_dropped, victims.len() as u64);
            for victim in victims {
                let Victim::Link(peer) = victim else {
                    continue;
                };
                match st.io.links.get_mut(peer) {
                    // The core never heard of it; its sockets close with the link.
                    Some(link) if matches!(link.phase, LinkPhase::Assembling { .. }) => {
                        st.io.links.remove(peer);
                    }
                    // Handshaking: its halves stop, then the core hears of the disconnect.
                    Some(link) => {
                        link.abort();
                    }
                    None => {}
                }
            }
            st.io.lobby.enter(addr, since, handle)
        };
        let deadline = kvpipe_driver::later(since, self.config.preamble_timeout);
        let shared = self.clone();
        let reader = thread::Builder::new()
            .name("kvpipe-tcp-preamble".into())
            .stack_size(PREAMBLE_STACK)
            .spawn(move || {
                let pre = read_preamble(&stream, deadline);
                let mut st = shared.lock();
                // Dropped meanwhile (to make room, or the node stopped): its socket is shut.
                let Some(origin) = st.io.lobby.leave(ticket) else {
                    return;
                };
                let Some(pre) = pre.filter(|_| shared.configure(&stream).is_ok()) else {
                    bump(&shared.stats.preambles_failed, 1);
                    return;
                };
                let now = shared.now();
                shared.attach(&mut st, now, pre, stream, Some(origin), None);
            });
        if reader.is_err() {
            // No thread for it: it leaves at once (the stream was moved into the failed
            // closure and is closed).
            self.lock().io.lobby.leave(ticket);
            bump(&self.stats.preambles_failed, 1);
        }
    }

    /// Connects the connections of one peer bundle and writes their preambles. A sender whose
    /// data path is not the socket's makes its peer-copy offer first (see
    /// [`crate::peer_copy`]): it goes in the `Hello` once the bundle starts.
    pub(crate) fn open_bundle(
        &self,
        addr: impl ToSocketAddrs,
    ) -> io::Result<(Bundle, Option<Offer>)> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        let count = self.config.connections_per_peer.clamp(1, 255);
        let token = self.new_token();
        let path = self.config.data_path;
        let is_sender = self.lock().endpoint.role() == Role::Sender;
        if path == TcpDataPath::PeerCopy && !is_sender {
            return Err(io::Error::other(
                "peer copies are negotiated by a connecting sender; this node is a receiver",
            ));
        }
        // Exported before connecting, on the caller's thread.
        let offer = (path != TcpDataPath::Socket && is_sender).then(|| self.peer_copy_offer());
        if let (TcpDataPath::PeerCopy, Some(Offer::Declined(why))) = (path, offer) {
            return Err(io::Error::other(format!("peer copies refused: {why}")));
        }
        let streams = (0..count)
            .map(|index| {
                let mut s = TcpStream::connect_timeout(&addr, self.config.preamble_timeout)?;
                self.configure(&s)?;
                let pre = Preamble {
                    index: index as u8,
                    count: count as u8,
                    token,
                    flags: 0,
                };
                s.write_all(&pre.encode())?;
                Ok((pre, s))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok((streams, offer.cloned()))
    }

    /// This sender's peer-copy offer (its regions exported), made once.
    fn peer_copy_offer(&self) -> &Offer {
        self.offer
            .get_or_init(|| peer_copy::local_offer(self.config.data_path, &self.regions))
    }

    /// Whether this node can pull a sender's writes at all, or why not.
    fn can_pull(&self) -> Result<(), String> {
        let is_receiver = self.lock().endpoint.role() == Role::Receiver;
        peer_copy::can_pull(self.config.data_path, is_receiver, &self.regions)
    }

    /// Makes a peer of connected streams (from [`Shared::open_bundle`]); the handshake starts,
    /// its `Hello` carrying `offer`. Returns the peer and its placement, which the handshake
    /// decides when an offer is part of it.
    pub(crate) fn adopt_bundle(
        self: &Arc<Self>,
        streams: Bundle,
        offer: Option<Offer>,
    ) -> io::Result<(PeerId, Arc<PeerPlacement>)> {
        let mut st = self.lock();
        let now = self.now();
        let mut assembling = None;
        for (pre, stream) in streams {
            match self.attach(&mut st, now, pre, stream, None, offer.clone()) {
                Attached::Waiting(peer) => assembling = Some(peer),
                Attached::Complete(peer) => {
                    return match st.io.links.get(peer) {
                        Some(link) => Ok((peer, link.placement.clone())),
                        None => Err(io::Error::other("could not start the connections")),
                    }
                }
                Attached::Refused => break,
            }
        }
        if let Some(peer) = assembling {
            st.io.links.remove(peer);
        }
        Err(io::Error::other("the connection bundle was refused"))
    }

    /// Adds a connection to its bundle and starts the bundle once it is complete.
    fn attach(
        self: &Arc<Self>,
        st: &mut State<E>,
        now: Instant,
        pre: Preamble,
        stream: TcpStream,
        origin: Option<(IpAddr, std::time::Instant)>,
        offer: Option<Offer>,
    ) -> Attached {
        if !matches!(st.io.phase, NodePhase::Running) {
            return Attached::Refused;
        }
        let attached = st
            .io
            .links
            .attach(pre, stream, std::time::Instant::now(), origin);
        // The offer goes in the `Hello` of the control connection (once the bundle starts).
        if let (Attached::Waiting(peer) | Attached::Complete(peer), 0) = (attached, pre.index) {
            if let Some(link) = st.io.links.get_mut(peer) {
                link.offer = offer;
            }
        }
        match attached {
            Attached::Refused => return attached,
            Attached::Waiting(_) => {
                bump(&self.stats.connections, 1);
                // The timer drops the bundle if it stays incomplete.
                self.wake_timer_by(
                    st,
                    kvpipe_driver::deadline_after(self.config.preamble_timeout),
                );
            }
            Attached::Complete(peer) => {
                bump(&self.stats.connections, 1);
                self.start(st, now, peer);
            }
        }
        attached
    }

    /// Starts the halves of every connection of `peer`'s complete bundle, then tells the core
    /// the peer connected. A bundle none of whose halves started is dropped unseen by the core.
    fn start(self: &Arc<Self>, st: &mut State<E>, now: Instant, peer: PeerId) {
        let hooks: Arc<dyn NodeHooks> = self.clone();
        let pulls = self.can_pull_quickly(st.endpoint.role());
        let Some(link) = st.io.links.get_mut(peer) else {
            return;
        };
        let wanted = 2 * link.conns.len() as u32;
        let mut started = 0;
        // A receiver's readers may pull (when the handshake says so); a sender that offered its
        // regions may be acknowledged on every connection.
        let offered = matches!(link.offer, Some(Offer::Regions(_)));
        for conn in &mut link.conns {
            let Some(stream) = conn.pending.take() else {
                continue;
            };
            // Each connection's pulled pieces, acknowledged on that connection.
            let acks = offered.then(Arc::<PullAcks>::default);
            let inbound = Inbound::new(
                peer,
                hooks.clone(),
                self.regions.clone(),
                self.stats.clone(),
                &self.config,
            )
            .pulling(
                pulls.then(|| link.placement.clone()),
                &conn.queue,
                &self.config,
            )
            .acking(acks.clone(), &conn.queue)
            .carries_frames(conn.carries_frames());
            let outbound = Outbound::new(
                peer,
                (conn.queue.clone(), link.backlog.clone()),
                hooks.clone(),
                self.stats.clone(),
                &self.config,
            )
            .acked_by(acks.map(|a| (a, link.placement.clone())));
            started += self.spawn.start(peer, stream, inbound, outbound);
        }
        link.halves = started;
        link.phase = LinkPhase::Open;
        tracing::debug!(
            target: "kvpipe::tcp", %peer, connections = link.conns.len(), halves = started,
            "connection bundle started"
        );
        if started == 0 {
            st.io.links.remove(peer);
            return;
        }
        if started < wanted {
            link.abort();
        }
        let input = match &link.offer {
            Some(offer) => TransportInput::PeerConnectedWithOffer {
                peer,
                offer: offer.encode().into(),
            },
            None => TransportInput::PeerConnected { peer },
        };
        st.feed(now, input);
        self.drain(st, now);
    }

    /// Whether this node's readers may ever pull (a receiver not on the socket data path):
    /// only then do they look at the placement.
    fn can_pull_quickly(&self, role: Role) -> bool {
        role == Role::Receiver && self.config.data_path != TcpDataPath::Socket
    }

    /// A token no other bundle of this process uses.
    pub(crate) fn new_token(&self) -> u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(self.tokens.fetch_add(1, Ordering::Relaxed));
        h.write_u64(self.now().as_nanos());
        h.write_u32(std::process::id());
        h.finish()
    }

    /// Socket options of every connection: no Nagle delay, reads block until data or a
    /// shutdown, writes fail after the stall timeout.
    pub(crate) fn configure(&self, stream: &TcpStream) -> io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(self.config.write_stall_timeout)?;
        Ok(())
    }
}
