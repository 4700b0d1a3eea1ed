//! Write grants on the receiver: which destination bytes each registered request may receive,
//! and the check every incoming data write goes through before a byte is applied.
//!
//! A request's granted extents are computed from its registration's anchored runs and the
//! receiver's pool layout: for every id run `[first, first + len)` of group `g` and every pool of
//! `g`, the bytes `[first * slot_bytes, (first + len) * slot_bytes)` of the pool's region.
//! A write is applied only if its request is registered, its grant matches, it comes from one of
//! the request's writers, and `[offset, offset + len)` lies inside one granted extent.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use kvpipe_core::wire::{DataWrite, Frame, RecvRegistration};
use kvpipe_core::{AnchoredRun, GrantId, LayerGroupLayout, PeerId, RegionId, RequestId};

/// Why an incoming data write was refused (never applied).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WriteRefusal {
    /// No registration for the request.
    #[error("data write for {0}, which has no registration")]
    UnknownRequest(RequestId),
    /// The write carries another grant than the registration's.
    #[error("data write for {request} carries {got}, not the registration's grant")]
    WrongGrant {
        /// The request.
        request: RequestId,
        /// The grant carried.
        got: GrantId,
    },
    /// The write comes from a peer that is not one of the request's writers.
    #[error("data write for {request} from {peer}, which is not one of its writers")]
    NotAWriter {
        /// The request.
        request: RequestId,
        /// The peer.
        peer: PeerId,
    },
    /// The destination lies outside the extents granted to the request.
    #[error("data write for {request} to {region} [{offset}, +{len}) lies outside its grant")]
    OutsideGrant {
        /// The request.
        request: RequestId,
        /// Destination region.
        region: RegionId,
        /// Destination offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// The destination region is not registered with the node (or too small).
    #[error("data write for {request} to {region}, which is not registered memory")]
    UnknownRegion {
        /// The request.
        request: RequestId,
        /// The region.
        region: RegionId,
    },
    /// The peer's handshake has not completed.
    #[error("data write from {0} before its handshake completed")]
    BeforeHandshake(PeerId),
}

/// A request's granted byte ranges, sorted and merged: `(region, start, end)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GrantedExtents {
    ranges: Vec<(RegionId, u64, u64)>,
}

impl GrantedExtents {
    /// The extents granted by `groups` (one anchored run per layer group) over `layout`.
    /// Groups or ranges that overflow are skipped (nothing is granted for them).
    pub fn compute(layout: &[LayerGroupLayout], groups: &[AnchoredRun]) -> Self {
        let mut ranges = Vec::new();
        for (g, run) in groups.iter().enumerate() {
            let Some(group) = layout.get(g) else { continue };
            for id_run in &run.runs {
                for pool in &group.pools {
                    let start = u64::from(id_run.first.0).checked_mul(pool.slot_bytes);
                    let end = (u64::from(id_run.first.0) + u64::from(id_run.len))
                        .checked_mul(pool.slot_bytes);
                    if let (Some(start), Some(end)) = (start, end) {
                        if start < end {
                            ranges.push((pool.region, start, end));
                        }
                    }
                }
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(RegionId, u64, u64)> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == r.0 && r.1 <= last.2 => last.2 = last.2.max(r.2),
                _ => merged.push(r),
            }
        }
        GrantedExtents { ranges: merged }
    }

    /// Whether `[offset, offset + len)` of `region` lies inside one granted extent.
    pub fn contains(&self, region: RegionId, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        // The last range starting at or before (region, offset).
        let idx = self
            .ranges
            .partition_point(|&(r, s, _)| (r, s) <= (region, offset));
        idx > 0 && {
            let (r, s, e) = self.ranges[idx - 1];
            r == region && s <= offset && end <= e
        }
    }

    /// The merged ranges.
    pub fn ranges(&self) -> &[(RegionId, u64, u64)] {
        &self.ranges
    }

    /// Total granted bytes.
    pub fn total_bytes(&self) -> u64 {
        self.ranges.iter().map(|&(_, s, e)| e - s).sum()
    }
}

