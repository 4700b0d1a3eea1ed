//! Executing write plans: resolving extents against registrations and copying them.

use std::sync::Arc;

use kvpipe_core::{RegionId, WritePlan};
use thiserror::Error;

use crate::region::{RegionMemory, RegionTable, Registration};

/// One extent of a write batch, resolved to the registrations it reads and writes. Holding it
/// keeps both registrations in use.
#[derive(Clone, Debug)]
pub struct Segment {
    src: Arc<Registration>,
    src_offset: usize,
    dst: Arc<Registration>,
    dst_offset: usize,
    len: usize,
}

impl Segment {
    /// Bytes copied.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment copies nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A write plan resolved against the two sides' registrations, bounds-checked: executing it
/// cannot touch memory outside them.
#[derive(Clone, Debug, Default)]
pub struct ResolvedBatch {
    segments: Vec<Segment>,
    bytes: u64,
}

/// Why a plan could not be resolved; the batch then fails without copying anything.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WriteError {
    /// An extent names a region the side did not register.
    #[error("the {side} has no registered {region}")]
    UnknownRegion {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
    },
    /// An extent runs past the end of its region.
    #[error("{side} extent {offset}+{len} runs past {region}'s {size} bytes")]
    OutOfBounds {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
        /// Start of the extent.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's size.
        size: u64,
    },
}

fn checked(
    side: &'static str,
    table: &RegionTable,
    region: RegionId,
    offset: u64,
    len: u64,
) -> Result<(Arc<Registration>, usize), WriteError> {
    let reg = table
        .get(region)
        .ok_or(WriteError::UnknownRegion { side, region })?;
    let size = reg.memory.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(WriteError::OutOfBounds {
            side,
            region,
            offset,
            len,
            size,
        });
    }
    Ok((Arc::clone(reg), offset as usize))
}

impl ResolvedBatch {
    /// Resolves every extent of `plan`: sources in `src`, destinations in `dst`.
    pub fn resolve(
        plan: &WritePlan,
        src: &RegionTable,
        dst: &RegionTable,
    ) -> Result<Self, WriteError> {
        let mut segments = Vec::with_capacity(plan.len());
        let mut bytes = 0;
        for e in plan.extents() {
            let (s, so) = checked("sender", src, e.src_region, e.src_offset, e.len)?;
            let (d, doff) = checked("receiver", dst, e.dst_region, e.dst_offset, e.len)?;
            bytes += e.len;
            segments.push(Segment {
                src: s,
                src_offset: so,
                dst: d,
                dst_offset: doff,
                len: e.len as usize,
            });
        }
        Ok(ResolvedBatch { segments, bytes })
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The segments, in plan order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Keeps the segments whose entry in `keep` (one per segment, in plan order) is true.
    pub fn retain(&mut self, keep: &[bool]) {
        let mut flags = keep.iter();
        self.segments
            .retain(|_| flags.next().copied().unwrap_or(false));
        self.bytes = self.segments.iter().map(|s| s.len as u64).sum();
    }

    /// Keeps only the first half of the bytes (a write that failed part-way).
    pub fn truncate_half(&mut self) {
        let mut keep = self.bytes / 2;
        let mut out = Vec::new();
        for mut s in self.segments.drain(..) {
            if keep == 0 {
                break;
            }
            let take = (s.len as u64).min(keep);
            s.len = take as usize;
            keep -= take;
            out.push(s);
        }
        self.bytes = out.iter().map(|s| s.len as u64).sum();
        self.segments = out;
    }

    /// Copies every segment, split evenly over `threads` threads (the calling thread is one of
    /// them) when the batch holds at least `parallel_threshold` bytes.
    pub fn execute(&self, threads: usize, parallel_threshold: u64) {
        let threads = threads.max(1);
        if threads == 1 || self.bytes < parallel_threshold {
            for s in &self.segments {
                copy_segment(s, 0, s.len);
            }
            return;
        }
        let lens: Vec<usize> = self.segments.iter().map(|s| s.len).collect();
        let shares = split_even(&lens, threads);
        std::thread::scope(|scope| {
            let mut shares = shares.into_iter();
            let first = shares.next().unwrap_or_default();
            for share in shares {
                scope.spawn(move || {
                    for p in share {
                        copy_segment(&self.segments[p.index], p.offset, p.len);
                    }
                });
            }
            for p in first {
                copy_segment(&self.segments[p.index], p.offset, p.len);
            }
        });
    }
}

/// A piece of one extent: bytes `offset..offset + len` of extent `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The extent.
    pub index: usize,
    /// First byte inside the extent.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Splits extents of lengths `lens` into `parts` shares of (nearly) equal bytes, in order; an
/// extent crossing a share boundary is cut. Used by the transport and by the memcpy baseline of
/// `kvpipe bench transfer`, so both copy the same pieces on the same number of threads.
pub fn split_even(lens: &[usize], parts: usize) -> Vec<Vec<Piece>> {
    let parts = parts.max(1);
    let total: usize = lens.iter().sum();
    let share = total.div_ceil(parts).max(1);
    let mut out = vec![Vec::new(); parts];
    let mut part = 0;
    let mut room = share;
    for (index, &len) in lens.iter().enumerate() {
        let mut offset = 0;
        while offset < len {
            if room == 0 {
                part = (part + 1).min(parts - 1);
                room = share;
            }
            let take = (len - offset).min(room);
            out[part].push(Piece {
                index,
                offset,
                len: take,
            });
            offset += take;
            room -= take;
        }
    }
    out
}

/// Copies bytes `offset..offset + len` of segment `s`, dispatching on the pair of memory kinds.
fn copy_segment(s: &Segment, offset: usize, len: usize) {
    match (&s.src.memory, &s.dst.memory) {
        (RegionMemory::Host(src), RegionMemory::Host(dst)) => {
            // SAFETY: `resolve` checked both ranges against the registrations, which the
            // segment keeps alive; the registration contract guarantees the memory is valid
            // and that nothing else touches these bytes while the batch is in flight.
            // `ptr::copy` tolerates a source and destination registered over the same memory.
            unsafe {
                std::ptr::copy(
                    src.as_ptr().add(s.src_offset + offset),
                    dst.as_ptr().add(s.dst_offset + offset),
                    len,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_every_byte_once_in_order() {
        for (lens, parts) in [
            (vec![10usize, 3, 7], 3usize),
            (vec![100], 4),
            (vec![1, 1, 1], 8),
            (vec![], 2),
            (vec![5, 0, 5], 2),
        ] {
            let shares = split_even(&lens, parts);
            assert_eq!(shares.len(), parts);
            let mut seen: Vec<Vec<bool>> = lens.iter().map(|&l| vec![false; l]).collect();
            for p in shares.iter().flatten() {
                for b in &mut seen[p.index][p.offset..p.offset + p.len] {
                    assert!(!*b, "byte copied twice");
                    *b = true;
                }
            }
            assert!(seen.iter().flatten().all(|&b| b), "byte not copied");
            let total: usize = lens.iter().sum();
            for s in &shares {
                let bytes: usize = s.iter().map(|p| p.len).sum();
                assert!(bytes <= total.div_ceil(parts).max(1));
            }
        }
    }
}
