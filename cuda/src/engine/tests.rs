//! Tests of the pure parts: coalescing, strided runs, stream choice.

use super::copies::{coalesce, coalesce_in, CopyExtent, CopyOp, Direction, Memory};
use super::copy_engine::least_loaded;
use super::strided::{strided_runs, StridedRun};
use crate::CudaError;

fn dev(addr: u64) -> Memory {
    Memory::Device { ordinal: 0, addr }
}

fn ext(src: Memory, so: u64, dst: Memory, d: u64, len: u64) -> CopyExtent {
    CopyExtent {
        src,
        src_offset: so,
        dst,
        dst_offset: d,
        len,
    }
}

#[test]
fn extents_contiguous_on_both_sides_become_one_copy() {
    let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
    let extents = [
        ext(a, 0, b, 0, 100),
        ext(a, 100, b, 100, 50),
        ext(a, 150, b, 150, 0),
        ext(a, 150, b, 150, 10),
        // Source continues, destination does not: a new copy.
        ext(a, 160, b, 500, 10),
        // Destination continues, source does not.
        ext(a, 0, b, 510, 10),
    ];
    let mut out = Vec::new();
    coalesce(&extents, &mut out).unwrap();
    let d = Direction::DeviceToDevice { ordinal: 0 };
    assert_eq!(
        out,
        vec![
            CopyOp {
                direction: d,
                src: 0x1000_0000,
                dst: 0x2000_0000,
                len: 160
            },
            CopyOp {
                direction: d,
                src: 0x1000_0000 + 160,
                dst: 0x2000_0000 + 500,
                len: 10
            },
            CopyOp {
                direction: d,
                src: 0x1000_0000,
                dst: 0x2000_0000 + 510,
                len: 10
            },
        ]
    );
    assert_eq!(out.iter().map(|c| c.len).sum::<u64>(), 180);
}

#[test]
fn directions_follow_the_two_sides_and_never_merge_across_kinds() {
    let host = Memory::Host { addr: 0x5000 };
    let d0 = dev(0x1_0000_0000);
    let d1 = Memory::Device {
        ordinal: 1,
        addr: 0x1_0000_0000,
    };
    let mut out = Vec::new();
    coalesce(
        &[
            ext(host, 0, d0, 0, 8),
            // Contiguous in addresses, but device to host: its own copy.
            ext(d0, 0, host, 8, 8),
            ext(d0, 8, d1, 8, 8),
            ext(d1, 16, d0, 16, 8),
        ],
        &mut out,
    )
    .unwrap();
    let dirs: Vec<_> = out.iter().map(|c| c.direction).collect();
    assert_eq!(
        dirs,
        vec![
            Direction::HostToDevice { ordinal: 0 },
            Direction::DeviceToHost { ordinal: 0 },
            Direction::Peer { src: 0, dst: 1 },
            Direction::Peer { src: 1, dst: 0 },
        ]
    );
    assert_eq!(out[2].direction.executor(), 0);
    assert_eq!(out[3].direction.executor(), 1);
    assert_eq!(out[0].direction.executor(), 0);
}

#[test]
fn host_to_host_extents_are_refused_with_their_index() {
    let host = Memory::Host { addr: 0x5000 };
    let mut out = Vec::new();
    assert_eq!(
        coalesce(
            &[ext(dev(0), 0, host, 0, 4), ext(host, 0, host, 64, 4)],
            &mut out
        ),
        Err(CudaError::HostToHost { index: 1 })
    );
}

#[test]
fn copies_go_to_the_least_loaded_stream() {
    assert_eq!(least_loaded(&[0, 0]), 0);
    assert_eq!(least_loaded(&[10, 0, 5]), 1);
    assert_eq!(least_loaded(&[10, 10, 5]), 2);
}

