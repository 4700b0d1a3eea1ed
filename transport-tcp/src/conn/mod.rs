//! One connection's two halves, without I/O: the reading half ([`Inbound`]: the core's
//! [`StreamReader`](kvpipe_core::stream::StreamReader) plus the registered memory it reads
//! payloads into) and the writing half ([`Outbound`]: the queue of encoded frames and data-write
//! pieces, turned into vectored writes). Both report to their node through [`NodeHooks`].
//!
//! The blocking shells (`crate::blocking`) and the async ones (`crate::tokio_driver`) own the
//! sockets and only make the `read`, `write_vectored` and wait calls these pieces ask for.

mod acks;
mod backlog;
mod hooks;
mod inbound;
mod outbound;
mod pieces;

pub(crate) use acks::PullAcks;
pub(crate) use backlog::{Backlog, BatchTally, TalliedPiece};
pub(crate) use hooks::{HalfEnd, NodeHooks, ReadEnd, WriteEnd};
pub(crate) use inbound::{Inbound, Stop};
pub(crate) use outbound::{Job, JobQueue, Next, Outbound};
pub(crate) use pieces::cut_plan;
