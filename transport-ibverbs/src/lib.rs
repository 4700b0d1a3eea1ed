//! # kvpipe-ibverbs
//!
//! The RDMA verbs transport: RC queue pairs exchanged over a TCP side channel, coalesced
//! one-sided RDMA WRITEs, and registration of host memory and (behind `cuda`) GPU memory
//! through dmabuf.
//!
//! Status: the driver is not built yet; this crate currently exports nothing.
