//! Failures on real sockets: a stalled writer, a receiver that drops its connection mid-write
//! and a sender process that is killed. The affected sessions fail on both sides within their
//! deadlines and reach `Quiesced`; other requests carry on.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::{
    AuxData, DataWrite, Frame, HelloAccept, RecvRegistration, Role, TransferStatus,
};
use kvpipe_core::ChunkSpec;
use kvpipe_core::{
    AnchoredRun, BlockId, Event, GrantId, InstanceId, PeerId, ReceiverSliceId, RegionId, RequestId,
};
use kvpipe_tcp::{TcpReceiver, TcpSender};
use smallvec::smallvec;
use support::*;

const T: Duration = Duration::from_secs(10);

fn ready_peer(next: impl Fn(Duration) -> Option<Event>) -> PeerId {
    match wait_for(next, |e| matches!(e, Event::PeerReady { .. }), T) {
        Ok((Event::PeerReady { peer, .. }, _)) => peer,
        other => panic!("no PeerReady: {other:?}"),
    }
}

fn register(rx: &TcpReceiver, request: RequestId, first_slot: u32, writer: PeerId) {
    let ids: Vec<BlockId> = (first_slot..first_slot + 10).map(BlockId).collect();
    rx.register(Registration {
        request,
        prompt_len: 40,
        groups: vec![AnchoredRun::from_ids(0, &ids)],
        writers: smallvec![writer],
        aux_capacity: 64,
        expected_part: None,
    })
    .unwrap();
}

/// A whole healthy transfer of `request` (10 blocks from slot 0) from `tx` to `peer`.
fn send_whole(tx: &TcpSender, peer: PeerId, request: RequestId) {
    tx.open_request(SendRequest {
        request,
        receivers: smallvec![peer],
        beam_width: 1,
    })
    .unwrap();
    let spec = ChunkSpec {
        start: 0,
        end: 40,
        prompt_len: 40,
        prepopulated_len: 0,
        is_last: true,
        prefix_sent_early: false,
    };
    tx.submit_chunk(
        request,
        spec,
        &mut Linear {
            base: 0,
            blocks: 10,
        },
    )
    .unwrap();
    tx.submit_aux(
        request,
        AuxData {
            prompt_tokens: 40,
            ..AuxData::default()
        },
    )
    .unwrap();
}

/// Collects receiver events until both `failed` quiesced and `healthy` completed.
fn expect_outcomes(
    next: impl Fn(Duration) -> Option<Event>,
    failed: RequestId,
    healthy: Option<RequestId>,
    within: Duration,
    mut seen: Vec<Event>,
) -> Vec<Event> {
    let start = Instant::now();
    let done = |seen: &[Event]| {
        let q = seen
            .iter()
            .any(|e| matches!(e, Event::Quiesced { request } if *request == failed));
        let c = healthy.is_none_or(|h| {
            seen.iter()
                .any(|e| matches!(e, Event::Completed { request, .. } if *request == h))
        });
        q && c
    };
    while !done(&seen) {
        assert!(start.elapsed() < within, "outcomes not reached: {seen:?}");
        if let Some(e) = next(Duration::from_millis(50)) {
            seen.push(e);
        }
    }
    let failed_first = seen.iter().position(|e| {
        matches!(e,
            Event::Failed { request, .. } | Event::TimedOut { request, .. }
                if *request == failed)
    });
    let quiesced = seen
        .iter()
        .position(|e| matches!(e, Event::Quiesced { request } if *request == failed));
    assert!(
        failed_first.is_some() && failed_first < quiesced,
        "the failure is reported before Quiesced: {seen:?}"
    );
    seen
}

#[test]
fn stalled_writer_fails_its_session_within_the_liveness_deadline() {
    let (rx, regions) = receiver(2, 64);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    // The stalled writer: a raw socket that stops in the middle of a payload.
    let mut raw = RawPeer::connect(addr, 0x57a11);
    raw.send(&Frame::Hello(sender_config(9).local.to_hello(Role::Sender)));
    raw.recv_until(|f| matches!(f, Frame::HelloAccept(_)))
        .unwrap();
    let raw_peer = ready_peer(|t| rx.next_event(t));
    // A healthy sender.
    let (tx, tx_regions) = sender(1, 2, 64);
    let tx_peer = tx.connect(addr).unwrap();
    let healthy_peer = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| tx.next_event(t));

    register(&rx, RequestId(1), 0, raw_peer);
    let Some(Frame::RecvRegistration(reg)) =
        raw.recv_until(|f| matches!(f, Frame::RecvRegistration(_)))
    else {
        panic!("no registration")
    };
    raw.send(&Frame::DataWrite(DataWrite {
        request: RequestId(1),
        grant: reg.grant,
        region: RegionId(20),
        offset: 0,
        len: LAYER_BLOCK,
    }));
    raw.stream.write_all(&[0xee; 100]).unwrap();
    let stalled_at = Instant::now();

    register(&rx, RequestId(2), 20, healthy_peer);
    send_whole(&tx, tx_peer, RequestId(2));

    let seen = expect_outcomes(
        |t| rx.next_event(t),
        RequestId(1),
        Some(RequestId(2)),
        T,
        vec![],
    );
    // Liveness is 600 ms: the stalled session ends well within a few deadlines.
    assert!(stalled_at.elapsed() < Duration::from_secs(4), "{seen:?}");
    assert!(
        seen.iter().any(|e| matches!(
            e,
            Event::TimedOut {
                request: RequestId(1),
                ..
            } | Event::Failed {
                request: RequestId(1),
                ..
            }
        )),
        "{seen:?}"
    );
    for ord in 0..10 {
        assert!(block_matches(&tx_regions, &regions, ord, 20 + ord));
    }
    assert!(raw.closed_by_node());
}

