//! The reading half of one connection: the core's [`StreamReader`] says where the next bytes go
//! (the frame being assembled, memory the receiver admitted, or a scratch buffer for a payload
//! being dropped); [`Inbound`] turns that into the buffer of the next `read` call and turns each
//! completed read into a call on the node (a frame, an admission, a landed write).
//!
//! A shell's loop is: `read` into [`Inbound::buffer`], pass the count to
//! [`Inbound::consumed`], and when the stream ends or fails, [`Inbound::finish`].
//!
//! A write admitted into device memory (`cuda` feature) is read into pinned staging slots and
//! copied up slot by slot while the socket fills the next ([`crate::gpu`]); it is reported
//! landed once the copies of its last bytes completed.
//!
//! On a peer-copy connection ([`crate::peer_copy`]) the reader of a **receiver** reads each data
//! write's source after its header, pulls the bytes from the sender's exported region into the
//! admitted destination itself, waits for that copy, reports the write landed and queues an
//! acknowledgement on the connection's writer; the reader of a **sender** takes the
//! acknowledgements that arrive between frames and reports each batch whose last piece they
//! acknowledged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpipe_core::stream::{ReadInto, StreamEnd, StreamError, StreamEvent, StreamReader};
use kvpipe_core::wire::{DataWrite, MAX_BODY_LEN};
use kvpipe_core::{Admission, PeerId};

use super::acks::PullAcks;
use super::hooks::{HalfEnd, NodeHooks, ReadEnd};
use super::outbound::JobQueue;
use crate::config::TcpConfig;
use crate::gpu::{PullCopies, RecvStaging, StagingSpec};
use crate::memory::{RegionTable, Registered};
use crate::peer_copy::{ACK_LEN, SOURCE_LEN};
use crate::placement::{Decision, PeerPlacement, Placement};
use crate::stats::{bump, StatCells};

mod pull;

use pull::{AckReader, Puller};

/// Scratch buffer for payloads that are read and dropped.
const DISCARD_CHUNK: usize = 64 << 10;

/// How often a reader tells the node that an admitted write's payload is still arriving
/// ([`NodeHooks::data_arriving`]): well within any sensible liveness timeout (the core's
/// default is 10 s), rarely enough to cost nothing (one short call on the node's lock).
pub(crate) const ARRIVING_EVERY: Duration = Duration::from_millis(250);

/// Why a shell stopped reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// `read` returned 0: the peer ended its stream, or the node shut the socket down.
    Eof,
    /// `read` failed.
    Io,
    /// [`Inbound::consumed`] said so.
    Ended(ReadEnd),
}

/// The reading half of one connection (see the module doc).
pub(crate) struct Inbound {
    peer: PeerId,
    reader: StreamReader,
    hooks: Arc<dyn NodeHooks>,
    regions: Arc<RegionTable>,
    stats: Arc<StatCells>,
    scratch: Vec<u8>,
    /// Most payload bytes one `read` call lands in memory.
    read_max: usize,
    /// Writes into device memory, through pinned staging slots.
    staging: RecvStaging,
    /// (Receiver, peer copies) this reader pulls each write from the sender's memory.
    puller: Option<Puller>,
    /// (Receiver) the link's placement, read at the first data write: whether to pull.
    pull_from: Option<(Arc<PeerPlacement>, Arc<JobQueue>, StagingSpec)>,
    /// (Sender, peer copies) the receiver acknowledges pulled pieces on this connection.
    acker: Option<AckReader>,
    /// The peer's control frames travel on this connection: payload arriving here holds them
    /// back, and is reported to keep the peer alive.
    carries_frames: bool,
    /// When payload arriving was last reported, and how often it is ([`ARRIVING_EVERY`]).
    arriving_reported: Instant,
    arriving_every: Duration,
}

impl Inbound {
    pub(crate) fn new(
        peer: PeerId,
        hooks: Arc<dyn NodeHooks>,
        regions: Arc<RegionTable>,
        stats: Arc<StatCells>,
        config: &TcpConfig,
    ) -> Self {
        Inbound {
            peer,
            // A handshake's body limit until the core says the peer completed it.
            reader: StreamReader::new(),
            hooks,
            regions,
            stats,
            scratch: Vec::new(),
            read_max: config.socket_read_bytes.max(1),
            staging: RecvStaging::new(StagingSpec::from_config(config)),
            puller: None,
            pull_from: None,
            acker: None,
            carries_frames: true,
            arriving_reported: Instant::now(),
            arriving_every: ARRIVING_EVERY,
        }
    }

