//! GPU regions through the engine API (`cuda` feature): a request moved between device pools,
//! and between a device and a host pool, in process (device copies) and over TCP (pinned
//! staging), every destination byte checked; and a chunk handed over behind a fence while the
//! GPU still computes it. Where no CUDA driver or device is found each test
//! is reported as ignored with the reason ("skipped: no CUDA driver"), never as passed;
//! `scripts/gpu-check` runs them on the GPU machine.

mod common;

use std::time::Duration;

use std::sync::Arc;

use common::{
    check_landed, configs, connect, first_token, open_request, source_pool, transfer, wait_for,
    whole_prompt, SLOT, SLOTS,
};
use kvpipe::{
    mem_pair, BlockId, BlockTables, DecodeNode, Event, PrefillNode, RawRegion, RegionId, RequestId,
    TcpConfig, Transport, MEM_RECEIVER_PEER, MEM_SENDER_PEER,
};
use kvpipe_cuda::{check_driver, BusyKernel, CopyEngine, CopyExtent, Device, DeviceBuffer, Memory};
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

/// A chunk handed over behind a fence while a kernel stands for its compute: over mem the call
/// returns at once and the copies wait on the GPU, so what is written to the source while the
/// kernel runs is what lands; over tcp the call returns only once the fence passed.
fn fenced(device: &Device, transport: &Transport) -> Result<(), Failed> {
    let old = source_pool();
    let new: Vec<u8> = old.iter().map(|b| b ^ 0xA5).collect();
    let mut src = Pool::new(device, Place::Gpu, old.clone())?;
    let mut dst = Pool::new(device, Place::Gpu, vec![0; SLOT * SLOTS])?;
    let mut fresh = DeviceBuffer::new(device, new.len())?;
    fresh.upload(0, &new)?;
    let scratch = DeviceBuffer::new(device, 64)?;
    let gpu = |b: &DeviceBuffer| Memory::Device {
        ordinal: b.device().ordinal(),
        addr: b.ptr(),
    };
    let copy = |from: &DeviceBuffer, to: &DeviceBuffer, len: usize| CopyExtent {
        src: gpu(from),
        src_offset: 0,
        dst: gpu(to),
        dst_offset: 0,
        len: len as u64,
    };
    // The writer's streams and kernel are made before the compute runs (loading a kernel may
    // wait for the GPU).
    let mut writer = CopyEngine::new(1)?;
    let deadline = || std::time::Instant::now() + Duration::from_secs(30);
    // SAFETY: both buffers outlive the wait, and nothing else touches them.
    unsafe { writer.submit(&[copy(&fresh, &scratch, 64)]) }?.wait(deadline())?;
    let mut busy = BusyKernel::new(device)?;
    let (s, r) = configs(transport.clone());
    let (src_regions, dst_regions) = ([src.region(1)], [dst.region(2)]);
    let Pool::Gpu(src_buf) = &src else {
        unreachable!("the source pool is on the GPU")
    };
    let mem = matches!(transport, Transport::Mem);
    {
        // SAFETY: the pools outlive the nodes (dropped at the end of the block).
        let (tx, rx, to_receiver, to_sender) = if mem {
            let (tx, rx) = unsafe { mem_pair(&s, &src_regions, &r, &dst_regions) }?;
            let ready = |e: &Event| matches!(e, Event::PeerReady { .. });
            wait_for(&rx, "PeerReady", ready);
            wait_for(&tx, "PeerReady", ready);
            (tx, rx, MEM_RECEIVER_PEER, MEM_SENDER_PEER)
        } else {
            // SAFETY: as above.
            let rx = unsafe { DecodeNode::new(&r, &dst_regions) }?;
            // SAFETY: as above.
            let tx = unsafe { PrefillNode::new(&s, &src_regions) }?;
            let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
            (tx, rx, to_receiver, to_sender)
        };
        // A first request makes the transport's copy engine (loading its kernel may wait for
        // the GPU, which must not happen while the kernel below runs).
        transfer(&tx, &rx, to_receiver, to_sender);
        let request = RequestId(43);
        let table: Vec<Option<BlockId>> = open_request(&tx, &rx, request, to_receiver, to_sender);
        let groups: [&[Option<BlockId>]; 1] = [&table];
        busy.launch(Duration::from_millis(300))?;
        let fence = Arc::new(busy.fence()?);
        let out = tx.submit_chunk_after(
            request,
            whole_prompt(),
            &mut BlockTables { groups: &groups },
            &fence,
        )?;
        assert!(out.slice().is_some(), "{out:?}");
        if mem {
            // The copies wait for the kernel: the source written now is what they read.
            // SAFETY: both buffers outlive the wait; the fenced copies read the source only
            // after the kernel, which this copy ends before (checked below).
            unsafe { writer.submit(&[copy(&fresh, src_buf, new.len())]) }?.wait(deadline())?;
            if fence.is_done()? {
                return Err(
                    "the kernel ended before the source was rewritten: inconclusive".into(),
                );
            }
        } else {
            assert!(
                fence.is_done()?,
                "the call returned before its fence passed"
            );
        }
        tx.submit_aux(request, first_token())?;
        let quiesced = |e: &Event| matches!(e, Event::Quiesced { request: q } if *q == request);
        wait_for(&rx, "Quiesced (decode)", quiesced);
        wait_for(&tx, "Quiesced (prefill)", quiesced);
        if !mem {
            tx.close(Duration::from_secs(5))?;
            rx.close(Duration::from_secs(5))?;
        }
    }
    check_landed(if mem { &new } else { &old }, &dst.bytes()?);
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
    let mut trials: Vec<Trial> = cases
        .into_iter()
        .map(|(name, transport, from, to)| {
            Trial::ignorable_test(name, move || match device() {
                Err(reason) => Ok(Completion::ignored_with(reason)),
                Ok(d) => moves(&d, &transport, from, to).map(|()| Completion::Completed),
            })
        })
        .collect();
    for (name, transport) in [
        ("mem_fenced_chunk", Transport::Mem),
        ("tcp_fenced_chunk", Transport::Tcp(TcpConfig::default())),
    ] {
        trials.push(Trial::ignorable_test(name, move || match device() {
            Err(reason) => Ok(Completion::ignored_with(reason)),
            Ok(d) => fenced(&d, &transport).map(|()| Completion::Completed),
        }));
    }
    libtest_mimic::run(&args, trials).exit();
}
