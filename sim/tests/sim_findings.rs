//! What the simulator found in the session state machines: each test reproduces one finding
//! with a scripted scenario and asserts the behaviour the design asks for (both were fixed in
//! the sessions; the tests keep them fixed).

use kvpipe_core::Duration;
use kvpipe_sim::{CancelSide, FaultSet, RequestPlan, SimConfig, Simulation};

/// The prefill engine cancels a request before opening it (the cancel is remembered). The
/// receiver's registration arrives; the sender refuses it with a `Cancel`; the receiver stops and
/// sends its own `Cancel` back. That answer overwrites the remembered origin, so when the engine
/// opens the request the sender reports `Cancelled { origin: Peer(receiver) }` — but the engine
/// cancelled it itself, first (`Remembered::insert` replaces the value of a known id).
#[test]
fn sim_finding_a_local_cancel_keeps_its_origin_when_the_receiver_answers_it() {
    let mut plan = RequestPlan::simple(1, 40, 4);
    plan.cancel = Some((Duration::ZERO, CancelSide::Sender));
    plan.register_after = Duration::from_micros(50);
    plan.open_after = Duration::from_micros(100);
    let mut cfg = SimConfig::new(7, FaultSet::NONE);
    cfg.trace = true;
    let mut sim = Simulation::new(cfg, vec![plan], vec![]);
    let report = sim.run();
    let trace = sim.trace().join("\n");
    assert!(!report.has_bugs(), "{trace}");
    let cancelled: Vec<&str> = trace
        .lines()
        .filter(|l| l.contains("S0 event Cancelled req#1"))
        .collect();
    assert_eq!(cancelled.len(), 1, "{trace}");
    assert!(
        cancelled[0].ends_with("Cancelled req#1 Local"),
        "the engine cancelled first, the sender reports: {}\n{trace}",
        cancelled[0]
    );
}

/// The decode engine cancels a request before registering it (the cancel is remembered), then
/// registers it: the receiver cancels it at once — but tells no writer, because none was sent
/// the registration. The writer ranks keep computing and pinning the request's blocks until
/// their registration deadline (1 s here) ends it as `TimedOut(Registration)`. A cancel from the
/// decode side must reach the prefill side, as the prefill side's remembered cancel reaches the
/// receivers (the receiver knows the writers when it registers).
#[test]
fn sim_finding_a_remembered_receiver_cancel_reaches_the_writers() {
    let mut plan = RequestPlan::simple(1, 40, 4);
    plan.cancel = Some((Duration::ZERO, CancelSide::Receiver));
    plan.register_after = Duration::from_micros(50);
    plan.open_after = Duration::from_micros(100);
    let mut cfg = SimConfig::new(7, FaultSet::NONE);
    cfg.trace = true;
    let mut sim = Simulation::new(cfg, vec![plan], vec![]);
    let report = sim.run();
    let trace = sim.trace().join("\n");
    assert!(!report.has_bugs(), "{trace}");
    let o = &report.outcomes[0];
    assert_eq!(
        o.senders,
        vec![Some(kvpipe_sim::Terminal::Cancelled)],
        "the writer was not told of the cancel:\n{trace}"
    );
    assert!(
        o.duration.is_some_and(|d| d < Duration::from_millis(50)),
        "the writer held the request for {:?}:\n{trace}",
        o.duration
    );
}

/// A decode mistake drawn for a registration with no block (the decode side holds the whole
/// prompt): a truncation changes nothing, the request completes correctly with nothing sent —
/// and the oracle used to count it `undetected` (seen as `kvpipe sim --requests 3000 --seed 40
/// --faults all` failing). Only a mistake that bends the registration is expected to fail.
#[test]
fn sim_finding_a_truncation_of_a_registration_with_no_block_is_no_mistake() {
    use kvpipe_sim::FaultKind;
    let plans = (1..=10)
        .map(|i| {
            let mut plan = RequestPlan::simple(i, 64, 4);
            plan.receiver_prefix = 64;
            plan
        })
        .collect();
    let mut cfg = SimConfig::new(7, FaultSet::NONE.with(FaultKind::Decode));
    cfg.rates.decode = 1.0;
    let report = Simulation::new(cfg, plans, vec![]).run();
    let json = serde_json::to_string(&report).unwrap();
    assert!(!report.has_bugs(), "{json}");
    // Every request drew a mistake: the truncations completed and are not counted as
    // mistakes; the others (a writer listed that writes nothing of it) failed.
    assert_eq!(report.undetected, 0, "{json}");
    assert!(report.completed > 0, "{json}");
    assert_eq!(report.completed + report.decode_faults, 10, "{json}");
}
