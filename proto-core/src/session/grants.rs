//! Write grants on the receiver: which destination bytes a registered request may receive
//! ([`GrantedExtents`]) and the admitted data writes still being applied
//! ([`WritesInFlight`]), so the receiver can answer every incoming write from its own
//! registrations and never hand memory back while a write may still land in it.

use std::collections::{btree_map, BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::blocks::AnchoredRun;
use crate::ids::{PeerId, RegionId, RequestId};
use crate::layout::LayerGroupLayout;
use smallvec::SmallVec;

use super::transport::WriteTicket;

/// A request's granted byte ranges, sorted and merged: `(region, start, end)`.
///
/// For every id run `[first, first + len)` of group `g` and every pool of `g`, the bytes
/// `[first * slot_bytes, (first + len) * slot_bytes)` of the pool's region.
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

/// One admitted write being applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flight {
    pub(crate) request: RequestId,
    pub(crate) peer: PeerId,
    pub(crate) region: RegionId,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// Most extents an [`Extents`] keeps in a sorted vector before it moves them into a B-tree:
/// below it an insertion moves at most this many entries, cheaper than a B-tree's search,
/// node split and allocation; above it the B-tree's logarithmic cost is kept. (Small in tests,
/// so the property test crosses it both ways.)
const SORTED_VEC_MAX: usize = if cfg!(test) { 4 } else { 64 };

/// Disjoint extents of one region keyed by their start, each with a value (that holds its
/// end): a sorted vector while there are few, a B-tree beyond [`SORTED_VEC_MAX`].
#[derive(Clone, Debug)]
enum Extents<V> {
    Few(Vec<(u64, V)>),
    Many(BTreeMap<u64, V>),
}

impl<V: Copy> Extents<V> {
    /// The last extent starting before `bound`.
    fn before(&self, bound: u64) -> Option<(u64, &V)> {
        match self {
            Extents::Few(v) => {
                let i = v.partition_point(|e| e.0 < bound);
                i.checked_sub(1).map(|i| (v[i].0, &v[i].1))
            }
            Extents::Many(m) => m.range(..bound).next_back().map(|(&s, v)| (s, v)),
        }
    }

    /// Adds (or replaces) the extent starting at `start`.
    fn insert(&mut self, start: u64, value: V) {
        match self {
            Extents::Few(v) => {
                match v.binary_search_by_key(&start, |e| e.0) {
                    Ok(i) => v[i].1 = value,
                    Err(i) => v.insert(i, (start, value)),
                }
                if v.len() > SORTED_VEC_MAX {
                    *self = Extents::Many(v.drain(..).collect());
                }
            }
            Extents::Many(m) => {
                m.insert(start, value);
            }
        }
    }

    /// Removes the extent starting at `start` when `mine` says it is the one meant.
    fn remove_if(&mut self, start: u64, mine: impl FnOnce(&V) -> bool) {
        match self {
            Extents::Few(v) => {
                if let Ok(i) = v.binary_search_by_key(&start, |e| e.0) {
                    if mine(&v[i].1) {
                        v.remove(i);
                    }
                }
            }
            Extents::Many(m) => {
                if let btree_map::Entry::Occupied(e) = m.entry(start) {
                    if mine(e.get()) {
                        e.remove();
                    }
                }
                if m.is_empty() {
                    // Back to the vector once the burst is over.
                    *self = Extents::Few(Vec::new());
                }
            }
        }
    }

    /// Every extent in order (for tests).
    #[cfg(test)]
    fn iter(&self) -> Box<dyn Iterator<Item = (u64, &V)> + '_> {
        match self {
            Extents::Few(v) => Box::new(v.iter().map(|(s, v)| (*s, v))),
            Extents::Many(m) => Box::new(m.iter().map(|(&s, v)| (s, v))),
        }
    }
}

