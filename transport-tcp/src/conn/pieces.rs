//! Cutting a write plan into data writes spread over a peer's connections.

use kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
use kvpipe_core::{RegionId, WritePlan};

use crate::memory::{RegionTable, Registered};
use crate::peer_copy::PeerMappings;

/// One data write as the sender puts it on a stream: its encoded `DataWrite` header, then `len`
/// bytes of `src` from `src_offset`.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub(crate) header: [u8; DATA_WRITE_FRAME_LEN],
    src: Registered,
    src_offset: u64,
    pub(crate) len: u64,
    /// With peer copies: where the sender copies the payload itself (the header then goes on
    /// the stream without it).
    pub(crate) placed: Option<PlacedDst>,
}

/// A piece's destination in the peer's memory, opened in this process: `len` bytes at device
/// address `addr` of GPU `ordinal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlacedDst {
    /// The GPU the mapping was opened on.
    pub(crate) ordinal: usize,
    /// The device address (in this process) of the first byte.
    pub(crate) addr: u64,
}

/// Where a piece's payload is.
#[derive(Debug)]
pub(crate) enum Payload<'a> {
    /// In host memory: these bytes.
    Host(&'a [u8]),
    /// In device memory: `len` bytes at device address `addr` of GPU `ordinal` (the writer
    /// stages them into pinned host memory first).
    #[cfg(feature = "cuda")]
    Device {
        /// The GPU.
        ordinal: usize,
        /// The device address of the first byte.
        addr: u64,
    },
}

impl Piece {
    /// A piece of `src`; `None` when the bytes lie outside it.
    pub(crate) fn new(
        header: [u8; DATA_WRITE_FRAME_LEN],
        src: &Registered,
        src_offset: u64,
        len: u64,
    ) -> Option<Piece> {
        src.contains(src_offset, len).then(|| Piece {
            header,
            src: src.clone(),
            src_offset,
            len,
            placed: None,
        })
    }

    /// The bytes on the stream: the header, and the payload unless the sender places it.
    pub(crate) fn wire_len(&self) -> usize {
        self.header.len()
            + if self.placed.is_some() {
                0
            } else {
                self.len as usize
            }
    }

    /// The source bytes.
    pub(crate) fn payload(&self) -> Payload<'_> {
        match &self.src {
            // SAFETY: a piece belongs to a write batch the sender endpoint handed to the
            // transport. Its source blocks stay pinned — the engine neither changes nor frees
            // them — until the request's `Quiesced`, which the core emits only after the batch
            // was reported or the peer was reported disconnected; the writer holding this piece
            // reports its part only after these bytes are written, and the node reports the
            // disconnect only after the writer stopped. So nobody writes these bytes while this
            // shared slice lives. The range was checked against the region in `Piece::new`.
            Registered::Host(r) => Payload::Host(
                unsafe { r.slice(self.src_offset, self.len) }.expect("checked in Piece::new"),
            ),
            #[cfg(feature = "cuda")]
            Registered::Device(d) => Payload::Device {
                ordinal: d.ordinal(),
                addr: d.ptr() + self.src_offset,
            },
        }
    }
}

/// An extent that cannot be sent: its source is not registered memory here, or (peer copies)
/// its destination lies outside the peer's opened regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadExtent {
    /// The local source region.
    Source(RegionId),
    /// The peer's destination region.
    Destination(RegionId),
}

