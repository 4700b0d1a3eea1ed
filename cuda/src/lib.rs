//! # kvpipe-cuda
//!
//! GPU memory for kvpipe's transports, on the CUDA driver API through
//! [cudarc](https://docs.rs/cudarc) with dynamic loading: the crate builds on machines with no
//! CUDA installed and loads libcuda when first used. Every byte-moving crate uses it behind its
//! own `cuda` feature.
//!
//! - [`check_driver`]: whether the driver can be loaded. Without one every function returns
//!   [`CudaError::NoDriver`] (message "no CUDA driver") — never a panic, although cudarc's own
//!   context constructor panics when libcuda is missing.
//! - [`Device`]: one GPU through its primary context (shared with the CUDA runtime and the
//!   frameworks, so their pointers work here).
//! - [`DeviceBuffer`] and [`PinnedBuffer`]: device memory and page-locked host memory;
//!   [`Uploader`]: many host → device uploads through page-locked staging, waited for once.
//! - [`CopyEngine`]: lists of [`CopyExtent`]s (device → device, host ↔ device, and peer copies
//!   between GPUs) merged where contiguous and copied asynchronously on the engine's own
//!   streams; a [`CopyTicket`] per submission reports completion through CUDA events, polled or
//!   waited for with a deadline. No call synchronizes a whole device. A [`Fence`] recorded on
//!   an engine's stream (its forward pass) makes a submission's copies start on the GPU right
//!   after the work before it, with no host round trip between.
//! - [`export_dmabuf`] / [`DeviceBuffer::export_dmabuf`]: device memory as a dmabuf file
//!   descriptor, offset and length (`cuMemGetHandleForAddressRange`), for RDMA registration.
//! - [`export_ipc`] / [`DeviceBuffer::export_ipc`] → [`IpcHandle`] → [`IpcMapping::open`]:
//!   device memory of one process opened by another on the same host (CUDA IPC), for copies
//!   straight into it (peer copies when the two processes use different GPUs).
//! - [`BusyKernel`]: a kernel that keeps the GPU busy for a given time, the simulated compute
//!   of the demo's device runs (a serving engine's GPU is busy while it streams KV).
//!
//! ## Tests that need a GPU
//!
//! Tests that need a GPU live in `tests/gpu.rs` (and in the transports' `tests/gpu.rs`), built
//! with a small harness ([libtest-mimic](https://docs.rs/libtest-mimic)) instead of the
//! built-in one. Before running, each test asks [`check_driver`] and, for a device, opens
//! device 0; when either fails the test is reported as **ignored** with the reason — "skipped:
//! no CUDA driver" on a machine without the driver — so `cargo test` counts it among the
//! ignored tests, never among the passed ones. On a machine with a GPU the same binaries run
//! every test for real. `scripts/gpu-check` runs them on the GPU machine and prints one JSON
//! line per test and per figure.
//!
//! ```
//! match kvpipe_cuda::check_driver() {
//!     Ok(()) => println!("{} CUDA device(s)", kvpipe_cuda::device_count().unwrap_or(0)),
//!     Err(e) => println!("{e}"), // "no CUDA driver" on a machine without one
//! }
//! ```

mod busy;
mod device;
mod dmabuf;
mod engine;
mod error;
mod fence;
mod ipc;
mod memory;
mod poll;
mod ptx;
mod stream;
mod upload;

pub use busy::BusyKernel;
pub use device::{check_driver, device_count, driver_version, Device};
pub use dmabuf::{dmabuf_window, export_dmabuf, host_page_size, Dmabuf};
pub use engine::{
    coalesce, least_loaded, CopyEngine, CopyExtent, CopyOp, CopyTicket, Direction, Memory,
    COPY_KERNEL_ENV,
};
pub use error::CudaError;
pub use fence::Fence;
pub use ipc::{export_ipc, IpcHandle, IpcMapping, IPC_DRIVER_HANDLE_LEN, IPC_HANDLE_LEN};
pub use memory::{DeviceBuffer, PinnedBuffer};
pub use stream::Stream;
pub use upload::Uploader;
