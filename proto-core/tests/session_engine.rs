//! What the sender checks of its engine: every block run against the bounded block-source
//! contract, the prefix, and what a failure before any slice looks like on the other side.
//! Each mistake ends the request on both sides; none ends as a partial `Completed`.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{
    BlockRunFault, CancelOrigin, EngineFault, Event, Submitted, UsageError,
};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{
    BlockId, BlockRun, BlockSource, BlockSourceError, ChunkSpec, GroupIndex, RequestId,
};
use session_support::*;

const R: RequestId = RequestId(11);

/// A block source that answers like `TestSource` (ordinal `o` in slot `100 + o`, 4 blocks)
/// and then lets a test bend the answer.
struct Bent<F: FnMut(u32, u32, &mut BlockRun)>(F);

impl<F: FnMut(u32, u32, &mut BlockRun)> BlockSource for Bent<F> {
    fn block_run(
        &mut self,
        _: RequestId,
        _: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        out.first_ordinal = begin;
        out.ids = (begin..end).map(|o| BlockId(100 + o)).collect();
        (self.0)(begin, end, out);
        Ok(())
    }
}

/// Prompt 16, chunks 0:6 and 6:16, 4 tokens per block: chunk 0:6 sends block 0, chunk 6:16
/// blocks 1..4 (512 bytes in all).
fn net() -> Net {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net
}

fn spec(start: u32, end: u32, prepopulated_len: u32) -> ChunkSpec {
    ChunkSpec {
        start,
        end,
        prompt_len: 16,
        prepopulated_len,
        is_last: end == 16,
        prefix_sent_early: false,
    }
}

/// Submits a chunk and returns the sender's answer; pumps the network.
/// Submits a chunk whose answer breaks the engine's contract: the call succeeds (it is no
/// usage error) and its outcome is the engine's fault.
fn submit(net: &mut Net, spec: ChunkSpec, source: &mut impl BlockSource) -> EngineFault {
    let now = net.now;
    let outcome = net.senders[0]
        .submit_chunk(now, R, spec, source)
        .expect("an engine's fault is an outcome, not a usage error");
    net.pump();
    match outcome {
        Submitted::EngineFault(fault) => fault,
        other => panic!("the engine's mistake was taken: {other:?}"),
    }
}

/// Both sides ended the request with an engine error, quiesced, and nothing completed.
fn assert_failed_on_both_sides(net: &Net) {
    let sender = net.events(Side::Sender(0));
    let receiver = net.events(Side::Receiver(0));
    assert!(
        sender.iter().any(|e| matches!(
            e,
            Event::Failed {
                cause: TransferStatus::EngineError,
                ..
            }
        )),
        "{sender:?}"
    );
    assert!(
        receiver.iter().any(|e| matches!(
            e,
            Event::Failed {
                cause: TransferStatus::EngineError,
                ..
            }
        )),
        "{receiver:?}"
    );
    for e in sender.iter().chain(&receiver) {
        assert!(!matches!(e, Event::Completed { .. }), "{e:?}");
    }
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}

#[test]
fn a_run_missing_its_head_in_a_full_attention_group() {
    let mut net = net();
    let mut ok = Bent(|_, _, _| {});
    net.submit(0, R, spec(0, 6, 0), &mut ok);
    let mut headless = Bent(|_, _, run: &mut BlockRun| {
        run.first_ordinal += 2;
        run.ids.drain(..2);
    });
    let err = submit(&mut net, spec(6, 16, 0), &mut headless);
    assert!(
        matches!(err, EngineFault::BlockRun(e) if e.fault == BlockRunFault::TooShort
            && (e.asked.begin, e.asked.end, e.returned.begin, e.returned.end) == (1, 4, 3, 4)),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("asked for ordinals [1, 4), got [3, 4)"),
        "{err}"
    );
    assert_failed_on_both_sides(&net);
}

#[test]
fn an_over_long_run_would_send_blocks_not_computed_yet() {
    let mut net = net();
    // Chunk 0:6 computed block 0 only; the cache answers with the whole allocation.
    let mut whole = Bent(|_, _, run: &mut BlockRun| {
        run.first_ordinal = 0;
        run.ids = (0..4).map(|o| BlockId(100 + o)).collect();
    });
    let err = submit(&mut net, spec(0, 6, 0), &mut whole);
    assert!(
        matches!(err, EngineFault::BlockRun(e) if e.fault == BlockRunFault::TooLong),
        "{err}"
    );
    assert_failed_on_both_sides(&net);
    assert_eq!(
        net.senders[0].counters().write_batches,
        0,
        "nothing was written"
    );
}

