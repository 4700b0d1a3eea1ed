//! Two `kvpipe` processes on one GPU (`cuda` feature): `kvpipe serve --memory device` and
//! `kvpipe demo --memory device --connect`, by CUDA IPC peer copies and on the socket path, every
//! byte verified. Reported as ignored, with the reason ("skipped: no CUDA driver"), where no
//! driver or device is found — never as passed; `scripts/gpu-check` runs them on the GPU
//! machine.

use kvpipe_cuda::{check_driver, Device};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// Why a GPU test is skipped here, if it is.
fn skip_reason() -> Option<String> {
    if let Err(e) = check_driver() {
        return Some(format!("skipped: {e}"));
    }
    Device::open(0).err().map(|e| format!("skipped: {e}"))
}

/// The `kvpipe` binary: `KVPIPE_BIN` where the tests run away from the build (the GPU machine
/// gets the binaries carried over), else the one cargo built beside this test.
fn kvpipe_bin() -> String {
    std::env::var("KVPIPE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvpipe").to_string())
}

/// Prompt tokens of the two-process test (`KVPIPE_TWO_PROCESS_TOKENS`, default 32768).
fn two_process_tokens() -> String {
    std::env::var("KVPIPE_TWO_PROCESS_TOKENS").unwrap_or_else(|_| "32768".into())
}

/// Runs `kvpipe serve --memory device` and `kvpipe demo --memory device --connect` as two
/// processes on GPU 0 with `data_path`; returns both JSON reports (decode, prefill).
fn two_processes(
    data_path: &str,
    tokens: &str,
) -> Result<(serde_json::Value, serde_json::Value), Failed> {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    let bin = kvpipe_bin();
    let workload = [
        "--model",
        "llama3-8b",
        "--prompt-tokens",
        tokens,
        "--requests",
        "1",
        "--memory",
        "device",
        "--gpu",
        "0",
        "--data-path",
        data_path,
        "--json",
    ];
    let mut serve = Command::new(&bin)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--accept-timeout-s",
            "120",
        ])
        .args(workload)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut errors = BufReader::new(serve.stderr.take().ok_or("no stderr")?);
    let mut line = String::new();
    let addr = loop {
        line.clear();
        if errors.read_line(&mut line)? == 0 {
            let _ = serve.kill();
            return Err("kvpipe serve ended before it listened".into());
        }
        if let Some(addr) = line.trim().strip_prefix("kvpipe serve: listening on ") {
            break addr.to_string();
        }
    };
    // Keep draining serve's stderr so it never blocks on a full pipe.
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = errors.read_to_string(&mut rest);
        rest
    });
    let demo = Command::new(&bin)
        .args([
            "demo",
            "--transport",
            "tcp",
            "--connect",
            &addr,
            "--prefill-ms-per-chunk",
            "0",
        ])
        .args(workload)
        .output()?;
    let served = serve.wait_with_output()?;
    let serve_err = drain.join().unwrap_or_default();
    let parse = |out: &[u8], who: &str, err: &str| -> Result<serde_json::Value, Failed> {
        let text = String::from_utf8_lossy(out);
        let json = text
            .lines()
            .find(|l| l.starts_with('{'))
            .ok_or_else(|| Failed::from(format!("{who} printed no report: {text} {err}")))?;
        Ok(serde_json::from_str(json).map_err(|e| e.to_string())?)
    };
    let decode = parse(&served.stdout, "serve", &serve_err)?;
    let prefill = parse(&demo.stdout, "demo", &String::from_utf8_lossy(&demo.stderr))?;
    println!(
        "{{\"figure\":\"two-process-{data_path}\",\"decode\":{decode},\"prefill\":{prefill}}}"
    );
    if !served.status.success() || !demo.status.success() {
        return Err(format!("serve {}, demo {}: {serve_err}", served.status, demo.status).into());
    }
    Ok((decode, prefill))
}

/// Two processes on one GPU, llama3-8b KV of a 32768-token prompt: the prefill process opens
/// the decode process's pools by CUDA IPC and copies every piece into them (the control frames
/// over TCP); the decode side reads its pools back from the device and checks every byte.
fn two_processes_move_kv_by_peer_copies_and_verify_every_byte() -> Result<Completion, Failed> {
    if let Some(reason) = skip_reason() {
        return Ok(Completion::ignored_with(reason));
    }
    let (decode, prefill) = two_processes("peer-copy", &two_process_tokens())?;
    let tokens: u64 = two_process_tokens().parse().map_err(|_| "tokens")?;
    // llama3-8b: 32 layers × K and V × 8 KV heads × 128 × 2 bytes per token.
    let expected = tokens * 32 * 2 * 8 * 128 * 2;
    let checks = [
        ("verified", decode["verified"] == true),
        ("data path (decode)", decode["data_path"] == "peer-copy"),
        ("data path (prefill)", prefill["data_path"] == "peer-copy"),
        ("bytes", decode["bytes"].as_u64() == Some(expected)),
        (
            "bytes placed",
            prefill["bytes_placed"].as_u64() == Some(expected),
        ),
        ("writes placed", decode["writes_placed"].as_u64() > Some(0)),
        ("mismatched", decode["mismatched_blocks"] == 0),
    ];
    for (what, ok) in checks {
        if !ok {
            return Err(format!("{what}: decode {decode}, prefill {prefill}").into());
        }
    }
    Ok(Completion::Completed)
}

/// The same two processes on the socket path (pinned staging), for comparison, verified too.
fn two_processes_on_the_socket_path_verify_every_byte() -> Result<Completion, Failed> {
    if let Some(reason) = skip_reason() {
        return Ok(Completion::ignored_with(reason));
    }
    let (decode, prefill) = two_processes("socket", &two_process_tokens())?;
    if decode["verified"] != true || decode["data_path"] != "socket" || prefill["bytes_placed"] != 0
    {
        return Err(format!("decode {decode}, prefill {prefill}").into());
    }
    Ok(Completion::Completed)
}

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        Trial::ignorable_test(
            "two_processes_move_kv_by_peer_copies_and_verify_every_byte",
            two_processes_move_kv_by_peer_copies_and_verify_every_byte,
        ),
        Trial::ignorable_test(
            "two_processes_on_the_socket_path_verify_every_byte",
            two_processes_on_the_socket_path_verify_every_byte,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
