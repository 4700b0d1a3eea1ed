//! Layer slices through the sessions: a chunk submitted in layer ranges writes what the whole
//! chunk writes, only its first range asks the block source, the request completes only after
//! the last chunk's last range, and every misuse is refused with nothing changed.

mod session_support;

use kvpipe_core::session::state::SendPhase;
use kvpipe_core::session::LocalHello;
use kvpipe_core::session::{Event, Output, SenderInput, UsageError};
use kvpipe_core::{
    ChunkSpec, ChunkSpecField, GroupIndex, InstanceId, LayerOrder, LayerRange, RequestId, Sender,
    SenderConfig,
};
use session_support::*;

const R: RequestId = RequestId(7);

fn completed(net: &Net, side: Side) -> bool {
    net.events(side)
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if *request == R))
}

fn layers(begin: u32, end: u32) -> LayerRange {
    LayerRange::new(begin, end)
}

fn submit_layers(
    net: &mut Net,
    spec: ChunkSpec,
    range: LayerRange,
    source: &mut TestSource,
) -> Option<kvpipe_core::SenderSliceId> {
    let now = net.now;
    let id = net.senders[0]
        .submit_chunk_layers(now, R, spec, range, source)
        .unwrap();
    net.pump();
    id.slice()
}

/// The extents written to the receiver, as (dst offset, len) merged where contiguous, and the
/// number of write batches.
fn written(net: &Net) -> (Vec<(u64, u64)>, usize) {
    let mut extents = Vec::new();
    let mut batches = 0;
    for (side, o) in &net.log {
        if let (Side::Sender(_), Output::ExecuteWrites { plan, .. }) = (side, o) {
            batches += 1;
            for e in plan.extents() {
                extents.push((e.dst_offset, e.len, e.src_offset));
            }
        }
    }
    extents.sort();
    let mut merged: Vec<(u64, u64, u64)> = Vec::new();
    for (dst, len, src) in extents {
        if let Some(last) = merged.last_mut() {
            assert!(last.0 + last.1 <= dst, "a byte is written twice");
            if last.0 + last.1 == dst && last.2 + last.1 == src {
                last.1 += len;
                continue;
            }
        }
        merged.push((dst, len, src));
    }
    (
        merged.into_iter().map(|(d, l, _)| (d, l)).collect(),
        batches,
    )
}

#[test]
fn layer_ranges_write_what_the_whole_chunk_writes_and_complete_after_the_last_range() {
    // Whole chunks.
    let mut whole = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    whole.register(0, registration(R, 16, &[0]));
    whole.open(0, send_request(R, &[0]));
    whole.submit(0, R, chunk(0, 8, 16, false), &mut source);
    whole.submit(0, R, chunk(8, 16, 16, true), &mut source);
    whole.aux(0, R);
    assert!(completed(&whole, Side::Receiver(0)));

    // The same chunks, each in two layer ranges (the layout has 2 layers).
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    assert_eq!(net.senders[0].layer_count(), 2);
    net.aux(0, R);
    let first = chunk(0, 8, 16, false);
    let s0 = submit_layers(&mut net, first, layers(0, 1), &mut source);
    assert_eq!(net.senders[0].next_chunk_layer(R), Some(1));
    let queries = source.queries.len();
    let s1 = submit_layers(&mut net, first, layers(1, 2), &mut source);
    assert_eq!(source.queries.len(), queries, "a later range asks nothing");
    assert_eq!(net.senders[0].next_chunk_layer(R), None);
    assert_eq!(
        (s0.unwrap().0, s1.unwrap().0),
        (0, 1),
        "each range is a slice"
    );
    let last = chunk(8, 16, 16, true);
    submit_layers(&mut net, last, layers(0, 1), &mut source);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Streaming));
    assert!(!completed(&net, Side::Receiver(0)), "one range is missing");
    assert!(!completed(&net, Side::Sender(0)));
    submit_layers(&mut net, last, layers(1, 2), &mut source);
    assert!(completed(&net, Side::Receiver(0)));
    assert!(completed(&net, Side::Sender(0)));

    let (whole_extents, whole_batches) = written(&whole);
    let (layer_extents, layer_batches) = written(&net);
    assert_eq!(layer_extents, whole_extents);
    assert_eq!((whole_batches, layer_batches), (2, 4));
    assert_eq!(source.queries.len(), 2, "one query per chunk");
    // Only the last result is marked last.
    let lasts = net
        .frames(Side::Sender(0))
        .iter()
        .filter(|f| matches!(f, kvpipe_core::wire::Frame::KvResult(r) if r.is_last))
        .count();
    assert_eq!(lasts, 1);
}

#[test]
fn a_late_registration_replays_the_ranges_in_order() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.open(0, send_request(R, &[0]));
    let spec = chunk(0, 16, 16, true);
    submit_layers(&mut net, spec, layers(0, 1), &mut source);
    submit_layers(&mut net, spec, layers(1, 2), &mut source);
    net.register(0, registration(R, 16, &[0]));
    net.aux(0, R);
    assert!(completed(&net, Side::Receiver(0)));
    let (extents, batches) = written(&net);
    assert_eq!(extents, vec![(500 * BLOCK_BYTES, 4 * BLOCK_BYTES)]);
    assert_eq!(batches, 2);
}