#[test]
fn a_run_ending_early_would_never_send_the_last_block() {
    let mut net = net();
    net.submit(0, R, spec(0, 6, 0), &mut Bent(|_, _, _| {}));
    let mut early = Bent(|_, _, run: &mut BlockRun| {
        run.ids.pop();
    });
    let err = submit(&mut net, spec(6, 16, 0), &mut early);
    assert!(
        matches!(err, EngineFault::BlockRun(e) if e.fault == BlockRunFault::WrongEnd),
        "{err}"
    );
    assert_failed_on_both_sides(&net);
}

#[test]
fn a_changed_prefix_would_send_blocks_twice() {
    let mut net = net();
    net.submit(0, R, spec(0, 6, 0), &mut Bent(|_, _, _| {}));
    let err = submit(&mut net, spec(6, 16, 6), &mut Bent(|_, _, _| {}));
    assert_eq!(
        err,
        EngineFault::PrefixChanged {
            request: R,
            expected: 0,
            got: 6
        }
    );
    assert_failed_on_both_sides(&net);
}

#[test]
fn the_failing_chunk_is_recorded_and_replays() {
    let mut net = Net::new(1, 1);
    net.senders[0].record_inputs(true);
    net.connect(0, 0);
    net.pump();
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let err = submit(
        &mut net,
        spec(0, 6, 0),
        &mut Bent(|_, _, run: &mut BlockRun| run.ids.push(BlockId(7))),
    );
    assert!(matches!(err, EngineFault::BlockRun(_)));
    let inputs = net.senders[0].take_recorded_inputs();
    assert!(inputs
        .iter()
        .any(|i| matches!(i, kvpipe_core::SenderInput::Chunk { .. })));
    let original: Vec<_> = net
        .log
        .iter()
        .filter(|(side, _)| *side == Side::Sender(0))
        .map(|(_, o)| o.clone())
        .collect();
    let mut fresh = kvpipe_core::Sender::new(sender_config(0)).unwrap();
    let mut replayed = Vec::new();
    for input in inputs {
        fresh.handle_input(input).unwrap();
        while let Some(o) = fresh.poll_output() {
            replayed.push(o);
        }
    }
    assert_eq!(replayed, original);
    assert_eq!(fresh.phase(R), Some(SendPhase::Quiesced));
}

#[test]
fn a_cancel_before_the_first_chunk_is_a_cancel_on_the_receiver_with_no_slice() {
    let mut net = net();
    let now = net.now;
    net.senders[0].cancel(now, R).unwrap();
    net.pump();
    let receiver = net.events(Side::Receiver(0));
    assert!(
        receiver.contains(&Event::Cancelled {
            request: R,
            origin: CancelOrigin::Peer(tx_peer(0))
        }),
        "{receiver:?}"
    );
    assert!(!receiver.iter().any(|e| matches!(e, Event::Failed { .. })));
}

#[test]
fn a_failure_before_the_first_slice_names_no_slice() {
    let mut net = net();
    let err = submit(
        &mut net,
        spec(0, 6, 0),
        &mut Bent(|_, _, run: &mut BlockRun| run.first_ordinal += 1),
    );
    assert!(matches!(err, EngineFault::BlockRun(_)));
    let receiver = net.events(Side::Receiver(0));
    assert!(
        receiver.iter().any(|e| matches!(
            e,
            Event::Failed {
                cause: TransferStatus::EngineError,
                sender_slice: None,
                ..
            }
        )),
        "{receiver:?}"
    );
}

#[test]
fn an_early_prefix_and_the_chunks_send_every_block_exactly_once() {
    let mut net = net();
    let mut source = TestSource::with(R, 100, 4);
    let now = net.now;
    // 6 tokens cached: block 0 is whole and leaves at once; block 1 waits for its chunk.
    let early = net.senders[0]
        .submit_prefix(now, R, 16, 6, &mut source)
        .unwrap();
    net.pump();
    assert!(matches!(early, Submitted::Slice(_)));
    let early_spec = |start, end| ChunkSpec {
        prefix_sent_early: true,
        ..spec(start, end, 6)
    };
    // A chunk that does not say the prefix went early is refused, nothing changed.
    assert!(matches!(
        net.senders[0].submit_chunk(now, R, spec(6, 10, 6), &mut source),
        Err(UsageError::EarlyPrefixMismatch {
            sent_early: true,
            ..
        })
    ));
    net.submit(0, R, early_spec(6, 10), &mut source);
    net.submit(0, R, early_spec(10, 16), &mut source);
    net.aux(0, R);
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Completed));
    assert_eq!(net.receivers[0].counters().bytes_written, 4 * BLOCK_BYTES);
    assert_eq!(net.receivers[0].counters().bytes_landed, 4 * BLOCK_BYTES);
    // Each block was asked for exactly once.
    let mut asked: Vec<u32> = source.queries.iter().flat_map(|q| q.2..q.3).collect();
    asked.sort_unstable();
    assert_eq!(asked, [0, 1, 2, 3]);
}

