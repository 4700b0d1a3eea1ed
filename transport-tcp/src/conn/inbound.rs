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

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpipe_core::stream::{ReadInto, StreamEnd, StreamError, StreamEvent, StreamReader};
use kvpipe_core::wire::MAX_BODY_LEN;
use kvpipe_core::{Admission, PeerId};

use super::hooks::{HalfEnd, NodeHooks, ReadEnd};
#[cfg(feature = "cuda")]
use super::staging::{RecvStaging, StagingSpec};
use crate::config::TcpConfig;
use crate::memory::{RegionTable, Registered};
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
    /// The peer places its writes itself (peer copies, [`crate::peer_copy`]): headers come
    /// without payload.
    placed: bool,
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
            placed: false,
            carries_frames: true,
            arriving_reported: Instant::now(),
            arriving_every: ARRIVING_EVERY,
        }
    }

    /// The same reader for a peer that places its writes itself (peer copies): each admitted
    /// write is reported landed as soon as it is admitted, and no payload is read.
    pub(crate) fn placed(mut self, placed: bool) -> Self {
        self.placed = placed;
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
        let how = match (stop, end) {
            (Stop::Eof, StreamEnd::Clean) => ReadEnd::Eof,
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
                Ok(())
            }
            Some(StreamEvent::DataWrite(header)) => self.admit(&header),
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
    fn admit(&mut self, header: &[u8]) -> Result<(), ReadEnd> {
        let admission = self.hooks.admit(self.peer, header);
        if self.placed {
            return self.admit_placed(admission);
        }
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

    /// A write the peer placed itself (peer copies): its bytes are in memory before its header
    /// was sent, so an admitted one has landed, with no payload to read; a refused one stops
    /// the reader as on the socket path (the core fails the request and closes the peer).
    fn admit_placed(&mut self, admission: Admission) -> Result<(), ReadEnd> {
        let admission = match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } => {
                if !self
                    .regions
                    .registered(region)
                    .is_some_and(|r| r.contains(offset, len))
                {
                    bump(&self.stats.unbacked_writes, 1);
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
    use kvpipe_core::wire::{DataWrite, Frame, Heartbeat};
    use kvpipe_core::{GrantId, RegionId, RequestId, WriteTicket};
    use std::sync::Mutex;

    use crate::memory::MemoryRegion;

    /// Answers every data write with `answer` and records what the reader reported, in order.
    struct Recorder {
        answer: Admission,
        log: Mutex<Vec<String>>,
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
        fn admit(&self, _: PeerId, _: &[u8]) -> Admission {
            self.log.lock().unwrap().push("admit".into());
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
        fn batch_written(&self, _: WriteBatchId) {}
        fn half_ended(&self, _: PeerId, end: HalfEnd) {
            self.log.lock().unwrap().push(format!("ended {end:?}"));
        }
    }

    fn inbound(answer: Admission, region_len: usize) -> (Inbound, Arc<Recorder>, MemoryRegion) {
        let region = MemoryRegion::zeroed(region_len);
        let hooks = Arc::new(Recorder {
            answer,
            log: Mutex::new(Vec::new()),
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

    fn data_write(len: u64) -> Vec<u8> {
        Frame::DataWrite(DataWrite {
            request: RequestId(1),
            grant: GrantId(2),
            region: RegionId(3),
            offset: 4,
            len,
        })
        .to_vec()
        .unwrap()
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

    #[test]
    fn a_placed_write_lands_at_admission_and_no_payload_is_read() {
        let (r, hooks, region) = inbound(APPLY, 32);
        let mut r = r.placed(true);
        // The header alone, then the next frame: no payload between them.
        let mut stream = data_write(20);
        let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
        stream.extend(&hb);
        feed(&mut r, &stream).unwrap();
        let stats = r.stats.snapshot();
        r.finish(Stop::Eof);
        // The reader never writes the memory itself: the peer placed the bytes.
        assert_eq!(region.to_vec(), vec![0u8; 32]);
        assert_eq!(
            *hooks.log.lock().unwrap(),
            [
                "admit".to_string(),
                "finished 5 true".into(),
                format!("frame {}", hb.len()),
                "ended Read(Eof)".into(),
            ]
        );
        assert_eq!((stats.writes_placed, stats.bytes_applied), (1, 20));
    }

    #[test]
    fn a_placed_write_outside_the_grant_is_refused_and_stops_the_reader() {
        let refusal = WriteRefusal::OutsideGrant {
            request: RequestId(1),
            region: RegionId(3),
            offset: 4,
            len: 20,
        };
        let (r, hooks, _) = inbound(Admission::Refuse(refusal), 32);
        let mut r = r.placed(true);
        let stream = data_write(20);
        assert_eq!(feed(&mut r, &stream), Err(ReadEnd::Refused));
        r.finish(Stop::Ended(ReadEnd::Refused));
        assert_eq!(*hooks.log.lock().unwrap(), ["admit", "ended Read(Refused)"]);
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
        let refuse = Admission::Refuse(WriteRefusal::Malformed);
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
