//! The verbs fabric on a real device: two fabrics in one process (each with its own poller
//! thread) connected over a loopback bootstrap, moving control messages over SEND/RECV and
//! write plans as RDMA WRITEs, and failing links the ways a fabric fails.
//!
//! These tests need an RDMA device. They are ignored by default and run in the Soft-RoCE
//! guest by `scripts/test-verbs` (`cargo test -p kvpipe-ibverbs -- --ignored`); without a
//! device they fail, they do not pass silently.

mod support;

use std::time::Duration;

use kvpipe_core::{RegionId, WriteExtent};
use kvpipe_ibverbs::{Exposure, FabricConfig, LinkFailure, Posted, WriteFailure};
use support::{open_device, Node, Recorded};

const WAIT: Duration = Duration::from_secs(20);

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn control_messages_flow_both_ways_in_order_past_the_credits_and_the_buffer_size() {
    let device = open_device();
    let config = FabricConfig {
        recv_depth: 8,
        recv_buf_len: 256,
        ..FabricConfig::default()
    };
    let a = Node::new(&device, config.clone(), vec![]);
    let b = Node::new(&device, config, vec![]);
    let addr = b.fabric.listen("127.0.0.1:0").expect("listen");
    let to_b = a.fabric.connect(addr).expect("connect");
    let to_a = b.wait_connected(WAIT);
    // Many more messages than receive buffers (credits), some longer than a buffer
    // (fragments), all in order.
    let messages: Vec<Vec<u8>> = (0..200u32)
        .map(|i| {
            let len = if i % 10 == 0 {
                1000 + i as usize
            } else {
                i as usize % 50
            };
            (0..len).map(|j| (i as usize * 7 + j) as u8).collect()
        })
        .collect();
    for m in &messages {
        a.fabric.send(to_b, m.clone()).expect("send a→b");
        b.fabric
            .send(to_a, m.iter().rev().copied().collect())
            .expect("send b→a");
    }
    let got_b = b.wait_messages(to_a, messages.len(), WAIT);
    let got_a = a.wait_messages(to_b, messages.len(), WAIT);
    assert_eq!(got_b, messages);
    let reversed: Vec<Vec<u8>> = messages
        .iter()
        .map(|m| m.iter().rev().copied().collect())
        .collect();
    assert_eq!(got_a, reversed);
    a.fabric.close(to_b, true);
    a.wait_disconnected(to_b, WAIT);
    assert_eq!(b.wait_disconnected(to_a, WAIT), LinkFailure::PeerClosed);
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_write_plan_lands_exactly_its_extents_with_sge_lists_and_split_writes() {
    let device = open_device();
    const LEN: usize = 1 << 20;
    let config = FabricConfig {
        max_sge: 4,
        max_write_bytes: 64 << 10,
        ..FabricConfig::default()
    };
    let src: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    let a = Node::new(
        &device,
        config.clone(),
        vec![(RegionId(1), src, Exposure::Local)],
    );
    let b = Node::new(
        &device,
        config,
        vec![(RegionId(2), vec![0u8; LEN], Exposure::RemoteWrite)],
    );
    let addr = b.fabric.listen("127.0.0.1:0").expect("listen");
    let link = a.fabric.connect(addr).expect("connect");
    let peer = b.wait_connected(WAIT);
    let ext = |so: u64, d: u64, len: u64| WriteExtent {
        src_region: RegionId(1),
        src_offset: so,
        dst_region: RegionId(2),
        dst_offset: d,
        len,
    };
    // Scattered sources into contiguous destinations (SGE lists), a long extent (split into
    // several writes), and gaps that must stay untouched.
    let mut plan = vec![
        ext(0, 4096, 100),
        ext(9000, 4196, 300),
        ext(20_000, 4496, 7),
    ];
    plan.push(ext(100_000, 300_000, 200_000));
    plan.extend((0..40).map(|i| ext(600_000 + i * 1000, 700_000 + i * 512, 512)));
    assert_eq!(a.fabric.post_writes(link, 77, &plan), Ok(Posted::Queued));
    assert_eq!(a.wait_writes(link, 77, WAIT), Ok(()));
    let dst = b.region(RegionId(2));
    let src = a.region(RegionId(1));
    let mut expected = vec![0u8; LEN];
    for e in &plan {
        let (s, d, l) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
        expected[d..d + l].copy_from_slice(&src[s..s + l]);
    }
    assert!(
        dst == expected,
        "destination differs from the plan's extents"
    );
    // A plan of zero-length extents is done at once.
    assert_eq!(
        a.fabric.post_writes(link, 78, &[ext(0, 0, 0)]),
        Ok(Posted::Done)
    );
    // Unregistered sources and unannounced destinations are refused before posting.
    let mut bad = ext(0, 0, 8);
    bad.src_region = RegionId(9);
    assert!(matches!(
        a.fabric.post_writes(link, 79, &[bad]),
        Err(WriteFailure::Unmappable(_))
    ));
    let mut bad = ext(0, 0, 8);
    bad.dst_region = RegionId(9);
    assert!(matches!(
        a.fabric.post_writes(link, 80, &[bad]),
        Err(WriteFailure::Unmappable(_))
    ));
    // The link is still fine.
    a.fabric.send(link, b"still up".to_vec()).expect("send");
    assert_eq!(b.wait_messages(peer, 1, WAIT), [b"still up".to_vec()]);
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_write_outside_the_peers_registration_is_a_remote_access_error_that_fails_both_sides() {
    let device = open_device();
    let a = Node::new(
        &device,
        FabricConfig::default(),
        vec![(RegionId(1), vec![1u8; 8192], Exposure::Local)],
    );
    let b = Node::new(
        &device,
        FabricConfig::default(),
        vec![(RegionId(2), vec![0u8; 4096], Exposure::RemoteWrite)],
    );
    let addr = b.fabric.listen("127.0.0.1:0").expect("listen");
    let link = a.fabric.connect(addr).expect("connect");
    let peer = b.wait_connected(WAIT);
    // The destination ends 4 KiB past the announced region: only the peer's adapter knows.
    let plan = [WriteExtent {
        src_region: RegionId(1),
        src_offset: 0,
        dst_region: RegionId(2),
        dst_offset: 0,
        len: 8192,
    }];
    assert_eq!(a.fabric.post_writes(link, 5, &plan), Ok(Posted::Queued));
    match a.wait_writes(link, 5, WAIT) {
        Err(WriteFailure::Completion(name, _)) => assert_eq!(name, "REM_ACCESS_ERR"),
        other => panic!("expected a remote access error, got {other:?}"),
    }
    assert!(matches!(
        a.wait_disconnected(link, WAIT),
        LinkFailure::Completion {
            name: "REM_ACCESS_ERR",
            ..
        }
    ));
    // The peer's link goes down too (it sees the bootstrap socket end, or its own error).
    b.wait_disconnected(peer, WAIT);
    // Nothing landed past... or inside: the adapter refuses the whole write.
    assert!(b.region(RegionId(2)).iter().all(|&x| x == 0));
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_queue_pair_in_error_flushes_its_work_and_takes_only_its_link_down() {
    let device = open_device();
    const LEN: usize = 8 << 20;
    let a = Node::new(
        &device,
        FabricConfig::default(),
        vec![(RegionId(1), vec![3u8; LEN], Exposure::Local)],
    );
    let b = Node::new(
        &device,
        FabricConfig::default(),
        vec![(RegionId(2), vec![0u8; LEN], Exposure::RemoteWrite)],
    );
    let addr = b.fabric.listen("127.0.0.1:0").expect("listen");
    let doomed = a.fabric.connect(addr).expect("connect");
    let doomed_b = b.wait_connected(WAIT);
    let healthy = a.fabric.connect(addr).expect("connect");
    let healthy_b = b.wait_connected(WAIT);
    let plan: Vec<WriteExtent> = (0..64)
        .map(|i| WriteExtent {
            src_region: RegionId(1),
            src_offset: i * (LEN as u64 / 64),
            dst_region: RegionId(2),
            dst_offset: i * (LEN as u64 / 64),
            len: LEN as u64 / 64,
        })
        .collect();
    assert_eq!(a.fabric.post_writes(doomed, 1, &plan), Ok(Posted::Queued));
    a.fabric.inject_error_state(doomed).expect("QP to ERR");
    // The batch either finished before the error or was flushed; the link goes down on the
    // first flushed completion (its receive buffers flush even when no write is left), on
    // both sides.
    assert!(
        matches!(
            a.wait_disconnected(doomed, WAIT),
            LinkFailure::Completion {
                name: "WR_FLUSH_ERR",
                ..
            }
        ),
        "{:?}",
        a.events()
    );
    b.wait_disconnected(doomed_b, WAIT);
    assert!(a.fabric.send(doomed, vec![1]).is_err());
    // The other link carries on.
    assert_eq!(
        a.fabric.post_writes(healthy, 2, &plan[..4]),
        Ok(Posted::Queued)
    );
    assert_eq!(a.wait_writes(healthy, 2, WAIT), Ok(()));
    a.fabric.send(healthy, b"ok".to_vec()).expect("send");
    assert_eq!(b.wait_messages(healthy_b, 1, WAIT), [b"ok".to_vec()]);
    let events = a.events();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Recorded::Disconnected(l, _) if *l == healthy)),
        "the healthy link went down: {events:?}"
    );
    drop(b);
    a.wait_disconnected(healthy, WAIT);
}
