//! Strided runs copied by a kernel of kvpipe's own instead of `cuMemcpy2DAsync`, where the
//! run allows it: every thread moves 16-byte pieces, so the rows, the pitches and both
//! addresses must be multiples of 16 bytes (KV rows of 16-bit elements are: a head's row of a
//! block is `head_dim × 2` bytes per token, and whole layers of a block are copied at once).
//!
//! Why: on an H200 a 2D copy of a layer range of one chunk (16 rows of 512 KiB, 4 MiB apart)
//! takes about 17 µs of GPU time, twice a contiguous copy of the same bytes (docs/PERFORMANCE.md,
//! "Run 4"), and that copy is on the exposed tail of every request streamed in layer ranges. The
//! kernel moves the rows at the device's memory bandwidth. It runs on the SMs, where the copy
//! engines would not: a strided run's kernel shares the GPU with the model's compute for the
//! few microseconds it lasts.
//!
//! The grid's `y` dimension is the row, so a thread finds its row without a division; its `x`
//! dimension strides over the row's 16-byte pieces.

use cudarc::driver::{result, sys};

use super::strided::StridedRun;
use crate::ptx::Kernel;
use crate::CudaError;

/// `kvpipe_copy_rows(dst, src, dst_pitch, src_pitch, per_row)`: row `ctaid.y` of the run;
/// within it, 16-byte piece `ctaid.x * ntid.x + tid.x`, then every `nctaid.x * ntid.x`-th
/// piece after it, below `per_row`.
const PTX: &str = r#"
.version 6.0
.target sm_60
.address_size 64

.visible .entry kvpipe_copy_rows(
    .param .u64 dst,
    .param .u64 src,
    .param .u64 dst_pitch,
    .param .u64 src_pitch,
    .param .u32 per_row
)
{
    .reg .pred %p;
    .reg .b32 %r<16>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [dst_pitch];
    ld.param.u64 %rd4, [src_pitch];
    ld.param.u32 %r1, [per_row];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r2, %ctaid.y;
    cvt.u64.u32 %rd5, %r2;
    mad.lo.u64 %rd1, %rd5, %rd3, %rd1;
    mad.lo.u64 %rd2, %rd5, %rd4, %rd2;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    mov.u32 %r7, %nctaid.x;
    mul.lo.u32 %r8, %r7, %r4;
    setp.ge.u32 %p, %r6, %r1;
    @%p bra DONE;
LOOP:
    mul.wide.u32 %rd6, %r6, 16;
    add.u64 %rd7, %rd2, %rd6;
    add.u64 %rd8, %rd1, %rd6;
    ld.global.nc.v4.u32 {%r10, %r11, %r12, %r13}, [%rd7];
    st.global.v4.u32 [%rd8], {%r10, %r11, %r12, %r13};
    add.u32 %r6, %r6, %r8;
    setp.lt.u32 %p, %r6, %r1;
    @%p bra LOOP;
DONE:
    ret;
}
"#;

/// Threads per block.
const THREADS: u32 = 256;
/// 16-byte pieces each thread moves (about): the grid's `x` dimension is sized for it.
const PIECES_PER_THREAD: u64 = 2;
/// The most rows one launch covers (the grid's `y` dimension).
const MAX_ROWS: u64 = 65_535;
/// The most 16-byte pieces in one row (the thread's index and step stay below 2^32).
const MAX_PIECES_PER_ROW: u64 = 1 << 31;

/// The row-copy kernel, loaded in one device's context.
#[derive(Debug)]
pub(super) struct RowCopier {
    kernel: Kernel,
}

impl RowCopier {
    /// Loads the kernel in the current context.
    pub(super) fn load() -> Result<RowCopier, CudaError> {
        Ok(RowCopier {
            kernel: Kernel::load(PTX, "kvpipe_copy_rows")?,
        })
    }

    /// Whether the kernel copies `run`: device → device on one device, more than one row (a
    /// single copy goes to the copy engines), everything aligned to 16 bytes, within the
    /// grid's limits.
    pub(super) fn fits(run: &StridedRun) -> bool {
        let aligned = |x: u64| x % 16 == 0;
        matches!(
            run.first.direction,
            super::copies::Direction::DeviceToDevice { .. }
        ) && (2..=MAX_ROWS).contains(&run.rows)
            && run.first.len > 0
            && run.first.len / 16 <= MAX_PIECES_PER_ROW
            && [
                run.first.src,
                run.first.dst,
                run.first.len,
                run.src_pitch,
                run.dst_pitch,
            ]
            .into_iter()
            .all(aligned)
    }

    /// Enqueues the copy of `run` on `stream` (its context current).
    ///
    /// # Safety
    ///
    /// [`fits`](Self::fits)`(run)`, and every row's addresses are valid device memory of the
    /// current context for the row's length until the stream has run the copy; no row's
    /// destination overlaps another row or a source.
    pub(super) unsafe fn launch(
        &self,
        run: &StridedRun,
        stream: sys::CUstream,
    ) -> Result<(), CudaError> {
        let mut dst = run.first.dst;
        let mut src = run.first.src;
        let mut dst_pitch = run.dst_pitch;
        let mut src_pitch = run.src_pitch;
        let pieces = run.first.len / 16;
        let mut per_row = pieces as u32;
        let per_block = u64::from(THREADS) * PIECES_PER_THREAD;
        let blocks_x = pieces
            .div_ceil(per_block)
            .clamp(1, u64::from(u32::MAX / THREADS)) as u32;
        let mut params = [
            &mut dst as *mut u64 as *mut std::ffi::c_void,
            &mut src as *mut u64 as *mut std::ffi::c_void,
            &mut dst_pitch as *mut u64 as *mut std::ffi::c_void,
            &mut src_pitch as *mut u64 as *mut std::ffi::c_void,
            &mut per_row as *mut u32 as *mut std::ffi::c_void,
        ];
        // SAFETY: the kernel's five parameters are these five values, in order and of these
        // types (the driver copies them at the launch); the caller vouches for the memory.
        unsafe {
            result::launch_kernel(
                self.kernel.function,
                (blocks_x, run.rows as u32, 1),
                (THREADS, 1, 1),
                0,
                stream,
                &mut params,
            )
        }
        .map_err(CudaError::driver("cuLaunchKernel"))
    }

    /// Unloads the kernel (its context current).
    ///
    /// # Safety
    ///
    /// No launch may still be queued or running.
    pub(super) unsafe fn unload(&self) {
        // SAFETY: forwarded.
        unsafe { self.kernel.unload() }
    }
}
