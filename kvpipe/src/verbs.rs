//! The RDMA verbs transport behind a handle (`verbs` feature): opening the device named by
//! [`VerbsConfig`], registering the engine's regions with it, and the closing rule.

use std::io;

use kvpipe_ibverbs::{Exposure, MemoryTable, VerbsDevice};

use crate::config::RawRegion;
use crate::transport::VerbsConfig;
use crate::EmbedError;

/// Opens the device `config` names and registers `regions` with it, exposed as `exposure`
/// (the prefill side's regions only to its own adapter, the decode side's for remote write).
///
/// # Safety
/// As [`RawRegion`]: the registrations live as long as the node made from them.
pub(crate) unsafe fn open(
    config: &VerbsConfig,
    regions: &[RawRegion],
    exposure: Exposure,
) -> Result<(VerbsDevice, MemoryTable), EmbedError> {
    let device = VerbsDevice::open(&config.device).map_err(|e| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "the verbs transport needs an active RDMA device: {e} (without RDMA hardware, \
                 a Soft-RoCE device (rdma_rxe) gives one; or choose Transport::Tcp)"
            ),
        )
    })?;
    let mut table = MemoryTable::new();
    for r in regions {
        let registered = match r.device {
            // SAFETY: the caller keeps the bytes valid while the node exists (RawRegion's
            // contract, forwarded); the sessions pin a request's blocks until it quiesces.
            None => unsafe { table.register_host(&device, r.id, r.ptr, r.len, exposure) },
            #[cfg(feature = "cuda")]
            Some(ordinal) => {
                // SAFETY: as above; `ptr` is device memory of GPU `ordinal` allocated in this
                // process (RawRegion's contract).
                unsafe {
                    table.register_device(
                        &device,
                        r.id,
                        ordinal as usize,
                        r.ptr as u64,
                        r.len,
                        exposure,
                    )
                }
            }
            #[cfg(not(feature = "cuda"))]
            Some(ordinal) => return Err(crate::gpu::refuse(r.id, ordinal)),
        };
        registered.map_err(|e| {
            io::Error::other(format!(
                "registering memory with RDMA device {}: {e}",
                device.name()
            ))
        })?;
    }
    Ok((device, table))
}

/// A verbs close that did not finish in order, as an error.
pub(crate) fn closed(clean: bool) -> Result<(), EmbedError> {
    if clean {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "some RDMA links did not close in order before the deadline; they were shut down",
        )
        .into())
    }
}

/// The verbs node's own settings.
pub(crate) fn node_config(config: &VerbsConfig) -> kvpipe_ibverbs::VerbsConfig {
    kvpipe_ibverbs::VerbsConfig {
        fabric: config.fabric.clone(),
        ..kvpipe_ibverbs::VerbsConfig::default()
    }
}
