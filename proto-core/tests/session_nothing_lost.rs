//! Nothing lost: a request the endpoints report complete holds every byte of its KV. Each test
//! here is a path by which a request could once complete (or wait out a deadline) without it.

mod session_support;

use kvpipe_core::session::{CoverFault, Event, GroupPart, ProtocolError, UsageError};
use kvpipe_core::wire::{EncodeError, Frame, Malformation, RecvRegistration, TransferStatus};
use kvpipe_core::{
    AnchoredRun, BlockId, ChunkSpec, Duration, GrantId, IdRun, ReceiverSliceId, RequestId,
};
use session_support::*;
use smallvec::smallvec;

const R: RequestId = RequestId(0x7a11);

#[test]
fn a_registration_that_ends_before_the_prompts_last_block_is_refused() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    // 16 tokens are 4 blocks; the engine registered 3.
    let mut short = registration(R, 16, &[0]);
    short.groups[0] = AnchoredRun::from_ids(0, &[BlockId(500), BlockId(501), BlockId(502)]);
    let refused = net.receivers[0].register(now, short);
    assert!(
        matches!(
            refused,
            Err(UsageError::RegistrationOutsidePrompt(
                ProtocolError::RegistrationShort {
                    end: 3,
                    blocks: 4,
                    prompt_len: 16,
                    ..
                }
            ))
        ),
        "{refused:?}"
    );
    assert_eq!(
        net.receivers[0].session_count(),
        0,
        "a usage error changes nothing"
    );
    // A receiver that holds a cached prefix registers from its first missing block; one that
    // holds every block registers an empty run anchored at the end.
    let mut tail = registration(R, 16, &[0]);
    tail.groups[0] = AnchoredRun::from_ids(1, &[BlockId(501), BlockId(502), BlockId(503)]);
    net.receivers[0].register(now, tail).unwrap();
    let mut all_cached = registration(RequestId(2), 16, &[0]);
    all_cached.groups[0] = AnchoredRun::empty(4);
    net.receivers[0].register(now, all_cached).unwrap();
}

#[test]
fn a_sender_fails_a_short_registration_from_its_peer() {
    let mut net = Net::connected(1, 1);
    net.open(0, send_request(R, &[0]));
    let frame = Frame::RecvRegistration(RecvRegistration {
        request: R,
        slice: ReceiverSliceId(0),
        prompt_len: 16,
        grant: GrantId(9),
        aux_capacity: 64,
        groups: vec![AnchoredRun::from_ids(0, &[BlockId(500), BlockId(501)])],
    });
    let now = net.now;
    net.senders[0]
        .handle_transport(
            now,
            kvpipe_core::session::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: frame.to_bytes().unwrap(),
            },
        )
        .unwrap();
    let events: Vec<Event> = std::iter::from_fn(|| net.senders[0].poll_output())
        .filter_map(|o| match o {
            kvpipe_core::session::Output::Event(e) => Some(e),
            _ => None,
        })
        .collect();
    assert!(
        events.iter().any(|e| matches!(
            e,
            Event::Failed { request, cause: TransferStatus::ProtocolError, .. } if *request == R
        )),
        "{events:?}"
    );
}

#[test]
fn a_first_chunk_that_starts_after_the_cached_prefix_is_refused() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let now = net.now;
    // Prefix of 4 tokens, first chunk at 8: tokens 4..8 would never be sent.
    let gap = ChunkSpec {
        prepopulated_len: 4,
        ..chunk(8, 16, 16, true)
    };
    assert_eq!(
        net.senders[0].submit_chunk(now, R, gap, &mut source),
        Err(UsageError::FirstChunkAfterPrefix {
            request: R,
            start: 8,
            prepopulated_len: 4
        })
    );
    assert!(
        source.queries.is_empty(),
        "refused before asking the engine"
    );
    // The same request then goes through from the prefix's end.
    let from_prefix = ChunkSpec {
        prepopulated_len: 4,
        ..chunk(4, 16, 16, true)
    };
    net.submit(0, R, from_prefix, &mut source);
    net.aux(0, R);
    assert!(net
        .events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if *request == R)));
}

