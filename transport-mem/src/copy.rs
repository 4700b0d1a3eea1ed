//! Executing write plans: resolving extents against registrations and copying them.
//!
//! Host → host segments are copied with `memcpy`, split over threads for large batches. With
//! the `cuda` feature, segments that touch device memory (device → device, between devices,
//! host ↔ device) are submitted to a `kvpipe_cuda::CopyEngine` in one list, which merges
//! contiguous extents into few large copies on its own streams; `ResolvedBatch::start` returns
//! an `InFlight` batch whose completion is polled through CUDA events, so the copy worker keeps
//! accepting batches while the GPU copies.

use std::sync::Arc;

use kvpipe_core::{RegionId, WritePlan};
use thiserror::Error;

use crate::region::{RegionMemory, RegionTable, Registration};

/// One extent of a write batch, resolved to the registrations it reads and writes. Holding it
/// keeps both registrations in use.
#[derive(Clone, Debug)]
pub struct Segment {
    src: Arc<Registration>,
    src_offset: usize,
    dst: Arc<Registration>,
    dst_offset: usize,
    len: usize,
}

impl Segment {
    /// Whether both sides are host memory.
    pub fn is_host(&self) -> bool {
        matches!(
            (&self.src.memory, &self.dst.memory),
            (RegionMemory::Host(_), RegionMemory::Host(_))
        )
    }

    /// Whether either side is host memory (a copy the host takes part in: the driver may read
    /// or write the host side when the copy is issued, not when the GPU runs it).
    pub fn touches_host(&self) -> bool {
        matches!(self.src.memory, RegionMemory::Host(_))
            || matches!(self.dst.memory, RegionMemory::Host(_))
    }

    /// The segment as an extent for the GPU copy engine.
    #[cfg(feature = "cuda")]
    fn extent(&self) -> kvpipe_cuda::CopyExtent {
        fn memory(m: &RegionMemory) -> kvpipe_cuda::Memory {
            match m {
                RegionMemory::Host(h) => kvpipe_cuda::Memory::Host {
                    addr: h.as_ptr() as usize,
                },
                RegionMemory::Device(d) => kvpipe_cuda::Memory::Device {
                    ordinal: d.ordinal(),
                    addr: d.ptr(),
                },
            }
        }
        kvpipe_cuda::CopyExtent {
            src: memory(&self.src.memory),
            src_offset: self.src_offset as u64,
            dst: memory(&self.dst.memory),
            dst_offset: self.dst_offset as u64,
            len: self.len as u64,
        }
    }

    /// Bytes copied.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment copies nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A write plan resolved against the two sides' registrations, bounds-checked: executing it
/// cannot touch memory outside them.
#[derive(Clone, Debug, Default)]
pub struct ResolvedBatch {
    segments: Vec<Segment>,
    bytes: u64,
}

/// Why a plan could not be resolved; the batch then fails without copying anything.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WriteError {
    /// An extent names a region the side did not register.
    #[error("the {side} has no registered {region}")]
    UnknownRegion {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
    },
    /// An extent runs past the end of its region.
    #[error("{side} extent {offset}+{len} runs past {region}'s {size} bytes")]
    OutOfBounds {
        /// "sender" or "receiver".
        side: &'static str,
        /// The region.
        region: RegionId,
        /// Start of the extent.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's size.
        size: u64,
    },
}

/// Why a resolved batch could not be copied. Without the `cuda` feature host copies cannot
/// fail and this enum has no variant.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CopyError {
    /// A device copy could not start or failed on the GPU (no driver, no device, a driver
    /// error, or a deadline that passed while the copies were still running).
    #[cfg(feature = "cuda")]
    #[error("device copy: {0}")]
    Device(#[from] kvpipe_cuda::CudaError),
}

/// Streams the copy engine uses on each GPU.
#[cfg(feature = "cuda")]
pub const DEVICE_STREAMS: usize = 2;

