//! The receiver's side of the transport contract: admission of data writes, results held until
//! their bytes landed, quiesce after every admitted write finished, and replay of recorded
//! inputs.

mod session_support;

use kvpipe_core::session::state::RecvPhase;
use kvpipe_core::session::{
    Admission, Event, Output, ProtocolError, ReceiverInput, TransportInput, WriteRefusal,
    WriteTicket,
};
use kvpipe_core::wire::{DataWrite, Frame, TransferStatus};
use kvpipe_core::{GrantId, Receiver, RegionId, RequestId};
use session_support::*;

const R: RequestId = RequestId(5);

/// A connected pair with `R` registered (16 tokens, blocks 500..504) and opened, one chunk of
/// 8 tokens submitted and its batch held by the test.
fn one_held_batch() -> Net {
    let (net, _) = Net::first_chunk_held(R);
    assert_eq!(net.held.len(), 1);
    net
}

fn header(net: &Net, region: u32, offset: u64, len: u64) -> DataWrite {
    net.held[0].headers.frame(RegionId(region), offset, len)
}

#[test]
fn admission_applies_only_granted_non_overlapping_writes() {
    let mut net = one_held_batch();
    let now = net.now;
    let ok = header(&net, 2, 500 * BLOCK_BYTES, BLOCK_BYTES);
    let Admission::Apply {
        ticket,
        region,
        offset,
        len,
    } = net.receivers[0].admit_write(now, tx_peer(0), &ok)
    else {
        panic!("a granted write is applied")
    };
    assert_eq!(
        (region, offset, len),
        (RegionId(2), 500 * BLOCK_BYTES, BLOCK_BYTES)
    );
    assert_eq!(net.receivers[0].writes_in_flight(), 1);
    // The same bytes again while the first write is in flight: refused, never two writers.
    let again = header(&net, 2, 500 * BLOCK_BYTES + 8, 8);
    assert!(matches!(
        net.receivers[0].admit_write(now, tx_peer(0), &again),
        Admission::Refuse(WriteRefusal::Overlap { .. })
    ));
    // The refusal failed the request and asks to close the writer; the memory stays pinned
    // while the admitted write is in flight and until the transport reports the writer gone
    // (frames from a peer being closed are no longer taken as its word).
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Stopping));
    let mut outputs = Vec::new();
    while let Some(o) = net.receivers[0].poll_output() {
        outputs.push(o);
    }
    assert!(outputs
        .iter()
        .any(|o| matches!(o, Output::ClosePeer { .. })));
    let cancel = Frame::Cancel(kvpipe_core::wire::Cancel {
        request: R,
        reason: kvpipe_core::wire::CancelReason::Failure,
    });
    net.receivers[0]
        .handle_transport(
            now,
            TransportInput::FrameReceived {
                peer: tx_peer(0),
                bytes: cancel.to_bytes().unwrap(),
            },
        )
        .unwrap();
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Stopping));
    net.write_landed(0, ticket);
    assert_eq!(net.receivers[0].writes_in_flight(), 0);
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Stopping));
    net.receivers[0]
        .handle_transport(now, TransportInput::PeerDisconnected { peer: tx_peer(0) })
        .unwrap();
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

/// A write of no bytes where an admitted write starts takes nothing of it: once the empty
/// write is reported finished, the other write's bytes are still held, and a write over them is
/// still refused (a peer could otherwise free bytes still being written by naming them with
/// an empty write).
#[test]
fn an_empty_write_does_not_release_the_bytes_of_a_write_in_flight() {
    let mut net = one_held_batch();
    let now = net.now;
    let at = 500 * BLOCK_BYTES;
    let first = header(&net, 2, at, BLOCK_BYTES);
    let Admission::Apply { .. } = net.receivers[0].admit_write(now, tx_peer(0), &first) else {
        panic!("a granted write is applied")
    };
    let empty = header(&net, 2, at, 0);
    let ticket = match net.receivers[0].admit_write(now, tx_peer(0), &empty) {
        Admission::Apply { ticket, len, .. } => {
            assert_eq!(len, 0);
            ticket
        }
        other => panic!("an empty write inside the grant is admitted, got {other:?}"),
    };
    net.write_landed(0, ticket);
    assert_eq!(net.receivers[0].writes_in_flight(), 1);
    let over = header(&net, 2, at + 8, 8);
    assert!(matches!(
        net.receivers[0].admit_write(now, tx_peer(0), &over),
        Admission::Refuse(WriteRefusal::Overlap { .. })
    ));
}

