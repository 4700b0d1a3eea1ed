//! Handshake: success, and clear rejections on both sides for version, compatibility and role
//! mismatches; handshake deadline; session frames before the handshake.

mod session_support;

use kvpipe_core::session::{
    CloseReason, Event, Output, ProtocolError, Receiver, ReceiverInput, Sender, SenderInput,
};
use kvpipe_core::wire::{Frame, RejectReason, Role, VersionRange};
use kvpipe_core::{Duration, PeerId, RequestId};
use session_support::*;

#[test]
fn handshake_makes_both_sides_ready() {
    let net = Net::connected(1, 1);
    assert!(net.senders[0].is_peer_ready(rx_peer(0)));
    assert!(net.receivers[0].is_peer_ready(tx_peer(0)));
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::PeerReady {
            role: Role::Receiver,
            ..
        }
    )));
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::PeerReady {
            role: Role::Sender,
            ..
        }
    )));
}

fn rejection(side: Side, net: &Net) -> Option<(RejectReason, String)> {
    net.events(side).into_iter().find_map(|e| match e {
        Event::PeerRejected {
            reason, message, ..
        } => Some((reason, message)),
        _ => None,
    })
}

#[test]
fn version_mismatch_is_rejected_on_both_sides_naming_both_versions() {
    let mut net = Net::new(1, 1);
    let mut cfg = sender_config(0);
    cfg.local.versions = VersionRange { min: 7, max: 9 };
    net.senders[0] = Sender::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let (reason, message) = rejection(side, &net).expect("rejected");
        assert_eq!(reason, RejectReason::VersionMismatch, "{side:?}");
        assert!(
            message.contains("7..=9") && message.contains("version 2"),
            "{message}"
        );
    }
    assert!(!net.senders[0].is_peer_ready(rx_peer(0)));
    assert!(!net.receivers[0].is_peer_ready(tx_peer(0)));
    // Both sides asked for the connection to be closed.
    assert!(net
        .log
        .iter()
        .any(|(s, o)| *s == Side::Sender(0) && matches!(o, Output::ClosePeer { .. })));
    assert!(net
        .log
        .iter()
        .any(|(s, o)| *s == Side::Receiver(0) && matches!(o, Output::ClosePeer { .. })));
}

/// A sender and a receiver whose compatibility hashes differ, after their handshake.
fn compatibility_mismatched() -> Net {
    let mut net = Net::new(1, 1);
    let mut cfg = receiver_config(0);
    cfg.local.compat_hash ^= 1;
    net.receivers[0] = Receiver::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    net
}

#[test]
fn compatibility_mismatch_is_rejected_on_both_sides() {
    let net = compatibility_mismatched();
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let (reason, _) = rejection(side, &net).expect("rejected");
        assert_eq!(reason, RejectReason::CompatibilityMismatch);
    }
}

#[test]
fn pools_that_cannot_pair_are_rejected_at_the_handshake() {
    // Same model, but the receiver's slots are too small for the layers its pool claims:
    // refused at the handshake, naming the group and the slot size, not at the first slice.
    let mut net = Net::new(1, 1);
    let mut cfg = receiver_config(0);
    cfg.local.groups[0].pools[0].slot_bytes = 100;
    net.receivers[0] = Receiver::new(cfg).unwrap();
    net.connect(0, 0);
    net.pump();
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let (reason, message) = rejection(side, &net).expect("rejected");
        assert_eq!(reason, RejectReason::LayoutMismatch, "{message}");
        assert!(message.contains("group#0"), "{message}");
        assert!(message.contains("100-byte slots"), "{message}");
    }
}

#[test]
fn an_unsound_topology_is_refused_when_the_node_is_made() {
    for (tp_size, tp_rank, needle) in [
        (
            2,
            2,
            "tensor-parallel rank 2 is not below the tensor-parallel size 2",
        ),
        (
            0,
            1,
            "tensor-parallel rank 1 is not below the tensor-parallel size 0",
        ),
    ] {
        let mut cfg = sender_config(0);
        cfg.local.topology.tp_size = tp_size;
        cfg.local.topology.tp_rank = tp_rank;
        let refused = Sender::new(cfg).unwrap_err().to_string();
        assert!(refused.contains(needle), "{refused}");
    }
    let mut cfg = receiver_config(0);
    cfg.local.topology.pp_size = 2;
    cfg.local.topology.pp_rank = 3;
    let refused = Receiver::new(cfg).unwrap_err().to_string();
    assert!(
        refused.contains("pipeline-parallel rank 3 is not below the pipeline-parallel size 2"),
        "{refused}"
    );
    let mut cfg = receiver_config(0);
    cfg.local.topology.layer_begin = 9;
    cfg.local.topology.layer_end = 2;
    let refused = Receiver::new(cfg).unwrap_err().to_string();
    assert!(
        refused.contains("begin at 9, after their end 2"),
        "{refused}"
    );
    // Two tensor ranks of a model of one KV head: each holds it, not a share of it.
    let mut cfg = sender_config(0);
    cfg.local.topology.tp_size = 2;
    cfg.local.groups[0].kv_heads = 2;
    cfg.local.groups[0].shard.model_kv_heads = 2;
    let refused = Sender::new(cfg).unwrap_err().to_string();
    assert!(refused.contains("layer group 0"), "{refused}");
}

