//! One engine API over every transport: the same request moved in process and over TCP (by
//! `new` with the transport in the configuration, and by the `tcp` alias), and what cannot be
//! made refused with an error that names why: a lone in-process node, GPU memory this build or
//! machine cannot serve.

mod common;

use std::time::Duration;

use common::{configs, connect, transfer, transfer_layers, Sides};
use kvpipe::{
    mem_pair, BlockId, BlockRun, BlockSource, BlockSourceError, BlockTables, ChunkSpec, DecodeNode,
    EmbedError, GpuUnavailable, GroupIndex, LayerRange, NodeConfig, PrefillNode, RawRegion,
    RegionId, RequestId, SendRequest, TcpConfig, Transport, MEM_RECEIVER_PEER, MEM_SENDER_PEER,
};

#[test]
fn a_request_moves_in_process() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Mem);
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: `sides` outlives both nodes (dropped before it, at the end of the block).
    {
        let (tx, rx) = unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap();
        assert_eq!(tx.transport().unwrap(), "mem");
        common::wait_for(&rx, "PeerReady", |e| {
            matches!(e, kvpipe::Event::PeerReady { .. })
        });
        common::wait_for(&tx, "PeerReady", |e| {
            matches!(e, kvpipe::Event::PeerReady { .. })
        });
        transfer(&tx, &rx, MEM_RECEIVER_PEER, MEM_SENDER_PEER);
    }
    sides.check();
}

#[test]
fn a_request_moves_over_tcp_chosen_by_configuration() {
    let mut sides = Sides::new();
    let tcp = TcpConfig {
        connections_per_peer: 2,
        ..TcpConfig::default()
    };
    let (s, r) = configs(Transport::Tcp(tcp));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::new(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::new(&s, &src) }.unwrap();
        assert_eq!(tx.transport().unwrap(), "tcp");
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        transfer(&tx, &rx, to_receiver, to_sender);
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
    sides.check();
}

#[test]
fn the_tcp_alias_ignores_the_configured_transport() {
    let mut sides = Sides::new();
    // `tcp` builds a TCP node from `config.tcp` even where the configuration names another
    // transport (here one that cannot be made alone).
    let (s, r) = configs(Transport::Mem);
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::tcp(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::tcp(&s, &src) }.unwrap();
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        transfer(&tx, &rx, to_receiver, to_sender);
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
    sides.check();
}

#[test]
fn a_request_moves_layer_by_layer_in_process() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Mem);
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: `sides` outlives both nodes (dropped before it, at the end of the block).
    {
        let (tx, rx) = unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap();
        common::wait_for(&rx, "PeerReady", |e| {
            matches!(e, kvpipe::Event::PeerReady { .. })
        });
        common::wait_for(&tx, "PeerReady", |e| {
            matches!(e, kvpipe::Event::PeerReady { .. })
        });
        transfer_layers(&tx, &rx, MEM_RECEIVER_PEER, MEM_SENDER_PEER);
    }
    sides.check();
}

#[test]
fn a_request_moves_layer_by_layer_over_tcp() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Tcp(TcpConfig::default()));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::new(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::new(&s, &src) }.unwrap();
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        transfer_layers(&tx, &rx, to_receiver, to_sender);
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
    sides.check();
}

