//! One file per frame kind. Each holds the frame's representation (the validated struct and
//! its enums), its fixed body part as a zerocopy view, its body encoding (a
//! [`FrameBody`](super::body::FrameBody) implementation: cap, length, `parse_body`,
//! `emit_body`), its `Display` and its unit tests; `docs/PROTOCOL.md` gives each layout byte
//! by byte.
//!
//! A new frame kind takes: its file here (and a line below), a kind code in
//! [`FrameKind`](super::FrameKind), a variant and its dispatch arms in
//! [`Frame`](super::Frame), and a golden sample in [`samples`](super::samples).

mod accept;
mod aux_result;
mod cancel;
mod data_path;
mod data_write;
mod heartbeat;
mod hello;
mod kv_result;
mod recv_complete;
mod registration;
mod reject;

pub use accept::HelloAccept;
pub use aux_result::{AuxData, AuxResult};
pub use cancel::{Cancel, CancelReason};
pub use data_path::MAX_DATA_PATH_LEN;
pub use data_write::{DataWrite, DATA_WRITE_FRAME_LEN};
pub use heartbeat::Heartbeat;
pub use hello::{Capabilities, Hello, Role, Topology};
pub use kv_result::KvResult;
pub use recv_complete::RecvComplete;
pub use registration::RecvRegistration;
pub use reject::{HelloReject, RejectReason, MAX_REJECT_MESSAGE};
