//! The conformance suite over the in-process transport: one test per scenario.

kvpipe_conformance::conformance_tests!(kvpipe_conformance::suite::MemHarness::default());

/// The suite's own list and the tests above stay in step.
#[test]
fn every_scenario_has_a_test() {
    let names: Vec<&str> = kvpipe_conformance::suite::scenarios()
        .iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(
        names.len(),
        24,
        "a scenario was added: list it in conformance_tests!"
    );
}
