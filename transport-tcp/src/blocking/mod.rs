//! The blocking driver: std sockets and threads, no async runtime.
//!
//! Per peer, one reader and one writer thread per connection; one timer thread and (when
//! listening) one accept thread per node.

pub(crate) mod conn;
pub(crate) mod node;
pub(crate) mod roles;

pub use node::{CloseError, EndpointGuard};
pub use roles::{TcpReceiver, TcpSender};