#[test]
fn one_range_of_every_layer_is_a_whole_chunk() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    submit_layers(&mut net, chunk(0, 16, 16, true), layers(0, 2), &mut source);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Finishing));
    net.aux(0, R);
    assert!(completed(&net, Side::Receiver(0)));
    assert_eq!(written(&net).1, 1);
}

/// A sender alone, its group holding 4 layers.
fn four_layer_sender() -> Sender {
    let mut groups = layout(1);
    groups[0].layers = 4;
    groups[0].pools[0].layers = 4;
    groups[0].pools[0].slot_bytes = 256;
    let local = LocalHello::new(InstanceId(1), Default::default(), groups);
    let mut config = SenderConfig::new(local);
    config.deadlines = deadlines();
    let mut s = Sender::new(config).unwrap();
    s.open_request(kvpipe_core::Instant::from_millis(1), send_request(R, &[0]))
        .unwrap();
    s
}

#[test]
fn misplaced_ranges_are_refused_with_nothing_changed() {
    let now = kvpipe_core::Instant::from_millis(2);
    let mut s = four_layer_sender();
    let mut source = TestSource::with(R, 100, 8);
    let spec = chunk(0, 16, 32, false);
    let refuse = |s: &mut Sender, spec: ChunkSpec, range: LayerRange| {
        let before = (*s.counters(), s.next_chunk_layer(R));
        let mut source = TestSource::with(R, 100, 8);
        let err = s
            .submit_chunk_layers(now, R, spec, range, &mut source)
            .unwrap_err();
        assert_eq!((*s.counters(), s.next_chunk_layer(R)), before);
        err
    };
    assert!(matches!(
        refuse(&mut s, spec, layers(0, 0)),
        UsageError::LayerRangeEmpty { .. }
    ));
    assert!(matches!(
        refuse(&mut s, spec, layers(2, 1)),
        UsageError::LayerRangeEmpty { .. }
    ));
    assert!(matches!(
        refuse(&mut s, spec, layers(0, 5)),
        UsageError::LayerRangePastLayers { count: 4, .. }
    ));
    assert!(matches!(
        refuse(&mut s, spec, layers(1, 2)),
        UsageError::LayerRangeOutOfOrder { expected: 0, .. }
    ));
    s.submit_chunk_layers(now, R, spec, layers(0, 2), &mut source)
        .unwrap();
    // Overlap, gap and going back.
    for (b, e) in [(1, 3), (3, 4), (0, 2), (0, 1)] {
        let err = refuse(&mut s, spec, layers(b, e));
        assert!(
            matches!(err, UsageError::LayerRangeOutOfOrder { expected: 2, .. }),
            "{err}"
        );
    }
    // The open chunk again, but described differently: the error names the field that differs
    // and both values, and nothing changes.
    let differing = [
        (
            ChunkSpec { end: 12, ..spec },
            ChunkSpecField::End,
            "end = 12",
            "end = 16",
        ),
        (
            ChunkSpec {
                prompt_len: 40,
                ..spec
            },
            ChunkSpecField::PromptLen,
            "prompt_len = 40",
            "prompt_len = 32",
        ),
        (
            ChunkSpec {
                end: 32,
                is_last: true,
                ..spec
            },
            ChunkSpecField::End,
            "end = 32",
            "end = 16",
        ),
        (
            ChunkSpec {
                is_last: true,
                ..spec
            },
            ChunkSpecField::IsLast,
            "is_last = true",
            "is_last = false",
        ),
        (
            ChunkSpec {
                prefix_sent_early: true,
                ..spec
            },
            ChunkSpecField::PrefixSentEarly,
            "prefix_sent_early = true",
            "prefix_sent_early = false",
        ),
    ];
    for (other, field, got, open) in differing {
        let err = refuse(&mut s, other, layers(2, 4));
        assert_eq!(
            err,
            UsageError::ChunkRangeSpecMismatch {
                request: R,
                field,
                open: spec,
                got: other,
            }
        );
        let text = err.to_string();
        assert!(text.contains(got) && text.contains(open), "{text}");
    }
    // The first field that differs is named.
    let other = ChunkSpec {
        prepopulated_len: 4,
        is_last: true,
        ..spec
    };
    assert!(matches!(
        refuse(&mut s, other, layers(2, 4)),
        UsageError::ChunkRangeSpecMismatch {
            field: ChunkSpecField::PrepopulatedLen,
            ..
        }
    ));
    // Another chunk, whole or in ranges, while this one is open.
    let next = chunk(16, 32, 32, true);
    assert!(matches!(
        refuse(&mut s, next, layers(0, 4)),
        UsageError::ChunkLayersUnfinished { next_layer: 2, .. }
    ));
    let before = *s.counters();
    let err = s.submit_chunk(now, R, next, &mut source).unwrap_err();
    assert!(matches!(
        err,
        UsageError::ChunkLayersUnfinished {
            next_layer: 2,
            layers: 4,
            ..
        }
    ));
    assert!(err.to_string().contains("layers 2..4"), "{err}");
    assert_eq!(s.counters(), &before);
    // Runs given to a later range.
    let runs = s
        .chunk_query(R, &chunk(0, 16, 32, false))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(runs, UsageError::ChunkLayersUnfinished { .. }));
    let query = s.chunk_layers_query(R, &spec, layers(2, 4)).unwrap();
    assert!(query.is_empty());
    let given = vec![(GroupIndex(0), kvpipe_core::BlockRun::default())];
    assert!(matches!(
        s.submit_chunk_layers_runs(now, R, spec, layers(2, 4), given),
        Err(UsageError::RunsDoNotMatchChunk { .. })
    ));
    assert_eq!(s.next_chunk_layer(R), Some(2));
    // The chunk's last range closes it; the next chunk follows.
    s.submit_chunk_layers(now, R, spec, layers(2, 4), &mut source)
        .unwrap();
    assert_eq!(s.next_chunk_layer(R), None);
    s.submit_chunk_layers(now, R, next, layers(0, 1), &mut source)
        .unwrap();
    assert_eq!(s.phase(R), Some(SendPhase::Streaming));
    s.submit_chunk_layers(now, R, next, layers(1, 4), &mut source)
        .unwrap();
    assert_eq!(s.phase(R), Some(SendPhase::Finishing));
    assert!(matches!(
        s.submit_chunk_layers(now, R, next, layers(0, 1), &mut source),
        Err(UsageError::ChunkAfterLast(_))
    ));
}

