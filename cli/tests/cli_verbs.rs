//! `kvpipe demo --transport verbs` (both nodes in one process) and `kvpipe serve --transport
//! verbs` with `kvpipe demo --transport verbs --connect` (two processes), end to end on an RDMA
//! device: every request completes and every byte is verified. Ignored on the host; run in the
//! Soft-RoCE guest by `scripts/test-verbs`.

mod support;

use std::process::Command;
use std::time::Duration;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");
/// Small enough for a debug build under emulation: 2 requests × 4 blocks of 32 tokens × 40 KiB.
const WORKLOAD: [&str; 6] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "128",
    "--requests",
    "2",
];

fn device_args() -> Vec<String> {
    std::env::var("KVPIPE_VERBS_DEVICE")
        .map(|d| vec!["--device".to_string(), d])
        .unwrap_or_default()
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn demo_over_verbs_completes_and_verifies_every_byte() {
    let out = Command::new(KVPIPE)
        .args(["demo", "--transport", "verbs", "--json"])
        .args(["--chunk-tokens", "32", "--prefill-ms-per-chunk", "1"])
        .args(WORKLOAD)
        .args(device_args())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["transport"], "verbs", "{summary}");
    assert_eq!(summary["verified"], true, "{summary}");
    assert_eq!(summary["completed"], 2, "{summary}");
    assert_eq!(summary["bytes"], 2 * 4 * 32 * 40 * 1024, "{summary}");
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn serve_and_demo_over_verbs_transfer_and_verify_across_processes() {
    let device = device_args();
    let device: Vec<&str> = device.iter().map(String::as_str).collect();
    let serve_args = [
        &["--transport", "verbs", "--json", "--accept-timeout-s", "60"],
        &WORKLOAD[..],
        &device[..],
    ]
    .concat();
    let (mut serve, addr, _err) = support::spawn_serve(KVPIPE, &serve_args);
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "verbs", "--connect", &addr, "--json"])
        .args(["--chunk-tokens", "32", "--prefill-ms-per-chunk", "1"])
        .args(WORKLOAD)
        .args(device_args())
        .output()
        .unwrap();
    assert!(
        demo.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&demo.stderr)
    );
    let prefill: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(prefill["transport"], "verbs", "{prefill}");
    assert_eq!(prefill["completed"], 2, "{prefill}");
    assert_eq!(prefill["chunks"], 8, "{prefill}");
    let status = support::wait_exit(&mut serve, Duration::from_secs(120));
    let mut out = String::new();
    std::io::Read::read_to_string(&mut serve.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success(), "serve: {out}");
    let decode: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(decode["transport"], "verbs", "{decode}");
    assert_eq!(decode["verified"], true, "{decode}");
    assert_eq!(decode["completed"], 2, "{decode}");
    assert_eq!(decode["mismatched_blocks"], 0, "{decode}");
    assert_eq!(decode["bytes"], prefill["bytes"], "{decode} {prefill}");
    assert_eq!(decode["bytes"], 2 * 4 * 32 * 40 * 1024, "{decode}");
}

#[test]
#[ignore = "needs an RDMA device and perftest: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn bench_transfer_over_verbs_reports_against_ib_write_bw() {
    // One small run: the figures themselves are the bench's business, not a test's.
    let out = Command::new(KVPIPE)
        .args(["bench", "transfer", "--transport", "verbs", "--json"])
        .args(["--tokens", "256", "--chunk-tokens", "128", "--runs", "1"])
        .args(device_args())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(r["transport"], "verbs", "{r}");
    assert_eq!(r["baseline"], "ib_write_bw", "{r}");
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["bytes"], 256 * 128 * 1024, "{r}");
    assert_eq!(r["qps"], 1, "{r}");
    assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    assert!(r["baseline_gbps"].as_f64().is_some_and(|x| x > 0.0), "{r}");
}