#[test]
fn chunks_cannot_claim_an_early_prefix_that_was_not_sent() {
    let mut net = net();
    let mut source = TestSource::with(R, 100, 4);
    let now = net.now;
    let claim = ChunkSpec {
        prefix_sent_early: true,
        ..spec(6, 10, 6)
    };
    assert!(matches!(
        net.senders[0].submit_chunk(now, R, claim, &mut source),
        Err(UsageError::EarlyPrefixMismatch {
            sent_early: false,
            ..
        })
    ));
    net.submit(0, R, spec(6, 10, 6), &mut source);
    assert_eq!(
        net.senders[0].submit_prefix(now, R, 16, 6, &mut source),
        Err(UsageError::PrefixAfterChunks(R))
    );
}

#[test]
fn a_chunk_whose_prompt_differs_from_the_registration_fails_both_sides() {
    // The decode side registered 16 tokens; the prefill side computes 24.
    let mut net = net();
    let now = net.now;
    let mut source = TestSource::with(R, 100, 6);
    let long = ChunkSpec {
        prompt_len: 24,
        ..spec(0, 8, 0)
    };
    let outcome = net.senders[0]
        .submit_chunk(now, R, long, &mut source)
        .expect("an engine's fault is an outcome, not a usage error");
    net.pump();
    let err = outcome.engine_fault().cloned().expect("the request failed");
    assert_eq!(
        err,
        EngineFault::PromptLenDiffersFromRegistration {
            request: R,
            registered: 16,
            local: 24
        }
    );
    assert!(err.to_string().contains("24 tokens") && err.to_string().contains("16"));
    for side in [Side::Sender(0), Side::Receiver(0)] {
        assert!(
            net.events(side)
                .iter()
                .any(|e| matches!(e, Event::Failed { .. })),
            "{side:?}"
        );
    }
}

#[test]
fn a_registration_past_the_prompt_is_refused_on_both_sides() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    let mut reg = registration(R, 16, &[0]);
    reg.groups = vec![kvpipe_core::AnchoredRun::from_ids(1000, &[BlockId(500)])];
    let err = net.receivers[0].register(now, reg.clone()).unwrap_err();
    assert!(err.to_string().contains("ordinal 1001"), "{err}");
    // A receiver that sends one anyway (a hostile or buggy peer): the sender refuses it.
    net.open(0, send_request(R, &[0]));
    let frame = kvpipe_core::wire::Frame::RecvRegistration(kvpipe_core::wire::RecvRegistration {
        request: R,
        slice: kvpipe_core::ReceiverSliceId(9),
        prompt_len: 16,
        grant: kvpipe_core::GrantId(1),
        aux_capacity: 64,
        groups: reg.groups,
    });
    sender_hears(&mut net, frame);
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            ..
        }
    )));
}

#[test]
fn a_registration_that_repeats_a_destination_block_is_refused_changing_nothing() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    let counters = *net.receivers[0].counters();
    let events = |net: &Net| {
        (
            net.events(Side::Receiver(0)).len(),
            net.events(Side::Sender(0)).len(),
        )
    };
    let before = events(&net);
    // Adjacent (`[20, 20]`) and inside an earlier run (`[20, 21, 22, 21]`).
    for (ids, prompt_len) in [(&[20, 20][..], 8), (&[20, 21, 22, 21][..], 16)] {
        let mut reg = registration(R, prompt_len, &[0]);
        let ids: Vec<BlockId> = ids.iter().map(|&i| BlockId(i)).collect();
        reg.groups = vec![kvpipe_core::AnchoredRun::from_ids(0, &ids)];
        let err = net.receivers[0].register(now, reg).unwrap_err();
        let block = if ids.len() == 2 { 20 } else { 21 };
        assert_eq!(
            err,
            UsageError::RepeatedBlock {
                request: R,
                group: 0,
                block: BlockId(block)
            }
        );
        let message = err.to_string();
        assert!(
            message.contains(&R.to_string())
                && message.contains(&format!("names {} twice", BlockId(block)))
                && message.contains("group 0"),
            "{message}"
        );
    }
    assert_eq!(net.receivers[0].session_count(), 0);
    assert_eq!(*net.receivers[0].counters(), counters);
    net.pump();
    assert_eq!(events(&net), before);
    // The same request with distinct blocks is taken.
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(net.receivers[0].session_count(), 1);
}

