//! The conformance suite and the demo with both caches' pools in GPU memory (`cuda` feature),
//! over the mem transport (copied by the GPU's copy engines) and the TCP transport (through
//! pinned staging): every scenario's checks read the pools back from the device. Tests that
//! need a GPU are reported as ignored, with the reason ("skipped: no CUDA driver"), where no
//! driver or device is found — never as passed; `scripts/gpu-check` runs them on the GPU
//! machine. One test covers the opposite case: without a driver, a harness asked for device
//! pools fails to connect with "no CUDA driver" (it is ignored where a driver is present). The
//! two-process tests that run the `kvpipe` binary are `kvpipe-cli`'s `tests/gpu.rs`.

use std::time::Duration;

use kvpipe_conformance::suite::demo::{run_demo, DemoConfig, Model};
use kvpipe_conformance::suite::{
    scenarios, Harness, MemHarness, PoolMemory, Scenario, SimulatedCompute, TcpHarness,
    TransferMode,
};
use kvpipe_cuda::{check_driver, Device};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// Why a GPU test is skipped here, if it is.
fn skip_reason() -> Option<String> {
    if let Err(e) = check_driver() {
        return Some(format!("skipped: {e}"));
    }
    Device::open(0).err().map(|e| format!("skipped: {e}"))
}

const DEVICE: PoolMemory = PoolMemory::Device { ordinal: 0 };

fn mem() -> MemHarness {
    MemHarness {
        memory: DEVICE,
        ..MemHarness::default()
    }
}

fn tcp() -> TcpHarness {
    TcpHarness {
        memory: DEVICE,
        ..TcpHarness::blocking(2)
    }
}

fn scenario_trial<H: Harness + Send + 'static>(transport: &str, s: Scenario, h: H) -> Trial {
    Trial::ignorable_test(format!("{transport}::{}", s.name), move || {
        if let Some(reason) = skip_reason() {
            return Ok(Completion::ignored_with(reason));
        }
        match s.run(&h) {
            Ok(Some(_)) => Ok(Completion::Completed),
            Ok(None) => Ok(Completion::ignored_with(format!(
                "skipped: {} cannot inject the faults this scenario needs",
                h.name()
            ))),
            Err(e) => Err(Failed::from(format!("{} over {}: {e}", s.name, h.name()))),
        }
    })
}

/// The demo at a small size, every model, both transports: every byte compared after the
/// pools came back from the device.
fn demo_verifies_every_model_from_device_memory() -> Result<Completion, Failed> {
    if let Some(reason) = skip_reason() {
        return Ok(Completion::ignored_with(reason));
    }
    for (name, model) in Model::ALL {
        let config = DemoConfig {
            model,
            prompt_tokens: 1000,
            chunk_tokens: 96,
            tokens_per_block: 16,
            window: (model == Model::Gemma3Swa).then_some(200),
            requests: 2,
            prefill_per_chunk: Duration::ZERO,
            mode: TransferMode::Pipelined,
            ..DemoConfig::default()
        };
        let runs = [
            ("mem", run_demo(&mem(), &config, |_, _| {})),
            ("tcp", run_demo(&tcp(), &config, |_, _| {})),
        ];
        for (transport, result) in runs {
            let (summary, _) = result.map_err(|e| format!("{name} over {transport}: {e}"))?;
            if !summary.verified || summary.completed != 2 || summary.bytes_verified == 0 {
                return Err(format!("{name} over {transport}: {summary:?}").into());
            }
        }
    }
    Ok(Completion::Completed)
}

/// With the simulated compute on the GPU (a kernel for each layer range's share), every range
/// goes out once its kernel is done and every byte lands; the run takes at least the compute
/// time the kernels stood for. Fenced, each range is handed over while its kernel is queued
/// (over mem its copies wait for the kernel on the GPU; tcp waits on the host): every byte
/// still lands as computed.
fn demo_with_the_gpu_kept_busy_verifies_layer_slices() -> Result<Completion, Failed> {
    if let Some(reason) = skip_reason() {
        return Ok(Completion::ignored_with(reason));
    }
    for fenced in [false, true] {
        let config = DemoConfig {
            prompt_tokens: 1024,
            chunk_tokens: 256,
            tokens_per_block: 16,
            requests: 1,
            prefill_per_chunk: Duration::from_millis(8),
            mode: TransferMode::LayerSlices(4),
            compute: SimulatedCompute::Gpu { ordinal: 0, fenced },
            ..DemoConfig::default()
        };
        for (transport, result) in [
            ("mem", run_demo(&mem(), &config, |_, _| {})),
            ("tcp", run_demo(&tcp(), &config, |_, _| {})),
        ] {
            let (summary, _) =
                result.map_err(|e| format!("over {transport}, fenced {fenced}: {e}"))?;
            if !summary.verified || summary.completed != 1 || summary.seconds < 0.032 {
                return Err(format!("over {transport}, fenced {fenced}: {summary:?}").into());
            }
        }
    }
    Ok(Completion::Completed)
}

/// A corrupted byte is found after the pools came back from the device.
fn verification_reads_the_device_bytes() -> Result<Completion, Failed> {
    if let Some(reason) = skip_reason() {
        return Ok(Completion::ignored_with(reason));
    }
    let config = DemoConfig {
        prompt_tokens: 512,
        chunk_tokens: 96,
        tokens_per_block: 16,
        requests: 1,
        prefill_per_chunk: Duration::ZERO,
        corrupt_one_byte: true,
        ..DemoConfig::default()
    };
    let (summary, _) = run_demo(&mem(), &config, |_, _| {})?;
    if summary.verified || summary.mismatched_blocks == 0 {
        return Err(format!("the flipped byte went unnoticed: {summary:?}").into());
    }
    Ok(Completion::Completed)
}

/// Without a driver a harness asked for device pools cannot connect, and says why.
fn without_a_driver_device_pools_are_refused() -> Result<Completion, Failed> {
    if check_driver().is_ok() {
        return Ok(Completion::ignored_with(
            "skipped: a CUDA driver is present",
        ));
    }
    let config = DemoConfig {
        prompt_tokens: 64,
        chunk_tokens: 32,
        tokens_per_block: 16,
        requests: 1,
        prefill_per_chunk: Duration::ZERO,
        ..DemoConfig::default()
    };
    for err in [
        run_demo(&mem(), &config, |_, _| {}).err(),
        run_demo(&tcp(), &config, |_, _| {}).err(),
    ] {
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        if !message.contains("no CUDA driver") {
            return Err(format!("expected \"no CUDA driver\", got {message:?}").into());
        }
    }
    Ok(Completion::Completed)
}

fn main() {
    let args = Arguments::from_args();
    let mut tests = Vec::new();
    for s in scenarios() {
        tests.push(scenario_trial("mem", s, mem()));
        tests.push(scenario_trial("tcp", s, tcp()));
    }
    tests.push(Trial::ignorable_test(
        "demo_verifies_every_model_from_device_memory",
        demo_verifies_every_model_from_device_memory,
    ));
    tests.push(Trial::ignorable_test(
        "demo_with_the_gpu_kept_busy_verifies_layer_slices",
        demo_with_the_gpu_kept_busy_verifies_layer_slices,
    ));
    tests.push(Trial::ignorable_test(
        "verification_reads_the_device_bytes",
        verification_reads_the_device_bytes,
    ));
    tests.push(Trial::ignorable_test(
        "without_a_driver_device_pools_are_refused",
        without_a_driver_device_pools_are_refused,
    ));
    libtest_mimic::run(&args, tests).exit();
}
