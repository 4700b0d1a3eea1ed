//! What `kvpipe` reports about a transfer besides its own output: spans and events on stderr
//! under `RUST_LOG`, quiet by default, and `kvpipe serve --metrics` serving Prometheus text.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");
const SMALL: [&str; 8] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "256",
    "--chunk-tokens",
    "128",
    "--prefill-ms-per-chunk",
    "1",
];

fn demo(requests: &str, rust_log: Option<&str>) -> (String, String) {
    let mut cmd = Command::new(KVPIPE);
    cmd.args(["demo", "--requests", requests]).args(SMALL);
    // The pipelined run only: the monolithic baseline would open its own spans.
    cmd.arg("--no-baseline");
    cmd.env_remove("RUST_LOG").env_remove("KVPIPE_OBSERVE");
    if let Some(filter) = rust_log {
        cmd.env("RUST_LOG", filter);
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

/// The lines that report a request span closing.
fn closed_spans(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("request{") && l.contains(" close "))
        .collect()
}

#[test]
fn rust_log_debug_shows_one_span_per_request_and_side_with_its_events() {
    let (_, log) = demo("1", Some("kvpipe=debug"));
    let spans = closed_spans(&log);
    assert_eq!(spans.len(), 2, "one span per side:\n{log}");
    for role in ["sender", "receiver"] {
        assert_eq!(
            spans
                .iter()
                .filter(
                    |l| l.contains("request{request=1 ") && l.contains(&format!("role=\"{role}\""))
                )
                .count(),
            1,
            "{role}:\n{log}"
        );
    }
    for event in [
        "handshake complete",
        "registration sent",
        "registration received",
        "write batch done",
        "result sent",
        "completed",
        "quiesced",
    ] {
        assert!(log.contains(event), "no {event:?} in\n{log}");
    }
    let batch = log
        .lines()
        .find(|l| l.contains("write batch done"))
        .unwrap();
    for field in ["bytes=", "extents=", "duration_ms=", "request{request=1 "] {
        assert!(batch.contains(field), "{batch}");
    }

    let (_, log) = demo("2", Some("kvpipe=debug"));
    let spans = closed_spans(&log);
    assert_eq!(spans.len(), 4, "{log}");
    for id in ["request{request=1 ", "request{request=2 "] {
        assert_eq!(spans.iter().filter(|l| l.contains(id)).count(), 2, "{log}");
    }
}

#[test]
fn the_default_level_is_quiet() {
    let (out, log) = demo("1", None);
    assert!(log.is_empty(), "{log}");
    assert!(out.contains("exposed tail") && out.contains("p99"), "{out}");
    assert!(out.contains("transfer time"), "{out}");
}

/// One HTTP GET of `path`, the body.
fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default()
}

/// The value of the sample line `name{labels…}` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn serve_metrics_can_be_scraped_after_a_two_process_transfer() {
    let workload = [
        "--model",
        "llama3-70b-tp8",
        "--prompt-tokens",
        "300",
        "--requests",
        "2",
    ];
    let mut serve = Command::new(KVPIPE)
        .args(["serve", "--listen", "127.0.0.1:0", "--json"])
        .args(["--accept-timeout-s", "60"])
        .args(["--metrics", "127.0.0.1:0", "--metrics-linger-s", "120"])
        .args(workload)
        .env_remove("RUST_LOG")
        .env_remove("KVPIPE_OBSERVE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(serve.stderr.take().unwrap());
    let addr = support::listening_addr(&mut err);
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let metrics = line
        .trim()
        .strip_prefix("kvpipe serve: metrics on http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected second line {line:?}"))
        .to_string();
    let before = get(&metrics, "/metrics");
    assert_eq!(
        sample(&before, "kvpipe_bytes_received_total", &[]).unwrap_or(0.0),
        0.0,
        "{before}"
    );

    let demo = Command::new(KVPIPE)
        .args(["demo", "--transport", "tcp", "--connect", &addr, "--json"])
        .args(["--chunk-tokens", "64", "--prefill-ms-per-chunk", "1"])
        .args(workload)
        .output()
        .unwrap();
    assert!(
        demo.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&demo.stderr)
    );
    // The report comes out when the transfer is done; then serve lingers with its metrics.
    let mut out = BufReader::new(serve.stdout.take().unwrap());
    let mut report = String::new();
    out.read_line(&mut report).unwrap();
    let report: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(report["verified"], true, "{report}");
    assert!(
        report["exposed_tail_p99_ms"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    assert!(
        report["transfer_p50_ms"].as_f64().unwrap() > 0.0,
        "{report}"
    );

    let text = get(&metrics, "/metrics");
    let _ = serve.kill();
    let _ = serve.wait();
    let receiver = ["role=\"receiver\"", "transport=\"tcp\""];
    // 2 requests × 10 blocks of 32 tokens × 40 KiB per token.
    assert_eq!(
        sample(&text, "kvpipe_bytes_received_total", &receiver),
        Some(2.0 * 10.0 * 32.0 * 40.0 * 1024.0),
        "{text}"
    );
    assert!(
        text.contains("# TYPE kvpipe_exposed_tail_seconds histogram"),
        "{text}"
    );
    let tail = ["view=\"receiver\"", "transport=\"tcp\""];
    assert_eq!(
        sample(&text, "kvpipe_exposed_tail_seconds_count", &tail),
        Some(2.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "kvpipe_exposed_tail_seconds_bucket",
            &["le=\"+Inf\""]
        ) == Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvpipe_requests_total",
            &["outcome=\"completed\"", "role=\"receiver\""]
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvpipe_open_sessions", &receiver),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvpipe_pinned_blocks", &receiver),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvpipe_writes_refused_total", &receiver),
        Some(0.0),
        "{text}"
    );
}
