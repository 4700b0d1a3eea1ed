//! The peer-copy negotiation's device half ([`crate::peer_copy`]): a sender's regions exported
//! as CUDA IPC handles, and the receiver's opening of them.

use std::collections::HashMap;

use kvpipe_core::RegionId;

use super::DeviceRegion;
use crate::gpu::{OfferEntry, PlacedRegion};

/// The sender's regions opened in this process; they close when dropped.
#[derive(Debug, Default)]
pub(crate) struct IpcMappings {
    _open: Vec<kvpipe_cuda::IpcMapping>,
}

/// Every region of `regions` (`None`: host memory) exported with CUDA IPC, by region id;
/// `Err`: why not (a host region, no driver, memory the driver cannot export).
pub(crate) fn export<'a>(
    regions: impl Iterator<Item = (RegionId, Option<&'a DeviceRegion>)>,
) -> Result<Vec<OfferEntry>, String> {
    let mut out = Vec::new();
    for (id, d) in regions {
        let Some(d) = d else {
            return Err(format!("{id} is host memory"));
        };
        let device = kvpipe_cuda::Device::open(d.ordinal()).map_err(|e| e.to_string())?;
        let handle = kvpipe_cuda::export_ipc(&device, d.ptr(), d.len() as u64)
            .map_err(|e| format!("{id}: {e}"))?;
        out.push(OfferEntry {
            region: id,
            ordinal: d.ordinal() as u32,
            handle: handle.to_bytes(),
        });
    }
    out.sort_by_key(|e| e.region.0);
    Ok(out)
}

/// Opens every offered region on GPU `ordinal` (this node's own): where each lies here, and the
/// mappings that keep them open. `Err`: why one does not open (another host, the same process,
/// no driver).
pub(crate) fn import(
    entries: &[OfferEntry],
    ordinal: usize,
) -> Result<(HashMap<RegionId, PlacedRegion>, IpcMappings), String> {
    let device = kvpipe_cuda::Device::open(ordinal).map_err(|e| e.to_string())?;
    let mut mappings = Vec::with_capacity(entries.len());
    let mut placed = HashMap::with_capacity(entries.len());
    for e in entries {
        let handle = kvpipe_cuda::IpcHandle::from_bytes(&e.handle).map_err(|x| x.to_string())?;
        let mapping = kvpipe_cuda::IpcMapping::open(&device, &handle).map_err(|x| {
            format!(
                "{} (GPU {} of the peer) does not open here (another host, or the same \
                 process?): {x}",
                e.region, e.ordinal
            )
        })?;
        placed.insert(
            e.region,
            PlacedRegion {
                ordinal: mapping.ordinal(),
                ptr: mapping.ptr(),
                len: mapping.len(),
            },
        );
        mappings.push(mapping);
    }
    Ok((placed, IpcMappings { _open: mappings }))
}
