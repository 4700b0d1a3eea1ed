//! Turning a write plan into RDMA WRITE work requests, independent of the verbs calls that post
//! them (so it is tested without a device).
//!
//! 1. Each extent's source must lie inside a locally registered region; its bytes are named by
//!    that region's address and local key. A source outside is refused (a local bug, nothing is
//!    posted).
//! 2. Each extent's destination region must be one the peer announced; the remote address is
//!    the announced address plus the offset (overflow refused). The destination is **not**
//!    checked against the announced length here: the peer's adapter checks every byte against
//!    its memory registration and answers a write outside it with a remote access error,
//!    which fails the link (the receiver's protection does not depend on the sender's code).
//! 3. Consecutive extents whose destinations are contiguous in one region share one work
//!    request, each source a scatter/gather entry (up to `max_sge` entries and `max_bytes`
//!    bytes per request). Extents longer than `max_bytes` are split.

use kvpipe_core::{RegionId, WriteExtent};
use thiserror::Error;

use crate::bootstrap::RegionDescriptor;

/// A local registered region as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRegion {
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key of the registration.
    pub lkey: u32,
}

/// One scatter/gather entry: local bytes a work request reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Address of the first byte.
    pub addr: u64,
    /// Length (at most `u32::MAX`).
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

/// One RDMA WRITE: its segments are `segments[first..first + count]` of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRequest {
    /// Destination address on the peer.
    pub remote_addr: u64,
    /// The peer's remote key for it.
    pub rkey: u32,
    /// Index of the first segment.
    pub first: usize,
    /// Number of segments.
    pub count: usize,
    /// Bytes written.
    pub len: u64,
}

/// A plan that cannot be turned into work requests.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WriteMappingError {
    /// The source region is not registered locally.
    #[error("source {0} is not a registered local region")]
    UnknownSource(RegionId),
    /// The source bytes lie outside the local region.
    #[error("source bytes {offset}..+{len} lie outside {region} ({region_len} bytes)")]
    SourceOutOfBounds {
        /// The region.
        region: RegionId,
        /// Offset of the extent.
        offset: u64,
        /// Length of the extent.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The peer did not announce the destination region.
    #[error("destination {0} was not announced by the peer")]
    UnknownDestination(RegionId),
    /// The destination address overflows.
    #[error("destination offset {offset} overflows {region}'s address")]
    DestinationOverflow {
        /// The region.
        region: RegionId,
        /// The offset.
        offset: u64,
    },
}

/// Limits of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrLimits {
    /// Scatter/gather entries per work request (the queue pair's `max_send_sge`).
    pub max_sge: usize,
    /// Bytes per work request (at most the port's maximum message size).
    pub max_bytes: u64,
}

/// Appends the work requests of `extents` to `wrs` and their segments to `segments` (both
/// cleared first). On error both are left empty.
pub fn map_extents(
    extents: &[WriteExtent],
    local: impl Fn(RegionId) -> Option<LocalRegion>,
    remote: impl Fn(RegionId) -> Option<RegionDescriptor>,
    limits: WrLimits,
    wrs: &mut Vec<WriteRequest>,
    segments: &mut Vec<Segment>,
) -> Result<(), WriteMappingError> {
    wrs.clear();
    segments.clear();
    let r = map_into(extents, local, remote, limits, wrs, segments);
    if r.is_err() {
        wrs.clear();
        segments.clear();
    }
    r
}