/// How long [`ResolvedBatch::execute`] waits for device copies, and a batch with host memory
/// for its fence.
#[cfg(feature = "cuda")]
const EXECUTE_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Resolves one side's extents against its table, remembering the last region: consecutive
/// extents almost always name the same region, so most skip the table lookup.
struct Resolver<'a> {
    side: &'static str,
    table: &'a RegionTable,
    recent: Option<(RegionId, Arc<Registration>)>,
}

impl<'a> Resolver<'a> {
    fn new(side: &'static str, table: &'a RegionTable) -> Self {
        Resolver {
            side,
            table,
            recent: None,
        }
    }

    /// The registration of `region` with `offset + len` checked against its size.
    fn checked(
        &mut self,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> Result<(Arc<Registration>, usize), WriteError> {
        let side = self.side;
        let reg = match &self.recent {
            Some((id, reg)) if *id == region => Arc::clone(reg),
            _ => {
                let reg = self
                    .table
                    .get(region)
                    .ok_or(WriteError::UnknownRegion { side, region })?;
                self.recent = Some((region, Arc::clone(reg)));
                Arc::clone(reg)
            }
        };
        let size = reg.memory.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(WriteError::OutOfBounds {
                side,
                region,
                offset,
                len,
                size,
            });
        }
        Ok((reg, offset as usize))
    }
}