impl Extents<u64> {
    /// Records `[offset, end)` (it overlaps no extent), merged with the extents it touches:
    /// the one that begins where it ends is absorbed, the one that ends where it begins is
    /// extended in place (the usual case: a block's layer ranges land in order).
    fn land(&mut self, offset: u64, end: u64) {
        match self {
            Extents::Few(v) => {
                // Before `at`: the extents starting before `offset`; at `next`: the one
                // starting at `end`, if any. None starts in between (no overlap), so `next` is
                // `at` and one search finds both; a second is made only if one did.
                let at = v.partition_point(|e| e.0 < offset);
                let next = match v.get(at) {
                    Some(e) if e.0 < end => at + v[at..].partition_point(|e| e.0 < end),
                    _ => at,
                };
                let absorbed = v.get(next).filter(|e| e.0 == end).map(|e| e.1);
                let stop = absorbed.unwrap_or(end);
                match at.checked_sub(1) {
                    Some(prev) if v[prev].1 == offset => {
                        v[prev].1 = stop;
                        if absorbed.is_some() {
                            v.remove(next);
                        }
                    }
                    _ if absorbed.is_some() && next == at => v[next] = (offset, stop),
                    _ => {
                        if absorbed.is_some() {
                            v.remove(next);
                        }
                        self.insert(offset, stop);
                    }
                }
            }
            Extents::Many(map) => {
                // One search finds both neighbours.
                let mut near = map.range_mut(..=end);
                let mut last = near.next_back();
                let absorbed = match &last {
                    Some((&s, e)) if s == end => {
                        let absorbed = **e;
                        last = near.next_back();
                        Some(absorbed)
                    }
                    _ => None,
                };
                let stop = absorbed.unwrap_or(end);
                match last {
                    Some((_, e)) if *e == offset => {
                        *e = stop;
                        if absorbed.is_some() {
                            map.remove(&end);
                        }
                    }
                    _ => {
                        if absorbed.is_some() {
                            map.remove(&end);
                        }
                        map.insert(offset, stop);
                    }
                }
            }
        }
    }
}

/// [`Extents`] per destination region. A receiver writes into a few regions (its pools), so
/// the region is found by a binary search of a short sorted list and every search of the
/// extents compares plain offsets.
#[derive(Clone, Debug)]
struct ByRegion<V> {
    /// Sorted by region.
    regions: SmallVec<[(RegionId, Extents<V>); 4]>,
}

impl<V> Default for ByRegion<V> {
    fn default() -> Self {
        ByRegion {
            regions: SmallVec::new(),
        }
    }
}

impl<V: Copy> ByRegion<V> {
    fn get(&self, region: RegionId) -> Option<&Extents<V>> {
        let i = self.regions.binary_search_by_key(&region, |e| e.0).ok()?;
        Some(&self.regions[i].1)
    }

    fn get_mut(&mut self, region: RegionId) -> Option<&mut Extents<V>> {
        let i = self.regions.binary_search_by_key(&region, |e| e.0).ok()?;
        Some(&mut self.regions[i].1)
    }

    /// The extents of `region`, created empty when there are none. (Regions come from
    /// granted extents, so there are never more than the local pools.)
    fn get_or_default(&mut self, region: RegionId) -> &mut Extents<V> {
        let i = match self.regions.binary_search_by_key(&region, |e| e.0) {
            Ok(i) => i,
            Err(i) => {
                self.regions.insert(i, (region, Extents::Few(Vec::new())));
                i
            }
        };
        &mut self.regions[i].1
    }

    /// Whether the last extent starting before `end` reaches past `offset` (`end_of` gives an
    /// entry's end): for disjoint extents, whether `[offset, end)` overlaps one.
    fn overlaps(
        &self,
        region: RegionId,
        offset: u64,
        end: u64,
        end_of: impl Fn(&V) -> u64,
    ) -> bool {
        self.get(region)
            .and_then(|x| x.before(end))
            .is_some_and(|(_, v)| end_of(v) > offset)
    }