#[test]
fn an_unsound_topology_from_a_peer_is_rejected_at_the_handshake() {
    // A peer built elsewhere (another build, another binding) may still claim one.
    let mut receiver = Receiver::new(receiver_config(0)).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    let peer = PeerId(0);
    receiver
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::PeerConnected { peer },
        })
        .unwrap();
    let mut hello = sender_config(0).local.to_hello(Role::Sender);
    hello.topology.tp_size = 2;
    hello.topology.tp_rank = 2;
    receiver
        .handle_input(ReceiverInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer,
                bytes: Frame::Hello(hello).to_bytes().unwrap(),
            },
        })
        .unwrap();
    let rejected = std::iter::from_fn(|| receiver.poll_output()).find_map(|o| match o {
        Output::Event(Event::PeerRejected {
            reason, message, ..
        }) => Some((reason, message)),
        _ => None,
    });
    let (reason, message) = rejected.expect("rejected");
    assert_eq!(reason, RejectReason::TopologyMismatch, "{message}");
    assert!(message.contains("rank 2"), "{message}");
}

#[test]
fn two_senders_reject_each_other() {
    let mut a = Sender::new(sender_config(0)).unwrap();
    let mut b = Sender::new(sender_config(1)).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    a.handle_input(SenderInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::PeerConnected { peer: PeerId(1) },
    })
    .unwrap();
    b.handle_input(SenderInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::PeerConnected { peer: PeerId(0) },
    })
    .unwrap();
    let hello_a = match a.poll_output() {
        Some(Output::Transmit { frame, .. }) => frame,
        o => panic!("{o:?}"),
    };
    b.handle_input(SenderInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::FrameReceived {
            peer: PeerId(0),
            bytes: kvpipe_core::wire::Frame::to_bytes(&hello_a).unwrap(),
        },
    })
    .unwrap();
    let outs: Vec<Output> = std::iter::from_fn(|| b.poll_output()).collect();
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Event(Event::PeerRejected {
            reason: RejectReason::RoleMismatch,
            ..
        })
    )));
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Transmit {
            frame: Frame::HelloReject(_),
            ..
        }
    )));
}

#[test]
fn handshake_deadline_closes_the_peer() {
    let mut net = Net::new(1, 1);
    net.cut.insert((0, 0));
    net.connect(0, 0);
    net.pump();
    net.advance(Duration::from_millis(99));
    assert!(!net
        .log
        .iter()
        .any(|(_, o)| matches!(o, Output::ClosePeer { .. })));
    net.advance(Duration::from_millis(2));
    assert!(net.log.iter().any(|(_, o)| matches!(
        o,
        Output::ClosePeer {
            reason: CloseReason::HandshakeTimeout,
            ..
        }
    )));
    assert_eq!(net.senders[0].counters().timeouts, 1);
}

#[test]
fn receiver_registration_waiting_on_a_silent_peer_times_out_with_the_handshake() {
    let mut net = Net::new(1, 1);
    net.cut.insert((0, 0));
    net.connect(0, 0);
    net.register(0, registration(RequestId(1), 8, &[0]));
    net.advance(Duration::from_millis(150));
    assert!(net.events(Side::Receiver(0)).contains(&Event::TimedOut {
        request: RequestId(1),
        waiting_for: kvpipe_core::session::Wait::Handshake,
    }));
    // The registration never left: nothing can land, so it quiesces at once.
    assert!(net.events(Side::Receiver(0)).contains(&Event::Quiesced {
        request: RequestId(1)
    }));
}

#[test]
fn session_frame_before_handshake_is_a_violation_and_closes() {
    let mut r = Receiver::new(receiver_config(0)).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    r.handle_input(ReceiverInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::PeerConnected { peer: PeerId(0) },
    })
    .unwrap();
    r.handle_input(ReceiverInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::FrameReceived {
            peer: PeerId(0),
            bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::Heartbeat(
                kvpipe_core::wire::Heartbeat { seq: 1 },
            ))
            .unwrap(),
        },
    })
    .unwrap();
    r.handle_input(ReceiverInput::Transport {
        now,
        input: kvpipe_core::session::TransportInput::FrameReceived {
            peer: PeerId(0),
            bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::Cancel(kvpipe_core::wire::Cancel {
                request: RequestId(1),
                reason: kvpipe_core::wire::CancelReason::Engine,
            }))
            .unwrap(),
        },
    })
    .unwrap();
    let outs: Vec<Output> = std::iter::from_fn(|| r.poll_output()).collect();
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Event(Event::ProtocolViolation {
            error: ProtocolError::FrameBeforeHandshake { kind: "Cancel" },
            ..
        })
    )));
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::ClosePeer {
            reason: CloseReason::ProtocolViolation,
            ..
        }
    )));
}