fn map_into(
    extents: &[WriteExtent],
    local: impl Fn(RegionId) -> Option<LocalRegion>,
    remote: impl Fn(RegionId) -> Option<RegionDescriptor>,
    limits: WrLimits,
    wrs: &mut Vec<WriteRequest>,
    segments: &mut Vec<Segment>,
) -> Result<(), WriteMappingError> {
    let max_sge = limits.max_sge.max(1);
    let max_bytes = limits.max_bytes.clamp(1, u64::from(u32::MAX));
    // The region of the open work request, to extend it only within one region.
    let mut open: Option<RegionId> = None;
    for e in extents.iter().filter(|e| e.len > 0) {
        let src = local(e.src_region).ok_or(WriteMappingError::UnknownSource(e.src_region))?;
        let inside = e
            .src_offset
            .checked_add(e.len)
            .is_some_and(|end| end <= src.len);
        if !inside {
            return Err(WriteMappingError::SourceOutOfBounds {
                region: e.src_region,
                offset: e.src_offset,
                len: e.len,
                region_len: src.len,
            });
        }
        let dst =
            remote(e.dst_region).ok_or(WriteMappingError::UnknownDestination(e.dst_region))?;
        let overflow = WriteMappingError::DestinationOverflow {
            region: e.dst_region,
            offset: e.dst_offset,
        };
        let mut remote_addr = dst
            .addr
            .checked_add(e.dst_offset)
            .ok_or_else(|| overflow.clone())?;
        remote_addr
            .checked_add(e.len)
            .ok_or_else(|| overflow.clone())?;
        let mut src_addr = src.addr + e.src_offset;
        let mut left = e.len;
        while left > 0 {
            let extend = match wrs.last() {
                Some(w) => {
                    open == Some(e.dst_region)
                        && w.rkey == dst.rkey
                        && w.remote_addr + w.len == remote_addr
                        && w.count < max_sge
                        && w.len < max_bytes
                }
                None => false,
            };
            if !extend {
                wrs.push(WriteRequest {
                    remote_addr,
                    rkey: dst.rkey,
                    first: segments.len(),
                    count: 0,
                    len: 0,
                });
                open = Some(e.dst_region);
            }
            let w = wrs.last_mut().expect("just ensured");
            let piece = left.min(max_bytes - w.len);
            segments.push(Segment {
                addr: src_addr,
                len: piece as u32,
                lkey: src.lkey,
            });
            w.count += 1;
            w.len += piece;
            src_addr += piece;
            remote_addr += piece;
            left -= piece;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(src: u32, so: u64, dst: u32, d: u64, len: u64) -> WriteExtent {
        WriteExtent {
            src_region: RegionId(src),
            src_offset: so,
            dst_region: RegionId(dst),
            dst_offset: d,
            len,
        }
    }

    fn local(r: RegionId) -> Option<LocalRegion> {
        (r.0 < 3).then_some(LocalRegion {
            addr: 0x1000_0000 * u64::from(r.0 + 1),
            len: 1 << 20,
            lkey: 100 + r.0,
        })
    }

    fn remote(r: RegionId) -> Option<RegionDescriptor> {
        (r.0 >= 10).then_some(RegionDescriptor {
            region: r,
            rkey: 200 + r.0,
            addr: 0x9000_0000 + 0x100_0000 * u64::from(r.0),
            len: 1 << 20,
        })
    }

    fn map(
        extents: &[WriteExtent],
        limits: WrLimits,
    ) -> Result<(Vec<WriteRequest>, Vec<Segment>), WriteMappingError> {
        let (mut w, mut s) = (Vec::new(), Vec::new());
        map_extents(extents, local, remote, limits, &mut w, &mut s).map(|()| (w, s))
    }

    const WIDE: WrLimits = WrLimits {
        max_sge: 4,
        max_bytes: 1 << 30,
    };

    #[test]
    fn contiguous_destinations_share_a_request_with_several_segments() {
        // Two sources from different regions landing back to back, then a jump.
        let (wrs, segs) = map(
            &[
                ext(0, 0, 10, 0, 100),
                ext(1, 500, 10, 100, 50),
                ext(0, 4096, 10, 8192, 10),
            ],
            WIDE,
        )
        .expect("maps");
        assert_eq!(wrs.len(), 2);
        assert_eq!((wrs[0].count, wrs[0].len), (2, 150));
        assert_eq!(wrs[0].remote_addr, remote(RegionId(10)).unwrap().addr);
        assert_eq!(wrs[0].rkey, 210);
        assert_eq!(
            segs[1],
            Segment {
                addr: 0x2000_0000 + 500,
                len: 50,
                lkey: 101
            }
        );
        assert_eq!((wrs[1].first, wrs[1].count), (2, 1));
        assert_eq!(
            wrs[1].remote_addr,
            remote(RegionId(10)).unwrap().addr + 8192
        );
    }

    #[test]
    fn requests_respect_the_segment_and_byte_limits() {
        let limits = WrLimits {
            max_sge: 2,
            max_bytes: 64,
        };
        let extents: Vec<_> = (0..5).map(|i| ext(0, i * 1000, 11, i * 10, 10)).collect();
        let (wrs, segs) = map(&extents, limits).expect("maps");
        assert_eq!(wrs.iter().map(|w| w.count).collect::<Vec<_>>(), [2, 2, 1]);
        assert_eq!(segs.len(), 5);
        // One long extent is split at the byte limit.
        let (wrs, segs) = map(&[ext(2, 0, 12, 0, 200)], limits).expect("maps");
        assert_eq!(
            wrs.iter().map(|w| w.len).collect::<Vec<_>>(),
            [64, 64, 64, 8]
        );
        assert_eq!(segs.iter().map(|s| u64::from(s.len)).sum::<u64>(), 200);
        assert_eq!(wrs[3].remote_addr - wrs[0].remote_addr, 192);
        // Every byte is covered exactly once, in order.
        let mut at = segs[0].addr;
        for s in &segs {
            assert_eq!(s.addr, at);
            at += u64::from(s.len);
        }
    }

    #[test]
    fn refuses_unknown_or_out_of_bounds_regions_and_leaves_nothing() {
        let (mut w, mut s) = (Vec::new(), Vec::new());
        let bad = [ext(0, 0, 10, 0, 8), ext(7, 0, 10, 8, 8)];
        assert_eq!(
            map_extents(&bad, local, remote, WIDE, &mut w, &mut s),
            Err(WriteMappingError::UnknownSource(RegionId(7)))
        );
        assert!(w.is_empty() && s.is_empty());
        assert_eq!(
            map(&[ext(0, 0, 3, 0, 8)], WIDE),
            Err(WriteMappingError::UnknownDestination(RegionId(3)))
        );
        assert!(matches!(
            map(&[ext(0, (1 << 20) - 4, 10, 0, 8)], WIDE),
            Err(WriteMappingError::SourceOutOfBounds { .. })
        ));
        assert!(matches!(
            map(&[ext(0, 0, 10, u64::MAX - 4, 8)], WIDE),
            Err(WriteMappingError::DestinationOverflow { .. })
        ));
        // Past the announced length is the peer adapter's to refuse, not this mapping's.
        assert!(map(&[ext(0, 0, 10, 2 << 20, 8)], WIDE).is_ok());
        assert_eq!(map(&[], WIDE), Ok((Vec::new(), Vec::new())));
    }
}