/// A minimal receiver played by hand: accepts one connection, handshakes, registers one
/// request, reads `read_bytes` of data and drops the connection.
fn dropping_receiver(listener: TcpListener, read_bytes: usize) {
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut pre = [0u8; 16];
    s.read_exact(&mut pre).unwrap();
    let mut raw = RawPeer { stream: s };
    raw.recv_until(|f| matches!(f, Frame::Hello(_))).unwrap();
    raw.send(&Frame::Hello(
        receiver_config(5).local.to_hello(Role::Receiver),
    ));
    raw.send(&Frame::HelloAccept(HelloAccept {
        version: 1,
        instance: InstanceId(5),
        data_path_answer: None,
    }));
    let ids: Vec<BlockId> = (0..4096).map(BlockId).collect();
    raw.send(&Frame::RecvRegistration(RecvRegistration {
        request: RequestId(3),
        slice: ReceiverSliceId(0),
        prompt_len: 4096 * TPB,
        grant: GrantId(99),
        aux_capacity: 64,
        groups: vec![AnchoredRun::from_ids(0, &ids)],
    }));
    let mut buf = vec![0u8; read_bytes];
    raw.stream.read_exact(&mut buf).unwrap();
    drop(raw);
}

#[test]
fn connection_dropped_mid_write_fails_the_sender_session() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = std::thread::spawn(move || dropping_receiver(listener, 10_000));
    let (tx, _) = sender(1, 1, 4096);
    let peer = tx.connect(addr).unwrap();
    ready_peer(|t| tx.next_event(t));
    tx.open_request(SendRequest {
        request: RequestId(3),
        receivers: smallvec![peer],
        beam_width: 1,
    })
    .unwrap();
    let spec = ChunkSpec {
        start: 0,
        end: 4096 * TPB,
        prompt_len: 4096 * TPB,
        prepopulated_len: 0,
        is_last: true,
        prefix_sent_early: false,
    };
    tx.submit_chunk(
        RequestId(3),
        spec,
        &mut Linear {
            base: 0,
            blocks: 4096,
        },
    )
    .unwrap();
    fake.join().unwrap();
    let seen = expect_outcomes(|t| tx.next_event(t), RequestId(3), None, T, vec![]);
    assert!(
        seen.iter().any(|e| matches!(
            e,
            Event::Failed {
                request: RequestId(3),
                cause: TransferStatus::PeerLost,
                ..
            }
        )),
        "{seen:?}"
    );
    assert_eq!(tx.session_count(), 1);
    tx.retire(RequestId(3)).unwrap();
}

const CHILD_ENV: &str = "KVPIPE_TCP_TEST_CHILD_ADDR";

/// Runs only as the child of `killed_sender_process_fails_its_sessions_only`: a sender that
/// sends the first chunk of request 4, then waits to be killed.
#[test]
fn child_sender_process() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (tx, _) = sender(77, 2, 64);
    let peer = tx.connect(addr.as_str()).unwrap();
    ready_peer(|t| tx.next_event(t));
    tx.open_request(SendRequest {
        request: RequestId(4),
        receivers: smallvec![peer],
        beam_width: 1,
    })
    .unwrap();
    let spec = ChunkSpec {
        start: 0,
        end: 20,
        prompt_len: 40,
        prepopulated_len: 0,
        is_last: false,
        prefix_sent_early: false,
    };
    tx.submit_chunk(
        RequestId(4),
        spec,
        &mut Linear {
            base: 0,
            blocks: 10,
        },
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn killed_sender_process_fails_its_sessions_only() {
    let (rx, regions) = receiver(2, 64);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_sender_process", "--exact", "--nocapture"])
        .env(CHILD_ENV, addr.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child_peer = ready_peer(|t| rx.next_event(t));
    register(&rx, RequestId(4), 0, child_peer);
    // Wait for the child's first chunk to land (5 blocks in 2 pools).
    let start = Instant::now();
    while rx.stats().bytes_applied < 5 * 2 * LAYER_BLOCK {
        assert!(start.elapsed() < T, "the child's first chunk never landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = Instant::now();

    let (tx, tx_regions) = sender(1, 2, 64);
    let tx_peer = tx.connect(addr).unwrap();
    ready_peer(|t| tx.next_event(t));
    let mut early = Vec::new();
    let healthy_peer = loop {
        match wait_for(
            |t| rx.next_event(t),
            |e| matches!(e, Event::PeerReady { .. }),
            T,
        ) {
            Ok((Event::PeerReady { peer, .. }, seen)) if peer != child_peer => {
                early.extend(seen);
                break peer;
            }
            Ok((e, seen)) => {
                early.extend(seen);
                early.push(e);
            }
            Err(seen) => panic!("{seen:?}"),
        }
    };
    register(&rx, RequestId(5), 20, healthy_peer);
    send_whole(&tx, tx_peer, RequestId(5));
    let seen = expect_outcomes(
        |t| rx.next_event(t),
        RequestId(4),
        Some(RequestId(5)),
        T,
        early,
    );
    assert!(killed_at.elapsed() < Duration::from_secs(4), "{seen:?}");
    assert!(
        seen.iter().any(|e| matches!(
            e,
            Event::Failed {
                request: RequestId(4),
                cause: TransferStatus::PeerLost,
                ..
            }
        )),
        "{seen:?}"
    );
    for ord in 0..5 {
        assert!(
            block_matches(&tx_regions, &regions, ord, ord),
            "child block {ord}"
        );
    }
    for ord in 0..10 {
        assert!(block_matches(&tx_regions, &regions, ord, 20 + ord));
    }
}
