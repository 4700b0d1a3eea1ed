//! The package's exceptions, each carrying the underlying crate's message.

use kvpipe::EmbedError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::PyErr;

create_exception!(
    kvpipe,
    KvpipeError,
    PyException,
    "Base of kvpipe's errors; the message is the core's or the transport's own."
);
create_exception!(
    kvpipe,
    UsageError,
    KvpipeError,
    "The core refused an engine command; nothing changed."
);
create_exception!(
    kvpipe,
    SessionEndedError,
    UsageError,
    "The request already ended (completed, failed, timed out or cancelled, by this side or the \
     peer; its event says which); nothing changed. An engine that aborts requests meets it \
     routinely: a chunk or the aux data submitted after the request's cancel."
);
create_exception!(
    kvpipe,
    EngineFaultError,
    KvpipeError,
    "The engine's answer to a submitted chunk broke its contract (a block source's run, a \
     changed prefix, a prompt length the receiver did not register). The submission was \
     applied: the request was failed on both sides, and a ``failed`` event follows."
);
create_exception!(
    kvpipe,
    ConfigError,
    KvpipeError,
    "The configuration cannot run pipelined transfer."
);
create_exception!(
    kvpipe,
    TransportError,
    KvpipeError,
    "A socket operation or the transport failed (listen, connect, an unfinished close), or the \
     transport cannot use the memory given (a GPU pool in this build)."
);
create_exception!(kvpipe, ClosedError, KvpipeError, "The node was closed.");

/// The exception for `e`.
pub(crate) fn to_py(e: EmbedError) -> PyErr {
    let message = e.to_string();
    match e {
        EmbedError::Usage(kvpipe_core::session::UsageError::SessionEnded(_)) => {
            SessionEndedError::new_err(message)
        }
        EmbedError::Usage(_) => UsageError::new_err(message),
        EmbedError::Config(_) => ConfigError::new_err(message),
        EmbedError::Closed => ClosedError::new_err(message),
        EmbedError::DuplicateRegion(_)
        | EmbedError::NullRegion(_)
        | EmbedError::OverlappingRegions { .. }
        | EmbedError::MissingRegion { .. } => PyValueError::new_err(message),
        EmbedError::Io(_)
        | EmbedError::Close(_)
        | EmbedError::Registration(_)
        | EmbedError::Drive(_)
        | EmbedError::Unsupported { .. }
        | EmbedError::DeviceRegion { .. }
        | EmbedError::Fence(_) => TransportError::new_err(message),
    }
}
