//! End-to-end transfers between a sender node and a receiver node over loopback sockets.

mod support;

use std::time::Duration;

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::{AuxData, RejectReason};
use kvpipe_core::ChunkSpec;
use kvpipe_core::{AnchoredRun, BlockId, Event, PeerId, RegionId, RequestId};
use kvpipe_tcp::{RegionTable, TcpConfig, TcpDataPath, TcpReceiver, TcpSender};
use smallvec::smallvec;
use support::*;

const T: Duration = Duration::from_secs(10);

fn ready_peer(next: impl Fn(Duration) -> Option<Event>) -> PeerId {
    match wait_for(next, |e| matches!(e, Event::PeerReady { .. }), T) {
        Ok((Event::PeerReady { peer, .. }, _)) => peer,
        other => panic!("no PeerReady: {other:?}"),
    }
}

fn chunk(start: u32, end: u32, prompt_len: u32) -> ChunkSpec {
    ChunkSpec {
        start,
        end,
        prompt_len,
        prepopulated_len: 0,
        is_last: end == prompt_len,
        prefix_sent_early: false,
    }
}

fn run_transfer(connections: usize) {
    run_transfer_with(connections, TcpDataPath::Socket, TcpDataPath::Socket);
}

/// Nodes over host memory whose data paths are `tx_path` and `rx_path`.
fn nodes_with(
    connections: usize,
    tx_path: TcpDataPath,
    rx_path: TcpDataPath,
) -> ((TcpSender, RegionTable), (TcpReceiver, RegionTable)) {
    let config = receiver_config(2);
    let rx_regions = regions(&config.local.groups, 64, false);
    let rx_tcp = TcpConfig {
        data_path: rx_path,
        ..tcp(1)
    };
    let rx = TcpReceiver::new(config, rx_tcp, rx_regions.clone()).unwrap();
    let config = sender_config(1);
    let tx_regions = regions(&config.local.groups, 64, true);
    let tx_tcp = TcpConfig {
        data_path: tx_path,
        ..tcp(connections)
    };
    let tx = TcpSender::new(config, tx_tcp, tx_regions.clone()).unwrap();
    ((tx, tx_regions), (rx, rx_regions))
}

fn run_transfer_with(connections: usize, tx_path: TcpDataPath, rx_path: TcpDataPath) {
    let ((tx, tx_regions), (rx, rx_regions)) = nodes_with(connections, tx_path, rx_path);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let peer_at_tx = tx.connect(addr).unwrap();
    let peer_at_rx = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| tx.next_event(t));

    // Two requests of 10 blocks each, fragmented destinations, pipelined in three chunks.
    let dst: [Vec<u32>; 2] = [
        vec![50, 51, 52, 7, 8, 9, 10, 30, 31, 32],
        vec![1, 2, 3, 4, 5, 40, 41, 60, 61, 62],
    ];
    let base = [3u32, 20];
    for (i, d) in dst.iter().enumerate() {
        let ids: Vec<BlockId> = d.iter().map(|&b| BlockId(b)).collect();
        rx.register(Registration {
            request: RequestId(100 + i as u64),
            prompt_len: 40,
            groups: vec![AnchoredRun::from_ids(0, &ids)],
            writers: smallvec![peer_at_rx],
            aux_capacity: 64,
            expected_part: None,
        })
        .unwrap();
        tx.open_request(SendRequest {
            request: RequestId(100 + i as u64),
            receivers: smallvec![peer_at_tx],
            beam_width: 1,
        })
        .unwrap();
    }
    for (start, end) in [(0, 12), (12, 30), (30, 40)] {
        for (i, &b) in base.iter().enumerate() {
            let mut source = Linear {
                base: b,
                blocks: 10,
            };
            tx.submit_chunk(
                RequestId(100 + i as u64),
                chunk(start, end, 40),
                &mut source,
            )
            .unwrap();
        }
    }
    for i in 0..2u32 {
        let aux = AuxData {
            prompt_tokens: 40,
            cached_tokens: 0,
            first_tokens: vec![7 + i],
            draft_tokens: vec![],
        };
        tx.submit_aux(RequestId(100 + u64::from(i)), aux).unwrap();
    }
    for node in [0, 1] {
        let mut done = 0;
        let next = |t| {
            if node == 0 {
                tx.next_event(t)
            } else {
                rx.next_event(t)
            }
        };
        while done < 2 {
            match wait_for(next, |e| matches!(e, Event::Quiesced { .. }), T) {
                Ok((_, seen)) => {
                    if node == 1 {
                        let aux = seen.iter().find_map(|e| match e {
                            Event::Completed { aux, .. } => aux.clone(),
                            _ => None,
                        });
                        assert_eq!(aux.map(|a| a.prompt_tokens), Some(40), "{seen:?}");
                    }
                    assert!(
                        seen.iter().all(|e| !matches!(
                            e,
                            Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. }
                        )),
                        "{seen:?}"
                    );
                    done += 1;
                }
                Err(seen) => panic!("node {node}: not quiesced: {seen:?}"),
            }
        }
    }
    for (i, d) in dst.iter().enumerate() {
        for (ord, &slot) in d.iter().enumerate() {
            assert!(
                block_matches(&tx_regions, &rx_regions, base[i] + ord as u32, slot),
                "request {i} block {ord}"
            );
        }
    }
    // Slots outside every registration were not touched.
    let r = rx_regions.get(RegionId(20)).unwrap().to_vec();
    for slot in [0u64, 6, 11, 29, 33, 49, 63] {
        let s = (slot * LAYER_BLOCK) as usize;
        assert!(
            r[s..s + LAYER_BLOCK as usize].iter().all(|&b| b == 0),
            "slot {slot}"
        );
    }
    let stats = rx.stats();
    assert_eq!(stats.bytes_applied, 2 * 10 * 2 * LAYER_BLOCK);
    assert_eq!(stats.writes_refused, 0);
    assert_eq!(tx.stats().bytes_sent, 2 * 10 * 2 * LAYER_BLOCK);
    assert_eq!(rx.counters().completions, 2);
    assert_eq!(tx.counters().completions, 2);
    if connections > 1 {
        assert_eq!(rx.stats().connections, connections as u64);
    }
    tx.retire(RequestId(100)).unwrap();
    rx.retire(RequestId(100)).unwrap();
}

