//! Coverage proofs: the writers a registration lists must together write every layer and head
//! of what the decode rank expects, each exactly once.
//!
//! Every writer's byte counts can be right while the writers together miss part of the rank (an
//! engine that lists one of its two prefill tensor ranks) or write part of it twice (two senders
//! claiming the same rank): each writer delivers its share and the request would complete with
//! heads or layers never written. So once every listed writer's handshake is known, the receiver
//! lays the writers' parts over what it expects — per layer group, a rectangle of the model's
//! layers × KV heads: the whole rank, or the part a registration declares
//! ([`Registration::expected_part`](super::Registration::expected_part)) — and checks that
//! they tile it exactly. Writers are few, so the check compresses the rectangles' edges into a
//! small grid and counts the writers over each cell: O(writers³) per group, once per request.

use core::fmt;
use core::ops::Range;

use crate::ids::PeerId;
use crate::layout::LayerGroupLayout;
use crate::shard::writes_group;
use crate::wire::Topology;

/// A part of one layer group: the model's layers `layers` × its KV heads `heads`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct GroupPart {
    /// The model's layers (of this group's layer numbering, as
    /// [`LayerGroupLayout::layer_range`](crate::LayerGroupLayout::layer_range)).
    pub layers: Range<u32>,
    /// The model's KV heads.
    pub heads: Range<u32>,
}

impl GroupPart {
    /// What a rank holds of a layer group: its layers × its KV heads.
    pub fn held(layout: &LayerGroupLayout) -> GroupPart {
        GroupPart {
            layers: layout.layer_range(),
            heads: layout.head_range(),
        }
    }

    /// The part of receiver rank `dst`'s group that sender rank `src` writes: the overlap of
    /// what both hold when the sender writes the group to that rank
    /// ([`writes_group`]), else empty. An engine that gives each
    /// writer its own receiving endpoint declares this part in that endpoint's registrations.
    pub fn written_by(
        src_topology: &Topology,
        src: &LayerGroupLayout,
        dst_topology: &Topology,
        dst: &LayerGroupLayout,
    ) -> GroupPart {
        if writes_group(src_topology, src, dst_topology, dst) {
            GroupPart::held(dst).intersect(&GroupPart::held(src))
        } else {
            GroupPart::default()
        }
    }

    /// Whether the part holds nothing.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty() || self.heads.is_empty()
    }

    /// The part both hold.
    pub(crate) fn intersect(&self, other: &GroupPart) -> GroupPart {
        let clip = |a: &Range<u32>, b: &Range<u32>| {
            let start = a.start.max(b.start);
            start..a.end.min(b.end).max(start)
        };
        GroupPart {
            layers: clip(&self.layers, &other.layers),
            heads: clip(&self.heads, &other.heads),
        }
    }

    /// Whether `other` lies inside this part (an empty part lies inside any).
    pub(crate) fn contains(&self, other: &GroupPart) -> bool {
        other.is_empty()
            || (self.layers.start <= other.layers.start
                && other.layers.end <= self.layers.end
                && self.heads.start <= other.heads.start
                && other.heads.end <= self.heads.end)
    }
}

impl fmt::Display for GroupPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layers {}..{} × KV heads {}..{}",
            self.layers.start, self.layers.end, self.heads.start, self.heads.end
        )
    }
}

/// What is wrong with the writers' cover of one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoverFault {
    /// No listed writer writes `part`.
    Missing {
        /// A part nobody writes (one cell of the grid; there may be more).
        part: GroupPart,
    },
    /// Two listed writers both write `part`.
    Doubled {
        /// A part written twice (one cell of the grid).
        part: GroupPart,
        /// One writer of it.
        first: PeerId,
        /// Another writer of it.
        second: PeerId,
    },
    /// A writer writes `part`, which lies outside what the registration expects.
    Outside {
        /// The writer.
        writer: PeerId,
        /// What it writes.
        part: GroupPart,
    },
}

impl fmt::Display for CoverFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoverFault::Missing { part } => write!(f, "{part} is written by none of its writers"),
            CoverFault::Doubled {
                part,
                first,
                second,
            } => write!(f, "{part} is written by both {first} and {second}"),
            CoverFault::Outside { writer, part } => write!(
                f,
                "{writer} writes {part}, outside the part the registration expects"
            ),
        }
    }
}

