//! The writer's tests: bounded slices, batch reports, pulled pieces and their
//! acknowledgements, several writers sharing one peer's backlog, pokes and aborts.

use super::*;
use crate::memory::{MemoryRegion, Registered};
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::{Admission, RegionId, WriteTicket};
use std::sync::Mutex as StdMutex;

#[derive(Default)]
struct Recorder {
    written: StdMutex<Vec<WriteBatchId>>,
}

impl NodeHooks for Recorder {
    fn frame(&self, _: PeerId, _: Bytes) {}
    fn body_limit(&self, _: PeerId) -> u32 {
        kvpipe_core::wire::MAX_BODY_LEN
    }
    fn admit(&self, _: PeerId, _: &kvpipe_core::wire::DataWrite) -> Admission {
        Admission::Discard { len: 0 }
    }
    fn data_arriving(&self, _: PeerId) {}
    fn write_finished(&self, _: WriteTicket, _: bool) {}
    fn batch_written(&self, batch: WriteBatchId) {
        self.written.lock().unwrap().push(batch);
    }
    fn half_ended(&self, _: PeerId, _: HalfEnd) {}
}

/// A batch's pieces, bound to one connection.
fn data(batch: u64, pieces: Vec<Piece>) -> Job {
    Job::Data(tallied(batch, pieces))
}

fn tallied(batch: u64, pieces: Vec<Piece>) -> Vec<TalliedPiece> {
    let tally = BatchTally::new(WriteBatchId(batch), pieces.len() as u64);
    pieces
        .into_iter()
        .map(|piece| TalliedPiece {
            piece,
            tally: tally.clone(),
        })
        .collect()
}

