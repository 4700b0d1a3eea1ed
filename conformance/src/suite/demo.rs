//! The demo: a realistic pipelined prefill→decode transfer of one model's KV cache, shared by
//! `kvpipe demo` and the tests that keep it honest.
//!
//! Models (per rank, as the cache sees them; all bf16, K and V planes):
//!
//! | model | layer groups | KV heads | head dim | KV bytes per token |
//! |---|---|---|---|---|
//! | `llama3-8b` | 32 full-attention layers | 8 | 128 | 128 KiB |
//! | `llama3-70b-tp8` | 80 full-attention layers (one of 8 TP ranks) | 1 | 128 | 40 KiB |
//! | `gemma3-swa` | 8 global layers + 40 local layers with a 1024-token window (Gemma 3 12B's 5:1 interleave) | 8 | 256 | 384 KiB (local layers keep only the window) |

use std::time::Duration as StdDuration;

use std::sync::atomic::{AtomicU64, Ordering};

use kvpipe_core::{Duration, GroupIndex, Instant, LayerOrder};
use kvpipe_observe::{names, TransferTimings};
use serde::Serialize;

use super::engine::run_workload_with;
use super::report::RunReport;
use super::timeline::{BatchSpan, Lane};
use super::workload::{suite_deadlines, RequestPlan, TransferMode, Workload};
use super::{BatchTiming, FaultPlan, Harness, SimulatedCompute, SuiteError};
use crate::cache::{AllocationStyle, GroupSpec};

/// A model preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Model {
    /// Llama 3 8B: 32 layers, 8 KV heads, head dim 128, bf16.
    Llama3_8b,
    /// Llama 3 70B on one of 8 tensor-parallel ranks: 80 layers, 1 KV head, head dim 128.
    Llama3_70bTp8,
    /// Gemma-3-style interleaved sliding-window model: 8 global + 40 local layers (window
    /// 1024), 8 KV heads, head dim 256.
    Gemma3Swa,
}

impl Model {
    /// Every preset with its command-line name.
    pub const ALL: [(&'static str, Model); 3] = [
        ("llama3-8b", Model::Llama3_8b),
        ("llama3-70b-tp8", Model::Llama3_70bTp8),
        ("gemma3-swa", Model::Gemma3Swa),
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        Model::ALL
            .iter()
            .find(|(_, m)| *m == self)
            .map_or("?", |(n, _)| n)
    }

    /// The order its layers are computed in, over the groups of [`Model::groups`]: Gemma 3's
    /// five local layers then one global layer, eight times; the others' one group in order.
    /// Layer ranges ([`TransferMode::LayerSlices`]) index it.
    pub fn layer_order(self) -> LayerOrder {
        match self {
            Model::Gemma3Swa => {
                let (global, local) = (GroupIndex(0), GroupIndex(1));
                LayerOrder::repeat(&[local, local, local, local, local, global], 8)
            }
            Model::Llama3_8b | Model::Llama3_70bTp8 => LayerOrder::stacked(),
        }
    }

    /// The layer groups; `window` overrides the local layers' window (or, on a model without
    /// local layers, makes every layer windowed).
    pub fn groups(self, window: Option<u32>) -> Vec<GroupSpec> {
        let group = |layers: u16, heads: u16, dim: u16, window: Option<u32>| GroupSpec {
            layers,
            kv_factor: 2,
            kv_heads: heads,
            head_dim: dim,
            elem_bytes: 2,
            window,
            sink_tokens: 0,
            pool_split: vec![layers],
            slot_padding: 0,
        };
        match self {
            Model::Llama3_8b => vec![group(32, 8, 128, window)],
            Model::Llama3_70bTp8 => vec![group(80, 1, 128, window)],
            Model::Gemma3Swa => vec![
                group(8, 8, 256, None),
                group(40, 8, 256, Some(window.unwrap_or(1024))),
            ],
        }
    }
}

/// What the demo runs.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoConfig {
    /// The model.
    pub model: Model,
    /// Prompt length of every request.
    pub prompt_tokens: u32,
    /// Prefill chunk length.
    pub chunk_tokens: u32,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
    /// Sliding window override.
    pub window: Option<u32>,
    /// Tokens the sender has cached already.
    pub sender_prefix: u32,
    /// Tokens the receiver has cached already.
    pub receiver_prefix: u32,
    /// Concurrent requests (per rank).
    pub requests: u32,
    /// Tensor-parallel ranks, each with its own sender, receiver and caches (1: one rank).
    pub ranks: u32,
    /// Simulated compute time of one prefill chunk.
    pub prefill_per_chunk: StdDuration,
    /// Pipelined (the point) or monolithic (the baseline).
    pub mode: TransferMode,
    /// Flip one destination byte before verification (shows that verification catches it).
    pub corrupt_one_byte: bool,
    /// How the simulated compute passes (a GPU kept busy, or the engine's thread asleep).
    pub compute: SimulatedCompute,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            model: Model::Llama3_8b,
            prompt_tokens: 4096,
            chunk_tokens: 512,
            tokens_per_block: 32,
            window: None,
            sender_prefix: 0,
            receiver_prefix: 0,
            requests: 2,
            ranks: 1,
            prefill_per_chunk: StdDuration::from_millis(20),
            mode: TransferMode::Pipelined,
            corrupt_one_byte: false,
            compute: SimulatedCompute::Sleep,
        }
    }
}