#[test]
fn a_hand_built_non_canonical_run_is_refused_at_once_saying_why() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    let cases = [
        (
            // Two runs that continue each other: the canonical form merges them.
            smallvec![
                IdRun {
                    first: BlockId(500),
                    len: 2
                },
                IdRun {
                    first: BlockId(502),
                    len: 2
                }
            ],
            Malformation::UnmergedRun,
        ),
        (
            smallvec![
                IdRun {
                    first: BlockId(500),
                    len: 4
                },
                IdRun {
                    first: BlockId(900),
                    len: 0
                }
            ],
            Malformation::ZeroLengthRun,
        ),
    ];
    for (runs, why) in cases {
        let mut reg = registration(R, 16, &[0]);
        reg.groups[0] = AnchoredRun {
            first_ordinal: 0,
            runs,
        };
        let refused = net.receivers[0].register(now, reg);
        assert!(
            matches!(
                &refused,
                Err(UsageError::RegistrationUnencodable {
                    request: R,
                    error: EncodeError::Invalid { reason, .. }
                }) if *reason == why
            ),
            "{refused:?}"
        );
        assert!(refused.unwrap_err().to_string().contains("cannot be sent"));
        assert_eq!(net.receivers[0].session_count(), 0);
    }
}

/// A receiver that registers late gets every queued slice at once; on a slow link they complete
/// one after another. Each batch's deadline follows the link's progress, so none fails while
/// batches towards that receiver keep completing; a link that stops fails them.
#[test]
fn write_deadlines_follow_the_links_progress() {
    let wc = deadlines().write_completion; // 200 ms
    let mut net = Net::connected(1, 1);
    net.auto_complete = false;
    let mut source = TestSource::with(R, 100, 4);
    net.open(0, send_request(R, &[0]));
    for k in 0..4 {
        net.submit(0, R, chunk(4 * k, 4 * k + 4, 16, k == 3), &mut source);
    }
    net.aux(0, R);
    net.register(0, registration(R, 16, &[0]));
    assert_eq!(net.held.len(), 4, "the replay issues every queued slice");
    // Each batch takes 3/4 of the deadline: the last one ends 3 deadlines after the replay.
    let step = Duration::from_nanos(wc.as_nanos() * 3 / 4);
    for _ in 0..4 {
        net.advance(step);
        net.complete_held(0);
    }
    let events = net.events(Side::Sender(0));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Completed { request, .. } if *request == R)),
        "{events:?}"
    );

    // A link that stops completing fails what it still holds one deadline after its last
    // completion.
    const Q: RequestId = RequestId(0x51a11);
    let mut source = TestSource::with(Q, 200, 4);
    net.log.clear();
    net.open(0, send_request(Q, &[0]));
    for k in 0..2 {
        net.submit(0, Q, chunk(4 * k, 4 * k + 4, 16, false), &mut source);
    }
    net.register(0, registration(Q, 16, &[0]));
    net.advance(step);
    net.complete_held(0);
    net.advance(step);
    let events = net.events(Side::Sender(0));
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::TimedOut { .. } | Event::Failed { .. })),
        "still within a deadline of progress: {events:?}"
    );
    net.advance(wc);
    let events = net.events(Side::Sender(0));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::TimedOut { request, .. } if *request == Q)),
        "{events:?}"
    );
}

/// Sender `rank` of a tensor-parallel prefill side of `heads` ranks, holding KV head `head` of
/// the model's `heads` (the support network's `tensor_parallel` gives rank `i` head `i`).
fn tp_sender(rank: u16, head: u16, heads: u16) -> kvpipe_core::Sender {
    let mut groups = layout(1);
    groups[0].shard.model_kv_heads = heads;
    groups[0].shard.first_head = head;
    let topology = kvpipe_core::wire::Topology {
        tp_size: heads,
        tp_rank: rank,
        pp_size: 1,
        pp_rank: 0,
        layer_begin: 0,
        layer_end: 2,
    };
    let mut c = kvpipe_core::SenderConfig::new(kvpipe_core::session::LocalHello::new(
        kvpipe_core::InstanceId(90 + u64::from(rank)),
        topology,
        groups,
    ));
    c.deadlines = deadlines();
    kvpipe_core::Sender::new(c).unwrap()
}

fn part(layers: std::ops::Range<u32>, heads: std::ops::Range<u32>) -> GroupPart {
    GroupPart { layers, heads }
}

