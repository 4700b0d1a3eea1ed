//! What a cache holds, read without changing it: its geometry and layouts, slot occupancy,
//! the regions' bytes and where a byte lies ([`SlotLocation`]), block tables.

use kvpipe_core::{
    BlockId, BlockRun, BlockSourceError, GroupIndex, LayerGroupLayout, RegionId, RequestId,
};

use super::ReferenceCache;

/// Where a byte of a region lies in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotLocation {
    /// The group owning the region.
    pub group: GroupIndex,
    /// Index of the pool in the group.
    pub pool: usize,
    /// The slot.
    pub slot: BlockId,
    /// Byte offset inside the slot.
    pub offset_in_slot: u64,
}

impl ReferenceCache {
    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u32 {
        self.tpb
    }

    /// Number of layer groups.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// The layout of `group` as the core sees it.
    pub fn layout(&self, group: GroupIndex) -> Option<&LayerGroupLayout> {
        self.groups.get(usize::from(group.0)).map(|g| &g.layout)
    }

    /// Every group's layout, in group order.
    pub fn layouts(&self) -> Vec<LayerGroupLayout> {
        self.groups.iter().map(|g| g.layout.clone()).collect()
    }

    /// Free slots left in `group`.
    pub fn free_slots(&self, group: GroupIndex) -> usize {
        self.groups
            .get(usize::from(group.0))
            .map_or(0, |g| g.free.len())
    }

    /// The most slots `group` held at once since the cache was built. Slots are reused
    /// last-freed first, so this is also how many distinct slots were ever used: for a
    /// windowed group, the part of its memory the OS committed.
    pub fn peak_slots(&self, group: GroupIndex) -> u32 {
        self.groups.get(usize::from(group.0)).map_or(0, |g| g.peak)
    }

    /// Bytes of the blocks held now, over every group and pool.
    pub fn resident_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.held) * g.block_bytes)
            .sum()
    }

    /// The most bytes each group held at once, summed over the groups: each group's
    /// [`ReferenceCache::peak_slots`] times its block bytes (its pools' slot bytes). It is the
    /// live KV the cache holds at its peak; a windowed pool's memory in RAM is exactly its part
    /// (a full-attention pool is committed whole, and its requests use it whole).
    pub fn peak_resident_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.peak) * g.block_bytes)
            .sum()
    }

    /// Table entries read by [`BlockSource::block_run`] since the cache was built: the bounded
    /// contract's cost, checked by tests.
    ///
    /// [`BlockSource::block_run`]: kvpipe_core::BlockSource::block_run
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// The bytes of a region (empty when the cache is not materialised).
    pub fn region(&self, id: RegionId) -> Option<&[u8]> {
        let &(g, p) = self
            .regions
            .get(id.0.checked_sub(self.first_region)? as usize)?;
        Some(&self.groups[g].memory[p])
    }

    /// The bytes of a region, writable (transports copy into it).
    pub fn region_mut(&mut self, id: RegionId) -> Option<&mut [u8]> {
        let &(g, p) = self
            .regions
            .get(id.0.checked_sub(self.first_region)? as usize)?;
        Some(&mut self.groups[g].memory[p])
    }

    /// Every region id of the cache.
    pub fn region_ids(&self) -> impl Iterator<Item = RegionId> + '_ {
        (0..self.regions.len() as u32).map(|i| RegionId(self.first_region + i))
    }

    /// Where byte `offset` of `region` lies.
    pub fn locate(&self, region: RegionId, offset: u64) -> Option<SlotLocation> {
        let &(g, p) = self
            .regions
            .get(region.0.checked_sub(self.first_region)? as usize)?;
        let slot_bytes = self.groups[g].layout.pools[p].slot_bytes;
        let slot = offset / slot_bytes;
        (slot < self.groups[g].owner.len() as u64).then_some(SlotLocation {
            group: GroupIndex(g as u16),
            pool: p,
            slot: BlockId(slot as u32),
            offset_in_slot: offset % slot_bytes,
        })
    }

    /// The (request, ordinal) a slot of `group` holds now.
    pub fn owner(&self, group: GroupIndex, slot: BlockId) -> Option<(RequestId, u32)> {
        *self
            .groups
            .get(usize::from(group.0))?
            .owner
            .get(slot.0 as usize)?
    }

    /// The block table of `request` in `group`: ordinal → slot (`None`: not resident).
    pub fn table(&self, request: RequestId, group: GroupIndex) -> Option<&[Option<BlockId>]> {
        Some(
            &self
                .requests
                .get(&request)?
                .tables
                .get(usize::from(group.0))?[..],
        )
    }

    /// The naive whole-list query the bounded contract replaces: walks every block of the
    /// request from ordinal 0 and returns a fresh list of the resident run ending at the
    /// allocation's end (restarting after each gap). O(request) and allocating; kept only as
    /// the baseline of `kvpipe bench plan` and as a monolithic transfer in tests.
    pub fn whole_block_list(
        &self,
        request: RequestId,
        group: GroupIndex,
    ) -> Result<BlockRun, BlockSourceError> {
        let req = self
            .requests
            .get(&request)
            .ok_or(BlockSourceError::UnknownRequest(request))?;
        let table = req
            .tables
            .get(usize::from(group.0))
            .ok_or(BlockSourceError::UnknownGroup(group))?;
        let mut run = BlockRun::default();
        for (ordinal, entry) in table.iter().enumerate() {
            match entry {
                Some(id) => run.ids.push(*id),
                None => {
                    run.ids.clear();
                    run.first_ordinal = ordinal as u32 + 1;
                }
            }
        }
        Ok(run)
    }

    /// Tokens of `request` whose KV the cache holds.
    pub fn computed_tokens(&self, request: RequestId) -> Option<u32> {
        self.requests.get(&request).map(|r| r.computed)
    }
}