impl ResolvedBatch {
    /// Resolves every extent of `plan`: sources in `src`, destinations in `dst`.
    pub fn resolve(
        plan: &WritePlan,
        src: &RegionTable,
        dst: &RegionTable,
    ) -> Result<Self, WriteError> {
        let mut segments = Vec::with_capacity(plan.len());
        let mut bytes = 0;
        let (mut src, mut dst) = (Resolver::new("sender", src), Resolver::new("receiver", dst));
        for e in plan.extents() {
            let (s, so) = src.checked(e.src_region, e.src_offset, e.len)?;
            let (d, doff) = dst.checked(e.dst_region, e.dst_offset, e.len)?;
            bytes += e.len;
            segments.push(Segment {
                src: s,
                src_offset: so,
                dst: d,
                dst_offset: doff,
                len: e.len as usize,
            });
        }
        Ok(ResolvedBatch { segments, bytes })
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The segments, in plan order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Keeps the segments whose entry in `keep` (one per segment, in plan order) is true.
    pub fn retain(&mut self, keep: &[bool]) {
        let mut flags = keep.iter();
        self.segments
            .retain(|_| flags.next().copied().unwrap_or(false));
        self.bytes = self.segments.iter().map(|s| s.len as u64).sum();
    }

    /// Keeps only the first half of the bytes (a write that failed part-way).
    pub fn truncate_half(&mut self) {
        let mut keep = self.bytes / 2;
        let mut out = Vec::new();
        for mut s in self.segments.drain(..) {
            if keep == 0 {
                break;
            }
            let take = (s.len as u64).min(keep);
            s.len = take as usize;
            keep -= take;
            out.push(s);
        }
        self.bytes = out.iter().map(|s| s.len as u64).sum();
        self.segments = out;
    }

    /// Whether some segment reads or writes device memory.
    pub fn touches_device(&self) -> bool {
        self.segments.iter().any(|s| !s.is_host())
    }

    /// Copies every segment and returns when all are done: host → host segments split evenly
    /// over `threads` threads (the calling thread is one of them) when the batch holds at least
    /// `parallel_threshold` bytes; with the `cuda` feature, segments touching device memory
    /// through a copy engine made for this call (the copy worker keeps one engine and uses
    /// `start` instead).
    pub fn execute(&self, threads: usize, parallel_threshold: u64) -> Result<(), CopyError> {
        #[cfg(feature = "cuda")]
        if self.touches_device() {
            let mut engine = kvpipe_cuda::CopyEngine::new(DEVICE_STREAMS)?;
            let in_flight = self
                .clone()
                .start(&mut engine, threads, parallel_threshold)?;
            in_flight.wait(std::time::Instant::now() + EXECUTE_LIMIT)?;
            return Ok(());
        }
        self.copy_host(threads, parallel_threshold);
        Ok(())
    }

    /// Copies the host → host segments now (as [`execute`](Self::execute) does) and submits
    /// the segments touching device memory to `engine` in one list, returning at once. The
    /// batch (and so its registrations) is held by the returned [`InFlight`] until its copies
    /// are done.
    #[cfg(feature = "cuda")]
    pub fn start(
        self,
        engine: &mut kvpipe_cuda::CopyEngine,
        threads: usize,
        parallel_threshold: u64,
    ) -> Result<InFlight, CopyError> {
        self.start_after(engine, threads, parallel_threshold, None)
    }

    /// [`start`](Self::start), with the copies starting only once `after` passed: a batch whose
    /// every segment is device → device waits for it on the GPU (the call returns at once);
    /// one with host memory on either side of a segment waits for it on this thread first
    /// (the driver may touch pageable host memory when a copy is issued; an error after 60 s,
    /// with nothing copied).
    #[cfg(feature = "cuda")]
    pub fn start_after(
        self,
        engine: &mut kvpipe_cuda::CopyEngine,
        threads: usize,
        parallel_threshold: u64,
        after: Option<&kvpipe_cuda::Fence>,
    ) -> Result<InFlight, CopyError> {
        if let Some(fence) = after.filter(|_| self.segments.iter().any(Segment::touches_host)) {
            fence.wait(std::time::Instant::now() + EXECUTE_LIMIT)?;
        }
        self.copy_host(threads, parallel_threshold);
        let extents: Vec<kvpipe_cuda::CopyExtent> = self
            .segments
            .iter()
            .filter(|s| !s.is_host())
            .map(Segment::extent)
            .collect();
        let ticket = if extents.is_empty() {
            None
        } else {
            // SAFETY: `resolve` checked every extent against its registration; the registrations'
            // contract keeps the memory valid and untouched by anything else while the batch is
            // in flight, and the returned `InFlight` holds the registrations (and waits in its
            // `Drop`) until the copies are done. Destinations of one plan do not overlap.
            // The fence only delays the copies; the registrations are held all the same.
            Some(unsafe { engine.submit_after(&extents, after) }?)
        };
        Ok(InFlight {
            ticket,
            batch: self,
        })
    }

    /// Copies the host → host segments, split evenly over `threads` threads (the calling thread
    /// is one of them) when the batch holds at least `parallel_threshold` bytes.
    fn copy_host(&self, threads: usize, parallel_threshold: u64) {
        let threads = threads.max(1);
        let host_bytes: u64 = self
            .segments
            .iter()
            .filter(|s| s.is_host())
            .map(|s| s.len as u64)
            .sum();
        if host_bytes == 0 {
            return;
        }
        if threads == 1 || host_bytes < parallel_threshold {
            for s in self.segments.iter().filter(|s| s.is_host()) {
                copy_segment(s, 0, s.len);
            }
            return;
        }
        // Device segments count as empty here: they are not this function's to copy.
        let lens: Vec<usize> = self
            .segments
            .iter()
            .map(|s| if s.is_host() { s.len } else { 0 })
            .collect();
        let shares = split_even(&lens, threads);
        std::thread::scope(|scope| {
            let mut shares = shares.into_iter();
            let first = shares.next().unwrap_or_default();
            for share in shares {
                scope.spawn(move || {
                    for p in share {
                        copy_segment(&self.segments[p.index], p.offset, p.len);
                    }
                });
            }
            for p in first {
                copy_segment(&self.segments[p.index], p.offset, p.len);
            }
        });
    }
}

/// A batch whose device copies were submitted: poll [`is_complete`](Self::is_complete) or
/// [`wait`](Self::wait). It holds the batch's registrations until the copies are done; dropping
/// it before then waits for them (so memory is never released under a running copy).
#[cfg(feature = "cuda")]
#[derive(Debug)]
#[must_use = "the device copies may still be running"]
pub struct InFlight {
    ticket: Option<kvpipe_cuda::CopyTicket>,
    batch: ResolvedBatch,
}

#[cfg(feature = "cuda")]
impl InFlight {
    /// Whether every copy of the batch is done; an error if one failed on the GPU.
    pub fn is_complete(&self) -> Result<bool, CopyError> {
        match &self.ticket {
            None => Ok(true),
            Some(t) => Ok(t.is_complete()?),
        }
    }