#[test]
fn a_registration_frame_that_repeats_a_block_fails_the_request_before_any_write() {
    let mut net = Net::connected(1, 1);
    net.open(0, send_request(R, &[0]));
    // A receiver that sends one anyway (a hostile or buggy peer): the sender refuses it.
    let frame = kvpipe_core::wire::Frame::RecvRegistration(kvpipe_core::wire::RecvRegistration {
        request: R,
        slice: kvpipe_core::ReceiverSliceId(9),
        prompt_len: 8,
        grant: kvpipe_core::GrantId(1),
        aux_capacity: 64,
        groups: vec![kvpipe_core::AnchoredRun::from_ids(
            0,
            &[BlockId(20), BlockId(20)],
        )],
    });
    sender_hears(&mut net, frame);
    let events = net.events(Side::Sender(0));
    assert!(events.iter().any(|e| matches!(
        e,
        Event::ProtocolViolation { error, .. }
            if error.to_string().contains("names blk#20 twice in layer group 0")
    )));
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            ..
        }
    )));
    assert!(!events.iter().any(|e| matches!(e, Event::Registered { .. })));
}

/// Sender 0 receives `frame` from receiver 0 (as a hostile or buggy peer would send it), and
/// the network is pumped.
fn sender_hears(net: &mut Net, frame: kvpipe_core::wire::Frame) {
    let now = net.now;
    net.senders[0]
        .handle_transport(
            now,
            kvpipe_core::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: frame.to_bytes().unwrap(),
            },
        )
        .unwrap();
    net.pump();
}

/// A pair whose sender's pool holds `sender_slots` slots and whose receiver's holds
/// `receiver_slots` (`region_bytes` given), connected.
fn net_with_pools(sender_slots: u64, receiver_slots: u64) -> Net {
    use kvpipe_core::{Receiver, RegionId, Sender};
    let mut net = Net::new(1, 1);
    let mut tx = sender_config(0);
    tx.region_bytes = vec![(RegionId(1), sender_slots * BLOCK_BYTES)];
    let mut rx = receiver_config(0);
    // A region the layout does not name changes nothing.
    rx.region_bytes = vec![
        (RegionId(9), 0),
        (RegionId(2), receiver_slots * BLOCK_BYTES),
    ];
    net.senders[0] = Sender::new(tx).unwrap();
    net.receivers[0] = Receiver::new(rx).unwrap();
    net.connect(0, 0);
    net.pump();
    net
}

#[test]
fn a_registration_past_the_receivers_pool_is_refused_changing_nothing() {
    // `registration(R, 16)` names blocks 500..504: they fit 504 slots exactly.
    let mut net = net_with_pools(200, 504);
    let now = net.now;
    let counters = *net.receivers[0].counters();
    let err = net.receivers[0]
        .register(now, registration(R, 20, &[0]))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::BlockPastPool {
            request: R,
            group: 0,
            block: BlockId(504),
            slots: 504,
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("names blk#504") && message.contains("holds 504 slots"),
        "{message}"
    );
    assert_eq!(net.receivers[0].session_count(), 0);
    assert_eq!(*net.receivers[0].counters(), counters);
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(net.receivers[0].session_count(), 1);
}

#[test]
fn a_source_block_past_the_senders_pool_fails_the_request_before_it_is_written() {
    // The source names slot 100 + ordinal; the pool holds 103 slots. Chunk 0:6 (block 0, slot
    // 100) is taken; chunk 6:16 names slots 101..104 and 103 is past the pool.
    let mut net = net_with_pools(103, 600);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let mut fine = Bent(|_, _, _| {});
    net.submit(0, R, spec(0, 6, 0), &mut fine);
    let batches = net.senders[0].counters().write_batches;
    let err = submit(&mut net, spec(6, 16, 0), &mut fine);
    assert_eq!(
        err,
        EngineFault::BlockPastPool {
            request: R,
            group: GroupIndex(0),
            block: BlockId(103),
            slots: 103,
        }
    );
    assert!(
        err.to_string().contains("named blk#103") && err.to_string().contains("holds 103 slots"),
        "{err}"
    );
    assert_failed_on_both_sides(&net);
    assert_eq!(
        net.senders[0].counters().write_batches,
        batches,
        "nothing of the chunk was written"
    );
}

