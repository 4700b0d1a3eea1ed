//! Peer copies: data writes placed in the receiver's device memory by the sender itself, with
//! control frames still on the TCP connections (`cuda` feature; two processes on one host).
//!
//! ## Negotiation (before the handshake, on the control connection)
//!
//! 1. A connecting **sender** whose [`TcpDataPath`] is not `Socket` sets
//!    [`PREAMBLE_PEER_COPY`](crate::preamble::PREAMBLE_PEER_COPY) in its control connection's
//!    preamble.
//! 2. The accepting node answers at once with an **offer**: a receiver whose data path is not
//!    `Socket` and whose every registered region is device memory exports each region with
//!    CUDA IPC (`kvpipe_cuda::export_ipc`) and lists them; any other node declines, saying why.
//! 3. The sender imports every handle on its own GPU (`kvpipe_cuda::IpcMapping`, opened with
//!    lazy peer access) — only when its own regions are all device memory too — and answers
//!    **accepted** or **declined**. Then the `Hello` follows as on any connection.
//!
//! A declined offer leaves the peer on the socket data path (`Auto`), or fails the connect
//! with the reason (`PeerCopy`). "Same host" is decided by the import itself: a handle opens
//! only on the host (and for the user) that exported it, so a peer on another host falls
//! back (or fails, with `PeerCopy`).
//!
//! | bytes | offer (accepting node → sender) |
//! |---|---|
//! | 4 | magic `b"KVPC"` |
//! | 1 | version (1) |
//! | 1 | 1: offered, 0: declined |
//! | 2 | `n` (u16 LE): regions offered, or bytes of the reason |
//! | `n` × 88 | offered: region id (u32 LE), the exporter's GPU (u32 LE), the IPC handle (80 bytes, `kvpipe_cuda::IpcHandle::to_bytes`) |
//! | `n` | declined: the reason, UTF-8 |
//!
//! | bytes | answer (sender → accepting node) |
//! |---|---|
//! | 4 | magic `b"KVPA"` |
//! | 1 | version (1) |
//! | 1 | 1: accepted, 0: declined |
//! | 2 | 0 |
//!
//! ## The data path
//!
//! The core is unchanged: the sender's endpoint plans writes from the receiver's registration
//! (its grant) exactly as for the socket path, and the receiver's endpoint admits every write
//! (`Receiver::admit_write`). Only where the payload travels differs:
//!
//! - the sender's writer copies each piece device → device into the imported region (the copy
//!   engine, on the sender GPU's stream; the handles are opened on the sender's GPU with lazy
//!   peer access, so pools of a receiver on another GPU are written through peer access over
//!   NVLink or PCIe), refusing a piece that
//!   leaves the imported region, waits for the copy (bounded), and only then writes the
//!   piece's `DataWrite` header — with no payload — on the socket;
//! - the receiver's reader takes the header, asks the core's admission as for any write, and
//!   reports the write landed at once (the payload is already in place: the admitted length
//!   is handed to the stream reader as an empty payload).
//!
//! So results still wait for their data (a header is sent only after its bytes landed, and
//! the receiver holds results until the headers before them were admitted and landed). The
//! difference to the socket path is the trust model: with the handles the sending process can
//! write anywhere in the exported pools, like an RDMA peer with a memory key. The receiver's
//! admission still checks every write against the request's grant and fails the request and
//! the peer on a write outside it, but it learns of the write after the bytes moved. Exported
//! memory is the registered pools only.
//!
//! ## Failures
//!
//! A writer that stops (a closed or failed connection, a cancel that tears the peer down)
//! waits for every copy it issued (bounded by the staging wait) before it reports its batch
//! parts or its end, so the sender's `Quiesced` — and the receiver's, which needs the writer's
//! connection gone — never comes while one of its copies may still write. A copy still running
//! after that wait (60 s: a GPU that stopped answering) is given up like a staging copy: its
//! engine and ticket are kept alive for good and the writer reports its end. When
//! the prefill **process** dies mid-copy the driver destroys its contexts, which ends its
//! copies; the receiver sees the connections close and fails the requests; the bytes of the
//! cut-short writes are partial, and the requests are failed, never completed.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use kvpipe_core::RegionId;

use crate::memory::RegionTable;
#[cfg(feature = "cuda")]
use crate::memory::Registered;

/// How a node's data writes reach the peer's memory ([`TcpConfig::data_path`](crate::TcpConfig::data_path)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TcpDataPath {
    /// Over the sockets (payload after each `DataWrite` header). The default.
    #[default]
    Socket,
    /// Peer copies when both sides' regions are device memory and the receiver's CUDA IPC
    /// handles open here (same host); otherwise the socket path, without an error.
    Auto,
    /// Peer copies or nothing: a connecting sender fails `connect` with the reason when the
    /// peer declines or a handle does not open; a receiver whose regions cannot be exported
    /// fails `listen` with the reason, and drops a connection whose sender declines its offer.
    PeerCopy,
}

