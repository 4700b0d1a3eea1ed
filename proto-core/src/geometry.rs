//! Chunk geometry: which block ordinals one prefill chunk sends for one layer group.
//!
//! The rules (DESIGN §3), for a chunk `[start, end)` of a prompt of `prompt_len` tokens with
//! `tpb` tokens per block and `total_blocks = ceil(prompt_len / tpb)`:
//! 1. The **first chunk** is the one with `start == prepopulated_len` (unless the reused prefix
//!    was already sent early). It reaches back to block 0, so a reused prefix is sent too.
//! 2. A non-final chunk ends at `floor(end / tpb)`: a partly computed block waits for the chunk
//!    that completes it. The final chunk ends at `total_blocks`. A chunk begins at block 0 when
//!    it is the first, else at `floor(start / tpb)`.
//! 3. A non-final chunk that completes no block sends nothing ([`chunk_window`] is `None`).
//! 4. A windowed group (window `W < prompt_len`) never sends blocks below the
//!    [`StaleBoundary`] `stale` of the whole prompt: its range starts there. Each chunk sends
//!    its own computed blocks at or above `stale` — rules 1–3 applied to
//!    `[max(stale, begin), end)` — as soon as they are computed, and a chunk that lies wholly
//!    below `stale` sends nothing (the cache is not queried). Blocks at or above `stale` never
//!    leave the final window (the boundary is computed from the whole prompt), so sending them
//!    early is safe, and only the last chunk's own blocks are left on the time-to-first-token
//!    path.
//! 5. Over any sequence of chunks, the windows tile `[0, total_blocks)` (windowed groups:
//!    `[stale, total_blocks)`) exactly once per group.
//!
//! When the prefix was sent early, that early send is described by [`early_prefix_window`];
//! the chunks then start at `floor(prepopulated_len / tpb)` and the tiling still holds.

use core::fmt;

use thiserror::Error;

use crate::layout::LayerGroupLayout;

/// One prefill chunk as the sender's engine reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct ChunkSpec {
    /// First token computed by this chunk.
    pub start: u32,
    /// One past the last token computed by this chunk.
    pub end: u32,
    /// Tokens in the whole prompt.
    pub prompt_len: u32,
    /// Prefix tokens the sender already had cached (reused, not recomputed).
    pub prepopulated_len: u32,
    /// Whether this is the request's final prefill chunk (`end == prompt_len`).
    pub is_last: bool,
    /// Whether the reused prefix was already sent before the first chunk, with
    /// [`Sender::submit_prefix`](crate::Sender::submit_prefix) (see [`early_prefix_window`]);
    /// the first chunk then does not reach back to block 0. The sender refuses a chunk whose
    /// flag disagrees with what was sent.
    pub prefix_sent_early: bool,
}

impl ChunkSpec {
    /// Whether this chunk is the request's first: it starts where the reused prefix ends and
    /// the prefix was not sent early, so it reaches back to block 0.
    pub fn is_first(&self) -> bool {
        self.start == self.prepopulated_len && !self.prefix_sent_early
    }

    /// Checks the chunk is consistent with its prompt (see [`GeometryError`]).
    pub fn validate(&self) -> Result<(), GeometryError> {
        if self.start > self.end {
            return Err(GeometryError::ChunkReversed {
                start: self.start,
                end: self.end,
            });
        }
        if self.end > self.prompt_len {
            return Err(GeometryError::ChunkPastPrompt {
                end: self.end,
                prompt_len: self.prompt_len,
            });
        }
        if self.prepopulated_len > self.prompt_len {
            return Err(GeometryError::PrefixPastPrompt {
                prepopulated_len: self.prepopulated_len,
                prompt_len: self.prompt_len,
            });
        }
        if self.start < self.prepopulated_len {
            return Err(GeometryError::ChunkInsidePrefix {
                start: self.start,
                prepopulated_len: self.prepopulated_len,
            });
        }
        if self.is_last && self.end != self.prompt_len {
            return Err(GeometryError::LastChunkEndsEarly {
                end: self.end,
                prompt_len: self.prompt_len,
            });
        }
        if !self.is_last && self.end == self.prompt_len {
            // No chunk can follow it, so the request could only end by a deadline.
            return Err(GeometryError::PromptEndNotLast { end: self.end });
        }
        Ok(())
    }

