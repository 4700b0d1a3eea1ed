//! Cancellation from either side in every state, and cancels for requests not seen yet.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{CancelOrigin, Event, Receiver, ReceiverInput, Sender, SenderInput};
use kvpipe_core::wire::{Cancel, CancelReason, Frame};
use kvpipe_core::{Instant, RequestId};
use session_support::*;

const R: RequestId = RequestId(41);

/// The states a request can be in when a cancel arrives.
#[derive(Clone, Copy, Debug)]
enum Stage {
    /// Sender open, receiver not registered.
    OpenUnregistered,
    /// Receiver registered, sender not open.
    RegisteredUnopened,
    /// Both sides know it, no chunk yet.
    Registered,
    /// Mid-prefill, a batch in flight.
    MidPrefill,
    /// Last chunk submitted, aux data missing.
    Finishing,
    /// Completed on both sides.
    Completed,
}

const STAGES: [Stage; 6] = [
    Stage::OpenUnregistered,
    Stage::RegisteredUnopened,
    Stage::Registered,
    Stage::MidPrefill,
    Stage::Finishing,
    Stage::Completed,
];

fn setup(stage: Stage) -> (Net, TestSource) {
    let mut net = Net::connected(1, 1);
    net.auto_complete = !matches!(stage, Stage::MidPrefill);
    let mut source = TestSource::with(R, 100, 4);
    match stage {
        Stage::OpenUnregistered => net.open(0, send_request(R, &[0])),
        Stage::RegisteredUnopened => net.register(0, registration(R, 16, &[0])),
        Stage::Registered => {
            net.register(0, registration(R, 16, &[0]));
            net.open(0, send_request(R, &[0]));
        }
        Stage::MidPrefill => {
            net.register(0, registration(R, 16, &[0]));
            net.open(0, send_request(R, &[0]));
            net.submit(0, R, chunk(0, 8, 16, false), &mut source);
        }
        Stage::Finishing => {
            net.register(0, registration(R, 16, &[0]));
            net.open(0, send_request(R, &[0]));
            net.submit(0, R, chunk(0, 16, 16, true), &mut source);
        }
        Stage::Completed => {
            net.register(0, registration(R, 16, &[0]));
            net.open(0, send_request(R, &[0]));
            net.submit(0, R, chunk(0, 16, 16, true), &mut source);
            net.aux(0, R);
        }
    }
    (net, source)
}

fn settle(net: &mut Net) {
    for _ in 0..net.held.len() {
        net.complete_held(0);
    }
}

fn check_ended(net: &Net, stage: Stage, cancelled_by_sender: bool) {
    let sender = net.senders[0].phase(R);
    let receiver = net.receivers[0].phase(R);
    if matches!(stage, Stage::Completed) {
        assert_eq!(sender, Some(SendPhase::Completed), "{stage:?}");
        assert_eq!(receiver, Some(RecvPhase::Completed), "{stage:?}");
        return;
    }
    // Whoever knows the request ended it and quiesced.
    let origin_knows = if cancelled_by_sender {
        !matches!(stage, Stage::RegisteredUnopened)
    } else {
        !matches!(stage, Stage::OpenUnregistered)
    };
    if origin_knows {
        let origin_side = if cancelled_by_sender {
            Side::Sender(0)
        } else {
            Side::Receiver(0)
        };
        assert!(
            net.events(origin_side).contains(&Event::Cancelled {
                request: R,
                origin: CancelOrigin::Local
            }),
            "{stage:?}"
        );
    }
    for (side, phase) in [
        (Side::Sender(0), sender.map(|p| p == SendPhase::Quiesced)),
        (
            Side::Receiver(0),
            receiver.map(|p| p == RecvPhase::Quiesced),
        ),
    ] {
        if let Some(quiesced) = phase {
            assert!(quiesced, "{stage:?} {side:?}");
            assert!(net.events(side).contains(&Event::Quiesced { request: R }));
        }
    }
}

#[test]
fn sender_cancel_in_every_stage() {
    for stage in STAGES {
        let (mut net, _source) = setup(stage);
        let now = net.now;
        net.senders[0].cancel(now, R).unwrap();
        net.pump();
        settle(&mut net);
        check_ended(&net, stage, true);
        if matches!(
            stage,
            Stage::Registered | Stage::MidPrefill | Stage::Finishing
        ) {
            assert!(
                net.events(Side::Receiver(0))
                    .iter()
                    .any(|e| matches!(e, Event::Failed { .. } | Event::Cancelled { .. })),
                "{stage:?}"
            );
        }
    }
}