#[test]
fn a_layer_range_out_of_order_is_refused_and_changes_nothing() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Mem);
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: `sides` outlives both nodes (dropped at the end of the block).
    let (tx, _rx) = unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap();
    let request = RequestId(5);
    tx.open_request(SendRequest::new(request, [MEM_RECEIVER_PEER]))
        .unwrap();
    let table: Vec<Option<BlockId>> = (0..3).map(|o| Some(BlockId(o))).collect();
    let groups: [&[Option<BlockId>]; 1] = [&table];
    let chunk = ChunkSpec {
        start: 0,
        end: 12,
        prompt_len: 26,
        prepopulated_len: 0,
        is_last: false,
        prefix_sent_early: false,
    };
    let mut asked = 0;
    let mut source = CountingSource {
        tables: BlockTables { groups: &groups },
        asked: &mut asked,
    };
    // A chunk's ranges start at layer 0: the second layer first is the caller's bug.
    let err = tx
        .submit_chunk_layers(request, chunk, LayerRange::new(1, 2), &mut source)
        .unwrap_err();
    assert!(matches!(err, EmbedError::Usage(_)), "{err}");
    assert!(err.to_string().contains("must start at layer 0"), "{err}");
    // Past the rank's two layers.
    let err = tx
        .submit_chunk_layers(request, chunk, LayerRange::new(0, 3), &mut source)
        .unwrap_err();
    assert!(matches!(err, EmbedError::Usage(_)), "{err}");
    assert_eq!(
        *source.asked, 0,
        "a refused range asks the block source nothing"
    );
    // In order, the same chunk goes out; only its first range asks for blocks.
    for layer in 0..2 {
        let slice = tx
            .submit_chunk_layers(
                request,
                chunk,
                LayerRange::new(layer, layer + 1),
                &mut source,
            )
            .unwrap();
        assert!(slice.slice().is_some());
    }
    assert_eq!(
        *source.asked, 1,
        "one bounded query for the chunk's one group"
    );
    drop(tx);
    drop(_rx);
    drop(sides);
}

/// A block source that counts its queries.
struct CountingSource<'a> {
    tables: BlockTables<'a>,
    asked: &'a mut usize,
}

impl BlockSource for CountingSource<'_> {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        *self.asked += 1;
        self.tables.block_run(request, group, begin, end, out)
    }
}

#[test]
fn an_in_process_node_cannot_be_made_alone() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Mem);
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: refused before any region is used.
    let err = unsafe { PrefillNode::new(&s, &src) }
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            EmbedError::Unsupported {
                transport: "mem",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("mem_pair"), "{err}");
    // SAFETY: as above.
    let err = unsafe { DecodeNode::new(&r, &dst) }.err().expect("refused");
    assert!(matches!(err, EmbedError::Unsupported { .. }), "{err:?}");
}

/// A GPU region on a GPU no machine has (so the refusal is the same with or without a driver).
fn gpu_region() -> RawRegion {
    RawRegion {
        id: RegionId(1),
        ptr: 0x7f00_0000_0000 as *mut u8,
        len: common::SLOT * common::SLOTS,
        device: Some(4096),
    }
}

/// The refusal names the region, the GPU and what is missing.
fn assert_gpu_refused(err: EmbedError) {
    let message = err.to_string();
    let EmbedError::DeviceRegion {
        region,
        ordinal,
        reason,
    } = err
    else {
        panic!("not a device-region refusal: {err:?}")
    };
    assert_eq!((region, ordinal), (RegionId(1), 4096));
    assert!(
        message.starts_with("region#1 is memory on GPU 4096, "),
        "{message}"
    );
    assert!(message.ends_with("; give host memory"), "{message}");
    if cfg!(feature = "cuda") {
        assert!(
            !matches!(reason, GpuUnavailable::NoCudaFeature),
            "{reason:?}"
        );
        // Without a driver: "no CUDA driver"; with one: no device 4096.
        assert!(
            message.contains(", but the CUDA driver cannot serve it: no CUDA driver")
                || message.contains(", but the CUDA driver cannot serve it: no CUDA device 4096"),
            "{message}"
        );
    } else {
        assert!(
            matches!(reason, GpuUnavailable::NoCudaFeature),
            "{reason:?}"
        );
        // The words kvpipe used before it could serve GPU regions, then what is missing.
        assert_eq!(
            message,
            "region#1 is memory on GPU 4096, which this build's transports cannot read or write \
             yet (kvpipe was built without its `cuda` feature); give host memory"
        );
    }
}

