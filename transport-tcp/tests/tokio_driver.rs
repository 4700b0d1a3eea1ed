//! The async driver on loopback: a pipelined transfer lands every byte, and a write outside the
//! grant is refused exactly as with the blocking driver, and a sender closing right after its
//! request completed loses nothing.
#![cfg(feature = "tokio")]

mod support;

use std::io::Write;
use std::time::Duration;

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::{AuxData, DataWrite, Frame, Role};
use kvpipe_core::{AnchoredRun, BlockId, ChunkSpec, Event, PeerId, RegionId, RequestId};
use kvpipe_tcp::tokio_driver::{TcpReceiver, TcpSender};
use smallvec::smallvec;
use support::*;

async fn ready(next: impl AsyncFn(Duration) -> Option<Event>) -> PeerId {
    for _ in 0..100 {
        if let Some(Event::PeerReady { peer, .. }) = next(Duration::from_millis(100)).await {
            return peer;
        }
    }
    panic!("no PeerReady");
}

async fn until(
    next: impl AsyncFn(Duration) -> Option<Event>,
    pred: impl Fn(&Event) -> bool,
) -> Vec<Event> {
    let mut seen = Vec::new();
    for _ in 0..100 {
        if let Some(e) = next(Duration::from_millis(100)).await {
            let done = pred(&e);
            seen.push(e);
            if done {
                return seen;
            }
        }
    }
    panic!("not reached: {seen:?}");
}