fn concat(slices: &[IoSlice<'_>]) -> Vec<u8> {
    slices.iter().flat_map(|s| s.iter().copied()).collect()
}

#[test]
fn writes_in_bounded_slices_and_reports_batches_once_written() {
    let src = Registered::Host(MemoryRegion::from_vec((0..100u8).collect()));
    let hooks = Arc::new(Recorder::default());
    let queue = Arc::new(JobQueue::new());
    let mut out = Outbound::new(
        PeerId(1),
        (queue.clone(), Arc::default()),
        hooks.clone(),
        Arc::new(StatCells::default()),
        &TcpConfig {
            socket_write_bytes: 7,
            ..TcpConfig::default()
        },
    );
    assert_eq!(out.next(), Next::Wait);
    assert!(queue.push(Job::Frame(Bytes::from_static(b"frame"))));
    let piece = |off: u64, len: u64| {
        Piece::new([9; kvpipe_core::wire::DATA_WRITE_FRAME_LEN], &src, off, len)
    };
    assert!(queue.push(data(4, vec![piece(10, 3).unwrap(), piece(50, 2).unwrap()])));
    assert!(queue.push(Job::Close));
    assert!(!queue.push(Job::Frame(Bytes::from_static(b"late"))));
    let mut wire: Vec<u8> = Vec::new();
    loop {
        match out.next() {
            Next::Write => {
                let slices = out.slices();
                let total: usize = slices.iter().map(|s| s.len()).sum();
                assert!(total <= 7 && total > 0);
                // Write one byte less than offered when possible: partial writes resume.
                let n = total.saturating_sub(1).max(1);
                wire.extend(&concat(&slices)[..n]);
                out.written(n);
            }
            Next::Close => break,
            other => panic!("{other:?}"),
        }
    }
    let h = kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
    let mut expected = b"frame".to_vec();
    expected.extend(vec![9; h]);
    expected.extend([10, 11, 12]);
    expected.extend(vec![9; h]);
    expected.extend([50, 51]);
    assert_eq!(wire, expected);
    assert_eq!(*hooks.written.lock().unwrap(), [WriteBatchId(4)]);
    out.finish(WriteEnd::Closed);
}

/// A writer of a link whose peer may pull (`placement` says whether it does), with a lookahead
/// of 64 bytes (no staging slots, pieces of at most 16 bytes), and what the test watches.
struct PullRig {
    out: Outbound,
    hooks: Arc<Recorder>,
    queue: Arc<JobQueue>,
    backlog: Arc<Backlog>,
    acks: Arc<PullAcks>,
}

fn pull_rig(placement: Arc<PeerPlacement>) -> PullRig {
    let hooks = Arc::new(Recorder::default());
    let queue = Arc::new(JobQueue::new());
    let backlog = Arc::new(Backlog::default());
    let acks = Arc::new(PullAcks::default());
    let out = Outbound::new(
        PeerId(1),
        (queue.clone(), backlog.clone()),
        hooks.clone(),
        Arc::new(StatCells::default()),
        &TcpConfig {
            socket_write_bytes: 64,
            staging_slot_bytes: 0,
            max_piece_bytes: 16,
            ..TcpConfig::default()
        },
    )
    .acked_by(Some((acks.clone(), placement)));
    PullRig {
        out,
        hooks,
        queue,
        backlog,
        acks,
    }
}

#[test]
fn pulled_pieces_go_out_as_header_and_source_and_complete_only_on_acknowledgement() {
    use crate::peer_copy::{Source, SOURCE_LEN};
    let src = Registered::Host(MemoryRegion::zeroed(1 << 10));
    let PullRig {
        mut out,
        hooks,
        queue,
        backlog,
        acks,
    } = pull_rig(PeerPlacement::placed(Placement::Source));
    let h = kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
    let pulled = |tag: u8, off: u64| {
        let mut p = Piece::new(
            [tag; kvpipe_core::wire::DATA_WRITE_FRAME_LEN],
            &src,
            off,
            40,
        )
        .unwrap();
        p.source = Some(
            Source {
                region: RegionId(1),
                offset: off,
            }
            .encode(),
        );
        p
    };
    let pieces = (0..4u8).map(|i| pulled(i + 1, 40 * u64::from(i))).collect();
    assert!(backlog.push(tallied(9, pieces)));
    queue.poke();
    // Two pieces make the lookahead; the others stay in the backlog while these two are
    // not acknowledged, however fast the stream takes them.
    let wire = drive(&mut out, usize::MAX);
    assert_eq!(wire.len(), 2 * (h + SOURCE_LEN));
    for (i, record) in wire.chunks(h + SOURCE_LEN).enumerate() {
        assert_eq!(record[..h], vec![i as u8 + 1; h][..]);
        let source = Source::decode(record[h..].try_into().unwrap()).unwrap();
        assert_eq!(source.offset, 40 * i as u64);
    }
    assert_eq!(backlog.len(), 2);
    assert_eq!(acks.unacked_bytes(), 80);
    assert!(
        hooks.written.lock().unwrap().is_empty(),
        "written is not done"
    );
    // Acknowledged: the writer takes the next two (the reader would wake it).
    assert!(acks.acked(2).unwrap().batches.is_empty());
    assert_eq!(drive(&mut out, usize::MAX).len(), 2 * (h + SOURCE_LEN));
    assert_eq!(backlog.len(), 0);
    assert!(hooks.written.lock().unwrap().is_empty());
    // The batch completes with its last acknowledgement (reported by the reader).
    assert_eq!(acks.acked(2).unwrap().batches, [WriteBatchId(9)]);
    out.finish(WriteEnd::Closed);
}

#[test]
fn a_link_placed_on_the_sockets_after_its_offer_reports_pieces_once_written() {
    let src = Registered::Host(MemoryRegion::zeroed(1 << 10));
    let placement = PeerPlacement::pending();
    let PullRig {
        mut out,
        hooks,
        queue,
        backlog,
        acks,
    } = pull_rig(placement.clone());
    // Nothing decided yet: frames go out as on any connection.
    queue.push(Job::Frame(bytes::Bytes::from_static(b"hello")));
    assert_eq!(drive(&mut out, usize::MAX), b"hello");
    // The peer declined: the sockets, the payload written, the batch reported once written.
    placement.decide(Decision::Placed(Placement::Socket));
    let h = kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
    let pieces = (0..2u8)
        .map(|i| {
            Piece::new(
                [i + 1; kvpipe_core::wire::DATA_WRITE_FRAME_LEN],
                &src,
                40 * u64::from(i),
                40,
            )
            .unwrap()
        })
        .collect();
    assert!(backlog.push(tallied(5, pieces)));
    queue.poke();
    assert_eq!(drive(&mut out, usize::MAX).len(), 2 * (h + 40));
    assert_eq!(*hooks.written.lock().unwrap(), [WriteBatchId(5)]);
    assert_eq!(acks.unacked_bytes(), 0);
    out.finish(WriteEnd::Closed);
}

/// Drives `out` until it waits or closes, writing at most `calls` write calls in full;
/// returns the bytes written.
fn drive(out: &mut Outbound, calls: usize) -> Vec<u8> {
    let mut wire = Vec::new();
    for _ in 0..calls {
        if out.next() != Next::Write {
            break;
        }
        let bytes = concat(&out.slices());
        out.written(bytes.len());
        wire.extend(bytes);
    }
    wire
}

#[test]
fn writers_of_one_peer_take_pieces_as_their_streams_run_low_and_the_last_one_reports() {
    let src = Registered::Host(MemoryRegion::from_vec((0..200u8).collect()));
    let hooks = Arc::new(Recorder::default());
    let backlog = Arc::new(Backlog::default());
    let writer = || {
        let queue = Arc::new(JobQueue::new());
        let out = Outbound::new(
            PeerId(1),
            (queue.clone(), backlog.clone()),
            hooks.clone(),
            Arc::new(StatCells::default()),
            &TcpConfig {
                socket_write_bytes: 10,
                staging_slots: 2,
                staging_slot_bytes: 4,
                ..TcpConfig::default()
            },
        );
        (out, queue)
    };
    let (mut fast, fast_queue) = writer();
    let (mut slow, slow_queue) = writer();
    let h = kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
    let piece = |i: u8| {
        Piece::new(
            [i; kvpipe_core::wire::DATA_WRITE_FRAME_LEN],
            &src,
            10 * u64::from(i),
            10,
        )
        .unwrap()
    };
    assert!(backlog.push(tallied(7, (0..6).map(piece).collect())));
    fast_queue.poke();
    slow_queue.poke();
    // The slow writer takes what one write call needs, and stalls.
    assert_eq!(slow.next(), Next::Write);
    let held = 6 - backlog.len();
    assert!((1..6).contains(&held), "{held}");
    // The fast one writes every other piece, taking each as its stream runs low.
    let fast_wire = drive(&mut fast, usize::MAX);
    assert_eq!(fast_wire.len(), (6 - held) * (h + 10));
    assert_eq!(backlog.len(), 0);
    assert!(
        hooks.written.lock().unwrap().is_empty(),
        "the slow writer's pieces are left"
    );
    // The slow writer's pieces go out: the last byte of the batch reports it, once.
    let slow_wire = drive(&mut slow, usize::MAX);
    assert_eq!(slow_wire.len(), held * (h + 10));
    assert_eq!(*hooks.written.lock().unwrap(), [WriteBatchId(7)]);
    // Every piece went out once, header then payload, on one stream or the other.
    let mut seen: Vec<u8> = fast_wire
        .chunks(h + 10)
        .chain(slow_wire.chunks(h + 10))
        .map(|p| {
            let i = p[0];
            assert_eq!(&p[h..], &(10 * i..10 * i + 10).collect::<Vec<_>>()[..]);
            i
        })
        .collect();
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3, 4, 5]);
    assert_eq!(fast.next(), Next::Wait);
    // An orderly close writes out what the backlog still holds before the close.
    assert!(backlog.push(tallied(8, vec![piece(9)])));
    backlog.close();
    assert!(fast_queue.push(Job::Close));
    let wire = drive(&mut fast, usize::MAX);
    assert_eq!(wire.len(), h + 10);
    assert_eq!(fast.next(), Next::Close);
    assert_eq!(
        *hooks.written.lock().unwrap(),
        [WriteBatchId(7), WriteBatchId(8)]
    );
    fast.finish(WriteEnd::Closed);
    slow.finish(WriteEnd::Closed);
}

