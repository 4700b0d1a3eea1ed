//! The `session` target's checks over its committed seed corpus, and over structured cases that
//! must reach completion, on stable Rust.

use std::fs;
use std::path::Path;

use bytes::Bytes;
use kvpipe_core::session::{ReceiverInput, SenderInput, TransportInput, WriteBatchId};
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Instant, PeerId, RequestId};
use kvpipe_fuzz::session::{check, run_case, NetemCase, SessionCase, Step};

fn case(steps: Vec<Step>) -> SessionCase {
    SessionCase {
        netem: NetemCase::default(),
        steps,
    }
}

fn rid(r: u8) -> RequestId {
    RequestId(u64::from(r) % 4 + 1)
}

fn open(request: u8) -> Step {
    Step::Open {
        request,
        several_beams: false,
    }
}

fn aux(request: u8) -> Step {
    Step::Aux { request }
}

fn retire_sender(r: u8) -> Step {
    Step::Sender(SenderInput::Retire {
        now: Instant::ZERO,
        request: rid(r),
    })
}

fn retire_receiver(r: u8) -> Step {
    Step::Receiver(ReceiverInput::Retire {
        now: Instant::ZERO,
        request: rid(r),
    })
}

#[test]
fn session_seed_corpus_keeps_every_rule() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds/session");
    let mut seen = 0;
    let mut completed = 0;
    for entry in fs::read_dir(&dir).expect("the seed corpus exists") {
        let path = entry.unwrap().path();
        let data = fs::read(&path).unwrap();
        check(&data);
        if let Ok(case) = <SessionCase as arbitrary::Arbitrary>::arbitrary_take_rest(
            arbitrary::Unstructured::new(&data),
        ) {
            completed += run_case(&case).receiver_completed;
        }
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} seeds in {}", dir.display());
    // The seeds reach whole transfers, not only early failures.
    assert!(completed > 0, "no seed completes a transfer");
}

#[test]
fn session_pump_drives_a_transfer_to_completion() {
    let steps = vec![
        open(0),
        Step::Register {
            request: 0,
            cached: 5,
        },
        Step::Chunk {
            request: 0,
            tokens: 9,
            last: false,
        },
        Step::Pump,
        Step::Chunk {
            request: 0,
            tokens: 0,
            last: true,
        },
        Step::Pump,
        aux(0),
        Step::Pump,
    ];
    let stats = run_case(&case(steps));
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 1, "{stats:?}");
}

/// A whole transfer, step by step: both sides complete.
fn happy_path(request: u8) -> Vec<Step> {
    let mut steps = vec![
        Step::Register { request, cached: 0 },
        Step::Deliver,
        open(request),
    ];
    for last in [false, false, true] {
        steps.push(Step::Chunk {
            request,
            tokens: 6,
            last,
        });
        steps.push(Step::LandBatch { index: 0 });
        steps.push(Step::Deliver);
    }
    steps.push(aux(request));
    steps.push(Step::Deliver);
    steps.push(retire_sender(request));
    steps.push(retire_receiver(request));
    steps
}

#[test]
fn session_structured_transfer_completes_on_both_sides() {
    let stats = run_case(&case(happy_path(1)));
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 1, "{stats:?}");
    assert_eq!(stats.ended_otherwise, 0, "{stats:?}");
    assert!(stats.batches >= 2, "{stats:?}");
    assert!(stats.admitted >= 2, "{stats:?}");
}

#[test]
fn session_structured_transfer_completes_after_a_data_path_offer_is_answered() {
    let to_sender = |input| {
        Step::Sender(SenderInput::Transport {
            now: Instant::ZERO,
            input,
        })
    };
    // Reconnect with the sender offering a data path; the receiver's transport answers once
    // the Hello arrived; the transfer then runs as on any connection.
    let mut steps = vec![
        to_sender(TransportInput::PeerDisconnected { peer: PeerId(0) }),
        to_sender(TransportInput::PeerConnectedWithOffer {
            peer: PeerId(0),
            offer: Bytes::from_static(b"offer"),
        }),
        Step::Deliver,
        Step::Receiver(ReceiverInput::Transport {
            now: Instant::ZERO,
            input: TransportInput::DataPathAnswered {
                peer: PeerId(0),
                answer: Bytes::from_static(b"answer"),
            },
        }),
    ];
    steps.extend(happy_path(1));
    let stats = run_case(&case(steps));
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 1, "{stats:?}");
    assert_eq!(stats.ended_otherwise, 0, "{stats:?}");
}

