//! Pools in GPU memory (`cuda` feature).
//!
//! [`ReferenceCache::place_on_device`] gives every pool a device buffer of the same size and
//! uploads the host bytes. From then on the device buffers are the pools a transport registers
//! ([`ReferenceCache::device_pool`]) and the host buffers are the engine's side of them: what
//! the cache writes on the host (computed chunks, the filler of a slot handed out for the first
//! time, a receiver's cached prefix) is uploaded at the end of the call that wrote it, slot runs
//! at a time, before the call returns — so a chunk's blocks are in device memory when the chunk
//! is submitted, as a GPU engine's would be. The checks read host memory:
//! [`ReferenceCache::sync_from_device`] downloads every pool first (and so compares every byte
//! that went through the GPU), [`ReferenceCache::sync_held_from_device`] only the slots the
//! requests hold.
//!
//! **Host memory stays at about the live KV.** The host buffers are allocated zeroed and a slot's
//! host bytes are first written when the slot is first handed out (full-attention pools: when
//! the cache is built), so the operating system commits only those. Placing uploads only those
//! slots (the rest of the device buffer is zeroed on the GPU), and reading back only the held
//! slots leaves the others uncommitted: a windowed pool, reserved for every block of every
//! request but holding only a window of each, never commits its unused slots on the host.
//!
//! Uploads touch only slots no transfer reads or writes at that moment (a chunk's own blocks,
//! slots just handed out), so they run while transfers of other blocks go on.

use kvpipe_core::RegionId;
use kvpipe_cuda::{Device, DeviceBuffer, Uploader};

use super::error::CacheError;
use super::ReferenceCache;

/// A pool's device memory, as a transport registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePool {
    /// The GPU.
    pub ordinal: usize,
    /// The device address of the pool's first byte.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
}

/// The device buffers of a cache's pools, in region order (empty until placed). A clone of the
/// cache is a host cache: it does not share or copy the device buffers.
#[derive(Debug, Default)]
pub(super) struct DeviceMirror {
    /// What uploads the host's writes once placed (made on the first upload). Declared first,
    /// so it is dropped (and waits for its copies) before the buffers they write are freed.
    uploader: Option<Uploader>,
    buffers: Vec<DeviceBuffer>,
    placed: bool,
}

/// The page-locked staging of a cache's uploads: a layer range of 4 layers of a 512-token
/// chunk of llama3-8b is 8 MiB, so such a range goes out with one wait.
const UPLOAD_STAGING: usize = 8 << 20;

impl Clone for DeviceMirror {
    fn clone(&self) -> Self {
        DeviceMirror::default()
    }
}

impl DeviceMirror {
    pub(super) fn is_placed(&self) -> bool {
        self.placed
    }
}

/// Merges sorted, deduplicated slots into runs `[first, end)`.
fn runs(slots: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &s in slots {
        match out.last_mut() {
            Some((_, end)) if *end == s => *end += 1,
            _ => out.push((s, s + 1)),
        }
    }
    out
}

impl ReferenceCache {
    /// Moves the pools to GPU `device`: one device buffer per pool, holding the host bytes
    /// (see the module doc). Placing a cache that is on a device already does nothing; a cache
    /// without memory (`materialize: false`) cannot be placed.
    pub fn place_on_device(&mut self, device: &Device) -> Result<(), CacheError> {
        if self.device.placed {
            return Ok(());
        }
        if !self.materialized {
            return Err(CacheError::InvalidSpec {
                group: 0,
                reason: "a cache without memory cannot be placed in device memory",
            });
        }
        let mut buffers = Vec::with_capacity(self.regions.len());
        for &(g, p) in &self.regions {
            let group = &self.groups[g];
            let host = &group.memory[p];
            let mut buf = DeviceBuffer::new(device, host.len())?;
            // Slots never handed out are still zero on the host (and not committed): zero them
            // on the GPU and upload only the others, without reading the untouched pages.
            let touched: Vec<u32> = (0..group.touched.len() as u32)
                .filter(|&s| group.touched[s as usize])
                .collect();
            if touched.len() < group.touched.len() {
                buf.fill(0)?;
            }
            let slot_bytes = group.layout.pools[p].slot_bytes as usize;
            for (first, end) in runs(&touched) {
                let range = first as usize * slot_bytes..end as usize * slot_bytes;
                buf.upload(range.start, &host[range])?;
            }
            buffers.push(buf);
        }
        for group in &mut self.groups {
            group.dirty = Some(Vec::new());
        }
        self.device = DeviceMirror {
            buffers,
            placed: true,
            uploader: None,
        };
        Ok(())
    }