    /// The same reader pulling every data write from the sender's regions opened here when the
    /// link's `placement` says so (a receiver whose handshake accepted a peer-copy offer;
    /// `None`, or any other placement: the socket path). The placement is read at the first
    /// data write, which the handshake's decision precedes. Acknowledgements go out on
    /// `writer`, the connection's writer.
    pub(crate) fn pulling(
        mut self,
        placement: Option<Arc<PeerPlacement>>,
        writer: &Arc<JobQueue>,
        config: &TcpConfig,
    ) -> Self {
        self.pull_from = placement.map(|p| (p, writer.clone(), StagingSpec::from_config(config)));
        self
    }

    /// Reads the link's placement once (at the first data write): a puller if it pulls.
    fn place(&mut self) {
        let Some((placement, writer, spec)) = self.pull_from.take() else {
            return;
        };
        if let Decision::Placed(Placement::Pull(mappings)) = placement.get() {
            self.puller = Some(Puller {
                mappings,
                writer,
                header: None,
                source: [0; SOURCE_LEN],
                filled: 0,
                copies: PullCopies::new(spec),
            });
        }
    }

    /// The same reader taking the receiver's acknowledgements of the pulled pieces in `acks`
    /// (a sender on a peer-copy connection; `None`: the socket path), waking `writer`, the
    /// connection's writer, as they make room.
    pub(crate) fn acking(mut self, acks: Option<Arc<PullAcks>>, writer: &Arc<JobQueue>) -> Self {
        self.acker = acks.map(|acks| AckReader {
            acks,
            writer: writer.clone(),
            between: true,
            head: [0; ACK_LEN],
            filled: 0,
        });
        self
    }

    /// The same reader on a connection that does (`true`, the default) or does not carry the
    /// peer's control frames. Only the first reports payload still arriving
    /// ([`NodeHooks::data_arriving`]): payload elsewhere holds no frame back.
    pub(crate) fn carries_frames(mut self, carries: bool) -> Self {
        self.carries_frames = carries;
        self
    }

    /// Where the next `read` goes. Never empty while the stream goes on.
    pub(crate) fn buffer(&mut self) -> &mut [u8] {
        if self.puller.as_ref().is_some_and(|p| p.header.is_some()) {
            let p = self.puller.as_mut().expect("checked");
            return &mut p.source[p.filled..];
        }
        if self.acker.as_ref().is_some_and(|a| a.between) {
            let a = self.acker.as_mut().expect("checked");
            return &mut a.head[a.filled..];
        }
        let Inbound {
            reader,
            regions,
            scratch,
            read_max,
            staging,
            ..
        } = self;
        match reader.read_into() {
            ReadInto::Frame(buf) => buf,
            ReadInto::Memory {
                region,
                offset,
                len,
            } => {
                let len = len.min(*read_max as u64);
                let region = regions
                    .registered(region)
                    .expect("the admitted region was checked to be registered at admission");
                match region {
                    // SAFETY: these bytes belong to a write the receiver admitted
                    // (`Admission::Apply`) and this reader has not reported finished: admission
                    // guarantees that no other write in flight overlaps them, and the engine
                    // does not touch a request's blocks before its `Quiesced`, which the core
                    // holds until this write is reported with `WriteFinished`. So this is the
                    // only reference to them while the `read` fills it. The range lies inside
                    // the registered region (checked in `admit` for the whole write; this is a
                    // part of it).
                    Registered::Host(region) => unsafe { region.slice_mut(offset, len) }
                        .expect("inside the write checked at admission"),
                    // Device memory: the bytes go to the current staging slot (`admit` started
                    // the staged write at this offset; they continue it).
                    Registered::Device(_) => staging.buffer(len as usize),
                }
            }
            ReadInto::Discard { len } => {
                if scratch.is_empty() {
                    scratch.resize(DISCARD_CHUNK, 0);
                }
                let len = (len as usize).min(scratch.len());
                &mut scratch[..len]
            }
        }
    }

    /// `n > 0` bytes were read into [`buffer`](Self::buffer). `Err`: stop reading.
    pub(crate) fn consumed(&mut self, n: usize) -> Result<(), ReadEnd> {
        if self.puller.as_ref().is_some_and(|p| p.header.is_some()) {
            return self.source_read(n);
        }
        if self.acker.as_ref().is_some_and(|a| a.between) {
            return self.ack_read(n);
        }
        if self.reader.in_flight().is_some() {
            bump(&self.stats.bytes_applied, n as u64);
            if self.carries_frames {
                let now = Instant::now();
                if now.duration_since(self.arriving_reported) >= self.arriving_every {
                    self.arriving_reported = now;
                    self.hooks.data_arriving(self.peer);
                }
            }
        }
        let staged = self.staging.active();
        let event = self.reader.advance(n).map_err(|e| self.stream_error(e))?;
        if staged {
            let last = matches!(event, Some(StreamEvent::Landed(_)));
            if self.staging.filled(n, last).is_err() {
                if let Some(StreamEvent::Landed(ticket)) = event {
                    // The reader is past this write: report it here, once its copies stopped.
                    self.staging.abandon();
                    self.hooks.write_finished(ticket, false);
                }
                return Err(ReadEnd::Failed);
            }
        }
        self.on_event(event)
    }

