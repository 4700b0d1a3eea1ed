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
        expected_part: None,
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

#[test]
fn a_data_write_header_that_does_not_decode_is_judged_as_bytes_that_are_no_frame() {
    use kvpipe_core::session::ProtocolError;
    use kvpipe_core::wire::{DecodeError, FrameHeader, FrameKind, PROTOCOL_VERSION};
    let (rx, mut raw) = registered_raw_writer();
    // A DataWrite header declaring a 16-byte body (a DataWrite's is 36), the 16 bytes, and
    // what would be its payload: the stream reader decodes the body before asking the core to
    // admit anything, and hands the bytes to the core as a frame.
    let mut bytes = FrameHeader::new(FrameKind::DataWrite, PROTOCOL_VERSION, 16)
        .to_bytes()
        .to_vec();
    bytes.extend([0u8; 16 + 64]);
    raw.stream.write_all(&bytes).unwrap();
    let failed = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::Failed { request, .. } if *request == REQ),
        T,
    );
    let Ok((Event::Failed { cause, .. }, before)) = failed else {
        panic!("{failed:?}")
    };
    assert_eq!(cause, TransferStatus::ProtocolError, "{before:?}");
    assert!(
        before.iter().any(|e| matches!(
            e,
            Event::ProtocolViolation {
                error: ProtocolError::Undecodable {
                    error: DecodeError::Malformed {
                        kind: FrameKind::DataWrite,
                        ..
                    }
                },
                ..
            }
        )),
        "{before:?}"
    );
    assert!(raw.closed_by_node());
    assert_eq!(rx.stats().decode_errors, 1);
    assert_eq!(rx.stats().writes_refused, 0, "never asked to admit");
}

/// A receiver with `tcp`'s caps and preamble timeout.
fn receiver_with(tcp: kvpipe_tcp::TcpConfig) -> (TcpReceiver, std::net::SocketAddr) {
    let config = receiver_config(2);
    let regions = regions(&config.local.groups, 64, false);
    let rx = TcpReceiver::new(config, tcp, regions).unwrap();
    let addr = rx.listen("127.0.0.1:0").unwrap();
    (rx, addr)
}

/// A sender connected to `addr` and the receiver's peer id for it, once both are ready.
fn legitimate_peer(
    rx: &TcpReceiver,
    addr: std::net::SocketAddr,
    within: Duration,
) -> (kvpipe_tcp::TcpSender, PeerId) {
    let (tx, _) = sender(1, 2, 16);
    tx.connect(addr).unwrap();
    let ready = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        within,
    );
    let Ok((Event::PeerReady { peer, .. }, _)) = ready else {
        panic!("the legitimate peer was not accepted in {within:?}: {ready:?}")
    };
    assert!(
        wait_for(
            |t| tx.next_event(t),
            |e| matches!(e, Event::PeerReady { .. }),
            within
        )
        .is_ok(),
        "the sender's handshake"
    );
    (tx, peer)
}

