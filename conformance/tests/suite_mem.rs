//! The conformance suite over the in-process transport: one test per scenario.

kvpipe_conformance::conformance_tests!(kvpipe_conformance::suite::MemHarness::default());