/// Receiver memory below which the demo also checks content and untouched blocks.
const THOROUGH_BYTES: u64 = 96 << 20;

impl DemoConfig {
    /// The workload it runs.
    pub fn workload(&self) -> Workload {
        let groups = self.model.groups(self.window);
        let requests = (0..self.requests)
            .map(|i| RequestPlan {
                sender_prefix: self.sender_prefix,
                receiver_prefix: self.receiver_prefix,
                ..RequestPlan::new(u64::from(i) + 1, self.prompt_tokens, self.chunk_tokens)
            })
            .collect();
        let thorough = self.kv_bytes() <= THOROUGH_BYTES;
        let mut deadlines = suite_deadlines();
        deadlines.result_wait = Duration::from_secs(600);
        deadlines.registration = Duration::from_secs(600);
        deadlines.write_completion = Duration::from_secs(60);
        // Each rank's engine computes its chunks on the thread that drives its endpoints, and
        // ranks share the machine's cores: on a busy machine a rank may not get to answer for
        // seconds. Peers here are never lost, so only deadlines far past that are useful.
        deadlines.handshake = Duration::from_secs(60);
        deadlines.liveness_timeout = Duration::from_secs(60);
        deadlines.aux_wait = Duration::from_secs(60);
        deadlines.result_idle = Duration::from_secs(120);
        Workload {
            tokens_per_block: self.tokens_per_block,
            groups,
            receiver_pool_split: None,
            spare_slots: 1,
            slot_order_seed: None,
            allocation: AllocationStyle::FullPrompt,
            requests,
            prefill_per_chunk: self.prefill_per_chunk,
            mode: self.mode,
            layer_order: self.model.layer_order(),
            deadlines,
            faults: FaultPlan::default(),
            receiver_versions: None,
            verify_content: thorough,
            check_untouched: thorough,
            corrupt_one_byte: self.corrupt_one_byte,
            compute: self.compute,
            time_limit: StdDuration::from_secs(600),
        }
    }

    /// KV bytes of all requests' prompts (one side).
    pub fn kv_bytes(&self) -> u64 {
        let blocks = u64::from(self.prompt_tokens.div_ceil(self.tokens_per_block.max(1)));
        let per_block: u64 = self
            .model
            .groups(self.window)
            .iter()
            .map(|g| {
                u64::from(g.layers)
                    * u64::from(g.kv_factor)
                    * u64::from(g.kv_heads)
                    * u64::from(g.head_dim)
                    * u64::from(g.elem_bytes)
                    * u64::from(self.tokens_per_block)
            })
            .sum();
        blocks * per_block * u64::from(self.requests)
    }
}

