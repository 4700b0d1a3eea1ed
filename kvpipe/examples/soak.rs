//! Soak: many tiny requests through an in-process pair ([`mem_pair`]), in waves, each one
//! completed, quiesced and retired on both sides; prints the resident set size every
//! `--every` requests and fails when it grew by more than `--max-growth` percent between the
//! end of the warm-up and the end of the run. A server that runs for months must not grow with
//! the number of requests it has served.
//!
//! ```text
//! scripts/soak \
//!     [--requests 1000000] [--wave 8] [--every 100000] [--warmup 0.5] [--max-growth 5]
//! ```

use std::process::ExitCode;
use std::time::{Duration, Instant as StdInstant};

use kvpipe::{
    mem_pair, BlockTables, DecodeNode, NodeConfig, PrefillNode, RawRegion, MEM_RECEIVER_PEER,
    MEM_SENDER_PEER,
};
use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    AnchoredRun, BlockId, ChunkSpec, Event, LayerGroupLayout, PoolLayout, RegionId, RequestId,
};

const TPB: u32 = 4;
const SLOT_BYTES: u64 = 64;

struct Args {
    requests: u64,
    wave: u64,
    every: u64,
    warmup: f64,
    max_growth: f64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        requests: 1_000_000,
        wave: 8,
        every: 100_000,
        warmup: 0.5,
        max_growth: 5.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--requests" => a.requests = value.parse().map_err(|e| bad(&e))?,
            "--wave" => a.wave = value.parse().map_err(|e| bad(&e))?,
            "--every" => a.every = value.parse().map_err(|e| bad(&e))?,
            "--warmup" => a.warmup = value.parse().map_err(|e| bad(&e))?,
            "--max-growth" => a.max_growth = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.wave == 0 || a.every == 0 || !(0.0..1.0).contains(&a.warmup) {
        return Err("--wave and --every must be positive, --warmup in [0, 1)".into());
    }
    Ok(a)
}

/// Resident set size in bytes, from `/proc/self/statm` (0 where it cannot be read).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn layout(region: u32) -> Vec<LayerGroupLayout> {
    vec![LayerGroupLayout {
        layers: 1,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 4,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        block_layout: Default::default(),
        pools: [PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 1,
            slot_bytes: SLOT_BYTES,
        }]
        .into_iter()
        .collect(),
        shard: Default::default(),
    }]
}

/// Waits for `side`'s next event, failing after 10 s or on any failure event.
fn next(node: &dyn Fn(Duration) -> Option<Event>, side: &str) -> Result<Event, String> {
    let event = node(Duration::from_secs(10)).ok_or(format!("{side}: no event within 10 s"))?;
    match &event {
        Event::Failed { .. }
        | Event::TimedOut { .. }
        | Event::Cancelled { .. }
        | Event::PeerRejected { .. }
        | Event::ProtocolViolation { .. } => Err(format!("{side}: {event:?}")),
        _ => Ok(event),
    }
}

/// One wave: `wave` requests with consecutive ids from `first`, block `i` of the pools each.
fn wave(tx: &PrefillNode, rx: &DecodeNode, first: u64, wave: u64) -> Result<(), String> {
    let e = |e: kvpipe::EmbedError| e.to_string();
    for i in 0..wave {
        let request = RequestId(first + i);
        let block = BlockId(i as u32);
        rx.register(Registration {
            request,
            prompt_len: TPB,
            groups: vec![AnchoredRun::from_ids(0, &[block])],
            writers: [MEM_SENDER_PEER].into_iter().collect(),
            aux_capacity: 64,
            expected_part: None,
        })
        .map_err(e)?;
        tx.open_request(SendRequest::new(request, [MEM_RECEIVER_PEER]))
            .map_err(e)?;
        let table = [Some(block)];
        let groups: [&[Option<BlockId>]; 1] = [&table];
        let spec = ChunkSpec {
            start: 0,
            end: TPB,
            prompt_len: TPB,
            prepopulated_len: 0,
            is_last: true,
            prefix_sent_early: false,
        };
        tx.submit_chunk(request, spec, &mut BlockTables { groups: &groups })
            .map_err(e)?;
        tx.submit_aux(
            request,
            AuxData {
                prompt_tokens: TPB,
                cached_tokens: 0,
                first_tokens: vec![1],
                draft_tokens: Vec::new(),
            },
        )
        .map_err(e)?;
    }
    // Both sides: every request of the wave quiesces, then is retired.
    retire_quiesced(
        "prefill",
        wave,
        &|t| tx.next_event(t).ok().flatten(),
        &|r| tx.retire(r),
    )?;
    retire_quiesced("decode", wave, &|t| rx.next_event(t).ok().flatten(), &|r| {
        rx.retire(r)
    })
}