#[test]
fn frames_from_an_unknown_peer_are_a_usage_error() {
    let mut s = Sender::new(sender_config(0)).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    let err = s
        .handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: PeerId(9),
                bytes: kvpipe_core::wire::Frame::to_bytes(&Frame::Heartbeat(
                    kvpipe_core::wire::Heartbeat { seq: 1 },
                ))
                .unwrap(),
            },
        })
        .unwrap_err();
    assert_eq!(
        err,
        kvpipe_core::session::UsageError::UnknownPeer(PeerId(9))
    );
    assert!(s.poll_output().is_none());
}

#[test]
fn before_its_handshake_a_peer_may_send_only_handshake_sized_bodies() {
    use kvpipe_core::session::{Endpoint, TransportInput};
    use kvpipe_core::wire::{
        DecodeError, FrameHeader, FrameKind, MAX_BODY_LEN, MAX_HANDSHAKE_BODY_LEN,
    };
    // Every handshake frame fits.
    assert!(FrameKind::HelloReject.max_body_len() <= MAX_HANDSHAKE_BODY_LEN);
    assert!(FrameKind::HelloAccept.max_body_len() <= MAX_HANDSHAKE_BODY_LEN);

    let mut r = Receiver::new(receiver_config(0)).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    let peer = PeerId(0);
    assert_eq!(r.frame_body_limit(peer), MAX_HANDSHAKE_BODY_LEN, "unknown");
    r.handle_transport(now, TransportInput::PeerConnected { peer })
        .unwrap();
    assert_eq!(r.frame_body_limit(peer), MAX_HANDSHAKE_BODY_LEN);
    // A Hello header declaring a body one byte over the limit, with that body: refused before
    // it is decoded, as a protocol violation naming both lengths.
    let len = MAX_HANDSHAKE_BODY_LEN + 1;
    let mut bytes = FrameHeader::new(FrameKind::Hello, 1, len)
        .to_bytes()
        .to_vec();
    bytes.resize(bytes.len() + len as usize, 0);
    r.handle_transport(
        now,
        TransportInput::FrameReceived {
            peer,
            bytes: bytes.into(),
        },
    )
    .unwrap();
    let outs: Vec<Output> = std::iter::from_fn(|| r.poll_output()).collect();
    assert!(
        outs.iter().any(|o| matches!(
            o,
            Output::Event(Event::ProtocolViolation {
                error: ProtocolError::Undecodable {
                    error: DecodeError::BodyTooLong {
                        kind: FrameKind::Hello,
                        len: l,
                        max: MAX_HANDSHAKE_BODY_LEN,
                    },
                },
                ..
            }) if *l == len
        )),
        "{outs:?}"
    );
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::ClosePeer {
            reason: CloseReason::ProtocolViolation,
            ..
        }
    )));

    // Once the handshake completed, the limit is the largest body.
    let net = Net::connected(1, 1);
    assert_eq!(net.receivers[0].frame_body_limit(tx_peer(0)), MAX_BODY_LEN);
    assert_eq!(net.senders[0].frame_body_limit(rx_peer(0)), MAX_BODY_LEN);
}

/// The `PeerLost` events `side` reported, in order.
fn lost(net: &Net, side: Side) -> Vec<(PeerId, Option<CloseReason>)> {
    net.events(side)
        .into_iter()
        .filter_map(|e| match e {
            Event::PeerLost { peer, reason } => Some((peer, reason)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_handshake_that_never_finishes_ends_with_peer_lost_on_both_sides() {
    let mut net = Net::new(1, 1);
    net.cut.insert((0, 0));
    net.connect(0, 0);
    net.pump();
    net.advance(Duration::from_millis(99));
    assert!(lost(&net, Side::Sender(0)).is_empty());
    assert!(lost(&net, Side::Receiver(0)).is_empty());
    net.advance(Duration::from_millis(2));
    // This side closed it for the deadline (the harness then reports the disconnect to both).
    let sender = lost(&net, Side::Sender(0));
    let receiver = lost(&net, Side::Receiver(0));
    assert_eq!(sender, [(rx_peer(0), Some(CloseReason::HandshakeTimeout))]);
    assert_eq!(receiver.len(), 1, "{receiver:?}");
    assert_eq!(receiver[0].0, tx_peer(0));
    assert!(
        receiver[0].1 == Some(CloseReason::HandshakeTimeout) || receiver[0].1.is_none(),
        "{receiver:?}"
    );
}

#[test]
fn a_refused_handshake_ends_with_peer_lost_after_peer_rejected() {
    let net = compatibility_mismatched();
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let events = net.events(side);
        let rejected = events
            .iter()
            .position(|e| matches!(e, Event::PeerRejected { .. }));
        let lost = events
            .iter()
            .position(|e| matches!(e, Event::PeerLost { .. }));
        assert!(
            matches!((rejected, lost), (Some(r), Some(l)) if r < l),
            "{events:?}"
        );
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, Event::PeerLost { .. }))
                .count(),
            1,
            "{events:?}"
        );
    }
}
