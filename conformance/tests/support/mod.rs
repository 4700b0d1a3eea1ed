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