    /// Every entry in order: `(region, start, value)` (for tests).
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (RegionId, u64, &V)> {
        self.regions
            .iter()
            .flat_map(|(r, x)| x.iter().map(move |(s, v)| (*r, s, v)))
    }
}

/// How many finished tickets (beyond twice the writes in it) a [`ByTicket`] window keeps
/// before it moves its oldest writes out. (Small in tests, so writes do move.)
const WINDOW_SLACK: usize = if cfg!(test) { 2 } else { 64 };

/// The writes in flight by ticket. Tickets are issued in order and most writes finish soon
/// after, so they are kept in a window indexed by `ticket - first` (a finished write leaves a
/// hole until the front passes it): issuing and finishing cost no hashing and no search. A
/// write still in flight long after the later ones finished is moved out of the window into a
/// hashed map, so the window never holds more than twice its writes plus [`WINDOW_SLACK`].
#[derive(Clone, Debug, Default)]
struct ByTicket {
    window: VecDeque<Option<Flight>>,
    /// The ticket of `window[0]`; `first + window.len()` is the next ticket issued.
    first: u64,
    /// Writes in the window.
    in_window: usize,
    /// Writes moved out of the window.
    moved: HashMap<WriteTicket, Flight, BuildHasherDefault<TicketHasher>>,
}

impl ByTicket {
    /// Adds the write of the next ticket.
    fn push(&mut self, flight: Flight) {
        self.window.push_back(Some(flight));
        self.in_window += 1;
        while self.window.len() > 2 * self.in_window + WINDOW_SLACK {
            if let Some(Some(f)) = self.window.pop_front() {
                self.moved.insert(WriteTicket(self.first), f);
                self.in_window -= 1;
            }
            self.first += 1;
            self.trim();
        }
    }

    /// Drops the finished tickets at the front.
    fn trim(&mut self) {
        while let Some(None) = self.window.front() {
            self.window.pop_front();
            self.first += 1;
        }
    }

    fn remove(&mut self, ticket: WriteTicket) -> Option<Flight> {
        match ticket.0.checked_sub(self.first) {
            Some(i) if i < self.window.len() as u64 => {
                let flight = self.window[i as usize].take()?;
                self.in_window -= 1;
                self.trim();
                Some(flight)
            }
            // Before the window: moved out (or finished); after it: never issued.
            Some(_) => None,
            None => self.moved.remove(&ticket),
        }
    }

    /// The tickets of `peer`'s writes, in no order.
    fn tickets_of(&self, peer: PeerId) -> impl Iterator<Item = WriteTicket> + '_ {
        let window = (self.window.iter().enumerate())
            .filter(move |(_, f)| f.is_some_and(|f| f.peer == peer))
            .map(|(i, _)| WriteTicket(self.first + i as u64));
        let moved = (self.moved.iter())
            .filter(move |(_, f)| f.peer == peer)
            .map(|(t, _)| *t);
        window.chain(moved)
    }

    fn len(&self) -> usize {
        self.in_window + self.moved.len()
    }
}

/// The admitted writes not reported finished yet. No two overlap, so a transport may hold one
/// `&mut [u8]` per write.
#[derive(Clone, Debug, Default)]
pub(crate) struct WritesInFlight {
    /// Destination start → (destination end, ticket), per region; writes of length 0 hold no
    /// byte and are not in it.
    by_dest: ByRegion<(u64, WriteTicket)>,
    /// Ticket → write, looked up once per write finished.
    by_ticket: ByTicket,
    next: u64,
}

/// Hashes a ticket (a counter) by one multiplication: fast, and the same in every run, so
/// nothing that iterates the map depends on a random seed.
#[derive(Default)]
pub(crate) struct TicketHasher(u64);

impl Hasher for TicketHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl WritesInFlight {
    /// Whether `[offset, end)` of `region` overlaps a write in flight.
    pub(crate) fn overlaps(&self, region: RegionId, offset: u64, end: u64) -> bool {
        // Writes in flight are disjoint: only the last one starting before `end` can reach
        // past `offset`.
        self.by_dest.overlaps(region, offset, end, |&(e, _)| e)
    }