    /// The first field, in declaration order, in which `other` differs from this chunk
    /// (`None`: they are the same chunk).
    pub fn first_difference(&self, other: &ChunkSpec) -> Option<ChunkSpecField> {
        use ChunkSpecField as F;
        [
            (F::Start, self.start != other.start),
            (F::End, self.end != other.end),
            (F::PromptLen, self.prompt_len != other.prompt_len),
            (
                F::PrepopulatedLen,
                self.prepopulated_len != other.prepopulated_len,
            ),
            (F::IsLast, self.is_last != other.is_last),
            (
                F::PrefixSentEarly,
                self.prefix_sent_early != other.prefix_sent_early,
            ),
        ]
        .into_iter()
        .find_map(|(field, differs)| differs.then_some(field))
    }
}

/// One field of a [`ChunkSpec`], named in errors that say where two specs differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkSpecField {
    /// [`ChunkSpec::start`].
    Start,
    /// [`ChunkSpec::end`].
    End,
    /// [`ChunkSpec::prompt_len`].
    PromptLen,
    /// [`ChunkSpec::prepopulated_len`].
    PrepopulatedLen,
    /// [`ChunkSpec::is_last`].
    IsLast,
    /// [`ChunkSpec::prefix_sent_early`].
    PrefixSentEarly,
}

impl ChunkSpecField {
    /// The field's name in [`ChunkSpec`].
    pub fn name(self) -> &'static str {
        match self {
            ChunkSpecField::Start => "start",
            ChunkSpecField::End => "end",
            ChunkSpecField::PromptLen => "prompt_len",
            ChunkSpecField::PrepopulatedLen => "prepopulated_len",
            ChunkSpecField::IsLast => "is_last",
            ChunkSpecField::PrefixSentEarly => "prefix_sent_early",
        }
    }

    /// The field's value in `spec`, as text.
    pub fn value_in(self, spec: &ChunkSpec) -> ChunkSpecValue {
        match self {
            ChunkSpecField::Start => ChunkSpecValue::Tokens(spec.start),
            ChunkSpecField::End => ChunkSpecValue::Tokens(spec.end),
            ChunkSpecField::PromptLen => ChunkSpecValue::Tokens(spec.prompt_len),
            ChunkSpecField::PrepopulatedLen => ChunkSpecValue::Tokens(spec.prepopulated_len),
            ChunkSpecField::IsLast => ChunkSpecValue::Flag(spec.is_last),
            ChunkSpecField::PrefixSentEarly => ChunkSpecValue::Flag(spec.prefix_sent_early),
        }
    }
}

impl fmt::Display for ChunkSpecField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The value of one [`ChunkSpecField`] of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkSpecValue {
    /// A token position or count.
    Tokens(u32),
    /// A flag.
    Flag(bool),
}

impl fmt::Display for ChunkSpecValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChunkSpecValue::Tokens(n) => write!(f, "{n}"),
            ChunkSpecValue::Flag(b) => write!(f, "{b}"),
        }
    }
}

/// A half-open range of block ordinals `[begin, end)` of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct BlockWindow {
    /// First ordinal.
    pub begin: u32,
    /// One past the last ordinal.
    pub end: u32,
}

impl BlockWindow {
    /// Number of ordinals in the window (0 when reversed).
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.begin)
    }

    /// Whether the window holds no ordinal.
    pub fn is_empty(&self) -> bool {
        self.end <= self.begin
    }

    /// Whether `ordinal` lies in the window.
    pub fn contains(&self, ordinal: u32) -> bool {
        self.begin <= ordinal && ordinal < self.end
    }

    /// `Some(self)` when the window holds at least one ordinal, else `None`.
    fn non_empty(self) -> Option<Self> {
        (!self.is_empty()).then_some(self)
    }
}

/// The first block ordinal a windowed group still needs once prefill is over:
/// `max(0, (prompt_len + 1 - W) / tpb)`. The `+ 1` is the first generated token's position;
/// the whole request's `prompt_len` is used, never a chunk's end. Blocks below it are never
/// sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StaleBoundary(pub u32);

impl StaleBoundary {
    /// The stale boundary of a group with `window` tokens for a prompt of `prompt_len` tokens.
    /// A window of at least `prompt_len` tokens is full attention: the boundary is 0.
    pub fn new(prompt_len: u32, window: u32, tpb: u32) -> Result<Self, GeometryError> {
        stale_boundary(prompt_len, window, tpb).map(StaleBoundary)
    }

    /// The stale boundary of `group` (0 for a full-attention group or a window that covers the
    /// prompt).
    pub fn for_group(prompt_len: u32, group: &LayerGroupLayout) -> Result<Self, GeometryError> {
        match group.window {
            Some(w) => Self::new(prompt_len, w, group.tokens_per_block),
            None => {
                check_tpb(group.tokens_per_block)?;
                Ok(StaleBoundary(0))
            }
        }
    }