    /// The stream ended or failed: reports the admitted write cut short (if any) as not landed
    /// (once no staging copy writes its memory any more), then tells the node this half
    /// stopped.
    pub(crate) fn finish(mut self, stop: Stop) {
        let end = self.reader.end();
        self.staging.abandon();
        if let StreamEnd::Truncated {
            unfinished: Some(ticket),
        } = end
        {
            self.hooks.write_finished(ticket, false);
        }
        // Cut inside a pulled write's source, or inside an acknowledgement.
        let cut = self.puller.as_ref().is_some_and(|p| p.header.is_some())
            || self.acker.as_ref().is_some_and(|a| a.filled > 0);
        let how = match (stop, end) {
            (Stop::Eof, StreamEnd::Clean) if !cut => ReadEnd::Eof,
            (Stop::Eof | Stop::Io, _) => ReadEnd::Failed,
            (Stop::Ended(how), _) => how,
        };
        self.hooks.half_ended(self.peer, HalfEnd::Read(how));
    }

    fn on_event(&mut self, event: Option<StreamEvent>) -> Result<(), ReadEnd> {
        match event {
            None => Ok(()),
            Some(StreamEvent::Frame(bytes)) => {
                self.hooks.frame(self.peer, bytes);
                self.raise_body_limit();
                if let Some(a) = &mut self.acker {
                    a.between = true;
                }
                Ok(())
            }
            Some(StreamEvent::DataWrite(header)) => {
                self.place();
                match &mut self.puller {
                    // Its source follows; the write is admitted once that is read.
                    Some(p) => {
                        p.header = Some(header);
                        p.filled = 0;
                        Ok(())
                    }
                    None => self.admit(&header),
                }
            }
            Some(StreamEvent::Landed(ticket)) => {
                // A staged write has landed once its last copy completed.
                if self.staging.active() && self.staging.finish_write().is_err() {
                    self.hooks.write_finished(ticket, false);
                    return Err(ReadEnd::Failed);
                }
                bump(&self.stats.writes_applied, 1);
                self.hooks.write_finished(ticket, true);
                self.raise_body_limit();
                Ok(())
            }
        }
    }

    /// While the reader holds a handshake's body limit, asks the core whether the peer has
    /// completed its handshake since (once it has, the limit is the largest and never asked
    /// again).
    fn raise_body_limit(&mut self) {
        if self.reader.body_limit() < MAX_BODY_LEN {
            self.reader.set_body_limit(self.hooks.body_limit(self.peer));
        }
    }

    /// Asks the core about a data write and tells the stream reader the answer.
    fn admit(&mut self, header: &DataWrite) -> Result<(), ReadEnd> {
        let admission = self.hooks.admit(self.peer, header);
        match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } if !self
                .regions
                .registered(region)
                .is_some_and(|r| r.contains(offset, len)) =>
            {
                // Granted by the layout, but the engine registered no memory behind it: nothing
                // is written, and the connection cannot go on (the payload is not read).
                bump(&self.stats.unbacked_writes, 1);
                self.hooks.write_finished(ticket, false);
                return Err(ReadEnd::Failed);
            }
            Admission::Apply {
                ticket,
                region,
                offset,
                ..
            } => {
                if let Some(Registered::Device(d)) = self.regions.registered(region) {
                    let (ordinal, addr) = (d.ordinal(), d.ptr() + offset);
                    if self.staging.begin(ordinal, addr).is_err() {
                        // No staging (no driver, a failed allocation): nothing is written.
                        self.hooks.write_finished(ticket, false);
                        return Err(ReadEnd::Failed);
                    }
                }
            }
            Admission::Discard { len } => {
                bump(&self.stats.late_writes, 1);
                bump(&self.stats.bytes_drained, len);
            }
            Admission::Refuse(_) => bump(&self.stats.writes_refused, 1),
        }
        let event = self
            .reader
            .admitted(admission)
            .map_err(|e| self.stream_error(e))?;
        self.on_event(event)
    }

    fn stream_error(&self, e: StreamError) -> ReadEnd {
        match e {
            StreamError::Refused(_) => ReadEnd::Refused,
            StreamError::Header { bytes, .. } => {
                // Bytes that are no frame (or a body over the peer's limit): the core judges
                // them, reports the protocol error, fails the peer's sessions with it and asks
                // to close the peer. Nothing more is read from this connection.
                bump(&self.stats.decode_errors, 1);
                self.hooks.frame(self.peer, bytes);
                ReadEnd::Refused
            }
            StreamError::Misuse(_) => ReadEnd::Failed,
        }
    }
}

#[cfg(test)]
mod tests;
