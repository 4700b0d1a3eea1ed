//! Timed-out and cancelled sessions keep their blocks pinned until `Quiesced`: the sender until
//! no write batch is unreported, the receiver until every writer confirmed it stopped (or was
//! disconnected); past the quiesce deadline the peer is fenced with `ClosePeer`.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{CloseReason, Event, Output, UsageError};
use kvpipe_core::{Duration, RequestId};
use session_support::*;

const R: RequestId = RequestId(31);

fn quiesced(net: &Net, side: Side) -> bool {
    net.events(side).contains(&Event::Quiesced { request: R })
}

#[test]
fn cancelled_sender_quiesces_only_after_the_transport_reports_its_batch() {
    let (mut net, _) = Net::first_chunk_held(R);
    let now = net.now;
    net.senders[0].cancel(now, R).unwrap();
    net.pump();
    assert!(net
        .events(Side::Sender(0))
        .iter()
        .any(|e| matches!(e, Event::Cancelled { .. })));
    assert!(!quiesced(&net, Side::Sender(0)));
    assert!(
        !quiesced(&net, Side::Receiver(0)),
        "the receiver waits for the sender's terminal"
    );
    assert_eq!(
        net.senders[0].retire(now, R),
        Err(UsageError::NotQuiesced(R))
    );
    assert_eq!(
        net.receivers[0].retire(now, R),
        Err(UsageError::NotQuiesced(R))
    );
    net.complete_held(0);
    assert!(quiesced(&net, Side::Sender(0)));
    assert!(quiesced(&net, Side::Receiver(0)));
    net.senders[0].retire(now, R).unwrap();
    net.receivers[0].retire(now, R).unwrap();
}

#[test]
fn receiver_fences_a_writer_that_never_confirms() {
    let (mut net, _) = Net::first_chunk_held(R);
    // Frames stop flowing; the receiver's engine cancels.
    net.cut.insert((0, 0));
    let now = net.now;
    net.receivers[0].cancel(now, R).unwrap();
    net.pump();
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Stopping));
    net.advance(Duration::from_millis(149));
    assert!(!quiesced(&net, Side::Receiver(0)));
    net.advance(Duration::from_millis(1));
    // Past the quiesce deadline: the writer is fenced, and the blocks are handed back only
    // after the transport reported the disconnect.
    let close = net
        .position(|(s, o)| {
            *s == Side::Receiver(0)
                && matches!(
                    o,
                    Output::ClosePeer {
                        reason: CloseReason::QuiesceFence,
                        ..
                    }
                )
        })
        .expect("fenced");
    let q = net
        .position(|(s, o)| {
            *s == Side::Receiver(0) && matches!(o, Output::Event(Event::Quiesced { .. }))
        })
        .expect("quiesced after the disconnect");
    assert!(close < q);
    // The sender's batch was to the disconnected peer: it can no longer touch memory.
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.senders[0].batches_in_flight(), 0);
}

#[test]
fn sender_fences_a_batch_the_transport_never_reports() {
    let (mut net, _) = Net::first_chunk_held(R);
    let now = net.now;
    net.senders[0].cancel(now, R).unwrap();
    net.pump();
    net.advance(Duration::from_millis(150));
    assert!(net.log.iter().any(|(s, o)| *s == Side::Sender(0)
        && matches!(
            o,
            Output::ClosePeer {
                reason: CloseReason::QuiesceFence,
                ..
            }
        )));
    assert!(quiesced(&net, Side::Sender(0)));
    assert!(quiesced(&net, Side::Receiver(0)));
    // A late report of the forgotten batch is harmless.
    net.complete_held(0);
}

#[test]
fn timed_out_receiver_keeps_blocks_until_the_sender_confirms() {
    let mut net = Net::new(1, 1);
    let mut cfg = receiver_config(0);
    cfg.deadlines.result_wait = Duration::from_millis(100);
    net.receivers[0] = kvpipe_core::Receiver::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    net.auto_complete = false;
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.advance(Duration::from_millis(100));
    assert!(net.events(Side::Receiver(0)).contains(&Event::TimedOut {
        request: R,
        waiting_for: kvpipe_core::session::Wait::Results,
    }));
    // The sender learned at once (a Cancel) but its batch is still in flight.
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::Cancelled {
            origin: kvpipe_core::session::CancelOrigin::Peer(_),
            ..
        }
    )));
    assert!(!quiesced(&net, Side::Receiver(0)));
    assert!(!quiesced(&net, Side::Sender(0)));
    net.complete_held(0);
    assert!(quiesced(&net, Side::Sender(0)));
    assert!(quiesced(&net, Side::Receiver(0)));
    assert!(
        !net.log
            .iter()
            .any(|(_, o)| matches!(o, Output::ClosePeer { .. })),
        "a confirmed stop needs no fence"
    );
}

/// Blocks a session pins now, by the endpoint's counters.
fn pinned(c: &kvpipe_core::session::Counters) -> u64 {
    c.blocks_pinned - c.blocks_released
}

#[test]
fn counters_show_blocks_pinned_until_the_session_quiesces() {
    let mut net = Net::connected(1, 1);
    net.auto_complete = false;
    let mut source = TestSource::with(R, 100, 4);
    // 16 tokens in blocks of 4: the receiver pins the 4 registered blocks at once.
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(pinned(net.receivers[0].counters()), 4);
    net.open(0, send_request(R, &[0]));
    assert_eq!(
        pinned(net.senders[0].counters()),
        0,
        "no chunk named a block yet"
    );
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    assert_eq!(pinned(net.senders[0].counters()), 2);
    let now = net.now;
    net.senders[0].cancel(now, R).unwrap();
    net.pump();
    // Cancelled, with a batch still unreported: nothing is handed back yet.
    assert_eq!(pinned(net.senders[0].counters()), 2);
    assert_eq!(pinned(net.receivers[0].counters()), 4);
    net.complete_held(0);
    assert!(quiesced(&net, Side::Sender(0)) && quiesced(&net, Side::Receiver(0)));
    for c in [net.senders[0].counters(), net.receivers[0].counters()] {
        assert_eq!(pinned(c), 0, "{c:?}");
    }
    assert_eq!(net.senders[0].counters().blocks_released, 2);
    assert_eq!(net.receivers[0].counters().blocks_released, 4);
}

#[test]
fn a_completed_transfer_releases_every_block_it_pinned() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    assert_eq!(pinned(net.senders[0].counters()), 4);
    net.aux(0, R);
    for c in [net.senders[0].counters(), net.receivers[0].counters()] {
        assert_eq!((c.blocks_pinned, c.blocks_released), (4, 4), "{c:?}");
    }
}
