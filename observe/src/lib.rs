//! # kvpipe-observe
//!
//! What a kvpipe endpoint did, for the people who run it: `tracing` spans and events, and
//! counters, gauges and histograms through the `metrics` facade. The core stays I/O-free: it
//! reports what happened through its outputs ([`Output`](kvpipe_core::Output), events included)
//! and its [`Counters`](kvpipe_core::session::Counters); each transport's driver hands them to
//! an [`Observer`] at the one place where it drains the endpoint, and the observer turns them
//! into spans, events and metrics. The program chooses the subscriber and the recorder (the
//! `kvpipe` CLI: an env-filtered `fmt` subscriber, and a Prometheus recorder for `kvpipe serve
//! --metrics`); without them every call here is a cheap no-op.
//!
//! - **Spans**: one `request` span per request on each endpoint (fields `request`, `role`,
//!   `peer`, `transport`), opened by the first output about the request and closed when it
//!   quiesces. Level `INFO`; every event about the request is its child.
//! - **Events** (targets under `kvpipe`, see [`TARGET`]): handshake done or refused, peer
//!   closed (`INFO`/`WARN`); registration, each write batch issued and done (bytes, extents,
//!   duration), each result and aux data sent, quiesce (`DEBUG`); completion (`INFO`, with the
//!   request's timings); failures with their cause, timeouts with what was awaited (`WARN`);
//!   cancels (`INFO`); protocol violations (`WARN`). Nothing per byte or per piece.
//! - **Metrics**: see [`names`] for every metric, its kind, labels and meaning.
//! - **Timings**: [`TransferTimings`] puts one request's sender and receiver
//!   [`RequestTimings`](kvpipe_core::session::RequestTimings) side by side when both endpoints
//!   share a clock, and names each milestone and interval (exposed tail, transfer time).
//!
//! [`set_enabled`]`(false)` turns every observer off at once (one relaxed load per call
//! remains), for measuring what observing costs.

mod observer;
mod timings;

pub mod names;

pub use observer::{is_enabled, set_enabled, Observer};
pub use timings::TransferTimings;

/// The `tracing` target of the observer's spans and events: `RUST_LOG=kvpipe=debug` selects
/// them (with the TCP node's own events, target `kvpipe::tcp`).
pub const TARGET: &str = "kvpipe::session";
