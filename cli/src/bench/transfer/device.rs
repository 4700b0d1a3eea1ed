//! `kvpipe bench transfer --transport mem --memory device`: the mem bench's request with both
//! sides' KV pools in device memory (GPU 0), moved through the real sessions and the
//! transport's copy worker, which hands each write batch to the GPU's copy engine
//! (`kvpipe-cuda`: async copies on its own streams, completion through CUDA events). The
//! baseline, `cuda-memcpy-d2d`, is `cuMemcpyDtoDAsync` of the same coalesced extents (planned
//! by the same planner) issued back to back on one stream, then one stream synchronize — the
//! fastest a hand-written loop gets. One untimed warm-up of each, then `--runs` rounds, the
//! transport and the baseline back to back in alternating order; `ratio` is the median of the
//! runs' own ratios. Every run zeroes the destination first and verifies every copied byte
//! after the transport's copy (read back to the host). While a transfer runs the bench polls the
//! driver (`MemPair::pump` in a loop, as an engine's busy loop would, and as the baseline's
//! `cuStreamSynchronize` spins); `--driver-wait block` sleeps in `drive_until` instead, on the
//! copy worker's reports. `copy_span_runs_s` is, per run, from the first batch's issue to the
//! last batch's copy end as the copy worker saw it; `start_lag_runs_s` and `end_lag_runs_s` are
//! the time from the first chunk's submission to the first copy's start and from the last
//! copy's end to the receiver's completion: what the sessions, frames and reports add around
//! the copies. Needs a kvpipe built with the `cuda` feature; without a driver it fails with "no
//! CUDA driver".

use std::process::ExitCode;

use crate::CliError;

/// Without the `cuda` feature there is no device memory to measure.
#[cfg(not(feature = "cuda"))]
pub(super) fn run(_args: super::TransferBenchArgs) -> Result<ExitCode, CliError> {
    Err(crate::NEEDS_CUDA.into())
}

