//! # kvpipe-mem
//!
//! The in-process transport: both endpoints live in one process, frames travel through
//! in-memory queues and write batches are carried out as memory copies of the coalesced
//! extents. It is the zero-setup default and the home of the fault-injecting wrapper the
//! conformance suite uses.
//!
//! Status: the driver is not built yet; this crate currently exports nothing.