/// The demo's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DemoSummary {
    /// Transport name.
    pub transport: String,
    /// Model name.
    pub model: String,
    /// Pipelined or monolithic.
    pub mode: String,
    /// Requests per rank.
    pub requests: u32,
    /// Ranks.
    pub ranks: u32,
    /// Requests (over all ranks) that completed on both sides.
    pub completed: u32,
    /// Prompt tokens per request.
    pub prompt_tokens: u32,
    /// Chunk length.
    pub chunk_tokens: u32,
    /// KV bytes written into the receiver.
    pub bytes: u64,
    /// Chunks submitted.
    pub chunks: u64,
    /// Write batches.
    pub write_batches: u64,
    /// Wall time from the first chunk to the last completion.
    pub seconds: f64,
    /// Bytes per second while the transport was moving bytes, in GB/s (per rank: ranks copy
    /// side by side): bytes over [`copy_busy_time`], the time at least one batch was copying,
    /// so batches copying at once count once.
    pub transfer_gbps: f64,
    /// Median time the transport took to move one write batch's bytes.
    pub chunk_transfer_ms: f64,
    /// Copy time of the last chunk's write batches (the chunk whose batch was issued last,
    /// with nothing else running): one batch, or in layer slices every range's batch summed,
    /// i.e. the chunk's whole transfer.
    pub last_chunk_transfer_ms: f64,
    /// Copy time of the write batch issued last alone (with layer slices: the last range's).
    pub last_batch_transfer_ms: f64,
    /// Median over requests of the exposed tail: last chunk computed (the sender's
    /// `last_chunk`) → receiver complete (the receiver's `ended`), both sides' timings on the
    /// run's one clock ([`TransferTimings::exposed_tail`]). For an even count of requests the
    /// mean of the middle two ([`median`]).
    pub exposed_tail_ms: f64,
    /// Largest exposed tail.
    pub max_exposed_tail_ms: f64,
    /// The p50 of the exposed tail over requests: the median, the same figure as
    /// `exposed_tail_ms` (the table's "p50").
    pub exposed_tail_p50_ms: f64,
    /// The p99 of the exposed tail over requests, nearest rank ([`percentile`]): with fewer
    /// than 100 requests, the largest.
    pub exposed_tail_p99_ms: f64,
    /// The p50 over requests of the transfer time, first byte sent → last byte landed
    /// ([`TransferTimings::transfer_time`]): the median, as `exposed_tail_p50_ms`.
    pub transfer_p50_ms: f64,
    /// The p99 of the transfer time, nearest rank ([`percentile`]).
    pub transfer_p99_ms: f64,
    /// Where the exposed tail of the request whose last chunk came last went (`None` when it
    /// did not complete).
    pub last_tail_parts: Option<TailParts>,
    /// Destination bytes compared against the sender's.
    pub bytes_verified: u64,
    /// Destination blocks that differ.
    pub mismatched_blocks: u64,
    /// Whether the expected content and untouched blocks were checked too.
    pub thorough_checks: bool,
    /// Every request completed and every byte matched.
    pub verified: bool,
}

/// The exposed tail of one request in four consecutive parts, in microseconds (on the run's
/// one clock): its sum is the tail. The last write batch is the request's own last batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TailParts {
    /// Last chunk submitted → its write batch issued to the transport (the core's planning,
    /// block queries and admission).
    pub submit_us: f64,
    /// The transport's own copy time of the last batch (started → seen finished; for a
    /// batch issued before its compute ended, that end → seen finished).
    pub copy_us: f64,
    /// Batch issued → its outcome reached the sender, less the copy time: starting the
    /// copy, seeing it finish and handing the report to the driver (for a batch issued before
    /// its compute ended: seen finished → outcome at the sender).
    pub report_us: f64,
    /// Outcome at the sender → decode side complete (the result frame, aux data, the
    /// receiver's completion).
    pub complete_us: f64,
}

/// The [`TailParts`] of the request whose last chunk was computed last, split at that
/// request's own last write batch: the last batch paired with one of its chunks on its lane of
/// the timeline (a lane is one request on one rank, so another request's or rank's batch can
/// never stand in). `None` when the request did not complete or its batches could not be
/// paired with its chunks (see [`super::timeline`]).
fn last_tail_parts(report: &RunReport) -> Option<TailParts> {
    // The lanes follow the requests one for one (plan order, rank by rank).
    tail_parts_of_last(
        report
            .requests
            .iter()
            .zip(&report.timeline.lanes)
            .filter_map(|(r, lane)| {
                let t = r.transfer_timings()?;
                Some((t.sender.last_chunk?, t.receiver.ended, lane))
            }),
    )
}

