//! Random operation sequences (engine calls on both sides, write reports, time, cancels,
//! retirements, disconnects and hostile frames) applied to a connected sender and receiver.
//! Nothing may panic; every request ends at most once and quiesces at most once, after it
//! ended; and once the engines stop acting and the transport reports every batch, every session
//! ends and quiesces within its deadlines (nothing waits forever).

mod session_support;

use std::collections::BTreeMap;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{Event, ReceiverInput, SenderInput};
use kvpipe_core::wire::{
    AuxResult, Cancel, CancelReason, Frame, KvResult, RecvRegistration, TransferStatus,
};
use kvpipe_core::{
    AnchoredRun, BlockId, Duration, GrantId, ReceiverSliceId, RequestId, SenderSliceId,
};
use proptest::prelude::*;
use session_support::*;

const PROMPT: u32 = 16;

#[derive(Clone, Debug)]
enum Op {
    Advance(u8),
    Open(u8, bool),
    Register(u8),
    Submit(u8, u8),
    /// The next layer range of a request's chunk (a new chunk's first range when none is open).
    SubmitLayer(u8, u8),
    Aux(u8),
    Complete(u8),
    Fail(u8),
    SenderCancel(u8),
    ReceiverCancel(u8),
    SenderRetire(u8),
    ReceiverRetire(u8),
    Disconnect,
    Cut(bool),
    ToSender(Frame),
    ToReceiver(Frame),
}

fn req(r: u8) -> RequestId {
    RequestId(u64::from(r % 2))
}

fn is_terminal(e: &Event) -> Option<RequestId> {
    match e {
        Event::Completed { request, .. }
        | Event::Failed { request, .. }
        | Event::TimedOut { request, .. }
        | Event::Cancelled { request, .. } => Some(*request),
        _ => None,
    }
}

fn check_events(net: &Net) {
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let mut ended: BTreeMap<RequestId, usize> = BTreeMap::new();
        let mut quiesced: BTreeMap<RequestId, usize> = BTreeMap::new();
        for e in net.events(side) {
            if let Some(r) = is_terminal(&e) {
                *ended.entry(r).or_default() += 1;
                assert!(
                    !quiesced.contains_key(&r),
                    "{side:?}: {r} ended after it quiesced"
                );
            }
            if let Event::Quiesced { request } = e {
                *quiesced.entry(request).or_default() += 1;
                assert!(
                    ended.contains_key(&request),
                    "{side:?}: {request} quiesced before it ended"
                );
            }
        }
        assert!(
            ended.values().all(|&n| n == 1),
            "{side:?}: a request ended twice: {ended:?}"
        );
        assert!(
            quiesced.values().all(|&n| n == 1),
            "{side:?}: quiesced twice: {quiesced:?}"
        );
    }
}