#[test]
fn a_poke_wakes_a_waiting_writer_and_an_abort_drops_the_backlog() {
    let queue = Arc::new(JobQueue::new());
    let backlog = Arc::new(Backlog::default());
    let mut out = Outbound::new(
        PeerId(1),
        (queue.clone(), backlog.clone()),
        Arc::new(Recorder::default()),
        Arc::new(StatCells::default()),
        &TcpConfig::default(),
    );
    assert_eq!(out.next(), Next::Wait);
    let waiter = {
        let queue = queue.clone();
        std::thread::spawn(move || queue.wait())
    };
    let src = Registered::Host(MemoryRegion::zeroed(64));
    let piece = Piece::new([0; kvpipe_core::wire::DATA_WRITE_FRAME_LEN], &src, 0, 64).unwrap();
    assert!(backlog.push(tallied(1, vec![piece])));
    queue.poke();
    waiter.join().unwrap();
    assert_eq!(out.next(), Next::Write);
    backlog.abort();
    queue.abort();
    assert_eq!(out.next(), Next::Stop);
    assert!(!backlog.push(Vec::new()));
}

#[test]
fn an_abort_stops_the_writer_and_refuses_later_jobs() {
    let queue = Arc::new(JobQueue::new());
    let mut out = Outbound::new(
        PeerId(1),
        (queue.clone(), Arc::default()),
        Arc::new(Recorder::default()),
        Arc::new(StatCells::default()),
        &TcpConfig::default(),
    );
    assert!(queue.push(Job::Frame(Bytes::from_static(b"x"))));
    queue.abort();
    queue.wait();
    assert_eq!(out.next(), Next::Stop);
    assert!(!queue.push(Job::Frame(Bytes::from_static(b"y"))));
}

