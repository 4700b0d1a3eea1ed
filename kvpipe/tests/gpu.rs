//! GPU regions through the engine API (`cuda` feature): a request moved between device pools,
//! and between a device and a host pool, in process (device copies) and over TCP (pinned
//! staging), every destination byte checked. Where no CUDA driver or device is found each test
//! is reported as ignored with the reason ("skipped: no CUDA driver"), never as passed;
//! `scripts/gpu-check` runs them on the GPU machine.

mod common;

use std::time::Duration;

use common::{check_landed, configs, connect, source_pool, transfer, SLOT, SLOTS};
use kvpipe::{
    mem_pair, DecodeNode, PrefillNode, RawRegion, RegionId, TcpConfig, Transport,
    MEM_RECEIVER_PEER, MEM_SENDER_PEER,
};
use kvpipe_cuda::{check_driver, Device, DeviceBuffer};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

/// Where one side's pool lives.
#[derive(Clone, Copy, Debug)]
enum Place {
    Host,
    Gpu,
}

/// One side's pool: host bytes or a device buffer, with its bytes at the start.
enum Pool {
    Host(Vec<u8>),
    Gpu(DeviceBuffer),
}

impl Pool {
    fn new(device: &Device, place: Place, bytes: Vec<u8>) -> Result<Pool, Failed> {
        Ok(match place {
            Place::Host => Pool::Host(bytes),
            Place::Gpu => {
                let mut buf = DeviceBuffer::new(device, bytes.len())?;
                buf.upload(0, &bytes)?;
                Pool::Gpu(buf)
            }
        })
    }

    fn region(&mut self, id: u32) -> RawRegion {
        match self {
            Pool::Host(bytes) => RawRegion::host(RegionId(id), bytes),
            Pool::Gpu(buf) => RawRegion {
                id: RegionId(id),
                ptr: buf.ptr() as *mut u8,
                len: buf.len(),
                device: Some(buf.device().ordinal() as u32),
            },
        }
    }

    fn bytes(&self) -> Result<Vec<u8>, Failed> {
        Ok(match self {
            Pool::Host(bytes) => bytes.clone(),
            Pool::Gpu(buf) => {
                let mut out = vec![0; buf.len()];
                buf.download(0, &mut out)?;
                out
            }
        })
    }
}

/// Moves the common request from a pool in `from` to one in `to` over `transport`, then checks
/// the destination.
fn moves(device: &Device, transport: &Transport, from: Place, to: Place) -> Result<(), Failed> {
    let mut src = Pool::new(device, from, source_pool())?;
    let mut dst = Pool::new(device, to, vec![0; SLOT * SLOTS])?;
    let (s, r) = configs(transport.clone());
    let (src_regions, dst_regions) = ([src.region(1)], [dst.region(2)]);
    {
        if let Transport::Mem = transport {
            // SAFETY: both pools outlive the nodes (dropped at the end of the block).
            let (tx, rx) = unsafe { mem_pair(&s, &src_regions, &r, &dst_regions) }?;
            let ready = |e: &kvpipe::Event| matches!(e, kvpipe::Event::PeerReady { .. });
            common::wait_for(&rx, "PeerReady", ready);
            common::wait_for(&tx, "PeerReady", ready);
            transfer(&tx, &rx, MEM_RECEIVER_PEER, MEM_SENDER_PEER);
        } else {
            // SAFETY: as above.
            let rx = unsafe { DecodeNode::new(&r, &dst_regions) }?;
            // SAFETY: as above.
            let tx = unsafe { PrefillNode::new(&s, &src_regions) }?;
            let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
            transfer(&tx, &rx, to_receiver, to_sender);
            tx.close(Duration::from_secs(5))?;
            rx.close(Duration::from_secs(5))?;
        }
    }
    check_landed(&src.bytes()?, &dst.bytes()?);
    Ok(())
}

/// Device 0, or the reason the tests are skipped.
fn device() -> Result<Device, String> {
    check_driver().map_err(|e| format!("skipped: {e}"))?;
    Device::open(0).map_err(|e| format!("skipped: {e}"))
}

fn main() {
    let args = Arguments::from_args();
    let tcp = Transport::Tcp(TcpConfig::default());
    let cases = [
        ("mem_gpu_to_gpu", Transport::Mem, Place::Gpu, Place::Gpu),
        ("mem_gpu_to_host", Transport::Mem, Place::Gpu, Place::Host),
        ("mem_host_to_gpu", Transport::Mem, Place::Host, Place::Gpu),
        ("tcp_gpu_to_gpu", tcp.clone(), Place::Gpu, Place::Gpu),
        ("tcp_gpu_to_host", tcp.clone(), Place::Gpu, Place::Host),
        ("tcp_host_to_gpu", tcp, Place::Host, Place::Gpu),
    ];
    let trials = cases
        .into_iter()
        .map(|(name, transport, from, to)| {
            Trial::ignorable_test(name, move || match device() {
                Err(reason) => Ok(Completion::ignored_with(reason)),
                Ok(d) => moves(&d, &transport, from, to).map(|()| Completion::Completed),
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
