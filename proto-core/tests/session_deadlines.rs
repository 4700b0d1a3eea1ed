//! Every wait has a deadline and a failure twin: registration, writes, results, aux (both
//! sides), liveness; heartbeats keep idle peers alive; early timeouts are harmless.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{
    CloseReason, Event, Output, ReceiverInput, SenderInput, TransportInput, Wait,
};
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::{Duration, RequestId};
use session_support::*;

const R: RequestId = RequestId(21);

fn timed_out(net: &Net, side: Side, wait: Wait) -> bool {
    net.events(side).contains(&Event::TimedOut {
        request: R,
        waiting_for: wait,
    })
}

#[test]
fn registration_deadline() {
    let mut net = Net::connected(1, 1);
    net.open(0, send_request(R, &[0]));
    net.advance(Duration::from_millis(999));
    assert!(!timed_out(&net, Side::Sender(0), Wait::Registration));
    net.advance(Duration::from_millis(1));
    assert!(timed_out(&net, Side::Sender(0), Wait::Registration));
    // Nothing was written: the session quiesces at once, and the receiver was told.
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert!(net
        .frames(Side::Sender(0))
        .iter()
        .any(|f| matches!(f, Frame::Cancel(c) if c.request == R)));
    assert_eq!(net.senders[0].counters().timeouts, 1);
}

#[test]
fn write_completion_deadline() {
    let (mut net, mut source) = Net::held_pair(R, 16);
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.advance(Duration::from_millis(200));
    assert!(timed_out(&net, Side::Sender(0), Wait::Writes));
    // The receiver learns at once that the outcome is in doubt.
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::InDoubt,
            ..
        }
    )));
    // The batch is still unreported: the sender keeps the blocks pinned.
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Stopping));
    net.complete_held(0);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn a_later_batch_keeps_its_write_deadline_though_only_the_earliest_is_queued() {
    // A request queues one write deadline, not one per batch: the later batch's deadline is
    // found again when the earlier entry fires (stale, its batch done).
    let (mut net, mut source) = Net::held_pair(R, 32);
    net.submit(0, R, chunk(0, 16, 32, false), &mut source); // batch 0, due at 200 ms
    net.advance(Duration::from_millis(150));
    net.submit(0, R, chunk(16, 32, 32, true), &mut source); // batch 1, due at 350 ms
    net.complete_held(0);
    net.advance(Duration::from_millis(199)); // 349 ms: batch 0's entry fired at 200, stale
    assert!(!timed_out(&net, Side::Sender(0), Wait::Writes));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Finishing));
    net.advance(Duration::from_millis(1));
    assert!(timed_out(&net, Side::Sender(0), Wait::Writes));
}

#[test]
fn result_wait_deadline() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    // The prefill side opened the request but never computes a chunk.
    net.open(0, send_request(R, &[0]));
    net.advance(Duration::from_millis(4_999));
    assert!(!timed_out(&net, Side::Receiver(0), Wait::Results));
    net.advance(Duration::from_millis(1));
    assert!(timed_out(&net, Side::Receiver(0), Wait::Results));
    // The sender (which wrote nothing) confirms the cancel at once.
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn sender_aux_deadline() {
    let mut net = Net::new(1, 1);
    let mut cfg = sender_config(0);
    cfg.deadlines.aux_wait = Duration::from_millis(200);
    net.senders[0] = kvpipe_core::Sender::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.advance(Duration::from_millis(200));
    assert!(timed_out(&net, Side::Sender(0), Wait::Aux));
    // The receiver had the last result already; a failed terminal result fails it too.
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::TimedOut,
            ..
        }
    )));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn receiver_aux_deadline() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    // The aux frame is lost on the way: cut the link right after the last result.
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.cut.insert((0, 0));
    net.aux(0, R);
    assert!(!net
        .events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { .. })));
    net.advance(Duration::from_millis(300));
    assert!(timed_out(&net, Side::Receiver(0), Wait::Aux));
    // Every writer had already sent its last result: nothing can land, quiesced at once.
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn heartbeats_keep_an_idle_connection_alive() {
    let mut net = Net::connected(1, 1);
    net.advance(Duration::from_millis(2_000));
    assert!(net.senders[0].counters().heartbeats_sent >= 30);
    assert!(net.receivers[0].counters().heartbeats_sent >= 30);
    assert!(!net
        .log
        .iter()
        .any(|(_, o)| matches!(o, Output::ClosePeer { .. })));
    assert!(net.senders[0].is_peer_ready(rx_peer(0)));
}

#[test]
fn liveness_deadline_fails_the_peers_sessions() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.cut.insert((0, 0));
    net.advance(Duration::from_millis(400));
    for side in [Side::Sender(0), Side::Receiver(0)] {
        assert!(timed_out(&net, side, Wait::Liveness), "{side:?}");
        assert!(net.log.iter().any(|(s, o)| *s == side
            && matches!(
                o,
                Output::ClosePeer {
                    reason: CloseReason::LivenessTimeout,
                    ..
                }
            )));
    }
    // The closes were carried out: both sessions quiesced on the disconnect.
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn payload_still_arriving_keeps_a_peer_alive_and_its_end_does_not() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    // The sender's frames queue behind a long payload: only the payload's bytes arrive, for
    // three times the liveness timeout (400 ms).
    net.stalled.insert((0, 0));
    for _ in 0..12 {
        net.advance(Duration::from_millis(100));
        let now = net.now;
        net.receivers[0]
            .handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::DataArriving { peer: tx_peer(0) },
            })
            .unwrap();
    }
    assert!(!timed_out(&net, Side::Receiver(0), Wait::Liveness));
    assert!(net.receivers[0].is_peer_ready(tx_peer(0)));
    // The payload stops too: the liveness deadline ends the peer.
    net.advance(Duration::from_millis(500));
    assert!(timed_out(&net, Side::Receiver(0), Wait::Liveness));
}

