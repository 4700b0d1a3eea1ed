//! Randomised workloads over the in-process transport: random geometry, groups, windows,
//! prefixes, allocation and slot order must always transfer every byte; random faults must
//! always end cleanly.

use kvpipe_conformance::cache::{AllocationStyle, GroupSpec};
use kvpipe_conformance::suite::{
    check_clean, run_workload, FaultPlan, Interrupt, MemHarness, RequestPlan, Workload,
};
use kvpipe_core::session::Deadlines;
use kvpipe_core::wire::Role;
use kvpipe_core::Duration;
use proptest::prelude::*;

fn group() -> impl Strategy<Value = (GroupSpec, Vec<u16>)> {
    (
        1u16..4,
        prop::option::of(1u32..40),
        0u32..8,
        any::<bool>(),
        0u64..3,
    )
        .prop_map(|(layers, window, sinks, split, pad)| {
            let sender_split = if split && layers > 1 {
                vec![1, layers - 1]
            } else {
                vec![layers]
            };
            let receiver_split = if !split && layers > 1 {
                vec![layers - 1, 1]
            } else {
                vec![layers]
            };
            let mut g = GroupSpec::full(layers, &sender_split);
            if let Some(w) = window {
                g = g.windowed(w, sinks);
            }
            g.slot_padding = pad * 8;
            (g, receiver_split)
        })
}

fn request(id: u64) -> impl Strategy<Value = RequestPlan> {
    (1u32..90, 1u32..30, 0u32..100, 0u32..100, 0u32..4).prop_map(
        move |(prompt, chunk, sp, rp, late)| RequestPlan {
            sender_prefix: sp % (prompt + 1),
            receiver_prefix: rp % (prompt + 1),
            register_after_chunks: late,
            ..RequestPlan::new(id, prompt, chunk)
        },
    )
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::sample::select(vec![1u32, 2, 4, 8, 16]),
        prop::collection::vec(group(), 1..4),
        prop::collection::vec(request(0), 1..4),
        any::<bool>(),
        prop::option::of(any::<u64>()),
    )
        .prop_map(|(tpb, groups, requests, incremental, seed)| {
            let mut w = Workload::small(
                requests
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| RequestPlan {
                        id: kvpipe_core::RequestId(i as u64 + 1),
                        ..r
                    })
                    .collect(),
            );
            w.tokens_per_block = tpb;
            w.receiver_pool_split = Some(groups.iter().map(|(_, r)| r.clone()).collect());
            w.groups = groups.into_iter().map(|(g, _)| g).collect();
            w.allocation = if incremental {
                AllocationStyle::Incremental
            } else {
                AllocationStyle::FullPrompt
            };
            w.slot_order_seed = seed;
            w.spare_slots = 4;
            w
        })
}

fn fast(w: &mut Workload) {
    w.deadlines = Deadlines {
        handshake: Duration::from_millis(1_000),
        registration: Duration::from_millis(300),
        write_completion: Duration::from_secs(5),
        result_wait: Duration::from_millis(600),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_millis(600),
        aux_wait: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(100),
        liveness_timeout: Duration::from_secs(10),
        quiesce: Duration::from_millis(300),
    };
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_workloads_transfer_every_byte(w in workload()) {
        let report = run_workload(&MemHarness::default(), &w).unwrap();
        if let Err(e) = check_clean(&report) {
            return Err(TestCaseError::fail(format!("{e}; {:?}", report.requests)));
        }
        prop_assert!(report.verified(), "{:?}", report.requests);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn random_faults_end_cleanly(w in workload(), seed in any::<u64>(), drop in 0.0f64..0.1,
                                 dup in 0.0f64..0.2, reorder in 0.0f64..0.2,
                                 fail in 0.0f64..0.1) {
        let mut w = w;
        w.faults = FaultPlan {
            seed,
            drop,
            duplicate: dup,
            reorder,
            delay: 0.2,
            max_delay_ms: 3,
            fail_writes: fail,
            ..FaultPlan::default()
        };
        fast(&mut w);
        let report = run_workload(&MemHarness::default(), &w).unwrap();
        if let Err(e) = check_clean(&report) {
            return Err(TestCaseError::fail(format!("{e}; {:?}", report.requests)));
        }
        for q in &report.requests {
            prop_assert!(q.sender.is_end() && q.receiver.is_end(), "{:?}", q);
            // A writer completes only on its receiver's word: never alone. (The other way
            // round is the last frame's inherent race: a receiver that completed while its
            // `RecvComplete` was lost leaves the writer failed.)
            if q.sender.is_completed() {
                prop_assert!(q.receiver.is_completed(), "{:?}", q);
            }
        }
    }
}

fn interrupt() -> impl Strategy<Value = Option<(u32, Interrupt)>> {
    prop::option::of((
        0u32..6,
        prop::sample::select(vec![
            Interrupt::Cancel(Role::Sender),
            Interrupt::Cancel(Role::Receiver),
            Interrupt::Kill(Role::Sender),
            Interrupt::Kill(Role::Receiver),
        ]),
    ))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_cancels_and_deaths_end_cleanly(
        w in workload(),
        interrupts in prop::collection::vec(interrupt(), 3),
    ) {
        let mut w = w;
        // A death ends the connection for every request: allow one, on the first request.
        for (i, (r, it)) in w.requests.iter_mut().zip(interrupts).enumerate() {
            r.interrupt = it.filter(|(_, what)| i == 0 || matches!(what, Interrupt::Cancel(_)));
        }
        fast(&mut w);
        let report = run_workload(&MemHarness::default(), &w).unwrap();
        if let Err(e) = check_clean(&report) {
            return Err(TestCaseError::fail(format!("{e}; {:?}", report.requests)));
        }
        for (q, plan) in report.requests.iter().zip(&w.requests) {
            if plan.interrupt.is_none()
                && !w.requests.iter().any(|r| matches!(r.interrupt, Some((_, Interrupt::Kill(_)))))
            {
                prop_assert!(q.sender.is_completed() && q.receiver.is_completed(), "{:?}", q);
            }
        }
    }
}
