//! Failure rules: a failed slice fails the request on both sides at once, naming both slice
//! ids; protocol errors fail the session and travel as a status; usage errors change nothing.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{
    Admission, Event, Output, ProtocolError, ReceiverInput, SenderInput, UsageError, WriteBatchId,
    WriteRefusal,
};
use kvpipe_core::wire::{Frame, KvResult, TransferStatus};
use kvpipe_core::{ReceiverSliceId, RequestId, SenderSliceId};
use session_support::*;

const R: RequestId = RequestId(11);

#[test]
fn failed_slice_fails_both_sides_at_once_naming_both_slices() {
    let (mut net, mut source) = Net::held_pair(R, 24);
    net.submit(0, R, chunk(0, 8, 24, false), &mut source);
    net.submit(0, R, chunk(8, 16, 24, false), &mut source);
    // Slice 1's writes fail while slice 0's are still in flight.
    net.fail_held(1, TransferStatus::WriteFailed);
    let expected = |peer| Event::Failed {
        request: R,
        cause: TransferStatus::WriteFailed,
        peer: Some(peer),
        sender_slice: Some(SenderSliceId(1)),
        receiver_slice: Some(ReceiverSliceId(0)),
    };
    assert!(net.events(Side::Sender(0)).contains(&expected(rx_peer(0))));
    // The receiver learned at once, before slice 0's writes were reported.
    assert!(net
        .events(Side::Receiver(0))
        .contains(&expected(tx_peer(0))));
    assert_eq!(net.held.len(), 1);
    // Both keep the blocks pinned: slice 0's batch may still be writing.
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Stopping));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Stopping));
    // Once the transport reports it, the sender sends its terminal result and both quiesce.
    net.complete_held(0);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    let terminal = net
        .frames(Side::Sender(0))
        .into_iter()
        .filter_map(|f| match f {
            Frame::KvResult(r) => Some(r),
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(
        terminal
            .iter()
            .map(|r| (r.status, r.is_last))
            .collect::<Vec<_>>(),
        [
            (TransferStatus::WriteFailed, false),
            (TransferStatus::WriteFailed, true)
        ]
    );
    assert_eq!(
        net.senders[0]
            .counters()
            .failures
            .get(TransferStatus::WriteFailed),
        1
    );
    assert_eq!(
        net.receivers[0]
            .counters()
            .failures
            .get(TransferStatus::WriteFailed),
        1
    );
}

#[test]
fn failure_reaches_every_receiver_of_the_request() {
    let mut net = Net::connected(1, 2);
    net.auto_complete = false;
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.register(1, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0, 1]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    assert_eq!(net.held.len(), 2);
    net.fail_held(0, TransferStatus::GrantViolation);
    for j in 0..2 {
        assert!(
            net.events(Side::Receiver(j)).iter().any(|e| matches!(
                e,
                Event::Failed {
                    cause: TransferStatus::GrantViolation,
                    sender_slice: Some(SenderSliceId(0)),
                    ..
                }
            )),
            "receiver {j}"
        );
    }
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    assert_eq!(net.receivers[1].phase(R), Some(RecvPhase::Stopping));
    net.complete_held(0);
    assert_eq!(net.receivers[1].phase(R), Some(RecvPhase::Quiesced));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
}

#[test]
fn result_for_an_unknown_slice_fails_the_session_as_a_protocol_error() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    let now = net.now;
    net.receivers[0]
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: tx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::KvResult(KvResult {
                    request: R,
                    sender_slice: SenderSliceId(0),
                    receiver_slice: ReceiverSliceId(77),
                    is_last: false,
                    status: TransferStatus::Success,
                    bytes_written: 0,
                }))
                .unwrap(),
            },
        })
        .unwrap();
    net.pump();
    let ev = net.events(Side::Receiver(0));
    assert!(ev.iter().any(|e| matches!(
        e,
        Event::ProtocolViolation {
            error: ProtocolError::UnknownSlice {
                got: ReceiverSliceId(77),
                ..
            },
            ..
        }
    )));
    assert!(ev.iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            ..
        }
    )));
    // The sender was told (a Cancel) so it stops and confirms.
    assert!(net
        .frames(Side::Receiver(0))
        .iter()
        .any(|f| matches!(f, Frame::Cancel(c) if c.request == R)));
    assert_eq!(net.receivers[0].counters().protocol_errors, 1);
}

