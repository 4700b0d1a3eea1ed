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
    batch.execute(1, 0);
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
        b.execute(threads, 0);
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
    b.execute(1, 0);
    drop((b, s, d));
    assert!(dst[..30].iter().all(|&x| x == 9));
    assert!(dst[30..].iter().all(|&x| x == 0));
}
