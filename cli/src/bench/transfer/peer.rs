//! `kvpipe bench transfer --memory device --peer-gpu N`: the peer-copy data path across two
//! processes (`kvpipe-tcp` with `TcpDataPath::PeerCopy`) against `cuda-memcpy-peer`.
//!
//! Each run starts this program twice: `serve --memory device --gpu N --data-path peer-copy`
//! (the decode side, which pulls every write from the prefill side's pools, exported by CUDA
//! IPC) and `demo --connect --memory device --gpu G --data-path peer-copy --chunk-tokens T`
//! with the whole `--tokens` prompt as one chunk, so the request's KV (llama3-8b, 128 KiB per
//! token) is one write batch: the transport's time is the prefill side's `transfer_p50_ms` of
//! that batch (handed to the transport → every piece pulled by the decode side and
//! acknowledged), and the decode side verifies
//! every byte after reading its pools back. The baseline, in this process, copies the same
//! number of bytes from a buffer on GPU G to one on GPU N in the transport's pieces
//! (`TcpConfig::max_piece_bytes`), one `cuMemcpyDtoDAsync` per piece on one stream, then one
//! synchronize: on one GPU a device copy, across GPUs (unified addressing) a peer copy. Figures
//! are medians over `--runs`; `ratio` is the median of the runs' own ratios (baseline time /
//! transport time).

use std::process::ExitCode;

use crate::CliError;

/// Without the `cuda` feature there is no device memory to measure.
#[cfg(not(feature = "cuda"))]
pub(super) fn run(_args: super::TransferBenchArgs, _peer_gpu: usize) -> Result<ExitCode, CliError> {
    Err(crate::NEEDS_CUDA.into())
}

#[cfg(feature = "cuda")]
pub(super) use gpu::run;

#[cfg(feature = "cuda")]
mod gpu {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    use std::time::Instant;

    use kvpipe_conformance::suite::demo::median;
    use kvpipe_cuda::{Device, DeviceBuffer, Stream};
    use serde::Serialize;

    use super::super::TransferBenchArgs;
    use super::{CliError, ExitCode};

    #[derive(Debug, Serialize)]
    struct PeerTransferReport {
        transport: &'static str,
        data_path: &'static str,
        memory: &'static str,
        gpu: usize,
        peer_gpu: usize,
        processes: u32,
        bytes: u64,
        seconds: f64,
        gbps: f64,
        baseline: &'static str,
        baseline_seconds: f64,
        baseline_gbps: f64,
        ratio: f64,
        ratio_of_medians: f64,
        verified: bool,
        model: &'static str,
        tokens: u32,
        piece_bytes: u64,
        runs: u32,
        transport_runs_s: Vec<f64>,
        baseline_runs_s: Vec<f64>,
    }

    fn json_of(text: &[u8], who: &str, err: &str) -> Result<serde_json::Value, CliError> {
        let text = String::from_utf8_lossy(text);
        let line = text
            .lines()
            .find(|l| l.starts_with('{'))
            .ok_or_else(|| format!("{who} printed no report: {text} {err}"))?;
        Ok(serde_json::from_str(line)?)
    }

