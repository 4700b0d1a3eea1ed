//! Peer copies: data writes moved device → device between two processes on one host, the
//! receiver **pulling** each write from the sender's memory itself (`cuda` feature). Control
//! frames and the data-write headers still travel on the TCP connections.
//!
//! This module holds the negotiation and the records on the wire; the device half (exporting
//! and opening regions, the copies) is in `crate::gpu`, with the rest of the GPU path.
//!
//! ## Negotiation (before the handshake, on the control connection)
//!
//! 1. A connecting **sender** whose [`TcpDataPath`] is not `Socket` sets
//!    [`PREAMBLE_PEER_COPY`](crate::preamble::PREAMBLE_PEER_COPY) in its control connection's
//!    preamble and sends its **offer** right after it: when every one of its registered
//!    regions is device memory, each region exported with CUDA IPC (`kvpipe_cuda::export_ipc`);
//!    otherwise a decline that says why.
//! 2. The accepting **receiver** — when its data path is not `Socket` and its own regions are
//!    all device memory — opens every offered handle on its own GPU
//!    (`kvpipe_cuda::IpcMapping`, lazy peer access) and **answers** accepted, or declined with
//!    the reason (any other node declines). Then the `Hello` follows as on any connection.
//!
//! A declined offer leaves the peer on the socket data path (`Auto`), or fails the connect
//! with the reason (`PeerCopy`; a receiver on `PeerCopy` drops a connection it cannot pull
//! from). "Same host" is decided by the import itself: a handle opens only on the host (and
//! for the user) that exported it, so a peer on another host falls back (or fails).
//!
//! | bytes | offer (sender → accepting node, after the preamble) |
//! |---|---|
//! | 4 | magic `b"KVPC"` |
//! | 1 | version (2) |
//! | 1 | 1: offered, 0: declined |
//! | 2 | `n` (u16 LE): regions offered, or bytes of the reason |
//! | `n` × 88 | offered: region id (u32 LE), the exporter's GPU (u32 LE), the IPC handle (80 bytes, `kvpipe_cuda::IpcHandle::to_bytes`) |
//! | `n` | declined: the reason, UTF-8 |
//!
//! | bytes | answer (accepting node → sender) |
//! |---|---|
//! | 4 | magic `b"KVPA"` |
//! | 1 | version (2) |
//! | 1 | 1: accepted, 0: declined |
//! | 2 | `n` (u16 LE): bytes of the reason (0 when accepted) |
//! | `n` | the reason, UTF-8 |
//!
//! Version 1 (the sender copied into memory the receiver exported) is not spoken any more: a
//! version-1 peer's bytes fail the exchange, and the connect says so.
//!
//! ## The data path
//!
//! The core is unchanged: the sender's endpoint plans writes from the receiver's registration
//! (its grant) exactly as for the socket path, and the receiver's endpoint admits every write
//! (`Receiver::admit_write`). On a peer-copy connection:
//!
//! - the sender's writer sends each piece's `DataWrite` header followed, in place of the
//!   payload, by the piece's **source** (16 bytes, below): where the bytes lie in the sender's
//!   exported regions. It sends nothing else for the piece and touches no memory of the peer.
//! - the receiver's reader takes the header and the source, asks the core's admission as for
//!   any write, checks that the source lies inside the region the sender exported, copies the
//!   bytes from the sender's region into its own admitted destination (the copy engine, on a
//!   stream of the reader's own, in the receiver's process), **waits for the copy**, reports
//!   the write landed (`WriteFinished`), and then sends an **acknowledgement** back on the same
//!   connection. A discarded write (the request ended here) is acknowledged without a copy.
//! - the sender completes a write batch (`WritesCompleted`) only when every piece of it was
//!   acknowledged. Acknowledgements count pieces in the order the connection carried them.
//!
//! | bytes | source (sender → receiver, after each `DataWrite` header) |
//! |---|---|
//! | 4 | the sender's region id (u32 LE) |
//! | 4 | reserved, 0 |
//! | 8 | offset in that region (u64 LE); the length is the header's |
//!
//! | bytes | acknowledgement (receiver → sender, between frames) |
//! |---|---|
//! | 4 | magic `b"KVPK"` (no frame starts so: frames start with `b"KVPF"`) |
//! | 4 | `count` (u32 LE): the next `count` pieces of this connection were pulled (or dropped) |
//!
//! ## The fence
//!
//! Only the receiver's own process ever writes the receiver's memory, and only its reader
//! issues those writes: each one between the write's admission and its `WriteFinished`, which
//! waits for the copy. So when the receiver's core learns that a peer is gone
//! (`PeerDisconnected`, reported once every half of the peer's connections stopped) no copy
//! into its memory is still running, and none can start: a stopped (`SIGSTOP`), slow or dying
//! prefill process has no handle on the decode side's memory. The receiver's `Quiesced`
//! therefore means what it means on the socket path: its blocks may be reused at once. A copy
//! of the receiver's own that its GPU does not finish within the staging wait (60 s) is given
//! up like a staging copy (its engine is kept alive for good, the write fails, the reader
//! stops).
//!
//! The sender's blocks are read by the receiver, so the sender keeps them pinned until the
//! receiver says it has read them: a batch completes only on acknowledgements, and its result
//! (and so the request's last result) is sent only after. If the receiver stops answering, the
//! sender's own deadlines fail the batch and close the peer; its blocks are released once the
//! connection is gone. A stopped receiver that resumes after that may copy whatever those
//! blocks then hold into its own destination, but only into the blocks of a request that
//! cannot complete: the writes it pulls then were never acknowledged, so the result that would
//! complete it was never sent, and its connections are closed.
//!
//! The trust model: the IPC handles give the receiver read access to the sender's exported
//! pools (the registered regions, nothing else), like an RDMA peer holding a key for remote
//! reads. The receiver copies only the extents its core admitted, from sources that lie inside
//! the exported regions; a source outside them fails the write and the connection.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use kvpipe_core::RegionId;

