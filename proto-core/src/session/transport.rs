//! The transport contract as types: what a transport reports to an endpoint
//! ([`TransportInput`]), the question a receiving transport asks before it applies a data write
//! ([`Endpoint::admit_write`] → [`Admission`]), how a transport declares where its writes land
//! ([`DataPath`]), and the one trait both endpoints implement ([`Endpoint`]), so a driver is
//! written once for both roles. `docs/TRANSPORT.md` is the same contract in prose.

use bytes::Bytes;
use thiserror::Error;

use super::{Counters, Output, UsageError};
use crate::ids::{GrantId, PeerId, RegionId, RequestId};
use crate::time::Instant;
use crate::wire::{DataWrite, Frame, FrameKind, Role, DATA_WRITE_FRAME_LEN};

/// What a transport reports to an endpoint. The same for both roles; the role-specific ones
/// are refused with [`UsageError::WrongRole`] by the other role.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum TransportInput {
    /// A connection to `peer` is up (either direction); the endpoint starts the handshake.
    PeerConnected {
        /// The new peer.
        peer: PeerId,
    },
    /// A connection to `peer` is up, as [`PeerConnected`](Self::PeerConnected), and this
    /// endpoint offers the transport's own data path on it: `offer` (at most
    /// [`MAX_DATA_PATH_LEN`](crate::wire::MAX_DATA_PATH_LEN) bytes, opaque to the core) travels
    /// in its `Hello`. The handshake completes only once the peer's `HelloAccept` came back;
    /// the peer's answer is then reported ([`DataPathNegotiation::Answered`]) just before
    /// [`Event::PeerReady`](super::Event::PeerReady).
    PeerConnectedWithOffer {
        /// The new peer.
        peer: PeerId,
        /// The offer.
        #[cfg_attr(feature = "arbitrary", arbitrary(with = arbitrary_bytes))]
        offer: Bytes,
    },
    /// The transport's answer to `peer`'s data-path offer
    /// ([`DataPathNegotiation::Offered`]), at most
    /// [`MAX_DATA_PATH_LEN`](crate::wire::MAX_DATA_PATH_LEN) bytes, opaque to the core: it goes
    /// back in this endpoint's `HelloAccept`, and the peer is ready from then on. An empty answer
    /// declines in any transport's format. Refused ([`UsageError::NoOfferPending`]) unless the
    /// peer's handshake waits for it.
    DataPathAnswered {
        /// The offering peer.
        peer: PeerId,
        /// The answer.
        #[cfg_attr(feature = "arbitrary", arbitrary(with = arbitrary_bytes))]
        answer: Bytes,
    },
    /// `peer` is gone (closed, lost or fenced). The transport promises that no write of that
    /// connection can still touch memory on this side: no batch towards it still reads source
    /// memory (sender), no admitted write from it is still being applied (receiver).
    PeerDisconnected {
        /// The peer.
        peer: PeerId,
    },
    /// One whole encoded frame from `peer` (header and body), in the order `peer` sent it.
    /// The endpoint decodes it at the version it negotiated with `peer`.
    FrameReceived {
        /// The sending peer.
        peer: PeerId,
        /// The frame's bytes.
        #[cfg_attr(feature = "arbitrary", arbitrary(with = arbitrary_bytes))]
        bytes: Bytes,
    },
    /// (Sender) every write of `batch` completed: the transport no longer reads its source
    /// memory, and every byte is on its way to the receiver ahead of any later frame
    /// ([`DataPath`] says how the receiver learns it landed).
    WritesCompleted {
        /// The batch from [`Output::ExecuteWrites`].
        batch: super::WriteBatchId,
    },
    /// (Sender) a write of `batch` failed; no write of the batch is still in flight.
    WritesFailed {
        /// The batch from [`Output::ExecuteWrites`].
        batch: super::WriteBatchId,
        /// Why ([`TransferStatus::WriteFailed`](crate::wire::TransferStatus), …; never
        /// `Success`).
        status: crate::wire::TransferStatus,
    },
    /// (Receiver) the header of a data write from `peer` arrived, decoded (a stream transport's
    /// [`StreamReader`](crate::stream::StreamReader) decodes it once; an in-process transport
    /// takes it from [`DataWriteHeaders::frame`]); the payload follows.
    /// [`Endpoint::admit_write`] is this input with its answer.
    WriteArrived {
        /// The writing peer.
        peer: PeerId,
        /// The data write's header.
        header: DataWrite,
    },
    /// (Receiver) an admitted write is over: all of its bytes landed (`landed`), or the
    /// transport gave up part way (the connection failed; `landed == false`).
    WriteFinished {
        /// The ticket from [`Admission::Apply`].
        ticket: WriteTicket,
        /// Whether every byte of the write is in memory.
        landed: bool,
    },
    /// (Receiver) payload bytes of an admitted write from `peer` are still arriving on the
    /// stream that carries `peer`'s frames: the peer is alive though no whole frame came from
    /// it lately. A write whose payload takes longer than
    /// [`Deadlines::liveness_timeout`](super::Deadlines) (a large write on a slow link, with
    /// the peer's heartbeats queued behind it) would otherwise end the peer while its bytes
    /// flow. A transport whose frames can wait behind payload (TCP's first connection) reports
    /// it while such payload arrives, at most every so often and well within the liveness
    /// timeout; payload on other streams holds no frame back and is not reported.
    DataArriving {
        /// The writing peer.
        peer: PeerId,
    },
    /// The deadline from `poll_timeout` passed (early delivery is harmless).
    Timeout,
}

