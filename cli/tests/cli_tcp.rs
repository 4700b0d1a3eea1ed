//! `kvpipe serve` and `kvpipe demo --transport tcp --connect` as two processes on loopback:
//! every request completes and the decode side verifies every byte.

mod support;

use std::process::Command;
use std::time::Duration;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");
const WORKLOAD: [&str; 6] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "300",
    "--requests",
    "2",
];

#[test]
fn serve_and_demo_connect_transfer_and_verify_across_processes() {
    let serve_args = [&["--json", "--accept-timeout-s", "60"], &WORKLOAD[..]].concat();
    let demo_args = [
        &[
            "--json",
            "--chunk-tokens",
            "64",
            "--prefill-ms-per-chunk",
            "1",
        ],
        &WORKLOAD[..],
    ]
    .concat();
    let (status, out, _, demo) = pair(&serve_args, &demo_args);
    assert!(
        demo.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&demo.stderr)
    );
    let prefill: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(prefill["completed"], 2, "{prefill}");
    assert_eq!(prefill["chunks"], 10, "{prefill}");
    assert!(status.success(), "serve: {out}");
    let decode: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(decode["verified"], true, "{decode}");
    assert_eq!(decode["completed"], 2, "{decode}");
    assert_eq!(decode["mismatched_blocks"], 0, "{decode}");
    assert_eq!(decode["writes_refused"], 0, "{decode}");
    assert_eq!(decode["bytes"], prefill["bytes"], "{decode} {prefill}");
    // 300 tokens of 80 layers × 1 head × 128 dims × K,V × bf16 = 40 KiB per token, in whole
    // blocks of 32 tokens (10 blocks), per request.
    assert_eq!(decode["bytes"], 2 * 10 * 32 * 40 * 1024, "{decode}");
}

#[test]
fn serve_refuses_a_prefill_node_with_another_block_size() {
    let (mut serve, addr, _err) = support::spawn_serve(
        KVPIPE,
        &[&["--accept-timeout-s", "3"], &WORKLOAD[..]].concat(),
    );
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &addr])
        .args(["--tokens-per-block", "16"])
        .args(WORKLOAD)
        .output()
        .unwrap();
    assert!(!demo.status.success());
    let msg = String::from_utf8_lossy(&demo.stderr);
    assert!(msg.contains("handshake failed"), "{msg}");
    let _ = serve.kill();
    let _ = serve.wait();
}

/// Runs `serve` with `serve_args` and `demo --connect` with `demo_args` against it; returns
/// serve's exit status, stdout and stderr (after the listening line), and demo's output.
fn pair(
    serve_args: &[&str],
    demo_args: &[&str],
) -> (
    std::process::ExitStatus,
    String,
    String,
    std::process::Output,
) {
    let (mut serve, addr, mut err) = support::spawn_serve(KVPIPE, serve_args);
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &addr])
        .args(demo_args)
        .output()
        .unwrap();
    let status = support::wait_exit(&mut serve, Duration::from_secs(120));
    let (mut out, mut rest) = (String::new(), String::new());
    std::io::Read::read_to_string(&mut serve.stdout.take().unwrap(), &mut out).unwrap();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    (status, out, rest, demo)
}

#[test]
fn serve_checks_only_the_blocks_a_prefill_side_with_a_smaller_window_sends() {
    // The handshake lets the decode side keep a larger window (here full attention against a
    // 256-token window): the blocks before the prefill side's stale boundary never come.
    let workload = ["--prompt-tokens", "1000", "--requests", "1", "--json"];
    let (status, out, err, demo) = pair(
        &workload,
        &[&workload[..], &["--window", "256", "--chunk-tokens", "250"]].concat(),
    );
    assert!(
        demo.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&demo.stderr)
    );
    assert!(status.success(), "serve: {out} {err}");
    let decode: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(decode["verified"], true, "{decode}");
    assert_eq!(decode["mismatched_blocks"], 0, "{decode}");
    assert!(
        err.contains(
            "the prefill side keeps a 256-token window against this side's full attention"
        ),
        "{err}"
    );
    // Only the window's blocks were sent: fewer bytes than the whole prompt's 32 blocks.
    let sent = decode["bytes"].as_u64().unwrap();
    assert!(sent > 0 && sent < 32 * 32 * 128 * 1024, "{decode}");
}

#[test]
fn serve_names_the_refusal_when_no_prefill_node_completes_the_handshake() {
    let (status, _, err, demo) = pair(
        &["--accept-timeout-s", "3", "--prompt-tokens", "300"],
        &["--tokens-per-block", "16", "--prompt-tokens", "300"],
    );
    assert!(!demo.status.success());
    assert!(!status.success());
    assert!(
        err.contains("no prefill node completed the handshake in time; the last one was refused: model layouts are incompatible"),
        "{err}"
    );
}
