//! Sessions over real verbs: a pipelined transfer, and the ways a link fails — a remote access
//! error, a queue pair in the error state (its work flushed), a killed peer process. The
//! sessions on the failed link fail on both sides within their deadlines and reach
//! `Quiesced`; sessions on other links carry on.
//!
//! These tests need an RDMA device: ignored by default, run in the Soft-RoCE guest by
//! `scripts/test-verbs`.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::{AuxData, TransferStatus};
use kvpipe_core::{AnchoredRun, BlockId, ChunkSpec, Event, PeerId, RegionId, RequestId};
use kvpipe_ibverbs::{LinkId, VerbsReceiver, VerbsSender};
use smallvec::smallvec;
use support::*;

const T: Duration = Duration::from_secs(30);
const SLOTS: u64 = 64;

fn ready_peer(next: impl Fn(Duration) -> Option<Event>) -> PeerId {
    match wait_event(next, |e| matches!(e, Event::PeerReady { .. }), T) {
        Ok((Event::PeerReady { peer, .. }, _)) => peer,
        other => panic!("no PeerReady: {other:?}"),
    }
}

/// Registers 10 blocks (40 tokens) of `request` at receiver slots `first_slot..+10`.
fn register(rx: &VerbsReceiver, request: RequestId, first_slot: u32, writer: PeerId) {
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

fn chunk(start: u32, end: u32) -> ChunkSpec {
    ChunkSpec {
        start,
        end,
        prompt_len: 40,
        prepopulated_len: 0,
        is_last: end == 40,
        prefix_sent_early: false,
    }
}

/// Opens `request` towards `peer` and submits its first chunk (5 of its 10 blocks, from
/// sender slots `base..`).
fn open_and_first_chunk(tx: &VerbsSender, peer: PeerId, request: RequestId, base: u32) {
    tx.open_request(SendRequest {
        request,
        receivers: smallvec![peer],
        beam_width: 1,
    })
    .unwrap();
    tx.submit_chunk(request, chunk(0, 20), &mut Linear { base, blocks: 10 })
        .unwrap();
}

/// The rest of a transfer opened with [`open_and_first_chunk`].
fn finish(tx: &VerbsSender, request: RequestId, base: u32) {
    tx.submit_chunk(request, chunk(20, 40), &mut Linear { base, blocks: 10 })
        .unwrap();
    tx.submit_aux(
        request,
        AuxData {
            prompt_tokens: 40,
            first_tokens: vec![7],
            ..AuxData::default()
        },
    )
    .unwrap();
}

/// Collects events until `failed` quiesced and `healthy` (if any) completed; checks the
/// failure came before `Quiesced`.
fn expect_outcomes(
    next: impl Fn(Duration) -> Option<Event>,
    failed: RequestId,
    healthy: Option<RequestId>,
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
        assert!(start.elapsed() < T, "outcomes not reached: {seen:?}");
        if let Some(e) = next(Duration::from_millis(50)) {
            seen.push(e);
        }
    }
    let failed_at = seen.iter().position(|e| {
        matches!(e,
            Event::Failed { request, .. } | Event::TimedOut { request, .. } if *request == failed)
    });
    let quiesced = seen
        .iter()
        .position(|e| matches!(e, Event::Quiesced { request } if *request == failed));
    assert!(
        failed_at.is_some() && failed_at < quiesced,
        "the failure is reported before Quiesced: {seen:?}"
    );
    seen
}