/// Bytes of an encoded IPC handle (`kvpipe_cuda::IPC_HANDLE_LEN`).
pub(crate) const HANDLE_LEN: usize = 80;
/// Bytes of one offered region.
const ENTRY_LEN: usize = 8 + HANDLE_LEN;
/// Most regions one offer lists.
pub(crate) const MAX_OFFER_REGIONS: usize = 4096;
const OFFER_MAGIC: [u8; 4] = *b"KVPC";
const ANSWER_MAGIC: [u8; 4] = *b"KVPA";
const VERSION: u8 = 1;

/// One exported region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OfferEntry {
    pub(crate) region: RegionId,
    /// The exporter's GPU (informational).
    pub(crate) ordinal: u32,
    pub(crate) handle: [u8; HANDLE_LEN],
}

/// What the accepting node offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Offer {
    /// Its regions, exported.
    Regions(Vec<OfferEntry>),
    /// No peer copies, and why.
    Declined(String),
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
                let mut end = reason.len().min(1024);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.push(0);
                out.extend((end as u16).to_le_bytes());
                out.extend(&reason.as_bytes()[..end]);
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
        if head[..4] != OFFER_MAGIC || head[4] != VERSION || head[5] > 1 {
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

/// The sender's answer: 8 bytes.
pub(crate) fn encode_answer(accepted: bool) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&ANSWER_MAGIC);
    out[4] = VERSION;
    out[5] = u8::from(accepted);
    out
}

/// Reads the sender's answer by `deadline`: whether it accepted.
pub(crate) fn read_answer(stream: &TcpStream, deadline: Instant) -> io::Result<bool> {
    let mut b = [0u8; 8];
    read_by(stream, &mut b, deadline)?;
    decode_answer(&b)
}

fn decode_answer(b: &[u8; 8]) -> io::Result<bool> {
    if b[..4] != ANSWER_MAGIC || b[4] != VERSION || b[5] > 1 || b[6] != 0 || b[7] != 0 {
        return Err(invalid(format!("not a peer-copy answer ({b:02x?})")));
    }
    Ok(b[5] == 1)
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

/// A region of the peer, opened in this process: the device address of its first byte on
/// GPU `ordinal`, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlacedRegion {
    pub(crate) ordinal: usize,
    pub(crate) ptr: u64,
    pub(crate) len: u64,
}

/// The peer's regions opened in this process (a sender's view of an accepted offer). The IPC
/// mappings close when the last clone of the link's `Arc` is gone — after every writer that
/// copies into them stopped.
#[derive(Debug, Default)]
pub(crate) struct PeerMappings {
    regions: HashMap<RegionId, PlacedRegion>,
    #[cfg(feature = "cuda")]
    _mappings: Vec<kvpipe_cuda::IpcMapping>,
}

impl PeerMappings {
    /// The opened region `id`.
    pub(crate) fn get(&self, id: RegionId) -> Option<PlacedRegion> {
        self.regions.get(&id).copied()
    }

    /// Mappings over given addresses (tests: no driver).
    #[cfg(test)]
    pub(crate) fn fake(regions: impl IntoIterator<Item = (RegionId, PlacedRegion)>) -> Self {
        PeerMappings {
            regions: regions.into_iter().collect(),
            #[cfg(feature = "cuda")]
            _mappings: Vec::new(),
        }
    }
}

/// How a peer's data writes travel, decided when its bundle connected.
#[derive(Clone, Debug, Default)]
pub(crate) enum Placement {
    /// Over the sockets.
    #[default]
    Socket,
    /// (Receiver) the peer places them itself; headers arrive without payload.
    Receive,
    /// (Sender) this node places them in these opened regions.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Send(std::sync::Arc<PeerMappings>),
}