#[test]
fn a_gpu_region_is_refused_with_what_is_missing_on_every_transport() {
    let mut dst = vec![0u8; common::SLOT * common::SLOTS];
    let host = [RawRegion::host(RegionId(2), &mut dst)];
    let gpu = [gpu_region()];
    let config = NodeConfig::new(common::layout(1));
    // SAFETY: refused before the (fake) device address is handed to any transport.
    assert_gpu_refused(
        unsafe { PrefillNode::new(&config, &gpu) }
            .err()
            .expect("refused"),
    );
    // SAFETY: as above.
    assert_gpu_refused(
        unsafe { PrefillNode::tcp(&config, &gpu) }
            .err()
            .expect("refused"),
    );
    let decode = NodeConfig::new(common::layout(1));
    // SAFETY: as above.
    assert_gpu_refused(
        unsafe { DecodeNode::new(&decode, &gpu) }
            .err()
            .expect("refused"),
    );
    // SAFETY: as above; `dst` outlives the call.
    assert_gpu_refused(
        unsafe { mem_pair(&config, &gpu, &NodeConfig::new(common::layout(2)), &host) }
            .err()
            .expect("refused"),
    );
    #[cfg(feature = "verbs")]
    {
        // The region is refused before a device is looked for.
        let verbs = config.with_transport(Transport::Verbs(kvpipe::VerbsConfig::on_device(
            "kvpipe-no-such-device",
        )));
        // SAFETY: as above.
        assert_gpu_refused(
            unsafe { PrefillNode::new(&verbs, &gpu) }
                .err()
                .expect("refused"),
        );
    }
}

/// The engine's block source runs with the node unlocked: a source that calls into the same
/// node while it answers (as an engine's block table guarded by the engine's own calls may)
/// does not deadlock, and the chunk still goes out.
#[test]
fn the_block_source_runs_without_the_node_locked() {
    use kvpipe::{AnchoredRun, BlockId, BlockRun, BlockSource, Registration};
    use kvpipe::{BlockSourceError, GroupIndex, RequestId, SendRequest};

    struct Reentrant<'a> {
        node: &'a PrefillNode,
        calls: u32,
    }
    impl BlockSource for Reentrant<'_> {
        fn block_run(
            &mut self,
            _request: RequestId,
            _group: GroupIndex,
            begin: u32,
            end: u32,
            out: &mut BlockRun,
        ) -> Result<(), BlockSourceError> {
            // Reads the node while answering: with the node locked, this waited forever.
            self.calls += self.node.session_count().map_or(0, |_| 1);
            out.first_ordinal = begin;
            out.ids = (begin..end).map(|o| BlockId(common::src_slot(o))).collect();
            Ok(())
        }
    }

    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Tcp(TcpConfig::default()));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::new(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::new(&s, &src) }.unwrap();
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        let request = RequestId(7);
        let blocks = common::PROMPT.div_ceil(4);
        let ids: Vec<BlockId> = (0..blocks).map(|o| BlockId(common::dst_slot(o))).collect();
        rx.register(Registration {
            request,
            prompt_len: common::PROMPT,
            groups: vec![AnchoredRun::from_ids(0, &ids)],
            writers: [to_sender].into_iter().collect(),
            aux_capacity: 64,
            expected_part: None,
        })
        .unwrap();
        tx.open_request(SendRequest::new(request, [to_receiver]))
            .unwrap();
        let spec = common::whole_prompt();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut source = Reentrant {
                    node: &tx,
                    calls: 0,
                };
                let outcome = tx.submit_chunk(request, spec, &mut source);
                done_tx.send((outcome.is_ok(), source.calls)).unwrap();
            });
            match done_rx.recv_timeout(Duration::from_secs(20)) {
                Ok(done) => assert_eq!(done, (true, 1)),
                Err(_) => {
                    // The submitting thread is stuck and cannot be joined: fail the binary.
                    eprintln!("the submission did not return: the source ran with the node locked");
                    std::process::exit(101);
                }
            }
        });
        tx.submit_aux(
            request,
            kvpipe::AuxData {
                prompt_tokens: common::PROMPT,
                cached_tokens: 0,
                first_tokens: vec![1],
                draft_tokens: vec![],
            },
        )
        .unwrap();
        common::wait_for(&rx, "Completed (decode)", |e| {
            matches!(e, kvpipe::Event::Completed { .. })
        });
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
}

