//! Randomised sweeps of the deterministic simulator: hundreds of requests per seed, under no
//! fault, each fault kind alone, and all faults together. Hung, corrupted, leaked and one-sided
//! requests, stray writes and engine anomalies must all be zero.

use kvpipe_core::RequestId;
use kvpipe_sim::{FaultKind, FaultSet, Outcome, PlantedBug, SimConfig, SimReport, Simulation};

fn sweep(seed: u64, faults: FaultSet, requests: usize) -> SimReport {
    sweep_with(SimConfig::new(seed, faults), requests)
}

fn sweep_with(cfg: SimConfig, requests: usize) -> SimReport {
    let (seed, faults) = (cfg.seed, cfg.faults);
    let report = Simulation::random(cfg, requests).run();
    let json = serde_json::to_string(&report).unwrap();
    assert_eq!(report.requests, requests as u64);
    assert_eq!(report.hung, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.corrupted, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.leaked, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.one_sided, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.undetected, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(
        report.timed_out_progressing, 0,
        "seed {seed} faults {faults}: {json}"
    );
    assert_eq!(
        report.stray_writes, 0,
        "seed {seed} faults {faults}: {json}"
    );
    assert_eq!(report.anomalies, 0, "seed {seed} faults {faults}: {json}");
    assert!(report.leak_details.is_empty(), "{json}");
    assert_eq!(
        report.completed + report.failed + report.cancelled,
        report.requests,
        "{json}"
    );
    // Every request hit by a fatal fault ended without completing on the writer and receiver.
    for o in report.outcomes.iter().filter(|o| o.fatal) {
        assert_ne!(o.outcome, Outcome::Completed, "{o:?}");
    }
    report
}

#[test]
fn sim_sweep_without_faults_completes_every_uncancelled_request() {
    for seed in 1..=3 {
        let r = sweep(seed, FaultSet::NONE, 300);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(r.failed, 0, "{json}");
        assert_eq!(r.fatal, 0, "{json}");
        assert!(r.completed >= 250, "{json}");
        // Only an engine cancel racing with the last frames leaves one side completed.
        for o in &r.outcomes {
            assert!(
                o.outcome == Outcome::Completed || o.outcome == Outcome::Cancelled,
                "{o:?}"
            );
        }
    }
}

#[test]
fn sim_sweep_each_fault_kind_alone() {
    for (k, kind) in FaultKind::ALL.into_iter().enumerate() {
        let r = sweep(10 + k as u64, FaultSet::NONE.with(kind), 250);
        let json = serde_json::to_string(&r).unwrap();
        assert!(r.completed > 100, "{kind}: {json}");
        match kind {
            // Faults the transport contract hides from the protocol: nothing fails.
            FaultKind::Latency | FaultKind::Duplication | FaultKind::Reordering => {
                assert_eq!(r.failed, 0, "{kind}: {json}");
                assert_eq!(r.fatal, 0, "{kind}: {json}");
            }
            FaultKind::WriteFailure => {
                assert!(r.fatal > 0 && r.failed > 0, "{kind}: {json}");
                assert!(r.write_failures > 0, "{kind}: {json}");
            }
            FaultKind::PeerDeath => assert!(r.link_deaths > 0, "{kind}: {json}"),
            // Every mistaken chunk fails its request (undetected is zero in `sweep`).
            FaultKind::Engine => {
                assert!(r.engine_faults > 0 && r.fatal > 0, "{kind}: {json}");
                assert!(r.receiver_failed > 0, "{kind}: {json}");
            }
            // Every mistaken registration is refused or fails its request (at the default rate
            // a short sweep may draw none: `sim_decode_engine_mistakes_never_complete_anywhere`
            // draws many).
            FaultKind::Decode => assert!(r.fatal >= r.decode_faults.min(1), "{kind}: {json}"),
            // Hashed ids in any order: nothing fails for it.
            FaultKind::RandomIds => {
                assert_eq!(r.failed, 0, "{kind}: {json}");
                assert_eq!(r.fatal, 0, "{kind}: {json}");
            }
            FaultKind::Loss | FaultKind::Delay => {}
        }
    }
}

#[test]
fn sim_sweep_all_faults() {
    for seed in 1..=4 {
        let r = sweep(seed, FaultSet::all(), 400);
        let json = serde_json::to_string(&r).unwrap();
        assert!(r.completed > 100, "{json}");
        assert!(r.failed > 0, "{json}");
        assert!(r.fatal > 0, "{json}");
        assert!(r.engine_faults > 0, "{json}");
    }
}

#[test]
fn sim_engine_mistakes_never_complete_on_the_decode_side() {
    // Many mistakes, nothing else: each request a mistake hit ends failed on the receiver.
    for seed in 31..=33 {
        let mut cfg = SimConfig::new(seed, FaultSet::NONE.with(FaultKind::Engine));
        cfg.rates.engine = 0.1;
        let r = sweep_with(cfg, 300);
        let json = serde_json::to_string(&r).unwrap();
        assert!(r.engine_faults >= 20, "{json}");
        assert!(r.receiver_failed > 0, "{json}");
    }
}

#[test]
fn sim_decode_engine_mistakes_never_complete_anywhere() {
    // Many mistaken registrations (a writer left out, a writer of the same part listed, too
    // few blocks) over several sender ranks, on every split: none completes on the decode side
    // (`undetected` is zero in `sweep_with`), and no writer completes a request the decode
    // side then fails (`one_sided`).
    for seed in 51..=54 {
        let mut cfg = SimConfig::new(seed, FaultSet::NONE.with(FaultKind::Decode));
        cfg.rates.decode = 0.2;
        let r = sweep_with(cfg, 300);
        let json = serde_json::to_string(&r).unwrap();
        assert!(r.decode_faults >= 30, "{json}");
        assert_eq!(r.one_sided, 0, "{json}");
    }
}

#[test]
fn sim_slow_prefill_completes_because_deadlines_follow_progress() {
    // Prefill outlasts `result_wait` up to ~5x; chunks keep coming, so nothing times out.
    for seed in 41..=43 {
        let cfg = SimConfig::new(seed, FaultSet::NONE).slow_prefill();
        let base = cfg.deadlines.result_wait;
        let r = sweep_with(cfg, 200);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(r.receiver_timed_out, 0, "{json}");
        assert_eq!(r.failed, 0, "{json}");
        assert!(r.completed >= 180, "{json}");
        assert!(r.virtual_ms > 10 * base.as_millis(), "{json}");
    }
    // Under every fault, requests whose connections die or whose frames are held back past
    // the idle deadline time out; none does while its writes keep landing.
    for seed in 44..=45 {
        let r = sweep_with(SimConfig::new(seed, FaultSet::all()).slow_prefill(), 300);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(r.timed_out_progressing, 0, "{json}");
        assert!(r.receiver_timed_out > 0 && r.completed > 0, "{json}");
    }
    // The same workload under a total deadline that ignores progress times requests out.
    let mut cfg = SimConfig::new(41, FaultSet::NONE).slow_prefill();
    cfg.deadlines.result_per_token = kvpipe_core::Duration::ZERO;
    let r = Simulation::random(cfg, 200).run();
    assert!(
        r.receiver_timed_out > 50,
        "{}",
        serde_json::to_string(&r).unwrap()
    );
}

#[test]
fn sim_is_deterministic_per_seed() {
    let a = Simulation::random(SimConfig::new(99, FaultSet::all()), 200).run();
    let b = Simulation::random(SimConfig::new(99, FaultSet::all()), 200).run();
    assert_eq!(a, b);
    let c = Simulation::random(SimConfig::new(100, FaultSet::all()), 200).run();
    assert_ne!(a.outcomes, c.outcomes);
}

#[test]
fn sim_step_cap_reports_unfinished_requests_as_hung() {
    let mut cfg = SimConfig::new(5, FaultSet::NONE);
    cfg.max_steps = 50;
    let r = Simulation::random(cfg, 40).run();
    assert!(r.hung > 0, "{}", serde_json::to_string(&r).unwrap());
    assert_eq!(r.hung + r.completed + r.failed + r.cancelled, 40);
}

#[test]
fn sim_sweep_faults_end_exactly_the_requests_they_touch() {
    // Connection deaths and write failures, no engine cancel and no timing fault: a request
    // that did not complete everywhere was touched by a fault (its connection died or one of
    // its writes failed); requests on healthy connections carry on.
    let faults = FaultSet::NONE
        .with(FaultKind::PeerDeath)
        .with(FaultKind::WriteFailure);
    for seed in 21..=23 {
        let mut cfg = SimConfig::new(seed, faults);
        cfg.cancel_percent = 0;
        cfg.rates.peer_death = 0.03;
        let r = Simulation::random(cfg, 300).run();
        let json = serde_json::to_string(&r).unwrap();
        assert!(!r.has_bugs(), "{json}");
        assert!(r.link_deaths > 0 && r.write_failures > 0, "{json}");
        let untouched = r.outcomes.iter().filter(|o| !o.exposed).count();
        assert!(untouched > 100, "{json}");
        for o in &r.outcomes {
            assert!(o.outcome == Outcome::Completed || o.exposed, "{o:?}");
        }
    }
}

#[test]
fn sim_checks_catch_planted_leaks_and_corruption() {
    // The checks can fail: a request whose blocks are never freed is leaked, one whose writes
    // land a wrong byte is corrupted, and nothing else is.
    let mut cfg = SimConfig::new(3, FaultSet::NONE);
    cfg.cancel_percent = 0;
    cfg.planted_bug = Some(PlantedBug::KeepBlocks(RequestId(5)));
    let r = Simulation::random(cfg.clone(), 30).run();
    assert_eq!((r.leaked, r.corrupted), (1, 0), "{:?}", r.leak_details);
    assert!(r.has_bugs());
    let o = r
        .outcomes
        .iter()
        .find(|o| o.request == RequestId(5))
        .unwrap();
    assert_eq!(o.outcome, Outcome::Leaked);
    assert!(o.leaks.iter().any(|l| l.contains("sender blocks")), "{o:?}");

    cfg.planted_bug = Some(PlantedBug::FlipByte(RequestId(7)));
    let r = Simulation::random(cfg, 30).run();
    assert_eq!((r.leaked, r.corrupted), (0, 1));
    let o = r
        .outcomes
        .iter()
        .find(|o| o.request == RequestId(7))
        .unwrap();
    assert_eq!(o.outcome, Outcome::Corrupted);
}

#[test]
fn sim_sweep_summary_table() {
    // The outcome counts of fixed sweeps, as a snapshot: a change in how the endpoints end
    // requests under faults shows up as a reviewed diff.
    let mut table = String::from(
        "faults          requests completed failed cancelled split fatal hung corrupted leaked\n",
    );
    let mut sets: Vec<(String, FaultSet)> = vec![("none".into(), FaultSet::NONE)];
    sets.extend(
        FaultKind::ALL
            .into_iter()
            .map(|k| (k.to_string(), FaultSet::NONE.with(k))),
    );
    sets.push(("all".into(), FaultSet::all()));
    for (name, faults) in sets {
        let r = sweep(42, faults, 200);
        table.push_str(&format!(
            "{name:<15} {:>8} {:>9} {:>6} {:>9} {:>5} {:>5} {:>4} {:>9} {:>6}\n",
            r.requests,
            r.completed,
            r.failed,
            r.cancelled,
            r.split,
            r.fatal,
            r.hung,
            r.corrupted,
            r.leaked
        ));
    }
    insta::assert_snapshot!(table);
}

#[test]
fn sim_sweep_damaged_frames_close_connections_cleanly() {
    // Frame headers damaged on the wire (alone, and with every other fault): decoding catches
    // each, the receiving endpoint closes the connection, the requests on it fail on both
    // sides, and nothing hangs, leaks, lands outside its blocks or completes on one side only.
    for (seed, faults) in [(31, FaultSet::NONE), (32, FaultSet::all())] {
        let mut cfg = SimConfig::new(seed, faults);
        cfg.rates.corruption = 0.01;
        let mut sim = Simulation::random(cfg, 300);
        let r = sim.run();
        let json = serde_json::to_string(&r).unwrap();
        assert!(!r.has_bugs(), "{json}");
        assert_eq!((r.hung, r.corrupted, r.leaked), (0, 0, 0), "{json}");
        assert!(r.leak_details.is_empty(), "{json}");
        let net = sim.net_counters();
        assert!(net.corrupted > 0 && net.closes > 0, "{net:?}");
        assert!(r.receiver_failed > 0 && r.completed > 50, "{json}");
        let violations = sim.sender(0).counters().decode_errors
            + sim.sender(1).counters().decode_errors
            + sim.receiver().counters().decode_errors;
        assert!(violations > 0, "{net:?}");
    }
}

#[test]
fn sim_layer_slices_keep_every_rule() {
    // Every chunk submitted in layer ranges (one layer, then two, at a time) as its layers are
    // computed: without faults every uncancelled request completes with its bytes verified;
    // under every fault nothing hangs, leaks, corrupts or completes on one side only, and no
    // mistaken chunk goes undetected (all checked in `sweep_with`).
    for (seed, layers) in [(61, 1), (62, 2)] {
        let mut cfg = SimConfig::new(seed, FaultSet::NONE);
        cfg.layers_per_slice = layers;
        let r = sweep_with(cfg, 250);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(r.failed, 0, "{json}");
        assert!(r.completed >= 200, "{json}");
        // More write batches than whole chunks would issue: each range is its own slice.
        let mut whole = SimConfig::new(seed, FaultSet::NONE);
        whole.layers_per_slice = 0;
        let w = sweep_with(whole, 250);
        assert!(r.write_batches > w.write_batches, "{json}");
    }
    for seed in 63..=66 {
        let mut cfg = SimConfig::new(seed, FaultSet::all());
        cfg.layers_per_slice = 1;
        let r = sweep_with(cfg, 400);
        let json = serde_json::to_string(&r).unwrap();
        assert!(r.completed > 100, "{json}");
        assert!(r.fatal > 0 && r.engine_faults > 0, "{json}");
    }
}
