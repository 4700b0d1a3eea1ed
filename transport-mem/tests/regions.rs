//! Registration and write-batch execution of the in-process transport.

use kvpipe_core::{RegionId, WriteExtent, WritePlan};
use kvpipe_mem::{RegionTable, RegionUse, RegistrationError, ResolvedBatch, WriteError};

fn plan(extents: &[(u32, u64, u32, u64, u64)]) -> WritePlan {
    let mut p = WritePlan::new();
    for &(sr, so, dr, doff, len) in extents {
        p.push(WriteExtent {
            src_region: RegionId(sr),
            src_offset: so,
            dst_region: RegionId(dr),
            dst_offset: doff,
            len,
        });
    }
    p
}

#[test]
fn a_region_cannot_be_deregistered_while_a_batch_holds_it() {
    let mut src = vec![7u8; 64];
    let mut dst = vec![0u8; 64];
    let (mut s, mut d) = (RegionTable::new(), RegionTable::new());
    // SAFETY: the buffers outlive the tables and the batch (declared before them).
    unsafe {
        s.register_slice(RegionId(1), RegionUse::KvPool, &mut src)
            .unwrap();
        d.register_slice(RegionId(2), RegionUse::KvPool, &mut dst)
            .unwrap();
    }
    let batch = ResolvedBatch::resolve(&plan(&[(1, 0, 2, 8, 16)]), &s, &d).unwrap();
    assert_eq!(d.in_use(), 1);
    assert_eq!(
        d.deregister(RegionId(2)),
        Err(RegistrationError::InUse {
            region: RegionId(2),
            holders: 1
        })
    );
    batch.execute(1, 0).unwrap();
    drop(batch);
    assert_eq!(d.deregister(RegionId(2)), Ok(()));
    assert_eq!(
        d.deregister(RegionId(2)),
        Err(RegistrationError::NotRegistered(RegionId(2)))
    );
    assert_eq!(&dst[8..24], &[7u8; 16]);
    assert!(dst[..8].iter().chain(&dst[24..]).all(|&b| b == 0));
}

#[test]
fn registering_an_id_twice_is_refused() {
    let mut a = vec![0u8; 8];
    let mut t = RegionTable::new();
    // SAFETY: `a` outlives `t`.
    unsafe {
        t.register_slice(RegionId(1), RegionUse::Aux, &mut a)
            .unwrap();
        assert_eq!(
            t.register_slice(RegionId(1), RegionUse::Aux, &mut a),
            Err(RegistrationError::AlreadyRegistered(RegionId(1)))
        );
        assert_eq!(
            t.register_host(RegionId(2), RegionUse::Aux, std::ptr::null_mut(), 4),
            Err(RegistrationError::NullPointer(RegionId(2)))
        );
    }
}

#[test]
fn plans_outside_registrations_are_refused_before_any_copy() {
    let mut src = vec![1u8; 32];
    let mut dst = vec![0u8; 32];
    let (mut s, mut d) = (RegionTable::new(), RegionTable::new());
    // SAFETY: the buffers outlive the tables.
    unsafe {
        s.register_slice(RegionId(1), RegionUse::KvPool, &mut src)
            .unwrap();
        d.register_slice(RegionId(2), RegionUse::KvPool, &mut dst)
            .unwrap();
    }
    let err =
        ResolvedBatch::resolve(&plan(&[(1, 0, 2, 0, 8), (1, 0, 2, 30, 8)]), &s, &d).unwrap_err();
    assert_eq!(
        err,
        WriteError::OutOfBounds {
            side: "receiver",
            region: RegionId(2),
            offset: 30,
            len: 8,
            size: 32
        }
    );
    let err = ResolvedBatch::resolve(&plan(&[(9, 0, 2, 0, 8)]), &s, &d).unwrap_err();
    assert_eq!(
        err,
        WriteError::UnknownRegion {
            side: "sender",
            region: RegionId(9)
        }
    );
    let err = ResolvedBatch::resolve(&plan(&[(1, u64::MAX, 2, 0, 8)]), &s, &d).unwrap_err();
    assert!(matches!(
        err,
        WriteError::OutOfBounds { side: "sender", .. }
    ));
    assert_eq!(d.in_use(), 0, "a refused plan holds nothing");
    drop((s, d));
    assert!(dst.iter().all(|&b| b == 0));
}