pub(crate) use crate::config::TcpDataPath;
use crate::gpu::{self, IpcMappings};
pub(crate) use crate::gpu::{OfferEntry, PlacedRegion, HANDLE_LEN};
use crate::memory::{RegionTable, Registered};

/// Bytes of one offered region.
const ENTRY_LEN: usize = 8 + HANDLE_LEN;
/// Most regions one offer lists.
pub(crate) const MAX_OFFER_REGIONS: usize = 4096;
/// Most bytes of a reason.
const MAX_REASON: usize = 1024;
const OFFER_MAGIC: [u8; 4] = *b"KVPC";
const ANSWER_MAGIC: [u8; 4] = *b"KVPA";
/// Version of the negotiation and of the source and acknowledgement records.
const VERSION: u8 = 2;
/// Bytes of a piece's source, sent after its `DataWrite` header.
pub(crate) const SOURCE_LEN: usize = 16;
/// Bytes of an acknowledgement.
pub(crate) const ACK_LEN: usize = 8;
/// First bytes of an acknowledgement.
pub(crate) const ACK_MAGIC: [u8; 4] = *b"KVPK";

/// What the connecting sender offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Offer {
    /// Its regions, exported.
    Regions(Vec<OfferEntry>),
    /// No peer copies, and why.
    Declined(String),
}

/// `reason` cut to at most [`MAX_REASON`] bytes at a character boundary.
fn short_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

