//! The conformance suite over the RDMA verbs transport (see [`VerbsHarness`]): every scenario
//! is a test that needs an RDMA device, ignored on the host and run in the Soft-RoCE guest by
//! `scripts/test-verbs` (`--ignored`); without a device they fail, they never pass skipped.
//! (The suite's `conformance_tests!` makes plain tests, which would fail on a host without a
//! device, hence this file's own list; `every_scenario_has_a_verbs_test` keeps it complete.)

use kvpipe_conformance::suite::{scenario, scenarios, Harness, VerbsHarness};

macro_rules! verbs_scenarios {
    ($($name:ident),* $(,)?) => {
        /// Every scenario of the suite has a test here (runs on the host too).
        #[test]
        fn every_scenario_has_a_verbs_test() {
            let tested = [$(stringify!($name)),*];
            for s in scenarios() {
                assert!(tested.contains(&s.name), "scenario {} has no verbs test", s.name);
            }
            assert_eq!(tested.len(), scenarios().len());
        }
        $(
            #[test]
            #[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
            fn $name() {
                let harness = VerbsHarness::default();
                if let Err(e) = harness.open_device() {
                    panic!("this test needs an RDMA device (run it in the Soft-RoCE guest): {e}");
                }
                let s = scenario(stringify!($name)).expect("a scenario of that name exists");
                if let Err(e) = s.run(&harness) {
                    panic!("{} over {}: {e}", stringify!($name), harness.name());
                }
            }
        )*
    };
}

verbs_scenarios!(
    geometry_single_chunk,
    geometry_ragged_chunks,
    geometry_chunks_without_blocks,
    geometry_prompt_shorter_than_block,
    geometry_fragmented_slots,
    geometry_mla,
    geometry_empty_prompt,
    sender_prefix_sent_early,
    sender_prefix_reuse,
    receiver_prefix_reuse,
    both_prefixes,
    windows_with_sinks,
    several_layer_groups,
    concurrent_requests,
    incremental_allocation,
    late_registration,
    cancel_mid_prefill_sender,
    cancel_mid_prefill_receiver,
    cancel_before_registration,
    sender_death,
    receiver_death,
    registration_timeout,
    write_failure,
    write_timeout,
    duplicated_frames,
    delayed_frames,
    reordered_frames,
    chaos,
    version_mismatch,
    monolithic_transfer,
    layer_slices_full_attention,
    layer_slices_windowed,
    layer_slices_sinks_and_prefixes,
    layer_slices_late_registration,
    layer_slices_write_failure,
);
