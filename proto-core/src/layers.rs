//! Layer slices: a prefill chunk submitted in ranges of the sender rank's layers, as the engine
//! finishes computing them, so the last chunk's transfer overlaps its own compute.
//!
//! The rules (the sender checks each; see [`Sender::submit_chunk_layers`](crate::Sender)):
//!
//! 1. **Layer order.** A [`LayerRange`] indexes the sender rank's layers in the order the
//!    engine computes them: the rank's [`LayerOrder`] lists, for each of its layers in compute
//!    order, the layer group that layer belongs to. Within a group the rank's layers are
//!    computed in ascending order, so position `i` of the order is the `n`-th layer of its group
//!    where `n` counts that group's earlier entries. The default order (empty) is the groups
//!    stacked in group order: all of group 0's layers, then group 1's, … — the model's order for
//!    a model of one group. A model whose groups interleave (Gemma 3's five local layers per
//!    global one) states its order, so a range of the first layers computed is the first
//!    layers of each group they belong to.
//! 2. **What a range covers.** Range `[begin, end)` covers, in each group `g`, the rank's
//!    layers of `g` at positions `begin..end` of the order: a contiguous range of the group's
//!    layers (possibly empty), counted from the rank's first layer of the group as pools'
//!    [`layer_begin`](crate::PoolLayout::layer_begin) are ([`LayerOrder::group_ranges`]).
//! 3. **Ranges of one chunk** are submitted in ascending, contiguous order, the first starting
//!    at layer 0 and the last ending at the rank's layer count; each is non-empty. The next
//!    chunk is submitted only after the previous chunk's last range.
//! 4. **Planning.** The chunk's first range asks the block source for the chunk's windows and
//!    pairs its blocks once; each range's writes are that pairing restricted to the range's
//!    layers. A block's slot is laid out `[layer][K|V][head][token][dim]`, so the range's layers
//!    of one block held in one pool are one extent.
//! 5. **Slices.** Each range that writes something is its own slice with its own result; the
//!    last chunk's last range is the `is_last` slice. Ordering, completion and coverage hold
//!    per slice as for whole chunks.

use core::ops::Range;

use smallvec::SmallVec;

use crate::ids::GroupIndex;
use crate::layout::LayerGroupLayout;

/// A half-open range `[begin, end)` of the sender rank's layers, in its [`LayerOrder`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct LayerRange {
    /// First layer of the range (position in the rank's layer order).
    pub begin: u32,
    /// One past the last layer of the range.
    pub end: u32,
}

impl LayerRange {
    /// The layers `begin..end`.
    pub const fn new(begin: u32, end: u32) -> Self {
        LayerRange { begin, end }
    }

    /// Layers in the range (0 when `end <= begin`).
    pub const fn len(&self) -> u32 {
        self.end.saturating_sub(self.begin)
    }

    /// Whether the range holds no layer.
    pub const fn is_empty(&self) -> bool {
        self.end <= self.begin
    }
}

impl core::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "layers {}..{}", self.begin, self.end)
    }
}

impl From<Range<u32>> for LayerRange {
    fn from(r: Range<u32>) -> Self {
        LayerRange::new(r.start, r.end)
    }
}

/// The order in which a sender rank's layers are computed, as the group of each layer (see
/// the module doc, rule 1). Empty: the groups stacked in group order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LayerOrder {
    /// The group of each of the rank's layers, in compute order (empty: stacked groups).
    pub groups: Vec<GroupIndex>,
}

impl LayerOrder {
    /// The stacked order: every group's layers after the previous group's.
    pub fn stacked() -> Self {
        LayerOrder::default()
    }

    /// An order that repeats `pattern` (e.g. five local-window layers then one global layer)
    /// `times` times.
    pub fn repeat(pattern: &[GroupIndex], times: usize) -> Self {
        LayerOrder {
            groups: pattern.repeat(times),
        }
    }

    /// The rank's layers: the sum of its groups' layers.
    pub fn layer_count(groups: &[LayerGroupLayout]) -> u32 {
        groups.iter().map(|g| u32::from(g.layers)).sum()
    }

    /// Checks the order against the rank's groups: an empty order, or one entry per layer of
    /// the rank naming each group exactly as many times as the group has layers. Returns the
    /// first group whose count differs: `(group, listed, layers)`.
    pub fn check(&self, groups: &[LayerGroupLayout]) -> Result<(), LayerOrderError> {
        if self.groups.is_empty() {
            return Ok(());
        }
        let mut counts: SmallVec<[u32; 4]> = SmallVec::from_elem(0, groups.len());
        for g in &self.groups {
            match counts.get_mut(usize::from(g.0)) {
                Some(c) => *c += 1,
                None => {
                    return Err(LayerOrderError::UnknownGroup {
                        group: *g,
                        groups: groups.len(),
                    })
                }
            }
        }
        for (i, (listed, layout)) in counts.iter().zip(groups).enumerate() {
            if *listed != u32::from(layout.layers) {
                return Err(LayerOrderError::WrongCount {
                    group: GroupIndex(i as u16),
                    listed: *listed,
                    layers: layout.layers,
                });
            }
        }
        Ok(())
    }