    /// Records an admitted write and returns its ticket. The caller checked for overlaps.
    pub(crate) fn admit(&mut self, flight: Flight) -> WriteTicket {
        let ticket = WriteTicket(self.next);
        self.next += 1;
        if flight.len > 0 {
            self.by_dest
                .get_or_default(flight.region)
                .insert(flight.offset, (flight.offset + flight.len, ticket));
        }
        self.by_ticket.push(flight);
        ticket
    }

    /// Forgets a finished write.
    pub(crate) fn finish(&mut self, ticket: WriteTicket) -> Option<Flight> {
        let flight = self.by_ticket.remove(ticket)?;
        if let Some(x) = self.by_dest.get_mut(flight.region) {
            x.remove_if(flight.offset, |&(_, t)| t == ticket);
        }
        Some(flight)
    }

    /// Whether `ticket` was ever issued.
    pub(crate) fn issued(&self, ticket: WriteTicket) -> bool {
        ticket.0 < self.next
    }

    /// Forgets every write of `peer` (it was reported disconnected: none of them still
    /// applies) and returns them.
    pub(crate) fn remove_peer(&mut self, peer: PeerId) -> Vec<Flight> {
        let mut gone: Vec<WriteTicket> = self.by_ticket.tickets_of(peer).collect();
        // In admission order, as they were admitted.
        gone.sort_unstable();
        gone.into_iter().filter_map(|t| self.finish(t)).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.by_ticket.len()
    }
}

/// The bytes of one request that landed, merged: completion requires that no byte landed twice,
/// so with every writer's landed count equal to its share the landed extents are exactly what
/// the writers had to write (a duplicated write plus an omission of the same size no longer
/// adds up).
#[derive(Clone, Debug, Default)]
pub(crate) struct LandedExtents {
    /// Start → end per region, disjoint and not touching (touching extents are merged).
    by_start: ByRegion<u64>,
}

impl LandedExtents {
    /// Whether `[offset, end)` of `region` overlaps bytes that landed.
    pub(crate) fn overlaps(&self, region: RegionId, offset: u64, end: u64) -> bool {
        self.by_start.overlaps(region, offset, end, |&e| e)
    }

    /// Records `[offset, end)` of `region` as landed (the caller checked it overlaps nothing),
    /// merged with the extents it touches.
    pub(crate) fn insert(&mut self, region: RegionId, offset: u64, end: u64) {
        self.by_start.get_or_default(region).land(offset, end);
    }

    /// Merged extents held (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_start.iter().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockId;
    use crate::layout::PoolLayout;
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
    fn writes_in_flight_never_overlap() {
        let mut w = WritesInFlight::default();
        let f = |region, offset, len| Flight {
            request: RequestId(1),
            peer: PeerId(1),
            region: RegionId(region),
            offset,
            len,
        };
        assert!(!w.overlaps(RegionId(1), 100, 200));
        let a = w.admit(f(1, 100, 100));
        assert!(w.overlaps(RegionId(1), 150, 160));
        assert!(w.overlaps(RegionId(1), 0, 101));
        assert!(w.overlaps(RegionId(1), 199, 300));
        assert!(!w.overlaps(RegionId(1), 200, 300));
        assert!(!w.overlaps(RegionId(1), 0, 100));
        assert!(!w.overlaps(RegionId(2), 100, 200));
        let b = w.admit(f(1, 300, 10));
        assert!(w.overlaps(RegionId(1), 250, 301));
        assert_eq!(w.len(), 2);
        assert_eq!(w.finish(a).map(|x| x.offset), Some(100));
        assert!(!w.overlaps(RegionId(1), 100, 200));
        assert!(w.issued(a) && w.issued(b) && !w.issued(WriteTicket(9)));
        assert_eq!(w.remove_peer(PeerId(1)).len(), 1);
        assert_eq!(w.len(), 0);
        // A write of length 0 where another one starts holds no byte: finishing it leaves the
        // other one's bytes held.
        let c = w.admit(f(1, 500, 10));
        let empty = w.admit(f(1, 500, 0));
        assert!(w.finish(empty).is_some());
        assert!(w.overlaps(RegionId(1), 505, 506));
        assert!(w.finish(c).is_some() && !w.overlaps(RegionId(1), 505, 506));
    }