/// Of `requests` (last chunk computed, decode side complete, its lane), the [`TailParts`] of
/// the one computed last, split at the last batch of its own lane.
fn tail_parts_of_last<'a>(
    requests: impl Iterator<Item = (Instant, Instant, &'a Lane)>,
) -> Option<TailParts> {
    let us = |d: Duration| d.as_nanos() as f64 / 1e3;
    let (computed, ended, lane) = requests.max_by_key(|&(computed, _, _)| computed)?;
    let (chunk, batch) = lane
        .chunks
        .iter()
        .filter_map(|c| Some((c, c.batch?)))
        .max_by_key(|(_, b)| b.issued)?;
    // A batch issued before the tail began is the last range's only if that range was handed
    // over behind a fence (its compute ended when the tail began); else it is an earlier
    // range's and the last range wrote nothing.
    if (batch.issued < computed && chunk.computed < computed) || batch.reported > ended {
        return None;
    }
    if batch.issued < computed {
        // Issued before its compute ended (a fenced range): the copy counts from that end to
        // when it was seen done, and nothing is left of the submission.
        return Some(TailParts {
            submit_us: 0.0,
            copy_us: us(batch.copied - computed),
            report_us: us(batch.reported - batch.copied.max(computed)),
            complete_us: us(ended - batch.reported),
        });
    }
    let handoff = batch.reported - batch.issued;
    Some(TailParts {
        submit_us: us(batch.issued - computed),
        copy_us: us(batch.transfer),
        report_us: (us(handoff) - us(batch.transfer)).max(0.0),
        complete_us: us(ended - batch.reported),
    })
}