    /// One transfer through two processes: (seconds of the one write batch, verified, bytes).
    fn one_run(args: &TransferBenchArgs, peer_gpu: usize) -> Result<(f64, bool, u64), CliError> {
        let exe = std::env::current_exe()?;
        let tokens = args.tokens.to_string();
        let workload = |gpu: usize| -> Vec<String> {
            [
                "--model",
                "llama3-8b",
                "--prompt-tokens",
                &tokens,
                "--tokens-per-block",
                &args.tokens_per_block.to_string(),
                "--requests",
                "1",
                "--memory",
                "device",
                "--gpu",
                &gpu.to_string(),
                "--data-path",
                "peer-copy",
                "--json",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect()
        };
        let mut serve = Command::new(&exe)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--accept-timeout-s",
                "120",
            ])
            .args(workload(peer_gpu))
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
            if let Some(a) = line.trim().strip_prefix("kvpipe serve: listening on ") {
                break a.to_string();
            }
        };
        let drain = std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = errors.read_to_string(&mut rest);
            rest
        });
        let demo = Command::new(&exe)
            .args(["demo", "--transport", "tcp", "--connect", &addr])
            .args(["--prefill-ms-per-chunk", "0", "--chunk-tokens", &tokens])
            .args(workload(args.gpu()))
            .output()?;
        let served = serve.wait_with_output()?;
        let serve_err = drain.join().unwrap_or_default();
        let decode = json_of(&served.stdout, "serve", &serve_err)?;
        let prefill = json_of(&demo.stdout, "demo", &String::from_utf8_lossy(&demo.stderr))?;
        if prefill["data_path"] != "peer-copy" || prefill["chunks"] != 1 {
            return Err(format!("not one peer-copy batch: {prefill}").into());
        }
        let ms = prefill["transfer_p50_ms"].as_f64().unwrap_or(f64::NAN);
        let verified =
            decode["verified"] == true && served.status.success() && demo.status.success();
        Ok((ms / 1e3, verified, decode["bytes"].as_u64().unwrap_or(0)))
    }

    /// `bytes` from GPU `gpu` to GPU `peer_gpu` in `piece` pieces: seconds.
    fn baseline(
        stream: &Stream,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        bytes: u64,
        piece: u64,
    ) -> Result<f64, CliError> {
        let start = Instant::now();
        let mut at = 0;
        while at < bytes {
            let len = piece.min(bytes - at);
            // SAFETY: both buffers are this function's caller's, `bytes` long at least, and not
            // touched by anything else until the synchronize below.
            unsafe { stream.copy_dtod(dst.ptr() + at, src.ptr() + at, len as usize) }?;
            at += len;
        }
        stream.synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    }

    pub(in super::super) fn run(
        args: TransferBenchArgs,
        peer_gpu: usize,
    ) -> Result<ExitCode, CliError> {
        let device = Device::open(args.gpu())?;
        let peer = Device::open(peer_gpu)?;
        let bytes = u64::from(args.tokens) * (128 << 10);
        let piece = kvpipe_tcp::TcpConfig::default().max_piece_bytes;
        let src = DeviceBuffer::new(&device, bytes as usize)?;
        let dst = DeviceBuffer::new(&peer, bytes as usize)?;
        let stream = Stream::new(&device)?;
        baseline(&stream, &src, &dst, bytes, piece)?;
        let (mut t, mut b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let mut verified = true;
        for _ in 0..args.runs.max(1) {
            let (secs, ok, moved) = one_run(&args, peer_gpu)?;
            verified &= ok && moved == bytes;
            let base = baseline(&stream, &src, &dst, bytes, piece)?;
            t.push(secs);
            b.push(base);
            ratios.push(base / secs);
        }
        let (seconds, baseline_seconds) = (median(t.clone()), median(b.clone()));
        let gb = |s: f64| bytes as f64 / s / 1e9;
        let report = PeerTransferReport {
            transport: "tcp",
            data_path: "peer-copy",
            memory: "device",
            gpu: args.gpu(),
            peer_gpu,
            processes: 2,
            bytes,
            seconds,
            gbps: gb(seconds),
            baseline: "cuda-memcpy-peer",
            baseline_seconds,
            baseline_gbps: gb(baseline_seconds),
            ratio: median(ratios),
            ratio_of_medians: baseline_seconds / seconds,
            verified,
            model: "llama3-8b",
            tokens: args.tokens,
            piece_bytes: piece,
            runs: args.runs.max(1),
            transport_runs_s: t,
            baseline_runs_s: b,
        };
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "peer copies, GPU {} → GPU {} across two processes: {} bytes in {:.3} ms = {:.1} GB/s; \
                 cuda-memcpy-peer {:.3} ms = {:.1} GB/s; ratio {:.3}; verified: {}",
                report.gpu,
                report.peer_gpu,
                bytes,
                seconds * 1e3,
                report.gbps,
                baseline_seconds * 1e3,
                report.baseline_gbps,
                report.ratio,
                verified
            );
        }
        Ok(if verified {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}
