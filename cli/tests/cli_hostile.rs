//! The `kvpipe` program against hostile peers and extreme input, by running the binary: every
//! input it accepts ends cleanly (no panic, no abort, no sleeping forever), a decode side that
//! dies or stops is named on the prefill side with the requests it failed, a peer that leaves
//! right after its handshake does not leave `serve` hung, and a decode side believes no byte
//! count it did not check.

mod support;

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpipe_conformance::cache::{CacheSpec, ReferenceCache};
use kvpipe_conformance::suite::demo::Model;
use kvpipe_core::session::LocalHello;
use kvpipe_core::wire::{
    AuxData, AuxResult, Frame, KvResult, Role, Topology, TransferStatus, HEADER_LEN,
};
use kvpipe_core::{InstanceId, SenderSliceId};
use kvpipe_tcp::preamble::Preamble;
use support::{finish, run, turn};

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");

/// A running `kvpipe serve`, its address and what it printed on stderr so far.
struct Serve {
    child: Child,
    addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Serve {
    fn start(args: &[&str]) -> Serve {
        let (child, addr, err) = support::spawn_serve(KVPIPE, args);
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut rest = String::new();
            for line in err.lines().map_while(Result::ok) {
                rest.push_str(&line);
                rest.push('\n');
                *sink.lock().unwrap() = rest.clone();
            }
        });
        Serve {
            child,
            addr,
            stderr,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status and stdout, failing if it still runs after `limit`.
    fn wait(mut self, limit: Duration) -> (bool, String, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "serve still ran after {limit:?}: {}",
                    self.stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        // Let the stderr reader catch up with the last lines.
        std::thread::sleep(Duration::from_millis(100));
        let err = self.stderr.lock().unwrap().clone();
        (status.success(), out, err)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A signal to a process we started (`kill` is a shell builtin).
fn signal(pid: u32, sig: &str) {
    let ok = Command::new("sh")
        .args(["-c", &format!("kill -{sig} {pid}")])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Exited with a `kvpipe: …` message (status 1), not a panic (101) or a signal.
fn ended_cleanly(out: &Output) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("kvpipe"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn every_input_the_cli_accepts_ends_cleanly() {
    let _turn = turn();
    let listen = ["serve", "--listen", "127.0.0.1:0"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        listen
            .iter()
            .copied()
            .chain(extra.iter().copied())
            .collect()
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            with(&["--accept-timeout-s", "18446744073709551615"]),
            "--accept-timeout-s",
        ),
        (
            vec!["demo", "--prompt-tokens", "10000000"],
            "lower --prompt-tokens",
        ),
        (
            vec!["demo", "--tokens-per-block", "4294967295"],
            "lower --prompt-tokens",
        ),
        (
            vec!["demo", "--requests", "4294967295", "--prompt-tokens", "1"],
            "--requests",
        ),
        (
            vec!["demo", "--ranks", "4294967295", "--prompt-tokens", "1"],
            "--ranks",
        ),
        (
            with(&["--prompt-tokens", "10000000"]),
            "lower --prompt-tokens",
        ),
        (vec!["sim", "--requests", "4294967295"], "lower --requests"),
        (vec!["sim", "--senders", "4294967295"], "--senders"),
        (
            vec!["sim", "--requests", "10", "--senders", "100000"],
            "--senders",
        ),
        (
            vec!["bench", "pipeline", "--prompt-tokens", "10000000"],
            "lower --prompt-tokens",
        ),
        (
            vec![
                "bench",
                "transfer",
                "--tokens-per-block",
                "4294967295",
                "--tokens",
                "64",
            ],
            "lower --tokens-per-block",
        ),
        (
            vec![
                "demo",
                "--model",
                "gemma3-swa",
                "--prompt-tokens",
                "3000000",
                "--requests",
                "2",
            ],
            "lower --prompt-tokens",
        ),
        (
            vec![
                "plan",
                "--prompt-tokens",
                "4294967295",
                "--tokens-per-block",
                "1",
                "--chunks",
                "0:4294967295",
            ],
            "lower --prompt-tokens",
        ),
        (
            vec!["bench", "plan", "--prompt-tokens", "4294967295"],
            "lower --prompt-tokens",
        ),
        (
            with(&["--prompt-tokens", "0"]),
            "--prompt-tokens must be at least 1",
        ),
        (with(&["--requests", "0"]), "--requests must be at least 1"),
        (
            with(&["--tokens-per-block", "0"]),
            "--tokens-per-block must be at least 1",
        ),
        (
            with(&["--prompt-tokens", "100", "--receiver-prefix", "200"]),
            "--receiver-prefix 200 is longer than the prompt",
        ),
        (
            vec!["demo", "--prefill-ms-per-chunk", "18446744073709551615"],
            "--prefill-ms-per-chunk",
        ),
        (
            vec!["bench", "plan", "--samples", "0"],
            "--samples must be at least 1",
        ),
        (
            vec![
                "demo",
                "--transport",
                "tcp",
                "--connect",
                "no-such-host.invalid:7070",
            ],
            "--connect",
        ),
        (vec!["serve", "--listen", "256.0.0.1:7070"], "--listen"),
    ];
    for (args, expected) in cases {
        let start = Instant::now();
        let out = run(&args, Duration::from_secs(60));
        let err = ended_cleanly(&out);
        assert!(err.contains(expected), "{args:?}: {err}");
        if err.contains("of memory") {
            // The refusal names the need, what is available and the flag to lower.
            assert!(err.contains("available") && err.contains("lower"), "{err}");
        }
        // Refused before anything was allocated or bound.
        assert!(start.elapsed() < Duration::from_secs(30), "{args:?}");
    }
}

#[test]
fn a_failed_demo_names_its_causes_over_every_rank() {
    let _turn = turn();
    let out = run(
        &[
            "demo",
            "--ranks",
            "3",
            "--prompt-tokens",
            "64",
            "--requests",
            "1",
            "--prefill-ms-per-chunk",
            "1",
            "--corrupt-one-byte",
        ],
        Duration::from_secs(120),
    );
    assert!(!out.status.success());
    let table = text(&out.stdout);
    let err = text(&out.stderr);
    // Requests per rank × ranks.
    assert!(table.contains("of 3 request(s) completed"), "{table}");
    assert!(
        err.contains("3 request(s): completed, but 1 destination block(s) differ"),
        "{err}"
    );
}

/// A raw prefill node: its preamble, then a Hello matching `kvpipe serve`'s workload.
fn raw_prefill_node(addr: &str, model: Model, prompt_tokens: u32, requests: u32) -> TcpStream {
    let tpb = 32;
    let cache = ReferenceCache::new(&CacheSpec {
        tokens_per_block: tpb,
        groups: model.groups(None),
        slots_per_group: prompt_tokens.div_ceil(tpb) * requests + 1,
        first_region: 1,
        slot_order_seed: None,
        materialize: false,
    })
    .unwrap();
    let hello = LocalHello::new(InstanceId(77), Topology::default(), cache.layouts());
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let pre = Preamble {
        index: 0,
        count: 1,
        token: 0x7e57,
        flags: 0,
    };
    s.write_all(&pre.encode()).unwrap();
    s.write_all(&Frame::Hello(hello.to_hello(Role::Sender)).to_vec().unwrap())
        .unwrap();
    s
}

/// The next frame on `s` (`None`: end of stream or error).
fn recv(s: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).ok()?;
    let (_, _, total) = Frame::peek_header(&head).ok()?;
    let mut buf = vec![0; total];
    buf[..HEADER_LEN].copy_from_slice(&head);
    s.read_exact(&mut buf[HEADER_LEN..]).ok()?;
    Frame::parse(&buf).ok().map(|(f, _)| f)
}

const SMALL_SERVE: [&str; 6] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "300",
    "--requests",
    "2",
];

#[test]
fn a_peer_leaving_right_after_its_handshake_does_not_leave_serve_hung() {
    let _turn = turn();
    for _ in 0..5 {
        let mut args = SMALL_SERVE.to_vec();
        args.extend(["--accept-timeout-s", "3"]);
        let serve = Serve::start(&args);
        // Gone right after its Hello: the node hears of the handshake and of the disconnect
        // at about the same moment, usually before serve registers anything.
        let s = raw_prefill_node(&serve.addr, Model::Llama3_70bTp8, 300, 2);
        drop(s);
        // It ends (waiting for another node until its accept deadline, or failing the
        // requests it registered), well before its 600 s result deadline.
        let (ok, _, err) = serve.wait(Duration::from_secs(60));
        assert!(!ok, "{err}");
        assert!(
            err.contains("left right after its handshake")
                || err.contains("disconnected right after its handshake")
                || err.contains("was lost"),
            "{err}"
        );
    }
}

/// `serve` and a slow `demo --connect` (10 chunks per request, 300 ms each).
fn serve_and_slow_demo() -> (Serve, Child) {
    let serve = Serve::start(&SMALL_SERVE);
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &serve.addr])
        .args(["--chunk-tokens", "32", "--prefill-ms-per-chunk", "300"])
        .args(SMALL_SERVE)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the transfer to be under way.
    let start = Instant::now();
    while !serve
        .stderr
        .lock()
        .unwrap()
        .contains("prefill node connected")
    {
        assert!(start.elapsed() < Duration::from_secs(30), "no connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    (serve, demo)
}

#[test]
fn the_prefill_side_names_a_decode_side_that_died_and_the_requests_it_failed() {
    let _turn = turn();
    let (serve, demo) = serve_and_slow_demo();
    signal(serve.pid(), "KILL");
    let out = finish(demo, Duration::from_secs(60), "demo --connect");
    let err = ended_cleanly(&out);
    assert!(err.contains("was lost"), "{err}");
    assert!(err.contains(&serve.addr), "{err}");
    assert!(err.contains("req#1") && err.contains("req#2"), "{err}");
    assert!(!err.contains("already ended"), "{err}");
    // A decode side that died mid-transfer is not taken for one that served fewer requests.
    assert!(!err.contains("--requests"), "{err}");
}

#[test]
fn a_decode_side_serving_fewer_requests_is_named_as_the_likely_cause() {
    let _turn = turn();
    let serve = Serve::start(&[
        "--model",
        "llama3-70b-tp8",
        "--prompt-tokens",
        "300",
        "--requests",
        "1",
    ]);
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &serve.addr])
        .args(["--prefill-ms-per-chunk", "0"])
        .args(SMALL_SERVE)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(demo, Duration::from_secs(60), "demo --connect");
    let err = ended_cleanly(&out);
    assert!(err.contains("req#2 failed"), "{err}");
    assert!(
        err.contains("registered none of the failed request(s) (req#2)")
            && err.contains("does it serve as many as this side sends (2)?"),
        "{err}"
    );
}

