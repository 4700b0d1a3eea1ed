//! Peer copies: data writes moved device → device between two processes on one host, the
//! receiver **pulling** each write from the sender's memory itself (`cuda` feature). Control
//! frames and the data-write headers still travel on the TCP connections.
//!
//! This module holds the offer, the answer and the records on the wire; the node carries the
//! negotiation out (`node/offers.rs`, `TcpIo::data_path`) and a link's placement is in
//! `crate::placement`; the device half (exporting and opening regions, the copies) is in
//! `crate::gpu`, with the rest of the GPU path.
//!
//! ## Negotiation (inside the core's handshake)
//!
//! The offer and the answer travel in the core's versioned handshake, as the opaque data-path
//! sections of `Hello` and `HelloAccept` (`docs/PROTOCOL.md`, "Data-path offers"); the core
//! holds the receiver's `HelloAccept` until this transport answered.
//!
//! 1. A connecting **sender** whose [`TcpDataPath`] is not `Socket` connects its bundle with
//!    `TransportInput::PeerConnectedWithOffer`, the offer in its `Hello`: when every one of
//!    its registered regions is device memory, each region exported with CUDA IPC
//!    (`kvpipe_cuda::export_ipc`); otherwise a decline that says why (on `PeerCopy` the
//!    connect fails before connecting instead).
//! 2. The accepting node's core checks the `Hello` as any other, then asks this transport
//!    (`DataPathNegotiation::Offered`). On a thread of its own, outside the node's lock, the
//!    node — when its data path is not `Socket`, it is a receiver and its own regions are all
//!    device memory — opens every offered handle on its own GPU (`kvpipe_cuda::IpcMapping`,
//!    lazy peer access), places the link (pull, or the sockets) and answers accepted, or
//!    declined with the reason (`TransportInput::DataPathAnswered`); its `HelloAccept` carries
//!    the answer, and the peer is ready on this side from then on.
//! 3. The sender's core reports the answer (`DataPathNegotiation::Answered`) just before
//!    `PeerReady`; the node places the link then. Its `connect` returns once the link is
//!    placed.
//!
//! A declined offer leaves the peer on the socket data path (`Auto`), or fails the connect
//! with the reason (`PeerCopy`; a receiver on `PeerCopy` answers, then closes a connection it
//! cannot pull from). "Same host" is decided by the import itself: a handle opens only on the
//! host (and for the user) that exported it, so a peer on another host falls back (or fails).
//! Every data write of the peer is planned after `PeerReady` and read after the receiver's
//! `HelloAccept`, so every connection of the bundle knows the placement before one flows.
//!
//! | bytes | offer (the `Hello`'s data-path section) |
//! |---|---|
//! | 4 | magic `b"KVPC"` |
//! | 1 | version (2) |
//! | 1 | 1: offered, 0: declined |
//! | 2 | `n` (u16 LE): regions offered (at most [`MAX_OFFER_REGIONS`]), or bytes of the reason |
//! | `n` × 88 | offered: region id (u32 LE), the exporter's GPU (u32 LE), the IPC handle (80 bytes, `kvpipe_cuda::IpcHandle::to_bytes`) |
//! | `n` | declined: the reason, UTF-8 |
//!
//! | bytes | answer (the `HelloAccept`'s data-path section) |
//! |---|---|
//! | 4 | magic `b"KVPA"` |
//! | 1 | version (2) |
//! | 1 | 1: accepted, 0: declined |
//! | 2 | `n` (u16 LE): bytes of the reason (0 when accepted) |
//! | `n` | the reason, UTF-8 |
//!
//! An answer that is no such record (an empty one: the peer's transport takes no offers) is a
//! decline. Version 1 (the sender copied into memory the receiver exported) is not spoken any
//! more: a version-1 record is declined, naming both versions.
//!
//! ## The data path
//!
//! The core's sessions are unchanged: the sender's endpoint plans writes from the receiver's
//! registration (its grant) exactly as for the socket path, and the receiver's endpoint admits
//! every write (`Receiver::admit_write`). On a peer-copy connection:
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

use kvpipe_core::wire::MAX_DATA_PATH_LEN;
use kvpipe_core::RegionId;

pub(crate) use crate::config::TcpDataPath;
use crate::gpu::{self, IpcMappings};
pub(crate) use crate::gpu::{OfferEntry, PlacedRegion, HANDLE_LEN};
use crate::memory::{RegionTable, Registered};

/// Bytes of an offer's or an answer's head.
const HEAD_LEN: usize = 8;
/// Bytes of one offered region.
const ENTRY_LEN: usize = 8 + HANDLE_LEN;
/// Most regions one offer lists: as many as the `Hello`'s data-path section holds.
pub(crate) const MAX_OFFER_REGIONS: usize = (MAX_DATA_PATH_LEN - HEAD_LEN) / ENTRY_LEN;
/// Most bytes of a reason.
const MAX_REASON: usize = 1024;
const OFFER_MAGIC: [u8; 4] = *b"KVPC";
const ANSWER_MAGIC: [u8; 4] = *b"KVPA";
/// Version of the offer and answer records, and of the source and acknowledgement records.
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
    /// Its regions, exported (at most [`MAX_OFFER_REGIONS`]).
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

