//! Cutting a write plan into data writes spread over a peer's connections.

use kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
use kvpipe_core::{RegionId, WritePlan};

use crate::memory::{RegionTable, Registered};
use crate::peer_copy::{Source, SOURCE_LEN};

/// One data write as the sender puts it on a stream: its encoded `DataWrite` header, then `len`
/// bytes of `src` from `src_offset` — or, when the receiver pulls it (peer copies), the
/// encoded [`Source`] of those bytes instead.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub(crate) header: [u8; DATA_WRITE_FRAME_LEN],
    src: Registered,
    src_offset: u64,
    pub(crate) len: u64,
    /// With peer copies: the encoded source the receiver pulls the payload from (it goes on
    /// the stream after the header, in place of the payload).
    pub(crate) source: Option<[u8; SOURCE_LEN]>,
}

/// Where a piece's payload is.
#[derive(Debug)]
pub(crate) enum Payload<'a> {
    /// In host memory: these bytes.
    Host(&'a [u8]),
    /// In device memory: `len` bytes at device address `addr` of GPU `ordinal` (the writer
    /// stages them into pinned host memory first).
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
            source: None,
        })
    }

    /// The bytes on the stream: the header, then the payload or (pulled) its source.
    pub(crate) fn wire_len(&self) -> usize {
        self.header.len()
            + match self.source {
                Some(s) => s.len(),
                None => self.len as usize,
            }
    }

    /// Whether the receiver pulls it (peer copies).
    pub(crate) fn pulled(&self) -> bool {
        self.source.is_some()
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
            Registered::Device(d) => Payload::Device {
                ordinal: d.ordinal(),
                addr: d.ptr() + self.src_offset,
            },
        }
    }
}

/// An extent that cannot be sent: its source is not registered memory here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadExtent {
    /// The local source region.
    Source(RegionId),
}

/// Cuts `plan` into the pieces of `connections` streams: extents are cut into pieces of about
/// `total / connections` bytes (clamped to `[min_piece, max_piece]`), in plan order.
/// `header(region, offset, len)` encodes a piece's `DataWrite` header (the core's
/// `DataWriteHeaders::encode`).
///
/// With `pulled` (peer copies) every piece carries its source (region and offset here) for
/// the receiver to pull from; the receiver checks it against the regions this node exported.
pub(crate) fn cut_plan(
    plan: &WritePlan,
    header: impl Fn(RegionId, u64, u64) -> [u8; DATA_WRITE_FRAME_LEN],
    connections: usize,
    (min_piece, max_piece): (u64, u64),
    regions: &RegionTable,
    pulled: bool,
) -> Result<Vec<Piece>, BadExtent> {
    let per_conn = plan.total_bytes().div_ceil(connections.max(1) as u64);
    let piece_max = per_conn.clamp(min_piece.max(1), max_piece.max(min_piece).max(1));
    let mut pieces = Vec::new();
    for e in plan.extents() {
        let src = regions
            .registered(e.src_region)
            .ok_or(BadExtent::Source(e.src_region))?;
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
            piece.source = pulled.then(|| {
                Source {
                    region: e.src_region,
                    offset: e.src_offset + done,
                }
                .encode()
            });
            pieces.push(piece);
            done += len;
        }
    }
    Ok(pieces)
}

/// Binds `pieces` to `connections` streams, each to the least loaded so far. Returns one list
/// per connection, in write order (tests: how evenly pieces share out).
#[cfg(test)]
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
        frame
            .emit_versioned(kvpipe_core::wire::PROTOCOL_VERSION, &mut out)
            .unwrap();
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
        let pieces = cut_plan(&plan, header, 4, bounds, &regions, false).unwrap();
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
        assert!(cut_plan(&bad, header, 4, bounds, &regions, false).is_err());
        let mut past_end = WritePlan::new();
        past_end.push(WriteExtent {
            src_region: RegionId(1),
            src_offset: 10 << 20,
            dst_region: RegionId(7),
            dst_offset: 0,
            len: 1,
        });
        assert!(cut_plan(&past_end, header, 4, bounds, &regions, false).is_err());
    }

    #[test]
    fn pulled_pieces_carry_their_source_in_place_of_the_payload() {
        let mut regions = RegionTable::new();
        regions.insert(RegionId(1), MemoryRegion::zeroed(8 << 20));
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
        let pieces = cut_plan(&plan, header, 2, bounds, &regions, true).unwrap();
        let mut pulled: Vec<(u64, u64, u64)> = Vec::new();
        for p in &pieces {
            assert!(p.pulled());
            let source = Source::decode(&p.source.expect("every piece is pulled")).unwrap();
            assert_eq!(source.region, RegionId(1));
            assert_eq!(source.offset, p.src_offset);
            let (f, _) = Frame::parse(&p.header).unwrap();
            let Frame::DataWrite(w) = f else { panic!() };
            assert_eq!(w.len, p.len);
            assert_eq!(
                p.wire_len(),
                DATA_WRITE_FRAME_LEN + SOURCE_LEN,
                "no payload on the stream"
            );
            pulled.push((w.offset, source.offset, p.len));
        }
        pulled.sort();
        // Every destination byte comes from the source byte the plan pairs it with.
        assert_eq!(pulled[0], (0, 6 << 20, 4096));
        let mut at = 4096;
        for &(dst, src, len) in &pulled[1..] {
            assert_eq!((dst, src), (at, at - 4096));
            at += len;
        }
        assert_eq!(at, 4096 + (3 << 20));
        // Not pulled: the payload follows the header.
        let sent = cut_plan(&plan, header, 2, bounds, &regions, false).unwrap();
        assert!(sent
            .iter()
            .all(|p| !p.pulled() && p.wire_len() == DATA_WRITE_FRAME_LEN + p.len as usize));
    }
}