    /// Waits until every copy is done or `deadline` passes (an error; the copies keep running
    /// and this value keeps holding the registrations).
    pub fn wait(&self, deadline: std::time::Instant) -> Result<(), CopyError> {
        match &self.ticket {
            None => Ok(()),
            Some(t) => Ok(t.wait(deadline)?),
        }
    }

    /// The batch.
    pub fn batch(&self) -> &ResolvedBatch {
        &self.batch
    }

    /// Driver copies issued for the batch's device segments (after merging contiguous ones; a
    /// strided run of device copies counts once).
    pub fn device_copies(&self) -> usize {
        self.ticket.as_ref().map_or(0, |t| t.copies())
    }
}

#[cfg(feature = "cuda")]
impl Drop for InFlight {
    fn drop(&mut self) {
        // Keep the registrations until the GPU is done with their memory. A failed device
        // reports an error from the query instead of completing, which ends the wait.
        if let Some(t) = &self.ticket {
            while let Ok(false) = t.is_complete() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// A piece of one extent: bytes `offset..offset + len` of extent `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The extent.
    pub index: usize,
    /// First byte inside the extent.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Splits extents of lengths `lens` into `parts` shares of (nearly) equal bytes, in order; an
/// extent crossing a share boundary is cut. Used by the transport and by the memcpy baseline of
/// `kvpipe bench transfer`, so both copy the same pieces on the same number of threads.
pub fn split_even(lens: &[usize], parts: usize) -> Vec<Vec<Piece>> {
    let parts = parts.max(1);
    let total: usize = lens.iter().sum();
    let share = total.div_ceil(parts).max(1);
    let mut out = vec![Vec::new(); parts];
    let mut part = 0;
    let mut room = share;
    for (index, &len) in lens.iter().enumerate() {
        let mut offset = 0;
        while offset < len {
            if room == 0 {
                part = (part + 1).min(parts - 1);
                room = share;
            }
            let take = (len - offset).min(room);
            out[part].push(Piece {
                index,
                offset,
                len: take,
            });
            offset += take;
            room -= take;
        }
    }
    out
}

/// Copies bytes `offset..offset + len` of host → host segment `s` (segments touching device
/// memory are left to the copy engine).
fn copy_segment(s: &Segment, offset: usize, len: usize) {
    match (&s.src.memory, &s.dst.memory) {
        (RegionMemory::Host(src), RegionMemory::Host(dst)) => {
            // SAFETY: `resolve` checked both ranges against the registrations, which the
            // segment keeps alive; the registration contract guarantees the memory is valid
            // and that nothing else touches these bytes while the batch is in flight.
            // `ptr::copy` tolerates a source and destination registered over the same memory.
            unsafe {
                std::ptr::copy(
                    src.as_ptr().add(s.src_offset + offset),
                    dst.as_ptr().add(s.dst_offset + offset),
                    len,
                );
            }
        }
        #[cfg(feature = "cuda")]
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_every_byte_once_in_order() {
        for (lens, parts) in [
            (vec![10usize, 3, 7], 3usize),
            (vec![100], 4),
            (vec![1, 1, 1], 8),
            (vec![], 2),
            (vec![5, 0, 5], 2),
        ] {
            let shares = split_even(&lens, parts);
            assert_eq!(shares.len(), parts);
            let mut seen: Vec<Vec<bool>> = lens.iter().map(|&l| vec![false; l]).collect();
            for p in shares.iter().flatten() {
                for b in &mut seen[p.index][p.offset..p.offset + p.len] {
                    assert!(!*b, "byte copied twice");
                    *b = true;
                }
            }
            assert!(seen.iter().flatten().all(|&b| b), "byte not copied");
            let total: usize = lens.iter().sum();
            for s in &shares {
                let bytes: usize = s.iter().map(|p| p.len).sum();
                assert!(bytes <= total.div_ceil(parts).max(1));
            }
        }
    }
}
