//! One request moved between a prefill and a decode node through the engine API, whatever
//! their transport: scattered slots on both sides, two chunks and the aux data, then every
//! destination byte checked and both sides quiesced and retired.

#![allow(dead_code)] // each test binary uses part of it

use std::time::{Duration, Instant};

use kvpipe::{
    AnchoredRun, AuxData, BlockId, BlockTables, ChunkSpec, DecodeNode, Event, LayerGroupLayout,
    LayerRange, NodeConfig, PeerId, PoolLayout, PrefillNode, RawRegion, RegionId, Registration,
    RequestId, SendRequest,
};

/// Bytes of one slot: 2 layers × K|V × 1 head × 4 tokens × 8 dims × 2 bytes.
pub(crate) const SLOT: usize = 2 * 2 * 4 * 8 * 2;
/// Slots of each pool.
pub(crate) const SLOTS: usize = 16;
/// A 26-token prompt: 7 blocks of 4 tokens (the last one partial).
pub(crate) const PROMPT: u32 = 26;

/// One layer group of 2 layers in one pool of region `region`.
pub(crate) fn layout(region: u32) -> Vec<LayerGroupLayout> {
    vec![LayerGroupLayout {
        layers: 2,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 8,
        elem_bytes: 2,
        tokens_per_block: 4,
        window: None,
        block_layout: Default::default(),
        pools: [PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 2,
            slot_bytes: SLOT as u64,
        }]
        .into_iter()
        .collect(),
        shard: Default::default(),
    }]
}

/// The source pool: every byte names its slot and offset.
pub(crate) fn source_pool() -> Vec<u8> {
    (0..SLOT * SLOTS)
        .map(|i| ((i / SLOT) as u8).wrapping_mul(31) ^ (i as u8))
        .collect()
}

/// Where block ordinal `o` lives: scattered, and differently on the two sides.
pub(crate) fn src_slot(o: u32) -> u32 {
    (o * 5 + 3) % SLOTS as u32
}
/// As [`src_slot`], on the decode side.
pub(crate) fn dst_slot(o: u32) -> u32 {
    (o * 3 + 1) % SLOTS as u32
}

/// Pools and configs of both sides around the same layout (prefill: region 1, decode: 2).
pub(crate) struct Sides {
    /// The prefill pool.
    pub(crate) src: Vec<u8>,
    /// The decode pool, zeroed.
    pub(crate) dst: Vec<u8>,
}

impl Sides {
    pub(crate) fn new() -> Self {
        Sides {
            src: source_pool(),
            dst: vec![0; SLOT * SLOTS],
        }
    }

    pub(crate) fn src_region(&mut self) -> [RawRegion; 1] {
        [RawRegion::host(RegionId(1), &mut self.src)]
    }

    pub(crate) fn dst_region(&mut self) -> [RawRegion; 1] {
        [RawRegion::host(RegionId(2), &mut self.dst)]
    }

    /// Every registered block landed byte for byte; every other slot is still zero.
    pub(crate) fn check(&self) {
        check_landed(&self.src, &self.dst);
    }
}

/// Every registered block of `dst` holds its block of `src`; every other slot is still zero.
pub(crate) fn check_landed(src: &[u8], dst: &[u8]) {
    let blocks = PROMPT.div_ceil(4);
    for o in 0..blocks {
        let (s, d) = (src_slot(o) as usize * SLOT, dst_slot(o) as usize * SLOT);
        assert_eq!(dst[d..d + SLOT], src[s..s + SLOT], "block {o} did not land");
    }
    let used: Vec<u32> = (0..blocks).map(dst_slot).collect();
    for slot in (0..SLOTS as u32).filter(|s| !used.contains(s)) {
        let d = slot as usize * SLOT;
        assert!(
            dst[d..d + SLOT].iter().all(|&b| b == 0),
            "slot {slot} was written"
        );
    }
}

/// Waits for an event `want` accepts, failing on a failure event or at the deadline; returns
/// it. Events before it are dropped.
pub(crate) fn wait_for<E: kvpipe::Role>(
    node: &kvpipe::Node<E>,
    what: &str,
    want: impl Fn(&Event) -> bool,
) -> Event {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no {what} within 20 s");
        match node.next_event(left).expect("the node is open") {
            Some(e) if want(&e) => return e,
            Some(e @ (Event::Failed { .. } | Event::PeerRejected { .. })) => {
                panic!("waiting for {what}: {e:?}")
            }
            _ => {}
        }
    }
}

/// The peer a `PeerReady` names.
pub(crate) fn ready_peer(e: &Event) -> PeerId {
    match e {
        Event::PeerReady { peer, .. } => *peer,
        other => panic!("not PeerReady: {other:?}"),
    }
}

/// Moves request 42 from `tx` to `rx` (already connected: `tx` names `rx` `to_receiver`, `rx`
/// names `tx` `to_sender`), waits for `Completed` and `Quiesced` on both sides and retires it.
pub(crate) fn transfer(tx: &PrefillNode, rx: &DecodeNode, to_receiver: PeerId, to_sender: PeerId) {
    transfer_with(tx, rx, to_receiver, to_sender, false);
}

/// [`transfer`], each chunk submitted one layer at a time
/// ([`PrefillNode::submit_chunk_layers`]): every range that writes is a slice of its own.
pub(crate) fn transfer_layers(
    tx: &PrefillNode,
    rx: &DecodeNode,
    to_receiver: PeerId,
    to_sender: PeerId,
) {
    transfer_with(tx, rx, to_receiver, to_sender, true);
}

