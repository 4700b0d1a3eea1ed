//! [`apply_plan`]: carrying out a write plan between two caches by memcpy, bounds-checked first.

use kvpipe_core::{RegionId, WritePlan};
use thiserror::Error;

use super::ReferenceCache;

/// Carries out `plan` by memcpy from `src`'s regions to `dst`'s; returns the bytes copied.
/// Every extent is bounds-checked first, so a bad plan changes nothing.
pub fn apply_plan(
    src: &ReferenceCache,
    dst: &mut ReferenceCache,
    plan: &WritePlan,
) -> Result<u64, ApplyError> {
    for e in plan.extents() {
        let s = src.region(e.src_region).ok_or(ApplyError::UnknownRegion {
            side: "sender",
            region: e.src_region,
        })?;
        let d = dst.region(e.dst_region).ok_or(ApplyError::UnknownRegion {
            side: "receiver",
            region: e.dst_region,
        })?;
        for (side, region, offset, size) in [
            ("sender", e.src_region, e.src_offset, s.len()),
            ("receiver", e.dst_region, e.dst_offset, d.len()),
        ] {
            if offset
                .checked_add(e.len)
                .is_none_or(|end| end > size as u64)
            {
                return Err(ApplyError::OutOfBounds {
                    side,
                    region,
                    offset,
                    len: e.len,
                    size: size as u64,
                });
            }
        }
    }
    let mut copied = 0;
    for e in plan.extents() {
        let (so, doff, len) = (e.src_offset as usize, e.dst_offset as usize, e.len as usize);
        let s = &src.region(e.src_region).unwrap_or_default()[so..so + len];
        dst.region_mut(e.dst_region).unwrap_or_default()[doff..doff + len].copy_from_slice(s);
        copied += e.len;
    }
    Ok(copied)
}

/// Why a write plan could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ApplyError {
    /// The plan names a region the cache does not have.
    #[error("the {side} cache has no {region}")]
    UnknownRegion {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
    },
    /// An extent runs past its region.
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
