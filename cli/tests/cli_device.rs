//! `kvpipe bench transfer --memory device`, `kvpipe bench request --memory device` and `kvpipe
//! demo --memory device`: without the `cuda` feature or without a driver they exit non-zero and
//! say why ("no CUDA driver"); with a GPU a short run verifies.

use std::process::Command;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");

/// Runs `kvpipe ARGS`: where device memory cannot run here it must fail, say why and print
/// nothing; else it must succeed with every line of `expect` in its report and every byte
/// verified.
fn says_why_or_verifies(args: &[&str], expect: &[&str]) {
    let out = Command::new(KVPIPE).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    match expected_error() {
        Some(message) => {
            assert!(!out.status.success(), "{args:?}: {stdout}");
            assert!(stderr.contains(message), "{args:?}: {stderr}");
            assert!(stdout.is_empty(), "{args:?}: {stdout}");
        }
        None => {
            assert!(out.status.success(), "{args:?}: {stderr}");
            for e in expect.iter().chain(&["\"verified\":true"]) {
                assert!(stdout.contains(e), "{args:?}: no {e} in {stdout}");
            }
        }
    }
}

#[test]
fn device_memory_bench_says_why_it_cannot_run_or_runs_and_verifies() {
    for (transport, baseline) in [
        ("mem", "\"baseline\":\"cuda-memcpy-d2d\""),
        ("tcp", "\"baseline\":\"min(tcp-raw, pinned-copy)\""),
    ] {
        says_why_or_verifies(
            &[
                "bench",
                "transfer",
                "--transport",
                transport,
                "--memory",
                "device",
                "--json",
                "--tokens",
                "2048",
                "--chunk-tokens",
                "512",
                "--runs",
                "1",
            ],
            &[baseline],
        );
    }
}

#[test]
fn device_memory_request_bench_says_why_it_cannot_run_or_runs_and_verifies() {
    for gpu in ["busy", "idle"] {
        says_why_or_verifies(
            &[
                "bench",
                "request",
                "--memory",
                "device",
                "--gpu",
                gpu,
                "--requests",
                "20",
                "--json",
            ],
            &[
                "\"baseline\":\"copy-engine\"",
                &format!("\"gpu\":\"{gpu}\""),
            ],
        );
    }
}

/// What a `--memory device` run must print on stderr when it cannot run here, if it cannot.
fn expected_error() -> Option<&'static str> {
    #[cfg(not(feature = "cuda"))]
    return Some("needs kvpipe built with the `cuda` feature");
    #[cfg(feature = "cuda")]
    match kvpipe_cuda::check_driver() {
        Err(kvpipe_cuda::CudaError::NoDriver) => Some("kvpipe: no CUDA driver"),
        Err(_) => Some("kvpipe: "),
        Ok(()) => None,
    }
}

#[test]
fn device_memory_demo_says_why_it_cannot_run_or_runs_and_verifies() {
    for transport in ["mem", "tcp"] {
        says_why_or_verifies(
            &[
                "demo",
                "--memory",
                "device",
                "--transport",
                transport,
                "--json",
                "--prompt-tokens",
                "256",
                "--chunk-tokens",
                "96",
                "--prefill-ms-per-chunk",
                "0",
            ],
            &["\"memory\":\"device\""],
        );
    }
    // Device memory is moved only by transports that run both sides here.
    let out = Command::new(KVPIPE)
        .args(["demo", "--memory", "device", "--transport", "verbs"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--transport mem or tcp"));
}

/// The heterogeneous split in device memory (every rank's pools on one GPU, over mem): where
/// it cannot run it says why; with a GPU it verifies the whole model. Over tcp it is refused,
/// with or without a GPU, and says which transport runs it.
#[test]
fn device_memory_split_says_why_it_cannot_run_or_runs_and_verifies() {
    let split = [
        "--model",
        "llama3-70b-tp8",
        "--sender-tp",
        "4",
        "--receiver-tp",
        "2",
        "--receiver-pp",
        "2",
        "--prompt-tokens",
        "256",
        "--chunk-tokens",
        "96",
        "--prefill-ms-per-chunk",
        "0",
    ];
    let args = [&["demo", "--memory", "device", "--json"][..], &split].concat();
    says_why_or_verifies(&args, &["\"memory\":\"device\""]);
    let out = Command::new(KVPIPE)
        .args(["demo", "--memory", "device", "--transport", "tcp"])
        .args(split)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--sender-tp/--receiver-tp/--receiver-pp runs over --transport mem"),
        "{stderr}"
    );
}

/// The two-process commands with device pools, where they cannot run (no `cuda` feature, no
/// driver): both refuse before listening or connecting and say why; a `--data-path` they do
/// not know, and device pools over verbs, are refused with the choices.
#[test]
fn two_process_device_memory_says_why_it_cannot_run() {
    let run = |args: &[&str]| {
        let out = Command::new(KVPIPE).args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stderr) = run(&[
        "demo",
        "--transport",
        "tcp",
        "--connect",
        "127.0.0.1:9",
        "--data-path",
        "carrier-pigeon",
    ]);
    assert!(
        !ok && stderr.contains("auto, peer-copy or socket"),
        "{stderr}"
    );
    let (ok, stderr) = run(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--transport",
        "verbs",
        "--memory",
        "device",
    ]);
    assert!(!ok && stderr.contains("--transport tcp only"), "{stderr}");
    let (ok, stderr) = run(&["bench", "transfer", "--peer-gpu", "0"]);
    assert!(
        !ok && stderr.contains("--peer-gpu needs --memory device"),
        "{stderr}"
    );
    if let Some(message) = expected_error() {
        for args in [
            &["serve", "--listen", "127.0.0.1:0", "--memory", "device"][..],
            &[
                "bench",
                "transfer",
                "--memory",
                "device",
                "--peer-gpu",
                "0",
                "--json",
            ][..],
            &[
                "demo",
                "--transport",
                "tcp",
                "--connect",
                "127.0.0.1:9",
                "--memory",
                "device",
                "--data-path",
                "peer-copy",
            ][..],
        ] {
            let (ok, stderr) = run(args);
            assert!(!ok && stderr.contains(message), "{args:?}: {stderr}");
            assert!(!stderr.contains("listening"), "{stderr}");
        }
    }
}
