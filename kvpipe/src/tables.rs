//! A block source over the engine's block tables: what an engine that keeps, per request and
//! layer group, a list of slots indexed by block ordinal hands the sender.

use kvpipe_core::{BlockId, BlockRun, BlockSource, BlockSourceError, GroupIndex, RequestId};

/// One request's block tables, one per layer group: entry `o` of a group's table is the slot of
/// block ordinal `o`, or `None` when the block is not resident (evicted from a window, or not
/// kept). The table's length is the blocks allocated so far.
///
/// Answers the core's queries by the [`BlockSource`] contract, in O(end − begin): the run of
/// resident blocks ending at `end`, everything up to and including the last gap dropped; `end`
/// past the table is [`BlockSourceError::PastAllocation`], never clamped.
#[derive(Clone, Copy, Debug)]
pub struct BlockTables<'a> {
    /// The tables, in group order.
    pub groups: &'a [&'a [Option<BlockId>]],
}

impl BlockSource for BlockTables<'_> {
    fn block_run(
        &mut self,
        _request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let table = self
            .groups
            .get(usize::from(group.0))
            .ok_or(BlockSourceError::UnknownGroup(group))?;
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        let allocated = u32::try_from(table.len()).unwrap_or(u32::MAX);
        if end > allocated {
            return Err(BlockSourceError::PastAllocation { end, allocated });
        }
        let asked = &table[begin as usize..end as usize];
        let resident = asked.iter().rev().take_while(|slot| slot.is_some()).count();
        out.ids.clear();
        out.ids
            .extend(asked[asked.len() - resident..].iter().flatten().copied());
        out.first_ordinal = end - resident as u32;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(table: &[Option<BlockId>], begin: u32, end: u32) -> Result<BlockRun, BlockSourceError> {
        let groups = [table];
        let mut out = BlockRun::default();
        BlockTables { groups: &groups }.block_run(
            RequestId(1),
            GroupIndex(0),
            begin,
            end,
            &mut out,
        )?;
        Ok(out)
    }

    #[test]
    fn answers_by_the_block_source_contract() {
        let b = |i| Some(BlockId(i));
        // Sink block 0 resident, 1 evicted, 2..5 the window.
        let table = [b(10), None, b(12), b(13), b(14)];
        assert_eq!(
            run(&table, 2, 5).unwrap(),
            BlockRun {
                first_ordinal: 2,
                ids: vec![BlockId(12), BlockId(13), BlockId(14)]
            }
        );
        // The last gap and everything before it are dropped.
        assert_eq!(run(&table, 0, 5).unwrap().first_ordinal, 2);
        // An empty range is anchored at its end.
        assert_eq!(
            run(&table, 3, 3).unwrap(),
            BlockRun {
                first_ordinal: 3,
                ids: vec![]
            }
        );
        // A range ending in a gap has no resident run.
        assert_eq!(
            run(&table, 0, 2).unwrap(),
            BlockRun {
                first_ordinal: 2,
                ids: vec![]
            }
        );
        assert_eq!(
            run(&table, 0, 6),
            Err(BlockSourceError::PastAllocation {
                end: 6,
                allocated: 5
            })
        );
        assert_eq!(
            run(&table, 4, 3),
            Err(BlockSourceError::BeginAfterEnd { begin: 4, end: 3 })
        );
        let mut out = BlockRun::default();
        let groups: [&[Option<BlockId>]; 1] = [&table];
        assert_eq!(
            BlockTables { groups: &groups }.block_run(RequestId(1), GroupIndex(1), 0, 1, &mut out),
            Err(BlockSourceError::UnknownGroup(GroupIndex(1)))
        );
    }
}