#[test]
fn every_refusal_names_its_reason() {
    let mut net = one_held_batch();
    let now = net.now;
    let grant = net.held[0].headers.grant();
    let good = DataWrite {
        request: R,
        grant,
        region: RegionId(2),
        offset: 500 * BLOCK_BYTES,
        len: BLOCK_BYTES,
    };
    type Expect = fn(&WriteRefusal) -> bool;
    // (A header that does not decode never reaches admission: the stream reader refuses it as
    // bytes that are no frame; `kvpipe_core::stream`'s tests.)
    let cases: Vec<(DataWrite, Expect)> = vec![
        (
            DataWrite {
                request: RequestId(77),
                ..good
            },
            |r| matches!(r, WriteRefusal::UnknownRequest(_)),
        ),
        (
            DataWrite {
                grant: GrantId(grant.0 ^ 1),
                ..good
            },
            |r| matches!(r, WriteRefusal::WrongGrant { .. }),
        ),
        (
            DataWrite {
                offset: 504 * BLOCK_BYTES,
                ..good
            },
            |r| matches!(r, WriteRefusal::OutsideGrant { .. }),
        ),
        (
            DataWrite {
                region: RegionId(9),
                ..good
            },
            |r| matches!(r, WriteRefusal::OutsideGrant { .. }),
        ),
        (
            DataWrite {
                offset: u64::MAX - 4,
                len: 8,
                ..good
            },
            |r| matches!(r, WriteRefusal::OutsideGrant { .. }),
        ),
    ];
    for (write, expected) in cases {
        // A fresh receiver for each case: a refusal closes the peer.
        let mut net = one_held_batch();
        let admission = net.receivers[0].admit_write(now, tx_peer(0), &write);
        match admission {
            Admission::Refuse(reason) => assert!(expected(&reason), "{reason:?}"),
            other => panic!("{other:?} for {write}"),
        }
        assert_eq!(net.receivers[0].counters().writes_refused, 1);
        assert_eq!(net.receivers[0].writes_in_flight(), 0);
    }
    // A peer the receiver never connected: a driver bug, still never applied.
    assert!(matches!(
        net.receivers[0].admit_write(now, tx_peer(7), &good),
        Admission::Refuse(_)
    ));
}

#[test]
fn results_wait_until_their_bytes_landed() {
    let mut net = one_held_batch();
    let h = net.held.remove(0);
    // The sender learns its batch is complete before the receiving side applied a byte (data
    // and results travel on different connections): the result must wait.
    let now = net.now;
    net.senders[0]
        .handle_transport(now, TransportInput::WritesCompleted { batch: h.batch })
        .unwrap();
    net.pump();
    assert!(net
        .frames(Side::Sender(0))
        .iter()
        .any(|f| matches!(f, Frame::KvResult(r) if r.status == TransferStatus::Success)));
    assert_eq!(net.receivers[0].counters().bytes_written, 0, "held");
    // The bytes land: the result is taken.
    net.land(0, 0, &h.plan, &h.headers);
    net.pump();
    assert_eq!(net.receivers[0].counters().bytes_written, h.bytes);
    assert_eq!(net.receivers[0].counters().bytes_landed, h.bytes);
}

#[test]
fn a_stopped_session_takes_held_confirmations_at_once() {
    let mut net = one_held_batch();
    let h = net.held.remove(0);
    let now = net.now;
    net.senders[0]
        .handle_transport(now, TransportInput::WritesCompleted { batch: h.batch })
        .unwrap();
    net.pump();
    // The engine on the decode side cancels while the result waits for its data; the data
    // never lands (the sender stops). The writer's cancel confirms it stopped: no fence.
    net.receivers[0].cancel(now, R).unwrap();
    net.pump();
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    assert_eq!(net.receivers[0].counters().peers_closed, 0);
}

#[test]
fn late_writes_of_an_ended_request_are_discarded() {
    let mut net = one_held_batch();
    let h = net.held[0].clone();
    let now = net.now;
    net.receivers[0].cancel(now, R).unwrap();
    net.pump();
    let admissions = net.land(0, 0, &h.plan, &h.headers);
    assert!(admissions
        .iter()
        .all(|a| matches!(a, Admission::Discard { .. })));
    assert!(net.receivers[0].counters().late_writes > 0);
}

#[test]
fn the_sender_refuses_data_writes() {
    let mut net = one_held_batch();
    let now = net.now;
    let bytes = header(&net, 2, 500 * BLOCK_BYTES, BLOCK_BYTES);
    assert_eq!(
        net.senders[0].admit_write(now, rx_peer(0), &bytes),
        Admission::Refuse(WriteRefusal::NotAccepted)
    );
    net.pump();
    assert!(!net.senders[0].is_peer_ready(rx_peer(0)));
}