#[cfg(feature = "cuda")]
mod device {
    use super::*;
    use crate::gpu::{fake, SendStaging, StagingSpec};
    use crate::memory::DeviceRegion;

    impl Outbound {
        /// The same writer staging device memory through `spec`.
        fn with_staging(mut self, spec: StagingSpec) -> Self {
            self.staging = SendStaging::new(spec);
            self
        }
    }

    fn writer(spec: StagingSpec, write_max: usize) -> (Outbound, Arc<JobQueue>, Arc<Recorder>) {
        let hooks = Arc::new(Recorder::default());
        let queue = Arc::new(JobQueue::new());
        let out = Outbound::new(
            PeerId(1),
            (queue.clone(), Arc::default()),
            hooks.clone(),
            Arc::new(StatCells::default()),
            &TcpConfig {
                socket_write_bytes: write_max,
                ..TcpConfig::default()
            },
        )
        .with_staging(spec);
        (out, queue, hooks)
    }

    fn header(tag: u8) -> [u8; kvpipe_core::wire::DATA_WRITE_FRAME_LEN] {
        [tag; kvpipe_core::wire::DATA_WRITE_FRAME_LEN]
    }

    /// "Device memory" (host bytes the fake GPU copies from) as a registered region.
    fn device_region(bytes: &[u8]) -> Registered {
        // SAFETY: the fake GPU treats device addresses as host addresses; `bytes` outlives
        // the test's writer.
        Registered::Device(unsafe {
            DeviceRegion::from_raw_parts(0, bytes.as_ptr() as u64, bytes.len())
        })
    }