fn failed_with(seen: &[Event], request: RequestId) -> Option<TransferStatus> {
    seen.iter().find_map(|e| match e {
        Event::Failed {
            request: r, cause, ..
        } if *r == request => Some(*cause),
        _ => None,
    })
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_pipelined_transfer_lands_every_block_and_completes_on_both_sides() {
    let device = open_device();
    let mut tx_pools = Pools::new(&layout(10), SLOTS, true);
    let mut rx_pools = Pools::new(&layout(20), SLOTS, false);
    let rx = receiver(&device, 2, &mut rx_pools, |_, len| len);
    let tx = sender(&device, 1, &mut tx_pools);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let peer = tx.connect(addr).unwrap();
    let writer = ready_peer(|t| rx.next_event(t));
    assert_eq!(ready_peer(|t| tx.next_event(t)), peer);

    register(&rx, RequestId(1), 20, writer);
    open_and_first_chunk(&tx, peer, RequestId(1), 3);
    finish(&tx, RequestId(1), 3);
    let completed = |next: &dyn Fn(Duration) -> Option<Event>| {
        let (e, seen) = wait_event(next, |e| matches!(e, Event::Completed { .. }), T)
            .unwrap_or_else(|seen| panic!("no completion: {seen:?}"));
        let (_, _) = wait_event(next, |e| matches!(e, Event::Quiesced { .. }), T)
            .unwrap_or_else(|s| panic!("no Quiesced: {seen:?} {s:?}"));
        e
    };
    let bytes = 10 * 2 * LAYER_BLOCK;
    match completed(&|t| rx.next_event(t)) {
        Event::Completed {
            bytes_written, aux, ..
        } => {
            assert_eq!(bytes_written, bytes);
            assert_eq!(aux.expect("aux data").first_tokens, [7]);
        }
        e => panic!("{e:?}"),
    }
    assert!(matches!(
        completed(&|t| tx.next_event(t)),
        Event::Completed { bytes_written, .. } if bytes_written == bytes
    ));
    for ord in 0..10 {
        assert!(
            block_matches(&tx_pools, &rx_pools, 3 + ord, 20 + ord),
            "block {ord}"
        );
    }
    for slot in (0..20).chain(30..SLOTS as u32) {
        assert!(block_untouched(&rx_pools, slot), "slot {slot} was written");
    }
    assert_eq!(tx.counters().write_batches, 2);
    tx.retire(RequestId(1)).unwrap();
    rx.retire(RequestId(1)).unwrap();
    assert_eq!((tx.session_count(), rx.session_count()), (0, 0));
    assert!(
        tx.close(Duration::from_secs(5)),
        "the sender closed in order"
    );
    drop(rx);
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_remote_access_error_fails_only_its_sessions_on_both_sides() {
    let device = open_device();
    let mut a_pools = Pools::new(&layout(10), SLOTS, true);
    let mut b_pools = Pools::new(&layout(10), SLOTS, true);
    let mut rx_pools = Pools::new(&layout(20), SLOTS, false);
    // Region 20 is registered for its first 16 slots only: the adapter refuses writes past.
    let rx = receiver(&device, 3, &mut rx_pools, |r, len| {
        if r == RegionId(20) {
            16 * LAYER_BLOCK as usize
        } else {
            len
        }
    });
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let a = sender(&device, 1, &mut a_pools);
    let a_peer = a.connect(addr).unwrap();
    let a_writer = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| a.next_event(t));
    let b = sender(&device, 2, &mut b_pools);
    let b_peer = b.connect(addr).unwrap();
    let b_writer = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| b.next_event(t));

    // Request 1 lands at slots 40..50: outside region 20's registration.
    register(&rx, RequestId(1), 40, a_writer);
    register(&rx, RequestId(2), 0, b_writer);
    open_and_first_chunk(&a, a_peer, RequestId(1), 0);
    let failed_at = Instant::now();
    let a_seen = expect_outcomes(|t| a.next_event(t), RequestId(1), None, vec![]);
    assert_eq!(
        failed_with(&a_seen, RequestId(1)),
        Some(TransferStatus::WriteFailed),
        "{a_seen:?}"
    );
    // The other sender's request carries on to completion.
    open_and_first_chunk(&b, b_peer, RequestId(2), 0);
    finish(&b, RequestId(2), 0);
    let rx_seen = expect_outcomes(
        |t| rx.next_event(t),
        RequestId(1),
        Some(RequestId(2)),
        vec![],
    );
    assert!(failed_at.elapsed() < Duration::from_secs(10), "{rx_seen:?}");
    assert_eq!(
        failed_with(&rx_seen, RequestId(1)),
        Some(TransferStatus::PeerLost),
        "{rx_seen:?}"
    );
    for slot in 40..50 {
        assert!(
            rx_pools.slot(RegionId(20), slot).iter().all(|&x| x == 0),
            "slot {slot} of the unregistered part changed"
        );
    }
    for ord in 0..10 {
        assert!(block_matches(&b_pools, &rx_pools, ord, ord), "block {ord}");
    }
    // Only the failed link went down (on the sender it may still be finishing its teardown
    // after the request quiesced on the failed batch's report).
    assert_eq!(rx.peers(), vec![b_writer]);
    assert_eq!(b.peers(), vec![b_peer]);
    let start = Instant::now();
    while !a.peers().is_empty() {
        assert!(start.elapsed() < T, "the failed link never went down");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_queue_pair_in_error_fails_its_sessions_on_both_sides_and_others_carry_on() {
    let device = open_device();
    let mut a_pools = Pools::new(&layout(10), SLOTS, true);
    let mut b_pools = Pools::new(&layout(10), SLOTS, true);
    let mut rx_pools = Pools::new(&layout(20), SLOTS, false);
    let rx = receiver(&device, 3, &mut rx_pools, |_, len| len);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let a = sender(&device, 1, &mut a_pools);
    let a_peer = a.connect(addr).unwrap();
    let a_writer = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| a.next_event(t));
    let b = sender(&device, 2, &mut b_pools);
    let b_peer = b.connect(addr).unwrap();
    let b_writer = ready_peer(|t| rx.next_event(t));
    ready_peer(|t| b.next_event(t));

    register(&rx, RequestId(1), 0, a_writer);
    register(&rx, RequestId(2), 20, b_writer);
    open_and_first_chunk(&a, a_peer, RequestId(1), 0);
    // The first chunk's writes complete, then the queue pair breaks mid-request.
    let start = Instant::now();
    while a.counters().bytes_written < 5 * 2 * LAYER_BLOCK {
        assert!(start.elapsed() < T, "the first chunk never completed");
        std::thread::sleep(Duration::from_millis(5));
    }
    a.fabric()
        .inject_error_state(LinkId(a_peer.0))
        .expect("QP to ERR");
    let a_seen = expect_outcomes(|t| a.next_event(t), RequestId(1), None, vec![]);
    assert_eq!(
        failed_with(&a_seen, RequestId(1)),
        Some(TransferStatus::PeerLost),
        "{a_seen:?}"
    );
    open_and_first_chunk(&b, b_peer, RequestId(2), 30);
    finish(&b, RequestId(2), 30);
    let rx_seen = expect_outcomes(
        |t| rx.next_event(t),
        RequestId(1),
        Some(RequestId(2)),
        vec![],
    );
    assert_eq!(
        failed_with(&rx_seen, RequestId(1)),
        Some(TransferStatus::PeerLost),
        "{rx_seen:?}"
    );
    for ord in 0..5 {
        assert!(
            block_matches(&a_pools, &rx_pools, ord, ord),
            "first chunk block {ord}"
        );
    }
    for ord in 0..10 {
        assert!(
            block_matches(&b_pools, &rx_pools, 30 + ord, 20 + ord),
            "block {ord}"
        );
    }
    a.retire(RequestId(1)).unwrap();
    rx.retire(RequestId(1)).unwrap();
}

const CHILD_ENV: &str = "KVPIPE_VERBS_TEST_CHILD_ADDR";

/// Runs only as the child of `a_killed_sender_process_fails_its_sessions_only` (with the
/// address in its environment): a sender that sends the first chunk of request 4, then waits
/// to be killed.
#[test]
#[ignore = "needs an RDMA device: the child of a_killed_sender_process_fails_its_sessions_only"]
fn child_sender_process() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let device = open_device();
    let mut pools = Pools::new(&layout(10), SLOTS, true);
    let tx = sender(&device, 77, &mut pools);
    let peer = tx.connect(addr.as_str()).unwrap();
    ready_peer(|t| tx.next_event(t));
    open_and_first_chunk(&tx, peer, RequestId(4), 0);
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_killed_sender_process_fails_its_sessions_only() {
    let device = open_device();
    let mut rx_pools = Pools::new(&layout(20), SLOTS, false);
    let expected = Pools::new(&layout(10), SLOTS, true);
    let rx = receiver(&device, 2, &mut rx_pools, |_, len| len);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_sender_process",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, addr.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let child_peer = ready_peer(|t| rx.next_event(t));
    register(&rx, RequestId(4), 0, child_peer);
    // The child's first chunk (5 blocks) lands.
    let start = Instant::now();
    while !(0..5).all(|o| block_matches(&expected, &rx_pools, o, o)) {
        assert!(start.elapsed() < T, "the child's first chunk never landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = Instant::now();

    let mut tx_pools = Pools::new(&layout(10), SLOTS, true);
    let tx = sender(&device, 1, &mut tx_pools);
    let tx_peer = tx.connect(addr).unwrap();
    ready_peer(|t| tx.next_event(t));
    let mut early = Vec::new();
    let healthy = loop {
        match wait_event(
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
    register(&rx, RequestId(5), 20, healthy);
    open_and_first_chunk(&tx, tx_peer, RequestId(5), 0);
    finish(&tx, RequestId(5), 0);
    let seen = expect_outcomes(
        |t| rx.next_event(t),
        RequestId(4),
        Some(RequestId(5)),
        early,
    );
    assert!(killed_at.elapsed() < Duration::from_secs(10), "{seen:?}");
    assert_eq!(
        failed_with(&seen, RequestId(4)),
        Some(TransferStatus::PeerLost),
        "{seen:?}"
    );
    for ord in 0..10 {
        assert!(
            block_matches(&tx_pools, &rx_pools, ord, 20 + ord),
            "block {ord}"
        );
    }
}

/// `Duration::MAX` means "no hurry", not a panic: waiting for an event with it returns the
/// event as soon as it comes, and closing with it closes (both used to overflow the clock).
#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn the_longest_timeouts_wait_instead_of_overflowing() {
    let device = open_device();
    let mut tx_pools = Pools::new(&layout(10), SLOTS, true);
    let mut rx_pools = Pools::new(&layout(20), SLOTS, false);
    let rx = receiver(&device, 2, &mut rx_pools, |_, len| len);
    let tx = sender(&device, 1, &mut tx_pools);
    let addr = rx.listen("127.0.0.1:0").unwrap();
    tx.connect(addr).unwrap();
    // On threads and bounded here, so a wait that never ends fails the test instead of hanging.
    let (done, came) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let events = (rx.next_event(Duration::MAX), tx.next_event(Duration::MAX));
        let closed = (tx.close(Duration::MAX), rx.close(Duration::MAX));
        let _ = done.send((events, closed));
    });
    let ((at_rx, at_tx), _) = came.recv_timeout(T).expect("events and closes in time");
    assert!(at_rx.is_some() && at_tx.is_some(), "{at_rx:?} {at_tx:?}");
}
