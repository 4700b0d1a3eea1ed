//! The reading half of one connection: the core's [`StreamReader`] says where the next bytes go
//! (the frame being assembled, memory the receiver admitted, or a scratch buffer for a payload
//! being dropped); [`Inbound`] turns that into the buffer of the next `read` call and turns each
//! completed read into a call on the node (a frame, an admission, a landed write).
//!
//! A shell's loop is: `read` into [`Inbound::buffer`], pass the count to
//! [`Inbound::consumed`], and when the stream ends or fails, [`Inbound::finish`].
//!
//! With the `cuda` feature a write admitted into device memory is read into pinned staging slots
//! and copied up slot by slot while the socket fills the next ([`super::staging`]); it is
//! reported landed once the copies of its last bytes completed.
//!
//! On a peer-copy connection ([`crate::peer_copy`]) the reader of a **receiver** reads each data
//! write's source after its header, pulls the bytes from the sender's exported region into the
//! admitted destination itself, waits for that copy, reports the write landed and queues an
//! acknowledgement on the connection's writer; the reader of a **sender** takes the
//! acknowledgements that arrive between frames and reports each batch whose last piece they
//! acknowledged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpipe_core::stream::{ReadInto, StreamEnd, StreamError, StreamEvent, StreamReader};
use kvpipe_core::wire::{DataWrite, MAX_BODY_LEN};
use kvpipe_core::{Admission, PeerId, RegionId};

use super::acks::PullAcks;
use super::hooks::{HalfEnd, NodeHooks, ReadEnd};
use super::outbound::{Job, JobQueue};
#[cfg(feature = "cuda")]
use super::staging::{PullCopies, RecvStaging, StagingSpec};
use crate::config::TcpConfig;
use crate::memory::{RegionTable, Registered};
use crate::peer_copy::{decode_ack, encode_ack, PeerMappings, Source, ACK_LEN, SOURCE_LEN};
use crate::stats::{bump, StatCells};

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

/// A receiver's reader on a peer-copy connection: the source that follows each data write's
/// header, the sender's regions it pulls from, and the writer its acknowledgements go out on.
struct Puller {
    mappings: Arc<PeerMappings>,
    writer: Arc<JobQueue>,
    /// The header of the write whose source is being read.
    header: Option<DataWrite>,
    source: [u8; SOURCE_LEN],
    filled: usize,
    #[cfg(feature = "cuda")]
    copies: PullCopies,
}