/// Per (request, writer) accounting: payload bytes consumed from the writer versus bytes its
/// results reported, and the control frames held until the data they report has landed.
#[derive(Debug, Default)]
pub(crate) struct WriterAccount {
    pub(crate) peer: PeerId,
    pub(crate) consumed: u64,
    pub(crate) reported: u64,
    /// Frames waiting, each with the `consumed` count it needs.
    pub(crate) held: VecDeque<(u64, Frame)>,
}

/// One registered request's grant.
#[derive(Debug)]
pub(crate) struct GrantEntry {
    pub(crate) grant: GrantId,
    pub(crate) extents: GrantedExtents,
    pub(crate) writers: Vec<WriterAccount>,
    /// Set when the session ended: later writes are drained, never applied.
    pub(crate) revoked: Arc<AtomicBool>,
    /// Readers currently copying a payload into this request's memory.
    pub(crate) inside: u32,
    /// The core's `Quiesced` event, held until `inside` drops to zero.
    pub(crate) quiesce_pending: bool,
}

/// What to do with an incoming write.
pub(crate) enum WriteVerdict {
    /// Apply it; the reader must call [`GrantTable::leave`] afterwards.
    Apply(Arc<AtomicBool>),
    /// A write of a request whose session ended: drain it, count it as late.
    Late,
    /// Refuse it: the writer is not trusted any more.
    Refuse(WriteRefusal),
}

/// The grants of one receiver node.
#[derive(Debug, Default)]
pub(crate) struct GrantTable {
    pub(crate) entries: HashMap<RequestId, GrantEntry>,
    /// Recently retired (request, grant, writers), to recognise late writes.
    retired: VecDeque<(RequestId, GrantId, Vec<PeerId>)>,
}

const RETIRED_REMEMBERED: usize = 4096;

impl GrantTable {
    /// Records that `reg` went to `peer`: the request's grant (created on its first
    /// registration) now admits `peer` as a writer.
    pub(crate) fn grant(
        &mut self,
        peer: PeerId,
        reg: &RecvRegistration,
        layout: &[LayerGroupLayout],
    ) {
        match self.entries.get_mut(&reg.request) {
            Some(e) if e.grant == reg.grant => {
                if !e.writers.iter().any(|a| a.peer == peer) {
                    e.writers.push(WriterAccount {
                        peer,
                        ..WriterAccount::default()
                    });
                }
            }
            _ => {
                let extents = GrantedExtents::compute(layout, &reg.groups);
                self.insert(reg.request, reg.grant, extents, &[peer]);
            }
        }
    }

    pub(crate) fn insert(
        &mut self,
        request: RequestId,
        grant: GrantId,
        extents: GrantedExtents,
        writers: &[PeerId],
    ) {
        self.entries.insert(
            request,
            GrantEntry {
                grant,
                extents,
                writers: writers
                    .iter()
                    .map(|&peer| WriterAccount {
                        peer,
                        ..WriterAccount::default()
                    })
                    .collect(),
                revoked: Arc::new(AtomicBool::new(false)),
                inside: 0,
                quiesce_pending: false,
            },
        );
    }

    pub(crate) fn check(&mut self, peer: PeerId, w: &DataWrite) -> WriteVerdict {
        let request = w.request;
        let Some(entry) = self.entries.get_mut(&request) else {
            let late = self
                .retired
                .iter()
                .any(|(r, g, ws)| *r == request && *g == w.grant && ws.contains(&peer));
            return if late {
                WriteVerdict::Late
            } else {
                WriteVerdict::Refuse(WriteRefusal::UnknownRequest(request))
            };
        };
        if entry.grant != w.grant {
            return WriteVerdict::Refuse(WriteRefusal::WrongGrant {
                request,
                got: w.grant,
            });
        }
        if !entry.writers.iter().any(|a| a.peer == peer) {
            return WriteVerdict::Refuse(WriteRefusal::NotAWriter { request, peer });
        }
        if !entry.extents.contains(w.region, w.offset, w.len) {
            return WriteVerdict::Refuse(WriteRefusal::OutsideGrant {
                request,
                region: w.region,
                offset: w.offset,
                len: w.len,
            });
        }
        if entry.revoked.load(std::sync::atomic::Ordering::Acquire) {
            return WriteVerdict::Late;
        }
        entry.inside += 1;
        WriteVerdict::Apply(entry.revoked.clone())
    }