#[test]
fn the_prefill_side_names_a_decode_side_that_stopped_answering() {
    let _turn = turn();
    let (serve, demo) = serve_and_slow_demo();
    signal(serve.pid(), "STOP");
    // The liveness timeout (10 s) and the bounded close (10 s) pass first.
    let out = finish(demo, Duration::from_secs(90), "demo --connect");
    drop(serve);
    let err = ended_cleanly(&out);
    assert!(err.contains("stopped answering"), "{err}");
    assert!(err.contains("req#"), "{err}");
}

#[test]
fn a_sender_reporting_bytes_it_never_wrote_does_not_complete_a_request() {
    let _turn = turn();
    let serve = Serve::start(&SMALL_SERVE);
    let mut s = raw_prefill_node(&serve.addr, Model::Llama3_70bTp8, 300, 2);
    let mut registrations = Vec::new();
    while registrations.len() < 2 {
        match recv(&mut s) {
            Some(Frame::RecvRegistration(r)) => registrations.push(r),
            Some(_) => {}
            None => panic!("no registrations: {}", serve.stderr.lock().unwrap()),
        }
    }
    // "Everything went to you": without a single data write.
    for r in &registrations {
        let result = Frame::KvResult(KvResult {
            request: r.request,
            sender_slice: SenderSliceId(0),
            receiver_slice: r.slice,
            is_last: true,
            status: TransferStatus::Success,
            bytes_written: 0,
        });
        let aux = Frame::AuxResult(AuxResult {
            request: r.request,
            status: TransferStatus::Success,
            data: AuxData {
                prompt_tokens: 300,
                cached_tokens: 0,
                first_tokens: vec![1],
                draft_tokens: Vec::new(),
            },
        });
        s.write_all(&result.to_vec().unwrap()).unwrap();
        s.write_all(&aux.to_vec().unwrap()).unwrap();
    }
    let (ok, out, err) = serve.wait(Duration::from_secs(60));
    drop(s);
    assert!(!ok, "{out}{err}");
    assert!(out.contains("0 of 2 request(s) completed"), "{out}");
    assert!(err.contains("protocol error"), "{err}");
}