impl Placement {
    /// The peer's opened regions when this node places its writes there itself.
    pub(crate) fn sent(&self) -> Option<&PeerMappings> {
        match self {
            Placement::Send(m) => Some(m),
            _ => None,
        }
    }
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

/// The offer of an accepting node whose data path is `path`: every region exported, or why
/// not.
pub(crate) fn local_offer(path: TcpDataPath, is_receiver: bool, regions: &RegionTable) -> Offer {
    if path == TcpDataPath::Socket {
        return Offer::Declined("the accepting node uses the socket data path".into());
    }
    if !is_receiver {
        return Offer::Declined("the accepting node is not a receiver".into());
    }
    if let Err(why) = device_only(regions) {
        return Offer::Declined(format!("the receiver cannot export: {why}"));
    }
    match export(regions) {
        Ok(entries) => Offer::Regions(entries),
        Err(why) => Offer::Declined(format!("the receiver cannot export: {why}")),
    }
}

#[cfg(feature = "cuda")]
fn export(regions: &RegionTable) -> Result<Vec<OfferEntry>, String> {
    let mut out = Vec::new();
    for (id, r) in regions.entries() {
        let Registered::Device(d) = r else {
            return Err(format!("{id} is host memory"));
        };
        let device = kvpipe_cuda::Device::open(d.ordinal()).map_err(|e| e.to_string())?;
        let handle = kvpipe_cuda::export_ipc(&device, d.ptr(), d.len() as u64)
            .map_err(|e| format!("{id}: {e}"))?;
        out.push(OfferEntry {
            region: id,
            ordinal: d.ordinal() as u32,
            handle: handle.to_bytes(),
        });
    }
    out.sort_by_key(|e| e.region.0);
    Ok(out)
}

#[cfg(not(feature = "cuda"))]
fn export(_regions: &RegionTable) -> Result<Vec<OfferEntry>, String> {
    Err("kvpipe-tcp was built without the `cuda` feature".into())
}

/// The sender's side: opens every offered region on the GPU of its own regions. `Err`: why
/// the offer cannot be accepted.
pub(crate) fn accept(offer: &Offer, regions: &RegionTable) -> Result<PeerMappings, String> {
    let entries = match offer {
        Offer::Declined(why) => return Err(format!("the peer declined: {why}")),
        Offer::Regions(e) if e.is_empty() => return Err("the peer offered no region".into()),
        Offer::Regions(e) => e,
    };
    device_only(regions).map_err(|why| format!("this node cannot copy: {why}"))?;
    import(entries, regions)
}

#[cfg(feature = "cuda")]
fn import(entries: &[OfferEntry], regions: &RegionTable) -> Result<PeerMappings, String> {
    let ordinal = regions
        .entries()
        .find_map(|(_, r)| match r {
            Registered::Device(d) => Some(d.ordinal()),
            Registered::Host(_) => None,
        })
        .unwrap_or(0);
    let device = kvpipe_cuda::Device::open(ordinal).map_err(|e| e.to_string())?;
    let mut mappings = Vec::with_capacity(entries.len());
    let mut placed = HashMap::with_capacity(entries.len());
    for e in entries {
        let handle = kvpipe_cuda::IpcHandle::from_bytes(&e.handle).map_err(|x| x.to_string())?;
        let mapping = kvpipe_cuda::IpcMapping::open(&device, &handle).map_err(|x| {
            format!(
                "{} (GPU {} of the peer) does not open here (another host, or the same \
                 process?): {x}",
                e.region, e.ordinal
            )
        })?;
        placed.insert(
            e.region,
            PlacedRegion {
                ordinal: mapping.ordinal(),
                ptr: mapping.ptr(),
                len: mapping.len(),
            },
        );
        mappings.push(mapping);
    }
    Ok(PeerMappings {
        regions: placed,
        _mappings: mappings,
    })
}

#[cfg(not(feature = "cuda"))]
fn import(_entries: &[OfferEntry], _regions: &RegionTable) -> Result<PeerMappings, String> {
    Err("kvpipe-tcp was built without the `cuda` feature".into())
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
        assert_eq!(Offer::decode(&bytes).unwrap(), offer);
        let no = Offer::Declined("the receiver cannot export: r1 is host memory".into());
        assert_eq!(Offer::decode(&no.encode()).unwrap(), no);
        assert!(decode_answer(&encode_answer(true)).unwrap());
        assert!(!decode_answer(&encode_answer(false)).unwrap());
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
        let mut a = encode_answer(true);
        a[6] = 1;
        assert!(decode_answer(&a).is_err());
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
        // The receiver declines to export host memory, or any region with the socket path.
        for (path, want) in [
            (TcpDataPath::Auto, "host memory"),
            (TcpDataPath::PeerCopy, "host memory"),
            (TcpDataPath::Socket, "socket data path"),
        ] {
            match local_offer(path, true, &host) {
                Offer::Declined(why) => assert!(why.contains(want), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            local_offer(TcpDataPath::Auto, false, &host),
            Offer::Declined(_)
        ));
        // A sender with host memory declines an offer.
        let why = accept(&Offer::Regions(vec![entry(1)]), &host).unwrap_err();
        assert!(why.contains("host memory"), "{why}");
    }
}