impl Offer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8);
        out.extend(OFFER_MAGIC);
        out.push(VERSION);
        match self {
            Offer::Regions(entries) => {
                let n = entries.len().min(MAX_OFFER_REGIONS);
                out.push(1);
                out.extend((n as u16).to_le_bytes());
                for e in &entries[..n] {
                    out.extend(e.region.0.to_le_bytes());
                    out.extend(e.ordinal.to_le_bytes());
                    out.extend(e.handle);
                }
            }
            Offer::Declined(reason) => {
                let reason = short_reason(reason);
                out.push(0);
                out.extend((reason.len() as u16).to_le_bytes());
                out.extend(reason);
            }
        }
        out
    }

    /// Reads an offer from `stream` by `deadline`.
    pub(crate) fn read(stream: &TcpStream, deadline: Instant) -> io::Result<Offer> {
        let mut head = [0u8; 8];
        read_by(stream, &mut head, deadline)?;
        let (offered, n) = Offer::check_head(&head)?;
        let mut body = vec![0u8; if offered { n * ENTRY_LEN } else { n }];
        read_by(stream, &mut body, deadline)?;
        Offer::decode_body(offered, &body)
    }

    /// Checks an offer's first 8 bytes: whether it offers regions, and the count.
    fn check_head(head: &[u8; 8]) -> io::Result<(bool, usize)> {
        check_version(head, OFFER_MAGIC, "offer")?;
        if head[5] > 1 {
            return Err(invalid(format!(
                "not a peer-copy offer (header {head:02x?})"
            )));
        }
        let n = usize::from(u16::from_le_bytes([head[6], head[7]]));
        if head[5] == 1 && n > MAX_OFFER_REGIONS {
            return Err(invalid(format!(
                "a peer-copy offer of {n} regions (at most {MAX_OFFER_REGIONS})"
            )));
        }
        if head[5] == 0 && n > MAX_REASON {
            return Err(invalid(format!(
                "a peer-copy decline of {n} bytes (at most {MAX_REASON})"
            )));
        }
        Ok((head[5] == 1, n))
    }

    fn decode_body(offered: bool, body: &[u8]) -> io::Result<Offer> {
        if !offered {
            return Ok(Offer::Declined(String::from_utf8_lossy(body).into_owned()));
        }
        if body.len() % ENTRY_LEN != 0 {
            return Err(invalid(format!(
                "a peer-copy offer body of {} bytes is not whole {ENTRY_LEN}-byte entries",
                body.len()
            )));
        }
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        Ok(Offer::Regions(
            body.chunks_exact(ENTRY_LEN)
                .map(|c| {
                    let mut handle = [0u8; HANDLE_LEN];
                    handle.copy_from_slice(&c[8..]);
                    OfferEntry {
                        region: RegionId(word(&c[..4])),
                        ordinal: word(&c[4..8]),
                        handle,
                    }
                })
                .collect(),
        ))
    }

    /// Decodes a whole offer held in memory (tests).
    #[cfg(test)]
    fn decode(bytes: &[u8]) -> io::Result<Offer> {
        let head: [u8; 8] = bytes
            .get(..8)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| invalid("short offer".into()))?;
        let (offered, n) = Offer::check_head(&head)?;
        let want = if offered { n * ENTRY_LEN } else { n };
        if bytes.len() - 8 != want {
            return Err(invalid("offer length".into()));
        }
        Offer::decode_body(offered, &bytes[8..])
    }
}

/// Checks the magic and the version of a negotiation message's head; a peer speaking another
/// version is named as such.
fn check_version(head: &[u8; 8], magic: [u8; 4], what: &str) -> io::Result<()> {
    if head[..4] != magic {
        return Err(invalid(format!(
            "not a peer-copy {what} (header {head:02x?})"
        )));
    }
    if head[4] != VERSION {
        return Err(invalid(format!(
            "a peer-copy {what} of version {} (this node speaks version {VERSION}: upgrade \
             both sides together, or use the socket data path)",
            head[4]
        )));
    }
    Ok(())
}

/// The accepting node's answer: whether it pulls from the offered regions, or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// It opened every offered region and pulls the data writes.
    Accepted,
    /// No peer copies, and why.
    Declined(String),
}

impl Answer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8);
        out.extend(ANSWER_MAGIC);
        out.push(VERSION);
        let reason: &[u8] = match self {
            Answer::Accepted => &[],
            Answer::Declined(why) => short_reason(why),
        };
        out.push(u8::from(matches!(self, Answer::Accepted)));
        out.extend((reason.len() as u16).to_le_bytes());
        out.extend(reason);
        out
    }

    /// Reads an answer from `stream` by `deadline`.
    pub(crate) fn read(stream: &TcpStream, deadline: Instant) -> io::Result<Answer> {
        let mut head = [0u8; 8];
        read_by(stream, &mut head, deadline)?;
        let n = Answer::check_head(&head)?;
        let mut body = vec![0u8; n];
        read_by(stream, &mut body, deadline)?;
        Ok(Answer::from_parts(head[5] == 1, &body))
    }

    /// Checks an answer's first 8 bytes: the bytes of its reason.
    fn check_head(head: &[u8; 8]) -> io::Result<usize> {
        check_version(head, ANSWER_MAGIC, "answer")?;
        let n = usize::from(u16::from_le_bytes([head[6], head[7]]));
        if head[5] > 1 || (head[5] == 1 && n != 0) || n > MAX_REASON {
            return Err(invalid(format!("not a peer-copy answer ({head:02x?})")));
        }
        Ok(n)
    }

    fn from_parts(accepted: bool, reason: &[u8]) -> Answer {
        if accepted {
            Answer::Accepted
        } else {
            Answer::Declined(String::from_utf8_lossy(reason).into_owned())
        }
    }

    /// Decodes a whole answer held in memory (tests).
    #[cfg(test)]
    fn decode(bytes: &[u8]) -> io::Result<Answer> {
        let head: [u8; 8] = bytes
            .get(..8)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| invalid("short answer".into()))?;
        let n = Answer::check_head(&head)?;
        if bytes.len() - 8 != n {
            return Err(invalid("answer length".into()));
        }
        Ok(Answer::from_parts(head[5] == 1, &bytes[8..]))
    }
}