/// A sender's reader on a peer-copy connection: acknowledgements arrive between frames.
struct AckReader {
    acks: Arc<PullAcks>,
    /// The connection's writer, woken when acknowledged bytes make room in its lookahead.
    writer: Arc<JobQueue>,
    /// Whether the stream is between frames (where an acknowledgement may come).
    between: bool,
    head: [u8; ACK_LEN],
    filled: usize,
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
    #[cfg(feature = "cuda")]
    staging: RecvStaging,
    /// (Receiver, peer copies) this reader pulls each write from the sender's memory.
    puller: Option<Puller>,
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
            #[cfg(feature = "cuda")]
            staging: RecvStaging::new(StagingSpec::from_config(config)),
            puller: None,
            acker: None,
            carries_frames: true,
            arriving_reported: Instant::now(),
            arriving_every: ARRIVING_EVERY,
        }
    }

    /// The same reader pulling every data write from `mappings`, the sender's regions opened
    /// here (a receiver on a peer-copy connection; `None`: the socket path). Acknowledgements
    /// go out on `writer`, the connection's writer.
    pub(crate) fn pulling(
        mut self,
        mappings: Option<Arc<PeerMappings>>,
        writer: &Arc<JobQueue>,
        config: &TcpConfig,
    ) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = config;
        self.puller = mappings.map(|mappings| Puller {
            mappings,
            writer: writer.clone(),
            header: None,
            source: [0; SOURCE_LEN],
            filled: 0,
            #[cfg(feature = "cuda")]
            copies: PullCopies::new(StagingSpec::from_config(config)),
        });
        self
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

    /// The same reader pulling through `spec`'s GPU (tests).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn with_pull_gpu(mut self, spec: StagingSpec) -> Self {
        if let Some(p) = &mut self.puller {
            p.copies = PullCopies::new(spec);
        }
        self
    }

    /// The same reader on a connection that does (`true`, the default) or does not carry the
    /// peer's control frames. Only the first reports payload still arriving
    /// ([`NodeHooks::data_arriving`]): payload elsewhere holds no frame back.
    pub(crate) fn carries_frames(mut self, carries: bool) -> Self {
        self.carries_frames = carries;
        self
    }

    /// The same reader staging device memory through `spec` (tests).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn with_staging(mut self, spec: StagingSpec) -> Self {
        self.staging = RecvStaging::new(spec);
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
            #[cfg(feature = "cuda")]
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
                    #[cfg(feature = "cuda")]
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
        #[cfg(feature = "cuda")]
        let staged = self.staging.active();
        let event = self.reader.advance(n).map_err(|e| self.stream_error(e))?;
        #[cfg(feature = "cuda")]
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
        #[cfg(feature = "cuda")]
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
            Some(StreamEvent::DataWrite(header)) => match &mut self.puller {
                // Its source follows; the write is admitted once that is read.
                Some(p) => {
                    p.header = Some(header);
                    p.filled = 0;
                    Ok(())
                }
                None => self.admit(&header),
            },
            Some(StreamEvent::Landed(ticket)) => {
                // A staged write has landed once its last copy completed.
                #[cfg(feature = "cuda")]
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
            #[cfg(feature = "cuda")]
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
            #[cfg(not(feature = "cuda"))]
            Admission::Apply { .. } => {}
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

    /// (Receiver, peer copies) `n` more bytes of a write's source were read; once it is whole,
    /// the write is admitted and pulled.
    fn source_read(&mut self, n: usize) -> Result<(), ReadEnd> {
        let p = self.puller.as_mut().expect("pulling");
        p.filled += n;
        if p.filled < SOURCE_LEN {
            return Ok(());
        }
        let header = p.header.take().expect("a source follows a header");
        let Some(source) = Source::decode(&p.source) else {
            tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, "a pulled write's source is malformed; the connection stops");
            return Err(ReadEnd::Failed);
        };
        let admission = self.hooks.admit(self.peer, &header);
        self.admit_pulled(admission, source)
    }

    /// (Receiver, peer copies) the core's answer to a pulled write: an admitted one is copied
    /// from the sender's region into the admitted bytes, waited for, and reported landed; a
    /// discarded one is dropped without a copy; a refused one stops the reader as on the socket
    /// path (the core fails the request and closes the peer). Every write admitted or discarded
    /// is then acknowledged to the sender, which keeps its source pinned until then.
    fn admit_pulled(&mut self, admission: Admission, source: Source) -> Result<(), ReadEnd> {
        let admission = match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } => {
                if let Err(why) = self.pull(source, region, offset, len) {
                    tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, %why, "a pulled write failed; the connection stops");
                    self.hooks.write_finished(ticket, false);
                    return Err(ReadEnd::Failed);
                }
                bump(&self.stats.bytes_applied, len);
                bump(&self.stats.writes_placed, 1);
                Admission::Apply {
                    ticket,
                    region,
                    offset,
                    len: 0,
                }
            }
            Admission::Discard { len } => {
                bump(&self.stats.late_writes, 1);
                bump(&self.stats.bytes_drained, len);
                Admission::Discard { len: 0 }
            }
            refused @ Admission::Refuse(_) => {
                bump(&self.stats.writes_refused, 1);
                refused
            }
        };
        let event = self
            .reader
            .admitted(admission)
            .map_err(|e| self.stream_error(e))?;
        self.on_event(event)?;
        if let Some(p) = &self.puller {
            // A writer that stopped takes nothing more: the peer is going away, and the
            // sender fails what it did not hear of.
            p.writer
                .push(Job::Frame(Bytes::copy_from_slice(&encode_ack(1))));
        }
        Ok(())
    }

    /// Copies `len` bytes from the sender's `source` into the admitted `offset` of `region`
    /// and waits for the copy.
    fn pull(
        &mut self,
        source: Source,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let Some(dst) = self
            .regions
            .registered(region)
            .filter(|r| r.contains(offset, len))
        else {
            // Granted by the layout, but the engine registered no memory behind it.
            bump(&self.stats.unbacked_writes, 1);
            return Err(format!("{region} holds no {len} bytes at {offset}"));
        };
        let p = self.puller.as_mut().expect("pulling");
        let Some((src_ordinal, src_addr)) = p.mappings.locate(source, len) else {
            return Err(format!(
                "the source ({len} bytes at {} of the sender's {}) is not in a region it exported",
                source.offset, source.region
            ));
        };
        #[cfg(feature = "cuda")]
        {
            let Registered::Device(d) = dst else {
                return Err(format!("{region} is host memory"));
            };
            let src = kvpipe_cuda::Memory::Device {
                ordinal: src_ordinal,
                addr: src_addr,
            };
            let to = kvpipe_cuda::Memory::Device {
                ordinal: d.ordinal(),
                addr: d.ptr() + offset,
            };
            // SAFETY: the destination bytes belong to a write the receiver admitted
            // (`Admission::Apply`) and not yet reported finished: admission guarantees that no
            // other write in flight overlaps them, and the engine does not touch a request's
            // blocks before its `Quiesced`, which waits for this write's report (made after
            // this copy completed, or after it was given up and left running for good). They
            // lie inside the registered region (checked above). The source lies inside a
            // region the sender exported (checked by `locate`); the sender keeps it pinned
            // until this write is acknowledged, which happens after the copy; the mapping
            // stays open while this reader holds `mappings`.
            unsafe { p.copies.copy(src, to, len) }.map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (dst, src_ordinal, src_addr);
            Err("kvpipe-tcp was built without the `cuda` feature".into())
        }
    }

    /// (Sender, peer copies) `n` more bytes between frames were read: an acknowledgement
    /// reports the batches it completes; anything else is a frame's first bytes, handed to the
    /// stream reader.
    fn ack_read(&mut self, n: usize) -> Result<(), ReadEnd> {
        let a = self.acker.as_mut().expect("acking");
        a.filled += n;
        if a.filled < ACK_LEN {
            return Ok(());
        }
        a.filled = 0;
        let head = a.head;
        if let Some(count) = decode_ack(&head) {
            let Ok(acked) = a.acks.acked(count) else {
                tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, count, "acknowledgements of pieces never sent; the connection stops");
                return Err(ReadEnd::Failed);
            };
            a.writer.poke();
            bump(&self.stats.bytes_placed, acked.bytes);
            for batch in acked.batches {
                self.hooks.batch_written(batch);
            }
            return Ok(());
        }
        a.between = false;
        let ReadInto::Frame(buf) = self.reader.read_into() else {
            return Err(ReadEnd::Failed);
        };
        if buf.len() < ACK_LEN {
            return Err(ReadEnd::Failed);
        }
        buf[..ACK_LEN].copy_from_slice(&head);
        let event = self
            .reader
            .advance(ACK_LEN)
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
mod tests {
    use super::*;
    use bytes::Bytes;
    use kvpipe_core::session::WriteBatchId;
    use kvpipe_core::session::WriteRefusal;
    use kvpipe_core::wire::{Frame, Heartbeat};
    use kvpipe_core::{GrantId, RegionId, RequestId, WriteTicket};
    use std::sync::Mutex;

