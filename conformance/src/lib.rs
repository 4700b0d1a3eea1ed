//! # kvpipe-conformance
//!
//! What every kvpipe transport is checked against: the scenario suite and its harnesses, and the
//! reference paged KV cache used by tests, benches and the simulator (`kvpipe-sim`). The
//! `kvpipe` command-line program lives in `kvpipe-cli`.

pub mod cache;
pub mod suite;
