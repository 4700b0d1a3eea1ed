//! `kvpipe bench request`: the fixed cost of a request's last layer range against the bare copy
//! of its extents. Host memory runs here; device memory says why it cannot run, or verifies.

mod support;

use std::time::Duration;
use support::{run, turn};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn field(report: &serde_json::Value, path: &[&str]) -> f64 {
    let mut v = report;
    for key in path {
        v = &v[key];
    }
    v.as_f64().unwrap_or_else(|| panic!("{path:?} in {report}"))
}

#[test]
fn host_memory_reports_the_protocol_against_its_own_copy_and_verifies() {
    let _turn = turn();
    let out = run(
        &["bench", "request", "--requests", "40", "--json"],
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["memory"], "host");
    assert_eq!(report["gpu"], "none");
    assert_eq!(report["baseline"], "memcpy");
    assert_eq!(report["requests"], 40);
    assert_eq!(report["verified"], true);
    // The last range: 16 blocks × 4 layers × K and V × 16 tokens × 8 dims × 2 bytes.
    assert_eq!(report["range_bytes"], 16 * 4 * 2 * 16 * 8 * 2);
    let total = field(&report, &["total_us", "p50"]);
    let baseline = field(&report, &["baseline_us", "p50"]);
    let protocol = field(&report, &["protocol_us", "p50"]);
    assert!(baseline > 0.0 && total > 0.0, "{report}");
    // Each request's protocol cost is its total less its own baseline.
    assert!(protocol < total, "{report}");
    assert!(
        field(&report, &["protocol_us", "p90"]) >= protocol,
        "{report}"
    );
    let ratio = field(&report, &["ratio"]);
    assert!((ratio - total / baseline).abs() < 1e-6 * ratio, "{report}");
    let parts: f64 = ["submit_us", "issue_us", "copy_us", "complete_us"]
        .iter()
        .map(|p| field(&report, &[p]))
        .sum();
    assert!(parts > 0.0, "{report}");

    let table = run(
        &["bench", "request", "--requests", "5"],
        Duration::from_secs(60),
    );
    assert!(table.status.success(), "{}", text(&table.stderr));
    let table = text(&table.stdout);
    assert!(table.contains("protocol (total − base)"), "{table}");
    assert!(table.contains("every byte verified"), "{table}");
}

#[test]
fn what_the_bench_cannot_do_is_refused() {
    let _turn = turn();
    for (args, says) in [
        (
            &["bench", "request", "--gpu", "busy"][..],
            "--gpu applies to --memory device",
        ),
        (&["bench", "request", "--requests", "0"][..], "--requests"),
        (&["bench", "request", "--memory", "disk"][..], "--memory"),
    ] {
        let out = run(args, Duration::from_secs(30));
        assert!(!out.status.success(), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}
