//! Layered chunk intake: a chunk submitted in ranges of the rank's layers (see
//! [`crate::layers`]). The first range is checked and applied as a whole chunk is (its block
//! runs are asked for and checked once, in `intake.rs`); each later range is checked against the
//! open chunk and becomes a slice that writes its layers of the first range's blocks.

use super::session::{OpenChunk, SliceLayers};
use super::*;
use crate::geometry::ChunkSpecField;

/// What a checked layer range does.
pub(super) enum RangeStep {
    /// The chunk's first range: the chunk's checks passed, its windows are asked for.
    First {
        next_phase: SendPhase,
        windows: super::intake::Windows,
    },
    /// A later range of the open chunk: it asks the block source nothing.
    Later { next_phase: SendPhase },
}

impl Sender {
    /// The usage error for a chunk submitted while `open`'s layers are not all submitted.
    pub(super) fn chunk_layers_unfinished(
        &self,
        request: RequestId,
        open: &OpenChunk,
    ) -> UsageError {
        UsageError::ChunkLayersUnfinished {
            request,
            next_layer: open.next_layer,
            layers: self.layer_count,
        }
    }

    /// The checks on a layer range that need no block run; the state is not changed.
    pub(super) fn check_chunk_layers(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
        layers: LayerRange,
    ) -> Result<RangeStep, UsageError> {
        let session = self.sessions.held(request)?;
        let Some(open) = session.open_chunk else {
            // The chunk's first range: every check of a whole chunk, then the range's.
            let next_phase = self.check_chunk(request, spec)?;
            check_range_bounds(request, layers, 0, self.layer_count)?;
            let windows = self.chunk_windows(request, spec)?;
            return Ok(RangeStep::First {
                next_phase,
                windows,
            });
        };
        let Some(next_phase) = super::intake::chunk_phase(session.phase, open.spec.is_last) else {
            return Err(UsageError::SessionEnded(request));
        };
        match open.spec.first_difference(spec) {
            None => {}
            // Another start is another chunk, which waits for this one's last range.
            Some(ChunkSpecField::Start) => return Err(self.chunk_layers_unfinished(request, &open)),
            // The same chunk, described differently: name what differs.
            Some(field) => {
                return Err(UsageError::ChunkRangeSpecMismatch {
                    request,
                    field,
                    open: open.spec,
                    got: *spec,
                })
            }
        }
        check_range_bounds(request, layers, open.next_layer, self.layer_count)?;
        Ok(RangeStep::Later { next_phase })
    }

    /// Applies a layer range (errors as in [`Self::on_chunk`]).
    pub(super) fn on_chunk_layers(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        match self.check_chunk_layers(request, &spec, layers)? {
            RangeStep::First {
                next_phase,
                windows,
            } => self.apply_chunk(now, request, spec, next_phase, &windows, runs, Some(layers)),
            RangeStep::Later { next_phase } => {
                self.apply_later_range(now, request, layers, next_phase, runs)
            }
        }
    }

    /// The first range of a chunk submitted in several (its runs were checked and applied):
    /// opens the chunk and, when the chunk writes something, creates the range's slice, which
    /// holds the chunk's runs.
    pub(super) fn open_layered_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Option<SenderSliceId> {
        let session = self
            .sessions
            .live
            .get_mut(&request)
            .expect("the caller checked");
        let writes = !runs.is_empty();
        let runs_at = writes.then_some(session.slices.len());
        session.open_chunk = Some(OpenChunk {
            spec,
            next_layer: layers.end,
            runs_at,
        });
        let at = runs_at?;
        let groups = self
            .config
            .layer_order
            .group_ranges(&self.config.local.groups, layers);
        let layers = SliceLayers {
            runs_at: at,
            groups,
            last_of_chunk: false,
        };
        Some(self.add_slice(now, request, false, runs, Some(layers)))
    }

    /// A later range of the open chunk: it reuses the first range's runs, so it must be given
    /// none.
    fn apply_later_range(
        &mut self,
        now: Instant,
        request: RequestId,
        layers: LayerRange,
        next_phase: SendPhase,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        if !runs.is_empty() {
            return Err(UsageError::RunsDoNotMatchChunk {
                request,
                expected: Vec::new(),
                given: runs.iter().map(|(g, _)| *g).collect(),
            });
        }
        let last_of_chunk = layers.end == self.layer_count;
        let session = self.sessions.live.get_mut(&request).expect("checked above");
        let Some(open) = session.open_chunk.as_mut() else {
            // Checked above: a later range has an open chunk.
            return Err(UsageError::SessionEnded(request));
        };
        open.next_layer = layers.end;
        let (spec, runs_at) = (open.spec, open.runs_at);
        if last_of_chunk {
            session.open_chunk = None;
            session.phase = next_phase;
            if spec.is_last {
                session.timings.last_chunk = Some(now);
            }
        }
        let is_last = spec.is_last && last_of_chunk;
        let Some(runs_at) = runs_at else {
            // The chunk writes nothing: only the last chunk's last range has a slice, which
            // carries the request's last result.
            return Ok(Submitted::sent(
                is_last.then(|| self.add_slice(now, request, true, Vec::new(), None)),
            ));
        };
        let groups = self
            .config
            .layer_order
            .group_ranges(&self.config.local.groups, layers);
        let slice_layers = SliceLayers {
            runs_at,
            groups,
            last_of_chunk,
        };
        Ok(Submitted::Slice(self.add_slice(
            now,
            request,
            is_last,
            Vec::new(),
            Some(slice_layers),
        )))
    }
}

/// A range must be non-empty, start at `next` (the rank's first layer for a chunk's first
/// range, the previous range's end after it) and lie within the rank's `count` layers.
fn check_range_bounds(
    request: RequestId,
    layers: LayerRange,
    next: u32,
    count: u32,
) -> Result<(), UsageError> {
    if layers.is_empty() {
        return Err(UsageError::LayerRangeEmpty { request, layers });
    }
    if layers.end > count {
        return Err(UsageError::LayerRangePastLayers {
            request,
            layers,
            count,
        });
    }
    if layers.begin != next {
        return Err(UsageError::LayerRangeOutOfOrder {
            request,
            layers,
            expected: next,
        });
    }
    Ok(())
}