/// Whether the node closed `s` (end of stream or reset within `within`; `false` if it is
/// still open then).
fn closed(s: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn preamble(token: u64) -> [u8; 16] {
    kvpipe_tcp::preamble::Preamble {
        index: 0,
        count: 1,
        token,
        flags: 0,
    }
    .encode()
}

/// Preambles wait 30 s here: a node that read them one at a time would keep the legitimate
/// peer waiting far past the 20 s it is given.
fn patient() -> kvpipe_tcp::TcpConfig {
    kvpipe_tcp::TcpConfig {
        preamble_timeout: Duration::from_secs(30),
        ..tcp(1)
    }
}

#[test]
fn idle_connections_do_not_delay_a_legitimate_peer() {
    let (rx, addr) = receiver_with(patient());
    let idle: Vec<std::net::TcpStream> = (0..5)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    legitimate_peer(&rx, addr, Duration::from_secs(20));
    assert_eq!(rx.stats().unauthenticated_dropped, 0, "within the caps");
    drop(idle);
}

#[test]
fn a_preamble_trickling_in_does_not_delay_a_legitimate_peer() {
    let (rx, addr) = receiver_with(patient());
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            for b in preamble(0x51_0e).iter().take(15) {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || slow.write_all(&[*b]).is_err()
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    legitimate_peer(&rx, addr, Duration::from_secs(20));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
}

#[test]
fn a_preamble_slower_than_its_deadline_is_dropped() {
    let (rx, addr) = receiver_with(kvpipe_tcp::TcpConfig {
        preamble_timeout: Duration::from_millis(1500),
        ..tcp(1)
    });
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    let mut probe = slow.try_clone().unwrap();
    // One byte every 400 ms: each read is quick, the whole preamble would take 6 s.
    let trickle = std::thread::spawn(move || {
        for b in preamble(0x51_0e) {
            if slow.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(400));
        }
    });
    assert!(closed(&mut probe, Duration::from_secs(4)), "still open");
    assert_eq!(rx.stats().preambles_failed, 1);
    assert!(rx.peers().is_empty());
    trickle.join().unwrap();
}

#[test]
fn past_the_cap_per_address_the_oldest_unauthenticated_connection_goes() {
    let (rx, addr) = receiver_with(kvpipe_tcp::TcpConfig {
        max_unauthenticated_per_address: 4,
        ..patient()
    });
    let mut held = Vec::new();
    for i in 0..4u64 {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        if i == 1 {
            // A peer that sent its preamble and never its Hello: still unauthenticated.
            s.write_all(&preamble(0xa11ce)).unwrap();
            let start = std::time::Instant::now();
            while rx.peers().is_empty() {
                assert!(start.elapsed() < T, "bundle not attached");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        held.push(s);
        // Acceptance order is the age order.
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut fifth = std::net::TcpStream::connect(addr).unwrap();
    assert!(closed(&mut held[0], T), "the oldest is dropped");
    assert!(!closed(&mut held[2], Duration::from_millis(300)));
    // A legitimate bundle of two displaces the next two oldest: the handshaking peer first.
    let _tx = legitimate_peer(&rx, addr, T);
    assert!(closed(&mut held[1], T));
    assert!(closed(&mut held[2], T));
    assert!(!closed(&mut held[3], Duration::from_millis(300)));
    assert!(!closed(&mut fifth, Duration::from_millis(300)));
    assert_eq!(rx.stats().unauthenticated_dropped, 3);
    // The handshaking peer that was dropped is gone for the core too.
    let start = std::time::Instant::now();
    while rx.peers().len() > 1 {
        assert!(start.elapsed() < T, "{:?}", rx.peers());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn past_the_node_cap_the_oldest_unauthenticated_connection_goes() {
    let (rx, addr) = receiver_with(kvpipe_tcp::TcpConfig {
        max_unauthenticated: 3,
        ..patient()
    });
    let mut held: Vec<std::net::TcpStream> = (0..3)
        .map(|_| {
            let s = std::net::TcpStream::connect(addr).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            s
        })
        .collect();
    let _tx = legitimate_peer(&rx, addr, T);
    assert!(closed(&mut held[0], T));
    assert!(closed(&mut held[1], T));
    assert!(!closed(&mut held[2], Duration::from_millis(300)));
    // Once ready, the legitimate peer no longer counts: newcomers displace only the waiting.
    let newcomers: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    assert!(!closed(&mut held[2], Duration::from_millis(300)), "3 of 3");
    let _third = std::net::TcpStream::connect(addr).unwrap();
    assert!(closed(&mut held[2], T));
    drop(newcomers);
    assert_eq!(rx.peers().len(), 1);
}

#[test]
fn before_the_handshake_a_body_larger_than_a_hello_is_refused_at_its_header() {
    use kvpipe_core::session::ProtocolError;
    use kvpipe_core::wire::{
        DecodeError, FrameHeader, FrameKind, MAX_BODY_LEN, MAX_HANDSHAKE_BODY_LEN,
    };
    let (rx, addr) = receiver_with(tcp(1));
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&preamble(0xb16)).unwrap();
    // A Hello declaring the largest body, and one byte of it.
    s.write_all(&FrameHeader::new(FrameKind::Hello, 1, MAX_BODY_LEN).to_bytes())
        .unwrap();
    s.write_all(&[0]).unwrap();
    let violation = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::ProtocolViolation { .. }),
        T,
    );
    let Ok((Event::ProtocolViolation { error, .. }, _)) = violation else {
        panic!("{violation:?}")
    };
    assert_eq!(
        error,
        ProtocolError::Undecodable {
            error: DecodeError::BodyTooLong {
                kind: FrameKind::Hello,
                len: MAX_BODY_LEN,
                max: MAX_HANDSHAKE_BODY_LEN,
            }
        }
    );
    assert!(closed(&mut s, T));
    assert_eq!(rx.stats().decode_errors, 1);
}

#[test]
fn a_bundle_may_arrive_in_any_order() {
    let (rx, addr) = receiver_with(patient());
    let bundle = |index| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(
            &kvpipe_tcp::preamble::Preamble {
                index,
                count: 2,
                token: 0xb0_b0,
                flags: 0,
            }
            .encode(),
        )
        .unwrap();
        s
    };
    let _data = bundle(1);
    std::thread::sleep(Duration::from_millis(100));
    let mut control = RawPeer { stream: bundle(0) };
    control
        .stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    control.send(&Frame::Hello(sender_config(9).local.to_hello(Role::Sender)));
    assert!(control
        .recv_until(|f| matches!(f, Frame::HelloAccept(_)))
        .is_some());
    ready_peer(&rx);
}

/// A listener for a raw decode side, and its address.
fn raw_receiver() -> (std::net::TcpListener, std::net::SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

#[test]
fn a_registration_reaching_past_the_prompt_is_refused_by_the_sender_over_tcp() {
    use kvpipe_core::session::SendRequest;
    use kvpipe_core::wire::{RecvRegistration, TransferStatus};
    use kvpipe_core::{GrantId, ReceiverSliceId};
    let (listener, addr) = raw_receiver();
    let (tx, _) = sender(1, 1, 16);
    let peer = tx.connect(addr).unwrap();
    let (stream, _) = listener.accept().unwrap();
    let mut raw = RawPeer { stream };
    raw.stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut preamble = [0u8; 16];
    std::io::Read::read_exact(&mut raw.stream, &mut preamble).unwrap();
    raw.send(&Frame::Hello(
        receiver_config(3).local.to_hello(Role::Receiver),
    ));
    assert!(raw
        .recv_until(|f| matches!(f, Frame::HelloAccept(_)))
        .is_some());
    wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    )
    .expect("handshake");
    tx.open_request(SendRequest {
        request: REQ,
        receivers: smallvec![peer],
        beam_width: 1,
    })
    .unwrap();
    // A prompt of 8 tokens is 2 blocks; this registration starts at ordinal 1000.
    raw.send(&Frame::RecvRegistration(RecvRegistration {
        request: REQ,
        slice: ReceiverSliceId(1),
        prompt_len: 8,
        grant: GrantId(9),
        aux_capacity: 64,
        groups: vec![AnchoredRun::from_ids(1000, &[BlockId(5)])],
    }));
    let failed = wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::Failed { request, .. } if *request == REQ),
        T,
    );
    let Ok((Event::Failed { cause, .. }, before)) = failed else {
        panic!("{failed:?}")
    };
    assert_eq!(cause, TransferStatus::ProtocolError);
    let named = before.iter().any(|e| {
        matches!(e, Event::ProtocolViolation { error, .. }
            if error.to_string().contains("1001") && error.to_string().contains("8"))
    });
    assert!(named, "{before:?}");
}
