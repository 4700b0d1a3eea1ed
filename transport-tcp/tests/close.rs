//! Closing a node right after a transfer: everything it had queued must still reach the peer.

mod support;

use std::time::{Duration, Instant};

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{AnchoredRun, BlockId, ChunkSpec, Event, RequestId};
use smallvec::smallvec;
use support::*;

const T: Duration = Duration::from_secs(10);
const BLOCKS: u32 = 32;

/// A sender finishes a request and at once closes (odd rounds) or is dropped (even rounds):
/// the receiver must still land every byte, get the results and the aux data, and complete the
/// request. Repeated so the race between the sender's last queued frames and its exit is hit.
#[test]
fn a_sender_closing_right_after_completing_loses_nothing() {
    let rounds = 40u32;
    let started = Instant::now();
    let (rx, rx_regions) = receiver(2, u64::from(BLOCKS));
    let addr = rx.listen("127.0.0.1:0").unwrap();
    for round in 0..rounds {
        let (tx, tx_regions) = sender(100 + u64::from(round), 2, 2 * u64::from(BLOCKS));
        let at_tx = tx.connect(addr).unwrap();
        let at_rx = match wait_for(
            |t| rx.next_event(t),
            |e| matches!(e, Event::PeerReady { .. }),
            T,
        ) {
            Ok((Event::PeerReady { peer, .. }, _)) => peer,
            other => panic!("round {round}: no PeerReady at the receiver: {other:?}"),
        };
        wait_for(
            |t| tx.next_event(t),
            |e| matches!(e, Event::PeerReady { .. }),
            T,
        )
        .unwrap_or_else(|seen| panic!("round {round}: no PeerReady at the sender: {seen:?}"));

        let request = RequestId(1 + u64::from(round));
        let dst: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
        rx.register(Registration {
            request,
            prompt_len: BLOCKS * TPB,
            groups: vec![AnchoredRun::from_ids(0, &dst)],
            writers: smallvec![at_rx],
            aux_capacity: 64,
            expected_part: None,
        })
        .unwrap();
        tx.open_request(SendRequest {
            request,
            receivers: smallvec![at_tx],
            beam_width: 1,
        })
        .unwrap();
        // Alternate the source slots so every round lands different bytes.
        let base = (round % 2) * BLOCKS;
        let mut source = Linear {
            base,
            blocks: BLOCKS,
        };
        let prompt = BLOCKS * TPB;
        for (start, end) in [(0, prompt / 2), (prompt / 2, prompt)] {
            let spec = ChunkSpec {
                start,
                end,
                prompt_len: prompt,
                prepopulated_len: 0,
                is_last: end == prompt,
                prefix_sent_early: false,
            };
            tx.submit_chunk(request, spec, &mut source).unwrap();
        }
        tx.submit_aux(
            request,
            AuxData {
                prompt_tokens: prompt,
                cached_tokens: 0,
                first_tokens: vec![round],
                draft_tokens: vec![],
            },
        )
        .unwrap();
        match wait_for(
            |t| tx.next_event(t),
            |e| {
                matches!(
                    e,
                    Event::Completed { .. } | Event::Failed { .. } | Event::TimedOut { .. }
                )
            },
            T,
        ) {
            Ok((Event::Completed { .. }, _)) => {}
            other => panic!("round {round}: the sender did not complete: {other:?}"),
        }
        // The sender is done as far as its engine knows: it goes away at once.
        if round % 2 == 1 {
            tx.close(Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        } else {
            drop(tx);
        }

        match wait_for(
            |t| rx.next_event(t),
            |e| {
                matches!(
                    e,
                    Event::Completed { .. }
                        | Event::Failed { .. }
                        | Event::TimedOut { .. }
                        | Event::Cancelled { .. }
                )
            },
            T,
        ) {
            Ok((
                Event::Completed {
                    request: r, aux, ..
                },
                _,
            )) => {
                assert_eq!(r, request, "round {round}");
                assert_eq!(
                    aux.map(|a| a.first_tokens),
                    Some(vec![round]),
                    "round {round}"
                );
            }
            other => panic!("round {round}: the receiver did not complete: {other:?}"),
        }
        for ord in 0..BLOCKS {
            assert!(
                block_matches(&tx_regions, &rx_regions, base + ord, ord),
                "round {round}: block {ord}"
            );
        }
        wait_for(
            |t| rx.next_event(t),
            |e| matches!(e, Event::Quiesced { .. }),
            T,
        )
        .unwrap_or_else(|seen| panic!("round {round}: not quiesced: {seen:?}"));
        rx.retire(request).unwrap();
        assert!(
            eventually(|| rx.peers().is_empty()),
            "round {round}: the sender never left"
        );
    }
    assert_eq!(rx.counters().completions, u64::from(rounds));
    assert_eq!(rx.stats().writes_refused, 0);
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// The receiver closing after its requests completed ends in order on both sides: `close`
/// returns `Ok` once the sender, which sees the end of stream, closes its side too.
#[test]
fn a_receiver_close_is_orderly_when_the_sender_follows() {
    let (rx, _) = receiver(2, 8);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let (tx, _) = sender(1, 3, 8);
    tx.connect(addr).unwrap();
    wait_for(
        |t| rx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    )
    .unwrap();
    wait_for(
        |t| tx.next_event(t),
        |e| matches!(e, Event::PeerReady { .. }),
        T,
    )
    .unwrap();
    rx.close(Duration::from_secs(5)).unwrap();
    assert!(eventually(|| tx.peers().is_empty()));
}

/// A peer that never ends its side: `close` gives up at its deadline and says so.
#[test]
fn a_close_the_peer_does_not_answer_ends_at_the_deadline() {
    let (rx, _) = receiver(2, 8);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut raw = RawPeer::connect(addr, 7);
    // Let the node attach the connection, then close while the raw peer keeps its side open.
    assert!(eventually(|| rx.peers().len() == 1));
    let peer = rx.peers()[0];
    let started = Instant::now();
    let closed = rx.close(Duration::from_millis(300));
    assert_eq!(
        closed,
        Err(kvpipe_tcp::CloseError::Unflushed {
            peers: 1,
            which: vec![peer]
        })
    );
    // The message names the peer.
    assert!(
        closed
            .unwrap_err()
            .to_string()
            .ends_with(&format!(": {peer}")),
        "names {peer}"
    );
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(raw.closed_by_node());
}

/// A bundle whose other connections never come is dropped after the preamble timeout, before
/// the core ever hears of it.
#[test]
fn an_incomplete_bundle_is_dropped_after_the_preamble_timeout() {
    use std::io::Read;
    let config = receiver_config(2);
    let regions = regions(&config.local.groups, 8, false);
    let tcp = kvpipe_tcp::TcpConfig {
        preamble_timeout: Duration::from_millis(300),
        ..tcp(1)
    };
    let rx = kvpipe_tcp::TcpReceiver::new(config, tcp, regions).unwrap();
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let pre = kvpipe_tcp::preamble::Preamble {
        index: 0,
        count: 2,
        token: 9,
        flags: 0,
    };
    std::io::Write::write_all(&mut s, &pre.encode()).unwrap();
    assert!(eventually(|| rx.peers().len() == 1));
    // Not started: the node sends nothing (no handshake) on the lone connection.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    assert!(matches!(s.read(&mut buf), Ok(0)));
    assert!(rx.peers().is_empty());
    assert!(rx.next_event(Duration::ZERO).is_none());
}

/// Whether `cond` holds within [`T`].
fn eventually(cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// `Duration::MAX` means "no hurry", not a panic: waiting for an event with it returns the
/// event as soon as it comes, and closing with it closes (both used to overflow the clock).
#[test]
fn the_longest_timeouts_wait_instead_of_overflowing() {
    let (rx, _rx_regions) = receiver(2, u64::from(BLOCKS));
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let (tx, _tx_regions) = sender(7, 2, u64::from(BLOCKS));
    tx.connect(addr).unwrap();
    let (done, came) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = done.send((rx.next_event(Duration::MAX), tx.next_event(Duration::MAX)));
        });
        // Bounded here, so a wait that never ends fails the test instead of hanging it.
        let (at_rx, at_tx) = came.recv_timeout(T).expect("both nodes reported an event");
        assert!(at_rx.is_some() && at_tx.is_some(), "{at_rx:?} {at_tx:?}");
    });
    tx.close(Duration::MAX).unwrap();
    rx.close(Duration::MAX).unwrap();
}
