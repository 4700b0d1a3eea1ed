//! The sender's view of the engine's paged KV cache: a bounded query for one chunk's blocks.

use thiserror::Error;

use crate::blocks::BlockRun;
use crate::ids::{GroupIndex, RequestId};

/// Where the sender gets a chunk's blocks: the engine's paged KV cache.
///
/// # Contract
/// `block_run(request, group, begin, end, out)` fills `out` with the **contiguous run of
/// resident blocks ending at `end`**: `out.first_ordinal == end - out.ids.len()`.
/// - It may be shorter than `end - begin` (an evicted window head), never longer, and never has
///   holes. When the resident blocks in `[begin, end)` have gaps (sink tokens kept resident,
///   a gap, then the window), everything up to and including the last gap is dropped.
/// - `begin == end` is valid and yields an empty run anchored at `end`.
/// - `begin > end` is [`BlockSourceError::BeginAfterEnd`]; `end` past the request's allocated
///   blocks is [`BlockSourceError::PastAllocation`]. Neither is ever clamped.
/// - Its cost is O(end − begin), never O(request); `out`'s buffer is reused by the caller.
pub trait BlockSource {
    /// Fills `out` with the resident run ending at `end` (see the trait's contract).
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError>;
}

/// A bounded block query the cache could not answer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BlockSourceError {
    /// The range is reversed.
    #[error("block range begins at ordinal {begin}, after its end {end}")]
    BeginAfterEnd {
        /// First ordinal asked for.
        begin: u32,
        /// One past the last ordinal asked for.
        end: u32,
    },
    /// The range ends past the blocks the request has allocated.
    #[error(
        "block range ends at ordinal {end}, past the {allocated} blocks allocated to the request"
    )]
    PastAllocation {
        /// One past the last ordinal asked for.
        end: u32,
        /// Blocks the request has allocated in this group.
        allocated: u32,
    },
    /// The cache holds no such request.
    #[error("the cache holds no request {0}")]
    UnknownRequest(RequestId),
    /// The cache has no such layer group.
    #[error("the cache has no layer group {0}")]
    UnknownGroup(GroupIndex),
}