#[test]
fn a_write_cut_short_does_not_count_as_landed() {
    let mut net = one_held_batch();
    let now = net.now;
    let bytes = header(&net, 2, 500 * BLOCK_BYTES, BLOCK_BYTES);
    let Admission::Apply { ticket, .. } = net.receivers[0].admit_write(now, tx_peer(0), &bytes)
    else {
        panic!()
    };
    net.receivers[0]
        .handle_transport(
            now,
            TransportInput::WriteFinished {
                ticket,
                landed: false,
            },
        )
        .unwrap();
    assert_eq!(net.receivers[0].counters().bytes_landed, 0);
    // Reported twice, or never issued: a late report is harmless, an unknown one a usage error.
    net.write_landed(0, ticket);
    assert!(net.receivers[0]
        .handle_transport(
            now,
            TransportInput::WriteFinished {
                ticket: WriteTicket(999),
                landed: true
            }
        )
        .is_err());
}

#[test]
fn recorded_inputs_replay_into_a_fresh_receiver() {
    let mut net = Net::new(1, 1);
    net.receivers[0].record_inputs(true);
    net.connect(0, 0);
    net.pump();
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    net.aux(0, R);
    let inputs = net.receivers[0].take_recorded_inputs();
    assert!(inputs.iter().any(|i| matches!(
        i,
        ReceiverInput::Transport {
            input: TransportInput::WriteArrived { .. },
            ..
        }
    )));
    let original: Vec<Output> = net
        .log
        .iter()
        .filter(|(side, _)| *side == Side::Receiver(0))
        .map(|(_, o)| o.clone())
        .collect();
    let mut fresh = Receiver::new(receiver_config(0)).unwrap();
    let mut replayed = Vec::new();
    for input in inputs {
        fresh.handle_input(input).unwrap();
        while let Some(o) = fresh.poll_output() {
            replayed.push(o);
        }
    }
    assert_eq!(replayed, original);
    assert_eq!(fresh.phase(R), Some(RecvPhase::Completed));
}

/// Frames a hostile writer sends without having written anything.
fn lie(net: &mut Net, bytes_written: u64) {
    let now = net.now;
    let frames = [
        Frame::KvResult(kvpipe_core::wire::KvResult {
            request: R,
            sender_slice: kvpipe_core::SenderSliceId(0),
            receiver_slice: kvpipe_core::ReceiverSliceId(0),
            is_last: true,
            status: TransferStatus::Success,
            bytes_written,
        }),
        Frame::AuxResult(kvpipe_core::wire::AuxResult {
            request: R,
            status: TransferStatus::Success,
            data: Default::default(),
        }),
    ];
    for frame in frames {
        net.receivers[0]
            .handle_transport(
                now,
                TransportInput::FrameReceived {
                    peer: tx_peer(0),
                    bytes: frame.to_bytes().unwrap(),
                },
            )
            .unwrap();
    }
    net.pump();
}

#[test]
fn a_writer_that_reports_what_it_never_wrote_does_not_complete_the_request() {
    // Reported nothing, wrote nothing: the registration's 512 bytes never moved.
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    lie(&mut net, 0);
    let events = net.events(Side::Receiver(0));
    assert!(
        !events.iter().any(|e| matches!(e, Event::Completed { .. })),
        "{events:?}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        Event::ProtocolViolation {
            error: ProtocolError::BytesMismatch {
                expected: 512,
                reported: 0,
                landed: Some(0),
                ..
            },
            ..
        }
    )));
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            ..
        }
    )));
}