#[test]
fn transfer_over_one_connection_lands_every_byte() {
    run_transfer(1);
}

#[test]
fn transfer_over_four_connections_lands_every_byte() {
    run_transfer(4);
}

#[test]
fn incompatible_layout_is_rejected_at_the_handshake() {
    let (rx, _) = receiver(2, 8);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut config = sender_config(1);
    config.local =
        kvpipe_core::session::LocalHello::new(kvpipe_core::InstanceId(1), Default::default(), {
            let mut l = layout(10);
            l[0].tokens_per_block = 8;
            l
        });
    let regions = regions(&config.local.groups, 8, true);
    let tx = kvpipe_tcp::TcpSender::new(config, tcp(2), regions).unwrap();
    tx.connect(addr).unwrap();
    for next in [
        &(|t| tx.next_event(t)) as &dyn Fn(Duration) -> Option<Event>,
        &|t| rx.next_event(t),
    ] {
        match wait_for(next, |e| matches!(e, Event::PeerRejected { .. }), T) {
            Ok((
                Event::PeerRejected {
                    message, reason, ..
                },
                _,
            )) => {
                assert_eq!(reason, RejectReason::CompatibilityMismatch);
                assert!(
                    message.contains("local") && message.contains("remote"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn host_memory_offered_peer_copies_falls_back_to_the_sockets() {
    // Both sides ask for peer copies where possible; host memory cannot be exported, so the
    // sender's offer is a decline and every byte goes over the sockets (the transfer checks
    // them all).
    run_transfer_with(2, TcpDataPath::Auto, TcpDataPath::Auto);
    // A receiver on the socket path declines too.
    run_transfer_with(1, TcpDataPath::Auto, TcpDataPath::Socket);
}

#[test]
fn an_explicit_peer_copy_request_that_is_declined_fails_the_connect_with_the_reason() {
    let ((tx, _), (rx, _)) = nodes_with(2, TcpDataPath::PeerCopy, TcpDataPath::Auto);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let err = tx.connect(addr).unwrap_err().to_string();
    assert!(
        err.contains("peer copies refused") && err.contains("host memory"),
        "{err}"
    );
    assert_eq!(tx.stats().peer_copy_peers, 0);
    assert_eq!(rx.stats().peer_copy_peers, 0);
    // A receiver never negotiates peer copies as the connecting side.
    let ((tx2, _), (rx2, _)) = nodes_with(1, TcpDataPath::Auto, TcpDataPath::PeerCopy);
    let addr = tx2.listen("127.0.0.1:0").unwrap();
    let err = rx2.connect(addr).unwrap_err().to_string();
    assert!(err.contains("connecting sender"), "{err}");
}

#[test]
fn connecting_to_a_listener_that_never_answers_fails_in_time_and_says_so() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Accepts every connection and sends nothing.
    let held = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(listener.accept().unwrap().0);
        }
        std::thread::sleep(Duration::from_secs(3));
    });
    let config = sender_config(1);
    let tx_regions = regions(&config.local.groups, 4, true);
    // `Auto` (the CLI's default) sends its peer-copy offer and reads the listener's answer
    // before anything else.
    let tx_tcp = TcpConfig {
        preamble_timeout: Duration::from_millis(500),
        data_path: TcpDataPath::Auto,
        ..tcp(2)
    };
    let tx = TcpSender::new(config, tx_tcp, tx_regions).unwrap();
    let start = std::time::Instant::now();
    let err = tx.connect(addr).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "the peer at {addr} did not answer the peer-copy offer within 500ms"
        )),
        "{msg}"
    );
    held.join().unwrap();
}

#[test]
fn a_receiver_that_must_use_peer_copies_but_cannot_offer_them_refuses_to_listen() {
    // A receiver pulls into device memory only: `PeerCopy` (no fall back) fails at once, with
    // why.
    let ((tx, _), (rx, _)) = nodes_with(1, TcpDataPath::PeerCopy, TcpDataPath::PeerCopy);
    let err = rx.listen("127.0.0.1:0").unwrap_err().to_string();
    assert!(
        err.contains("peer copies were asked for, but this node cannot take them")
            && err.contains("host memory"),
        "{err}"
    );
    // A sender negotiates where it connects: it still listens.
    tx.listen("127.0.0.1:0").unwrap();
}