fn receiver_node(rt: tokio::runtime::Handle) -> (TcpReceiver, kvpipe_tcp::RegionTable) {
    let config = receiver_config(2);
    let regions = regions(&config.local.groups, 64, false);
    (
        TcpReceiver::new(config, tcp(1), regions.clone(), rt).unwrap(),
        regions,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_transfer_lands_every_byte() {
    let rt = tokio::runtime::Handle::current();
    let (rx, rx_regions) = receiver_node(rt.clone());
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let config = sender_config(1);
    let tx_regions = regions(&config.local.groups, 64, true);
    let tx = TcpSender::new(config, tcp(3), tx_regions.clone(), rt).unwrap();
    let peer_at_tx = tx.connect(addr).await.unwrap();
    let peer_at_rx = ready(async |t| rx.next_event(t).await).await;
    ready(async |t| tx.next_event(t).await).await;
    let dst: Vec<BlockId> = [50, 51, 52, 7, 8, 9, 10, 30, 31, 32].map(BlockId).to_vec();
    rx.register(Registration {
        request: RequestId(1),
        prompt_len: 40,
        groups: vec![AnchoredRun::from_ids(0, &dst)],
        writers: smallvec![peer_at_rx],
        aux_capacity: 64,
        expected_part: None,
    })
    .unwrap();
    tx.open_request(SendRequest {
        request: RequestId(1),
        receivers: smallvec![peer_at_tx],
        beam_width: 1,
    })
    .unwrap();
    for (start, end) in [(0, 12), (12, 30), (30, 40)] {
        let spec = ChunkSpec {
            start,
            end,
            prompt_len: 40,
            prepopulated_len: 0,
            is_last: end == 40,
            prefix_sent_early: false,
        };
        tx.submit_chunk(
            RequestId(1),
            spec,
            &mut Linear {
                base: 3,
                blocks: 10,
            },
        )
        .unwrap();
    }
    tx.submit_aux(RequestId(1), AuxData::default()).unwrap();
    let seen = until(
        async |t| rx.next_event(t).await,
        |e| matches!(e, Event::Quiesced { .. }),
    )
    .await;
    assert!(
        seen.iter().any(|e| matches!(e, Event::Completed { .. })),
        "{seen:?}"
    );
    for (ord, id) in dst.iter().enumerate() {
        assert!(block_matches(
            &tx_regions,
            &rx_regions,
            3 + ord as u32,
            id.0
        ));
    }
    assert_eq!(rx.stats().connections, 3);
    assert_eq!(rx.stats().bytes_applied, 10 * 2 * LAYER_BLOCK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_receiver_refuses_a_write_outside_the_grant() {
    let rt = tokio::runtime::Handle::current();
    let (rx, rx_regions) = receiver_node(rt);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let raw_task = tokio::task::spawn_blocking(move || {
        let mut raw = RawPeer::connect(addr, 0xbad);
        raw.send(&Frame::Hello(sender_config(9).local.to_hello(Role::Sender)));
        raw.recv_until(|f| matches!(f, Frame::HelloAccept(_)))
            .unwrap();
        raw
    });
    let peer = ready(async |t| rx.next_event(t).await).await;
    let mut raw = raw_task.await.unwrap();
    rx.register(Registration {
        request: RequestId(7),
        prompt_len: 8,
        groups: vec![AnchoredRun::from_ids(0, &[BlockId(5), BlockId(6)])],
        writers: smallvec![peer],
        aux_capacity: 64,
        expected_part: None,
    })
    .unwrap();
    let raw = tokio::task::spawn_blocking(move || {
        let Some(Frame::RecvRegistration(reg)) =
            raw.recv_until(|f| matches!(f, Frame::RecvRegistration(_)))
        else {
            panic!("no registration")
        };
        raw.send(&Frame::DataWrite(DataWrite {
            request: RequestId(7),
            grant: reg.grant,
            region: RegionId(20),
            offset: 7 * LAYER_BLOCK,
            len: LAYER_BLOCK,
        }));
        let _ = raw.stream.write_all(&[0xcd; LAYER_BLOCK as usize]);
        let cancel = raw.recv_until(|f| matches!(f, Frame::Cancel(_)));
        (cancel.is_some(), raw.closed_by_node())
    })
    .await
    .unwrap();
    assert_eq!(raw, (true, true));
    until(
        async |t| rx.next_event(t).await,
        |e| matches!(e, Event::Quiesced { .. }),
    )
    .await;
    assert_eq!(rx.stats().writes_refused, 1);
    assert!(rx_regions
        .get(RegionId(20))
        .unwrap()
        .to_vec()
        .iter()
        .all(|&b| b == 0));
}

/// The async sender closes as soon as its engine saw the request complete: the receiver still
/// lands every byte and completes it, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_sender_closing_right_after_completing_loses_nothing() {
    let rt = tokio::runtime::Handle::current();
    let (rx, rx_regions) = receiver_node(rt.clone());
    let addr = rx.listen("127.0.0.1:0").unwrap();
    for round in 0..20u32 {
        let config = sender_config(10 + u64::from(round));
        let tx_regions = regions(&config.local.groups, 64, true);
        let tx = TcpSender::new(config, tcp(2), tx_regions.clone(), rt.clone()).unwrap();
        let peer_at_tx = tx.connect(addr).await.unwrap();
        let peer_at_rx = ready(async |t| rx.next_event(t).await).await;
        ready(async |t| tx.next_event(t).await).await;
        let request = RequestId(100 + u64::from(round));
        let dst: Vec<BlockId> = (0..32).map(BlockId).collect();
        rx.register(Registration {
            request,
            prompt_len: 128,
            groups: vec![AnchoredRun::from_ids(0, &dst)],
            writers: smallvec![peer_at_rx],
            aux_capacity: 64,
            expected_part: None,
        })
        .unwrap();
        tx.open_request(SendRequest {
            request,
            receivers: smallvec![peer_at_tx],
            beam_width: 1,
        })
        .unwrap();
        let base = (round % 2) * 32;
        let spec = ChunkSpec {
            start: 0,
            end: 128,
            prompt_len: 128,
            prepopulated_len: 0,
            is_last: true,
            prefix_sent_early: false,
        };
        tx.submit_chunk(request, spec, &mut Linear { base, blocks: 32 })
            .unwrap();
        tx.submit_aux(request, AuxData::default()).unwrap();
        let seen = until(
            async |t| tx.next_event(t).await,
            |e| matches!(e, Event::Completed { .. } | Event::Failed { .. }),
        )
        .await;
        assert!(
            matches!(seen.last(), Some(Event::Completed { .. })),
            "{seen:?}"
        );
        tx.close(Duration::from_secs(5)).await.unwrap();
        let seen = until(
            async |t| rx.next_event(t).await,
            |e| matches!(e, Event::Quiesced { .. }),
        )
        .await;
        assert!(
            seen.iter().any(|e| matches!(e, Event::Completed { .. })),
            "round {round}: {seen:?}"
        );
        for ord in 0..32 {
            assert!(block_matches(&tx_regions, &rx_regions, base + ord, ord));
        }
        rx.retire(request).unwrap();
    }
}