fn run(ops: Vec<Op>) {
    let mut net = Net::connected(1, 1);
    net.auto_complete = false;
    let mut source = TestSource::default();
    for r in 0..4 {
        source
            .allocations
            .insert(RequestId(r), (100 * r as u32, PROMPT / TPB));
    }
    let mut next_start: BTreeMap<RequestId, u32> = BTreeMap::new();
    let mut open_chunk: BTreeMap<RequestId, kvpipe_core::ChunkSpec> = BTreeMap::new();
    for op in ops {
        let now = net.now;
        match op {
            Op::Advance(ms) => net.advance(Duration::from_millis(u64::from(ms) * 10)),
            Op::Open(r, beams) => {
                let mut s = send_request(req(r), &[0]);
                // Now and then a request pipelined transfer refuses (several beams).
                s.beam_width = if beams { 1 } else { 2 };
                let _ = net.senders[0].open_request(now, s);
            }
            Op::Register(r) => {
                let _ = net.receivers[0].register(now, registration(req(r), PROMPT, &[0]));
            }
            Op::Submit(r, n) => {
                let start = next_start.get(&req(r)).copied().unwrap_or(0);
                let end = (start + 2 + u32::from(n % 8)).min(PROMPT);
                let spec = chunk(start, end, PROMPT, end == PROMPT);
                if net.senders[0]
                    .submit_chunk(now, req(r), spec, &mut source)
                    .is_ok()
                {
                    next_start.insert(req(r), end);
                }
            }
            Op::SubmitLayer(r, n) => {
                let count = net.senders[0].layer_count();
                let (spec, begin) = match (
                    open_chunk.get(&req(r)),
                    net.senders[0].next_chunk_layer(req(r)),
                ) {
                    (Some(spec), Some(next)) => (*spec, next),
                    _ => {
                        let start = next_start.get(&req(r)).copied().unwrap_or(0);
                        let end = (start + 2 + u32::from(n % 8)).min(PROMPT);
                        (chunk(start, end, PROMPT, end == PROMPT), 0)
                    }
                };
                let range = kvpipe_core::LayerRange::new(begin, begin + 1);
                if net.senders[0]
                    .submit_chunk_layers(now, req(r), spec, range, &mut source)
                    .is_ok()
                {
                    next_start.insert(req(r), spec.end);
                    if range.end == count {
                        open_chunk.remove(&req(r));
                    } else {
                        open_chunk.insert(req(r), spec);
                    }
                }
            }
            Op::Aux(r) => {
                let _ = net.senders[0].handle_input(SenderInput::Aux {
                    now,
                    request: req(r),
                    data: Default::default(),
                });
            }
            Op::Complete(i) if !net.held.is_empty() => {
                let i = usize::from(i) % net.held.len();
                net.complete_held(i);
            }
            Op::Fail(i) if !net.held.is_empty() => {
                let i = usize::from(i) % net.held.len();
                net.fail_held(i, TransferStatus::WriteFailed);
            }
            Op::Complete(_) | Op::Fail(_) => {}
            Op::SenderCancel(r) => {
                let _ = net.senders[0].cancel(now, req(r));
            }
            Op::ReceiverCancel(r) => {
                let _ = net.receivers[0].cancel(now, req(r));
            }
            Op::SenderRetire(r) => {
                let _ = net.senders[0].retire(now, req(r));
            }
            Op::ReceiverRetire(r) => {
                let _ = net.receivers[0].retire(now, req(r));
            }
            Op::Disconnect => net.disconnect(0, 0),
            Op::Cut(on) => {
                if on {
                    net.cut.insert((0, 0));
                } else {
                    net.cut.remove(&(0, 0));
                }
            }
            Op::ToSender(frame) => {
                let _ = net.senders[0].handle_input(SenderInput::Transport {
                    now,
                    input: kvpipe_core::session::TransportInput::FrameReceived {
                        peer: rx_peer(0),
                        bytes: kvpipe_core::wire::Frame::to_bytes(&frame).unwrap(),
                    },
                });
            }
            Op::ToReceiver(frame) => {
                let _ = net.receivers[0].handle_input(ReceiverInput::Transport {
                    now,
                    input: kvpipe_core::session::TransportInput::FrameReceived {
                        peer: tx_peer(0),
                        bytes: kvpipe_core::wire::Frame::to_bytes(&frame).unwrap(),
                    },
                });
            }
        }
        net.pump();
        check_events(&net);
    }
    // The sender's engine abandons the prefills it did not finish (a sender session waits for
    // its engine's next chunk without a deadline: prefill runs at the engine's pace), then both
    // engines stop acting and the transport reports every batch. Everything ends in time.
    for r in 0..4 {
        if net.senders[0].phase(RequestId(r)) == Some(SendPhase::Streaming) {
            let now = net.now;
            net.senders[0].cancel(now, RequestId(r)).unwrap();
        }
    }
    net.pump();
    for _ in 0..40 {
        while !net.held.is_empty() {
            net.complete_held(0);
        }
        net.advance(Duration::from_millis(500));
    }
    check_events(&net);
    for r in 0..4 {
        let r = RequestId(r);
        if let Some(p) = net.senders[0].phase(r) {
            assert!(
                matches!(
                    p,
                    SendPhase::Completed | SendPhase::Quiesced | SendPhase::Retired
                ),
                "sender {r} stuck in {p:?}"
            );
        }
        if let Some(p) = net.receivers[0].phase(r) {
            assert!(
                matches!(
                    p,
                    RecvPhase::Completed | RecvPhase::Quiesced | RecvPhase::Retired
                ),
                "receiver {r} stuck in {p:?}"
            );
        }
    }
    assert_eq!(net.senders[0].batches_in_flight(), 0);
    if std::env::var_os("KVPIPE_MODEL_STATS").is_some() {
        eprintln!(
            "ops ran; sender {:?} receiver {:?}",
            net.senders[0].counters(),
            net.receivers[0].counters()
        );
    }
}