#[test]
fn a_chunk_spanning_more_blocks_than_the_senders_pool_is_refused_before_the_engine_is_asked() {
    // The pool holds 3 slots (4 tokens a block); a chunk of 16 tokens spans 4 blocks at once.
    let mut net = net_with_pools(3, 600);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let mut source = TestSource::with(R, 0, 4);
    let now = net.now;
    let err = net.senders[0]
        .submit_chunk(now, R, chunk(0, 16, 16, true), &mut source)
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::ChunkPastPool {
            request: R,
            group: 0,
            blocks: 4,
            slots: 3,
        }
    );
    assert!(err.to_string().contains("holds 3 slots"), "{err}");
    assert!(
        source.queries.is_empty(),
        "the engine was asked: {:?}",
        source.queries
    );
    // A chunk of three blocks fits.
    net.submit(0, R, chunk(0, 12, 16, false), &mut source);
    assert_eq!(source.queries.len(), 1);
}

#[test]
fn a_block_another_live_request_holds_is_refused_until_that_request_quiesces() {
    let mut net = net();
    let now = net.now;
    let other = RequestId(12);
    // `net()` registered R into blocks 500..504; 503 is R's until R quiesces.
    let counters = *net.receivers[0].counters();
    let err = net.receivers[0]
        .register(now, registration_from(other, 8, &[0], 503))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::BlockHeldByRequest {
            request: other,
            group: 0,
            block: BlockId(503),
            holder: R,
        }
    );
    assert!(
        err.to_string()
            .contains("names blk#503 in layer group 0, which req#11 still holds"),
        "{err}"
    );
    assert_eq!(net.receivers[0].session_count(), 1);
    assert_eq!(*net.receivers[0].counters(), counters);
    // Blocks of its own are taken.
    net.register(0, registration_from(other, 8, &[0], 504));
    // R completes and quiesces: its blocks are free for a new request before R is retired.
    let mut source = TestSource::with(R, 100, 4);
    net.submit(0, R, spec(0, 16, 0), &mut source);
    net.aux(0, R);
    assert!(net
        .events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Quiesced { request } if *request == R)));
    let third = RequestId(13);
    net.register(0, registration_from(third, 8, &[0], 502));
    // After R's retirement the new holder keeps its blocks.
    net.receivers[0].retire(net.now, R).unwrap();
    let err = net.receivers[0]
        .register(net.now, registration_from(RequestId(14), 4, &[0], 503))
        .unwrap_err();
    assert!(
        matches!(err, UsageError::BlockHeldByRequest { holder, .. } if holder == third),
        "{err}"
    );
}

/// A windowed pair: window 8 tokens, 4 tokens per block, so a 16-token prompt's stale
/// boundary is block 2 (`(16 + 1 - 8) / 4`); the receiver registers blocks 2 and 3.
fn windowed_net() -> Net {
    use kvpipe_core::{Receiver, Sender};
    let mut net = Net::new(1, 1);
    let mut tx = sender_config(0);
    tx.local.groups[0].window = Some(8);
    let mut rx = receiver_config(0);
    rx.local.groups[0].window = Some(8);
    net.senders[0] = Sender::new(tx).unwrap();
    net.receivers[0] = Receiver::new(rx).unwrap();
    net.connect(0, 0);
    net.pump();
    let mut reg = registration(R, 16, &[0]);
    reg.groups[0] = kvpipe_core::AnchoredRun::from_ids(2, &[BlockId(502), BlockId(503)]);
    net.register(0, reg);
    net.open(0, send_request(R, &[0]));
    net
}

#[test]
fn a_windowed_run_missing_a_block_inside_the_window_fails_the_request() {
    // The sender asks only from the stale boundary on ([2, 4)); a cache that evicted block 2
    // as well answers [3, 4).
    let mut net = windowed_net();
    let mut evicted_too_many = Bent(|_, _, run: &mut BlockRun| {
        run.first_ordinal += 1;
        run.ids.drain(..1);
    });
    let err = submit(&mut net, spec(0, 16, 0), &mut evicted_too_many);
    assert!(
        matches!(err, EngineFault::BlockRun(e) if e.fault == BlockRunFault::InsideWindow
            && (e.returned.begin, e.returned.end) == (3, 4)),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("misses a block inside the sliding window"),
        "{err}"
    );
    assert_failed_on_both_sides(&net);
    // Every block from the boundary on resident (those below it may be evicted, and are not
    // asked for): it completes.
    let mut net = windowed_net();
    net.submit(0, R, spec(0, 16, 0), &mut Bent(|_, _, _| {}));
    net.aux(0, R);
    assert!(net
        .events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { .. })));
}
