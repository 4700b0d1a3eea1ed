//! Cutting a write plan into data writes spread over a peer's connections.

use kvpipe_core::wire::DATA_WRITE_FRAME_LEN;
use kvpipe_core::{RegionId, WritePlan};

use crate::memory::{RegionTable, Registered};

/// One data write as the sender puts it on a stream: its encoded `DataWrite` header, then `len`
/// bytes of `src` from `src_offset`.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub(crate) header: [u8; DATA_WRITE_FRAME_LEN],
    src: Registered,
    src_offset: u64,
    pub(crate) len: u64,
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
        })
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

/// A local source extent that is not registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BadSource(pub(crate) RegionId);

/// Splits `plan` over `connections` streams: extents are cut into pieces of about
/// `total / connections` bytes (clamped to `[min_piece, max_piece]`) and each piece goes to the
/// least loaded connection. `header(region, offset, len)` encodes a piece's `DataWrite` header
/// (the core's `DataWriteHeaders::encode`). Returns one list per connection, in write order.
pub(crate) fn split_plan(
    plan: &WritePlan,
    header: impl Fn(RegionId, u64, u64) -> [u8; DATA_WRITE_FRAME_LEN],
    connections: usize,
    (min_piece, max_piece): (u64, u64),
    regions: &RegionTable,
) -> Result<Vec<Vec<Piece>>, BadSource> {
    let connections = connections.max(1);
    let per_conn = plan.total_bytes().div_ceil(connections as u64);
    let piece_max = per_conn.clamp(min_piece.max(1), max_piece.max(min_piece).max(1));
    let mut parts: Vec<Vec<Piece>> = vec![Vec::new(); connections];
    let mut load = vec![0u64; connections];
    for e in plan.extents() {
        let src = regions
            .registered(e.src_region)
            .ok_or(BadSource(e.src_region))?;
        let mut done = 0;
        while done < e.len {
            let len = (e.len - done).min(piece_max);
            let piece = Piece::new(
                header(e.dst_region, e.dst_offset + done, len),
                src,
                e.src_offset + done,
                len,
            )
            .ok_or(BadSource(e.src_region))?;
            let c = (0..connections).min_by_key(|&i| load[i]).unwrap_or(0);
            load[c] += len;
            parts[c].push(piece);
            done += len;
        }
    }
    Ok(parts)
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
        let parts = split_plan(&plan, header, 4, bounds, &regions).unwrap();
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
        assert!(split_plan(&bad, header, 4, bounds, &regions).is_err());
        let mut past_end = WritePlan::new();
        past_end.push(WriteExtent {
            src_region: RegionId(1),
            src_offset: 10 << 20,
            dst_region: RegionId(7),
            dst_offset: 0,
            len: 1,
        });
        assert!(split_plan(&past_end, header, 4, bounds, &regions).is_err());
    }
}
