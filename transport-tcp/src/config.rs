//! Transport settings (the protocol's own deadlines live in the core's configs).

use std::time::Duration;

/// How a node uses its sockets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Connections opened to each peer by the connecting side (1..=255). Control frames use the
    /// first one; data writes are spread over all of them (each connection's writer takes the
    /// next pieces of the peer's batches when its stream runs low).
    pub connections_per_peer: usize,
    /// Smallest piece a large extent is cut into (extents are cut into about one piece per
    /// connection, within this and [`max_piece_bytes`](Self::max_piece_bytes)).
    pub min_piece_bytes: u64,
    /// Largest piece of one data write. Each piece costs the receiver one admission and one
    /// landing report (short calls on the node's lock), so large extents go in few pieces; the
    /// socket calls that move a piece are sized by the two settings below.
    pub max_piece_bytes: u64,
    /// Most bytes one vectored socket write takes (frames, data-write headers and payload).
    /// Default 1 MiB: on loopback a plain socket written in 1 MiB calls moves a share faster
    /// than in one call of the whole share, and no slower than 256 KiB to 32 MiB calls
    /// (`kvpipe bench transfer --transport tcp` measures the sizes side by side).
    pub socket_write_bytes: usize,
    /// Most payload bytes one socket read lands in memory. A read returns at most what the
    /// socket has buffered (Linux's `tcp_rmem` maximum, 32 MiB by default), so the default,
    /// 32 MiB, reads whatever arrived. On a loaded two-core machine, reads capped at 1 MiB
    /// moved one connection's data about 15 % slower than uncapped ones.
    pub socket_read_bytes: usize,
    /// How long an accepted connection may take to send its preamble (each connection has its
    /// own deadline; preambles are read concurrently), a connecting bundle to bring all its
    /// connections, and a connecting sender offering peer copies to hear the peer's answer
    /// (in the handshake) before `connect` gives up.
    pub preamble_timeout: Duration,
    /// Most accepted connections that have not completed the handshake (reading their
    /// preamble, in a bundle still assembling, or handshaking) held at once; a new connection
    /// past it drops the oldest of them. Their handshake deadline is the core's
    /// (`Deadlines::handshake`).
    pub max_unauthenticated: usize,
    /// Most of those from one IP address; a new connection past it drops the oldest from its
    /// address first. Keep it above the connecting peers'
    /// [`connections_per_peer`](Self::connections_per_peer) (up to 255), so that a bundle fits
    /// while it assembles.
    pub max_unauthenticated_per_address: usize,
    /// How long a graceful close (flushing queued frames, then reading until the peer's end of
    /// stream) may take before sockets are shut down: the bound of a close the core asks for, of
    /// one a peer starts by ending its stream, and of dropping a node.
    pub close_grace: Duration,
    /// A blocked socket write failing after this long tears the peer down (`None`: never).
    pub write_stall_timeout: Option<Duration>,
    /// The instant the core's time counts from (`None`: when the node starts). Nodes of one
    /// process given the same origin report comparable event times.
    pub origin: Option<std::time::Instant>,
    /// Bytes of one pinned staging slot (`cuda` feature; at least 4 KiB): device memory goes on
    /// the socket, and comes off it, in pieces of at most this size, each copied by the GPU
    /// while the socket moves another. With the default, 4 MiB × 4 slots, 4 GiB moved between
    /// device pools over 4 loopback connections on an H200 machine as fast as with 1 MiB × 8
    /// and faster than with 16 MiB × 4 (`docs/PERFORMANCE.md`).
    pub staging_slot_bytes: usize,
    /// Staging slots per connection half (`cuda` feature; at least 2, so one slot's copy
    /// overlaps another's socket I/O). Each connection's writer and reader that touches device
    /// memory allocates `staging_slots × staging_slot_bytes` of pinned host memory once.
    pub staging_slots: usize,
    /// How data writes reach the peer's memory: over the sockets (the default), or by peer
    /// copies into the peer's device memory opened through CUDA IPC (`cuda` feature; two
    /// processes on one host, control frames still over TCP). See [`TcpDataPath`].
    pub data_path: TcpDataPath,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_peer: 2,
            min_piece_bytes: 256 << 10,
            max_piece_bytes: 32 << 20,
            socket_write_bytes: 1 << 20,
            socket_read_bytes: 32 << 20,
            preamble_timeout: Duration::from_secs(5),
            max_unauthenticated: 1024,
            max_unauthenticated_per_address: 256,
            close_grace: Duration::from_millis(500),
            write_stall_timeout: Some(Duration::from_secs(30)),
            origin: None,
            staging_slot_bytes: 4 << 20,
            staging_slots: 4,
            data_path: TcpDataPath::Socket,
        }
    }
}

/// How a node's data writes reach the peer's memory ([`TcpConfig::data_path`](crate::TcpConfig::data_path)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TcpDataPath {
    /// Over the sockets (payload after each `DataWrite` header). The default.
    #[default]
    Socket,
    /// Peer copies when both sides' regions are device memory and the sender's CUDA IPC
    /// handles open at the receiver (same host); otherwise the socket path, without an error.
    Auto,
    /// Peer copies or nothing: a connecting sender fails `connect` with the reason when it
    /// cannot export its regions or the peer declines; a receiver whose regions are not all
    /// device memory fails `listen` with the reason, and drops a connection whose sender it
    /// cannot pull from.
    PeerCopy,
}