fn runs_of(extents: &[CopyExtent]) -> Vec<StridedRun> {
    let (mut copies, mut memories, mut runs) = (Vec::new(), Vec::new(), Vec::new());
    coalesce_in(extents, &mut copies, &mut memories).unwrap();
    strided_runs(&copies, &memories, &mut runs);
    runs
}

#[test]
fn head_slices_of_every_layer_become_one_strided_run() {
    // One head (8 KiB) of four, for 80 layer planes: sources adjacent, destinations 32 KiB
    // apart; then a copy of another length ends the run.
    let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
    let mut extents: Vec<_> = (0..80u64)
        .map(|l| ext(a, l * 8192, b, l * 32768 + 2 * 8192, 8192))
        .collect();
    extents.push(ext(a, 1 << 24, b, 1 << 24, 100));
    let runs = runs_of(&extents);
    assert_eq!(runs.len(), 2);
    assert_eq!(
        (runs[0].rows, runs[0].src_pitch, runs[0].dst_pitch),
        (80, 8192, 32768)
    );
    assert_eq!(runs[0].first.src, 0x1000_0000);
    assert_eq!(runs[0].first.dst, 0x2000_0000 + 2 * 8192);
    assert_eq!(runs[0].bytes(), 80 * 8192);
    assert_eq!((runs[1].rows, runs[1].first.len), (1, 100));
    assert_eq!(runs[0].row(79).src, 0x1000_0000 + 79 * 8192);
    assert_eq!(runs[0].row(79).dst, 0x2000_0000 + 79 * 32768 + 2 * 8192);
}

#[test]
fn only_device_copies_with_constant_forward_pitches_form_runs() {
    let (a, b) = (dev(0x1000_0000), dev(0x2000_0000));
    let host = Memory::Host { addr: 0x7000_0000 };
    let count =
        |extents: &[CopyExtent]| runs_of(extents).iter().map(|r| r.rows).collect::<Vec<_>>();
    // Backwards destinations: one copy each.
    assert_eq!(
        count(&[ext(a, 0, b, 4096, 64), ext(a, 64, b, 0, 64)]),
        vec![1, 1]
    );
    // Rows that would overlap (pitch below the length): one copy each.
    assert_eq!(
        count(&[ext(a, 0, b, 0, 64), ext(a, 128, b, 32, 64)]),
        vec![1, 1]
    );
    // The pitch changes after three rows: a run of three, then a new run.
    assert_eq!(
        count(&[
            ext(a, 0, b, 0, 64),
            ext(a, 100, b, 200, 64),
            ext(a, 200, b, 400, 64),
            ext(a, 1000, b, 1000, 64),
            ext(a, 1100, b, 1100, 64),
        ]),
        vec![3, 2]
    );
    // Host → device copies are never strided.
    assert_eq!(
        count(&[ext(host, 0, b, 0, 64), ext(host, 100, b, 200, 64)]),
        vec![1, 1]
    );
    // A pitch past the limit: one copy each.
    assert_eq!(
        count(&[ext(a, 0, b, 0, 64), ext(a, 1 << 32, b, 1 << 32, 64)]),
        vec![1, 1]
    );
    // Rows in two allocations (pools) on one side: a run per allocation, since a 2D
    // copy's span must lie in one.
    let c = dev(0x3000_0000);
    assert_eq!(
        count(&[
            ext(a, 0, b, 0, 64),
            ext(a, 100, b, 200, 64),
            ext(c, 0, b, 400, 64),
            ext(c, 100, b, 600, 64),
        ]),
        vec![2, 2]
    );
    // Contiguous extents of two allocations do not merge either.
    let mut copies = Vec::new();
    coalesce(
        &[ext(a, 0, b, 0, 64), ext(dev(0x1000_0040), 0, b, 64, 64)],
        &mut copies,
    )
    .unwrap();
    assert_eq!(copies.len(), 2);
    let mut runs = vec![];
    strided_runs(&[], &[], &mut runs);
    assert!(runs.is_empty());
}
