//! Behaviours the reference implementation tests that are easy to lose: one bad peer among
//! good ones, failures attributed to the same slice on both sides, quiescing exactly once,
//! degenerate requests, idempotent cancels and forgotten pending registrations.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{Event, Receiver, Sender, UsageError};
use kvpipe_core::wire::RejectReason;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{AnchoredRun, BlockId, ChunkSpec, Duration, RequestId, SenderSliceId};
use session_support::*;

fn quiesced_count(net: &Net, side: Side, request: RequestId) -> usize {
    net.events(side)
        .iter()
        .filter(|e| matches!(e, Event::Quiesced { request: r } if *r == request))
        .count()
}

#[test]
fn one_rejected_peer_fails_only_its_own_requests() {
    let mut net = Net::new(2, 1);
    let mut cfg = sender_config(1);
    cfg.local.compat_hash ^= 1;
    net.senders[1] = Sender::new(cfg).unwrap();
    let (good, bad) = (RequestId(1), RequestId(2));
    net.register(0, registration(good, 16, &[0]));
    net.register(0, registration_from(bad, 16, &[1], 600));
    net.connect(0, 0);
    net.connect(1, 0);
    net.pump();
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::PeerRejected {
            reason: RejectReason::CompatibilityMismatch,
            ..
        }
    )));
    let mut source = TestSource::with(good, 100, 4);
    net.open(0, send_request(good, &[0]));
    net.submit(0, good, chunk(0, 16, 16, true), &mut source);
    net.aux(0, good);
    assert_eq!(net.receivers[0].phase(good), Some(RecvPhase::Completed));
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed { request, cause: TransferStatus::PeerLost, .. } if *request == bad
    )));
}

#[test]
fn a_late_registration_that_cannot_be_planned_names_the_same_slice_on_both_sides() {
    // The receiver's slots are so large that block 2^24 lies past the 64-bit address range.
    let mut net = Net::new(1, 1);
    let mut cfg = receiver_config(0);
    cfg.local.groups[0].pools[0].slot_bytes = 1 << 40;
    net.receivers[0] = Receiver::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    let r = RequestId(3);
    let mut source = TestSource::with(r, 100, 4);
    net.open(0, send_request(r, &[0]));
    net.submit(0, r, chunk(0, 8, 16, false), &mut source);
    let mut reg = registration(r, 16, &[0]);
    reg.groups = vec![AnchoredRun::from_ids(
        0,
        &(0..4).map(|o| BlockId((1 << 24) + o)).collect::<Vec<_>>(),
    )];
    net.register(0, reg);
    let slice = |side| {
        net.events(side).iter().find_map(|e| match e {
            Event::Failed { sender_slice, .. } => Some(*sender_slice),
            _ => None,
        })
    };
    assert_eq!(slice(Side::Sender(0)), Some(Some(SenderSliceId(0))));
    assert_eq!(slice(Side::Receiver(0)), Some(Some(SenderSliceId(0))));
}

#[test]
fn a_cancel_then_a_failed_batch_quiesces_exactly_once() {
    let mut net = Net::connected(1, 1);
    net.auto_complete = false;
    let r = RequestId(4);
    let mut source = TestSource::with(r, 100, 4);
    net.register(0, registration(r, 16, &[0]));
    net.open(0, send_request(r, &[0]));
    net.submit(0, r, chunk(0, 8, 16, false), &mut source);
    let now = net.now;
    net.senders[0].cancel(now, r).unwrap();
    net.pump();
    assert_eq!(
        quiesced_count(&net, Side::Sender(0), r),
        0,
        "a batch is in flight"
    );
    net.fail_held(0, TransferStatus::WriteFailed);
    assert_eq!(quiesced_count(&net, Side::Sender(0), r), 1);
    assert_eq!(quiesced_count(&net, Side::Receiver(0), r), 1);
    net.advance(Duration::from_secs(5));
    assert_eq!(quiesced_count(&net, Side::Sender(0), r), 1);
    assert_eq!(quiesced_count(&net, Side::Receiver(0), r), 1);
}

#[test]
fn one_chunk_with_a_reused_prefix_is_one_whole_slice() {
    let mut net = Net::connected(1, 1);
    let r = RequestId(5);
    let mut source = TestSource::with(r, 100, 4);
    net.register(0, registration(r, 16, &[0]));
    net.open(0, send_request(r, &[0]));
    let spec = ChunkSpec {
        prepopulated_len: 10,
        ..chunk(10, 16, 16, true)
    };
    assert_eq!(net.submit(0, r, spec, &mut source), Some(SenderSliceId(0)));
    net.aux(0, r);
    assert_eq!(net.senders[0].counters().slices, 1);
    assert_eq!(source.queries, vec![(r, kvpipe_core::GroupIndex(0), 0, 4)]);
    assert_eq!(net.receivers[0].counters().bytes_written, 4 * BLOCK_BYTES);
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Completed));
}

#[test]
fn an_empty_request_completes_on_both_sides() {
    let mut net = Net::connected(1, 1);
    let r = RequestId(6);
    let mut source = TestSource::with(r, 100, 0);
    net.register(0, registration(r, 0, &[0]));
    net.open(0, send_request(r, &[0]));
    assert!(net
        .submit(0, r, chunk(0, 0, 0, true), &mut source)
        .is_some());
    net.aux(0, r);
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Completed));
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Completed));
    assert_eq!(net.receivers[0].counters().bytes_written, 0);
}

#[test]
fn cancelling_twice_from_either_side_is_idempotent() {
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let mut net = Net::connected(1, 1);
        let r = RequestId(7);
        net.register(0, registration(r, 16, &[0]));
        net.open(0, send_request(r, &[0]));
        let now = net.now;
        for _ in 0..2 {
            match side {
                Side::Sender(i) => net.senders[i].cancel(now, r).unwrap(),
                Side::Receiver(j) => net.receivers[j].cancel(now, r).unwrap(),
            }
            net.pump();
        }
        for s in [Side::Sender(0), Side::Receiver(0)] {
            let ends = net
                .events(s)
                .iter()
                .filter(|e| matches!(e, Event::Cancelled { .. } | Event::Failed { .. }))
                .count();
            assert_eq!(
                ends, 1,
                "{side:?} cancelled twice; {s:?} ended {ends} times"
            );
            assert_eq!(quiesced_count(&net, s, r), 1);
        }
    }
}

#[test]
fn registrations_for_requests_never_opened_are_dropped_after_their_deadline() {
    let mut net = Net::connected(1, 1);
    let r = RequestId(8);
    net.register(0, registration(r, 16, &[0]));
    assert_eq!(net.senders[0].pending_registration_count(), 1);
    // The registration deadline (1 s in these tests) passes without the engine opening it.
    net.advance(Duration::from_millis(1_000));
    assert_eq!(net.senders[0].pending_registration_count(), 0);
    // The receiver learns at once that nobody will write it.
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Cancelled { request, .. } | Event::Failed { request, .. } if *request == r
    )));
    let now = net.now;
    // Opening it later is still possible (the receiver already gave up; the sender learns).
    assert_eq!(
        net.senders[0].open_request(now, send_request(r, &[0])),
        Ok(())
    );
    let _ = UsageError::NoPeers(r);
}