#[test]
fn a_sender_refuses_data_arriving() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    assert!(net.senders[0]
        .handle_input(SenderInput::Transport {
            now,
            input: TransportInput::DataArriving { peer: rx_peer(0) },
        })
        .is_err());
}

#[test]
fn early_timeout_is_a_no_op() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let before = net.log.len();
    let now = net.now;
    net.senders[0]
        .handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::Timeout,
        })
        .unwrap();
    net.receivers[0]
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::Timeout,
        })
        .unwrap();
    net.pump();
    assert_eq!(net.log.len(), before);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Streaming));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Receiving));
    // A deadline is always pending while something is awaited.
    assert!(net.senders[0].poll_timeout().is_some());
    assert!(net.receivers[0].poll_timeout().is_some());
}

/// A receiver whose results are due within 1 s of the last progress, and within
/// 1 s + 100 ms per prompt token overall.
fn progress_net() -> Net {
    let mut net = Net::new(1, 1);
    let mut cfg = receiver_config(0);
    cfg.deadlines.result_wait = Duration::from_millis(1_000);
    cfg.deadlines.result_per_token = Duration::from_millis(100);
    cfg.deadlines.result_idle = Duration::from_millis(1_000);
    net.receivers[0] = kvpipe_core::Receiver::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    net
}

#[test]
fn a_slow_prefill_that_keeps_progressing_completes() {
    // 64 tokens in 8 chunks, one every 0.9 s: 7.2 s in all, longer than the idle deadline
    // many times over and than any fixed 5 s wait, within the cap (1 s + 6.4 s).
    let mut net = progress_net();
    let mut source = TestSource::with(R, 100, 16);
    net.register(0, registration(R, 64, &[0]));
    net.open(0, send_request(R, &[0]));
    for k in 0..8u32 {
        net.advance(Duration::from_millis(900));
        net.submit(0, R, chunk(8 * k, 8 * k + 8, 64, k == 7), &mut source);
    }
    net.aux(0, R);
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Completed));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Completed));
}

#[test]
fn a_stalled_prefill_fails_within_the_idle_deadline() {
    let mut net = progress_net();
    let mut source = TestSource::with(R, 100, 16);
    net.register(0, registration(R, 64, &[0]));
    net.open(0, send_request(R, &[0]));
    net.advance(Duration::from_millis(500));
    net.submit(0, R, chunk(0, 8, 64, false), &mut source);
    // Progress at 0.5 s; nothing after: due at 1.5 s, long before the 7.4 s cap.
    net.advance(Duration::from_millis(999));
    assert!(!timed_out(&net, Side::Receiver(0), Wait::Results));
    net.advance(Duration::from_millis(1));
    assert!(timed_out(&net, Side::Receiver(0), Wait::Results));
}

#[test]
fn the_cap_bounds_a_request_that_never_progresses() {
    let mut net = progress_net();
    net.register(0, registration(R, 64, &[0]));
    net.open(0, send_request(R, &[0]));
    net.advance(Duration::from_millis(7_399));
    assert!(!timed_out(&net, Side::Receiver(0), Wait::Results));
    net.advance(Duration::from_millis(1));
    assert!(timed_out(&net, Side::Receiver(0), Wait::Results));
}

#[test]
fn a_deadline_that_cannot_work_is_refused_at_start_naming_the_field() {
    use kvpipe_core::{ConfigError, Receiver, Sender};
    // Every deadline but result_per_token (which only adds to result_wait) must be positive.
    type Zero = fn(&mut kvpipe_core::session::Deadlines);
    let fields: [(&str, Zero); 9] = [
        ("handshake", |d| d.handshake = Duration::ZERO),
        ("registration", |d| d.registration = Duration::ZERO),
        ("write_completion", |d| d.write_completion = Duration::ZERO),
        ("result_wait", |d| d.result_wait = Duration::ZERO),
        ("result_idle", |d| d.result_idle = Duration::ZERO),
        ("aux_wait", |d| d.aux_wait = Duration::ZERO),
        ("heartbeat_interval", |d| {
            d.heartbeat_interval = Duration::ZERO
        }),
        ("liveness_timeout", |d| d.liveness_timeout = Duration::ZERO),
        ("quiesce", |d| d.quiesce = Duration::ZERO),
    ];
    for (field, zero) in fields {
        let mut sender = sender_config(0);
        zero(&mut sender.deadlines);
        let err = Sender::new(sender).err();
        assert_eq!(err, Some(ConfigError::ZeroDeadline(field)), "{field}");
        assert!(err.unwrap().to_string().contains(field));
        let mut receiver = receiver_config(0);
        zero(&mut receiver.deadlines);
        assert_eq!(
            Receiver::new(receiver).err(),
            Some(ConfigError::ZeroDeadline(field)),
            "{field}"
        );
    }
    // A liveness timeout no longer than the heartbeat interval loses quiet healthy peers.
    let mut sender = sender_config(0);
    sender.deadlines.liveness_timeout = sender.deadlines.heartbeat_interval;
    let err = Sender::new(sender).err().unwrap();
    assert!(matches!(err, ConfigError::LivenessNotAboveHeartbeat { .. }));
    assert!(err.to_string().contains("liveness_timeout"));
    // A zero per-token allowance is fine.
    let mut receiver = receiver_config(0);
    receiver.deadlines.result_per_token = Duration::ZERO;
    assert!(Receiver::new(receiver).is_ok());
}
