//! The native part of kvpipe's Python package (`kvpipe._kvpipe`; the package re-exports it).
//!
//! It binds `kvpipe`'s prefill and decode nodes: every call that touches a node releases
//! the GIL first (the node's lock is never waited for while holding it), and a Python block
//! source takes the GIL back only while it answers the core's query.

mod arguments;
mod errors;
mod event;
mod fence;
mod layout;
mod nodes;
mod pools;
mod source;
mod topology;

use pyo3::prelude::*;

/// Stream one LLM request's KV cache from prefill to decode while prefill runs (native part).
#[pymodule]
#[pyo3(name = "_kvpipe")]
mod native {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::errors::{
        ClosedError, ConfigError, EngineFaultError, KvpipeError, SessionEndedError, TransportError,
        UsageError,
    };
    #[pymodule_export]
    use super::event::Event;
    #[pymodule_export]
    use super::layout::{LayerGroup, Pool};
    #[pymodule_export]
    use super::nodes::{mem_pair, Receiver, Sender};
    #[pymodule_export]
    use super::topology::{rank_heads, tensor_writes_to};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("MEM_SENDER_PEER", kvpipe::MEM_SENDER_PEER.0)?;
        m.add("MEM_RECEIVER_PEER", kvpipe::MEM_RECEIVER_PEER.0)?;
        Ok(())
    }
}