/// How long at least one write batch was copying: the length of the union of the batches'
/// copy intervals, each placed at its issue (`[issued, issued + transfer]`: the transport
/// times its own copy but not when it began, which lies between the issue and the report).
/// Batches that overlap (several connections or copy workers) count once, so bytes over this
/// time can never fall below bytes over the run's wall time. Every batch must be on one clock
/// (one rank's run).
pub fn copy_busy_time(batches: &[BatchTiming]) -> Duration {
    let mut spans: Vec<(Instant, Instant)> = batches
        .iter()
        .map(|b| (b.issued, b.issued + b.transfer))
        .collect();
    spans.sort_unstable();
    let mut busy = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (start, end) in spans {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                busy = busy + (e - s);
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = current {
        busy = busy + (e - s);
    }
    busy
}

fn ms(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}

/// The median of `v`: its middle value, or for an even count the mean of the middle two (0
/// for none). Every "median" and every "p50" the demo, `serve` and the benches report is this.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `p`-th percentile of `v` (`p` in 0..=100), nearest rank: the smallest value with at
/// least `p` % of the values at or below it (0 for none). For the reported p99s; a p50 is the
/// [`median`] instead, which differs from the nearest rank's 50th for an even count.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The copy time of the chunk whose write batch was issued last: its batches' copy times
/// summed (several when it went out in layer ranges; from the run's timeline), or the last
/// batch's alone when the batches could not be paired with the chunks.
pub fn last_chunk_transfer(report: &RunReport) -> Option<Duration> {
    Some(
        last_chunk_batches(report)?
            .iter()
            .fold(Duration::ZERO, |sum, b| sum + b.transfer),
    )
}

/// The write batches of the chunk whose batch was issued last, in issue order (several when it
/// went out in layer ranges; from the run's timeline), or the last batch alone when the
/// batches could not be paired with the chunks.
pub fn last_chunk_batches(report: &RunReport) -> Option<Vec<BatchSpan>> {
    let last = report.batch_timings.iter().max_by_key(|t| t.issued)?;
    let lanes = &report.timeline.lanes;
    let owner = lanes.iter().find_map(|l| {
        l.chunks
            .iter()
            .find(|c| c.batch.is_some_and(|b| b.issued == last.issued))
            .map(|c| (l, c.index))
    });
    Some(match owner {
        Some((lane, index)) => lane
            .chunks
            .iter()
            .filter(|c| c.index == index)
            .filter_map(|c| c.batch)
            .collect(),
        None => vec![BatchSpan {
            bytes: last.bytes,
            issued: last.issued,
            reported: last.reported,
            transfer: last.transfer,
            copied: last.copied,
        }],
    })
}

/// Summarises a run. `copy_busy` is how long the transport was copying: each rank's
/// [`copy_busy_time`] (on its own clock), summed over the ranks, so the rate is per rank.
pub fn summarize(
    transport: &str,
    config: &DemoConfig,
    report: &RunReport,
    copy_busy: Duration,
    thorough: bool,
) -> DemoSummary {
    let timings: Vec<TransferTimings> = report
        .requests
        .iter()
        .filter_map(|r| r.transfer_timings())
        .collect();
    let tails: Vec<f64> = timings
        .iter()
        .filter_map(|t| t.exposed_tail().map(ms))
        .collect();
    let transfers: Vec<f64> = timings
        .iter()
        .filter_map(|t| t.transfer_time().map(ms))
        .collect();
    let batch_ms: Vec<f64> = report
        .batch_timings
        .iter()
        .map(|t| ms(t.transfer))
        .collect();
    let busy = copy_busy.as_nanos();
    // The exposed tail's median, reported as `exposed_tail_ms` and as its p50.
    let tail_median = median(tails.clone());
    let copied: u64 = report.batch_timings.iter().map(|t| t.bytes).sum();
    DemoSummary {
        transport: transport.to_string(),
        model: config.model.name().to_string(),
        mode: config.mode.describe(),
        requests: config.requests,
        ranks: config.ranks,
        completed: report
            .requests
            .iter()
            .filter(|r| r.sender.is_completed() && r.receiver.is_completed())
            .count() as u32,
        prompt_tokens: config.prompt_tokens,
        chunk_tokens: config.chunk_tokens,
        bytes: report.bytes,
        chunks: report.chunks,
        write_batches: report.batch_timings.len() as u64,
        seconds: ms(report.finished - report.started) / 1e3,
        transfer_gbps: if busy == 0 {
            0.0
        } else {
            copied as f64 / busy as f64
        },
        chunk_transfer_ms: median(batch_ms),
        last_chunk_transfer_ms: last_chunk_transfer(report).map_or(0.0, ms),
        last_batch_transfer_ms: report
            .batch_timings
            .iter()
            .max_by_key(|t| t.issued)
            .map_or(0.0, |t| ms(t.transfer)),
        exposed_tail_ms: tail_median,
        max_exposed_tail_ms: tails.iter().copied().fold(0.0, f64::max),
        exposed_tail_p50_ms: tail_median,
        exposed_tail_p99_ms: percentile(&tails, 99.0),
        transfer_p50_ms: median(transfers.clone()),
        transfer_p99_ms: percentile(&transfers, 99.0),
        last_tail_parts: last_tail_parts(report),
        bytes_verified: report.requests.iter().map(|r| r.bytes_verified).sum(),
        mismatched_blocks: report
            .requests
            .iter()
            .map(|r| r.mismatched_blocks as u64)
            .sum(),
        thorough_checks: thorough,
        verified: report.verified(),
    }
}

/// Runs the demo over `harness`, calling `progress(done, total)` after every chunk.
pub fn run_demo<H: Harness + Sync>(
    harness: &H,
    config: &DemoConfig,
    progress: impl Fn(u64, u64) + Sync,
) -> Result<(DemoSummary, RunReport), SuiteError> {
    if config.chunk_tokens == 0
        || config.tokens_per_block == 0
        || config.prompt_tokens == 0
        || config.requests == 0
        || config.ranks == 0
    {
        return Err(SuiteError::Check(
            "prompt, chunk and block sizes and the request and rank counts must be positive".into(),
        ));
    }
    if config.sender_prefix > config.prompt_tokens || config.receiver_prefix > config.prompt_tokens
    {
        return Err(SuiteError::Check(
            "a prefix is longer than the prompt".into(),
        ));
    }
    let workload = config.workload();
    let (report, copy_busy) = if config.ranks == 1 {
        let report = run_workload_with(harness, &workload, &progress)?;
        let busy = copy_busy_time(&report.batch_timings);
        (report, busy)
    } else {
        // One thread per rank, each with its own caches and its own connected pair: tensor
        // parallel ranks write their own KV heads to the decode rank of the same index.
        let ranks = u64::from(config.ranks);
        let done = AtomicU64::new(0);
        let reports: Vec<Result<RunReport, SuiteError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..ranks)
                .map(|_| {
                    scope.spawn(|| {
                        let mut seen = 0;
                        run_workload_with(harness, &workload, |d, total| {
                            let now = done.fetch_add(d - seen, Ordering::Relaxed) + d - seen;
                            seen = d;
                            progress(now, total * ranks);
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(SuiteError::Check("a rank's thread panicked".into()))
                    })
                })
                .collect()
        });
        let reports = reports.into_iter().collect::<Result<Vec<_>, _>>()?;
        // Each rank on its own clock: a union across ranks would mix clocks.
        let busy = reports.iter().fold(Duration::ZERO, |sum, r| {
            sum + copy_busy_time(&r.batch_timings)
        });
        (merge(reports), busy)
    };
    let summary = summarize(
        harness.name(),
        config,
        &report,
        copy_busy,
        workload.verify_content,
    );
    record_timings(harness.name(), &report);
    Ok((summary, report))
}