    #[test]
    fn device_payloads_are_staged_ahead_and_written_only_once_copied() {
        let memory: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(3) | 1).collect();
        let dev = device_region(&memory);
        let host = Registered::Host(MemoryRegion::from_vec((100..120u8).collect()));
        let (spec, gpu) = fake::spec(8, 2);
        let (mut out, queue, hooks) = writer(spec, 7);
        let piece = |src: &Registered, tag, off, len| Piece::new(header(tag), src, off, len);
        assert!(queue.push(data(
            1,
            vec![
                piece(&dev, 1, 3, 20).unwrap(),
                piece(&host, 2, 0, 5).unwrap(),
                piece(&dev, 3, 40, 0).unwrap(),
            ]
        )));
        assert!(queue.push(data(2, vec![piece(&dev, 4, 40, 17).unwrap()])));
        assert!(queue.push(Job::Close));
        // Before a byte is written the ring is full, and the first slot's copy is done.
        assert_eq!(out.next(), Next::Write);
        assert_eq!(
            gpu.lock().unwrap().log,
            ["alloc 16", "d2h 8", "d2h 8", "done 8"]
        );
        let mut wire: Vec<u8> = Vec::new();
        let mut step = 0;
        loop {
            match out.next() {
                Next::Write => {
                    assert!(out.staging.staged_parts() <= 2);
                    let slices = out.slices();
                    let total: usize = slices.iter().map(|s| s.len()).sum();
                    assert!(total <= 7 && total > 0);
                    let n = total.saturating_sub(1).max(1);
                    wire.extend(&concat(&slices)[..n]);
                    out.written(n);
                    // Now and then every copy finishes at once (more is ready than the
                    // first slot).
                    step += 1;
                    if step % 3 == 0 {
                        gpu.lock().unwrap().complete_all();
                    }
                }
                Next::Close => break,
                other => panic!("{other:?}"),
            }
        }
        let mut expected = header(1).to_vec();
        expected.extend(&memory[3..23]);
        expected.extend(header(2));
        expected.extend(100..105u8);
        expected.extend(header(3));
        expected.extend(header(4));
        expected.extend(&memory[40..57]);
        assert_eq!(wire, expected);
        assert_eq!(
            *hooks.written.lock().unwrap(),
            [WriteBatchId(1), WriteBatchId(2)]
        );
        let st = gpu.lock().unwrap();
        // 20 bytes in 3 slots, 17 in 3: six copies, never more than the ring's two at once.
        assert_eq!(st.log.iter().filter(|l| l.starts_with("d2h")).count(), 6);
        assert!(st.most_pending <= 2);
        drop(st);
        out.finish(WriteEnd::Closed);
    }

    #[test]
    fn a_stopping_writer_waits_for_its_copies_before_it_reports() {
        let memory = vec![7u8; 64];
        let dev = device_region(&memory);
        let (spec, gpu) = fake::spec(8, 4);
        let (mut out, queue, _hooks) = writer(spec, 1 << 20);
        assert!(queue.push(data(1, vec![Piece::new(header(1), &dev, 0, 64).unwrap()])));
        assert_eq!(out.next(), Next::Write);
        assert_eq!(gpu.lock().unwrap().pending(), 3);
        out.finish(WriteEnd::Failed);
        assert_eq!(gpu.lock().unwrap().pending(), 0);
    }

    #[test]
    fn without_a_driver_a_device_piece_stops_the_writer() {
        let memory = vec![7u8; 64];
        let dev = device_region(&memory);
        let (mut out, queue, hooks) = writer(fake::no_driver(), 1 << 20);
        assert!(queue.push(data(1, vec![Piece::new(header(1), &dev, 0, 64).unwrap()])));
        assert_eq!(out.next(), Next::Stop);
        out.finish(WriteEnd::Failed);
        assert!(hooks.written.lock().unwrap().is_empty());
    }
}
