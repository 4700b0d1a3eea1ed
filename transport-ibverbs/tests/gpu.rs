//! kvpipe-ibverbs with device memory (`cuda` feature): GPU memory exported as a dma-buf for
//! registration. Tests that need a GPU are reported as ignored, with the reason ("skipped: no
//! CUDA driver"), where no driver or device is found — never as passed; the one that also
//! needs an RDMA adapter says "skipped: no RDMA device" where there is none (the GPU machines
//! have no adapter, the Soft-RoCE guest has no GPU). `scripts/gpu-check` runs them on the GPU
//! machine.

use std::io::{Seek, SeekFrom};

use kvpipe_core::RegionId;
use kvpipe_cuda::{check_driver, host_page_size, Device, DeviceBuffer};
use kvpipe_ibverbs::{export_device_memory, DeviceSpec, Exposure, MemoryTable, VerbsDevice};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// Device 0, or the reason the test is skipped.
fn device() -> Result<Device, String> {
    check_driver().map_err(|e| format!("skipped: {e}"))?;
    Device::open(0).map_err(|e| format!("skipped: {e}"))
}

/// The exported dma-buf is what `ibv_reg_dmabuf_mr` needs: a file descriptor covering the
/// whole pages around the range, the range's offset in it, its length, and the device address
/// as iova (so SGEs name GPU memory by the engine's addresses).
fn device_memory_exports_for_registration(d: &Device) -> Result<Completion, Failed> {
    let page = host_page_size();
    let buf = DeviceBuffer::new(d, 5 * page as usize)?;
    if !d.supports_dmabuf()? {
        return Ok(Completion::ignored_with(
            "skipped: the GPU cannot export dma-bufs",
        ));
    }
    for (offset, len) in [(0u64, 5 * page), (page + 100, 2 * page), (300, 10)] {
        let ptr = buf.ptr() + offset;
        let exported = export_device_memory(RegionId(3), d.ordinal(), ptr, len as usize)?;
        let dmabuf = exported.dmabuf();
        assert!(dmabuf.fd >= 0);
        assert_eq!(dmabuf.iova, ptr, "the iova is the device address");
        assert_eq!(dmabuf.len as u64, len);
        assert_eq!(
            dmabuf.offset,
            ptr % page,
            "the range starts where asked inside the pages"
        );
        let span = (ptr % page + len).div_ceil(page) * page;
        let mut file = std::fs::File::from(exported.exported().fd.try_clone()?);
        assert_eq!(
            file.seek(SeekFrom::End(0))?,
            span,
            "whole pages are exported"
        );
    }
    Ok(Completion::Completed)
}

/// Memory the driver did not allocate is refused with the driver's error, before any RDMA
/// device is involved.
fn foreign_addresses_are_refused(d: &Device) -> Result<Completion, Failed> {
    let host = vec![0u8; 8192];
    let r = export_device_memory(RegionId(4), d.ordinal(), host.as_ptr() as u64, host.len());
    match r {
        Err(kvpipe_ibverbs::RegisterError::Cuda {
            region: RegionId(4),
            ..
        }) => Ok(Completion::Completed),
        other => Err(format!("expected a CUDA error, got {other:?}").into()),
    }
}

/// Registration through an adapter (GPUDirect RDMA). Needs an RDMA device next to the GPU.
fn device_memory_registers_with_an_rdma_device(d: &Device) -> Result<Completion, Failed> {
    let rdma = match VerbsDevice::open(&DeviceSpec::default()) {
        Ok(r) => r,
        Err(e) => {
            return Ok(Completion::ignored_with(format!(
                "skipped: no RDMA device ({e})"
            )))
        }
    };
    let buf = DeviceBuffer::new(d, 1 << 20)?;
    let mut table = MemoryTable::new();
    // SAFETY: `buf` outlives `table`.
    unsafe {
        table.register_device(
            &rdma,
            RegionId(9),
            d.ordinal(),
            buf.ptr(),
            buf.len(),
            Exposure::RemoteWrite,
        )
    }?;
    let descriptors = table.descriptors();
    assert_eq!(descriptors.len(), 1);
    assert_eq!(descriptors[0].region, RegionId(9));
    assert_eq!(descriptors[0].addr, buf.ptr());
    assert_eq!(descriptors[0].len, buf.len() as u64);
    drop(table);
    Ok(Completion::Completed)
}

fn gpu(name: &'static str, test: fn(&Device) -> Result<Completion, Failed>) -> Trial {
    Trial::ignorable_test(name, move || match device() {
        Err(reason) => Ok(Completion::ignored_with(reason)),
        Ok(d) => test(&d),
    })
}

fn main() {
    let args = Arguments::from_args();
    let tests = vec![
        gpu(
            "device_memory_exports_for_registration",
            device_memory_exports_for_registration,
        ),
        gpu(
            "foreign_addresses_are_refused",
            foreign_addresses_are_refused,
        ),
        gpu(
            "device_memory_registers_with_an_rdma_device",
            device_memory_registers_with_an_rdma_device,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