#[test]
fn parallel_copies_write_exactly_what_serial_copies_write() {
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut src = src;
    let mut serial = vec![0u8; 4096];
    let mut parallel = vec![0u8; 4096];
    let p = plan(&[
        (1, 0, 2, 100, 1000),
        (1, 2000, 2, 1200, 1500),
        (1, 1000, 2, 3000, 7),
    ]);
    for (dst, threads) in [(&mut serial, 1usize), (&mut parallel, 3)] {
        let (mut s, mut d) = (RegionTable::new(), RegionTable::new());
        // SAFETY: the buffers outlive the tables and the batch.
        unsafe {
            s.register_slice(RegionId(1), RegionUse::KvPool, &mut src)
                .unwrap();
            d.register_slice(RegionId(2), RegionUse::KvPool, dst)
                .unwrap();
        }
        let b = ResolvedBatch::resolve(&p, &s, &d).unwrap();
        assert_eq!(b.bytes(), 2507);
        b.execute(threads, 0).unwrap();
    }
    assert_eq!(serial, parallel);
    assert_eq!(&serial[100..1100], &src[..1000]);
    assert_eq!(&serial[1200..2700], &src[2000..3500]);
    assert_eq!(&serial[3000..3007], &src[1000..1007]);
}

#[test]
fn a_half_failed_batch_copies_only_its_first_half() {
    let mut src = vec![9u8; 100];
    let mut dst = vec![0u8; 100];
    let (mut s, mut d) = (RegionTable::new(), RegionTable::new());
    // SAFETY: the buffers outlive the tables and the batch.
    unsafe {
        s.register_slice(RegionId(1), RegionUse::KvPool, &mut src)
            .unwrap();
        d.register_slice(RegionId(2), RegionUse::KvPool, &mut dst)
            .unwrap();
    }
    let mut b =
        ResolvedBatch::resolve(&plan(&[(1, 0, 2, 0, 30), (1, 0, 2, 50, 30)]), &s, &d).unwrap();
    b.truncate_half();
    assert_eq!(b.bytes(), 30);
    b.execute(1, 0).unwrap();
    drop((b, s, d));
    assert!(dst[..30].iter().all(|&x| x == 9));
    assert!(dst[30..].iter().all(|&x| x == 0));
}

/// Device regions (`cuda` feature) are registered, bounds-checked and released like host ones;
/// nothing here touches their memory, so no GPU is needed.
#[cfg(feature = "cuda")]
#[test]
fn device_regions_are_registered_and_bounds_checked_like_host_ones() {
    use kvpipe_mem::RegionKind;
    let mut host = vec![0u8; 64];
    let (mut s, mut d) = (RegionTable::new(), RegionTable::new());
    // SAFETY: nothing is executed, so the device addresses are never touched; `host` outlives
    // the tables.
    unsafe {
        s.register_device(RegionId(1), RegionUse::KvPool, 1, 0x7f00_0000_0000, 4096)
            .unwrap();
        assert_eq!(
            s.register_device(RegionId(1), RegionUse::KvPool, 0, 0x7f00_0000_0000, 8),
            Err(RegistrationError::AlreadyRegistered(RegionId(1)))
        );
        assert_eq!(
            s.register_device(RegionId(3), RegionUse::KvPool, 0, 0, 8),
            Err(RegistrationError::NullPointer(RegionId(3)))
        );
        s.register_slice(RegionId(4), RegionUse::Aux, &mut host)
            .unwrap();
        d.register_device(RegionId(2), RegionUse::KvPool, 0, 0x7f10_0000_0000, 4096)
            .unwrap();
    }
    let kind = |t: &RegionTable, id| t.get(RegionId(id)).map(|r| r.memory.kind());
    assert_eq!(kind(&s, 1), Some(RegionKind::Device { ordinal: 1 }));
    assert_eq!(kind(&s, 4), Some(RegionKind::Host));
    assert_eq!(s.get(RegionId(1)).map(|r| r.memory.len()), Some(4096));
    let err = ResolvedBatch::resolve(&plan(&[(1, 4000, 2, 0, 200)]), &s, &d).unwrap_err();
    assert_eq!(
        err,
        WriteError::OutOfBounds {
            side: "sender",
            region: RegionId(1),
            offset: 4000,
            len: 200,
            size: 4096
        }
    );
    let b = ResolvedBatch::resolve(&plan(&[(1, 0, 2, 0, 4096)]), &s, &d).unwrap();
    assert!(b.touches_device());
    assert_eq!(
        d.deregister(RegionId(2)),
        Err(RegistrationError::InUse {
            region: RegionId(2),
            holders: 1
        })
    );
    drop(b);
    assert_eq!(d.deregister(RegionId(2)), Ok(()));
    let host_only = ResolvedBatch::resolve(&plan(&[(4, 0, 4, 32, 8)]), &s, &s).unwrap();
    assert!(!host_only.touches_device());
}
