//! The copy engine: lists of extents copied asynchronously on the engine's own streams, with
//! completion observed through CUDA events.
//!
//! 1. [`CopyEngine::submit`] merges extents that are contiguous on both sides into one copy
//!    ([`coalesce`]), so a write plan of many adjacent blocks becomes a few large copies.
//! 2. Each copy is issued on a stream of the device that executes it — the destination for
//!    device → device and host → device, the source for device → host and for peer copies
//!    (the GPU pushes over NVLink/PCIe; peer access is enabled once per pair of devices where
//!    the hardware allows it, otherwise the driver stages the copy) — spreading copies over the
//!    device's streams by bytes queued.
//! 3. One event is recorded behind the last copy on every stream used; the returned
//!    [`CopyTicket`] holds them. [`CopyTicket::is_complete`] polls them, [`CopyTicket::wait`]
//!    polls until a deadline. Nothing synchronizes a whole device or context.
//! 4. Device → device copies of one length whose sources and destinations each advance by a
//!    constant pitch (a head slice of every layer of a block, as tensor-parallel splits write)
//!    go as one 2D copy ([`strided_runs`](strided::strided_runs), `cuMemcpy2DAsync`) instead
//!    of one call each: the driver calls, not the bytes, bound a batch of many small extents.
//!    Where such a run is aligned to 16 bytes it goes through kvpipe's own row-copy kernel
//!    instead (`rows.rs`): on an H200 a 2D copy of a layer range takes twice the time of a
//!    contiguous copy of its bytes. [`COPY_KERNEL_ENV`]`=0` (or
//!    [`CopyEngine::set_row_kernel`]) turns the kernel off.
//! 5. Events are reused: a dropped ticket hands its events back to the engine's pool, and the
//!    next submission records them again, so a submission in steady state creates and destroys
//!    none (each is a driver call of its own on the submit path).
//!
//! - `copies.rs`: extents, driver copies and their directions, [`coalesce`];
//! - `strided.rs`: device → device copies of constant pitches grouped into 2D copies;
//! - `rows.rs`: the row-copy kernel for such runs;
//! - `copy_engine.rs`: [`CopyEngine`], its streams and submissions;
//! - `ticket.rs`: [`CopyTicket`], a submission's completion;
//! - `events.rs`: the pool of events that tickets hand back.

mod copies;
mod copy_engine;
mod events;
mod rows;
mod strided;
#[cfg(test)]
mod tests;
mod ticket;

pub use copies::{coalesce, CopyExtent, CopyOp, Direction, Memory};
pub use copy_engine::{least_loaded, CopyEngine, COPY_KERNEL_ENV};
pub use ticket::CopyTicket;
