//! The reader's tests: frames, payloads, refusals, staging and peer-copy pulling and
//! acknowledgements, driven with a recording node.

use super::*;
use bytes::Bytes;
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::session::WriteRefusal;
use kvpipe_core::wire::{Frame, Heartbeat};
use kvpipe_core::{GrantId, RegionId, RequestId, WriteTicket};
use std::sync::Mutex;

use crate::memory::MemoryRegion;
use crate::peer_copy::{encode_ack, PeerMappings, Source};

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
/// A link placed to pull from the sender's region 1 of 64 bytes at `ptr`.
fn sender_regions(ptr: u64) -> Arc<PeerPlacement> {
    PeerPlacement::placed(Placement::Pull(Arc::new(PeerMappings::fake([(
        RegionId(1),
        crate::peer_copy::PlacedRegion {
            ordinal: 0,
            ptr,
            len: 64,
        },
    )]))))
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
fn a_reader_reads_its_links_placement_at_the_first_data_write() {
    // Placed to pull after the reader started (the handshake ends after the halves start).
    let writer = Arc::new(JobQueue::new());
    let (r, _, _) = inbound(Admission::Discard { len: 20 }, 32);
    let placement = PeerPlacement::pending();
    let mut r = r.pulling(Some(placement.clone()), &writer, &TcpConfig::default());
    placement.decide(sender_regions(0x1000).get());
    let mut stream = data_write(20);
    stream.extend(source(8));
    feed(&mut r, &stream).unwrap();
    r.finish(Stop::Eof);
    assert_eq!(writer.queued_frames(), [encode_ack(1).to_vec()]);

    // Placed on the sockets (the offer was declined): the payload follows the header, and
    // nothing is acknowledged.
    let writer = Arc::new(JobQueue::new());
    let (r, hooks, _) = inbound(Admission::Discard { len: 20 }, 32);
    let placement = PeerPlacement::pending();
    let mut r = r.pulling(Some(placement.clone()), &writer, &TcpConfig::default());
    placement.decide(Decision::Placed(Placement::Socket));
    let mut stream = data_write(20);
    stream.extend([9u8; 20]);
    let hb = Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap();
    stream.extend(&hb);
    feed(&mut r, &stream).unwrap();
    r.finish(Stop::Eof);
    assert!(writer.queued_frames().is_empty());
    assert_eq!(
        *hooks.log.lock().unwrap(),
        [
            "admit".to_string(),
            format!("frame {}", hb.len()),
            "ended Read(Eof)".into()
        ]
    );
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
    use crate::gpu::{fake, PullCopies, RecvStaging, StagingSpec};
    use crate::memory::DeviceRegion;

    impl Inbound {
        /// The same reader staging device memory through `spec`.
        fn with_staging(mut self, spec: StagingSpec) -> Self {
            self.staging = RecvStaging::new(spec);
            self
        }

        /// The same reader pulling through `spec`'s GPU.
        fn with_pull_gpu(mut self, spec: StagingSpec) -> Self {
            if let Some(p) = &mut self.puller {
                p.copies = PullCopies::new(spec.clone());
            }
            if let Some(pending) = &mut self.pull_from {
                pending.2 = spec;
            }
            self
        }
    }

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