/// Where a pulled piece's bytes lie in the sender's exported regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub(crate) region: RegionId,
    pub(crate) offset: u64,
}

impl Source {
    pub(crate) fn encode(&self) -> [u8; SOURCE_LEN] {
        let mut out = [0u8; SOURCE_LEN];
        out[..4].copy_from_slice(&self.region.0.to_le_bytes());
        out[8..].copy_from_slice(&self.offset.to_le_bytes());
        out
    }

    /// `None`: the reserved bytes are not zero (not a source this version sends).
    pub(crate) fn decode(b: &[u8; SOURCE_LEN]) -> Option<Source> {
        if b[4..8] != [0; 4] {
            return None;
        }
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&b[8..]);
        Some(Source {
            region: RegionId(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            offset: u64::from_le_bytes(offset),
        })
    }
}

/// An acknowledgement of `count` pulled pieces.
pub(crate) fn encode_ack(count: u32) -> [u8; ACK_LEN] {
    let mut out = [0u8; ACK_LEN];
    out[..4].copy_from_slice(&ACK_MAGIC);
    out[4..].copy_from_slice(&count.to_le_bytes());
    out
}

/// The count of an acknowledgement; `None` when `b` is none (a frame's first bytes) or
/// acknowledges nothing.
pub(crate) fn decode_ack(b: &[u8; ACK_LEN]) -> Option<u32> {
    if b[..4] != ACK_MAGIC {
        return None;
    }
    let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    (count > 0).then_some(count)
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// Reads exactly `buf.len()` bytes by `deadline` (the socket's read timeout is restored to
/// none, as the connection's reader expects).
fn read_by(mut stream: &TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    let result = loop {
        if filled == buf.len() {
            break Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => break Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // A read timeout (EAGAIN on Linux): the deadline passed.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                break Err(io::Error::from(io::ErrorKind::TimedOut))
            }
            Err(e) => break Err(e),
        }
    };
    stream.set_read_timeout(None)?;
    result
}

/// Writes `bytes` whole.
pub(crate) fn write_all(mut stream: &TcpStream, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes)
}

/// The sender's regions opened in this process (a receiver's view of an accepted offer). The
/// IPC mappings close when the last clone of the link's `Arc` is gone — after every reader
/// that copies from them stopped.
#[derive(Debug, Default)]
pub(crate) struct PeerMappings {
    regions: HashMap<RegionId, PlacedRegion>,
    _mappings: IpcMappings,
}

impl PeerMappings {
    /// The opened region `id`.
    pub(crate) fn get(&self, id: RegionId) -> Option<PlacedRegion> {
        self.regions.get(&id).copied()
    }

    /// Where `len` bytes from `source` lie in this process: `None` when they leave the
    /// exported region (or it was not offered).
    pub(crate) fn locate(&self, source: Source, len: u64) -> Option<(usize, u64)> {
        let r = self.get(source.region)?;
        let end = source.offset.checked_add(len)?;
        (end <= r.len).then(|| (r.ordinal, r.ptr + source.offset))
    }

    /// Mappings over given addresses (tests: no driver).
    #[cfg(test)]
    pub(crate) fn fake(regions: impl IntoIterator<Item = (RegionId, PlacedRegion)>) -> Self {
        PeerMappings {
            regions: regions.into_iter().collect(),
            ..PeerMappings::default()
        }
    }
}

/// How a peer's data writes travel, decided when its bundle connected.
#[derive(Clone, Debug, Default)]
pub(crate) enum Placement {
    /// Over the sockets.
    #[default]
    Socket,
    /// (Receiver) this node pulls them from the sender's regions, opened here.
    Pull(std::sync::Arc<PeerMappings>),
    /// (Sender) the peer pulls them: pieces carry their source, batches complete on the
    /// peer's acknowledgements.
    Source,
}

/// Why the local regions cannot take part in peer copies, if they cannot: every region must be
/// device memory (and there must be one).
pub(crate) fn device_only(regions: &RegionTable) -> Result<(), String> {
    let mut any = false;
    for (id, r) in regions.entries() {
        if !r.is_device() {
            return Err(format!(
                "{id} is host memory; peer copies need device memory on both sides"
            ));
        }
        any = true;
    }
    if any {
        Ok(())
    } else {
        Err("no region is registered".into())
    }
}

