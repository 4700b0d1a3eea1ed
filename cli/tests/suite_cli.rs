//! Keeps `kvpipe demo` and the transfer benches honest: they run end to end at small sizes,
//! verify every byte, and fail when a byte differs.

use std::process::Command;
use std::time::Duration;

use kvpipe_conformance::suite::demo::{run_demo, DemoConfig, Model};
use kvpipe_conformance::suite::{MemHarness, SimulatedCompute, TransferMode};

fn small(model: Model) -> DemoConfig {
    DemoConfig {
        model,
        prompt_tokens: 112,
        chunk_tokens: 40,
        tokens_per_block: 16,
        window: None,
        sender_prefix: 0,
        receiver_prefix: 0,
        requests: 1,
        ranks: 1,
        prefill_per_chunk: Duration::ZERO,
        mode: TransferMode::Pipelined,
        corrupt_one_byte: false,
        compute: SimulatedCompute::Sleep,
    }
}

#[test]
fn demo_logic_verifies_every_model() {
    for (name, model) in Model::ALL {
        let mut config = small(model);
        if model == Model::Gemma3Swa {
            // A window shorter than the prompt, so local layers send only their window.
            config.window = Some(50);
        }
        let (summary, report) = run_demo(&MemHarness::default(), &config, |_, _| {}).unwrap();
        assert!(summary.verified, "{name}: {summary:?}");
        assert_eq!(summary.completed, 1, "{name}");
        assert!(
            summary.bytes > 0 && summary.bytes_verified >= summary.bytes,
            "{name}"
        );
        assert_eq!(
            summary.thorough_checks,
            config.kv_bytes() <= 96 << 20,
            "{name}: small runs check content and untouched blocks too"
        );
        assert!(report.stray_writes.is_empty(), "{name}");
    }
}

#[test]
fn demo_logic_with_prefixes_and_monolithic_mode_verifies() {
    let mut config = small(Model::Llama3_70bTp8);
    config.sender_prefix = 40;
    config.receiver_prefix = 70;
    config.prompt_tokens = 300;
    config.requests = 2;
    config.mode = TransferMode::Monolithic;
    let (summary, _) = run_demo(&MemHarness::default(), &config, |_, _| {}).unwrap();
    assert!(summary.verified, "{summary:?}");
    assert_eq!(summary.chunks, 2, "one slice per request");
}

#[test]
fn demo_logic_runs_tensor_parallel_ranks_side_by_side() {
    let mut config = small(Model::Llama3_70bTp8);
    config.ranks = 3;
    config.requests = 2;
    let (summary, report) = run_demo(&MemHarness::default(), &config, |_, _| {}).unwrap();
    assert!(summary.verified, "{summary:?}");
    assert_eq!(summary.completed, 6);
    assert_eq!(report.requests.len(), 6);
    let one_rank = run_demo(
        &MemHarness::default(),
        &DemoConfig {
            ranks: 1,
            ..config.clone()
        },
        |_, _| {},
    )
    .unwrap()
    .0;
    assert_eq!(summary.bytes, 3 * one_rank.bytes);
}

#[test]
fn demo_logic_catches_one_corrupted_byte() {
    let mut config = small(Model::Llama3_8b);
    config.corrupt_one_byte = true;
    let (summary, _) = run_demo(&MemHarness::default(), &config, |_, _| {}).unwrap();
    assert!(!summary.verified);
    assert!(summary.mismatched_blocks >= 1);
}

fn kvpipe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpipe"))
        .args(args)
        .output()
        .expect("running kvpipe");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

const SMALL_DEMO: &[&str] = &[
    "demo",
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "200",
    "--chunk-tokens",
    "48",
    "--tokens-per-block",
    "16",
    "--requests",
    "2",
    "--prefill-ms-per-chunk",
    "1",
    "--json",
];

#[test]
fn demo_command_prints_verified_json_and_exits_zero() {
    let (ok, out, err) = kvpipe(SMALL_DEMO);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["requests"], 2);
    assert_eq!(v["transport"], "mem");
    assert!(v["bytes"].as_u64().unwrap() > 0);
    assert!(err.is_empty(), "nothing on stderr with --json: {err}");
}

#[test]
fn demo_command_exits_non_zero_when_a_byte_differs() {
    let mut args = SMALL_DEMO.to_vec();
    args.push("--corrupt-one-byte");
    let (ok, out, _) = kvpipe(&args);
    assert!(!ok);
    assert_eq!(json(&out)["verified"], false);
}

