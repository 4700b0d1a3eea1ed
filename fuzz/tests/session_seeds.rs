//! The `session` target's checks over its committed seed corpus, and over structured cases that
//! must reach completion, on stable Rust.

use std::fs;
use std::path::Path;

use kvpipe_fuzz::session::{check, run_case, Op, SessionCase};

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
    let ops = vec![
        Op::Open {
            request: 0,
            sends_aux: false,
        },
        Op::Register {
            request: 0,
            cached: 5,
        },
        Op::SubmitChunk {
            request: 0,
            tokens: 9,
            last: false,
        },
        Op::Pump,
        Op::SubmitChunk {
            request: 0,
            tokens: 0,
            last: true,
        },
        Op::Pump,
    ];
    let stats = run_case(&SessionCase { ops });
    // Without aux data the receiver waits for it and ends on its aux deadline later; the
    // sender completes once its last result went out.
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 0, "{stats:?}");
}

/// A whole transfer, step by step: both sides complete.
fn happy_path(request: u8) -> Vec<Op> {
    let mut ops = vec![
        Op::Register { request, cached: 0 },
        Op::DeliverNext { to_receiver: false },
        Op::Open {
            request,
            sends_aux: true,
        },
    ];
    for last in [false, false, true] {
        ops.push(Op::SubmitChunk {
            request,
            tokens: 6,
            last,
        });
        ops.push(Op::CompleteWrite { index: 0 });
        ops.push(Op::DeliverNext { to_receiver: true });
    }
    ops.push(Op::SubmitAux { request });
    ops.push(Op::DeliverNext { to_receiver: true });
    ops.push(Op::DeliverNext { to_receiver: true });
    ops.push(Op::RetireSender { request });
    ops.push(Op::RetireReceiver { request });
    ops
}

#[test]
fn session_structured_transfer_completes_on_both_sides() {
    let stats = run_case(&SessionCase { ops: happy_path(1) });
    assert_eq!(stats.sender_completed, 1, "{stats:?}");
    assert_eq!(stats.receiver_completed, 1, "{stats:?}");
    assert_eq!(stats.ended_otherwise, 0, "{stats:?}");
    assert!(stats.batches >= 2, "{stats:?}");
}

#[test]
fn session_structured_failed_write_ends_both_sides() {
    let mut ops = happy_path(2);
    // Fail the first batch instead of completing it.
    let k = ops
        .iter()
        .position(|o| matches!(o, Op::CompleteWrite { .. }))
        .unwrap();
    ops[k] = Op::FailWrite {
        index: 0,
        status: 0,
    };
    let stats = run_case(&SessionCase { ops });
    assert_eq!(stats.sender_completed + stats.receiver_completed, 0);
    assert_eq!(stats.ended_otherwise, 2, "{stats:?}");
}

#[test]
fn session_structured_disorder_and_timeouts_keep_the_rules() {
    let mut ops = happy_path(3);
    ops.insert(
        4,
        Op::Duplicate {
            to_receiver: true,
            index: 0,
        },
    );
    ops.insert(
        6,
        Op::DeliverAny {
            to_receiver: true,
            index: 1,
        },
    );
    ops.push(Op::Advance { millis: 999 });
    ops.push(Op::Disconnect);
    ops.push(Op::Advance { millis: 999 });
    ops.push(Op::Reconnect);
    ops.extend(happy_path(1));
    run_case(&SessionCase { ops });
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
            "{} {} {} {} {} {}",
            path.display(),
            case.ops.len(),
            s.sender_completed,
            s.receiver_completed,
            s.ended_otherwise,
            s.batches
        );
    }
}
