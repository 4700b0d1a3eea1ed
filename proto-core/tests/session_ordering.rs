//! Ordering rules: per (request, receiver) write batches and results leave in slice order; the
//! result of slice k only after its writes completed; `is_last` only after every earlier
//! slice's writes; a late registration replays every queued slice in order, exactly once.

mod session_support;

use kvpipe_core::session::{Event, Output};
use kvpipe_core::wire::{Frame, KvResult, TransferStatus};
use kvpipe_core::{RequestId, SenderSliceId};
use session_support::*;

const R: RequestId = RequestId(7);

fn results(net: &Net) -> Vec<KvResult> {
    net.frames(Side::Sender(0))
        .into_iter()
        .filter_map(|f| match f {
            Frame::KvResult(r) => Some(r),
            _ => None,
        })
        .collect()
}

fn batches(net: &Net) -> Vec<SenderSliceId> {
    net.log
        .iter()
        .filter_map(|(_, o)| match o {
            Output::ExecuteWrites { slice, .. } => Some(*slice),
            _ => None,
        })
        .collect()
}

/// Three chunks of 8 tokens (2 blocks each) of a 24-token prompt.
fn three_chunks(net: &mut Net, source: &mut TestSource) {
    net.submit(0, R, chunk(0, 8, 24, false), source);
    net.submit(0, R, chunk(8, 16, 24, false), source);
    net.submit(0, R, chunk(16, 24, 24, true), source);
}

#[test]
fn batches_and_results_leave_in_slice_order() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 6);
    net.register(0, registration(R, 24, &[0]));
    net.open(0, send_request(R, &[0]));
    three_chunks(&mut net, &mut source);
    assert_eq!(batches(&net), [0, 1, 2].map(SenderSliceId));
    let r = results(&net);
    assert_eq!(
        r.iter().map(|r| r.sender_slice).collect::<Vec<_>>(),
        [0, 1, 2].map(SenderSliceId)
    );
    assert_eq!(
        r.iter().map(|r| r.is_last).collect::<Vec<_>>(),
        [false, false, true]
    );
    assert!(r.iter().all(|r| r.status == TransferStatus::Success));
    assert!(r.iter().all(|r| r.bytes_written == 2 * BLOCK_BYTES));
    // Each slice's batch leaves before its result.
    for k in 0..3u32 {
        let batch = net
            .position(|(_, o)| matches!(o, Output::ExecuteWrites { slice, .. } if slice.0 == k))
            .unwrap();
        let result = net
            .position(|(_, o)| matches!(o, Output::Transmit { frame: Frame::KvResult(r), .. } if r.sender_slice.0 == k))
            .unwrap();
        assert!(batch < result, "slice {k}");
    }
}

#[test]
fn result_of_a_slice_waits_for_its_writes() {
    let (mut net, mut source) = Net::held_pair(R, 24);
    net.submit(0, R, chunk(0, 8, 24, false), &mut source);
    assert_eq!(net.held.len(), 1);
    assert!(
        results(&net).is_empty(),
        "no result before the writes completed"
    );
    net.complete_held(0);
    assert_eq!(results(&net).len(), 1);
    assert_eq!(results(&net)[0].sender_slice, SenderSliceId(0));
}

#[test]
fn later_slice_completing_first_waits_for_the_earlier_result() {
    let (mut net, mut source) = Net::held_pair(R, 24);
    three_chunks(&mut net, &mut source);
    assert_eq!(net.held.len(), 3);
    // Complete slices 2 (the last) and 1 before 0.
    net.complete_held(2);
    net.complete_held(1);
    assert!(
        results(&net).is_empty(),
        "is_last and slice 1 wait for slice 0's writes"
    );
    net.complete_held(0);
    let r = results(&net);
    assert_eq!(
        r.iter()
            .map(|r| (r.sender_slice.0, r.is_last))
            .collect::<Vec<_>>(),
        [(0, false), (1, false), (2, true)]
    );
}

#[test]
fn is_last_waits_for_every_earlier_slice() {
    let (mut net, mut source) = Net::held_pair(R, 24);
    three_chunks(&mut net, &mut source);
    net.aux(0, R);
    net.complete_held(2);
    net.complete_held(0);
    let r = results(&net);
    assert_eq!(r.len(), 1, "only slice 0 may be reported");
    assert!(!r.iter().any(|r| r.is_last));
    assert!(!net
        .events(Side::Sender(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { .. })));
    net.complete_held(0);
    assert_eq!(results(&net).last().map(|r| r.is_last), Some(true));
}