#[test]
fn demo_command_prints_a_table() {
    let args: Vec<&str> = SMALL_DEMO
        .iter()
        .copied()
        .filter(|a| *a != "--json")
        .collect();
    let (ok, out, _) = kvpipe(&args);
    assert!(ok);
    for row in [
        "requests",
        "bytes",
        "chunks",
        "throughput",
        "exposed tail",
        "verification",
    ] {
        assert!(out.contains(row), "missing {row}: {out}");
    }
    assert!(out.contains("OK"));
}

#[test]
fn other_transports_give_a_clear_error() {
    let (ok, _, err) = kvpipe(&["demo", "--transport", "ibverbs"]);
    assert!(!ok);
    assert!(err.contains("--transport mem"), "{err}");
    let (ok, _, err) = kvpipe(&["demo", "--model", "gpt5"]);
    assert!(!ok);
    assert!(err.contains("llama3-8b"), "{err}");
    let (ok, _, err) = kvpipe(&["demo", "--requests", "0"]);
    assert!(!ok);
    assert!(err.contains("--requests"), "{err}");
    let (ok, _, err) = kvpipe(&["demo", "--prompt-tokens", "10", "--sender-prefix", "11"]);
    assert!(!ok);
    assert!(err.contains("--sender-prefix"), "{err}");
}

#[test]
fn bench_transfer_reports_a_verified_ratio() {
    let (ok, out, err) = kvpipe(&[
        "bench",
        "transfer",
        "--transport",
        "mem",
        "--json",
        "--tokens",
        "512",
        "--chunk-tokens",
        "128",
        "--runs",
        "1",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["baseline"], "memcpy");
    assert_eq!(v["bytes"], 512 * 128 * 1024);
    for key in ["seconds", "gbps", "baseline_gbps", "ratio"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
}

#[test]
fn bench_pipeline_reports_both_tails() {
    let (ok, out, err) = kvpipe(&[
        "bench",
        "pipeline",
        "--transport",
        "mem",
        "--json",
        "--prompt-tokens",
        "256",
        "--chunk-tokens",
        "64",
        "--prefill-ms-per-chunk",
        "2",
        "--runs",
        "1",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["chunks"], 4);
    for key in [
        "chunk_transfer_ms",
        "exposed_tail_ms",
        "monolithic_tail_ms",
        "tail_ratio",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
}

/// A prompt that is not a multiple of the chunk ends in a short chunk: the tail's target ratio
/// is over that last chunk's own transfer, not over the median full chunk's, which would make a
/// short last chunk read as a pass.
#[test]
fn bench_pipeline_compares_the_tail_with_the_last_chunks_own_transfer() {
    let args = [
        "bench",
        "pipeline",
        "--transport",
        "mem",
        "--prompt-tokens",
        "250",
        "--chunk-tokens",
        "100",
        "--prefill-ms-per-chunk",
        "1",
        "--runs",
        "1",
    ];
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let ms_after = |label: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} line in {out}"));
        line[label.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let last_chunk = ms_after("last chunk alone");
    let tail = ms_after("exposed tail");
    let line = out.lines().find(|l| l.starts_with("exposed tail")).unwrap();
    let (_, rest) = line.split_once(" = ").expect(line);
    let ratio: f64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    assert!(
        rest.contains("× the last chunk's transfer (target ≤ 1.25"),
        "{line}"
    );
    // Both printed to two decimals: the ratio is theirs within the rounding.
    let expected = tail / last_chunk;
    assert!(
        (ratio - expected).abs() <= 0.01 + 0.01 * expected,
        "{ratio} printed, {tail} ms / {last_chunk} ms = {expected}: {line}"
    );

    let (ok, out, err) = kvpipe(&[&args[..], &["--json"]].concat());
    assert!(ok, "{err}");
    let v = json(&out);
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {out}"));
    assert_eq!(v["chunks"], 3);
    assert!(
        (f("tail_over_last_chunk") - f("exposed_tail_ms") / f("last_chunk_transfer_ms")).abs()
            < 1e-9
    );
    assert!((f("tail_over_chunk") - f("exposed_tail_ms") / f("chunk_transfer_ms")).abs() < 1e-9);
}
