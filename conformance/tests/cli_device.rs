//! `kvpipe bench transfer --memory device`: without the `cuda` feature or without a driver it
//! exits non-zero and says why ("no CUDA driver"); with a GPU a short run verifies.

use std::process::Command;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");

#[test]
fn device_memory_bench_says_why_it_cannot_run_or_runs_and_verifies() {
    let out = Command::new(KVPIPE)
        .args([
            "bench",
            "transfer",
            "--transport",
            "mem",
            "--memory",
            "device",
        ])
        .args([
            "--json",
            "--tokens",
            "2048",
            "--chunk-tokens",
            "512",
            "--runs",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    #[cfg(not(feature = "cuda"))]
    let expected_error = Some("needs kvpipe built with the `cuda` feature");
    #[cfg(feature = "cuda")]
    let expected_error = match kvpipe_cuda::check_driver() {
        Err(kvpipe_cuda::CudaError::NoDriver) => Some("kvpipe: no CUDA driver"),
        Err(_) => Some("kvpipe: "),
        Ok(()) => None,
    };
    match expected_error {
        Some(message) => {
            assert!(!out.status.success(), "{stdout}");
            assert!(stderr.contains(message), "{stderr}");
            assert!(stdout.is_empty(), "{stdout}");
        }
        None => {
            assert!(out.status.success(), "{stderr}");
            assert!(
                stdout.contains("\"baseline\":\"cuda-memcpy-d2d\""),
                "{stdout}"
            );
            assert!(stdout.contains("\"verified\":true"), "{stdout}");
        }
    }
}