    #[test]
    fn landed_extents_merge_and_find_overlaps() {
        let mut l = LandedExtents::default();
        l.insert(RegionId(1), 0, 10);
        l.insert(RegionId(1), 20, 30);
        l.insert(RegionId(2), 10, 20);
        assert_eq!(l.len(), 3);
        l.insert(RegionId(1), 10, 20);
        assert_eq!(l.len(), 2, "0..10, 10..20 and 20..30 merge into one");
        assert!(l.overlaps(RegionId(1), 29, 31) && l.overlaps(RegionId(1), 0, 1));
        assert!(!l.overlaps(RegionId(1), 30, 40) && !l.overlaps(RegionId(2), 0, 10));
        assert!(l.overlaps(RegionId(2), 15, 16) && !l.overlaps(RegionId(2), 20, 21));
    }

    proptest::proptest! {
        /// Disjoint extents inserted in any order merge into exactly the runs a naive merge of
        /// the sorted extents gives, and every byte of them (and none beside) overlaps, landed
        /// or in flight.
        #[test]
        fn landed_extents_and_writes_in_flight_equal_a_naive_model(
            cuts in proptest::collection::vec((0u32..3, 1u64..9, proptest::bool::ANY), 1..40),
            order in proptest::collection::vec(proptest::num::usize::ANY, 40),
        ) {
            // Pieces laid end to end per region; `keep` leaves gaps between some of them.
            let mut next = [0u64; 3];
            let mut pieces = Vec::new();
            for &(r, len, keep) in &cuts {
                let at = next[r as usize];
                next[r as usize] += len;
                if keep {
                    pieces.push((RegionId(r), at, at + len));
                }
            }
            let mut shuffled = pieces.clone();
            for (i, &o) in order.iter().enumerate().take(shuffled.len()) {
                let j = o % shuffled.len();
                shuffled.swap(i, j);
            }
            // Landed one by one: after each, exactly the bytes landed so far overlap (the
            // extents cross from a sorted vector into a B-tree on the way).
            let mut l = LandedExtents::default();
            for (n, &(r, a, b)) in shuffled.iter().enumerate() {
                l.insert(r, a, b);
                let so_far = &shuffled[..=n];
                for byte in 0..next[r.0 as usize] + 1 {
                    let held = so_far.iter().any(|&(pr, a, b)| pr == r && a <= byte && byte < b);
                    proptest::prop_assert_eq!(l.overlaps(r, byte, byte + 1), held);
                }
            }
            pieces.sort();
            let mut naive: Vec<(RegionId, u64, u64)> = Vec::new();
            for &(r, a, b) in &pieces {
                match naive.last_mut() {
                    Some(last) if last.0 == r && last.2 == a => last.2 = b,
                    _ => naive.push((r, a, b)),
                }
            }
            let merged: Vec<(RegionId, u64, u64)> =
                l.by_start.iter().map(|(r, a, &b)| (r, a, b)).collect();
            proptest::prop_assert_eq!(&merged, &naive);
            // The same extents as writes in flight: each byte overlaps exactly when one holds it.
            let mut w = WritesInFlight::default();
            let tickets: Vec<WriteTicket> = shuffled
                .iter()
                .map(|&(region, a, b)| {
                    w.admit(Flight { request: RequestId(1), peer: PeerId(1), region, offset: a, len: b - a })
                })
                .collect();
            for r in 0..3u32 {
                for byte in 0..next[r as usize] + 1 {
                    let held = pieces.iter().any(|&(pr, a, b)| pr == RegionId(r) && a <= byte && byte < b);
                    proptest::prop_assert_eq!(l.overlaps(RegionId(r), byte, byte + 1), held);
                    proptest::prop_assert_eq!(w.overlaps(RegionId(r), byte, byte + 1), held);
                }
            }
            // Finished in another order (the B-tree goes back to a vector once empty): after
            // each, exactly the bytes of the writes left overlap, and a ticket finishes once.
            let mut left: Vec<(WriteTicket, (RegionId, u64, u64))> =
                tickets.iter().copied().zip(shuffled.iter().copied()).collect();
            let n = left.len();
            for (i, &o) in order.iter().rev().enumerate().take(n) {
                left.swap(i, o.rotate_left(7) % n);
            }
            while let Some((t, (r, _, _))) = left.pop() {
                proptest::prop_assert!(w.finish(t).is_some());
                proptest::prop_assert!(w.finish(t).is_none() && w.issued(t));
                for byte in 0..next[r.0 as usize] + 1 {
                    let held = left.iter().any(|&(_, (pr, a, b))| pr == r && a <= byte && byte < b);
                    proptest::prop_assert_eq!(w.overlaps(r, byte, byte + 1), held);
                }
            }
            proptest::prop_assert_eq!(w.len(), 0);
            proptest::prop_assert!(!w.overlaps(RegionId(0), 0, u64::MAX));
        }
    }