/// Records each completed request's exposed tail and transfer time, from both sides' timings
/// on the run's one clock, in the `view="both"` histograms (a no-op without a recorder).
fn record_timings(transport: &str, report: &RunReport) {
    let transport = transport.to_string();
    let tail = metrics::histogram!(
        names::EXPOSED_TAIL_SECONDS, "view" => "both", "transport" => transport.clone()
    );
    let transfer = metrics::histogram!(
        names::TRANSFER_SECONDS, "view" => "both", "transport" => transport
    );
    for t in report.requests.iter().filter_map(|r| r.transfer_timings()) {
        if let Some(d) = t.exposed_tail() {
            tail.record(d.as_nanos() as f64 / 1e9);
        }
        if let Some(d) = t.transfer_time() {
            transfer.record(d.as_nanos() as f64 / 1e9);
        }
    }
}

/// One report over several ranks' runs. Each rank has its own clock, so the merged run spans
/// from zero to the longest rank's duration; per-request times stay within their rank.
fn merge(reports: Vec<RunReport>) -> RunReport {
    let longest = reports
        .iter()
        .map(|r| r.finished - r.started)
        .max()
        .unwrap_or_default();
    let mut merged = RunReport {
        requests: Vec::new(),
        events: Vec::new(),
        stray_writes: Vec::new(),
        bytes: 0,
        chunks: 0,
        started: Instant::ZERO,
        finished: Instant::ZERO + longest,
        batch_timings: Vec::new(),
        leftover_sessions: 0,
        leftover_writes: 0,
        timeline: Default::default(),
    };
    for (rank, r) in (0u32..).zip(reports) {
        merged.timeline.extend_with_rank(rank, r.timeline);
        merged.requests.extend(r.requests);
        merged.events.extend(r.events);
        merged.stray_writes.extend(r.stray_writes);
        merged.bytes += r.bytes;
        merged.chunks += r.chunks;
        merged.batch_timings.extend(r.batch_timings);
        merged.leftover_sessions += r.leftover_sessions;
        merged.leftover_writes += r.leftover_writes;
    }
    merged
}

#[cfg(test)]
mod tests {
    use kvpipe_core::RequestId;

    use super::super::timeline::ChunkTiming;
    use super::*;

    fn at_us(us: u64) -> Instant {
        Instant::ZERO + Duration::from_micros(us)
    }

    /// A batch issued at `issued` µs that copied for `transfer` µs.
    fn batch(issued: u64, transfer: u64) -> BatchTiming {
        BatchTiming {
            bytes: 1_000,
            issued: at_us(issued),
            transfer: Duration::from_micros(transfer),
            copied: at_us(issued + transfer),
            reported: at_us(issued + transfer + 5),
        }
    }

    fn busy_us(batches: &[BatchTiming]) -> u64 {
        copy_busy_time(batches).as_nanos() / 1_000
    }

    #[test]
    fn copy_busy_time_is_the_union_of_the_batches_copies() {
        assert_eq!(busy_us(&[]), 0);
        // Overlapping: [0, 10] ∪ [5, 20] = [0, 20].
        assert_eq!(busy_us(&[batch(0, 10), batch(5, 15)]), 20);
        // Nested: [0, 30] ⊇ [10, 20], in either order.
        assert_eq!(busy_us(&[batch(10, 10), batch(0, 30)]), 30);
        // Disjoint: [0, 10] and [20, 25].
        assert_eq!(busy_us(&[batch(20, 5), batch(0, 10)]), 15);
        // Touching: [0, 10] and [10, 20] make one span.
        assert_eq!(busy_us(&[batch(0, 10), batch(10, 10)]), 20);
        // A mix: [0, 10] ∪ [5, 8] ∪ [12, 20] ∪ [15, 30] = 10 + 18.
        assert_eq!(
            busy_us(&[batch(15, 15), batch(0, 10), batch(12, 8), batch(5, 3)]),
            28
        );
    }

