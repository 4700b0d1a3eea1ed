//! Cutting a write plan into data writes spread over a peer's connections.

use kvpipe_core::wire::{DataWrite, Frame};
use kvpipe_core::{GrantId, RegionId, RequestId, WritePlan};

use crate::config::TcpConfig;
use crate::memory::{MemoryRegion, RegionTable};

/// One data write as the sender puts it on a stream: its encoded `DataWrite` frame, then `len`
/// bytes of `src` starting at `src_offset`.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub(crate) header: Vec<u8>,
    pub(crate) src: MemoryRegion,
    pub(crate) src_offset: u64,
    pub(crate) len: u64,
}

/// A local source extent that is not registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BadSource(pub(crate) RegionId);

/// Splits `plan` over `connections` streams: extents are cut into pieces of about
/// `total / connections` bytes (clamped to the config's piece bounds) and each piece goes to the
/// least loaded connection. Returns one list per connection, in write order.
pub(crate) fn split_plan(
    plan: &WritePlan,
    request: RequestId,
    grant: GrantId,
    version: u16,
    connections: usize,
    config: &TcpConfig,
    regions: &RegionTable,
) -> Result<Vec<Vec<Piece>>, BadSource> {
    let connections = connections.max(1);
    let total = plan.total_bytes();
    let per_conn = total.div_ceil(connections as u64);
    let piece_max = per_conn
        .clamp(config.min_piece_bytes.max(1), config.max_piece_bytes.max(1))
        .max(1);
    let mut parts: Vec<Vec<Piece>> = vec![Vec::new(); connections];
    let mut load = vec![0u64; connections];
    for e in plan.extents() {
        let src = regions
            .get(e.src_region)
            .filter(|r| r.contains(e.src_offset, e.len))
            .ok_or(BadSource(e.src_region))?;
        let mut done = 0;
        while done < e.len {
            let len = (e.len - done).min(piece_max);
            let frame = Frame::DataWrite(DataWrite {
                request,
                grant,
                region: e.dst_region,
                offset: e.dst_offset + done,
                len,
            });
            let mut header = vec![0; frame.encoded_len()];
            frame
                .emit_versioned(version, &mut header)
                .map_err(|_| BadSource(e.src_region))?;
            let c = (0..connections).min_by_key(|&i| load[i]).unwrap_or(0);
            load[c] += len;
            parts[c].push(Piece {
                header,
                src: src.clone(),
                src_offset: e.src_offset + done,
                len,
            });
            done += len;
        }
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpipe_core::WriteExtent;

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
        let config = TcpConfig::default();
        let parts = split_plan(&plan, RequestId(1), GrantId(2), 1, 4, &config, &regions).unwrap();
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
        let bad = {
            let mut p = WritePlan::new();
            p.push(WriteExtent {
                src_region: RegionId(2),
                src_offset: 0,
                dst_region: RegionId(7),
                dst_offset: 0,
                len: 1,
            });
            p
        };
        assert!(split_plan(&bad, RequestId(1), GrantId(2), 1, 4, &config, &regions).is_err());
    }
}