#[test]
fn session_structured_failed_write_ends_both_sides() {
    let mut steps = happy_path(2);
    // Fail the first batch instead of landing it.
    let k = steps
        .iter()
        .position(|o| matches!(o, Step::LandBatch { .. }))
        .unwrap();
    steps[k] = Step::Sender(SenderInput::Transport {
        now: Instant::ZERO,
        input: TransportInput::WritesFailed {
            batch: WriteBatchId(0),
            status: TransferStatus::WriteFailed,
        },
    });
    let stats = run_case(&case(steps));
    assert_eq!(stats.sender_completed + stats.receiver_completed, 0);
    assert_eq!(stats.ended_otherwise, 2, "{stats:?}");
}

#[test]
fn session_structured_disorder_and_timeouts_keep_the_rules() {
    // A lossy, duplicating, reordering, delaying network, writes outside the grant, and a
    // connection that drops and comes back.
    let mut steps = happy_path(3);
    steps.insert(
        4,
        Step::DataWrite {
            request: 3,
            offset: 3,
            len: 4,
            stray: false,
        },
    );
    steps.insert(
        5,
        Step::DataWrite {
            request: 3,
            offset: 4,
            len: 4,
            stray: true,
        },
    );
    steps.push(Step::Advance { millis: 999 });
    steps.push(Step::Receiver(ReceiverInput::Transport {
        now: Instant::ZERO,
        input: TransportInput::PeerDisconnected {
            peer: Default::default(),
        },
    }));
    steps.push(Step::Advance { millis: 999 });
    steps.push(Step::Sender(SenderInput::Transport {
        now: Instant::ZERO,
        input: TransportInput::PeerConnected {
            peer: Default::default(),
        },
    }));
    steps.extend(happy_path(1));
    let netem = NetemCase {
        seed: 3,
        loss: 20,
        duplicate: 40,
        reorder: 40,
        delay: 60,
    };
    let stats = run_case(&SessionCase { netem, steps });
    assert!(stats.admitted > 0, "{stats:?}");
}

/// The bytes that decode to `case`, for cases made of the fixed-size steps only (the
/// `arbitrary` encoding: an enum's variant is a little-endian `u32` scaled onto the variant
/// count, then its fields in order; the step list takes the rest of the input, each step
/// behind an odd byte).
fn encode(case: &SessionCase) -> Vec<u8> {
    const VARIANTS: u64 = 14;
    let mut out = case.netem.seed.to_le_bytes().to_vec();
    let n = &case.netem;
    out.extend([n.loss, n.duplicate, n.reorder, n.delay]);
    for step in &case.steps {
        let (variant, fields): (u64, Vec<u8>) = match *step {
            Step::Open {
                request,
                several_beams,
            } => (2, vec![request, several_beams.into()]),
            Step::Chunk {
                request,
                tokens,
                last,
            } => (3, vec![request, tokens, last.into()]),
            Step::Aux { request } => (4, vec![request]),
            Step::Register { request, cached } => (5, vec![request, cached]),
            Step::LandBatch { index } => (6, vec![index]),
            Step::DataWrite {
                request,
                offset,
                len,
                stray,
            } => {
                let [a, b] = offset.to_le_bytes();
                (7, vec![request, a, b, len, stray.into()])
            }
            Step::Deliver => (8, vec![]),
            Step::DeliverAny { to_receiver, index } => (9, vec![to_receiver.into(), index]),
            Step::Advance { millis } => (10, millis.to_le_bytes().to_vec()),
            Step::Pump => (11, vec![]),
            Step::ChunkLayers {
                request,
                tokens,
                last,
                layers,
            } => (13, vec![request, tokens, last.into(), layers]),
            Step::Sender(SenderInput::Cancel { now, request }) => {
                (0, [enum_index(6, 8), now_and(now, request)].concat())
            }
            Step::Sender(SenderInput::Retire { now, request }) => {
                (0, [enum_index(7, 8), now_and(now, request)].concat())
            }
            Step::Receiver(ReceiverInput::Cancel { now, request }) => {
                (1, [enum_index(2, 4), now_and(now, request)].concat())
            }
            Step::Receiver(ReceiverInput::Retire { now, request }) => {
                (1, [enum_index(3, 4), now_and(now, request)].concat())
            }
            _ => panic!("{step:?} has no fixed-size encoding"),
        };
        out.push(1); // another step follows
        out.extend(enum_index(variant, VARIANTS));
        out.extend(fields);
    }
    out
}

/// The `u32` that `arbitrary` scales onto variant `index` of `count`.
fn enum_index(index: u64, count: u64) -> Vec<u8> {
    let x = (index << 32).div_ceil(count);
    assert_eq!((x * count) >> 32, index);
    (x as u32).to_le_bytes().to_vec()
}

