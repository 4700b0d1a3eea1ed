//! A buggy or malicious writer, played by a raw socket speaking the wire format: every write
//! outside the receiver's grant is refused, never applied, counted, reported to the writer as a
//! failure of the request, and the connection is closed.

mod support;

use std::io::Write;
use std::time::Duration;

use kvpipe_core::session::Registration;
use kvpipe_core::wire::{DataWrite, Frame, RecvRegistration, Role, TransferStatus};
use kvpipe_core::{AnchoredRun, BlockId, Event, GrantId, PeerId, RegionId, RequestId};
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

/// A receiver, a raw writer that completed the handshake, and the registration it received
/// (blocks 5 and 6 granted).
fn setup() -> (
    TcpReceiver,
    kvpipe_tcp::RegionTable,
    RawPeer,
    RecvRegistration,
) {
    let (rx, regions) = receiver(2, 64);
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
    let Some(Frame::RecvRegistration(reg)) =
        raw.recv_until(|f| matches!(f, Frame::RecvRegistration(_)))
    else {
        panic!("no registration");
    };
    (rx, regions, raw, reg)
}

fn send_write(raw: &mut RawPeer, w: DataWrite, payload_len: usize, byte: u8) {
    raw.send(&Frame::DataWrite(w));
    let _ = raw.stream.write_all(&vec![byte; payload_len]);
}

fn zeros_except(regions: &kvpipe_tcp::RegionTable, applied: &[(u32, u64, u64)]) -> bool {
    [20u32, 21].iter().all(|&r| {
        let bytes = regions.get(RegionId(r)).unwrap().to_vec();
        bytes.iter().enumerate().all(|(i, &b)| {
            let i = i as u64;
            let inside = applied
                .iter()
                .any(|&(ar, off, len)| ar == r && i >= off && i < off + len);
            inside || b == 0
        })
    })
}

/// Sends one valid write (applied), then `bad`; checks the refusal.
fn refused(bad: DataWrite, request_known: bool) {
    let (rx, regions, mut raw, reg) = setup();
    let good = DataWrite {
        request: REQ,
        grant: reg.grant,
        region: RegionId(20),
        offset: 5 * LAYER_BLOCK,
        len: LAYER_BLOCK,
    };
    send_write(&mut raw, good, LAYER_BLOCK as usize, 0xab);
    let bad = DataWrite {
        grant: if bad.grant == GrantId(0) {
            reg.grant
        } else {
            bad.grant
        },
        ..bad
    };
    send_write(&mut raw, bad, 4096, 0xcd);
    if request_known {
        let cancel = raw.recv_until(|f| matches!(f, Frame::Cancel(c) if c.request == REQ));
        assert!(cancel.is_some(), "the writer is told the request failed");
    }
    assert!(
        raw.closed_by_node(),
        "the connection is not trusted further"
    );
    // The request ends on the receiver and its memory is handed back.
    let ended = wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::Quiesced { request } if *request == REQ),
        T,
    );
    let Ok((_, before)) = &ended else {
        panic!("{ended:?}")
    };
    if request_known {
        // The engine learns why: a grant violation by that writer, not a plain cancel.
        assert!(
            before.iter().any(|e| matches!(
                e,
                Event::Failed { request, cause: TransferStatus::GrantViolation, .. } if *request == REQ
            )),
            "{before:?}"
        );
    }
    let stats = rx.stats();
    assert_eq!(stats.writes_refused, 1, "{stats:?}");
    assert_eq!(stats.writes_applied, 1, "{stats:?}");
    assert!(zeros_except(
        &regions,
        &[(20, 5 * LAYER_BLOCK, LAYER_BLOCK)]
    ));
    let mut block = vec![0u8; LAYER_BLOCK as usize];
    regions
        .get(RegionId(20))
        .unwrap()
        .copy_to(5 * LAYER_BLOCK, &mut block)
        .unwrap();
    assert!(block.iter().all(|&b| b == 0xab), "the valid write landed");
}

fn base() -> DataWrite {
    DataWrite {
        request: REQ,
        grant: GrantId(0),
        region: RegionId(20),
        offset: 5 * LAYER_BLOCK,
        len: LAYER_BLOCK,
    }
}

#[test]
fn write_to_a_block_outside_the_grant_is_refused() {
    refused(
        DataWrite {
            offset: 7 * LAYER_BLOCK,
            ..base()
        },
        true,
    );
}

#[test]
fn write_running_past_the_granted_blocks_is_refused() {
    refused(
        DataWrite {
            offset: 6 * LAYER_BLOCK + 100,
            ..base()
        },
        true,
    );
}

#[test]
fn write_with_a_wrong_grant_is_refused() {
    refused(
        DataWrite {
            grant: GrantId(0x1234_5678),
            ..base()
        },
        true,
    );
}

#[test]
fn write_to_an_unregistered_region_is_refused() {
    refused(
        DataWrite {
            region: RegionId(99),
            ..base()
        },
        true,
    );
}

#[test]
fn write_with_an_overflowing_range_is_refused_without_reading_it() {
    refused(
        DataWrite {
            offset: u64::MAX - 10,
            len: 1 << 40,
            ..base()
        },
        true,
    );
}

#[test]
fn write_for_an_unknown_request_is_refused() {
    refused(
        DataWrite {
            request: RequestId(8),
            ..base()
        },
        false,
    );
}

#[test]
fn write_before_the_handshake_is_refused() {
    let (rx, regions) = receiver(2, 64);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut raw = RawPeer::connect(addr, 0xbad);
    send_write(
        &mut raw,
        DataWrite {
            grant: GrantId(1),
            ..base()
        },
        LAYER_BLOCK as usize,
        0xcd,
    );
    assert!(raw.closed_by_node());
    // The reader counts the refusal after the core asked to close the peer, so the close can
    // reach the peer first: wait (bounded) for the count.
    assert_eq!(counted(|| rx.stats().writes_refused, 1), 1);
    assert!(zeros_except(&regions, &[]));
}

#[test]
fn garbage_instead_of_frames_closes_the_connection() {
    let (rx, regions) = receiver(2, 64);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut raw = RawPeer::connect(addr, 0xbad);
    raw.stream.write_all(&[0x55; 64]).unwrap();
    assert!(raw.closed_by_node());
    assert_eq!(counted(|| rx.stats().decode_errors, 1), 1);
    assert!(zeros_except(&regions, &[]));
}

/// Polls `count` until it reaches `want` or 5 s pass; returns the last value read.
fn counted(count: impl Fn() -> u64, want: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let n = count();
        if n >= want || std::time::Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
