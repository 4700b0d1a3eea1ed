//! Kernels of kvpipe's own, written in PTX and loaded with `cuModuleLoadData` (the driver
//! compiles PTX for the GPU it runs on), so that nothing needs a CUDA compiler at build or run
//! time.

use std::ffi::{c_void, CString};

use cudarc::driver::{result, sys};

use crate::CudaError;

/// A loaded kernel: its module and its entry. The module stays loaded until
/// [`unload`](Self::unload).
#[derive(Debug)]
pub(crate) struct Kernel {
    module: sys::CUmodule,
    pub(crate) function: sys::CUfunction,
}

impl Kernel {
    /// Loads `ptx` in the current context and finds its entry `name`.
    pub(crate) fn load(ptx: &str, name: &str) -> Result<Kernel, CudaError> {
        let image = CString::new(ptx).expect("PTX holds no NUL");
        let name = CString::new(name).expect("a kernel name holds no NUL");
        // SAFETY: `image` is a NUL-terminated PTX text that lives across the call.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(CudaError::driver("cuModuleLoadData"))?;
        // SAFETY: `module` was loaded above and is not unloaded while this runs.
        match unsafe { result::module::get_function(module, name) } {
            Ok(function) => Ok(Kernel { module, function }),
            Err(e) => {
                // SAFETY: loaded above, unloaded once; nothing of it is in use.
                let _ = unsafe { result::module::unload(module) };
                Err(CudaError::driver("cuModuleGetFunction")(e))
            }
        }
    }

    /// Unloads the module (its context current).
    ///
    /// # Safety
    ///
    /// No launch of the kernel may still be running or queued, and the kernel is not used
    /// again.
    pub(crate) unsafe fn unload(&self) {
        // SAFETY: the caller guarantees nothing of the module is in use.
        let _ = unsafe { result::module::unload(self.module) };
    }
}
