//! The suite itself can fail: a transport that writes outside the granted blocks, or lands a
//! wrong byte, is caught; a transport that cannot inject faults skips the scenarios that need
//! them.

use kvpipe_conformance::cache::ReferenceCache;
use kvpipe_conformance::suite::{
    scenario, BatchTiming, FaultKind, FaultPlan, Harness, Link, LinkError, MemHarness, SuiteError,
};
use kvpipe_core::session::{ReceiverConfig, SenderConfig};
use kvpipe_core::wire::Role;
use kvpipe_core::{Event, Instant, PeerId, Receiver, Sender};
use kvpipe_mem::MemPair;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sabotage {
    /// Flip the last byte of the receiver's first pool (a spare slot nobody granted).
    StrayWrite,
    /// Flip the first byte of the receiver's first pool once a request completed.
    CorruptGranted,
    /// Claim no fault injection.
    NoFaults,
}

struct SabotagedHarness(Sabotage);

struct SabotagedLink {
    pair: MemPair,
    kind: Sabotage,
    region: (*mut u8, usize),
    done: bool,
}

impl SabotagedLink {
    fn flip(&mut self, at: usize) {
        if self.done || self.region.1 == 0 {
            return;
        }
        self.done = true;
        // SAFETY: `region` is the receiver cache's first pool, which outlives the link (the
        // suite's contract for `Harness::connect`); no write batch is in flight when this runs
        // (after a completion, or before any request was registered).
        unsafe {
            *self.region.0.add(at) ^= 0xff;
        }
    }
}

impl Harness for SabotagedHarness {
    type Link = SabotagedLink;

    fn name(&self) -> &'static str {
        "sabotaged mem"
    }

    fn supports(&self, kind: FaultKind) -> bool {
        self.0 != Sabotage::NoFaults && MemHarness::default().supports(kind)
    }

    unsafe fn connect(
        &self,
        sender: SenderConfig,
        receiver: ReceiverConfig,
        sender_cache: &mut ReferenceCache,
        receiver_cache: &mut ReferenceCache,
        faults: &FaultPlan,
    ) -> Result<SabotagedLink, LinkError> {
        let first = receiver_cache.region_ids().next();
        let region = first
            .and_then(|id| receiver_cache.region_mut(id))
            .map_or((std::ptr::null_mut(), 0), |r| (r.as_mut_ptr(), r.len()));
        // SAFETY: forwarded; the caller upholds the contract.
        let pair = unsafe {
            MemHarness::default().connect(sender, receiver, sender_cache, receiver_cache, faults)?
        };
        Ok(SabotagedLink {
            pair,
            kind: self.0,
            region,
            done: false,
        })
    }
}

impl Link for SabotagedLink {
    fn now(&self) -> Instant {
        Link::now(&self.pair)
    }
    fn sender(&mut self) -> &mut Sender {
        Link::sender(&mut self.pair)
    }
    fn receiver(&mut self) -> &mut Receiver {
        Link::receiver(&mut self.pair)
    }
    fn sender_peer(&self) -> PeerId {
        Link::sender_peer(&self.pair)
    }
    fn receiver_peer(&self) -> PeerId {
        Link::receiver_peer(&self.pair)
    }
    fn pump(&mut self) -> Result<(), LinkError> {
        if self.kind == Sabotage::StrayWrite {
            let last = self.region.1.saturating_sub(1);
            self.flip(last);
        }
        Link::pump(&mut self.pair)
    }
    fn wait(&mut self, max: std::time::Duration) {
        Link::wait(&mut self.pair, max);
    }
    fn take_events(&mut self) -> Vec<(Role, Instant, Event)> {
        let events = Link::take_events(&mut self.pair);
        let completed = events
            .iter()
            .any(|(s, _, e)| *s == Role::Receiver && matches!(e, Event::Completed { .. }));
        if self.kind == Sabotage::CorruptGranted && completed {
            self.flip(0);
        }
        events
    }
    fn kill(&mut self, side: Role) -> Result<(), LinkError> {
        Link::kill(&mut self.pair, side)
    }
    fn is_alive(&self, side: Role) -> bool {
        Link::is_alive(&self.pair, side)
    }
    fn writes_in_flight(&self) -> usize {
        Link::writes_in_flight(&self.pair)
    }
    fn batch_timings(&self) -> Vec<BatchTiming> {
        Link::batch_timings(&self.pair)
    }
}

fn check_failure(kind: Sabotage, scenario_name: &str, expect: &str) {
    let s = scenario(scenario_name).unwrap();
    match s.run(&SabotagedHarness(kind)) {
        Err(SuiteError::Check(message)) => {
            assert!(message.contains(expect), "{kind:?}: {message}");
        }
        other => panic!("{kind:?} over {scenario_name} was not caught: {other:?}"),
    }
}

#[test]
fn a_write_outside_the_granted_blocks_fails_the_suite() {
    check_failure(
        Sabotage::StrayWrite,
        "geometry_single_chunk",
        "outside the granted blocks",
    );
    check_failure(
        Sabotage::StrayWrite,
        "receiver_death",
        "outside the granted blocks",
    );
}

#[test]
fn a_wrong_byte_in_a_granted_block_fails_the_suite() {
    check_failure(Sabotage::CorruptGranted, "geometry_ragged_chunks", "differ");
    check_failure(Sabotage::CorruptGranted, "concurrent_requests", "differ");
}

#[test]
fn scenarios_needing_faults_are_skipped_by_transports_without_them() {
    let harness = SabotagedHarness(Sabotage::NoFaults);
    assert!(scenario("chaos").unwrap().run(&harness).unwrap().is_none());
    assert!(scenario("write_failure")
        .unwrap()
        .run(&harness)
        .unwrap()
        .is_none());
    assert!(scenario("geometry_single_chunk")
        .unwrap()
        .run(&harness)
        .unwrap()
        .is_some());
}