#[test]
fn a_registration_listing_one_of_two_tensor_ranks_is_refused_naming_the_missing_heads() {
    let mut net = Net::tensor_parallel(2);
    let now = net.now;
    let refused = net.receivers[0].register(now, registration(R, 16, &[0]));
    assert_eq!(
        refused,
        Err(UsageError::WritersDoNotCover(
            ProtocolError::WritersDoNotCover {
                request: R,
                group: kvpipe_core::GroupIndex(0),
                fault: CoverFault::Missing {
                    part: part(0..2, 1..2)
                },
            }
        ))
    );
    let message = refused.unwrap_err().to_string();
    assert!(
        message.contains("KV heads 1..2 is written by none"),
        "{message}"
    );
    assert_eq!(net.receivers[0].session_count(), 0);
    // Both ranks listed: accepted.
    net.receivers[0]
        .register(now, registration(R, 16, &[0, 1]))
        .unwrap();
}

#[test]
fn two_senders_claiming_the_same_rank_fail_the_request_once_both_handshakes_are_known() {
    // Writer 1 is not connected yet when the decode engine registers.
    let mut net = Net::tensor_parallel_unconnected(2);
    net.connect(0, 0);
    net.pump();
    net.open(0, send_request(R, &[0]));
    net.register(0, registration(R, 16, &[0, 1]));
    assert_eq!(net.receivers[0].session_count(), 1, "cover not known yet");
    // Until the cover is proved no writer gets the registration, so none can write (and
    // complete on its side) a request that is about to fail.
    assert!(
        !net.events(Side::Sender(0))
            .iter()
            .any(|e| matches!(e, Event::Registered { .. })),
        "writer 0 was sent the registration before writer 1's handshake"
    );
    // It comes up claiming rank 0's head as well.
    net.senders[1] = tp_sender(0, 0, 2);
    net.connect(1, 0);
    net.pump();
    let violations: Vec<Event> = net
        .events(Side::Receiver(0))
        .into_iter()
        .filter(|e| matches!(e, Event::ProtocolViolation { .. } | Event::Failed { .. }))
        .collect();
    assert!(
        violations.iter().any(|e| matches!(
            e,
            Event::ProtocolViolation {
                error: ProtocolError::WritersDoNotCover {
                    fault: CoverFault::Doubled { .. },
                    ..
                },
                ..
            }
        )),
        "{violations:?}"
    );
    assert!(violations.iter().any(|e| matches!(
        e,
        Event::Failed { request, cause: TransferStatus::ProtocolError, .. } if *request == R
    )));
}

#[test]
fn a_declared_part_completes_with_its_own_writer_and_refuses_others() {
    let mut net = Net::tensor_parallel(2);
    let now = net.now;
    let mut source = TestSource::with(R, 100, 4);
    // One endpoint per writer: this registration expects only head 0, from writer 0.
    let mut reg = registration(R, 16, &[0]);
    reg.expected_part = Some(vec![part(0..2, 0..1)]);
    net.register(0, reg);
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.aux(0, R);
    assert!(net
        .events(Side::Receiver(0))
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if *request == R)));
    // Writer 1 writes head 1, outside a part of head 0.
    let mut other = registration(RequestId(2), 16, &[1]);
    other.expected_part = Some(vec![part(0..2, 0..1)]);
    assert!(matches!(
        net.receivers[0].register(now, other),
        Err(UsageError::WritersDoNotCover(
            ProtocolError::WritersDoNotCover {
                fault: CoverFault::Outside { .. },
                ..
            }
        ))
    ));
    // A part the rank does not hold is a usage error.
    let mut beyond = registration(RequestId(3), 16, &[0]);
    beyond.expected_part = Some(vec![part(0..4, 0..1)]);
    assert!(matches!(
        net.receivers[0].register(now, beyond),
        Err(UsageError::ExpectedPartNotHeld { .. })
    ));
}

