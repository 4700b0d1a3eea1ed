//! Status codes, the calling thread's last error message, and the guard that keeps panics on
//! this side of the boundary.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvpipe::EmbedError;

/// What a call did. Non-negative: success; negative: an error, whose message
/// [`kvpipe_last_error_message`] returns on the same thread.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvpipe_status {
    /// Done.
    KVPIPE_OK = 0,
    /// A poll's timeout passed with no event (not an error).
    KVPIPE_NO_EVENT = 1,
    /// A null pointer, a string that is not UTF-8, regions sharing an id, a pool naming a region
    /// not given, a block source callback returning an unknown status.
    KVPIPE_ERR_INVALID_ARGUMENT = -1,
    /// The core refused an engine command, its state unchanged (an unknown or retired request,
    /// chunks out of order, a registration not matching the layout, …). An engine's broken
    /// answer is `KVPIPE_ERR_ENGINE_FAULT`, not this.
    KVPIPE_ERR_USAGE = -2,
    /// The configuration cannot run pipelined transfer.
    KVPIPE_ERR_CONFIG = -3,
    /// A socket call failed (listen, connect, address resolution).
    KVPIPE_ERR_IO = -4,
    /// The transport failed: an orderly close did not finish in time, the in-process transport
    /// refused a region or stopped.
    KVPIPE_ERR_TRANSPORT = -5,
    /// The operation does not exist on the node's transport (listen or connect in process).
    KVPIPE_ERR_UNSUPPORTED = -6,
    /// The node was closed.
    KVPIPE_ERR_CLOSED = -7,
    /// A panic was caught at the boundary (a bug in kvpipe; the message says where).
    KVPIPE_ERR_PANIC = -8,
    /// The engine's answer to a submitted chunk broke its contract (a block source's run, a
    /// changed prefix, a prompt length the receiver did not register; the message says which).
    /// The submission was applied: the request was failed on both sides, and a
    /// `KVPIPE_EVENT_FAILED` with `KVPIPE_TRANSFER_ENGINE_ERROR` (or a protocol error) follows.
    KVPIPE_ERR_ENGINE_FAULT = -9,
}

use kvpipe_status::*;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// An error on its way to the caller: its status and its message.
#[derive(Debug)]
pub struct Failure {
    /// The status returned.
    pub status: kvpipe_status,
    /// The message [`kvpipe_last_error_message`] returns.
    pub message: String,
}

impl Failure {
    /// A `KVPIPE_ERR_INVALID_ARGUMENT` failure.
    pub fn invalid(message: impl Into<String>) -> Self {
        Failure {
            status: KVPIPE_ERR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }
}

impl From<EmbedError> for Failure {
    fn from(e: EmbedError) -> Self {
        let status = match &e {
            EmbedError::Usage(_) => KVPIPE_ERR_USAGE,
            EmbedError::Config(_) => KVPIPE_ERR_CONFIG,
            EmbedError::Io(_) => KVPIPE_ERR_IO,
            EmbedError::Close(_)
            | EmbedError::Drive(_)
            | EmbedError::Registration(_)
            | EmbedError::Fence(_) => KVPIPE_ERR_TRANSPORT,
            EmbedError::DuplicateRegion(_)
            | EmbedError::NullRegion(_)
            | EmbedError::OverlappingRegions { .. }
            | EmbedError::MissingRegion { .. } => KVPIPE_ERR_INVALID_ARGUMENT,
            EmbedError::Unsupported { .. } | EmbedError::DeviceRegion { .. } => {
                KVPIPE_ERR_UNSUPPORTED
            }
            EmbedError::Closed => KVPIPE_ERR_CLOSED,
        };
        Failure {
            status,
            message: e.to_string(),
        }
    }
}

fn set_last_error(message: &str) {
    // A message with an interior NUL is cut there.
    let bytes: Vec<u8> = message.bytes().take_while(|&b| b != 0).collect();
    let text = CString::new(bytes).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// Runs one entry point: its result becomes a status, its error the thread's last error, and a
/// panic `KVPIPE_ERR_PANIC`.
pub(crate) fn guard(f: impl FnOnce() -> Result<kvpipe_status, Failure>) -> kvpipe_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(status)) => status,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".to_string());
            set_last_error(&format!(
                "kvpipe panicked (a bug; please report it): {what}"
            ));
            KVPIPE_ERR_PANIC
        }
    }
}

/// The message of the last error returned on the calling thread (an empty string before any).
/// The pointer stays valid until the next error on this thread.
#[no_mangle]
pub extern "C" fn kvpipe_last_error_message() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// A status's name (`"KVPIPE_ERR_USAGE"`), or `"unknown status"`; a static string.
#[no_mangle]
pub extern "C" fn kvpipe_status_name(status: i32) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"KVPIPE_OK",
        1 => c"KVPIPE_NO_EVENT",
        -1 => c"KVPIPE_ERR_INVALID_ARGUMENT",
        -2 => c"KVPIPE_ERR_USAGE",
        -3 => c"KVPIPE_ERR_CONFIG",
        -4 => c"KVPIPE_ERR_IO",
        -5 => c"KVPIPE_ERR_TRANSPORT",
        -6 => c"KVPIPE_ERR_UNSUPPORTED",
        -7 => c"KVPIPE_ERR_CLOSED",
        -8 => c"KVPIPE_ERR_PANIC",
        -9 => c"KVPIPE_ERR_ENGINE_FAULT",
        _ => c"unknown status",
    };
    name.as_ptr()
}

/// The library's version (`"0.1.0"`); a static string.
#[no_mangle]
pub extern "C" fn kvpipe_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: the pointer is this thread's NUL-terminated message.
        unsafe { CStr::from_ptr(kvpipe_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = guard(|| panic!("boom at the boundary"));
        assert_eq!(status, KVPIPE_ERR_PANIC);
        assert!(
            last_error().contains("boom at the boundary"),
            "{}",
            last_error()
        );
        let status = guard(|| Err(Failure::invalid("a null pointer")));
        assert_eq!(status, KVPIPE_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "a null pointer");
        assert_eq!(guard(|| Ok(KVPIPE_NO_EVENT)), KVPIPE_NO_EVENT);
    }
}
