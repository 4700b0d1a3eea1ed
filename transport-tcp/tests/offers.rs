//! Peer-copy offers inside the core's handshake, over real sockets and without a GPU: the
//! sender's offer rides in its `Hello`, the receiver's answer in its `HelloAccept` (nothing
//! travels before the `Hello` any more), and a node that cannot pull declines with the reason.

mod support;

use std::net::TcpListener;
use std::time::Duration;

use bytes::Bytes;
use kvpipe_core::wire::{Frame, HelloAccept, Role};
use kvpipe_core::{Event, InstanceId};
use kvpipe_tcp::{TcpConfig, TcpDataPath, TcpReceiver, TcpSender};
use support::*;

const T: Duration = Duration::from_secs(10);

/// A peer-copy offer record (version 2) that offers nothing: a decline saying `why`.
fn declined_offer(why: &str) -> Bytes {
    let mut b = b"KVPC\x02\x00".to_vec();
    b.extend((why.len() as u16).to_le_bytes());
    b.extend(why.as_bytes());
    Bytes::from(b)
}

#[test]
fn an_offer_in_the_hello_is_answered_in_the_hello_accept_with_the_reason() {
    let config = receiver_config(2);
    let rx_regions = regions(&config.local.groups, 16, false);
    let rx_tcp = TcpConfig {
        data_path: TcpDataPath::Auto,
        ..tcp(1)
    };
    let rx = TcpReceiver::new(config, rx_tcp, rx_regions).unwrap();
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut raw = RawPeer::connect(addr, 7);
    let mut hello = sender_config(1).local.to_hello(Role::Sender);
    hello.data_path_offer = Some(declined_offer("testing"));
    raw.send(&Frame::Hello(hello.clone()));
    // The receiver's Hello, then its HelloAccept carrying the answer: a decline (this
    // receiver's pools are host memory), with the reason.
    let mut frames = Vec::new();
    while let Some(f) = raw.recv() {
        let accept = matches!(f, Frame::HelloAccept(_));
        frames.push(f);
        if accept {
            break;
        }
    }
    assert!(
        matches!(frames[..], [Frame::Hello(_), Frame::HelloAccept(_)]),
        "{frames:?}"
    );
    let Some(Frame::HelloAccept(HelloAccept {
        data_path_answer: Some(answer),
        ..
    })) = frames.pop()
    else {
        panic!("no answer");
    };
    assert_eq!(&answer[..6], b"KVPA\x02\x00", "a version-2 decline");
    let why = String::from_utf8_lossy(&answer[8..]);
    assert!(why.contains("host memory"), "{why}");
    // The receiver is ready once it answered; no peer copies.
    match wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    ) {
        Ok((Event::PeerReady { role, .. }, _)) => assert_eq!(role, Role::Sender),
        other => panic!("{other:?}"),
    }
    assert_eq!(rx.stats().peer_copy_peers, 0);
    // The sender's own HelloAccept completes the handshake on its side too.
    raw.send(&Frame::HelloAccept(HelloAccept {
        version: 1,
        instance: InstanceId(1),
        data_path_answer: None,
    }));
}

#[test]
fn a_sender_offering_to_a_peer_that_answers_nothing_uses_the_sockets() {
    // A receiver played by hand that takes no offers: its HelloAccept carries no answer.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut raw = RawPeer { stream: s };
        let mut pre = [0u8; 16];
        std::io::Read::read_exact(&mut raw.stream, &mut pre).unwrap();
        let Some(Frame::Hello(hello)) = raw.recv() else {
            panic!("no Hello");
        };
        raw.send(&Frame::Hello(
            receiver_config(5).local.to_hello(Role::Receiver),
        ));
        raw.send(&Frame::HelloAccept(HelloAccept {
            version: 1,
            instance: InstanceId(5),
            data_path_answer: None,
        }));
        // Keep the connection until the sender is ready.
        raw.recv_until(|f| matches!(f, Frame::HelloAccept(_)));
        hello.data_path_offer
    });
    let config = sender_config(1);
    let tx_regions = regions(&config.local.groups, 4, true);
    let tx_tcp = TcpConfig {
        data_path: TcpDataPath::Auto,
        ..tcp(1)
    };
    let tx = TcpSender::new(config, tx_tcp, tx_regions).unwrap();
    tx.connect(addr).unwrap();
    match wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    ) {
        Ok((Event::PeerReady { role, .. }, _)) => assert_eq!(role, Role::Receiver),
        other => panic!("{other:?}"),
    }
    assert_eq!(tx.stats().peer_copy_peers, 0);
    // `Auto` with host pools offers a decline that says why, in its Hello.
    let offer = peer.join().unwrap().expect("an offer in the Hello");
    assert_eq!(&offer[..6], b"KVPC\x02\x00");
    assert!(String::from_utf8_lossy(&offer[8..]).contains("host memory"));
}

#[test]
fn a_rejected_handshake_with_an_offer_is_reported_as_without_one() {
    // The receiver's layout differs: the handshake is rejected before any offer is evaluated.
    let config = receiver_config(2);
    let rx_regions = regions(&config.local.groups, 16, false);
    let rx = TcpReceiver::new(config, tcp(1), rx_regions).unwrap();
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut config = sender_config(1);
    config.local = kvpipe_core::session::LocalHello::new(InstanceId(1), Default::default(), {
        let mut l = layout(10);
        l[0].tokens_per_block = 8;
        l
    });
    let tx_regions = regions(&config.local.groups, 8, true);
    let tx_tcp = TcpConfig {
        data_path: TcpDataPath::Auto,
        ..tcp(2)
    };
    let tx = TcpSender::new(config, tx_tcp, tx_regions).unwrap();
    // `connect` returns the peer; its events say why it is gone.
    tx.connect(addr).unwrap();
    match wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerRejected { .. }),
        T,
    ) {
        Ok((Event::PeerRejected { reason, .. }, _)) => {
            assert_eq!(
                reason,
                kvpipe_core::wire::RejectReason::CompatibilityMismatch
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(tx.stats().peer_copy_peers, 0);
}