/// Blocks past a pool's memory, on either side, are caught before anything is written: the
/// decode side's registration is refused, and a chunk whose source blocks lie past the prefill
/// pool is the engine's fault that fails the request on both sides.
#[test]
fn blocks_past_a_pool_are_caught_before_any_write_over_every_transport() {
    use kvpipe::{AnchoredRun, EngineFault, Event, Registration, Submitted, UsageError};
    let past_the_pool = |tx: &PrefillNode, rx: &DecodeNode, to_receiver, to_sender| {
        let slots = common::SLOTS as u32;
        let request = RequestId(5);
        let registration = |last: u32| Registration {
            request,
            prompt_len: common::PROMPT,
            groups: vec![AnchoredRun::from_ids(
                0,
                &(0..7).map(|o| BlockId(last - 6 + o)).collect::<Vec<_>>(),
            )],
            writers: [to_sender].into_iter().collect(),
            aux_capacity: 64,
            expected_part: None,
        };
        // Slots 10..=16 of a 16-slot pool: the last one is past it.
        let refused = rx.register(registration(slots)).unwrap_err();
        assert!(
            matches!(
                refused,
                EmbedError::Usage(UsageError::BlockPastPool {
                    block: BlockId(16),
                    slots: 16,
                    ..
                })
            ),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("holds 16 slots"), "{refused}");
        // Slots 9..=15 fit.
        rx.register(registration(slots - 1)).unwrap();
        tx.open_request(SendRequest::new(request, [to_receiver]))
            .unwrap();
        let table: Vec<Option<BlockId>> = (0..7).map(|o| Some(BlockId(12 + o))).collect();
        let groups: [&[Option<BlockId>]; 1] = [&table];
        let whole = common::whole_prompt();
        let outcome = tx
            .submit_chunk(request, whole, &mut BlockTables { groups: &groups })
            .unwrap();
        assert!(
            matches!(
                outcome,
                Submitted::EngineFault(EngineFault::BlockPastPool {
                    block: BlockId(16),
                    ..
                })
            ),
            "{outcome:?}"
        );
        // The decode side hears it as the request's failure, or, where its registration
        // reached the prefill side only after the fault, as the prefill side's cancel.
        let ended = |e: &Event| match e {
            Event::Failed { request: r, .. } | Event::Cancelled { request: r, .. } => *r == request,
            _ => false,
        };
        loop {
            match rx.next_event(Duration::from_secs(10)).unwrap() {
                Some(e) if ended(&e) => break,
                Some(Event::PeerReady { .. }) => {}
                other => panic!("the decode side's next event: {other:?}"),
            }
        }
        let failed = |e: &Event| matches!(e, Event::Failed { request: r, .. } if *r == request);
        common::wait_for(tx, "Failed (prefill)", failed);
        assert_eq!(tx.counters().unwrap().write_batches, 0);
    };
    let mut sides = Sides::new();
    for transport in [Transport::Mem, Transport::Tcp(TcpConfig::default())] {
        let (s, r) = configs(transport.clone());
        let (src, dst) = (sides.src_region(), sides.dst_region());
        // SAFETY: `sides` outlives the nodes (dropped at the end of each pass).
        let (tx, rx) = match transport {
            Transport::Mem => unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap(),
            _ => unsafe {
                (
                    PrefillNode::new(&s, &src).unwrap(),
                    DecodeNode::new(&r, &dst).unwrap(),
                )
            },
        };
        let (to_receiver, to_sender) = match transport {
            Transport::Mem => (MEM_RECEIVER_PEER, MEM_SENDER_PEER),
            _ => connect(&tx, &rx, "127.0.0.1"),
        };
        past_the_pool(&tx, &rx, to_receiver, to_sender);
    }
    assert!(sides.dst.iter().all(|&b| b == 0), "nothing landed");
}
