//! A block's rows in the model's coordinates (model layer, place in the model's layer), so
//! ranks split differently see equal content: writing the expected content, finding the first
//! byte that differs from it.

use kvpipe_core::{BlockId, GroupIndex, RequestId};

use super::content::fill_content;
use super::GroupState;

/// Calls `f(pool, slot_byte_offset, layer, byte_in_layer, len)` for every row (one head's
/// elements of one token) of tokens `tokens` of block `slot` in every pool of `group`. `layer`
/// is the model's layer of the group and `byte_in_layer` the row's place in the model's layer
/// (`[K|V][head][token][dim]` over all the model's KV heads), so a rank holding part of the
/// model sees the same coordinates as one holding all of it.
fn for_each_row(
    group: &GroupState,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
    mut f: impl FnMut(usize, u64, u16, u64, u64),
) {
    let layout = &group.layout;
    let row = u64::from(layout.head_dim) * u64::from(layout.elem_bytes);
    let tpb = u64::from(tpb);
    let heads = u64::from(layout.kv_heads);
    let model_heads = u64::from(layout.model_kv_heads());
    let first_head = u64::from(layout.shard.first_head);
    let rows = u64::from(layout.kv_factor) * heads * tpb;
    let layer_bytes = rows * row;
    for (p, pool) in layout.pools.iter().enumerate() {
        let base = u64::from(slot.0) * pool.slot_bytes;
        for i in 0..pool.layers {
            let layer = layout.shard.first_layer + pool.layer_begin + i;
            let layer_base = base + u64::from(i) * layer_bytes;
            for r in 0..rows {
                let token = (r % tpb) as u32;
                if tokens.contains(&token) {
                    let (kv, head) = (r / (heads * tpb), (r / tpb) % heads);
                    let model_row = (kv * model_heads + first_head + head) * tpb + r % tpb;
                    f(p, layer_base + r * row, layer, model_row * row, row);
                }
            }
        }
    }
}

/// Writes the expected content of tokens `tokens` (relative to the block) of `ordinal`: of
/// every layer, or of the rank's layers `only` of the group (counted from its first).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_content(
    group: &mut GroupState,
    request: RequestId,
    g: usize,
    ordinal: u32,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
    only: Option<std::ops::Range<u16>>,
) {
    let first = group.layout.shard.first_layer;
    let mut writes = Vec::new();
    for_each_row(group, slot, tokens, tpb, |p, at, layer, byte, len| {
        if only.as_ref().is_none_or(|l| l.contains(&(layer - first))) {
            writes.push((p, at, layer, byte, len));
        }
    });
    for (p, at, layer, byte, len) in writes {
        let row = &mut group.memory[p][at as usize..(at + len) as usize];
        fill_content(request, GroupIndex(g as u16), ordinal, layer, byte, row);
    }
    match only {
        Some(layers) => group.mark_dirty_layers(slot.0, layers),
        None => group.mark_dirty(slot.0),
    }
}

/// The first byte of tokens `tokens` of `ordinal` that differs from the expected content, as
/// (pool, offset in slot).
pub(super) fn first_difference(
    group: &GroupState,
    request: RequestId,
    g: GroupIndex,
    ordinal: u32,
    slot: BlockId,
    tokens: std::ops::Range<u32>,
    tpb: u32,
) -> Option<(usize, u64)> {
    let mut found = None;
    let mut expected = Vec::new();
    for_each_row(group, slot, tokens, tpb, |p, at, layer, byte, len| {
        if found.is_some() {
            return;
        }
        let mem = &group.memory[p][at as usize..(at + len) as usize];
        let slot_base = u64::from(slot.0) * group.layout.pools[p].slot_bytes;
        expected.resize(len as usize, 0);
        fill_content(request, g, ordinal, layer, byte, &mut expected);
        if let Some(k) = mem.iter().zip(&expected).position(|(a, b)| a != b) {
            found = Some((p, at + k as u64 - slot_base));
        }
    });
    found
}
