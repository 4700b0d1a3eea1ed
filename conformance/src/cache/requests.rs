//! A request's blocks over its life: the sender's prefill (a reused prefix, then chunk by chunk
//! or layer range by layer range, with eviction from windowed groups), the receiver's
//! destination blocks, and release.

use kvpipe_core::{stale_boundary, AnchoredRun, GroupIndex, RequestId, StaleBoundary};

use super::error::CacheError;
use super::rows::write_content;
use super::spec::AllocationStyle;
use super::{ReferenceCache, RequestState};

impl ReferenceCache {
    /// Sender side: starts prefill of `request`, with its first `prefix_tokens` tokens already
    /// cached (reused prefix, content written now). Allocates every block of the prompt
    /// ([`AllocationStyle::FullPrompt`]) or only the prefix's ([`AllocationStyle::Incremental`]).
    pub fn begin_prefill(
        &mut self,
        request: RequestId,
        prompt_len: u32,
        prefix_tokens: u32,
        style: AllocationStyle,
    ) -> Result<(), CacheError> {
        if self.requests.contains_key(&request) {
            return Err(CacheError::DuplicateRequest(request));
        }
        if prefix_tokens > prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end: prefix_tokens,
                prompt_len,
            });
        }
        let groups = self.groups.len();
        self.requests.insert(
            request,
            RequestState {
                prompt_len,
                computed: 0,
                tables: vec![Vec::new(); groups],
                evict_from: vec![0; groups],
            },
        );
        let allocate_to = match style {
            AllocationStyle::FullPrompt => prompt_len,
            AllocationStyle::Incremental => prefix_tokens,
        };
        // The reused prefix is already cached: a windowed group holds only its live part.
        let result = self
            .allocate_to(
                request,
                allocate_to.div_ceil(self.tpb),
                prefix_tokens.div_ceil(self.tpb),
                prefix_tokens,
            )
            .and_then(|()| self.compute(request, 0, prefix_tokens, None, true));
        if result.is_err() {
            self.release(request);
        }
        result.and_then(|()| self.flush_device())
    }

    /// Sender side: prefill computed tokens `[start, end)` of `request`: allocates their blocks
    /// if needed, writes their content, then evicts windowed blocks that left the window.
    /// Chunks must be computed in order (`start` = tokens computed so far).
    pub fn compute_chunk(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
    ) -> Result<(), CacheError> {
        self.compute_tokens(request, start, end, None, true)
    }

    /// Sender side, one range of a chunk's layers at a time, as an engine computes them:
    /// [`compute_chunk`](Self::compute_chunk) writing only layers `layers[g]` of each group
    /// `g` (counted from the rank's first layer of the group, as pools' `layer_begin`; a group
    /// without an entry writes nothing). The chunk's blocks are allocated by its first call;
    /// its `last` call (the chunk's last range) evicts what left the window and marks the
    /// chunk computed, so every call of one chunk passes the same `start` and `end`.
    pub fn compute_chunk_layers(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
        layers: &[std::ops::Range<u16>],
        last: bool,
    ) -> Result<(), CacheError> {
        self.compute_tokens(request, start, end, Some(layers), last)
    }

    /// [`compute_chunk`](Self::compute_chunk) and
    /// [`compute_chunk_layers`](Self::compute_chunk_layers): checks the chunk's order and
    /// length, allocates its blocks, writes `layers` of them (`None`: every layer).
    fn compute_tokens(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
        layers: Option<&[std::ops::Range<u16>]>,
        last: bool,
    ) -> Result<(), CacheError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        if start != req.computed || end < start {
            return Err(CacheError::ChunkOutOfOrder {
                start,
                end,
                computed: req.computed,
            });
        }
        if end > req.prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end,
                prompt_len: req.prompt_len,
            });
        }
        let blocks = end.div_ceil(self.tpb);
        self.allocate_to(request, blocks, blocks, start)?;
        self.compute(request, start, end, layers, last)?;
        self.flush_device()
    }

    /// Writes the content of tokens `[start, end)` (and, when `end` completes the prompt, of
    /// the last block's padding tokens) of every layer, or of `layers[g]` in each group `g`;
    /// with `finish`, then evicts and marks the tokens computed.
    fn compute(
        &mut self,
        request: RequestId,
        start: u32,
        end: u32,
        layers: Option<&[std::ops::Range<u16>]>,
        finish: bool,
    ) -> Result<(), CacheError> {
        let tpb = self.tpb;
        let req = self
            .requests
            .get_mut(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        let prompt_len = req.prompt_len;
        let token_end = if end == prompt_len {
            prompt_len.div_ceil(tpb) * tpb
        } else {
            end
        };
        for (g, group) in self.groups.iter_mut().enumerate() {
            let table = &req.tables[g];
            if self.materialized {
                let first_block = start / tpb;
                let end_block = token_end.div_ceil(tpb);
                let windowed = group.windowed_for(prompt_len);
                for ordinal in first_block..end_block {
                    let slot = match table[ordinal as usize] {
                        Some(slot) => slot,
                        // A windowed group never allocated what had left its window before the
                        // computation began (a reused prefix's head): nothing to write there.
                        None if windowed => continue,
                        None => {
                            return Err(CacheError::NotAllocated {
                                group: GroupIndex(g as u16),
                                ordinal,
                            })
                        }
                    };
                    let lo = start.max(ordinal * tpb) - ordinal * tpb;
                    let hi = token_end.min((ordinal + 1) * tpb) - ordinal * tpb;
                    let only = layers.map(|l| l.get(g).cloned().unwrap_or(0..0));
                    write_content(group, request, g, ordinal, slot, lo..hi, tpb, only);
                }
            }
            if !finish {
                continue;
            }
            // Evict what left the window (the cache's own policy; sinks stay resident).
            if let Some(w) = group.layout.window {
                if group.layout.is_windowed_for(prompt_len) {
                    let stale = stale_boundary(end, w, tpb).unwrap_or(0);
                    let sinks = group.sink_tokens.div_ceil(tpb);
                    let from = req.evict_from[g].max(sinks);
                    let table = &mut req.tables[g];
                    for ordinal in from..stale.min(table.len() as u32) {
                        if let Some(slot) = table[ordinal as usize].take() {
                            group.give_back(slot);
                        }
                    }
                    req.evict_from[g] = req.evict_from[g].max(stale);
                }
            }
        }
        if finish {
            req.computed = end;
        }
        Ok(())
    }

    /// Grows the tables of `request` to `blocks` ordinals (a windowed group's to
    /// `windowed_blocks`: only what is being computed), taking free slots. A windowed group
    /// leaves the ordinals that were out of its window before token `from_token` unallocated
    /// (its sink blocks aside).
    fn allocate_to(
        &mut self,
        request: RequestId,
        blocks: u32,
        windowed_blocks: u32,
        from_token: u32,
    ) -> Result<(), CacheError> {
        let req = self
            .requests
            .get_mut(&request)
            .ok_or(CacheError::UnknownRequest(request))?;
        let prompt_len = req.prompt_len;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let table = &mut req.tables[g];
            let (blocks, live_from) = if group.windowed_for(prompt_len) {
                (windowed_blocks, group.live_from(prompt_len, from_token))
            } else {
                (blocks, 0)
            };
            let sinks = group.sink_tokens.div_ceil(self.tpb);
            while (table.len() as u32) < blocks {
                let ordinal = table.len() as u32;
                if ordinal >= sinks && ordinal < live_from {
                    table.push(None);
                    continue;
                }
                let slot = group.take(request, ordinal).ok_or(CacheError::OutOfSlots {
                    group: GroupIndex(g as u16),
                })?;
                table.push(Some(slot));
            }
        }
        Ok(())
    }

    /// Receiver side: allocates `request`'s destination blocks for a prompt of `prompt_len`
    /// tokens, of which the first `cached_prefix_tokens` are already cached here (their full
    /// blocks get their content now), and returns each group's [`AnchoredRun`]: the blocks the
    /// receiver lacks — from the cached prefix's end (and, for a windowed group, from the stale
    /// boundary) to the prompt's last block.
    pub fn register_destination(
        &mut self,
        request: RequestId,
        prompt_len: u32,
        cached_prefix_tokens: u32,
    ) -> Result<Vec<AnchoredRun>, CacheError> {
        if self.requests.contains_key(&request) {
            return Err(CacheError::DuplicateRequest(request));
        }
        if cached_prefix_tokens > prompt_len {
            return Err(CacheError::TokensPastPrompt {
                end: cached_prefix_tokens,
                prompt_len,
            });
        }
        let tpb = self.tpb;
        let total = prompt_len.div_ceil(tpb);
        let prefix_blocks = cached_prefix_tokens / tpb;
        let mut state = RequestState {
            prompt_len,
            computed: prompt_len,
            tables: Vec::with_capacity(self.groups.len()),
            evict_from: vec![0; self.groups.len()],
        };
        let mut runs = Vec::with_capacity(self.groups.len());
        let mut failed = None;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let stale = StaleBoundary::for_group(prompt_len, &group.layout)
                .map_or(0, StaleBoundary::ordinal);
            let mut table = vec![None; total as usize];
            let mut run = AnchoredRun::empty(stale.max(prefix_blocks).min(total));
            for ordinal in stale..total {
                let Some(slot) = group.take(request, ordinal) else {
                    failed = Some(CacheError::OutOfSlots {
                        group: GroupIndex(g as u16),
                    });
                    break;
                };
                table[ordinal as usize] = Some(slot);
                if ordinal < prefix_blocks {
                    if self.materialized {
                        write_content(group, request, g, ordinal, slot, 0..tpb, tpb, None);
                    }
                } else {
                    run.push(slot);
                }
            }
            state.tables.push(table);
            runs.push(run);
            if failed.is_some() {
                break;
            }
        }
        self.requests.insert(request, state);
        if let Some(err) = failed {
            self.release(request);
            return Err(err);
        }
        self.flush_device()?;
        Ok(runs)
    }

    /// Frees every slot of `request` (its memory keeps its bytes, as a real cache's would).
    pub fn release(&mut self, request: RequestId) {
        if let Some(req) = self.requests.remove(&request) {
            for (g, table) in req.tables.into_iter().enumerate() {
                for slot in table.into_iter().flatten() {
                    self.groups[g].give_back(slot);
                }
            }
        }
    }
}
