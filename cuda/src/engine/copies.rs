//! What a copy is: the memory on each side ([`Memory`]), the extents a caller gives
//! ([`CopyExtent`]), the driver copies they become ([`CopyOp`], [`Direction`]), and
//! [`coalesce`], which merges extents contiguous on both sides.

use crate::CudaError;

/// Where one side of a copy lives, and its base address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Memory {
    /// Host memory (pinned or pageable) starting at `addr`.
    Host {
        /// The address of the first byte.
        addr: usize,
    },
    /// Device memory of device `ordinal` starting at device address `addr`.
    Device {
        /// The device.
        ordinal: usize,
        /// The device address of the first byte.
        addr: u64,
    },
}

impl Memory {
    /// The address of byte `offset`.
    fn at(self, offset: u64) -> u64 {
        match self {
            Memory::Host { addr } => addr as u64 + offset,
            Memory::Device { addr, .. } => addr + offset,
        }
    }

    fn ordinal(self) -> Option<usize> {
        match self {
            Memory::Host { .. } => None,
            Memory::Device { ordinal, .. } => Some(ordinal),
        }
    }
}

/// One extent: `len` bytes from `src` + `src_offset` to `dst` + `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyExtent {
    /// The source memory.
    pub src: Memory,
    /// First source byte.
    pub src_offset: u64,
    /// The destination memory.
    pub dst: Memory,
    /// First destination byte.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What kind of driver copy an extent becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Within one device (`cuMemcpyDtoDAsync`).
    DeviceToDevice {
        /// The device.
        ordinal: usize,
    },
    /// Between two devices (`cuMemcpyPeerAsync`).
    Peer {
        /// The source device.
        src: usize,
        /// The destination device.
        dst: usize,
    },
    /// Host to device (`cuMemcpyHtoDAsync`).
    HostToDevice {
        /// The device.
        ordinal: usize,
    },
    /// Device to host (`cuMemcpyDtoHAsync`).
    DeviceToHost {
        /// The device.
        ordinal: usize,
    },
}

impl Direction {
    /// The device whose stream carries the copy.
    pub fn executor(self) -> usize {
        match self {
            Direction::DeviceToDevice { ordinal }
            | Direction::HostToDevice { ordinal }
            | Direction::DeviceToHost { ordinal } => ordinal,
            Direction::Peer { src, .. } => src,
        }
    }
}

/// One driver copy: absolute addresses (host addresses as integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyOp {
    /// Its kind.
    pub direction: Direction,
    /// The first source byte.
    pub src: u64,
    /// The first destination byte.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Turns extents into driver copies, merging each extent into the previous copy when both
/// sides continue it (same direction, same memory on each side, source and destination both
/// contiguous). Empty extents vanish. Host → host extents are refused: they are the caller's
/// `memcpy`.
pub fn coalesce(extents: &[CopyExtent], out: &mut Vec<CopyOp>) -> Result<(), CudaError> {
    coalesce_in(extents, out, &mut Vec::new())
}

/// [`coalesce`], also giving each copy's memory on both sides (`memories[i]` for `out[i]`).
pub(super) fn coalesce_in(
    extents: &[CopyExtent],
    out: &mut Vec<CopyOp>,
    memories: &mut Vec<(Memory, Memory)>,
) -> Result<(), CudaError> {
    out.clear();
    memories.clear();
    for (index, e) in extents.iter().enumerate() {
        let direction = match (e.src.ordinal(), e.dst.ordinal()) {
            (None, None) => return Err(CudaError::HostToHost { index }),
            (Some(s), Some(d)) if s == d => Direction::DeviceToDevice { ordinal: s },
            (Some(src), Some(dst)) => Direction::Peer { src, dst },
            (None, Some(ordinal)) => Direction::HostToDevice { ordinal },
            (Some(ordinal), None) => Direction::DeviceToHost { ordinal },
        };
        if e.len == 0 {
            continue;
        }
        let (src, dst) = (e.src.at(e.src_offset), e.dst.at(e.dst_offset));
        if let Some(last) = out.last_mut() {
            if last.direction == direction
                && memories.last() == Some(&(e.src, e.dst))
                && last.src.checked_add(last.len) == Some(src)
                && last.dst.checked_add(last.len) == Some(dst)
            {
                last.len += e.len;
                continue;
            }
        }
        out.push(CopyOp {
            direction,
            src,
            dst,
            len: e.len,
        });
        memories.push((e.src, e.dst));
    }
    Ok(())
}