/// The head of a record: magic, version, status, and the count or length after it.
fn head(magic: [u8; 4], status: bool, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD_LEN);
    out.extend(magic);
    out.push(VERSION);
    out.push(u8::from(status));
    out.extend((n as u16).to_le_bytes());
    out
}

impl Offer {
    /// The offer's bytes (a `Hello`'s data-path section). An offer of more than
    /// [`MAX_OFFER_REGIONS`] is never made ([`local_offer`] declines it).
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Offer::Regions(entries) => {
                let n = entries.len().min(MAX_OFFER_REGIONS);
                let mut out = head(OFFER_MAGIC, true, n);
                for e in &entries[..n] {
                    out.extend(e.region.0.to_le_bytes());
                    out.extend(e.ordinal.to_le_bytes());
                    out.extend(e.handle);
                }
                out
            }
            Offer::Declined(reason) => {
                let reason = short_reason(reason);
                let mut out = head(OFFER_MAGIC, false, reason.len());
                out.extend(reason);
                out
            }
        }
    }

    /// Decodes an offer; `Err`: why it is none this node takes.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Offer, String> {
        let (offered, n, body) = check_head(bytes, OFFER_MAGIC, "offer")?;
        if !offered {
            if n > MAX_REASON || body.len() != n {
                return Err(format!("a malformed peer-copy decline ({n} bytes said)"));
            }
            return Ok(Offer::Declined(String::from_utf8_lossy(body).into_owned()));
        }
        if n > MAX_OFFER_REGIONS {
            return Err(format!(
                "a peer-copy offer of {n} regions (at most {MAX_OFFER_REGIONS})"
            ));
        }
        if body.len() != n * ENTRY_LEN {
            return Err(format!(
                "a peer-copy offer of {n} regions in {} bytes (not whole {ENTRY_LEN}-byte entries)",
                body.len()
            ));
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
}

/// Checks a record's head (magic, version, status byte): whether its status is set, its count
/// or length, and the bytes after the head. A peer speaking another version is named as such.
fn check_head<'a>(
    bytes: &'a [u8],
    magic: [u8; 4],
    what: &str,
) -> Result<(bool, usize, &'a [u8]), String> {
    let Some((h, body)) = bytes.split_first_chunk::<HEAD_LEN>() else {
        return Err(format!("not a peer-copy {what} ({} bytes)", bytes.len()));
    };
    if h[..4] != magic || h[5] > 1 {
        return Err(format!("not a peer-copy {what} (header {h:02x?})"));
    }
    if h[4] != VERSION {
        return Err(format!(
            "a peer-copy {what} of version {} (this node speaks version {VERSION}: upgrade \
             both sides together, or use the socket data path)",
            h[4]
        ));
    }
    Ok((
        h[5] == 1,
        usize::from(u16::from_le_bytes([h[6], h[7]])),
        body,
    ))
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
    /// The answer's bytes (a `HelloAccept`'s data-path section).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let reason: &[u8] = match self {
            Answer::Accepted => &[],
            Answer::Declined(why) => short_reason(why),
        };
        let mut out = head(ANSWER_MAGIC, matches!(self, Answer::Accepted), reason.len());
        out.extend(reason);
        out
    }

    /// Decodes an answer; one that is no answer of this version is a decline saying so.
    pub(crate) fn decode(bytes: &[u8]) -> Answer {
        match check_head(bytes, ANSWER_MAGIC, "answer") {
            Ok((true, 0, [])) => Answer::Accepted,
            Ok((false, n, reason)) if n <= MAX_REASON && reason.len() == n => {
                Answer::Declined(String::from_utf8_lossy(reason).into_owned())
            }
            Ok(_) => Answer::Declined(format!("a malformed peer-copy answer ({bytes:02x?})")),
            Err(why) => Answer::Declined(why),
        }
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
    let count = regions.entries().count();
    if count > MAX_OFFER_REGIONS {
        return Offer::Declined(format!(
            "the sender has {count} regions, more than an offer lists ({MAX_OFFER_REGIONS})"
        ));
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

/// The accepting node's evaluation of a peer's offer (the bytes of its `Hello`'s data-path
/// section): the sender's regions opened here, or why this node does not pull from them.
pub(crate) fn evaluate(
    offer: &[u8],
    path: TcpDataPath,
    is_receiver: bool,
    regions: &RegionTable,
) -> Result<PeerMappings, String> {
    can_pull(path, is_receiver, regions)?;
    accept(&Offer::decode(offer)?, regions)
}

/// Whether the peer pulls a sender's data writes once it answered its `offer` (`answer`: the
/// data-path section of the peer's `HelloAccept`; `None`: it carried none): `Ok` makes the
/// link the source of pulled copies; `Err` says why there are no peer copies.
pub(crate) fn peer_pulls(answer: Option<&[u8]>, offer: &Offer) -> Result<(), String> {
    let answer = answer.map_or_else(
        || Answer::Declined("the peer's transport answered no peer-copy offer".into()),
        Answer::decode,
    );
    match (answer, offer) {
        (Answer::Accepted, Offer::Regions(_)) => Ok(()),
        (Answer::Accepted, Offer::Declined(_)) => {
            Err("the peer accepted a declined peer-copy offer".into())
        }
        (Answer::Declined(why), _) => Err(why),
    }
}

#[cfg(test)]
mod tests;
