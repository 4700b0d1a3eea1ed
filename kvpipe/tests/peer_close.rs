//! Closing or dropping one node: the other side loses the peer at once, whatever the transport
//! — its open requests fail with `PeerLost`, the peer is no longer ready, and no byte lands in
//! the closed decode node's pools afterwards. The in-process pair gives the same events as TCP.

mod common;

use std::time::{Duration, Instant};

use common::{configs, connect, open_request, wait_for, Sides, PROMPT, SLOT};
use kvpipe::{
    mem_pair, BlockId, BlockTables, ChunkSpec, DecodeNode, Event, PeerId, PrefillNode, RequestId,
    TcpConfig, Transport, MEM_RECEIVER_PEER, MEM_SENDER_PEER,
};
use kvpipe_core::wire::TransferStatus;

/// How long the surviving side may take to hear of the close (TCP hears it at once; the core's
/// own deadlines are tens of seconds).
const HEARS_WITHIN: Duration = Duration::from_secs(3);

const REQUEST: RequestId = RequestId(42);

/// Both nodes on `transport` over `sides`' pools, connected and ready; with the receiver as the
/// prefill node names it and the sender as the decode node names it.
fn nodes(transport: &str, sides: &mut Sides) -> (PrefillNode, DecodeNode, PeerId, PeerId) {
    let (src, dst) = (sides.src_region(), sides.dst_region());
    if transport == "mem" {
        let (s, r) = configs(Transport::Mem);
        // SAFETY: every test drops both nodes before `sides`.
        let (tx, rx) = unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap();
        let ready = |e: &Event| matches!(e, Event::PeerReady { .. });
        wait_for(&rx, "PeerReady (decode)", ready);
        wait_for(&tx, "PeerReady (prefill)", ready);
        (tx, rx, MEM_RECEIVER_PEER, MEM_SENDER_PEER)
    } else {
        let (s, r) = configs(Transport::Tcp(TcpConfig::default()));
        // SAFETY: as above.
        let (tx, rx) = unsafe { (PrefillNode::new(&s, &src), DecodeNode::new(&r, &dst)) };
        let (tx, rx) = (tx.unwrap(), rx.unwrap());
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        (tx, rx, to_receiver, to_sender)
    }
}

/// Chunk `start..end` of the prompt.
fn chunk(start: u32, end: u32) -> ChunkSpec {
    ChunkSpec {
        start,
        end,
        prompt_len: PROMPT,
        prepopulated_len: 0,
        is_last: end == PROMPT,
        prefix_sent_early: false,
    }
}

/// The first outcome (`Completed`, `Failed`, `TimedOut`, `Cancelled`) `node` reports for
/// `request` within [`HEARS_WITHIN`], then its `Quiesced`; and the peers whose `PeerLost` came
/// before that outcome.
fn outcome<E: kvpipe::Role>(node: &kvpipe::Node<E>, side: &str) -> (Event, Vec<PeerId>) {
    let deadline = Instant::now() + HEARS_WITHIN;
    let mut outcome = None;
    let mut lost = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{side}: no outcome and Quiesced within {HEARS_WITHIN:?} (outcome so far: {outcome:?})"
        );
        match node.next_event(left).expect("the node is open") {
            Some(Event::Quiesced { request }) if request == REQUEST => {
                return (outcome.expect("an outcome before Quiesced"), lost);
            }
            Some(Event::PeerLost { peer, reason }) if outcome.is_none() => {
                assert_eq!(reason, None, "{side}: the peer closed it, not this side");
                lost.push(peer);
            }
            Some(
                e @ (Event::Completed { request, .. }
                | Event::Failed { request, .. }
                | Event::TimedOut { request, .. }
                | Event::Cancelled { request, .. }),
            ) if request == REQUEST => outcome = Some(e),
            _ => {}
        }
    }
}

/// Pumps `node` until the decode side counted `bytes` landed.
fn until_landed<E: kvpipe::Role>(node: &kvpipe::Node<E>, rx: &DecodeNode, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rx.counters().unwrap().bytes_landed < bytes {
        assert!(Instant::now() < deadline, "{bytes} bytes did not land");
        let _ = node.next_event(Duration::from_millis(5)).unwrap();
        let _ = rx.next_event(Duration::from_millis(5)).unwrap();
    }
}

