//! [`CacheError`]: why the reference cache refused an operation.

use kvpipe_core::{GroupIndex, RequestId};
use thiserror::Error;

/// Why the reference cache refused an operation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CacheError {
    /// The spec is inconsistent.
    #[error("invalid cache spec for group {group}: {reason}")]
    InvalidSpec {
        /// The group concerned.
        group: u16,
        /// What is wrong.
        reason: &'static str,
    },
    /// A group has no free slot left.
    #[error("{group} has no free block slot left: make the cache larger")]
    OutOfSlots {
        /// The exhausted group.
        group: GroupIndex,
    },
    /// The request already exists.
    #[error("the cache already holds {0}")]
    DuplicateRequest(RequestId),
    /// The request does not exist.
    #[error("the cache holds no {0}")]
    UnknownRequest(RequestId),
    /// A chunk does not start where prefill stands.
    #[error("chunk {start}..{end} is out of order: {computed} tokens are computed")]
    ChunkOutOfOrder {
        /// First token of the chunk.
        start: u32,
        /// One past its last token.
        end: u32,
        /// Tokens computed so far.
        computed: u32,
    },
    /// Tokens past the prompt.
    #[error("token {end} is past the prompt's {prompt_len} tokens")]
    TokensPastPrompt {
        /// The offending token bound.
        end: u32,
        /// Tokens in the prompt.
        prompt_len: u32,
    },
    /// A block to write is not resident.
    #[error("{group} block {ordinal} is not allocated")]
    NotAllocated {
        /// The group.
        group: GroupIndex,
        /// The ordinal.
        ordinal: u32,
    },
    /// The pools' device memory could not be allocated, written or read (`cuda` feature).
    #[cfg(feature = "cuda")]
    #[error("device memory: {0}")]
    Device(#[from] kvpipe_cuda::CudaError),
}
