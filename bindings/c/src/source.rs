//! The engine's block source as a C callback.

use std::ffi::c_void;

use kvpipe_core::{BlockId, BlockRun, BlockSource, BlockSourceError, GroupIndex, RequestId};

/// Where a block source callback writes its answer. kvpipe sets `ids` to a buffer of `capacity`
/// entries (`end - begin`: a run is never longer than asked) and zeroes the rest; the callback
/// sets `first_ordinal` and `len`, and fills `ids[0..len]` — or points `ids` at an array of its
/// own holding the `len` ids, which must stay valid until the submit call returns (the request's
/// block table, say; not an array on the callback's stack): kvpipe copies them as soon as the
/// callback returns. A null `ids` with `len` above 0 breaks the contract.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpipe_block_run {
    /// Ordinal of `ids[0]`: `end - len` for an answer that keeps the contract.
    pub first_ordinal: u32,
    /// The slots of consecutive ordinals, written by the callback into the buffer given, or
    /// an array of the callback's own it points `ids` at.
    pub ids: *mut u32,
    /// Entries `ids` holds.
    pub capacity: usize,
    /// Entries written. More than `capacity` breaks the contract: the core fails the request
    /// on both sides (`KVPIPE_TRANSFER_ENGINE_ERROR`).
    pub len: usize,
    /// With `KVPIPE_BLOCK_SOURCE_PAST_ALLOCATION`: the blocks the request has allocated.
    pub allocated: u32,
}

/// What a block source callback returns.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_block_source_status {
    /// `out` holds the answer.
    KVPIPE_BLOCK_SOURCE_OK = 0,
    /// The cache holds no such request.
    KVPIPE_BLOCK_SOURCE_UNKNOWN_REQUEST = 1,
    /// The cache has no such layer group.
    KVPIPE_BLOCK_SOURCE_UNKNOWN_GROUP = 2,
    /// `end` lies past the blocks the request has allocated (set `out->allocated`).
    KVPIPE_BLOCK_SOURCE_PAST_ALLOCATION = 3,
}

/// The engine's paged KV cache, asked for one layer group's blocks of one chunk.
///
/// The contract (the core's `BlockSource`): write the **contiguous run of resident blocks
/// ending at `end`**, i.e. ordinals `[end - len, end)` with `first_ordinal = end - len`. It may
/// be shorter than `end - begin` (an evicted window head), never longer, never has holes; when
/// the resident blocks of `[begin, end)` have gaps, drop everything up to and including the
/// last gap. `begin == end` is an empty run anchored at `end`. `end` past the request's
/// allocated blocks is `KVPIPE_BLOCK_SOURCE_PAST_ALLOCATION`, never clamped. Cost O(end - begin).
///
/// Called on the thread that submits the chunk, before the submit call returns, with the node
/// unlocked (the chunk is checked again when the answers are applied). `user` is the pointer
/// given to the submit call. Returns a [`kvpipe_block_source_status`] value.
pub type kvpipe_block_source_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        request: u64,
        group: u16,
        begin: u32,
        end: u32,
        out: *mut kvpipe_block_run,
    ) -> i32,
>;

/// A [`kvpipe_block_source_fn`] as the core's [`BlockSource`].
pub(crate) struct CallbackSource {
    pub(crate) callback:
        unsafe extern "C" fn(*mut c_void, u64, u16, u32, u32, *mut kvpipe_block_run) -> i32,
    pub(crate) user: *mut c_void,
    buffer: Vec<u32>,
    /// A status the callback returned that is none of [`kvpipe_block_source_status`].
    pub(crate) unknown_status: Option<i32>,
}

impl CallbackSource {
    pub(crate) fn new(
        callback: unsafe extern "C" fn(
            *mut c_void,
            u64,
            u16,
            u32,
            u32,
            *mut kvpipe_block_run,
        ) -> i32,
        user: *mut c_void,
    ) -> Self {
        CallbackSource {
            callback,
            user,
            buffer: Vec::new(),
            unknown_status: None,
        }
    }
}

impl BlockSource for CallbackSource {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        let capacity = (end - begin) as usize;
        self.buffer.clear();
        self.buffer.resize(capacity, 0);
        let mut run = kvpipe_block_run {
            first_ordinal: end,
            ids: self.buffer.as_mut_ptr(),
            capacity,
            len: 0,
            allocated: 0,
        };
        // SAFETY: the callback was given by the caller of the submit call for this purpose;
        // `run.ids` points to `capacity` writable entries, which it may fill.
        let status =
            unsafe { (self.callback)(self.user, request.0, group.0, begin, end, &mut run) };
        match status {
            0 => {}
            1 => return Err(BlockSourceError::UnknownRequest(request)),
            2 => return Err(BlockSourceError::UnknownGroup(group)),
            3 => {
                return Err(BlockSourceError::PastAllocation {
                    end,
                    allocated: run.allocated,
                })
            }
            other => {
                self.unknown_status = Some(other);
                return Err(BlockSourceError::UnknownRequest(request));
            }
        }
        out.first_ordinal = run.first_ordinal;
        out.ids.clear();
        let len = run.len.min(capacity);
        let ids: &[u32] = if run.ids == self.buffer.as_mut_ptr() {
            &self.buffer[..len]
        } else if run.ids.is_null() {
            if len > 0 {
                // No ids behind the length claimed: a run longer than asked is the contract
                // breach the core refuses (failing the request on both sides).
                out.ids.resize(capacity + 1, BlockId(0));
            }
            return Ok(());
        } else {
            // SAFETY: the callback pointed `ids` at an array of its own holding `len` entries,
            // valid until it returned (the contract above); read at once, at most `capacity`.
            unsafe { std::slice::from_raw_parts(run.ids, len) }
        };
        out.ids.extend(ids.iter().copied().map(BlockId));
        if run.len > capacity {
            // The callback claims more blocks than asked; only `capacity` fit. One more id
            // makes the run longer than asked, which the core refuses as the contract breach
            // it is (failing the request on both sides) instead of sending part of it.
            out.ids.push(BlockId(0));
        }
        Ok(())
    }
}