/// Takes `side`'s events until `count` requests quiesced, retiring each.
fn retire_quiesced(
    side: &str,
    count: u64,
    poll: &dyn Fn(Duration) -> Option<Event>,
    retire: &dyn Fn(RequestId) -> Result<(), kvpipe::EmbedError>,
) -> Result<(), String> {
    let mut quiesced = 0;
    while quiesced < count {
        if let Event::Quiesced { request } = next(poll, side)? {
            retire(request).map_err(|e| e.to_string())?;
            quiesced += 1;
        }
    }
    Ok(())
}

fn run(a: &Args) -> Result<(), String> {
    let mut src = vec![7u8; (SLOT_BYTES * a.wave) as usize];
    let mut dst = vec![0u8; (SLOT_BYTES * a.wave) as usize];
    let region = |id, bytes: &mut Vec<u8>| RawRegion {
        id: RegionId(id),
        ptr: bytes.as_mut_ptr(),
        len: bytes.len(),
        device: None,
    };
    let (s_regions, r_regions) = ([region(1, &mut src)], [region(2, &mut dst)]);
    // SAFETY: `src` and `dst` outlive both nodes (dropped at the end of this function, after
    // the nodes, which are declared later).
    let (tx, rx) = unsafe {
        mem_pair(
            &NodeConfig::new(layout(1)),
            &s_regions,
            &NodeConfig::new(layout(2)),
            &r_regions,
        )
    }
    .map_err(|e| e.to_string())?;
    let ready = |e: Event| matches!(e, Event::PeerReady { .. });
    if !ready(next(&|t| rx.next_event(t).ok().flatten(), "decode")?)
        || !ready(next(&|t| tx.next_event(t).ok().flatten(), "prefill")?)
    {
        return Err("the handshake did not come first".into());
    }
    let start = StdInstant::now();
    let warm_at = (a.requests as f64 * a.warmup) as u64;
    let mut warm_rss = None;
    let mut served = 0;
    let mut next_report = a.every;
    println!("requests,seconds,rss_mib,sessions_prefill,sessions_decode");
    while served < a.requests {
        let n = a.wave.min(a.requests - served);
        wave(&tx, &rx, served + 1, n)?;
        served += n;
        if warm_rss.is_none() && served >= warm_at {
            warm_rss = Some(rss());
        }
        if served >= next_report || served == a.requests {
            next_report += a.every;
            let sessions = |c: Result<usize, _>| c.map_or(-1, |n| n as i64);
            println!(
                "{served},{:.1},{:.1},{},{}",
                start.elapsed().as_secs_f64(),
                rss() as f64 / (1 << 20) as f64,
                sessions(tx.session_count()),
                sessions(rx.session_count()),
            );
        }
    }
    let (warm, end) = (warm_rss.unwrap_or(0), rss());
    let growth = (end as f64 - warm as f64) / warm.max(1) as f64 * 100.0;
    println!(
        "rss after warm-up {:.1} MiB, at the end {:.1} MiB: {growth:+.1} %",
        warm as f64 / (1 << 20) as f64,
        end as f64 / (1 << 20) as f64,
    );
    if growth > a.max_growth {
        return Err(format!(
            "resident memory grew {growth:.1} % after warm-up (limit {} %)",
            a.max_growth
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let outcome = parse().and_then(|a| run(&a));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::FAILURE
        }
    }
}