#[test]
fn receiver_cancel_in_every_stage() {
    for stage in STAGES {
        let (mut net, _source) = setup(stage);
        let now = net.now;
        net.receivers[0].cancel(now, R).unwrap();
        net.pump();
        settle(&mut net);
        if matches!(stage, Stage::OpenUnregistered) {
            // The receiver never knew its writers: the sender ends by its registration deadline.
            assert_eq!(net.senders[0].phase(R), Some(SendPhase::Streaming));
            net.advance(kvpipe_core::Duration::from_secs(1));
        }
        check_ended(&net, stage, false);
        if matches!(
            stage,
            Stage::Registered | Stage::MidPrefill | Stage::Finishing
        ) {
            assert!(
                net.events(Side::Sender(0)).contains(&Event::Cancelled {
                    request: R,
                    origin: CancelOrigin::Peer(rx_peer(0))
                }),
                "{stage:?}"
            );
        }
    }
}

#[test]
fn cancel_before_the_request_exists_is_applied_when_it_appears() {
    // Sender engine cancels first.
    let mut net = Net::connected(1, 1);
    let now = net.now;
    net.senders[0].cancel(now, R).unwrap();
    net.open(0, send_request(R, &[0]));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert!(net.events(Side::Sender(0)).contains(&Event::Cancelled {
        request: R,
        origin: CancelOrigin::Local
    }));

    // Receiver engine cancels first.
    let mut net = Net::connected(1, 1);
    let now = net.now;
    net.receivers[0].cancel(now, R).unwrap();
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    assert!(
        !net.frames(Side::Receiver(0))
            .iter()
            .any(|f| matches!(f, Frame::RecvRegistration(_))),
        "a cancelled registration is never sent"
    );
}

#[test]
fn peer_cancel_before_the_request_exists_is_remembered() {
    // The receiver cancels a request the sender has not opened: the sender confirms at once
    // and cancels the request when the engine opens it.
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    let now = net.now;
    net.receivers[0].cancel(now, R).unwrap();
    net.pump();
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    net.open(0, send_request(R, &[0]));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert!(net.events(Side::Sender(0)).contains(&Event::Cancelled {
        request: R,
        origin: CancelOrigin::Peer(rx_peer(0)),
    }));

    // A sender's cancel reaching a receiver before its registration cancels the registration.
    let mut r = Receiver::new(receiver_config(0)).unwrap();
    let mut s = Sender::new(sender_config(0)).unwrap();
    let now = Instant::from_millis(1);
    let mut net = Net::new(0, 0);
    net.senders.push(std::mem::replace(
        &mut s,
        Sender::new(sender_config(0)).unwrap(),
    ));
    net.receivers.push(std::mem::replace(
        &mut r,
        Receiver::new(receiver_config(0)).unwrap(),
    ));
    net.connect(0, 0);
    net.pump();
    net.receivers[0]
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: tx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::Cancel(Cancel {
                    request: R,
                    reason: CancelReason::Engine,
                }))
                .unwrap(),
            },
        })
        .unwrap();
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
    assert!(net.events(Side::Receiver(0)).contains(&Event::Cancelled {
        request: R,
        origin: CancelOrigin::Peer(tx_peer(0)),
    }));
}

#[test]
fn remembered_cancels_are_bounded() {
    let mut cfg = sender_config(0);
    cfg.max_remembered_cancels = 2;
    let mut s = Sender::new(cfg).unwrap();
    let now = Instant::from_millis(1);
    for r in 1..=3 {
        s.handle_input(SenderInput::Cancel {
            now,
            request: RequestId(r),
        })
        .unwrap();
    }
    // The oldest was forgotten: request 1 opens normally, 2 and 3 are cancelled.
    for r in 1..=3 {
        s.open_request(now, send_request(RequestId(r), &[0]))
            .unwrap();
    }
    assert_eq!(s.phase(RequestId(1)), Some(SendPhase::Streaming));
    assert_eq!(s.phase(RequestId(2)), Some(SendPhase::Quiesced));
    assert_eq!(s.phase(RequestId(3)), Some(SendPhase::Quiesced));
}
