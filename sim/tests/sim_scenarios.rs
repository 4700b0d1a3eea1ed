//! Scripted simulator scenarios with exact event traces (insta snapshots): a change in what the
//! endpoints emit, or in what order, shows up as a reviewed diff. Each scenario also asserts its
//! outcome on every side.

use kvpipe_conformance::cache::RankSplit;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::Duration;
use kvpipe_sim::{
    CancelSide, FaultSet, Outcome, RequestPlan, ScriptedFault, SimConfig, SimReport, Simulation,
    Terminal,
};

/// Runs the scenario (no random fault), returns its report and trace.
fn run(plans: Vec<RequestPlan>, script: Vec<ScriptedFault>) -> (SimReport, String) {
    run_split(plans, script, RankSplit::WHOLE)
}

/// Two prefill tensor ranks, each holding half of the model's KV heads, write the decode rank
/// (which holds them all): the request's writers are both ranks.
fn run_two_tensor_ranks(
    plans: Vec<RequestPlan>,
    script: Vec<ScriptedFault>,
) -> (SimReport, String) {
    run_split(plans, script, RankSplit::tensor(2, 1, 0))
}

fn run_split(
    plans: Vec<RequestPlan>,
    script: Vec<ScriptedFault>,
    split: RankSplit,
) -> (SimReport, String) {
    let mut cfg = SimConfig::new(7, FaultSet::NONE);
    if split.sender_tp > 1 {
        cfg.senders = usize::from(split.sender_tp);
    }
    cfg.split = split;
    cfg.tokens_per_block = 4;
    cfg.window = 24;
    cfg.sink_tokens = 4;
    cfg.sender_pool_split = vec![1, 1];
    cfg.receiver_pool_split = vec![1, 1];
    cfg.receiver_slot_padding = 0;
    cfg.trace = true;
    let mut sim = Simulation::new(cfg, plans, script);
    let report = sim.run();
    assert_eq!(report.anomalies, 0, "{:?}", sim.anomalies());
    assert!(
        !report.has_bugs(),
        "{}",
        serde_json::to_string(&report).unwrap()
    );
    (report, sim.trace().join("\n"))
}

fn sides(report: &SimReport, k: usize) -> (Outcome, Option<Terminal>, Vec<Option<Terminal>>) {
    let o = &report.outcomes[k];
    (o.outcome, o.receiver, o.senders.clone())
}

const C: Option<Terminal> = Some(Terminal::Completed);