#[cfg(feature = "cuda")]
pub(super) use gpu::run;

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::{Duration, Instant};

    use kvpipe_conformance::cache::fill_filler;
    use kvpipe_conformance::suite::demo::median;
    use kvpipe_core::session::LocalHello;
    use kvpipe_core::wire::{AuxData, Topology};
    use kvpipe_core::{
        Event, InstanceId, LayerGroupLayout, ReceiverConfig, RegionId, RequestId, SenderConfig,
        SenderInput, WritePlan,
    };
    use kvpipe_cuda::{Device, DeviceBuffer, Stream};
    use kvpipe_mem::{Endpoint, MemPair, PairConfig, RegionUse, RECEIVER_PEER, SENDER_PEER};
    use serde::Serialize;

    use super::super::{
        chunks, layout, mem_available, register_and_open, sender_plans, slots, ContiguousSource,
        TransferBenchArgs,
    };
    use super::{CliError, ExitCode};

    /// The figures `kvpipe bench transfer --memory device` prints.
    #[derive(Debug, Serialize)]
    struct DeviceTransferReport {
        transport: String,
        memory: &'static str,
        device: String,
        bytes: u64,
        seconds: f64,
        gbps: f64,
        baseline: &'static str,
        baseline_seconds: f64,
        baseline_gbps: f64,
        /// Median over runs of each run's own ratio (baseline time / transport time).
        ratio: f64,
        /// `gbps / baseline_gbps`.
        ratio_of_medians: f64,
        verified: bool,
        model: &'static str,
        tokens: u32,
        chunk_tokens: u32,
        write_batches: u32,
        /// Extents of all plans (after the planner's coalescing): the baseline's copies.
        extents: usize,
        runs: u32,
        memory_limited: bool,
        /// Every timed run's seconds: transport, baseline, and the transport's copy span.
        transport_runs_s: Vec<f64>,
        baseline_runs_s: Vec<f64>,
        copy_span_runs_s: Vec<f64>,
        /// Per run: from the first chunk's submission to the first batch's copy start, and
        /// from the last batch's copy end (as the copy worker saw it) to the receiver's
        /// completion.
        start_lag_runs_s: Vec<f64>,
        end_lag_runs_s: Vec<f64>,
        /// How the bench waited for the completion: `poll` (pump in a loop) or `block`
        /// (`drive_until`, sleeping on the copy worker's reports).
        driver_wait: String,
    }

    /// The baseline: `cuMemcpyDtoDAsync` of every extent of every plan on one stream, then one
    /// synchronize; returns the seconds from the first enqueue to the synchronize's return.
    fn baseline_run(
        stream: &Stream,
        src: &DeviceBuffer,
        dst: &mut DeviceBuffer,
        plans: &[WritePlan],
    ) -> Result<f64, CliError> {
        dst.fill(0)?;
        let t0 = Instant::now();
        for e in plans.iter().flat_map(|p| p.extents()) {
            // SAFETY: the planner's extents lie inside both pools (the transport's resolve
            // checks the same extents against the same sizes); nothing else touches the
            // buffers until the synchronize below returns.
            unsafe {
                stream.copy_dtod(
                    dst.ptr() + e.dst_offset,
                    src.ptr() + e.src_offset,
                    e.len as usize,
                )
            }?;
        }
        stream.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Whether every extent's destination bytes equal the source's (read back in pieces).
    fn verify(src: &[u8], dst: &DeviceBuffer, plans: &[WritePlan]) -> Result<bool, CliError> {
        const PIECE: usize = 64 << 20;
        let mut buf = vec![0u8; PIECE];
        for e in plans.iter().flat_map(|p| p.extents()) {
            let (s, d, n) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
            let mut done = 0;
            while done < n {
                let take = (n - done).min(PIECE);
                dst.download(d + done, &mut buf[..take])?;
                if buf[..take] != src[s + done..s + done + take] {
                    return Ok(false);
                }
                done += take;
            }
        }
        Ok(true)
    }

    pub(in super::super) fn run(args: TransferBenchArgs) -> Result<ExitCode, CliError> {
        if args.transport != "mem" {
            return Err(format!(
                "--memory device is measured over --transport mem or tcp (not {:?})",
                args.transport
            )
            .into());
        }
        kvpipe_cuda::check_driver()?;
        let device = Device::open(0)?;
        let name = device.name()?;
        let tpb = args.tokens_per_block.max(1);
        let chunk_tokens = args.chunk_tokens.max(tpb) / tpb * tpb;
        let src_layout = layout(1, tpb);
        let dst_layout = layout(2, tpb);
        let slot_bytes = src_layout.pools[0].slot_bytes;
        let per_token = slot_bytes / u64::from(tpb);
        // Both pools on the GPU, the source's content once on the host (for filling and
        // verifying).
        let mut tokens = args.tokens.max(1);
        let mut memory_limited = false;
        let (free, _) = device.memory_info()?;
        let mut budget = (free as u64).saturating_sub(1 << 30) / 2;
        if let Some(avail) = mem_available() {
            budget = budget.min(avail.saturating_sub(1 << 30));
        }
        if u64::from(tokens) * per_token > budget {
            tokens = ((budget / per_token) as u32 / chunk_tokens * chunk_tokens).max(chunk_tokens);
            memory_limited = true;
        }
        let blocks = tokens.div_ceil(tpb);
        let pool_bytes = (u64::from(blocks) * slot_bytes) as usize;
        let mut host_src = vec![0u8; pool_bytes];
        fill_filler(RegionId(1), 0, &mut host_src);
        let mut src = DeviceBuffer::new(&device, pool_bytes)?;
        src.upload(0, &host_src)?;
        let mut dst = DeviceBuffer::new(&device, pool_bytes)?;
        dst.fill(1)?;

        let hello = |i, l: &LayerGroupLayout| {
            LocalHello::new(InstanceId(i), Topology::default(), vec![l.clone()])
        };
        let mut pair = MemPair::new(PairConfig::new(
            SenderConfig::new(hello(1, &src_layout)),
            ReceiverConfig::new(hello(2, &dst_layout), 11),
        ))?;
        let (kv, ordinal) = (RegionUse::KvPool, device.ordinal());
        // SAFETY: `src` and `dst` outlive `pair` (dropped before them below) and are only
        // touched here between transfers (zeroing, the baseline and verification happen after
        // both sides quiesced, when no write batch is in flight).
        unsafe {
            let (s, d) = ((src.ptr(), src.len()), (dst.ptr(), dst.len()));
            pair.register_device(Endpoint::Sender, RegionId(1), kv, ordinal, s.0, s.1)?;
            pair.register_device(Endpoint::Receiver, RegionId(2), kv, ordinal, d.0, d.1)?;
        }
        pair.connect()?;
        pair.drive_until(Duration::from_secs(10), |p| {
            p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
        })
        .map_err(|e| format!("handshake: {e}"))?;

        // The plans the sender makes, for the baseline and the verification.
        let specs = chunks(tokens, chunk_tokens);
        let plans = sender_plans(&src_layout, &dst_layout, &specs, blocks, tpb)?;
        let anchored = slots(blocks);
        let bytes: u64 = plans.iter().map(WritePlan::total_bytes).sum();
        let extents = plans.iter().map(WritePlan::len).sum();

        let stream = Stream::new(&device)?;
        let mut source = ContiguousSource { blocks };
        let runs = args.runs.max(1);
        let (mut t_transport, mut t_baseline, mut t_span) = (Vec::new(), Vec::new(), Vec::new());
        let (mut t_start_lag, mut t_end_lag) = (Vec::new(), Vec::new());
        let mut verified = true;
        // Round 0 warms both paths up (stream and event creation, first copies) untimed.
        for round in 0..=runs {
            let request = RequestId(u64::from(round) + 1);
            if round % 2 == 1 {
                t_baseline.push(baseline_run(&stream, &src, &mut dst, &plans)?);
            }
            dst.fill(0)?;
            register_and_open(
                &mut pair,
                request,
                tokens,
                vec![anchored.clone()],
                None,
                true,
            )?;
            // Only this round's batches are timed below.
            drop(pair.take_batch_timings());
            let t0 = Instant::now();
            let t0_core = pair.now();
            for spec in &specs {
                let now = pair.now();
                pair.sender_mut()
                    .submit_chunk(now, request, *spec, &mut source)?;
                pair.pump()?;
            }
            let now = pair.now();
            pair.sender_mut().handle_input(SenderInput::Aux {
                now,
                request,
                data: AuxData {
                    prompt_tokens: tokens,
                    ..AuxData::default()
                },
            })?;
            let mut completed = false;
            let mut failed = None;
            let mut quiesced = 0;
            let mut seen = |p: &mut MemPair| {
                for (side, _, e) in p.take_events() {
                    match e {
                        Event::Completed { .. } if side == Endpoint::Receiver => completed = true,
                        Event::Failed { .. } | Event::TimedOut { .. } => {
                            failed = Some(format!("{side:?}: {e:?}"))
                        }
                        Event::Quiesced { .. } => quiesced += 1,
                        _ => {}
                    }
                }
                completed || failed.is_some()
            };
            if args.driver_wait() == "block" {
                pair.drive_until(Duration::from_secs(600), seen)
                    .map_err(|e| format!("transfer: {e}"))?;
            } else {
                // Poll the driver, as an engine's busy loop would (and as the baseline's
                // stream synchronize spins), within the same deadline.
                let limit = Instant::now() + Duration::from_secs(600);
                loop {
                    pair.pump()?;
                    if seen(&mut pair) {
                        break;
                    }
                    if Instant::now() > limit {
                        return Err("transfer: no completion within 600 s".into());
                    }
                    std::hint::spin_loop();
                }
            }
            let end_core = pair.now();
            let elapsed = t0.elapsed().as_secs_f64();
            if let Some(f) = failed {
                return Err(format!("the transfer failed: {f}").into());
            }
            pair.drive_until(Duration::from_secs(10), |p| {
                quiesced += p
                    .take_events()
                    .iter()
                    .filter(|(_, _, e)| matches!(e, Event::Quiesced { .. }))
                    .count();
                quiesced >= 2
            })
            .map_err(|e| format!("quiesce: {e}"))?;
            let now = pair.now();
            pair.sender_mut().retire(now, request)?;
            pair.receiver_mut().retire(now, request)?;
            let timings = &pair.take_batch_timings();
            let secs = |d: kvpipe_core::Duration| d.as_nanos() as f64 / 1e9;
            let (span, start_lag, end_lag) = match (
                timings.iter().map(|t| t.issued).min(),
                timings.iter().map(|t| t.copy_started).min(),
                timings.iter().map(|t| t.copy_finished).max(),
            ) {
                (Some(issued), Some(first), Some(last)) => (
                    secs(last.saturating_duration_since(issued)),
                    secs(first.saturating_duration_since(t0_core)),
                    secs(end_core.saturating_duration_since(last)),
                ),
                _ => (0.0, 0.0, 0.0),
            };
            verified &= verify(&host_src, &dst, &plans)?;
            if round > 0 {
                t_transport.push(elapsed);
                t_span.push(span);
                t_start_lag.push(start_lag);
                t_end_lag.push(end_lag);
            }
            if round % 2 == 0 {
                let t = baseline_run(&stream, &src, &mut dst, &plans)?;
                if round > 0 {
                    t_baseline.push(t);
                }
            }
        }
        drop(pair);
        let paired_ratio = median(
            t_transport
                .iter()
                .zip(&t_baseline)
                .map(|(t, b)| b / t)
                .collect(),
        );
        let seconds = median(t_transport.clone());
        let baseline_seconds = median(t_baseline.clone());
        let gbps = bytes as f64 / seconds / 1e9;
        let baseline_gbps = bytes as f64 / baseline_seconds / 1e9;
        let driver_wait = args.driver_wait().to_string();
        let report = DeviceTransferReport {
            transport: args.transport,
            memory: "device",
            device: name,
            bytes,
            seconds,
            gbps,
            baseline: "cuda-memcpy-d2d",
            baseline_seconds,
            baseline_gbps,
            ratio: paired_ratio,
            ratio_of_medians: gbps / baseline_gbps,
            verified,
            model: "llama3-8b",
            tokens,
            chunk_tokens,
            write_batches: plans.len() as u32,
            extents,
            runs,
            memory_limited,
            transport_runs_s: t_transport,
            baseline_runs_s: t_baseline,
            copy_span_runs_s: t_span,
            start_lag_runs_s: t_start_lag,
            end_lag_runs_s: t_end_lag,
            driver_wait,
        };
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "transfer over {} in device memory ({}): {} bytes ({} tokens of llama3-8b KV, {} batches) in {:.6} s = {:.1} GB/s",
                report.transport, report.device, bytes, tokens, report.write_batches, seconds, gbps
            );
            println!(
                "baseline cuMemcpyDtoDAsync of the same {extents} extents on one stream: {baseline_seconds:.6} s = {baseline_gbps:.1} GB/s"
            );
            println!(
                "ratio {:.3} (target ≥ 0.9), verified: {verified}{}",
                report.ratio,
                if memory_limited {
                    " (prompt shortened to fit memory)"
                } else {
                    ""
                }
            );
        }
        Ok(if verified {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}