#[cfg(feature = "arbitrary")]
fn arbitrary_bytes(u: &mut arbitrary::Unstructured<'_>) -> arbitrary::Result<Bytes> {
    Ok(Bytes::from(<Vec<u8> as arbitrary::Arbitrary>::arbitrary(
        u,
    )?))
}

/// The data-path negotiation, as the endpoint reports it to its transport
/// ([`Output::DataPath`]): never for the engine. See `docs/TRANSPORT.md`, "Data-path offers".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataPathNegotiation {
    /// `peer`'s `Hello` carries a data-path offer. Its handshake waits (within the handshake
    /// deadline) until the transport answers with [`TransportInput::DataPathAnswered`].
    Offered {
        /// The offering peer.
        peer: PeerId,
        /// The offer, as the peer's transport made it.
        offer: Bytes,
    },
    /// The handshake with `peer`, to whom this endpoint offered a data path
    /// ([`TransportInput::PeerConnectedWithOffer`]), completed: `answer` is what the peer's
    /// transport answered (`None`: its `HelloAccept` carried no answer). Reported just before
    /// [`Event::PeerReady`](super::Event::PeerReady), so the transport knows the placement
    /// before the endpoint plans any write to the peer.
    Answered {
        /// The peer.
        peer: PeerId,
        /// The peer's answer.
        answer: Option<Bytes>,
    },
}

/// Identifies one admitted data write until the transport reports it finished. Unique per
/// receiver endpoint, never reused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct WriteTicket(pub u64);

impl core::fmt::Display for WriteTicket {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "write#{}", self.0)
    }
}

/// The receiver's answer to an incoming data write.
#[must_use = "the transport must apply, discard or refuse the payload as told"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Copy the `len` payload bytes into `region` at `offset`, then report
    /// [`TransportInput::WriteFinished`] with `ticket`. Until then the request's memory stays
    /// pinned, and no other admitted write overlaps these bytes (so the transport may form
    /// one `&mut [u8]` over them).
    Apply {
        /// Report the write's end with this.
        ticket: WriteTicket,
        /// Destination region.
        region: RegionId,
        /// Destination offset.
        offset: u64,
        /// Payload length.
        len: u64,
    },
    /// The request already ended: read and drop the `len` payload bytes; nothing to report.
    Discard {
        /// Payload length.
        len: u64,
    },
    /// Refused and never to be applied: stop reading from this connection (the payload is not
    /// read). The endpoint has already failed the request it named (if it is the peer's) and
    /// asked to close the peer ([`Output::ClosePeer`]).
    Refuse(WriteRefusal),
}

/// Why an incoming data write was refused. (A header that does not decode never reaches
/// admission: the stream reader refuses it as bytes that are no frame.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
pub enum WriteRefusal {
    /// This endpoint never accepts data writes (a sender), or takes none through admission
    /// (a [`DataPath::Ordered`] receiver).
    #[error("this endpoint does not accept data writes")]
    NotAccepted,
    /// The peer's handshake has not completed (or the peer is closing).
    #[error("data write from {0} before its handshake completed or after it was closed")]
    PeerNotReady(PeerId),
    /// No registration for the request.
    #[error("data write for {0}, which has no registration")]
    UnknownRequest(RequestId),
    /// The write carries another grant than the registration's.
    #[error("data write for {request} carries {got}, not the registration's grant")]
    WrongGrant {
        /// The request.
        request: RequestId,
        /// The grant carried.
        got: GrantId,
    },
    /// The write comes from a peer that did not get the registration.
    #[error("data write for {request} from {peer}, which is not one of its writers")]
    NotAWriter {
        /// The request.
        request: RequestId,
        /// The peer.
        peer: PeerId,
    },
    /// The destination lies outside the extents granted to the request.
    #[error("data write for {request} to {region} [{offset}, +{len}) lies outside its grant")]
    OutsideGrant {
        /// The request.
        request: RequestId,
        /// Destination region.
        region: RegionId,
        /// Destination offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// The destination overlaps another write that is still being applied, or bytes of the
    /// request that already landed (no byte lands twice).
    #[error(
        "data write for {request} to {region} [{offset}, +{len}) overlaps a write in flight or \
         bytes that already landed"
    )]
    Overlap {
        /// The request.
        request: RequestId,
        /// Destination region.
        region: RegionId,
        /// Destination offset.
        offset: u64,
        /// Length.
        len: u64,
    },
}