    use crate::memory::MemoryRegion;

    /// Answers every data write with `answer` and records what the reader reported, in order.
    struct Recorder {
        answer: Admission,
        log: Mutex<Vec<String>>,
        /// The data write headers asked about.
        headers: Mutex<Vec<DataWrite>>,
        /// Memory to read back whenever a write is reported finished (device tests).
        watch: Mutex<Option<(usize, usize)>>,
        /// What it held then.
        at_finish: Mutex<Vec<Vec<u8>>>,
    }

    impl NodeHooks for Recorder {
        fn frame(&self, _: PeerId, bytes: Bytes) {
            self.log
                .lock()
                .unwrap()
                .push(format!("frame {}", bytes.len()));
        }
        fn body_limit(&self, _: PeerId) -> u32 {
            MAX_BODY_LEN
        }
        fn admit(&self, _: PeerId, header: &DataWrite) -> Admission {
            self.log.lock().unwrap().push("admit".into());
            self.headers.lock().unwrap().push(*header);
            self.answer
        }
        fn data_arriving(&self, peer: PeerId) {
            self.log
                .lock()
                .unwrap()
                .push(format!("arriving {}", peer.0));
        }
        fn write_finished(&self, ticket: WriteTicket, landed: bool) {
            self.log
                .lock()
                .unwrap()
                .push(format!("finished {} {landed}", ticket.0));
            if let Some((ptr, len)) = *self.watch.lock().unwrap() {
                // SAFETY: the test's buffer outlives the reader; nothing writes it now.
                let now = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
                self.at_finish.lock().unwrap().push(now.to_vec());
            }
        }
        fn batch_written(&self, batch: WriteBatchId) {
            self.log.lock().unwrap().push(format!("batch {}", batch.0));
        }
        fn half_ended(&self, _: PeerId, end: HalfEnd) {
            self.log.lock().unwrap().push(format!("ended {end:?}"));
        }
    }

