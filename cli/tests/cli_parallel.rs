//! The `kvpipe` commands of heterogeneous parallelism and sliding windows, end to end at small
//! sizes: the demo between sides split differently (every destination byte checked against the
//! whole model), `bench fragments`, and `bench pipeline` with another model and over TCP.

use std::process::Command;
use std::sync::Mutex;

/// One `kvpipe` at a time: the runs keep deadlines of seconds, and several at once on a small,
/// shared machine can starve each other past them.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn kvpipe(args: &[&str]) -> (bool, String, String) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_kvpipe"))
        .args(args)
        .output()
        .expect("kvpipe runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

const SMALL: [&str; 8] = [
    "--prompt-tokens",
    "200",
    "--chunk-tokens",
    "64",
    "--tokens-per-block",
    "16",
    "--prefill-ms-per-chunk",
    "1",
];

#[test]
fn demo_between_different_splits_verifies_the_whole_model() {
    for (model, split, writers) in [
        (
            "llama3-70b-tp8",
            [
                "--sender-tp",
                "8",
                "--receiver-tp",
                "2",
                "--receiver-pp",
                "2",
            ],
            // Decode rank (tp, pp) takes heads 4·tp.. from prefill ranks 4·tp..4·tp+4.
            vec![
                vec![0, 1, 2, 3],
                vec![0, 1, 2, 3],
                vec![4, 5, 6, 7],
                vec![4, 5, 6, 7],
            ],
        ),
        (
            "llama3-70b-tp8",
            [
                "--sender-tp",
                "2",
                "--receiver-tp",
                "8",
                "--receiver-pp",
                "1",
            ],
            (0..8).map(|j| vec![j / 4]).collect(),
        ),
        (
            // 8 KV heads over 16 prefill ranks: each head twice; the decode rank takes replica 0.
            "llama3-8b",
            [
                "--sender-tp",
                "16",
                "--receiver-tp",
                "1",
                "--receiver-pp",
                "1",
            ],
            vec![(0..8).map(|h| 2 * h).collect()],
        ),
    ] {
        let mut args = vec!["demo", "--json", "--model", model];
        args.extend(SMALL);
        args.extend(split);
        let (ok, out, err) = kvpipe(&args);
        assert!(ok, "{model} {split:?}: {err}{out}");
        let v = json(&out);
        assert_eq!(v["verified"], true, "{v}");
        assert_eq!(v["completed"], 2);
        assert_eq!(v["mismatched_blocks"], 0);
        let got: Vec<Vec<usize>> = serde_json::from_value(v["writers"].clone()).unwrap();
        assert_eq!(got, writers, "{split:?}");
        // Every destination byte of the whole model: 200 tokens in 13 blocks of 16, per
        // request, of the model's KV per token.
        let per_token: u64 = if model == "llama3-8b" {
            128 << 10
        } else {
            320 << 10
        };
        assert_eq!(v["bytes_verified"], 2 * 13 * 16 * per_token, "{split:?}");
        assert!(v["live_kv_bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn demo_splits_that_cannot_be_made_are_refused() {
    let mut args = vec!["demo", "--receiver-tp", "3"];
    args.extend(SMALL);
    let (ok, _, err) = kvpipe(&args);
    assert!(!ok);
    assert!(err.contains("cannot be split"), "{err}");
    let (ok, _, err) = kvpipe(&["demo", "--sender-tp", "2", "--transport", "tcp"]);
    assert!(!ok);
    assert!(err.contains("--transport mem"), "{err}");
}

#[test]
fn demo_reports_memory_against_the_live_kv() {
    let mut args = vec!["demo", "--json", "--model", "gemma3-swa", "--window", "50"];
    args.extend(SMALL);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}{out}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    let live = v["live_kv_bytes"].as_u64().unwrap();
    // The local layers hold a window, not the prompt: less than the two sides' whole KV.
    let whole = 2 * 2 * 13 * 16 * (384u64 << 10);
    assert!(live > 0 && live < whole, "{live} vs {whole}");
}

#[test]
fn bench_fragments_reports_its_overhead_ratio() {
    let (ok, out, err) = kvpipe(&[
        "bench",
        "fragments",
        "--json",
        "--fragments",
        "3200",
        "--chunk-tokens",
        "128",
        "--runs",
        "1",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["fragments"], 3200);
    assert_eq!(v["fragment_bytes"], 8192);
    // 8 KiB slices contiguous on neither side: nothing coalesces.
    assert_eq!(v["extents"], 3200);
    assert_eq!(v["write_batches"], 5);
    for key in ["overhead_ratio", "plan_ms", "post_ms", "transfer_ms"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
}

#[test]
fn bench_pipeline_runs_other_models_and_tcp() {
    for (model, transport) in [("gemma3-swa", "mem"), ("llama3-8b", "tcp")] {
        let (ok, out, err) = kvpipe(&[
            "bench",
            "pipeline",
            "--json",
            "--model",
            model,
            "--transport",
            transport,
            "--prompt-tokens",
            "256",
            "--chunk-tokens",
            "64",
            "--prefill-ms-per-chunk",
            "2",
            "--runs",
            "1",
        ]);
        assert!(ok, "{model} {transport}: {err}{out}");
        let v = json(&out);
        assert_eq!(v["verified"], true);
        assert_eq!(v["model"], model);
        assert_eq!(v["transport"], transport);
        assert_eq!(v["chunks"], 4);
        assert!(v["monolithic_over_pipelined"].as_f64().unwrap() > 0.0);
    }
}