/// Registers `request` on `rx` (its blocks: every destination slot of the prompt, written by
/// `to_sender`) and opens it on `tx` towards `to_receiver`; returns the prefill side's block
/// table of the prompt's blocks, for a [`kvpipe::BlockTables`].
pub(crate) fn open_request(
    tx: &PrefillNode,
    rx: &DecodeNode,
    request: RequestId,
    to_receiver: PeerId,
    to_sender: PeerId,
) -> Vec<Option<BlockId>> {
    let blocks = PROMPT.div_ceil(4);
    let dst: Vec<BlockId> = (0..blocks).map(|o| BlockId(dst_slot(o))).collect();
    rx.register(Registration {
        request,
        prompt_len: PROMPT,
        groups: vec![AnchoredRun::from_ids(0, &dst)],
        writers: [to_sender].into_iter().collect(),
        aux_capacity: 64,
        expected_part: None,
    })
    .unwrap();
    tx.open_request(SendRequest::new(request, [to_receiver]))
        .unwrap();
    (0..blocks).map(|o| Some(BlockId(src_slot(o)))).collect()
}

/// The whole prompt as one last chunk.
pub(crate) fn whole_prompt() -> ChunkSpec {
    ChunkSpec {
        start: 0,
        end: PROMPT,
        prompt_len: PROMPT,
        prepopulated_len: 0,
        is_last: true,
        prefix_sent_early: false,
    }
}

/// The aux data the tests' engine submits: the prompt's first token.
pub(crate) fn first_token() -> AuxData {
    AuxData {
        prompt_tokens: PROMPT,
        cached_tokens: 0,
        first_tokens: vec![9],
        draft_tokens: vec![],
    }
}

fn transfer_with(
    tx: &PrefillNode,
    rx: &DecodeNode,
    to_receiver: PeerId,
    to_sender: PeerId,
    layered: bool,
) {
    let request = RequestId(42);
    let blocks = PROMPT.div_ceil(4);
    let table = open_request(tx, rx, request, to_receiver, to_sender);
    let groups: [&[Option<BlockId>]; 1] = [&table];
    let chunk = |start, end, is_last| ChunkSpec {
        start,
        end,
        prompt_len: PROMPT,
        prepopulated_len: 0,
        is_last,
        prefix_sent_early: false,
    };
    let mut slices = Vec::new();
    for (start, end, last) in [(0, 12, false), (12, PROMPT, true)] {
        let mut source = BlockTables { groups: &groups };
        if !layered {
            slices.push(tx.submit_chunk(request, chunk(start, end, last), &mut source));
            continue;
        }
        let layers = tx.layer_count().unwrap();
        assert_eq!(layers, 2, "the layout's layers");
        for layer in 0..layers {
            let range = LayerRange::new(layer, layer + 1);
            slices.push(tx.submit_chunk_layers(
                request,
                chunk(start, end, last),
                range,
                &mut source,
            ));
        }
    }
    let slices: Vec<_> = slices.into_iter().map(|s| s.unwrap()).collect();
    // Every chunk completes a block: one slice per chunk, or per layer range of it.
    assert_eq!(slices.len(), if layered { 4 } else { 2 });
    assert!(slices.iter().all(|s| s.slice().is_some()), "{slices:?}");
    tx.submit_aux(request, first_token()).unwrap();
    let bytes = u64::from(blocks) * SLOT as u64;
    for (side, completed) in [
        (
            "decode",
            wait_for(rx, "Completed (decode)", |e| {
                matches!(e, Event::Completed { .. })
            }),
        ),
        (
            "prefill",
            wait_for(tx, "Completed (prefill)", |e| {
                matches!(e, Event::Completed { .. })
            }),
        ),
    ] {
        let Event::Completed {
            bytes_written, aux, ..
        } = completed
        else {
            unreachable!()
        };
        assert_eq!(bytes_written, bytes, "{side}");
        if side == "decode" {
            assert_eq!(aux.expect("aux on the decode side").first_tokens, [9]);
        }
    }
    let quiesced = |e: &Event| matches!(e, Event::Quiesced { request: r } if *r == request);
    wait_for(rx, "Quiesced (decode)", quiesced);
    wait_for(tx, "Quiesced (prefill)", quiesced);
    tx.retire(request).unwrap();
    rx.retire(request).unwrap();
    assert_eq!(tx.session_count().unwrap(), 0);
    assert_eq!(rx.session_count().unwrap(), 0);
    assert_eq!(tx.counters().unwrap().bytes_written, bytes);
    // The receiving transport counts what it landed itself; over verbs the adapter places the
    // data and nothing is counted on the decode side.
    if rx.transport().unwrap() != "verbs" {
        assert_eq!(rx.counters().unwrap().bytes_landed, bytes);
    }
}

/// The configs of both sides on `transport`.
pub(crate) fn configs(transport: kvpipe::Transport) -> (NodeConfig, NodeConfig) {
    (
        NodeConfig::new(layout(1)).with_transport(transport.clone()),
        NodeConfig::new(layout(2)).with_transport(transport),
    )
}

/// Connects `tx` to `rx` (which listens on loopback) and waits for both handshakes; returns
/// (the receiver as `tx` names it, the sender as `rx` names it).
pub(crate) fn connect(tx: &PrefillNode, rx: &DecodeNode, host: &str) -> (PeerId, PeerId) {
    let addr = rx.listen(&format!("{host}:0")).unwrap();
    let to_receiver = tx.connect(&addr.to_string()).unwrap();
    let to_sender = ready_peer(&wait_for(rx, "PeerReady (decode)", |e| {
        matches!(e, Event::PeerReady { .. })
    }));
    assert_eq!(
        ready_peer(&wait_for(tx, "PeerReady (prefill)", |e| matches!(
            e,
            Event::PeerReady { .. }
        ))),
        to_receiver
    );
    (to_receiver, to_sender)
}