#[test]
fn sim_scenario_pipelined_transfer_completes() {
    let (report, trace) = run(vec![RequestPlan::simple(1, 22, 3)], vec![]);
    assert_eq!(sides(&report, 0), (Outcome::Completed, C, vec![C]));
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_late_registration_replays_queued_slices_in_order() {
    let mut plan = RequestPlan::simple(1, 40, 4);
    // Prefill starts at once; the receiver registers after two chunks were computed.
    plan.open_after = Duration::ZERO;
    plan.register_after = Duration::from_micros(250);
    let (report, trace) = run(vec![plan], vec![]);
    assert_eq!(sides(&report, 0), (Outcome::Completed, C, vec![C]));
    let writes: Vec<&str> = trace.lines().filter(|l| l.contains(" writes ")).collect();
    assert_eq!(writes.len(), 4, "{trace}");
    for (k, line) in writes.iter().enumerate() {
        assert!(line.contains(&format!("sslice#{k} ")), "{line}");
    }
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_two_writer_ranks_complete_one_request() {
    let plan = RequestPlan::simple(1, 30, 2);
    let (report, trace) = run_two_tensor_ranks(vec![plan], vec![]);
    assert_eq!(sides(&report, 0), (Outcome::Completed, C, vec![C, C]));
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_windowed_group_with_prefixes_on_both_sides() {
    let mut plan = RequestPlan::simple(1, 61, 1);
    plan.sender_prefix = 10;
    plan.receiver_prefix = 17;
    plan.chunk_ends = vec![20, 33, 50, 61];
    plan.allocation = kvpipe_conformance::cache::AllocationStyle::Incremental;
    let (report, trace) = run(vec![plan], vec![]);
    assert_eq!(sides(&report, 0), (Outcome::Completed, C, vec![C]));
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_failed_write_fails_both_sides_naming_both_slices() {
    let plan = RequestPlan::simple(1, 40, 4);
    let fail = ScriptedFault::FailBatch {
        sender: 0,
        nth: 1,
        status: TransferStatus::WriteFailed,
    };
    let (report, trace) = run(vec![plan], vec![fail]);
    let o = &report.outcomes[0];
    assert_eq!(o.outcome, Outcome::Failed);
    assert!(o.fatal && !o.one_sided);
    assert_eq!(o.receiver, Some(Terminal::Failed));
    assert_eq!(o.senders, vec![Some(Terminal::Failed)]);
    assert!(
        trace.contains("R event Failed req#1 WriteFailed peer=peer#0 sslice=1 rslice=0"),
        "{trace}"
    );
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_connection_death_fails_its_request_and_the_next_one_completes() {
    let first = RequestPlan::simple(1, 40, 4);
    let mut second = RequestPlan::simple(2, 16, 2);
    second.arrival = Duration::from_millis(80);
    let kill = ScriptedFault::KillLink {
        sender: 0,
        at: Duration::from_micros(250),
    };
    let (report, trace) = run(vec![first, second], vec![kill]);
    let o = &report.outcomes[0];
    assert_eq!(o.outcome, Outcome::Failed);
    assert!(o.fatal && !o.one_sided);
    assert_eq!(o.receiver, Some(Terminal::Failed));
    assert_eq!(o.senders, vec![Some(Terminal::Failed)]);
    assert_eq!(sides(&report, 1), (Outcome::Completed, C, vec![C]));
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_receiver_cancels_mid_prefill() {
    let mut plan = RequestPlan::simple(1, 40, 4);
    plan.cancel = Some((Duration::from_micros(250), CancelSide::Receiver));
    let (report, trace) = run(vec![plan], vec![]);
    let cancelled = Some(Terminal::Cancelled);
    assert_eq!(
        sides(&report, 0),
        (Outcome::Cancelled, cancelled, vec![cancelled])
    );
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_sender_cancel_before_open_is_remembered() {
    let mut plan = RequestPlan::simple(1, 40, 4);
    plan.cancel = Some((Duration::ZERO, CancelSide::Sender));
    plan.register_after = Duration::from_micros(50);
    plan.open_after = Duration::from_micros(100);
    let (report, trace) = run(vec![plan], vec![]);
    let o = &report.outcomes[0];
    assert_eq!(o.outcome, Outcome::Cancelled);
    assert_eq!(o.senders, vec![Some(Terminal::Cancelled)]);
    assert_eq!(o.receiver, Some(Terminal::Cancelled));
    assert!(!trace.contains(" writes "), "{trace}");
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_silent_death_with_writes_in_flight_is_fenced_before_memory_is_freed() {
    // The connection dies silently while the first slice's writes are in flight: the write
    // deadline passes (outcome in doubt), the blocks stay pinned, and after the quiesce deadline
    // the sender asks for the connection to be closed; only the disconnect report quiesces it.
    let plan = RequestPlan::simple(1, 40, 4);
    let cut = ScriptedFault::BreakLink {
        sender: 0,
        at: Duration::from_micros(210),
    };
    let (report, trace) = run(vec![plan], vec![cut]);
    let o = &report.outcomes[0];
    assert!(o.fatal && !o.one_sided, "{o:?}");
    assert_eq!(o.outcome, Outcome::Failed);
    assert_eq!(o.senders, vec![Some(Terminal::TimedOut)]);
    assert_ne!(o.receiver, Some(Terminal::Completed));
    let at = |needle: &str| {
        trace
            .lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` in\n{trace}"))
    };
    assert!(at("S0 event TimedOut req#1 Writes") < at("S0 close link S0: QuiesceFence"));
    assert!(at("S0 close link S0: QuiesceFence") < at("S0 event Quiesced req#1"));
    insta::assert_snapshot!(trace);
}

#[test]
fn sim_scenario_one_writer_rank_fails_and_the_other_is_stopped() {
    // Two writer ranks; rank 1's second write batch fails. The receiver fails the request at
    // once, naming rank 1's slice, and tells rank 0, which stops too; both quiesce.
    let plan = RequestPlan::simple(1, 40, 4);
    let fail = ScriptedFault::FailBatch {
        sender: 1,
        nth: 1,
        status: TransferStatus::GrantViolation,
    };
    let (report, trace) = run_two_tensor_ranks(vec![plan], vec![fail]);
    let o = &report.outcomes[0];
    assert_eq!(o.outcome, Outcome::Failed);
    assert!(o.fatal && !o.one_sided);
    assert_eq!(o.receiver, Some(Terminal::Failed));
    assert_eq!(o.senders[1], Some(Terminal::Failed));
    assert_ne!(o.senders[0], Some(Terminal::Completed));
    assert!(
        trace.contains("R event Failed req#1 GrantViolation peer=peer#1 sslice=1 rslice=0"),
        "{trace}"
    );
    insta::assert_snapshot!(trace);
}
