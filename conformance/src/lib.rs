//! # kvpipe-conformance
//!
//! What every kvpipe transport is checked against: the scenario suite, the reference paged KV
//! cache used by tests and benches, and the deterministic simulated network. The `kvpipe`
//! command-line program (demo, bench, plan, sim) is built from this crate too.

pub mod cache;
pub mod picture;
pub mod sim;
pub mod suite;