/// Cuts `plan` into the pieces of `connections` streams: extents are cut into pieces of about
/// `total / connections` bytes (clamped to `[min_piece, max_piece]`), in plan order.
/// `header(region, offset, len)` encodes a piece's `DataWrite` header (the core's
/// `DataWriteHeaders::encode`).
///
/// With `placed` (peer copies) every piece also gets its destination in the peer's opened
/// regions; a destination outside them fails the whole plan before anything is queued, so a
/// copy goes only where the plan — made by the core from the receiver's grant — says, and
/// never past the memory the receiver exported.
pub(crate) fn cut_plan(
    plan: &WritePlan,
    header: impl Fn(RegionId, u64, u64) -> [u8; DATA_WRITE_FRAME_LEN],
    connections: usize,
    (min_piece, max_piece): (u64, u64),
    regions: &RegionTable,
    placed: Option<&PeerMappings>,
) -> Result<Vec<Piece>, BadExtent> {
    let per_conn = plan.total_bytes().div_ceil(connections.max(1) as u64);
    let piece_max = per_conn.clamp(min_piece.max(1), max_piece.max(min_piece).max(1));
    let mut pieces = Vec::new();
    for e in plan.extents() {
        let src = regions
            .registered(e.src_region)
            .ok_or(BadExtent::Source(e.src_region))?;
        let dst = match placed {
            None => None,
            Some(m) => {
                let region = m
                    .get(e.dst_region)
                    .filter(|r| {
                        e.dst_offset
                            .checked_add(e.len)
                            .is_some_and(|end| end <= r.len)
                    })
                    .ok_or(BadExtent::Destination(e.dst_region))?;
                Some(region)
            }
        };
        let mut done = 0;
        while done < e.len {
            let len = (e.len - done).min(piece_max);
            let mut piece = Piece::new(
                header(e.dst_region, e.dst_offset + done, len),
                src,
                e.src_offset + done,
                len,
            )
            .ok_or(BadExtent::Source(e.src_region))?;
            piece.placed = dst.map(|r| PlacedDst {
                ordinal: r.ordinal,
                addr: r.ptr + e.dst_offset + done,
            });
            pieces.push(piece);
            done += len;
        }
    }
    Ok(pieces)
}