#[test]
fn reported_bytes_that_never_landed_wait_for_their_data() {
    // Reported all 512 bytes, wrote none: the result waits for data that never comes, and the
    // request fails at its deadline instead of completing.
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    lie(&mut net, 512);
    net.advance(kvpipe_core::Duration::from_secs(6));
    let events = net.events(Side::Receiver(0));
    assert!(!events.iter().any(|e| matches!(e, Event::Completed { .. })));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

/// One write of the batch-admission model: inside the grant (a block, an offset in it, a
/// length, so writes overlap, repeat and leave gaps), or refused for a reason.
#[derive(Clone, Copy, Debug)]
enum ModelWrite {
    Granted { block: u64, at: u64, len: u64 },
    WrongGrant,
    UnknownRequest,
    OutsideGrant,
}

/// One step of the model: a batch of writes asked about, or admitted writes reported finished.
#[derive(Clone, Debug)]
enum ModelStep {
    Admit(Vec<ModelWrite>),
    /// The oldest `count` writes in flight (or, `newest_first`, the newest), then an unknown
    /// ticket when `unknown`.
    Finish {
        count: usize,
        newest_first: bool,
        landed: bool,
        unknown: bool,
    },
    /// The decode engine cancels the request: later writes to it are discarded, not admitted.
    Cancel,
}

fn model_write() -> impl proptest::strategy::Strategy<Value = ModelWrite> {
    use proptest::prelude::*;
    prop_oneof![
        12 => (0u64..4, prop::sample::select(vec![0u64, 8, 64]), prop::sample::select(vec![0u64, 8, 56, 64]))
            .prop_map(|(block, at, len)| ModelWrite::Granted { block, at, len }),
        1 => Just(ModelWrite::WrongGrant),
        1 => Just(ModelWrite::UnknownRequest),
        1 => Just(ModelWrite::OutsideGrant),
    ]
}

fn model_step() -> impl proptest::strategy::Strategy<Value = ModelStep> {
    use proptest::prelude::*;
    prop_oneof![
        3 => prop::collection::vec(model_write(), 0..10).prop_map(ModelStep::Admit),
        2 => (0usize..6, any::<bool>(), prop::bool::weighted(0.85), prop::bool::weighted(0.1))
            .prop_map(|(count, newest_first, landed, unknown)| ModelStep::Finish {
                count,
                newest_first,
                landed,
                unknown,
            }),
        1 => Just(ModelStep::Cancel),
    ]
}

fn model_header(net: &Net, w: ModelWrite) -> DataWrite {
    let good = header(net, 2, 500 * BLOCK_BYTES, BLOCK_BYTES);
    match w {
        ModelWrite::Granted { block, at, len } => DataWrite {
            offset: (500 + block) * BLOCK_BYTES + at,
            len,
            ..good
        },
        ModelWrite::WrongGrant => DataWrite {
            grant: GrantId(good.grant.0 ^ 1),
            ..good
        },
        ModelWrite::UnknownRequest => DataWrite {
            request: RequestId(77),
            ..good
        },
        ModelWrite::OutsideGrant => DataWrite {
            offset: 504 * BLOCK_BYTES,
            ..good
        },
    }
}

proptest::proptest! {
    /// `admit_writes` and `writes_finished` answer, change and record exactly what
    /// `admit_write` and `WriteFinished` of each write in turn do (up to the first refusal of a
    /// batch, and the first refused ticket), whatever the writes: the same admissions, usage
    /// errors, counters, phases, outputs and recorded inputs after every step.
    #[test]
    fn batch_admission_is_admission_of_each_write_in_turn(
        steps in proptest::collection::vec(model_step(), 1..24),
        recording: bool,
    ) {
        let (mut one, mut batch) = (one_held_batch(), one_held_batch());
        one.receivers[0].record_inputs(recording);
        batch.receivers[0].record_inputs(recording);
        let now = one.now;
        let mut in_flight: Vec<WriteTicket> = Vec::new();
        let (mut scratch, mut answers) = (Vec::new(), Vec::new());
        for step in steps {
            match step {
                ModelStep::Admit(writes) => {
                    scratch.clear();
                    scratch.extend(writes.iter().map(|&w| model_header(&one, w)));
                    let mut expected = Vec::new();
                    for w in &scratch {
                        let a = one.receivers[0].admit_write(now, tx_peer(0), w);
                        let refused = matches!(a, Admission::Refuse(_));
                        expected.push(a);
                        if refused {
                            break;
                        }
                    }
                    answers.clear();
                    batch.receivers[0].admit_writes(now, tx_peer(0), &scratch, &mut answers);
                    proptest::prop_assert_eq!(&answers, &expected);
                    in_flight.extend(expected.iter().filter_map(|a| match a {
                        Admission::Apply { ticket, .. } => Some(*ticket),
                        _ => None,
                    }));
                }
                ModelStep::Finish { count, newest_first, landed, unknown } => {
                    let count = count.min(in_flight.len());
                    let mut tickets: Vec<WriteTicket> = if newest_first {
                        in_flight.split_off(in_flight.len() - count).into_iter().rev().collect()
                    } else {
                        in_flight.drain(..count).collect()
                    };
                    if unknown {
                        tickets.push(WriteTicket(1 << 40));
                    }
                    let expected = tickets.iter().try_for_each(|&ticket| {
                        one.receivers[0]
                            .handle_transport(now, TransportInput::WriteFinished { ticket, landed })
                    });
                    let got = batch.receivers[0].writes_finished(now, &tickets, landed);
                    proptest::prop_assert_eq!(got, expected);
                }
                ModelStep::Cancel => {
                    let expected = one.receivers[0].cancel(now, R);
                    proptest::prop_assert_eq!(batch.receivers[0].cancel(now, R), expected);
                }
            }
            let (a, b) = (&mut one.receivers[0], &mut batch.receivers[0]);
            proptest::prop_assert_eq!(a.counters(), b.counters());
            proptest::prop_assert_eq!(a.phase(R), b.phase(R));
            proptest::prop_assert_eq!(a.writes_in_flight(), b.writes_in_flight());
            let outputs = |r: &mut Receiver| std::iter::from_fn(|| r.poll_output()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(outputs(a), outputs(b));
        }
        proptest::prop_assert_eq!(
            one.receivers[0].take_recorded_inputs(),
            batch.receivers[0].take_recorded_inputs()
        );
    }
}