fn now_and(now: Instant, request: RequestId) -> Vec<u8> {
    [now.as_nanos().to_le_bytes(), request.0.to_le_bytes()].concat()
}

/// A whole transfer with every chunk submitted in layer ranges (one layer at a time: the
/// fixed layout has two), its batches landing as they come.
fn layered_path(request: u8) -> Vec<Step> {
    let mut steps = vec![
        Step::Register { request, cached: 0 },
        Step::Deliver,
        open(request),
    ];
    for last in [false, false, true] {
        for _ in 0..2 {
            steps.push(Step::ChunkLayers {
                request,
                tokens: 6,
                last,
                layers: 0,
            });
            steps.push(Step::LandBatch { index: 0 });
            steps.push(Step::Deliver);
        }
    }
    steps.push(aux(request));
    steps.push(Step::Deliver);
    steps.push(retire_sender(request));
    steps.push(retire_receiver(request));
    steps
}

#[test]
fn session_structured_layer_slices_complete_on_both_sides() {
    let stats = run_case(&case(layered_path(1)));
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 1, "{stats:?}");
    assert_eq!(stats.ended_otherwise, 0, "{stats:?}");
    assert_eq!(stats.refused, 0, "{stats:?}");
    // Two ranges per chunk, each its own batch.
    assert!(stats.batches >= 5, "{stats:?}");
    // The last range missing: the request does not complete.
    let mut steps = layered_path(2);
    let k = steps
        .iter()
        .rposition(|o| matches!(o, Step::ChunkLayers { .. }))
        .unwrap();
    steps.remove(k);
    let stats = run_case(&case(steps));
    assert_eq!(stats.receiver_completed, 0, "{stats:?}");
    assert_eq!(stats.sender_completed, 0, "{stats:?}");
}

/// The structured seeds: whole transfers, a failed write, disorder on a lossy network.
fn structured_seeds() -> Vec<(&'static str, SessionCase)> {
    let lossy = NetemCase {
        seed: 5,
        loss: 12,
        duplicate: 30,
        reorder: 30,
        delay: 50,
    };
    let mut two = happy_path(1);
    two.extend(happy_path(2));
    let mut stray = happy_path(0);
    stray.insert(
        4,
        Step::DataWrite {
            request: 0,
            offset: 2,
            len: 3,
            stray: true,
        },
    );
    let mut cancel = happy_path(3);
    cancel.insert(5, Step::Advance { millis: 600 });
    vec![
        ("structured_transfer", case(happy_path(1))),
        ("structured_two_transfers", case(two)),
        ("structured_stray_write", case(stray)),
        ("structured_slow_aux", case(cancel)),
        ("structured_layer_slices", case(layered_path(1))),
        (
            "structured_lossy_network",
            SessionCase {
                netem: lossy,
                steps: happy_path(2),
            },
        ),
    ]
}

#[test]
fn session_structured_seeds_decode_to_their_cases() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds/session");
    let regenerate = std::env::var_os("KVPIPE_REGENERATE_SEEDS").is_some();
    for (name, case) in structured_seeds() {
        let bytes = encode(&case);
        let decoded = <SessionCase as arbitrary::Arbitrary>::arbitrary_take_rest(
            arbitrary::Unstructured::new(&bytes),
        )
        .unwrap();
        assert_eq!(format!("{decoded:?}"), format!("{case:?}"));
        let path = dir.join(name);
        if regenerate {
            fs::write(&path, &bytes).unwrap();
        }
        assert_eq!(
            fs::read(&path).ok(),
            Some(bytes),
            "{} (run KVPIPE_REGENERATE_SEEDS=1 cargo test --test session_seeds)",
            path.display()
        );
    }
}

/// Lists, for a corpus directory named by `SESSION_CORPUS`, what each case reaches (used to pick
/// the committed seeds). Run with `--ignored --nocapture`.
#[test]
#[ignore]
fn session_corpus_stats() {
    let Ok(dir) = std::env::var("SESSION_CORPUS") else {
        return;
    };
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let data = fs::read(&path).unwrap();
        let Ok(case) = <SessionCase as arbitrary::Arbitrary>::arbitrary_take_rest(
            arbitrary::Unstructured::new(&data),
        ) else {
            continue;
        };
        let s = run_case(&case);
        println!(
            "{} {} {} {} {} {} {}",
            path.display(),
            case.steps.len(),
            s.sender_completed,
            s.receiver_completed,
            s.ended_otherwise,
            s.batches,
            s.admitted
        );
    }
}