/// `serve` with `serve_prompt` tokens against `demo --connect` with `demo_prompt` tokens:
/// neither side may report success.
fn mismatched_prompts(serve_prompt: &str, demo_prompt: &str) {
    let _turn = turn();
    let serve = Serve::start(&[
        "--model",
        "llama3-70b-tp8",
        "--prompt-tokens",
        serve_prompt,
        "--accept-timeout-s",
        "60",
    ]);
    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &serve.addr])
        .args(["--model", "llama3-70b-tp8", "--prompt-tokens", demo_prompt])
        .args([
            "--chunk-tokens",
            "128",
            "--prefill-ms-per-chunk",
            "1",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let demo = finish(demo, Duration::from_secs(120), "demo --connect");
    let (ok, out, err) = serve.wait(Duration::from_secs(120));
    assert!(!demo.status.success(), "demo: {}", text(&demo.stdout));
    assert!(!ok, "serve: {out}");
    // No request completed: its report's figures of completed requests are null, not 0.
    let report: serde_json::Value = serde_json::from_str(text(&demo.stdout).trim()).unwrap();
    assert_eq!(report["completed"], 0, "{report}");
    for figure in [
        "exposed_tail_ms",
        "exposed_tail_p50_ms",
        "max_exposed_tail_ms",
    ] {
        assert!(report[figure].is_null(), "{figure}: {report}");
    }
    assert!(report["transfer_p50_ms"].is_null(), "{report}");
    // The prefill side names both lengths; the decode side, which never learns the other,
    // its own.
    let said = text(&demo.stderr);
    assert!(
        said.contains(serve_prompt) && said.contains(demo_prompt),
        "{said}"
    );
    assert!(
        err.contains(&format!("registered {serve_prompt} prompt tokens")),
        "{err}"
    );
}

#[test]
fn a_decode_side_with_a_shorter_prompt_is_not_a_success() {
    mismatched_prompts("512", "1024");
}

#[test]
fn a_decode_side_with_a_longer_prompt_is_not_a_success() {
    mismatched_prompts("1024", "512");
}

/// `demo --connect` to something that is not a `kvpipe serve`: a listener that never answers,
/// and one that answers like a web server. Each is named with the reason the connection closed
/// before the handshake, not a bare "did not complete the handshake".
#[test]
fn a_connect_to_something_that_is_not_a_decode_side_says_what_it_found() {
    let _turn = turn();
    for answer in [None, Some(&b"HTTP/1.1 400 Bad Request\r\n\r\n"[..])] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let peer = std::thread::spawn(move || {
            // Hold every connection open (answering, if told to) until the demo is done.
            let mut held = Vec::new();
            listener.set_nonblocking(true).unwrap();
            let until = Instant::now() + Duration::from_secs(30);
            while Instant::now() < until && held.len() < 2 {
                if let Ok((mut s, _)) = listener.accept() {
                    if let Some(bytes) = answer {
                        let _ = s.write_all(bytes);
                    }
                    held.push(s);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_secs(15));
        });
        let demo = Command::new(KVPIPE)
            .args(["demo", "--transport", "tcp", "--connect", &addr])
            .args(["--data-path", "socket", "--prompt-tokens", "64"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = finish(demo, Duration::from_secs(60), "demo --connect");
        let err = ended_cleanly(&out);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains(&format!(
                "the connection to {addr} closed before the handshake completed"
            )),
            "{err}"
        );
        match answer {
            None => assert!(err.contains("HandshakeTimeout"), "{err}"),
            Some(_) => assert!(err.contains("not a kvpipe peer?"), "{err}"),
        }
        drop(peer);
    }
}