#[test]
fn frames_about_unknown_requests_are_violations_without_side_effects() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    net.receivers[0]
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: tx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::KvResult(KvResult {
                    request: RequestId(404),
                    sender_slice: SenderSliceId(0),
                    receiver_slice: ReceiverSliceId(0),
                    is_last: true,
                    status: TransferStatus::Success,
                    bytes_written: 0,
                }))
                .unwrap(),
            },
        })
        .unwrap();
    net.pump();
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::ProtocolViolation {
            error: ProtocolError::UnknownRequest { .. },
            ..
        }
    )));
    assert_eq!(net.receivers[0].session_count(), 0);
    // The sender is told to stop whatever it does for that request.
    assert!(net
        .frames(Side::Receiver(0))
        .iter()
        .any(|f| matches!(f, Frame::Cancel(c) if c.request == RequestId(404))));
}

#[test]
fn registration_with_the_wrong_group_count_fails_the_request() {
    let mut net = Net::connected(1, 1);
    net.open(0, send_request(R, &[0]));
    let now = net.now;
    net.senders[0]
        .handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::RecvRegistration(
                    kvpipe_core::wire::RecvRegistration {
                        request: R,
                        slice: ReceiverSliceId(5),
                        prompt_len: 16,
                        grant: kvpipe_core::GrantId(1),
                        aux_capacity: 64,
                        groups: vec![],
                    },
                ))
                .unwrap(),
            },
        })
        .unwrap();
    net.pump();
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            receiver_slice: Some(ReceiverSliceId(5)),
            ..
        }
    )));
}

#[test]
fn usage_errors_change_nothing() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    let now = net.now;
    let s = &mut net.senders[0];
    assert_eq!(
        s.submit_chunk(now, R, chunk(0, 8, 16, false), &mut source),
        Err(UsageError::UnknownRequest(R))
    );
    s.open_request(now, send_request(R, &[0])).unwrap();
    assert_eq!(
        s.open_request(now, send_request(R, &[0])),
        Err(UsageError::DuplicateRequest(R))
    );
    assert_eq!(
        s.open_request(now, send_request(RequestId(2), &[])),
        Err(UsageError::NoPeers(RequestId(2)))
    );
    assert_eq!(
        s.open_request(now, send_request(RequestId(2), &[0, 0])),
        Err(UsageError::DuplicatePeer {
            request: RequestId(2),
            peer: rx_peer(0)
        })
    );
    // A chunk past the allocation is refused by the block source; nothing was created.
    assert!(matches!(
        s.submit_chunk(now, R, chunk(0, 20, 20, true), &mut source),
        Err(UsageError::BlockSource { .. })
    ));
    assert_eq!(s.counters().slices, 0);
    assert!(s
        .submit_chunk(now, R, chunk(0, 8, 16, false), &mut source)
        .unwrap()
        .slice()
        .is_some());
    assert_eq!(
        s.submit_chunk(now, R, chunk(4, 16, 16, true), &mut source),
        Err(UsageError::ChunkOutOfOrder {
            request: R,
            expected: 8,
            got: 4
        })
    );
    assert_eq!(
        s.submit_chunk(now, R, chunk(8, 12, 12, true), &mut source),
        Err(UsageError::PromptLenChanged {
            request: R,
            expected: 16,
            got: 12
        })
    );
    assert!(matches!(
        s.submit_chunk(now, R, chunk(8, 12, 16, true), &mut source),
        Err(UsageError::Geometry { .. })
    ));
    assert!(s
        .submit_chunk(now, R, chunk(8, 16, 16, true), &mut source)
        .unwrap()
        .slice()
        .is_some());
    assert_eq!(
        s.submit_chunk(now, R, chunk(16, 16, 16, true), &mut source),
        Err(UsageError::ChunkAfterLast(R))
    );
    assert_eq!(
        s.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::WritesCompleted {
                batch: WriteBatchId(999)
            }
        }),
        Err(UsageError::UnknownBatch(WriteBatchId(999)))
    );
    assert_eq!(
        s.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::WritesFailed {
                batch: WriteBatchId(0),
                status: TransferStatus::Success
            }
        }),
        Err(UsageError::FailureWithSuccessStatus(WriteBatchId(0)))
    );
    assert_eq!(s.retire(now, R), Err(UsageError::NotQuiesced(R)));
    assert_eq!(
        s.handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerConnected { peer: rx_peer(0) }
        }),
        Err(UsageError::PeerAlreadyConnected(rx_peer(0)))
    );
    assert_eq!(s.counters().slices, 2);
    assert_eq!(s.phase(R), Some(SendPhase::Finishing));
    while let Some(o) = s.poll_output() {
        assert!(!matches!(o, Output::Event(Event::Failed { .. })));
    }

    let r = &mut net.receivers[0];
    r.register(now, registration(R, 16, &[0])).unwrap();
    assert_eq!(
        r.register(now, registration(R, 16, &[0])),
        Err(UsageError::DuplicateRequest(R))
    );
    let mut bad = registration(RequestId(3), 16, &[0]);
    bad.groups.push(Default::default());
    assert_eq!(
        r.register(now, bad),
        Err(UsageError::GroupCountMismatch {
            request: RequestId(3),
            expected: 1,
            got: 2
        })
    );
    assert_eq!(r.session_count(), 1);
}