/// The offer of a connecting sender whose data path is `path`: every region exported, or why
/// not.
pub(crate) fn local_offer(path: TcpDataPath, regions: &RegionTable) -> Offer {
    if path == TcpDataPath::Socket {
        return Offer::Declined("the sender uses the socket data path".into());
    }
    if let Err(why) = device_only(regions) {
        return Offer::Declined(format!("the sender cannot export: {why}"));
    }
    match gpu::export(regions.entries().map(|(id, r)| match r {
        Registered::Device(d) => (id, Some(d)),
        Registered::Host(_) => (id, None),
    })) {
        Ok(entries) => Offer::Regions(entries),
        Err(why) => Offer::Declined(format!("the sender cannot export: {why}")),
    }
}

/// Whether an accepting node whose data path is `path` can pull at all, or why not.
pub(crate) fn can_pull(
    path: TcpDataPath,
    is_receiver: bool,
    regions: &RegionTable,
) -> Result<(), String> {
    if path == TcpDataPath::Socket {
        return Err("the accepting node uses the socket data path".into());
    }
    if !is_receiver {
        return Err("the accepting node is not a receiver".into());
    }
    device_only(regions).map_err(|why| format!("the receiver cannot pull: {why}"))?;
    gpu::supported().map_err(|e| e.to_string())
}

