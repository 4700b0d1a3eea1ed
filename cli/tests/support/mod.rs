//! What the tests that run `kvpipe serve` as a process share.
// Each test file uses the part it needs.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The address `kvpipe serve` prints as its first line on stderr ("kvpipe serve: listening on
/// ADDR"); panics on any other first line.
pub(crate) fn listening_addr(stderr: &mut impl BufRead) -> String {
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    line.trim()
        .strip_prefix("kvpipe serve: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string()
}

/// Starts `kvpipe serve --listen 127.0.0.1:0 ARGS` (the binary at `kvpipe`) with stdout and
/// stderr piped; returns it, the address it listens on, and the rest of its stderr.
pub(crate) fn spawn_serve(kvpipe: &str, args: &[&str]) -> (Child, String, BufReader<ChildStderr>) {
    let mut serve = Command::new(kvpipe)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(serve.stderr.take().unwrap());
    let addr = listening_addr(&mut err);
    (serve, addr, err)
}

/// Waits up to `limit` for `child` to exit; panics past it.
pub(crate) fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            start.elapsed() < limit,
            "the process did not exit in {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One `kvpipe` at a time within a test binary: the runs keep deadlines of seconds, and several
/// at once on a small, shared machine can starve each other past them.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the turn to run `kvpipe` (see [`ONE_AT_A_TIME`]).
pub(crate) fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `kvpipe args` (the crate's binary), killing it (and failing) if it outlives `limit`.
pub(crate) fn run(args: &[&str], limit: Duration) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_kvpipe"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, limit, &args.join(" "))
}

/// Waits for `child` and collects its output, killing it (and failing) if it outlives `limit`.
pub(crate) fn finish(mut child: Child, limit: Duration, what: &str) -> std::process::Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "`kvpipe {what}` still ran after {limit:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