#[test]
fn refused_write_fails_both_sides_as_a_grant_violation() {
    let (mut net, mut source) = Net::held_pair(R, 24);
    net.submit(0, R, chunk(0, 8, 24, false), &mut source);
    // The writer's transport sends a data write outside the grant (block 500 + 100 was never
    // registered); the receiver refuses it.
    let held = net.held[0].clone();
    let header = held
        .headers
        .frame(kvpipe_core::RegionId(2), 600 * BLOCK_BYTES, BLOCK_BYTES);
    let now = net.now;
    let admission = net.receivers[0].admit_write(now, tx_peer(0), &header);
    assert!(
        matches!(
            admission,
            Admission::Refuse(WriteRefusal::OutsideGrant { request, .. }) if request == R
        ),
        "{admission:?}"
    );
    net.pump();
    assert!(net.events(Side::Receiver(0)).contains(&Event::Failed {
        request: R,
        cause: TransferStatus::GrantViolation,
        peer: Some(tx_peer(0)),
        sender_slice: None,
        receiver_slice: Some(ReceiverSliceId(0)),
    }));
    assert_eq!(
        net.receivers[0]
            .counters()
            .failures
            .get(TransferStatus::GrantViolation),
        1
    );
    assert_eq!(net.receivers[0].counters().writes_refused, 1);
    // The writer hears of it before the connection is closed; the close ends both sides'
    // sessions and hands the memory back once nothing can land.
    let cancel_at = net.position(|(side, o)| {
        *side == Side::Receiver(0)
            && matches!(o, Output::Transmit { frame: Frame::Cancel(c), .. } if c.request == R)
    });
    let close_at = net
        .position(|(side, o)| *side == Side::Receiver(0) && matches!(o, Output::ClosePeer { .. }));
    assert!(cancel_at.unwrap() < close_at.unwrap());
    assert!(net
        .events(Side::Sender(0))
        .iter()
        .any(|e| matches!(e, Event::Failed { request, .. } | Event::Cancelled { request, .. } if *request == R)));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn a_registration_whose_aux_slot_holds_no_aux_data_is_refused() {
    // Any aux data takes 16 bytes (two counts, two lengths): a smaller slot would refuse every
    // writer's aux data after the KV had moved.
    let mut net = Net::connected(1, 1);
    let now = net.now;
    for capacity in [0, 15] {
        let mut reg = registration(R, 16, &[0]);
        reg.aux_capacity = capacity;
        assert_eq!(
            net.receivers[0].register(now, reg),
            Err(UsageError::AuxSlotTooSmall {
                request: R,
                capacity,
                min: 16
            })
        );
        assert_eq!(net.receivers[0].session_count(), 0);
    }
    let mut reg = registration(R, 16, &[0]);
    reg.aux_capacity = 16;
    net.receivers[0].register(now, reg).unwrap();
}