    pub(crate) fn account(
        &mut self,
        request: RequestId,
        peer: PeerId,
    ) -> Option<&mut WriterAccount> {
        self.entries
            .get_mut(&request)?
            .writers
            .iter_mut()
            .find(|a| a.peer == peer)
    }

    pub(crate) fn retire(&mut self, request: RequestId) {
        if let Some(e) = self.entries.remove(&request) {
            if self.retired.len() >= RETIRED_REMEMBERED {
                self.retired.pop_front();
            }
            self.retired
                .push_back((request, e.grant, e.writers.iter().map(|a| a.peer).collect()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpipe_core::{BlockId, PoolLayout};
    use smallvec::smallvec;

    fn layout() -> Vec<LayerGroupLayout> {
        vec![LayerGroupLayout {
            layers: 2,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 2,
            elem_bytes: 1,
            tokens_per_block: 4,
            window: None,
            block_layout: Default::default(),
            shard: Default::default(),
            pools: smallvec![
                PoolLayout {
                    region: RegionId(1),
                    layer_begin: 0,
                    layers: 1,
                    slot_bytes: 16
                },
                PoolLayout {
                    region: RegionId(2),
                    layer_begin: 1,
                    layers: 1,
                    slot_bytes: 16
                },
            ],
        }]
    }

    #[test]
    fn extents_follow_runs_and_pools() {
        let run = AnchoredRun::from_ids(3, &[5, 6, 7, 2].map(BlockId));
        let g = GrantedExtents::compute(&layout(), &[run]);
        assert_eq!(
            g.ranges(),
            &[
                (RegionId(1), 32, 48),
                (RegionId(1), 80, 128),
                (RegionId(2), 32, 48),
                (RegionId(2), 80, 128)
            ]
        );
        assert!(g.contains(RegionId(1), 80, 48));
        assert!(g.contains(RegionId(2), 100, 28));
        assert!(!g.contains(RegionId(1), 80, 49));
        assert!(!g.contains(RegionId(1), 48, 1));
        assert!(!g.contains(RegionId(1), 31, 2));
        assert!(!g.contains(RegionId(3), 80, 1));
        assert!(!g.contains(RegionId(1), u64::MAX, 2));
        assert_eq!(g.total_bytes(), 128);
    }

    #[test]
    fn check_refuses_everything_but_a_granted_write() {
        let mut t = GrantTable::default();
        let run = AnchoredRun::from_ids(0, &[BlockId(4)]);
        let ext = GrantedExtents::compute(&layout(), &[run]);
        t.insert(RequestId(9), GrantId(77), ext, &[PeerId(1)]);
        let ok = DataWrite {
            request: RequestId(9),
            grant: GrantId(77),
            region: RegionId(1),
            offset: 64,
            len: 16,
        };
        assert!(matches!(t.check(PeerId(1), &ok), WriteVerdict::Apply(_)));
        let cases = [
            (PeerId(2), ok),
            (
                PeerId(1),
                DataWrite {
                    grant: GrantId(78),
                    ..ok
                },
            ),
            (
                PeerId(1),
                DataWrite {
                    request: RequestId(8),
                    ..ok
                },
            ),
            (PeerId(1), DataWrite { offset: 65, ..ok }),
            (
                PeerId(1),
                DataWrite {
                    region: RegionId(5),
                    ..ok
                },
            ),
        ];
        for (peer, w) in cases {
            assert!(
                matches!(t.check(peer, &w), WriteVerdict::Refuse(_)),
                "{w:?}"
            );
        }
        t.retire(RequestId(9));
        assert!(matches!(t.check(PeerId(1), &ok), WriteVerdict::Late));
        assert!(matches!(t.check(PeerId(2), &ok), WriteVerdict::Refuse(_)));
    }
}