/// The receiver's side: opens every offered region on the GPU of its own regions. `Err`: why
/// the offer cannot be accepted.
pub(crate) fn accept(offer: &Offer, regions: &RegionTable) -> Result<PeerMappings, String> {
    let entries = match offer {
        Offer::Declined(why) => return Err(format!("the sender declined: {why}")),
        Offer::Regions(e) if e.is_empty() => return Err("the sender offered no region".into()),
        Offer::Regions(e) => e,
    };
    device_only(regions).map_err(|why| format!("this node cannot pull: {why}"))?;
    // This node's GPU: the one its own regions are on (all device memory, checked above).
    let ordinal = regions
        .entries()
        .find_map(|(_, r)| match r {
            Registered::Device(d) => Some(d.ordinal()),
            Registered::Host(_) => None,
        })
        .unwrap_or(0);
    let (placed, mappings) = gpu::import(entries, ordinal)?;
    Ok(PeerMappings {
        regions: placed,
        _mappings: mappings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryRegion;

    fn entry(region: u32) -> OfferEntry {
        let mut handle = [0u8; HANDLE_LEN];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i as u8) ^ (region as u8);
        }
        OfferEntry {
            region: RegionId(region),
            ordinal: region % 2,
            handle,
        }
    }

    #[test]
    fn offers_and_answers_round_trip() {
        let offer = Offer::Regions(vec![entry(1000), entry(1001)]);
        let bytes = offer.encode();
        assert_eq!(bytes.len(), 8 + 2 * ENTRY_LEN);
        assert_eq!(bytes[4], 2, "version 2: the receiver pulls");
        assert_eq!(Offer::decode(&bytes).unwrap(), offer);
        let no = Offer::Declined("the sender cannot export: r1 is host memory".into());
        assert_eq!(Offer::decode(&no.encode()).unwrap(), no);
        assert_eq!(Answer::encode(&Answer::Accepted).len(), 8);
        assert_eq!(
            Answer::decode(&Answer::Accepted.encode()).unwrap(),
            Answer::Accepted
        );
        let why = Answer::Declined("r1 (GPU 0 of the peer) does not open here".into());
        assert_eq!(Answer::decode(&why.encode()).unwrap(), why);
        // A long reason is cut at a character boundary.
        let long = Answer::Declined("é".repeat(MAX_REASON));
        let Answer::Declined(cut) = Answer::decode(&long.encode()).unwrap() else {
            panic!("declined");
        };
        assert!(cut.len() <= MAX_REASON && cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn malformed_offers_and_answers_are_refused() {
        let bytes = Offer::Regions(vec![entry(7)]).encode();
        // Wrong magic, version, status.
        for (at, v) in [(0, b'X'), (4, 9), (5, 2)] {
            let mut b = bytes.clone();
            b[at] = v;
            assert!(Offer::decode(&b).is_err(), "byte {at}");
        }
        // A region count past the cap is refused before its body is read.
        let mut b = bytes.clone();
        b[6..8].copy_from_slice(&(MAX_OFFER_REGIONS as u16 + 1).to_le_bytes());
        assert!(Offer::check_head(b[..8].try_into().unwrap()).is_err());
        // A body that is not whole entries (a handle of the wrong length).
        assert!(Offer::decode_body(true, &bytes[8..bytes.len() - 1]).is_err());
        // An accepted answer carries no reason; a status is 0 or 1.
        let mut a = Answer::Accepted.encode();
        a[6] = 1;
        a.push(b'x');
        assert!(Answer::decode(&a).is_err());
        let mut a = Answer::Accepted.encode();
        a[5] = 2;
        assert!(Answer::decode(&a).is_err());
    }

    #[test]
    fn a_version_1_peer_is_named_as_such() {
        // Version 1: the receiver offered its own regions and the sender copied into them.
        let mut b = Offer::Regions(vec![entry(7)]).encode();
        b[4] = 1;
        let e = Offer::decode(&b).unwrap_err().to_string();
        assert!(e.contains("version 1") && e.contains("version 2"), "{e}");
        let mut a = Answer::Accepted.encode();
        a[4] = 1;
        let e = Answer::decode(&a).unwrap_err().to_string();
        assert!(e.contains("version 1"), "{e}");
    }

    #[test]
    fn sources_and_acknowledgements_round_trip_and_never_look_like_frames() {
        let s = Source {
            region: RegionId(0x0102_0304),
            offset: 0x1122_3344_5566_7788,
        };
        let b = s.encode();
        assert_eq!(b.len(), SOURCE_LEN);
        assert_eq!(Source::decode(&b), Some(s));
        let mut bad = b;
        bad[5] = 1;
        assert_eq!(Source::decode(&bad), None, "reserved bytes must be zero");

        assert_eq!(decode_ack(&encode_ack(3)), Some(3));
        assert_eq!(decode_ack(&encode_ack(u32::MAX)), Some(u32::MAX));
        assert_eq!(decode_ack(&encode_ack(0)), None, "acknowledges nothing");
        // A frame's first bytes are no acknowledgement.
        let frame = kvpipe_core::wire::Frame::Heartbeat(kvpipe_core::wire::Heartbeat { seq: 1 })
            .to_vec()
            .unwrap();
        let head: [u8; ACK_LEN] = frame[..ACK_LEN].try_into().unwrap();
        assert_eq!(decode_ack(&head), None);
        assert_ne!(ACK_MAGIC, kvpipe_core::wire::MAGIC);
    }

    #[test]
    fn sources_outside_the_exported_region_are_not_located() {
        let m = PeerMappings::fake([(
            RegionId(4),
            PlacedRegion {
                ordinal: 1,
                ptr: 0x1000,
                len: 256,
            },
        )]);
        let at = |region, offset| Source {
            region: RegionId(region),
            offset,
        };
        assert_eq!(m.locate(at(4, 16), 240), Some((1, 0x1010)));
        assert_eq!(m.locate(at(4, 16), 241), None);
        assert_eq!(m.locate(at(4, u64::MAX), 2), None);
        assert_eq!(m.locate(at(5, 0), 1), None);
    }

    #[test]
    fn a_declined_offer_is_not_accepted_and_says_why() {
        let regions = RegionTable::new();
        let why = accept(&Offer::Declined("no device".into()), &regions).unwrap_err();
        assert!(why.contains("no device"), "{why}");
        let why = accept(&Offer::Regions(vec![]), &regions).unwrap_err();
        assert!(why.contains("no region"), "{why}");
    }

    #[test]
    fn host_memory_on_either_side_falls_back() {
        let mut host = RegionTable::new();
        host.insert(RegionId(3), MemoryRegion::zeroed(16));
        // A sender declines to export host memory, or any region with the socket path.
        for (path, want) in [
            (TcpDataPath::Auto, "host memory"),
            (TcpDataPath::PeerCopy, "host memory"),
            (TcpDataPath::Socket, "socket data path"),
        ] {
            match local_offer(path, &host) {
                Offer::Declined(why) => assert!(why.contains(want), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        // A receiver with host memory (or no receiver, or the socket path) cannot pull.
        assert!(can_pull(TcpDataPath::Auto, true, &host).is_err());
        assert!(can_pull(TcpDataPath::Auto, false, &host).is_err());
        assert!(can_pull(TcpDataPath::Socket, true, &host).is_err());
        let why = accept(&Offer::Regions(vec![entry(1)]), &host).unwrap_err();
        assert!(why.contains("host memory"), "{why}");
    }
}