    proptest::proptest! {
        /// Writes admitted, finished (in any order, twice, or never issued) and forgotten by
        /// peer behave as a naive map of tickets, while some stay in flight long enough to be
        /// moved out of the ticket window.
        #[test]
        fn writes_in_flight_equal_a_naive_model(
            ops in proptest::collection::vec((0u8..4, 0u64..64, 1u64..6), 1..120),
        ) {
            let mut w = WritesInFlight::default();
            let mut model: BTreeMap<u64, Flight> = BTreeMap::new();
            let (mut issued, mut cursor) = (0u64, 0u64);
            for (op, k, len) in ops {
                match op {
                    0 | 1 => {
                        // Disjoint extents, of two peers, some of length 0.
                        let len = if k % 7 == 0 { 0 } else { len };
                        let flight = Flight {
                            request: RequestId(1),
                            peer: PeerId((k % 2) as u32),
                            region: RegionId((k % 3) as u32),
                            offset: cursor,
                            len,
                        };
                        cursor += len + k % 2;
                        let t = w.admit(flight);
                        proptest::prop_assert_eq!(t, WriteTicket(issued));
                        model.insert(issued, flight);
                        issued += 1;
                        // The window stays short however long the oldest write takes.
                        let window = &w.by_ticket;
                        proptest::prop_assert!(window.window.len() <= 2 * window.in_window + WINDOW_SLACK);
                    }
                    2 => {
                        // Mostly a recent ticket, sometimes one never issued.
                        let t = WriteTicket(issued.saturating_sub(k % 9) + k / 60);
                        proptest::prop_assert_eq!(w.finish(t), model.remove(&t.0));
                        proptest::prop_assert_eq!(w.issued(t), t.0 < issued);
                    }
                    _ => {
                        let peer = PeerId((k % 2) as u32);
                        let gone: Vec<Flight> = model.values().filter(|f| f.peer == peer).copied().collect();
                        model.retain(|_, f| f.peer != peer);
                        proptest::prop_assert_eq!(w.remove_peer(peer), gone);
                    }
                }
                proptest::prop_assert_eq!(w.len(), model.len());
                for f in model.values().filter(|f| f.len > 0) {
                    proptest::prop_assert!(w.overlaps(f.region, f.offset + f.len - 1, f.offset + f.len));
                }
                for r in 0..3u32 {
                    for byte in 0..cursor + 1 {
                        let held = model.values().any(|f| f.region == RegionId(r) && f.offset <= byte && byte < f.offset + f.len);
                        proptest::prop_assert_eq!(w.overlaps(RegionId(r), byte, byte + 1), held);
                    }
                }
            }
        }
    }
}
