//! Hostile peers on real sockets: bytes that are no frame, connections that never say who they
//! are or say it one byte at a time, floods of them, and bodies declared larger than a
//! handshake before it. The node stays bounded and keeps serving legitimate peers.

mod support;

use std::io::Write;
use std::time::Duration;

use kvpipe_core::session::Registration;
use kvpipe_core::wire::{Frame, Role, TransferStatus};
use kvpipe_core::{AnchoredRun, BlockId, Event, PeerId, RequestId};
use kvpipe_tcp::TcpReceiver;
use smallvec::smallvec;
use support::*;

const T: Duration = Duration::from_secs(10);
const REQ: RequestId = RequestId(7);

fn ready_peer(rx: &TcpReceiver) -> PeerId {
    match wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    ) {
        Ok((Event::PeerReady { peer, .. }, _)) => peer,
        other => panic!("no PeerReady: {other:?}"),
    }
}

/// A receiver and a raw writer that completed the handshake and got a registration for `REQ`.
fn registered_raw_writer() -> (TcpReceiver, RawPeer) {
    let (rx, _) = receiver(2, 64);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut raw = RawPeer::connect(addr, 0xbad);
    raw.send(&Frame::Hello(sender_config(9).local.to_hello(Role::Sender)));
    raw.recv_until(|f| matches!(f, Frame::HelloAccept(_)))
        .expect("handshake accepted");
    let peer = ready_peer(&rx);
    rx.register(Registration {
        request: REQ,
        prompt_len: 8,
        groups: vec![AnchoredRun::from_ids(0, &[BlockId(5), BlockId(6)])],
        writers: smallvec![peer],
        aux_capacity: 64,
    })
    .unwrap();
    raw.recv_until(|f| matches!(f, Frame::RecvRegistration(_)))
        .expect("registration");
    (rx, raw)
}

#[test]
fn bytes_that_are_no_frame_fail_the_writers_sessions_as_a_protocol_error() {
    let (rx, mut raw) = registered_raw_writer();
    raw.stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let failed = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::Failed { request, .. } if *request == REQ),
        T,
    );
    let Ok((Event::Failed { cause, .. }, before)) = failed else {
        panic!("{failed:?}")
    };
    // The core judged the bytes: a protocol error, not a lost peer.
    assert_eq!(cause, TransferStatus::ProtocolError, "{before:?}");
    assert!(
        before
            .iter()
            .any(|e| matches!(e, Event::ProtocolViolation { .. })),
        "{before:?}"
    );
    assert!(raw.closed_by_node());
    assert_eq!(rx.stats().decode_errors, 1);
}