    #[test]
    fn the_rate_while_copying_is_never_below_the_runs_average() {
        // Four batches copying side by side on four connections during a 110 µs run: their
        // copy times sum to 400 µs, more than the run lasted.
        let batches = [batch(0, 100), batch(2, 100), batch(4, 100), batch(6, 100)];
        let bytes: u64 = batches.iter().map(|b| b.bytes).sum();
        let wall = Duration::from_micros(110);
        let busy = copy_busy_time(&batches);
        assert!(busy <= wall);
        let while_copying = bytes as f64 / busy.as_nanos() as f64;
        let average = bytes as f64 / wall.as_nanos() as f64;
        assert!(
            while_copying >= average,
            "{while_copying} GB/s while copying < {average} GB/s over the run"
        );
    }

    fn lane(rank: u32, request: u64, batches: &[(u64, u64)]) -> Lane {
        Lane {
            rank,
            request: RequestId(request),
            origin: Instant::ZERO,
            chunks: batches
                .iter()
                .zip(0u32..)
                .map(|(&(issued, transfer), index)| ChunkTiming {
                    index,
                    tokens: (index * 64, index * 64 + 64),
                    layers: None,
                    compute_started: at_us(issued.saturating_sub(20)),
                    computed: at_us(issued.saturating_sub(10)),
                    submitted: Some(at_us(issued.saturating_sub(10))),
                    sliced: true,
                    batch: Some(BatchSpan {
                        bytes: 1_000,
                        issued: at_us(issued),
                        reported: at_us(issued + transfer + 5),
                        transfer: Duration::from_micros(transfer),
                        // The copy starts 2 µs after its issue.
                        copied: at_us(issued + transfer + 2),
                    }),
                })
                .collect(),
            last_computed: None,
            completed: None,
        }
    }

    #[test]
    fn the_tail_splits_at_the_last_batch_of_its_own_request() {
        // Request 1 on rank 0 computes last (at 490 µs, its batch issued at 500); request 1 on
        // rank 1 (another clock, same id) issued a batch later (at 900) that must not stand in.
        let mine = lane(0, 1, &[(100, 50), (500, 40)]);
        let other_rank = lane(1, 1, &[(300, 50), (900, 40)]);
        let other_request = lane(0, 2, &[(200, 50), (700, 40)]);
        let parts = tail_parts_of_last(
            [
                (at_us(480), at_us(1_000), &other_request),
                (at_us(490), at_us(600), &mine),
                (at_us(470), at_us(1_000), &other_rank),
            ]
            .into_iter(),
        )
        .unwrap();
        assert_eq!(
            parts,
            TailParts {
                submit_us: 10.0,
                copy_us: 40.0,
                report_us: 5.0,
                complete_us: 55.0,
            }
        );
        assert_eq!(
            parts.submit_us + parts.copy_us + parts.report_us + parts.complete_us,
            110.0
        );
    }

    #[test]
    fn a_range_handed_over_before_its_compute_ended_splits_from_that_end() {
        // The last range's batch was issued at 500 µs behind a fence; its compute ended at 530
        // and the copy was seen done at 542, reported at 545.
        let mut fenced = lane(0, 1, &[(100, 50), (500, 40)]);
        fenced.chunks[1].computed = at_us(530);
        let parts = tail_parts_of_last([(at_us(530), at_us(600), &fenced)].into_iter()).unwrap();
        assert_eq!(
            parts,
            TailParts {
                submit_us: 0.0,
                copy_us: 12.0,
                report_us: 3.0,
                complete_us: 55.0,
            }
        );
        // The same batch under a range computed before the tail began is an earlier range's:
        // the last range wrote nothing, and there are no parts to give.
        fenced.chunks[1].computed = at_us(490);
        assert_eq!(
            tail_parts_of_last([(at_us(530), at_us(600), &fenced)].into_iter()),
            None
        );
    }

    #[test]
    fn no_tail_parts_when_the_requests_batches_were_not_paired() {
        let mut unpaired = lane(0, 1, &[(100, 50)]);
        unpaired.chunks[0].batch = None;
        let paired = lane(1, 1, &[(100, 50)]);
        assert_eq!(
            tail_parts_of_last(
                [
                    (at_us(90), at_us(300), &unpaired),
                    (at_us(80), at_us(300), &paired)
                ]
                .into_iter()
            ),
            None
        );
    }
}
