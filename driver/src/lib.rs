//! The node driver shared by kvpipe's threaded transports (`kvpipe-tcp`, `kvpipe-ibverbs`).
//!
//! A node is one core endpoint ([`kvpipe_core::Sender`] or [`kvpipe_core::Receiver`]) behind
//! one lock, and this crate is everything about it that is not I/O:
//!
//! - [`Driver`]: the lock, feeding inputs, carrying out outputs in order ([`Driver::drain`]),
//!   the inbox for threads that must not wait ([`Driver::post`]), the timer thread, the
//!   observer hook-up, and the engine's commands ([`Driver::submit_chunk`], ...);
//! - [`submit_chunk`], [`submit_chunk_layers`]: a chunk's submission in two commands, the
//!   engine's block table asked in between with the node unlocked, for any [`SenderLock`];
//! - [`Io`]: what a transport plugs in: sending a frame, posting a write batch, closing a
//!   peer, its own deadlines;
//! - [`EventQueue`]: the engine's events, with their own lock;
//! - [`Batches`]: write batches in flight and recent timings;
//! - [`EndpointGuard`]: exclusive access to the endpoint for the engine;
//! - [`Clock`]: the core's time on this node.
//!
//! The order of dependencies: core ← driver ← transports ← engine API. Nothing here knows a
//! socket, a queue pair or a GPU.

mod batches;
mod clock;
mod commands;
mod events;
mod guard;
mod node;

pub use batches::Batches;
pub use clock::{deadline_after, later, Clock, WallInstant};
pub use commands::{submit_chunk, submit_chunk_layers, submit_prefix, SenderLock};
pub use events::EventQueue;
pub use guard::EndpointGuard;
pub use node::{Arrival, Driven, Driver, Io, Locked, Posted};