    /// Per group (every group of `groups`, in group order), the rank's layers of that group
    /// that `range` covers, counted from the rank's first layer of the group (rule 2). `range`
    /// must lie within the rank's layers and the order must have passed [`check`](Self::check).
    /// Costs O(groups) for the stacked order, O(range end) otherwise; allocates nothing for up
    /// to four groups.
    pub fn group_ranges(
        &self,
        groups: &[LayerGroupLayout],
        range: LayerRange,
    ) -> SmallVec<[Range<u16>; 4]> {
        let mut out: SmallVec<[Range<u16>; 4]> = SmallVec::new();
        if self.groups.is_empty() {
            let mut first = 0u32;
            for g in groups {
                let n = u32::from(g.layers);
                let lo = range.begin.clamp(first, first + n) - first;
                let hi = range.end.clamp(first, first + n) - first;
                // Both are at most the group's layer count, a u16.
                out.push(lo as u16..hi.max(lo) as u16);
                first += n;
            }
            return out;
        }
        let mut counts: SmallVec<[u16; 4]> = SmallVec::from_elem(0, groups.len());
        for (i, g) in self.groups.iter().enumerate() {
            if i as u32 == range.begin {
                out.extend(counts.iter().map(|&c| c..c));
            }
            if i as u32 >= range.end {
                break;
            }
            if let Some(c) = counts.get_mut(usize::from(g.0)) {
                *c += 1;
            }
        }
        if out.is_empty() {
            // The range starts at (or past) the rank's last layer.
            out.extend(counts.iter().map(|&c| c..c));
        }
        for (r, c) in out.iter_mut().zip(&counts) {
            r.end = *c;
        }
        out
    }
}

/// A [`LayerOrder`] that does not list the rank's layers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayerOrderError {
    /// The order names a group the rank does not have.
    #[error("the layer order names {group}, but the rank has {groups} layer groups")]
    UnknownGroup {
        /// The group named.
        group: GroupIndex,
        /// Groups of the rank.
        groups: usize,
    },
    /// The order lists a group a different number of times than it has layers.
    #[error(
        "the layer order lists {group} {listed} times, but the rank holds {layers} layers \
         of it: list each of the rank's layers once, in compute order"
    )]
    WrongCount {
        /// The group.
        group: GroupIndex,
        /// Times the order lists it.
        listed: u32,
        /// Layers of the group on the rank.
        layers: u16,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(layers: &[u16]) -> Vec<LayerGroupLayout> {
        layers
            .iter()
            .map(|&layers| LayerGroupLayout {
                layers,
                ..LayerGroupLayout::default()
            })
            .collect()
    }

    fn ranges(order: &LayerOrder, g: &[LayerGroupLayout], b: u32, e: u32) -> Vec<Range<u16>> {
        order
            .group_ranges(g, LayerRange::new(b, e))
            .into_iter()
            .collect()
    }

    #[test]
    fn stacked_ranges_split_at_group_edges() {
        let g = groups(&[3, 4]);
        let o = LayerOrder::stacked();
        assert_eq!(ranges(&o, &g, 0, 2), vec![0..2, 0..0]);
        assert_eq!(ranges(&o, &g, 2, 5), vec![2..3, 0..2]);
        assert_eq!(ranges(&o, &g, 5, 7), vec![3..3, 2..4]);
        assert_eq!(LayerOrder::layer_count(&g), 7);
    }

    #[test]
    fn interleaved_ranges_count_each_group() {
        // Two local layers (group 1) then one global (group 0), twice.
        let g = groups(&[2, 4]);
        let o = LayerOrder::repeat(&[GroupIndex(1), GroupIndex(1), GroupIndex(0)], 2);
        assert_eq!(o.check(&g), Ok(()));
        assert_eq!(ranges(&o, &g, 0, 2), vec![0..0, 0..2]);
        assert_eq!(ranges(&o, &g, 2, 4), vec![0..1, 2..3]);
        assert_eq!(ranges(&o, &g, 4, 6), vec![1..2, 3..4]);
        assert_eq!(ranges(&o, &g, 0, 6), vec![0..2, 0..4]);
    }

    #[test]
    fn an_order_must_list_every_layer_once() {
        let g = groups(&[2, 1]);
        let short = LayerOrder {
            groups: vec![GroupIndex(0), GroupIndex(1)],
        };
        assert_eq!(
            short.check(&g),
            Err(LayerOrderError::WrongCount {
                group: GroupIndex(0),
                listed: 1,
                layers: 2
            })
        );
        let unknown = LayerOrder {
            groups: vec![GroupIndex(0), GroupIndex(0), GroupIndex(2)],
        };
        assert!(matches!(
            unknown.check(&g),
            Err(LayerOrderError::UnknownGroup { .. })
        ));
        assert!(LayerOrder::stacked().check(&g).is_ok());
    }
}