/// Where a transport's data writes land, which decides when the receiver may trust a result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DataPath {
    /// The receiving transport applies every data write itself (byte streams, in-process
    /// copies): it asks [`Endpoint::admit_write`] before applying one and reports
    /// [`TransportInput::WriteFinished`] after. A writer's results are held until the bytes
    /// they report have landed (data and results may travel on different connections).
    #[default]
    Landed,
    /// The fabric places a writer's data before any frame the writer sends later (RDMA RC:
    /// a WRITE is placed before a later SEND on the same queue pair). No admission, no landing
    /// reports; results are trusted on arrival. Only the registered memory is exposed to the
    /// peer (the transport's own protection, e.g. memory keys).
    Ordered,
}

/// Encodes the `DataWrite` headers of one write batch at the version negotiated with its
/// receiver, for stream transports (the transport never learns the version).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataWriteHeaders {
    pub(crate) version: u16,
    pub(crate) request: RequestId,
    pub(crate) grant: GrantId,
}

impl DataWriteHeaders {
    /// The data write header for `len` bytes to `region` at `offset` (what an in-process
    /// transport hands to [`Endpoint::admit_write`]).
    pub fn frame(&self, region: RegionId, offset: u64, len: u64) -> DataWrite {
        DataWrite {
            request: self.request,
            grant: self.grant,
            region,
            offset,
            len,
        }
    }

    /// The encoded data write header for `len` bytes to `region` at `offset` (what a stream
    /// transport sends ahead of the payload).
    pub fn encode(&self, region: RegionId, offset: u64, len: u64) -> [u8; DATA_WRITE_FRAME_LEN] {
        let mut out = [0u8; DATA_WRITE_FRAME_LEN];
        let frame = Frame::DataWrite(self.frame(region, offset, len));
        // The version was negotiated with this build and a DataWrite has a fixed size: this
        // cannot fail.
        let n = frame
            .emit_versioned(self.version, &mut out)
            .unwrap_or_default();
        debug_assert_eq!(n, DATA_WRITE_FRAME_LEN);
        out
    }

    /// The request the batch belongs to.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The grant the writes carry.
    pub fn grant(&self) -> GrantId {
        self.grant
    }
}

/// Whether a frame header announces a data write (stream transports read its payload next).
pub fn is_data_write(header: &crate::wire::FrameHeader) -> bool {
    header.kind == FrameKind::DataWrite.code()
}

/// What a transport needs from an endpoint: the same run loop for a [`Sender`](super::Sender)
/// and a [`Receiver`](super::Receiver).
///
/// A driver feeds [`TransportInput`]s with [`handle_transport`](Self::handle_transport),
/// asks [`admit_write`](Self::admit_write) before applying an incoming data write, then drains
/// [`poll_output`](Self::poll_output) until `None` and arms a timer for
/// [`poll_timeout`](Self::poll_timeout). Engine commands (open, chunk, register, cancel,
/// retire) go to the role's own methods.
pub trait Endpoint {
    /// Sender or receiver.
    fn role(&self) -> Role;

    /// Applies what the transport saw. A [`UsageError`] is a driver bug (an unknown peer, a
    /// batch reported twice, an input for the other role); nothing changed.
    fn handle_transport(&mut self, now: Instant, input: TransportInput) -> Result<(), UsageError>;

    /// Asks whether the data write whose decoded header is `header` may be applied (see
    /// [`Admission`]). Records it as [`TransportInput::WriteArrived`].
    fn admit_write(&mut self, now: Instant, peer: PeerId, header: &DataWrite) -> Admission;

    /// The next output, or `None` when there is nothing to do until the next input.
    fn poll_output(&mut self) -> Option<Output>;

    /// When to deliver [`TransportInput::Timeout`] next (`None`: no deadline pending).
    fn poll_timeout(&mut self) -> Option<Instant>;

    /// What the endpoint has done so far.
    fn counters(&self) -> &Counters;

    /// Whether the handshake with `peer` completed (and the peer is not closing).
    fn is_peer_ready(&self, peer: PeerId) -> bool;

    /// The largest frame body `peer` may send next:
    /// [`MAX_HANDSHAKE_BODY_LEN`](crate::wire::MAX_HANDSHAKE_BODY_LEN) until its handshake
    /// completed (and for a peer this endpoint does not know), then
    /// [`MAX_BODY_LEN`](crate::wire::MAX_BODY_LEN). A stream transport hands it to the
    /// connection's [`StreamReader`](crate::stream::StreamReader::set_body_limit), so a peer
    /// that has not said who it is cannot make it buffer more than a Hello; the endpoint
    /// refuses a larger frame from such a peer itself too.
    fn frame_body_limit(&self, peer: PeerId) -> u32;

    /// Connected peers (handshaking, ready or closing).
    fn peer_count(&self) -> usize;

    /// Sessions held (not yet retired).
    fn session_count(&self) -> usize;
}