#[test]
fn a_range_after_the_session_ended_is_refused() {
    let now = kvpipe_core::Instant::from_millis(2);
    let mut s = four_layer_sender();
    let mut source = TestSource::with(R, 100, 8);
    let spec = chunk(0, 16, 32, false);
    s.submit_chunk_layers(now, R, spec, layers(0, 2), &mut source)
        .unwrap();
    s.cancel(now, R).unwrap();
    assert!(matches!(
        s.submit_chunk_layers(now, R, spec, layers(2, 4), &mut source),
        Err(UsageError::SessionEnded(_))
    ));
}

#[test]
fn an_interleaved_layer_order_must_list_every_layer() {
    let mut groups = layout(1);
    groups.push(groups[0].clone());
    let local = LocalHello::new(InstanceId(1), Default::default(), groups);
    let mut config = SenderConfig::new(local);
    config.layer_order = LayerOrder::repeat(&[GroupIndex(1), GroupIndex(0)], 1);
    let err = Sender::new(config.clone()).unwrap_err();
    assert!(err.to_string().contains("lists group#0 1 times"), "{err}");
    config.layer_order = LayerOrder::repeat(&[GroupIndex(1), GroupIndex(0)], 2);
    assert_eq!(Sender::new(config).unwrap().layer_count(), 4);
}

#[test]
fn layered_inputs_are_recorded_and_replay_exactly() {
    let mut net = Net::new(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.senders[0].record_inputs(true);
    net.connect(0, 0);
    net.pump();
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let first = chunk(0, 8, 16, false);
    let last = chunk(8, 16, 16, true);
    for spec in [first, last] {
        let now = net.now;
        for range in [layers(0, 1), layers(1, 2)] {
            // The lock-free pair, as drivers use it.
            let query = net.senders[0].chunk_layers_query(R, &spec, range).unwrap();
            let runs = query.ask(&mut source).unwrap();
            net.senders[0]
                .submit_chunk_layers_runs(now, R, spec, range, runs)
                .unwrap();
            net.pump();
        }
    }
    net.aux(0, R);
    assert!(completed(&net, Side::Receiver(0)));
    let inputs = net.senders[0].take_recorded_inputs();
    let layered: Vec<_> = inputs
        .iter()
        .filter_map(|i| match i {
            SenderInput::ChunkLayers { layers, runs, .. } => Some((*layers, runs.len())),
            _ => None,
        })
        .collect();
    assert_eq!(
        layered,
        vec![
            (layers(0, 1), 1),
            (layers(1, 2), 0),
            (layers(0, 1), 1),
            (layers(1, 2), 0)
        ]
    );
    // Replayed into a fresh sender, the inputs give the same outputs.
    let outputs = |s: &mut Sender| std::iter::from_fn(|| s.poll_output()).collect::<Vec<_>>();
    let original: Vec<Output> = net
        .log
        .iter()
        .filter(|(side, _)| *side == Side::Sender(0))
        .map(|(_, o)| o.clone())
        .collect();
    let mut replay = Sender::new(sender_config(0)).unwrap();
    let mut replayed = Vec::new();
    for input in inputs {
        replay.handle_input(input).unwrap();
        replayed.extend(outputs(&mut replay));
    }
    assert_eq!(replayed, original);
    assert_eq!(replay.phase(R), net.senders[0].phase(R));
}
