//! The cache as the sender's [`BlockSource`]: the bounded block-run query.

use kvpipe_core::{BlockRun, BlockSource, BlockSourceError, GroupIndex, RequestId};

use super::ReferenceCache;

impl BlockSource for ReferenceCache {
    /// The bounded query: walks back from `end` over resident blocks only, never past `begin`,
    /// so it reads at most `end - begin` table entries.
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(BlockSourceError::UnknownRequest(request))?;
        let table = req
            .tables
            .get(usize::from(group.0))
            .ok_or(BlockSourceError::UnknownGroup(group))?;
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end as usize > table.len() {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: table.len() as u32,
            });
        }
        out.ids.clear();
        let mut first = end;
        while first > begin {
            self.lookups += 1;
            match table[first as usize - 1] {
                Some(id) => out.ids.push(id),
                None => break,
            }
            first -= 1;
        }
        out.ids.reverse();
        out.first_ordinal = first;
        Ok(())
    }
}
