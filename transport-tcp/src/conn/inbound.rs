//! The reading half of one connection: the core's [`StreamReader`] says where the next bytes go
//! (the frame being assembled, memory the receiver admitted, or a scratch buffer for a payload
//! being dropped); [`Inbound`] turns that into the buffer of the next `read` call and turns each
//! completed read into a call on the node (a frame, an admission, a landed write).
//!
//! A shell's loop is: `read` into [`Inbound::buffer`], pass the count to
//! [`Inbound::consumed`], and when the stream ends or fails, [`Inbound::finish`].

use std::sync::Arc;

use kvpipe_core::stream::{ReadInto, StreamEnd, StreamError, StreamEvent, StreamReader};
use kvpipe_core::wire::MAX_BODY_LEN;
use kvpipe_core::{Admission, PeerId};

use super::hooks::{HalfEnd, NodeHooks, ReadEnd};
use crate::memory::RegionTable;
use crate::stats::{bump, StatCells};

/// Scratch buffer for payloads that are read and dropped.
const DISCARD_CHUNK: usize = 64 << 10;

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
}

impl Inbound {
    pub(crate) fn new(
        peer: PeerId,
        hooks: Arc<dyn NodeHooks>,
        regions: Arc<RegionTable>,
        stats: Arc<StatCells>,
        read_max: usize,
    ) -> Self {
        Inbound {
            peer,
            // A handshake's body limit until the core says the peer completed it.
            reader: StreamReader::new(),
            hooks,
            regions,
            stats,
            scratch: Vec::new(),
            read_max: read_max.max(1),
        }
    }

    /// Where the next `read` goes. Never empty while the stream goes on.
    pub(crate) fn buffer(&mut self) -> &mut [u8] {
        let Inbound {
            reader,
            regions,
            scratch,
            read_max,
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
                    .get(region)
                    .expect("the admitted region was checked to be registered at admission");
                // SAFETY: these bytes belong to a write the receiver admitted
                // (`Admission::Apply`) and this reader has not reported finished: admission
                // guarantees that no other write in flight overlaps them, and the engine does
                // not touch a request's blocks before its `Quiesced`, which the core holds until
                // this write is reported with `WriteFinished`. So this is the only reference to
                // them while the `read` fills it. The range lies inside the registered region
                // (checked in `admit` for the whole write; this is a part of it).
                unsafe { region.slice_mut(offset, len) }
                    .expect("inside the write checked at admission")
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
        }
        let event = self.reader.advance(n).map_err(|e| self.stream_error(e))?;
        self.on_event(event)
    }

    /// The stream ended or failed: reports the admitted write cut short (if any) as not landed,
    /// then tells the node this half stopped.
    pub(crate) fn finish(mut self, stop: Stop) {
        let end = self.reader.end();
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
        match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } if !self
                .regions
                .get(region)
                .is_some_and(|r| r.contains(offset, len)) =>
            {
                // Granted by the layout, but the engine registered no memory behind it: nothing
                // is written, and the connection cannot go on (the payload is not read).
                bump(&self.stats.unbacked_writes, 1);
                self.hooks.write_finished(ticket, false);
                return Err(ReadEnd::Failed);
            }
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
        fn write_finished(&self, ticket: WriteTicket, landed: bool) {
            self.log
                .lock()
                .unwrap()
                .push(format!("finished {} {landed}", ticket.0));
        }
        fn batch_part_written(&self, _: WriteBatchId) {}
        fn half_ended(&self, _: PeerId, end: HalfEnd) {
            self.log.lock().unwrap().push(format!("ended {end:?}"));
        }
    }

    fn inbound(answer: Admission, region_len: usize) -> (Inbound, Arc<Recorder>, MemoryRegion) {
        let region = MemoryRegion::zeroed(region_len);
        let hooks = Arc::new(Recorder {
            answer,
            log: Mutex::new(Vec::new()),
        });
        let regions: RegionTable = [(RegionId(3), region.clone())].into_iter().collect();
        let r = Inbound::new(
            PeerId(1),
            hooks.clone(),
            Arc::new(regions),
            Arc::new(StatCells::default()),
            7,
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
}