/// A writer that writes one extent twice and leaves out another of the same size lands the
/// right byte count; completion requires the landed extents to be what it had to write, so the
/// second copy is refused and the request fails instead of completing without the tail.
#[test]
fn a_duplicated_write_plus_an_omission_of_the_same_size_does_not_complete() {
    let (mut net, mut source) = Net::held_pair(R, 16);
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    let held = net.held.remove(0);
    let extent = *held.plan.extents().first().expect("one coalesced extent");
    assert_eq!(extent.len, 4 * BLOCK_BYTES);
    let now = net.now;
    let (region, at) = (extent.dst_region, extent.dst_offset);
    let pieces = [
        (at, BLOCK_BYTES),
        (at, BLOCK_BYTES), // again
        (at + BLOCK_BYTES, 2 * BLOCK_BYTES),
        // [at + 3 blocks, +1 block) never written
    ];
    let mut admissions = Vec::new();
    for (offset, len) in pieces {
        let header = held.headers.frame(region, offset, len);
        let admission = net.receivers[0].admit_write(now, tx_peer(0), &header);
        if let kvpipe_core::session::Admission::Apply { ticket, .. } = admission {
            net.receivers[0]
                .handle_transport(
                    now,
                    kvpipe_core::session::TransportInput::WriteFinished {
                        ticket,
                        landed: true,
                    },
                )
                .unwrap();
        }
        admissions.push(admission);
    }
    assert!(
        matches!(
            admissions[1],
            kvpipe_core::session::Admission::Refuse(
                kvpipe_core::session::WriteRefusal::Overlap { .. }
            )
        ),
        "{admissions:?}"
    );
    net.senders[0]
        .handle_transport(
            now,
            kvpipe_core::session::TransportInput::WritesCompleted { batch: held.batch },
        )
        .unwrap();
    net.pump();
    // The refusal failed the request on both sides at once.
    let now = net.now;
    assert!(net.senders[0]
        .submit_aux(now, R, Default::default())
        .is_err());
    let events = net.events(Side::Receiver(0));
    assert!(
        !events.iter().any(|e| matches!(e, Event::Completed { .. })),
        "{events:?}"
    );
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Failed { request, .. } if *request == R)));
}

/// The DESIGN's pipelined mode needs a prefill side without pipeline parallelism; the rank's
/// topology says when it has it, and the sender refuses at once.
#[test]
fn a_prefill_side_split_by_pipeline_parallelism_is_refused_when_made() {
    let mut c = sender_config(0);
    c.local.topology.pp_size = 2;
    assert_eq!(
        kvpipe_core::Sender::new(c).err(),
        Some(kvpipe_core::ConfigError::SenderPipelineParallel(2))
    );
}

/// MLA (`kv_factor` 1, one latent "head" every tensor rank holds in full) from two prefill
/// tensor ranks to one decode rank: the replica rule picks rank 0 as the writer, so a
/// registration naming rank 0 completes with every byte and one naming only rank 1 is refused.
#[test]
fn mla_across_tensor_parallel_sizes_is_covered_by_the_replica_the_rule_picks() {
    let mla = |region: u32| {
        let mut g = layout(region);
        g[0].kv_factor = 1;
        g[0].shard.model_kv_heads = 1;
        g[0].pools[0].slot_bytes = BLOCK_BYTES / 2;
        g
    };
    let mut net = Net::new(2, 1);
    for rank in 0..2u16 {
        let topology = kvpipe_core::wire::Topology {
            tp_size: 2,
            tp_rank: rank,
            pp_size: 1,
            pp_rank: 0,
            layer_begin: 0,
            layer_end: 2,
        };
        let mut c = kvpipe_core::SenderConfig::new(kvpipe_core::session::LocalHello::new(
            kvpipe_core::InstanceId(70 + u64::from(rank)),
            topology,
            mla(1),
        ));
        c.deadlines = deadlines();
        net.senders[usize::from(rank)] = kvpipe_core::Sender::new(c).unwrap();
    }
    let mut c = kvpipe_core::ReceiverConfig::new(
        kvpipe_core::session::LocalHello::new(
            kvpipe_core::InstanceId(80),
            Default::default(),
            mla(2),
        ),
        0x31a,
    );
    c.deadlines = deadlines();
    net.receivers[0] = kvpipe_core::Receiver::new(c).unwrap();
    net.connect(0, 0);
    net.connect(1, 0);
    net.pump();
    let now = net.now;
    assert!(matches!(
        net.receivers[0].register(now, registration(R, 16, &[1])),
        Err(UsageError::WritersDoNotCover(
            ProtocolError::WritersDoNotCover {
                fault: CoverFault::Missing { .. },
                ..
            }
        ))
    ));
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.aux(0, R);
    let completed = net
        .events(Side::Receiver(0))
        .into_iter()
        .find_map(|e| match e {
            Event::Completed { bytes_written, .. } => Some(bytes_written),
            _ => None,
        });
    assert_eq!(
        completed,
        Some(4 * BLOCK_BYTES / 2),
        "every latent byte of 4 blocks"
    );
}