/// Checks that `writers`' parts (each already clipped to what the rank holds; empty when the
/// writer does not write the group) tile `expected` exactly once.
pub(crate) fn check_group_cover(
    expected: &GroupPart,
    writers: &[(PeerId, GroupPart)],
) -> Result<(), CoverFault> {
    let parts: Vec<&(PeerId, GroupPart)> = writers.iter().filter(|(_, p)| !p.is_empty()).collect();
    for (writer, part) in &parts {
        if !expected.contains(part) {
            return Err(CoverFault::Outside {
                writer: *writer,
                part: part.clone(),
            });
        }
    }
    if expected.is_empty() {
        return Ok(());
    }
    let edges = |pick: fn(&GroupPart) -> &Range<u32>| {
        let mut e: Vec<u32> = core::iter::once(pick(expected))
            .chain(parts.iter().map(|(_, p)| pick(p)))
            .flat_map(|r| [r.start, r.end])
            .collect();
        e.sort_unstable();
        e.dedup();
        e
    };
    let (layer_edges, head_edges) = (edges(|p| &p.layers), edges(|p| &p.heads));
    for l in layer_edges.windows(2) {
        for h in head_edges.windows(2) {
            let cell = GroupPart {
                layers: l[0]..l[1],
                heads: h[0]..h[1],
            };
            if !expected.contains(&cell) {
                continue;
            }
            let mut over = parts.iter().filter(|(_, p)| p.contains(&cell));
            match (over.next(), over.next()) {
                (None, _) => return Err(CoverFault::Missing { part: cell }),
                (Some((first, _)), Some((second, _))) => {
                    return Err(CoverFault::Doubled {
                        part: cell,
                        first: *first,
                        second: *second,
                    })
                }
                (Some(_), None) => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(layers: Range<u32>, heads: Range<u32>) -> GroupPart {
        GroupPart { layers, heads }
    }

    #[test]
    fn writers_that_tile_the_part_cover_it() {
        let all = part(0..8, 0..4);
        let tp2 = [(PeerId(1), part(0..8, 0..2)), (PeerId(2), part(0..8, 2..4))];
        assert_eq!(check_group_cover(&all, &tp2), Ok(()));
        // A pipeline split and a tensor split together, plus a writer of another group.
        let grid = [
            (PeerId(1), part(0..4, 0..2)),
            (PeerId(2), part(0..4, 2..4)),
            (PeerId(3), part(4..8, 0..4)),
            (PeerId(4), part(0..0, 0..0)),
        ];
        assert_eq!(check_group_cover(&all, &grid), Ok(()));
    }

    #[test]
    fn a_missing_writer_is_named_by_the_part_nobody_writes() {
        let all = part(0..8, 0..4);
        let one_of_two = [(PeerId(1), part(0..8, 0..2))];
        assert_eq!(
            check_group_cover(&all, &one_of_two),
            Err(CoverFault::Missing {
                part: part(0..8, 2..4)
            })
        );
        assert_eq!(
            check_group_cover(&all, &[]),
            Err(CoverFault::Missing { part: all.clone() })
        );
    }

    #[test]
    fn two_writers_of_the_same_rank_are_named() {
        let all = part(0..8, 0..4);
        let twice = [
            (PeerId(1), part(0..8, 0..2)),
            (PeerId(2), part(0..8, 2..4)),
            (PeerId(3), part(0..8, 2..4)),
        ];
        let fault = check_group_cover(&all, &twice).unwrap_err();
        assert_eq!(
            fault,
            CoverFault::Doubled {
                part: part(0..8, 2..4),
                first: PeerId(2),
                second: PeerId(3)
            }
        );
        assert!(fault.to_string().contains("written by both"));
    }

    #[test]
    fn a_declared_part_is_covered_by_its_own_writers_only() {
        let half = part(0..8, 2..4);
        assert_eq!(
            check_group_cover(&half, &[(PeerId(2), part(0..8, 2..4))]),
            Ok(())
        );
        assert_eq!(
            check_group_cover(&half, &[(PeerId(1), part(0..8, 0..4))]),
            Err(CoverFault::Outside {
                writer: PeerId(1),
                part: part(0..8, 0..4)
            })
        );
        // An empty expected part (a group this pair does not share) needs no writer.
        assert_eq!(check_group_cover(&part(0..0, 0..0), &[]), Ok(()));
    }
}
