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
/// stray or missing write shows up. One multiply per 8-byte word (not a hash, unlike
/// [`content_byte`]): slots get it when first handed out, while a transfer may be running.
pub fn filler_byte(region: RegionId, offset: u64) -> u8 {
    (filler_word(region, offset / 8) >> ((offset % 8) * 8)) as u8
}

/// The filler of 8-byte word `word` of `region`: distinct per region and word (an odd
/// multiplier is a bijection on `u64`).
fn filler_word(region: RegionId, word: u64) -> u64 {
    (0xf111_e4ed ^ (u64::from(region.0) << 40) ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Fills `out` with the bytes `word_at(w)` yields for the 8-byte words covering
/// `start..start + out.len()` (little-endian within a word): one hash per word instead of one
/// per byte.
fn fill_words(start: u64, out: &mut [u8], word_at: impl Fn(u64) -> u64) {
    let mut pos = start;
    let mut rest = out;
    // Unaligned head.
    while pos % 8 != 0 && !rest.is_empty() {
        rest[0] = (word_at(pos / 8) >> ((pos % 8) * 8)) as u8;
        rest = &mut rest[1..];
        pos += 1;
    }
    let mut words = rest.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&word_at(pos / 8).to_le_bytes());
        pos += 8;
    }
    for b in words.into_remainder() {
        *b = (word_at(pos / 8) >> ((pos % 8) * 8)) as u8;
        pos += 1;
    }
}

/// Writes [`content_byte`]`(request, group, ordinal, layer, byte + i)` into `out[i]` for every
/// `i` — the same bytes, computed a word at a time.
pub fn fill_content(
    request: RequestId,
    group: GroupIndex,
    ordinal: u32,
    layer: u16,
    byte: u64,
    out: &mut [u8],
) {
    let key =
        mix(request.0
            ^ mix((u64::from(group.0) << 48) | (u64::from(layer) << 32) | u64::from(ordinal)));
    fill_words(byte, out, |w| mix(key ^ w));
}

/// Writes [`filler_byte`]`(region, offset + i)` into `out[i]` for every `i`, a word at a time.
pub fn fill_filler(region: RegionId, offset: u64, out: &mut [u8]) {
    fill_words(offset, out, |w| filler_word(region, w));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_fills_match_the_bytewise_functions() {
        for (start, len) in [(0u64, 0usize), (0, 17), (3, 5), (5, 40), (8, 64), (13, 1)] {
            let mut out = vec![0u8; len];
            fill_content(RequestId(9), GroupIndex(2), 7, 3, start, &mut out);
            for (i, b) in out.iter().enumerate() {
                assert_eq!(
                    *b,
                    content_byte(RequestId(9), GroupIndex(2), 7, 3, start + i as u64)
                );
            }
            fill_filler(RegionId(4), start, &mut out);
            for (i, b) in out.iter().enumerate() {
                assert_eq!(*b, filler_byte(RegionId(4), start + i as u64));
            }
        }
    }
}