fn peer_lost(e: &Event, peer: PeerId) -> bool {
    matches!(
        e,
        Event::Failed { cause: TransferStatus::PeerLost, peer: Some(p), .. } if *p == peer
    )
}

/// Opens [`REQUEST`], submits its first chunk (tokens 0..12) and waits until it landed;
/// returns the prefill side's block table of the prompt.
fn first_chunk_landed(
    tx: &PrefillNode,
    rx: &DecodeNode,
    to_receiver: PeerId,
    to_sender: PeerId,
) -> Vec<Option<BlockId>> {
    let table = open_request(tx, rx, REQUEST, to_receiver, to_sender);
    let groups: [&[Option<BlockId>]; 1] = [&table];
    tx.submit_chunk(REQUEST, chunk(0, 12), &mut BlockTables { groups: &groups })
        .unwrap();
    until_landed(tx, rx, 3 * SLOT as u64);
    table
}

/// The decode node closes between two chunks: the prefill node's request fails with
/// `PeerLost` at once, the peer is no longer ready, and
/// the second chunk lands nowhere in the closed node's pool.
fn decode_closed(transport: &str) {
    let mut sides = Sides::new();
    {
        let (tx, rx, to_receiver, to_sender) = nodes(transport, &mut sides);
        let table = first_chunk_landed(&tx, &rx, to_receiver, to_sender);
        let groups: [&[Option<BlockId>]; 1] = [&table];
        rx.close(Duration::from_secs(1)).unwrap();
        let before = sides.dst.clone();
        // The chunk may be refused or accepted; either way it must not land.
        let _ = tx.submit_chunk(
            REQUEST,
            chunk(12, PROMPT),
            &mut BlockTables { groups: &groups },
        );
        let _ = tx.submit_aux(REQUEST, common::first_token());
        let (end, lost) = outcome(&tx, &format!("{transport} prefill"));
        assert!(peer_lost(&end, to_receiver), "{transport}: {end:?}");
        assert_eq!(
            lost,
            [to_receiver],
            "{transport}: PeerLost once, before the failure"
        );
        assert!(!tx.is_peer_ready(to_receiver).unwrap(), "{transport}");
        // Give any stray write time to land before looking.
        let _ = tx.next_event(Duration::from_millis(100)).unwrap();
        assert!(
            sides.dst == before,
            "{transport}: bytes landed in the closed node's pool"
        );
    }
}

/// The prefill node closes (or is dropped, `drop_it`) mid-request: the decode node's request
/// fails with `PeerLost` at once and the peer is no longer ready.
fn prefill_closed(transport: &str, drop_it: bool) {
    let mut sides = Sides::new();
    {
        let (tx, rx, to_receiver, to_sender) = nodes(transport, &mut sides);
        first_chunk_landed(&tx, &rx, to_receiver, to_sender);
        if drop_it {
            drop(tx);
        } else {
            tx.close(Duration::from_secs(1)).unwrap();
        }
        let (end, lost) = outcome(&rx, &format!("{transport} decode"));
        assert!(peer_lost(&end, to_sender), "{transport}: {end:?}");
        assert_eq!(
            lost,
            [to_sender],
            "{transport}: PeerLost once, before the failure"
        );
        assert!(!rx.is_peer_ready(to_sender).unwrap(), "{transport}");
    }
}

