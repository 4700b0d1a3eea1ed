//! Plans a request's chunks group by group the way a sender does: chunk window, bounded block
//! query, ordinal pairing. Shared by the `kvpipe plan` command, the plan bench and the tests.

use kvpipe_core::{
    chunk_window, plan_group_with_cursor, AnchoredRun, BlockRun, BlockSource, BlockSourceError,
    BlockWindow, ChunkSpec, DstCursor, GeometryError, GroupIndex, LayerGroupLayout, PairStats,
    PlanError, RequestId, WritePlan,
};
use thiserror::Error;

/// The sender's planning state for one request and one receiver: both sides' layouts, the
/// receiver's runs, a cursor per group and reused buffers, so planning a chunk allocates
/// nothing once the buffers have grown.
#[derive(Clone, Debug)]
pub struct ChunkPlanner {
    src_layouts: Vec<LayerGroupLayout>,
    dst_layouts: Vec<LayerGroupLayout>,
    dst_runs: Vec<AnchoredRun>,
    cursors: Vec<DstCursor>,
    src: BlockRun,
    plan: WritePlan,
}

/// What planning one group of one chunk produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupChunkPlan {
    /// The ordinals the chunk sends for the group.
    pub window: BlockWindow,
    /// The source run the cache returned.
    pub src_first_ordinal: u32,
    /// Length of that run.
    pub src_blocks: u32,
    /// The pairing's statistics.
    pub stats: PairStats,
    /// The group's extents in [`ChunkPlanner::plan`]: `extents.0..extents.1`.
    pub extents: (usize, usize),
}

impl ChunkPlanner {
    /// A planner for one request: per group, the sender's and receiver's layouts and the
    /// receiver's anchored run.
    pub fn new(
        src_layouts: Vec<LayerGroupLayout>,
        dst_layouts: Vec<LayerGroupLayout>,
        dst_runs: Vec<AnchoredRun>,
    ) -> Self {
        let groups = src_layouts.len();
        ChunkPlanner {
            src_layouts,
            dst_layouts,
            dst_runs,
            cursors: vec![DstCursor::default(); groups],
            src: BlockRun::default(),
            plan: WritePlan::new(),
        }
    }

    /// The plan built since the last [`ChunkPlanner::clear`].
    pub fn plan(&self) -> &WritePlan {
        &self.plan
    }

    /// The per-group cursors into the receiver's runs (where the next chunk's search starts).
    pub fn cursors(&self) -> &[DstCursor] {
        &self.cursors
    }

    /// Puts the cursors back to a state saved with [`ChunkPlanner::cursors`] (benches replan a
    /// chunk from the state its predecessor left).
    pub fn restore_cursors(&mut self, cursors: &[DstCursor]) {
        self.cursors.copy_from_slice(cursors);
    }

    /// Empties the plan, keeping its buffer.
    pub fn clear(&mut self) {
        self.plan.clear();
    }

    /// Appends `group`'s writes for `chunk` to the plan; `None` when the group sends nothing in
    /// this chunk (the cache is then not queried).
    pub fn plan_group(
        &mut self,
        source: &mut impl BlockSource,
        request: RequestId,
        chunk: &ChunkSpec,
        group: GroupIndex,
    ) -> Result<Option<GroupChunkPlan>, ChunkPlanError> {
        let g = usize::from(group.0);
        let (Some(src_layout), Some(dst_layout), Some(dst_run)) = (
            self.src_layouts.get(g),
            self.dst_layouts.get(g),
            self.dst_runs.get(g),
        ) else {
            return Err(ChunkPlanError::UnknownGroup(group));
        };
        let Some(window) = chunk_window(chunk, src_layout)? else {
            return Ok(None);
        };
        source.block_run(request, group, window.begin, window.end, &mut self.src)?;
        let before = self.plan.len();
        let stats = plan_group_with_cursor(
            src_layout,
            dst_layout,
            &self.src,
            dst_run,
            &mut self.cursors[g],
            &mut self.plan,
        )?;
        Ok(Some(GroupChunkPlan {
            window,
            src_first_ordinal: self.src.first_ordinal,
            src_blocks: self.src.ids.len() as u32,
            stats,
            extents: (before, self.plan.len()),
        }))
    }

    /// Clears the plan and plans every group of `chunk`; returns the number of extents.
    pub fn plan_chunk(
        &mut self,
        source: &mut impl BlockSource,
        request: RequestId,
        chunk: &ChunkSpec,
    ) -> Result<usize, ChunkPlanError> {
        self.plan.clear();
        for g in 0..self.src_layouts.len() {
            self.plan_group(source, request, chunk, GroupIndex(g as u16))?;
        }
        Ok(self.plan.len())
    }
}

/// Why a chunk could not be planned.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ChunkPlanError {
    /// The chunk does not fit the prompt or layout.
    #[error("chunk geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// The cache refused the bounded query.
    #[error("block source: {0}")]
    Source(#[from] BlockSourceError),
    /// The two sides' layouts cannot be paired.
    #[error("write planning: {0}")]
    Plan(#[from] PlanError),
    /// The planner has no such group.
    #[error("the planner has no {0}")]
    UnknownGroup(GroupIndex),
}