const STATUSES: [TransferStatus; 8] = [
    TransferStatus::Success,
    TransferStatus::WriteFailed,
    TransferStatus::InDoubt,
    TransferStatus::Cancelled,
    TransferStatus::TimedOut,
    TransferStatus::GrantViolation,
    TransferStatus::PeerLost,
    TransferStatus::ProtocolError,
];

/// Frames a confused or hostile peer might send about the requests in play.
fn hostile_frame() -> impl Strategy<Value = Frame> {
    let request = (0u64..4).prop_map(RequestId);
    prop_oneof![
        (
            request.clone(),
            0u32..4,
            0u32..3,
            any::<bool>(),
            0usize..8,
            0u64..1024
        )
            .prop_map(
                |(request, s, r, is_last, st, bytes)| Frame::KvResult(KvResult {
                    request,
                    sender_slice: SenderSliceId(s),
                    receiver_slice: ReceiverSliceId(r),
                    is_last,
                    status: STATUSES[st],
                    bytes_written: bytes,
                })
            ),
        request.clone().prop_map(|request| Frame::Cancel(Cancel {
            request,
            reason: CancelReason::Engine
        })),
        (request.clone(), 0usize..8).prop_map(|(request, st)| Frame::AuxResult(AuxResult {
            request,
            status: STATUSES[st],
            data: Default::default(),
        })),
        (
            request,
            0u32..3,
            prop_oneof![Just(PROMPT), 0u32..40],
            0usize..3
        )
            .prop_map(
                |(request, slice, prompt_len, groups)| Frame::RecvRegistration(RecvRegistration {
                    request,
                    slice: ReceiverSliceId(slice),
                    prompt_len,
                    grant: GrantId(9),
                    aux_capacity: 64,
                    groups: (0..groups)
                        .map(|_| AnchoredRun::from_ids(0, &(0..4).map(BlockId).collect::<Vec<_>>()))
                        .collect(),
                })
            ),
    ]
}

/// Engine and transport operations; `disruptive` adds write failures, cancels, disconnects,
/// lost frames and hostile frames.
fn op(disruptive: bool) -> impl Strategy<Value = Op> {
    let r = any::<u8>();
    let d = 1;
    let all = prop_oneof![
        3 => any::<u8>().prop_map(|ms| Op::Advance(ms % 40)),
        3 => (r, any::<bool>()).prop_map(|(r, a)| Op::Open(r, a)),
        3 => r.prop_map(Op::Register),
        6 => (r, any::<u8>()).prop_map(|(r, n)| Op::Submit(r, n)),
        4 => (r, any::<u8>()).prop_map(|(r, n)| Op::SubmitLayer(r, n)),
        2 => r.prop_map(Op::Aux),
        6 => any::<u8>().prop_map(Op::Complete),
        d => any::<u8>().prop_map(Op::Fail),
        d => r.prop_map(Op::SenderCancel),
        d => r.prop_map(Op::ReceiverCancel),
        1 => r.prop_map(Op::SenderRetire),
        1 => r.prop_map(Op::ReceiverRetire),
        d => Just(Op::Disconnect),
        d => any::<bool>().prop_map(Op::Cut),
        d => hostile_frame().prop_map(Op::ToSender),
        d => hostile_frame().prop_map(Op::ToReceiver),
    ];
    all.prop_map(move |op| match op {
        Op::Fail(_)
        | Op::SenderCancel(_)
        | Op::ReceiverCancel(_)
        | Op::Disconnect
        | Op::Cut(_)
        | Op::ToSender(_)
        | Op::ToReceiver(_)
            if !disruptive =>
        {
            Op::Advance(1)
        }
        op => op,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn random_operations_keep_the_session_rules(ops in proptest::collection::vec(op(true), 0..64)) {
        run(ops);
    }

    #[test]
    fn engine_operations_keep_the_session_rules(ops in proptest::collection::vec(op(false), 0..64)) {
        run(ops);
    }
}