    /// The boundary as a block ordinal.
    pub fn ordinal(self) -> u32 {
        self.0
    }
}

/// `max(0, (prompt_len + 1 - window) / tpb)` as a block ordinal (see [`StaleBoundary`]).
pub fn stale_boundary(prompt_len: u32, window: u32, tpb: u32) -> Result<u32, GeometryError> {
    check_tpb(tpb)?;
    if window == 0 {
        return Err(GeometryError::ZeroWindow);
    }
    if window >= prompt_len {
        return Ok(0);
    }
    // `window < prompt_len`, so `prompt_len + 1 - window` is in `2..=prompt_len`.
    Ok((prompt_len - window + 1) / tpb)
}

/// `ceil(prompt_len / tpb)`: the number of blocks a prompt occupies.
pub fn total_blocks(prompt_len: u32, tpb: u32) -> Result<u32, GeometryError> {
    check_tpb(tpb)?;
    Ok(prompt_len.div_ceil(tpb))
}

fn check_tpb(tpb: u32) -> Result<(), GeometryError> {
    if tpb == 0 {
        Err(GeometryError::ZeroTokensPerBlock)
    } else {
        Ok(())
    }
}

/// The block ordinals `group` sends for `chunk`, or `None` when the group sends nothing in this
/// chunk — the cache must then not be queried.
///
/// Rules 1–3 of the module doc give `[begin, end)`; a windowed group sends
/// `[max(stale, begin), end)` (rule 4), so a chunk wholly below its stale boundary sends
/// nothing. Full attention and windows of at least the prompt have `stale == 0`.
pub fn chunk_window(
    chunk: &ChunkSpec,
    group: &LayerGroupLayout,
) -> Result<Option<BlockWindow>, GeometryError> {
    chunk.validate()?;
    let tpb = group.tokens_per_block;
    let total = total_blocks(chunk.prompt_len, tpb)?;
    let stale = StaleBoundary::for_group(chunk.prompt_len, group)?.ordinal();
    let begin = if chunk.is_first() {
        0
    } else {
        chunk.start / tpb
    };
    let end = if chunk.is_last {
        total
    } else {
        chunk.end / tpb
    };
    Ok(BlockWindow {
        begin: begin.max(stale),
        end,
    }
    .non_empty())
}

/// The blocks of `group` an early send of the sender's reused prefix carries, before the first
/// chunk: the fully cached blocks `[0, floor(prepopulated_len / tpb))`, or from the stale
/// boundary for a windowed group. `None` when there are none. Chunks with
/// [`ChunkSpec::prefix_sent_early`] set skip exactly these blocks.
pub fn early_prefix_window(
    prompt_len: u32,
    prepopulated_len: u32,
    group: &LayerGroupLayout,
) -> Result<Option<BlockWindow>, GeometryError> {
    if prepopulated_len > prompt_len {
        return Err(GeometryError::PrefixPastPrompt {
            prepopulated_len,
            prompt_len,
        });
    }
    let stale = StaleBoundary::for_group(prompt_len, group)?;
    let window = BlockWindow {
        begin: stale.ordinal(),
        end: prepopulated_len / group.tokens_per_block,
    };
    Ok(window.non_empty())
}