/// With no request open, closing either node is still heard: the other reports `PeerLost`
/// (the peer closed it), once, and the peer is no longer ready.
fn idle_close_is_heard(transport: &str) {
    for close_decode in [true, false] {
        let mut sides = Sides::new();
        let (tx, rx, to_receiver, to_sender) = nodes(transport, &mut sides);
        let lost_from = |node_events: &dyn Fn(Duration) -> Option<Event>, peer: PeerId| {
            let deadline = Instant::now() + HEARS_WITHIN;
            let mut seen = Vec::new();
            while Instant::now() < deadline {
                if let Some(e) = node_events(Duration::from_millis(20)) {
                    seen.push(e);
                }
            }
            let lost: Vec<&Event> = (seen.iter())
                .filter(|e| matches!(e, Event::PeerLost { .. }))
                .collect();
            assert_eq!(
                lost,
                [&Event::PeerLost { peer, reason: None }],
                "{transport}: {seen:?}"
            );
        };
        if close_decode {
            rx.close(Duration::from_secs(1)).unwrap();
            lost_from(&|t| tx.next_event(t).unwrap(), to_receiver);
            assert!(!tx.is_peer_ready(to_receiver).unwrap(), "{transport}");
        } else {
            tx.close(Duration::from_secs(1)).unwrap();
            lost_from(&|t| rx.next_event(t).unwrap(), to_sender);
            assert!(!rx.is_peer_ready(to_sender).unwrap(), "{transport}");
        }
    }
}

#[test]
fn a_close_with_no_request_open_is_heard_over_tcp() {
    idle_close_is_heard("tcp");
}

#[test]
fn a_close_with_no_request_open_is_heard_in_process() {
    idle_close_is_heard("mem");
}

#[test]
fn closing_the_decode_node_fails_the_prefill_side_over_tcp() {
    decode_closed("tcp");
}

#[test]
fn closing_the_decode_node_fails_the_prefill_side_in_process() {
    decode_closed("mem");
}

#[test]
fn closing_the_prefill_node_fails_the_decode_side_over_tcp() {
    prefill_closed("tcp", false);
}

#[test]
fn closing_the_prefill_node_fails_the_decode_side_in_process() {
    prefill_closed("mem", false);
}

#[test]
fn dropping_the_prefill_node_fails_the_decode_side_over_tcp() {
    prefill_closed("tcp", true);
}

#[test]
fn dropping_the_prefill_node_fails_the_decode_side_in_process() {
    prefill_closed("mem", true);
}

/// A pool of `blocks` slots of 16 MiB each (1 layer, K|V, 8 heads of 128 dims, 4096 tokens a
/// block), in region `region`.
fn big_layout(region: u32) -> Vec<kvpipe::LayerGroupLayout> {
    vec![kvpipe::LayerGroupLayout {
        layers: 1,
        kv_factor: 2,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        tokens_per_block: BIG_BLOCK,
        window: None,
        block_layout: Default::default(),
        pools: [kvpipe::PoolLayout {
            region: kvpipe::RegionId(region),
            layer_begin: 0,
            layers: 1,
            slot_bytes: BIG_SLOT as u64,
        }]
        .into_iter()
        .collect(),
        shard: Default::default(),
    }]
}

const BIG_BLOCK: u32 = 4096;
const BIG_SLOT: usize = 2 * 8 * 128 * 2 * BIG_BLOCK as usize;
const BIG_BLOCKS: u32 = 4;