/// Sink tokens are never transferred: the sender's bounded query drops a windowed group's blocks
/// up to the last gap, sinks included. A decode engine that registers them would get the
/// request completed with them unwritten, so the registration is refused, naming the boundary.
#[test]
fn a_windowed_registration_below_the_stale_boundary_is_refused() {
    let mut groups = layout(2);
    groups[0].window = Some(8);
    let mut c = kvpipe_core::ReceiverConfig::new(
        kvpipe_core::session::LocalHello::new(
            kvpipe_core::InstanceId(5),
            Default::default(),
            groups,
        ),
        1,
    );
    c.deadlines = deadlines();
    let mut receiver = kvpipe_core::Receiver::new(c).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    // 16 tokens, window 8, 4 tokens per block: the stale boundary is block (16 + 1 - 8) / 4 = 2.
    let with_sinks = registration(R, 16, &[0]);
    assert_eq!(
        receiver.register(now, with_sinks),
        Err(UsageError::RegistrationBelowWindow {
            request: R,
            group: kvpipe_core::GroupIndex(0),
            first: 0,
            stale: 2
        })
    );
    let mut window = registration(R, 16, &[0]);
    window.groups[0] = AnchoredRun::from_ids(2, &[BlockId(7), BlockId(8)]);
    receiver.register(now, window).unwrap();
}

/// A decode engine that lists a prefill rank writing none of its heads (here: MLA's other
/// replica) would wait for that writer's results in vain while the real writer completes; the
/// registration is refused, naming the writer.
#[test]
fn a_listed_writer_that_writes_nothing_here_is_refused() {
    // A one-KV-head model over two prefill tensor ranks: both hold head 0, and the replica
    // rule picks rank 0 to write this decode rank; rank 1 writes nothing here.
    let mut net = Net::new(2, 1);
    for rank in 0..2u16 {
        let mut groups = layout(1);
        groups[0].shard.model_kv_heads = 1;
        let topology = kvpipe_core::wire::Topology {
            tp_size: 2,
            tp_rank: rank,
            pp_size: 1,
            pp_rank: 0,
            layer_begin: 0,
            layer_end: 2,
        };
        let mut c = kvpipe_core::SenderConfig::new(kvpipe_core::session::LocalHello::new(
            kvpipe_core::InstanceId(60 + u64::from(rank)),
            topology,
            groups,
        ));
        c.deadlines = deadlines();
        net.senders[usize::from(rank)] = kvpipe_core::Sender::new(c).unwrap();
        net.connect(usize::from(rank), 0);
    }
    net.pump();
    let now = net.now;
    let refused = net.receivers[0].register(now, registration(R, 16, &[0, 1]));
    assert_eq!(
        refused,
        Err(UsageError::WritersDoNotCover(
            ProtocolError::WriterWritesNothing {
                request: R,
                writer: tx_peer(1)
            }
        ))
    );
    net.receivers[0]
        .register(now, registration(R, 16, &[0]))
        .unwrap();
}

/// A submission in two halves (the driver queries the engine without holding the sender):
/// the query changes nothing, the runs are checked again when applied, and a request that
/// ended in between refuses them.
#[test]
fn a_chunk_submitted_in_two_halves_is_checked_again_when_applied() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let now = net.now;
    let spec = chunk(0, 8, 16, false);
    let query = net.senders[0].chunk_query(R, &spec).unwrap();
    assert_eq!(query.windows().len(), 1);
    assert_eq!(
        net.senders[0].counters().slices,
        0,
        "the query changes nothing"
    );
    let runs = query.ask(&mut source).unwrap();
    assert_eq!(source.queries, [(R, kvpipe_core::GroupIndex(0), 0, 2)]);
    let slice = net.senders[0]
        .submit_chunk_runs(now, R, spec, runs.clone())
        .unwrap();
    assert_eq!(slice.slice(), Some(kvpipe_core::SenderSliceId(0)));
    // The next chunk's query, then a cancel before its answers are applied.
    let next = chunk(8, 16, 16, true);
    let query = net.senders[0].chunk_query(R, &next).unwrap();
    let runs = query.ask(&mut source).unwrap();
    net.senders[0].cancel(now, R).unwrap();
    assert_eq!(
        net.senders[0].submit_chunk_runs(now, R, next, runs),
        Err(UsageError::SessionEnded(R))
    );
}