/// A chunk or layout the geometry cannot place (a usage error of the caller).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GeometryError {
    /// The layer group has `tokens_per_block == 0`.
    #[error("tokens per block is 0: every layer group needs at least one token per block")]
    ZeroTokensPerBlock,
    /// The layer group has a window of 0 tokens.
    #[error("sliding window of 0 tokens: use `None` for full attention or a window of at least 1")]
    ZeroWindow,
    /// The chunk's token range is reversed.
    #[error("chunk starts at token {start}, after its end {end}")]
    ChunkReversed {
        /// First token of the chunk.
        start: u32,
        /// One past the last token of the chunk.
        end: u32,
    },
    /// The chunk ends past the prompt.
    #[error("chunk ends at token {end}, past the prompt's {prompt_len} tokens")]
    ChunkPastPrompt {
        /// One past the last token of the chunk.
        end: u32,
        /// Tokens in the prompt.
        prompt_len: u32,
    },
    /// The reused prefix is longer than the prompt.
    #[error(
        "reused prefix of {prepopulated_len} tokens is longer than the {prompt_len}-token prompt"
    )]
    PrefixPastPrompt {
        /// Prefix tokens the sender had cached.
        prepopulated_len: u32,
        /// Tokens in the prompt.
        prompt_len: u32,
    },
    /// The chunk starts inside the reused prefix, which is never recomputed.
    #[error(
        "chunk starts at token {start}, inside the {prepopulated_len}-token reused prefix; \
         chunks start at or after the prefix"
    )]
    ChunkInsidePrefix {
        /// First token of the chunk.
        start: u32,
        /// Prefix tokens the sender had cached.
        prepopulated_len: u32,
    },
    /// A chunk marked last does not end at the prompt's end.
    #[error("the last chunk ends at token {end}, before the prompt's end {prompt_len}")]
    LastChunkEndsEarly {
        /// One past the last token of the chunk.
        end: u32,
        /// Tokens in the prompt.
        prompt_len: u32,
    },
    /// A chunk reaching the prompt's end is not marked last: no chunk can follow it.
    #[error(
        "the chunk ends at the prompt's end (token {end}) but is not marked last; mark the \
         request's final chunk is_last"
    )]
    PromptEndNotLast {
        /// One past the last token of the chunk: the prompt's length.
        end: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(tpb: u32, window: Option<u32>) -> LayerGroupLayout {
        LayerGroupLayout {
            layers: 1,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 1,
            elem_bytes: 1,
            tokens_per_block: tpb,
            window,
            ..LayerGroupLayout::default()
        }
    }

    fn chunk(start: u32, end: u32, prompt_len: u32, prefix: u32) -> ChunkSpec {
        ChunkSpec {
            start,
            end,
            prompt_len,
            prepopulated_len: prefix,
            is_last: end == prompt_len,
            prefix_sent_early: false,
        }
    }

    fn win(begin: u32, end: u32) -> Option<BlockWindow> {
        Some(BlockWindow { begin, end })
    }

    #[test]
    fn reference_chunking_tiles_the_prompt() {
        let g = group(4, None);
        let got: Vec<_> = [(0, 6), (6, 12), (12, 32)]
            .into_iter()
            .map(|(s, e)| chunk_window(&chunk(s, e, 32, 0), &g).unwrap())
            .collect();
        assert_eq!(got, vec![win(0, 1), win(1, 3), win(3, 8)]);
    }

    #[test]
    fn first_chunk_reaches_back_over_a_reused_prefix() {
        let g = group(4, None);
        assert_eq!(chunk_window(&chunk(6, 14, 32, 6), &g).unwrap(), win(0, 3));
        // The same chunk when the prefix was sent early starts at its own first block.
        let early = ChunkSpec {
            prefix_sent_early: true,
            ..chunk(6, 14, 32, 6)
        };
        assert_eq!(chunk_window(&early, &g).unwrap(), win(1, 3));
        assert_eq!(early_prefix_window(32, 6, &g).unwrap(), win(0, 1));
    }

    #[test]
    fn non_final_chunks_that_complete_no_block_send_nothing() {
        let g = group(4, None);
        assert_eq!(chunk_window(&chunk(0, 2, 32, 0), &g).unwrap(), None);
        assert_eq!(chunk_window(&chunk(5, 7, 32, 0), &g).unwrap(), None);
    }

    #[test]
    fn one_chunk_over_the_prompt_sends_every_block() {
        let g = group(4, None);
        assert_eq!(chunk_window(&chunk(0, 30, 30, 0), &g).unwrap(), win(0, 8));
    }

    #[test]
    fn window_covering_the_prompt_streams_like_full_attention() {
        for w in [32, 33, 1000] {
            let g = group(4, Some(w));
            assert_eq!(chunk_window(&chunk(0, 6, 32, 0), &g).unwrap(), win(0, 1));
            assert_eq!(chunk_window(&chunk(6, 12, 32, 0), &g).unwrap(), win(1, 3));
            assert_eq!(chunk_window(&chunk(12, 32, 32, 0), &g).unwrap(), win(3, 8));
        }
    }

    #[test]
    fn windowed_group_streams_from_the_stale_boundary() {
        // W = 10, prompt 32: stale = (32 + 1 - 10) / 4 = 5.
        let g = group(4, Some(10));
        assert_eq!(stale_boundary(32, 10, 4), Ok(5));
        // Wholly below the boundary: nothing, and the cache is not queried.
        assert_eq!(chunk_window(&chunk(0, 6, 32, 0), &g).unwrap(), None);
        assert_eq!(chunk_window(&chunk(6, 20, 32, 0), &g).unwrap(), None);
        // Crossing it: the chunk's own computed blocks from the boundary on.
        assert_eq!(chunk_window(&chunk(20, 28, 32, 0), &g).unwrap(), win(5, 7));
        assert_eq!(chunk_window(&chunk(28, 32, 32, 0), &g).unwrap(), win(7, 8));
        // A final chunk that starts above the boundary carries only its own blocks.
        assert_eq!(chunk_window(&chunk(31, 32, 32, 0), &g).unwrap(), win(7, 8));
        // One chunk over the whole prompt: exactly the final window.
        assert_eq!(chunk_window(&chunk(0, 32, 32, 0), &g).unwrap(), win(5, 8));
        // A first chunk reaches back over the reused prefix, but never below the boundary.
        assert_eq!(chunk_window(&chunk(18, 26, 32, 18), &g).unwrap(), win(5, 6));
        // The same chunk after an early prefix send starts at its own first block.
        let early = ChunkSpec {
            prefix_sent_early: true,
            ..chunk(18, 26, 32, 18)
        };
        assert_eq!(chunk_window(&early, &g).unwrap(), win(5, 6));
        assert_eq!(early_prefix_window(32, 18, &g).unwrap(), None);
        assert_eq!(early_prefix_window(32, 24, &g).unwrap(), win(5, 6));
    }

    #[test]
    fn a_final_window_of_no_block_sends_nothing() {
        // W = 1, prompt 32, tpb 4: stale = 32 / 4 = 8 = total blocks.
        let g = group(4, Some(1));
        assert_eq!(stale_boundary(32, 1, 4), Ok(8));
        assert_eq!(chunk_window(&chunk(0, 32, 32, 0), &g).unwrap(), None);
        assert_eq!(chunk_window(&chunk(24, 32, 32, 0), &g).unwrap(), None);
    }

    #[test]
    fn stale_boundary_uses_the_first_generated_token() {
        // prompt 8, W 4, tpb 4: (8 + 1 - 4) / 4 = 1; without the +1 it would be 1 too, but at
        // prompt 7: (7 + 1 - 4) / 4 = 1 where (7 - 4) / 4 = 0.
        assert_eq!(stale_boundary(7, 4, 4), Ok(1));
        assert_eq!(stale_boundary(7, 7, 4), Ok(0));
        assert_eq!(stale_boundary(7, 6, 1), Ok(2));
        assert_eq!(stale_boundary(7, 0, 4), Err(GeometryError::ZeroWindow));
        assert_eq!(
            stale_boundary(7, 3, 0),
            Err(GeometryError::ZeroTokensPerBlock)
        );
    }

    #[test]
    fn total_blocks_rounds_up() {
        assert_eq!(total_blocks(0, 4), Ok(0));
        assert_eq!(total_blocks(1, 4), Ok(1));
        assert_eq!(total_blocks(32, 4), Ok(8));
        assert_eq!(total_blocks(33, 4), Ok(9));
        assert_eq!(total_blocks(u32::MAX, 1), Ok(u32::MAX));
        assert_eq!(total_blocks(3, 0), Err(GeometryError::ZeroTokensPerBlock));
    }

    #[test]
    fn inconsistent_chunks_are_typed_errors() {
        let g = group(4, None);
        let cases = [
            (
                chunk(7, 6, 32, 0),
                GeometryError::ChunkReversed { start: 7, end: 6 },
            ),
            (
                chunk(0, 40, 32, 0),
                GeometryError::ChunkPastPrompt {
                    end: 40,
                    prompt_len: 32,
                },
            ),
            (
                chunk(3, 8, 32, 40),
                GeometryError::PrefixPastPrompt {
                    prepopulated_len: 40,
                    prompt_len: 32,
                },
            ),
            (
                chunk(3, 8, 32, 6),
                GeometryError::ChunkInsidePrefix {
                    start: 3,
                    prepopulated_len: 6,
                },
            ),
            (
                ChunkSpec {
                    is_last: true,
                    ..chunk(0, 8, 32, 0)
                },
                GeometryError::LastChunkEndsEarly {
                    end: 8,
                    prompt_len: 32,
                },
            ),
            (
                ChunkSpec {
                    is_last: false,
                    ..chunk(24, 32, 32, 0)
                },
                GeometryError::PromptEndNotLast { end: 32 },
            ),
        ];
        for (c, err) in cases {
            assert_eq!(chunk_window(&c, &g), Err(err));
        }
        assert_eq!(
            chunk_window(&chunk(0, 8, 32, 0), &group(0, None)),
            Err(GeometryError::ZeroTokensPerBlock)
        );
        assert_eq!(
            chunk_window(&chunk(0, 8, 32, 0), &group(4, Some(0))),
            Err(GeometryError::ZeroWindow)
        );
    }
}
