//! What a node's data path did, for reports and metrics ([`Node::data_path`]).
//!
//! [`Node::data_path`]: crate::Node::data_path

/// The path a node's KV takes and what the transport counted on it. Each transport counts
/// what applies to it; the other figures stay 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataPathStats {
    /// `"mem"` (copies in this process), `"socket"` (TCP), `"peer-copy"` (TCP, with CUDA IPC
    /// peer copies, pulled by the decode side, with at least one peer on this host) or
    /// `"rdma"` (verbs).
    pub path: &'static str,
    /// Bytes a decode peer pulled from this prefill node's memory by peer copies and
    /// acknowledged.
    pub bytes_placed: u64,
    /// Data writes this decode node pulled from a prefill peer's memory by peer copies.
    pub writes_placed: u64,
    /// Data writes the transport refused (TCP's grant check; the verbs transport fails the
    /// link instead, the mem transport cannot see a foreign write).
    pub writes_refused: u64,
}
