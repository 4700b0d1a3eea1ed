//! The emulator's decisions: seeded, reproducible, and each fault doing what it says.

use bytes::Bytes;
use kvpipe_core::wire::{Frame, Heartbeat, TransferStatus};
use kvpipe_core::{Duration, Instant};
use kvpipe_netem::{
    BatchFault, Direction, FrameFate, FrameQueue, LossModel, Netem, NetemConfig, ScriptedBatch,
    SeededRng,
};

fn heartbeat(seq: u64) -> Bytes {
    Bytes::from(Frame::Heartbeat(Heartbeat { seq }).to_vec().unwrap())
}

#[test]
fn same_seed_same_sequence_and_ranges_hold() {
    let mut a = SeededRng::new(7);
    let mut b = SeededRng::new(7);
    for _ in 0..1000 {
        assert_eq!(a.next_u64(), b.next_u64());
        let v = a.range(3, 9);
        assert!((3..=9).contains(&v));
        assert_eq!(v, b.range(3, 9));
    }
    assert_ne!(SeededRng::new(1).next_u64(), SeededRng::new(2).next_u64());
    let hits = (0..10_000).filter(|_| a.chance(0.25)).count();
    assert!((2_000..3_000).contains(&hits), "{hits}");
}

#[test]
fn the_default_injects_nothing_and_keeps_order() {
    let mut net = Netem::new(NetemConfig::default());
    let mut link = net.link();
    let mut q = FrameQueue::default();
    let now = Instant::from_millis(1);
    for seq in 0..50 {
        let fate = net.frame(now, &mut link, Direction::ToReceiver, heartbeat(seq));
        assert!(matches!(
            fate,
            FrameFate::Deliver {
                copies: 1,
                overtake: false,
                at,
                ..
            } if at == now
        ));
        q.push(fate);
    }
    for seq in 0..50 {
        assert_eq!(q.pop_due(now), Some(heartbeat(seq)));
    }
    let fate = net.batch(now, &mut link, 0, 1 << 20);
    assert_eq!((fate.fail, fate.stall, fate.done_at), (None, None, now));
    assert_eq!(net.counters().frames, 50);
    assert!(!NetemConfig::default().is_active());
}

#[test]
fn the_same_seed_gives_the_same_fates() {
    let config = NetemConfig {
        seed: 9,
        latency: (Duration::from_micros(20), Duration::from_millis(2)),
        jitter_percent: 50,
        loss: 0.1,
        loss_model: LossModel::Retransmit {
            retry: 0.3,
            timeout: Duration::from_millis(3),
            reset_after: 3,
        },
        delay: 0.1,
        duplicate: 0.1,
        reorder: 0.1,
        corrupt: 0.1,
        write_failure: 0.2,
        grant_violation_share: 0.5,
        ..NetemConfig::default()
    };
    let run = || {
        let mut net = Netem::new(config.clone());
        let mut link = net.link();
        let fates: Vec<_> = (0..200)
            .map(|s| {
                let at = Instant::from_millis(s);
                (
                    net.frame(at, &mut link, Direction::ToSender, heartbeat(s)),
                    net.batch(at, &mut link, 0, 100),
                )
            })
            .collect();
        (fates, *net.counters())
    };
    let (a, counts) = run();
    assert_eq!(a, run().0);
    assert!(counts.lost > 0 && counts.delayed > 0 && counts.duplicated > 0);
    assert!(counts.reordered > 0 && counts.corrupted > 0 && counts.failed_writes > 0);
}

