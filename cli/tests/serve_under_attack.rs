//! `kvpipe serve` under a flood of connections that never say who they are: while 200 idle
//! connections and 50 sending their preamble one byte every 4 s are held open (reopened as the
//! server drops them at their deadline), after 50 that declared a body far larger than a
//! handshake's, a legitimate two-process demo (10 chunks over 4 s) completes and verifies, and
//! the server's resident memory stays under 1.5 × what it held idle.
//!
//! Its own test binary, so that no other test shares the machine with it.

mod support;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpipe_core::wire::{FrameHeader, FrameKind, MAX_BODY_LEN};
use kvpipe_tcp::preamble::Preamble;

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");
const WORKLOAD: [&str; 6] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "300",
    "--requests",
    "2",
];
const IDLE: usize = 200;
const SLOW: usize = 50;
const AMPLIFIERS: usize = 50;

/// Resident memory of process `pid` (`VmRSS`), in bytes.
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether the server closed `s` (checked without waiting; what it sent is read and dropped).
fn closed(s: &mut TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let mut buf = [0u8; 4096];
    let gone = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e) => break e.kind() != ErrorKind::WouldBlock,
        }
    };
    let _ = s.set_nonblocking(false);
    gone
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()
}

/// Keeps `IDLE` idle and `SLOW` slow-preamble connections open until `stop`, reopening those
/// the server dropped; counts the reopenings.
fn flood(addr: SocketAddr, stop: Arc<AtomicBool>, reopened: Arc<AtomicU64>) {
    let preamble = Preamble {
        index: 0,
        count: 1,
        token: 0x5107,
        flags: 0,
    }
    .encode();
    let mut idle: Vec<Option<TcpStream>> = (0..IDLE).map(|_| connect(addr)).collect();
    let mut slow: Vec<(Option<TcpStream>, usize)> = (0..SLOW).map(|_| (connect(addr), 0)).collect();
    let mut last_byte = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for s in &mut idle {
            if s.as_mut().is_none_or(closed) {
                *s = connect(addr);
                reopened.fetch_add(1, Ordering::Relaxed);
            }
        }
        let tick = last_byte.elapsed() >= Duration::from_secs(4);
        for (s, sent) in &mut slow {
            if s.as_mut().is_none_or(closed) {
                *s = connect(addr);
                *sent = 0;
                reopened.fetch_add(1, Ordering::Relaxed);
            } else if tick && *sent < preamble.len() - 1 {
                let _ = s.as_mut().map(|s| s.write_all(&preamble[*sent..*sent + 1]));
                *sent += 1;
            }
        }
        if tick {
            last_byte = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_legitimate_demo_completes_while_serve_is_flooded_and_memory_stays_bounded() {
    let mut serve = Command::new(KVPIPE)
        .args(["serve", "--listen", "127.0.0.1:0", "--json"])
        .args(["--accept-timeout-s", "120"])
        .args(WORKLOAD)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = serve.id();
    let mut err = BufReader::new(serve.stderr.take().unwrap());
    let addr: SocketAddr = support::listening_addr(&mut err).parse().unwrap();
    std::thread::spawn(move || for _ in err.lines() {});
    std::thread::sleep(Duration::from_millis(300));
    let idle_rss = rss(pid).expect("VmRSS");

    // Memory amplification: a preamble and a Hello header declaring 16 MiB, plus one byte.
    let mut amplifiers = Vec::new();
    for _ in 0..AMPLIFIERS {
        if let Some(mut s) = connect(addr) {
            let pre = Preamble {
                index: 0,
                count: 1,
                token: 0xa3f,
                flags: 0,
            };
            let _ = s.write_all(&pre.encode());
            let _ = s.write_all(&FrameHeader::new(FrameKind::Hello, 1, MAX_BODY_LEN).to_bytes());
            let _ = s.write_all(&[0]);
            amplifiers.push(s);
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let reopened = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (stop, reopened) = (stop.clone(), reopened.clone());
        std::thread::spawn(move || flood(addr, stop, reopened))
    };
    let peak = Arc::new(AtomicU64::new(idle_rss));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match rss(pid) {
                    Some(r) => {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                    None => break,
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        })
    };
    // Let the flood settle in (every connection open, the slow ones part way); the server
    // drops and the flood reopens them (their preamble deadline is 5 s) while the demo runs.
    std::thread::sleep(Duration::from_secs(2));

    let start = Instant::now();
    let demo = Command::new(KVPIPE)
        .args([
            "demo",
            "--transport",
            "tcp",
            "--connect",
            &addr.to_string(),
            "--json",
        ])
        .args(["--chunk-tokens", "64", "--prefill-ms-per-chunk", "400"])
        .args(WORKLOAD)
        .output()
        .unwrap();
    let demo_s = start.elapsed();
    let served = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = serve.kill();
            panic!("serve did not finish");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    sampler.join().unwrap();
    let amplifiers_closed = amplifiers.iter_mut().map(closed).filter(|&c| c).count();

    assert!(
        demo.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&demo.stderr)
    );
    let prefill: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(prefill["completed"], 2, "{prefill}");
    let mut out = String::new();
    serve
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(served.success(), "serve: {out}");
    let decode: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(decode["verified"], true, "{decode}");
    assert_eq!(decode["completed"], 2, "{decode}");

    let peak = peak.load(Ordering::Relaxed);
    eprintln!(
        "serve RSS idle {} KiB, peak {} KiB ({:.2}×); demo {:.2} s; {} connections reopened; \
         {amplifiers_closed} of {AMPLIFIERS} amplifiers closed",
        idle_rss >> 10,
        peak >> 10,
        peak as f64 / idle_rss as f64,
        demo_s.as_secs_f64(),
        reopened.load(Ordering::Relaxed),
    );
    assert!(
        peak * 2 < idle_rss * 3,
        "peak RSS {peak} is not under 1.5 × idle {idle_rss}"
    );
    assert_eq!(amplifiers_closed, AMPLIFIERS, "refused at their header");
}