/// The decode node closes right after the prefill node submitted 64 MiB: its close returns
/// only once no copy can still land, so its pool stays exactly as it was when close returned.
#[test]
fn a_closed_decode_node_pool_is_still_once_close_returned() {
    let mut src = vec![7u8; BIG_SLOT * BIG_BLOCKS as usize];
    let mut dst = vec![0u8; BIG_SLOT * BIG_BLOCKS as usize];
    let (s_regions, r_regions) = (
        [kvpipe::RawRegion::host(kvpipe::RegionId(1), &mut src)],
        [kvpipe::RawRegion::host(kvpipe::RegionId(2), &mut dst)],
    );
    let prompt = BIG_BLOCK * BIG_BLOCKS;
    {
        // SAFETY: `src` and `dst` outlive both nodes (dropped at the end of the block).
        let (tx, rx) = unsafe {
            mem_pair(
                &kvpipe::NodeConfig::new(big_layout(1)),
                &s_regions,
                &kvpipe::NodeConfig::new(big_layout(2)),
                &r_regions,
            )
        }
        .unwrap();
        let ready = |e: &Event| matches!(e, Event::PeerReady { .. });
        wait_for(&rx, "PeerReady (decode)", ready);
        wait_for(&tx, "PeerReady (prefill)", ready);
        let ids: Vec<BlockId> = (0..BIG_BLOCKS).map(BlockId).collect();
        rx.register(kvpipe::Registration {
            request: REQUEST,
            prompt_len: prompt,
            groups: vec![kvpipe::AnchoredRun::from_ids(0, &ids)],
            writers: [MEM_SENDER_PEER].into_iter().collect(),
            aux_capacity: 64,
            expected_part: None,
        })
        .unwrap();
        tx.open_request(kvpipe::SendRequest::new(REQUEST, [MEM_RECEIVER_PEER]))
            .unwrap();
        let table: Vec<Option<BlockId>> = ids.iter().copied().map(Some).collect();
        let groups: [&[Option<BlockId>]; 1] = [&table];
        let spec = ChunkSpec {
            start: 0,
            end: prompt,
            prompt_len: prompt,
            prepopulated_len: 0,
            is_last: true,
            prefix_sent_early: false,
        };
        // Pump until the registration reached the prefill side, so the chunk's write is issued
        // as it is submitted.
        wait_for(&tx, "Registered", |e| matches!(e, Event::Registered { .. }));
        tx.submit_chunk(REQUEST, spec, &mut BlockTables { groups: &groups })
            .unwrap();
        rx.close(Duration::from_secs(1)).unwrap();
        // SAFETY: no write touches `dst` once the decode side's close returned.
        let at_close = unsafe { std::slice::from_raw_parts(r_regions[0].ptr, dst.len()) }.to_vec();
        let (end, lost) = outcome(&tx, "mem prefill");
        assert!(peer_lost(&end, MEM_RECEIVER_PEER), "{end:?}");
        assert_eq!(lost, [MEM_RECEIVER_PEER]);
        let _ = tx.next_event(Duration::from_millis(200)).unwrap();
        // SAFETY: as above.
        let later = unsafe { std::slice::from_raw_parts(r_regions[0].ptr, dst.len()) };
        assert!(later == at_close, "bytes landed after close returned");
    }
}

/// After the decode node closed, a request the prefill node opens towards it fails at once with
/// `PeerLost` (the peer never comes back under that id), and the other way round a registration
/// naming the closed prefill node: neither waits out its deadline.
fn towards_a_departed_peer(transport: &str) {
    for close_decode in [true, false] {
        let mut sides = Sides::new();
        let (tx, rx, to_receiver, to_sender) = nodes(transport, &mut sides);
        let side = format!("{transport}, decode closed: {close_decode}");
        if close_decode {
            rx.close(Duration::from_secs(1)).unwrap();
            wait_for(&tx, "PeerLost (prefill)", |e| {
                matches!(e, Event::PeerLost { .. })
            });
            tx.open_request(kvpipe::SendRequest::new(REQUEST, [to_receiver]))
                .unwrap();
            let (end, _) = outcome(&tx, &side);
            assert!(peer_lost(&end, to_receiver), "{side}: {end:?}");
        } else {
            tx.close(Duration::from_secs(1)).unwrap();
            wait_for(&rx, "PeerLost (decode)", |e| {
                matches!(e, Event::PeerLost { .. })
            });
            let dst: Vec<BlockId> = (0..PROMPT.div_ceil(4)).map(BlockId).collect();
            rx.register(kvpipe::Registration {
                request: REQUEST,
                prompt_len: PROMPT,
                groups: vec![kvpipe::AnchoredRun::from_ids(0, &dst)],
                writers: [to_sender].into_iter().collect(),
                aux_capacity: 64,
                expected_part: None,
            })
            .unwrap();
            let (end, _) = outcome(&rx, &side);
            assert!(peer_lost(&end, to_sender), "{side}: {end:?}");
        }
    }
}

#[test]
fn mem_towards_a_departed_peer() {
    towards_a_departed_peer("mem");
}

#[test]
fn tcp_towards_a_departed_peer() {
    towards_a_departed_peer("tcp");
}
