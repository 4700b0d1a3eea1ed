//! Write plans: the byte extents a slice copies from sender memory to receiver memory, and
//! [`plan_group`], which pairs one chunk's source blocks with the receiver's blocks by ordinal
//! and turns the pairs into coalesced extents — whole layers when both ranks hold the same
//! part of the model, layer ranges and head slices when tensor or pipeline parallelism differs
//! between the sides ([`plan_rank_group`], [`shard`](crate::shard)).
//!
//! - `write_plan.rs`: the plan type ([`WritePlan`] of [`WriteExtent`]s) and its coalescing;
//! - `pairing.rs`: whether two layouts of a group can be paired, and what both ranks hold;
//! - `cursor.rs`: the search of the receiver's run ([`DstCursor`]) and its overlaps with a chunk;
//! - `segments.rs`: the layer ranges one sender pool and one receiver pool both hold;
//! - `extents.rs`: a layer range's whole-layer or head-slice extents for the paired blocks;
//! - `planner.rs`: the entry points ([`plan_group`], [`plan_rank_group`] and their variants);
//! - `error.rs`: [`PlanError`] and the [`Side`] it names.
//!
//! No two files import each other: `planner` uses the rest, `extents` uses `cursor`, `pairing`,
//! `segments` and `write_plan`, and `pairing` and `segments` use `error`.

mod cursor;
mod error;
mod extents;
mod pairing;
mod planner;
mod segments;
#[cfg(test)]
mod tests;
mod write_plan;

pub use cursor::DstCursor;
pub use error::{PlanError, Side};
pub use pairing::{check_layout, check_pairable, GroupPairing};
pub use planner::{
    plan_group, plan_group_with_cursor, plan_rank_group, plan_rank_group_layers, PairStats,
    RankGroup,
};
pub use write_plan::{WriteExtent, WritePlan};