#[test]
fn late_registration_replays_queued_slices_in_order_exactly_once() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 6);
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 24, false), &mut source);
    net.submit(0, R, chunk(8, 16, 24, false), &mut source);
    assert!(
        batches(&net).is_empty(),
        "nothing is written before the registration"
    );
    // The registration arrives; before the sender's outputs are drained, a new chunk comes.
    let now = net.now;
    net.receivers[0]
        .register(now, registration(R, 24, &[0]))
        .unwrap();
    // Deliver the registration frame by hand, then submit the next chunk before pumping.
    let mut reg_frame = None;
    while let Some(o) = net.receivers[0].poll_output() {
        if let Output::Transmit {
            frame: f @ Frame::RecvRegistration(_),
            ..
        } = &o
        {
            reg_frame = Some(f.clone());
        }
        net.log.push((Side::Receiver(0), o));
    }
    net.senders[0]
        .handle_input(kvpipe_core::session::SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&reg_frame.unwrap()).unwrap(),
            },
        })
        .unwrap();
    let last = net.senders[0]
        .submit_chunk(now, R, chunk(16, 24, 24, true), &mut source)
        .unwrap();
    assert_eq!(last.slice(), Some(SenderSliceId(2)));
    net.pump();
    assert_eq!(batches(&net), [0, 1, 2].map(SenderSliceId));
    let r = results(&net);
    assert_eq!(
        r.iter().map(|r| r.sender_slice.0).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // The block source was asked once per chunk, for that chunk's window only.
    assert_eq!(
        source
            .queries
            .iter()
            .map(|q| (q.2, q.3))
            .collect::<Vec<_>>(),
        [(0, 2), (2, 4), (4, 6)]
    );
}

#[test]
fn duplicate_registration_replays_nothing() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 6);
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 24, false), &mut source);
    net.register(0, registration(R, 24, &[0]));
    let reg = net
        .frames(Side::Receiver(0))
        .into_iter()
        .find(|f| matches!(f, Frame::RecvRegistration(_)))
        .unwrap();
    let now = net.now;
    net.senders[0]
        .handle_input(kvpipe_core::session::SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&reg).unwrap(),
            },
        })
        .unwrap();
    net.pump();
    assert_eq!(batches(&net), [SenderSliceId(0)]);
    assert_eq!(net.senders[0].counters().duplicates, 1);
}

#[test]
fn a_chunk_that_completes_no_block_sends_nothing() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 3);
    net.register(0, registration(R, 10, &[0]));
    net.open(0, send_request(R, &[0]));
    // Tokens [0, 3) complete no block of 4.
    let id = net.submit(0, R, chunk(0, 3, 10, false), &mut source);
    assert_eq!(id, None);
    assert!(batches(&net).is_empty() && results(&net).is_empty());
    assert!(
        source.queries.is_empty(),
        "a chunk that sends nothing does not query the cache"
    );
    // The next chunk picks the block up: [0, 2) after tokens [3, 9).
    let id = net.submit(0, R, chunk(3, 9, 10, false), &mut source);
    assert_eq!(id, Some(SenderSliceId(0)));
    net.submit(0, R, chunk(9, 10, 10, true), &mut source);
    assert_eq!(
        source
            .queries
            .iter()
            .map(|q| (q.2, q.3))
            .collect::<Vec<_>>(),
        [(0, 2), (2, 3)]
    );
}

#[test]
fn registrations_before_open_are_held_and_bounded() {
    let mut net = Net::new(1, 1);
    let mut cfg = sender_config(0);
    cfg.max_pending_registrations = 1;
    net.senders[0] = kvpipe_core::Sender::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    net.register(0, registration(RequestId(1), 8, &[0]));
    net.register(0, registration_from(RequestId(2), 8, &[0], 600));
    // The second registration found no room: the receiver is told at once.
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Cancelled {
            request: RequestId(2),
            ..
        }
    )));
    // The first is adopted when the engine opens the request.
    net.open(0, send_request(RequestId(1), &[0]));
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::Registered {
            request: RequestId(1),
            ..
        }
    )));
    let mut source = TestSource::with(RequestId(1), 100, 2);
    net.submit(0, RequestId(1), chunk(0, 8, 8, true), &mut source);
    net.aux(0, RequestId(1));
    assert_eq!(
        net.receivers[0].phase(RequestId(1)),
        Some(kvpipe_core::session::state::RecvPhase::Completed)
    );
}
