//! The in-process transport's observers: what a transfer over `kvpipe-mem` records in the
//! installed metrics recorder (the network drives its endpoints on the calling thread, so a
//! thread-local recorder sees everything).

use kvpipe_conformance::suite::{run_workload, Interrupt, MemHarness, RequestPlan, Workload};
use kvpipe_core::wire::Role;
use metrics_exporter_prometheus::PrometheusBuilder;

/// Runs `w` over the mem transport with a Prometheus recorder installed; the rendered text.
fn metrics_of(w: &Workload) -> (kvpipe_conformance::suite::RunReport, String) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let report = metrics::with_local_recorder(&recorder, || {
        run_workload(&MemHarness::default(), w).unwrap()
    });
    (report, handle.render())
}

fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn a_transfer_records_bytes_batches_outcomes_and_both_sides_timings() {
    let w = Workload::small(vec![
        RequestPlan::new(1, 40, 16),
        RequestPlan::new(2, 24, 8),
    ]);
    let (report, text) = metrics_of(&w);
    assert!(report.verified());
    let sender = ["role=\"sender\"", "transport=\"mem\""];
    let receiver = ["role=\"receiver\"", "transport=\"mem\""];
    let bytes = report.bytes as f64;
    assert!(bytes > 0.0);
    assert_eq!(
        sample(&text, "kvpipe_bytes_sent_total", &sender),
        Some(bytes),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvpipe_bytes_received_total", &receiver),
        Some(bytes),
        "{text}"
    );
    let batches = report.batch_timings.len() as f64;
    assert_eq!(
        sample(&text, "kvpipe_write_batches_total", &sender),
        Some(batches),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvpipe_write_batch_seconds_count",
            &["transport=\"mem\""]
        ),
        Some(batches),
        "{text}"
    );
    for side in [sender, receiver] {
        let completed = [side[0], side[1], "outcome=\"completed\""];
        assert_eq!(
            sample(&text, "kvpipe_requests_total", &completed),
            Some(2.0),
            "{text}"
        );
    }
    for view in ["view=\"sender\"", "view=\"receiver\""] {
        assert_eq!(
            sample(&text, "kvpipe_exposed_tail_seconds_count", &[view]),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "kvpipe_transfer_seconds_count", &[view]),
            Some(2.0),
            "{text}"
        );
    }
    // Everything retired and the network dropped: no session or pinned block is left counted.
    for side in [sender, receiver] {
        assert_eq!(
            sample(&text, "kvpipe_open_sessions", &side),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "kvpipe_pinned_blocks", &side),
            Some(0.0),
            "{text}"
        );
    }
    // Both sides' timings on one clock.
    for r in &report.requests {
        let t = r.transfer_timings().expect("completed on both sides");
        assert!(
            t.exposed_tail().is_some() && t.transfer_time().is_some(),
            "{t:?}"
        );
        assert!(t.last_chunk_computed() <= Some(t.receiver_complete()));
    }
}

#[test]
fn a_lost_peer_is_counted_as_a_failure_with_its_cause() {
    let mut plan = RequestPlan::new(1, 40, 8);
    plan.interrupt = Some((1, Interrupt::Kill(Role::Receiver)));
    let (report, text) = metrics_of(&Workload::small(vec![plan]));
    assert!(!report.requests[0].sender.is_completed());
    let failed = [
        "role=\"sender\"",
        "outcome=\"failed\"",
        "cause=\"peer_lost\"",
    ];
    assert_eq!(
        sample(&text, "kvpipe_requests_total", &failed),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvpipe_requests_total",
            &["role=\"sender\"", "outcome=\"completed\""]
        ),
        None,
        "{text}"
    );
}