    fn inbound(answer: Admission, region_len: usize) -> (Inbound, Arc<Recorder>, MemoryRegion) {
        let region = MemoryRegion::zeroed(region_len);
        let hooks = Arc::new(Recorder {
            answer,
            log: Mutex::new(Vec::new()),
            headers: Mutex::new(Vec::new()),
            watch: Mutex::new(None),
            at_finish: Mutex::new(Vec::new()),
        });
        let regions: RegionTable = [(RegionId(3), region.clone())].into_iter().collect();
        let r = Inbound::new(
            PeerId(1),
            hooks.clone(),
            Arc::new(regions),
            Arc::new(StatCells::default()),
            &TcpConfig {
                socket_read_bytes: 7,
                ..TcpConfig::default()
            },
        );
        (r, hooks, region)
    }

    fn header(len: u64) -> DataWrite {
        DataWrite {
            request: RequestId(1),
            grant: GrantId(2),
            region: RegionId(3),
            offset: 4,
            len,
        }
    }

    fn data_write(len: u64) -> Vec<u8> {
        Frame::DataWrite(header(len)).to_vec().unwrap()
    }

    /// Feeds `bytes` as a socket would, in reads of at most what `buffer` offers.
    fn feed(r: &mut Inbound, mut bytes: &[u8]) -> Result<(), ReadEnd> {
        while !bytes.is_empty() {
            let buf = r.buffer();
            let n = buf.len().min(bytes.len());
            assert!(n > 0);
            buf[..n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            r.consumed(n)?;
        }
        Ok(())
    }

    const APPLY: Admission = Admission::Apply {
        ticket: WriteTicket(5),
        region: RegionId(3),
        offset: 4,
        len: 20,
    };

    #[test]
    fn payloads_land_in_the_admitted_bytes_and_frames_pass_through() {
        let (mut r, hooks, region) = inbound(APPLY, 32);
        let mut stream = data_write(20);
        stream.extend(1..=20u8);
        let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
        stream.extend(&hb);
        feed(&mut r, &stream).unwrap();
        r.finish(Stop::Eof);
        let mut expected = vec![0u8; 4];
        expected.extend(1..=20u8);
        expected.extend([0; 8]);
        assert_eq!(region.to_vec(), expected);
        assert_eq!(
            *hooks.log.lock().unwrap(),
            [
                "admit".to_string(),
                "finished 5 true".into(),
                format!("frame {}", hb.len()),
                "ended Read(Eof)".into(),
            ]
        );
        // The core was asked with the header as sent, decoded by the stream reader.
        assert_eq!(*hooks.headers.lock().unwrap(), [header(20)]);
    }

    #[test]
    fn a_data_write_header_that_does_not_decode_goes_to_the_core_as_a_frame() {
        // A DataWrite declaring an 8-byte body (it has 36): never admitted; its bytes go to
        // the core, which judges them as it judges any bytes that are no frame.
        let (mut r, hooks, region) = inbound(APPLY, 32);
        let mut stream = kvpipe_core::wire::FrameHeader::new(
            kvpipe_core::wire::FrameKind::DataWrite,
            kvpipe_core::wire::PROTOCOL_VERSION,
            8,
        )
        .to_bytes()
        .to_vec();
        stream.extend([7; 8 + 20]);
        assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Refused));
        assert_eq!(r.stats.snapshot().decode_errors, 1);
        r.finish(Stop::Ended(ReadEnd::Refused));
        assert!(region.to_vec().iter().all(|&b| b == 0));
        assert_eq!(
            *hooks.log.lock().unwrap(),
            ["frame 20", "ended Read(Refused)"]
        );
        assert!(hooks.headers.lock().unwrap().is_empty());
    }

    #[test]
    fn payload_still_arriving_is_reported_between_reads_at_most_so_often() {
        // Reads of at most 7 bytes: a 20-byte payload takes three.
        let (mut r, hooks, _) = inbound(APPLY, 32);
        r.arriving_every = Duration::ZERO;
        let mut stream = data_write(20);
        stream.extend(1..=20u8);
        feed(&mut r, &stream).unwrap();
        assert_eq!(
            *hooks.log.lock().unwrap(),
            [
                "admit".to_string(),
                "arriving 1".into(),
                "arriving 1".into(),
                "arriving 1".into(),
                "finished 5 true".into(),
            ]
        );

        // A connection that carries no frames holds none back: nothing to report.
        let (r, hooks, _) = inbound(APPLY, 32);
        let mut r = r.carries_frames(false);
        r.arriving_every = Duration::ZERO;
        feed(&mut r, &stream).unwrap();
        assert_eq!(
            *hooks.log.lock().unwrap(),
            ["admit".to_string(), "finished 5 true".into()]
        );

        // With the default interval, a payload read within it is not reported.
        let (mut r, hooks, _) = inbound(APPLY, 32);
        feed(&mut r, &stream).unwrap();
        assert_eq!(
            *hooks.log.lock().unwrap(),
            ["admit".to_string(), "finished 5 true".into()]
        );
    }

    /// The sender's region 1 as opened here: 64 bytes at `ptr` (fake: a host address).
    fn sender_regions(ptr: u64) -> Arc<PeerMappings> {
        Arc::new(PeerMappings::fake([(
            RegionId(1),
            crate::peer_copy::PlacedRegion {
                ordinal: 0,
                ptr,
                len: 64,
            },
        )]))
    }

    fn source(offset: u64) -> [u8; SOURCE_LEN] {
        Source {
            region: RegionId(1),
            offset,
        }
        .encode()
    }

    #[test]
    fn a_discarded_pulled_write_is_acknowledged_and_a_refused_one_is_not() {
        let writer = Arc::new(JobQueue::new());
        let (r, hooks, _) = inbound(Admission::Discard { len: 20 }, 32);
        let mut r = r.pulling(Some(sender_regions(0x1000)), &writer, &TcpConfig::default());
        let mut stream = data_write(20);
        stream.extend(source(8));
        let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
        stream.extend(&hb);
        feed(&mut r, &stream).unwrap();
        r.finish(Stop::Eof);
        // No copy (the request ended here), but the sender may release its source.
        assert_eq!(writer.queued_frames(), [encode_ack(1).to_vec()]);
        assert_eq!(
            *hooks.log.lock().unwrap(),
            [
                "admit".to_string(),
                format!("frame {}", hb.len()),
                "ended Read(Eof)".into()
            ]
        );

        let refusal = WriteRefusal::OutsideGrant {
            request: RequestId(1),
            region: RegionId(3),
            offset: 4,
            len: 20,
        };
        let writer = Arc::new(JobQueue::new());
        let (r, hooks, _) = inbound(Admission::Refuse(refusal), 32);
        let mut r = r.pulling(Some(sender_regions(0x1000)), &writer, &TcpConfig::default());
        let mut stream = data_write(20);
        stream.extend(source(8));
        assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Refused));
        r.finish(Stop::Ended(ReadEnd::Refused));
        assert!(writer.queued_frames().is_empty());
        assert_eq!(*hooks.log.lock().unwrap(), ["admit", "ended Read(Refused)"]);
    }

    #[test]
    fn a_stream_cut_inside_a_source_ends_the_reader_as_failed_without_an_admission() {
        let writer = Arc::new(JobQueue::new());
        let (r, hooks, _) = inbound(APPLY, 32);
        let mut r = r.pulling(Some(sender_regions(0x1000)), &writer, &TcpConfig::default());
        let mut stream = data_write(20);
        stream.extend(&source(8)[..7]);
        feed(&mut r, &stream).unwrap();
        r.finish(Stop::Eof);
        assert_eq!(*hooks.log.lock().unwrap(), ["ended Read(Failed)"]);
        assert!(writer.queued_frames().is_empty());
    }

    #[test]
    fn acknowledgements_between_frames_report_batches_and_frames_still_pass() {
        use super::super::backlog::BatchTally;
        let writer = Arc::new(JobQueue::new());
        let acks = Arc::new(PullAcks::default());
        let seven = BatchTally::new(WriteBatchId(7), 2);
        acks.expect(seven.clone(), 10);
        acks.expect(seven, 10);
        acks.expect(BatchTally::new(WriteBatchId(8), 1), 5);
        let (r, hooks, _) = inbound(APPLY, 32);
        let mut r = r.acking(Some(acks.clone()), &writer);
        let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
        let mut stream = encode_ack(1).to_vec();
        stream.extend(&hb);
        stream.extend(encode_ack(2));
        stream.extend(&hb);
        feed(&mut r, &stream).unwrap();
        assert_eq!(
            *hooks.log.lock().unwrap(),
            [
                format!("frame {}", hb.len()),
                "batch 7".into(),
                "batch 8".into(),
                format!("frame {}", hb.len()),
            ]
        );
        assert_eq!(acks.unacked_bytes(), 0);
        assert_eq!(r.stats.snapshot().bytes_placed, 25);
        // An acknowledgement of a piece never sent stops the reader.
        assert_eq!(feed(&mut r, &encode_ack(1)), Err(ReadEnd::Failed));

        // A stream cut inside an acknowledgement is not a clean end.
        let (r, hooks, _) = inbound(APPLY, 32);
        let mut r = r.acking(Some(Arc::new(PullAcks::default())), &writer);
        feed(&mut r, &encode_ack(1)[..5]).unwrap();
        r.finish(Stop::Eof);
        assert_eq!(*hooks.log.lock().unwrap(), ["ended Read(Failed)"]);
    }

    #[test]
    fn a_payload_cut_short_is_reported_not_landed_before_the_half_ends() {
        let (mut r, hooks, _) = inbound(APPLY, 32);
        let mut stream = data_write(20);
        stream.extend([7; 9]);
        feed(&mut r, &stream).unwrap();
        r.finish(Stop::Eof);
        assert_eq!(
            *hooks.log.lock().unwrap(),
            ["admit", "finished 5 false", "ended Read(Failed)"]
        );
    }

    #[test]
    fn a_refused_write_stops_the_reader_before_its_payload() {
        let refuse = Admission::Refuse(WriteRefusal::NotAccepted);
        let (mut r, hooks, region) = inbound(refuse, 32);
        let mut stream = data_write(20);
        stream.extend([7; 20]);
        assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Refused));
        r.finish(Stop::Ended(ReadEnd::Refused));
        assert!(region.to_vec().iter().all(|&b| b == 0));
        assert_eq!(*hooks.log.lock().unwrap(), ["admit", "ended Read(Refused)"]);
    }

    #[test]
    fn an_admitted_destination_outside_registered_memory_is_never_written() {
        // The grant says 20 bytes at offset 4, but only 16 bytes are registered.
        let (mut r, hooks, region) = inbound(APPLY, 16);
        let mut stream = data_write(20);
        stream.extend([7; 20]);
        assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Failed));
        r.finish(Stop::Ended(ReadEnd::Failed));
        assert!(region.to_vec().iter().all(|&b| b == 0));
        assert_eq!(
            *hooks.log.lock().unwrap(),
            ["admit", "finished 5 false", "ended Read(Failed)"]
        );
    }

    #[cfg(feature = "cuda")]
    mod device {
        use super::*;
        use crate::conn::staging::{fake, StagingSpec};
        use crate::memory::DeviceRegion;

        /// A reader whose region 3 is "device memory" (`memory`, which the fake GPU copies
        /// into), reading at most 7 bytes per call.
        fn device_inbound(
            answer: Admission,
            memory: &mut [u8],
            spec: StagingSpec,
        ) -> (Inbound, Arc<Recorder>) {
            let hooks = Arc::new(Recorder {
                answer,
                log: Mutex::new(Vec::new()),
                headers: Mutex::new(Vec::new()),
                watch: Mutex::new(Some((memory.as_ptr() as usize, memory.len()))),
                at_finish: Mutex::new(Vec::new()),
            });
            let mut regions = RegionTable::new();
            // SAFETY: the fake GPU treats device addresses as host addresses; `memory`
            // outlives the reader.
            regions.insert_device(RegionId(3), unsafe {
                DeviceRegion::from_raw_parts(0, memory.as_mut_ptr() as u64, memory.len())
            });
            let r = Inbound::new(
                PeerId(1),
                hooks.clone(),
                Arc::new(regions),
                Arc::new(StatCells::default()),
                &TcpConfig {
                    socket_read_bytes: 7,
                    ..TcpConfig::default()
                },
            )
            .with_staging(spec);
            (r, hooks)
        }

        #[test]
        fn a_device_write_lands_only_once_its_copies_completed() {
            let mut memory = vec![0u8; 32];
            let (spec, gpu) = fake::spec(8, 2);
            let (mut r, hooks) = device_inbound(APPLY, &mut memory, spec);
            let mut stream = data_write(20);
            stream.extend(1..=20u8);
            let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
            stream.extend(&hb);
            feed(&mut r, &stream).unwrap();
            r.finish(Stop::Eof);
            let mut expected = vec![0u8; 4];
            expected.extend(1..=20u8);
            expected.extend([0; 8]);
            // Every byte was in "device memory" when the write was reported landed.
            assert_eq!(*hooks.at_finish.lock().unwrap(), [expected.clone()]);
            assert_eq!(memory, expected);
            assert_eq!(
                *hooks.log.lock().unwrap(),
                [
                    "admit".to_string(),
                    "finished 5 true".into(),
                    format!("frame {}", hb.len()),
                    "ended Read(Eof)".into(),
                ]
            );
            let st = gpu.lock().unwrap();
            // 20 bytes through 8-byte slots: three copies up, none left running.
            let ups: Vec<&String> = st.log.iter().filter(|l| l.starts_with("h2d")).collect();
            assert_eq!(ups, ["h2d 8", "h2d 8", "h2d 4"]);
            assert_eq!(st.pending(), 0);
            assert!(st.most_pending <= 2);
        }

        #[test]
        fn a_device_write_cut_short_is_reported_after_its_copies_stopped() {
            let mut memory = vec![0u8; 32];
            let (spec, gpu) = fake::spec(8, 4);
            let (mut r, hooks) = device_inbound(APPLY, &mut memory, spec);
            let mut stream = data_write(20);
            stream.extend([7; 11]);
            feed(&mut r, &stream).unwrap();
            // One full slot was sent up and may still be copying.
            assert_eq!(gpu.lock().unwrap().pending(), 1);
            r.finish(Stop::Eof);
            assert_eq!(gpu.lock().unwrap().pending(), 0);
            assert_eq!(
                *hooks.log.lock().unwrap(),
                ["admit", "finished 5 false", "ended Read(Failed)"]
            );
            // The copied slot is there when the write is reported; the partial one is dropped.
            let mut expected = vec![0u8; 4];
            expected.extend([7; 8]);
            expected.extend([0; 20]);
            assert_eq!(*hooks.at_finish.lock().unwrap(), [expected]);
        }

        #[test]
        fn a_pulled_write_is_copied_and_waited_for_before_it_is_reported_and_acknowledged() {
            let src: Vec<u8> = (0..64u8).map(|i| i ^ 0x3c).collect();
            let mut memory = vec![0u8; 32];
            let (spec, gpu) = fake::spec(8, 2);
            let (r, hooks) = device_inbound(APPLY, &mut memory, spec.clone());
            let writer = Arc::new(JobQueue::new());
            let mut r = r
                .pulling(
                    Some(sender_regions(src.as_ptr() as u64)),
                    &writer,
                    &TcpConfig::default(),
                )
                .with_pull_gpu(spec);
            let mut stream = data_write(20);
            stream.extend(source(8));
            let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
            stream.extend(&hb);
            feed(&mut r, &stream).unwrap();
            // The reader's own copy completed before anything was reported: none runs now,
            // so the half may end (and the peer be reported gone) at any time.
            assert_eq!(gpu.lock().unwrap().pending(), 0);
            r.finish(Stop::Eof);
            let mut expected = vec![0u8; 4];
            expected.extend(&src[8..28]);
            expected.extend([0; 8]);
            // Every byte was in place when the write was reported landed.
            assert_eq!(*hooks.at_finish.lock().unwrap(), [expected.clone()]);
            assert_eq!(memory, expected);
            assert_eq!(
                *hooks.log.lock().unwrap(),
                [
                    "admit".to_string(),
                    "finished 5 true".into(),
                    format!("frame {}", hb.len()),
                    "ended Read(Eof)".into(),
                ]
            );
            assert_eq!(gpu.lock().unwrap().log, ["d2d 20", "done 20"]);
            // Acknowledged once landed: the sender may release its source.
            assert_eq!(writer.queued_frames(), [encode_ack(1).to_vec()]);
        }

        #[test]
        fn a_pulled_write_from_outside_the_exported_region_is_never_copied() {
            let src = [7u8; 64];
            let mut memory = vec![0u8; 32];
            let (spec, gpu) = fake::spec(8, 2);
            let (r, hooks) = device_inbound(APPLY, &mut memory, spec.clone());
            let writer = Arc::new(JobQueue::new());
            let mut r = r
                .pulling(
                    Some(sender_regions(src.as_ptr() as u64)),
                    &writer,
                    &TcpConfig::default(),
                )
                .with_pull_gpu(spec);
            let mut stream = data_write(20);
            // 20 bytes from offset 50 of a 64-byte region.
            stream.extend(source(50));
            assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Failed));
            r.finish(Stop::Ended(ReadEnd::Failed));
            assert!(memory.iter().all(|&b| b == 0));
            assert!(gpu.lock().unwrap().log.is_empty());
            assert!(writer.queued_frames().is_empty());
            assert_eq!(
                *hooks.log.lock().unwrap(),
                ["admit", "finished 5 false", "ended Read(Failed)"]
            );
        }

        #[test]
        fn without_a_driver_a_device_write_is_refused_before_its_payload() {
            let mut memory = vec![0u8; 32];
            let (mut r, hooks) = device_inbound(APPLY, &mut memory, fake::no_driver());
            let mut stream = data_write(20);
            stream.extend([7; 20]);
            assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Failed));
            r.finish(Stop::Ended(ReadEnd::Failed));
            assert!(memory.iter().all(|&b| b == 0));
            assert_eq!(
                *hooks.log.lock().unwrap(),
                ["admit", "finished 5 false", "ended Read(Failed)"]
            );
        }
    }
}
