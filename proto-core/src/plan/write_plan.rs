//! [`WriteExtent`] and [`WritePlan`]: the writes of one slice, merged as they are appended
//! wherever both sides are contiguous.

use crate::ids::RegionId;

/// One write: `len` bytes from `src_region + src_offset` (sender) to
/// `dst_region + dst_offset` (receiver).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WriteExtent {
    /// Sender region (a KV pool).
    pub src_region: RegionId,
    /// Byte offset in the sender region.
    pub src_offset: u64,
    /// Receiver region (a KV pool).
    pub dst_region: RegionId,
    /// Byte offset in the receiver region.
    pub dst_offset: u64,
    /// Bytes to write.
    pub len: u64,
}

/// The coalesced writes of one slice. The buffer is kept across chunks (`clear` keeps the
/// capacity), so steady-state planning allocates nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WritePlan {
    pub(super) extents: Vec<WriteExtent>,
}

impl WritePlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the plan, keeping its buffer.
    pub fn clear(&mut self) {
        self.extents.clear();
    }

    /// The writes, in planning order.
    pub fn extents(&self) -> &[WriteExtent] {
        &self.extents
    }

    /// Total bytes the plan writes.
    pub fn total_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }

    /// Whether the plan writes nothing.
    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// Number of (coalesced) writes.
    pub fn len(&self) -> usize {
        self.extents.len()
    }

    /// Extents the plan can hold without allocating.
    pub fn capacity(&self) -> usize {
        self.extents.capacity()
    }

    /// Makes room for at least `additional` more extents, so later planning does not allocate.
    pub fn reserve(&mut self, additional: usize) {
        self.extents.reserve(additional);
    }

    /// Appends a write, merging it into the previous one when both sides are contiguous.
    pub fn push(&mut self, extent: WriteExtent) {
        if extent.len == 0 {
            return;
        }
        if let Some(last) = self.extents.last_mut() {
            if last.src_region == extent.src_region
                && last.dst_region == extent.dst_region
                && last.src_offset.checked_add(last.len) == Some(extent.src_offset)
                && last.dst_offset.checked_add(last.len) == Some(extent.dst_offset)
            {
                last.len += extent.len;
                return;
            }
        }
        self.extents.push(extent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(src: u64, dst: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(1),
            src_offset: src,
            dst_region: RegionId(2),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn push_coalesces_only_when_both_sides_are_contiguous() {
        let mut plan = WritePlan::new();
        plan.push(ext(0, 100, 10));
        plan.push(ext(10, 110, 10)); // contiguous on both sides
        plan.push(ext(20, 200, 10)); // contiguous at the source only
        plan.push(ext(40, 210, 10)); // contiguous at the destination only
        plan.push(ext(50, 220, 0)); // empty: dropped
        assert_eq!(
            plan.extents(),
            &[ext(0, 100, 20), ext(20, 200, 10), ext(40, 210, 10)]
        );
        assert_eq!(plan.total_bytes(), 40);
        plan.clear();
        assert!(plan.is_empty());
    }
}
