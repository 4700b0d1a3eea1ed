//! Data-path offers inside the handshake: a sender's offer holds the receiver's `HelloAccept`
//! until the receiver's transport answers, within the handshake deadline; the sender learns the
//! answer just before `PeerReady`. An answer nobody waits for is a usage error that changes
//! nothing; an offer past the cap is refused as input and as bytes.

mod session_support;

use bytes::Bytes;
use kvpipe_core::session::{
    CloseReason, DataPathNegotiation, Event, Output, ProtocolError, Receiver, TransportInput,
    UsageError,
};
use kvpipe_core::wire::{DecodeError, Frame, FrameKind, Malformation, Role, MAX_DATA_PATH_LEN};
use kvpipe_core::{Duration, PeerId, RequestId};
use session_support::*;

/// The data-path outputs `side` produced, in order.
fn negotiation(net: &Net, side: Side) -> Vec<DataPathNegotiation> {
    net.log
        .iter()
        .filter(|(s, _)| *s == side)
        .filter_map(|(_, o)| match o {
            Output::DataPath(n) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

fn answer(net: &mut Net, j: usize, answer: &'static [u8]) -> Result<(), UsageError> {
    let now = net.now;
    net.receivers[j].handle_transport(
        now,
        TransportInput::DataPathAnswered {
            peer: tx_peer(0),
            answer: Bytes::from_static(answer),
        },
    )
}

#[test]
fn an_offer_waits_for_the_answer_which_the_sender_learns_before_peer_ready() {
    let mut net = Net::new(1, 1);
    net.connect_offering(0, 0, b"offer");
    net.register(0, registration(RequestId(1), 8, &[0]));
    net.pump();
    // The receiver's transport is asked; neither side is ready, no HelloAccept left the
    // receiver, and the registration waits.
    assert_eq!(
        negotiation(&net, Side::Receiver(0)),
        [DataPathNegotiation::Offered {
            peer: tx_peer(0),
            offer: Bytes::from_static(b"offer"),
        }]
    );
    assert!(!net.receivers[0].is_peer_ready(tx_peer(0)));
    assert!(!net.senders[0].is_peer_ready(rx_peer(0)));
    assert!(!net
        .frames(Side::Receiver(0))
        .iter()
        .any(|f| matches!(f, Frame::HelloAccept(_) | Frame::RecvRegistration(_))));
    // The sender's own HelloAccept carries no answer: it was offered nothing.
    let sender_accept = net
        .frames(Side::Sender(0))
        .into_iter()
        .find_map(|f| match f {
            Frame::HelloAccept(a) => Some(a),
            _ => None,
        });
    assert_eq!(sender_accept.expect("sent").data_path_answer, None);

    answer(&mut net, 0, b"pulling").unwrap();
    net.pump();
    assert!(net.receivers[0].is_peer_ready(tx_peer(0)));
    assert!(net.senders[0].is_peer_ready(rx_peer(0)));
    let accept = net
        .frames(Side::Receiver(0))
        .into_iter()
        .find_map(|f| match f {
            Frame::HelloAccept(a) => Some(a),
            _ => None,
        });
    assert_eq!(
        accept.expect("sent").data_path_answer.as_deref(),
        Some(&b"pulling"[..])
    );
    // The registration left the receiver after its HelloAccept.
    let frames = net.frames(Side::Receiver(0));
    let kinds: Vec<&str> = frames
        .iter()
        .map(|f| match f {
            Frame::Hello(_) => "Hello",
            Frame::HelloAccept(_) => "HelloAccept",
            Frame::RecvRegistration(_) => "RecvRegistration",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["Hello", "HelloAccept", "RecvRegistration"]);
    // The sender heard the answer, then PeerReady.
    let sender: Vec<&Output> = net
        .log
        .iter()
        .filter(|(s, _)| *s == Side::Sender(0))
        .map(|(_, o)| o)
        .filter(|o| matches!(o, Output::DataPath(_) | Output::Event(_)))
        .collect();
    assert!(
        matches!(
            sender[..],
            [
                Output::DataPath(DataPathNegotiation::Answered { peer, answer: Some(ref a) }),
                Output::Event(Event::PeerReady { role: Role::Receiver, .. }),
            ] if *peer == rx_peer(0) && a == &b"pulling"[..]
        ),
        "{sender:?}"
    );
    // The receiver reports nothing more about the data path, and each side's handshake
    // deadline is gone: nothing closes later.
    assert_eq!(negotiation(&net, Side::Receiver(0)).len(), 1);
    net.advance(Duration::from_millis(300));
    assert!(!net
        .log
        .iter()
        .any(|(_, o)| matches!(o, Output::ClosePeer { .. })));
}

#[test]
fn a_hello_without_an_offer_is_accepted_at_once_and_reports_no_data_path() {
    let net = Net::connected(1, 1);
    assert!(net.senders[0].is_peer_ready(rx_peer(0)));
    assert!(negotiation(&net, Side::Sender(0)).is_empty());
    assert!(negotiation(&net, Side::Receiver(0)).is_empty());
}

#[test]
fn an_offer_never_answered_fails_the_handshake_at_its_deadline_on_both_sides() {
    let mut net = Net::new(1, 1);
    net.connect_offering(0, 0, b"offer");
    net.pump();
    net.advance(Duration::from_millis(99));
    assert!(!net
        .log
        .iter()
        .any(|(_, o)| matches!(o, Output::ClosePeer { .. })));
    net.advance(Duration::from_millis(2));
    for side in [Side::Sender(0), Side::Receiver(0)] {
        assert!(
            net.log.iter().any(|(s, o)| *s == side
                && matches!(
                    o,
                    Output::ClosePeer {
                        reason: CloseReason::HandshakeTimeout,
                        ..
                    }
                )),
            "{side:?}"
        );
    }
    assert!(!net
        .events(Side::Sender(0))
        .iter()
        .any(|e| matches!(e, Event::PeerReady { .. })));
    // A late answer finds no handshake waiting for it.
    let mut r = Receiver::new(receiver_config(0)).unwrap();
    let now = net.now;
    r.handle_transport(now, TransportInput::PeerConnected { peer: tx_peer(0) })
        .unwrap();
    let hello = net
        .log
        .iter()
        .find_map(|(s, o)| match o {
            Output::Transmit {
                bytes,
                frame: Frame::Hello(_),
                ..
            } if *s == Side::Sender(0) => Some(bytes.clone()),
            _ => None,
        })
        .expect("the sender's Hello");
    r.handle_transport(
        now,
        TransportInput::FrameReceived {
            peer: tx_peer(0),
            bytes: hello,
        },
    )
    .unwrap();
    while r.poll_output().is_some() {}
    let later = now + Duration::from_millis(101);
    r.handle_transport(later, TransportInput::Timeout).unwrap();
    while r.poll_output().is_some() {}
    assert_eq!(
        r.handle_transport(
            later,
            TransportInput::DataPathAnswered {
                peer: tx_peer(0),
                answer: Bytes::from_static(b"late"),
            }
        ),
        Err(UsageError::NoOfferPending(tx_peer(0)))
    );
    assert!(r.poll_output().is_none());
}

#[test]
fn an_answer_nobody_waits_for_is_a_usage_error_that_changes_nothing() {
    let mut net = Net::connected(1, 1);
    let before = *net.receivers[0].counters();
    // A ready peer that offered nothing, an unknown peer.
    assert_eq!(
        answer(&mut net, 0, b"x"),
        Err(UsageError::NoOfferPending(tx_peer(0)))
    );
    let now = net.now;
    assert_eq!(
        net.receivers[0].handle_transport(
            now,
            TransportInput::DataPathAnswered {
                peer: PeerId(77),
                answer: Bytes::new(),
            }
        ),
        Err(UsageError::UnknownPeer(PeerId(77)))
    );
    assert!(net.receivers[0].poll_output().is_none());
    assert_eq!(net.receivers[0].counters(), &before);

    // Answered once: a second answer is refused too, and one past the cap before that.
    let mut net = Net::new(1, 1);
    net.connect_offering(0, 0, b"offer");
    net.pump();
    let long: &'static [u8] = Box::leak(vec![0u8; MAX_DATA_PATH_LEN + 1].into_boxed_slice());
    assert_eq!(
        answer(&mut net, 0, long),
        Err(UsageError::DataPathTooLong {
            len: MAX_DATA_PATH_LEN + 1,
            max: MAX_DATA_PATH_LEN
        })
    );
    assert!(net.receivers[0].poll_output().is_none());
    answer(&mut net, 0, b"no").unwrap();
    net.pump();
    assert!(net.senders[0].is_peer_ready(rx_peer(0)));
    assert_eq!(
        answer(&mut net, 0, b"again"),
        Err(UsageError::NoOfferPending(tx_peer(0)))
    );
}

#[test]
fn an_offer_past_the_cap_is_refused_as_input_and_as_bytes() {
    let mut net = Net::new(1, 1);
    let now = net.now;
    let long = Bytes::from(vec![0u8; MAX_DATA_PATH_LEN + 1]);
    assert_eq!(
        net.senders[0].handle_transport(
            now,
            TransportInput::PeerConnectedWithOffer {
                peer: rx_peer(0),
                offer: long,
            }
        ),
        Err(UsageError::DataPathTooLong {
            len: MAX_DATA_PATH_LEN + 1,
            max: MAX_DATA_PATH_LEN
        })
    );
    assert_eq!(net.senders[0].peer_count(), 0);
    assert!(net.senders[0].poll_output().is_none());

    // A Hello whose offer declares more than the cap: a decode error, the peer is closed.
    net.connect_offering(0, 0, b"abc");
    let mut hello = net.senders[0]
        .poll_output()
        .and_then(|o| match o {
            Output::Transmit { bytes, .. } => Some(bytes.to_vec()),
            _ => None,
        })
        .expect("the Hello");
    let at = hello.len() - 7;
    hello[at..at + 4].copy_from_slice(&(MAX_DATA_PATH_LEN as u32 + 1).to_le_bytes());
    net.receivers[0]
        .handle_transport(
            now,
            TransportInput::FrameReceived {
                peer: tx_peer(0),
                bytes: Bytes::from(hello),
            },
        )
        .unwrap();
    let outputs: Vec<Output> = std::iter::from_fn(|| net.receivers[0].poll_output()).collect();
    let error = DecodeError::Malformed {
        kind: FrameKind::Hello,
        field: "data_path_offer",
        reason: Malformation::TooLong {
            len: MAX_DATA_PATH_LEN + 1,
            max: MAX_DATA_PATH_LEN,
        },
    };
    assert!(outputs.iter().any(|o| matches!(
        o,
        Output::Event(Event::ProtocolViolation { error: ProtocolError::Undecodable { error: e }, .. })
            if *e == error
    )), "{outputs:?}");
    assert!(outputs.iter().any(|o| matches!(
        o,
        Output::ClosePeer {
            reason: CloseReason::ProtocolViolation,
            ..
        }
    )));
    assert!(!outputs.iter().any(|o| matches!(o, Output::DataPath(_))));
}