    /// The device memory of region `id`, once the cache is placed on a device.
    pub fn device_pool(&self, id: RegionId) -> Option<DevicePool> {
        let index = id.0.checked_sub(self.first_region)? as usize;
        let buf = self.device.buffers.get(index)?;
        Some(DevicePool {
            ordinal: buf.device().ordinal(),
            ptr: buf.ptr(),
            len: buf.len(),
        })
    }

    /// Uploads what the host wrote since the last upload: whole slots in runs of adjacent
    /// slots, and of a slot written only in some layers (a chunk computed in layer ranges) the
    /// span of those layers in each pool that holds them.
    pub(super) fn upload_dirty(&mut self) -> Result<(), CacheError> {
        let queued = self.queue_dirty_uploads();
        // What was queued has landed when this returns, also when queueing failed part-way.
        let landed = match &mut self.device.uploader {
            Some(u) => u.finish().map_err(CacheError::from),
            None => Ok(()),
        };
        queued?;
        landed?;
        for group in &mut self.groups {
            if let Some(dirty) = &mut group.dirty {
                dirty.clear();
            }
        }
        Ok(())
    }

    /// Queues the uploads [`upload_dirty`](Self::upload_dirty) waits for.
    fn queue_dirty_uploads(&mut self) -> Result<(), CacheError> {
        let DeviceMirror {
            buffers, uploader, ..
        } = &mut self.device;
        let Some(first) = buffers.first() else {
            // No pools, nothing to upload.
            return Ok(());
        };
        let uploader = match uploader {
            Some(u) => u,
            None => uploader.insert(Uploader::new(first.device(), UPLOAD_STAGING)?),
        };
        for (i, &(g, p)) in self.regions.iter().enumerate() {
            let group = &self.groups[g];
            let Some(dirty) = &group.dirty else {
                continue;
            };
            if dirty.is_empty() {
                continue;
            }
            let mut dirty = dirty.clone();
            dirty.sort_unstable();
            dirty.dedup();
            let whole: Vec<u32> = dirty
                .iter()
                .filter(|d| d.layers.is_none())
                .map(|d| d.slot)
                .collect();
            let pool = &group.layout.pools[p];
            let slot_bytes = pool.slot_bytes as usize;
            // Checked when the cache was built (every pool's slot holds its layers' bytes).
            let layer_bytes = group.layout.layer_block_bytes().unwrap_or(0) as usize;
            let host = &group.memory[p];
            let buf = &mut buffers[i];
            for (first, end) in runs(&whole) {
                let range = first as usize * slot_bytes..end as usize * slot_bytes;
                uploader.upload(buf, range.start, &host[range])?;
            }
            let pool_layers = pool.layer_begin..pool.layer_begin + pool.layers;
            for d in &dirty {
                let Some((begin, end)) = d.layers else {
                    continue;
                };
                let (lo, hi) = (begin.max(pool_layers.start), end.min(pool_layers.end));
                if lo >= hi || whole.binary_search(&d.slot).is_ok() {
                    continue;
                }
                let at = d.slot as usize * slot_bytes
                    + usize::from(lo - pool_layers.start) * layer_bytes;
                let range = at..at + usize::from(hi - lo) * layer_bytes;
                uploader.upload(buf, range.start, &host[range])?;
            }
        }
        Ok(())
    }

    /// Downloads the slots a request holds, in runs of adjacent slots, into the host buffers.
    pub(super) fn download_held(&mut self) -> Result<(), CacheError> {
        for (i, &(g, p)) in self.regions.iter().enumerate() {
            let group = &mut self.groups[g];
            let held: Vec<u32> = (0..group.owner.len() as u32)
                .filter(|&s| group.owner[s as usize].is_some())
                .collect();
            let slot_bytes = group.layout.pools[p].slot_bytes as usize;
            let host = &mut group.memory[p];
            for (first, end) in runs(&held) {
                let range = first as usize * slot_bytes..end as usize * slot_bytes;
                self.device.buffers[i].download(range.start, &mut host[range])?;
            }
        }
        Ok(())
    }

    /// Downloads every pool into its host buffer.
    pub(super) fn download_all(&mut self) -> Result<(), CacheError> {
        for (i, &(g, p)) in self.regions.iter().enumerate() {
            let host = &mut self.groups[g].memory[p];
            self.device.buffers[i].download(0, host)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn adjacent_slots_upload_as_one_run() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[3]), vec![(3, 4)]);
        assert_eq!(runs(&[0, 1, 2, 5, 6, 9]), vec![(0, 3), (5, 7), (9, 10)]);
    }
}
