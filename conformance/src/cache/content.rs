//! Deterministic cache contents: every byte of a request's KV is a function of where it belongs,
//! so a byte written to the wrong block, layer or offset is detectable.

use kvpipe_core::{GroupIndex, RegionId, RequestId};

/// splitmix64's finaliser: a cheap, well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The byte a correctly transferred cache holds at `byte` of layer `layer` of block `ordinal`
/// of `request` in `group` (`byte` counts from the start of that layer's part of the block).
/// Identical on sender and receiver, since both hold the same tokens' KV.
pub fn content_byte(
    request: RequestId,
    group: GroupIndex,
    ordinal: u32,
    layer: u16,
    byte: u64,
) -> u8 {
    let key =
        mix(request.0
            ^ mix((u64::from(group.0) << 48) | (u64::from(layer) << 32) | u64::from(ordinal)));
    (mix(key ^ (byte / 8)) >> ((byte % 8) * 8)) as u8
}

/// The byte a slot holds before any request wrote it: different per region and offset, so a
/// stray or missing write shows up.
pub fn filler_byte(region: RegionId, offset: u64) -> u8 {
    (mix(0xf111_e4ed ^ (u64::from(region.0) << 40) ^ (offset / 8)) >> ((offset % 8) * 8)) as u8
}