/// Binds `pieces` to `connections` streams, each to the least loaded so far. Returns one list
/// per connection, in write order.
pub(crate) fn spread<T>(
    pieces: impl IntoIterator<Item = T>,
    connections: usize,
    len: impl Fn(&T) -> u64,
) -> Vec<Vec<T>> {
    let connections = connections.max(1);
    let mut parts: Vec<Vec<T>> = (0..connections).map(|_| Vec::new()).collect();
    let mut load = vec![0u64; connections];
    for piece in pieces {
        let c = (0..connections).min_by_key(|&i| load[i]).unwrap_or(0);
        load[c] += len(&piece);
        parts[c].push(piece);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryRegion;
    use kvpipe_core::wire::{DataWrite, Frame};
    use kvpipe_core::{GrantId, RequestId, WriteExtent};

    fn header(region: RegionId, offset: u64, len: u64) -> [u8; DATA_WRITE_FRAME_LEN] {
        let frame = Frame::DataWrite(DataWrite {
            request: RequestId(1),
            grant: GrantId(2),
            region,
            offset,
            len,
        });
        let mut out = [0; DATA_WRITE_FRAME_LEN];
        frame.emit_versioned(1, &mut out).unwrap();
        out
    }

    #[test]
    fn pieces_cover_the_plan_and_balance() {
        let mut regions = RegionTable::new();
        regions.insert(RegionId(1), MemoryRegion::zeroed(10 << 20));
        let mut plan = WritePlan::new();
        plan.push(WriteExtent {
            src_region: RegionId(1),
            src_offset: 0,
            dst_region: RegionId(7),
            dst_offset: 100,
            len: 4 << 20,
        });
        plan.push(WriteExtent {
            src_region: RegionId(1),
            src_offset: 5 << 20,
            dst_region: RegionId(7),
            dst_offset: 9 << 20,
            len: 1000,
        });
        let bounds = (256 << 10, 32 << 20);
        let pieces = cut_plan(&plan, header, 4, bounds, &regions, None).unwrap();
        let parts = spread(pieces, 4, |p| p.len);
        let loads: Vec<u64> = parts
            .iter()
            .map(|p| p.iter().map(|x| x.len).sum())
            .collect();
        assert_eq!(loads.iter().sum::<u64>(), plan.total_bytes());
        assert!(loads.iter().all(|&l| l >= 1 << 20), "{loads:?}");
        let mut covered: Vec<(u64, u64)> = parts
            .iter()
            .flatten()
            .map(|p| {
                let (f, _) = Frame::parse(&p.header).unwrap();
                let Frame::DataWrite(w) = f else { panic!() };
                let expected = if p.src_offset < 5 << 20 {
                    p.src_offset + 100
                } else {
                    p.src_offset - (5 << 20) + (9 << 20)
                };
                assert_eq!(w.offset, expected);
                assert_eq!(w.len, p.len);
                (w.offset, w.len)
            })
            .collect();
        covered.sort();
        assert_eq!(covered.first().unwrap().0, 100);
        let mut bad = WritePlan::new();
        bad.push(WriteExtent {
            src_region: RegionId(2),
            src_offset: 0,
            dst_region: RegionId(7),
            dst_offset: 0,
            len: 1,
        });
        assert!(cut_plan(&bad, header, 4, bounds, &regions, None).is_err());
        let mut past_end = WritePlan::new();
        past_end.push(WriteExtent {
            src_region: RegionId(1),
            src_offset: 10 << 20,
            dst_region: RegionId(7),
            dst_offset: 0,
            len: 1,
        });
        assert!(cut_plan(&past_end, header, 4, bounds, &regions, None).is_err());
    }

    #[test]
    fn placed_pieces_copy_only_into_the_planned_extents_of_the_opened_regions() {
        use crate::peer_copy::PlacedRegion;
        let mut regions = RegionTable::new();
        regions.insert(RegionId(1), MemoryRegion::zeroed(8 << 20));
        let base = 0x7f00_0000_0000u64;
        let mappings = PeerMappings::fake([(
            RegionId(7),
            PlacedRegion {
                ordinal: 1,
                ptr: base,
                len: 4 << 20,
            },
        )]);
        let mut plan = WritePlan::new();
        for (src, dst, len) in [(0u64, 4096u64, 3u64 << 20), (6 << 20, 0, 4096)] {
            plan.push(WriteExtent {
                src_region: RegionId(1),
                src_offset: src,
                dst_region: RegionId(7),
                dst_offset: dst,
                len,
            });
        }
        let bounds = (256 << 10, 1 << 20);
        let pieces = cut_plan(&plan, header, 2, bounds, &regions, Some(&mappings)).unwrap();
        let mut copied: Vec<(u64, u64)> = Vec::new();
        for p in &pieces {
            let dst = p.placed.expect("every piece is placed");
            assert_eq!(dst.ordinal, 1);
            let (f, _) = Frame::parse(&p.header).unwrap();
            let Frame::DataWrite(w) = f else { panic!() };
            // The copy goes exactly where the header (the core's plan) says.
            assert_eq!(dst.addr, base + w.offset);
            assert_eq!(
                p.wire_len(),
                DATA_WRITE_FRAME_LEN,
                "no payload on the stream"
            );
            copied.push((w.offset, p.len));
        }
        copied.sort();
        let mut at = 4096;
        for &(o, l) in &copied[1..] {
            assert_eq!(o, at);
            at += l;
        }
        assert_eq!(copied[0], (0, 4096));
        assert_eq!(at, 4096 + (3 << 20));
        // A destination past the opened region, or in a region not opened: nothing is split.
        for (region, offset) in [(7, (4 << 20) - 10), (8, 0)] {
            let mut bad = WritePlan::new();
            bad.push(WriteExtent {
                src_region: RegionId(1),
                src_offset: 0,
                dst_region: RegionId(region),
                dst_offset: offset,
                len: 4096,
            });
            assert_eq!(
                cut_plan(&bad, header, 2, bounds, &regions, Some(&mappings)).unwrap_err(),
                BadExtent::Destination(RegionId(region))
            );
        }
    }
}