#[test]
fn a_link_delivers_in_order_unless_a_frame_overtakes() {
    let config = NetemConfig {
        seed: 3,
        delay: 0.5,
        delay_range: (Duration::ZERO, Duration::from_millis(5)),
        ..NetemConfig::default()
    };
    let mut net = Netem::new(config);
    let mut link = net.link();
    let mut last = Instant::ZERO;
    for s in 0..200 {
        let FrameFate::Deliver { at, .. } = net.frame(
            Instant::ZERO + Duration::from_micros(s * 10),
            &mut link,
            Direction::ToReceiver,
            heartbeat(s),
        ) else {
            panic!("nothing is lost");
        };
        assert!(at >= last);
        last = at;
    }
    // An overtaking frame goes before the last queued one, at its time.
    let mut q = FrameQueue::default();
    let at = |ms| Instant::from_millis(ms);
    for (seq, overtake) in [(1, false), (2, false), (3, true)] {
        q.push(FrameFate::Deliver {
            at: at(seq),
            copies: 1,
            overtake,
            bytes: heartbeat(seq),
        });
    }
    assert_eq!(q.next_due(), Some(at(1)));
    assert_eq!(q.pop_due(at(5)), Some(heartbeat(1)));
    assert_eq!(q.pop_due(at(1)), None);
    assert_eq!(q.pop_due(at(2)), Some(heartbeat(3)));
    assert_eq!(q.pop_due(at(2)), Some(heartbeat(2)));
    assert!(q.is_empty());
}

#[test]
fn a_corrupted_frame_never_decodes() {
    let config = NetemConfig {
        seed: 5,
        corrupt: 1.0,
        ..NetemConfig::default()
    };
    let mut net = Netem::new(config);
    let mut link = net.link();
    for s in 0..500 {
        let FrameFate::Deliver { bytes, .. } = net.frame(
            Instant::ZERO,
            &mut link,
            Direction::ToReceiver,
            heartbeat(s),
        ) else {
            panic!("nothing is lost");
        };
        assert_ne!(bytes, heartbeat(s));
        assert_eq!(bytes.len(), heartbeat(s).len());
        assert!(Frame::parse(&bytes).is_err(), "{bytes:?} decodes");
    }
    assert_eq!(net.counters().corrupted, 500);
}

#[test]
fn retransmissions_hold_a_frame_back_and_too_many_reset_the_link() {
    let config = NetemConfig {
        seed: 1,
        loss: 1.0,
        loss_model: LossModel::Retransmit {
            retry: 1.0,
            timeout: Duration::from_millis(3),
            reset_after: 4,
        },
        ..NetemConfig::default()
    };
    let mut net = Netem::new(config);
    let mut link = net.link();
    let fate = net.frame(
        Instant::ZERO,
        &mut link,
        Direction::ToReceiver,
        heartbeat(1),
    );
    assert_eq!(
        fate,
        FrameFate::Reset {
            at: Instant::from_millis(12)
        }
    );
    assert_eq!((net.counters().lost, net.counters().resets), (4, 1));
}

#[test]
fn scripted_batches_fail_or_stall_exactly() {
    let config = NetemConfig {
        scripted_batches: vec![
            ScriptedBatch {
                writer: 1,
                nth: 1,
                fault: BatchFault::Fail(TransferStatus::GrantViolation),
            },
            ScriptedBatch {
                writer: 0,
                nth: 2,
                fault: BatchFault::Stall(Duration::from_millis(7)),
            },
        ],
        write_latency: Duration::from_micros(20),
        write_bytes_per_ns: 10,
        ..NetemConfig::default()
    };
    let mut net = Netem::new(config);
    let mut link = net.link();
    let now = Instant::from_millis(1);
    let fates: Vec<_> = (0..3)
        .flat_map(|_| [0, 1].map(|w| net.batch(now, &mut link, w, 1000)))
        .collect();
    let failed: Vec<usize> = (0..6).filter(|&i| fates[i].fail.is_some()).collect();
    assert_eq!(failed, vec![3]);
    assert_eq!(fates[3].fail, Some(TransferStatus::GrantViolation));
    let stalled: Vec<usize> = (0..6).filter(|&i| fates[i].stall.is_some()).collect();
    assert_eq!(stalled, vec![4]);
    assert_eq!(fates[0].done_at, now + Duration::from_nanos(20_100));
}
